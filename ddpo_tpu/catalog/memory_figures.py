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


def split_transformer_memory(ckpt_eager_ratio: float, ckpt_scores_ratio: float, billions: Mapping[str, float],
                             encoders: tuple[str, ...], state_gib: float, eager_gib: Mapping[str, float],
                             scores_gib: float) -> FamilyMemory:
    """The memory figures of a family whose transformer is split over mesh.fsdp while its text encoders and VAE
    (float32) stay whole on every chip (FLUX, Qwen-Image): per evaluation the eager part plus XLA's softmaxes, with
    activation checkpointing the eager part x ckpt_eager_ratio and the scores x ckpt_scores_ratio
    (catalog/families.py passes SD 3.5's measured eager ratio and SD 1.x's scores ratio)."""
    b = billions
    text = sum(b[e] for e in encoders)

    def resident(model, fsdp: int, dtype: str) -> float:
        size = 2 if dtype == "bfloat16" else 4
        return ((b["transformer"] / fsdp + text) * size + b["vae"] * 4) * 1e9 / GIB + state_gib

    def full_finetune(fsdp: int) -> float:
        # the transformer's weights x (weight, gradient, 2 AdamW moments) x 4 bytes split by fsdp; the text encoders
        # in bfloat16 (as flow_grpo casts them) and the VAE in float32 whole, and the epoch's samples and runtime
        whole = (text * 2 + b["vae"] * 4) * 1e9 / GIB + 1.1
        return b["transformer"] * 16 * 1e9 / GIB / fsdp + whole

    return FamilyMemory(
        activation_gib_per_eval_512={k: v + scores_gib for k, v in eager_gib.items()},
        checkpointed_gib_per_eval_512={k: round(v * ckpt_eager_ratio + ckpt_scores_ratio * scores_gib, 2)
                                       for k, v in eager_gib.items()},
        resident_gib=resident, full_finetune_gib=full_finetune, fsdp_splits_frozen_weights=True,
        # 1024 image + 128 text tokens; FLUX.1-dev's VAE sample_size and QwenImagePipeline's default: 1024 px
        tokens_512=(1024, 128), scores_gib_512=scores_gib,
        checkpointed_scores_gib_512=ckpt_scores_ratio * scores_gib, native_pixels=1024)
