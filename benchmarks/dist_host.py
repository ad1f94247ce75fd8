"""The distributed runtime with one process against eager, same config, alternating runs (issue 41, item 3;
docs/performance.md "The distributed runtime's host cost at one process").

The 2026-11-24 host-overhead row (benchmarks/RESULTS.md, `--host-overhead --variants eager_k1 dist_none_k1`) put
the one-process distributed runtime 30% above eager (64.4 / 102.7 against 49.4 / 82.7 host ms per sampling step /
trained timestep). Its per-step code is eager's (one process: no DDP wrapper, compile=none: the functions as they
are), so this runs the two variants of benchmarks/probes/host_overhead.py alternately (model=tiny by default, or
--model sd14_topology for that row's shape) and reports per run: the host ms per sampling step and per trained
timestep (the main thread's CPU time, time.thread_time, medians of epochs 1 and 2) and the wall ms, at each
OMP_NUM_THREADS given (0: unset, torch's default of one thread a core).

    PYTHONPATH=$PWD python benchmarks/dist_host.py --repeats 2 [--threads N] [--model tiny]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import runner  # noqa: E402
from benchmarks.probes.host_overhead import HOST_ARGS, HOST_VARIANTS, with_variant  # noqa: E402

VARIANTS = ("eager_k1", "dist_none_k1")


def one(name: str, root: Path, model: str, threads: int | None) -> dict:
    args = with_variant(HOST_ARGS, [*HOST_VARIANTS[name], f"model={model}"]) + [f"output_root={root}",
                                                                              f"run_name={name}"]
    env = runner.clean_env(**({"OMP_NUM_THREADS": str(threads)} if threads else {}))
    proc, wall = runner.run_train(args, env=env)
    if proc.returncode:
        return {"variant": name, "error": runner.failure(proc, 800)}
    epochs = runner.read_records(root / name, "epoch")[1:]
    med = lambda xs: round(statistics.median(xs), 2)
    ph = lambda e, k: e["phases"][k]
    return {"variant": name, "threads": threads or f"default ({os.cpu_count()})",
            "host_ms_per_sampling_step": med([1000 * ph(e, "sampling")["host_seconds"] / 16 for e in epochs]),
            "wall_ms_per_sampling_step": med([1000 * ph(e, "sampling")["seconds"] / 16 for e in epochs]),
            "host_ms_per_trained_timestep": med([1000 * ph(e, "training")["host_seconds"] / 32 for e in epochs]),
            "wall_ms_per_trained_timestep": med([1000 * ph(e, "training")["seconds"] / 32 for e in epochs]),
            "run_wall_s": round(wall, 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, nargs="*", default=[0], help="OMP_NUM_THREADS per run (0: unset)")
    ap.add_argument("--model", default="tiny")
    a = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.repeats):
            for k in a.threads:
                for name in VARIANTS:
                    rows.append(runner.progress(one(name, Path(tmp) / f"{r}_{k}", a.model, k or None)))
    print(runner.table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
