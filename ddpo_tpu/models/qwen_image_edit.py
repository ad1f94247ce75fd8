"""Qwen-Image-Edit-2509 ("edit plus"): Qwen-Image's transformer, VAE and schedule, conditioned on one or more input
images as diffusers' ``QwenImageEditPlusPipeline`` (0.42.1, pipelines/qwenimage/pipeline_qwenimage_edit_plus.py) and
yifan123/flow_grpo's edit script (scripts/train_qwenimage_edit_plus.py and flow_grpo/diffusers_patch/
qwenimage_edit_plus_pipeline_with_logprob.py at 9dcdc35b211205511f171a4f3566e40786575bc3) feed them:

* through the text encoder: each input image resized to ``CONDITION_IMAGE_SIZE`` pixels at its aspect ratio
  (``calculate_dimensions``: sides rounded to 32), named in the prompt as "Picture k: <|vision_start|><|image_pad|>
  <|vision_end|>" before the instruction, the whole in the edit chat template; Qwen2VLProcessor expands each image pad
  to its patch tokens and Qwen2.5-VL's vision tower fills them; the last hidden state past the template's first 64
  tokens (its system part) is the prompt's conditioning;
* through the VAE: each image resized to ``VAE_IMAGE_SIZE`` pixels at its aspect ratio, encoded to its distribution's
  mode, normalised per channel, packed as the generated latents are, and the packed tokens of all images appended
  after the generated ones along the sequence (the RoPE shapes ``img_shapes`` list the generated grid then each
  image's); the transformer's prediction is cut back to the generated tokens.

Which images (flow_grpo: two per row, the reference then the control image, both resized to its square
``config.resolution`` first; its VAE side at 512 x 512 pixels) is the dataset's (prompts/datasets.py); this module
encodes what it is given as the pipeline does. The pipeline samples one prompt at a time; a batch here holds prompts
with the same number of images at the same sizes (one RoPE shape list for the batch), which the dataset reader checks.

The tiny build (``build_tiny_qwen_image_edit``, saved in QwenImageEditPlusPipeline's layout and loaded part by part
with ``from_pretrained``): the tiny Qwen-Image transformer and VAE (models/qwen_image.py), a 1-layer Qwen2.5-VL whose
vision tower is used (patch 14, merge 2), a byte-level tokenizer that spells each of the edit template's words as one
token (its system part is then 74 tokens; the pipeline drops its first 64, ``prompt_template_encode_start_idx``, here
as there) with the vision special tokens, and a Qwen2VLProcessor whose image processor keeps at most 56 x 56 pixels (4
image tokens a picture).
Its VAE side is ``TINY_VAE_IMAGE_SIZE`` (32 x 32 px: 16 packed tokens a picture), the only departure from the
pipeline's constants (tests set the pipeline's to the same value).
"""

from __future__ import annotations

import json
import math
import os
import pathlib
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from ddpo_tpu.models.qwen_image import QwenImageComponents

TINY_QWEN_IMAGE_EDIT_VERSION = "v1"
# pipeline_qwenimage_edit_plus.py: CONDITION_IMAGE_SIZE, VAE_IMAGE_SIZE, prompt_template_encode(_start_idx)
CONDITION_IMAGE_SIZE = 384 * 384
VAE_IMAGE_SIZE = 1024 * 1024
TINY_VAE_IMAGE_SIZE = 32 * 32
# flow_grpo's edit sampler encodes its pictures at 512 x 512 px (qwenimage_edit_plus_pipeline_with_logprob.py:42), not
# the pipeline's 1024 x 1024: 1024 tokens a picture instead of 4096. The family's choice for real checkpoints
FLOW_GRPO_VAE_IMAGE_SIZE = 512 * 512
EDIT_TEMPLATE = ("<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, "
                 "objects, background), then explain how the user's text instruction should alter or modify the "
                 "image. Generate a new image that meets the user's requirements while maintaining consistency with "
                 "the original input where appropriate.<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
                 "<|im_start|>assistant\n")
EDIT_TEMPLATE_START = 64
PICTURE = "Picture {}: <|vision_start|><|image_pad|><|vision_end|>"
_VISION_SPECIALS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>")
# conditioning tokens kept per prompt (the pictures' tokens included): the tiny build's pictures are 4 tokens each
TINY_EDIT_TEXT_TOKENS = 128
# 2 pictures at 384 x 384 are 2 x 196 tokens and flow_grpo's rows add a sentence; its pipeline call's
# max_sequence_length is 512 (which the edit-plus encoder does not apply; a longer prompt is refused here)
EDIT_TEXT_TOKENS = 512


