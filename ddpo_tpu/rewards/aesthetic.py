"""LAION aesthetic-predictor reward (the DDPO paper's "aesthetic quality" task), as ddpo-pytorch's aesthetic_scorer.py.

score(image) = MLP(e / ||e||), where ``e`` is the CLIP image embedding (``CLIPModel.get_image_features``: the
projected pooled output) of the image after the CLIP image processor (resize the shortest edge, centre-crop,
normalise). The MLP is the LAION "improved aesthetic predictor" head, whose state-dict keys ``layers.{0,2,4,6,7}.*``
are those of the public checkpoint ``sac+logos+ava1-l14-linearMSE.pth`` (it loads as is).

Only the CLIP vision tower and its projection are loaded (``CLIPVisionModelWithProjection``, also from a full
``CLIPModel`` checkpoint): it computes exactly ``get_image_features``. Everything runs in float32, as the reference.

Where it runs: on the host uint8 images, with torch on ``device``: the host CPU on XLA and CPU runs, the CUDA device
on GPUs (``rewards/from_config.py`` decides). With ``reward.host_workers=0`` it scores inline on the main thread.
Only numpy is imported with this module; torch and transformers when a reward is built.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from ddpo_tpu.rewards.base import Metadata, Reward, RewardError, register_reward

__all__ = ["AESTHETIC_MLP_KEYS", "AestheticReward", "make_aesthetic_mlp", "load_mlp_state_dict",
           "clip_image_processor_class"]

_NAME = "aesthetic"
#: State-dict keys of the MLP (its Linear layers; 1, 3 and 5 are Dropouts), as in the LAION / ddpo-pytorch checkpoint.
AESTHETIC_MLP_KEYS = tuple(f"layers.{i}.{p}" for i in (0, 2, 4, 6, 7) for p in ("weight", "bias"))
_MLP_FIX = ("download the LAION aesthetic predictor weights sac+logos+ava1-l14-linearMSE.pth "
            "(github.com/christophschuhmann/improved-aesthetic-predictor) and set reward.mlp_path=/path/to/"
            "sac+logos+ava1-l14-linearMSE.pth")


def make_aesthetic_mlp(input_size: int = 768):
    """The LAION aesthetic MLP head (random init), with the reference's layers and state-dict keys; maps
    (B, input_size) embeddings to (B, 1) scores."""
    import torch.nn as nn

    class AestheticMLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.Sequential(
                nn.Linear(input_size, 1024), nn.Dropout(0.2), nn.Linear(1024, 128), nn.Dropout(0.2),
                nn.Linear(128, 64), nn.Dropout(0.1), nn.Linear(64, 16), nn.Linear(16, 1))

        def forward(self, embed):
            return self.layers(embed)

    return AestheticMLP()


def load_mlp_state_dict(path: str | os.PathLike) -> dict:
    """The MLP state dict from a ``.safetensors`` file or a torch pickle (``.pth``/``.pt``, read with
    ``weights_only=True``). Raises RewardError naming ``reward.mlp_path`` when the file is missing or unreadable."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise RewardError(_NAME, f"reward.mlp_path={str(path)!r} does not exist or is not a file; {_MLP_FIX}")
    try:
        if p.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(p), device="cpu")
        else:
            import torch

            state = torch.load(str(p), map_location="cpu", weights_only=True)
    except Exception as exc:
        raise RewardError(_NAME, f"could not read the aesthetic MLP weights reward.mlp_path={str(path)!r}: "
                          f"{type(exc).__name__}: {exc}") from exc
    if not isinstance(state, dict):
        raise RewardError(_NAME, f"reward.mlp_path={str(path)!r} holds a {type(state).__name__}, not a state dict")
    return state


def clip_image_processor_class():
    """The CLIP image processor class to use: the PIL/numpy backend when available.

    transformers 5 has two backends (``CLIPImageProcessorPil`` and the torchvision-based
    ``CLIPImageProcessor``); the PIL one matches the processor the reference used and needs no torchvision,
    so results do not depend on whether torchvision happens to be installed.
    """
    try:
        from transformers.models.clip import CLIPImageProcessorPil

        return CLIPImageProcessorPil
    except ImportError:  # transformers 4.x: CLIPImageProcessor is the PIL/numpy one
        from transformers import CLIPImageProcessor

        return CLIPImageProcessor


def _load_image_encoder(clip_model: str, local_files_only: bool):
    """CLIPVisionModelWithProjection from a CLIP checkpoint, quietly skipping a full CLIPModel's text tower."""
    import torch
    from transformers import CLIPVisionModelWithProjection

    class CLIPImageEncoder(CLIPVisionModelWithProjection):
        _keys_to_ignore_on_load_unexpected = [r"^text_model\.", r"^text_projection\.", r"^logit_scale$"]

    return CLIPImageEncoder.from_pretrained(clip_model, dtype=torch.float32, local_files_only=local_files_only,
                                            output_loading_info=True)


