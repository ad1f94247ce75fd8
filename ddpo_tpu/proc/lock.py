"""One training process per host holds the accelerator.

On a TPU host a second Python process that touches the device grabs /dev/vfio/* from under a running job, so the
training process takes an exclusive lock before it touches the accelerator, and a second launch is refused at once,
naming the holder (pid, run dir, start time, command).

How it works
------------
* ``fcntl.flock(LOCK_EX | LOCK_NB)`` on a file descriptor kept open for the life of the process. The kernel drops a
  flock when the last descriptor of its open file description is closed, which happens when the process dies by
  any means (exit, exception, SIGKILL, OOM killer): a lock left by a dead process is taken over with no clean-up
  step and no pid guessing.
* After taking the lock the holder writes who it is into the file as JSON (truncate, write, fsync), so a refused
  launch can name it. The JSON is only ever believed while the flock is held; a stale JSON left by a dead holder
  (flock free) is simply overwritten by the next acquire.
* The lock file is never unlinked: unlinking a flock'ed path lets two processes hold locks on two different inodes.
  ``release()`` empties the file while still holding the lock, then unlocks.
* The descriptor is not inheritable (O_CLOEXEC / ``os.set_inheritable(fd, False)``), so programs started with exec
  (a reward server, a shell) never keep the accelerator "held" after the trainer dies. A plain ``fork()`` copies
  descriptors whatever their close-on-exec flag (multiprocessing/DataLoader workers); a fork handler closes the
  child's copy, which drops only the child's reference and leaves the parent's lock in place.
* A restart right after a SIGKILL of the whole job (front end and training process) may find the lock still held:
  the kernel frees it only when the last process sharing it has finished exiting. An acquire waits (up to
  ``EXITING_WAIT_S``) rather than refusing whenever the record's process is not a live holder: gone, exiting, a
  SIGKILL queued but not yet acted on, or its pid reused by a process started after the record (pid and start time).
* The lock path must be on a host-local file system (flock over NFS is not reliable, and the lock is per host
  anyway): ``default_lock_path(cache_root, accelerator)`` puts it under the local cache root.

Who holds the lock
------------------
The training process (the child started by ``ddpo_tpu.launch.process``) holds it, not the front end that starts
it: the lock must be released exactly when the process that owns the device dies. If the front end held it, a
SIGKILLed front end would free the lock while its orphaned child still drives the TPU, and a child that outlived a
crash would not be covered. The child takes the lock first thing, before importing torch/torch_xla (importing them
takes seconds and may already open the device), so a refusal arrives well within 2 seconds. The front end may call
``AcceleratorLock.holder()`` beforehand to refuse without starting a child at all; that check is advisory, the
child's ``acquire()`` is the authority.

The run dir's lock (``RunDirLock``) is taken earlier, by the front end, before it writes anything in the run dir
(two identical commands started together: the second is refused in its front end). The front end hands it to the
training process (``handover_fd``: a descriptor of the same open file, inherited; ``adopt`` in the child), so it is
held while either lives, and the holder named is the training process once it has adopted it.

This module reads no environment variables (paths come in as arguments) and uses the standard library only.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import pathlib
import shlex
import socket
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["AcceleratorBusy", "AcceleratorLock", "LockHolder", "RunDirBusy", "RunDirLock", "default_lock_path",
           "run_dir_lock_path"]

LOCK_FORMAT = 1
# how long a refused acquire keeps looking when the file does not name a live holder yet: the holder may be between
# its flock and its JSON write, or a holder() probe may be holding a shared lock for a few microseconds
_GRACE_S = 0.5
_POLL_S = 0.02
# how long an acquire waits for a holder that is exiting (killed, tearing down its memory: the kernel closes its files,
# and so frees the flock, only after it unmaps the process's memory, a second or more for a large torch process) or
# that has died while a process sharing its lock (the front end it was handed over from) is still going
EXITING_WAIT_S = 15.0
_PF_EXITING = 0x4  # the task flag /proc/PID/stat shows once a process has begun to exit (include/linux/sched.h)


def _format_time(started: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(started))


@dataclass(frozen=True)
class LockHolder:
    """Who holds (or last held) the accelerator lock, as written into the lock file by the holder."""

    pid: int
    run_dir: str
    started: float  # time.time() at acquire
    command: str
    hostname: str

    @property
    def started_utc(self) -> str:
        return _format_time(self.started)

    def to_json(self) -> str:
        return json.dumps({"format": LOCK_FORMAT, **asdict(self)}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> LockHolder | None:
        """The holder named by ``text``, or None when it is empty, truncated or not a holder record."""
        try:
            data = json.loads(text)
            return cls(pid=int(data["pid"]), run_dir=str(data["run_dir"]), started=float(data["started"]),
                       command=str(data.get("command", "")), hostname=str(data.get("hostname", "")))
        except (ValueError, TypeError, KeyError):
            return None


class AcceleratorBusy(RuntimeError):
    """Raised by ``AcceleratorLock.acquire`` when another process holds the accelerator of this host."""

    def __init__(self, lock_path: pathlib.Path, holder: LockHolder | None):
        self.lock_path = pathlib.Path(lock_path)
        self.holder = holder
        super().__init__(self._message())

    def __reduce__(self):  # picklable (crosses process boundaries intact)
        return (type(self), (self.lock_path, self.holder))

    def _message(self) -> str:
        advice = "or set lock_accelerator=false for CPU runs that share the host"
        h = self.holder
        if h is None:
            return (f"the accelerator of this host is held by another process that has not named itself "
                    f"(lock file {self.lock_path}): wait for it, stop it, {advice}")
        details = [f"run dir {h.run_dir}", f"started {h.started_utc}"]
        if h.command:
            command = h.command if len(h.command) <= 300 else h.command[:297] + "..."
            details.append(f"command {command}")
        where = ""
        if h.hostname and h.hostname != socket.gethostname():
            # the same lock file seen from another host name (a shared file system or a renamed host)
            details.append(f"host {h.hostname}")
            where = f" on {h.hostname}"
        return (f"the accelerator of this host is held by pid {h.pid} ({', '.join(details)}): wait for it, "
                f"stop it (kill -TERM {h.pid}{where}: it checkpoints and exits), {advice} "
                f"[lock file {self.lock_path}]")


class RunDirBusy(AcceleratorBusy):
    """Raised by ``RunDirLock.acquire``: another process writes this run dir."""

    def _message(self) -> str:
        h, run_dir = self.holder, self.lock_path.absolute().parent
        if h is None:
            return (f"run dir {run_dir} is in use by another process that has not named itself (lock file "
                    f"{self.lock_path}): one training process per run dir; wait for it or use another run_name=...")
        where = f" on {h.hostname}" if h.hostname and h.hostname != socket.gethostname() else ""
        return (f"run dir {run_dir} is in use by pid {h.pid}{where} (started {h.started_utc}): one training process "
                f"per run dir; wait for it, stop it (kill -TERM {h.pid}: it checkpoints and exits), or start "
                f"another run with run_name=... [lock file {self.lock_path}]")


def run_dir_lock_path(run_dir: pathlib.Path, suffix: str = "") -> pathlib.Path:
    """The lock of one run dir: held by its training process for the run's life, whatever the accelerator
    (`suffix`: "-node<N>" for node N > 0 of a multi-node distributed run, env.node_suffix)."""
    return pathlib.Path(run_dir) / f"lock{suffix}"


def accelerator_lock_path(cfg) -> pathlib.Path | None:
    """Where the host-wide accelerator lock of a run lives, or None when it takes no lock (lock_accelerator)."""
    from ddpo_tpu.env import cache_root

    enabled = cfg.lock_accelerator
    if enabled == "auto":
        enabled = cfg.tpu_topology.accelerator != "cpu"
    if not enabled:
        return None
    return default_lock_path(cache_root(), cfg.tpu_topology.accelerator)


def default_lock_path(cache_root: pathlib.Path, accelerator: str) -> pathlib.Path:
    """``cache_root/locks/<accelerator>.lock``; ``accelerator`` is a short name such as "tpu" (no path parts)."""
    name = str(accelerator).strip()
    if not name or "/" in name or "\\" in name or name in (".", ".."):
        raise ValueError(f"accelerator must be a plain name such as 'tpu', got {accelerator!r}")
    return pathlib.Path(cache_root) / "locks" / f"{name}.lock"


def _read_holder(fd: int) -> LockHolder | None:
    size = os.fstat(fd).st_size
    if size <= 0:
        return None
    data = os.pread(fd, min(size, 1 << 20), 0)
    return LockHolder.from_json(data.decode("utf-8", errors="replace"))


def _write_record(fd: int, data: bytes) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)
    os.fsync(fd)


def proc_state(pid: int) -> tuple[str, int] | None:
    """(state letter, task flags) of a process from /proc/PID/stat; None when gone or not Linux."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return fields[0], int(fields[6])
    except (OSError, ValueError, IndexError):
        return None


