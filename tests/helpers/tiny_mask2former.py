"""A tiny random-weight Mask2Former (Swin backbone) saved with its image processor, for GenEval's `transformers`
detector: its id2label spells three classes the detectron2 way (mouse, remote, keyboard) as the hub checkpoint
facebook/mask2former-swin-small-coco-instance does, and its class head is biased towards one label so that
detections clear GenEval's 0.3 threshold."""

from __future__ import annotations

from pathlib import Path


def build_tiny_mask2former(path: Path, favour: str = "mouse", seed: int = 0) -> Path:
    import torch
    from transformers import (Mask2FormerConfig, Mask2FormerForUniversalSegmentation, Mask2FormerImageProcessor,
                              SwinConfig)

    from ddpo_tpu.rewards.geneval import CLASSNAMES

    id2label = dict(enumerate(CLASSNAMES))
    id2label.update({64: "mouse", 65: "remote", 66: "keyboard"})
    backbone = SwinConfig(image_size=64, patch_size=4, embed_dim=16, depths=[1, 1, 1, 1], num_heads=[1, 1, 1, 1],
                          window_size=4, out_features=["stage1", "stage2", "stage3", "stage4"])
    cfg = Mask2FormerConfig(backbone_config=backbone, feature_size=32, mask_feature_size=32, hidden_dim=32,
                            encoder_feedforward_dim=32, dim_feedforward=32, encoder_layers=1, decoder_layers=2,
                            num_attention_heads=2, num_queries=4, common_stride=4, id2label=id2label,
                            label2id={v: k for k, v in id2label.items()}, num_labels=len(id2label))
    torch.manual_seed(seed)
    model = Mask2FormerForUniversalSegmentation(cfg).eval()
    with torch.no_grad():
        model.class_predictor.bias.zero_()
        model.class_predictor.bias[cfg.label2id[favour]] = 20.0
    model.save_pretrained(path)
    Mask2FormerImageProcessor(size={"shortest_edge": 64, "longest_edge": 64}, size_divisor=32).save_pretrained(path)
    return path
