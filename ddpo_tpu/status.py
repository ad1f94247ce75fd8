"""Where a run stands: `python -m ddpo_tpu.status RUN_DIR [--json] [--width N]` (console script `ddpo-status`).

Reads only what the run leaves in its directory (config.yaml, metrics.jsonl, train.log, parity.json, checkpoints/)
and, when present, the accelerator lock; never imports torch and never touches a device, so it is instant and works
on a machine without the training dependencies (it needs PyYAML and rich only).

How the state is decided (the output says which rule fired):
  finished         train.log's last word (after the last progress line) is "ddpo_tpu: run complete", or every epoch
                   has its metrics line and no process is alive
  failed           a traceback, an "error: ..." line or a fatal XLA check comes after the last progress line
  stopped          a "preempted" event (or log line) is the last thing the run did, or (dead) heartbeat.json is older
                   than 60 s and no live process holds the run's lock, or (without a heartbeat file, older runs)
                   nothing was written for longer than the staleness threshold and no live process holds the lock
  running          a live process holds the run's lock, or the last event (metrics line or train.log write) is recent
  not started      no metrics and no progress line in train.log

Progress lines are those the training process prints ("ddpo_tpu: <runtime>; N epochs of ..." at start and
"[epoch N] ..." as it goes). A run restarted in the same directory appends to train.log and metrics.jsonl, so an
error before the last progress line belongs to an earlier attempt (reported, but the run is not "failed"), and an
epoch logged twice counts once (the later line wins).

Exit codes: 0 the run dir exists and has config.yaml (whatever the run's state); 2 otherwise.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["collect", "main", "render", "sparkline", "read_metrics", "scan_log"]

EXIT_OK = 0
EXIT_NO_RUN = 2

BLOCKS = "▁▂▃▄▅▆▇█"
ASCII_BLOCKS = "_.-:=+*#"
LOG_TAIL_BYTES = 8 << 20          # train.log can grow large (progress bars); the end is what matters
DEFAULT_STALE_S = 900.0          # a first XLA compile can be silent for many minutes
HEARTBEAT_DEAD_S = 60.0          # the training process rewrites heartbeat.json every 10 s, even while compiling
RATE_WINDOW = 5                  # epochs averaged for samples/s and the ETA

_EPOCH_LINE = re.compile(r"^\[epoch (\d+)\] (.*)$")
_HEADER_LINE = re.compile(r"^ddpo_tpu: .*\b\d+ epochs of ")
_COMPLETE_LINE = "ddpo_tpu: run complete"
_BATCH_DONE = re.compile(r"^sampling batch (\d+)/(\d+) done")
_ERROR_LINE = re.compile(r"^(?:[\w.\-]+: )?error: ", re.IGNORECASE)
_XLA_FATAL = re.compile(r"^\d{4}-\d\d-\d\d [\d:.]+: F \S+\] ")
_TRACEBACK = "Traceback (most recent call last):"
_CHAIN_LINES = ("During handling of the above exception", "The above exception was the direct cause")
_PREEMPT_LINE = re.compile(r"preempt|SIGTERM", re.IGNORECASE)
_RESUME_LINE = re.compile(r"^ddpo_tpu: .*resum", re.IGNORECASE)


# --- reading the run dir --------------------------------------------------------------------------------------------

@dataclass
class Metrics:
    records: list[dict[str, Any]] = field(default_factory=list)
    bad_lines: int = 0                 # unparseable lines other than a truncated last one
    truncated_last_line: bool = False  # the writer was killed mid-line
    kinds: dict[str, int] = field(default_factory=dict)


def read_metrics(path: Path) -> Metrics:
    m = Metrics()
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return m
    text = data.decode("utf-8", errors="replace")
    lines = text.split("\n")
    ends_clean = text.endswith("\n") or text == ""
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            if i == len(lines) - 1 and not ends_clean:
                m.truncated_last_line = True
            else:
                m.bad_lines += 1
            continue
        if not isinstance(rec, dict):
            m.bad_lines += 1
            continue
        kind = str(rec.get("kind", "?"))
        m.kinds[kind] = m.kinds.get(kind, 0) + 1
        m.records.append(rec)
    return m


@dataclass
class LogScan:
    exists: bool = False
    mtime: float | None = None
    size: int = 0
    partial: bool = False                      # only the tail was read
    lines: int = 0
    last_line: str | None = None
    last_progress: int | None = None           # index of the last header or [epoch N] line
    last_epoch_line: tuple[int, str] | None = None
    complete_at: int | None = None
    preempted_at: int | None = None
    preempted_line: str | None = None
    errors: list[tuple[int, str]] = field(default_factory=list)


def scan_log(path: Path, max_bytes: int = LOG_TAIL_BYTES) -> LogScan:
    s = LogScan()
    path = Path(path)
    try:
        st = path.stat()
    except FileNotFoundError:
        return s
    s.exists, s.mtime, s.size = True, st.st_mtime, st.st_size
    with open(path, "rb") as f:
        if st.st_size > max_bytes:
            f.seek(st.st_size - max_bytes)
            s.partial = True
        data = f.read(max_bytes)
    lines = re.split(r"\r\n|\r|\n", data.decode("utf-8", errors="replace"))
    if s.partial:
        lines = lines[1:]  # the first one is cut
    in_traceback = False
    for i, raw in enumerate(lines):
        line = raw.rstrip()
        if not line.strip():
            continue
        s.lines += 1
        s.last_line = line
        if in_traceback:
            if line[0].isspace() or line.startswith(_TRACEBACK):
                continue
            if line.startswith(_CHAIN_LINES):
                continue
            s.errors.append((i, line))  # the exception line: "Type: message"
            in_traceback = False
            continue
        if line.startswith(_TRACEBACK):
            in_traceback = True
            continue
        m = _EPOCH_LINE.match(line)
        if m:
            s.last_progress = i
            s.last_epoch_line = (int(m.group(1)), m.group(2))
            if _PREEMPT_LINE.search(m.group(2)):
                s.preempted_at, s.preempted_line = i, line
            continue
        if _HEADER_LINE.match(line) or _RESUME_LINE.match(line):
            s.last_progress = i
            continue
        if line == _COMPLETE_LINE:
            s.complete_at = i
            continue
        if _ERROR_LINE.match(line) or _XLA_FATAL.match(line):
            s.errors.append((i, line))
            continue
        if _PREEMPT_LINE.search(line) and line.startswith("ddpo_tpu:"):
            s.preempted_at, s.preempted_line = i, line
    if in_traceback:
        s.errors.append((len(lines), "(traceback without a final line: output cut off)"))
    return s


def _load_yaml(path: Path) -> Any:
    import yaml

    with open(path) as f:
        return yaml.safe_load(f)


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


def read_heartbeat(run_dir: Path) -> dict | None:
    """heartbeat.json as the training process last wrote it ({"time", "pid", "hostname", "interval_s"}), or None
    (no such file: a run from before heartbeats, or one that has not started its training process)."""
    try:
        data = json.loads((Path(run_dir) / "heartbeat.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or _num(data.get("time")) is None:
        return None
    return data


def find_live_holder(run_dir: Path, cfg: dict, lock_paths: list[Path] | None = None) -> dict | None:
    """A live process that holds a lock naming this run dir: run_dir/lock, or this host's accelerator lock.

    Only positive evidence: locks are per host, so a free lock says nothing when the run lives on another machine."""
    try:
        from ddpo_tpu.launch.lock import AcceleratorLock
    except Exception:  # pragma: no cover - stdlib only, but never let status fail on it
        return None
    if lock_paths is None:
        lock_paths = [run_dir / "lock"]
        accelerator = _get(cfg, "tpu_topology.accelerator")
        if isinstance(accelerator, str) and accelerator:
            try:
                from ddpo_tpu.launch.env import cache_root  # the one module that reads the environment
                from ddpo_tpu.launch.lock import default_lock_path

                lock_paths.append(default_lock_path(cache_root(), accelerator))
            except Exception:
                pass
    here = run_dir.resolve()
    for path in lock_paths:
        try:
            holder = AcceleratorLock.holder(path)
        except Exception:
            continue
        if holder is None:
            continue
        same_run = path == run_dir / "lock"
        try:
            same_run = same_run or Path(holder.run_dir).resolve() == here
        except Exception:
            pass
        if same_run:
            return {"pid": holder.pid, "hostname": getattr(holder, "hostname", None), "lock": str(path),
                    "started": holder.started, "this_host": getattr(holder, "hostname", None) == socket.gethostname()}
    return None


# --- the facts ----------------------------------------------------------------------------------------------------

def _phase_seconds(rec: dict) -> float | None:
    phases = rec.get("phases")
    if not isinstance(phases, dict):
        return None
    secs = [_num(p.get("seconds")) for p in phases.values() if isinstance(p, dict)]
    secs = [x for x in secs if x is not None]
    return sum(secs) if secs else None


def _host_time(epochs: list[dict]) -> dict | None:
    """The newest epoch's main-thread CPU seconds against wall seconds, per phase: a phase whose host time is near
    its wall time is bound by tracing and dispatch on the host, not by the devices."""
    for e in reversed(epochs):
        phases = e.get("phases")
        if not isinstance(phases, dict):
            continue
        rows = {k: (_num(p.get("host_seconds")), _num(p.get("seconds"))) for k, p in phases.items()
                if isinstance(p, dict)}
        rows = {k: v for k, v in rows.items() if v[0] is not None and v[1] is not None}
        if rows:
            host, wall = sum(h for h, _ in rows.values()), sum(w for _, w in rows.values())
            return {"epoch": e.get("epoch"), "host_s": host, "wall_s": wall,
                    "fraction": host / wall if wall > 0 else None,
                    "phases": {k: {"host_s": h, "wall_s": w} for k, (h, w) in rows.items()}}
    return None


def _describe_phase(text: str, epoch: int, done_last: bool) -> tuple[str, str]:
    """(phase, detail) from the text after "[epoch N] "."""
    if text.startswith("sampling start"):
        return "sampling", "sampling batch 1 (none done yet)"
    m = _BATCH_DONE.match(text)
    if m:
        b, n = int(m.group(1)), int(m.group(2))
        if b < n:
            return "sampling", f"sampling batch {b + 1}/{n} ({b}/{n} done)"
        return "reward", f"all {n} sampling batches done, gathering rewards"
    if text.startswith("rewards gathered"):
        return "advantages", "rewards gathered, computing advantages"
    if text.startswith("training start"):
        return "training", "training"
    if text.startswith("done"):
        if done_last:
            return "finishing", f"epoch {epoch} done (the last one): saving and exiting"
        return "between epochs", f"epoch {epoch} done, epoch {epoch + 1} starting"
    return text.split(":")[0].strip() or "?", text


def _ago(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    seconds = max(0.0, seconds)
    return f"{_duration(seconds)} ago"


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
    if t is None:
        return None
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def collect(run_dir: Path, now: float | None = None, stale_after: float = DEFAULT_STALE_S,
            lock_paths: list[Path] | None = None) -> dict[str, Any]:
    """Every fact the report shows, as a JSON-able dict. Raises FileNotFoundError when there is no run here."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir}: no such directory")
    if not (run_dir / "config.yaml").is_file():
        raise FileNotFoundError(f"{run_dir}: no config.yaml here, so not a ddpo_tpu run dir "
                                "(the launcher writes it before starting the training process)")
    now = time.time() if now is None else now
    notes: list[str] = []
    try:
        cfg = _load_yaml(run_dir / "config.yaml")
    except Exception as e:
        cfg = None
        notes.append(f"config.yaml unreadable: {type(e).__name__}: {e}")
    if not isinstance(cfg, dict):
        cfg = {}
    num_epochs = _get(cfg, "num_epochs")
    num_epochs = num_epochs if isinstance(num_epochs, int) else None
    batch, nbatches = _get(cfg, "sample.batch_size"), _get(cfg, "sample.num_batches_per_epoch")

    metrics = read_metrics(run_dir / "metrics.jsonl")
    log = scan_log(run_dir / "train.log")

    if metrics.truncated_last_line:
        notes.append("metrics.jsonl ends in a truncated line (writer killed mid-write); it was skipped")
    if metrics.bad_lines:
        notes.append(f"metrics.jsonl has {metrics.bad_lines} unparseable line(s); skipped")
    unknown = sorted(k for k in metrics.kinds if k not in ("step", "epoch", "event"))
    if unknown:
        notes.append("metrics.jsonl has records of unknown kind(s) " + ", ".join(unknown) + "; ignored")
    if log.partial:
        notes.append(f"train.log is {log.size / 2**20:.0f} MiB; only its last {LOG_TAIL_BYTES >> 20} MiB were read")

    # epochs: the later line wins when a restarted run logged an epoch again
    by_epoch: dict[int, dict] = {}
    for rec in metrics.records:
        if rec.get("kind") == "epoch" and isinstance(rec.get("epoch"), int):
            by_epoch[rec["epoch"]] = rec
    epochs = [by_epoch[k] for k in sorted(by_epoch)]
    events = [r for r in metrics.records if r.get("kind") == "event"]
    times = [t for t in (_num(r.get("time")) for r in metrics.records) if t is not None]
    last_event_time = max(times) if times else None
    last_record = metrics.records[-1] if metrics.records else None

    # where the run is: the last [epoch N] line of train.log, else the metrics
    epochs_done = len(epochs)
    current_epoch, phase, phase_detail = None, None, None
    if log.last_epoch_line is not None:
        current_epoch, text = log.last_epoch_line
        done_last = num_epochs is not None and current_epoch + 1 >= num_epochs
        phase, phase_detail = _describe_phase(text, current_epoch, done_last)
    elif epochs:
        current_epoch = epochs[-1]["epoch"] + 1
        phase, phase_detail = "between epochs", f"epoch {epochs[-1]['epoch']} done (from metrics.jsonl)"
    elif log.last_progress is not None:
        phase, phase_detail = "setup", "training process started, no epoch yet"
    elif log.exists:
        phase, phase_detail = "setup", "loading (no progress line yet)"

    # optimizer steps in the current epoch (global_step counts them across epochs)
    steps_now, steps_expected = None, None
    if current_epoch is not None:
        prev = by_epoch.get(current_epoch - 1)
        base = prev.get("global_step") if prev else (0 if current_epoch == 0 else None)
        cur_steps = [r for r in metrics.records if r.get("kind") == "step" and r.get("epoch") == current_epoch]
        last_gs = cur_steps[-1].get("global_step") if cur_steps else base
        if isinstance(base, int) and isinstance(last_gs, int):
            steps_now = last_gs - base
        gs = [(e["epoch"], e.get("global_step")) for e in epochs]
        for (e0, g0), (e1, g1) in zip(gs, gs[1:]):
            if e1 == e0 + 1 and isinstance(g0, int) and isinstance(g1, int):
                steps_expected = g1 - g0
        if steps_expected is None and len(gs) == 1 and gs[0][0] == 0 and isinstance(gs[0][1], int):
            steps_expected = gs[0][1]
    if phase == "training" and steps_now is not None:
        phase_detail = f"training, optimizer step {steps_now}" + (f"/{steps_expected}" if steps_expected else "")
        phase_detail += " done"

    # throughput and ETA over the last few epochs, preferring those without new compilations
    window = epochs[-RATE_WINDOW:]
    steady = [e for e in window if not e.get("new_compilations") and not e.get("new_replicate_compilations")]
    basis = steady or window
    rate, epoch_s, rate_basis = None, None, None
    secs = [(e, _phase_seconds(e)) for e in basis]
    secs = [(e, s) for e, s in secs if s is not None and s > 0]
    if secs:
        total_s = sum(s for _, s in secs)
        samples = sum(int(e.get("num_samples") or 0) for e, _ in secs)
        rate = samples / total_s if samples else None
        epoch_s = total_s / len(secs)
        skipped = len(window) - len(basis)
        rate_basis = (f"epochs {secs[0][0]['epoch']}-{secs[-1][0]['epoch']}" if len(secs) > 1
                      else f"epoch {secs[0][0]['epoch']}")
        if skipped:
            rate_basis += f" ({skipped} with new compilations left out)"

    # state
    live = find_live_holder(run_dir, cfg, lock_paths)
    heartbeat = read_heartbeat(run_dir)
    heartbeat_age = None if heartbeat is None else now - heartbeat["time"]
    activity = [(t, src) for t, src in ((last_event_time, "metrics.jsonl line"), (log.mtime, "train.log write"),
                                         (None if heartbeat is None else heartbeat["time"], "heartbeat"))
                if t is not None]
    last_activity, activity_src = max(activity) if activity else (None, None)
    age = None if last_activity is None else now - last_activity
    longest_phase = 0.0
    for e in epochs:
        for p in (e.get("phases") or {}).values():
            if isinstance(p, dict) and _num(p.get("seconds")):
                longest_phase = max(longest_phase, float(p["seconds"]))
    stale_limit = max(stale_after, 1.5 * longest_phase)
    progress = log.last_progress if log.last_progress is not None else -1
    current_errors = [e for e in log.errors if e[0] > progress]
    last_preempt_event = next((r for r in reversed(events) if r.get("event") == "preempted"), None)
    preempt_is_last = (last_record is not None and last_record.get("kind") == "event"
                       and last_record.get("event") == "preempted")
    log_preempted = log.preempted_at is not None and log.preempted_at >= progress

    state, stop_reason = None, None
    if log.complete_at is not None and log.complete_at > progress:
        state, decided = "finished", f'train.log ends with "{_COMPLETE_LINE}"'
    elif current_errors:
        state, decided = "failed", "train.log has an error after its last progress line"
    elif preempt_is_last or log_preempted:
        state, stop_reason = "stopped", "preempted"
        decided = ('the last metrics record is a "preempted" event' if preempt_is_last
                   else f"train.log: {log.preempted_line}")
        decided += " (the same command resumes)"
        if live is not None:
            decided += f"; pid {live['pid']} still holds the lock (writing its checkpoint?)"
    elif live is not None:
        state = "running"
        where = "" if live["this_host"] else f" on {live['hostname']}"
        decided = f"pid {live['pid']}{where} holds the lock {live['lock']}; last event {_ago(age)} ({activity_src})"
    elif num_epochs is not None and epochs_done >= num_epochs and epochs_done > 0:
        state, decided = "finished", f"all {num_epochs} epochs have a metrics line (no \"run complete\" in train.log)"
    elif heartbeat_age is not None and heartbeat_age > HEARTBEAT_DEAD_S:
        state, stop_reason = "stopped", "dead"
        decided = (f"the training process's heartbeat is {_duration(heartbeat_age)} old (written every "
                   f"{_duration(heartbeat.get('interval_s'))} while it lives; pid {heartbeat.get('pid')}) and no live "
                   "process holds the run's lock: killed (SIGKILL, OOM, a lost host) without an exit message")
    elif not metrics.records and log.last_progress is None and (not log.exists or age is None or age > stale_limit):
        state, decided = "not started", ("no train.log and no metrics.jsonl" if not log.exists
                                         else "train.log has no progress line and no metrics were written")
    elif age is not None and age <= stale_limit:
        state = "running"
        decided = (f"last event {_ago(age)} ({activity_src}; within the {_duration(stale_limit)} staleness "
                   "threshold); no live lock holder seen on this host")
    else:
        state, stop_reason = "stopped", "no activity"
        decided = (f"no event for {_duration(age)} (threshold {_duration(stale_limit)}), no exit message in "
                   "train.log and no live lock holder on this host: killed, hung, or running on another host")
    label = state if stop_reason is None else f"{state} ({stop_reason})"

    eta = None
    if state in ("running", "stopped") and epoch_s is not None and num_epochs is not None:
        eta = max(0, num_epochs - epochs_done) * epoch_s

    last_error = None
    if log.errors:
        idx, line = log.errors[-1]
        last_error = {"line": line, "current_attempt": idx > progress}

    rewards = [_num(e.get("reward_mean")) for e in epochs]
    valid = [(e["epoch"], r) for e, r in zip(epochs, rewards) if r is not None]
    reward = None
    if valid:
        best = max(valid, key=lambda x: x[1])
        reward = {"first": valid[0][1], "last": valid[-1][1], "best": best[1], "best_epoch": best[0],
                  "first_epoch": valid[0][0], "last_epoch": valid[-1][0]}

    table = [{"epoch": e["epoch"], "reward_mean": _num(e.get("reward_mean")), "reward_std": _num(e.get("reward_std")),
              "approx_kl": _num(e.get("approx_kl")), "clipfrac": _num(e.get("clipfrac")),
              "loss": _num(e.get("loss")), "new_compilations": e.get("new_compilations"),
              "num_samples": e.get("num_samples"), "seconds": _phase_seconds(e), "time": _num(e.get("time"))}
             for e in epochs]

    host_time = _host_time(epochs)

    ckpt_dir = run_dir / "checkpoints"
    checkpoints = None
    ck_events = [r for r in events if r.get("event") == "checkpoint"]
    if ckpt_dir.is_dir() or ck_events:
        entries = sorted(ckpt_dir.iterdir(), key=lambda p: p.stat().st_mtime) if ckpt_dir.is_dir() else []
        entries = [p for p in entries if not p.name.startswith(".")]
        checkpoints = {"count": len(entries), "latest": entries[-1].name if entries else None,
                       "latest_time": entries[-1].stat().st_mtime if entries else None,
                       "last_event": ck_events[-1] if ck_events else None}

    parity = None
    try:
        rows = json.loads((run_dir / "parity.json").read_text())
        if isinstance(rows, list):
            bad = [r.get("constraint") for r in rows if isinstance(r, dict) and r.get("ok") is False]
            parity = {"constraints": len(rows), "failing": bad}
    except (OSError, ValueError):
        pass

    return {
        "run_dir": str(run_dir),
        "run_name": _get(cfg, "run_name") or run_dir.name,
        "topology": _get(cfg, "tpu_topology.name"),
        "samples_per_epoch_config": (batch * nbatches if isinstance(batch, int) and isinstance(nbatches, int)
                                     else None),
        "state": state,
        "stop_reason": stop_reason,
        "state_label": label,
        "decided_by": decided,
        "now": now,
        "live_process": live,
        "heartbeat_age_s": heartbeat_age,
        "num_epochs": num_epochs,
        "epochs_done": epochs_done,
        "current_epoch": current_epoch,
        "phase": phase,
        "phase_detail": phase_detail,
        "optimizer_steps_in_epoch": steps_now,
        "optimizer_steps_per_epoch": steps_expected,
        "global_step": next((r.get("global_step") for r in reversed(metrics.records)
                             if isinstance(r.get("global_step"), int)), None),
        "last_event_time": last_event_time,
        "epoch_seconds_total": sum(x["seconds"] or 0.0 for x in table) if table else None,
        "last_event_kind": None if last_record is None else last_record.get("kind"),
        "last_event_age_s": None if last_event_time is None else now - last_event_time,
        "train_log_mtime": log.mtime,
        "train_log_last_line": log.last_line,
        "stale_after_s": stale_limit,
        "samples_per_s": rate,
        "epoch_seconds_mean": epoch_s,
        "rate_basis": rate_basis,
        "eta_s": eta,
        "eta_time": None if eta is None else now + eta,
        "reward": reward,
        "reward_curve": [r for _, r in valid],
        "epochs": table,
        "last_error": last_error,
        "events": [{k: v for k, v in r.items() if k != "kind"} for r in events[-5:]],
        "checkpoints": checkpoints,
        "host_time": host_time,
        "parity": parity,
        "metrics": {"records": len(metrics.records), "kinds": metrics.kinds, "bad_lines": metrics.bad_lines,
                    "truncated_last_line": metrics.truncated_last_line},
        "notes": notes,
    }


