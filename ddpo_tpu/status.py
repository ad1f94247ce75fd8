"""Where a run stands: `python -m ddpo_tpu.status RUN_DIR [--json | --brief] [--events N]` (console script
`ddpo-status`).

Three steps: read what the run leaves in its directory (`read_run`: config.yaml, events.jsonl, metrics.jsonl,
heartbeat.json, parity.json, checkpoints/, the end of train.log, and whether a live process holds the run's lock),
derive the facts from those values (`derive`: a pure function, `now` passed in), render them (`render`, `render_brief`,
or JSON). Never imports torch and never touches a device, so it is instant and works on a machine without the training
dependencies (it needs PyYAML and rich only).

The state comes from events (ddpo_tpu/events.py), never from console text. events.jsonl is appended by every attempt
of a run: the front end writes `worker_started` when it starts the training process and `worker_exited` (its exit
code) when it ends, whatever ended it; the training process writes `run_start`, the progress of each epoch, and
`run_complete`, `preempted` or `error`. An attempt opens at `worker_started` (or at a `run_start` that follows another
attempt's). Only the last attempt decides the state; an error of an earlier attempt is reported, not held against a
run that went on. The first rule that holds decides (the output names it):

  rule             state
  error_event      failed       the last attempt has an `error` event
  exit_code        failed       the last attempt ended with an exit code other than 0 and 75 (`worker_exited`)
  preempted        stopped      the last attempt has a `preempted` event or ended with exit 75 (the same command
                                resumes)
  complete         finished     the last attempt has `run_complete` or `already_complete`, or ended with exit 0
  lock_holder      running      a live process holds the run's lock (run_dir/lock or this host's accelerator lock)
  heartbeat_dead   stopped      heartbeat.json is older than 60 s and no live process holds the lock: killed (SIGKILL,
                                OOM, a lost host) with no exit recorded
  all_epochs       finished     every epoch has its metrics line, and no process is alive
  not_started      not started  no event and no metrics, and nothing written recently
  recent_activity  running      something was written within the staleness threshold (no lock holder seen on this
                                host: the run may live on another one)
  no_activity      stopped      nothing written for longer than the staleness threshold

Numbers (epochs, rewards, throughput, ETA) come from metrics.jsonl, where an epoch logged twice by a resumed run counts
once (the later line wins). The last lines of train.log are shown to people, never read for the state.

Exit codes: 0 the run dir exists and has config.yaml (whatever the run's state); 2 otherwise.
"""

from __future__ import annotations

import argparse
import json
import math
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddpo_tpu import events as ev

__all__ = ["RunFiles", "Stamped", "collect", "derive", "main", "read_metrics", "read_run", "render", "render_brief",
           "sparkline"]

EXIT_OK = 0
EXIT_NO_RUN = 2

BLOCKS = "▁▂▃▄▅▆▇█"
ASCII_BLOCKS = "_.-:=+*#"
HEARTBEAT_FILE = "heartbeat.json"  # ddpo_tpu.rundir.HEARTBEAT_FILE (not imported: rundir needs numpy)
LOG_TAIL_BYTES = 64 << 10          # the end of train.log, shown to people
LOG_TAIL_LINES = 8
DEFAULT_STALE_S = 900.0            # a first XLA compile can be silent for many minutes
HEARTBEAT_DEAD_S = 60.0            # the training process rewrites heartbeat.json every 10 s, even while compiling
RATE_WINDOW = 5                    # epochs averaged for samples/s and the ETA
EXIT_PREEMPTED = 75                # ddpo_tpu.launch.process.EXIT_PREEMPTED
METRICS_KINDS = ("step", "epoch", "eval", "event")


# --- reading the run dir (the only I/O) -------------------------------------------------------------------------------

@dataclass
class Metrics:
    records: list[dict[str, Any]] = field(default_factory=list)
    bad_lines: int = 0                 # unparseable lines other than a truncated last one
    truncated_last_line: bool = False  # the writer was killed mid-line
    kinds: dict[str, int] = field(default_factory=dict)


def read_metrics(path: Path) -> Metrics:
    m = Metrics()
    try:
        text = Path(path).read_bytes().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return m
    lines = text.split("\n")
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            rec = None
            if i == len(lines) - 1:  # no newline after it: cut short by a kill
                m.truncated_last_line = True
                continue
        if not isinstance(rec, dict):
            m.bad_lines += 1
            continue
        kind = str(rec.get("kind", "?"))
        m.kinds[kind] = m.kinds.get(kind, 0) + 1
        m.records.append(rec)
    return m


@dataclass(frozen=True)
class Stamped:
    """An event and when it was written."""

    time: float
    event: ev.Event


@dataclass
class LogTail:
    mtime: float | None = None
    size: int = 0
    lines: list[str] = field(default_factory=list)  # the last non-empty lines, for people


