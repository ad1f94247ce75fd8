"""FLUX.1-dev's parts and training activations (`python scripts/bench.py --flux-activations`): its parts counted on
the meta device (the checkpoint's configs), and its transformer at full width (3072 = 24 heads of 128) and 512 px
(1024 packed image tokens + 128 T5 tokens), one or two double-stream and single-stream blocks, LoRA as
model=flux1_dev, one forward + backward per process on eager CPU, float32: what the backward keeps (saved bytes and
peak RSS), extrapolated to 19 + 38 blocks, plus the attention softmaxes XLA keeps (derived, not measured).

Memory-model constants (ddpo_tpu/catalog/families.py): FLUX1_DEV_BILLIONS (the parts), FLUX_EAGER_F32_GIB (the
"57_blocks_eager" figure of the saved-bytes accounting: 0.40 + 18 x 0.240 + 37 x 0.159 = 10.61) and
FLUX_ATTENTION_SCORES_GIB_512 (6.76, attention_scores_gib()). bf16 is not probed (its matmuls are ~20x slower on this
CPU): the catalog takes float32's x 0.74, SD 3.5's ratio.

    python scripts/bench.py --flux-activations   # about 5 minutes, ~4 GiB
"""

from __future__ import annotations

import sys

from benchmarks import runner
from benchmarks.eager_memory import EAGER_ENV, measure_backward, random_weights

# black-forest-labs/FLUX.1-dev transformer/config.json (diffusers FluxTransformer2DModel)
FLUX1_DEV_TRANSFORMER = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                             num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768,
                             guidance_embeds=True, axes_dims_rope=(16, 56, 56))
# its text_encoder/ (CLIP-L), text_encoder_2/ (T5 v1.1 XXL's encoder) and vae/ config.json values that fix the counts
CLIP_L = dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
              max_position_embeddings=77, hidden_act="quick_gelu", projection_dim=768)
T5_XXL = dict(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
              feed_forward_proj="gated-gelu")
VAE = dict(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(128, 256, 512, 512),
           down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4, layers_per_block=2,
           use_quant_conv=False, use_post_quant_conv=False)
# flow_grpo's scripts/train_flux.py LoRA (conf/model/flux1_dev.yaml)
LORA_TARGETS = ["attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0", "attn.add_k_proj", "attn.add_q_proj",
                "attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj",
                "ff_context.net.2"]
