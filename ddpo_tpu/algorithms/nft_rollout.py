"""DiffusionNFT's rollouts as NVlabs' code samples them (NVlabs/DiffusionNFT@24af5554, the presets' `solver="dpm2"`,
`deterministic=True`, guidance 1): the ODE with the 2nd-order multistep DPM-Solver++ on the flow schedule, and the
transformer called with the timestep cast to an integer.

The solver (flow_grpo/diffusers_patch/solver.py: run_sampling, dpm_step, ddim_update,
multistep_dpm_solver_second_order_update), on sigmas s_0 = 1 > ... > s_N = 0 with alpha = 1 - sigma and
lambda = log(alpha) - log(sigma); m_i = x_i - s_i v_i is the step's x0 prediction:

* the first and the last step are DDIM with eta 0 (the Euler step of the flow ODE):
  x' = (1 - s') m_i + s' (x_i - (1 - s_i) m_i) / s_i;
* every other step is DPM-Solver++(2M): h = lambda' - lambda_i, r = (lambda_i - lambda_{i-1}) / h,
  x' = (s' / s_i) x_i - alpha' (e^-h - 1) (m_i + (m_i - m_{i-1}) / (2 r)).
  At the second step lambda_{i-1} = log 0 - log 1 = -inf, so r = inf and the correction is 0 there as in float64.

Each step is written x' = a x + b m_i + c m_{i-1} with (a, b, c) from the sigmas, computed once on the host in float64
(the reference upcasts its sigmas to float64 for these scalars), so every step is one graph with its coefficients
gathered by step index. The previous x0 prediction is carried by sample_trajectory (a step with `multistep`).

The timestep: the reference's sampling pipeline calls the SD3 transformer with `torch.full(..., sigma * 1000,
dtype=torch.long)` (pipeline_with_logprob.py:213): float32 sigma x 1000, truncated. Its training passes the float
`scheduler.timesteps` (train_nft_sd3.py:878), so the two differ; `algorithm.integer_rollout_timesteps` picks it.
"""

from __future__ import annotations


import numpy as np
import torch
from torch import Tensor

from ddpo_tpu.diffusion.flow import FlowTables
from ddpo_tpu.diffusion.sampling import autocast_context

SOLVERS = ("euler", "dpm2")
TRAIN_TIMESTEPS = 1000  # the SD3 pipeline's sigma -> timestep factor (hard-coded there too)


def dpm2_coefficients(sigmas) -> np.ndarray:
    """(N, 3) float64: step i's x' = a x + b m_i + c m_{i-1} for the sigmas (N + 1,) ending in 0."""
    s = np.asarray(sigmas, dtype=np.float64)
    n = len(s) - 1
    with np.errstate(divide="ignore"):
        lam = np.log(1 - s) - np.log(s)  # -inf at sigma 1, +inf at sigma 0
    out = np.zeros((n, 3))
    for i in range(n):
        cur, nxt = s[i], s[i + 1]
        if i == 0 or i == n - 1:  # ddim_update, eta 0
            out[i] = (nxt / cur, (1 - nxt) - nxt * (1 - cur) / cur, 0.0)
            continue
        h = lam[i + 1] - lam[i]
        r = (lam[i] - lam[i - 1]) / h
        k = -(1 - nxt) * (np.exp(-h) - 1)     # the first-order coefficient of D0 = m_i
        half = 0.5 * k / r                     # of D1 = (m_i - m_{i-1}) / r, halved; 0 where r is inf
        out[i] = (nxt / cur, k + half, -half)
    return out


def integer_timesteps(tables: FlowTables) -> FlowTables:
    """The same sigmas with the transformer's timesteps as the reference samples: trunc(float32 sigma x 1000)."""
    sigmas = tables.sigmas.detach().to("cpu", torch.float32)
    steps = torch.trunc(sigmas[:-1] * TRAIN_TIMESTEPS)
    return FlowTables(sigmas, steps).to(tables.device)


def make_rollout_step(family, autocast, tables: FlowTables, solver: str):
    """The ODE rollout step with the sampling loop's signature plus the carried x0 prediction:
    (x, step index (B,), noise (ignored), cond, uncond (ignored: CFG-free), m_prev) -> (x', log-prob 0, m)."""
    if solver not in SOLVERS:
        raise ValueError(f"solver {solver!r} must be one of {SOLVERS}")
    coef = dpm2_coefficients(tables.sigmas.detach().cpu().tolist()) if solver == "dpm2" else None
    table = torch.as_tensor(coef, dtype=torch.float32).to(tables.device) if coef is not None else None

    def step(x: Tensor, idx: Tensor, z: Tensor, cond, uncond, m_prev: Tensor):
        with autocast_context(autocast):
            v = family.velocity(x, idx, cond, None, tables)
        zero = torch.zeros(x.shape[0], device=x.device)
        if table is None:  # Euler: the flow_sde sampler's ODE step
            return tables.ode_step(v.float(), idx, x), zero, m_prev
        shape = (-1,) + (1,) * (x.dim() - 1)
        sigma = tables.sigmas_at(idx)[0].reshape(shape)
        m = x.float() - sigma * v.float()  # convert_model_output: the x0 prediction
        abc = table.index_select(0, idx)
        a, b, c = (abc[:, k].reshape(shape) for k in range(3))
        return a * x.float() + b * m + c * m_prev.float(), zero, m

    # sample_trajectory carries m between steps; a function attribute, which mypy does not model on a def
    step.multistep = True  # type: ignore[attr-defined]
    return step
