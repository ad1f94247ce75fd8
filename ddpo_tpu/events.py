"""Progress as typed events: machines read events, people read text.

The training process emits one event per thing that happened (a phase started, a sampling batch is done, a
checkpoint is in place, the run stopped). Each event is appended as one JSON line to `events.jsonl` in the run dir
and rendered as one console line for people. Everything that needs to know where a run stands (ddpo-status, the
front end's live status line, the pod launcher, the tests) reads the events file, never console text, so a console
line can be reworded without breaking anything.

`events.jsonl` is append-only across attempts of a run (a resumed run appends; `run_start` opens each attempt), and
a line cut short by a kill is ignored by `read_events`. metrics.jsonl stays the record of the numbers (one line per
optimizer step, epoch and evaluation, each epoch once); this file is the record of what happened.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

EVENTS_FILE = "events.jsonl"

_KINDS: dict[str, type["Event"]] = {}


@dataclass(frozen=True)
class Event:
    """One thing that happened. Subclasses name themselves (`kind`) and say how a person reads them (`text`)."""

    kind: ClassVar[str] = ""

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        _KINDS[cls.kind] = cls

    def text(self) -> str | None:
        """The console line, or None for events only machines read."""
        return None

    def record(self) -> dict[str, Any]:
        return {"event": self.kind, **dataclasses.asdict(self)}


# --- a run's life ----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RunStart(Event):
    kind: ClassVar[str] = "run_start"
    backend: str
    num_epochs: int
    start_epoch: int
    samples_per_batch: int
    batches_per_epoch: int
    train_timesteps: int
    state: str
    compiles_graphs: bool

    def text(self) -> str:
        line = (f"ddpo_tpu: {self.backend}; {self.num_epochs} epochs of {self.samples_per_batch} x "
                f"{self.batches_per_epoch} samples, {self.train_timesteps} train timesteps; {self.state}")
        if self.compiles_graphs:
            line += (f"\nddpo_tpu: epoch {self.start_epoch} compiles the graphs first (the denoising step, the "
                     f"training micro-step, the update; minutes at Stable Diffusion scale); later epochs reuse them")
        return line


@dataclass(frozen=True)
class Resumed(Event):
    kind: ClassVar[str] = "resumed"
    epoch: int
    global_step: int
    checkpoint: str

    def text(self) -> str:
        return f"ddpo_tpu: resumed from {self.checkpoint} (epoch {self.epoch} done, global step {self.global_step})"


@dataclass(frozen=True)
class CheckpointDamaged(Event):
    kind: ClassVar[str] = "checkpoint_damaged"
    checkpoint: str
    problem: str

    def text(self) -> str:
        return f"ddpo_tpu: warning: {self.problem}; trying the previous checkpoint"


@dataclass(frozen=True)
class AlreadyComplete(Event):
    kind: ClassVar[str] = "already_complete"
    num_epochs: int

    def text(self) -> str:
        return f"ddpo_tpu: run complete (all {self.num_epochs} epochs were done already)"


@dataclass(frozen=True)
class RunComplete(Event):
    kind: ClassVar[str] = "run_complete"
    first_epoch: int | None = None   # the epochs this attempt trained (None: none)
    last_epoch: int | None = None
    num_epochs: int = 0
    minutes: float = 0.0
    reward_first: float | None = None
    reward_last: float | None = None
    global_step: int = 0
    weights: str = ""
    metrics: str = ""

    def text(self) -> str:
        if self.first_epoch is None:
            return "ddpo_tpu: run complete"
        return (f"ddpo_tpu: summary: epochs {self.first_epoch}-{self.last_epoch} of {self.num_epochs} in "
                f"{self.minutes:.1f} min (this process), reward {self.reward_first:.4f} -> {self.reward_last:.4f}, "
                f"{self.global_step} optimizer steps in all; weights {self.weights}; metrics {self.metrics}\n"
                f"ddpo_tpu: run complete")


@dataclass(frozen=True)
class Preempted(Event):
    kind: ClassVar[str] = "preempted"
    epoch: int             # the last epoch whose checkpoint is in place (-1: none)
    global_step: int
    message: str

    def text(self) -> str:
        return f"ddpo_tpu: preempted: {self.message}"


@dataclass(frozen=True)
class Failed(Event):
    kind: ClassVar[str] = "error"
    message: str

    def text(self) -> str:
        return f"error: {self.message}"


@dataclass(frozen=True)
class WorkerExited(Event):
    """Written by the front end when the training process ends, whatever ended it (a SIGKILL leaves no other
    trace): the exit code as the front end reports it."""

    kind: ClassVar[str] = "worker_exited"
    code: int
    message: str = ""  # how it ended, for people ("was killed by SIGKILL"); empty for a documented exit code


@dataclass(frozen=True)
class WorkerStarted(Event):
    """Written by the front end when it starts the training process: it opens an attempt (ddpo-status decides a
    run's state from its last attempt), before the training process has written anything."""

    kind: ClassVar[str] = "worker_started"
    worker_pid: int


# --- an epoch --------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PhaseStart(Event):
    kind: ClassVar[str] = "phase_start"
    epoch: int
    phase: str  # sampling | training | evaluation

    def text(self) -> str | None:
        return f"[epoch {self.epoch}] {self.phase} start" if self.phase != "evaluation" else None


@dataclass(frozen=True)
class PhaseEnd(Event):
    kind: ClassVar[str] = "phase_end"
    epoch: int
    phase: str
    seconds: float
    host_seconds: float
    compilations: int
    compile_seconds: float


@dataclass(frozen=True)
class SamplingBatch(Event):
    kind: ClassVar[str] = "sampling_batch"
    epoch: int
    batch: int  # 1-based: batches done
    of: int

    def text(self) -> str:
        return f"[epoch {self.epoch}] sampling batch {self.batch}/{self.of} done"


@dataclass(frozen=True)
class RewardsGathered(Event):
    kind: ClassVar[str] = "rewards"
    epoch: int
    mean: float
    std: float
    nonfinite: int = 0

    def text(self) -> str:
        line = f"[epoch {self.epoch}] rewards gathered: mean {self.mean:.4f} std {self.std:.4f}"
        if self.nonfinite:
            line += (f"\n[epoch {self.epoch}] {self.nonfinite} non-finite reward(s): zero advantage for those "
                     f"samples")
        return line


@dataclass(frozen=True)
class TrainingProgress(Event):
    kind: ClassVar[str] = "training_progress"
    epoch: int
    done: int    # timesteps trained so far this epoch
    total: int
    updates: int

    def text(self) -> str:
        return (f"[epoch {self.epoch}] training: {self.done}/{self.total} timesteps trained, {self.updates} "
                f"optimizer step(s) done")


@dataclass(frozen=True)
class Evaluated(Event):
    kind: ClassVar[str] = "evaluated"
    epoch: int
    mean: float
    std: float

    def text(self) -> str:
        return f"[epoch {self.epoch}] eval: reward {self.mean:.4f} +- {self.std:.4f}"


@dataclass(frozen=True)
class CheckpointSaved(Event):
    kind: ClassVar[str] = "checkpoint"
    epoch: int
    global_step: int
    path: str

    def text(self) -> str:
        return f"[epoch {self.epoch}] checkpoint {self.path}"


@dataclass(frozen=True)
class EpochDone(Event):
    kind: ClassVar[str] = "epoch_done"
    epoch: int
    reward_mean: float
    reward_std: float
    approx_kl: float
    clipfrac: float
    updates: int
    phases: dict[str, dict[str, float]] = field(default_factory=dict)

    def text(self) -> str:
        phases = ", ".join(f"{k} {v['seconds']:.1f}s/{v['compilations']}c"
                           + (f"+{v['replicate_compilations']}r" if "replicate_compilations" in v else "")
                           for k, v in self.phases.items())
        return (f"[epoch {self.epoch}] done: reward {self.reward_mean:.4f} +- {self.reward_std:.4f}, approx_kl "
                f"{self.approx_kl:.2e}, clipfrac {self.clipfrac:.3f}, {self.updates} updates, {phases}")


# --- writing and reading ---------------------------------------------------------------------------------------------

class EventLog:
    """Appends events to run_dir/events.jsonl and prints their text. Only the main process of a multi-host run
    writes or prints (the others' events are the same)."""

    def __init__(self, run_dir: Path | None, is_main: bool = True, echo=None):
        self.path = Path(run_dir) / EVENTS_FILE if run_dir is not None else None
        self.is_main = is_main
        self._echo = echo

    def emit(self, event: Event) -> dict[str, Any]:
        rec = {"time": round(time.time(), 3), "pid": os.getpid(), **event.record()}
        if not self.is_main:
            return rec
        if self.path is not None:
            try:
                with open(self.path, "a") as f:  # flushed on close; a SIGKILL loses no line the OS was handed
                    f.write(json.dumps(rec, default=_jsonable) + "\n")
            except OSError:
                pass  # a full or read-only disk is reported by the writes that matter (and by this event's text)
        text = event.text()
        if text is not None:
            (self._echo or _print)(text, isinstance(event, Failed))
        return rec


def _print(text: str, error: bool = False) -> None:
    print(text, file=sys.stderr if error else sys.stdout, flush=True)


def read_events(path: Path) -> list[dict[str, Any]]:
    """The records of an events file (a file or a run dir), in order; a torn or foreign line is skipped."""
    path = Path(path)
    if path.is_dir():
        path = path / EVENTS_FILE
    try:
        data = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return []
    out = []
    for line in data.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("event"), str):
            out.append(rec)
    return out


def parse(rec: dict[str, Any]) -> Event | None:
    """The typed event of a record (None for a kind this version does not know: a newer writer)."""
    cls = _KINDS.get(rec.get("event", ""))
    if cls is None:
        return None
    names = {f.name for f in dataclasses.fields(cls)}
    try:
        return cls(**{k: v for k, v in rec.items() if k in names})
    except TypeError:  # a required field missing: a record of another version, read as unknown
        return None


def _jsonable(x: Any) -> Any:
    if hasattr(x, "item"):
        return x.item()
    if hasattr(x, "tolist"):
        return x.tolist()
    raise TypeError(f"not JSON serialisable: {type(x)}")


__all__ = [name for name, obj in list(globals().items())
           if isinstance(obj, type) and issubclass(obj, Event)] + ["EVENTS_FILE", "EventLog", "read_events", "parse"]
