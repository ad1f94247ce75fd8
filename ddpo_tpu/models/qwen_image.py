"""The Qwen-Image family: loading its components through ``from_pretrained``, prompt encoding with Qwen2.5-VL, packed
latents, the schedule, the guided transformer call with its true-CFG norm rescaling, decoding, and a tiny
Qwen-Image-shaped build -- each as diffusers' ``QwenImagePipeline`` (0.42) holds and calls them and as
yifan123/flow_grpo's Qwen-Image code samples and trains with them (``flow_grpo/diffusers_patch/
qwenimage_pipeline_with_logprob.py`` and ``scripts/train_qwenimage.py``, upstream history as mirrored by
zhtmike/flow_grpo at 9745241; added in 4b13ec7, KL fixed in 27b6ef8).

Components (as in Qwen/Qwen-Image): ``QwenImageTransformer2DModel`` (60 double-stream MMDiT blocks, 3072 wide = 24
heads of 128, joint attention over [text, image] tokens with a text mask, RoPE over (frame, row, column)),
``AutoencoderKLQwenImage`` (Wan 2.1's causal VAE run on one frame: 16 latent channels, 8x spatial; latents are
normalised per channel with ``latents_mean`` / ``latents_std``), ``Qwen2_5_VLForConditionalGeneration`` (Qwen2.5-VL
7B Instruct: the last hidden state of a chat-templated prompt, its system part dropped) + ``Qwen2Tokenizer``, and
``FlowMatchEulerDiscreteScheduler`` with dynamic, exponential shifting (``mu`` from the image's token count, FLUX's
``calculate_shift`` with Qwen-Image's base/max shift 0.5/0.9 over 256..8192 tokens, ``shift_terminal`` 0.02).

Latents are packed as FLUX's (2x2 patches as tokens of 4 x 16 channels, ``models/flux.py::pack_latents``); RoPE
positions come from ``img_shapes`` [(1, h/2, w/2)] and the text length, so there are no position ids to keep.

Prompts are padded to ``TEXT_TOKENS`` with the mask saying which tokens are real (flow_grpo pads to the longest prompt
of its batch): the transformer masks the padding out of the joint attention (diffusers >= 0.36) and the text RoPE
positions of real tokens do not depend on the padded length, so a fixed length changes nothing but the shapes (which
every batch of a run then shares: trajectories and compiled steps need that). A prompt longer than ``TEXT_TOKENS``
Qwen tokens is cut there (flow_grpo keeps up to its max_sequence_length, 512).

The tiny build (``build_tiny_qwen_image`` / ``ensure_tiny_qwen_image``, version ``TINY_QWEN_IMAGE_VERSION``: bump it
whenever anything below changes) is saved exactly like a real checkpoint (``QwenImagePipeline.save_pretrained``):

* QwenImageTransformer2DModel with Qwen-Image's block kind at toy widths: 2 blocks, 2 heads of 16 (RoPE axes 4 + 6 +
  6), 64 packed channels, joint_attention_dim 32 (the tiny text encoder's width).
* AutoencoderKLQwenImage at base_dim 8 with 3 levels (temporal downsampling [False, True]; Qwen-Image has 4 levels,
  8x): 4x spatial, so 32x32 RGB <-> 16 x 8 x 8 latents = 16 packed tokens, the tiny FLUX's count. The decoder's
  residual branches start at zero (as the tiny Wan's), so images follow the latents and a reward can be raised.
* Qwen2_5_VLForConditionalGeneration built from a Qwen2_5_VLConfig at toy widths (text: 1 layer, width 32, 2 heads,
  1 KV head, mrope sections 2 + 3 + 3; vision: 1 block of width 16, unused by text prompts, present because the class
  and QwenImagePipeline hold one): the real class, so prompts go through Qwen2.5-VL's own forward, masks and mrope.
* Qwen2Tokenizer: byte-level BPE over the 256 byte symbols plus merges that spell each word of Qwen-Image's prompt
  template as one token, and the chat special tokens: the template's system part is 34 tokens, as with the real
  tokenizer, so the pipeline's ``prompt_template_encode_start_idx`` drops exactly it; prompts are spelled byte by byte.
* FlowMatchEulerDiscreteScheduler with Qwen-Image's scheduler config (``QWEN_IMAGE_SCHEDULER``).
"""

