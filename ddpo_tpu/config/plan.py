"""The run plan: every runtime decision validation makes about a run, computed once and frozen.

Validation (config/compose.py `validate_tree`) computes it from the validated config and the topology's facts (the
chips, the mesh, the processes the launch must find), after every rule passed; `Validated.plan` carries it. From
there it is
  - shown: `--check` and the start screen (display/console.py `plan_line`), and `--check --json` prints it as JSON
    (one object per run: train.py `print_check_json`),
  - stored: the run dir's parity.json, as one more row (`parity_row`; constraint "run plan", always ok), so a run
    dir says what its last start decided; an older parity.json without that row is as valid (`plan_of_rows`: None),
  - read: the training process validates its saved config once (worker.py), and the Trainer, the epoch trainers
    (through the step shape), the algorithms (`make_algorithm(cfg, plan)`: `Algorithm.plan`; GRPO's updates per inner
    epoch, AWM's accumulation window) and the out-of-memory line read the plan instead of asking config/memory.py and
    config/batch.py again.

Torch-free and JSON-serialisable (`as_dict` / `from_dict` round-trip exactly), so the front end can print and save it
and a test can compare what `--check` printed with what the loop was handed (tests/unit/config/test_run_plan.py).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Callable

from ddpo_tpu.config.batch import totals
from ddpo_tpu.config.memory import activation_checkpointing, fused_timesteps
from ddpo_tpu.config.schema import RunConfig

PLAN_ROW = "run plan"  # the parity.json row that holds the plan (its `effective` value)


@dataclass(frozen=True)
class SdeWindowPlan:
    """sample.sde_window as the sampler places it (diffusion/window.py `sde_window_at` reads these attributes): the
    window's size, how it moves and the range [lo, hi) it moves in (the whole rollout when the config has none)."""

    size: int
    placement: str
    start: int
    range: tuple[int, int]
    shift_every: int
    stride: int

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "range": list(self.range)}


@dataclass(frozen=True)
class RunPlan:
    rollout_steps: int              # denoising steps of each sampled trajectory (sample.num_steps)
    # timesteps trained per sample: the algorithm's own count where its catalog entry names one (AWM:
    # algorithm.train_timesteps), else an SDE window's size, else int(steps x fraction) (config/batch.py)
    train_timesteps: int
    # timesteps per forward/backward: train.timesteps_per_micro_step resolved, or all train_timesteps for an algorithm
    # that trains them in one forward (catalog AlgorithmSpec.one_forward: AWM's K x B rows)
    fused_timesteps: int
    activation_checkpointing: bool  # train.activation_checkpointing resolved (auto: by the HBM estimate)
    replicas: int                   # devices the global batch is split over
    processes: int                  # training processes of the whole run
    global_sample_batch: int        # sample.batch_size x replicas: one sampling batch of the whole run
    global_train_batch: int         # train.batch_size x replicas: one train batch of the whole run
    gradient_accumulation_steps: int
    # trained timesteps per optimizer step (the stepper's window): gradient_accumulation_steps x train_timesteps, in
    # timesteps for every algorithm (AWM's micro-step counts its one forward's train_timesteps: G train batches)
    accumulation_window: int
    samples_per_epoch: int          # of the whole run
    updates_per_epoch: float        # optimizer steps per epoch
    # optimizer steps per inner epoch: samples_per_epoch // (global_train_batch x gradient_accumulation_steps), the
    # same on every process (keep_samples_on_rank halves the samples and the train batch alike); GRPO's rebatching
    updates_per_inner_epoch: int
    # each rank trains the samples it drew (distributed.keep_samples_on_rank, several processes under torchrun)
    keep_samples_on_rank: bool
    samples_on_rank: int            # samples one training process trains per epoch
    sde_window: SdeWindowPlan | None  # None: every step is the SDE's

    def as_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["sde_window"] = self.sde_window.as_dict() if self.sde_window is not None else None
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunPlan:
        """The plan of `as_dict`, or of an older run dir's parity.json: a field added since (ADDED) is derived from
        the fields that row has, as run_plan derives it."""
        w = d.get("sde_window")
        window = SdeWindowPlan(**{**w, "range": tuple(w["range"])}) if w is not None else None
        d = {**{k: derive(d) for k, derive in ADDED.items() if k not in d}, **d}
        return cls(**{**{f.name: d[f.name] for f in fields(cls) if f.name != "sde_window"}, "sde_window": window})

    def parity_row(self) -> dict[str, Any]:
        """The plan as a row of parity.json (the report rows' shape, so every reader of the rows takes it)."""
        return {"constraint": PLAN_ROW, "target": None, "effective": self.as_dict(), "ok": True}

    def describe(self) -> str:
        """One line for --check and the start screen."""
        window = ""
        if self.sde_window is not None:
            w = self.sde_window
            window = f", SDE window {w.size} of [{w.range[0]}, {w.range[1]}) {w.placement}"
        rank = f", {self.samples_on_rank} samples kept on each rank" if self.keep_samples_on_rank else ""
        return (f"{self.rollout_steps} rollout steps, {self.train_timesteps} trained x {self.fused_timesteps} per "
                f"micro-step, checkpointing {'on' if self.activation_checkpointing else 'off'}; "
                f"batches {self.global_sample_batch} sampled / {self.global_train_batch} trained over "
                f"{self.replicas} replica(s), an update per {self.gradient_accumulation_steps} train batch(es) x "
                f"{self.train_timesteps} timesteps{window}{rank}")


