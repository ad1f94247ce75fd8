"""ddpo_tpu: DDPO (reinforcement learning for Stable Diffusion) on Cloud TPUs through PyTorch/XLA.

Where things live (docs/architecture.md has the floors and the rules between them):
  train.py, worker.py, torchrun.py   the entry points: the front end, the training process, the distributed agent
  env.py, problems.py   cross-cutting: the one module that reads the environment; one-line problems with their fixes
  config/     the typed schema and the compose-time rules (parity arithmetic, topology, memory, ranges)
  catalog/    the registry of model families, samplers, rewards and algorithms
  launch/     the front end's machinery: machine checks, locks, the training process, sweeps, pods
  status/     ddpo-status: what a run dir says
  runtime/    the small runtime interface and its backends (eager torch, torch_xla, torch.distributed)
  models/     loading through from_pretrained, the tiny local models, LoRA
  families/   each model family's encode, denoising step with log-prob and decode
  diffusion/  DDIM and the flow SDE with log-probability, the sampler, SDE windows
  rewards/    the rewards (JPEG, aesthetic, PickScore, CLIP, remote, weighted, per-frame video)
  prompts/    prompt sources and their word lists
  algorithms/ DDPO, GRPO, DiffusionNFT, AWM: a module each, their interface and shared PPO pieces
  training/   the one training loop, the training state, checkpointing, what a run reports
  rundir/     the run dir: its files, events, checkpoints and bucket storage
  display/    what people see: the console, the reward curve, wandb and TensorBoard
"""

__version__ = "0.1.0"
