"""SD 3.5 Medium's training activations (`python scripts/bench.py --sd3-activations`): its transformer at full width
and 512 px, 2 and 3 layers deep with and without dual attention, one forward + backward per process on eager CPU:
what the backward keeps per sample and layer (saved bytes and peak RSS), extrapolated to 24 layers, plus the
attention softmaxes XLA keeps (derived, not measured).

Memory-model constants (ddpo_tpu/catalog/families.py): SD3_EAGER_GIB["no"] (2.9: the float32 "24_layers_eager" figure;
its "bf16" 2.1 is float32's x 0.74 from an earlier 1-layer pass, RESULTS.md 2026-11-23 14:16) and
SD3_ATTENTION_SCORES_GIB_512 (4.37: the "+ XLA attention scores" column, arithmetic in attention_scores_gib()).
With checkpointed=True (benchmarks/probes/checkpointing.py) the same probe gives SD3_CKPT_EAGER_RATIO.

    python scripts/bench.py --sd3-activations --precisions float32   # about 15 minutes, ~3 GiB (bf16: slow here)
"""

from __future__ import annotations

import sys

from benchmarks import runner
from benchmarks.eager_memory import EAGER_ENV, measure_backward, random_weights

# SD 3.5 Medium's transformer (stabilityai/stable-diffusion-3.5-medium transformer/config.json, diffusers
# SD3Transformer2DModel): 24 layers of 24 heads x 64, dual attention (MMDiT-X) in layers 0-12, RMS qk-norm
SD35_MEDIUM_TRANSFORMER = dict(sample_size=128, patch_size=2, in_channels=16, num_layers=24, attention_head_dim=64,
                               num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536,
                               pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=384,
                               dual_attention_layers=tuple(range(13)), qk_norm="rms_norm")
SD3_TEXT_TOKENS = 77 + 128  # CLIP's 77 + T5's 128 (flow_grpo's max_sequence_length; families/sd3.T5_TOKENS)
SD3_LATENT = 64  # 512 px / 8
# (layers, dual-attention layers). The first layer keeps less than the others (its input needs no gradient: a frozen
# part, e.g. layer 0's dual attention, keeps nothing) and the last is context_pre_only (its text stream ends in the
# attention), so the ordinary layer measured is a middle one: 3 layers - 2 layers, joint or dual
SD3_PROBES = [(2, ()), (3, ()), (3, (1,))]
# bf16 matmuls are ~20x slower than float32 on this CPU (no bf16 units): bf16 at batch 1 only, without a warm-up
# call (float32 shows the cost linear in the batch: its batch-0 intercept is under 2% of a sample)
SD3_BATCHES = {"float32": (1, 2), "bf16": (1,)}


def add_arguments(ap) -> None:
    runner.add_shared(ap, "--precisions", nargs="+", default=["float32", "bf16"], choices=["float32", "bf16"],
                      help="--sd3-activations: the precisions probed")


