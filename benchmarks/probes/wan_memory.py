"""Wan 2.1's memory model (`python scripts/bench.py --wan-memory`): the fit of what a block saves for the backward,
its check on the tiny build, and the full-size figures the HBM rule computes.

Memory-model constants (ddpo_tpu/catalog/wan_memory.py): SAVED_PER_TOKEN, SAVED_PER_TEXT_TOKEN and
SAVED_PER_BLOCK_DIM (the fit below, integers). Its parameter counts come from the config
(tests/unit/config/test_wan_memory.py).

1. The fit: the bytes autograd saves for the backward (saved_tensors_hooks over one forward, weights excluded) in one
   block of WanTransformer3DModel (3 blocks less 2, so the embedders and the first block's frozen input cancel) at toy
   widths, LoRA r4 on the attention projections, float32, eager CPU, fitted by least squares to
   S (a dim + b ffn + c heads + d) + L (e dim + f) + g dim: S video tokens, L text tokens (the fit is exact, in
   integers: 14, 1, 2, 33; 3, 9; 8).
2. The shape on the tiny build itself (model=tiny_wan's transformer, 2 blocks, loaded as built): the whole model's
   saved bytes and its peak resident memory over one forward + backward (VmHWM reset before, minus VmRSS before; a
   process of its own per row, MALLOC_MMAP_THRESHOLD_ low so freed tensors leave the RSS) at growing videos, against
   the formula (linear in S; the embedders and the text embedder add a constant the formula leaves out).
3. The full-size figures the HBM rule computes for Wan 2.1 T2V 1.3B and 14B at flow_grpo's 33 x 240 x 416 video.

    python scripts/bench.py --wan-memory   # about 6 minutes on 2 cores at load 7.5
"""

from __future__ import annotations

import sys

from benchmarks import runner
from benchmarks.eager_memory import EAGER_ENV, measure_backward

# (heads, head_dim, ffn, latent (f, h, w), text tokens): the fit's grid
GRID = [(2, 16, 64, (4, 16, 16), 16), (2, 16, 64, (4, 8, 8), 16), (2, 16, 64, (4, 16, 16), 512),
        (4, 16, 64, (4, 16, 16), 16), (2, 32, 64, (4, 16, 16), 16), (2, 16, 256, (4, 16, 16), 16),
        (4, 32, 128, (4, 16, 16), 16), (8, 16, 128, (4, 16, 16), 16), (4, 32, 256, (2, 16, 16), 128),
        (2, 64, 64, (4, 8, 8), 64), (4, 16, 64, (4, 16, 16), 512), (8, 16, 64, (2, 8, 8), 256)]
TERMS = ("S*dim", "S*ffn", "S*heads", "S", "L*dim", "L", "dim")
# the tiny build's videos: latent (frames, h, w) = 5 frames of 32 px (the smoke's), then longer and larger
TINY_VIDEOS = [(2, 4, 4), (5, 16, 16), (9, 32, 32), (17, 32, 32)]


def add_arguments(ap) -> None:
    pass


def _transformer(heads: int, head_dim: int, ffn: int, layers: int):
    import torch
    from diffusers import WanTransformer3DModel
    from peft import LoraConfig

    from ddpo_tpu.models import wan

    torch.manual_seed(0)
    config = dict(wan._build_transformer().config, num_attention_heads=heads, attention_head_dim=head_dim,
                  ffn_dim=ffn, num_layers=layers)
    model = WanTransformer3DModel.from_config(config).requires_grad_(False)
    model.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=["to_k", "to_out.0", "to_q", "to_v"]))
    return model


def saved_bytes(model, latent, text_tokens: int) -> int:
    """Bytes of the distinct storages autograd saves for one forward's backward, weights and buffers excluded."""
    import torch

    weights = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    saved: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in weights:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(**_inputs(model, latent, text_tokens), return_dict=False)[0]
    out.square().mean().backward()
    return sum(saved.values())


def _inputs(model, latent, text_tokens: int) -> dict:
    import torch

    return dict(hidden_states=torch.randn(1, 16, *latent), timestep=torch.tensor([500.0]),
                encoder_hidden_states=torch.randn(1, text_tokens, model.config.text_dim))


