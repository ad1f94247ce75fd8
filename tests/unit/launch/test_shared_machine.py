"""Several runs on one machine: a model cache built once under a lock (ddpo_tpu/proc/build_cache.py), a CPU run
told about the others (ddpo_tpu/launch/busy.py), and a run dir lock whose holder is exiting waited for instead of
refused (ddpo_tpu/proc/lock.py)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from ddpo_tpu.proc import lock as lockmod
from ddpo_tpu.proc.build_cache import build_once


class _Announces:
    """sys.stderr, setting `event` when a line containing `words` is written to it."""

    def __init__(self, inner, words: str, event: threading.Event):
        self.inner, self.words, self.event = inner, words, event

    def write(self, text: str) -> int:
        if self.words in text:
            self.event.set()
        return self.inner.write(text)

    def flush(self) -> None:
        self.inner.flush()


def test_a_second_builder_waits_for_the_first_and_reuses_its_build(tmp_path, capfd, monkeypatch):
    calls = []
    started, waiting = threading.Event(), threading.Event()
    monkeypatch.setattr(sys, "stderr", _Announces(sys.stderr, "waiting for it", waiting))

    def build(tmp):
        calls.append(tmp)
        started.set()
        # the build lasts until the second builder has said it waits (not a fixed second, which a busy machine can
        # spend before the second builder even looks, finding the build done and saying nothing)
        assert waiting.wait(60), "the second builder never said it waits"
        (tmp / "model.bin").write_bytes(b"weights")

    results = []
    first = threading.Thread(target=lambda: results.append(build_once(tmp_path, "m", ["model.bin"], build)))
    first.start()
    assert started.wait(10)
    second = build_once(tmp_path, "m", ["model.bin"], build)  # the lock is a flock: a second open file waits
    first.join()
    assert len(calls) == 1 and results == [second] and (second / "model.bin").read_bytes() == b"weights"
    err = capfd.readouterr().err
    assert f"{tmp_path / 'm'} is being built by pid {os.getpid()}" in err and "waiting for it" in err


def test_a_killed_builder_leaves_the_lock_free(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from ddpo_tpu.proc.build_cache import build_once\n"
        "build_once(sys.argv[1], 'm', ['f'], lambda tmp: (print('building', flush=True), time.sleep(60)))"),
        str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "building"
        child.kill()
        child.wait()
        t0 = time.monotonic()
        out = build_once(tmp_path, "m", ["f"], lambda tmp: (tmp / "f").write_text("x"))
        assert (out / "f").read_text() == "x" and time.monotonic() - t0 < 5
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_a_cpu_run_is_told_about_another_run_on_the_machine(tmp_path):
    from ddpo_tpu.env import RUN_DIR_VARIABLE
    from ddpo_tpu.launch.busy import busy_line

    other = tmp_path / "other-run"
    # a process that looks like another run's training process: its command and its run dir
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "-m", "ddpo_tpu.worker"],
                             env={**os.environ, RUN_DIR_VARIABLE: str(other)})
    try:
        time.sleep(0.3)
        line = busy_line(tmp_path / "mine")
        assert line is not None and line.startswith("note: this machine is busy")
        assert f"{other} (pid {child.pid})" in line
        assert busy_line(other) is None or str(other) not in busy_line(other)  # a run is not busy with itself
    finally:
        child.kill()
        child.wait()


def _hold_for(path, pid: int):
    """This process takes the flock of `path` naming `pid` as the holder (the open file a dying run still has)."""
    import fcntl

    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    rec = {"pid": pid, "run_dir": "x", "started": time.time(), "command": "c", "hostname": socket.gethostname()}
    os.write(fd, json.dumps(rec).encode())
    return fd


@pytest.mark.parametrize("holder", ["zombie", "dead"])
def test_a_lock_whose_holder_is_exiting_is_waited_for(tmp_path, holder):
    """A run SIGKILLed and started again at once: the killed process (a zombie here; or one whose descriptor another
    process still shares) frees the lock a moment later, and the new run takes it instead of exit 3."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    if holder == "dead":
        child.wait()
    else:
        while True:  # not reaped: a zombie
            with open(f"/proc/{child.pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
            time.sleep(0.05)
        assert lockmod._exiting(child.pid)
    path = tmp_path / "lock"
    fd = _hold_for(path, child.pid)
    t0 = time.monotonic()  # before the timer starts: a late t0 (a busy machine) would shorten the wait measured
    threading.Timer(1.5, os.close, (fd,)).start()
    lockmod.RunDirLock(tmp_path).acquire().release()
    assert 1.4 < time.monotonic() - t0 < lockmod.EXITING_WAIT_S
    child.wait()


def test_a_live_holder_is_still_refused_at_once(tmp_path):
    fd = _hold_for(tmp_path / "lock", os.getpid())
    try:
        assert not lockmod._exiting(os.getpid())
        t0 = time.monotonic()
        with pytest.raises(lockmod.RunDirBusy, match=f"in use by pid {os.getpid()}"):
            lockmod.RunDirLock(tmp_path).acquire()
        assert time.monotonic() - t0 < 1.0
    finally:
        os.close(fd)
