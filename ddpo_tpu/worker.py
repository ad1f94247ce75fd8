"""The training process. Started by the front end (ddpo_tpu.train) with an environment built from the config, so
torch and torch_xla are imported here, after every XLA/PJRT variable is final. `main` takes the locks, guards the
console and beats the heartbeat; `run` builds the Trainer (training/loop.py) and turns every expected way a run ends
(preempted, refused, non-finite, a full disk, a device out of memory) into one event line and an exit code.

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
import errno
import io
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ddpo_tpu.config.compose import Validated
    from ddpo_tpu.config.plan import RunPlan
    from ddpo_tpu.config.schema import RunConfig


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
    from ddpo_tpu.proc.lock import AcceleratorBusy, AcceleratorLock, RunDirLock, accelerator_lock_path

    locks = [RunDirLock(run_dir, suffix=envmod.node_suffix(cfg))]
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
    if cfg.tpu_topology.accelerator == "cpu":
        from ddpo_tpu.launch.busy import busy_line

        note = busy_line(run_dir)
        if note:
            print(note, file=sys.stderr, flush=True)
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


def load_validated(run_dir: Path) -> Validated:
    """The run's saved config (config.yaml, or this node's), validated: the one validation of this process, whose
    plan (config/plan.py) the Trainer and the out-of-memory line read. The front end validated the same tree and saved
    the same plan in parity.json (tests/unit/config/test_run_plan.py compares them)."""
    from omegaconf import OmegaConf

    from ddpo_tpu import env as envmod
    from ddpo_tpu.config.compose import validate

    return validate(OmegaConf.load(run_dir / envmod.config_file_from_environment()))


def keep_torch_xla_out(cfg: RunConfig) -> None:
    """An execution that does not run on torch_xla (eager, distributed) keeps it unimportable in this process, before
    torch is imported: diffusers, accelerate and transformers import an installed torch_xla at their own import (about
    3 CPU-s of every start on this project's 2-core machines, measured 2026-11-29), and an imported torch_xla may
    claim an accelerator. `None` in sys.modules is Python's own "not importable": `importlib.util.find_spec` answers
    None and an import raises ImportError, which is how those libraries probe for it."""
    if not cfg.tpu_topology.spec.torch_xla:
        sys.modules.setdefault("torch_xla", None)


def main() -> int:
    from ddpo_tpu import env as envmod

    run_dir = envmod.run_dir_from_environment()
    if run_dir is None:
        print("ddpo_tpu.worker is started by `python -m ddpo_tpu.train`, not directly", file=sys.stderr)
        return 2
    validated = load_validated(run_dir)
    keep_torch_xla_out(validated.cfg)
    ranks = envmod.torchrun_ranks() if validated.cfg.tpu_topology.spec.torchrun else None
    if ranks is not None:  # a rank under torchrun: the launcher (ddpo_tpu/torchrun.py) holds the locks
        _end_with_parent()
        if ranks[0] != 0:
            _rank_console(run_dir, ranks[0])
        else:
            guard_console(run_dir / "train.log")
        from ddpo_tpu.proc.rankwatch import RankBeat

        beat = RankBeat(run_dir, ranks[0]).start()  # beats while the rank works: its launcher watches it
        locks = []
    else:
        guard_console(run_dir / "train.log")
        locks = hold_locks(validated.cfg, run_dir)
        if locks is None:
            from ddpo_tpu.proc.exit_codes import EXIT_BUSY

            return EXIT_BUSY
    from ddpo_tpu.rundir.files import Heartbeat

    heartbeat = Heartbeat(run_dir).start() if ranks is None or ranks[0] == 0 else None
    try:
        code = run(validated, run_dir)
    finally:
        if ranks is not None:
            beat.end()
        if heartbeat is not None:
            heartbeat.stop()
        for lock in reversed(locks):
            lock.release()
    from ddpo_tpu.proc.exit_codes import EXIT_FAILED, EXIT_RANK_SAID_WHY

    if ranks is not None and code == EXIT_FAILED:  # run() said its failure in one line before it returned 1
        # its launcher adds no second line (launch/process.py); exiting at once, before the process group's and the
        # interpreter's teardown, so that this code is what the launcher sees: a rank still tearing down when a
        # peer has ended is killed (SIGKILL, proc/rankwatch.py) once its beat is stale, as on a read-only disk
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(EXIT_RANK_SAID_WHY)
    return code


# --- the training run (torch is imported from here on) -------------------------------------------------------------

STORAGE_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM}


def storage_error_line(e: OSError, run_dir: Path) -> str:
    """One line for a write the run dir's disk refused. Checkpoints are written whole and renamed into place, so the
    last complete one is intact whatever write failed."""
    path = e.filename or run_dir
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        what, fix = "no space left on the disk", "free space there or set output_root=... on a larger disk"
    else:
        what, fix = f"cannot write there ({e.strerror})", "make the run dir writable or set output_root=..."
    return f"{path}: {what}: {fix}; the same command then resumes from the last complete checkpoint"


def out_of_memory_line(error: BaseException, cfg: RunConfig, saved: str, plan: RunPlan | None = None) -> str:
    """One line for a device that ran out of memory: what was asked of it (the run plan's fused timesteps and
    activation checkpointing, which the memory estimate chose unless they were set) and the keys that ask less, with
    the same parity. `plan`: the one the run trained with (None: computed from `cfg`)."""
    from ddpo_tpu.catalog import ALGORITHMS
    from ddpo_tpu.config.plan import run_plan

    plan = plan if plan is not None else run_plan(cfg)
    detail = next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)
    K, on, T = plan.fused_timesteps, plan.activation_checkpointing, plan.train_timesteps
    spec = ALGORITHMS.get(cfg.algorithm.name)
    if spec.one_forward and spec.trained_timesteps:  # its K is its trained timesteps, set by its own key (AWM)
        fused_key, fixes = spec.trained_timesteps, [f"{spec.trained_timesteps}={K - 1}"] if K > 1 else []
    else:  # K divides the trained timesteps
        fused_key = "train.timesteps_per_micro_step"
        fixes = [f"{fused_key}={k}" for k in range(K - 1, 0, -1) if T % k == 0][:1]
    if not on:
        fixes.append("train.activation_checkpointing=true")
    fixes.append("half the per-replica train.batch_size or sample.batch_size with twice the "
                 "train.gradient_accumulation_steps or sample.num_batches_per_epoch (the same parity)")
    return (f"the device ran out of memory ({detail[:240]}) at {fused_key}={K}, "
            f"train.activation_checkpointing={str(on).lower()}, train.batch_size={cfg.train.batch_size}, "
            f"sample.batch_size={cfg.sample.batch_size}. Fix: {', or '.join(fixes)}; {saved}")


def run(validated: Validated, run_dir: Path) -> int:
    """Train the run in `run_dir` in this process: the Trainer, the bucket mirror, and the exit code."""
    from ddpo_tpu.rundir import events as ev
    from ddpo_tpu.rundir import storage
    from ddpo_tpu.display.console import quiet_third_party
    from ddpo_tpu.training.checkpointing import StopRequest
    from ddpo_tpu.proc.exit_codes import EXIT_FAILED, EXIT_PREEMPTED
    from ddpo_tpu.rundir.files import RunDir
    from ddpo_tpu.runtime import make_runtime

    quiet_third_party()  # before the model loads (ddpo_tpu/display/console.py: what is dropped and why)
    stop = StopRequest()
    rt = make_runtime(validated.cfg)
    events = ev.EventLog(run_dir, rt.is_main, raise_errors=True)  # a refused write ends the run in one line
    url = storage.remote_run_dir(validated.cfg.output_root, run_dir)
    # output_root=gs://...: the main process mirrors the run dir to the bucket (ddpo_tpu/rundir/storage.py)
    # an upload that gives up (storage_timeout_s) stops the run at the next safe point, after a local checkpoint
    mirror = (storage.Mirror(run_dir, url, validated.cfg.checkpoint_limit, timeout_s=validated.cfg.storage_timeout_s,
                             on_give_up=lambda: setattr(stop, "requested", True)) if url is not None and rt.is_main
              else None)
    out = RunDir(run_dir, mirror)
    try:
        code = _run(validated, rt, out, stop, events)
    except BaseException:
        if mirror is not None:
            mirror.close()  # what was queued still goes up; the error that ended the run is the one reported
        raise
    try:
        out.close()  # a resume on another VM needs what is queued: wait for it
    except storage.StorageError as e:
        events.emit(ev.Failed(str(e)))
        return EXIT_FAILED if code in (0, EXIT_PREEMPTED) else code
    if code in (0, EXIT_PREEMPTED):
        # distributed: every rank ends together, after the main one wrote and committed (a rank that ended early
        # would make torchrun stop the others)
        rt.barrier()
    rt.close()
    return code


def _run(validated: Validated, rt, out, stop, events) -> int:
    """The Trainer's life, with every expected way it ends as one event line and an exit code."""
    from ddpo_tpu.rundir import events as ev
    from ddpo_tpu.rundir import storage
    from ddpo_tpu.training.checkpoint_files import ResumeRefused
    from ddpo_tpu.training.checkpointing import CannotStart, Preempted
    from ddpo_tpu.training.loop import NonFinite, Trainer
    from ddpo_tpu.proc.exit_codes import EXIT_FAILED, EXIT_PREEMPTED
    from ddpo_tpu.models.loading import ModelLoadError
    from ddpo_tpu.rewards import RewardError

    run_dir = out.path
    trainer = None
    try:
        trainer = Trainer(validated.cfg, rt, out, tree=validated.tree, stop=stop, events=events, plan=validated.plan)
        trainer.resume()
        if trainer.start_epoch >= validated.cfg.num_epochs:
            events.emit(ev.AlreadyComplete(validated.cfg.num_epochs))
            return 0
        trainer.fit()
    except Preempted as e:
        if not out.bucket_failed:  # a bucket that gave up stopped it: run() reports that, in one line
            events.emit(ev.Preempted(trainer.checkpoints.last_saved_epoch, trainer.global_step, str(e)))
        return EXIT_PREEMPTED
    except (ResumeRefused, CannotStart, NonFinite, RewardError, ModelLoadError, storage.StorageError) as e:
        events.emit(ev.Failed(str(e)))
        return EXIT_FAILED
    except OSError as e:
        if e.errno not in STORAGE_ERRORS:
            raise
        events.emit(ev.Failed(storage_error_line(e, run_dir)))
        return EXIT_FAILED
    except Exception as e:  # noqa: BLE001 -- two known causes get one line, any other keeps its traceback
        if isinstance(e, RuntimeError) and rt.out_of_memory(e):
            saved = trainer.checkpoints.saved_state() if trainer is not None else "nothing was trained yet"
            events.emit(ev.Failed(out_of_memory_line(e, validated.cfg, saved, validated.plan)))
            return EXIT_FAILED
        lost = rt.lost_peers(e, run_dir)
        if not lost:
            raise
        said = not all(ours for _, ours in lost)  # else our launcher saw it end and says how, in the job's one line
        if said:
            first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)[:200]
            events.emit(ev.Failed(f"{', '.join(d for d, _ in lost)} went away mid-job (a collective with it failed: "
                                  f"{first}); the job stopped; the same command resumes from the last checkpoint"))
        _exit_without_teardown(out, said)
    finally:
        stop_reward_processes()
    return 0


def stop_reward_processes() -> None:
    """The run's reward processes (reward.process.python, rewards/managed.py) end with it, however it ends; one
    that outlives a SIGKILLed trainer sees its parent gone and exits by itself (rewards/serve.py)."""
    managed = sys.modules.get("ddpo_tpu.rewards.managed")
    if managed is not None:
        managed.close_all()


def _exit_without_teardown(out, said: bool = False) -> None:
    """End a rank whose peer is gone: what is queued for the bucket goes up, then the process exits at once. The
    process group's teardown (and the interpreter's) can block on the dead peer's connections for as long as
    torchrun's SIGTERM grace, and nothing is left to write: the checkpoints are whole. `said`: its line is out (the
    launcher adds none)."""
    from ddpo_tpu.rundir import storage
    from ddpo_tpu.proc.exit_codes import EXIT_FAILED, EXIT_RANK_SAID_WHY

    stop_reward_processes()
    try:
        out.close()
    except storage.StorageError:
        pass
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(EXIT_RANK_SAID_WHY if said else EXIT_FAILED)
    return 0


if __name__ == "__main__":
    sys.exit(main())
