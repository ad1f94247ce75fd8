"""Rewards on videos. A video family (model.family=wan) decodes uint8 videos (B, F, H, W, 3); what each reward takes
is declared in its catalog entry (catalog/rewards.py RewardSpec.takes, checked against FamilySpec.output at compose
time):

* an image reward scores every frame: :class:`PerFrame` scores the B x F frames in one call (each frame with its
  video's prompt) and reduces over frames by the reward's `frame_reduction` key: ``mean`` (flow_grpo's Wan script
  scores whole videos; for an image reward the mean over frames is the plain video score) or ``min`` (the worst
  frame);
* a video reward (frame_consistency) takes the videos as they are.

``for_videos`` applies this to a run's reward, and to each component of reward=weighted (so a weighted sum may mix
per-frame image rewards with video rewards, and its per-component values stay one per video).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ddpo_tpu.catalog.rewards import FRAME_REDUCTIONS as REDUCTIONS
from ddpo_tpu.catalog.rewards import REWARDS
from ddpo_tpu.rewards.base import Metadata, Reward, RewardScores, score_with


class PerFrame(Reward):
    """``reward`` applied to every frame of (B, F, H, W, 3) uint8 videos, reduced over frames by ``reduction``."""

    def __init__(self, reward: Reward, reduction: str = "mean"):
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction given as {reduction!r} must be one of {REDUCTIONS}")
        self.reward, self.reduction = reward, reduction
        self.name = getattr(reward, "name", type(reward).__name__)

    def __getattr__(self, item):  # should_stop, components, ...: the wrapped reward's
        if item == "reward":
            raise AttributeError(item)
        return getattr(self.reward, item)

    def score(self, videos: np.ndarray, prompts: list[str], metadata: Metadata = None) -> RewardScores:
        """Every frame scored with its video's prompt (and metadata); values and extras reduced over the frames."""
        if not isinstance(videos, np.ndarray) or videos.ndim != 5 or videos.shape[-1] != 3:
            raise self._error(f"expected uint8 videos of shape (B, F, H, W, 3), got "
                              f"{getattr(videos, 'shape', type(videos).__name__)}")
        b, f = videos.shape[:2]
        if len(prompts) != b:
            raise self._error(f"got {b} videos but {len(prompts)} prompts")
        frames = np.ascontiguousarray(videos.reshape(b * f, *videos.shape[2:]))
        per_frame = None if metadata is None else [m for m in metadata for _ in range(f)]
        scored = score_with(self.reward, frames, [p for p in prompts for _ in range(f)], per_frame)
        return RewardScores(self._reduce(scored.values, b), {k: self._reduce(v, b) for k, v in scored.extras.items()})

    def _reduce(self, scores, videos: int) -> np.ndarray:
        per_frame = np.asarray(scores, dtype=np.float64).reshape(videos, -1)
        reduced = per_frame.mean(axis=1) if self.reduction == "mean" else per_frame.min(axis=1)
        return reduced.astype(np.float32)

    def __call__(self, videos: np.ndarray, prompts: list[str], metadata: Metadata = None) -> np.ndarray:
        return self.score(videos, prompts, metadata=metadata).values

    def __repr__(self) -> str:
        return f"PerFrame({self.reward!r}, reduction={self.reduction!r})"


def for_videos(reward: Reward, cfg: Any) -> Reward:
    """The run's reward (built from the reward config `cfg`) as it scores a video family's videos."""
    if cfg.name == "weighted":
        reward.components = tuple(_for_videos(r, c) for r, c in zip(reward.components, cfg.components))
        return reward
    return _for_videos(reward, cfg)


def _for_videos(reward: Reward, cfg: Any) -> Reward:
    return reward if REWARDS.get(cfg.name).takes == "videos" else PerFrame(reward, cfg.frame_reduction)