@dataclass
class RunFiles:
    """What `read_run` found: every input of `derive`, as plain values."""

    run_dir: str = "run"
    cfg: dict[str, Any] = field(default_factory=dict)
    events: list[Stamped] = field(default_factory=list)
    has_events_file: bool = True
    unknown_events: dict[str, int] = field(default_factory=dict)
    metrics: Metrics = field(default_factory=Metrics)
    heartbeat: dict[str, Any] | None = None
    holder: dict[str, Any] | None = None           # a live process holding the run's lock
    log: LogTail = field(default_factory=LogTail)
    checkpoints: list[tuple[str, float]] = field(default_factory=list)  # (name, mtime), oldest first
    parity: list[dict[str, Any]] | None = None
    notes: list[str] = field(default_factory=list)


def read_run(run_dir: Path, lock_paths: list[Path] | None = None) -> RunFiles:
    """Everything `derive` needs from the run dir. Raises FileNotFoundError when there is no run here."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir}: no such directory")
    if not (run_dir / "config.yaml").is_file():
        raise FileNotFoundError(f"{run_dir}: no config.yaml here, so not a ddpo_tpu run dir "
                                "(the launcher writes it before starting the training process)")
    run = RunFiles(run_dir=str(run_dir))
    run.cfg = _read_config(run_dir / "config.yaml", run.notes)
    run.events, run.unknown_events = _read_events(run_dir / ev.EVENTS_FILE)
    run.has_events_file = (run_dir / ev.EVENTS_FILE).is_file()
    run.metrics = read_metrics(run_dir / "metrics.jsonl")
    run.heartbeat = read_heartbeat(run_dir)
    run.holder = find_live_holder(run_dir, run.cfg, lock_paths)
    run.log = read_log_tail(run_dir / "train.log")
    run.checkpoints = _list_checkpoints(run_dir / "checkpoints")
    run.parity = _read_json_list(run_dir / "parity.json")
    return run


def _read_config(path: Path, notes: list[str]) -> dict[str, Any]:
    import yaml

    try:
        cfg = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        notes.append(f"config.yaml unreadable: {type(e).__name__}: {e}")
        return {}
    return cfg if isinstance(cfg, dict) else {}


def _read_events(path: Path) -> tuple[list[Stamped], dict[str, int]]:
    out, unknown = [], {}
    for rec in ev.read_events(path):
        event = ev.parse(rec)
        t = _num(rec.get("time"))
        if event is None or t is None:
            unknown[rec["event"]] = unknown.get(rec["event"], 0) + 1
            continue
        out.append(Stamped(t, event))
    return out, unknown


def read_heartbeat(run_dir: Path) -> dict | None:
    """heartbeat.json as the training process last wrote it ({"time", "pid", "hostname", "interval_s"}), or None
    (no such file: a run from before heartbeats, or one that has not started its training process)."""
    try:
        data = json.loads((Path(run_dir) / HEARTBEAT_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or _num(data.get("time")) is None:
        return None
    return data


def read_log_tail(path: Path, lines: int = LOG_TAIL_LINES, max_bytes: int = LOG_TAIL_BYTES) -> LogTail:
    """The last lines of train.log, to show (progress bars' carriage returns end lines too)."""
    try:
        st = path.stat()
        with open(path, "rb") as f:
            f.seek(max(0, st.st_size - max_bytes))
            data = f.read(max_bytes).decode("utf-8", errors="replace")
    except FileNotFoundError:
        return LogTail()
    text = [x.rstrip() for x in data.replace("\r\n", "\n").replace("\r", "\n").split("\n")]
    if st.st_size > max_bytes:
        text = text[1:]  # the first one is cut
    return LogTail(st.st_mtime, st.st_size, [x for x in text if x.strip()][-lines:])


def _list_checkpoints(path: Path) -> list[tuple[str, float]]:
    try:
        entries = [(p.name, p.stat().st_mtime) for p in path.iterdir() if not p.name.startswith(".")]
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(entries, key=lambda x: x[1])


def _read_json_list(path: Path) -> list | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, list) else None


def find_live_holder(run_dir: Path, cfg: dict, lock_paths: list[Path] | None = None) -> dict | None:
    """A live process that holds a lock naming this run dir: run_dir/lock, or this host's accelerator lock.

    Only positive evidence: locks are per host, so a free lock says nothing when the run lives on another machine."""
    from ddpo_tpu.launch.lock import AcceleratorLock, run_dir_lock_path

    own = run_dir_lock_path(run_dir)
    if lock_paths is None:
        lock_paths = [own, *_accelerator_lock_paths(cfg)]
    here = run_dir.resolve()
    for path in lock_paths:
        try:
            holder = AcceleratorLock.holder(path)
        except OSError:  # unreadable lock file: no evidence either way
            continue
        if holder is None or (path != own and Path(holder.run_dir).resolve() != here):
            continue
        return {"pid": holder.pid, "hostname": holder.hostname, "lock": str(path), "started": holder.started,
                "this_host": holder.hostname == socket.gethostname()}
    return None


def _accelerator_lock_paths(cfg: dict) -> list[Path]:
    accelerator = _get(cfg, "tpu_topology.accelerator")
    if not isinstance(accelerator, str) or not accelerator:
        return []
    from ddpo_tpu.launch.env import cache_root  # the one module that reads the environment
    from ddpo_tpu.launch.lock import default_lock_path

    return [default_lock_path(cache_root(), accelerator)]


