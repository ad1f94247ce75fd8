"""What the group algorithms share (Flow-GRPO, DiffusionNFT, AWM): flow_grpo's prompt groups, group-relative
advantages (or GDPO's per-reward ones), and the share of groups without signal. GroupAlgorithm is their common base;
each adds its own loss or epoch trainer."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ddpo_tpu.algorithms.base import Algorithm
from ddpo_tpu.algorithms.multi_reward import group_or_gdpo
# the share of zero-std groups is a reported statistic (training/reporting.py, which DDPO's report also uses)
from ddpo_tpu.training.reporting import zero_std_ratio  # noqa: F401 (re-exported)

__all__ = ["GROUP_STD_EPS", "GroupAlgorithm", "group_advantages", "zero_std_ratio"]

GROUP_STD_EPS = 1e-4  # flow_grpo's PerPromptStatTracker: std + 1e-4


def group_advantages(
    rewards: np.ndarray | Sequence[float],
    group_ids: np.ndarray | Sequence,
    eps: float = GROUP_STD_EPS,
    clip: float | None = None,
    global_std: bool = False,
) -> np.ndarray:
    """Group-relative advantages: ``(r - mean_g) / (std_g + eps)`` per group ``g`` (e.g. the prompt).

    ``rewards`` is (B,) or (B, ...) (the reference repeats each reward over the trained timesteps: (B, T)); statistics
    are over the samples of a group along axis 0, in float64, ``std`` the population std. ``group_ids`` (B,) are
    hashable labels (prompts or ints). ``global_std=True`` divides by the std of all rewards instead.
    ``clip`` clamps the result to ``[-clip, clip]``. Returns float32, the shape of ``rewards``.
    """
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim < 1:
        raise ValueError(f"rewards must have a batch axis, got shape {r.shape}")
    groups = np.asarray(group_ids)
    if groups.ndim != 1 or groups.shape[0] != r.shape[0]:
        raise ValueError(f"group_ids must be 1-D with one label per reward ({r.shape[0]}), got shape {groups.shape}")
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    adv = np.zeros_like(r)
    if r.shape[0] == 0:
        return adv.astype(np.float32)
    _, inverse = np.unique(groups, return_inverse=True)
    inverse = inverse.reshape(-1)
    all_std = np.std(r, axis=0, keepdims=True)
    for g in range(int(inverse.max()) + 1):
        mask = inverse == g
        group = r[mask]
        mean = np.mean(group, axis=0, keepdims=True)
        std = all_std if global_std else np.std(group, axis=0, keepdims=True)
        adv[mask] = (group - mean) / (std + eps)
    if clip is not None:
        adv = np.clip(adv, -clip, clip)
    return adv.astype(np.float32)


class GroupAlgorithm(Algorithm):
    """Prompts in groups of algorithm.group_size, advantages relative to the group (flow_grpo's stat tracker, cleared
    every epoch), groups keyed as flow_grpo keys them."""

    # flow_grpo keys groups by tokenizers[0]'s decoding of the prompt ids padded/truncated to 256 tokens
    key_tokens = 256

    def epoch_prompts(self, source, batches: int, batch_size: int, rng: np.random.Generator) -> list[list[str]]:
        """flow_grpo's DistributedKRepeatSampler, batch by batch: batch_size / group_size distinct prompts, each
        repeated group_size times, shuffled over the batch (and so over the replicas, which take contiguous slices
        of it). Every group lies inside one sampling batch; batches draw independently (a prompt drawn again in
        another batch joins its group, as the reference's per-epoch stat tracker merges it)."""
        g = self.cfg.algorithm.group_size
        if batch_size % g:
            raise ValueError(f"algorithm.group_size={g} does not divide the sampling batch of {batch_size}")
        out = []
        for _ in range(batches):
            distinct = source.sample_distinct(batch_size // g, rng)
            order = rng.permutation(batch_size)
            out.append([distinct[i // g] for i in order])
        return out

    def advantages(self, keys: list[str], rewards: np.ndarray, scores: dict | None = None,
                   components: dict | None = None) -> np.ndarray:
        """components: reward=weighted's unweighted components (algorithm.advantage_aggregation=gdpo)."""
        return group_or_gdpo(self.cfg, keys, rewards, components, group_advantages)

    def note_zero_std(self, keys: list[str], rewards: np.ndarray) -> None:
        """The epoch's share of groups whose finite rewards all equal (flow_grpo's zero_std_ratio), as its metric."""
        finite = np.isfinite(rewards)
        self.epoch_metrics = {"zero_std_ratio": zero_std_ratio(rewards[finite], [k for k, f in zip(keys, finite) if f])}
