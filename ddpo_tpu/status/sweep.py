"""A Hydra multirun dir (`outputs/<run_name>-multirun`, one numbered run dir per sweep point) as one table: each
point's overrides, state, epochs and rewards. Also a sweep in a bucket (`gs://.../<run_name>-multirun`).

A point's overrides come from the `.hydra/overrides.yaml` Hydra writes in its job dir; where that file is missing (a
bucket keeps only the run's own files) from the keys whose values differ between the points' config.yaml. A job dir
with no config.yaml yet (the front end creates every point's dir and lock before the first job starts) is a point not
started."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddpo_tpu.status.facts import DEFAULT_STALE_S, Facts, derive, finite
from ddpo_tpu.status.read import CONFIG_FILE, bucket_problem, read_any
from ddpo_tpu.status.render import STATE_STYLE, fmt

OVERRIDES_FILE = ".hydra/overrides.yaml"
MAX_KEYS = 4  # differing config keys shown per point when there is no overrides file


@dataclass(frozen=True)
class SweepRow:
    """One sweep point."""

    job: int
    run_dir: str
    overrides: tuple[str, ...]      # what sets this point apart (the overrides all points share are in `common`)
    state: str
    state_label: str
    rule: str                       # the deciding rule, or "no_config" for a point not started
    epochs_done: int
    num_epochs: int | None
    current_epoch: int | None
    phase_detail: str | None
    reward_last: float | None
    reward_best: float | None
    best_epoch: int | None
    last_event_age_s: float | None


@dataclass(frozen=True)
class Sweep:
    sweep_dir: str
    common: tuple[str, ...]         # overrides every point has
    points: tuple[SweepRow, ...]

    def to_json(self) -> dict[str, Any]:
        return finite(dataclasses.asdict(self))


def job_dirs(sweep_dir: Path) -> list[Path]:
    """The numbered job dirs of a local sweep dir, by number ([] when there are none: not a sweep dir)."""
    try:
        return sorted((p for p in sweep_dir.iterdir() if p.name.isdigit() and p.is_dir()), key=lambda p: int(p.name))
    except (FileNotFoundError, NotADirectoryError):
        return []


def is_sweep_dir(path: str | Path) -> bool:
    p = Path(path)
    return p.is_dir() and not (p / CONFIG_FILE).is_file() and bool(job_dirs(p))


def _read_overrides(job: Path) -> list[str] | None:
    import yaml

    try:
        data = yaml.safe_load((job / OVERRIDES_FILE).read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    return [str(x) for x in data] if isinstance(data, list) else None


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict) or not tree:
        return {prefix: tree} if prefix else {}
    out: dict[str, Any] = {}
    for k, v in tree.items():
        out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def _value(v: Any) -> str:
    return v if isinstance(v, str) else json.dumps(v)


def point_overrides(given: list[list[str] | None], configs: list[dict | None]) -> tuple[tuple[str, ...],
                                                                                       list[tuple[str, ...]]]:
    """(the overrides all points share, each point's own). From the overrides files when every started point has
    one; else `key=value` for the config keys whose values differ between the points."""
    started = [i for i, c in enumerate(configs) if c is not None]
    if started and all(given[i] is not None for i in started):
        common = [o for o in given[started[0]] if all(o in given[i] for i in started)]
        if len(started) == 1:
            common = []  # one point: its overrides are what it is
        return tuple(common), [tuple(o for o in (g or []) if o not in common) for g in given]
    flats = [_flat(c) if c is not None else None for c in configs]
    keys = list(dict.fromkeys(k for f in flats if f is not None for k in f))
    differ = [k for k in keys if len({_value(f.get(k)) for f in flats if f is not None}) > 1]
    own = []
    for f in flats:
        shown = [] if f is None else [f"{k}={_value(f.get(k))}" for k in differ]
        own.append(tuple(shown[:MAX_KEYS] + (["..."] if len(shown) > MAX_KEYS else [])))
    return (), own


def _row(job: int, run_dir: str, overrides: tuple[str, ...], f: Facts | None) -> SweepRow:
    if f is None:
        return SweepRow(job, run_dir, overrides, "not started", "not started", "no_config", 0, None, None, None,
                        None, None, None, None)
    rw = f.reward
    return SweepRow(job, run_dir, overrides, f.state, f.state_label, f.rule, f.epochs_done, f.num_epochs,
                    f.current_epoch, f.phase_detail, None if rw is None else rw.last, None if rw is None else rw.best,
                    None if rw is None else rw.best_epoch, f.last_event_age_s)


def _point(target: str | Path, now: float | None, stale_after: float,
           lock_paths: list[Path] | None) -> tuple[Facts | None, dict | None]:
    """(facts, config) of a job dir, local or in a bucket; (None, None) for one not composed yet (the front end
    created it, and its lock, before the first job started)."""
    import time

    try:
        run = read_any(target, lock_paths)
    except FileNotFoundError:
        return None, None
    return derive(run, time.time() if now is None else now, stale_after), run.cfg


def _sweep(where: str, jobs: list[str], targets: list, given: list[list[str] | None], now: float | None,
           stale_after: float, lock_paths: list[Path] | None) -> Sweep:
    points = [_point(t, now, stale_after, lock_paths) for t in targets]
    common, own = point_overrides(given, [cfg for _, cfg in points])
    return Sweep(where, common, tuple(_row(int(j), str(t), o, f) for j, t, o, (f, _) in zip(jobs, targets, own,
                                                                                            points)))


def summarise(sweep_dir: str | Path, now: float | None = None, stale_after: float = DEFAULT_STALE_S,
              lock_paths: list[Path] | None = None) -> Sweep:
    """Every point of a local sweep dir. Raises FileNotFoundError when it holds no numbered job dir."""
    root = Path(sweep_dir)
    jobs = job_dirs(root)
    if not jobs:
        raise FileNotFoundError(f"{root}: no config.yaml and no numbered job dirs here, so neither a ddpo_tpu run "
                                "dir nor a sweep dir (outputs/<run_name>-multirun)")
    return _sweep(str(root), [j.name for j in jobs], jobs, [_read_overrides(j) for j in jobs], now, stale_after,
                  lock_paths)


def summarise_bucket(url: str, now: float | None = None, stale_after: float = DEFAULT_STALE_S) -> Sweep:
    """Every point of a sweep dir in a bucket (no .hydra/ there: the points are told apart by their configs).
    Raises FileNotFoundError when it holds no numbered job dir."""
    from ddpo_tpu.rundir import storage

    problem = bucket_problem(url)
    if problem is not None:
        raise FileNotFoundError(problem)
    base = storage.parse(url)
    fs = storage.filesystem()
    fs.invalidate_cache()
    try:
        names = [str(p).rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(base.path, detail=False)]
    except FileNotFoundError:
        names = []
    jobs = sorted((n for n in names if n.isdigit()), key=int)
    if not jobs:
        raise FileNotFoundError(f"{url}: no config.yaml and no numbered job dirs there, so neither a ddpo_tpu run "
                                "dir nor a sweep dir in the bucket")
    return _sweep(str(base), jobs, [str(base.join(n)) for n in jobs], [None] * len(jobs), now, stale_after, None)


def short_age(seconds: float | None) -> str:
    """Time since, in at most 6 characters: 42s, 12m05s, 3h07m, 2d04h."""
    if seconds is None:
        return "-"
    s = max(0, int(round(seconds)))
    if s < 90:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def _counts(s: Sweep) -> str:
    counts: dict[str, int] = {}
    for p in s.points:
        counts[p.state] = counts.get(p.state, 0) + 1
    return ", ".join(f"{n} {state}" for state, n in counts.items())


def _epochs(p: SweepRow) -> str:
    return f"{p.epochs_done}/{p.num_epochs if p.num_epochs is not None else '?'}"


def render_sweep(s: Sweep, console: Any = None) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = console or Console(highlight=False)
    head = Text(f"sweep of {len(s.points)} point(s)", style="bold")
    head.append(f" ({_counts(s)})")
    head.append(f"  {s.sweep_dir}", style="dim")
    console.print(head, soft_wrap=True)
    if s.common:
        console.print(Text("every point: " + " ".join(s.common), style="dim"), soft_wrap=True)
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    for col, justify in (("job", "right"), ("overrides", "left"), ("state", "left"), ("epochs", "right"),
                         ("reward", "right"), ("best", "right"), ("updated", "right")):
        table.add_column(col, justify=justify, no_wrap=True)
    for p in s.points:  # reward: the last epoch's reward mean; updated: since the last event
        table.add_row(str(p.job), Text("\n".join(p.overrides) or "-"),  # Text: "[a,b]" is not rich markup
                      Text(p.state_label, style=STATE_STYLE.get(p.state, "")), _epochs(p), fmt(p.reward_last),
                      fmt(p.reward_best), short_age(p.last_event_age_s))
    # whole rows, whatever the console's width: a cut override would name another point (the terminal wraps)
    Console(file=console.file, width=10_000, highlight=False, force_terminal=console.is_terminal,
            color_system=console.color_system, no_color=console.no_color).print(table)


def render_sweep_brief(s: Sweep, out=None) -> None:
    """One line for the sweep, then one per point."""
    import sys

    out = out or sys.stdout
    print(f"{s.sweep_dir}: {len(s.points)} point(s): {_counts(s)}", file=out)
    for p in s.points:
        parts = [f"  {p.job} {' '.join(p.overrides) or '-'}: {p.state_label}", f"{_epochs(p)} epochs"]
        if p.reward_last is not None:
            parts.append(f"last reward {fmt(p.reward_last)}")
        print("; ".join(parts), file=out)
