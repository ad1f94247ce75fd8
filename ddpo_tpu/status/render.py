"""The report of one run: `render` (rich text), `render_brief` (one line), the reward sparkline, and the reward
curve as a PNG (`plot_curve`)."""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Any

from ddpo_tpu.status.decide import ago, duration
from ddpo_tpu.status.facts import Facts
from ddpo_tpu.status.read import read_any

BLOCKS = "▁▂▃▄▅▆▇█"
ASCII_BLOCKS = "_.-:=+*#"
STATE_STYLE = {"running": "bold cyan", "finished": "bold green", "failed": "bold red", "stopped": "bold yellow",
               "not started": "bold"}


def clock(t: float | None) -> str | None:
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


def fmt(x: Any, spec: str = ".4f") -> str:
    """A table cell: "-" for nothing, floats in a short fixed or exponent form."""
    if x is None:
        return "-"
    if isinstance(x, float):
        if x != 0 and (abs(x) < 1e-3 or abs(x) >= 1e5):
            return f"{x:.2e}"
        return format(x, spec)
    return str(x)


def console_blocks(console) -> str:
    """The sparkline's blocks, or ASCII ones where the console's encoding lacks them."""
    try:
        BLOCKS.encode(getattr(console.file, "encoding", None) or "utf-8")
        return BLOCKS
    except (UnicodeEncodeError, LookupError):
        return ASCII_BLOCKS


def _progress_text(f: Facts) -> str:
    n, done, cur = f.num_epochs, f.epochs_done, f.current_epoch
    text = f"{done}/{n if n is not None else '?'} epochs done"
    if f.state not in ("finished", "not started") and cur is not None:
        text += f"; epoch {cur}" + (f" (#{cur + 1} of {n})" if n else "")
    return text


def render_brief(f: Facts, events: int = 0, out=None) -> None:
    """One line (run, state, progress, phase, last write), then the text of the last `events` events."""
    out = out or sys.stdout
    parts = [f"{f.run_name}: {f.state_label}", _progress_text(f)]
    if f.phase_detail and f.state not in ("finished", "not started"):
        parts.append(f.phase_detail)
    if f.last_event_time is not None:
        parts.append(f"last event {ago(f.last_event_age_s)}")
    if f.last_error is not None and f.last_error.current_attempt:
        parts.append(f.last_error.line)
    print("; ".join(parts), file=out)
    for line in f.recent_events[-events:] if events > 0 else []:
        print("  " + line.replace("\n", "\n  "), file=out)


def render(f: Facts, width: int = 60, rows: int = 10, events: int = 0, console: Any = None) -> None:
    from rich.console import Console
    from rich.text import Text

    console = console or Console(highlight=False)

    def row(key: str, value: Any, style: str = "") -> None:
        t = Text(f"{key:<12}", style="dim")
        t.append(str(value), style=style)
        console.print(t, soft_wrap=True)

    head = Text(f.run_name, style="bold")
    if f.topology:
        head.append(f"  ({f.topology})", style="dim")
    head.append(f"  {f.run_dir}", style="dim")
    console.print(head, soft_wrap=True)
    _render_state(f, row)
    _render_files(f, row)
    if events > 0 and f.recent_events:
        console.print(Text("recent events", style="dim"))
        for line in f.recent_events[-events:]:
            console.print(Text("  " + line.replace("\n", "\n  ")), soft_wrap=True)
    if f.state == "failed" and f.train_log_tail:
        console.print(Text("train.log ends:", style="dim"))
        for line in f.train_log_tail:
            console.print(Text("  " + line, style="red"), soft_wrap=True)
    _render_rewards(f, console, width, rows, console_blocks(console))
    for note in f.notes:
        console.print(Text(f"note: {note}", style="yellow"), soft_wrap=True)


def _render_state(f: Facts, row) -> None:
    row("state", f.state_label, STATE_STYLE.get(f.state, "bold"))
    row("decided by", f"{f.decided_by} [{f.rule}]")
    prog = _progress_text(f)
    if f.global_step is not None:
        prog += f"; global step {f.global_step}"
    row("progress", prog)
    if f.phase_detail and f.state != "finished":
        row("phase", f.phase_detail if f.state == "running" else f"last seen: {f.phase_detail}")
    if f.last_event_time is not None:
        row("last event", f"{clock(f.last_event_time)} ({ago(f.last_event_age_s)}, {f.last_event_kind})")
    if f.state == "finished" and f.epoch_seconds_total:
        row("took", f"{duration(f.epoch_seconds_total)} in {f.epochs_done} epochs "
                    "(sum of phase seconds; model loading not included)")
    if f.train_log_mtime is not None:
        row("train.log", f"written {ago(f.now - f.train_log_mtime)}")
    if f.samples_per_s is not None:
        row("throughput", f"{f.samples_per_s:.2f} samples/s, {duration(f.epoch_seconds_mean)}/epoch "
                          f"(phase seconds, {f.rate_basis})")
    ht = f.host_time
    if ht is not None and ht.fraction is not None:
        big = sorted(ht.phases.items(), key=lambda kv: -kv[1].wall_s)[:2]
        row("host time", f"{ht.fraction:.0%} of epoch {ht.epoch} on the main thread "
                         f"({ht.host_s:.1f} of {ht.wall_s:.1f} s; "
                         + ", ".join(f"{k} {v.host_s:.1f}/{v.wall_s:.1f} s" for k, v in big)
                         + (")" if not ht.device_is_host else "; the CPU is the device here)")
                         + (": host-bound" if ht.fraction > 0.8 and not ht.device_is_host else ""))
    if f.eta_s is not None:
        left = (f.num_epochs or 0) - f.epochs_done
        row("ETA", f"{duration(f.eta_s)} ({left} epochs x {duration(f.epoch_seconds_mean)}), "
                   f"around {clock(f.eta_time)}" + ("" if f.state == "running" else " if resumed now"))


