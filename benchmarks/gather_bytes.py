"""What the distributed runtime's gather of an epoch's trajectories moves, computed (not measured): `python -m
benchmarks.gather_bytes [--ranks 8] [--link-gbps 350 12.5]`; docs/performance.md quotes its table.

Read from the code: after sampling, DDPOTrainer.epoch_samples (ddpo_tpu/training/loop.py) gathers every per-batch part
of the epoch with DistributedRuntime.gather_batch (ddpo_tpu/runtime/distributed.py, one all_gather_into_tensor per
part): the latents (B, T + 1, C, h, w) in the conditioning's dtype (sampling.py: `dtype = cond[0].dtype`), the
log-probs (B, T) and step indices (B, T, int64), and the conditioning (SD 1.x: the text embeddings (B, 77, 768);
SD 3: (B, 77 + 128, 4096) and the pooled (B, 2048)), in the text encoder's dtype (model.dtype). Advantages and weights
are computed on every rank (not gathered); rewards go through gather_rows (a float per sample). An all-gather of a
tensor of G bytes leaves every rank G and has each receive (W - 1) / W x G over its links.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

ITEM = {"float32": 4, "bfloat16": 2}


@dataclass(frozen=True)
class Shape:
    name: str
    samples: int          # global samples per epoch
    steps: int            # denoising steps (T)
    latent: tuple         # (C, h, w)
    cond: tuple           # shapes of the conditioning tensors per sample
    dtype: str            # model.dtype: latents and conditioning
    epoch_tflop: float    # the epoch's FLOPs (benchmarks/probes/accelerator.py's figures), for the time beside it


# the parity runs on 8 GPUs (README: compressibility_parity tpu_topology=gpu-8; flow_grpo_pickscore_sd35's 1152)
SHAPES = (
    Shape("SD 1.4, compressibility parity (256 x 50 steps)", 256, 50, (4, 64, 64), ((77, 768),), "float32",
          256 * (50 * 2 * 0.80 + 2.51 + 50 * 2 * 3 * 0.80)),
    Shape("SD 3.5 Medium, flow_grpo PickScore (1152 x 10 steps)", 1152, 10, (16, 64, 64), ((205, 4096), (2048,)),
          "bfloat16", 1152 * (10 * 2 * 6.08 + 2.51 + 9 * 2 * 3 * 6.08)),
)


def numel(shape: tuple) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def per_sample_bytes(s: Shape) -> dict:
    item = ITEM[s.dtype]
    return {"latents": (s.steps + 1) * numel(s.latent) * item, "log_probs": s.steps * 4, "step_indices": s.steps * 8,
            "conditioning": sum(numel(c) for c in s.cond) * item}


def gather_row(s: Shape, ranks: int, link_gbps: tuple[float, ...], mfu: float = 0.4, peak: float = 989.0) -> dict:
    parts = per_sample_bytes(s)
    whole = s.samples * sum(parts.values())
    received = whole * (ranks - 1) / ranks
    epoch_s = s.epoch_tflop / (ranks * peak * mfu)
    row = {"shape": s.name, "dtype": s.dtype, "MiB per sample": round(sum(parts.values()) / 2 ** 20, 2),
           "GiB held per rank": round(whole / 2 ** 30, 2), f"GiB received per rank ({ranks} ranks)":
           round(received / 2 ** 30, 2), f"epoch s at {mfu:.0%} MFU": round(epoch_s, 1)}
    for gbps in link_gbps:
        seconds = received / (gbps * 1e9)
        row[f"s at {gbps:g} GB/s"] = f"{seconds:.3f} ({100 * seconds / epoch_s:.2f}% of the epoch)"
    return row


def main(argv: list[str] | None = None) -> None:
    from benchmarks.runner import table

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--link-gbps", type=float, nargs="+", default=[350.0, 12.5],
                    help="per-rank all-gather bandwidth, GB/s (350: NVLink/NVSwitch within a node; 12.5: 100 Gb/s)")
    a = ap.parse_args(argv)
    print(table([gather_row(s, a.ranks, tuple(a.link_gbps)) for s in SHAPES]))


if __name__ == "__main__":
    main()
