"""Frame consistency: how steady a video is, from the CLIP image features of its frames (a video reward).

VBench's background consistency (Vchitect/VBench@45e79ec, vbench/background_consistency.py:42-56), per video: the
unit-norm CLIP image features f_0 .. f_{F-1} of its frames, and

    score = 1/(F-1) * sum_{i=1}^{F-1} ( max(0, cos(f_{i-1}, f_i)) + max(0, cos(f_0, f_i)) ) / 2

in [0, 1]: 1 for a video whose frames all look alike to CLIP, lower the more each frame departs from the one before
and from the first. VBench scores with CLIP ViT-B/32 (vbench/utils.py:244-252), the default of `reward.clip_model`
here; the frames go through the model's own image processor (VBench's clip_transform(224) is the same resize, crop
and normalisation for ViT-B/32). A consistency reward alone is maximised by a still video: weight it beside a reward
for the content (reward=weighted), as video RL recipes pair motion-quality and content rewards.

Takes uint8 videos (B, F, H, W, 3) (catalog/rewards.py: takes="videos"; a video family passes them unwrapped).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ddpo_tpu.rewards.base import Metadata, Reward, register_reward
from ddpo_tpu.rewards.clip_score import image_features, load_clip


def consistency(features: np.ndarray) -> np.ndarray:
    """(B, F, D) per-frame features -> (B,) VBench's background consistency of each video (F >= 2)."""
    f = np.asarray(features, dtype=np.float64)
    f = f / np.linalg.norm(f, axis=-1, keepdims=True)
    previous = np.maximum(0.0, np.sum(f[:, 1:] * f[:, :-1], axis=-1))  # cos(f_{i-1}, f_i), i = 1..F-1
    first = np.maximum(0.0, np.sum(f[:, 1:] * f[:, :1], axis=-1))      # cos(f_0, f_i)
    return ((previous + first) / 2).mean(axis=1)


@register_reward("frame_consistency")
class FrameConsistencyReward(Reward):
    name = "frame_consistency"

    def __init__(self, clip_model: str, batch_size: int | None = None, local_files_only: bool = True,
                 device: Any = "cpu"):
        self.processor, _, self.model, self.device = load_clip(self.name, clip_model, local_files_only, device)
        self.batch_size = batch_size

    def __call__(self, videos: np.ndarray, prompts: list[str], metadata: Metadata = None) -> np.ndarray:
        import torch

        videos = np.asarray(videos)
        if videos.dtype != np.uint8 or videos.ndim != 5 or videos.shape[-1] != 3 or videos.shape[1] < 2:
            raise self._error(f"expected uint8 videos (B, F, H, W, 3) of at least 2 frames, got {videos.dtype} "
                              f"{videos.shape}")
        if len(prompts) != len(videos):
            raise self._error(f"got {len(videos)} videos but {len(prompts)} prompts")
        b, f = videos.shape[:2]
        frames = videos.reshape(b * f, *videos.shape[2:])
        step = self.batch_size or len(frames)
        with torch.no_grad():
            feats = [image_features(self.processor, self.model, frames[i:i + step], self.device).float().cpu()
                     for i in range(0, len(frames), step)]
        return consistency(torch.cat(feats).numpy().reshape(b, f, -1)).astype(np.float32)
