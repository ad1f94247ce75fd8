"""Flow-GRPO's SDE step with log-probability as its Wan code computes it (yifan123/flow_grpo,
``flow_grpo/diffusers_patch/wan_pipeline_with_logprob.py::sde_step_with_logprob`` at 9745241, added in 11caf1b).

The mean is Flow-GRPO's reverse SDE (the same as the "sde" step of ``diffusion/flow.py``); the noise scale is not
``noise_level * sqrt(sigma / (1 - sigma))`` but a line in sigma fixed by the schedule, with no knob::

    std_dev_t = sigma_min + (sigma_max - sigma_min) * sigma     sigma_max = sigmas[1], sigma_min = sigmas[-1]
    dt        = sigma' - sigma  (< 0)
    mean      = x (1 + std_dev_t^2 dt / (2 sigma)) + v (1 + std_dev_t^2 (1 - sigma) / (2 sigma)) dt
    x'        = mean + std_dev_t sqrt(-dt) z
    log_prob  = mean over non-batch dims of -(x' - mean)^2 / (2 (std_dev_t sqrt(-dt))^2) - log(std_dev_t sqrt(-dt))
                - log sqrt(2 pi)

(``sigmas[1]`` is the schedule's second sigma, as the reference names it; Wan 2.1's UniPC schedule ends in 0, so
``sigma_min`` is 0 there.) Everything is float32 (the reference calls ``.float()``); ``prev_sample`` is detached
inside the log-prob, so gradients reach ``v`` through the mean only.

The step's standard deviation ``std_dev_t sqrt(-dt)`` is what the reference returns by default as its fourth output
and what train_wan2_1.py's KL term divides by (``2 (std_dev_t * dt_ref)^2`` with ``dt_ref = sqrt(-dt)``): the exact
per-element KL of the two step Gaussians. So the std returned here (``StepScore.std``) is that product, not
``std_dev_t`` alone (SD 3's KL in train_sd3.py divides by ``std_dev_t``: a different scale, kept there).

The schedule's sigmas and timesteps live in :class:`~ddpo_tpu.diffusion.flow.FlowTables` (gathered on the device with
a per-sample step index); the deterministic step is its ``ode_step`` (the reference's ``determistic`` branch).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ddpo_tpu.diffusion.flow import _LOG_SQRT_2PI, FlowTables

__all__ = ["wan_sde_core", "wan_sde_step"]


def wan_sde_core(model_output: Tensor, sample: Tensor, sigma: Tensor, sigma_prev: Tensor, sigma_max: Tensor,
                 sigma_min: Tensor, prev_sample: Tensor | None = None, noise: Tensor | None = None
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The step (see the module docstring): ``sigma`` / ``sigma_prev`` broadcastable against ``sample``,
    ``sigma_max`` / ``sigma_min`` 0-d. ``prev_sample`` is scored when given, else drawn with ``noise``.
    Returns ``(prev_sample, log_prob (B,), mean, std)`` in float32, ``std`` the step's std ``std_dev_t sqrt(-dt)``."""
    v, x = model_output.float(), sample.float()
    dt = sigma_prev - sigma
    std_dev_t = sigma_min + (sigma_max - sigma_min) * sigma
    mean = x * (1 + std_dev_t**2 / (2 * sigma) * dt) + v * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
    scale = std_dev_t * torch.sqrt(-dt)
    if prev_sample is None:
        if noise is None:
            raise ValueError("either prev_sample or noise must be given")
        prev_sample = mean + scale * noise.float()
    else:
        prev_sample = prev_sample.float()
    log_prob = -((prev_sample.detach() - mean) ** 2) / (2 * scale**2) - torch.log(scale) - _LOG_SQRT_2PI
    return prev_sample, log_prob.mean(dim=tuple(range(1, log_prob.ndim))), mean, scale


def wan_sde_step(tables: FlowTables, model_output: Tensor, step_index: Tensor, sample: Tensor, *,
                 noise: Tensor | None = None, prev_sample: Tensor | None = None
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The step at schedule positions ``step_index`` ((B,) long, on the device): sigmas gathered from ``tables``, so
    every position traces to the same graph. ``sigma_max`` / ``sigma_min`` are sliced inside the step (as
    FlowTables.step does), never cached constants that would join another graph."""
    if step_index.ndim != 1 or step_index.shape[0] != sample.shape[0]:
        raise ValueError(f"step_index must be of shape ({sample.shape[0]},), got {tuple(step_index.shape)}")
    sigma, sigma_prev = tables.sigmas_at(step_index)
    shape = (-1,) + (1,) * (sample.ndim - 1)
    return wan_sde_core(model_output, sample, sigma.reshape(shape), sigma_prev.reshape(shape), tables.sigmas[1],
                        tables.sigmas[-1], prev_sample=prev_sample, noise=noise)
