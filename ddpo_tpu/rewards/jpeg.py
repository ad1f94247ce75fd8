"""JPEG (in)compressibility rewards, as in the DDPO paper.

Each image is encoded with PIL as JPEG at quality 95; its size in kilobytes
(bytes / 1000) is the incompressibility reward, and minus that size is the
compressibility reward.  Imports only numpy and PIL.
"""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

from ddpo_tpu.rewards.base import Metadata, Reward, register_reward

__all__ = ["JPEG_QUALITY", "jpeg_sizes_kb", "JpegIncompressibility", "JpegCompressibility"]

JPEG_QUALITY = 95


def jpeg_sizes_kb(images: np.ndarray, quality: int = JPEG_QUALITY) -> np.ndarray:
    """JPEG-encoded size in kilobytes (1 kB = 1000 bytes) of each uint8 (B, H, W, 3) image.

    Returns float64 (B,), the exact bytes / 1000.
    """
    sizes = np.empty(len(images), dtype=np.float64)
    for i, image in enumerate(images):
        buffer = io.BytesIO()
        Image.fromarray(np.ascontiguousarray(image)).save(
            buffer, format="JPEG", quality=quality
        )
        sizes[i] = buffer.tell() / 1000
    return sizes


class _JpegReward(Reward):
    sign: float = 1.0

    def __init__(self, quality: int = JPEG_QUALITY):
        if not 1 <= int(quality) <= 100:
            raise self._error(f"JPEG quality must be in [1, 100], got {quality}")
        self.quality = int(quality)

    def __call__(self, images: np.ndarray, prompts: list[str], metadata: Metadata = None) -> np.ndarray:
        images = self._check_host_images(images, prompts)
        try:
            sizes = jpeg_sizes_kb(images, self.quality)
        except Exception as exc:
            raise self._error(f"JPEG encoding failed: {type(exc).__name__}: {exc}") from exc
        return (self.sign * sizes).astype(np.float32)


@register_reward("jpeg_incompressibility")
class JpegIncompressibility(_JpegReward):
    """Reward = JPEG size in kB (bigger files are better)."""

    name = "jpeg_incompressibility"
    sign = 1.0


@register_reward("jpeg_compressibility")
class JpegCompressibility(_JpegReward):
    """Reward = -JPEG size in kB (smaller files are better)."""

    name = "jpeg_compressibility"
    sign = -1.0
