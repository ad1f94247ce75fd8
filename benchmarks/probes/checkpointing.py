"""Activation checkpointing (`python scripts/bench.py --checkpointing`; train.activation_checkpointing, diffusers'
gradient checkpointing of every resnet and transformer block): what the backward keeps with and without it. Eager
CPU at full width (SD 1.4's UNet: benchmarks/probes/sd14_activations.py; SD 3.5 Medium's transformer 2-3 layers deep,
checkpointed: sd3_activations.py, its unchecked rows are --sd3-activations) per sample, and XLA CPU on SD 1.4's
topology at 4096 tokens (xla_checkpointing.py), where the attention scores XLA keeps show.

Memory-model constants (ddpo_tpu/catalog/families.py), the families' checkpointed_gib_per_eval_512:
SD1_CKPT_EAGER_RATIO (0.28 = 0.43 / 1.53, the per-sample table's SD 1.4 rows), SD3_CKPT_EAGER_RATIO (0.26 = 0.75 /
2.9, its SD 3.5 row over SD3_EAGER_GIB from --sd3-activations), CKPT_XLA_SCORES_RATIO (0.51, the XLA table: peak RSS
above the ~1.9 GiB baseline, 5.6 / 11.0).

    python scripts/bench.py --checkpointing  # about 30 minutes, ~14 GiB
"""

from __future__ import annotations

import sys

from benchmarks import runner
from benchmarks.probes import sd3_activations, sd14_activations, xla_checkpointing


def add_arguments(ap) -> None:
    sd14_activations.add_arguments(ap)  # --batches (1 2: the per-sample table needs both)
    xla_checkpointing.add_arguments(ap)  # --latent


def run(args, report: runner.Report) -> None:
    sd1 = sd14_activations.probe_rows(args.batches)
    sd3 = sd3_activations.probe_rows("float32", checkpointed=True)  # without: --sd3-activations
    xla = xla_checkpointing.probe_rows(args.latent)
    per_sample = sd14_activations.per_sample(sd1) + [
        {"model": "SD 3.5 Medium transformer (24 layers, extrapolated)", "checkpointed": True,
         "peak_rss_delta_gib": sd3_activations.eager_24_layers(est)}
        for est in sd3_activations.estimate(sd3, "peak_rss_delta_gib")]
    report.add(
        f"Activation checkpointing (train.activation_checkpointing; diffusers' gradient checkpointing of every resnet "
        f"and transformer block). Eager CPU, float32, LoRA, one forward + backward per process, full width at 512 px "
        f"(measure_backward: saved bytes, blind inside checkpointed blocks; peak RSS over the step minus the RSS "
        f"before it):\n\n{runner.table(sd1 + sd3)}\n\nPer sample and evaluation (batch 2 - batch 1; SD 3.5 Medium "
        f"extrapolated to 24 layers as --sd3-activations does), GiB:\n\n{runner.table(per_sample)}\n\n"
        f"{xla_checkpointing.describe(args.latent)}:\n\n{runner.table(xla)}")


if __name__ == "__main__":
    runner.main(sys.modules[__name__])
