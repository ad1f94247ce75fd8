"""The PPO-clip objective of DDPO on one denoising step of a batch of recorded trajectories."""

from __future__ import annotations

import torch
from torch import Tensor


def weighted_mean(x: Tensor, weights: Tensor | None) -> Tensor:
    """mean(w * x) over the batch (w None: the plain mean). Zero-weight rows still run (fixed shapes) but add nothing;
    with w = mask x B / kept the batch mean is the mean over the kept rows (GRPO's zero-advantage filter)."""
    return torch.mean(x if weights is None else weights * x)


def ppo_loss(log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor, clip_range: float,
             adv_clip_max: float, weights: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """loss = mean(w max(-A r, -A clip(r, 1-eps, 1+eps))), r = exp(logp - logp_old); A clipped to +-adv_clip_max.
    Also returns approx_kl = 0.5 mean(w (logp - logp_old)^2) and clipfrac = mean(w (|r - 1| > eps)), all on the
    device. `weights` (B,) per term, or None (all 1)."""
    adv = torch.clamp(advantages, -adv_clip_max, adv_clip_max)
    ratio = torch.exp(log_prob - old_log_prob)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    loss = weighted_mean(torch.maximum(unclipped, clipped), weights)
    with torch.no_grad():
        approx_kl = 0.5 * weighted_mean((log_prob - old_log_prob) ** 2, weights)
        clipfrac = weighted_mean((torch.abs(ratio - 1.0) > clip_range).float(), weights)
    return loss, {"approx_kl": approx_kl, "clipfrac": clipfrac}
