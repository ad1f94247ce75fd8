"""Reading a run dir (the only I/O of ddpo-status): what the run left there, as typed plain values (`RunFiles`).

A gs:// run dir is read from a copy of the bucket's files (ddpo_tpu/rundir/storage.py) in a temporary dir."""

from __future__ import annotations

import json
import math
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddpo_tpu.rundir import checkpoint_layout as layout
from ddpo_tpu.rundir import events as ev
from ddpo_tpu.rundir.files import HEARTBEAT_FILE

LOG_TAIL_BYTES = 64 << 10          # the end of train.log, shown to people
LOG_TAIL_LINES = 8
METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.yaml"
LAYOUT_EVENT = "state_layout"      # the trainer's record of how the state lies on the devices
LAYOUT_FIELDS = ("tensors", "sharded", "bytes_total", "bytes_per_device")


def num(x: Any) -> float | None:
    """A finite number as a float; None for anything else (a bool, a string, NaN, inf, a missing value)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return None if math.isnan(x) or math.isinf(x) else float(x)


def get(tree: Any, dotted: str, default: Any = None) -> Any:
    """tree["a"]["b"] for "a.b", or `default` where a level is missing."""
    for part in dotted.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return default
        tree = tree[part]
    return tree


@dataclass
class Metrics:
    records: list[dict[str, Any]] = field(default_factory=list)
    bad_lines: int = 0                 # unparseable lines other than a truncated last one
    truncated_last_line: bool = False  # the writer was killed mid-line
    kinds: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Stamped:
    """An event and when it was written."""

    time: float
    event: ev.Event


@dataclass(frozen=True)
class LogTail:
    mtime: float | None = None
    size: int = 0
    lines: tuple[str, ...] = ()  # the last non-empty lines, for people


@dataclass(frozen=True)
class Holder:
    """A live process holding a lock that names the run dir."""

    pid: int
    hostname: str
    lock: str
    started: float | None = None
    this_host: bool = True


@dataclass(frozen=True)
class Heartbeat:
    """heartbeat.json as the training process last wrote it."""

    time: float
    pid: int | None = None
    hostname: str | None = None
    interval_s: float | None = None


@dataclass(frozen=True)
class Layout:
    """How the training state lies on the devices (ddpo_tpu.runtime.base.StateLayout), and which file said so."""

    tensors: int
    sharded: int
    bytes_total: int
    bytes_per_device: int
    source: str

    def describe(self) -> str:
        return (f"{self.tensors} state tensors, {self.sharded} sharded: {self.bytes_per_device / 2**20:.1f} MiB per "
                f"device of {self.bytes_total / 2**20:.1f} MiB")


@dataclass
class RunFiles:
    """What `read_run` found: every input of `derive`, as plain values."""

    run_dir: str = "run"
    cfg: dict[str, Any] = field(default_factory=dict)
    events: list[Stamped] = field(default_factory=list)
    has_events_file: bool = True
    unknown_events: dict[str, int] = field(default_factory=dict)
    metrics: Metrics = field(default_factory=Metrics)
    heartbeat: Heartbeat | None = None
    holder: Holder | None = None           # a live process holding the run's lock
    log: LogTail = field(default_factory=LogTail)
    checkpoints: list[tuple[str, float]] = field(default_factory=list)  # (name, mtime), oldest first
    parity: list[dict[str, Any]] | None = None
    layout: Layout | None = None
    notes: list[str] = field(default_factory=list)
    evaluations: list[tuple[str, dict[str, Any]]] = field(default_factory=list)  # (eval/<name>, its summary.json)


def read_run(run_dir: Path, lock_paths: list[Path] | None = None) -> RunFiles:
    """Everything `derive` needs from the run dir. Raises FileNotFoundError when there is no run here."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir}: no such directory")
    if not (run_dir / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"{run_dir}: no config.yaml here, so not a ddpo_tpu run dir "
                                "(the launcher writes it before starting the training process)")
    run = RunFiles(run_dir=str(run_dir))
    run.cfg = read_config(run_dir / CONFIG_FILE, run.notes)
    records = ev.read_events(run_dir / ev.EVENTS_FILE)
    run.events, run.unknown_events = _parse_events(records)
    run.has_events_file = (run_dir / ev.EVENTS_FILE).is_file()
    run.metrics = read_metrics(run_dir / METRICS_FILE)
    run.layout = read_layout(records, run.metrics.records)
    run.heartbeat = read_heartbeat(run_dir)
    run.holder = find_live_holder(run_dir, run.cfg, lock_paths)
    run.log = read_log_tail(run_dir / "train.log")
    run.checkpoints = _list_checkpoints(run_dir / "checkpoints")
    run.parity = _read_json_list(run_dir / "parity.json")
    run.evaluations = read_evaluations(run_dir / "eval")
    return run


def read_evaluations(root: Path) -> list[tuple[str, dict[str, Any]]]:
    """The finished evaluations under a run's eval/ (training's and ddpo-eval's): each one's summary.json, written
    last (training/evaluation.py); one being written or unreadable is left for the next look."""
    out = []
    for summary in sorted(root.glob("*/summary.json")) if root.is_dir() else []:
        try:
            doc = json.loads(summary.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict):
            out.append((summary.parent.name, doc))
    return out


def read_config(path: Path, notes: list[str]) -> dict[str, Any]:
    """config.yaml as a dict ({} and a note when it cannot be read)."""
    import yaml

    try:
        cfg = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        notes.append(f"{path.name} unreadable: {type(e).__name__}: {e}")
        return {}
    return cfg if isinstance(cfg, dict) else {}


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


