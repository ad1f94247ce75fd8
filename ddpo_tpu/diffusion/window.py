"""Where an SDE window stands (sample.sde_window): the denoising steps that are the SDE's (stochastic, with log-probs,
stored and trained) while the others are the ODE's. A pure function of the config, the epoch and the sampling
batch, so every backend and every resumed run places the same windows.

  fixed    [start, start + size) every time
  sliding  MixGRPO (Li et al. 2025): from `start`, `stride` steps further every `shift_every` epochs, back to
           `start` once the next move would pass the range's end
  random   Flow-GRPO-Fast (flow_grpo's train_sd3_fast.py): a start drawn uniformly from [lo, hi - size] for every
           sampling batch, from the run's seed (flow_grpo draws it with Python's random per pipeline call)
"""

from __future__ import annotations

import numpy as np

from ddpo_tpu.random_streams import SDE_WINDOW


def sde_window_at(w, num_steps: int, seed: int, epoch: int, batch: int) -> tuple[int, int] | None:
    """[first, end) of the SDE steps of sampling batch `batch` of `epoch`; None without a window (all SDE)."""
    if w.size is None:
        return None
    lo, hi = w.range if w.range is not None else (0, num_steps)
    positions = hi - lo - w.size + 1  # where a window of `size` can start inside [lo, hi)
    if w.placement == "fixed":
        start = w.start
    elif w.placement == "sliding":
        cycle = (hi - w.size - w.start) // w.stride + 1  # moves from `start` until the next would leave the range
        start = w.start + (epoch // w.shift_every) % cycle * w.stride
    else:
        rng = np.random.default_rng([seed, epoch, SDE_WINDOW, batch])
        start = lo + int(rng.integers(positions))
    return start, start + w.size