from __future__ import annotations

import os
import pathlib
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from ddpo_tpu.models.loading import ModelLoadError, family_load_failure, frozen
from ddpo_tpu.models.vae_ops import xla_safe_vae

TINY_QWEN_IMAGE_VERSION = "v1"
# Qwen/Qwen-Image scheduler/scheduler_config.json (the keys that decide its sigmas and timesteps)
QWEN_IMAGE_SCHEDULER = dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5,
                            max_shift=0.9, base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02,
                            time_shift_type="exponential")
TEXT_TOKENS = 128  # prompt tokens kept after the template's system part (see the module docstring)
NEGATIVE_PROMPT = " "  # flow_grpo's negative_prompt for Qwen-Image (train_qwenimage.py: [" "] * len(prompts))
_TINY_TEXT_WIDTH = 32
_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


# --------------------------------------------------------------------------------------
# the tiny build
# --------------------------------------------------------------------------------------


def _template_words(template: str, specials: Sequence[str] = _SPECIALS) -> list[str]:
    """The template's pre-tokens (Qwen2's split regex, byte-level symbols) longer than one symbol, in order."""
    import regex
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    from ddpo_tpu.models.tiny import _bytes_to_unicode

    b2u = _bytes_to_unicode()
    words: list[str] = []
    for part in regex.split("|".join(regex.escape(s) for s in specials), template):
        for w in regex.findall(PRETOKENIZE_REGEX, part):
            sym = "".join(b2u[b] for b in w.encode())
            if len(sym) > 1 and sym not in words:
                words.append(sym)
    return words


def _build_tokenizer(template: str, specials: Sequence[str] = _SPECIALS):
    """``specials``: the chat tokens (and, for Qwen-Image-Edit, the vision ones), each one token."""
    from transformers import Qwen2Tokenizer

    from ddpo_tpu.models.tiny import _bytes_to_unicode

    vocab = {s: i for i, s in enumerate(_bytes_to_unicode().values())}
    merges = []
    for word in _template_words(template, specials):  # each word one token: a chain of merges through its prefixes
        for k in range(2, len(word) + 1):
            if word[:k] not in vocab:
                vocab[word[:k]] = len(vocab)
                merges.append((word[:k - 1], word[k - 1]))
    for s in specials:
        vocab[s] = len(vocab)
    return Qwen2Tokenizer(vocab=vocab, merges=merges, unk_token=None, eos_token="<|im_end|>",
                          pad_token="<|endoftext|>", additional_special_tokens=list(specials[1:]),
                          model_max_length=32768)


def _build_text_encoder(tokenizer, vision_ids: dict | None = None):
    """``vision_ids``: the image/video/vision-start token ids (Qwen-Image-Edit reads images through the vision tower);
    None: ids outside the vocabulary (text prompts never hold them)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    n = len(tokenizer)
    ids = vision_ids or dict(image_token_id=n, video_token_id=n + 1, vision_start_token_id=n + 2)
    text = dict(vocab_size=n, hidden_size=_TINY_TEXT_WIDTH, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048, rms_norm_eps=1e-6,
                rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}, tie_word_embeddings=False,
                bos_token_id=None, eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
                pad_token_id=tokenizer.pad_token_id)
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=_TINY_TEXT_WIDTH,
                  patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                  fullatt_block_indexes=[0])
    return Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids))


def _build_transformer():
    from diffusers import QwenImageTransformer2DModel

    return QwenImageTransformer2DModel(
        patch_size=2, in_channels=64, out_channels=16,  # packed 2x2 patches of 16 channels, as Qwen-Image
        num_layers=2, attention_head_dim=16, num_attention_heads=2,  # Qwen-Image: 60 blocks of 24 heads x 128
        joint_attention_dim=_TINY_TEXT_WIDTH, axes_dims_rope=(4, 6, 6),
    )


def _build_vae():
    from diffusers import AutoencoderKLQwenImage

    return AutoencoderKLQwenImage(base_dim=8, z_dim=16, dim_mult=[1, 2, 4], num_res_blocks=1,
                                  temperal_downsample=[False, True])


def build_tiny_qwen_image(out_dir: str | os.PathLike, seed: int = 0) -> pathlib.Path:
    """Build the tiny Qwen-Image-shaped pipeline with random (seeded) weights into ``out_dir`` (QwenImagePipeline's
    layout). Does not touch the caller's global RNG state."""
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline

    from ddpo_tpu.models.wan import _pass_latents_through

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _build_tokenizer(PROMPT_TEMPLATE)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = _build_text_encoder(tokenizer)
        torch.manual_seed(seed + 1)
        transformer = _build_transformer()
        torch.manual_seed(seed + 2)
        vae = _build_vae()
        _pass_latents_through(vae.decoder, prefix="QwenImage")  # Wan's VAE blocks under Qwen-Image's names
    pipe = QwenImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER), vae=vae,
                             text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer)
    pipe.save_pretrained(str(out), safe_serialization=True)
    return out