def _parse_events(records: list[dict[str, Any]]) -> tuple[list[Stamped], dict[str, int]]:
    out, unknown = [], {}
    for rec in records:
        event = ev.parse(rec)
        t = num(rec.get("time"))
        if event is None or t is None:
            if rec["event"] != LAYOUT_EVENT:  # read by read_layout whether or not events.py knows it
                unknown[rec["event"]] = unknown.get(rec["event"], 0) + 1
            continue
        out.append(Stamped(t, event))
    return out, unknown


def _layout_in(rec: dict[str, Any], source: str) -> Layout | None:
    """The layout in a record: its own fields, or a dict field holding them (run_start's, say)."""
    for c in (rec, *(v for v in rec.values() if isinstance(v, dict))):
        vals = [c.get(k) for k in LAYOUT_FIELDS]
        if all(isinstance(v, int) and not isinstance(v, bool) for v in vals):
            return Layout(*vals, source=source)
    return None


def read_layout(event_records: list[dict[str, Any]], metrics_records: list[dict[str, Any]]) -> Layout | None:
    """The newest state layout: from events.jsonl (a `state_layout` event, or a field of `run_start`); a run dir of
    an older version has it only in metrics.jsonl (a `"kind": "event"` line)."""
    for rec in reversed(event_records):
        if rec.get("event") in (LAYOUT_EVENT, "run_start"):
            found = _layout_in(rec, ev.EVENTS_FILE)
            if found is not None:
                return found
    for rec in reversed(metrics_records):
        if rec.get("kind") == "event" and rec.get("event") == LAYOUT_EVENT:
            found = _layout_in(rec, METRICS_FILE)
            if found is not None:
                return found
    return None


def read_heartbeat(run_dir: Path) -> Heartbeat | None:
    """heartbeat.json, or None (no such file: a run from before heartbeats, or one that has not started its
    training process)."""
    try:
        data = json.loads((Path(run_dir) / HEARTBEAT_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or num(data.get("time")) is None:
        return None
    pid = data.get("pid")
    return Heartbeat(num(data["time"]), pid if isinstance(pid, int) else None,
                     data.get("hostname") if isinstance(data.get("hostname"), str) else None,
                     num(data.get("interval_s")))


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
    return LogTail(st.st_mtime, st.st_size, tuple([x for x in text if x.strip()][-lines:]))


def _list_checkpoints(path: Path) -> list[tuple[str, float]]:
    try:
        # checkpoint names only (a bucket listing makes their dirs before their files: not `is_complete`)
        entries = [(p.name, p.stat().st_mtime) for p in path.iterdir() if layout.epoch_of(p.name) is not None]
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(entries, key=lambda x: x[1])


def _read_json_list(path: Path) -> list | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, list) else None


def find_live_holder(run_dir: Path, cfg: dict, lock_paths: list[Path] | None = None) -> Holder | None:
    """A live process that holds a lock naming this run dir: run_dir/lock, or this host's accelerator lock.

    Only positive evidence: locks are per host, so a free lock says nothing when the run lives on another machine."""
    from ddpo_tpu.proc.lock import AcceleratorLock, run_dir_lock_path

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
        return Holder(holder.pid, holder.hostname, str(path), holder.started, holder.hostname == socket.gethostname())
    return None


def _accelerator_lock_paths(cfg: dict) -> list[Path]:
    accelerator = get(cfg, "tpu_topology.accelerator")
    if not isinstance(accelerator, str) or not accelerator:
        return []
    from ddpo_tpu.env import cache_root  # the one module that reads the environment
    from ddpo_tpu.proc.lock import default_lock_path

    return [default_lock_path(cache_root(), accelerator)]


def bucket_problem(url: str) -> str | None:
    """Why the bucket URL cannot be read from here (a bad URL, no gcsfs), or None."""
    from ddpo_tpu.rundir import storage

    problem = storage.url_problem(url)
    if problem is not None:
        return f"{url}: {problem[0]}"
    if storage.gcsfs_missing():
        return f"{url}: gcsfs is not installed ({storage.INSTALL_FIX})"
    return None


def read_bucket_run(url: str) -> RunFiles:
    """read_run of the bucket's copy; a live holder of the run's lock is looked for in this host's staging dir."""
    import tempfile

    from ddpo_tpu.rundir import storage

    problem = bucket_problem(url)
    if problem is not None:
        raise FileNotFoundError(problem)
    with tempfile.TemporaryDirectory(prefix="ddpo-status-") as tmp:
        run = read_run(storage.snapshot(url, Path(tmp)), lock_paths=[])
    run.run_dir = url.rstrip("/")
    parts = storage.parse(url)
    root = str(run.cfg.get("output_root") or "")
    if storage.is_url(root) and storage.url_problem(root) is None:
        rel = parts.path[len(storage.parse(root).path):].strip("/")
        staging = Path(storage.local_root(root)) / rel
        if (staging / CONFIG_FILE).is_file():
            run.holder = find_live_holder(staging, run.cfg)
    return run


def read_any(run_dir: str | Path, lock_paths: list[Path] | None = None) -> RunFiles:
    """read_run of a local run dir, or of a gs:// one (from the bucket)."""
    if str(run_dir).startswith("gs://"):
        return read_bucket_run(str(run_dir))
    return read_run(Path(run_dir), lock_paths)