# --- deriving the facts (pure: no I/O, no clock) ----------------------------------------------------------------------

def _get(tree: Any, dotted: str, default: Any = None) -> Any:
    for part in dotted.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return default
        tree = tree[part]
    return tree


def _num(x: Any) -> float | None:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return None if math.isnan(x) or math.isinf(x) else float(x)


def attempts(events: list[Stamped]) -> list[list[Stamped]]:
    """The events split by attempt: one opens at `worker_started`, or at a `run_start` after another attempt's
    `run_start` or `worker_exited` (a training process started without the front end, or by an older one)."""
    out: list[list[Stamped]] = []
    for s in events:
        e = s.event
        opens = not out or isinstance(e, ev.WorkerStarted) or (
            isinstance(e, ev.RunStart) and any(isinstance(x.event, (ev.RunStart, ev.WorkerExited)) for x in out[-1]))
        if opens:
            out.append([s])
        else:
            out[-1].append(s)
    return out


def _last(attempt: list[Stamped], *kinds: type) -> ev.Event | None:
    return next((s.event for s in reversed(attempt) if isinstance(s.event, kinds)), None)


@dataclass(frozen=True)
class Decision:
    state: str                 # finished | failed | stopped | running | not started
    rule: str                  # which rule fired (the table in the module docstring)
    decided_by: str            # the same, for people
    stop_reason: str | None = None


@dataclass(frozen=True)
class Evidence:
    """What the state is decided from."""

    last_attempt: list[Stamped]
    holder: dict | None
    heartbeat: dict | None
    heartbeat_age: float | None
    epochs_done: int
    num_epochs: int | None
    has_data: bool                   # any event or metrics record
    activity_age: float | None       # since anything was last written
    activity_source: str | None
    stale_limit: float


def decide(x: Evidence) -> Decision:
    """The state: the first rule of the module docstring's table that holds."""
    for rule in _RULES:
        d = rule(x)
        if d is not None:
            return d
    raise AssertionError("no_activity always holds")  # pragma: no cover


def _rule_error_event(x: Evidence) -> Decision | None:
    err = _last(x.last_attempt, ev.Failed)
    if err is None:
        return None
    return Decision("failed", "error_event", f"the training process reported an error: {err.message}")


def _rule_exit_code(x: Evidence) -> Decision | None:
    ended = _last(x.last_attempt, ev.WorkerExited)
    if ended is None or ended.code in (0, EXIT_PREEMPTED):
        return None
    how = ended.message or f"exited with code {ended.code}"
    return Decision("failed", "exit_code", f"the training process {how} (exit {ended.code}, recorded by the front "
                                           "end; train.log has the reason)")


def _rule_preempted(x: Evidence) -> Decision | None:
    pre = _last(x.last_attempt, ev.Preempted)
    ended = _last(x.last_attempt, ev.WorkerExited)
    if pre is None and (ended is None or ended.code != EXIT_PREEMPTED):
        return None
    why = f"preempted: {pre.message}" if pre is not None else f"the training process exited {EXIT_PREEMPTED}"
    why += " (the same command resumes)"
    if x.holder is not None and ended is None:
        why += f"; pid {x.holder['pid']} still holds the lock (writing its checkpoint?)"
    return Decision("stopped", "preempted", why, "preempted")


def _rule_complete(x: Evidence) -> Decision | None:
    done = _last(x.last_attempt, ev.RunComplete, ev.AlreadyComplete)
    ended = _last(x.last_attempt, ev.WorkerExited)
    if done is not None:
        return Decision("finished", "complete", f"the last attempt ended with a {done.kind} event")
    if ended is not None and ended.code == 0:
        return Decision("finished", "complete", "the training process exited 0")
    return None


def _rule_lock_holder(x: Evidence) -> Decision | None:
    h = x.holder
    if h is None:
        return None
    where = "" if h.get("this_host", True) else f" on {h.get('hostname')}"
    return Decision("running", "lock_holder", f"pid {h['pid']}{where} holds the lock {h['lock']}; last write "
                                              f"{_ago(x.activity_age)} ({x.activity_source})")


def _rule_heartbeat_dead(x: Evidence) -> Decision | None:
    if x.heartbeat_age is None or x.heartbeat_age <= HEARTBEAT_DEAD_S:
        return None
    hb = x.heartbeat or {}
    return Decision("stopped", "heartbeat_dead",
                    f"the training process's heartbeat is {_duration(x.heartbeat_age)} old (written every "
                    f"{_duration(_num(hb.get('interval_s')))} while it lives; pid {hb.get('pid')}) and no live "
                    "process holds the run's lock: killed (SIGKILL, OOM, a lost host) without an exit recorded",
                    "dead")


def _rule_all_epochs(x: Evidence) -> Decision | None:
    if x.num_epochs is None or x.epochs_done < max(1, x.num_epochs):
        return None
    return Decision("finished", "all_epochs", f"all {x.num_epochs} epochs have a metrics line (no run_complete "
                                              "event)")