def _exiting(pid: int) -> bool:
    """Whether `pid` has begun to exit (PF_EXITING) or is a zombie."""
    state = proc_state(pid)
    return state is not None and (state[0] in ("Z", "X") or bool(state[1] & _PF_EXITING))


_SIGKILL_BIT = 1 << 8  # SIGKILL (9) in /proc/PID/status's pending-signal masks


def _kill_pending(pid: int) -> bool:
    """Whether a SIGKILL is queued for `pid` and not yet acted on. `kill -9` (of a process group too) marks every
    thread's pending set at once (kernel/signal.c complete_signal: a fatal signal's group exit), before the process
    is next scheduled and sets PF_EXITING: a restart that looks in that window sees a live, named holder."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
            masks = [int(line.split()[1], 16) for line in f if line.startswith(("SigPnd:", "ShdPnd:"))]
    except (OSError, ValueError, IndexError):
        return False
    return any(m & _SIGKILL_BIT for m in masks)


def _process_start(pid: int) -> float | None:
    """When `pid` started (seconds since the epoch, to about a second: /proc/stat's btime is whole seconds), or None
    when gone or not Linux. Field 22 of /proc/PID/stat is the start in clock ticks after boot."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat", encoding="ascii") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return btime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def _is_holder(holder: LockHolder) -> bool:
    """Whether the local process named by a lock record is that holder, alive and not being killed: its pid alive,
    not exiting, no SIGKILL queued, and started before the record was written (a later start is another process
    that reused the pid of a dead holder; 2 s of slack for btime's whole seconds and clock steps)."""
    pid = holder.pid
    if not _pid_alive(pid) or _exiting(pid) or _kill_pending(pid):
        return False
    started = _process_start(pid)
    return started is None or started <= holder.started + 2.0


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by another user
        return True
    return True


