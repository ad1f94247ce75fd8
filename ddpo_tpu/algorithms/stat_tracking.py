"""Advantage computation for DDPO: per-prompt reward normalisation.

Semantics follow the DDPO reference (kvablack/ddpo-pytorch):

* ``PerPromptStatTracker.update``: for each unique prompt in the batch, the
  batch's rewards for that prompt are appended to a bounded FIFO buffer
  (``deque(maxlen=buffer_size)``, oldest dropped).  If the buffer then holds
  fewer than ``min_count`` rewards the prompt is normalised with the mean/std
  of the *whole batch* (all prompts); otherwise with the buffer's mean/std.
  ``advantage = (r - mean) / (std + 1e-6)``, std being the population std
  (ddof=0).
* ``global_advantages`` (per-prompt tracking off):
  ``(r - mean) / (std + 1e-8)`` over the whole batch.

Precision: the reference's JPEG rewards are float64 (``np.array`` of Python
floats) and stay float64 through its gather, so its statistics are float64.
We compute statistics in float64 whatever the input dtype and return float32
advantages.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Sequence

import numpy as np

__all__ = ["PerPromptStatTracker", "global_advantages", "clip_advantages"]

PER_PROMPT_EPS = 1e-6
GLOBAL_EPS = 1e-8


def _as_rewards(rewards: Any) -> np.ndarray:
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 1:
        raise ValueError(f"rewards must be 1-D (B,), got shape {r.shape}")
    return r


class PerPromptStatTracker:
    """Per-prompt running reward statistics (bounded buffer per prompt)."""

    def __init__(self, buffer_size: int, min_count: int):
        buffer_size = int(buffer_size)
        min_count = int(min_count)
        if buffer_size < 1:
            raise ValueError(f"buffer_size must be >= 1, got {buffer_size}")
        if min_count < 0:
            raise ValueError(f"min_count must be >= 0, got {min_count}")
        # Note: with min_count > buffer_size a buffer can never reach min_count,
        # so every prompt is always normalised with batch statistics (as in the
        # reference).
        self.buffer_size = buffer_size
        self.min_count = min_count
        self.stats: dict[str, deque[float]] = {}
        self.raw_keys = False  # restored from a checkpoint keyed by raw text: rekey() before the next update

    def _buffer(self, prompt: str) -> deque[float]:
        buf = self.stats.get(prompt)
        if buf is None:
            buf = self.stats[prompt] = deque(maxlen=self.buffer_size)
        return buf

    def update(self, prompts: Sequence[str] | np.ndarray, rewards: np.ndarray) -> np.ndarray:
        """Add this batch's rewards to the buffers and return float32 advantages."""
        r = _as_rewards(rewards)
        # Keys are plain str; comparing as an object array works for any str.
        p = np.array([str(x) for x in np.asarray(prompts, dtype=object).reshape(-1)], dtype=object)
        if p.shape[0] != r.shape[0]:
            raise ValueError(f"got {p.shape[0]} prompts but {r.shape[0]} rewards")
        advantages = np.zeros_like(r)
        if r.size == 0:
            return advantages.astype(np.float32)

        batch_mean = np.mean(r)
        batch_std = np.std(r)
        for prompt in sorted(set(p.tolist())):
            mask = p == prompt
            prompt_rewards = r[mask]
            buf = self._buffer(prompt)
            buf.extend(float(x) for x in prompt_rewards)
            if len(buf) < self.min_count:
                mean, std = batch_mean, batch_std
            else:
                values = np.fromiter(buf, dtype=np.float64, count=len(buf))
                mean, std = np.mean(values), np.std(values)
            advantages[mask] = (prompt_rewards - mean) / (std + PER_PROMPT_EPS)
        return advantages.astype(np.float32)

    def get_stats(self) -> dict[str, dict[str, float | int]]:
        """Per prompt: {"mean", "std", "count"} of its buffer (Python scalars)."""
        out = {}
        for prompt, buf in self.stats.items():
            values = np.fromiter(buf, dtype=np.float64, count=len(buf))
            out[prompt] = {
                "mean": float(np.mean(values)) if len(values) else float("nan"),
                "std": float(np.std(values)) if len(values) else float("nan"),
                "count": len(values),
            }
        return out

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state (buffers as lists of Python floats, oldest first)."""
        return {
            "buffer_size": self.buffer_size,
            "min_count": self.min_count,
            "keys": "raw" if self.raw_keys else "tokenizer",  # what the stats are keyed by
            "stats": {prompt: [float(x) for x in buf] for prompt, buf in self.stats.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore buffers from ``state_dict()`` output.

        The tracker keeps its own ``buffer_size``/``min_count`` (the current
        config wins); if the saved buffers are longer than ``buffer_size``
        only their newest entries are kept, as the deque would.
        """
        if "stats" not in state:
            raise ValueError("stat tracker state has no 'stats' entry")
        stats: dict[str, deque[float]] = {}
        for prompt, values in state["stats"].items():
            stats[str(prompt)] = deque((float(v) for v in values), maxlen=self.buffer_size)
        self.stats = stats
        # checkpoints written before the tokenizer's keys have no "keys" entry: their keys are the raw prompt text
        self.raw_keys = state.get("keys", "raw") != "tokenizer"

    def rekey(self, key_of) -> None:
        """Raw-text keys (an older checkpoint) to the tokenizer's: key_of maps a list of texts to their keys.
        Texts that share a key share a buffer: their rewards in the order of the texts, the newest kept."""
        if not self.raw_keys:
            return
        texts = sorted(self.stats)
        merged: dict[str, deque[float]] = {}
        for text, key in zip(texts, key_of(texts) if texts else []):
            merged.setdefault(key, deque(maxlen=self.buffer_size)).extend(self.stats[text])
        self.stats, self.raw_keys = merged, False

    def __len__(self) -> int:
        return len(self.stats)


def global_advantages(rewards: np.ndarray) -> np.ndarray:
    """Whole-batch normalisation ``(r - mean) / (std + 1e-8)`` (float64 maths, float32 out)."""
    r = _as_rewards(rewards)
    if r.size == 0:
        return r.astype(np.float32)
    return ((r - r.mean()) / (r.std() + GLOBAL_EPS)).astype(np.float32)


def clip_advantages(adv: Any, adv_clip_max: float) -> np.ndarray:
    """Clip advantages to ``[-adv_clip_max, adv_clip_max]`` (float32 out)."""
    adv_clip_max = float(adv_clip_max)
    if not adv_clip_max >= 0:
        raise ValueError(f"adv_clip_max must be >= 0, got {adv_clip_max}")
    a = np.asarray(adv, dtype=np.float32)
    return np.clip(a, np.float32(-adv_clip_max), np.float32(adv_clip_max))
