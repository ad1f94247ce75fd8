"""HPSv2 (Wu et al. 2023, Human Preference Score v2; v2.1 by default, v2.0 by ``version``) as Flow-GRPO and
DiffusionNFT reward with it: an open_clip ViT-H/14 fine-tuned on human preferences.

For prompt p and image x (yifan123/flow_grpo@94e23ee flow_grpo/hpsv2_scorer.py ``HPSv2RewardInferencer.reward``;
NVlabs/DiffusionNFT@24af555 flow_grpo/hpsv2_scorer.py ``HPSv2Scorer.__call__``)::

    v = encode_image(preprocess(x)) / ||.||,   t = encode_text(tokenize(p)) / ||.||
    score = <v, t>                                # the diagonal of image_features @ text_features.T: a cosine

No logit scale and no rescaling: the raw cosine (typically ~0.2-0.35 for HPS v2.1) is the reward.

Preprocessing, the reference's ``preprocess_val`` (``create_model_and_transforms(..., light_augmentation=True)``
-> ``image_transform(224, is_train=False, resize_longest_max=True)``; tgxs002/HPSv2@866735e
hpsv2/src/open_clip/transform.py 26-48 ``ResizeMaxSize``, 135-152, factory.py 368-376): the uint8 image as float
in [0, 1] (``ToTensor``); scale = 224 / max(H, W); unless scale == 1, resize to (round(H * scale), round(W * scale))
with torchvision's tensor bicubic (torchvision 0.21, flow_grpo's pin: ``interpolate(mode="bicubic",
align_corners=False, antialias=True)``, no clamping of float images) and pad with 0 (black) to 224 x 224, the
extra row / column going to the bottom / right (``F.pad([pad_w // 2, pad_h // 2, pad_w - pad_w // 2, pad_h - pad_h
// 2])``); then OpenAI CLIP's mean/std. One difference, on purpose: an image whose longest side already is 224
but is not square is padded here; the reference skips the pad for it (scale == 1) and its ViT then fails.

Model: transformers' ``CLIPModel`` (the PickScore path) holding the released open_clip checkpoint, converted by
``ddpo_tpu/rewards/open_clip_convert.py`` (key map and why the forward passes agree are there). Decision: no
``open_clip_torch`` -- it needs torchvision and timm beside torch, the reference's vendored open_clip is an older
fork anyway, and a CLIP forward already exists here; ``tests/unit/rewards/test_hpsv2.py`` checks the converted model
against open_clip's forward written out from HPSv2@866735e's code.

Tokens: ``CLIPTokenizer`` (``laion/CLIP-ViT-H-14-laion2B-s32B-b79K``: the OpenAI BPE vocabulary open_clip's
``SimpleTokenizer`` uses), <start> + BPE + <end>, cut to 77 with <end> kept last and padded to 77 as the reference's
``tokenize``; the padding id differs (0 there) and cannot matter (causal attention; features taken at <end>). HTML
entities are unescaped as open_clip's ``basic_clean`` does; its ``ftfy.fix_text`` (mojibake repair) is not applied.
Checked once (not in CI: the BPE file is HPSv2's): a CLIPTokenizer built from HPSv2@866735e's
bpe_simple_vocab_16e6.txt.gz gives open_clip's ids for all 1981 ASCII prompts of flow_grpo's
dataset/pickscore/test.txt (79 of them cut at 77; without the unescaping one, "&#128104, emoji style...", differed).

Precision: float32, as DiffusionNFT (flow_grpo wraps the forward in CUDA fp16 autocast; its scores differ from
float32 ones by fp16 rounding). Runs on ``device`` (the host CPU by default, a CUDA device when the run has one) in
chunks of exactly ``batch_size`` images (the last chunk is filled with copies and the copies' scores dropped), text
always 77 tokens: fixed shapes for accelerators.

Weights: ``checkpoint`` is the path of ``HPS_v2.1_compressed.pt`` (or ``HPS_v2_compressed.pt``); null looks it up in
the Hugging Face cache as the reference's ``hf_hub_download("xswu/HPSv2", ...)`` does (``hf download xswu/HPSv2
HPS_v2.1_compressed.pt`` puts it there). ``architecture`` names the open_clip model, ``ViT-H-14`` (or the path of
an open_clip model-config JSON). With ``checkpoint=tiny`` (conf/reward_local/hpsv2_tiny*.yaml) a tiny random-weight
checkpoint in the same layout stands in (``ddpo_tpu/rewards/tiny_hpsv2.py``), loaded through this same code.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

import numpy as np

from ddpo_tpu.catalog.rewards import HPSV2_FILES  # flow_grpo's hps_version_map: version -> file in xswu/HPSv2
from ddpo_tpu.rewards.base import Metadata, Reward, register_reward

__all__ = ["HPSV2_REPO", "HPSV2_FILES", "HPSV2_TOKENIZER", "OPENAI_MEAN", "OPENAI_STD", "HPSv2Reward",
           "hpsv2_pixels", "resolve_checkpoint"]

_NAME = "hpsv2"
HPSV2_REPO = "xswu/HPSv2"
HPSV2_TOKENIZER = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"
# open_clip constants.py OPENAI_DATASET_MEAN / _STD (HPSv2@866735e)
OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)
CONTEXT_LENGTH = 77


def resolve_checkpoint(checkpoint: str | None, version: str) -> str | None:
    """The checkpoint file: the given path, or with null the reference's file for ``version`` in the Hugging Face
    cache; None when it is not there."""
    if checkpoint is not None:
        path = Path(checkpoint).expanduser()
        return str(path) if path.is_file() else None
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(HPSV2_REPO, HPSV2_FILES[version])
    return found if isinstance(found, str) and Path(found).is_file() else None


def hpsv2_pixels(images: np.ndarray, size: int):
    """uint8 (B, H, W, 3) -> float32 (B, 3, size, size): HPSv2's resize-longest-side + pad + OpenAI mean/std."""
    import torch
    import torch.nn.functional as F

    x = torch.from_numpy(np.ascontiguousarray(images)).permute(0, 3, 1, 2).to(torch.float32).div(255)
    h, w = x.shape[-2:]
    scale = size / float(max(h, w))
    if scale != 1.0:
        nh, nw = round(h * scale), round(w * scale)   # Python's round, as ResizeMaxSize
        x = F.interpolate(x, size=(nh, nw), mode="bicubic", align_corners=False, antialias=True)
    else:
        nh, nw = h, w
    pad_h, pad_w = size - nh, size - nw
    if pad_h or pad_w:   # torch's pad order: (left, right, top, bottom)
        x = F.pad(x, (pad_w // 2, pad_w - pad_w // 2, pad_h // 2, pad_h - pad_h // 2), value=0.0)
    mean = torch.tensor(OPENAI_MEAN, dtype=torch.float32).view(-1, 1, 1)
    std = torch.tensor(OPENAI_STD, dtype=torch.float32).view(-1, 1, 1)
    return x.sub(mean).div(std)


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def _local_or_hub(name: str) -> str:
    path = Path(name).expanduser()
    return str(path) if path.exists() else name


def _projected(features: Any):
    """transformers < 5 returns the projected embeddings; 5.x an output whose pooler_output holds them."""
    import torch

    return features if torch.is_tensor(features) else features.pooler_output


@register_reward(_NAME)
class HPSv2Reward(Reward):
    """cos(image features, text features) of HPSv2's CLIP per (image, its prompt); float32 (B,)."""

    name = _NAME

    def __init__(
        self,
        checkpoint: str | None = None,
        version: str = "v2.1",
        architecture: str = "ViT-H-14",
        tokenizer: str = HPSV2_TOKENIZER,
        local_files_only: bool = True,
        device: Any = "cpu",
        batch_size: int | None = None,
    ):
        import torch
        from transformers import CLIPTokenizer

        from ddpo_tpu.rewards.open_clip_convert import (OpenClipConversionError, clip_model_from_open_clip,
                                                        load_open_clip_config, open_clip_state_dict)

        if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int)
                                       or batch_size < 1):
            raise self._error(f"reward.batch_size={batch_size!r}: must be a positive integer or null")
        if version not in HPSV2_FILES:
            raise self._error(f"reward.version={version!r}: one of {sorted(HPSV2_FILES)}")
        self.version, self.batch_size, self.device = version, batch_size, torch.device(device)
        path = resolve_checkpoint(checkpoint, version)
        if path is None:
            raise self._error(
                f"reward.checkpoint={checkpoint if checkpoint is not None else 'null'}: "
                + ("file not found" if checkpoint is not None else f"{HPSV2_FILES[version]} is not in the Hugging "
                   "Face cache") + f". Fix: download it once (hf download {HPSV2_REPO} {HPSV2_FILES[version]}) and "
                "leave reward.checkpoint=null, or set reward.checkpoint=PATH")
        self.checkpoint, self.architecture_name, self.tokenizer_name = path, architecture, tokenizer
        try:
            self.tokenizer = CLIPTokenizer.from_pretrained(_local_or_hub(tokenizer), local_files_only=local_files_only)
        except Exception as exc:
            raise self._error(
                f"reward.tokenizer={tokenizer!r} cannot be loaded as a CLIPTokenizer ({_first_line(exc)}). Fix: "
                f"download it once (hf download {HPSV2_TOKENIZER} --include '*.json' '*.txt') or point "
                "reward.tokenizer at a local directory with its tokenizer files") from None
        try:
            oc_config = load_open_clip_config(architecture)
            sd = open_clip_state_dict(path)
            model = clip_model_from_open_clip(sd, oc_config, self.tokenizer)
        except OpenClipConversionError as exc:
            raise self._error(f"reward.checkpoint={path!r} with reward.architecture={architecture!r}: {exc}") from None
        except Exception as exc:
            raise self._error(f"reward.checkpoint={path!r} cannot be loaded ({_first_line(exc)}). Fix: point it "
                              f"at {HPSV2_FILES[version]} from {HPSV2_REPO}") from None
        del sd
        self.model = model.to(device=self.device, dtype=torch.float32).eval().requires_grad_(False)
        self.image_size = int(self.model.config.vision_config.image_size)

    # -- pieces ----------------------------------------------------------------------------------------

    def tokens(self, prompts: list[str]):
        """(B, 77) int64: <start> + BPE + <end>, cut to 77 with <end> last, padded to 77 (the reference's shape).
        HTML entities are unescaped twice first, as open_clip's ``basic_clean`` does ("&#128104" is one character)."""
        cleaned = [html.unescape(html.unescape(p)).strip() for p in prompts]
        return self.tokenizer(cleaned, padding="max_length", truncation=True, max_length=CONTEXT_LENGTH,
                              return_tensors="pt")["input_ids"]

    def image_embeddings(self, images: np.ndarray):
        """uint8 (B, H, W, 3) -> unit-norm image features, float32 (B, D) on ``device``."""
        import torch

        pixels = hpsv2_pixels(images, self.image_size).to(self.device)
        with torch.no_grad():
            emb = _projected(self.model.get_image_features(pixel_values=pixels))
        return emb / emb.norm(p=2, dim=-1, keepdim=True)

    def text_embeddings(self, prompts: list[str]):
        """B prompts -> unit-norm text features, float32 (B, D) on ``device``."""
        import torch

        with torch.no_grad():   # ids only: no padding mask, as open_clip (causal; pooled at <end>)
            emb = _projected(self.model.get_text_features(input_ids=self.tokens(prompts).to(self.device)))
        return emb / emb.norm(p=2, dim=-1, keepdim=True)

    def _score_chunk(self, images: np.ndarray, prompts: list[str]) -> np.ndarray:
        import torch

        with torch.no_grad():
            return (self.image_embeddings(images) * self.text_embeddings(prompts)).sum(dim=-1).float().cpu().numpy()

    def __call__(self, images: np.ndarray, prompts: list[str], metadata: Metadata = None) -> np.ndarray:
        return self._score_in_chunks(images, prompts, self.batch_size, self._score_chunk, "HPSv2",
                                     fixed_shape=True)

    def __repr__(self) -> str:
        return (f"HPSv2Reward(version={self.version!r}, checkpoint={self.checkpoint!r}, "
                f"architecture={self.architecture_name!r}, device={str(self.device)!r})")
