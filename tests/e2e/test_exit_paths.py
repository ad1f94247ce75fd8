"""Every way the launcher's job ends on a fault, one process and two (tpu_topology=cpu_dist2: torchrun, two gloo
ranks): a rank's own error, a killed rank, a full disk, a run dir that turns read-only mid-run. Each ends with exactly
one `error:` line on the console (stdout and stderr together), no traceback, the documented exit code, and nothing
lost: the last checkpoint verifies, and where the docs say so the same command resumes (docs/operations.md, "Exit
codes"). A hung rank is proc/rankwatch.py's path (tests/e2e/test_rank_faults.py, tests/e2e/test_distributed.py).

The disk faults are real, not injected at a Python call: the run's output root is a small tmpfs in a private mount
namespace held by a sleeping keeper process (`unshare -m`), so every write of every process (front end, torchrun,
ranks; Python, torch and C libraries alike) meets the kernel's ENOSPC or EROFS. Full: a file fills the tmpfs.
Read-only: the run dir is bind-mounted over itself and that mount remounted read-only (what docs/operations.md's
"Tried here" did); descriptors opened before keep writing, as on a disk remounted read-only by an operator. Nothing
of this leaks out of the namespace, and the keeper's death takes the tmpfs with it. Without the privilege to make a
mount namespace (not root, no CAP_SYS_ADMIN) those tests are skipped, saying so.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ddpo_tpu.rundir import events as ev
from tests.helpers import clean_env, wait_for_event

BASE = ["+experiment=smoke", "num_epochs=2", "save_freq=1", "reward.host_workers=0", "sample.num_batches_per_epoch=1",
        "run_name=faulty"]
TOPOLOGIES = {"one": [], "two": ["tpu_topology=cpu_dist2", "distributed.compile=none", "sample.batch_size=2",
                                 "train.batch_size=1"]}
EXIT_FAILED = 1
EXIT_CONFIG = 2
WORKER = "ddpo_tpu.worker"


def console_errors(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("error:")]


def assert_one_line(code: int, out: str, *named: str, want_code: int = EXIT_FAILED) -> str:
    """The job's end as the docs promise it: the exit code, one `error:` line naming `named`, no traceback."""
    errors = console_errors(out)
    assert code == want_code, out[-4000:]
    assert len(errors) == 1, "\n".join(errors) + "\n----\n" + out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    for part in named:
        assert part in errors[0], errors[0]
    return errors[0]


def assert_checkpoint_intact(run_dir: Path, epoch: int) -> None:
    """The checkpoint of `epoch` is in place and its files match the sums in its state.json."""
    from ddpo_tpu.training.checkpoint_files import verify

    assert verify(run_dir / "checkpoints" / f"epoch_{epoch:04d}")["epoch"] == epoch


class Mounts:
    """A private mount namespace (held by a sleeping keeper) whose `root` is a tmpfs of `size_mb`; commands run in it
    through nsenter, and its files are read from here through /proc/KEEPER/root."""

    def __init__(self, root: Path, size_mb: int = 128):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        script = f"mount -t tmpfs -o size={size_mb}m ddpo-test {self.root} && echo mounted && exec sleep 3600"
        try:
            self.keeper = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        except FileNotFoundError:
            pytest.skip("needs unshare(1) to give the run a tmpfs of its own")
        if self.keeper.stdout.readline().strip() != "mounted":
            why = self.keeper.stderr.read().strip()
            self.keeper.wait()
            pytest.skip(f"cannot make a private mount namespace with a tmpfs here (needs root): {why}")

    def view(self, path: Path) -> Path:
        """`path` as the namespace sees it, from outside it."""
        return Path(f"/proc/{self.keeper.pid}/root") / Path(path).relative_to("/")

    def command(self, cmd: list[str]) -> list[str]:
        return ["nsenter", "-t", str(self.keeper.pid), "-m", "--", *cmd]

    def sh(self, script: str) -> None:
        subprocess.run(self.command(["sh", "-c", script]), check=True, capture_output=True)

    def fill(self) -> None:
        """The tmpfs full: a file takes every block left (dd stops at ENOSPC)."""
        self.sh(f"dd if=/dev/zero of={self.root}/fill bs=1M 2>/dev/null; true")

    def free(self) -> None:
        self.sh(f"rm -f {self.root}/fill")

    def read_only(self, path: Path) -> None:
        self.sh(f"mount --bind {path} {path} && mount -o remount,bind,ro {path}")

    def writable(self, path: Path) -> None:
        self.sh(f"umount {path}")

    def close(self) -> None:
        self.keeper.kill()
        self.keeper.wait()


