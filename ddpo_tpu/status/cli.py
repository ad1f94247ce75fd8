"""`ddpo-status RUN_DIR | SWEEP_DIR [--json | --brief] [--events N] [--plot [PNG]]`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ddpo_tpu.proc.cli_args import OneLineParser, at_least
from ddpo_tpu.display.plot import CURVE_FILE

from ddpo_tpu.status.facts import DEFAULT_STALE_S, Facts, collect
from ddpo_tpu.status.render import plot_curve, render, render_brief
from ddpo_tpu.status.sweep import Sweep, is_sweep_dir, render_sweep, render_sweep_brief, summarise, summarise_bucket

EXIT_OK = 0
EXIT_NO_RUN = 2
EXIT_UNREADABLE = 1  # a bucket that cannot be reached or read


def _parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="ddpo-status", description="Where a ddpo_tpu run stands (reads its run dir), or "
                                                                "every point of a sweep (reads its multirun dir).")
    p.add_argument("run_dir", help="the run dir (outputs/<run_name>, or gs://BUCKET/PREFIX/<run_name>), or a sweep's "
                                   "multirun dir (outputs/<run_name>-multirun): one row per point")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--json", action="store_true", help="print the facts as JSON")
    how.add_argument("--brief", action="store_true", help="one line: state, progress, phase, last event (a sweep: "
                                                          "one line per point)")
    p.add_argument("--events", type=at_least(0), default=0, metavar="N",
                   help="also show the last N events of the current attempt as text (default 0)")
    p.add_argument("--width", type=at_least(1), default=60, help="characters of the reward sparkline (default 60)")
    p.add_argument("--rows", type=at_least(0), default=10,
                   help="epochs in the table, the last ones (0: all; default 10)")
    p.add_argument("--stale-after", type=at_least(1, float), default=DEFAULT_STALE_S, metavar="SECONDS",
                   help="with no live lock holder and no heartbeat, a run silent for longer than this (or 1.5x its "
                        f"longest phase) is reported stopped (default {DEFAULT_STALE_S:.0f})")
    p.add_argument("--plot", nargs="?", const="", default=None, metavar="PNG",
                   help="also write the reward curve (mean ± std per epoch, eval rewards) to PNG (default: the run "
                        "dir's reward_curve.png; for a gs:// run, ./<run_name>-reward_curve.png)")
    return p


def report(target: str, stale_after: float = DEFAULT_STALE_S) -> Facts | Sweep:
    """The facts of a run dir, or the table of a sweep dir (local or in a bucket). Raises FileNotFoundError when
    `target` is neither."""
    if is_sweep_dir(target):
        return summarise(target, stale_after=stale_after)
    if not target.startswith("gs://"):
        return collect(target, stale_after=stale_after)
    try:
        return collect(target, stale_after=stale_after)
    except FileNotFoundError as no_run:
        try:
            return summarise_bucket(target, stale_after=stale_after)
        except FileNotFoundError:
            raise no_run from None


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.plot is not None:
        if is_sweep_dir(args.run_dir):
            print(f"ddpo-status: {args.run_dir}: --plot draws one run; give a point's dir ({args.run_dir}/0, ...)",
                  file=sys.stderr)
            return EXIT_NO_RUN
        out = args.plot or None
        if out is not None and Path(out).is_dir():  # a directory: the curve goes inside it
            out = str(Path(out) / CURVE_FILE)
        try:
            print(f"reward curve: {plot_curve(args.run_dir, out)}")
        except FileNotFoundError as e:
            print(f"ddpo-status: {e}", file=sys.stderr)
            return EXIT_NO_RUN
        except OSError as e:  # the PNG cannot be written there (a read-only dir, a full disk)
            print(f"ddpo-status: --plot {args.plot or ''}: cannot write {e.filename or out} ({e.strerror or e}) "
                  f"(give a writable path)", file=sys.stderr)
            return EXIT_NO_RUN
    from ddpo_tpu.rundir.storage import StorageError

    try:
        found = report(args.run_dir, args.stale_after)
    except FileNotFoundError as e:
        print(f"ddpo-status: {e}", file=sys.stderr)
        return EXIT_NO_RUN
    except StorageError as e:  # a bucket that cannot be reached or read: one line (unreachable vs denied), not a trace
        print(f"ddpo-status: {e}", file=sys.stderr)
        return EXIT_UNREADABLE
    if args.json:
        print(json.dumps(found.to_json(), indent=1, default=str, allow_nan=False))
    elif isinstance(found, Sweep):
        (render_sweep_brief if args.brief else render_sweep)(found)
    elif args.brief:
        render_brief(found, events=args.events)
    else:
        render(found, width=args.width, rows=args.rows, events=args.events)
    return EXIT_OK
