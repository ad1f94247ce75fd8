"""SD 3.5 Medium's parts in billions of values (`python scripts/bench.py --sd3-parameters`): the diffusers and
transformers classes built with the checkpoint's configs on the meta device (no memory, no download, seconds): the
transformer's weights, its positional table (a buffer, whole on every chip), CLIP-L and CLIP-G, T5-XXL's encoder and
the VAE.

Memory-model constants (ddpo_tpu/catalog/families.py): SD35_MEDIUM_BILLIONS (every entry; pos_embed 0.2265, which
the catalog rounds to 0.227), which the SD 3 family's resident_gib turns into the GiB a chip holds besides the
activations.

    python scripts/bench.py --sd3-parameters
    python -m benchmarks.probes.sd3_parameters --no-append
"""

from __future__ import annotations

import sys

from benchmarks import runner
from benchmarks.probes.sd3_activations import SD35_MEDIUM_TRANSFORMER

# stabilityai/stable-diffusion-3.5-medium's text_encoder (CLIP-L), text_encoder_2 (CLIP-G), text_encoder_3 (T5 v1.1
# XXL's encoder) and vae config.json values that fix the parameter counts
CLIP_L = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
              projection_dim=768, vocab_size=49408, max_position_embeddings=77)
CLIP_G = dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=20,
              projection_dim=1280, vocab_size=49408, max_position_embeddings=77)
T5_XXL = dict(d_model=4096, d_ff=10240, d_kv=64, num_heads=64, num_layers=24, vocab_size=32128,
              feed_forward_proj="gated-gelu")
VAE = dict(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(128, 256, 512, 512),
           layers_per_block=2, down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
           use_quant_conv=False, use_post_quant_conv=False)


def add_arguments(ap) -> None:
    pass


def billions() -> dict:
    """Each part's values in billions, counted on the meta device."""
    import torch
    from diffusers import AutoencoderKL, SD3Transformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    count = lambda tensors: round(sum(t.numel() for t in tensors) / 1e9, 3)
    with torch.device("meta"):
        transformer = SD3Transformer2DModel(**SD35_MEDIUM_TRANSFORMER)
        clips = [CLIPTextModelWithProjection(CLIPTextConfig(**c)) for c in (CLIP_L, CLIP_G)]
        t5 = T5EncoderModel(T5Config(**T5_XXL))
        vae = AutoencoderKL(**VAE)
    return {"transformer": count(transformer.parameters()), "pos_embed": count(transformer.buffers()),
            "clip_l": count(clips[0].parameters()), "clip_g": count(clips[1].parameters()),
            "t5": count(t5.parameters()), "vae": count(vae.parameters())}


def run(args, report: runner.Report) -> None:
    row = runner.progress(billions())
    report.add("SD 3.5 Medium's parts, billions of values (the checkpoint's configs built on the meta device; "
               f"pos_embed: the transformer's positional table, a buffer):\n\n{runner.table([row])}")


if __name__ == "__main__":
    runner.main(sys.modules[__name__])
