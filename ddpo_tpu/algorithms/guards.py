"""Guards against reward over-optimisation that GRPO takes as options, GARDO's three (yifan123/flow_grpo@94e23ee5):
its adaptive KL reference, its uncertainty-gated KL and its diversity-aware advantages (GRPO-Guard's RatioNorm is a
loss, ratio_norm_loss in grpo.py). Line numbers: that commit's text as the store serves it, scripts/train_sd3_gardo.py
(gardo:N) and flow_grpo/stat_tracking.py (stat_tracking:N)."""

from __future__ import annotations

from typing import Any

import numpy as np


class AdaptiveReference:
    """GARDO's adaptive KL reference (yifan123/flow_grpo@94e23ee5405ab7241fc1f75d30cac8147e2b1f53,
    scripts/train_sd3_gardo.py; the copy at gardo:462-468 and 636-640, the reset at gardo:787-797, the flag at 1041):
    an "old" copy of the trained weights, equal to them at the start (the copy loop before `while True`), that the
    KL compares with (`transformer.module.set_adapter("old")` around the reference's compute_log_prob) in place of
    the adapter-off base model; reset to the current weights after an epoch's sampling (`if (epoch !=0 and
    reset==True) or (epoch - prev_epoch)>config.reset_freq`) when an update of the previous epoch logged a KL above
    `threshold` (`if info["kl_loss"] > thres: reset=True`, config.kl_thres) or more than `every` epochs passed since
    the last reset (config.reset_freq). Only with a KL term (`if config.train.beta>0`)."""

    NAME = "gardo_reference"   # its name in TrainState.copies (checkpointed with the optimizer)

    def __init__(self, threshold: float, every: int):
        self.threshold, self.every = threshold, every
        self.flagged, self.last = False, 0
        self.copy = None

    def attach(self, ctx):
        """The copy, registered in the training state (ctx: the run's EpochContext); its swapped_in context."""
        from ddpo_tpu.training.state import EMA

        self.copy = ctx.state.copies.setdefault(self.NAME, EMA(ctx.state.params, 0.0, 1, ctx.rt))
        return self.copy.swapped_in

    def observe(self, steps: list[dict]) -> None:
        """After an epoch's training: any update's KL over the threshold flags a reset (gardo:1041)."""
        self.flagged = self.flagged or any(s.get("kl", 0.0) > self.threshold for s in steps)

    def due(self, epoch: int) -> bool:
        """After sampling epoch `epoch`: reset the copy now? (gardo:788: (epoch != 0 and reset) or epoch - prev_epoch
        > reset_freq)"""
        if not ((epoch != 0 and self.flagged) or epoch - self.last > self.every):
            return False
        if self.copy is not None:
            self.copy.reset()
        self.flagged, self.last = False, epoch
        return True

    def state_dict(self) -> dict[str, Any]:
        return {"gardo_flagged": self.flagged, "gardo_last_reset": self.last}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.flagged, self.last = bool(state["gardo_flagged"]), int(state["gardo_last_reset"])


__all__ = ["AdaptiveReference", "ImageScores", "UncertaintyGate", "diversity_advantages", "rank_uncertainty"]


# --- GARDO's uncertainty-gated KL and diversity-aware advantages ------------------------------------------------------

SHARE_MIN, SHARE_MAX, SHARE_STEP, SHARE_WINDOW = 0.02, 0.2, 0.1, 20  # RiskCompensator's fixed values (gardo:219-225)


def rank_uncertainty(main: np.ndarray, aux: np.ndarray) -> np.ndarray:
    """Each sample's rank under the trained reward minus the mean of its ranks under the auxiliary rewards
    (gardo:826-833): ranks over the whole epoch, 1 = the highest score; `main` (N,), `aux` (N, M). Positive: the
    trained reward ranks the sample behind where the auxiliary rewards put it. Ties keep the samples' order (a stable
    sort; the reference's torch.sort leaves it unspecified)."""
    def ranks(scores):
        order = np.argsort(-np.asarray(scores, dtype=np.float64), kind="stable")
        r = np.empty(len(order), dtype=np.float32)
        r[order] = np.arange(1, len(order) + 1)
        return r

    aux = np.asarray(aux).reshape(len(main), -1)
    return ranks(main) - np.mean([ranks(aux[:, j]) for j in range(aux.shape[1])], axis=0, dtype=np.float32)


