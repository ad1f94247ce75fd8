"""PickScore (Kirstain et al. 2023): a CLIP ViT-H/14 fine-tuned on human preferences, as Flow-GRPO rewards with it.

For prompt p and image x (flow_grpo/pickscore_scorer.py, PickScoreScorer.__call__)::

    t = text_features(p) / ||text_features(p)||          # CLIPModel.get_text_features, projected
    v = image_features(x) / ||image_features(x)||        # CLIPModel.get_image_features, projected
    score = exp(logit_scale) * <t, v> / 26

``logit_scale`` is the model's own learned temperature (exp ~ 100 for PickScore_v1); flow_grpo divides by 26 to
bring typical scores near 0..1 (its comment: "norm to 0-1"); the division is kept so rewards, advantages' scale
before normalisation and logged curves compare with the reference's. Each image is scored against its own prompt
(the diagonal of the text x image similarity matrix).

Inputs as flow_grpo prepares them: images are uint8 (the reference rounds its [0, 1] floats to uint8 and makes PIL
images), the processor resizes the shortest edge to 224 (bicubic), centre-crops 224 x 224 and normalises with CLIP's
mean/std; prompts are tokenised with padding to the longest, truncated at 77 tokens.

Loading (transformers ``from_pretrained``; hub ids or local directories, offline by default):

* ``processor`` -- ``CLIPProcessor`` (tokenizer + image processor), by default
  ``laion/CLIP-ViT-H-14-laion2B-s32B-b79K`` (only its JSON/TXT files are needed);
* ``clip_model`` -- ``CLIPModel``, by default ``yuvalkirstain/PickScore_v1``.

The image processor is the PIL/numpy one (``ddpo_tpu.rewards.aesthetic.clip_image_processor_class``) whatever else
is installed, as the reference's was. The model runs in float32 on ``device`` (the host CPU by default: on XLA an
extra graph beside the training ones is not wanted; ``reward_from_config`` passes a CUDA device through).

With ``reward.clip_model=tiny`` (conf/reward_local/pickscore_tiny_sd3.yaml) a tiny random-weight CLIP and processor
stand in (``ddpo_tpu/rewards/tiny_pickscore.py``), loaded through this same code.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ddpo_tpu.rewards.base import Metadata, Reward, register_reward

__all__ = ["PICKSCORE_MODEL", "PICKSCORE_PROCESSOR", "PICKSCORE_DIVISOR", "PickScoreReward"]

_NAME = "pickscore"
PICKSCORE_MODEL = "yuvalkirstain/PickScore_v1"
PICKSCORE_PROCESSOR = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"
PICKSCORE_DIVISOR = 26.0  # flow_grpo: scores / 26 ("norm to 0-1")
TEXT_MAX_LENGTH = 77


def _local_or_hub(name: str) -> str:
    path = Path(name).expanduser()
    return str(path) if path.exists() else name


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def _projected(features: Any):
    """transformers < 5 returns the projected embeddings; 5.x an output whose pooler_output holds them."""
    import torch

    return features if torch.is_tensor(features) else features.pooler_output


@register_reward(_NAME)
class PickScoreReward(Reward):
    """exp(logit_scale) * cos(text, image) / 26 per (image, its prompt); float32 (B,)."""

    name = _NAME

    def __init__(
        self,
        clip_model: str = PICKSCORE_MODEL,
        processor: str = PICKSCORE_PROCESSOR,
        local_files_only: bool = True,
        device: Any = "cpu",
        batch_size: int | None = None,
    ):
        import torch
        from transformers import CLIPModel, CLIPProcessor

        from ddpo_tpu.rewards.aesthetic import clip_image_processor_class

        if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int)
                                       or batch_size < 1):
            raise self._error(f"reward.batch_size={batch_size!r}: must be a positive integer or null")
        self.clip_model, self.processor_name = clip_model, processor
        self.batch_size = batch_size
        self.device = torch.device(device)
        proc_src, model_src = _local_or_hub(processor), _local_or_hub(clip_model)
        try:
            image_processor = clip_image_processor_class().from_pretrained(proc_src, local_files_only=local_files_only)
            self.processor = CLIPProcessor.from_pretrained(proc_src, image_processor=image_processor,
                                                           local_files_only=local_files_only)
        except Exception as exc:
            raise self._error(
                f"reward.processor={processor!r} cannot be loaded as a CLIPProcessor ({_first_line(exc)}). Fix: "
                f"download it once (hf download {PICKSCORE_PROCESSOR} --include '*.json' '*.txt') or point "
                "reward.processor at a local directory with its tokenizer and preprocessor files") from None
        try:
            model = CLIPModel.from_pretrained(model_src, local_files_only=local_files_only)
        except Exception as exc:
            raise self._error(
                f"reward.clip_model={clip_model!r} cannot be loaded as a CLIPModel ({_first_line(exc)}). Fix: "
                f"download it once (hf download {PICKSCORE_MODEL}) or point reward.clip_model at a local "
                "directory") from None
        self.model = model.to(device=self.device, dtype=torch.float32).eval().requires_grad_(False)

    # -- pieces ----------------------------------------------------------------------------------------

    def image_embeddings(self, images: np.ndarray):
        """uint8 (B, H, W, 3) -> unit-norm projected image embeddings, float32 (B, D) on ``device``."""
        import torch

        pixels = self.processor(images=[np.ascontiguousarray(im) for im in images], return_tensors="pt",
                                input_data_format="channels_last")["pixel_values"]
        with torch.no_grad():
            emb = _projected(self.model.get_image_features(pixel_values=pixels.to(self.device, torch.float32)))
        return emb / emb.norm(p=2, dim=-1, keepdim=True)

    def text_embeddings(self, prompts: list[str]):
        """B prompts -> unit-norm projected text embeddings, float32 (B, D) on ``device``."""
        import torch

        tokens = self.processor(text=list(prompts), padding=True, truncation=True, max_length=TEXT_MAX_LENGTH,
                                return_tensors="pt")
        tokens = {k: v.to(self.device) for k, v in tokens.items()}
        with torch.no_grad():
            emb = _projected(self.model.get_text_features(**tokens))
        return emb / emb.norm(p=2, dim=-1, keepdim=True)

    def _score_chunk(self, images: np.ndarray, prompts: list[str]) -> np.ndarray:
        import torch

        with torch.no_grad():
            image = self.image_embeddings(images)
            text = self.text_embeddings(prompts)
            scale = self.model.logit_scale.exp()
            scores = scale * (text * image).sum(dim=-1) / PICKSCORE_DIVISOR
        return scores.float().cpu().numpy()

    def __call__(self, images: np.ndarray, prompts: list[str], metadata: Metadata = None) -> np.ndarray:
        return self._score_in_chunks(images, prompts, self.batch_size, self._score_chunk, "PickScore")

    def __repr__(self) -> str:
        return (f"PickScoreReward(clip_model={self.clip_model!r}, processor={self.processor_name!r}, "
                f"device={str(self.device)!r})")
