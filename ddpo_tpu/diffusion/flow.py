"""Flow-matching SDE step with log-probability: the Flow-GRPO sampler (yifan123/flow_grpo, arXiv 2505.05470).

A rectified-flow model (SD3, SD 3.5) predicts a velocity ``v`` with ``x_sigma = (1 - sigma) x_0 + sigma x_1``
(``x_1`` the noise, ``sigma`` from 1 down to 0 along the schedule). The deterministic sampler is the Euler step
``x' = x + (sigma' - sigma) v``. Flow-GRPO turns each step into a Gaussian policy with a log-density, in two ways
(``sde_type``), with ``sigma = sigmas[i]``, ``sigma' = sigmas[i + 1]`` and ``dt = sigma' - sigma < 0``:

``"sde"`` (Flow-GRPO's reverse SDE with the same marginals as the ODE)::

    std      = noise_level * sqrt(sigma / (1 - sigma_hat)),   sigma_hat = sigma, or sigmas[1] where sigma == 1
    mean     = x (1 + std^2 dt / (2 sigma)) + v (1 + std^2 (1 - sigma) / (2 sigma)) dt
    x'       = mean + std sqrt(-dt) z
    log_prob = mean over non-batch dims of  -(x' - mean)^2 / (2 (std sqrt(-dt))^2) - log(std sqrt(-dt)) - log sqrt(2 pi)

  Only the denominator's sigma is replaced at sigma == 1 (the numerator stays 1): the replacement keeps the first
  step's std finite.

``"cps"`` (coefficient-preserving sampling, Flow-CPS)::

    std      = sigma' sin(noise_level pi / 2)
    x0_hat   = x - sigma v,      x1_hat = x + (1 - sigma) v
    mean     = x0_hat (1 - sigma') + x1_hat sqrt(sigma'^2 - std^2)
    x'       = mean + std z
    log_prob = mean over non-batch dims of  -(x' - mean)^2          (the reference drops every constant, including
                                                                      the 1 / (2 std^2) factor)

Both return ``std`` as the reference does: ``std_dev_t`` (shape (B, 1, ..., 1)), which for "sde" is *not* the
step's standard deviation (that is ``std * sqrt(-dt)``) and for "cps" is. Flow-GRPO's KL term divides by
``2 std_dev_t^2`` (see ``ddpo_tpu.algorithms.grpo.kl_to_reference``).

Semantics follow flow_grpo's ``flow_grpo/diffusers_patch/sd3_sde_with_logprob.py::sde_step_with_logprob``:

* everything is computed in float32 (the reference calls ``.float()`` on model_output, sample and prev_sample: bf16
  overflows in the mean); float64 inputs are computed in float32 too, as there;
* ``prev_sample`` is returned in float32 (the value the log-prob was evaluated at) and is detached before it enters
  the log-prob: gradients reach ``model_output`` through the mean only;
* ``sigma_max`` (the sigma == 1 replacement) is ``scheduler.sigmas[1]``, the schedule's *second* sigma (the name is
  the reference's; it is not ``scheduler.sigma_max``, which is 1);
* the noise of the reference entry point is drawn with diffusers' ``randn_tensor(model_output.shape, generator,
  device, float32)``, as there, so a seeded generator reproduces the reference's samples.

Differences from the reference: passing both ``prev_sample`` and ``generator`` is an error here (the reference ignores
the generator); ``return_sqrt_dt`` is not offered (``sqrt(-dt)`` is ``sqrt(sigma - sigma')``, from the tables);
an unknown ``sde_type`` is an error (the reference fails later with an unbound name).

Evaluation: the reference evaluates with ``noise_level=0`` through the same step, i.e. the Euler ODE step with a
non-finite log-prob; :meth:`FlowTables.ode_step` is that step without the log-prob (and equals diffusers'
``FlowMatchEulerDiscreteScheduler.step``).

Two entry points sharing :func:`_flow_core`, so they agree bit for bit:

* :func:`sde_step_with_logprob` -- the reference calling convention (a diffusers ``FlowMatchEulerDiscreteScheduler``
  after ``set_timesteps``; ``timestep`` holds values of ``scheduler.timesteps``, looked up with
  ``index_for_timestep`` on the host). For tests and CPU/GPU use.
* :class:`FlowTables` -- the XLA form: sigmas and timesteps live on the device and are gathered with a per-sample
  step-index tensor, so every step traces to the same graph with no host round trip.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["SDE_TYPES", "sde_step_with_logprob", "FlowTables"]

SDE_TYPES = ("sde", "cps")

# log(sqrt(2 pi)) exactly as the reference evaluates it (in float32), so the log-prob agrees to the last bit.
_LOG_SQRT_2PI = float(torch.log(torch.sqrt(2 * torch.as_tensor(math.pi, dtype=torch.float32))))

_COMPUTE_DTYPE = torch.float32


def _check_sde_type(sde_type: str) -> None:
    if sde_type not in SDE_TYPES:
        raise ValueError(f"sde_type given as {sde_type!r} must be one of {SDE_TYPES}")


def _left_broadcast(v: Tensor, ndim: int) -> Tensor:
    """(B,) -> (B, 1, ..., 1); () -> (1, ..., 1)."""
    return v.reshape(tuple(v.shape) + (1,) * (ndim - v.ndim))


# --------------------------------------------------------------------------------------
# shared math
# --------------------------------------------------------------------------------------


def _flow_core(
    sde_type: str,
    model_output: Tensor,
    sample: Tensor,
    sigma: Tensor,
    sigma_prev: Tensor,
    sigma_max: Tensor,
    noise_level: float,
    prev_sample: Tensor | None,
    noise: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The step and its log-prob (see the module docstring).

    ``sigma`` / ``sigma_prev`` are float32, broadcastable against ``sample`` ((B, 1, ..., 1) or all ones);
    ``sigma_max`` is the 0-d float32 replacement for sigma == 1. ``prev_sample`` wins over ``noise``.
    Returns ``(prev_sample, log_prob (B,), prev_sample_mean, std_dev_t)``, all float32.
    """
    v = model_output.to(_COMPUTE_DTYPE)
    x = sample.to(_COMPUTE_DTYPE)
    dt = sigma_prev - sigma

    if sde_type == "sde":
        std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_max, sigma))) * noise_level
        mean = x * (1 + std_dev_t**2 / (2 * sigma) * dt) + v * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
        scale = std_dev_t * torch.sqrt(-dt)
    elif sde_type == "cps":
        std_dev_t = sigma_prev * math.sin(noise_level * math.pi / 2)
        x0_hat = x - sigma * v
        x1_hat = x + v * (1 - sigma)
        mean = x0_hat * (1 - sigma_prev) + x1_hat * torch.sqrt(sigma_prev**2 - std_dev_t**2)
        scale = std_dev_t
    else:
        raise ValueError(f"sde_type given as {sde_type!r} must be one of {SDE_TYPES}")

    if prev_sample is None:
        if noise is None:
            raise ValueError("either prev_sample or noise must be given")
        prev_sample = mean + scale * noise.to(_COMPUTE_DTYPE)
    else:
        prev_sample = prev_sample.to(_COMPUTE_DTYPE)

    x_prev = prev_sample.detach()
    if sde_type == "sde":
        log_prob = -((x_prev - mean) ** 2) / (2 * scale**2) - torch.log(scale) - _LOG_SQRT_2PI
    else:
        log_prob = -((x_prev - mean) ** 2)
    log_prob = log_prob.mean(dim=tuple(range(1, log_prob.ndim)))
    return prev_sample, log_prob, mean, std_dev_t


