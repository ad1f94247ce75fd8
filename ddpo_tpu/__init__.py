"""ddpo_tpu: reinforcement learning for diffusion models (DDPO, Flow-GRPO, DiffusionNFT, AWM) on Cloud TPUs and GPUs.

The package map (each package, its floor and the rules between floors) is docs/architecture.md's, the one copy."""

__version__ = "0.1.0"
