"""Advantages of a multi-reward run (reward=weighted) when each reward is normalised on its own: GDPO.

GRPO's default (``group_advantages`` on the weighted sum) lets the reward with the widest spread decide the ranking
inside a group: a reward whose values differ by 10 within a group drowns one whose values differ by 0.01, whatever
their weights say. GDPO, as X-GenGroup/Flow-Factory@a0b2bc5 computes it
(src/flow_factory/advantage/advantage_processor.py ``compute_gdpo``), normalises each reward inside each group first:

    adv_k[i]   = weight_k * (r_k[i] - mean_g(r_k)) / max(std_g(r_k), 1e-6)     (g: the prompt group of sample i)
    combined   = sum_k adv_k
    advantage  = (combined - mean(combined)) / max(std(combined), 1e-6)        (over the whole epoch's samples)

``std`` is the population std (numpy's default, ddof 0), statistics in float64. The floor is a ``max``, not the
``+ 1e-4`` of flow_grpo's tracker: a group of equal values gives 0 for that reward, not a division by ~0.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from ddpo_tpu.rewards.weighted import component_keys, component_weights  # noqa: F401 (re-exported)

__all__ = ["GDPO_STD_FLOOR", "AGGREGATIONS", "gdpo_advantages", "component_weights", "group_or_gdpo"]

GDPO_STD_FLOOR = 1e-6  # Flow-Factory's max(std, 1e-6), per group and for the batch normalisation
AGGREGATIONS = ("sum", "gdpo")  # sum: GRPO on the weighted sum (flow_grpo, DiffusionNFT); gdpo: per-reward first


def gdpo_advantages(components: Mapping[str, np.ndarray | Sequence[float]], weights: Mapping[str, float],
                    group_ids: Sequence) -> np.ndarray:
    """GDPO advantages (float32, (B,)) from each reward's unweighted values (name -> (B,)), the rewards' weights and
    each sample's group label (its prompt). Every component needs a weight and the same length as `group_ids`."""
    if not components:
        raise ValueError("GDPO needs at least one reward's values")
    missing = sorted(set(components) - set(weights))
    if missing:
        raise ValueError(f"no weight for reward(s) {missing}")
    groups = np.asarray(group_ids)
    n = groups.shape[0]
    _, inverse = np.unique(groups, return_inverse=True) if n else (None, np.zeros(0, dtype=np.int64))
    inverse = np.asarray(inverse).reshape(-1)
    combined = np.zeros(n, dtype=np.float64)
    for name, values in components.items():
        r = np.asarray(values, dtype=np.float64)
        if r.shape != (n,):
            raise ValueError(f"reward {name!r}: {r.shape} values for {n} samples")
        adv = np.zeros(n, dtype=np.float64)
        for g in range(int(inverse.max()) + 1 if n else 0):
            mask = inverse == g
            group = r[mask]
            adv[mask] = (group - group.mean()) / max(float(group.std()), GDPO_STD_FLOOR)
        combined += float(weights[name]) * adv
    if n == 0:
        return combined.astype(np.float32)
    out = (combined - combined.mean()) / max(float(combined.std()), GDPO_STD_FLOOR)
    # a group whose every reward is constant has no signal (combined exactly 0); the batch mean is 0 up to rounding,
    # so Flow-Factory's value there is ~1e-17: kept an exact 0, as GRPO's is, so drop_zero_advantage drops the group
    out[combined == 0] = 0.0
    return out.astype(np.float32)


def group_or_gdpo(cfg, keys: Sequence, rewards: np.ndarray, components: Mapping[str, np.ndarray] | None,
                  group_advantages) -> np.ndarray:
    """The group algorithms' advantages (GRPO, NFT, AWM): GDPO on the components when
    algorithm.advantage_aggregation=gdpo (compose time made sure the reward is weighted), else `group_advantages`
    (GRPO's, on the weighted sum)."""
    if getattr(cfg.algorithm, "advantage_aggregation", "sum") == "gdpo":
        weights = component_weights(cfg.reward)
        return gdpo_advantages({k: components[k] for k in weights}, weights, keys)
    return group_advantages(rewards, keys, global_std=cfg.algorithm.global_std)
