"""SD 1.4's training activations on eager CPU, with and without activation checkpointing (part of `python
scripts/bench.py --checkpointing`): one forward + backward of SD 1.4's UNet at full width (model=sd14_random's
build: 860M parameters, random weights), 512 px (64x64 latents), LoRA as model=sd14 (rank 4 on the attention
projections), float32, per process; batch 1 and 2, so batch 2 - batch 1 is one sample's share.

Memory-model constants (ddpo_tpu/catalog/families.py): SD1_ATTENTION_SCORES_GIB_512 (2.7, derived, not measured:
attention_scores_gib(), the softmaxes XLA keeps for the backward over the UNet's self-attentions);
SD1_CKPT_EAGER_RATIO (0.28 = 0.43 / 1.53 GiB per sample, peak RSS, checkpointed / not). SD1_EAGER_GIB (2.3
float32; 1.2 bf16, assumed half) is an earlier measurement of the same build (peak RSS at batch 1 and 2: +1.9 and
+4.5 GiB, docs/performance.md) that no probe here repeats as such; this probe's checkpointed=False rows are the
nearest (1.53 per sample, with a warm-up call and the peak reset before the step).

    python scripts/bench.py --sd14-activations     # 4 full-width processes, one at a time
    python scripts/bench.py --checkpointing        # with the SD 3.5 and XLA probes, about 30 minutes, ~14 GiB
"""

from __future__ import annotations

import sys

from benchmarks import runner
from benchmarks.eager_memory import EAGER_ENV, measure_backward, random_weights


def add_arguments(ap) -> None:
    runner.add_shared(ap, "--batches", type=int, nargs="+", default=[1, 2], help="the batch sizes probed")


def sd14_probe(batch: int, checkpointed: bool) -> dict:
    """The child: one forward + backward at `batch`; `checkpointed`: diffusers' gradient checkpointing on
    (train.activation_checkpointing)."""
    import torch
    from peft import LoraConfig

    from ddpo_tpu.models.tiny import SPECS, _build_unet

    torch.manual_seed(0)
    with torch.device("meta"):
        unet = _build_unet(SPECS["sd14_random"])
    unet = random_weights(unet, torch.float32)
    unet.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian",
                                target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    if checkpointed:
        unet.enable_gradient_checkpointing()
    x = torch.randn(batch, 4, 64, 64)
    t = torch.full((batch,), 500)
    text = torch.randn(batch, 77, 768)
    row = {"model": "sd14_random UNet", "batch": batch, "checkpointed": checkpointed}
    return row | measure_backward(unet, lambda: unet(x, t, text).sample, "float32", warmup=True)


CHILD = sd14_probe


def attention_scores_gib() -> float:
    """What XLA keeps that eager CPU does not, per sample and evaluation at 512 px: XLA lowers attention to matmul +
    softmax and keeps each softmax for the backward, heads x S^2 x 4 bytes (float32 under autocast too), over every
    self-attention of SD 1.4's UNet; heads and token counts read off a forward on the meta device (16 of them: 5 each
    at 4096, 1024 and 256 tokens, 1 at 64)."""
    import torch

    from ddpo_tpu.models.tiny import SPECS, _build_unet

    with torch.device("meta"):
        unet = _build_unet(SPECS["sd14_random"])
    seen = []
    record = lambda mod, args, kwargs: seen.append((mod.heads, (args or [kwargs["hidden_states"]])[0].shape[1]))
    for name, module in unet.named_modules():
        if name.endswith("attn1"):
            module.register_forward_pre_hook(record, with_kwargs=True)
    with torch.no_grad():
        unet(torch.randn(1, 4, 64, 64, device="meta"), torch.full((1,), 500, device="meta"),
             torch.randn(1, 77, 768, device="meta"))
    return sum(heads * tokens ** 2 * 4 for heads, tokens in seen) / 2 ** 30


def probe_rows(batches: list[int]) -> list[dict]:
    """Without then with checkpointing, each batch in a process of its own."""
    env = runner.clean_env(**EAGER_ENV)
    return [runner.run_child(__spec__.name, env, batch=b, checkpointed=c) for c in (False, True) for b in batches]


def per_sample(rows: list[dict]) -> list[dict]:
    """Batch 2 - batch 1, with and without checkpointing."""
    out = []
    for c in (False, True):
        v = {r["batch"]: r for r in rows if r["checkpointed"] == c}
        if {1, 2} <= set(v):
            out.append({"model": "SD 1.4 UNet", "checkpointed": c,
                        **{f: round(v[2][f] - v[1][f], 3) for f in ("saved_gib", "peak_rss_delta_gib")}})
    return out


def run(args, report: runner.Report) -> None:
    rows = probe_rows(args.batches)
    report.add(f"SD 1.4's UNet at full width, 512 px, eager CPU, float32, LoRA, one forward + backward per process "
               f"(measure_backward: saved bytes, blind inside checkpointed blocks; peak RSS over the step minus the "
               f"RSS before it):\n\n{runner.table(rows)}\n\nPer sample (batch 2 - batch 1), GiB:\n\n"
               f"{runner.table(per_sample(rows))}\n\nPlus the attention scores XLA keeps (8 heads x S^2 x 4 bytes over "
               f"the 16 self-attentions; derived, not measured): {attention_scores_gib():.2f} GiB per sample and "
               f"evaluation.")


if __name__ == "__main__":
    runner.main(sys.modules[__name__])
