"""CLIP image features: a feature model, not a score. GRPO's diversity-aware advantages (GARDO,
`algorithm.diversity_features`) compare each image's features with the other images of its group; GARDO's code uses
DINOv3 (timm `vit_large_patch16_dinov3.lvd1689m`, yifan123/flow_grpo@94e23ee5 scripts/train_sd3_gardo.py:624-631,
:713), a hub model this project has no local stand-in for; the CLIP image embedding plays its part here, and with
`clip_model: tiny` the tiny local CLIP does (rewards/tiny_clip.py).

Registered in the reward registry (catalog entry `features=True`) so it is built and configured as a reward is, but it
returns float32 (B, D) features (CLIP's projected image embedding, `get_image_features`), so it is refused as a run's
reward or a weighted component. The diversity advantage normalises the features itself, as the reference does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ddpo_tpu.rewards.base import Metadata, Reward, RewardError, register_reward

_NAME = "clip_features"


@register_reward(_NAME)
class ClipFeatures(Reward):
    name = _NAME

    def __init__(self, clip_model: str, local_files_only: bool = True, device: Any = "cpu",
                 batch_size: int | None = None):
        import torch

        from ddpo_tpu.rewards.aesthetic import _load_image_encoder, clip_image_processor_class

        local = Path(clip_model).expanduser()
        src = str(local) if local.exists() else clip_model
        try:
            self.processor = clip_image_processor_class().from_pretrained(src, local_files_only=local_files_only)
            encoder, _ = _load_image_encoder(src, local_files_only)
        except Exception as exc:
            raise RewardError(_NAME, f"clip_model={clip_model!r} cannot be loaded as a CLIP image encoder with its "
                              f"image processor ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
                              f". Fix: point clip_model at a local CLIP directory (or `tiny`)") from None
        self.device = torch.device(device)
        self.encoder = encoder.to(self.device).eval()
        self.batch_size = batch_size

    def __call__(self, images: np.ndarray, prompts: list[str] | None = None, metadata: Metadata = None) -> np.ndarray:
        import torch

        images = self._check_host_images(images, prompts)
        n = images.shape[0]
        step = self.batch_size or max(n, 1)
        out = []
        with torch.no_grad():
            for i in range(0, n, step):
                pixels = self.processor(images=[np.ascontiguousarray(im) for im in images[i:i + step]],
                                        return_tensors="pt", input_data_format="channels_last")["pixel_values"]
                emb = self.encoder(pixel_values=pixels.to(self.device, torch.float32)).image_embeds
                out.append(emb.float().cpu().numpy())
        return np.concatenate(out) if out else np.zeros((0, 0), dtype=np.float32)
