"""DDIM step that also returns the log-probability of the step under the policy.

This is the mathematical core of DDPO: each denoising step x_t -> x_{t-1} of a DDIM
sampler with eta > 0 is a Gaussian policy

    x_{t-1} ~ N(mean(x_t, eps_theta(x_t, t)), sigma_t^2 I)

and the policy-gradient objective needs log p(x_{t-1} | x_t) with a gradient w.r.t. the
model output (through the mean).

Notation (DDIM paper, eqs. 12 and 16), with ``a = scheduler.alphas_cumprod``:

    t_prev   = clamp(t - T // n, 0, T - 1)          T = num_train_timesteps, n = num steps
    a_t      = a[t],   a_prev = a[t_prev]
    x0_hat, eps_hat  from the model output (epsilon / v_prediction / sample)
    x0_hat   <- threshold or clip (per scheduler.config)
    sigma_t  = eta * sqrt((1 - a_prev) / (1 - a_t)) * sqrt(1 - a_t / a_prev)
    mean     = sqrt(a_prev) * x0_hat + sqrt(1 - a_prev - sigma_t^2) * eps_hat
    x_prev   = mean + sigma_t * z                    (unless x_prev is given)
    log_prob = mean over non-batch dims of
               -(x_prev - mean)^2 / (2 sigma_t^2) - log(sigma_t) - log(sqrt(2 pi))

Semantics follow ddpo-pytorch's ``ddim_step_with_logprob`` (kvablack/ddpo-pytorch):

* ``t_prev`` is clamped to ``[0, T-1]`` *before* the table lookup, so the last step uses
  ``alphas_cumprod[0]`` as ``a_prev`` -- never ``final_alpha_cumprod`` (which is what
  diffusers' own ``DDIMScheduler.step`` uses for a negative ``t_prev``). For the SD 1.x
  config (``set_alpha_to_one=False``) the two agree, because ``final_alpha_cumprod`` is
  ``alphas_cumprod[0]`` there; with ``set_alpha_to_one=True`` they differ at the last step.
* ``t_prev`` is always ``t - T // n`` (the "leading" spacing gap) whatever
  ``config.timestep_spacing`` says.
* ``x_prev`` is detached before it enters the log-prob: gradients flow through ``mean``
  (and ``sigma_t``, which does not depend on the model) only.
* ``use_clipped_model_output`` is not supported (the reference leaves it False).

Two entry points:

* :func:`ddim_step_with_logprob` -- the reference calling convention (a diffusers
  ``DDIMScheduler`` after ``set_timesteps``; train-timestep values). Looks the alphas up on
  the CPU, so it is meant for tests and CPU/GPU use.
* :class:`DDIMTables` -- the XLA-friendly form: per-step constants live on the device and
  are gathered with index tensors, so every step traces to the same graph.

Both share :func:`_ddim_core`, so they agree bit for bit given the same alphas.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["ddim_step_with_logprob", "DDIMTables"]

_PREDICTION_TYPES = ("epsilon", "v_prediction", "sample")
_LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)


# --------------------------------------------------------------------------------------
# shared math
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _StepConfig:
    """Per-run constants read from ``scheduler.config`` (Python values, not per-step)."""

    prediction_type: str
    clip_sample: bool
    clip_sample_range: float
    thresholding: bool
    dynamic_thresholding_ratio: float
    sample_max_value: float

    @classmethod
    def from_scheduler(cls, scheduler) -> "_StepConfig":
        cfg = scheduler.config
        prediction_type = cfg.get("prediction_type", "epsilon")
        if prediction_type not in _PREDICTION_TYPES:
            raise ValueError(
                f"prediction_type given as {prediction_type!r} must be one of {_PREDICTION_TYPES}"
            )
        return cls(
            prediction_type=prediction_type,
            clip_sample=bool(cfg.get("clip_sample", False)),
            clip_sample_range=float(cfg.get("clip_sample_range", 1.0)),
            thresholding=bool(cfg.get("thresholding", False)),
            dynamic_thresholding_ratio=float(cfg.get("dynamic_thresholding_ratio", 0.995)),
            sample_max_value=float(cfg.get("sample_max_value", 1.0)),
        )


def _compute_dtype(*tensors: Tensor) -> torch.dtype:
    """float64 stays float64; float32 / half / bfloat16 are computed in float32."""
    dtype = torch.float32
    for t in tensors:
        if t is not None:
            dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _left_broadcast(v: Tensor, ndim: int) -> Tensor:
    """(B,) -> (B, 1, ..., 1) ; () -> (1, ..., 1)."""
    return v.reshape(tuple(v.shape) + (1,) * (ndim - v.ndim))


def _threshold(x0: Tensor, cfg: _StepConfig) -> Tensor:
    """Dynamic thresholding (Imagen), same as diffusers' ``DDIMScheduler._threshold_sample``."""
    batch = x0.shape[0]
    flat = x0.reshape(batch, -1)
    s = torch.quantile(flat.abs(), cfg.dynamic_thresholding_ratio, dim=1)
    s = torch.clamp(s, min=1.0, max=cfg.sample_max_value).unsqueeze(1)
    flat = torch.clamp(flat, -s, s) / s
    return flat.reshape(x0.shape)