def block_row(heads: int, head_dim: int, ffn: int, latent, text: int) -> dict:
    per_block = (saved_bytes(_transformer(heads, head_dim, ffn, 3), latent, text)
                 - saved_bytes(_transformer(heads, head_dim, ffn, 2), latent, text))
    f, h, w = latent
    return {"dim": heads * head_dim, "ffn": ffn, "heads": heads, "S": f * h * w // 4, "L": text,
            "values_per_block": per_block // 4}


def fit(rows: list[dict]) -> dict:
    import numpy as np

    A = np.array([[r["S"] * r["dim"], r["S"] * r["ffn"], r["S"] * r["heads"], r["S"], r["L"] * r["dim"], r["L"],
                   r["dim"]] for r in rows], dtype=float)
    y = np.array([r["values_per_block"] for r in rows], dtype=float)
    coef, *_ = np.linalg.lstsq(A, y, rcond=None)
    worst = float(np.max(np.abs(A @ coef - y) / y))
    return {**{t: round(float(c), 3) for t, c in zip(TERMS, coef)}, "worst_residual": f"{worst:.2%}"}


def tiny_child(latent: list[int]) -> dict:
    """The child: the tiny build's transformer (2 blocks): saved bytes, then peak RSS over one forward + backward."""
    from ddpo_tpu.catalog import wan_memory as wm

    model = _transformer(2, 16, 64, 2)
    saved = saved_bytes(model, tuple(latent), wm.TEXT_TOKENS)
    inputs = _inputs(model, tuple(latent), wm.TEXT_TOKENS)
    rss = measure_backward(model, lambda: model(**inputs, return_dict=False)[0], "float32", warmup=True)
    S = latent[0] * latent[1] * latent[2] // 4
    formula = 2 * wm.saved_values_per_block(dict(model.config), S) * 4
    return {"latent": "x".join(map(str, latent)), "S": S, "saved_mib": round(saved / 2 ** 20, 3),
            "formula_mib": round(formula / 2 ** 20, 3),
            "peak_rss_delta_mib": round(rss["peak_rss_delta_gib"] * 1024, 1)}


CHILD = tiny_child


def full_size() -> list[dict]:
    from types import SimpleNamespace

    from ddpo_tpu.catalog import wan_memory as wm

    rows = []
    for hub_id, c in wm.WAN21_T2V.items():
        model = SimpleNamespace(pretrained=hub_id, resolution=None, num_frames=33,
                                lora=SimpleNamespace(enabled=True, rank=32,
                                                     target_modules=["to_k", "to_out.0", "to_q", "to_v"]))
        rows.append({"model": hub_id.split("/")[1], "transformer_B": round(wm.transformer_parameters(c) / 1e9, 3),
                     "tokens": wm.tokens(model),
                     "eval_f32_gib": round(wm.activation_gib(model, "no", False), 1),
                     "eval_bf16_gib": round(wm.activation_gib(model, "bf16", False), 1),
                     "eval_bf16_ckpt_gib": round(wm.activation_gib(model, "bf16", True), 1),
                     "of_which_softmaxes_gib": round(wm.attention_scores_gib(c, wm.tokens(model)), 1),
                     **{f"resident_fsdp{k}_gib": round(wm.resident_gib(model, k, "bfloat16"), 1) for k in (1, 4, 8)}})
    return rows


def run(args, report: runner.Report) -> None:
    rows = [runner.progress(block_row(h, d, f, latent, L)) for h, d, f, latent, L in GRID]
    coef = fit(rows)
    env = runner.clean_env(**EAGER_ENV)
    tiny = [runner.run_child(__spec__.name, env, latent=list(v)) for v in TINY_VIDEOS]
    report.add(
        f"Wan 2.1's memory model. (1) Values autograd saves for one WanTransformer3DModel block (3 blocks less 2), "
        f"toy widths, LoRA r4 on to_q/to_k/to_v/to_out.0, float32, eager CPU (saved_tensors_hooks; weights "
        f"excluded):\n\n{runner.table(rows)}\n\nLeast squares, values per block = sum of coefficient x term:\n\n"
        f"{runner.table([coef])}\n\n(2) The tiny build's transformer (2 blocks, model=tiny_wan's widths), one forward "
        f"+ backward per process: saved bytes, the formula's 2 blocks, and the peak resident memory above the start "
        f"(VmHWM; MALLOC_MMAP_THRESHOLD_=65536):\n\n{runner.table(tiny)}\n\n(3) The HBM rule's figures at "
        f"flow_grpo's 33 x 240 x 416 video, LoRA r32 (computed, not measured):\n\n{runner.table(full_size())}")


if __name__ == "__main__":
    runner.main(sys.modules[__name__])
