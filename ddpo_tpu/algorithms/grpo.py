"""GRPO pieces of Flow-GRPO (yifan123/flow_grpo, ``scripts/train_sd3.py``): group-relative advantages, the closed-form
KL to the reference policy, and the clipped objective with the KL penalty.

Semantics follow the reference:

* Advantages (``flow_grpo/stat_tracking.py``, ``PerPromptStatTracker.update(..., type='grpo')``, cleared every
  epoch): for each prompt of the epoch, ``(r - mean) / (std + 1e-4)`` over that prompt's rewards, ``std`` the
  population std (``np.std``, ddof 0), statistics in float64. With ``global_std`` the std is that of all rewards of the
  epoch (the reference's ``sample.global_std``). The advantage is clipped to ``+-adv_clip_max`` in the loss, as there;
  ``group_advantages(clip=...)`` can clip up front too.
* KL (``train_sd3.py``, ``beta > 0``): ``((mean - ref_mean)^2).mean(dims (1, 2, 3)) / (2 std_dev_t^2)``, then averaged
  over the batch, with ``mean`` / ``std_dev_t`` from ``sde_step_with_logprob`` under the trained policy and
  ``ref_mean`` under the reference (the base model with the LoRA adapter disabled), computed without gradient. For the
  "sde" step ``std_dev_t`` is the reference's ``std`` *before* the ``sqrt(-dt)`` factor, so this is the exact KL of
  the two step Gaussians (per latent element, averaged) times ``-dt``; for "cps" ``std_dev_t`` is the step's std and
  the value is the exact per-element KL. We keep the reference's value.
* Loss: the PPO-clip policy loss of ``ddpo_tpu.algorithms.ppo.ppo_loss`` (the same as the reference's GRPO logic:
  advantages clamped to ``+-adv_clip_max``, ratio ``exp(logp - logp_old)``, ``mean(max(-A r, -A clip(r, 1 +- eps)))``),
  plus ``beta * mean(kl)`` when ``beta > 0``.

* Zero-advantage samples (``train_sd3.py`` after the stat tracker): the reference keeps only the samples whose
  advantages are not all 0 (``mask = advantages.abs().sum(1) != 0``: a group of equal rewards drops out), turns random
  dropped ones back on until the kept count divides ``num_batches_per_epoch``, then per inner epoch permutes the kept
  samples (the permutation compounds over inner epochs) and cuts them into ``num_batches_per_epoch`` batches, each a
  mean over its kept samples. ``zero_advantage_plan`` does the same with fixed shapes: every sample still runs, in an
  order that puts the reference's batch b in the b-th block of a sampling batch's size, with a loss weight ``N / K``
  on the K kept samples and 0 on the others (docs/parity.md: why this is the reference's gradient per update).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ddpo_tpu.algorithms.base import TrainPlan
from ddpo_tpu.algorithms.guards import (AdaptiveReference, ImageScores, UncertaintyGate, diversity_advantages,
                                       rank_uncertainty)
from ddpo_tpu.algorithms.groups import GROUP_STD_EPS, GroupAlgorithm, group_advantages, zero_std_ratio
from ddpo_tpu.algorithms.ppo import ppo_loss, weighted_mean
from ddpo_tpu.config.plan import RunPlan
from ddpo_tpu.families.base import StepScore
from ddpo_tpu.random_streams import GRPO_PLAN

__all__ = ["GRPO", "PLAN_STREAM", "GROUP_STD_EPS", "group_advantages", "kl_to_reference", "grpo_loss",
           "ratio_norm_loss", "TrainPlan", "zero_advantage_plan", "zero_std_ratio"]

def kl_to_reference(mean: Tensor, ref_mean: Tensor, std: Tensor) -> Tensor:
    """Per-sample closed-form KL penalty of Flow-GRPO: ``mean over non-batch dims of (mean - ref_mean)^2 / (2 std^2)``.

    ``mean`` / ``ref_mean`` (B, ...) are the step means under the policy and the reference; ``std`` is the step's
    ``std_dev_t`` ((B, 1, ..., 1), (B,), (1, ...) or a scalar). Returns (B,), in the dtype of ``mean``. The batch
    mean of this is the reference's ``kl_loss``.

    A zero ``std`` gives 0 / 0 (NaN): the last step of a "cps" schedule (sigma' = 0) is deterministic. flow_grpo
    never trains that step (``timestep_fraction`` 0.99 trains the first ``int(0.99 T)`` = T - 1 steps); do the same.
    """
    if mean.shape != ref_mean.shape:
        raise ValueError(
            f"mean and ref_mean must have the same shape, got {tuple(mean.shape)} and {tuple(ref_mean.shape)}"
        )
    batch = mean.shape[0]
    sq = ((mean - ref_mean) ** 2).mean(dim=tuple(range(1, mean.ndim)))
    std = torch.as_tensor(std, dtype=sq.dtype, device=sq.device)
    if std.numel() == batch:
        std = std.reshape(batch)
    elif std.numel() == 1:
        std = std.reshape(())
    else:
        raise ValueError(f"std must have one value per sample ({batch}) or one in all, got shape {tuple(std.shape)}")
    return sq / (2 * std**2)


def grpo_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    clip_range: float,
    adv_clip_max: float,
    kl: Tensor | None = None,
    beta: float = 0.0,
    weights: Tensor | None = None,
    guard=None,
    kl_gate: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """``ppo_loss(...) + beta * mean(kl)`` (``guard``: weights -> (policy loss, info) in place of ppo_loss, GRPO-Guard's
    ``ratio_norm_loss``) (the KL term only when ``beta > 0`` and ``kl`` is given, as the reference).
    With ``weights`` (B,) every mean is ``mean(w * .)``: the zero-advantage filter (``zero_advantage_plan``).
    With ``kl_gate`` (B,) the KL's mean takes these row weights in place of ``weights`` (GARDO's gate: 0 on the rows
    that do not carry the KL, the others scaled so the mean is over them, all 0 when none does; training/epoch_data.py's
    ``batch_mean_weights``).

    Returns ``(loss, info)``; info holds ``approx_kl`` and ``clipfrac`` (as ppo_loss), ``policy_loss`` and ``kl``
    (``mean(kl)``, logged even when beta is 0; zero when kl is None), all detached, on the device.
    """
    if beta < 0:
        raise ValueError(f"beta must be >= 0, got {beta}")
    if beta > 0 and kl is None:
        raise ValueError("beta > 0 needs the kl term")
    policy_loss, info = (guard(weights) if guard is not None else
                         ppo_loss(log_prob, old_log_prob, advantages, clip_range, adv_clip_max, weights))
    if kl is not None:
        kl_mean = weighted_mean(kl, weights if kl_gate is None else kl_gate)
        loss = policy_loss + beta * kl_mean if beta > 0 else policy_loss
        info["kl"] = kl_mean.detach()
    else:
        loss = policy_loss
        info["kl"] = torch.zeros((), dtype=policy_loss.dtype, device=policy_loss.device)
    info["policy_loss"] = policy_loss.detach()
    return loss, info


def ratio_norm_loss(log_prob: Tensor, old_log_prob: Tensor, mean: Tensor, old_mean: Tensor, std: Tensor,
                    sqrt_dt: Tensor, steps: Tensor, advantages: Tensor, clip_range: float, adv_clip_max: float,
                    weights: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """GRPO-Guard's policy loss (RatioNorm and the gradient reweighting; scripts/train_sd3_GRPO_Guard.py, read at
    zhtmike/flow_grpo@2e2f712e, the training loop's `if config.rationorm:` blocks): with s = sqrt(-dt) std_dev_t,

        r = exp((logp - logp_old + bias / (2 s^2)) s),   loss = mean(w max(-A r, -A clip(r)) / dt),

    mu_old the sampling policy's step means and bias the mean of (mu - mu_old)^2 over the batch's kept samples and
    all their elements (the reference's `.mean(dim=tuple(range(1, log_prob.ndim)))` of a 1-d log_prob reduces
    everything: one scalar per batch). The reference's batch is one step j, s and dt its batch means; here rows of
    the same step (`steps`) form that batch, so fused steps keep their own. approx_kl is of the raw log-probs,
    clipfrac of the normalised ratio, as there."""
    dims = tuple(range(1, mean.dim()))
    s = (sqrt_dt.reshape(-1) * std.reshape(std.shape[0], -1)[:, 0]).to(log_prob.dtype)
    sq = ((mean - old_mean) ** 2).mean(dim=dims).to(log_prob.dtype)
    w = weights.to(sq.dtype) if weights is not None else torch.ones_like(sq)
    same = (steps.reshape(-1, 1) == steps.reshape(1, -1)).to(sq.dtype) * w.reshape(1, -1)  # kept rows of a step
    bias = (same @ sq) / same.sum(dim=1).clamp_min(1e-12)
    ratio = torch.exp((log_prob - old_log_prob + bias / (2 * s ** 2)) * s)
    adv = torch.clamp(advantages, -adv_clip_max, adv_clip_max)
    per = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range))
    loss = weighted_mean(per / sqrt_dt.reshape(-1).to(per.dtype) ** 2, weights)
    with torch.no_grad():
        approx_kl = 0.5 * weighted_mean((log_prob - old_log_prob) ** 2, weights)
        clipfrac = weighted_mean((torch.abs(ratio - 1.0) > clip_range).float(), weights)
    return loss, {"approx_kl": approx_kl, "clipfrac": clipfrac}


def zero_advantage_plan(advantages: np.ndarray, num_batches: int, updates: int, inner_epochs: int, rng) -> TrainPlan:
    """flow_grpo's zero-advantage filter and rebatching as an order and weights over all N samples.

    ``advantages`` (N,) or (N, T); ``num_batches`` the epoch's sampling batches (the reference rebatches into that
    many), ``updates`` optimizer steps per inner epoch, ``rng`` anything with ``permutation(n)`` (a numpy Generator),
    drawn in the reference's order: the re-included samples, then one permutation of the kept ones per inner epoch.

    The reference keeps ``mask = |A|.sum(1) != 0``, re-includes random dropped samples until the kept count K divides
    ``num_batches`` (here: lcm(num_batches, updates), the same number whenever an optimizer step holds whole sampling
    batches, the only layout the reference has), permutes the kept samples and cuts them into ``num_batches`` batches
    of m = K / num_batches. Here batch b's m samples sit, spread evenly, in positions [b B, (b + 1) B) (B = N /
    num_batches, a sampling batch) among zero-weight dropped ones, so they fall in the optimizer step the reference's
    batch b falls in, and weight N / K makes each step's mean of w * term the reference's mean over its kept samples.
    Nothing kept (every group's rewards equal; the reference fails there on an empty reshape): all weights 0.
    """
    adv = np.asarray(advantages)
    n = adv.shape[0]
    if num_batches < 1 or updates < 1 or n % num_batches or n % updates:
        raise ValueError(f"{n} samples do not split into {num_batches} batches and {updates} updates")
    mask = np.abs(adv.reshape(n, -1)).sum(axis=1) != 0
    modulus = math.lcm(num_batches, updates)
    missing = -int(mask.sum()) % modulus
    if missing:
        dropped = np.flatnonzero(~mask)  # n is a multiple of the modulus, so there are always enough
        mask[dropped[np.asarray(rng.permutation(len(dropped)))[:missing]]] = True
    kept_idx, fill_idx = np.flatnonzero(mask), np.flatnonzero(~mask)
    k, block = len(kept_idx), n // num_batches
    m = k // num_batches
    offsets = (np.arange(m) * block) // m if m else np.zeros(0, dtype=np.int64)
    free = np.ones(block, dtype=bool)
    free[offsets] = False
    orders = np.empty((inner_epochs, n), dtype=np.int64)
    cur = kept_idx
    for inner in range(inner_epochs):
        cur = cur[np.asarray(rng.permutation(k))] if k else cur  # compounds over inner epochs, as the reference
        fills = iter(fill_idx)
        for b in range(num_batches):
            pos = orders[inner, b * block:(b + 1) * block]
            pos[offsets] = cur[b * m:(b + 1) * m]
            pos[free] = [next(fills) for _ in range(block - m)]
    weights = np.zeros(n, dtype=np.float32)
    if k:
        weights[kept_idx] = np.float32(n / k)
    return TrainPlan(orders, weights, k, num_batches)


PLAN_STREAM = GRPO_PLAN  # the host generator of GRPO's zero-advantage plan (ddpo_tpu/random_streams.py)


class GRPO(GroupAlgorithm):
    ode_sampling = False            # the SDE samples: its steps are the policy's actions
    name = "grpo"
    stat_names: tuple[str, ...] = ("loss", "approx_kl", "clipfrac", "kl")

    def __init__(self, cfg, plan: RunPlan | None = None):
        super().__init__(cfg, plan)
        a = cfg.algorithm
        self.needs_reference = a.kl_beta > 0
        # GRPO-Guard's RatioNorm compares with the sampling policy's step means (the loop keeps its weights)
        self.needs_old_mean = a.ratio_norm
        # flow_grpo trains the first int(T x timestep_fraction) steps in order (the last, least noisy, are left out)
        self.shuffle_timesteps = False
        self.adaptive = (AdaptiveReference(a.reference_reset_kl, a.reference_reset_every)
                         if a.reference_reset_kl is not None else None)
        # GARDO's gated KL (kl_gate_rewards) and diversity-aware advantages (diversity_features): guards.py
        self.gate = UncertaintyGate(a.kl_gate_share) if a.kl_gate_rewards else None
        self.diversity = a.diversity_features is not None

    def advantages(self, keys: list[str], rewards: np.ndarray, scores: dict | None = None,
                   components: dict | None = None) -> np.ndarray:
        """scores: what image_scores gave these samples (GARDO's features); components: reward=weighted's unweighted
        components (algorithm.advantage_aggregation=gdpo)."""
        if self.diversity:
            assert scores is not None  # image_scores gave the features: GARDO's diversity scores every image
            return diversity_advantages(rewards, keys, scores["features"])
        return super().advantages(keys, rewards, scores, components)

    def image_scores(self, ctx) -> ImageScores | None:
        """What GARDO scores per image besides the reward (its auxiliary rewards, its features), or None."""
        if self.gate is None and not self.diversity:
            return None
        return ImageScores(self.cfg.algorithm, self.cfg.model.cache_dir, ctx.rt.device)

    def kl_gate(self, rewards: np.ndarray, scores: dict | None) -> np.ndarray | None:
        """(N,) 1 where a sample carries the KL (GARDO's gate over the epoch), None: every sample. Samples with a
        non-finite reward or auxiliary score are neither ranked nor gated."""
        if self.gate is None:
            return None
        assert scores is not None  # image_scores scores the auxiliary rewards whenever the gate is on
        aux = scores["kl_gate_rewards"]
        ok = np.isfinite(rewards) & np.isfinite(aux).all(axis=1)
        gate = np.zeros(len(rewards), dtype=np.float32)
        if ok.any():
            gate[ok] = self.gate(rank_uncertainty(rewards[ok], aux[ok]))
        # the reference logs the share as kl_perc
        self.epoch_metrics.update({"kl_gate_share": self.gate.share, "kl_gated": float(gate.mean())})
        return gate

    def train_plan(self, epoch: int, advantages: np.ndarray, keys: list[str], rewards: np.ndarray) -> TrainPlan | None:
        """flow_grpo's zero-advantage filter as an order and loss weights (algorithm.drop_zero_advantage), from a
        host generator of (seed, epoch); the epoch's kept fraction and share of zero-std groups for its metrics."""
        cfg = self.cfg
        self.note_zero_std(keys, rewards)
        if self.adaptive is not None and self.adaptive.due(epoch):  # after sampling, as train_sd3_gardo.py resets
            self.epoch_metrics["reference_reset"] = 1
        if not cfg.algorithm.drop_zero_advantage:
            return None
        # the optimizer steps of an inner epoch are the run plan's (validation decided the batches and the window);
        # the sampling batches and inner epochs are the user's own keys
        rng = np.random.default_rng([cfg.seed, epoch, PLAN_STREAM])
        plan = zero_advantage_plan(advantages, cfg.sample.num_batches_per_epoch, self.plan.updates_per_inner_epoch,
                                   cfg.train.num_inner_epochs, rng)
        self.epoch_metrics.update(plan.metrics)
        return plan

    def loss(self, score: StepScore, old_log_prob: Tensor, advantages: Tensor,
             reference_mean: Tensor | None = None, weights: Tensor | None = None, old_mean: Tensor | None = None,
             sqrt_dt: Tensor | None = None, steps: Tensor | None = None, kl_gate: Tensor | None = None
             ) -> tuple[Tensor, ...]:
        """old_mean, sqrt_dt, steps (GRPO-Guard's ratio_norm): the sampling policy's step means, each row's sqrt(-dt)
        and schedule step; kl_gate (GARDO): the KL's row weights, 0 on the rows that do not carry it."""
        t = self.cfg.train
        kl = kl_to_reference(score.mean, reference_mean, score.std) if reference_mean is not None else None
        guard = None
        if old_mean is not None:
            # the micro-step passes sqrt_dt and steps with old_mean (GRPO-Guard's needs_old_mean)
            assert sqrt_dt is not None and steps is not None
            guard = lambda w: ratio_norm_loss(score.log_prob, old_log_prob, score.mean, old_mean, score.std, sqrt_dt,
                                              steps, advantages, t.clip_range, t.adv_clip_max, w)
        loss, info = grpo_loss(score.log_prob, old_log_prob, advantages, t.clip_range, t.adv_clip_max, kl,
                               self.cfg.algorithm.kl_beta, weights, guard, kl_gate)
        return loss, info["approx_kl"], info["clipfrac"], info["kl"]

    def reference_policy(self, ctx):
        """The KL's reference context: GARDO's reset copy of the policy, or None (the family's adapter-off model)."""
        return self.adaptive.attach(ctx) if self.adaptive is not None else None

    def after_training(self, epoch: int, steps: list[dict]) -> None:
        if self.adaptive is not None:
            self.adaptive.observe(steps)

    def state_dict(self) -> dict[str, Any]:
        # no history: each epoch's groups stand alone; GARDO's reset schedule (its copy is TrainState.copies') and
        # its gate's share and window
        return {**(self.adaptive.state_dict() if self.adaptive is not None else {}),
                **(self.gate.state_dict() if self.gate is not None else {})}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for part in (self.adaptive, self.gate):
            if part is not None and state:
                part.load_state_dict(state)
