"""LAION aesthetic-predictor reward (the DDPO paper's "aesthetic quality" task).

score(image) = MLP(e / ||e||), where ``e`` is the CLIP image embedding (the
projected pooled output, i.e. ``CLIPModel.get_image_features``) of the image
after the CLIP image processor (resize shortest edge + center crop + normalise).
The MLP is the LAION "improved aesthetic predictor" head::

    layers = Sequential(Linear(D, 1024), Dropout(0.2), Linear(1024, 128), Dropout(0.2),
                        Linear(128, 64), Dropout(0.1), Linear(64, 16), Linear(16, 1))

with D the CLIP projection dim (768 for ViT-L/14).  Its state-dict keys are
``layers.{0,2,4,6,7}.{weight,bias}``, the naming of the public checkpoint
``sac+logos+ava1-l14-linearMSE.pth`` (which loads as is).

Only the CLIP vision tower and its projection are loaded
(``CLIPVisionModelWithProjection``, also from a full ``CLIPModel`` checkpoint);
it computes exactly ``CLIPModel.get_image_features``.

This module imports only numpy at import time; torch and transformers are
imported when a reward is built, so registering it stays cheap.

Current placement: the reward consumes host uint8 images (``needs =
{"host_images"}``) and runs the CLIP + MLP forward with torch on ``device``
(CPU by default).  Running it on the accelerator on device-resident images
(skipping the host copy) is a later step.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from ddpo_tpu.rewards.base import Reward, RewardError, register_reward

__all__ = [
    "AESTHETIC_MLP_HIDDEN",
    "AESTHETIC_MLP_KEYS",
    "AestheticReward",
    "make_aesthetic_mlp",
    "load_mlp_state_dict",
    "clip_image_processor_class",
]

_NAME = "aesthetic"

#: Output sizes of the Linear layers after the input (LAION improved-aesthetic-predictor).
AESTHETIC_MLP_HIDDEN = (1024, 128, 64, 16, 1)
#: Indices of the Linear layers inside ``layers`` (the others are Dropouts).
_LINEAR_INDICES = (0, 2, 4, 6, 7)
_DROPOUTS = {1: 0.2, 3: 0.2, 5: 0.1}
#: State-dict keys of the MLP, as in the LAION / ddpo-pytorch checkpoint.
AESTHETIC_MLP_KEYS = tuple(f"layers.{i}.{p}" for i in _LINEAR_INDICES for p in ("weight", "bias"))

_MLP_FIX = (
    "download the LAION aesthetic predictor weights sac+logos+ava1-l14-linearMSE.pth "
    "(github.com/christophschuhmann/improved-aesthetic-predictor) and set reward.mlp_path=/path/to/"
    "sac+logos+ava1-l14-linearMSE.pth"
)


def _error(message: str) -> RewardError:
    return RewardError(_NAME, message)


# ---------------------------------------------------------------------------
# MLP
# ---------------------------------------------------------------------------


def make_aesthetic_mlp(input_size: int = 768):
    """The LAION aesthetic MLP head (random init) as a module whose state dict uses the reference keys.

    Returns an ``nn.Module`` with a single child ``layers`` (an ``nn.Sequential``); call it on
    (B, input_size) embeddings to get (B, 1) scores.
    """
    import torch.nn as nn

    mods: list[nn.Module] = []
    prev = int(input_size)
    li = iter(AESTHETIC_MLP_HIDDEN)
    for idx in range(8):
        if idx in _DROPOUTS:
            mods.append(nn.Dropout(_DROPOUTS[idx]))
        else:
            out = next(li)
            mods.append(nn.Linear(prev, out))
            prev = out

    class AestheticMLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.Sequential(*mods)

        def forward(self, embed):
            return self.layers(embed)

    return AestheticMLP()


def _unwrap_state_dict(obj: Any) -> dict:
    if isinstance(obj, dict) and isinstance(obj.get("state_dict"), dict):
        obj = obj["state_dict"]
    if not isinstance(obj, dict):
        raise TypeError(f"expected a state dict (dict of tensors), got {type(obj).__name__}")
    # Tolerate DataParallel / Lightning-style prefixes in front of "layers.".
    out = {}
    for k, v in obj.items():
        key = str(k)
        for prefix in ("module.", "model."):
            if key.startswith(prefix) and key[len(prefix):].startswith("layers."):
                key = key[len(prefix):]
        out[key] = v
    return out


def load_mlp_state_dict(path: str | os.PathLike) -> dict:
    """Read the MLP state dict from a ``.safetensors`` file or a torch pickle (``.pth``/``.pt``/``.bin``).

    Torch pickles are read with ``weights_only=True`` (plain tensors only).
    Raises RewardError naming ``reward.mlp_path`` when the file is missing or unreadable.
    """
    p = Path(path).expanduser()
    if not p.is_file():
        raise _error(f"reward.mlp_path={str(path)!r} does not exist or is not a file; {_MLP_FIX}")
    try:
        if p.suffix == ".safetensors":
            from safetensors.torch import load_file

            sd = load_file(str(p), device="cpu")
        else:
            import torch

            sd = torch.load(str(p), map_location="cpu", weights_only=True)
        return _unwrap_state_dict(sd)
    except RewardError:
        raise
    except Exception as exc:
        raise _error(
            f"could not read the aesthetic MLP weights reward.mlp_path={str(path)!r}: "
            f"{type(exc).__name__}: {exc}"
        ) from exc


# ---------------------------------------------------------------------------
# CLIP
# ---------------------------------------------------------------------------


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


_VISION_CLASS = None


def _vision_model_class():
    """CLIPVisionModelWithProjection that quietly skips a full CLIPModel checkpoint's text tower."""
    global _VISION_CLASS
    if _VISION_CLASS is None:
        from transformers import CLIPVisionModelWithProjection

        class _CLIPImageEncoder(CLIPVisionModelWithProjection):
            _keys_to_ignore_on_load_unexpected = [r"^text_model\.", r"^text_projection\.", r"^logit_scale$"]

        _VISION_CLASS = _CLIPImageEncoder
    return _VISION_CLASS


