"""Flow-DPPO (arXiv 2606.11025): Flow-GRPO with PPO's ratio clip replaced by an asymmetric trust-region mask on the
exact Gaussian KL between the current and the sampling policy's SDE step.

Read from verl-project/verl-omni@a1139bafffb5b9711f0a6b6edff8ecaa60bfff30: ``FlowDPPOLoss.compute_loss`` in
``verl_omni/trainer/diffusion/diffusion_algos.py:361-443``, its config
``verl_omni/workers/config/diffusion/actor.py:47`` and
``verl_omni/trainer/config/diffusion/actor/diffusion_actor.yaml:51-54`` (``kl_mask_threshold`` 1e-5,
``add_kl_coefficient`` true), ``docs/algo/flowdppo.md``, and its check
``tests/trainer/diffusion/test_diffusion_core_algos_on_cpu.py:161-270``. Per row (a sample at one step):

    D   = mean over the latent's elements of (mu - mu_old)^2 / (2 sigma^2),  sigma = std_dev_t sqrt(-dt)
          (add_kl_coefficient false: (mu - mu_old)^2 / 2, no normalisation)
    r   = exp(logp - logp_old)
    out = D >= eps and ((A > 0 and r > 1) or (A < 0 and r < 1))       (moving further away, outside the region)
    loss = mean(where(out, 0, -A r))

What the reference does, kept here: the advantages are *not* clamped (its test asserts the loss differs from the one
with ``adv_clip_max`` applied), so ``train.adv_clip_max`` and ``train.clip_range`` are not read; the threshold test is
``>=`` (the paper's and docs' "D > eps" differ only at equality); ``mu_old`` is the step mean of the weights that
sampled the epoch (the reference records it at rollout; here, as GRPO-Guard's ``ratio_norm``, the loop keeps a copy of
the sampling weights and runs one forward of it per trained step: ``training/ppo_epoch.py``); the rest is Flow-GRPO
(group advantages, the zero-advantage filter, the KL penalty to the reference with ``kl_beta``: the reference's actor
adds ``kl_loss_coef`` x its KL loss to the policy loss, ``verl_omni/workers/utils/losses.py:101-110``, off by default
there as ``use_kl_loss``). Metrics: ``clipfrac`` is the masked fraction (what PPO's
clipfrac counts, rows that stop contributing gradient; the reference's ``masked_fraction``), ``approx_kl`` is
``0.5 mean((logp - logp_old)^2)`` as there, ``kl_new_old`` the mean D (``kl_new_old_mean``) and ``kl_mask_fraction``
the share of rows with D >= eps (the reference's name, though it counts rows outside the region, masked or not).
All means are weighted by the zero-advantage filter's row weights (a mean over the kept rows), as GRPO's.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ddpo_tpu.algorithms.grpo import GRPO, grpo_loss, kl_to_reference
from ddpo_tpu.algorithms.ppo import weighted_mean
from ddpo_tpu.config.plan import RunPlan
from ddpo_tpu.families.base import StepScore

__all__ = ["DPPO", "dppo_divergence", "dppo_loss"]


def dppo_divergence(mean: Tensor, old_mean: Tensor, std: Tensor, sqrt_dt: Tensor, normalise: bool = True) -> Tensor:
    """Per-row D (B,): the mean over non-batch dims of ``(mean - old_mean)^2 / (2 (std sqrt_dt)^2)`` (normalise,
    the reference's ``add_kl_coefficient``) or of ``(mean - old_mean)^2 / 2``. ``std`` is the step's ``std_dev_t``
    with a leading batch dim ((B, 1, ..., 1) or (B,)) or a scalar; ``sqrt_dt`` (B,) or a scalar. The division comes
    before the mean, as the reference's order."""
    sq = (mean - old_mean).pow(2)
    if normalise:
        ones = (1,) * (mean.ndim - 1)
        std = torch.as_tensor(std, dtype=sq.dtype, device=sq.device)
        std = std.reshape(std.shape[0], *ones) if std.ndim else std.reshape(1, *ones)
        dt = torch.as_tensor(sqrt_dt, dtype=sq.dtype, device=sq.device)
        dt = dt.reshape(dt.shape[0], *ones) if dt.ndim else dt.reshape(1, *ones)
        per = sq / (2 * (std * dt).pow(2))
    else:
        per = sq / 2
    return per.mean(dim=tuple(range(1, per.ndim))) if per.ndim > 1 else per


def dppo_loss(log_prob: Tensor, old_log_prob: Tensor, mean: Tensor, old_mean: Tensor, std: Tensor, sqrt_dt: Tensor,
              advantages: Tensor, threshold: float, normalise: bool = True, weights: Tensor | None = None
              ) -> tuple[Tensor, dict[str, Tensor]]:
    """Flow-DPPO's policy loss ``mean(w where(out, 0, -A r))`` (module docstring) and its metrics, all detached:
    approx_kl, clipfrac (the masked fraction), kl_new_old (mean D), kl_mask_fraction (share with D >= threshold)."""
    adv = advantages.detach()
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    d = dppo_divergence(mean, old_mean, std, sqrt_dt, normalise).to(ratio.dtype)
    high = d >= threshold
    out = high & (((ratio > 1.0) & (adv > 0)) | ((ratio < 1.0) & (adv < 0)))
    keep = (~out).detach()
    per = torch.where(keep, unclipped, torch.zeros((), dtype=unclipped.dtype, device=unclipped.device))
    loss = weighted_mean(per, weights)
    with torch.no_grad():
        info = {"approx_kl": weighted_mean(0.5 * log_ratio.pow(2), weights),
                "clipfrac": weighted_mean(out.to(ratio.dtype), weights),
                "kl_new_old": weighted_mean(d.detach(), weights),
                "kl_mask_fraction": weighted_mean(high.to(ratio.dtype), weights)}
    return loss, info


class DPPO(GRPO):
    """GRPO (its advantages, plan, KL and GARDO options) with Flow-DPPO's loss in place of PPO-clip."""

    name = "dppo"
    stat_names = ("loss", "approx_kl", "clipfrac", "kl", "kl_new_old", "kl_mask_fraction")

    def __init__(self, cfg, plan: RunPlan | None = None):
        super().__init__(cfg, plan)
        self.needs_old_mean = True  # D compares with the sampling policy's step means (the loop keeps its weights)

    def loss(self, score: StepScore, old_log_prob: Tensor, advantages: Tensor,
             reference_mean: Tensor | None = None, weights: Tensor | None = None, old_mean: Tensor | None = None,
             sqrt_dt: Tensor | None = None, steps: Tensor | None = None, kl_gate: Tensor | None = None
             ) -> tuple[Tensor, ...]:
        """As GRPO.loss; old_mean and sqrt_dt (the sampling weights' step means, each row's sqrt(-dt)) are required."""
        if old_mean is None or sqrt_dt is None:
            raise ValueError("Flow-DPPO needs the sampling policy's step means and each row's sqrt(-dt)")
        a, t = self.cfg.algorithm, self.cfg.train
        kl = kl_to_reference(score.mean, reference_mean, score.std) if reference_mean is not None else None
        guard = lambda w: dppo_loss(score.log_prob, old_log_prob, score.mean, old_mean, score.std, sqrt_dt, advantages,
                                    a.kl_mask_threshold, a.add_kl_coefficient, w)
        loss, info = grpo_loss(score.log_prob, old_log_prob, advantages, t.clip_range, t.adv_clip_max, kl, a.kl_beta,
                               weights, guard, kl_gate)
        return loss, info["approx_kl"], info["clipfrac"], info["kl"], info["kl_new_old"], info["kl_mask_fraction"]
