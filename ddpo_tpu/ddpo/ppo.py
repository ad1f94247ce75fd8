"""The PPO-clip objective of DDPO on one denoising step of a batch of recorded trajectories."""

from __future__ import annotations

import torch
from torch import Tensor


def ppo_loss(log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor, clip_range: float,
             adv_clip_max: float) -> tuple[Tensor, dict[str, Tensor]]:
    """loss = mean(max(-A r, -A clip(r, 1-eps, 1+eps))), r = exp(logp - logp_old); A clipped to +-adv_clip_max.
    Also returns approx_kl = 0.5 mean((logp - logp_old)^2) and clipfrac = mean(|r - 1| > eps), all on the device."""
    adv = torch.clamp(advantages, -adv_clip_max, adv_clip_max)
    ratio = torch.exp(log_prob - old_log_prob)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    loss = torch.mean(torch.maximum(unclipped, clipped))
    with torch.no_grad():
        approx_kl = 0.5 * torch.mean((log_prob - old_log_prob) ** 2)
        clipfrac = torch.mean((torch.abs(ratio - 1.0) > clip_range).float())
    return loss, {"approx_kl": approx_kl, "clipfrac": clipfrac}
