"""A second launch while a training process holds this host's accelerator is refused at once, naming the holder."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests.helpers import REPO, clean_env, timed_run, wait_for_event  # noqa: F401

pytestmark = pytest.mark.torch_free  # no torch in the test or what it starts (tests/conftest.py)

HOLD = """
import sys, time
from pathlib import Path
from ddpo_tpu.proc.lock import AcceleratorLock, default_lock_path
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
        proc, wall, cpu = timed_run([sys.executable, "-m", "ddpo_tpu.train", "+experiment=smoke",
                                     "lock_accelerator=true"], cwd=tmp_path, env=clean_env(XDG_CACHE_HOME=str(cache)),
                                    timeout=60)
        assert proc.returncode == 3, proc.stderr
        # refused by the front end before a training process exists: a worker needs a run dir (checked below); a
        # CPU-seconds bound here once stood for it and varied with the machine's load
        assert f"pid {holder.pid}" in proc.stderr and "/runs/holder" in proc.stderr and "UTC" in proc.stderr
        assert not (tmp_path / "outputs").exists()
    finally:
        holder.kill()
        holder.wait()
    # the holder died (SIGKILL): the kernel freed its lock, so the next launch may take it
    from ddpo_tpu.proc.lock import AcceleratorLock, default_lock_path

    assert AcceleratorLock.holder(default_lock_path(cache / "ddpo_tpu", "cpu")) is None


@pytest.mark.needs_torch
@pytest.mark.slow  # a real run, up to its first sampling batch
def test_second_identical_command_on_a_run_dir_is_refused_naming_the_holder(tmp_path, model_cache):
    """One writer per run dir on every accelerator (CPU too): the same command twice is refused fast, with exit 3,
    before the running run's files are touched."""
    import psutil

    from ddpo_tpu.rundir import events as ev
    from ddpo_tpu.proc.lock import run_dir_lock_path

    args = ["+experiment=smoke", "num_epochs=2", "reward.host_workers=0", f"model.cache_dir={model_cache}"]
    run = tmp_path / "outputs" / "smoke"
    first = subprocess.Popen([sys.executable, "-m", "ddpo_tpu.train", *args], cwd=tmp_path, env=clean_env(),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_event(run, "phase_start", first, phase="sampling")
        (worker,) = psutil.Process(first.pid).children()
        config_before = (run / "config.yaml").stat().st_mtime_ns
        second, wall, cpu = timed_run([sys.executable, "-m", "ddpo_tpu.train", *args], cwd=tmp_path, env=clean_env(),
                                      timeout=120)
        assert second.returncode == 3, second.stdout + second.stderr
        assert f"pid {worker.pid}" in second.stderr and "UTC" in second.stderr and str(run) in second.stderr
        assert "Traceback" not in second.stderr
        assert (run / "config.yaml").stat().st_mtime_ns == config_before
        # refused by the front end: no second training process was started (the front end records each one it
        # starts)
        assert [r["event"] for r in ev.read_events(run)].count("worker_started") == 1
        assert run_dir_lock_path(run).is_file()
    finally:
        first.kill()
        for child in psutil.Process().children(recursive=True):
            child.kill()
        first.wait()


@pytest.mark.needs_torch
@pytest.mark.slow  # one short real run
def test_two_identical_commands_started_together_one_is_refused_at_once(tmp_path, model_cache):
    """The front end takes the run dir's lock before it writes anything (and hands it to its training process):
    of two identical commands started within a second, one runs and the other exits 3 in its front end, naming the
    holder, with no training process of its own and nothing of the run's touched."""
    from ddpo_tpu.rundir import events as ev

    args = ["+experiment=smoke", "num_epochs=1", "sample.num_steps=2", "reward.host_workers=0",
            f"model.cache_dir={model_cache}"]
    t0 = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-m", "ddpo_tpu.train", *args], cwd=tmp_path, env=clean_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        while all(p.poll() is None for p in procs):
            assert time.perf_counter() - t0 < 120, "neither command ended"
            time.sleep(0.05)
        elapsed = time.perf_counter() - t0
        (loser,) = [p for p in procs if p.poll() is not None]
        (winner,) = [p for p in procs if p is not loser]
        out, err = loser.communicate()
        print(f"the second command was refused {elapsed:.2f} s after both started")
        assert loser.returncode == 3, out + err
        assert "is in use by pid" in err and "UTC" in err and "Traceback" not in err
        assert "run dir:" not in out  # refused before the config was printed, let alone saved
        assert winner.wait(timeout=600) == 0, winner.communicate()[1][-2000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    run = tmp_path / "outputs" / "smoke"
    started = [r for r in ev.read_events(run) if r["event"] == "worker_started"]
    assert len(started) == 1  # one training process ever ran in this run dir
    from ddpo_tpu.proc.lock import AcceleratorLock, run_dir_lock_path

    assert AcceleratorLock.holder(run_dir_lock_path(run)) is None  # released when the run ended