def ensure_tiny_qwen_image(cache_dir: str | os.PathLike, seed: int = 0) -> pathlib.Path:
    """``cache_dir/tiny-qwen-image-{version}-seed{seed}``, built atomically on first use (proc/build_cache.py)."""
    from ddpo_tpu.catalog import family
    from ddpo_tpu.proc.build_cache import build_once, pipeline_files

    required = pipeline_files(family("qwen_image").subfolders)  # the catalog's list, as the loader checks
    return build_once(cache_dir, f"tiny-qwen-image-{TINY_QWEN_IMAGE_VERSION}-seed{seed}", required,
                      lambda tmp: build_tiny_qwen_image(tmp, seed=seed))


# --------------------------------------------------------------------------------------
# loading
# --------------------------------------------------------------------------------------


@dataclass
class QwenImageComponents:
    transformer: object   # QwenImageTransformer2DModel
    vae: object           # AutoencoderKLQwenImage
    text_encoder: object  # Qwen2_5_VLForConditionalGeneration
    tokenizer: object     # Qwen2Tokenizer
    scheduler: object     # FlowMatchEulerDiscreteScheduler (dynamic, exponential shifting)

    @property
    def vae_scale_factor(self) -> int:
        """Pixels per latent pixel: 2 ** len(temperal_downsample), as QwenImagePipeline computes it."""
        return 2 ** len(self.vae.config.temperal_downsample)


def _load_failure(pretrained: str, revision: str | None, what: str, exc: BaseException | None = None) -> ModelLoadError:
    return family_load_failure("qwen_image", "Qwen-Image", "tiny_qwen_image", pretrained, revision, what, exc)


def load_qwen_image(pretrained: str | os.PathLike, revision: str | None = None, local_files_only: bool = True, *,
                    dtype: torch.dtype = torch.float32, vae_dtype: torch.dtype = torch.float32
                    ) -> QwenImageComponents:
    """Load a Qwen-Image checkpoint part by part with each class's ``from_pretrained(path, subfolder=...)``: the
    transformer and text encoder in ``dtype``, the VAE in ``vae_dtype`` (float32, as flow_grpo keeps it); all frozen in
    eval mode. Failures raise ModelLoadError naming the key and the fix."""
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    from ddpo_tpu.models.loading import load_parts

    classes = dict(transformer=QwenImageTransformer2DModel, vae=AutoencoderKLQwenImage,
                   text_encoder=Qwen2_5_VLForConditionalGeneration, tokenizer=AutoTokenizer,
                   scheduler=FlowMatchEulerDiscreteScheduler)
    parts = load_parts(pretrained, revision, local_files_only, classes,
                       dict(transformer=dtype, vae=vae_dtype, text_encoder=dtype),
                       lambda rev, what, exc: _load_failure(os.fspath(pretrained), rev, what, exc), "Qwen-Image")
    for name in ("transformer", "text_encoder"):
        parts[name] = frozen(parts[name], dtype)
    parts["vae"] = frozen(parts["vae"], vae_dtype)
    parts["transformer"].ddp_unreached_modules = unreached_modules(parts["transformer"])
    return QwenImageComponents(**parts)