# --- the report ---------------------------------------------------------------------------------------------------

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


def render(facts: dict[str, Any], width: int = 60, rows: int = 10, console: Any = None) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = console or Console(highlight=False)
    enc = (getattr(console.file, "encoding", None) or "utf-8")
    try:
        BLOCKS.encode(enc)
        blocks = BLOCKS
    except (UnicodeEncodeError, LookupError):
        blocks = ASCII_BLOCKS
    colour = {"running": "bold cyan", "finished": "bold green", "failed": "bold red", "stopped": "bold yellow",
              "not started": "bold"}.get(facts["state"], "bold")

    def row(key: str, value: Any, style: str = "") -> None:
        t = Text(f"{key:<12}", style="dim")
        t.append(str(value), style=style)
        console.print(t, soft_wrap=True)

    now = facts["now"]
    head = Text(facts["run_name"], style="bold")
    if facts.get("topology"):
        head.append(f"  ({facts['topology']})", style="dim")
    head.append(f"  {facts['run_dir']}", style="dim")
    console.print(head, soft_wrap=True)
    row("state", facts["state_label"], colour)
    row("decided by", facts["decided_by"])

    n, done, cur = facts["num_epochs"], facts["epochs_done"], facts["current_epoch"]
    prog = f"{done}/{n if n is not None else '?'} epochs done"
    if facts["state"] not in ("finished", "not started") and cur is not None:
        prog += f"; epoch {cur}"
        if n:
            prog += f" (#{cur + 1} of {n})"
    if facts.get("global_step") is not None:
        prog += f"; global step {facts['global_step']}"
    row("progress", prog)
    if facts["phase_detail"] and facts["state"] != "finished":
        row("phase", facts["phase_detail"] if facts["state"] == "running" else f"last seen: {facts['phase_detail']}")
    if facts["last_event_time"] is not None:
        row("last event", f"{_clock(facts['last_event_time'])} ({_ago(facts['last_event_age_s'])}, "
                          f"{facts['last_event_kind']} line)")
    if facts["state"] == "finished" and facts["epoch_seconds_total"]:
        row("took", f"{_duration(facts['epoch_seconds_total'])} in {facts['epochs_done']} epochs "
                    "(sum of phase seconds; model loading not included)")
    if facts["train_log_mtime"] is not None:
        row("train.log", f"written {_ago(now - facts['train_log_mtime'])}")
    if facts["samples_per_s"] is not None:
        row("throughput", f"{facts['samples_per_s']:.2f} samples/s, {_duration(facts['epoch_seconds_mean'])}/epoch "
                          f"(phase seconds, {facts['rate_basis']})")
    ht = facts.get("host_time")
    if ht and ht["fraction"] is not None:
        big = sorted(ht["phases"].items(), key=lambda kv: -kv[1]["wall_s"])[:2]
        row("host time", f"{ht['fraction']:.0%} of epoch {ht['epoch']} on the main thread "
                         f"({ht['host_s']:.1f} of {ht['wall_s']:.1f} s; "
                         + ", ".join(f"{k} {v['host_s']:.1f}/{v['wall_s']:.1f} s" for k, v in big)
                         + ("): host-bound" if ht["fraction"] > 0.8 else ")"))
    if facts["eta_s"] is not None:
        left = (n or 0) - done
        row("ETA", f"{_duration(facts['eta_s'])} ({left} epochs x {_duration(facts['epoch_seconds_mean'])}), "
                   f"around {_clock(facts['eta_time'])}" + ("" if facts["state"] == "running" else " if resumed now"))
    ck = facts.get("checkpoints")
    if ck:
        text = f"{ck['count']} in checkpoints/"
        if ck["latest"]:
            text += f", latest {ck['latest']} ({_ago(now - ck['latest_time'])})"
        row("checkpoints", text)
    par = facts.get("parity")
    if par:
        row("parity", "ok" if not par["failing"] else "NOT met: " + ", ".join(map(str, par["failing"])),
            "" if not par["failing"] else "yellow")
    err = facts.get("last_error")
    if err:
        row("last error", err["line"] + ("" if err["current_attempt"] else "  (earlier attempt; the run went on)"),
            "red" if err["current_attempt"] else "dim red")

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
    for note in facts["notes"]:
        console.print(Text(f"note: {note}", style="yellow"), soft_wrap=True)


