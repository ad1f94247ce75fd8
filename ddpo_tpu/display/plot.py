"""The reward curve as a PNG: the mean training reward per epoch with a band of one standard deviation, and the
evaluation rewards (the held-out pass of training/evaluation.py: its first panel reward's mean and std) as points.
Drawn with matplotlib (round ticks, a legend of what is drawn, labelled axes); it is imported only inside `draw`, so
the trainer and ddpo-status pay for it only when a curve is drawn.

`curves(records)` takes metrics.jsonl's records; `draw(path, ...)` writes the PNG (atomically: a reader never sees
half a file). Written by the main process at the end of every epoch (ddpo_tpu/display/tracking.py) and by `ddpo-status
--plot`.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Iterable

CURVE_FILE = "reward_curve.png"

Point = tuple[int, float, float]  # (epoch, mean, std)


def curves(records: Iterable[dict[str, Any]]) -> tuple[list[Point], list[Point]]:
    """(training, evaluation) points from metrics records, one per epoch (the last record of an epoch wins: a
    resumed run logs each epoch once, but an older file may repeat one), non-finite values left out."""
    train: dict[int, Point] = {}
    evals: dict[int, Point] = {}
    for r in records:
        kind, epoch, mean = r.get("kind"), r.get("epoch"), r.get("reward_mean")
        if kind not in ("epoch", "eval") or not isinstance(epoch, int) or not _finite(mean):
            continue
        std = r.get("reward_std")
        point = (epoch, float(mean), float(std) if _finite(std) else 0.0)
        (train if kind == "epoch" else evals)[epoch] = point
    return sorted(train.values()), sorted(evals.values())


def read_metrics(path: Path) -> list[dict[str, Any]]:
    out = []
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return out
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a line cut short by a kill
        if isinstance(rec, dict):
            out.append(rec)
    return out


def write_run_curve(run_dir: Path) -> Path:
    """run_dir/reward_curve.png from run_dir/metrics.jsonl."""
    run_dir = Path(run_dir)
    records = read_metrics(run_dir / "metrics.jsonl")
    train, evals = curves(records)
    return draw(run_dir / CURVE_FILE, train, evals, title=run_dir.name, bounds=bounds_of(records))


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


W, H = 720, 400  # pixels of the PNG
DPI = 100
LINE, BAND, EVAL, CONTROL = "#1f77b4", "#c6dbef", "#d62728", "#8c8c8c"


def draw(path: Path, train: list[Point], evals: list[Point], title: str = "",
         control: list[Point] | None = None, bounds: dict[int, tuple[float, float]] | None = None) -> Path:
    """Write the chart of `figure` as a PNG at `path` (atomically: a reader never sees half a file)."""
    return _save(figure(train, evals, title, control, bounds), path)


def figure(train: list[Point], evals: list[Point], title: str = "", control: list[Point] | None = None,
           bounds: dict[int, tuple[float, float]] | None = None):
    """The chart as a matplotlib Figure. `control`: another run's training means (e.g. a frozen policy), drawn as a
    grey line for comparison. `bounds`: epoch -> (lowest, highest) reward of that epoch; the one-std band is
    clipped to it, so a bounded reward (a probability) never shows a band below its floor. matplotlib (Agg, no
    pyplot state) is imported here, where a chart is drawn, and nowhere else."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(W / DPI, H / DPI), dpi=DPI)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.set_title(f"{title}: reward per epoch" if title else "reward per epoch", fontsize=11, loc="left")
    ax.set_xlabel("epoch")
    ax.set_ylabel("reward")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # round ticks; epochs are whole numbers
    ax.grid(True, color="#e4e4e4", linewidth=0.8)
    ax.set_axisbelow(True)
    control = control or []
    if not (train or evals or control):
        ax.text(0.5, 0.5, "no finished epoch yet", transform=ax.transAxes, ha="center", va="center")
        ax.set_yticks([])
        ax.set_xticks([])
    if train:
        e = [p[0] for p in train]
        m = [p[1] for p in train]
        lo, hi = _band(train, bounds or {})
        if len(train) > 1:
            ax.fill_between(e, lo, hi, color=BAND, linewidth=0, label="± 1 std (within the epoch's rewards)")
        else:
            ax.errorbar(e, m, yerr=[[m[0] - lo[0]], [hi[0] - m[0]]], color=BAND, elinewidth=5, fmt="none",
                        label="± 1 std (within the epoch's rewards)")
        ax.plot(e, m, color=LINE, linewidth=2, marker="o", markersize=3, label="mean (training samples)")
    if len(control) > 1:
        ax.plot([p[0] for p in control], [p[1] for p in control], color=CONTROL, linewidth=2,
                label="control (frozen policy)")
    if evals:  # only a run that evaluates gets the entry
        ax.errorbar([p[0] for p in evals], [p[1] for p in evals], yerr=[p[2] for p in evals], fmt="o",
                    mfc="white", mec=EVAL, ecolor=EVAL, mew=1.5, markersize=6, label="evaluation (held-out)")
    epochs = [p[0] for p in train + evals + control]
    if epochs and max(epochs) - min(epochs) < 2:  # one or two epochs: whole-epoch ticks need some room
        ax.set_xlim(min(epochs) - 1, max(epochs) + 1)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="best", fontsize=8, frameon=False)
    fig.tight_layout()
    return fig


def _band(train: list[Point], bounds: dict[int, tuple[float, float]]) -> tuple[list[float], list[float]]:
    lo, hi = [], []
    for e, m, s in train:
        b_lo, b_hi = bounds.get(e, (-math.inf, math.inf))
        lo.append(max(m - s, b_lo))
        hi.append(min(m + s, b_hi))
    return lo, hi


def bounds_of(records: Iterable[dict[str, Any]]) -> dict[int, tuple[float, float]]:
    """epoch -> (reward_min, reward_max) from the epoch records that carry them (runs before they were recorded
    have none: their band is not clipped)."""
    out = {}
    for r in records:
        lo, hi = r.get("reward_min"), r.get("reward_max")
        if r.get("kind") == "epoch" and isinstance(r.get("epoch"), int) and _finite(lo) and _finite(hi):
            out[r["epoch"]] = (float(lo), float(hi))
    return out


def _save(fig, path: Path) -> Path:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        fig.savefig(tmp, format="png", dpi=DPI)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
