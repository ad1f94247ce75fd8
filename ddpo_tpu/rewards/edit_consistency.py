"""edit_consistency: a cheap edit reward that sees the source pictures, the stand-in for the edit task's judges on
the tiny build (flow_grpo's edit runs score with a VLM judge that is given the reference picture beside the output:
train_qwenimage_edit_plus.py hands ``ref_images`` to its reward).

reward = -mean |pool(output) - pool(source)| / 255 (the first source picture; both averaged over a ``grid`` x ``grid``
grid of blocks: closeness to the picture the edit starts from in its coarse colour layout, a cheap feature that the
tiny build's random outputs can approach; grid 0 compares every pixel, the source resized to the output by nearest
neighbour) + ``color_weight`` x (the mean of the colour channel the
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


def _pool(img: np.ndarray, grid: int) -> np.ndarray:
    """(grid, grid, 3) block means of an (H, W, 3) image (blocks as even as the sides allow)."""
    rows = np.array_split(np.arange(img.shape[0]), grid)
    cols = np.array_split(np.arange(img.shape[1]), grid)
    return np.array([[img[r][:, c].reshape(-1, img.shape[2]).mean(0) for c in cols] for r in rows])


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

    def __init__(self, color_weight: float = 0.5, grid: int = 2):
        self.color_weight, self.grid = float(color_weight), int(grid)

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
            src = np.asarray(row[SOURCE_IMAGES][0])[..., :3].astype(np.float32)
            if self.grid:
                keep[i] = -np.abs(_pool(out[i], self.grid) - _pool(src, self.grid)).mean() / 255.0
            else:
                keep[i] = -np.abs(out[i] - _resize_nearest(src, h, w)).mean() / 255.0
            c = prompt_color(prompt)
            if c is not None:
                means = out[i].reshape(-1, 3).mean(0)
                color[i] = (means[c] - (means.sum() - means[c]) / 2) / 255.0
        values = keep + self.color_weight * np.nan_to_num(color, nan=0.0)
        return RewardScores(values.astype(np.float32), {"keep_source": keep, "asked_color": color})

    def __call__(self, images: np.ndarray, prompts: list[str], metadata: Metadata = None) -> np.ndarray:
        return self.score(images, prompts, metadata).values