def _resolve_dtype(dtype: Any):
    import torch

    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str):
        name = dtype.removeprefix("torch.")
        aliases = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
        resolved = getattr(torch, aliases.get(name, name), None)
        if isinstance(resolved, torch.dtype) and resolved.is_floating_point:
            return resolved
    raise _error(f"unsupported dtype {dtype!r}; use float32, bfloat16 or float16")


def _clip_missing_message(clip_model: str, local_files_only: bool, exc: BaseException) -> str:
    if Path(clip_model).expanduser().is_dir():
        where = "the directory does not hold a loadable CLIP checkpoint"
    elif local_files_only:
        where = "it is not a local directory and not in the Hugging Face cache (local_files_only=True: no download)"
    else:
        where = "it could not be loaded"
    return (
        f"could not load the CLIP image encoder reward.clip_model={clip_model!r}: {where} "
        f"({type(exc).__name__}: {exc}). Fix: set reward.clip_model to a local directory holding a CLIP "
        "checkpoint (config.json, weights, preprocessor_config.json; e.g. a saved openai/clip-vit-large-patch14) "
        "or pre-download the hub id into the Hugging Face cache."
    )


# ---------------------------------------------------------------------------
# Reward
# ---------------------------------------------------------------------------


@register_reward(_NAME)
class AestheticReward(Reward):
    """LAION aesthetic score of each image (higher = prettier), as in DDPO's aesthetic task.

    Args:
        clip_model: hub id or local directory of a CLIP checkpoint (``CLIPModel`` or
            ``CLIPVisionModelWithProjection``) with its ``preprocessor_config.json``.
            The reference uses ``openai/clip-vit-large-patch14``.
        mlp_path: the aesthetic MLP state dict (``.safetensors`` or ``.pth``), e.g.
            ``sac+logos+ava1-l14-linearMSE.pth``.  Its input size must equal the CLIP projection dim.
        device: torch device for the forward pass (default CPU).
        dtype: dtype of the CLIP encoder (torch dtype or name, default float32).  The embedding
            normalisation and the MLP always run in float32.
        local_files_only: never download (the default; the training machines have no network).
        batch_size: images per forward pass (None: the whole batch at once).

    Call with uint8 host images (B, H, W, 3) of any size (the processor resizes and crops);
    returns float32 (B,).  Runs on the images copied to the host (``needs = {"host_images"}``);
    moving it onto the accelerator is a later step.
    """

    name = _NAME
    needs = frozenset({"host_images"})

    def __init__(
        self,
        clip_model: str,
        mlp_path: str | os.PathLike | None,
        device: Any = "cpu",
        dtype: Any = "float32",
        local_files_only: bool = True,
        batch_size: int | None = None,
    ):
        if mlp_path is None or str(mlp_path).strip() == "":
            raise self._error(f"reward.mlp_path is not set (null); {_MLP_FIX}")
        if not clip_model or not str(clip_model).strip():
            raise self._error(
                "reward.clip_model is not set; set reward.clip_model=openai/clip-vit-large-patch14 "
                "(or a local CLIP directory)"
            )
        if batch_size is not None and int(batch_size) < 1:
            raise self._error(f"batch_size must be >= 1 or None, got {batch_size}")

        import torch

        self.clip_model = str(clip_model)
        self.mlp_path = str(mlp_path)
        self.device = torch.device(device) if isinstance(device, str) else device
        self.dtype = _resolve_dtype(dtype)
        self.local_files_only = bool(local_files_only)
        self.batch_size = None if batch_size is None else int(batch_size)

        # Check the (cheap) MLP file before loading the (big) CLIP model.
        state = load_mlp_state_dict(mlp_path)

        clip_src = self.clip_model
        local = Path(clip_src).expanduser()
        if local.exists():
            clip_src = str(local)
        elif clip_src.startswith((".", "/", "~")) or clip_src.count("/") > 1 or "\\" in clip_src:
            # A path (hub ids are "name" or "org/name") that does not exist.
            raise self._error(_clip_missing_message(self.clip_model, self.local_files_only,
                                                    FileNotFoundError(f"no such directory: {local}")))
        try:
            self.processor = clip_image_processor_class().from_pretrained(
                clip_src, local_files_only=self.local_files_only
            )
            encoder, info = _vision_model_class().from_pretrained(
                clip_src,
                dtype=self.dtype,
                local_files_only=self.local_files_only,
                output_loading_info=True,
            )
        except Exception as exc:
            raise self._error(_clip_missing_message(self.clip_model, self.local_files_only, exc)) from exc
        missing = list(info.get("missing_keys", []) or [])
        if missing:
            raise self._error(
                f"reward.clip_model={self.clip_model!r} is not a CLIP checkpoint with an image projection "
                f"(missing weights: {sorted(missing)[:5]}...); use a CLIPModel checkpoint such as "
                "openai/clip-vit-large-patch14"
            )
        self.encoder = encoder.to(self.device).eval()
        self.embed_dim = int(self.encoder.visual_projection.out_features)

        w0 = state.get("layers.0.weight")
        if w0 is not None and tuple(w0.shape[1:]) != (self.embed_dim,):
            raise self._error(
                f"the MLP in reward.mlp_path={self.mlp_path!r} takes {tuple(w0.shape[1:])} inputs but the CLIP "
                f"model reward.clip_model={self.clip_model!r} has projection_dim {self.embed_dim}; the LAION "
                "sac+logos+ava1-l14 MLP needs openai/clip-vit-large-patch14 (768)"
            )
        mlp = make_aesthetic_mlp(self.embed_dim)
        try:
            mlp.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
        except Exception as exc:
            raise self._error(
                f"reward.mlp_path={self.mlp_path!r} is not a LAION aesthetic MLP state dict "
                f"(expected keys {list(AESTHETIC_MLP_KEYS)}, got {sorted(state)[:12]}): {exc}"
            ) from exc
        self.mlp = mlp.to(self.device).eval()

    # -- pieces (also used by tests and by a future on-device version) -----------------------

    def preprocess(self, images: np.ndarray):
        """uint8 (B, H, W, 3) -> CLIP pixel_values float32 (B, 3, S, S) on the CPU."""
        out = self.processor(
            images=[np.ascontiguousarray(im) for im in images],
            return_tensors="pt",
            input_data_format="channels_last",
        )
        return out["pixel_values"]

    def embed(self, pixel_values):
        """pixel_values -> L2-normalised CLIP image embeddings, float32 (B, D) on ``device``."""
        import torch

        pixel_values = pixel_values.to(device=self.device, dtype=self.dtype)
        emb = self.encoder(pixel_values=pixel_values).image_embeds.float()
        return emb / torch.linalg.vector_norm(emb, dim=-1, keepdim=True).clamp_min(1e-12)

    def score_embeddings(self, embeds):
        """Normalised embeddings (B, D) -> aesthetic scores float32 (B,)."""
        return self.mlp(embeds.float()).squeeze(-1)

    def __call__(self, images: np.ndarray, prompts: list[str] | None = None) -> np.ndarray:
        import torch

        images = self._check_host_images(images, prompts)
        n = images.shape[0]
        if n == 0:
            return np.zeros((0,), dtype=np.float32)
        step = self.batch_size or n
        chunks = []
        try:
            with torch.no_grad():
                for start in range(0, n, step):
                    pixel_values = self.preprocess(images[start:start + step])
                    scores = self.score_embeddings(self.embed(pixel_values))
                    chunks.append(scores.detach().to("cpu", torch.float32).numpy())
        except RewardError:
            raise
        except Exception as exc:
            raise self._error(f"scoring failed: {type(exc).__name__}: {exc}") from exc
        return np.concatenate(chunks).astype(np.float32, copy=False)

    def __repr__(self) -> str:
        return (
            f"AestheticReward(clip_model={self.clip_model!r}, mlp_path={self.mlp_path!r}, "
            f"device={str(self.device)!r}, dtype={self.dtype})"
        )