def _render_files(f: Facts, row) -> None:
    ck = f.checkpoints
    if ck is not None:
        text = f"{ck.count} in checkpoints/"
        if ck.latest:
            text += f", latest {ck.latest} ({ago(f.now - ck.latest_time)})"
        row("checkpoints", text)
    if f.state_layout is not None:
        row("layout", f"{f.state_layout.describe()} (from {f.state_layout.source})")
    par = f.parity
    if par is not None:
        row("parity", "ok" if not par.failing else "NOT met: " + ", ".join(map(str, par.failing)),
            "" if not par.failing else "yellow")
    err = f.last_error
    if err is not None:
        row("last error", err.line + ("" if err.current_attempt else "  (earlier attempt; the run went on)"),
            "red" if err.current_attempt else "dim red")


def _render_rewards(f: Facts, console, width: int, rows: int, blocks: str) -> None:
    from rich import box
    from rich.table import Table
    from rich.text import Text

    rw = f.reward
    if rw is not None:
        console.print()
        t = Text("reward      ", style="dim")
        t.append(sparkline(list(f.reward_curve), width, blocks), style="green")
        console.print(t, soft_wrap=True)
        console.print(Text(f"{'':12}first {fmt(rw.first)} (epoch {rw.first_epoch})  "
                           f"last {fmt(rw.last)} (epoch {rw.last_epoch})  "
                           f"best {fmt(rw.best)} (epoch {rw.best_epoch})"), soft_wrap=True)
    if f.epochs:
        shown = f.epochs[-rows:] if rows > 0 else f.epochs
        title = None if len(shown) == len(f.epochs) else f"last {len(shown)} of {len(f.epochs)} epochs"
        table = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False)
        for col in ("epoch", "reward mean", "reward std", "approx_kl", "clipfrac", "compiles", "seconds"):
            table.add_column(col, justify="right")
        for e in shown:
            table.add_row(str(e.epoch), fmt(e.reward_mean), fmt(e.reward_std), fmt(e.approx_kl),
                          fmt(e.clipfrac, ".3f"), fmt(e.new_compilations), fmt(e.seconds, ".1f"))
        console.print(table)
    _render_evaluations(f, console)


def _render_evaluations(f: Facts, console) -> None:
    """The run's finished evaluations (training's and ddpo-eval's), each reward's mean ± std: two checkpoints side
    by side are two `ddpo-eval` commands and this table."""
    from rich import box
    from rich.table import Table

    rows = getattr(f, "evaluations", ())
    if not rows:
        return
    labels = list(dict.fromkeys(k for r in rows for k in r.rewards))
    table = Table(title="evaluations (eval/)", box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("evaluation", "epoch", "step", "images", *labels):
        table.add_column(col, justify="left" if col == "evaluation" else "right")
    for r in rows:
        cells = [f"{fmt(m)} ± {fmt(s)}" if (m, s) != (None, None) else "-"
                 for m, s in (r.rewards.get(k, (None, None)) for k in labels)]
        table.add_row(r.name, fmt(r.epoch), fmt(r.global_step), fmt(r.num_images), *cells)
    console.print(table)


def plot_curve(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Draw the run's reward curve (ddpo_tpu/display/plot.py) from its metrics.jsonl, local or in a bucket."""
    from ddpo_tpu.display import plot

    url = str(run_dir).startswith("gs://")
    run = read_any(run_dir, lock_paths=[])
    name = str(run_dir).rstrip("/").rsplit("/", 1)[-1]
    if out is None:
        out = Path(f"{name}-{plot.CURVE_FILE}") if url else Path(run_dir) / plot.CURVE_FILE
    train, evals = plot.curves(run.metrics.records)
    return plot.draw(Path(out), train, evals, title=name, bounds=plot.bounds_of(run.metrics.records))
