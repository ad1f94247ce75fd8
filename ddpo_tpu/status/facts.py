"""Every fact ddpo-status shows, as one typed, frozen record (`Facts`), derived from what `read_run` found
(`derive`: pure, `now` passed in; `collect` reads the run dir first)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddpo_tpu.catalog.executions import execution_or_none
from ddpo_tpu.rundir import events as ev
from ddpo_tpu.proc.exit_codes import EXIT_PREEMPTED
from ddpo_tpu.status.decide import Evidence, attempts, decide, last_of
from ddpo_tpu.status.progress import Compiling, epochs_of, locate, open_compile, optimizer_steps, training_detail
from ddpo_tpu.status.read import Holder, Layout, RunFiles, Stamped, get, num, read_any

DEFAULT_STALE_S = 900.0            # a first XLA compile can be silent for many minutes
RATE_WINDOW = 5                    # epochs averaged for samples/s and the ETA
METRICS_KINDS = ("step", "epoch", "eval", "event")


@dataclass(frozen=True)
class Reward:
    first: float
    last: float
    best: float
    best_epoch: int
    first_epoch: int
    last_epoch: int


@dataclass(frozen=True)
class EpochRow:
    epoch: int
    reward_mean: float | None
    reward_std: float | None
    approx_kl: float | None
    clipfrac: float | None
    loss: float | None
    new_compilations: Any
    num_samples: Any
    seconds: float | None
    time: float | None


@dataclass(frozen=True)
class EvalRow:
    """One finished evaluation of the run (eval/<name>/summary.json): in training (before_training, epoch_NNNN)
    or by ddpo-eval (checkpoint_epoch_NNNN, weights_NAME, base), side by side in one table."""
    name: str
    epoch: int | None
    global_step: int | None
    num_images: int | None
    rewards: dict[str, tuple[float | None, float | None]]   # label -> (mean, std)


@dataclass(frozen=True)
class HostPhase:
    host_s: float
    wall_s: float


@dataclass(frozen=True)
class HostTime:
    """The newest epoch's main-thread CPU seconds against its wall seconds, per phase."""

    epoch: int | None
    host_s: float
    wall_s: float
    device_is_host: bool
    fraction: float | None
    phases: dict[str, HostPhase]


@dataclass(frozen=True)
class LastError:
    line: str
    current_attempt: bool  # False: an earlier attempt's, and the run went on


@dataclass(frozen=True)
class Checkpoints:
    count: int
    latest: str | None
    latest_time: float | None
    last_event: dict[str, Any] | None  # the newest `checkpoint` event, with its time


@dataclass(frozen=True)
class Parity:
    constraints: int
    failing: tuple[Any, ...]


@dataclass(frozen=True)
class MetricsSummary:
    records: int
    kinds: dict[str, int]
    bad_lines: int
    truncated_last_line: bool


