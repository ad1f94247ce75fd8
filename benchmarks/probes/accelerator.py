"""Measure a real accelerator the day one is at hand (`python scripts/bench_accelerator.py`): images/s, MFU, peak
device memory and compile time of the trainer itself (python -m ddpo_tpu.train) at a given shape, from its
metrics.jsonl.

FLOPs are the project's figures per denoiser evaluation (forward), times 3 for a trained evaluation (forward +
backward), times 2 with classifier-free guidance; MFU = those FLOPs / (wall seconds x peak x devices). The SD 1.4
figures were counted with torch.utils.flop_counter on the meta device (BRIEF §5: 0.80 TFLOP per UNet evaluation at
512 px, 2.5 TFLOP per VAE decode; benchmarks/probes/step_estimate.py counts them); SD 3.5 Medium's is 2 x parameters
x tokens (2.24e9 x (1024 + 333) x 2), an estimate that leaves attention's quadratic term out.

Memory-model constants: none measured yet. Its peak_device_gib (the chip's allocator peak) is the check the memory
model's estimates (ddpo_tpu/catalog/families.py: each family's activation_gib_per_eval_512,
checkpointed_gib_per_eval_512, resident_gib; SD1_RESIDENT_GIB, SD3_STATE_GIB) wait for.

    # 8 GPUs, ddpo-pytorch's compressibility shape on SD 1.4 with random weights (no download needed)
    python scripts/bench_accelerator.py --model sd14 -- +experiment=compressibility_parity model=sd14_random \\
        tpu_topology=gpu-8 sample.batch_size=8 sample.num_batches_per_epoch=4 train.batch_size=4 \\
        train.gradient_accumulation_steps=2
    # a v6e-8 with TorchTPU (from .venv-torchtpu), the same shape
    .venv-torchtpu/bin/python scripts/bench_accelerator.py --model sd14 -- +experiment=compressibility_parity \\
        model=sd14_random tpu_topology=v6e-8 tpu_topology.execution=distributed
    # SD 3.5 Medium's shape (flow_grpo's PickScore run)
    python scripts/bench_accelerator.py --model sd35_medium -- +experiment=flow_grpo_pickscore_sd35 tpu_topology=gpu-8
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

from benchmarks import runner

# forward TFLOP per denoiser evaluation (one sample) and per VAE decode (one image), at the model's own resolution
MODEL_TFLOP = {"sd14": (0.80, 2.51), "sd35_medium": (6.08, 2.51), "tiny": (0.0004, 0.0003)}
# dense bf16 peak TFLOP/s per device
PEAK_TFLOPS = {"cuda": 312.0, "tpu_v4": 275.0, "tpu_v5e": 197.0, "tpu_v6e": 918.0, "cpu": 1.0}


def add_arguments(ap) -> None:
    ap.add_argument("--model", choices=list(MODEL_TFLOP), required=True, help="whose FLOP figures to use")
    ap.add_argument("--peak-tflops", type=float, help="per-device peak (default: by accelerator, bf16 dense)")
    ap.add_argument("overrides", nargs="*", help="the run's overrides (after --); num_epochs defaults to 3")


def epoch_tflop(cfg: dict, model: str) -> float:
    """FLOPs of one epoch of the run (all devices), from its composed config (config.yaml)."""
    per_eval, decode = MODEL_TFLOP[model]
    s, t, topo = cfg["sample"], cfg["train"], cfg["tpu_topology"]
    replicas = topo["mesh"]["dp"] * topo["mesh"]["fsdp"] if topo["execution"] in ("xla_spmd", "distributed") else 1
    samples = s["batch_size"] * s["num_batches_per_epoch"] * replicas
    guided = 2 if s["guidance_scale"] > 1 else 1
    trained = int(s["num_steps"] * t["timestep_fraction"]) * (2 if t["cfg"] else 1) * 3 * t["num_inner_epochs"]
    return samples * (s["num_steps"] * guided * per_eval + decode + trained * per_eval)


def measure(overrides: list[str], model: str, peak: float | None, out_root: Path) -> dict:
    proc, wall = runner.run_train([*overrides, f"output_root={out_root}", "run_name=bench"])
    if proc.returncode:
        raise SystemExit(f"the run failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    from omegaconf import OmegaConf

    run = out_root / "bench"
    cfg = OmegaConf.to_container(OmegaConf.load(run / "config.yaml"))
    epochs = runner.read_records(run, "epoch")
    if len(epochs) < 2:
        raise SystemExit("need num_epochs >= 2 (epoch 0 compiles; the rest are measured)")
    topo = cfg["tpu_topology"]
    work = ("sampling", "reward", "advantages", "training")
    seconds = statistics.median(sum(e["phases"][k]["seconds"] for k in work) for e in epochs[1:])
    peak = peak or PEAK_TFLOPS[topo["accelerator"]]
    tflop = epoch_tflop(cfg, model)
    return {"topology": topo["name"], "execution": topo["execution"], "model": cfg["model"]["name"],
            "images_per_s": round(epochs[1]["num_samples"] / seconds, 3), "epoch_s": round(seconds, 2),
            "epoch_tflop": round(tflop, 2), "mfu_%": round(100 * tflop / (seconds * peak * topo["chips"]), 2),
            "peak_device_gib": max((e["device_peak_gib"] or 0) for e in epochs) or None,
            "epoch0_compile_s": round(sum(p["compile_seconds"] for p in epochs[0]["phases"].values()), 1),
            "compilations_after_epoch0": sum(e["new_compilations"] for e in epochs[1:]),
            "run_wall_s": round(wall, 1)}


def run(args, report: runner.Report) -> dict:
    overrides = args.overrides if any(o.startswith("num_epochs=") for o in args.overrides) else [
        *args.overrides, "num_epochs=3"]
    with tempfile.TemporaryDirectory() as tmp:
        row = measure(overrides, args.model, args.peak_tflops, Path(tmp))
    report.add(f"The trainer at `{' '.join(overrides)}` ({args.model}'s FLOP figures):\n\n{runner.table([row])}")
    return row


if __name__ == "__main__":
    runner.main(sys.modules[__name__])