@register_reward(_NAME)
class AestheticReward(Reward):
    """LAION aesthetic score of each image (higher = prettier), as in DDPO's aesthetic task.

    Args:
        clip_model: hub id or local directory of a CLIP checkpoint (``CLIPModel`` or
            ``CLIPVisionModelWithProjection``) with its ``preprocessor_config.json``; the reference's is
            ``openai/clip-vit-large-patch14``.
        mlp_path: the aesthetic MLP state dict (``.safetensors`` or ``.pth``), e.g.
            ``sac+logos+ava1-l14-linearMSE.pth``. Its input size must equal the CLIP projection dim.
        device: torch device of the forward pass (default: the CPU).
        local_files_only: never download (the default; the training machines have no network).
        batch_size: images per forward pass (None: the whole batch at once).

    Call with uint8 host images (B, H, W, 3) of any size (the processor resizes and crops); returns float32 (B,).
    """

    name = _NAME

    def __init__(self, clip_model: str, mlp_path: str | os.PathLike | None, device: Any = "cpu",
                 local_files_only: bool = True, batch_size: int | None = None):
        if mlp_path is None or not str(mlp_path).strip():
            raise self._error(f"reward.mlp_path is not set (null); {_MLP_FIX}")
        if not clip_model or not str(clip_model).strip():
            raise self._error("reward.clip_model is not set; set reward.clip_model=openai/clip-vit-large-patch14 "
                              "(or a local CLIP directory)")
        if batch_size is not None and int(batch_size) < 1:
            raise self._error(f"batch_size must be >= 1 or None, got {batch_size}")
        import torch

        self.clip_model, self.mlp_path = str(clip_model), str(mlp_path)
        self.device = torch.device(device)
        self.batch_size = None if batch_size is None else int(batch_size)

        state = load_mlp_state_dict(mlp_path)  # the cheap file first, then the big model
        local = Path(self.clip_model).expanduser()
        source = str(local) if local.exists() else self.clip_model
        try:
            self.processor = clip_image_processor_class().from_pretrained(source, local_files_only=local_files_only)
            encoder, info = _load_image_encoder(source, local_files_only)
        except Exception as exc:
            where = ("the directory does not hold a loadable CLIP checkpoint" if local.is_dir() else
                     "it is not a local directory and not in the Hugging Face cache (local_files_only=True: no "
                     "download)" if local_files_only else "it could not be loaded")
            raise self._error(
                f"could not load the CLIP image encoder reward.clip_model={self.clip_model!r}: {where} "
                f"({type(exc).__name__}: {exc}). Fix: set reward.clip_model to a local directory holding a CLIP "
                "checkpoint (config.json, weights, preprocessor_config.json; e.g. a saved "
                "openai/clip-vit-large-patch14) or pre-download the hub id into the Hugging Face cache.") from exc
        if info.get("missing_keys"):
            raise self._error(
                f"reward.clip_model={self.clip_model!r} is not a CLIP checkpoint with an image projection "
                f"(missing weights: {sorted(info['missing_keys'])[:5]}...); use a CLIPModel checkpoint such as "
                "openai/clip-vit-large-patch14")
        self.encoder = encoder.to(self.device).eval()
        self.embed_dim = int(self.encoder.visual_projection.out_features)

        w0 = state.get("layers.0.weight")
        if w0 is not None and tuple(w0.shape[1:]) != (self.embed_dim,):
            raise self._error(
                f"the MLP in reward.mlp_path={self.mlp_path!r} takes {tuple(w0.shape[1:])} inputs but the CLIP "
                f"model reward.clip_model={self.clip_model!r} has projection_dim {self.embed_dim}; the LAION "
                "sac+logos+ava1-l14 MLP needs openai/clip-vit-large-patch14 (768)")
        mlp = make_aesthetic_mlp(self.embed_dim)
        try:
            mlp.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
        except Exception as exc:
            raise self._error(
                f"reward.mlp_path={self.mlp_path!r} is not a LAION aesthetic MLP state dict "
                f"(expected keys {list(AESTHETIC_MLP_KEYS)}, got {sorted(state)[:12]}): {exc}") from exc
        self.mlp = mlp.to(self.device).eval()

    def _score(self, images: np.ndarray):
        """uint8 (B, H, W, 3) -> float32 (B,) scores on ``device``: processor, unit-norm CLIP embedding, MLP."""
        import torch

        pixels = self.processor(images=[np.ascontiguousarray(im) for im in images], return_tensors="pt",
                                input_data_format="channels_last")["pixel_values"]
        emb = self.encoder(pixel_values=pixels.to(device=self.device, dtype=torch.float32)).image_embeds.float()
        emb = emb / torch.linalg.vector_norm(emb, dim=-1, keepdim=True).clamp_min(1e-12)
        return self.mlp(emb).squeeze(-1)

    def __call__(self, images: np.ndarray, prompts: list[str] | None = None, metadata: Metadata = None) -> np.ndarray:
        import torch

        images = self._check_host_images(images, prompts)
        n = images.shape[0]
        if n == 0:
            return np.zeros((0,), dtype=np.float32)
        step = self.batch_size or n
        try:
            with torch.no_grad():
                chunks = [self._score(images[i:i + step]).to("cpu", torch.float32).numpy() for i in range(0, n, step)]
        except Exception as exc:
            raise self._error(f"scoring failed: {type(exc).__name__}: {exc}") from exc
        return np.concatenate(chunks).astype(np.float32, copy=False)

    def __repr__(self) -> str:
        return (f"AestheticReward(clip_model={self.clip_model!r}, mlp_path={self.mlp_path!r}, "
                f"device={str(self.device)!r})")