def _finite(x: Any) -> Any:
    """NaN/inf (a diverged loss, an odd event field) become null: --json output stays strict JSON."""
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return None
    if isinstance(x, dict):
        return {str(k): _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ddpo-status", description="Where a ddpo_tpu run stands (reads its run dir).")
    p.add_argument("run_dir", type=Path, help="the run dir (outputs/<run_name>)")
    p.add_argument("--json", action="store_true", help="print the facts as JSON")
    p.add_argument("--width", type=int, default=60, help="characters of the reward sparkline (default 60)")
    p.add_argument("--rows", type=int, default=10, help="epochs in the table, the last ones (0: all; default 10)")
    p.add_argument("--stale-after", type=float, default=DEFAULT_STALE_S, metavar="SECONDS",
                   help="with no live lock holder, a run silent for longer than this (or 1.5x its longest phase) "
                        f"is reported stopped (default {DEFAULT_STALE_S:.0f})")
    args = p.parse_args(argv)
    try:
        facts = collect(args.run_dir, stale_after=args.stale_after)
    except FileNotFoundError as e:
        print(f"ddpo-status: {e}", file=sys.stderr)
        return EXIT_NO_RUN
    if args.json:
        print(json.dumps(_finite(facts), indent=1, default=str, allow_nan=False))
    else:
        render(facts, width=args.width, rows=args.rows)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