def calculate_dimensions(target_area: int, ratio: float) -> tuple[int, int]:
    """(width, height) of ``target_area`` pixels at aspect ``ratio`` (width / height), sides rounded to multiples of
    32 (the pipeline's own rule, written out: its module is imported only with torch)."""
    width = math.sqrt(target_area * ratio)
    return round(width / 32) * 32, round(width / ratio / 32) * 32


# --------------------------------------------------------------------------------------
# the tiny build
# --------------------------------------------------------------------------------------


def _tiny_image_processor():
    from transformers import Qwen2VLImageProcessor

    # the real processor's patching (14 px patches, 2x2 merged, 2 frames a temporal patch) at toy pixel bounds
    return Qwen2VLImageProcessor(min_pixels=28 * 28, max_pixels=56 * 56, patch_size=14, merge_size=2,
                                 temporal_patch_size=2)


def make_processor(image_processor, tokenizer):
    """A Qwen2VLProcessor of these parts without its video processor. transformers 5 makes every processor attribute
    mandatory, and Qwen2VLVideoProcessor needs torchvision, which this project does not install; image prompts never
    reach the video processor, and the processor's image path (its ``__call__``: patches, grids, each image pad
    expanded to the image's merged patch count) is the class's own."""
    from transformers import Qwen2VLProcessor

    proc = object.__new__(Qwen2VLProcessor)
    proc.image_processor, proc.tokenizer, proc.video_processor, proc.chat_template = (image_processor, tokenizer,
                                                                                      None, None)
    proc.image_token, proc.video_token = "<|image_pad|>", "<|video_pad|>"
    proc.image_token_id = tokenizer.convert_tokens_to_ids(proc.image_token)
    proc.video_token_id = tokenizer.convert_tokens_to_ids(proc.video_token)
    return proc


def build_tiny_qwen_image_edit(out_dir: str | os.PathLike, seed: int = 0) -> pathlib.Path:
    """Build the tiny Qwen-Image-Edit-Plus-shaped pipeline with random (seeded) weights into ``out_dir``
    (QwenImageEditPlusPipeline's layout). Does not touch the caller's global RNG state."""
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline

    from ddpo_tpu.models import qwen_image as q
    from ddpo_tpu.models.wan import _pass_latents_through

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = q._build_tokenizer(EDIT_TEMPLATE + PICTURE.format(1), (*q._SPECIALS, *_VISION_SPECIALS))
    ids = {k: tokenizer.convert_tokens_to_ids(t) for k, t in
           (("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
            ("vision_start_token_id", "<|vision_start|>"))}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = q._build_text_encoder(tokenizer, ids)
        torch.manual_seed(seed + 1)
        transformer = q._build_transformer()
        torch.manual_seed(seed + 2)
        vae = q._build_vae()
        _pass_latents_through(vae.decoder, prefix="QwenImage")
    # QwenImageEditPlusPipeline's folders: Qwen-Image's, and processor/ (the image processor and the tokenizer, as
    # the published checkpoint's). Written without the pipeline's save_pretrained, which would save the processor's
    # video part (see make_processor); model_index.json names the edit pipeline as the checkpoint's does.
    pipe = QwenImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(**q.QWEN_IMAGE_SCHEDULER), vae=vae,
                             text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer)
    pipe.save_pretrained(str(out), safe_serialization=True)
    _tiny_image_processor().save_pretrained(str(out / "processor"))
    tokenizer.save_pretrained(str(out / "processor"))
    index = json.loads((out / "model_index.json").read_text())
    index.update(_class_name="QwenImageEditPlusPipeline", processor=["transformers", "Qwen2VLProcessor"])
    (out / "model_index.json").write_text(json.dumps(index, indent=2))
    return out


def ensure_tiny_qwen_image_edit(cache_dir: str | os.PathLike, seed: int = 0) -> pathlib.Path:
    """``cache_dir/tiny-qwen-image-edit-{version}-seed{seed}``, built atomically on first use."""
    from ddpo_tpu.proc.build_cache import build_once, pipeline_files

    required = (*pipeline_files(("transformer", "vae", "text_encoder", "tokenizer", "scheduler")),
                "processor/preprocessor_config.json")
    return build_once(cache_dir, f"tiny-qwen-image-edit-{TINY_QWEN_IMAGE_EDIT_VERSION}-seed{seed}", required,
                      lambda tmp: build_tiny_qwen_image_edit(tmp, seed=seed))


