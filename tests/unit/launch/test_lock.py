"""ddpo_tpu.proc.lock: one process per host holds the accelerator; a second launch (another process) is refused
within 2 seconds naming the holder; a lock left by a dead process (even SIGKILLed) is taken over."""

from __future__ import annotations

import json
import os
import pickle
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddpo_tpu.proc.lock import AcceleratorBusy, AcceleratorLock, LockHolder, default_lock_path

pytestmark = pytest.mark.torch_free  # no torch in the test or what it starts (tests/conftest.py)

REPO = Path(__file__).resolve().parents[3]

# a process that takes the lock, says so, optionally starts descendants that must NOT keep the lock, then waits
HOLDER = r"""
import os, subprocess, sys, time
from pathlib import Path
from ddpo_tpu.proc.lock import AcceleratorLock
lock = AcceleratorLock(Path(sys.argv[1]), Path(sys.argv[2]), command="holder-cmd --flag").acquire()
mode = sys.argv[3] if len(sys.argv) > 3 else ""
if mode == "fork":
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the fork handlers have run by the time fork() returns here
        os.write(w, b"x")
        time.sleep(60)
        os._exit(0)
    os.read(r, 1)
    print("DESCENDANT", pid, flush=True)
elif mode == "spawn":
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], close_fds=False)
    print("DESCENDANT", child.pid, flush=True)
elif mode == "release-after":
    print("ACQUIRED", flush=True)
    time.sleep(float(sys.argv[4]))
    print("RELEASING", time.monotonic(), flush=True)  # CLOCK_MONOTONIC: one clock for every process of the host
    lock.release()
    time.sleep(60)
print("ACQUIRED", flush=True)
time.sleep(60)
"""

# a second launch: tries once, reports how it went and how long the refusal took
CONTENDER = r"""
import sys, time
from pathlib import Path
t0 = time.monotonic()
from ddpo_tpu.proc.lock import AcceleratorBusy, AcceleratorLock
try:
    AcceleratorLock(Path(sys.argv[1]), Path(sys.argv[2])).acquire()
except AcceleratorBusy as e:
    print(f"{time.monotonic() - t0:.3f}", file=sys.stdout)
    print(e, file=sys.stderr)
    sys.exit(3)
print("ACQUIRED")
"""


def _python(code: str, *args: object) -> list[str]:
    return [sys.executable, "-c", code, *map(str, args)]


