#!/usr/bin/env python
"""The cost of output_root=gs://... (issue 13) on the smoke run against a local run dir, on fake-gcs-server; appends
a table to benchmarks/RESULTS.md. A thin front over benchmarks/probes/bucket.py.

    python scripts/bench_bucket.py            # 3 runs each, about 3 minutes on 2 cores
    python scripts/bench_bucket.py --runs 1 --no-append
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import runner  # noqa: E402
from benchmarks.probes import bucket  # noqa: E402

if __name__ == "__main__":
    runner.main(bucket, command="python scripts/bench_bucket.py")
