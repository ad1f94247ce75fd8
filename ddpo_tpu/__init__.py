"""ddpo_tpu: DDPO (reinforcement learning for Stable Diffusion) on Cloud TPUs through PyTorch/XLA.

Where things live:
  config/     the typed schema and the compose-time rules (parity arithmetic, topology, ranges)
  launch/     the front end: environment from config (env.py), the training process (process.py)
  runtime/    the small runtime interface and its backends (eager torch, torch_xla single device / SPMD)
  models/     loading through from_pretrained, the tiny local model, LoRA
  diffusion/  DDIM with log-probability, the sampler
  rewards/    the reward registry (JPEG, ...)
  prompts/    prompt sources and their word lists
  ddpo/       advantages (stat tracking), the PPO update, the epoch loop
"""

__version__ = "0.1.0"
