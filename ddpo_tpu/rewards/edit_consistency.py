"""edit_consistency: a cheap edit reward that sees the source pictures, the stand-in for the edit task's judges on
the tiny build (flow_grpo's edit runs score with a VLM judge that is given the reference picture beside the output:
train_qwenimage_edit_plus.py hands ``ref_images`` to its reward).

reward = -mean |output - source| / 255 over the pixels (the first source picture, resized to the output by nearest
neighbour: closeness to the picture the edit starts from) + ``color_weight`` x (the mean of the colour channel the
prompt names, "red" / "green" / "blue", minus the other two's) / 255 (0 when the prompt names none): an edit that
keeps the picture and moves it toward the asked colour scores higher. The sources come in each image's metadata,
``metadata[i]["source_images"]`` (uint8 (H, W, 3) arrays, rewards/base.py's contract); extras log both terms.

numpy only.
"""

from __future__ import annotations

import numpy as np

from ddpo_tpu.rewards.base import Metadata, Reward, RewardScores, register_reward

SOURCE_IMAGES = "source_images"  # prompts/datasets.py SOURCE_IMAGES (the reward side need not import the reader)
COLORS = ("red", "green", "blue")


def _resize_nearest(img: np.ndarray, h: int, w: int) -> np.ndarray:
    rows = (np.arange(h) * img.shape[0] // h).clip(0, img.shape[0] - 1)
    cols = (np.arange(w) * img.shape[1] // w).clip(0, img.shape[1] - 1)
    return img[rows][:, cols]


def prompt_color(prompt: str) -> int | None:
    """The channel of the first colour word of the prompt, or None."""
    words = prompt.lower().replace(",", " ").split()
    for w in words:
        if w in COLORS:
            return COLORS.index(w)
    return None


@register_reward("edit_consistency")
class EditConsistency(Reward):
    """Closeness to the source picture plus the colour the prompt asks for (see the module docstring)."""

    name = "edit_consistency"
    takes_sources = True

    def __init__(self, color_weight: float = 0.5):
        self.color_weight = float(color_weight)

    def score(self, images: np.ndarray, prompts: list[str], metadata: Metadata = None) -> RewardScores:
        images = self._check_host_images(images, prompts)
        if metadata is None or any(not (m or {}).get(SOURCE_IMAGES) for m in metadata):
            raise self._error("every image needs its prompt's source pictures in metadata['source_images'] "
                              "(prompts=dataset on an edit dataset)")
        out = images.astype(np.float32)
        b, h, w = out.shape[:3]
        keep = np.empty(b, np.float32)
        color = np.full(b, np.nan, np.float32)
        for i, (prompt, row) in enumerate(zip(prompts, metadata)):
            src = _resize_nearest(np.asarray(row[SOURCE_IMAGES][0])[..., :3], h, w).astype(np.float32)
            keep[i] = -np.abs(out[i] - src).mean() / 255.0
            c = prompt_color(prompt)
            if c is not None:
                means = out[i].reshape(-1, 3).mean(0)
                color[i] = (means[c] - (means.sum() - means[c]) / 2) / 255.0
        values = keep + self.color_weight * np.nan_to_num(color, nan=0.0)
        return RewardScores(values.astype(np.float32), {"keep_source": keep, "asked_color": color})

    def __call__(self, images: np.ndarray, prompts: list[str], metadata: Metadata = None) -> np.ndarray:
        return self.score(images, prompts, metadata).values
