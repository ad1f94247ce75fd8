"""One epoch of SD 1.4 at full width (`python scripts/bench.py --full-width`): model=sd14_random (860M-param UNet,
512 px, random weights; LoRA; 1 sample, 2 denoising steps, train batch 1) on eager CPU and XLA CPU: does it run, how
long, and the training process's peak resident memory (on XLA CPU it holds the device buffers too).

Memory-model constants: none directly. Its OOM on XLA CPU (float32 and bf16) is the evidence behind
SD1_ATTENTION_SCORES_GIB_512 (the softmaxes XLA keeps, a derived figure); its eager peak RSS (11.6 GiB) sits beside
SD1_EAGER_GIB (ddpo_tpu/catalog/families.py).

    python scripts/bench.py --full-width     # about 20 minutes, ~10 GiB of memory
    python scripts/bench.py --full-width --backends cpu --overrides train.mixed_precision=bf16
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from benchmarks import runner
from benchmarks.probes.training_runs import add_backends, add_overrides

FULL_WIDTH_ARGS = ["model=sd14_random", "sample.batch_size=1", "sample.num_batches_per_epoch=1", "sample.num_steps=2",
                   "train.batch_size=1", "train.gradient_accumulation_steps=1", "num_epochs=1", "save_freq=1",
                   "reward.host_workers=0"]
TOPOLOGIES = ("eager_cpu", "cpu")  # the --backends it runs on


def add_arguments(ap) -> None:
    add_backends(ap)
    add_overrides(ap)


def epoch_run(topo: str, overrides: list[str], root: Path) -> dict:
    name = f"full_{topo}"
    proc, wall = runner.run_train([*FULL_WIDTH_ARGS, *overrides, f"tpu_topology={topo}", f"output_root={root}",
                                   f"run_name={name}"])
    row = {"backend": topo, "overrides": " ".join(overrides)}
    if proc.returncode:
        return row | {"error": runner.failure(proc)}
    (epoch,) = runner.read_records(root / name, "epoch")
    ph = epoch["phases"]
    return row | {"run_wall_s": round(wall, 1), "sampling_s": ph["sampling"]["seconds"],
                  "training_s": ph["training"]["seconds"],
                  "compile_s": round(sum(p["compile_seconds"] for p in ph.values()), 1),
                  "compilations": epoch["new_compilations"], "peak_rss_gib": epoch["host_peak_rss_gib"],
                  "loss": epoch["loss"]}


def run(args, report: runner.Report) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        rows = [runner.progress(epoch_run(topo, args.overrides, Path(tmp)))
                for topo in args.backends if topo in TOPOLOGIES]
    report.add("One epoch of SD 1.4 at full width (model=sd14_random: 860M-param UNet, 512 px, random weights; LoRA; "
               "1 sample, 2 denoising steps, train batch 1): wall seconds and the training process's peak resident "
               f"memory (on XLA CPU it holds the device buffers too):\n\n{runner.table(rows)}")


if __name__ == "__main__":
    runner.main(sys.modules[__name__])
