"""What a family's memory figures are (read by config/memory.py's HBM rules): the shape each family's spec fills in,
apart from the families so a family's own figures module (wan_memory.py) can build them without importing the
registry back."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

GIB = 2 ** 30


@dataclass(frozen=True)
class FamilyMemory:
    """Per-chip memory figures of an SD-sized member of the family at 512 px (estimates for the HBM rules; each
    figure says how it was measured). Per-evaluation figures are keyed by train.mixed_precision ("no", "bf16")."""

    activation_gib_per_eval_512: Mapping[str, float]    # kept for the backward of one denoiser evaluation
    checkpointed_gib_per_eval_512: Mapping[str, float]  # the same with activation checkpointing
    # (model config, fsdp, weight dtype) -> GiB held through training besides a micro-step's activations
    resident_gib: Callable[[Any, int, str], float]
    # fsdp -> GiB per chip of a full fine-tune (no LoRA) with AdamW
    full_finetune_gib: Callable[[int], float]
    fsdp_splits_frozen_weights: bool = False  # whether a larger mesh.fsdp lowers resident_gib (a fix to offer)