# --------------------------------------------------------------------------------------
# loading
# --------------------------------------------------------------------------------------


@dataclass
class QwenImageEditComponents(QwenImageComponents):
    processor: object = None  # Qwen2VLProcessor (the pictures' patches and the expanded image pads)


def load_qwen_image_edit(pretrained: str | os.PathLike, revision: str | None = None, local_files_only: bool = True,
                         *, dtype: torch.dtype = torch.float32, vae_dtype: torch.dtype = torch.float32
                         ) -> QwenImageEditComponents:
    """Qwen-Image's parts (models/qwen_image.py::load_qwen_image) and the checkpoint's ``processor/`` (its image
    processor, with the tokenizer of ``tokenizer/``: make_processor)."""
    from transformers import Qwen2VLImageProcessor

    from ddpo_tpu.models.loading import family_load_failure, load_parts
    from ddpo_tpu.models.qwen_image import load_qwen_image

    base = load_qwen_image(pretrained, revision, local_files_only, dtype=dtype, vae_dtype=vae_dtype)
    fail = lambda rev, what, exc: family_load_failure("qwen_image_edit", "Qwen-Image-Edit", "tiny_qwen_image_edit",
                                                      os.fspath(pretrained), rev, what, exc)
    image = load_parts(pretrained, revision, local_files_only, dict(processor=Qwen2VLImageProcessor), {}, fail,
                       "Qwen-Image-Edit")["processor"]
    return QwenImageEditComponents(**vars(base), processor=make_processor(image, base.tokenizer))


# --------------------------------------------------------------------------------------
# the input images, the prompts, the model call
# --------------------------------------------------------------------------------------


def _image_processor(c):
    from diffusers.image_processor import VaeImageProcessor

    return VaeImageProcessor(vae_scale_factor=c.vae_scale_factor * 2)  # the pipeline's (packing: 2 x the VAE's)


def encode_edit_prompts(c, prompts: Sequence[str], images: Sequence[Sequence], device, max_sequence_length: int,
                        condition_area: int = CONDITION_IMAGE_SIZE, fixed_length: bool = False
                        ) -> tuple[Tensor, Tensor]:
    """``(embeds (B, max_sequence_length, width), mask (B, max_sequence_length) int64)`` of prompts, each with its PIL
    input images (``images[i]``: row i's), as QwenImageEditPlusPipeline.__call__ (step 3) and
    ``_get_qwen_prompt_embeds`` encode one: each image resized to ``condition_area`` at its aspect ratio, "Picture k:
    ..." per image before the prompt in the edit template, the processor's ids and patches through Qwen2.5-VL, the last
    hidden state past the first 64 tokens; then zeros and mask 0 up to ``max_sequence_length``.

    The rows go through the encoder as one batch, padded on the right: a row's real tokens come first and (causal
    attention; Qwen2.5-VL's mrope positions counted over each row's real tokens, ``get_rope_index``) do not see the
    padding, so each row's kept states are the pipeline's single-prompt ones, which it encodes unpadded. Padded to
    the batch's longest row (``fixed_length`` False: eager, where the padding would cost time) or to exactly
    ``64 + max_sequence_length`` tokens (``fixed_length``: a runtime that compiles graphs, where each new longest
    prompt would be a new encoder graph; measured on XLA CPU, docs/families.md). The states are cut by slicing, not by
    the mask (a boolean index has a data-dependent shape)."""

    proc = _image_processor(c)
    texts, cond = [], []
    for prompt, row in zip(prompts, images):
        for img in row:
            w, h = calculate_dimensions(condition_area, img.size[0] / img.size[1])
            cond.append(proc.resize(img, h, w))
        texts.append(EDIT_TEMPLATE.format("".join(PICTURE.format(k + 1) for k in range(len(row))) + prompt))
    length = EDIT_TEMPLATE_START + max_sequence_length
    inputs = c.processor(text=texts, images=cond or None, padding="max_length" if fixed_length else "longest",
                         max_length=length if fixed_length else None, padding_side="right", return_tensors="pt")
    real = inputs["attention_mask"].sum(1) - EDIT_TEMPLATE_START  # on the host: the processor's own tensors
    for prompt, row, n in zip(prompts, images, real.tolist()):
        if n > max_sequence_length:
            raise ValueError(f"the prompt {prompt[:60]!r} with its {len(row)} picture(s) is {n} conditioning tokens, "
                             f"more than the family's {max_sequence_length}: shorten it or use smaller input images")
    inputs = inputs.to(device)
    out = c.text_encoder(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                         pixel_values=inputs.get("pixel_values"), image_grid_thw=inputs.get("image_grid_thw"),
                         output_hidden_states=True)
    hidden = out.hidden_states[-1][:, EDIT_TEMPLATE_START:length]
    mask = inputs["attention_mask"][:, EDIT_TEMPLATE_START:length]
    pad = max_sequence_length - hidden.shape[1]  # 0 when fixed_length
    if pad > 0:
        hidden = torch.nn.functional.pad(hidden, (0, 0, 0, pad))
        mask = torch.nn.functional.pad(mask, (0, pad))
    embeds = hidden * mask[..., None].to(hidden.dtype)  # the padding's states are zeros, as the pipeline pads
    return embeds.to(c.text_encoder.dtype), mask.long()


