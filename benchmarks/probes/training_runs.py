"""The XLA discipline and speed of the trainer on this machine (`python scripts/bench.py`, part 1): one training
process per run (the real launcher) for eager CPU, XLA CPU (one device), XLA CPU SPMD x4 and SPMD x4 as a dp 2 x
fsdp 2 mesh, at each sample.num_steps: compilations in epoch 0 and in epochs 1-2, host transfers per epoch, sampling
ms per denoising step and training ms per micro-step (both from epoch 2, after compilation), and the training state
(weights, gradients, Adam moments) one device holds.

Memory-model constants: none (speed and compilation discipline).

    python scripts/bench.py --steps 10 --backends eager_cpu cpu --no-pipeline
    python -m benchmarks.probes.training_runs --steps 2 --backends eager_cpu
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from benchmarks import runner

RUN_ARGS = ["+experiment=smoke", "num_epochs=3", "save_freq=3", "reward.host_workers=0",
            "sample.num_batches_per_epoch=1", "train.gradient_accumulation_steps=2"]
PER_BACKEND = {  # global batch 8 for sampling, 4 for training on every backend
    "eager_cpu": ["tpu_topology=eager_cpu"],
    "cpu": ["tpu_topology=cpu"],
    "cpu_spmd4": ["tpu_topology=cpu_spmd4", "sample.batch_size=2", "train.batch_size=1"],
    # the same mesh as dp 2 x fsdp 2: weights, gradients and Adam moments split in two
    "cpu_spmd4_fsdp2": ["tpu_topology=cpu_spmd4", "tpu_topology.mesh.dp=2", "tpu_topology.mesh.fsdp=2",
                        "sample.batch_size=2", "train.batch_size=1"],
}


def add_backends(ap) -> None:
    runner.add_shared(ap, "--backends", nargs="+", default=list(PER_BACKEND), choices=list(PER_BACKEND),
                      help="the topologies run (--full-width and the pipeline comparison: eager_cpu and cpu only)")


def add_overrides(ap) -> None:
    runner.add_shared(ap, "--overrides", nargs="*", default=[],
                      help="extra config overrides for every training run (e.g. model.cache_dir=...)")


def add_arguments(ap) -> None:
    runner.add_shared(ap, "--steps", type=int, nargs="+", default=[10, 20, 50], help="sample.num_steps values")
    add_backends(ap)
    add_overrides(ap)


def run_point(backend: str, steps: int, root: Path, overrides: list[str] = ()) -> dict:
    name = f"{backend}_{steps}"
    proc, wall = runner.run_train([*RUN_ARGS, *PER_BACKEND[backend], f"sample.num_steps={steps}", *overrides,
                                   f"output_root={root}", f"run_name={name}"])
    if proc.returncode:
        return {"backend": backend, "steps": steps, "error": runner.failure(proc, 500)}
    recs = runner.read_records(root / name)
    epochs = [r for r in recs if r["kind"] == "epoch"]
    from ddpo_tpu.rundir import events as ev

    layout = next(e for e in ev.read_events(root / name) if e["event"] == "state_layout")  # an event, not a metric
    last = epochs[-1]["phases"]
    micro = (8 // 4) * steps  # train batches per epoch x train timesteps
    return {
        "backend": backend, "steps": steps, "wall_s": round(wall, 1),
        "compilations_epoch0": epochs[0]["new_compilations"],
        "compilations_epochs1_2": sum(e["new_compilations"] for e in epochs[1:]),
        # programs torch_xla compiles to replicate a sharded tensor (on CPU: the inputs of the allowed fallback)
        "replicate_compilations_epochs1_2": sum(e.get("new_replicate_compilations", 0) for e in epochs[1:]),
        "state_mib_per_device": round(layout["bytes_per_device"] / 2**20, 2),
        "host_transfers_per_epoch": sum(p["host_transfers"] for p in last.values()),
        "sampling_ms_per_step": round(1000 * last["sampling"]["seconds"] / steps, 2),
        "training_ms_per_microstep": round(1000 * last["training"]["seconds"] / micro, 2),
    }


def run(args, report: runner.Report) -> None:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for backend in args.backends:
            for steps in args.steps:
                rows.append(runner.progress(run_point(backend, steps, Path(tmp), args.overrides)))
    report.add("Training runs (smoke experiment, 8 samples and 2 x 4-sample train batches per epoch, 3 epochs"
               + (f"; overrides {' '.join(args.overrides)}" if args.overrides else "") + f"):\n\n{runner.table(rows)}")


if __name__ == "__main__":
    import sys

    runner.main(sys.modules[__name__])
