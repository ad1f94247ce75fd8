"""Honest progress while XLA compiles: the first pass of a training process through each stage of an epoch compiles
its graphs (minutes at Stable Diffusion scale) with nothing else to report. A stage is announced (`compile_start`),
a thread reports the elapsed time and the graphs compiled so far every `every` seconds (`compile_progress`: XLA
compiles without holding Python's GIL, so the thread runs while the main thread waits), and its end says how many
graphs it compiled in how long (`compile_end`). The counts are the runtime's counters (torch_xla's UncachedCompile and
CompileTime metrics, read in runtime/xla.py only).

A stage is the whole first pass through it (the sampling phase: the denoising step and the decode; the training
phase: the micro-step's forward and backward and the update), so its time includes running what was compiled; its
`compile_end` gives both. Later passes replay the compiled graphs and are not watched.
"""

from __future__ import annotations

import contextlib
import threading
import time

from ddpo_tpu.rundir import events as ev

COMPILE_STAGES = ("sampling", "training")  # the phases whose first pass compiles graphs, in the order they run
PROGRESS_EVERY_S = 30.0


class CompileWatch:
    def __init__(self, counters, every: float = PROGRESS_EVERY_S):
        self.counters = counters  # () -> Counters, cumulative
        self.every = every
        self.seen: set[str] = set()

    @contextlib.contextmanager
    def stage(self, name: str, epoch: int, events: ev.EventLog):
        """Watch the first pass through stage `name`; later passes (and other names) run unwatched."""
        if name not in COMPILE_STAGES or name in self.seen:
            yield
            return
        self.seen.add(name)
        start = ev.CompileStart(epoch, name, COMPILE_STAGES.index(name) + 1, len(COMPILE_STAGES))
        c0, t0 = self.counters(), time.monotonic()

        def now(kind: type[ev.CompileProgress]) -> ev.CompileProgress:
            d = self.counters().minus(c0)
            return kind(start.epoch, start.stage, start.index, start.of, round(time.monotonic() - t0, 1),
                        d.compilations + d.replicate_compilations, round(d.compile_time_s, 2))

        stop = threading.Event()

        def report() -> None:
            while not stop.wait(self.every):
                events.emit(now(ev.CompileProgress))

        events.emit(start)
        thread = threading.Thread(target=report, name="ddpo-compile-progress", daemon=True)
        thread.start()
        try:
            yield
        finally:  # an exception (SIGTERM, an error) ends the stage with no compile_end: it did not finish
            stop.set()
            thread.join()
        events.emit(now(ev.CompileEnd))