# --------------------------------------------------------------------------------------
# reference calling convention
# --------------------------------------------------------------------------------------


def sde_step_with_logprob(
    scheduler,
    model_output: Tensor,
    timestep,
    sample: Tensor,
    noise_level: float = 0.7,
    prev_sample: Tensor | None = None,
    generator: torch.Generator | list[torch.Generator] | None = None,
    sde_type: str = "sde",
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One Flow-GRPO step x_sigma -> x_sigma' plus log p(x_sigma' | x_sigma), in flow_grpo's calling convention.

    Args:
        scheduler: a diffusers ``FlowMatchEulerDiscreteScheduler`` on which ``set_timesteps`` was called.
        model_output: the transformer's velocity prediction, (B, ...).
        timestep: values of ``scheduler.timesteps`` (sigma * num_train_timesteps): a (B,) tensor (may differ per
            sample), a (1,) tensor or a scalar (broadcast over the batch). Each is looked up with
            ``scheduler.index_for_timestep`` (host work, like the reference).
        sample: x at ``timestep``, (B, ...).
        noise_level: the SDE's noise scale (flow_grpo: 0.7 for "sde", 0.8 for "cps").
        prev_sample: the next sample to score; if None it is drawn with ``generator``.
        generator: RNG (or one per sample) for the noise; must be None when ``prev_sample`` is given.
        sde_type: "sde" or "cps".

    Returns:
        ``(prev_sample, log_prob, prev_sample_mean, std_dev_t)``: float32; log_prob (B,); std_dev_t (B or 1, 1, ...).
    """
    _check_sde_type(sde_type)
    if getattr(scheduler, "num_inference_steps", None) is None or scheduler.sigmas is None:
        raise ValueError("Number of inference steps is 'None', call scheduler.set_timesteps(...) first")
    if prev_sample is not None and generator is not None:
        raise ValueError("Cannot pass both generator and prev_sample.")

    ts = torch.as_tensor(timestep)
    if ts.ndim == 0:
        ts = ts.reshape(1)
    if ts.ndim != 1 or ts.shape[0] not in (1, sample.shape[0]):
        raise ValueError(f"timestep must be a scalar or of shape (1,) or ({sample.shape[0]},), got {tuple(ts.shape)}")
    schedule = scheduler.timesteps
    step_index = [scheduler.index_for_timestep(t.to(schedule.device), schedule) for t in ts]
    prev_index = [i + 1 for i in step_index]

    sigmas = scheduler.sigmas.to(device=sample.device, dtype=_COMPUTE_DTYPE)
    sigma = _left_broadcast(sigmas[step_index], sample.ndim)
    sigma_prev = _left_broadcast(sigmas[prev_index], sample.ndim)
    sigma_max = sigmas[1]

    noise = None
    if prev_sample is None:
        from diffusers.utils.torch_utils import randn_tensor

        noise = randn_tensor(model_output.shape, generator=generator, device=model_output.device,
                             dtype=_COMPUTE_DTYPE)
    return _flow_core(sde_type, model_output, sample, sigma, sigma_prev, sigma_max, noise_level, prev_sample, noise)


# --------------------------------------------------------------------------------------
# device-resident tables (XLA)
# --------------------------------------------------------------------------------------


def _gather(table: Tensor, index: Tensor) -> Tensor:
    """``table[index]`` for a 1-D table and an index tensor of any shape, via index_select."""
    return torch.index_select(table, 0, index.reshape(-1)).reshape(index.shape)


class FlowTables:
    """Device-friendly Flow-GRPO step for the sampling and training loops on XLA.

    ``sigmas`` ((num_steps + 1,), ending in 0) and ``timesteps`` ((num_steps,), the values the SD3 transformer is
    called with: ``sigma * num_train_timesteps`` in float32, exactly ``scheduler.timesteps``) live on the device and
    are gathered with a step-index tensor (0 = noisiest), so no ``.item()``, host lookup or data-dependent control
    flow happens per step and every call traces to the same graph.
    """

    def __init__(self, sigmas: Tensor, timesteps: Tensor):
        if sigmas.ndim != 1 or timesteps.ndim != 1 or sigmas.shape[0] != timesteps.shape[0] + 1:
            raise ValueError(
                f"sigmas must be (num_steps + 1,) and timesteps (num_steps,), got {tuple(sigmas.shape)} "
                f"and {tuple(timesteps.shape)}"
            )
        if sigmas.shape[0] < 2:
            raise ValueError("a flow schedule needs at least one step")
        self.sigmas = sigmas.to(_COMPUTE_DTYPE)
        self.timesteps = timesteps.to(_COMPUTE_DTYPE)
        self.num_steps = int(timesteps.shape[0])

    @classmethod
    def from_scheduler(cls, scheduler, num_steps: int, device, mu: float | None = None) -> "FlowTables":
        """Call ``scheduler.set_timesteps(num_steps)`` (on the CPU) and copy its sigmas and timesteps to ``device``.

        As StableDiffusion3Pipeline does for SD 3 / 3.5 (whose scheduler config has a fixed ``shift`` and no dynamic
        shifting): the static shift ``shift * s / (1 + (shift - 1) * s)`` is applied inside set_timesteps. A scheduler
        with ``use_dynamic_shifting`` needs ``mu`` (the pipeline computes it from the image sequence length).
        """
        if int(num_steps) < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        if scheduler.config.get("use_dynamic_shifting", False) and mu is None:
            raise ValueError("the scheduler uses dynamic shifting: pass mu (see diffusers' calculate_shift)")
        kwargs = {"mu": mu} if mu is not None else {}
        scheduler.set_timesteps(int(num_steps), **kwargs)
        sigmas = scheduler.sigmas.detach().to("cpu", _COMPUTE_DTYPE)
        timesteps = scheduler.timesteps.detach().to("cpu", _COMPUTE_DTYPE)
        return cls(sigmas.to(device), timesteps.to(device))

    @property
    def device(self) -> torch.device:
        return self.sigmas.device

    def to(self, device) -> "FlowTables":
        """A copy with the tables on another device."""
        return FlowTables(self.sigmas.to(device), self.timesteps.to(device))

    def timestep_at(self, step_index: Tensor) -> Tensor:
        """The transformer's timestep input (float32 ``sigma * num_train_timesteps``) at ``step_index``."""
        return _gather(self.timesteps, step_index)

    def sigmas_at(self, step_index: Tensor) -> tuple[Tensor, Tensor]:
        """``(sigma, sigma_next)`` at ``step_index`` (same shape as step_index)."""
        return _gather(self.sigmas, step_index), _gather(self.sigmas, step_index + 1)

    def _broadcast_sigmas(self, step_index: Tensor, sample: Tensor) -> tuple[Tensor, Tensor]:
        if step_index.ndim > 1 or (step_index.ndim == 1 and step_index.shape[0] != sample.shape[0]):
            raise ValueError(
                f"step_index must be 0-d or of shape ({sample.shape[0]},), got {tuple(step_index.shape)}"
            )
        sigma, sigma_prev = self.sigmas_at(step_index)
        return _left_broadcast(sigma, sample.ndim), _left_broadcast(sigma_prev, sample.ndim)

    def step(
        self,
        model_output: Tensor,
        step_index: Tensor,
        sample: Tensor,
        noise_level: float,
        *,
        sde_type: str = "sde",
        noise: Tensor | None = None,
        prev_sample: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The Flow-GRPO step at schedule positions ``step_index`` ((B,) or (), a long tensor on the device).

        ``noise`` (standard normal, like ``sample``, drawn by the caller) is used when ``prev_sample`` is None and
        ignored otherwise. Returns ``(prev_sample, log_prob (B,), prev_sample_mean, std_dev_t)`` in float32, as
        :func:`sde_step_with_logprob`.
        """
        _check_sde_type(sde_type)
        if prev_sample is None and noise is None:
            raise ValueError("FlowTables.step needs prev_sample or noise")
        sigma, sigma_prev = self._broadcast_sigmas(step_index, sample)
        # sigma_max, the reference's sigma == 1 replacement, is the schedule's second sigma. Sliced inside the step
        # (not cached at construction), so on XLA it is part of every step's graph, never a pending op of the first.
        sigma_max = self.sigmas[1]
        return _flow_core(sde_type, model_output, sample, sigma, sigma_prev, sigma_max, noise_level,
                          prev_sample, None if prev_sample is not None else noise)

    def ode_step(self, model_output: Tensor, step_index: Tensor, sample: Tensor) -> Tensor:
        """The deterministic Euler step ``x + (sigma_next - sigma) v`` in float32 (for evaluation).

        Equals ``FlowMatchEulerDiscreteScheduler.step`` before its cast back to the model dtype, and the reference's
        SDE step at ``noise_level=0``.
        """
        sigma, sigma_prev = self._broadcast_sigmas(step_index, sample)
        dt = sigma_prev - sigma
        return sample.to(_COMPUTE_DTYPE) + dt * model_output.to(_COMPUTE_DTYPE)

    def __repr__(self) -> str:
        return f"FlowTables(num_steps={self.num_steps}, device={self.device})"
