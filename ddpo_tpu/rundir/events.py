"""Progress as typed events: machines read events, people read text.

The training process emits one event per thing that happened (a phase started, a sampling batch is done, a
checkpoint is in place, the run stopped). Each event is appended as one JSON line to `events.jsonl` in the run dir
and rendered as one console line for people. Everything that needs to know where a run stands (ddpo-status, the
front end's live status line, the pod launcher, the tests) reads the events file, never console text, so a console
line can be reworded without breaking anything.

`events.jsonl` is append-only across attempts of a run (a resumed run appends; `run_start` opens each attempt); a
line cut short by a kill is ignored by `read_events`, and the next append starts on a fresh line (`append_line`).
metrics.jsonl stays the record of the numbers (one line per optimizer step, epoch and evaluation, each epoch once);
this file is the record of what happened.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, dataclass_transform

EVENTS_FILE = "events.jsonl"

_KINDS: dict[str, type["Event"]] = {}


@dataclass_transform(frozen_default=True, field_specifiers=(field,))
class Event:
    """One thing that happened. A subclass is a frozen dataclass of the event's fields, declared as

        class SamplingBatch(Event, kind="sampling_batch", text="[epoch {epoch}] sampling batch {batch}/{of} done"):
            epoch: int
            ...

    `kind` names it in events.jsonl; `text` is its console line, formatted with its fields (str.format). An event
    whose line depends on its values overrides `text()`; one without a line (machines only) gives neither."""

    kind: ClassVar[str] = ""
    template: ClassVar[str | None] = None

    def __init_subclass__(cls, kind: str = "", text: str | None = None, **kw):
        super().__init_subclass__(**kw)
        if not kind or kind in _KINDS:
            raise TypeError(f"{cls.__name__}: every event kind needs a name of its own, got {kind!r}")
        cls.kind, cls.template = kind, text
        dataclass(frozen=True)(cls)
        _KINDS[kind] = cls

    def text(self) -> str | None:
        """The console line, or None for events only machines read."""
        if self.template is None:
            return None
        return self.template.format(**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)})

    def record(self) -> dict[str, Any]:
        return {"event": self.kind, **dataclasses.asdict(self)}


# --- a run's life ----------------------------------------------------------------------------------------------------

class RunStart(Event, kind="run_start"):
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


class StateLayout(Event, kind="state_layout"):
    """How the training state lies on the devices (runtime/base.py StateLayout); run_start's `state` says it."""

    tensors: int
    sharded: int
    bytes_total: int
    bytes_per_device: int


class Resumed(Event, kind="resumed",
              text="ddpo_tpu: resumed from {checkpoint} (epoch {epoch} done, global step {global_step})"):
    epoch: int
    global_step: int
    checkpoint: str


class CheckpointDamaged(Event, kind="checkpoint_damaged",
                        text="ddpo_tpu: warning: {problem}; trying the previous checkpoint"):
    checkpoint: str
    problem: str


class ExportFailed(Event, kind="export_failed",
                   text="ddpo_tpu: warning: exporting weights/{name}.safetensors for diffusers and peft failed "
                        "({problem}); the weights and the checkpoint are saved; "
                        "retry with ddpo-export {run_dir} {name}"):
    name: str
    problem: str
    run_dir: str


class AlreadyComplete(Event, kind="already_complete",
                      text="ddpo_tpu: run complete (all {num_epochs} epochs were done already)"):
    num_epochs: int


class RunComplete(Event, kind="run_complete"):
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


class Preempted(Event, kind="preempted", text="ddpo_tpu: preempted: {message}"):
    epoch: int             # the last epoch whose checkpoint is in place (-1: none)
    global_step: int
    message: str


class Failed(Event, kind="error", text="error: {message}"):
    message: str


class WorkerExited(Event, kind="worker_exited"):
    """Written by the front end when the training process ends, whatever ended it (a SIGKILL leaves no other
    trace): the exit code as the front end reports it."""

    code: int
    message: str = ""  # how it ended, for people ("was killed by SIGKILL"); empty for a documented exit code


class WorkerStarted(Event, kind="worker_started"):
    """Written by the front end when it starts the training process: it opens an attempt (ddpo-status decides a
    run's state from its last attempt), before the training process has written anything."""

    worker_pid: int


