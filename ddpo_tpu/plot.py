"""The reward curve as a PNG: the mean training reward per epoch with a band of one standard deviation, and the
evaluation rewards (fixed prompts, fixed noise) as points. Drawn with Pillow alone: the trainer already depends on
it for its image grids, it costs no import time worth noticing at the end of an epoch, and a line chart needs no
more than lines, a polygon and text (matplotlib would be a dependency of ~10 MB for one chart).

`curves(records)` takes metrics.jsonl's records; `draw(path, ...)` writes the PNG (atomically: a reader never sees
half a file). Written by the main process at the end of every epoch (ddpo_tpu/tracking.py) and by `ddpo-status
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
    train, evals = curves(read_metrics(run_dir / "metrics.jsonl"))
    return draw(run_dir / CURVE_FILE, train, evals, title=run_dir.name)


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


W, H = 720, 400
LEFT, RIGHT, TOP, BOTTOM = 78, 20, 40, 52
BG, AXIS, GRID, TEXT = (255, 255, 255), (60, 60, 60), (228, 228, 228), (30, 30, 30)
LINE, BAND, EVAL, CONTROL = (31, 119, 180), (198, 219, 239), (214, 39, 40), (140, 140, 140)


def draw(path: Path, train: list[Point], evals: list[Point], title: str = "",
         control: list[Point] | None = None) -> Path:
    """`control`: another run's training means (e.g. a frozen policy), drawn as a grey line for comparison."""
    from PIL import Image, ImageDraw, ImageFont

    img = Image.new("RGB", (W, H), BG)
    d = ImageDraw.Draw(img)
    try:
        font = ImageFont.load_default(size=13)
    except TypeError:  # Pillow < 10.1: the bitmap font, one size
        font = ImageFont.load_default()
    control = control or []
    pts = train + evals + control
    d.text((LEFT, 12), f"{title}: reward per epoch", fill=TEXT, font=font)
    lx = W - RIGHT - 290  # the legend: shapes, not glyphs (the default font has no bullet)
    d.line([(lx, 20), (lx + 18, 20)], fill=LINE, width=2)
    d.text((lx + 22, 12), "mean", fill=TEXT, font=font)
    d.rectangle([lx + 70, 14, lx + 88, 26], fill=BAND)
    d.text((lx + 92, 12), "± 1 std", fill=TEXT, font=font)
    d.ellipse([lx + 160, 16, lx + 168, 24], outline=EVAL, width=2)
    d.text((lx + 172, 12), "eval (fixed prompts)", fill=TEXT, font=font)
    x0, x1, y0, y1 = LEFT, W - RIGHT, H - BOTTOM, TOP
    if not pts:
        d.line([(x0, y1), (x0, y0), (x1, y0)], fill=AXIS, width=1)
        d.text((x0 + 12, (y0 + y1) // 2), "no finished epoch yet", fill=TEXT, font=font)
        return _save(img, path)
    e_lo, e_hi = min(p[0] for p in pts), max(p[0] for p in pts)
    lo = min(p[1] - p[2] for p in pts)
    hi = max(p[1] + p[2] for p in pts)
    if hi - lo < 1e-12:
        lo, hi = lo - 0.5, hi + 0.5
    pad = 0.05 * (hi - lo)
    lo, hi = lo - pad, hi + pad
    sx = lambda e: x0 + (x1 - x0) * ((e - e_lo) / (e_hi - e_lo) if e_hi > e_lo else 0.5)  # noqa: E731
    sy = lambda v: y0 - (y0 - y1) * (v - lo) / (hi - lo)  # noqa: E731
    for i in range(5):  # horizontal grid with the reward values
        v = lo + (hi - lo) * i / 4
        y = sy(v)
        d.line([(x0 + 1, y), (x1, y)], fill=GRID)
        d.text((6, y - 7), f"{v:.3g}", fill=TEXT, font=font)
    for e in sorted({e_lo, e_hi, *(_ticks(e_lo, e_hi))}):
        d.line([(sx(e), y0), (sx(e), y0 + 4)], fill=AXIS)
        d.text((sx(e) - 6, y0 + 8), str(e), fill=TEXT, font=font)
    d.text(((x0 + x1) // 2 - 16, H - 22), "epoch", fill=TEXT, font=font)
    if train:
        upper = [(sx(e), sy(m + s)) for e, m, s in train]
        lower = [(sx(e), sy(m - s)) for e, m, s in reversed(train)]
        if len(train) > 1:
            d.polygon(upper + lower, fill=BAND)
            d.line([(sx(e), sy(m)) for e, m, _ in train], fill=LINE, width=2)
        for e, m, s in train:
            if len(train) == 1:
                d.line([(sx(e), sy(m - s)), (sx(e), sy(m + s))], fill=BAND, width=5)
            d.ellipse([sx(e) - 2, sy(m) - 2, sx(e) + 2, sy(m) + 2], fill=LINE)
    if len(control) > 1:
        d.line([(sx(e), sy(m)) for e, m, _ in control], fill=CONTROL, width=2)
        d.text((sx(control[-1][0]) - 150, sy(control[-1][1]) - 18), "control (frozen policy)", fill=CONTROL,
               font=font)
    for e, m, s in evals:
        d.line([(sx(e), sy(m - s)), (sx(e), sy(m + s))], fill=EVAL, width=1)
        d.ellipse([sx(e) - 4, sy(m) - 4, sx(e) + 4, sy(m) + 4], outline=EVAL, width=2)
    d.line([(x0, y1), (x0, y0), (x1, y0)], fill=AXIS, width=1)  # last: over the band and the grid
    return _save(img, path)


def _ticks(lo: int, hi: int) -> list[int]:
    span = hi - lo
    if span <= 0:
        return []
    step = max(1, 10 ** int(math.log10(span)))
    if span / step < 3:
        step = max(1, step // 2)
    return list(range(lo - lo % step + step, hi, step))


def _save(img, path: Path) -> Path:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    img.save(tmp, format="PNG")
    os.replace(tmp, path)
    return path
