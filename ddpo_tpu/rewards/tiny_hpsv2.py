"""A tiny random-weight stand-in for HPSv2: an open_clip-layout checkpoint, its open_clip model config and a
tokenizer, for tests and CPU smoke runs. ``HPSv2Reward`` loads it through the same converter and
``CLIPModel.from_pretrained`` code as ``HPS_v2.1_compressed.pt``::

    OUT_DIR/HPS_tiny_compressed.pt   {"state_dict": open_clip CLIP names (visual.*, transformer.*, token_embedding...)}
    OUT_DIR/open_clip_config.json    the open_clip model config (as model_configs/ViT-H-14.json, tiny sizes)
    OUT_DIR/tokenizer/               CLIPTokenizer (the tiny SD byte-level one; EOT is the largest id, as in CLIP's)

Architecture (``TINY_HPSV2_VERSION`` names it; bump it whenever anything here changes): image 32 px, patch 8, width
32, 2 blocks, head width 8 (4 heads); text width 32, 4 heads, 2 blocks, 77 positions; embed 16; exact GELU (ViT-H-14
has no quick_gelu). Weights are drawn per tensor with spread-out values (LayerNorm gains around 1, non-zero biases)
so a swapped or transposed tensor in a conversion changes the scores, and stored in float16 like a compressed
checkpoint, so loading exercises the float32 upcast.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["TINY_HPSV2_VERSION", "tiny_open_clip_config", "tiny_open_clip_state_dict", "build_tiny_hpsv2",
           "ensure_tiny_hpsv2"]

TINY_HPSV2_VERSION = "v1"
CHECKPOINT_NAME = "HPS_tiny_compressed.pt"
CONFIG_NAME = "open_clip_config.json"
TOKENIZER_SUBDIR = "tokenizer"
_REQUIRED_FILES = (CHECKPOINT_NAME, CONFIG_NAME, f"{TOKENIZER_SUBDIR}/tokenizer_config.json")


def tiny_open_clip_config() -> dict[str, Any]:
    from ddpo_tpu.models.tiny import tiny_vocab

    return {
        "embed_dim": 16,
        "vision_cfg": {"image_size": 32, "layers": 2, "width": 32, "head_width": 8, "patch_size": 8},
        "text_cfg": {"context_length": 77, "vocab_size": len(tiny_vocab()), "width": 32, "heads": 4, "layers": 2},
    }



def tiny_open_clip_state_dict(oc_config: dict[str, Any], seed: int = 0, meta: bool = False) -> dict[str, Any]:
    """Random tensors under open_clip's CLIP names and shapes (tgxs002/HPSv2@866735e hpsv2/src/open_clip model.py
    ``CLIP.__init__``, transformer.py ``VisionTransformer`` / ``ResidualAttentionBlock``), float32, seeded.
    ``meta``: shapes only, on the meta device (the released sizes, for checking a conversion without 4 GB)."""
    import math

    import torch

    v, t, embed = oc_config["vision_cfg"], oc_config["text_cfg"], oc_config["embed_dim"]
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, std=0.1, mean=0.0):
        return torch.empty(shape, device="meta") if meta else torch.randn(*shape, generator=g) * std + mean

    def blocks(prefix: str, width: int, layers: int) -> dict[str, Any]:
        out = {}
        for i in range(layers):
            p = f"{prefix}transformer.resblocks.{i}."
            out.update({
                p + "ln_1.weight": rnd(width, mean=1.0), p + "ln_1.bias": rnd(width),
                p + "attn.in_proj_weight": rnd(3 * width, width, std=width ** -0.5),
                p + "attn.in_proj_bias": rnd(3 * width),
                p + "attn.out_proj.weight": rnd(width, width, std=width ** -0.5), p + "attn.out_proj.bias": rnd(width),
                p + "ln_2.weight": rnd(width, mean=1.0), p + "ln_2.bias": rnd(width),
                p + "mlp.c_fc.weight": rnd(4 * width, width, std=width ** -0.5), p + "mlp.c_fc.bias": rnd(4 * width),
                p + "mlp.c_proj.weight": rnd(width, 4 * width, std=(4 * width) ** -0.5),
                p + "mlp.c_proj.bias": rnd(width),
            })
        return out

    vw, patch, grid = v["width"], v["patch_size"], v["image_size"] // v["patch_size"]
    tw = t["width"]
    sd = {
        "visual.class_embedding": rnd(vw, std=vw ** -0.5),
        "visual.positional_embedding": rnd(grid * grid + 1, vw, std=vw ** -0.5),
        "visual.proj": rnd(vw, embed, std=vw ** -0.5),
        "visual.conv1.weight": rnd(vw, 3, patch, patch, std=(3 * patch * patch) ** -0.5),
        "visual.ln_pre.weight": rnd(vw, mean=1.0), "visual.ln_pre.bias": rnd(vw),
        **blocks("visual.", vw, v["layers"]),
        "visual.ln_post.weight": rnd(vw, mean=1.0), "visual.ln_post.bias": rnd(vw),
        "positional_embedding": rnd(t["context_length"], tw, std=0.1),
        "text_projection": rnd(tw, embed, std=tw ** -0.5),
        "logit_scale": torch.tensor(math.log(1 / 0.07), device="meta" if meta else "cpu"),
        "token_embedding.weight": rnd(t["vocab_size"], tw, std=0.5),
        **blocks("", tw, t["layers"]),
        "ln_final.weight": rnd(tw, mean=1.0), "ln_final.bias": rnd(tw),
    }
    return sd


def build_tiny_hpsv2(out_dir: str | os.PathLike, seed: int = 0) -> tuple[Path, Path, Path]:
    """Write the tiny checkpoint, its open_clip config and tokenizer into ``out_dir``.

    Returns ``(checkpoint, open_clip_config, tokenizer_dir)``."""
    import torch

    from ddpo_tpu.models.tiny import _build_tokenizer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    oc_config = tiny_open_clip_config()
    sd = {k: v.half() for k, v in tiny_open_clip_state_dict(oc_config, seed=seed).items()}
    torch.save({"epoch": 1, "name": "tiny-hpsv2", "state_dict": sd}, str(out / CHECKPOINT_NAME))
    (out / CONFIG_NAME).write_text(json.dumps(oc_config, indent=2) + "\n")
    _build_tokenizer(out).save_pretrained(str(out / TOKENIZER_SUBDIR))
    return out / CHECKPOINT_NAME, out / CONFIG_NAME, out / TOKENIZER_SUBDIR


def ensure_tiny_hpsv2(cache_dir: str | os.PathLike, seed: int = 0) -> tuple[Path, Path, Path]:
    """``(checkpoint, open_clip_config, tokenizer_dir)`` under ``cache_dir``, built once atomically
    (``proc/build_cache.build_once``)."""
    from ddpo_tpu.proc.build_cache import build_once

    final = build_once(cache_dir, f"tiny-hpsv2-{TINY_HPSV2_VERSION}-seed{seed}", _REQUIRED_FILES,
                       lambda tmp: build_tiny_hpsv2(tmp, seed=seed))
    return final / CHECKPOINT_NAME, final / CONFIG_NAME, final / TOKENIZER_SUBDIR