def unreached_modules(transformer) -> tuple[str, ...]:
    """The transformer's modules no forward reaches backwards: the last block's text-stream output, its attention's
    text projection (``attn.to_add_out``) and text MLP (``txt_mlp``). Every double-stream block returns both streams;
    the model feeds only the image stream to ``norm_out`` / ``proj_out`` after the last one and drops the text
    stream (diffusers 0.42.1 transformers/transformer_qwenimage.py, ``QwenImageTransformer2DModel.forward``
    lines 949-983; SD 3's MMDiT instead builds its last block ``context_pre_only``, without them). So these weights,
    and the LoRA flow_grpo's target list puts on them (``to_add_out``, ``txt_mlp.net.0.proj``, ``txt_mlp.net.2``),
    get no gradient in any step: one process leaves them untouched (gradient None), and DDP is told to leave them out
    (runtime/distributed.py ``wrap_ddp``, which reads this as ``transformer.ddp_unreached_modules``, set at load):
    otherwise the reducer waits on them and never reduces (docs/families.md, Qwen-Image under DDP)."""
    last = len(transformer.transformer_blocks) - 1
    return (f"transformer_blocks.{last}.attn.to_add_out", f"transformer_blocks.{last}.txt_mlp")


# --------------------------------------------------------------------------------------
# prompts, the model call, decoding
# --------------------------------------------------------------------------------------

# QwenImagePipeline.prompt_template_encode and prompt_template_encode_start_idx (diffusers 0.42; the model's chat
# format, checked against the pipeline's own in tests/unit/models/test_qwen_image_model.py): the system part
# is 34 tokens
PROMPT_TEMPLATE = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, "
                   "text, spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}"
                   "<|im_end|>\n<|im_start|>assistant\n")
TEMPLATE_START = 34
_TOKENIZER_MAX = 1024  # QwenImagePipeline.tokenizer_max_length