def run_plan(cfg: RunConfig) -> RunPlan:
    """The plan of a validated config (its rules passed: the fused K divides the trained timesteps, ...)."""
    topo, sample, train = cfg.tpu_topology, cfg.sample, cfg.train
    tot = totals(cfg)
    T = tot.train_timesteps
    processes = topo.expected_processes
    keep = topo.spec.torchrun and processes > 1 and cfg.distributed.keep_samples_on_rank
    w = sample.sde_window
    window = None
    if w.size is not None:
        lo, hi = w.range if w.range is not None else (0, sample.num_steps)
        window = SdeWindowPlan(w.size, w.placement, w.start, (lo, hi), w.shift_every, w.stride)
    return RunPlan(
        rollout_steps=sample.num_steps,
        train_timesteps=T,
        fused_timesteps=fused_timesteps(cfg) if T >= 1 else 1,
        activation_checkpointing=bool(activation_checkpointing(cfg)),
        replicas=tot.replicas,
        processes=processes,
        global_sample_batch=sample.batch_size * tot.replicas,
        global_train_batch=train.batch_size * tot.replicas,
        gradient_accumulation_steps=train.gradient_accumulation_steps,
        accumulation_window=train.gradient_accumulation_steps * T,
        samples_per_epoch=tot.samples_per_epoch,
        updates_per_epoch=tot.updates_per_epoch,
        updates_per_inner_epoch=tot.samples_per_epoch // tot.total_train_batch,
        keep_samples_on_rank=bool(keep),
        samples_on_rank=tot.samples_per_epoch // processes if keep else tot.samples_per_epoch,
        sde_window=window,
    )


# Fields added to RunPlan after run dirs stored it (2026-11-29, issue 42): how an older row's other fields give them.
ADDED: dict[str, Callable[[dict[str, Any]], Any]] = {
    "updates_per_inner_epoch":
        lambda d: d["samples_per_epoch"] // (d["global_train_batch"] * d["gradient_accumulation_steps"]),
}


def plan_of_rows(rows: Any) -> RunPlan | None:
    """The plan stored in a parity.json's rows; None for a run dir written before the plan (or an unreadable row)."""
    for row in rows if isinstance(rows, list) else ():
        if isinstance(row, dict) and row.get("constraint") == PLAN_ROW and isinstance(row.get("effective"), dict):
            try:
                return RunPlan.from_dict(row["effective"])
            except (KeyError, TypeError):
                return None
    return None


__all__ = ["PLAN_ROW", "RunPlan", "SdeWindowPlan", "plan_of_rows", "run_plan"]