class UncertaintyGate:
    """Which samples carry the KL (gardo:834-836): the non-negative uncertainties' mean adapts the gated share
    (RiskCompensator.update, gardo:226-237: the first epoch takes `base`; a mean above every one of the last 20 epochs'
    grows it by 10 %, below every one shrinks it by 10 %; kept within [0.02, 0.2]), and a sample is gated when its
    uncertainty is above the (100 - 100 share)th percentile of the non-negative ones (numpy's linear percentile)."""

    def __init__(self, base: float):
        self.base, self.share = base, base
        self.window: list[float] = []

    def __call__(self, uncertainty: np.ndarray) -> np.ndarray:
        u = np.asarray(uncertainty)
        nonneg = u[u >= 0]  # never empty: the uncertainties of an epoch sum to 0
        level = np.mean(nonneg)
        if not self.window:
            self.share = self.base
        elif level > max(self.window):
            self.share *= 1 + SHARE_STEP
        elif level < min(self.window):
            self.share *= 1 - SHARE_STEP
        self.share = float(np.clip(self.share, SHARE_MIN, SHARE_MAX))
        self.window = [*self.window, level][-SHARE_WINDOW:]
        return u > np.percentile(nonneg, 100 - self.share * 100)

    def state_dict(self) -> dict[str, Any]:
        return {"gardo_gate_share": self.share, "gardo_gate_window": [float(x) for x in self.window]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "gardo_gate_share" in state:  # a checkpoint of a run without the gate: it starts afresh
            self.share, self.window = float(state["gardo_gate_share"]), [float(x) for x in state["gardo_gate_window"]]


def diversity_advantages(rewards: np.ndarray, keys, features: np.ndarray) -> np.ndarray:
    """GARDO's advantages (stat_tracking:11-50, type='gardo'): per group (prompt key), r - mean, times, for samples at
    or above the mean, the cosine distance of its unit-norm features to the nearest other sample of the group over the
    group's mean of those distances (below the mean: times 1); no division by a std. Where every distance of a group
    is 0 (identical images) the reference divides 0 by 0; the scale is 1 here. float64 maths, float32 out."""
    r = np.asarray(rewards, dtype=np.float64)
    f = np.nan_to_num(np.asarray(features, dtype=np.float64))  # the reference's np.nan_to_num of its features
    f = f / np.maximum(np.linalg.norm(f, axis=1, keepdims=True), 1e-12)  # an all-zero row: 0, not 0 / 0
    keys = np.asarray(keys, dtype=object)
    adv = np.zeros_like(r)
    for key in set(keys.tolist()):
        rows = np.flatnonzero(keys == key)
        g, d = r[rows], 1 - np.clip(f[rows] @ f[rows].T, -1, 1)
        np.fill_diagonal(d, np.inf)
        nearest = d.min(axis=1)
        scale = nearest / nearest.mean() if nearest.mean() > 0 else np.ones_like(nearest)
        centred = g - g.mean()
        adv[rows] = centred * np.where(centred < 0, 1.0, scale)
    return adv.astype(np.float32)


class ImageScores:
    """What GARDO scores besides the trained reward, per image on the host: the auxiliary rewards (N, M) and the
    feature model's features (N, D), each a reward-registry entry built as a reward is (rewards/from_config.py:
    `tiny` stand-ins, a CUDA device). Image families only (a video family is refused at compose time)."""

    def __init__(self, algorithm_cfg, cache_dir: str, device):
        from ddpo_tpu.rewards.from_config import reward_from_config

        build = lambda entry: reward_from_config(entry, model_cache_dir=cache_dir, device=device)
        self.aux = [build(e) for e in algorithm_cfg.kl_gate_rewards]
        f = algorithm_cfg.diversity_features
        self.features = build(f) if f is not None else None

    def __call__(self, images: np.ndarray, prompts: list[str]) -> dict[str, np.ndarray]:
        out = {}
        if self.aux:
            out["kl_gate_rewards"] = np.stack([np.asarray(r(images, prompts), dtype=np.float64) for r in self.aux], 1)
        if self.features is not None:
            out["features"] = np.asarray(self.features(images, prompts), dtype=np.float32)
        return out
