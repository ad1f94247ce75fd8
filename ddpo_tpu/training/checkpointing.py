"""The trainer's checkpoints: one component that owns save, commit, resume and the stop point (after torchtitan's
CheckpointManager), and the stateful parts a checkpoint holds: the trained weights (the family's trainable state),
the optimizer with its step count and EMA (TrainState), and the algorithm's state (the stat tracker).

An epoch ends as: checkpoint written under a temporary name (`save`), the epoch's outputs (metrics line, grid,
weights), then the rename that marks the epoch done (`commit`): a kill before the commit redoes the epoch, a kill after
it finds every output of the epoch. A stop request (SIGTERM) is honoured at safe points: the state as of the end of
the last finished epoch is saved (unless it is already) and `Preempted` ends the run. The file format is
ddpo_tpu/training/checkpoint_files.py's; what a checkpoint directory is, ddpo_tpu/rundir/checkpoint_layout.py's.
"""

from __future__ import annotations

import errno

import os
import shutil
import signal
import uuid
from pathlib import Path

import torch

from ddpo_tpu.waits import CHECKPOINT, waiting
from ddpo_tpu.training import checkpoint_files as ckpt
from ddpo_tpu.rundir import events as ev
from ddpo_tpu.rundir.checkpoint_layout import CHECKPOINTS
from ddpo_tpu.config.schema import RunConfig
from ddpo_tpu.rundir.files import RunDir, interrupted_writes
from ddpo_tpu.runtime import Runtime


class Preempted(Exception):
    """SIGTERM: the trainer reached a safe point and wrote a checkpoint."""


class CannotStart(RuntimeError):
    """The run dir cannot hold this run (permissions, disk space): found before any training."""


class StopRequest:
    """SIGTERM sets a flag checked at safe points (between sampling batches, at the end of an epoch); a second
    SIGTERM (or SIGINT) exits at once."""

    def __init__(self):
        self.requested = False
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, _frame):
        if self.requested:
            print(f"ddpo_tpu: second {signal.Signals(signum).name}: exiting now", flush=True)
            os._exit(128 + signum)
        self.requested = True
        print(f"ddpo_tpu: {signal.Signals(signum).name} received: stopping at the next safe point", flush=True)


