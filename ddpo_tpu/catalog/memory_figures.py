"""What a family's memory figures are (read by config/memory.py's HBM rules): the shape each family's spec fills in,
apart from the families so a family's own figures module (wan_memory.py) can build them without importing the
registry back."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping

GIB = 2 ** 30


@dataclass(frozen=True)
class FamilyMemory:
    """Per-chip memory figures of an SD-sized member of the family at 512 px (estimates for the HBM rules; each
    figure says how it was measured; config/memory.py scales them to the run's model.resolution with at_pixels).
    Per-evaluation figures are keyed by train.mixed_precision ("no", "bf16")."""

    activation_gib_per_eval_512: Mapping[str, float]    # kept for the backward of one denoiser evaluation
    checkpointed_gib_per_eval_512: Mapping[str, float]  # the same with activation checkpointing
    # (model config, fsdp, weight dtype) -> GiB held through training besides a micro-step's activations
    resident_gib: Callable[[Any, int, str], float]
    # fsdp -> GiB per chip of a full fine-tune (no LoRA) with AdamW
    full_finetune_gib: Callable[[int], float]
    fsdp_splits_frozen_weights: bool = False  # whether a larger mesh.fsdp lowers resident_gib (a fix to offer)
    # How the per-evaluation figures follow model.resolution (image families that read it; a video family's figures
    # are a function of its model config instead, wan_memory.py). tokens_512: (image tokens, text tokens) of the
    # 512 px evaluation the figures were measured at; None: they do not follow the size (at_pixels cannot scale).
    tokens_512: tuple[int, int] | None = None
    # the part of each table that is XLA's attention softmaxes (quadratic in the sequence; the rest is linear in it)
    scores_gib_512: float = 0.0
    checkpointed_scores_gib_512: float = 0.0
    # the side in pixels a full-size checkpoint samples at with model.resolution=null (its config's sample size)
    native_pixels: int | None = None

    def at_pixels(self, pixels: int) -> "FamilyMemory":
        """The figures of an evaluation at `pixels` x `pixels`: with s = the sequence (image + text tokens) over the
        512 px one, the linear part x s and the softmaxes x s^2 (an estimate, as the figures are). Unchanged at 512
        px; a family without tokens_512 cannot be scaled (ValueError)."""
        if self.tokens_512 is None:
            raise ValueError("these memory figures do not follow the image size")
        image, text = self.tokens_512
        s = (image * (pixels / 512) ** 2 + text) / (image + text)

        def scaled(table: Mapping[str, float], scores: float) -> dict[str, float]:
            return {k: (v - scores) * s + scores * s * s for k, v in table.items()}

        return replace(self, activation_gib_per_eval_512=scaled(self.activation_gib_per_eval_512, self.scores_gib_512),
                       checkpointed_gib_per_eval_512=scaled(self.checkpointed_gib_per_eval_512,
                                                            self.checkpointed_scores_gib_512),
                       tokens_512=(round(image * (pixels / 512) ** 2), text))
