"""The optimizer step, written once for every epoch trainer (issue 42.1): the accumulation window, the gradient-sync
suppression inside it, the scaled backward, the statistics, the update with its non-finite check, and the progress
events. An epoch trainer (the PPO re-scoring one in training/ppo_epoch.py, DiffusionNFT's, AWM's) decides what a
micro-step computes and in which order the samples come; the Stepper does the rest:

    stepper.begin(epoch, window=..., total=...)
    for each micro-step:  stepper.micro_step(lambda: loss_fn(...), units=K)   # (loss, *stats) of `units` terms
    after each batch:     stepper.batch_done()
    logs = stepper.finish()                                                    # one record per optimizer step

`units` is what a micro-step counts for in the window: the loop and NFT count trained timesteps (K per fused forward,
a window of gradient_accumulation_steps x train timesteps), AWM counts train batches (a window of
gradient_accumulation_steps). Each micro-step's loss is scaled by units / window before its backward, so every unit
weighs what it weighs unfused; the logged statistics are the window's unit-weighted means.

An epoch trainer gets an EpochContext: what it may use of the run (config, runtime, family, state, events, the
stepper and the step shape), not the Trainer."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch

from ddpo_tpu.rundir import events as ev

PROGRESS_EVERY_S = 30.0  # at most one progress event per phase this often (sampling also reports each batch)


class NonFinite(RuntimeError):
    """A non-finite loss, gradient, reward or advantage: the run stops with its last checkpoint intact."""


@dataclass(frozen=True)
class StepShape:
    """The shape of the optimizer steps, decided by validation (config/batch.py, config/memory.py)."""

    train_timesteps: int   # timesteps trained per sample
    fused: int             # timesteps per forward/backward (divides train_timesteps)
    train_batch: int       # the global train batch (train.batch_size x replicas)
    window: int            # trained timesteps per optimizer step (gradient_accumulation_steps x train_timesteps)


@dataclass
class EpochContext:
    """What an epoch trainer may use of the run."""

    cfg: Any
    rt: Any                # ddpo_tpu.runtime.Runtime
    family: Any            # ddpo_tpu.families.ModelFamily
    state: Any             # training/state.py TrainState
    events: Any            # rundir/events.py EventLog
    stepper: "Stepper"
    shape: StepShape
    mixed: bool            # bf16 autocast

    def autocast(self):
        return self.rt.autocast(self.mixed)


class Stepper:
    """Accumulates micro-steps into optimizer steps (see the module docstring). `stat_names` are the scalars a
    micro-step returns, the loss first; `report_step` receives each step's record; `saved_state()` says which
    checkpoint a stop falls back to (for the non-finite message)."""

    def __init__(self, cfg, rt, model: torch.nn.Module, state, events: ev.EventLog, stat_names: Sequence[str],
                 run_dir, report_step: Callable[[dict], None], saved_state: Callable[[], str]):
        self.cfg, self.rt, self.model, self.state, self.events = cfg, rt, model, state, events
        self.stat_names, self.run_dir = tuple(stat_names), run_dir
        self.report_step, self.saved_state = report_step, saved_state
        self.epoch, self.window, self.total, self.count = 0, 1, 0, 0
        self.logs: list[dict[str, float]] = []

    def begin(self, epoch: int, window: int, total: int) -> None:
        """An epoch of `total` units, an optimizer step every `window` units."""
        self.epoch, self.window, self.total, self.count = epoch, window, total, 0
        self.logs, self._said = [], time.monotonic()
        self._stats = self._zeros()

    def _zeros(self) -> torch.Tensor:
        # uploaded data, not a pending constant that would join the next graph
        return torch.zeros(len(self.stat_names)).to(self.rt.device)

    @property
    def window_closed(self) -> bool:
        """The last micro-step ended an optimizer step."""
        return self.count % self.window == 0

    def micro_step(self, compute: Callable[[], Sequence[torch.Tensor]], units: int = 1) -> None:
        """Run `compute()` -> (loss, *stats), each a mean over the micro-step's terms, and backpropagate its share of
        the window; the gradients are synchronised (DDP, FSDP) only on the window's last micro-step."""
        last = (self.count + units) % self.window == 0
        with contextlib.nullcontext() if last else self.rt.no_gradient_sync(self.model):
            out = compute()
            (out[0] / (self.window // units)).backward()
        step = torch.stack([o.detach().float() for o in out])
        self._stats = self._stats + (units * step if units != 1 else step)
        self.count += units
        if self.count % self.window == 0:
            self.logs.append(self.update(self._stats / self.window))
            self._stats = self._zeros()
        else:
            self.rt.sync()
        if time.monotonic() - self._said > PROGRESS_EVERY_S:  # a long phase is not a silent one
            self._said = time.monotonic()
            self.events.emit(ev.TrainingProgress(self.epoch, self.count, self.total, len(self.logs)))

    def batch_done(self) -> None:
        self.events.emit(ev.TrainingBatch(self.epoch, self.count, self.total, len(self.logs)))

    def finish(self) -> list[dict[str, float]]:
        return self.logs

    def update(self, stats: torch.Tensor) -> dict[str, float]:
        """The optimizer step on the accumulated gradients; the window's statistics and the gradient norm to the host
        in one copy; a non-finite one stops the run."""
        cfg, rt, step = self.cfg, self.rt, self.state.global_step
        with rt.profile(self.run_dir, step) if step in cfg.xla.profile_steps else contextlib.nullcontext():
            norm = self.state.update(cfg.train.max_grad_norm)
        step = self.state.global_step  # this update's number (counted from 1)
        stats = rt.mean_over_replicas(stats)  # distributed: each rank's mean of its rows -> the global batch's
        host = rt.to_host(torch.cat([stats, norm.reshape(1).float()])).tolist()  # one copy per optimizer step
        if not all(np.isfinite(host)):
            raise NonFinite(f"non-finite loss or gradient at global step {step} (loss {host[0]}, grad norm "
                            f"{host[-1]}): stopped; {self.saved_state()}. Try a lower train.learning_rate or "
                            f"train.mixed_precision=no")
        rec = {"kind": "step", "epoch": self.epoch, "global_step": step, **dict(zip(self.stat_names, host)),
               "grad_norm": host[-1]}
        self.report_step(rec)
        return rec


__all__ = ["EpochContext", "NonFinite", "PROGRESS_EVERY_S", "StepShape", "Stepper"]
