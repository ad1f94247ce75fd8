"""ImageReward v1.0 (Xu et al. 2023): BLIP + an MLP head trained on human preferences, as Flow-GRPO rewards with it.

flow_grpo (yifan123/flow_grpo@ac4c86e flow_grpo/imagereward_scorer.py, rewards.py ``imagereward_score``) rounds its
[0, 1] images to uint8, makes PIL images and calls the ``image-reward`` package's ``inference_rank(prompt, [image])``
once per (prompt, image) in float32: the score of each image with its own prompt is (THUDM/ImageReward@c1392c6
ImageReward/ImageReward.py)::

    text  = BertTokenizer(bert-base-uncased + BLIP's [DEC], [ENC])(prompt, padding="max_length", truncation=True,
                                                                    max_length=35)     # [CLS] ... [SEP] [PAD]...
    image = Normalize(BLIP mean/std)(ToTensor(CenterCrop(224)(Resize(224, BICUBIC)(pil.convert("RGB")))))
    v     = ViT-L/16(image)                                       # every token, after the final LayerNorm
    h     = BERT(text, cross-attending to v)[:, 0]                # the [CLS] state
    score = (MLP(h) - 0.16717362830052426) / 1.0333394966054072

That package (2023) no longer runs on current transformers, so the model is rebuilt on transformers' BLIP classes
(``imagereward_model.py``: what each layer is, why they match, and the converter from the released checkpoint's key
names) and fed here exactly as the reference feeds it: PIL's bicubic resize of the shortest edge (torchvision's
Resize on a PIL image is PIL's ``Image.resize``; the long edge ``int(size * long / short)``), the centre crop at
torchvision's offsets (``int(round((h - size) / 2))``), /255, BLIP's mean/std. torchvision itself is not needed.
Images are scored in batches (``batch_size`` per forward, the last chunk padded to it so every forward has one
shape); the reference's one-image forwards give the same numbers to float32 rounding
(tests/unit/rewards/test_imagereward.py).

Files (offline; ``hf download THUDM/ImageReward ImageReward.pt med_config.json --local-dir DIR``):

* ``checkpoint`` -- ImageReward.pt, the released state dict (1.7 GB);
* ``med_config`` -- its med_config.json (null: the one beside the checkpoint);
* ``tokenizer`` -- bert-base-uncased's tokenizer (hub id or local dir; ``hf download bert-base-uncased
  --include "*.txt" "*.json"``); BLIP's two added tokens are added on load as blip.py ``init_tokenizer`` does.

The model runs in float32 on ``device``: the host CPU by default, a CUDA device when the run trains on one
(``reward_from_config`` passes it, as for PickScore). With ``reward.checkpoint=tiny`` (conf/reward_local/
imagereward_tiny*.yaml) a tiny random-weight model in the released layout stands in
(``ddpo_tpu/rewards/tiny_imagereward.py``), loaded through this same code.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ddpo_tpu.rewards.base import Metadata, Reward, register_reward

__all__ = ["IMAGEREWARD_HUB", "TEXT_MAX_LENGTH", "BLIP_MEAN", "BLIP_STD", "ImageRewardReward", "preprocess",
           "resize_and_crop"]

_NAME = "imagereward"
IMAGEREWARD_HUB = "THUDM/ImageReward"
IMAGEREWARD_DOWNLOAD = f"hf download {IMAGEREWARD_HUB} ImageReward.pt med_config.json --local-dir DIR"
TOKENIZER = "bert-base-uncased"
TEXT_MAX_LENGTH = 35  # ImageReward.py: padding="max_length", truncation=True, max_length=35
# ImageReward.py _transform: Normalize((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711))
BLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
BLIP_STD = (0.26862954, 0.26130258, 0.27577711)
BLIP_ADDED_TOKENS = ({"bos_token": "[DEC]"}, {"additional_special_tokens": ["[ENC]"]})  # blip.py init_tokenizer


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def resize_and_crop(image: np.ndarray, size: int) -> np.ndarray:
    """uint8 (H, W, 3) -> uint8 (size, size, 3): Resize(size, BICUBIC) then CenterCrop(size) on a PIL image."""
    from PIL import Image

    pil = Image.fromarray(np.ascontiguousarray(image)).convert("RGB")
    w, h = pil.size
    short, long = (w, h) if w <= h else (h, w)
    new_short, new_long = size, int(size * long / short)
    new_w, new_h = (new_short, new_long) if w <= h else (new_long, new_short)
    if (new_w, new_h) != (w, h):
        pil = pil.resize((new_w, new_h), Image.BICUBIC)
    top, left = int(round((new_h - size) / 2.0)), int(round((new_w - size) / 2.0))
    return np.asarray(pil.crop((left, top, left + size, top + size)))


def preprocess(images: np.ndarray, size: int) -> np.ndarray:
    """uint8 (B, H, W, 3) -> float32 (B, 3, size, size), normalised with BLIP's mean/std."""
    out = np.stack([resize_and_crop(im, size) for im in images]).astype(np.float32) / 255.0
    out = (out - np.asarray(BLIP_MEAN, np.float32)) / np.asarray(BLIP_STD, np.float32)
    return np.ascontiguousarray(out.transpose(0, 3, 1, 2))