def _rule_not_started(x: Evidence) -> Decision | None:
    if x.has_data or (x.activity_age is not None and x.activity_age <= x.stale_limit):
        return None
    return Decision("not started", "not_started", "no event and no metrics written yet")


def _rule_recent_activity(x: Evidence) -> Decision | None:
    if x.activity_age is None or x.activity_age > x.stale_limit:
        return None
    return Decision("running", "recent_activity",
                    f"last write {_ago(x.activity_age)} ({x.activity_source}; within the {_duration(x.stale_limit)} "
                    "staleness threshold); no live lock holder seen on this host")


def _rule_no_activity(x: Evidence) -> Decision:
    return Decision("stopped", "no_activity",
                    f"nothing written for {_duration(x.activity_age)} (threshold {_duration(x.stale_limit)}), no exit "
                    "recorded and no live lock holder on this host: killed, hung, or running on another host",
                    "no activity")


_RULES = (_rule_error_event, _rule_exit_code, _rule_preempted, _rule_complete, _rule_lock_holder,
          _rule_heartbeat_dead, _rule_all_epochs, _rule_not_started, _rule_recent_activity, _rule_no_activity)
RULES = tuple(r.__name__.removeprefix("_rule_") for r in _RULES)


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
        first = {"sampling": "sampling batch 1 (none done yet)", "evaluation": "evaluating the fixed prompts"}
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
    start = _last(attempt, ev.RunStart)
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


def open_compile(attempt: list[Stamped], until: float) -> dict | None:
    """The compile in progress in an attempt (a compile_start with no compile_end after it), timed up to `until`
    (now for a running run, else its last event), or None."""
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
    return {"epoch": e.epoch, "stage": e.stage, "index": e.index, "of": e.of, "seconds": seconds,
            "compilations": done, "text": e.live(seconds, done).removeprefix(f"[epoch {e.epoch}] ")}


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


def _phase_seconds(rec: dict) -> float | None:
    phases = rec.get("phases")
    if not isinstance(phases, dict):
        return None
    secs = [_num(p.get("seconds")) for p in phases.values() if isinstance(p, dict)]
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
    return (_get(cfg, "tpu_topology.accelerator") == "cpu"
            and _get(cfg, "tpu_topology.execution") in ("eager", "distributed"))


def host_time(epochs: list[dict], on_host: bool = False) -> dict | None:
    """The newest epoch's main-thread CPU seconds against wall seconds, per phase: a phase whose host time is near
    its wall time is bound by tracing and dispatch on the host, not by the devices (unless `on_host`: the device
    is the host CPU, see device_is_host)."""
    for e in reversed(epochs):
        phases = e.get("phases")
        if not isinstance(phases, dict):
            continue
        rows = {k: (_num(p.get("host_seconds")), _num(p.get("seconds"))) for k, p in phases.items()
                if isinstance(p, dict)}
        rows = {k: v for k, v in rows.items() if v[0] is not None and v[1] is not None}
        if rows:
            host, wall = sum(h for h, _ in rows.values()), sum(w for _, w in rows.values())
            return {"epoch": e.get("epoch"), "host_s": host, "wall_s": wall, "device_is_host": on_host,
                    "fraction": host / wall if wall > 0 else None,
                    "phases": {k: {"host_s": h, "wall_s": w} for k, (h, w) in rows.items()}}
    return None


def reward_summary(epochs: list[dict]) -> tuple[dict | None, list[float]]:
    valid = [(e["epoch"], r) for e, r in ((e, _num(e.get("reward_mean"))) for e in epochs) if r is not None]
    if not valid:
        return None, []
    best = max(valid, key=lambda x: x[1])
    return ({"first": valid[0][1], "last": valid[-1][1], "best": best[1], "best_epoch": best[0],
             "first_epoch": valid[0][0], "last_epoch": valid[-1][0]}, [r for _, r in valid])


def epoch_table(epochs: list[dict]) -> list[dict]:
    return [{"epoch": e["epoch"], "reward_mean": _num(e.get("reward_mean")), "reward_std": _num(e.get("reward_std")),
             "approx_kl": _num(e.get("approx_kl")), "clipfrac": _num(e.get("clipfrac")), "loss": _num(e.get("loss")),
             "new_compilations": e.get("new_compilations"), "num_samples": e.get("num_samples"),
             "seconds": _phase_seconds(e), "time": _num(e.get("time"))} for e in epochs]


def last_error(runs: list[list[Stamped]]) -> dict | None:
    """The newest attempt's error (its `error` event, else a failing exit code) and whether it is the last attempt's."""
    for i in range(len(runs) - 1, -1, -1):
        err = _last(runs[i], ev.Failed)
        ended = _last(runs[i], ev.WorkerExited)
        if err is not None:
            line = f"error: {err.message}"
        elif ended is not None and ended.code not in (0, EXIT_PREEMPTED):
            line = f"the training process {ended.message or f'exited with code {ended.code}'}"
        else:
            continue
        return {"line": line, "current_attempt": i == len(runs) - 1}
    return None


def _text(event: ev.Event) -> str | None:
    """An event's console text; None when a record from another version cannot be rendered (a null number)."""
    try:
        return event.text()
    except (TypeError, ValueError, KeyError):
        return None


