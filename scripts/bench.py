#!/usr/bin/env python
"""Benchmark the XLA discipline, speed and training memory on this machine; prints a table and appends it, dated,
with the machine and its load, to benchmarks/RESULTS.md. A thin front over the probes in benchmarks/probes/ (one
module each, with what it measures and which memory-model constants it is the source of; each also runs on its own:
`python -m benchmarks.probes.NAME --help`).

Default: part 1, the trainer per topology and sample.num_steps (training_runs), and part 2, our sampler against
diffusers' StableDiffusionPipeline (pipeline).
--host-overhead: SD 1.4's topology, lazy tracing vs compiled steps and fused timesteps (host_overhead), then host ms
per step at the parity batch sizes against SD 1.4's FLOPs on a v6e chip (step_estimate).
--full-width: one epoch of model=sd14_random on eager and XLA CPU (full_width).
--sd3-activations: SD 3.5 Medium's transformer at full width, 2-3 layers, eager CPU (sd3_activations).
--sd14-activations: SD 1.4's UNet at full width, eager CPU, with and without checkpointing, and the attention scores
XLA keeps, derived (sd14_activations).
--checkpointing: the eager probes with and without gradient checkpointing and SD 1.4's topology compiled on XLA CPU
(checkpointing: sd14_activations, sd3_activations, xla_checkpointing).
--lazy-checkpointing: what XLA CPU's compiler does with the lazy path's checkpoint barriers (lazy_checkpointing).
--sd3-parameters: SD 3.5 Medium's parts in billions of values, built on the meta device (sd3_parameters).
--sde-window: Flow-GRPO's training time with and without SDE windows on the tiny SD3 model (sde_window).
--awm-vs-grpo: samples and transformer FLOPs AWM and Flow-GRPO need to reach the same reward on the tiny SD3 model
(awm_vs_grpo).

    python scripts/bench.py                  # parts 1 and 2 (about 35 minutes on 2 CPU cores)
    python scripts/bench.py --steps 10 --backends eager_cpu cpu --no-pipeline
    python scripts/bench.py --host-overhead  # about 50 minutes
    python scripts/bench.py --host-overhead --variants   # only the per-step estimate (about 12 minutes)
    python scripts/bench.py --full-width     # about 20 minutes, ~10 GiB of memory
    python scripts/bench.py --sd3-activations --precisions float32   # about 15 minutes, ~3 GiB (bf16: slow here)
    python scripts/bench.py --sd14-activations  # 4 full-width processes, one at a time
    python scripts/bench.py --checkpointing  # about 30 minutes, ~14 GiB
    python scripts/bench.py --lazy-checkpointing  # about 5 minutes
    python scripts/bench.py --sd3-parameters      # seconds
    python scripts/bench.py --sde-window          # about 6 minutes
    python scripts/bench.py --awm-vs-grpo         # about 4 minutes
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import runner  # noqa: E402
from benchmarks.probes import (checkpointing, full_width, host_overhead, lazy_checkpointing, pipeline,  # noqa: E402
                               sd3_activations, sd3_parameters, sd14_activations, sde_window, step_estimate,
                               training_runs)
from benchmarks.probes import awm_vs_grpo, flux_activations, qwen_image_activations, wan_memory  # noqa: E402

# flag -> (help, the probes it runs, in order); the first flag given wins, as before
MODES = {
    "--sd3-activations": ("only the SD 3.5 Medium training-activation probes (full width, 2-3 layers, eager CPU)",
                          [sd3_activations]),
    "--sd14-activations": ("only SD 1.4's UNet training-activation probes (full width, eager CPU, with and without "
                           "checkpointing)", [sd14_activations]),
    "--checkpointing": ("only the activation checkpointing probes (SD 1.4 and SD 3.5 Medium eager, SD 1.4's topology "
                        "on XLA CPU, with and without)", [checkpointing]),
    "--lazy-checkpointing": ("only the lazy path's checkpointing probes (HLO dumps of XLA CPU, with and without)",
                             [lazy_checkpointing]),
    "--host-overhead": ("only the host-overhead benchmark at SD 1.4's topology (model=sd14_topology)",
                        [host_overhead, step_estimate]),
    "--full-width": ("only one epoch of SD 1.4 at full width (model=sd14_random) on eager and XLA CPU", [full_width]),
    "--sd3-parameters": ("only SD 3.5 Medium's parameter counts (meta device, seconds)", [sd3_parameters]),
    "--sde-window": ("only Flow-GRPO's training time with and without SDE windows (tiny SD3, eager CPU)", [sde_window]),
    "--awm-vs-grpo": ("only the samples and FLOPs AWM and Flow-GRPO need to reach the same reward (tiny SD3, eager "
                      "CPU)", [awm_vs_grpo]),
    "--flux-activations": ("only FLUX.1-dev's parameter counts and training-activation probes (full width, 1-2 "
                           "blocks of each kind, eager CPU)", [flux_activations]),
    "--qwen-image-activations": ("only Qwen-Image's parameter counts and training-activation probes (full width, 1-2 "
                                 "blocks, eager CPU)", [qwen_image_activations]),
    "--wan-memory": ("only Wan 2.1's memory model: the saved-activation fit (toy widths), the tiny build's saved bytes "
                     "and peak RSS against it, the full-size figures (eager CPU)", [wan_memory]),
}
DEFAULT = [training_runs, pipeline]
PROBES = list(dict.fromkeys([*DEFAULT, *(m for _, probes in MODES.values() for m in probes)]))


def parse(argv: list[str]):
    ap = runner.parser(__doc__)
    for flag, (text, _) in MODES.items():
        ap.add_argument(flag, action="store_true", help=text)
    ap.add_argument("--no-pipeline", action="store_true", help="skip the diffusers pipeline comparison")
    ap.add_argument("--no-estimate", action="store_true",
                    help="--host-overhead: only the training runs, not the per-step XLA probe and device estimate")
    for probe in PROBES:
        probe.add_arguments(ap)
    return ap.parse_args(argv)


def selected(args) -> list:
    """The probes the flags ask for, in order."""
    for flag, (_, probes) in MODES.items():
        if getattr(args, flag[2:].replace("-", "_")):
            return [p for p in probes if not (p is step_estimate and args.no_estimate)]
    return [p for p in DEFAULT if not (p is pipeline and args.no_pipeline)]


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    runner.run_probes(selected(args), args, shlex.join(["python", "scripts/bench.py", *argv]))


if __name__ == "__main__":
    main()
