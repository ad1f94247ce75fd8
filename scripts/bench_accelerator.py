#!/usr/bin/env python
"""Measure a real accelerator the day one is at hand. Two commands:

    python scripts/bench_accelerator.py --model sd14 -- OVERRIDES...   # the trainer at a shape: images/s, MFU, peak
                                                                       # memory, compile time (probes/accelerator.py)
    python scripts/bench_accelerator.py --side-by-side --ddpo-pytorch CLONE --flow-grpo CLONE --ref-site sd14 SITE \\
        --ref-site sd35 SITE                                           # ddpo_tpu against ddpo-pytorch and flow_grpo
                                                                       # on this device (probes/side_by_side.py)

Each appends a table to benchmarks/RESULTS.md and prints its result as JSON last; --help after the first flag shows
that probe's own help. scripts/device_check.sh runs the side-by-side one on a lent GPU."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import runner  # noqa: E402
from benchmarks.probes import accelerator, side_by_side  # noqa: E402

if __name__ == "__main__":
    if "--side-by-side" in sys.argv[1:]:
        argv = [a for a in sys.argv[1:] if a != "--side-by-side"]
        runner.main(side_by_side, argv, command="python scripts/bench_accelerator.py --side-by-side")
    else:
        runner.main(accelerator, command="python scripts/bench_accelerator.py")