def checkpoint_summary(entries: list[tuple[str, float]], events: list[Stamped]) -> dict | None:
    saved = [s for s in events if isinstance(s.event, ev.CheckpointSaved)]
    if not entries and not saved:
        return None
    last = None if not saved else {"time": saved[-1].time, **saved[-1].event.record()}
    return {"count": len(entries), "latest": entries[-1][0] if entries else None,
            "latest_time": entries[-1][1] if entries else None, "last_event": last}


def parity_summary(rows: list | None) -> dict | None:
    if rows is None:
        return None
    return {"constraints": len(rows),
            "failing": [r.get("constraint") for r in rows if isinstance(r, dict) and r.get("ok") is False]}


def _notes(run: RunFiles) -> list[str]:
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
    return notes


def _activity(run: RunFiles, last_event_time: float | None) -> tuple[float | None, str | None]:
    """When anything was last written, and what."""
    seen = [(t, src) for t, src in ((last_event_time, "event"), (run.log.mtime, "train.log write"),
                                    (_num((run.heartbeat or {}).get("time")), "heartbeat")) if t is not None]
    return max(seen) if seen else (None, None)


def derive(run: RunFiles, now: float, stale_after: float = DEFAULT_STALE_S) -> dict[str, Any]:
    """Every fact the report shows, as a JSON-able dict, from what `read_run` found. Pure: `now` is passed in."""
    cfg = run.cfg
    num_epochs = _get(cfg, "num_epochs")
    num_epochs = num_epochs if isinstance(num_epochs, int) and not isinstance(num_epochs, bool) else None
    batch, nbatches = _get(cfg, "sample.batch_size"), _get(cfg, "sample.num_batches_per_epoch")
    epochs = epochs_of(run.metrics)
    runs = attempts(run.events)
    attempt = runs[-1] if runs else []

    current_epoch, phase, phase_detail = locate(attempt, epochs, num_epochs)
    steps_now, steps_per_epoch = optimizer_steps(run.metrics, epochs, current_epoch)
    progress = _last(attempt, ev.TrainingProgress, ev.TrainingBatch)
    progress = progress if progress is not None and progress.epoch == current_epoch else None
    if progress is not None and steps_now is not None:  # its count can be newer than the step lines
        steps_now = max(steps_now, progress.updates)
    if phase == "training" and steps_now is not None:
        phase_detail = (f"training, optimizer step {steps_now}" + (f"/{steps_per_epoch}" if steps_per_epoch else "")
                        + " done" + (f" ({progress.done}/{progress.total} timesteps)" if progress else ""))

    stamps = [(s.time, s.event.kind) for s in run.events] + [
        (t, f"metrics.jsonl {r.get('kind')} line") for r in run.metrics.records if (t := _num(r.get("time")))]
    last_event_time, last_kind = max(stamps, key=lambda x: x[0]) if stamps else (None, None)
    activity_t, activity_src = _activity(run, last_event_time)
    heartbeat_age = None if run.heartbeat is None else now - run.heartbeat["time"]
    longest_phase = max((float(p["seconds"]) for e in epochs for p in (e.get("phases") or {}).values()
                         if isinstance(p, dict) and _num(p.get("seconds"))), default=0.0)
    stale_limit = max(stale_after, 1.5 * longest_phase)
    decision = decide(Evidence(
        last_attempt=attempt, holder=run.holder, heartbeat=run.heartbeat, heartbeat_age=heartbeat_age,
        epochs_done=len(epochs), num_epochs=num_epochs, has_data=bool(run.events or run.metrics.records),
        activity_age=None if activity_t is None else now - activity_t, activity_source=activity_src,
        stale_limit=stale_limit))

    compiling = open_compile(attempt, now if decision.state == "running" else max((s.time for s in attempt),
                                                                                   default=now))
    if compiling is not None:
        phase_detail = compiling["text"]

    rate, epoch_s, rate_basis = throughput(epochs)
    eta = None
    if decision.state in ("running", "stopped") and epoch_s is not None and num_epochs is not None:
        eta = max(0, num_epochs - len(epochs)) * epoch_s
    reward, curve = reward_summary(epochs)
    table = epoch_table(epochs)
    return {
        "run_dir": run.run_dir,
        "run_name": _get(cfg, "run_name") or Path(run.run_dir).name,
        "topology": _get(cfg, "tpu_topology.name"),
        "samples_per_epoch_config": (batch * nbatches if isinstance(batch, int) and isinstance(nbatches, int)
                                     else None),
        "state": decision.state,
        "stop_reason": decision.stop_reason,
        "state_label": decision.state if decision.stop_reason is None else f"{decision.state} ({decision.stop_reason})",
        "rule": decision.rule,
        "decided_by": decision.decided_by,
        "now": now,
        "attempts": len(runs),
        "live_process": run.holder,
        "heartbeat_age_s": heartbeat_age,
        "num_epochs": num_epochs,
        "epochs_done": len(epochs),
        "current_epoch": current_epoch,
        "phase": phase,
        "phase_detail": phase_detail,
        "compiling": compiling,
        "optimizer_steps_in_epoch": steps_now,
        "optimizer_steps_per_epoch": steps_per_epoch,
        "global_step": next((r.get("global_step") for r in reversed(run.metrics.records)
                             if isinstance(r.get("global_step"), int)), None),
        "last_event_time": last_event_time,
        "last_event_kind": last_kind,
        "last_event_age_s": None if last_event_time is None else now - last_event_time,
        "epoch_seconds_total": sum(x["seconds"] or 0.0 for x in table) if table else None,
        "train_log_mtime": run.log.mtime,
        "train_log_tail": run.log.lines,
        "stale_after_s": stale_limit,
        "samples_per_s": rate,
        "epoch_seconds_mean": epoch_s,
        "rate_basis": rate_basis,
        "eta_s": eta,
        "eta_time": None if eta is None else now + eta,
        "reward": reward,
        "reward_curve": curve,
        "epochs": table,
        "last_error": last_error(runs),
        "events": [{"time": s.time, **s.event.record()} for s in run.events[-5:]],
        "recent_events": [t for t in (_text(s.event) for s in attempt) if t][-20:],
        "checkpoints": checkpoint_summary(run.checkpoints, run.events),
        "host_time": host_time(epochs, device_is_host(cfg)),
        "parity": parity_summary(run.parity),
        "metrics": {"records": len(run.metrics.records), "kinds": run.metrics.kinds,
                    "bad_lines": run.metrics.bad_lines, "truncated_last_line": run.metrics.truncated_last_line},
        "notes": _notes(run),
    }