@pytest.fixture
def mounts(tmp_path):
    m = Mounts(tmp_path / "disk")
    yield m
    m.close()


def start(args: list[str], cwd: Path, wrap=None, **env: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "ddpo_tpu.train", *args]
    return subprocess.Popen(wrap(cmd) if wrap else cmd, cwd=cwd, env=clean_env(**env), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def into_epoch_1(run_dir: Path, proc: subprocess.Popen) -> None:
    """Wait until epoch 0 is done (its checkpoint in place) and epoch 1 samples."""
    wait_for_event(run_dir, "phase_start", proc, timeout=240, epoch=1, phase="sampling")


# --- a rank's own error --------------------------------------------------------------------------------------------

FAULTY_OCR = '''
import os

from ddpo_tpu.rewards.base import RewardError

FLAG = {flag!r}


def read(images):
    """Reads every sign right until FLAG exists, then refuses as a recogniser's service would."""
    if os.path.exists(FLAG):
        raise RewardError("ocr", "the recogniser stand-in refused (tests/e2e/test_exit_paths.py)")
    return ["cat"] * len(images)
'''


@pytest.mark.slow
@pytest.mark.parametrize("topology", list(TOPOLOGIES))
def test_a_ranks_own_error_is_its_one_line(tmp_path, topology):
    """The reward of epoch 1 raises its RewardError (on every rank: they score their own samples): the rank's own
    line, and nothing from torchrun or the front end about how the rank exited."""
    flag = tmp_path / "refuse"
    (tmp_path / "faulty_ocr.py").write_text(FAULTY_OCR.format(flag=str(flag)))
    (tmp_path / "prompts.txt").write_text('a sign that says "cat"\na sign that says "dog"\n')
    args = [*BASE, *TOPOLOGIES[topology], "reward=ocr", "reward.recognizer=faulty_ocr:read", "prompts=from_file",
            f"prompts.file={tmp_path / 'prompts.txt'}", f"output_root={tmp_path / 'runs'}"]
    run_dir = tmp_path / "runs" / "faulty"
    proc = start(args, tmp_path, PYTHONPATH=f"{tmp_path}{os.pathsep}{clean_env()['PYTHONPATH']}")
    into_epoch_1(run_dir, proc)
    flag.touch()
    code, out = finish(proc)
    assert_one_line(code, out, "the recogniser stand-in refused")
    assert_checkpoint_intact(run_dir, 0)


# --- a killed rank -------------------------------------------------------------------------------------------------

def _ranks(front_end: int) -> list:
    """The processes running the worker under this front end (one, or torchrun's ranks)."""
    import psutil

    def module(cmd: list[str]) -> str:  # python [-u] -m MODULE ...: torchrun's own command runs ddpo_tpu.torchrun
        return cmd[cmd.index("-m") + 1] if "-m" in cmd[:-1] else ""

    return [p for p in psutil.Process(front_end).children(recursive=True) if module(p.cmdline()) == WORKER]


# both extended (docs/testing.md); CI makes their checks on siblings:
@pytest.mark.slow
@pytest.mark.parametrize("topology", [
    # ~45 s here: one process killed, exit 1 in one `error:` line, no traceback: tests/e2e/test_faults.py's
    # test_a_killed_training_process_exits_1_with_one_line
    pytest.param("one", marks=pytest.mark.extended),
    # ~72 s here: a killed rank named in one line and an exact resume: tests/e2e/test_distributed.py's
    # test_a_stopped_or_killed_rank_ends_the_job_naming_it_and_the_run_resumes_exactly
    pytest.param("two", marks=pytest.mark.extended)])
def test_a_killed_rank_is_one_line_and_the_same_command_resumes(tmp_path, topology):
    args = [*BASE, *TOPOLOGIES[topology], f"output_root={tmp_path / 'runs'}"]
    run_dir = tmp_path / "runs" / "faulty"
    proc = start(args, tmp_path)
    into_epoch_1(run_dir, proc)
    ranks = _ranks(proc.pid)
    assert len(ranks) == (2 if topology == "two" else 1), ranks
    max(ranks, key=lambda p: p.pid).send_signal(signal.SIGKILL)  # one worker: the last started
    code, out = finish(proc)
    assert_one_line(code, out, "SIGKILL")
    assert_checkpoint_intact(run_dir, 0)
    again = start(args, tmp_path)
    code, out = finish(again)
    assert code == 0, out[-4000:]
    assert [e["epoch"] for e in ev.read_events(run_dir) if e["event"] == "resumed"][-1:] == [0]


# --- the run dir's disk: full, read-only -----------------------------------------------------------------------------

# CI runs each fault and each topology once (pairwise: a full disk under one process, a read-only one under two);
# the other two pairs are extended (~65 and ~45 s here, docs/testing.md): the one-line refusal is written by the same
# storage layer whichever process meets the fault first
@pytest.mark.slow
@pytest.mark.parametrize("fault, topology", [
    ("full", "one"), ("read_only", "two"),
    pytest.param("full", "two", marks=pytest.mark.extended),
    pytest.param("read_only", "one", marks=pytest.mark.extended)])
def test_a_disk_fault_mid_run_is_one_line_and_the_same_command_resumes(tmp_path, mounts, topology, fault):
    """The disk under the run dir fills, or turns read-only, while epoch 1 samples: one line naming the refused
    write and the fix, exit 1, no traceback (from any process, at any later write: events, metrics, samples,
    checkpoint, heartbeat, the lock's record, train.log); the checkpoint of epoch 0 verifies; with the disk fixed the
    same command resumes from it and finishes."""
    root = mounts.root
    args = [*BASE, *TOPOLOGIES[topology], f"output_root={root}"]
    run_dir = root / "faulty"
    proc = start(args, tmp_path, wrap=mounts.command)
    into_epoch_1(mounts.view(run_dir), proc)
    if fault == "full":
        mounts.fill()
    else:
        mounts.read_only(run_dir)
    code, out = finish(proc)
    line = assert_one_line(code, out, "the same command")
    assert ("no space left" in line.lower()) == (fault == "full"), line
    assert ("Read-only file system" in line) == (fault == "read_only"), line
    assert_checkpoint_intact(mounts.view(run_dir), 0)
    # the same command before the disk is fixed: refused by the front end in one line, nothing started
    started = len([e for e in ev.read_events(mounts.view(run_dir)) if e["event"] == "worker_started"])
    code, out = finish(start(args, tmp_path, wrap=mounts.command), timeout=120)
    assert_one_line(code, out, str(run_dir), want_code=EXIT_CONFIG)
    assert "nothing was started" in out, out[-4000:]
    assert len([e for e in ev.read_events(mounts.view(run_dir)) if e["event"] == "worker_started"]) == started
    if fault == "full":
        mounts.free()
    else:
        mounts.writable(run_dir)
    code, out = finish(start(args, tmp_path, wrap=mounts.command))
    assert code == 0, out[-4000:]
    resumed = [e["epoch"] for e in ev.read_events(mounts.view(run_dir)) if e["event"] == "resumed"]
    assert resumed[-1:] == [0], resumed
    assert_checkpoint_intact(mounts.view(run_dir), 1)


# the run dir's files and folders that each write path of an epoch writes (docs/operations.md, "The weights a run
# leaves", "Preemption, resume"): one made read-only at a time, the rest of the run dir left writable
WRITE_PATHS = {"events": "events.jsonl", "metrics": "metrics.jsonl", "samples": "samples", "checkpoint": "checkpoints",
               "weights": "weights"}


@pytest.mark.slow
@pytest.mark.parametrize("path", list(WRITE_PATHS))
def test_each_write_path_turning_read_only_is_one_line(tmp_path, mounts, path):
    """Only one write path of the run refuses (a read-only bind mount over that file or folder) while epoch 1
    samples: the run ends at that write with the one line naming it, no traceback after it (the rest of the
    run dir, where the ending writes go, stays writable), exit 1, and the checkpoint of epoch 0 intact."""
    run_dir = mounts.root / "faulty"
    proc = start([*BASE, f"output_root={mounts.root}"], tmp_path, wrap=mounts.command)
    into_epoch_1(mounts.view(run_dir), proc)
    target = run_dir / WRITE_PATHS[path]
    mounts.read_only(target)
    code, out = finish(proc)
    assert_one_line(code, out, str(target), "Read-only file system", "the same command")
    assert_checkpoint_intact(mounts.view(run_dir), 0)


# --- the pieces, without a run ---------------------------------------------------------------------------------------

def _failure(code: int, at: float, pid: int):
    import types

    return types.SimpleNamespace(exitcode=code, timestamp=at, pid=pid)


def test_rank_0_that_said_why_gets_no_second_line_without_its_event():
    """A full disk refuses rank 0's `error` event, so the launcher cannot read that it reported; its exit code says
    so (EXIT_RANK_SAID_WHY), and rank 1, ended after it, is not named either."""
    from ddpo_tpu import torchrun
    from ddpo_tpu.proc.exit_codes import EXIT_RANK_SAID_WHY

    assert torchrun.outcome({0: _failure(EXIT_RANK_SAID_WHY, 1, 10), 1: _failure(-signal.SIGTERM, 1, 11)},
                            reported=False) == (EXIT_FAILED, "")
    # rank 0 exiting 1 without a line (a traceback) is still named, once
    code, line = torchrun.outcome({0: _failure(1, 1, 10)}, reported=False)
    assert code == EXIT_FAILED and line.startswith("error: rank 0 (pid 10) exited with code 1")


def test_another_rank_that_said_why_is_quoted_or_named_never_by_its_internal_code():
    """Rank 1's own line is in its log only: quoted by the launcher; when its disk refused the log too, the
    launcher's line names the rank and its log, not the internal exit code."""
    from ddpo_tpu import torchrun
    from ddpo_tpu.proc.exit_codes import EXIT_RANK_SAID_WHY

    failures = {1: _failure(EXIT_RANK_SAID_WHY, 1, 11), 0: _failure(1, 2, 10)}
    code, line = torchrun.outcome(failures, own=lambda r: {1: "the reward refused"}.get(r, ""))
    assert (code, line) == (EXIT_FAILED, "error: rank 1 (pid 11): the reward refused (its output: ranks/rank1.log)")
    code, line = torchrun.outcome(failures, own=lambda r: "")
    assert code == EXIT_FAILED and line.startswith("error: rank 1 (pid 11) failed") and "ranks/rank1.log" in line
    assert str(EXIT_RANK_SAID_WHY) not in line


@pytest.mark.parametrize("adopted", [False, True])
def test_a_lock_whose_record_the_disk_refuses_is_still_given_back(tmp_path, monkeypatch, adopted):
    """Releasing the run dir's lock rewrites its record; on a read-only disk that write fails, and the release
    (in the worker's, torchrun's and the front end's last steps) must neither raise nor keep the lock."""
    import errno

    from ddpo_tpu.proc import lock as lockmod

    held = lockmod.RunDirLock(tmp_path).acquire()
    if adopted:  # the training process's share of the front end's lock
        child = lockmod.RunDirLock(tmp_path).adopt(held.handover_fd())
    else:
        child = held

    def refused(*_a, **_k):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(lockmod, "_write_record", refused)
    monkeypatch.setattr(lockmod.os, "ftruncate", refused)
    child.release()
    monkeypatch.undo()
    if adopted:
        held.release()
    lockmod.RunDirLock(tmp_path).acquire().release()  # free: taken at once, not RunDirBusy