IMAGE_TOKENS, TEXT_TOKENS = (512 // 16) ** 2, 128  # 64 x 64 latents in 2 x 2 patches; flow_grpo's max_sequence_length
# (double, single) blocks: the first block of each kind keeps less (its input needs no gradient), so a middle block is
# (2, 1) - (1, 1) or (1, 2) - (1, 1)
PROBES = [(1, 1), (2, 1), (1, 2)]


def add_arguments(ap) -> None:
    pass


def parts():
    """FLUX.1-dev's transformer, CLIP-L, T5-XXL encoder and VAE, built on the meta device."""
    import torch
    from diffusers import AutoencoderKL, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    with torch.device("meta"):
        return {"transformer": FluxTransformer2DModel(**FLUX1_DEV_TRANSFORMER),
                "clip": CLIPTextModel(CLIPTextConfig(**CLIP_L)), "t5": T5EncoderModel(T5Config(**T5_XXL)),
                "vae": AutoencoderKL(**VAE)}


def billions() -> dict:
    return {name: round(sum(p.numel() for p in m.parameters()) / 1e9, 3) for name, m in parts().items()}


def flux_probe(double: int, single: int, batch: int = 1) -> dict:
    """The child: one forward + backward of FLUX.1-dev's transformer at full width, `double` + `single` blocks deep,
    512 px, LoRA rank 64 on flow_grpo's targets, float32, eager CPU."""
    import torch
    from diffusers import FluxTransformer2DModel
    from peft import LoraConfig

    torch.manual_seed(0)
    with torch.device("meta"):
        model = FluxTransformer2DModel(**dict(FLUX1_DEV_TRANSFORMER, num_layers=double, num_single_layers=single))
    model = random_weights(model, torch.float32)
    model.add_adapter(LoraConfig(r=64, lora_alpha=128, init_lora_weights="gaussian", target_modules=LORA_TARGETS))
    side = int(IMAGE_TOKENS ** 0.5)
    img_ids = torch.zeros(side, side, 3)
    img_ids[..., 1] += torch.arange(side)[:, None]
    img_ids[..., 2] += torch.arange(side)[None, :]
    inputs = dict(hidden_states=torch.randn(batch, IMAGE_TOKENS, 64), timestep=torch.rand(batch),
                  guidance=torch.full((batch,), 3.5), encoder_hidden_states=torch.randn(batch, TEXT_TOKENS, 4096),
                  pooled_projections=torch.randn(batch, 768), img_ids=img_ids.reshape(-1, 3),
                  txt_ids=torch.zeros(TEXT_TOKENS, 3))
    row = {"double": double, "single": single, "batch": batch, "tokens": IMAGE_TOKENS + TEXT_TOKENS}
    return row | measure_backward(model, lambda: model(**inputs, return_dict=False)[0], "float32", warmup=False)


CHILD = flux_probe


def attention_scores_gib() -> float:
    """What XLA keeps that eager CPU does not: heads x S^2 x 4 bytes for each of the 19 + 38 joint attentions."""
    c = FLUX1_DEV_TRANSFORMER
    blocks = c["num_layers"] + c["num_single_layers"]
    return blocks * c["num_attention_heads"] * (IMAGE_TOKENS + TEXT_TOKENS) ** 2 * 4 / 2 ** 30


def estimate(rows: list[dict], field: str) -> dict:
    v = {(r["double"], r["single"]): r[field] for r in rows}
    double, single = v[2, 1] - v[1, 1], v[1, 2] - v[1, 1]
    c = FLUX1_DEV_TRANSFORMER
    eager = v[1, 1] + (c["num_layers"] - 1) * double + (c["num_single_layers"] - 1) * single
    scores = attention_scores_gib()
    return {"accounting": field, "first_blocks_and_embedders": round(v[1, 1], 3), "double_block": round(double, 3),
            "single_block": round(single, 3), "57_blocks_eager": round(eager, 2),
            "+ XLA attention scores": round(scores, 2), "per_sample_eval_on_xla": round(eager + scores, 2)}


def run(args, report: runner.Report) -> None:
    counts = runner.progress(billions())
    env = runner.clean_env(**EAGER_ENV)
    rows = [runner.run_child(__spec__.name, env, double=d, single=s) for d, s in PROBES]
    est = [estimate(rows, "saved_gib"), estimate(rows, "peak_rss_delta_gib")]
    report.add(
        f"FLUX.1-dev's parts, billions of values (the checkpoint's configs on the meta device):\n\n"
        f"{runner.table([counts])}\n\n"
        f"Its transformer at full width (3072, 24 heads of 128), 512 px ({IMAGE_TOKENS} packed image tokens + "
        f"{TEXT_TOKENS} T5 tokens), LoRA rank 64 on flow_grpo's 12 targets, random weights, one or two double- and "
        f"single-stream blocks, one forward + backward per process on eager CPU in float32, batch 1 (saved, "
        f"peak_rss_delta as for SD 3.5):\n\n{runner.table(rows)}\n\n"
        f"Per sample and transformer evaluation, GiB (a middle block = 2 blocks of its kind - 1), extrapolated to 19 "
        f"double + 38 single blocks, plus the attention scores XLA keeps (24 heads x S^2 x 4 bytes over 57 joint "
        f"attentions at S = {IMAGE_TOKENS + TEXT_TOKENS}; derived):\n\n{runner.table(est)}")


if __name__ == "__main__":
    runner.main(sys.modules[__name__])