def collect(run_dir: Path, now: float | None = None, stale_after: float = DEFAULT_STALE_S,
            lock_paths: list[Path] | None = None) -> dict[str, Any]:
    """read_run + derive. Raises FileNotFoundError when there is no run here. A gs:// run dir is read from the
    bucket (its files copied into a temporary dir first, ddpo_tpu/storage.py)."""
    if str(run_dir).startswith("gs://"):
        run = _read_bucket_run(str(run_dir))
    else:
        run = read_run(Path(run_dir), lock_paths)
    return derive(run, time.time() if now is None else now, stale_after)


def _read_bucket_run(url: str) -> RunFiles:
    """read_run of the bucket's copy; a live holder of the run's lock is looked for in this host's staging dir."""
    import tempfile

    from ddpo_tpu import storage

    problem = storage.url_problem(url)
    if problem is not None:
        raise FileNotFoundError(f"{url}: {problem[0]}")
    if storage.gcsfs_missing():
        raise FileNotFoundError(f"{url}: gcsfs is not installed ({storage.INSTALL_FIX})")
    with tempfile.TemporaryDirectory(prefix="ddpo-status-") as tmp:
        run = read_run(storage.snapshot(url, Path(tmp)), lock_paths=[])
    run.run_dir = url.rstrip("/")
    parts = storage.parse(url)
    root = str(run.cfg.get("output_root") or "")
    if storage.is_url(root) and storage.url_problem(root) is None:
        rel = parts.path[len(storage.parse(root).path):].strip("/")
        staging = Path(storage.local_root(root)) / rel
        if (staging / "config.yaml").is_file():
            run.holder = find_live_holder(staging, run.cfg)
    return run


# --- the report ---------------------------------------------------------------------------------------------------

def _ago(seconds: float | None) -> str:
    return "?" if seconds is None else f"{_duration(max(0.0, seconds))} ago"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    s = int(round(seconds))
    if s < 90:
        return f"{seconds:.0f} s" if seconds >= 10 else f"{seconds:.1f} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    if s < 86400:
        return f"{s // 3600} h {s % 3600 // 60:02d} min"
    return f"{s // 86400} d {s % 86400 // 3600} h"