class Holder:
    """A holder process (and the descendants it reports), ended by pid on exit."""

    def __init__(self, lock_path: Path, run_dir: Path, *extra: object):
        self.proc = subprocess.Popen(_python(HOLDER, lock_path, run_dir, *extra), cwd=REPO, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        self.descendants: list[int] = []
        deadline = time.monotonic() + 20
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise AssertionError(f"holder ended early: {self.proc.wait()} {self.proc.stderr.read()}")
            if line.startswith("DESCENDANT"):
                self.descendants.append(int(line.split()[1]))
            if line.strip() == "ACQUIRED":
                break
            assert time.monotonic() < deadline

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def close(self) -> None:
        self.kill()
        for pid in self.descendants:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.stdout.close()
        self.proc.stderr.close()


@pytest.fixture
def paths(tmp_path):
    run_dir = tmp_path / "outputs" / "run"
    run_dir.mkdir(parents=True)
    return default_lock_path(tmp_path / "cache", "tpu"), run_dir


@pytest.fixture
def holders():
    started: list[Holder] = []
    yield lambda *a: started.append(Holder(*a)) or started[-1]
    for h in started:
        h.close()


def _contend(lock_path: Path, run_dir: Path) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    res = subprocess.run(_python(CONTENDER, lock_path, run_dir), cwd=REPO, capture_output=True, text=True, timeout=30)
    return res, time.monotonic() - t0


def _started_text(started: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(started))


# --- in one process ------------------------------------------------------------------------------------------------


def test_default_lock_path(tmp_path):
    assert default_lock_path(tmp_path, "tpu") == tmp_path / "locks" / "tpu.lock"
    for bad in ("", "a/b", "..", "."):
        with pytest.raises(ValueError):
            default_lock_path(tmp_path, bad)


def test_acquire_release_and_reacquire(paths):
    lock_path, run_dir = paths
    assert not lock_path.exists()
    assert AcceleratorLock.holder(lock_path) is None  # missing file: free, and holder() does not create it
    assert not lock_path.exists()

    lock = AcceleratorLock(lock_path, run_dir, command="train +experiment=x")
    assert lock.acquire() is lock and lock.held
    assert lock.acquire() is lock  # idempotent on the same object
    assert not os.get_inheritable(lock._fd)
    h = AcceleratorLock.holder(lock_path)
    assert h == lock.info
    assert (h.pid, h.run_dir, h.command, h.hostname) == (os.getpid(), str(run_dir.resolve()),
                                                         "train +experiment=x", socket.gethostname())
    assert abs(h.started - time.time()) < 60

    lock.release()
    assert not lock.held and lock.info is None
    assert AcceleratorLock.holder(lock_path) is None
    assert lock_path.exists() and lock_path.read_text() == ""  # emptied, never unlinked
    lock.release()  # no-op

    again = AcceleratorLock(lock_path, run_dir).acquire()
    assert AcceleratorLock.holder(lock_path).pid == os.getpid()
    again.release()


def test_json_is_complete_and_parseable_while_held(paths):
    lock_path, run_dir = paths
    with AcceleratorLock(lock_path, run_dir, command="python -m ddpo_tpu.train a=1") as lock:
        data = json.loads(lock_path.read_text())
        assert set(data) == {"format", "pid", "run_dir", "started", "command", "hostname"}
        assert data["format"] == 1
        assert data["pid"] == os.getpid()
        assert data["run_dir"] == str(run_dir.resolve())
        assert data["command"] == "python -m ddpo_tpu.train a=1"
        assert data["hostname"] == socket.gethostname()
        assert isinstance(data["started"], float) and data["started"] == lock.info.started
        assert LockHolder.from_json(lock_path.read_text()) == lock.info


def test_context_manager_releases_even_on_error(paths):
    lock_path, run_dir = paths
    with AcceleratorLock(lock_path, run_dir) as lock:
        assert lock.held and AcceleratorLock.holder(lock_path) is not None
    assert not lock.held and AcceleratorLock.holder(lock_path) is None

    with pytest.raises(KeyError):
        with AcceleratorLock(lock_path, run_dir):
            raise KeyError("boom")
    assert AcceleratorLock.holder(lock_path) is None
    AcceleratorLock(lock_path, run_dir).acquire().release()


def test_second_lock_object_in_same_process_is_refused(paths):
    lock_path, run_dir = paths
    with AcceleratorLock(lock_path, run_dir):
        t0 = time.monotonic()
        with pytest.raises(AcceleratorBusy) as err:
            AcceleratorLock(lock_path, run_dir).acquire()
        assert time.monotonic() - t0 < 0.5
        assert err.value.holder.pid == os.getpid()
        again = pickle.loads(pickle.dumps(err.value))
        assert str(again) == str(err.value) and again.holder == err.value.holder


def test_stale_record_of_a_dead_holder_is_ignored(paths):
    lock_path, run_dir = paths
    lock_path.parent.mkdir(parents=True)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = LockHolder(pid=int(dead.stdout), run_dir="/old/run", started=1.0, command="old", hostname="h")
    lock_path.write_text(stale.to_json())
    assert AcceleratorLock.holder(lock_path) is None  # flock free: the record is stale
    with AcceleratorLock(lock_path, run_dir) as lock:  # simply acquired, the record overwritten
        assert json.loads(lock_path.read_text())["pid"] == os.getpid() == lock.info.pid
    for junk in ("", "{not json", '{"pid": 1}'):
        lock_path.write_text(junk)
        assert AcceleratorLock.holder(lock_path) is None
        AcceleratorLock(lock_path, run_dir).acquire().release()


# --- across processes ----------------------------------------------------------------------------------------------


def test_second_launch_in_another_process_is_refused_within_2s_naming_the_holder(paths):
    lock_path, run_dir = paths
    with AcceleratorLock(lock_path, run_dir, command="python -m ddpo_tpu.train +experiment=smoke") as lock:
        res, wall = _contend(lock_path, Path("/elsewhere/run2"))
        assert res.returncode == 3, res
        assert wall < 2.0 and float(res.stdout) < 2.0
        msg = res.stderr
        started = _started_text(lock.info.started)
        assert re.search(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC", started)
        assert (f"the accelerator of this host is held by pid {os.getpid()} (run dir {run_dir.resolve()}, "
                f"started {started}, command python -m ddpo_tpu.train +experiment=smoke)") in msg
        assert f"kill -TERM {os.getpid()}: it checkpoints and exits" in msg
        assert "lock_accelerator=false" in msg
        assert AcceleratorLock.holder(lock_path) == lock.info  # the refused launch changed nothing
    res, _ = _contend(lock_path, run_dir)
    assert res.returncode == 0 and res.stdout.strip() == "ACQUIRED"


def test_lock_held_by_another_process_refuses_here_then_sigkill_frees_it(paths, holders):
    lock_path, run_dir = paths
    h = holders(lock_path, run_dir)
    named = AcceleratorLock.holder(lock_path)
    assert named is not None and named.pid == h.pid and named.run_dir == str(run_dir.resolve())
    assert named.command == "holder-cmd --flag"

    t0 = time.monotonic()
    with pytest.raises(AcceleratorBusy) as err:
        AcceleratorLock(lock_path, run_dir).acquire()
    assert time.monotonic() - t0 < 2.0
    assert err.value.holder == named and err.value.lock_path == lock_path
    assert f"held by pid {h.pid} (run dir {run_dir.resolve()}, started {_started_text(named.started)}" in str(err.value)

    h.kill()  # SIGKILL: no clean-up runs; the kernel drops the flock, the record stays behind
    assert json.loads(lock_path.read_text())["pid"] == h.pid
    assert AcceleratorLock.holder(lock_path) is None
    with AcceleratorLock(lock_path, run_dir) as lock:  # taken over
        assert AcceleratorLock.holder(lock_path).pid == os.getpid() == lock.info.pid


def test_timeout_waits_for_the_holder_to_release(paths, holders):
    lock_path, run_dir = paths
    h = holders(lock_path, run_dir, "release-after", 0.5)
    t0 = time.monotonic()
    with AcceleratorLock(lock_path, run_dir).acquire(timeout=10) as lock:
        acquired = time.monotonic()
        assert lock.held and AcceleratorLock.holder(lock_path).pid == os.getpid()
    # taken after the holder let go, by the holder's own clock: a duration measured from here would start late on a
    # busy machine (the holder's 0.5 s run from its "ACQUIRED", which this process may read long after)
    word, released = h.proc.stdout.readline().split()
    assert word == "RELEASING" and float(released) < acquired < t0 + 10
    assert h.proc.poll() is None  # it released while alive


def test_timeout_expires_with_busy(paths, holders):
    lock_path, run_dir = paths
    h = holders(lock_path, run_dir)
    t0 = time.monotonic()
    with pytest.raises(AcceleratorBusy) as err:
        AcceleratorLock(lock_path, run_dir).acquire(timeout=0.3)
    assert 0.3 <= time.monotonic() - t0 < 2.0
    assert err.value.holder.pid == h.pid


@pytest.mark.parametrize("mode", ["fork", "spawn"])
def test_descendants_do_not_keep_the_lock_after_the_holder_dies(paths, holders, mode):
    """fork()ed workers close their copy of the descriptor; exec'ed programs never get it (close-on-exec)."""
    lock_path, run_dir = paths
    h = holders(lock_path, run_dir, mode)
    assert len(h.descendants) == 1
    os.kill(h.descendants[0], 0)  # the descendant is alive
    assert AcceleratorLock.holder(lock_path).pid == h.pid
    h.kill()
    os.kill(h.descendants[0], 0)  # still alive, and yet the lock is free
    assert AcceleratorLock.holder(lock_path) is None
    AcceleratorLock(lock_path, run_dir).acquire().release()


def test_module_reads_no_environment_and_imports_no_torch():
    src = (REPO / "ddpo_tpu" / "proc" / "lock.py").read_text()
    assert not re.search(r"os\.environ|getenv|putenv", src)
    code = "import sys, ddpo_tpu.proc.lock; print(sys.modules.get('torch') is not None)"
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=30)
    assert res.returncode == 0 and res.stdout.strip() == "False"


# --- hand-over: the front end takes the run dir's lock before writing, its training process adopts it -----------------

ADOPT = """
import sys
from pathlib import Path
from ddpo_tpu.proc.lock import AcceleratorLock
lock = AcceleratorLock(Path(sys.argv[1]), Path(sys.argv[2])).adopt(int(sys.argv[3]))
print("adopted", flush=True)
sys.stdin.readline()
lock.release()
print("released", flush=True)
sys.stdin.readline()
"""


def _adopting_child(lock: AcceleratorLock, lock_path: Path, run_dir: Path) -> subprocess.Popen:
    fd = lock.handover_fd()
    try:
        child = subprocess.Popen([sys.executable, "-c", ADOPT, str(lock_path), str(run_dir), str(fd)], cwd=REPO,
                                 pass_fds=(fd,), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    finally:
        os.close(fd)
    assert child.stdout.readline().strip() == "adopted"
    return child


def test_a_handed_over_lock_names_the_child_and_goes_back_to_the_parent(paths):
    lock_path, run_dir = paths
    parent = AcceleratorLock(lock_path, run_dir).acquire()
    child = _adopting_child(parent, lock_path, run_dir)
    try:
        assert AcceleratorLock.holder(lock_path).pid == child.pid  # the training process names itself
        with pytest.raises(AcceleratorBusy):
            AcceleratorLock(lock_path, run_dir).acquire()
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "released"
        assert AcceleratorLock.holder(lock_path).pid == os.getpid()  # still held, by the parent again
    finally:
        child.kill()
        child.wait()
    assert AcceleratorLock.holder(lock_path).pid == os.getpid()  # the child's death changes nothing
    parent.release()
    assert AcceleratorLock.holder(lock_path) is None


def test_a_handed_over_lock_outlives_the_parent_and_dies_with_the_child(paths):
    """A SIGKILLed front end (its descriptor closed, no unlock) leaves the lock with the training process."""
    lock_path, run_dir = paths
    parent = AcceleratorLock(lock_path, run_dir).acquire()
    child = _adopting_child(parent, lock_path, run_dir)
    try:
        parent._forget_after_fork()  # what the parent's death does: its descriptor closed, the lock not released
        assert AcceleratorLock.holder(lock_path).pid == child.pid
        with pytest.raises(AcceleratorBusy):
            AcceleratorLock(lock_path, run_dir).acquire()
    finally:
        child.kill()
        child.wait()
    assert AcceleratorLock.holder(lock_path) is None
    AcceleratorLock(lock_path, run_dir).acquire().release()


def test_adopting_a_descriptor_of_another_file_is_refused(paths, tmp_path):
    lock_path, run_dir = paths
    AcceleratorLock(lock_path, run_dir).acquire().release()  # the lock file exists
    with open(tmp_path / "other", "w") as f, pytest.raises(ValueError, match="is not the lock"):
        AcceleratorLock(lock_path, run_dir).adopt(f.fileno())


# --- a whole job SIGKILLed and restarted at once (issue 43) ----------------------------------------------------------

# the front end and its training process as launch/process.py pairs them: the front end takes the run dir's lock and
# hands it over; the child adopts it (naming itself). Both hold some memory, so their exit takes a moment.
JOB = r"""
import os, subprocess, sys
from pathlib import Path
from ddpo_tpu.proc.lock import RunDirLock
run_dir = Path(sys.argv[1])
ballast = bytearray(64 << 20)
if len(sys.argv) > 2:  # the training process
    RunDirLock(run_dir).adopt(int(sys.argv[2]))
    print("adopted", flush=True)
    sys.stdin.readline()
    sys.exit(0)
lock = RunDirLock(run_dir).acquire()
fd = lock.handover_fd()
child = subprocess.Popen([sys.executable, "-c", os.environ["JOB_CODE"], str(run_dir), str(fd)], pass_fds=(fd,),
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
os.close(fd)
assert child.stdout.readline().strip() == "adopted"
print("ready", child.pid, flush=True)
sys.stdin.readline()
"""


@pytest.mark.parametrize("order", ["group", "child_first", "front_end_first"])
def test_a_killed_job_restarted_at_once_waits_for_its_lock_instead_of_refusing(tmp_path, order):
    """SIGKILL of the whole job, then the same command at once, 20 times in a row: the restart's acquire (timeout 0, as
    the front end's) waits for the dying holder's lock instead of raising RunDirBusy (exit 3). The holder is dying
    while the kernel has a SIGKILL queued for it (SigPnd), marks it exiting (PF_EXITING), or it is gone and its front
    end exits; it never refuses then, and it still refuses a live holder at once."""
    from ddpo_tpu.proc.lock import RunDirBusy, RunDirLock

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    env = {**os.environ, "JOB_CODE": JOB}
    waits = []
    for attempt in range(20 if order == "group" else 5):  # (the other orders: 5 each, for the shared CPUs' time)
        job = subprocess.Popen([sys.executable, "-c", JOB, str(run_dir)], cwd=REPO, env=env, stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True, start_new_session=True)
        line = job.stdout.readline().split()
        assert line[:1] == ["ready"], (attempt, line, job.poll())
        child = int(line[1])
        if attempt == 0:  # a live holder is refused at once
            t0 = time.monotonic()
            with pytest.raises(RunDirBusy, match=f"in use by pid {child}"):
                RunDirLock(run_dir).acquire()
            assert time.monotonic() - t0 < 2.0
        if order == "group":
            os.killpg(job.pid, signal.SIGKILL)
        else:
            first, second = (child, job.pid) if order == "child_first" else (job.pid, child)
            os.kill(first, signal.SIGKILL)
            os.kill(second, signal.SIGKILL)
        t0 = time.monotonic()
        lock = RunDirLock(run_dir).acquire()  # the restart: never RunDirBusy
        waits.append(time.monotonic() - t0)
        lock.release()
        job.wait(timeout=10)
        job.stdout.close()
        job.stdin.close()
        try:  # reap the child if it is ours to wait for (it is the job's; only its zombie may linger)
            os.waitpid(child, os.WNOHANG)
        except ChildProcessError:
            pass
    print(f"{order}: waited {max(waits):.3f} s at most over {len(waits)} restarts")
    assert max(waits) < 15.0


def test_a_reused_pid_is_not_the_holder_its_record_names():
    """The record names a pid and when it took the lock; a live process under that pid that started later is another
    process (the holder died and its pid was reused): an acquire waits for the lock rather than naming it."""
    from ddpo_tpu.proc.lock import _is_holder

    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(0.2)
        record = dict(run_dir="/r", command="c", hostname=socket.gethostname())
        assert _is_holder(LockHolder(pid=sleeper.pid, started=time.time(), **record))
        assert not _is_holder(LockHolder(pid=sleeper.pid, started=time.time() - 100, **record))
    finally:
        sleeper.kill()
        sleeper.wait()
    assert not _is_holder(LockHolder(pid=sleeper.pid, started=time.time(), **record))  # gone
