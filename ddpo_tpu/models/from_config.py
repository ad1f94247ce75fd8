"""Model loading from the `model` config group: a local tiny build or a real checkpoint, both via from_pretrained."""

from __future__ import annotations

from pathlib import Path

import torch

from ddpo_tpu.config.schema import ModelConfig


def load_from_config(cfg: ModelConfig):
    from ddpo_tpu.models.loading import load_components
    from ddpo_tpu.models.tiny import ensure_tiny_model

    dtype = torch.bfloat16 if cfg.dtype == "bfloat16" else torch.float32
    if cfg.builder == "digits":  # the digits demo model, pretrained here once (models/digits.py)
        from ddpo_tpu.models.digits import ensure_digits_model

        path = ensure_digits_model(Path(cfg.cache_dir).expanduser())
        return load_components(str(path), local_files_only=True, dtype=dtype)
    if cfg.builder is not None:  # a locally built pipeline (models/tiny.py SPECS)
        path = ensure_tiny_model(Path(cfg.cache_dir).expanduser(), spec=cfg.builder)
        return load_components(str(path), local_files_only=True, dtype=dtype)
    return load_components(cfg.pretrained, revision=cfg.revision, local_files_only=cfg.local_files_only, dtype=dtype)