# locks held by this process, so that a fork()ed child can drop its copies of their descriptors
_held: set[AcceleratorLock] = set()


def _close_in_forked_child() -> None:
    for lock in list(_held):
        lock._forget_after_fork()
    _held.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_in_forked_child)


class AcceleratorLock:
    """An exclusive, per-host lock on the accelerator, held by the training process for its lifetime.

    ``acquire()`` takes it or raises ``AcceleratorBusy`` naming the holder; ``release()`` (or the end of the
    process, however it ends) gives it back. Usable as a context manager. Not re-entrant across objects: a second
    ``AcceleratorLock`` on the same path in the same process is refused like any other process.
    """

    busy: type[AcceleratorBusy] = AcceleratorBusy

    def __init__(self, lock_path: pathlib.Path, run_dir: pathlib.Path, command: str = ""):
        self.lock_path = pathlib.Path(lock_path)
        self.run_dir = pathlib.Path(run_dir)
        self.command = command or shlex.join(sys.argv)
        self._fd: int | None = None
        self._info: LockHolder | None = None

    # --- state -------------------------------------------------------------------------------------------------

    @property
    def held(self) -> bool:
        return self._fd is not None

    @property
    def info(self) -> LockHolder | None:
        """What this lock wrote into the lock file while it is held, else None."""
        return self._info if self.held else None

    def __repr__(self) -> str:
        return f"AcceleratorLock({str(self.lock_path)!r}, held={self.held})"

    # --- acquire / release -------------------------------------------------------------------------------------

    def acquire(self, timeout: float | None = 0.0) -> AcceleratorLock:
        """Take the lock. ``timeout`` 0 (the default) refuses at once when a live holder is named; a positive
        timeout waits up to that many seconds; None waits for as long as it takes. Raises ``AcceleratorBusy``."""
        if self.held:
            return self
        self.lock_path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        except PermissionError:
            # a lock file made by another user: name its holder when there is one
            holder = AcceleratorLock.holder(self.lock_path)
            if holder is not None:
                raise self.busy(self.lock_path, holder) from None
            raise
        os.set_inheritable(fd, False)
        start = time.monotonic()
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError as e:
                    if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                        raise
                holder = _read_holder(fd)
                waited = time.monotonic() - start
                local = holder is not None and holder.hostname == socket.gethostname()
                named = holder is not None and (not local or _is_holder(holder))
                limit = _GRACE_S if timeout is not None and timeout < _GRACE_S and not named else timeout
                if local and timeout is not None and not named:
                    # a killed run restarted at once: its holder is dead, exiting, has a SIGKILL queued, or its pid
                    # is another process's now; wait for the kernel to free the lock (the last descriptor's close)
                    limit = max(timeout, EXITING_WAIT_S)
                if limit is not None and waited >= limit:
                    raise self.busy(self.lock_path, holder)
                time.sleep(_POLL_S)
            info = LockHolder(pid=os.getpid(), run_dir=str(self.run_dir.resolve()), started=time.time(),
                              command=self.command, hostname=socket.gethostname())
            _write_record(fd, (info.to_json() + "\n").encode("utf-8"))
        except BaseException:
            os.close(fd)  # drops the flock too, if it was taken
            raise
        self._fd, self._info = fd, info
        _held.add(self)
        return self

    def release(self) -> None:
        """Give the lock back (a no-op when not held). The file is emptied while still locked, then unlocked. An
        adopted lock (see ``adopt``) only gives its share back: the parent's record is put back and the parent
        still holds the lock."""
        fd, self._fd, self._info = self._fd, None, None
        _held.discard(self)
        if fd is None:
            return
        try:
            if self._parent_record is not None:
                _write_record(fd, self._parent_record)
            else:
                os.ftruncate(fd, 0)
                fcntl.flock(fd, fcntl.LOCK_UN)
        except OSError:  # a disk that refuses the record (read-only, full): the close below still frees the lock
            pass
        finally:
            os.close(fd)
            self._parent_record = None

    _parent_record: bytes | None = None

    # --- hand-over to a child process --------------------------------------------------------------------------

    def handover_fd(self) -> int:
        """A new descriptor of the held lock for a child process (``subprocess.Popen(pass_fds=...)``), which then
        calls ``adopt``. A flock belongs to the open file description, which both descriptors share: the lock stays
        held while the parent or the child lives, so neither's death frees it under the other. The caller closes
        its copy once the child is started. (A copy, not the lock's own descriptor: a fork handler closes that one
        in every fork()ed child.)"""
        if self._fd is None:
            raise RuntimeError(f"{self!r} is not held: nothing to hand over")
        return os.dup(self._fd)

    def adopt(self, fd: int) -> AcceleratorLock:
        """Hold the lock whose descriptor a parent handed over (``handover_fd``), naming this process as its holder.
        Raises ValueError when ``fd`` is not this lock's file, and ``busy`` when the lock is not held through it."""
        try:
            here, there = os.fstat(fd), os.stat(self.lock_path)
        except OSError as e:
            raise ValueError(f"descriptor {fd} is not the lock {self.lock_path} ({e})") from None
        if (here.st_dev, here.st_ino) != (there.st_dev, there.st_ino):
            raise ValueError(f"descriptor {fd} is not the lock {self.lock_path}")
        try:  # the same open file description: converting our own exclusive lock succeeds at once
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            raise self.busy(self.lock_path, _read_holder(fd)) from None
        os.set_inheritable(fd, False)
        size = os.fstat(fd).st_size
        self._parent_record = os.pread(fd, min(size, 1 << 20), 0) if size > 0 else b""
        info = LockHolder(pid=os.getpid(), run_dir=str(self.run_dir.resolve()), started=time.time(),
                          command=self.command, hostname=socket.gethostname())
        _write_record(fd, (info.to_json() + "\n").encode("utf-8"))
        self._fd, self._info = fd, info
        _held.add(self)
        return self

    def _forget_after_fork(self) -> None:
        # in a fork()ed child: close our copy of the descriptor (the parent's lock stays), never LOCK_UN
        fd, self._fd, self._info = self._fd, None, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass

    def __enter__(self) -> AcceleratorLock:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()

    # --- who holds it ------------------------------------------------------------------------------------------

    @staticmethod
    def holder(lock_path: pathlib.Path) -> LockHolder | None:
        """Who holds the lock now: None when the lock is free (whatever a stale file says) or missing.

        Probes with a shared, non-blocking flock (released at once), which never blocks the holder; the file is
        not created. A holder that has the lock but has not finished writing its record is waited for briefly
        (its write follows its flock by microseconds); one that never names itself (not an AcceleratorLock) reads
        as None, so this is an advisory check: ``acquire()`` is the authority and refuses such a holder too."""
        lock_path = pathlib.Path(lock_path)
        try:
            fd = os.open(lock_path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        try:
            deadline = time.monotonic() + _GRACE_S
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                except OSError as e:
                    if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                        raise
                else:
                    fcntl.flock(fd, fcntl.LOCK_UN)
                    return None  # free: whatever the file says is stale
                holder = _read_holder(fd)
                if holder is not None or time.monotonic() >= deadline:
                    return holder
                time.sleep(_POLL_S)
        finally:
            os.close(fd)


class RunDirLock(AcceleratorLock):
    """The same machinery on ``run_dir/lock``: one writer per run dir (see ``run_dir_lock_path``)."""

    busy = RunDirBusy

    def __init__(self, run_dir: pathlib.Path, command: str = "", suffix: str = ""):
        super().__init__(run_dir_lock_path(run_dir, suffix), run_dir, command)
