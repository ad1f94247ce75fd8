"""Diffusion-sampler math for DDPO (DDIM step with log-probability)."""

from ddpo_tpu.diffusion.ddim import DDIMTables, ddim_step_with_logprob

__all__ = ["DDIMTables", "ddim_step_with_logprob"]
