"""Every random stream of a run, numbered in one place. All randomness comes from host generators seeded by the run's
seed and a stream number (and the epoch, a batch, ...), so every backend sees the same prompts, noise and shuffles for
the same seed and a run restarted at an epoch boundary continues identically. The numbers are part of the run's
reproducibility: changing one changes every run that draws from it.

  stream  seeded by                                   draws
  0       (seed, epoch, 0)                            the epoch's prompts (training/loop.py)
  1       (seed, epoch, 1)                            initial latents and per-step noise (training/loop.py)
  2       (seed, epoch, 2, inner[, rank])             shuffles; NFT's and AWM's training times and noise
  3       (seed, epoch, 3)                            GRPO's zero-advantage plan (numpy default_rng)
  3       (seed, 3, prompt key, image index)          an evaluation image's noise (another layout: no epoch)
  4       (seed, epoch, 4, sampling batch)            a random SDE window's start (numpy default_rng)
"""

from __future__ import annotations

import numpy as np

PROMPTS, NOISE, SHUFFLE = 0, 1, 2
GRPO_PLAN = 3
EVALUATION = 3
SDE_WINDOW = 4


def stream_seed(seed: int, epoch: int, stream: int, sub: int = 0, *more: int) -> int:
    """A 63-bit torch generator seed for (seed, epoch, stream, sub, *more)."""
    return int(np.random.SeedSequence([seed, epoch, stream, sub, *more]).generate_state(1, dtype=np.uint64)[0] >> 1)


__all__ = ["EVALUATION", "GRPO_PLAN", "NOISE", "PROMPTS", "SDE_WINDOW", "SHUFFLE", "stream_seed"]
