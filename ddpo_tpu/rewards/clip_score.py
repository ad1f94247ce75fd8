"""CLIP score: prompt-image alignment, the cosine similarity of CLIP's image and text embeddings (in [-1, 1]).

Loads a CLIPModel, its image processor and its tokenizer through transformers' from_pretrained (hub id or local
directory; offline by default). With model=tiny the tiny local CLIP stands in (conf/reward_local/clip_score_tiny.yaml).
Runs on the host images, in the reward threads, like the other host rewards.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ddpo_tpu.rewards.base import Reward, RewardError, register_reward


@register_reward("clip_score")
class ClipScoreReward(Reward):
    name = "clip_score"

    def __init__(self, clip_model: str, local_files_only: bool = True, device: Any = "cpu"):
        import torch
        from transformers import CLIPModel, CLIPTokenizer

        from ddpo_tpu.rewards.aesthetic import clip_image_processor_class

        src = str(Path(clip_model).expanduser()) if Path(clip_model).expanduser().exists() else clip_model
        try:
            self.processor = clip_image_processor_class().from_pretrained(src, local_files_only=local_files_only)
            self.tokenizer = CLIPTokenizer.from_pretrained(src, local_files_only=local_files_only)
            self.model = CLIPModel.from_pretrained(src, local_files_only=local_files_only).to(device).eval()
        except Exception as exc:
            raise RewardError("clip_score", f"reward.clip_model={clip_model!r} cannot be loaded as a CLIP "
                              f"model with its tokenizer and image processor ({type(exc).__name__}: "
                              f"{str(exc).splitlines()[0] if str(exc) else ''}). Fix: point reward.clip_model at a "
                              f"local CLIP directory, or download openai/clip-vit-large-patch14 first") from None
        self.device = torch.device(device)

    def __call__(self, images: np.ndarray, prompts: list[str]) -> np.ndarray:
        import torch

        images = np.asarray(images)
        if images.dtype != np.uint8 or images.ndim != 4 or len(prompts) != len(images):
            raise RewardError("clip_score", f"expected uint8 (B, H, W, 3) images and B prompts, got "
                              f"{images.dtype} {images.shape} and {len(prompts)} prompts")
        pixels = self.processor(images=[np.ascontiguousarray(im) for im in images], return_tensors="pt",
                                input_data_format="channels_last")["pixel_values"].to(self.device)
        text = self.tokenizer(list(prompts), padding="max_length", truncation=True,
                              max_length=self.tokenizer.model_max_length, return_tensors="pt").to(self.device)
        with torch.no_grad():
            img = self.model.get_image_features(pixel_values=pixels)
            txt = self.model.get_text_features(**text)
            # transformers < 5 returns the projected embeddings; 5.x an output whose pooler_output holds them
            img = img if torch.is_tensor(img) else img.pooler_output
            txt = txt if torch.is_tensor(txt) else txt.pooler_output
            score = torch.nn.functional.cosine_similarity(img.float(), txt.float(), dim=-1)
        return score.cpu().numpy().astype(np.float32)
