"""A tiny random-weight Mask2Former (Swin backbone) + its image processor: GenEval's `transformers` detector stand-in
for tests and CPU smoke runs (``reward.detector_model=tiny``, conf/reward_local/geneval_tiny*.yaml), saved with
``save_pretrained`` and loaded through the same ``from_pretrained`` code as
facebook/mask2former-swin-small-coco-instance.

Its id2label spells three COCO classes the detectron2 way (mouse, remote, keyboard) as the hub checkpoint does, so
the label mapping runs; the class head is biased towards ``mouse`` so that detections clear GenEval's 0.3 threshold
and the count, colour and position rules see objects. Its detections mean nothing about images.
``TINY_MASK2FORMER_VERSION`` names the architecture in the cache; bump it whenever anything here changes.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["TINY_MASK2FORMER_VERSION", "build_tiny_mask2former", "ensure_tiny_mask2former"]

TINY_MASK2FORMER_VERSION = "v1"
_REQUIRED_FILES = ("config.json", "model.safetensors", "preprocessor_config.json")


def build_tiny_mask2former(out_dir: str | os.PathLike, favour: str = "mouse", seed: int = 0) -> Path:
    """Write the tiny model and processor into ``out_dir``; seeded, leaves the global RNG alone."""
    import torch
    from transformers import (Mask2FormerConfig, Mask2FormerForUniversalSegmentation, Mask2FormerImageProcessor,
                              SwinConfig)

    from ddpo_tpu.rewards.geneval import CLASSNAMES

    out = Path(out_dir)
    id2label = dict(enumerate(CLASSNAMES))
    id2label.update({64: "mouse", 65: "remote", 66: "keyboard"})
    backbone = SwinConfig(image_size=64, patch_size=4, embed_dim=16, depths=[1, 1, 1, 1], num_heads=[1, 1, 1, 1],
                          window_size=4, out_features=["stage1", "stage2", "stage3", "stage4"])
    # 32 channels: the pixel decoder's GroupNorm has 32 groups
    cfg = Mask2FormerConfig(backbone_config=backbone, feature_size=32, mask_feature_size=32, hidden_dim=32,
                            encoder_feedforward_dim=32, dim_feedforward=32, encoder_layers=1, decoder_layers=2,
                            num_attention_heads=2, num_queries=4, common_stride=4, id2label=id2label,
                            label2id={v: k for k, v in id2label.items()}, num_labels=len(id2label))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Mask2FormerForUniversalSegmentation(cfg).eval()
    with torch.no_grad():
        model.class_predictor.bias.zero_()
        model.class_predictor.bias[cfg.label2id[favour]] = 20.0
    model.save_pretrained(out)
    Mask2FormerImageProcessor(size={"shortest_edge": 64, "longest_edge": 64}, size_divisor=32).save_pretrained(out)
    return out


def ensure_tiny_mask2former(cache_dir: str | os.PathLike, seed: int = 0) -> Path:
    """``cache_dir/tiny-mask2former-{version}-seed{seed}``, built once (atomically, as the other stand-ins)."""
    from ddpo_tpu.proc.build_cache import build_once

    return build_once(cache_dir, f"tiny-mask2former-{TINY_MASK2FORMER_VERSION}-seed{seed}", _REQUIRED_FILES,
                      lambda tmp: build_tiny_mask2former(tmp, seed=seed))