def _clock(t: float | None) -> str | None:
    return None if t is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def sparkline(values: list[float], width: int = 60, blocks: str = BLOCKS) -> str:
    """One character per value (values averaged into `width` buckets when there are more)."""
    vals = [v for v in values if v is not None and not math.isnan(v)]
    if not vals:
        return ""
    width = max(1, width)
    if len(vals) > width:
        n = len(vals)
        vals = [sum(vals[i * n // width:(i + 1) * n // width]) / len(vals[i * n // width:(i + 1) * n // width])
                for i in range(width)]
    lo, hi = min(vals), max(vals)
    if hi - lo <= 1e-12 * max(1.0, abs(hi)):
        return blocks[len(blocks) // 2 - 1] * len(vals)
    top = len(blocks) - 1
    return "".join(blocks[min(top, int(round((v - lo) / (hi - lo) * top)))] for v in vals)


def _fmt(x: Any, spec: str = ".4f") -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        if x != 0 and (abs(x) < 1e-3 or abs(x) >= 1e5):
            return f"{x:.2e}"
        return format(x, spec)
    return str(x)


def _progress_text(facts: dict[str, Any]) -> str:
    n, done, cur = facts["num_epochs"], facts["epochs_done"], facts["current_epoch"]
    text = f"{done}/{n if n is not None else '?'} epochs done"
    if facts["state"] not in ("finished", "not started") and cur is not None:
        text += f"; epoch {cur}" + (f" (#{cur + 1} of {n})" if n else "")
    return text


def render_brief(facts: dict[str, Any], events: int = 0, out=None) -> None:
    """One line (run, state, progress, phase, last write), then the text of the last `events` events."""
    out = out or sys.stdout
    parts = [f"{facts['run_name']}: {facts['state_label']}", _progress_text(facts)]
    if facts["phase_detail"] and facts["state"] not in ("finished", "not started"):
        parts.append(facts["phase_detail"])
    if facts["last_event_time"] is not None:
        parts.append(f"last event {_ago(facts['last_event_age_s'])}")
    err = facts.get("last_error")
    if err and err["current_attempt"]:
        parts.append(err["line"])
    print("; ".join(parts), file=out)
    for line in facts["recent_events"][-events:] if events > 0 else []:
        print("  " + line.replace("\n", "\n  "), file=out)


def render(facts: dict[str, Any], width: int = 60, rows: int = 10, events: int = 0, console: Any = None) -> None:
    from rich.console import Console
    from rich.text import Text

    console = console or Console(highlight=False)
    enc = getattr(console.file, "encoding", None) or "utf-8"
    try:
        BLOCKS.encode(enc)
        blocks = BLOCKS
    except (UnicodeEncodeError, LookupError):
        blocks = ASCII_BLOCKS

    def row(key: str, value: Any, style: str = "") -> None:
        t = Text(f"{key:<12}", style="dim")
        t.append(str(value), style=style)
        console.print(t, soft_wrap=True)

    head = Text(facts["run_name"], style="bold")
    if facts.get("topology"):
        head.append(f"  ({facts['topology']})", style="dim")
    head.append(f"  {facts['run_dir']}", style="dim")
    console.print(head, soft_wrap=True)
    _render_state(facts, row)
    _render_files(facts, row)
    if events > 0 and facts["recent_events"]:
        console.print(Text("recent events", style="dim"))
        for line in facts["recent_events"][-events:]:
            console.print(Text("  " + line.replace("\n", "\n  ")), soft_wrap=True)
    if facts["state"] == "failed" and facts["train_log_tail"]:
        console.print(Text("train.log ends:", style="dim"))
        for line in facts["train_log_tail"]:
            console.print(Text("  " + line, style="red"), soft_wrap=True)
    _render_rewards(facts, console, width, rows, blocks)
    for note in facts["notes"]:
        console.print(Text(f"note: {note}", style="yellow"), soft_wrap=True)


def _render_state(facts: dict[str, Any], row) -> None:
    colour = {"running": "bold cyan", "finished": "bold green", "failed": "bold red", "stopped": "bold yellow",
              "not started": "bold"}.get(facts["state"], "bold")
    row("state", facts["state_label"], colour)
    row("decided by", f"{facts['decided_by']} [{facts['rule']}]")
    prog = _progress_text(facts)
    if facts.get("global_step") is not None:
        prog += f"; global step {facts['global_step']}"
    row("progress", prog)
    if facts["phase_detail"] and facts["state"] != "finished":
        row("phase", facts["phase_detail"] if facts["state"] == "running" else f"last seen: {facts['phase_detail']}")
    if facts["last_event_time"] is not None:
        row("last event", f"{_clock(facts['last_event_time'])} ({_ago(facts['last_event_age_s'])}, "
                          f"{facts['last_event_kind']})")
    if facts["state"] == "finished" and facts["epoch_seconds_total"]:
        row("took", f"{_duration(facts['epoch_seconds_total'])} in {facts['epochs_done']} epochs "
                    "(sum of phase seconds; model loading not included)")
    if facts["train_log_mtime"] is not None:
        row("train.log", f"written {_ago(facts['now'] - facts['train_log_mtime'])}")
    if facts["samples_per_s"] is not None:
        row("throughput", f"{facts['samples_per_s']:.2f} samples/s, {_duration(facts['epoch_seconds_mean'])}/epoch "
                          f"(phase seconds, {facts['rate_basis']})")
    ht = facts.get("host_time")
    if ht and ht["fraction"] is not None:
        big = sorted(ht["phases"].items(), key=lambda kv: -kv[1]["wall_s"])[:2]
        row("host time", f"{ht['fraction']:.0%} of epoch {ht['epoch']} on the main thread "
                         f"({ht['host_s']:.1f} of {ht['wall_s']:.1f} s; "
                         + ", ".join(f"{k} {v['host_s']:.1f}/{v['wall_s']:.1f} s" for k, v in big)
                         + (")" if not ht.get("device_is_host") else "; the CPU is the device here)")
                         + (": host-bound" if ht["fraction"] > 0.8 and not ht.get("device_is_host") else ""))
    if facts["eta_s"] is not None:
        left = (facts["num_epochs"] or 0) - facts["epochs_done"]
        row("ETA", f"{_duration(facts['eta_s'])} ({left} epochs x {_duration(facts['epoch_seconds_mean'])}), "
                   f"around {_clock(facts['eta_time'])}" + ("" if facts["state"] == "running" else " if resumed now"))


def _render_files(facts: dict[str, Any], row) -> None:
    ck = facts.get("checkpoints")
    if ck:
        text = f"{ck['count']} in checkpoints/"
        if ck["latest"]:
            text += f", latest {ck['latest']} ({_ago(facts['now'] - ck['latest_time'])})"
        row("checkpoints", text)
    par = facts.get("parity")
    if par:
        row("parity", "ok" if not par["failing"] else "NOT met: " + ", ".join(map(str, par["failing"])),
            "" if not par["failing"] else "yellow")
    err = facts.get("last_error")
    if err:
        row("last error", err["line"] + ("" if err["current_attempt"] else "  (earlier attempt; the run went on)"),
            "red" if err["current_attempt"] else "dim red")


def _render_rewards(facts: dict[str, Any], console, width: int, rows: int, blocks: str) -> None:
    from rich import box
    from rich.table import Table
    from rich.text import Text

    rw = facts.get("reward")
    if rw:
        console.print()
        t = Text("reward      ", style="dim")
        t.append(sparkline(facts["reward_curve"], width, blocks), style="green")
        console.print(t, soft_wrap=True)
        console.print(Text(f"{'':12}first {_fmt(rw['first'])} (epoch {rw['first_epoch']})  "
                           f"last {_fmt(rw['last'])} (epoch {rw['last_epoch']})  "
                           f"best {_fmt(rw['best'])} (epoch {rw['best_epoch']})"), soft_wrap=True)
    if facts["epochs"]:
        shown = facts["epochs"][-rows:] if rows > 0 else facts["epochs"]
        title = None if len(shown) == len(facts["epochs"]) else f"last {len(shown)} of {len(facts['epochs'])} epochs"
        table = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False)
        for col in ("epoch", "reward mean", "reward std", "approx_kl", "clipfrac", "compiles", "seconds"):
            table.add_column(col, justify="right")
        for e in shown:
            table.add_row(str(e["epoch"]), _fmt(e["reward_mean"]), _fmt(e["reward_std"]), _fmt(e["approx_kl"]),
                          _fmt(e["clipfrac"], ".3f"), _fmt(e["new_compilations"]), _fmt(e["seconds"], ".1f"))
        console.print(table)


def _finite(x: Any) -> Any:
    """NaN/inf (a diverged loss, an odd event field) become null: --json output stays strict JSON."""
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return None
    if isinstance(x, dict):
        return {str(k): _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def plot_curve(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Draw the run's reward curve (ddpo_tpu/plot.py) from its metrics.jsonl, local or in a bucket."""
    from ddpo_tpu import plot

    url = str(run_dir).startswith("gs://")
    run = _read_bucket_run(str(run_dir)) if url else read_run(Path(run_dir), lock_paths=[])
    name = str(run_dir).rstrip("/").rsplit("/", 1)[-1]
    if out is None:
        out = Path(f"{name}-{plot.CURVE_FILE}") if url else Path(run_dir) / plot.CURVE_FILE
    train, evals = plot.curves(run.metrics.records)
    return plot.draw(Path(out), train, evals, title=name)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ddpo-status", description="Where a ddpo_tpu run stands (reads its run dir).")
    p.add_argument("run_dir", help="the run dir (outputs/<run_name>, or gs://BUCKET/PREFIX/<run_name>)")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--json", action="store_true", help="print the facts as JSON")
    how.add_argument("--brief", action="store_true", help="one line: state, progress, phase, last event")
    p.add_argument("--events", type=int, default=0, metavar="N",
                   help="also show the last N events of the current attempt as text (default 0)")
    p.add_argument("--width", type=int, default=60, help="characters of the reward sparkline (default 60)")
    p.add_argument("--rows", type=int, default=10, help="epochs in the table, the last ones (0: all; default 10)")
    p.add_argument("--stale-after", type=float, default=DEFAULT_STALE_S, metavar="SECONDS",
                   help="with no live lock holder and no heartbeat, a run silent for longer than this (or 1.5x its "
                        f"longest phase) is reported stopped (default {DEFAULT_STALE_S:.0f})")
    p.add_argument("--plot", nargs="?", const="", default=None, metavar="PNG",
                   help="also write the reward curve (mean ± std per epoch, eval rewards) to PNG (default: the run "
                        "dir's reward_curve.png; for a gs:// run, ./<run_name>-reward_curve.png)")
    args = p.parse_args(argv)
    if args.plot is not None:
        try:
            print(f"reward curve: {plot_curve(args.run_dir, args.plot or None)}")
        except FileNotFoundError as e:
            print(f"ddpo-status: {e}", file=sys.stderr)
            return EXIT_NO_RUN
    try:
        facts = collect(args.run_dir, stale_after=args.stale_after)
    except FileNotFoundError as e:
        print(f"ddpo-status: {e}", file=sys.stderr)
        return EXIT_NO_RUN
    if args.json:
        print(json.dumps(_finite(facts), indent=1, default=str, allow_nan=False))
    elif args.brief:
        render_brief(facts, events=args.events)
    else:
        render(facts, width=args.width, rows=args.rows, events=args.events)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