@register_reward(_NAME)
class ImageRewardReward(Reward):
    """ImageReward v1.0's normalised score per (image, its prompt); float32 (B,)."""

    name = _NAME

    def __init__(
        self,
        checkpoint: str | None = None,
        med_config: str | None = None,
        tokenizer: str = TOKENIZER,
        batch_size: int | None = None,
        local_files_only: bool = True,
        device: Any = "cpu",
    ):
        import torch
        from transformers import BertTokenizer

        from ddpo_tpu.rewards.imagereward_model import load_imagereward

        if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int)
                                       or batch_size < 1):
            raise self._error(f"reward.batch_size={batch_size!r}: must be a positive integer or null")
        if not checkpoint:
            raise self._error(f"reward.checkpoint is required: ImageReward.pt ({IMAGEREWARD_DOWNLOAD}, then "
                              "reward.checkpoint=DIR/ImageReward.pt)")
        ckpt = Path(checkpoint).expanduser()
        med = Path(med_config).expanduser() if med_config else ckpt.parent / "med_config.json"
        self.checkpoint, self.med_config, self.tokenizer_name = str(ckpt), str(med), tokenizer
        self.batch_size = batch_size
        self.device = torch.device(device)
        try:
            model = load_imagereward(ckpt, med)
        except Exception as exc:
            raise self._error(
                f"reward.checkpoint={checkpoint!r} with med_config {str(med)!r} cannot be loaded as ImageReward "
                f"({_first_line(exc)}). Fix: {IMAGEREWARD_DOWNLOAD} and point reward.checkpoint at "
                "DIR/ImageReward.pt") from None
        tok_src = str(Path(tokenizer).expanduser()) if Path(tokenizer).expanduser().exists() else tokenizer
        try:
            tok = BertTokenizer.from_pretrained(tok_src, local_files_only=local_files_only)
        except Exception as exc:
            raise self._error(
                f"reward.tokenizer={tokenizer!r} cannot be loaded as a BertTokenizer ({_first_line(exc)}). Fix: "
                f"hf download {TOKENIZER} --include '*.txt' '*.json', or point reward.tokenizer at a local "
                "directory with its vocab.txt") from None
        for tokens in BLIP_ADDED_TOKENS:
            tok.add_special_tokens(tokens)
        if len(tok) > model.arch.text["vocab_size"]:
            raise self._error(f"reward.tokenizer={tokenizer!r} has {len(tok)} tokens with BLIP's two added, more "
                              f"than the checkpoint's {model.arch.text['vocab_size']} embeddings: not its tokenizer")
        self.tokenizer = tok
        self.image_size = model.arch.image_size
        self.model = model.to(device=self.device, dtype=torch.float32)

    # -- pieces ----------------------------------------------------------------------------------------

    def tokens(self, prompts: list[str]) -> dict:
        """B prompts -> input_ids / attention_mask (B, 35), as ImageReward.py tokenises one prompt."""
        t = self.tokenizer(list(prompts), padding="max_length", truncation=True, max_length=TEXT_MAX_LENGTH,
                           return_tensors="pt")
        return {"input_ids": t["input_ids"], "attention_mask": t["attention_mask"]}

    def _score_chunk(self, images: np.ndarray, prompts: list[str]) -> np.ndarray:
        import torch

        n = len(prompts)
        if self.batch_size is not None and n < self.batch_size:  # one shape for every forward: pad, then drop
            pad = self.batch_size - n
            images = np.concatenate([images, np.repeat(images[-1:], pad, axis=0)])
            prompts = prompts + [prompts[-1]] * pad
        pixels = torch.from_numpy(preprocess(images, self.image_size)).to(self.device)
        tokens = {k: v.to(self.device) for k, v in self.tokens(prompts).items()}
        with torch.no_grad():
            scores = self.model(pixels, tokens["input_ids"], tokens["attention_mask"])
        return scores[:n].float().cpu().numpy()

    def __call__(self, images: np.ndarray, prompts: list[str], metadata: Metadata = None) -> np.ndarray:
        return self._score_in_chunks(images, prompts, self.batch_size, self._score_chunk, "ImageReward",
                                     fixed_shape=True)

    def __repr__(self) -> str:
        return (f"ImageRewardReward(checkpoint={self.checkpoint!r}, tokenizer={self.tokenizer_name!r}, "
                f"device={str(self.device)!r})")
