"""Host overhead at Stable Diffusion 1.4's topology (`python scripts/bench.py --host-overhead`, docs/performance.md),
the training runs: model=sd14_topology for 3 epochs of the issue's workload (8 denoising steps, 4 x 2 samples, train
batch 2 x 2 accumulation, LoRA: 16 sampling steps and 32 trained timesteps per epoch) under each variant (lazy
tracing vs compiled steps, fused timesteps, eager, the distributed runtime with one process and each torch.compile
backend): the main thread's CPU seconds and the wall seconds per steady-state epoch (epochs 1 and 2). The per-step
estimate that follows it is benchmarks/probes/step_estimate.py.

Memory-model constants: none (host time).

    python scripts/bench.py --host-overhead --no-estimate --variants eager_k1 dynamo_k1
    python -m benchmarks.probes.host_overhead --variants eager_k1
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

from benchmarks import runner

HOST_ARGS = ["model=sd14_topology", "tpu_topology=cpu", "sample.num_steps=8", "sample.batch_size=4",
             "sample.num_batches_per_epoch=2", "train.batch_size=2", "train.gradient_accumulation_steps=2",
             "num_epochs=3", "save_freq=3", "prompts=simple_animals", "reward=jpeg_compressibility"]
HOST_VARIANTS = {  # name -> overrides
    "lazy_k1": ["xla.step_compiler=lazy", "train.timesteps_per_micro_step=1"],   # before compiled steps
    "lazy_k8": ["xla.step_compiler=lazy", "train.timesteps_per_micro_step=8"],
    "dynamo_k1": ["xla.step_compiler=dynamo", "train.timesteps_per_micro_step=1"],
    "dynamo_k2": ["xla.step_compiler=dynamo", "train.timesteps_per_micro_step=2"],
    "dynamo_k8": ["xla.step_compiler=dynamo", "train.timesteps_per_micro_step=8"],
    # plain PyTorch on the host CPU: the device is the main thread itself, so "host" time is all of the compute (an
    # upper bound of the dispatch overhead a GPU or TPU would see)
    "eager_k1": ["tpu_topology=eager_cpu", "train.timesteps_per_micro_step=1"],
    # the distributed runtime with one process (torchrun, the process group, DDP of one, torch.compile)
    **{f"dist_{backend}_k1": ["tpu_topology=cpu_dist2", "tpu_topology.chips_per_host=1", "tpu_topology.chips=1",
                              "tpu_topology.mesh.dp=1", f"distributed.compile={backend}",
                              "train.timesteps_per_micro_step=1"] for backend in ("none", "aot_eager", "inductor")},
}


def add_arguments(ap) -> None:
    runner.add_shared(ap, "--variants", nargs="*", default=list(HOST_VARIANTS), choices=list(HOST_VARIANTS),
                      help="training runs of the host-overhead benchmark (none: only the per-step estimate)")


def with_variant(args: list[str], variant: list[str]) -> list[str]:
    """HOST_ARGS with a variant's overrides; a variant's key replaces the same key of HOST_ARGS (Hydra refuses a
    config group given twice)."""
    keys = {o.split("=", 1)[0] for o in variant}
    return [a for a in args if a.split("=", 1)[0] not in keys] + list(variant)


def host_run(name: str, root: Path) -> dict:
    """One training process; per steady-state epoch (1 and 2): wall seconds and the main thread's CPU seconds
    (time.thread_time() around each phase in the trainer: tracing, dispatch, Python; XLA executes on other threads)."""
    proc, wall = runner.run_train([*with_variant(HOST_ARGS, HOST_VARIANTS[name]), f"output_root={root}",
                                   f"run_name={name}"])
    if proc.returncode:
        return {"variant": name, "error": runner.failure(proc, 800)}
    epochs = runner.read_records(root / name, "epoch")
    steady = epochs[1:]
    work = ("sampling", "reward", "advantages", "training")  # the checkpoint of the last epoch is left out
    med = lambda xs: round(statistics.median(xs), 2)
    return {
        "variant": name, "run_wall_s": round(wall, 1),
        "epoch0_compile_s": round(sum(p["compile_seconds"] for p in epochs[0]["phases"].values()), 1),
        "epoch0_compilations": epochs[0]["new_compilations"],
        "compilations_epochs1_2": sum(e["new_compilations"] for e in steady),
        "host_s_per_epoch": med([sum(e["phases"][k]["host_seconds"] for k in work) for e in steady]),
        "wall_s_per_epoch": med([sum(e["phases"][k]["seconds"] for k in work) for e in steady]),
        "host_ms_per_sampling_step": med([1000 * e["phases"]["sampling"]["host_seconds"] / 16 for e in steady]),
        "host_ms_per_trained_timestep": med([1000 * e["phases"]["training"]["host_seconds"] / 32 for e in steady]),
        "reward_epoch2": round(epochs[-1]["reward_mean"], 5),
    }


def run(args, report: runner.Report) -> None:
    if not args.variants:  # --variants with none: only the per-step estimate
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.variants:
            rows.append(runner.progress(host_run(name, Path(tmp))))
    report.add(
        "Host overhead at SD 1.4's topology (model=sd14_topology, LoRA; lazy_/dynamo_: XLA CPU; eager_ and "
        "dist_<torch.compile backend>_: plain PyTorch on the CPU, where the main thread also computes, so their host "
        "time is an upper bound of the dispatch cost; 8 denoising steps, 4 x 2 samples, train batch 2 x 2 "
        "accumulation: 16 sampling steps and 32 trained timesteps per epoch). Medians of the steady-state epochs 1 "
        "and 2; host = CPU time of the training process's main thread (time.thread_time around each phase; XLA "
        f"executes on other threads):\n\n{runner.table(rows)}")


if __name__ == "__main__":
    runner.main(sys.modules[__name__])