def encode_edit_prompt(c, prompt: str, images: Sequence, device, max_sequence_length: int,
                       condition_area: int = CONDITION_IMAGE_SIZE, fixed_length: bool = False
                       ) -> tuple[Tensor, Tensor]:
    """``(embeds (max_sequence_length, width), mask (max_sequence_length,))`` of one prompt with its PIL input images
    (encode_edit_prompts of one row: unpadded unless ``fixed_length``, as the pipeline encodes it)."""
    e, m = encode_edit_prompts(c, [prompt], [images], device, max_sequence_length, condition_area, fixed_length)
    return e[0], m[0]


def encode_edit_images(c, images: Sequence, device, vae_area: int = VAE_IMAGE_SIZE) -> tuple[Tensor, list]:
    """``(packed image latents (1, sum of the images' tokens, 64), [(1, rows, columns) per image])`` as the pipeline's
    step 3 and ``prepare_latents``: each image resized to ``vae_area`` at its aspect ratio and normalised to [-1, 1],
    encoded to the VAE distribution's mode (``sample_mode="argmax"``), ``(z - latents_mean) / latents_std``, packed
    into 2x2 tokens; the images' tokens in order along the sequence."""
    from ddpo_tpu.models.flux import pack_latents

    proc, vae = _image_processor(c), c.vae
    z_dim = vae.config.z_dim
    packed, shapes = [], []
    for img in images:
        w, h = calculate_dimensions(vae_area, img.size[0] / img.size[1])
        x = proc.preprocess(img, h, w).unsqueeze(2).to(device, vae.dtype)
        z = vae.encode(x).latent_dist.mode()
        mean = torch.tensor(vae.config.latents_mean).view(1, z_dim, 1, 1, 1).to(z.device, z.dtype)
        std = torch.tensor(vae.config.latents_std).view(1, z_dim, 1, 1, 1).to(z.device, z.dtype)
        z = ((z - mean) / std)[:, :, 0]
        packed.append(pack_latents(z))
        shapes.append((1, z.shape[-2] // 2, z.shape[-1] // 2))
    return torch.cat(packed, dim=1), shapes


def edit_velocity(transformer, packed: Tensor, image_latents: Tensor, timestep: Tensor, embeds: Tensor, mask: Tensor,
                  shapes: list, neg_embeds: Tensor | None = None, neg_mask: Tensor | None = None,
                  guidance_scale: float = 1.0, detach_uncond: bool = False) -> Tensor:
    """The velocity of the generated tokens: the transformer on ``[generated, image latents]`` along the sequence
    (``shapes``: one list a row, the generated grid first), cut back to the generated tokens (the pipeline's
    ``noise_pred[:, : latents.size(1)]``). Guidance as Qwen-Image's (models/qwen_image.py::qwen_velocity): its
    rescaling is per token, so cutting after it equals the reference's cut before it."""
    from ddpo_tpu.models.qwen_image import qwen_velocity

    n = packed.shape[1]
    x = torch.cat([packed, image_latents.to(packed.dtype)], dim=1)
    return qwen_velocity(transformer, x, timestep, embeds, mask, shapes, neg_embeds, neg_mask, guidance_scale,
                         detach_uncond)[:, :n]