# --- an epoch --------------------------------------------------------------------------------------------------------

class PhaseStart(Event, kind="phase_start"):
    epoch: int
    phase: str  # sampling | training | evaluation

    def text(self) -> str | None:
        return f"[epoch {self.epoch}] {self.phase} start" if self.phase != "evaluation" else None


class PhaseEnd(Event, kind="phase_end"):
    epoch: int
    phase: str
    seconds: float
    host_seconds: float
    compilations: int
    compile_seconds: float


class SamplingBatch(Event, kind="sampling_batch", text="[epoch {epoch}] sampling batch {batch}/{of} done"):
    epoch: int
    batch: int  # 1-based: batches done
    of: int


class RewardsGathered(Event, kind="rewards"):
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


class TrainingProgress(Event, kind="training_progress",
                       text="[epoch {epoch}] training: {done}/{total} timesteps trained, {updates} optimizer step(s) "
                            "done"):
    epoch: int
    done: int    # timesteps trained so far this epoch
    total: int
    updates: int


class TrainingBatch(Event, kind="training_batch"):
    """A train batch's timesteps are trained (machines only: the live progress bar; no console line)."""

    epoch: int
    done: int    # timesteps trained so far this epoch
    total: int
    updates: int


# --- compiling the graphs (XLA: the first epoch of a training process) ----------------------------------------------

def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def so_far(seconds: float) -> str:
    """Elapsed time as people read it: "45 s", "4 min"."""
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds // 60:.0f} min"


class CompileStart(Event, kind="compile_start"):
    """A stage of the first epoch whose graphs XLA compiles (the runtime's COMPILE_STAGES, `index` of `of`)."""

    epoch: int
    stage: str  # sampling | training
    index: int  # 1-based
    of: int

    def text(self) -> str:
        return f"[epoch {self.epoch}] compiling the {self.stage} graphs, {_ordinal(self.index)} of {self.of}"

    def live(self, seconds: float, compilations: int | None = None) -> str:
        """The line after `seconds`: what the console's status line, the periodic lines and ddpo-status say."""
        done = "" if compilations is None else f" ({compilations} graph(s) compiled)"
        return f"{CompileStart.text(self)}, {so_far(seconds)} so far{done}"


class CompileProgress(CompileStart, kind="compile_progress"):
    """Emitted from a thread every few seconds while a stage compiles: the compile holds the main thread."""

    seconds: float = 0.0        # since its compile_start
    compilations: int = 0       # graphs compiled so far in this stage (torch_xla's counters)
    compile_seconds: float = 0.0

    def text(self) -> str:
        return self.live(self.seconds, self.compilations)


class CompileEnd(CompileProgress, kind="compile_end"):
    def text(self) -> str:
        return (f"[epoch {self.epoch}] the {self.stage} graphs are compiled ({_ordinal(self.index)} of {self.of}): "
                f"{self.compilations} graph(s), {self.compile_seconds:.1f} s compiling in {self.seconds:.1f} s")


class Evaluated(Event, kind="evaluated", text="[epoch {epoch}] eval: reward {mean:.4f} +- {std:.4f}"):
    epoch: int  # BEFORE_TRAINING (-1): the frozen policy's evaluation, before epoch 0 trains
    mean: float
    std: float

    def text(self) -> str:
        where = "before training" if self.epoch < 0 else f"epoch {self.epoch}"
        return f"[{where}] eval: reward {self.mean:.4f} +- {self.std:.4f}"


BEFORE_TRAINING = -1  # the epoch an evaluation of the untrained policy is recorded under (metrics.jsonl, events)


class CheckpointSaved(Event, kind="checkpoint", text="[epoch {epoch}] checkpoint {path}"):
    epoch: int
    global_step: int
    path: str


EXTRAS_SHOWN = 3  # reward extras on an epoch's console line (weighted: its first components); metrics.jsonl has all