def encode_prompts_qwen(c: QwenImageComponents, prompts: Sequence[str], device,
                        max_sequence_length: int = TEXT_TOKENS) -> tuple[Tensor, Tensor]:
    """``(embeds (B, max_sequence_length, width), mask (B, max_sequence_length) int64)`` as
    QwenImagePipeline.encode_prompt: each prompt in the chat template, Qwen2.5-VL's last hidden state over its real
    tokens, the first 34 (the system part) dropped, cut at ``max_sequence_length``; then zeros and mask 0 up to
    ``max_sequence_length`` (the pipeline pads to the batch's longest).

    Tokens are padded on the right, so a prompt's real tokens are its first ones and (causal attention) do not see the
    padding, nor the tokens past the ``TEMPLATE_START + max_sequence_length`` kept: so every batch is tokenized to
    exactly that length (the pipeline: to the batch's longest, cut at 1024 + 34), which gives the kept states the
    pipeline's values and the text encoder one input shape. On XLA a batch-dependent length compiled a new encoder
    graph for each new longest prompt, epoch after epoch."""
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    length = TEMPLATE_START + min(max_sequence_length, _TOKENIZER_MAX)
    tok = c.tokenizer([PROMPT_TEMPLATE.format(p) for p in prompts], max_length=length,
                      padding="max_length", truncation=True, padding_side="right", return_tensors="pt")
    ids, mask = tok.input_ids.to(device), tok.attention_mask.to(device)
    hidden = c.text_encoder(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[-1]
    hidden, mask = hidden[:, TEMPLATE_START:TEMPLATE_START + max_sequence_length], mask[:, TEMPLATE_START:]
    mask = mask[:, :max_sequence_length]
    pad = max_sequence_length - hidden.shape[1]
    if pad > 0:
        hidden = torch.nn.functional.pad(hidden, (0, 0, 0, pad))
        mask = torch.nn.functional.pad(mask, (0, pad))
    embeds = hidden * mask[..., None].to(hidden.dtype)  # the pipeline's padding is zeros
    return embeds.to(c.text_encoder.dtype), mask.long()


def rope_tables_to(transformer, device) -> None:
    """Put the transformer's RoPE tables on ``device`` once. QwenEmbedRope keeps them as plain attributes (complex
    values, which a registered buffer would cast to real), so moving the model leaves them on the host and every
    forward copied them up (``.to(device)`` inside the call: a host-to-device upload per step on XLA, and a CPU
    constant in each compiled graph, which torch_xla's dynamo bridge warns of: "Found tensor with shape
    torch.Size([4096, 8]) on cpu"). Once they are there, that ``.to`` returns them as they are."""
    rope = transformer.pos_embed
    rope.pos_freqs, rope.neg_freqs = rope.pos_freqs.to(device), rope.neg_freqs.to(device)


def img_shapes(batch: int, tokens_h: int, tokens_w: int) -> list:
    """The transformer's RoPE shapes of a batch of packed images: one (frame, rows, columns) each."""
    return [[(1, tokens_h, tokens_w)]] * batch


def qwen_velocity(transformer, packed: Tensor, timestep: Tensor, embeds: Tensor, mask: Tensor, shapes: list,
                  neg_embeds: Tensor | None = None, neg_mask: Tensor | None = None, guidance_scale: float = 1.0,
                  detach_uncond: bool = False) -> Tensor:
    """The transformer's velocity on packed latents. ``timestep`` (B,) is the schedule's ``sigma * 1000``, cast to the
    latents' dtype and divided by 1000 as the pipeline does. With guidance (a negative prompt and a scale other than
    1): flow_grpo's true CFG, the conditional and unconditional passes as one batch of 2B (cond first), ``uncond + g
    (cond - uncond)``, rescaled per token to the conditional prediction's norm over the channels. ``detach_uncond``:
    the unconditional half without gradient."""
    t = timestep.to(packed.dtype) / 1000
    if neg_embeds is None or guidance_scale == 1.0:
        return transformer(hidden_states=packed, timestep=t, encoder_hidden_states=embeds,
                           encoder_hidden_states_mask=mask, img_shapes=shapes, return_dict=False)[0]
    both = transformer(hidden_states=torch.cat([packed, packed]), timestep=torch.cat([t, t]),
                       encoder_hidden_states=torch.cat([embeds, neg_embeds]),
                       encoder_hidden_states_mask=torch.cat([mask, neg_mask]), img_shapes=shapes * 2,
                       return_dict=False)[0]
    cond, uncond = both.chunk(2, dim=0)
    if detach_uncond:
        uncond = uncond.detach()
    comb = uncond + guidance_scale * (cond - uncond)
    return comb * (torch.norm(cond, dim=-1, keepdim=True) / torch.norm(comb, dim=-1, keepdim=True))


def decode_qwen_image(vae, packed: Tensor, height: int, width: int) -> Tensor:
    """Packed latents of a (height, width) latent -> images in [0, 1], (B, 3, H, W) float32, as the pipeline:
    unpack to one frame, ``latents / (1 / latents_std) + latents_mean`` per channel, decode, the first frame,
    ``(x / 2 + 0.5).clamp(0, 1)``."""
    from ddpo_tpu.models.flux import unpack_latents

    cfg = vae.config
    z = unpack_latents(packed, height, width).unsqueeze(2).to(vae.dtype)  # (B, C, 1, h, w)
    shape = (1, cfg.z_dim, 1, 1, 1)
    mean = torch.tensor(cfg.latents_mean).view(shape).to(z.device, z.dtype)
    inv_std = 1.0 / torch.tensor(cfg.latents_std).view(shape).to(z.device, z.dtype)
    with xla_safe_vae():
        image = vae.decode(z / inv_std + mean, return_dict=False)[0][:, :, 0]
    return (image.float() / 2 + 0.5).clamp(0, 1)
