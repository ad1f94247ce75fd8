"""A second launch while a training process holds this host's accelerator is refused at once, naming the holder."""

from __future__ import annotations

import subprocess
import sys
import time

from conftest import REPO, clean_env, run_train

HOLD = """
import sys, time
from pathlib import Path
from ddpo_tpu.launch.lock import AcceleratorLock, default_lock_path
lock = AcceleratorLock(default_lock_path(Path(sys.argv[1]) / "ddpo_tpu", "cpu"), Path("/runs/holder")).acquire()
print("held", flush=True)
time.sleep(60)
"""


def test_second_launch_is_refused_naming_the_holder(tmp_path):
    cache = tmp_path / "cache"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(cache)], cwd=REPO, env=clean_env(),
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        t0 = time.perf_counter()
        proc = run_train(["+experiment=smoke", "lock_accelerator=true"], tmp_path, timeout=30,
                         XDG_CACHE_HOME=str(cache))
        elapsed = time.perf_counter() - t0
        assert proc.returncode == 3, proc.stderr
        assert elapsed < 2.0, elapsed
        assert f"pid {holder.pid}" in proc.stderr and "/runs/holder" in proc.stderr and "UTC" in proc.stderr
        assert not (tmp_path / "outputs").exists()
    finally:
        holder.kill()
        holder.wait()
    # the holder died (SIGKILL): the kernel freed its lock, so the next launch may take it
    from ddpo_tpu.launch.lock import AcceleratorLock, default_lock_path

    assert AcceleratorLock.holder(default_lock_path(cache / "ddpo_tpu", "cpu")) is None
