#!/usr/bin/env python
"""Measure a real accelerator the day one is at hand: images/s, MFU, peak device memory and compile time of the
trainer at a given shape; appends a table to benchmarks/RESULTS.md and prints the row as JSON last. A thin front
over benchmarks/probes/accelerator.py (its docstring, also this script's --help, has the GPU and TPU commands)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import runner  # noqa: E402
from benchmarks.probes import accelerator  # noqa: E402

if __name__ == "__main__":
    runner.main(accelerator, command="python scripts/bench_accelerator.py")
