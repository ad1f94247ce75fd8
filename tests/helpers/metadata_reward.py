"""A test-only reward that records what the loop hands it (prompts and metadata, call by call) and reports extras:
one that applies to every image, one only to GenEval's counting rows (NaN elsewhere), one to no image. The loop's
tests swap it in for the run's reward (Trainer.reward) to prove each image reaches the reward with its own prompt's
metadata and each extra's epoch mean reaches metrics.jsonl."""

from __future__ import annotations

import threading

import numpy as np

from ddpo_tpu.rewards.base import Reward, RewardScores


class MetadataRecorder(Reward):
    name = "metadata_recorder"

    def __init__(self) -> None:
        self.calls: list[tuple[list[str], list | None, np.ndarray]] = []  # (prompts, metadata, values) per call
        self._lock = threading.Lock()  # the loop scores in a thread pool (reward.host_workers)

    def __call__(self, images: np.ndarray, prompts: list[str], metadata=None) -> np.ndarray:
        return self.score(images, prompts, metadata).values

    def score(self, images: np.ndarray, prompts: list[str], metadata=None) -> RewardScores:
        images = self._check_host_images(images, prompts)
        values = (images.astype(np.float64).mean(axis=(1, 2, 3)) / 255.0).astype(np.float32)
        counting = np.array([(m or {}).get("tag") == "counting" for m in (metadata or [{}] * len(prompts))])
        with self._lock:
            self.calls.append((list(prompts), metadata, values.copy()))
        return RewardScores(values, {"brightness": values * 2.0,
                                     "counting_brightness": np.where(counting, values, np.nan),
                                     "never": np.full(len(values), np.nan)})
