"""Qwen-Image's parts and training activations (`python scripts/bench.py --qwen-image-activations`): its parts counted
on the meta device (the checkpoint's configs), and its transformer at full width (3072 = 24 heads of 128) and 512 px
(1024 packed image tokens + 128 prompt tokens, ddpo_tpu's fixed prompt length for the family), one and two
double-stream blocks, LoRA as model=qwen_image (flow_grpo's rank 64 on its 12 targets), one forward + backward per
process on eager CPU, float32: what the backward keeps (saved bytes and peak RSS), extrapolated to 60 blocks, plus the
attention softmaxes XLA keeps (derived, not measured).

Memory-model constants (ddpo_tpu/catalog/families.py): QWEN_IMAGE_BILLIONS (the parts), QWEN_IMAGE_EAGER_F32_GIB (the
"60_blocks_eager" figure of the saved-bytes accounting) and QWEN_IMAGE_ATTENTION_SCORES_GIB_512
(attention_scores_gib()). bf16 is not probed (its matmuls are ~20x slower on this CPU): the catalog takes float32's
x 0.74, SD 3.5's measured ratio.

    python scripts/bench.py --qwen-image-activations   # about 4 minutes, ~4 GiB
"""

from __future__ import annotations

import sys

from benchmarks import runner
from benchmarks.eager_memory import EAGER_ENV, measure_backward, random_weights

# Qwen/Qwen-Image transformer/config.json: diffusers QwenImageTransformer2DModel's defaults are its values
QWEN_IMAGE_TRANSFORMER = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
                              num_attention_heads=24, joint_attention_dim=3584, axes_dims_rope=(16, 56, 56))
# its text_encoder/config.json: Qwen2.5-VL-7B-Instruct (text model and vision tower)
QWEN25_VL_TEXT = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                      num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False,
                      rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]})
QWEN25_VL_VISION = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                        patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                        fullatt_block_indexes=[7, 15, 23, 31])
# flow_grpo's scripts/train_qwenimage.py LoRA (conf/model/qwen_image.yaml)
LORA_TARGETS = ["attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0", "attn.add_k_proj", "attn.add_q_proj",
                "attn.add_v_proj", "attn.to_add_out", "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj",
                "txt_mlp.net.2"]
IMAGE_TOKENS, TEXT_TOKENS = (512 // 16) ** 2, 128  # 64 x 64 latents in 2 x 2 patches; models/qwen_image.TEXT_TOKENS
PROBES = [1, 2]  # blocks: the first keeps less (its input needs no gradient), so a middle block is 2 - 1


def add_arguments(ap) -> None:
    pass


def parts():
    """Qwen-Image's transformer, Qwen2.5-VL text encoder and VAE, built on the meta device."""
    import torch
    from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    with torch.device("meta"):
        encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(text_config=QWEN25_VL_TEXT,
                                                                      vision_config=QWEN25_VL_VISION))
        return {"transformer": QwenImageTransformer2DModel(**QWEN_IMAGE_TRANSFORMER), "text_encoder": encoder,
                "vae": AutoencoderKLQwenImage()}  # the class's defaults are Qwen-Image's VAE


def billions() -> dict:
    return {name: round(sum(p.numel() for p in m.parameters()) / 1e9, 3) for name, m in parts().items()}


def qwen_image_probe(blocks: int, batch: int = 1) -> dict:
    """The child: one forward + backward of Qwen-Image's transformer at full width, `blocks` blocks deep, 512 px,
    LoRA rank 64 on flow_grpo's targets, float32, eager CPU."""
    import torch
    from diffusers import QwenImageTransformer2DModel
    from diffusers.models.transformers.transformer_qwenimage import QwenEmbedRope
    from peft import LoraConfig

    torch.manual_seed(0)
    with torch.device("meta"):
        model = QwenImageTransformer2DModel(**dict(QWEN_IMAGE_TRANSFORMER, num_layers=blocks))
    model = random_weights(model, torch.float32)
    # the RoPE tables are plain attributes (complex, not buffers): made again off the meta device
    model.pos_embed = QwenEmbedRope(theta=10000, axes_dim=list(QWEN_IMAGE_TRANSFORMER["axes_dims_rope"]),
                                    scale_rope=True)
    model.add_adapter(LoraConfig(r=64, lora_alpha=128, init_lora_weights="gaussian", target_modules=LORA_TARGETS))
    side = int(IMAGE_TOKENS ** 0.5)
    mask = torch.zeros(batch, TEXT_TOKENS, dtype=torch.long)
    mask[:, :32] = 1  # a 32-token prompt padded to the fixed length, as the family pads it
    inputs = dict(hidden_states=torch.randn(batch, IMAGE_TOKENS, 64), timestep=torch.rand(batch),
                  encoder_hidden_states=torch.randn(batch, TEXT_TOKENS, 3584), encoder_hidden_states_mask=mask,
                  img_shapes=[[(1, side, side)]] * batch)
    row = {"blocks": blocks, "batch": batch, "tokens": IMAGE_TOKENS + TEXT_TOKENS}
    return row | measure_backward(model, lambda: model(**inputs, return_dict=False)[0], "float32", warmup=False)


CHILD = qwen_image_probe


def attention_scores_gib() -> float:
    """What XLA keeps that eager CPU does not: heads x S^2 x 4 bytes for each of the 60 joint attentions."""
    c = QWEN_IMAGE_TRANSFORMER
    return c["num_layers"] * c["num_attention_heads"] * (IMAGE_TOKENS + TEXT_TOKENS) ** 2 * 4 / 2 ** 30


def estimate(rows: list[dict], field: str) -> dict:
    v = {r["blocks"]: r[field] for r in rows}
    block = v[2] - v[1]
    eager = v[1] + (QWEN_IMAGE_TRANSFORMER["num_layers"] - 1) * block
    scores = attention_scores_gib()
    return {"accounting": field, "first_block_and_embedders": round(v[1], 3), "block": round(block, 3),
            "60_blocks_eager": round(eager, 2), "+ XLA attention scores": round(scores, 2),
            "per_sample_eval_on_xla": round(eager + scores, 2)}


def run(args, report: runner.Report) -> None:
    counts = runner.progress(billions())
    env = runner.clean_env(**EAGER_ENV)
    rows = [runner.run_child(__spec__.name, env, blocks=b) for b in PROBES]
    est = [estimate(rows, "saved_gib"), estimate(rows, "peak_rss_delta_gib")]
    report.add(
        f"Qwen-Image's parts, billions of values (the checkpoint's configs on the meta device):\n\n"
        f"{runner.table([counts])}\n\n"
        f"Its transformer at full width (3072, 24 heads of 128), 512 px ({IMAGE_TOKENS} packed image tokens + "
        f"{TEXT_TOKENS} prompt tokens, 32 of them real), LoRA rank 64 on flow_grpo's 12 targets, random weights, one "
        f"or two blocks, one forward + backward per process on eager CPU in float32, batch 1 (saved, "
        f"peak_rss_delta as for SD 3.5):\n\n{runner.table(rows)}\n\n"
        f"Per sample and transformer evaluation, GiB (a middle block = 2 blocks - 1), extrapolated to 60 blocks, plus "
        f"the attention scores XLA keeps (24 heads x S^2 x 4 bytes over 60 joint attentions at S = "
        f"{IMAGE_TOKENS + TEXT_TOKENS}; derived):\n\n{runner.table(est)}")


if __name__ == "__main__":
    runner.main(sys.modules[__name__])