def _ddim_core(
    cfg: _StepConfig,
    model_output: Tensor,
    sample: Tensor,
    alpha_t: Tensor,
    alpha_prev: Tensor,
    eta,
    prev_sample: Tensor | None,
    noise: Tensor | None,
    full: bool = False,
) -> tuple[Tensor, ...]:
    """The DDIM step + Gaussian log-prob.

    ``alpha_t`` / ``alpha_prev`` are already broadcastable against ``sample`` (shape
    ``(B, 1, ..., 1)`` or all-ones) and in the compute dtype. Exactly one of
    ``prev_sample`` / ``noise`` is used (``prev_sample`` wins).
    Returns ``(prev_sample in sample.dtype, log_prob (B,) in the compute dtype)``, and with ``full`` also the
    step's ``mean`` and ``std_dev_t`` (what a KL penalty between two policies' steps needs).
    """
    dtype = alpha_t.dtype
    out = model_output.to(dtype)
    x_t = sample.to(dtype)

    beta_t = 1.0 - alpha_t
    sqrt_alpha_t = alpha_t.sqrt()
    sqrt_beta_t = beta_t.sqrt()

    # predicted x_0 and epsilon
    if cfg.prediction_type == "epsilon":
        x0_hat = (x_t - sqrt_beta_t * out) / sqrt_alpha_t
        eps_hat = out
    elif cfg.prediction_type == "sample":
        x0_hat = out
        eps_hat = (x_t - sqrt_alpha_t * x0_hat) / sqrt_beta_t
    elif cfg.prediction_type == "v_prediction":
        x0_hat = sqrt_alpha_t * x_t - sqrt_beta_t * out
        eps_hat = sqrt_alpha_t * out + sqrt_beta_t * x_t
    else:  # pragma: no cover - validated in _StepConfig
        raise ValueError(cfg.prediction_type)

    # clip / threshold x_0 (eps_hat is *not* re-derived: use_clipped_model_output=False)
    if cfg.thresholding:
        x0_hat = _threshold(x0_hat, cfg)
    elif cfg.clip_sample:
        x0_hat = x0_hat.clamp(-cfg.clip_sample_range, cfg.clip_sample_range)

    # sigma_t (DDIM eq. 16), written exactly as the reference/diffusers do. Note that in float32
    # (1 - a_t / a_prev) loses ~4 digits at the last steps (a_t / a_prev ~ 0.999): sigma there is
    # only good to ~1e-4 relative. Kept for parity; it is a fixed per-step constant, identical at
    # sampling and training time, so it does not bias the importance ratio.
    variance = ((1.0 - alpha_prev) / beta_t) * (1.0 - alpha_t / alpha_prev)
    std_dev_t = eta * variance.sqrt()

    # mean of x_{t-1} (DDIM eq. 12)
    direction = (1.0 - alpha_prev - std_dev_t**2).sqrt() * eps_hat
    mean = alpha_prev.sqrt() * x0_hat + direction

    if prev_sample is None:
        if noise is None:
            raise ValueError("either prev_sample or noise must be given")
        prev_sample = mean + std_dev_t * noise.to(dtype)
    # What the caller gets back (and later feeds in again as prev_sample) is the sample-dtype
    # tensor, so the log-prob is evaluated at exactly that value. For float32/float64 this is
    # a no-op; for half/bf16 it keeps sampling-time and training-time log-probs consistent.
    prev_sample = prev_sample.to(sample.dtype)

    x_prev = prev_sample.detach().to(dtype)
    log_prob = (
        -((x_prev - mean) ** 2) / (2.0 * std_dev_t**2)
        - torch.log(std_dev_t)
        - _LOG_SQRT_2PI
    )
    log_prob = log_prob.mean(dim=tuple(range(1, log_prob.ndim)))
    if full:
        return prev_sample, log_prob, mean, std_dev_t
    return prev_sample, log_prob