@dataclass(frozen=True)
class Facts:
    """Where a run stands. `--json` prints these fields as they are named here."""

    run_dir: str
    run_name: str
    topology: str | None
    samples_per_epoch_config: int | None
    state: str                      # finished | failed | stopped | running | not started
    stop_reason: str | None         # preempted | dead | no activity (stopped only)
    state_label: str
    rule: str                       # the rule that decided (ddpo_tpu.status.decide.RULES)
    decided_by: str
    now: float
    attempts: int
    live_process: Holder | None
    heartbeat_age_s: float | None
    num_epochs: int | None
    epochs_done: int
    current_epoch: int | None
    phase: str | None
    phase_detail: str | None
    compiling: Compiling | None
    optimizer_steps_in_epoch: int | None
    optimizer_steps_per_epoch: int | None
    global_step: int | None
    last_event_time: float | None
    last_event_kind: str | None
    last_event_age_s: float | None
    epoch_seconds_total: float | None
    train_log_mtime: float | None
    train_log_tail: tuple[str, ...]
    stale_after_s: float
    samples_per_s: float | None
    epoch_seconds_mean: float | None
    rate_basis: str | None
    eta_s: float | None
    eta_time: float | None
    reward: Reward | None
    reward_curve: tuple[float, ...]
    epochs: tuple[EpochRow, ...]
    last_error: LastError | None
    events: tuple[dict[str, Any], ...]   # the last five records of events.jsonl
    recent_events: tuple[str, ...]       # the current attempt's events as text
    checkpoints: Checkpoints | None
    host_time: HostTime | None
    parity: Parity | None
    state_layout: Layout | None
    metrics: MetricsSummary
    notes: tuple[str, ...]
    evaluations: tuple[EvalRow, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict: the fields by name, NaN and inf as None."""
        return finite(dataclasses.asdict(self))


def collect(run_dir: str | Path, now: float | None = None, stale_after: float = DEFAULT_STALE_S,
            lock_paths: list[Path] | None = None) -> Facts:
    """read_run + derive (the one function here that reads files and the clock). Raises FileNotFoundError when
    there is no run here. A gs:// run dir is read from the bucket (its files copied into a temporary dir first)."""
    import time

    return derive(read_any(run_dir, lock_paths), time.time() if now is None else now, stale_after)


def finite(x: Any) -> Any:
    """x with NaN and inf (a diverged loss, an odd event field) as None: its JSON stays strict."""
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return None
    if isinstance(x, dict):
        return {str(k): finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite(v) for v in x]
    return x


def _phase_seconds(rec: dict) -> float | None:
    phases = rec.get("phases")
    if not isinstance(phases, dict):
        return None
    secs = [num(p.get("seconds")) for p in phases.values() if isinstance(p, dict)]
    secs = [x for x in secs if x is not None]
    return sum(secs) if secs else None


def throughput(epochs: list[dict]) -> tuple[float | None, float | None, str | None]:
    """(samples/s, seconds per epoch, which epochs) over the last few epochs, preferring those that compiled
    nothing new."""
    window = epochs[-RATE_WINDOW:]
    steady = [e for e in window if not e.get("new_compilations") and not e.get("new_replicate_compilations")]
    basis = steady or window
    secs = [(e, s) for e, s in ((e, _phase_seconds(e)) for e in basis) if s is not None and s > 0]
    if not secs:
        return None, None, None
    total = sum(s for _, s in secs)
    samples = sum(int(e.get("num_samples") or 0) for e, _ in secs)
    which = (f"epochs {secs[0][0]['epoch']}-{secs[-1][0]['epoch']}" if len(secs) > 1
             else f"epoch {secs[0][0]['epoch']}")
    if len(window) > len(basis):
        which += f" ({len(window) - len(basis)} with new compilations left out)"
    return (samples / total if samples else None), total / len(secs), which


def device_is_host(cfg: dict) -> bool:
    """Whether the run's device is the host CPU's own threads: eager PyTorch on the CPU, or torch.distributed with
    one CPU process per device. There the main thread runs the model itself, so its CPU time near the wall time says
    nothing about dispatch overhead; "host-bound" is meant for a host feeding another device (XLA, even XLA on the
    CPU, whose computations run on the runtime's own threads, or an accelerator). Unknown (an older config): False."""
    spec = execution_or_none(get(cfg, "tpu_topology.execution"))
    return get(cfg, "tpu_topology.accelerator") == "cpu" and spec is not None and not spec.torch_xla


def host_time(epochs: list[dict], on_host: bool = False) -> HostTime | None:
    """The newest epoch's host time: a phase whose host time is near its wall time is bound by tracing and dispatch
    on the host, not by the devices (unless `on_host`: the device is the host CPU, see device_is_host)."""
    for e in reversed(epochs):
        phases = e.get("phases")
        if not isinstance(phases, dict):
            continue
        rows = {k: (num(p.get("host_seconds")), num(p.get("seconds"))) for k, p in phases.items()
                if isinstance(p, dict)}
        rows = {k: v for k, v in rows.items() if v[0] is not None and v[1] is not None}
        if rows:
            host, wall = sum(h for h, _ in rows.values()), sum(w for _, w in rows.values())
            return HostTime(e.get("epoch"), host, wall, on_host, host / wall if wall > 0 else None,
                            {k: HostPhase(h, w) for k, (h, w) in rows.items()})
    return None


def reward_summary(epochs: list[dict]) -> tuple[Reward | None, tuple[float, ...]]:
    valid = [(e["epoch"], r) for e, r in ((e, num(e.get("reward_mean"))) for e in epochs) if r is not None]
    if not valid:
        return None, ()
    best = max(valid, key=lambda x: x[1])
    return (Reward(valid[0][1], valid[-1][1], best[1], best[0], valid[0][0], valid[-1][0]),
            tuple(r for _, r in valid))


def eval_table(evaluations: list[tuple[str, dict]]) -> tuple[EvalRow, ...]:
    """The run's finished evaluations (read.py read_evaluations), by epoch then name."""
    rows = []
    for name, doc in evaluations:
        rewards = {k: (num(v.get("mean")), num(v.get("std"))) for k, v in (doc.get("rewards") or {}).items()
                   if isinstance(v, dict)}
        ep, step, n = doc.get("epoch"), doc.get("global_step"), doc.get("num_images")
        rows.append(EvalRow(name, ep if isinstance(ep, int) else None, step if isinstance(step, int) else None,
                            n if isinstance(n, int) else None, rewards))
    return tuple(sorted(rows, key=lambda r: (r.epoch if r.epoch is not None else -2, r.name)))


def epoch_table(epochs: list[dict]) -> tuple[EpochRow, ...]:
    return tuple(EpochRow(e["epoch"], num(e.get("reward_mean")), num(e.get("reward_std")), num(e.get("approx_kl")),
                          num(e.get("clipfrac")), num(e.get("loss")), e.get("new_compilations"),
                          e.get("num_samples"), _phase_seconds(e), num(e.get("time"))) for e in epochs)


def last_error(runs: list[list[Stamped]]) -> LastError | None:
    """The newest attempt's error (its `error` event, else a failing exit code) and whether it is the last attempt's."""
    for i in range(len(runs) - 1, -1, -1):
        err = last_of(runs[i], ev.Failed)
        ended = last_of(runs[i], ev.WorkerExited)
        if err is not None:
            line = f"error: {err.message}"
        elif ended is not None and ended.code not in (0, EXIT_PREEMPTED):
            line = f"the training process {ended.message or f'exited with code {ended.code}'}"
        else:
            continue
        return LastError(line, i == len(runs) - 1)
    return None


def _text(event: ev.Event) -> str | None:
    """An event's console text; None when a record from another version cannot be rendered (a null number)."""
    try:
        return event.text()
    except (TypeError, ValueError, KeyError):
        return None


def checkpoint_summary(entries: list[tuple[str, float]], events: list[Stamped]) -> Checkpoints | None:
    saved = [s for s in events if isinstance(s.event, ev.CheckpointSaved)]
    if not entries and not saved:
        return None
    last = None if not saved else {"time": saved[-1].time, **saved[-1].event.record()}
    return Checkpoints(len(entries), entries[-1][0] if entries else None, entries[-1][1] if entries else None, last)


def parity_summary(rows: list | None) -> Parity | None:
    if rows is None:
        return None
    return Parity(len(rows), tuple(r.get("constraint") for r in rows if isinstance(r, dict) and r.get("ok") is False))


def _notes(run: RunFiles) -> tuple[str, ...]:
    m, notes = run.metrics, list(run.notes)
    if m.truncated_last_line:
        notes.append("metrics.jsonl ends in a truncated line (writer killed mid-write); it was skipped")
    if m.bad_lines:
        notes.append(f"metrics.jsonl has {m.bad_lines} unparseable line(s); skipped")
    unknown = sorted(k for k in m.kinds if k not in METRICS_KINDS)
    if unknown:
        notes.append("metrics.jsonl has records of unknown kind(s) " + ", ".join(unknown) + "; ignored")
    if run.unknown_events:
        notes.append("events.jsonl has events this version does not know (" + ", ".join(sorted(run.unknown_events))
                     + "): written by a newer ddpo_tpu? ignored")
    if not run.has_events_file and m.records:
        notes.append("no events.jsonl (a run from before events): the state comes from the lock, the heartbeat and "
                     "metrics.jsonl only")
    return tuple(notes)


def _activity(run: RunFiles, last_event_time: float | None) -> tuple[float | None, str | None]:
    """When anything was last written, and what."""
    seen = [(t, src) for t, src in ((last_event_time, "event"), (run.log.mtime, "train.log write"),
                                    (None if run.heartbeat is None else run.heartbeat.time, "heartbeat"))
            if t is not None]
    return max(seen) if seen else (None, None)


def derive(run: RunFiles, now: float, stale_after: float = DEFAULT_STALE_S) -> Facts:
    """Every fact the report shows, from what `read_run` found. Pure: `now` is passed in."""
    cfg = run.cfg
    num_epochs = get(cfg, "num_epochs")
    num_epochs = num_epochs if isinstance(num_epochs, int) and not isinstance(num_epochs, bool) else None
    batch, nbatches = get(cfg, "sample.batch_size"), get(cfg, "sample.num_batches_per_epoch")
    epochs = epochs_of(run.metrics)
    runs = attempts(run.events)
    attempt = runs[-1] if runs else []

    current_epoch, phase, phase_detail = locate(attempt, epochs, num_epochs)
    steps_now, steps_per_epoch = optimizer_steps(run.metrics, epochs, current_epoch)
    steps_now, training = training_detail(attempt, current_epoch, steps_now, steps_per_epoch)
    if phase == "training" and training is not None:
        phase_detail = training

    stamps = [(s.time, s.event.kind) for s in run.events] + [
        (t, f"metrics.jsonl {r.get('kind')} line") for r in run.metrics.records if (t := num(r.get("time")))]
    last_event_time, last_kind = max(stamps, key=lambda x: x[0]) if stamps else (None, None)
    activity_t, activity_src = _activity(run, last_event_time)
    heartbeat_age = None if run.heartbeat is None else now - run.heartbeat.time
    longest_phase = max((float(p["seconds"]) for e in epochs for p in (e.get("phases") or {}).values()
                         if isinstance(p, dict) and num(p.get("seconds"))), default=0.0)
    stale_limit = max(stale_after, 1.5 * longest_phase)
    decision = decide(Evidence(
        last_attempt=attempt, holder=run.holder, heartbeat=run.heartbeat, heartbeat_age=heartbeat_age,
        epochs_done=len(epochs), num_epochs=num_epochs, has_data=bool(run.events or run.metrics.records),
        activity_age=None if activity_t is None else now - activity_t, activity_source=activity_src,
        stale_limit=stale_limit))

    compiling = open_compile(attempt, now if decision.state == "running" else max((s.time for s in attempt),
                                                                                   default=now))
    if compiling is not None:
        phase_detail = compiling.text

    rate, epoch_s, rate_basis = throughput(epochs)
    eta = None
    if decision.state in ("running", "stopped") and epoch_s is not None and num_epochs is not None:
        eta = max(0, num_epochs - len(epochs)) * epoch_s
    reward, curve = reward_summary(epochs)
    table = epoch_table(epochs)
    m = run.metrics
    return Facts(
        run_dir=run.run_dir,
        run_name=get(cfg, "run_name") or Path(run.run_dir).name,
        topology=get(cfg, "tpu_topology.name"),
        samples_per_epoch_config=(batch * nbatches if isinstance(batch, int) and isinstance(nbatches, int)
                                  else None),
        state=decision.state,
        stop_reason=decision.stop_reason,
        state_label=decision.state if decision.stop_reason is None else f"{decision.state} ({decision.stop_reason})",
        rule=decision.rule,
        decided_by=decision.decided_by,
        now=now,
        attempts=len(runs),
        live_process=run.holder,
        heartbeat_age_s=heartbeat_age,
        num_epochs=num_epochs,
        epochs_done=len(epochs),
        current_epoch=current_epoch,
        phase=phase,
        phase_detail=phase_detail,
        compiling=compiling,
        optimizer_steps_in_epoch=steps_now,
        optimizer_steps_per_epoch=steps_per_epoch,
        global_step=next((r.get("global_step") for r in reversed(m.records)
                          if isinstance(r.get("global_step"), int)), None),
        last_event_time=last_event_time,
        last_event_kind=last_kind,
        last_event_age_s=None if last_event_time is None else now - last_event_time,
        epoch_seconds_total=sum(x.seconds or 0.0 for x in table) if table else None,
        train_log_mtime=run.log.mtime,
        train_log_tail=tuple(run.log.lines),
        stale_after_s=stale_limit,
        samples_per_s=rate,
        epoch_seconds_mean=epoch_s,
        rate_basis=rate_basis,
        eta_s=eta,
        eta_time=None if eta is None else now + eta,
        reward=reward,
        reward_curve=curve,
        epochs=table,
        last_error=last_error(runs),
        events=tuple({"time": s.time, **s.event.record()} for s in run.events[-5:]),
        recent_events=tuple([t for t in (_text(s.event) for s in attempt) if t][-20:]),
        checkpoints=checkpoint_summary(run.checkpoints, run.events),
        host_time=host_time(epochs, device_is_host(cfg)),
        parity=parity_summary(run.parity),
        state_layout=run.layout,
        metrics=MetricsSummary(len(m.records), dict(m.kinds), m.bad_lines, m.truncated_last_line),
        notes=_notes(run),
        evaluations=eval_table(run.evaluations),
    )