class CheckpointManager:
    """Where the run starts (`resume`), what marks an epoch done (`save` then `commit`) and where it stops
    (`stop_if_requested`). Building it reads the run dir (is it writable, is there room) but changes nothing."""

    def __init__(self, cfg: RunConfig, rt: Runtime, out: RunDir, events: ev.EventLog, tree: dict, stop, *,
                 family, state, algorithm):
        self.cfg, self.rt, self.out, self.events, self.tree, self.stop = cfg, rt, out, events, tree, stop
        self.family, self.state, self.algorithm = family, state, algorithm
        self.root = out.path / CHECKPOINTS
        self.start_epoch, self.last_saved_epoch = 0, -1
        self.run_id = uuid.uuid4().hex[:12]  # a resume continues the checkpoint's (the tracker's run)
        self._check_room()

    def _check_room(self) -> None:
        """Before any training: the run dir is writable and has room for the checkpoints it will keep."""
        path = self.out.path
        if not os.access(path, os.W_OK):
            raise CannotStart(f"run dir {path} is not writable: fix its permissions or set output_root=...")
        per_ckpt = self.state.parameter_bytes() * 4  # weights x2 (checkpoint + weights/) + Adam moments
        need = per_ckpt * (min(self.cfg.checkpoint_limit, self.cfg.num_epochs) + 1)
        free = shutil.disk_usage(path).free
        if free < need:
            raise CannotStart(f"run dir {path} has {free / 2**30:.1f} GiB free but {self.cfg.checkpoint_limit} "
                              f"checkpoint(s) need about {need / 2**30:.1f} GiB: free space, lower "
                              f"checkpoint_limit, or set output_root=... on a larger disk")

    # --- the start ----------------------------------------------------------------------------------------------
    def clear_interrupted_writes(self) -> list[Path]:
        """Remove the temporary files and directories of writes a kill cut short (a checkpoint, the final weights:
        gigabytes each at Stable Diffusion scale). Nothing of this run is being written yet."""
        run = self.out.path
        gone = ckpt.clear_leftovers(self.root)
        dirs = [run, *(d for d in sorted(run.iterdir()) if d.is_dir() and d.name != CHECKPOINTS)]
        for path in (p for d in dirs for p in interrupted_writes(d)):
            path.unlink(missing_ok=True)
            gone.append(path)
        return gone

    def resume(self) -> None:
        """Continue from the newest complete checkpoint (resume=auto) or the one named; metrics of epochs after it
        (work a killed attempt did past its last checkpoint) are dropped, so each epoch is logged once."""
        cfg, rt = self.cfg, self.rt
        if cfg.resume == "never" and ckpt.complete(self.root):
            raise ckpt.ResumeRefused(f"resume=never but {self.root} holds checkpoints of an earlier run: use "
                                     f"resume=auto to continue it or a new run_name to start over")
        if rt.is_main:
            self.clear_interrupted_writes()
        damaged = lambda e: self.events.emit(ev.CheckpointDamaged(str(e.path), str(e)))
        loaded = ckpt.load_resume(self.out.path, cfg.resume, self.tree, force=cfg.force_resume, on_damaged=damaged)
        if loaded is None:
            if rt.is_main:
                self.out.truncate_after_epoch(-1)  # a run killed before its first checkpoint starts clean
            return
        current = self.family.trainable_state()
        self.family.load_trainable_state({k: rt.place_like(v, current[k]) for k, v in loaded.trainable.items()})
        self.state.load_state_dict(loaded.optimizer)
        self.algorithm.load_state_dict(loaded.tracker)
        self.start_epoch, self.state.global_step = loaded.epoch + 1, loaded.global_step
        self.run_id, self.last_saved_epoch = loaded.run_id, loaded.epoch
        if rt.is_main:
            self.out.truncate_after_epoch(loaded.epoch)  # epochs after the checkpoint are logged again, once
        rt.sync()
        self.events.emit(ev.Resumed(loaded.epoch, self.state.global_step, str(loaded.path)))

    # --- an epoch's end -----------------------------------------------------------------------------------------
    def due(self, epoch: int) -> bool:
        """Whether `epoch` ends with a checkpoint by the schedule (every save_freq epochs, and the last)."""
        return (epoch + 1) % self.cfg.save_freq == 0 or epoch + 1 == self.cfg.num_epochs

    def _host_trainable(self) -> dict[str, torch.Tensor]:
        return self.rt.state_to_host(self.family.trainable_state())

    def save(self, epoch: int) -> ckpt.Pending | None:
        """Weights, optimizer and algorithm state as they are now, as the end of `epoch`: the weights files in place,
        the checkpoint written but not yet (`commit` renames it). Every process copies (device work); the main one
        writes and gets the Pending, the others None."""
        trainable = self._host_trainable()
        optimizer = self.state.state_dict()
        last = epoch + 1 == self.cfg.num_epochs
        final_ema = None
        if last and self.state.ema is not None:
            with self.state.ema_weights():
                final_ema = self._host_trainable()
        if not self.rt.is_main:
            return None
        with waiting(CHECKPOINT, f"epoch {epoch}"):  # the rank watch names a write that stops moving
            # the weights first: an epoch whose checkpoint is in place has its weights files too
            self.out.save_weights(f"epoch_{epoch:04d}", trainable)
            if last:
                self.out.save_weights("final", trainable)
            if final_ema is not None:
                self.out.save_weights("final_ema", final_ema)
            if last:  # the final weights also as users load them (diffusers, peft): training/export.py
                self._export("final", trainable)
                if final_ema is not None:
                    self._export("final_ema", final_ema)
            return ckpt.prepare(self.root, epoch=epoch, global_step=self.state.global_step, trainable=trainable,
                                optimizer=optimizer, tracker=self.algorithm.state_dict(), run_id=self.run_id,
                                tree=self.tree)

    def _export(self, name: str, state: dict) -> None:
        """A convenience copy of saved weights: its failure (a hub config missing, an old diffusers) costs one warning
        line and the `ddpo-export` command that retries it, never the checkpoint that follows."""
        from ddpo_tpu.training.export import export_weights

        try:
            export_weights(self.out.path / "weights", name, state, self.cfg.model)
        except OSError as e:
            if getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
                raise  # the disk: the checkpoint would fail the same way; its own error path names it
            self.events.emit(ev.ExportFailed(name, f"{type(e).__name__}: {e}", str(self.out.path)))
        except Exception as e:  # noqa: BLE001 -- any library failure of the copy, named once
            self.events.emit(ev.ExportFailed(name, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                                             str(self.out.path)))

    def commit(self, epoch: int, pending: ckpt.Pending | None) -> None:
        """The rename that marks `epoch` done (main process; the others only note it), then the bucket copy."""
        if pending is not None:
            with waiting(CHECKPOINT, f"epoch {epoch}, its commit"):
                path = pending.commit(self.cfg.checkpoint_limit)
                self.events.emit(ev.CheckpointSaved(epoch, self.state.global_step, str(path)))
                self.out.publish((path.name, pending.data, epoch))  # bucket copy: the files, then the checkpoint
        self.last_saved_epoch = epoch

    def saved_state(self) -> str:
        """What a stop leaves to resume from, for its message."""
        if self.last_saved_epoch < 0:
            return "no checkpoint was written yet (the same command starts over)"
        return f"the last checkpoint (epoch {self.last_saved_epoch}) is intact"

    # --- the stop point -----------------------------------------------------------------------------------------
    def stopping(self) -> bool:
        """Whether to stop at this safe point: a SIGTERM this process or any other got (every process of a run
        asks at the same points, so they stop together and write one checkpoint)."""
        return self.rt.any_process(self.stop.requested)

    def stop_if_requested(self, epoch_done: int, stopping: bool | None = None) -> None:
        """At a safe point: write the state as of the end of `epoch_done` (unless saved already) and stop. Safe
        points are where the algorithm's state is that of the end of `epoch_done` (its advantages of the next
        epoch not yet taken)."""
        if not (self.stopping() if stopping is None else stopping):
            return
        if epoch_done >= 0 and self.last_saved_epoch != epoch_done:
            self.commit(epoch_done, self.save(epoch_done))
        if epoch_done < 0:
            raise Preempted("stopped before the first epoch was done (no checkpoint yet); the same command starts over")
        raise Preempted(f"stopped after epoch {epoch_done}; the same command resumes")
