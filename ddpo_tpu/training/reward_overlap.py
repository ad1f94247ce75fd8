"""Rewards off the critical path: what each epoch's reward calls cost, how much of it sampling hid, and (on CUDA) a
stream of its own for each scoring thread.

With `reward.host_workers` > 0 the loop (training/loop.py `Trainer._score`) submits each sampling batch's images to a
thread pool, scored while the next batch samples, and waits for the results in the epoch's "reward" phase; with 0 each
batch is scored inline on the main thread, between two batches. The "reward" phase's wall seconds alone cannot tell
the two apart (inline scoring lands in "sampling"), so the phase's record (metrics.jsonl and the epoch_done event)
gains:

  scored_seconds  the reward calls' own wall seconds, summed over the epoch's batches (each call timed in the thread
                  that ran it: a pool thread, or the main thread inline)
  hidden_seconds  scored_seconds minus the seconds the loop waited for the pool's results in the reward phase, floored
                  at 0: the scoring that ran while sampling went on. 0 for inline scoring, which holds the main thread

Both are thread-seconds: with several workers scoring at once they may add up to more than the epoch's wall time. On a
host CPU the pool thread competes with sampling for the same cores, so hidden seconds are not free seconds there: the
epoch's wall time says what the overlap bought (docs/performance.md "Rewards off the critical path").

CUDA (the run's device is a CUDA device; torch rewards run on it, rewards/from_config.py): each pool thread scores on a
torch.cuda.Stream of its own, made lazily in that thread, so its kernels can run beside the sampling step's on the
default stream instead of queueing behind them in one stream. The new stream waits for nothing: the reward's inputs
are host uint8 arrays, so nothing it reads comes from the sampling stream, and whatever the reward put on the device
when it was built (on the default stream) was done before its first call was submitted (each batch's images reach the
host through a copy that synchronizes the default stream). The stream is synchronized before the call returns its
values to the host. Inline scoring, the CPU and XLA are unchanged. Unmeasured on a GPU (none was available when this
was written).
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Callable


class RewardTiming:
    """The epoch's reward calls, timed (`timed`), the loop's wait for them (`waiting`), and the phase record's fields
    (`take`, which starts the next epoch's count). `device`: the run's device (a torch.device, or None); `pooled`:
    whether the calls run in a pool (reward.host_workers > 0)."""

    def __init__(self, device: Any = None, pooled: bool = False):
        self.pooled = pooled
        self.cuda_device = device if getattr(device, "type", None) == "cuda" else None
        self._lock = threading.Lock()
        self._local = threading.local()  # each pool thread's CUDA stream
        self.scored = 0.0
        self.waited = 0.0

    def timed(self, fn: Callable) -> Callable:
        """`fn` (a reward call) that adds its own wall seconds to the epoch's, on its thread's stream when pooled on
        CUDA."""
        def call(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                with self._stream() as stream:
                    out = fn(*args, **kwargs)
                    if stream is not None:  # the values are the host's from here on
                        stream.synchronize()
                return out
            finally:
                with self._lock:
                    self.scored += time.perf_counter() - t0

        return call

    @contextlib.contextmanager
    def _stream(self):
        """The calling pool thread's own CUDA stream, current for the call (None: no stream change)."""
        if not self.pooled or self.cuda_device is None:
            yield None
            return
        import torch

        stream = getattr(self._local, "stream", None)
        if stream is None:
            stream = self._local.stream = torch.cuda.Stream(device=self.cuda_device)
        with torch.cuda.stream(stream):
            yield stream

    @contextlib.contextmanager
    def waiting(self):
        """Around the loop's wait for the pool's results: the seconds not hidden."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.waited += time.perf_counter() - t0

    def take(self) -> dict[str, float]:
        """The epoch's {"scored_seconds", "hidden_seconds"} (the reward phase's extra fields); counts from zero
        again."""
        with self._lock:
            scored, waited, self.scored, self.waited = self.scored, self.waited, 0.0, 0.0
        hidden = max(scored - waited, 0.0) if self.pooled else 0.0
        return {"scored_seconds": round(scored, 4), "hidden_seconds": round(hidden, 4)}