class EpochDone(Event, kind="epoch_done"):
    epoch: int
    reward_mean: float
    reward_std: float
    approx_kl: float
    clipfrac: float
    updates: int
    phases: dict[str, dict[str, float]] = field(default_factory=dict)
    # each reward extra's epoch mean (None: applied to no image); the line shows the first EXTRAS_SHOWN
    extras: dict[str, float | None] = field(default_factory=dict)

    def text(self) -> str:
        phases = ", ".join(f"{k} {v['seconds']:.1f}s/{v['compilations']}c"
                           + (f"+{v['replicate_compilations']}r" if "replicate_compilations" in v else "")
                           + _scored(v) for k, v in self.phases.items())
        return (f"[epoch {self.epoch}] done: reward {self.reward_mean:.4f} +- {self.reward_std:.4f}{self._extras()}, "
                f"approx_kl {self.approx_kl:.2e}, clipfrac {self.clipfrac:.3f}, {self.updates} updates, {phases}")

    def _extras(self) -> str:
        """" (pickscore 0.2210, aesthetic 5.1034, +2 more)": the first few extras (metrics.jsonl has them all)."""
        if not self.extras:
            return ""
        shown = [f"{k} {'n/a' if v is None else f'{v:.4f}'}" for k, v in list(self.extras.items())[:EXTRAS_SHOWN]]
        more = len(self.extras) - len(shown)
        return " (" + ", ".join(shown + ([f"+{more} more"] if more else [])) + ")"


def _scored(phase: dict) -> str:
    """" (1.9s scored, 1.8s hidden)" after the reward phase: the reward calls' own seconds and the part of them that
    ran while sampling went on (training/reward_overlap.py); "" for the other phases and older records."""
    if "scored_seconds" not in phase:
        return ""
    return f" ({phase['scored_seconds']:.1f}s scored, {phase.get('hidden_seconds', 0.0):.1f}s hidden)"


# --- writing and reading ---------------------------------------------------------------------------------------------

def append_line(path: Path, line: str, fsync: bool = False) -> None:
    """Append one whole line. After a line a kill cut short (the file does not end in a newline), start on a fresh
    line: the torn line stays one unreadable line that readers skip, and this record is not glued onto it."""
    try:
        with open(path, "ab+") as f:  # appends go to the end; reading from anywhere is allowed
            if f.seek(0, os.SEEK_END) > 0:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    line = "\n" + line
            f.write(line.encode())  # one write: a concurrent appender's line never lands inside it
            f.flush()
            if fsync:
                os.fsync(f.fileno())
    except OSError as e:
        if e.filename is not None:
            raise
        raise OSError(e.errno, e.strerror, str(path)) from e  # a full disk at flush: name the file all the same


class EventLog:
    """Appends events to run_dir/events.jsonl and prints their text. Only the main process of a multi-host run
    writes or prints (the others' events are the same).

    A write the disk refuses: with `raise_errors` (the training process), the first one raised from the main thread
    as an OSError naming events.jsonl, which the trainer turns into its one `error:` line; otherwise (the front end,
    threads, the events that end a run) kept in `write_error` and the text still printed."""

    def __init__(self, run_dir: Path | None, is_main: bool = True, echo=None, raise_errors: bool = False):
        self.path = Path(run_dir) / EVENTS_FILE if run_dir is not None else None
        self.is_main = is_main
        self.raise_errors = raise_errors
        self.write_error: OSError | None = None
        self._echo = echo
        self._lock = threading.Lock()  # a compile's progress is emitted from a thread: whole lines, in order

    def emit(self, event: Event) -> dict[str, Any]:
        with self._lock:
            return self._emit(event)

    def _emit(self, event: Event) -> dict[str, Any]:
        rec = {"time": round(time.time(), 3), "pid": os.getpid(), **event.record()}
        if not self.is_main:
            if isinstance(event, Failed):  # into the rank's own log (ranks/rank<N>.log), which its launcher quotes
                (self._echo or _print)(event.text(), True)
            return rec
        text = event.text()
        if self.path is not None:
            try:
                append_line(self.path, json.dumps(rec, default=_jsonable) + "\n")
            except OSError as e:
                first = self.write_error is None
                self.write_error = self.write_error or OSError(e.errno, e.strerror, str(self.path))
                if (first and self.raise_errors and threading.current_thread() is threading.main_thread()
                        and not isinstance(event, (Failed, Preempted))):
                    if text is not None:
                        (self._echo or _print)(text, False)
                    raise self.write_error from e
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
           if isinstance(obj, type) and issubclass(obj, Event)] + ["EVENTS_FILE", "EventLog", "append_line",
                                                                       "read_events", "parse"]
