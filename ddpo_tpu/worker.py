"""The training process. Started by the front end (ddpo_tpu.train) with an environment built from the config, so
torch and torch_xla are imported here, after every XLA/PJRT variable is final.

Output and train.log (decision): while the front end lives it is the one writer of train.log, because it reads the
process's fds 1 and 2 and so also catches what C libraries (XLA, libtpu) print. The front end can die first (SIGKILL,
a closed terminal, a dropped SSH session): its pipe breaks, and the next write here fails with EPIPE. From then on
fds 1 and 2 point at train.log itself (append), so the rest of the run, ours and the C libraries' output alike, is
still logged, and no console write ever raises: the SIGTERM that follows the front end's death ends in a checkpoint,
not in a BrokenPipeError. Only lines still in the pipe when the front end died can be missing from train.log;
metrics.jsonl is written here directly and loses nothing.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from pathlib import Path


class _Console(io.TextIOBase):
    """sys.stdout / sys.stderr of the training process: writes that never raise (see the module docstring)."""

    _log_path: Path | None = None
    _detached = False

    def __init__(self, stream, fileno: int):
        self._stream, self._fileno = stream, fileno

    @classmethod
    def _detach_to_log(cls) -> None:
        """The console is gone: point fds 1 and 2 at train.log (or /dev/null if that fails too)."""
        if cls._detached:
            return
        cls._detached = True
        try:
            fd = os.open(cls._log_path or os.devnull, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError:
            fd = os.open(os.devnull, os.O_WRONLY)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)

    def write(self, s: str) -> int:
        try:
            return self._stream.write(s)
        except (OSError, ValueError, RuntimeError):  # EPIPE, a closed stream, a write re-entered by a signal
            pass
        try:
            self._detach_to_log()
            # the failed buffer was dropped (not kept for a later flush), so the text is written again
            self._stream.write(s)
            self._stream.flush()
        except (OSError, ValueError, RuntimeError):
            pass
        return len(s)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except (OSError, ValueError, RuntimeError):
            try:
                self._detach_to_log()
            except OSError:
                pass

    def fileno(self) -> int:
        return self._fileno

    def isatty(self) -> bool:
        return False

    def writable(self) -> bool:
        return True

    @property
    def encoding(self):
        return getattr(self._stream, "encoding", "utf-8")

    @property
    def buffer(self):
        return self._stream.buffer


def guard_console(log_path: Path) -> None:
    _Console._log_path = log_path
    if not isinstance(sys.stdout, _Console):
        sys.stdout = _Console(sys.stdout, 1)
    if not isinstance(sys.stderr, _Console):
        sys.stderr = _Console(sys.stderr, 2)


def hold_locks(cfg, run_dir: Path):
    """Take the run dir's lock (adopting the one the front end handed over) and the accelerator's, held until this
    process ends; the list of locks, or None after printing why they are busy. Taken before torch is imported, so a
    refusal comes within seconds: one writer per run dir on every accelerator, one run per device."""
    from ddpo_tpu import env as envmod
    from ddpo_tpu.launch.lock import AcceleratorBusy, AcceleratorLock, RunDirLock, accelerator_lock_path

    locks = [RunDirLock(run_dir)]
    path = accelerator_lock_path(cfg)
    if path is not None:
        locks.append(AcceleratorLock(path, run_dir))
    handed = envmod.run_dir_lock_fd_from_environment()
    try:
        if handed is not None:
            try:
                locks[0].adopt(handed)
            except ValueError:  # not this run dir's lock: take it like any other process
                with contextlib.suppress(OSError):
                    os.close(handed)
        for lock in locks:
            lock.acquire()  # a no-op for the adopted lock
    except AcceleratorBusy as e:
        print(f"error: {e}", file=sys.stderr)
        for lock in locks:
            lock.release()
        return None
    return locks


def _rank_console(run_dir: Path, rank: int) -> None:
    """A rank other than 0 of the distributed execution writes its output to ranks/rank<N>.log (rank 0's goes to the
    console and train.log, through torchrun's pipe): one console, and every rank's traceback kept."""
    logs = run_dir / "ranks"
    logs.mkdir(exist_ok=True)
    fd = os.open(logs / f"rank{rank}.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _end_with_parent() -> None:
    """A distributed rank gets SIGTERM when torchrun dies (SIGKILL, OOM killer), as the front end does for its child:
    it checkpoints or stops instead of holding its device as an orphan."""
    import signal

    from ddpo_tpu.launch.process import terminate_with_parent

    terminate_with_parent()
    if os.getppid() == 1:  # torchrun died before the line above
        os.kill(os.getpid(), signal.SIGTERM)


def main() -> int:
    from omegaconf import OmegaConf

    from ddpo_tpu.config.compose import validate
    from ddpo_tpu import env as envmod

    run_dir = envmod.run_dir_from_environment()
    if run_dir is None:
        print("ddpo_tpu.worker is started by `python -m ddpo_tpu.train`, not directly", file=sys.stderr)
        return 2
    validated = validate(OmegaConf.load(run_dir / "config.yaml"))
    ranks = envmod.torchrun_ranks() if validated.cfg.tpu_topology.execution == "distributed" else None
    if ranks is not None:  # a rank under torchrun: the launcher (ddpo_tpu/torchrun.py) holds the locks
        _end_with_parent()
        if ranks[0] != 0:
            _rank_console(run_dir, ranks[0])
        else:
            guard_console(run_dir / "train.log")
        locks = []
    else:
        guard_console(run_dir / "train.log")
        locks = hold_locks(validated.cfg, run_dir)
        if locks is None:
            from ddpo_tpu.launch.process import EXIT_BUSY

            return EXIT_BUSY
    from ddpo_tpu.ddpo.loop import run
    from ddpo_tpu.rundir import Heartbeat

    heartbeat = Heartbeat(run_dir).start() if ranks is None or ranks[0] == 0 else None
    try:
        return run(validated, run_dir)
    finally:
        if heartbeat is not None:
            heartbeat.stop()
        for lock in reversed(locks):
            lock.release()


if __name__ == "__main__":
    sys.exit(main())
