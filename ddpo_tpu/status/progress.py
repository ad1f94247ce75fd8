"""Where an epoch stands, from the last attempt's events and metrics.jsonl. Pure: no I/O, no clock."""

from __future__ import annotations

from dataclasses import dataclass

from ddpo_tpu.rundir import events as ev
from ddpo_tpu.status.decide import last_of
from ddpo_tpu.status.read import Metrics, Stamped

_AFTER_PHASE = {  # what follows the end of a phase within an epoch
    "sampling": ("reward", "all sampling batches done, gathering rewards"),
    "reward": ("advantages", "rewards gathered, computing advantages"),
    "advantages": ("training", "advantages computed, training next"),
    "training": ("saving", "training done, saving the epoch"),
    "evaluation": ("saving", "evaluation done, saving the epoch"),
    "checkpoint": ("saving", "checkpoint files written, the epoch's outputs next"),
}


def describe(event: ev.Event, num_epochs: int | None) -> tuple[str, str] | None:
    """(phase, detail) after an epoch's event, or None for an event that does not say where an epoch is."""
    if isinstance(event, ev.PhaseStart):
        first = {"sampling": "sampling batch 1 (none done yet)", "evaluation": "evaluating the held-out prompts"}
        return event.phase, first.get(event.phase, event.phase)
    if isinstance(event, ev.SamplingBatch):
        if event.batch < event.of:
            return "sampling", f"sampling batch {event.batch + 1}/{event.of} ({event.batch}/{event.of} done)"
        return "reward", f"all {event.of} sampling batches done, gathering rewards"
    if isinstance(event, ev.RewardsGathered):
        return "advantages", "rewards gathered, computing advantages"
    if isinstance(event, (ev.TrainingProgress, ev.TrainingBatch)):
        return "training", f"training: {event.done}/{event.total} timesteps, {event.updates} optimizer step(s) done"
    if isinstance(event, ev.PhaseEnd):
        return _AFTER_PHASE.get(event.phase, (event.phase, f"{event.phase} done"))
    if isinstance(event, ev.Evaluated):
        if event.epoch < 0:
            return "sampling", f"evaluation before training done (reward {event.mean:.4f}), epoch 0 sampling next"
        return "saving", f"evaluation done (reward {event.mean:.4f}), saving the epoch"
    if isinstance(event, ev.CheckpointSaved):
        return "saving", f"checkpoint {event.path} in place"
    if isinstance(event, ev.EpochDone):
        if num_epochs is not None and event.epoch + 1 >= num_epochs:
            return "finishing", f"epoch {event.epoch} done (the last one): saving and exiting"
        return "between epochs", f"epoch {event.epoch} done, epoch {event.epoch + 1} starting"
    return None


def locate(attempt: list[Stamped], epochs: list[dict], num_epochs: int | None) -> tuple[int | None, str | None,
                                                                                          str | None]:
    """(current epoch, phase, detail) from the last attempt's newest event that says where an epoch is."""
    for s in reversed(attempt):
        where = describe(s.event, num_epochs)
        if where is not None:
            return s.event.epoch, where[0], where[1]
    next_epoch = epochs[-1]["epoch"] + 1 if epochs else None
    start = last_of(attempt, ev.RunStart)
    if start is not None:
        detail = f"training process started, epoch {start.start_epoch} next"
        if start.compiles_graphs:
            detail += " (compiling the graphs first)"
        return start.start_epoch, "setup", detail
    if attempt:
        return next_epoch, "setup", "loading (no progress event yet)"
    if epochs:
        return next_epoch, "between epochs", f"epoch {epochs[-1]['epoch']} done (from metrics.jsonl)"
    return None, None, None


@dataclass(frozen=True)
class Compiling:
    """A compile in progress (a compile_start with no compile_end after it)."""

    epoch: int
    stage: str
    index: int
    of: int
    seconds: float
    compilations: int | None
    text: str


def open_compile(attempt: list[Stamped], until: float) -> Compiling | None:
    """The compile in progress in an attempt, timed up to `until` (now for a running run, else its last event)."""
    start: Stamped | None = None
    done = None
    for s in attempt:
        if isinstance(s.event, ev.CompileEnd):
            start = None
        elif isinstance(s.event, ev.CompileProgress):
            done = s.event.compilations
        elif isinstance(s.event, ev.CompileStart):
            start, done = s, None
    if start is None:
        return None
    e = start.event
    seconds = max(0.0, until - start.time)
    return Compiling(e.epoch, e.stage, e.index, e.of, seconds, done,
                     e.live(seconds, done).removeprefix(f"[epoch {e.epoch}] "))


def epochs_of(metrics: Metrics) -> list[dict]:
    """One record per epoch, in order (the later line wins when a restarted run logged an epoch again)."""
    by_epoch = {r["epoch"]: r for r in metrics.records
                if r.get("kind") == "epoch" and isinstance(r.get("epoch"), int) and not isinstance(r["epoch"], bool)}
    return [by_epoch[k] for k in sorted(by_epoch)]


def optimizer_steps(metrics: Metrics, epochs: list[dict], current_epoch: int | None) -> tuple[int | None, int | None]:
    """(optimizer steps done in the current epoch, steps per epoch) from the global steps in metrics.jsonl."""
    if current_epoch is None:
        return None, None
    by_epoch = {e["epoch"]: e for e in epochs}
    prev = by_epoch.get(current_epoch - 1)
    base = prev.get("global_step") if prev else (0 if current_epoch == 0 else None)
    cur = [r for r in metrics.records if r.get("kind") == "step" and r.get("epoch") == current_epoch]
    last = cur[-1].get("global_step") if cur else base
    now = last - base if isinstance(base, int) and isinstance(last, int) else None
    per_epoch = None
    gs = [(e["epoch"], e.get("global_step")) for e in epochs]
    for (e0, g0), (e1, g1) in zip(gs, gs[1:]):
        if e1 == e0 + 1 and isinstance(g0, int) and isinstance(g1, int):
            per_epoch = g1 - g0
    if per_epoch is None and len(gs) == 1 and gs[0][0] == 0 and isinstance(gs[0][1], int):
        per_epoch = gs[0][1]
    return now, per_epoch


def training_detail(attempt: list[Stamped], current_epoch: int | None, steps_now: int | None,
                    steps_per_epoch: int | None) -> tuple[int | None, str | None]:
    """(optimizer steps done in the epoch, the training phase's detail) from the newest progress event and the step
    lines; None for the detail when neither says."""
    progress = last_of(attempt, ev.TrainingProgress, ev.TrainingBatch)
    progress = progress if progress is not None and progress.epoch == current_epoch else None
    if progress is not None and steps_now is not None:  # its count can be newer than the step lines
        steps_now = max(steps_now, progress.updates)
    if steps_now is None:
        return None, None
    return steps_now, (f"training, optimizer step {steps_now}" + (f"/{steps_per_epoch}" if steps_per_epoch else "")
                       + " done" + (f" ({progress.done}/{progress.total} timesteps)" if progress else ""))
