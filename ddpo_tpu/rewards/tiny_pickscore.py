"""A tiny random-weight stand-in for PickScore (CLIP model + CLIP processor), for tests and CPU smoke runs.

Saved with ``save_pretrained`` in the layout ``PickScoreReward`` loads the real assets from, so the same
``CLIPProcessor.from_pretrained`` / ``CLIPModel.from_pretrained`` code runs::

    OUT_DIR/processor/   CLIPProcessor: processor_config.json (image processor) + tokenizer files
    OUT_DIR/model/       CLIPModel: config.json + model.safetensors

Architecture (``TINY_PICKSCORE_VERSION`` names it; bump it whenever anything here changes): the tiny CLIP of
``tiny_clip.py`` (its version is part of the cache name too) with ``logit_scale`` initialised to ln(100), the
temperature PickScore_v1 ends with, so scores have the real model's range (|score| <= 100 / 26); the image
processor resizes the shortest edge to 32 and centre-crops 32 x 32; the tokenizer is the tiny SD byte-level one.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

__all__ = ["TINY_PICKSCORE_VERSION", "TINY_PICKSCORE_LOGIT_SCALE", "build_tiny_pickscore", "ensure_tiny_pickscore"]

TINY_PICKSCORE_VERSION = "v1"
TINY_PICKSCORE_LOGIT_SCALE = math.log(100.0)

PROCESSOR_SUBDIR = "processor"
MODEL_SUBDIR = "model"
_REQUIRED_FILES = (
    f"{PROCESSOR_SUBDIR}/processor_config.json",
    f"{PROCESSOR_SUBDIR}/tokenizer_config.json",
    f"{MODEL_SUBDIR}/config.json",
    f"{MODEL_SUBDIR}/model.safetensors",
)


def build_tiny_pickscore(out_dir: str | os.PathLike, seed: int = 0) -> tuple[Path, Path]:
    """Write the tiny processor and CLIP model into ``out_dir``; seeded, leaves the global RNG alone.

    Returns ``(processor_dir, model_dir)``.
    """
    import torch
    from transformers import CLIPModel, CLIPProcessor

    from ddpo_tpu.models.tiny import _build_tokenizer
    from ddpo_tpu.rewards.aesthetic import clip_image_processor_class
    from ddpo_tpu.rewards.tiny_clip import TINY_CLIP_IMAGE_SIZE, _clip_config

    out = Path(out_dir)
    processor_dir, model_dir = out / PROCESSOR_SUBDIR, out / MODEL_SUBDIR
    config = _clip_config()
    config.logit_scale_init_value = TINY_PICKSCORE_LOGIT_SCALE
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = CLIPModel(config).eval()
    model.save_pretrained(str(model_dir), safe_serialization=True)

    side = TINY_CLIP_IMAGE_SIZE
    image_processor = clip_image_processor_class()(size={"shortest_edge": side},
                                                   crop_size={"height": side, "width": side})
    CLIPProcessor(image_processor=image_processor, tokenizer=_build_tokenizer(out)).save_pretrained(str(processor_dir))
    return processor_dir, model_dir


def ensure_tiny_pickscore(cache_dir: str | os.PathLike, seed: int = 0) -> tuple[Path, Path]:
    """``(processor_dir, model_dir)`` under ``cache_dir``, built once atomically (``proc/build_cache.build_once``:
    a temporary sibling renamed into place when complete, so a killed or concurrent build leaves no partial model)."""
    from ddpo_tpu.proc.build_cache import build_once
    from ddpo_tpu.rewards.tiny_clip import TINY_AESTHETIC_VERSION

    name = f"tiny-pickscore-{TINY_PICKSCORE_VERSION}-clip{TINY_AESTHETIC_VERSION}-seed{seed}"
    final = build_once(cache_dir, name, _REQUIRED_FILES, lambda tmp: build_tiny_pickscore(tmp, seed=seed))
    return final / PROCESSOR_SUBDIR, final / MODEL_SUBDIR
