"""What the distributed runtime's epoch data path moves and holds, computed (not measured), both ways
(distributed.keep_samples_on_rank): `python -m benchmarks.gather_bytes [--ranks 8] [--link-gbps 350 12.5]`;
docs/performance.md quotes its table.

Read from the code: after sampling, Trainer.epoch_samples (ddpo_tpu/training/loop.py, training/epoch_data.py) by
default gathers every per-batch part of the epoch with DistributedRuntime.gather_batch (ddpo_tpu/runtime/
distributed.py, one all_gather_into_tensor per part): the latents (B, T + 1, C, [f,] h, w) in the conditioning's dtype
(sampling.py: `dtype = cond[0].dtype`), the log-probs (B, T) and step indices (B, T, int64), and the conditioning
(SD 1.x: the text embeddings (B, 77, 768); SD 3: (B, 77 + 128, 4096) and the pooled (B, 2048); Wan: UMT5's (B, 512,
4096)), in the text encoder's dtype (model.dtype). Advantages and weights are computed on every rank (not gathered);
rewards go through gather_rows (a float64 per sample), prompts are not gathered (every rank draws the same global
prompts). An all-gather of a tensor of G bytes leaves every rank G and has each receive (W - 1) / W x G over its
links. With keep_samples_on_rank=true only the rewards are gathered and each rank holds the 1/W of the epoch it drew.
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

# Wan 2.1 T2V 14B (transformer: 40 layers of width 5120, FFN 13824, patches (1, 2, 2); VAE: frames / 4, pixels / 8;
# UMT5 512 x 4096), on 8 GPUs with flow_grpo's Wan batches (yifan123/flow_grpo@31c71b9 config/grpo.py:35-45,
# general_ocr_wan2_1: 20 steps, 8 videos x 2 batches per GPU = 128 an epoch, guidance 4.5), at flow_grpo's video
# (33 frames of 240 x 416, the same lines) and at Wan's own default video (81 frames of 480 x 832:
# huggingface/diffusers@007f277 src/diffusers/pipelines/wan/pipeline_wan.py, WanPipeline.__call__'s defaults).
WAN_LAYERS, WAN_WIDTH, WAN_FFN, WAN_TEXT = 40, 5120, 13824, 512


def wan_forward_tflop(frames: int, height: int, width: int) -> float:
    """One transformer forward of one video, estimated (not counted): per token and layer the self-attention's four
    projections, the cross-attention's query and output, the FFN; attention over the s video tokens and the 512
    text tokens."""
    s = ((frames - 1) // 4 + 1) * (height // 16) * (width // 16)
    d, L = WAN_WIDTH, WAN_LAYERS
    per_token = 2 * (6 * d * d + 2 * d * WAN_FFN)
    return L * (s * per_token + 4 * s * s * d + 4 * s * WAN_TEXT * d) / 1e12


def wan_shape(name: str, frames: int, height: int, width: int, samples: int = 128, steps: int = 20) -> Shape:
    latent = (16, (frames - 1) // 4 + 1, height // 8, width // 8)
    f = wan_forward_tflop(frames, height, width)  # sampling with guidance (2 passes), training 19 steps x 2 x 3
    return Shape(name, samples, steps, latent, ((WAN_TEXT, 4096),), "bfloat16",
                 samples * (steps * 2 * f + int(steps * 0.99) * 2 * 3 * f))


SHAPES += (wan_shape("Wan 2.1 14B, flow_grpo's video (128 x 20 steps, 33 x 240 x 416)", 33, 240, 416),
           wan_shape("Wan 2.1 14B, Wan's default video (128 x 20 steps, 81 x 480 x 832)", 81, 480, 832))


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
    """Per rank, both ways: the default (the whole epoch gathered onto every rank) and keep_samples_on_rank (only
    the rewards, a float64 per sample, gathered; each rank holds its own 1/ranks of the epoch)."""
    parts = per_sample_bytes(s)
    whole = s.samples * sum(parts.values())
    received = whole * (ranks - 1) / ranks
    rewards_received = s.samples * 8 * (ranks - 1) / ranks
    epoch_s = s.epoch_tflop / (ranks * peak * mfu)
    row = {"shape": s.name, "dtype": s.dtype, "MiB per sample": round(sum(parts.values()) / 2 ** 20, 2),
           "GiB held per rank": round(whole / 2 ** 30, 2), f"GiB received per rank ({ranks} ranks)":
           round(received / 2 ** 30, 2),
           "kept on rank: GiB held per rank": round(whole / ranks / 2 ** 30, 2),
           "kept on rank: KiB received per rank": round(rewards_received / 2 ** 10, 2),
           f"epoch s at {mfu:.0%} MFU": round(epoch_s, 1)}
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