# --------------------------------------------------------------------------------------
# reference calling convention
# --------------------------------------------------------------------------------------


def ddim_step_with_logprob(
    scheduler,
    model_output: Tensor,
    timestep,
    sample: Tensor,
    eta: float,
    prev_sample: Tensor | None = None,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:
    """One DDIM step x_t -> x_{t-1} plus log p(x_{t-1} | x_t), batched over timesteps.

    Args:
        scheduler: a diffusers ``DDIMScheduler`` on which ``set_timesteps(n)`` was called.
        model_output: UNet output (B, ...), interpreted per ``scheduler.config.prediction_type``.
        timestep: train-timestep values: LongTensor (B,) (may differ per sample), a 0-d
            tensor or an int (broadcast over the batch).
        sample: x_t, shape (B, ...).
        eta: DDIM eta (> 0 for a finite log-prob).
        prev_sample: x_{t-1} to score; if None it is drawn as ``mean + sigma_t * z`` with
            ``z = torch.randn(sample.shape, generator=generator)`` on sample's device/dtype.
        generator: RNG for ``z``; must be None when ``prev_sample`` is given (as in the reference).

    Returns:
        ``(prev_sample, log_prob)``: prev_sample in ``sample.dtype``; log_prob of shape (B,)
        (float64 for float64 inputs, else float32).
    """
    if getattr(scheduler, "num_inference_steps", None) is None:
        raise ValueError(
            "Number of inference steps is 'None', call scheduler.set_timesteps(...) first"
        )
    if prev_sample is not None and generator is not None:
        raise ValueError("Cannot pass both generator and prev_sample.")
    cfg = _StepConfig.from_scheduler(scheduler)
    num_train = int(scheduler.config.num_train_timesteps)
    step_gap = num_train // int(scheduler.num_inference_steps)

    alphas_cumprod = scheduler.alphas_cumprod
    t = torch.as_tensor(timestep).to(device=alphas_cumprod.device, dtype=torch.long)
    if t.ndim > 1 or (t.ndim == 1 and t.shape[0] != sample.shape[0]):
        raise ValueError(
            f"timestep must be 0-d or of shape ({sample.shape[0]},), got {tuple(t.shape)}"
        )
    t_prev = torch.clamp(t - step_gap, 0, num_train - 1)

    dtype = _compute_dtype(model_output, sample, prev_sample)
    alpha_t = alphas_cumprod[t].to(device=sample.device, dtype=dtype)
    alpha_prev = alphas_cumprod[t_prev].to(device=sample.device, dtype=dtype)
    alpha_t = _left_broadcast(alpha_t, sample.ndim)
    alpha_prev = _left_broadcast(alpha_prev, sample.ndim)

    noise = None
    if prev_sample is None:
        # Drawn on the generator's device when it differs (e.g. a CPU generator for a GPU
        # sample, like diffusers' randn_tensor), then moved to sample's device.
        gen_device = generator.device if generator is not None else sample.device
        noise = torch.randn(
            sample.shape, generator=generator, device=gen_device, dtype=sample.dtype
        ).to(sample.device)
    return _ddim_core(cfg, model_output, sample, alpha_t, alpha_prev, eta, prev_sample, noise)


# --------------------------------------------------------------------------------------
# device-resident tables (XLA)
# --------------------------------------------------------------------------------------


def _gather(table: Tensor, index: Tensor) -> Tensor:
    """``table[index]`` for a 1-D table and an index tensor of any shape, via index_select."""
    return torch.index_select(table, 0, index.reshape(-1)).reshape(index.shape)


class DDIMTables:
    """Device-friendly DDIM-with-logprob for the training/sampling loops on XLA.

    All per-step constants (timesteps, alpha_t, alpha_prev) live on the device and are
    gathered with an index tensor, so no ``.cpu()`` / ``.item()`` / Python-int indexing /
    data-dependent control flow happens per step: each call traces to the same graph.
    The scheduler's config (prediction type, clipping, thresholding) is frozen at
    construction.
    """

    def __init__(
        self,
        cfg: _StepConfig,
        timesteps: Tensor,
        alpha_t: Tensor,
        alpha_prev: Tensor,
        num_train_timesteps: int,
    ):
        self._cfg = cfg
        self.timesteps = timesteps
        self._alpha_t = alpha_t
        self._alpha_prev = alpha_prev
        self.num_steps = int(timesteps.shape[0])
        self.num_train_timesteps = int(num_train_timesteps)

    @classmethod
    def from_scheduler(
        cls, scheduler, num_steps: int, device, dtype: torch.dtype = torch.float32
    ) -> "DDIMTables":
        """Calls ``scheduler.set_timesteps(num_steps)`` (on CPU) and copies the tables to ``device``."""
        cfg = _StepConfig.from_scheduler(scheduler)
        scheduler.set_timesteps(num_steps)
        num_train = int(scheduler.config.num_train_timesteps)
        step_gap = num_train // int(scheduler.num_inference_steps)

        ts = scheduler.timesteps.detach().to("cpu", torch.long)
        ts_prev = torch.clamp(ts - step_gap, 0, num_train - 1)
        alphas_cumprod = scheduler.alphas_cumprod.detach().cpu()
        alpha_t = alphas_cumprod[ts]
        alpha_prev = alphas_cumprod[ts_prev]
        if bool((alpha_prev == alpha_t).any()):
            warnings.warn(
                "DDIMTables: some step has alpha_prev == alpha_t (t_prev clamps onto t, e.g. "
                "timestep 0 in the schedule); sigma_t is 0 there and its log-prob is not finite.",
                stacklevel=2,
            )
        return cls(
            cfg,
            timesteps=ts.to(device),
            alpha_t=alpha_t.to(device=device, dtype=dtype),
            alpha_prev=alpha_prev.to(device=device, dtype=dtype),
            num_train_timesteps=num_train,
        )

    @property
    def dtype(self) -> torch.dtype:
        return self._alpha_t.dtype

    @property
    def device(self) -> torch.device:
        return self._alpha_t.device

    def to(self, device=None, dtype: torch.dtype | None = None) -> "DDIMTables":
        """A copy with the tables on another device and/or float dtype."""
        return DDIMTables(
            self._cfg,
            timesteps=self.timesteps.to(device) if device is not None else self.timesteps,
            alpha_t=self._alpha_t.to(device=device, dtype=dtype),
            alpha_prev=self._alpha_prev.to(device=device, dtype=dtype),
            num_train_timesteps=self.num_train_timesteps,
        )

    def timestep_at(self, step_index: Tensor) -> Tensor:
        """Train-timestep values ``timesteps[step_index]`` (gathered on device, same shape)."""
        return _gather(self.timesteps, step_index)

    def alphas_at(self, step_index: Tensor) -> tuple[Tensor, Tensor]:
        """``(alpha_t, alpha_prev)`` for the given step indices (same shape as step_index)."""
        return _gather(self._alpha_t, step_index), _gather(self._alpha_prev, step_index)

    def step(
        self,
        model_output: Tensor,
        step_index: Tensor,
        sample: Tensor,
        eta: float,
        prev_sample: Tensor | None = None,
        noise: Tensor | None = None,
        full: bool = False,
    ) -> tuple[Tensor, ...]:
        """DDIM step with log-prob at schedule positions ``step_index`` ((B,) or (), on device).

        ``noise`` (like ``sample``, drawn by the caller) is used when ``prev_sample`` is None;
        when ``prev_sample`` is given, ``noise`` is ignored. Returns ``(prev_sample, log_prob (B,))``,
        with ``full`` also ``(mean, std_dev_t)``.
        """
        if prev_sample is None and noise is None:
            raise ValueError("DDIMTables.step needs prev_sample or noise")
        if step_index.ndim > 1 or (step_index.ndim == 1 and step_index.shape[0] != sample.shape[0]):
            raise ValueError(
                f"step_index must be 0-d or of shape ({sample.shape[0]},), got {tuple(step_index.shape)}"
            )
        dtype = _compute_dtype(self._alpha_t, model_output, sample, prev_sample)
        alpha_t, alpha_prev = self.alphas_at(step_index)
        alpha_t = _left_broadcast(alpha_t.to(dtype), sample.ndim)
        alpha_prev = _left_broadcast(alpha_prev.to(dtype), sample.ndim)
        return _ddim_core(
            self._cfg,
            model_output,
            sample,
            alpha_t,
            alpha_prev,
            eta,
            prev_sample,
            None if prev_sample is not None else noise,
            full,
        )

    def __repr__(self) -> str:
        return (
            f"DDIMTables(num_steps={self.num_steps}, prediction_type={self._cfg.prediction_type!r}, "
            f"device={self.device}, dtype={self.dtype})"
        )
