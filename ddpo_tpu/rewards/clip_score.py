"""CLIP score: prompt-image alignment, the cosine similarity of CLIP's image and text embeddings (in [-1, 1]).

Loads a CLIPModel, its image processor and its tokenizer through transformers' from_pretrained (hub id or local
directory; offline by default). With model=tiny the tiny local CLIP stands in (conf/reward_local/clip_score_tiny.yaml).
Runs on the host images, in the reward threads, like the other host rewards.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ddpo_tpu.rewards.base import Metadata, Reward, RewardError, register_reward


@register_reward("clip_score")
class ClipScoreReward(Reward):
    name = "clip_score"

    def __init__(self, clip_model: str, local_files_only: bool = True, device: Any = "cpu"):
        from transformers import CLIPTokenizer

        self.processor, self.tokenizer, self.model, self.device = load_clip("clip_score", clip_model,
                                                                            local_files_only, device, CLIPTokenizer)

    def __call__(self, images: np.ndarray, prompts: list[str], metadata: Metadata = None) -> np.ndarray:
        import torch

        images = np.asarray(images)
        if images.dtype != np.uint8 or images.ndim != 4 or len(prompts) != len(images):
            raise RewardError("clip_score", f"expected uint8 (B, H, W, 3) images and B prompts, got "
                              f"{images.dtype} {images.shape} and {len(prompts)} prompts")
        text = self.tokenizer(list(prompts), padding="max_length", truncation=True,
                              max_length=self.tokenizer.model_max_length, return_tensors="pt").to(self.device)
        with torch.no_grad():
            img = image_features(self.processor, self.model, images, self.device)
            txt = _projected(self.model.get_text_features(**text))
            score = torch.nn.functional.cosine_similarity(img.float(), txt.float(), dim=-1)
        return score.cpu().numpy().astype(np.float32)


def load_clip(reward: str, clip_model: str, local_files_only: bool, device: Any, tokenizer_class=None):
    """(image processor, tokenizer (with `tokenizer_class`; else None), CLIPModel in eval mode, torch device) from a
    hub id or local directory. A load failure is one RewardError naming the key."""
    import torch
    from transformers import CLIPModel

    from ddpo_tpu.rewards.aesthetic import clip_image_processor_class

    src = str(Path(clip_model).expanduser()) if Path(clip_model).expanduser().exists() else clip_model
    try:
        processor = clip_image_processor_class().from_pretrained(src, local_files_only=local_files_only)
        tokenizer = tokenizer_class.from_pretrained(src, local_files_only=local_files_only) if tokenizer_class \
            else None
        model = CLIPModel.from_pretrained(src, local_files_only=local_files_only).to(device).eval()
    except Exception as exc:
        parts = "its tokenizer and image processor" if tokenizer_class else "its image processor"
        raise RewardError(reward, f"reward.clip_model={clip_model!r} cannot be loaded as a CLIP model with {parts} "
                          f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}). Fix: point "
                          f"reward.clip_model at a local CLIP directory, or download {clip_model} first") from None
    return processor, tokenizer, model, torch.device(device)


def image_features(processor, model, images: np.ndarray, device) -> Any:
    """CLIP's projected image embeddings (N, D) of uint8 (N, H, W, 3) images, not normalised (call under no_grad)."""
    pixels = processor(images=[np.ascontiguousarray(im) for im in images], return_tensors="pt",
                       input_data_format="channels_last")["pixel_values"].to(device)
    return _projected(model.get_image_features(pixel_values=pixels))


def _projected(out: Any) -> Any:
    # transformers < 5 returns the projected embeddings; 5.x an output whose pooler_output holds them
    import torch

    return out if torch.is_tensor(out) else out.pooler_output
