"""The front end's train.log tee when the run dir's disk fails mid-run (ddpo_tpu/launch/process.py): one `error:` line
naming the file, the training process stopped with SIGTERM (so it checkpoints where it can), its documented exit code
returned, no traceback, and the front end never leaves it running alone. The training process is a stand-in that
prints lines until SIGTERM, then "checkpoints" and exits 75 as the real one does."""

from __future__ import annotations

import errno
import os
import sys
import textwrap
from pathlib import Path

import pytest

from ddpo_tpu.rundir.events import read_events
from ddpo_tpu.launch import process

pytestmark = pytest.mark.torch_free  # no torch in the test or what it starts (tests/conftest.py)

CHILD = textwrap.dedent("""
    import signal, sys, time
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    for i in range(600):  # about a minute unless stopped
        print(f"[epoch 0] line {i}", flush=True)
        if stop:
            print("checkpoint written after SIGTERM", flush=True)
            sys.exit(75)
        time.sleep(0.1)
    sys.exit(0)
""")


def run(run_dir: Path, capfd) -> tuple[int, str]:
    code = process.run_training(dict(os.environ), run_dir / "train.log", cmd=[sys.executable, "-c", CHILD])
    out = capfd.readouterr()
    return code, out.out + out.err


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_a_full_disk_under_train_log_stops_the_run_in_one_line(tmp_path, capfd):
    (tmp_path / "train.log").symlink_to("/dev/full")  # every write: ENOSPC, as a full disk gives
    code, out = run(tmp_path, capfd)
    assert code == process.EXIT_PREEMPTED  # what the training process said: stopped after its checkpoint
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert errors == [f"error: {tmp_path / 'train.log'} could not be written (No space left on device): the training "
                      f"process was sent SIGTERM, to stop at its next safe point and checkpoint if its disk allows "
                      f"(make the run dir's disk writable or free space, then run the same command: it resumes from "
                      f"the last checkpoint)"]
    assert "checkpoint written after SIGTERM" in out and "Traceback" not in out
    assert "[epoch 0] line 0" in out  # the console still shows the training process's lines
    (exited,) = [e for e in read_events(tmp_path) if e["event"] == "worker_exited"]
    assert exited["code"] == 75 and "No space left on device" in exited["message"]


def test_a_disk_that_turns_read_only_mid_run(tmp_path, capfd, monkeypatch):
    """The first lines reach train.log, then the disk refuses (EROFS): the same one line, the run stopped."""
    real_open = open

    class ReadOnlyAfter:
        def __init__(self, f, n):
            self.f, self.n = f, n

        def write(self, data):
            self.n -= 1
            if self.n < 0:
                raise OSError(errno.EROFS, os.strerror(errno.EROFS))
            return self.f.write(data)

        def close(self):
            self.f.close()

    def fake_open(path, mode="r", *a, **kw):
        f = real_open(path, mode, *a, **kw)
        return ReadOnlyAfter(f, 3) if str(path).endswith("train.log") else f

    monkeypatch.setattr("builtins.open", fake_open)
    code, out = run(tmp_path, capfd)
    monkeypatch.undo()
    assert code == process.EXIT_PREEMPTED and "Traceback" not in out
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "could not be written (Read-only file system)" in errors[0]
    assert (tmp_path / "train.log").read_text().splitlines() == [f"[epoch 0] line {i}" for i in range(3)]
    assert "checkpoint written after SIGTERM" in out
    assert [e["event"] for e in read_events(tmp_path)] == ["worker_started", "worker_exited"]


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_a_training_process_that_names_the_disk_failure_is_the_one_line(tmp_path, capfd):
    """The same disk refuses the training process's own writes (its checkpoint, events.jsonl): it says so in its
    `error:` line and exits 1; the front end adds no second line about train.log."""
    (tmp_path / "train.log").symlink_to("/dev/full")
    child = CHILD.replace('print("checkpoint written after SIGTERM", flush=True)\n        sys.exit(75)',
                          'print("error: checkpoints: no space left on the disk", flush=True)\n        sys.exit(1)')
    assert child != CHILD
    code = process.run_training(dict(os.environ), tmp_path / "train.log", cmd=[sys.executable, "-c", child])
    out = capfd.readouterr()
    errors = [line for line in (out.out + out.err).splitlines() if line.startswith("error:")]
    assert code == process.EXIT_FAILED and errors == ["error: checkpoints: no space left on the disk"]