def sd3_probe(layers: int, dual: list[int], batch: int, precision: str, checkpointed: bool = False) -> dict:
    """The child: one forward + backward of SD 3.5 Medium's transformer at full width, `layers` deep (`dual` with
    dual attention), 512 px, LoRA as model=sd35_medium, eager CPU, as a training micro-step runs it (frozen weights in
    bfloat16 under bf16 autocast, float32 otherwise; LoRA weights float32); `checkpointed`: diffusers' gradient
    checkpointing on (train.activation_checkpointing)."""
    import torch
    from diffusers import SD3Transformer2DModel
    from peft import LoraConfig

    torch.manual_seed(0)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    cfg = dict(SD35_MEDIUM_TRANSFORMER, num_layers=layers, dual_attention_layers=tuple(dual))
    with torch.device("meta"):
        model = SD3Transformer2DModel(**cfg)
    model = random_weights(model, dtype)
    target = ["attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out", "attn.to_k",
              "attn.to_out.0", "attn.to_q", "attn.to_v"]
    model.add_adapter(LoraConfig(r=32, lora_alpha=64, init_lora_weights="gaussian", target_modules=target))
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    if checkpointed:
        model.enable_gradient_checkpointing()
    x = torch.randn(batch, 16, SD3_LATENT, SD3_LATENT, dtype=dtype)
    t = torch.rand(batch).to(dtype) * 1000
    text = torch.randn(batch, SD3_TEXT_TOKENS, 4096, dtype=dtype)
    pooled = torch.randn(batch, 2048, dtype=dtype)
    tokens = (SD3_LATENT // 2) ** 2 + SD3_TEXT_TOKENS
    forward = lambda: model(hidden_states=x, timestep=t, encoder_hidden_states=text, pooled_projections=pooled,
                            return_dict=False)[0]
    row = {"precision": precision, "layers": layers, "dual_layers": "+".join(map(str, dual)) or "-",
           "batch": batch, "checkpointed": checkpointed, "warm_up": precision == "float32", "tokens": tokens}
    return row | measure_backward(model, forward, precision, warmup=row["warm_up"])  # SD3_BATCHES


CHILD = sd3_probe


def probe_rows(precision: str, checkpointed: bool = False) -> list[dict]:
    """Every (layers, dual, batch) probe of one precision, one process each (each its own peak)."""
    env = runner.clean_env(**EAGER_ENV)
    return [runner.run_child(__spec__.name, env, layers=layers, dual=list(dual), batch=batch, precision=precision,
                             checkpointed=checkpointed)
            for layers, dual in SD3_PROBES for batch in SD3_BATCHES[precision]]


def attention_scores_gib() -> float:
    """What XLA keeps that eager CPU does not, per sample and evaluation: XLA lowers attention to matmul + softmax and
    keeps each softmax for the backward, heads x S^2 x 4 bytes (float32 under autocast too): the joint attention of
    all 24 layers over image + text tokens, and the second (image-only) attention of dual-attention layers 1-12
    (layer 0's has no LoRA and a frozen input: nothing of it needs a gradient, so nothing is kept)."""
    c = SD35_MEDIUM_TRANSFORMER
    image = (SD3_LATENT // c["patch_size"]) ** 2
    joint = c["num_layers"] * c["num_attention_heads"] * (image + SD3_TEXT_TOKENS) ** 2 * 4
    dual = (len(c["dual_attention_layers"]) - 1) * c["num_attention_heads"] * image ** 2 * 4
    return (joint + dual) / 2 ** 30


def estimate(rows: list[dict], field: str) -> list[dict]:
    """Per precision: per-sample costs of the first and last layers with the embeddings (2 layers), of a middle joint
    layer and of a middle dual-attention layer (3 layers - 2 layers); per sample = batch 2 - batch 1 where both were
    run, else batch 1. 24 layers: the first (layer 0, dual, whose second attention keeps nothing, as measured: a
    first-layer dual attention adds 0), the last, 10 joint and 12 dual middle layers; plus the scores XLA keeps."""
    out = []
    scores = attention_scores_gib()
    n_dual = len(SD35_MEDIUM_TRANSFORMER["dual_attention_layers"]) - 1
    n_joint = SD35_MEDIUM_TRANSFORMER["num_layers"] - 2 - n_dual
    for precision in dict.fromkeys(r["precision"] for r in rows):
        v = {(r["layers"], r["dual_layers"], r["batch"]): r[field] for r in rows if r["precision"] == precision}

        def per_sample(layers, dual):
            return v[layers, dual, 2] - v[layers, dual, 1] if (layers, dual, 2) in v else v[layers, dual, 1]

        ends = per_sample(2, "-")
        joint = per_sample(3, "-") - ends
        dual = per_sample(3, "1") - ends
        eager = ends + n_joint * joint + n_dual * dual
        out.append({"precision": precision, "accounting": field, "first_last_and_embeddings": round(ends, 3),
                    "joint_layer": round(joint, 3), "dual_attention_layer": round(dual, 3),
                    f"24_layers_eager (2 + {n_joint} x joint + {n_dual} x dual)": round(eager, 2),
                    "+ XLA attention scores": round(scores, 2), "per_sample_eval_on_xla": round(eager + scores, 2)})
    return out


def eager_24_layers(est: dict) -> float:
    """An estimate() row's 24-layer eager figure."""
    return next(v for k, v in est.items() if k.startswith("24_layers"))


def run(args, report: runner.Report) -> None:
    rows = [row for precision in args.precisions for row in probe_rows(precision)]
    est = estimate(rows, "peak_rss_delta_gib") + estimate(rows, "saved_gib")
    report.add(
        f"SD 3.5 Medium's transformer at full width (1536, 24 heads of 64, RMS qk-norm), 512 px (1024 image tokens + "
        f"{SD3_TEXT_TOKENS} text tokens), LoRA rank 32 on the attention as model=sd35_medium, random weights, 2 or 3 "
        f"layers deep (dual_layers: which have dual attention), one forward + backward on eager CPU (frozen weights "
        f"bfloat16 under bf16 autocast, float32 otherwise; bf16 at batch 1 without a warm-up call: its matmuls are "
        f"~20x slower here), one process per row. saved = bytes of the distinct storages autograd keeps for the "
        f"backward (saved_tensors_hooks; weights excluded); peak_rss_delta = the process's peak resident memory over "
        f"the step (VmHWM, reset before it) minus the resident memory before it (MALLOC_MMAP_THRESHOLD_=65536, so "
        f"freed tensors leave the RSS); score_matrices_saved = saved tensors of S x S shape (0: eager CPU's fused "
        f"attention keeps none):\n\n{runner.table(rows)}\n\n"
        f"Per sample and transformer evaluation, GiB (batch 2 - batch 1 where run, else batch 1; a middle layer = 3 "
        f"layers - 2 layers), extrapolated to SD 3.5 Medium's 24 layers, plus the attention scores XLA keeps (24 heads "
        f"x S^2 x 4 bytes: 24 joint attentions at S = {1024 + SD3_TEXT_TOKENS}, the image-only attentions of dual "
        f"layers 1-12 at S = 1024; derived, not measured):\n\n{runner.table(est)}")


if __name__ == "__main__":
    runner.main(sys.modules[__name__])
