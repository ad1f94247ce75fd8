"""A tiny random-weight CLIP + aesthetic MLP, for tests and CPU smoke runs of the aesthetic reward.

Saved exactly like the real assets, so ``AestheticReward`` loads it through the same ``from_pretrained`` /
state-dict code as ``openai/clip-vit-large-patch14`` + ``sac+logos+ava1-l14-linearMSE.pth``::

    OUT_DIR/clip/                       CLIPModel (config.json + model.safetensors) + preprocessor_config.json
    OUT_DIR/aesthetic_mlp.safetensors   LAION-shaped MLP head (keys layers.{0,2,4,6,7}.{weight,bias})

Architecture (``TINY_AESTHETIC_VERSION`` names it; bump it whenever anything below changes):

* vision tower: image_size 32, patch 8, hidden 32, intermediate 37, 2 layers, 4 heads;
* text tower: vocab 64, hidden 32, intermediate 37, 2 layers, 4 heads, 16 positions;
* projection_dim 16;
* image processor: CLIP mean/std, bicubic resize of the shortest edge to 32, 32x32 center crop;
* MLP: the LAION head with input size 16 (16 -> 1024 -> 128 -> 64 -> 16 -> 1).

Use: ``reward.clip_model=OUT_DIR/clip reward.mlp_path=OUT_DIR/aesthetic_mlp.safetensors``.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = [
    "TINY_AESTHETIC_VERSION",
    "TINY_CLIP_IMAGE_SIZE",
    "TINY_CLIP_PROJECTION_DIM",
    "build_tiny_aesthetic",
    "ensure_tiny_aesthetic",
]

TINY_AESTHETIC_VERSION = "v2"  # v2: text tower sized for the byte-level tokenizer (clip_score)
TINY_CLIP_IMAGE_SIZE = 32
TINY_CLIP_PROJECTION_DIM = 16

CLIP_SUBDIR = "clip"
MLP_FILENAME = "aesthetic_mlp.safetensors"

_REQUIRED_FILES = (
    f"{CLIP_SUBDIR}/config.json",
    f"{CLIP_SUBDIR}/model.safetensors",
    f"{CLIP_SUBDIR}/preprocessor_config.json",
    MLP_FILENAME,
)



def _clip_config():
    from transformers import CLIPConfig

    from ddpo_tpu.models.tiny import tiny_vocab

    vocab = len(tiny_vocab())  # the tiny SD byte-level tokenizer, saved next to the CLIP (clip_score needs text)
    text = dict(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=37,
        projection_dim=TINY_CLIP_PROJECTION_DIM,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=77,
        hidden_act="quick_gelu",
        bos_token_id=vocab - 2,
        eos_token_id=vocab - 1,
        pad_token_id=vocab - 1,
    )
    vision = dict(
        image_size=TINY_CLIP_IMAGE_SIZE,
        patch_size=8,
        num_channels=3,
        hidden_size=32,
        intermediate_size=37,
        projection_dim=TINY_CLIP_PROJECTION_DIM,
        num_hidden_layers=2,
        num_attention_heads=4,
        hidden_act="quick_gelu",
    )
    return CLIPConfig(text_config=text, vision_config=vision, projection_dim=TINY_CLIP_PROJECTION_DIM)


def build_tiny_aesthetic(out_dir: str | os.PathLike, seed: int = 0) -> tuple[Path, Path]:
    """Write the tiny CLIP (+ image processor) and a matching random aesthetic MLP into ``out_dir``.

    Seeded and deterministic; does not touch the caller's global RNG state.
    Returns ``(clip_dir, mlp_path)``.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import CLIPModel

    from ddpo_tpu.rewards.aesthetic import clip_image_processor_class, make_aesthetic_mlp

    out = Path(out_dir)
    clip_dir = out / CLIP_SUBDIR
    clip_dir.mkdir(parents=True, exist_ok=True)
    mlp_path = out / MLP_FILENAME

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        clip = CLIPModel(_clip_config()).eval()
        torch.manual_seed(seed + 1)
        mlp = make_aesthetic_mlp(TINY_CLIP_PROJECTION_DIM)

    clip.save_pretrained(str(clip_dir), safe_serialization=True)
    processor = clip_image_processor_class()(
        size={"shortest_edge": TINY_CLIP_IMAGE_SIZE},
        crop_size={"height": TINY_CLIP_IMAGE_SIZE, "width": TINY_CLIP_IMAGE_SIZE},
    )
    processor.save_pretrained(str(clip_dir))
    from ddpo_tpu.models.tiny import _build_tokenizer

    _build_tokenizer(out).save_pretrained(str(clip_dir))

    state = {k: v.detach().contiguous().clone() for k, v in mlp.state_dict().items()}
    save_file(state, str(mlp_path), metadata={"format": "pt"})
    return clip_dir, mlp_path


def ensure_tiny_aesthetic(cache_dir: str | os.PathLike, seed: int = 0) -> tuple[Path, Path]:
    """Return ``(clip_dir, mlp_path)`` under ``cache_dir/tiny-aesthetic-{version}-seed{seed}``, building once.

    The build goes into a temporary sibling directory that is ``os.replace``d into place only when complete,
    so a killed or concurrent build never leaves a half-written model at the final path; concurrent builders
    race harmlessly (the first rename wins, the others discard their copy).
    """
    from ddpo_tpu.proc.build_cache import build_once

    final = build_once(cache_dir, f"tiny-aesthetic-{TINY_AESTHETIC_VERSION}-seed{seed}", _REQUIRED_FILES,
                       lambda tmp: build_tiny_aesthetic(tmp, seed=seed))
    return final / CLIP_SUBDIR, final / MLP_FILENAME
