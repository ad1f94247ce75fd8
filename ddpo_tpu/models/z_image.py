"""The Z-Image family (Z-Image-Turbo and Z-Image base): loading its parts through ``from_pretrained``, prompt encoding
with a Qwen3 text encoder, the guided transformer call, decoding, and a tiny Z-Image-shaped build -- each as diffusers'
``ZImagePipeline`` (0.42.1, pipelines/z_image/pipeline_z_image.py) holds and calls them, and as X-GenGroup/Flow-Factory
trains them (src/flow_factory/models/z_image/z_image.py at a0b2bc5a2b4fbf9125429b3fb70c0c5d7631047c).

Components (Tongyi-MAI/Z-Image-Turbo, Tongyi-MAI/Z-Image): ``ZImageTransformer2DModel`` (a single-stream DiT: noise
and context refiner blocks, then 30 blocks of width 3840 over the joint [image, caption] sequence, 3D RoPE),
``AutoencoderKL`` (FLUX.1's VAE: 16 latent channels, 8x, ``scaling_factor`` / ``shift_factor``), a Qwen3 model
(Qwen3-4B; the *second to last* hidden state of the chat-templated prompt, its padding dropped) + its tokenizer, and
``FlowMatchEulerDiscreteScheduler`` (its config's shift; sigmas ``linspace(1, 1/N, N)`` set as the pipeline does).

The model call (``z_velocity``), as ZImagePipeline.__call__ (pipeline_z_image.py:496-562) and Flow-Factory's
``ZImageAdapter.forward`` (z_image.py:400-477):
* the latents go in as a list of (C, 1, H, W) and the caption states as a list of each prompt's real tokens;
* the transformer's time input is ``(1000 - t) / 1000`` = 1 - sigma (Z-Image counts time the other way);
* its output is the negative velocity: ``v = -out``;
* guidance is ``pos + g (pos - neg)`` with Z-Image's ``g`` (0 = no guidance, Turbo's). Here
  ``sample.guidance_scale`` = s is the usual ``neg + s (pos - neg)``, so s = g + 1 (Turbo: 1, base at g = 4: 5).
  No ``cfg_normalization`` / ``cfg_truncation`` (the pipeline's defaults: off and 1.0, which never truncates).

Prompts: ``TEXT_TOKENS`` = 512 (the pipeline's ``max_sequence_length``) tokens padded on the right; the mask picks the
real ones. The transformer takes variable-length caption lists, so the call's shapes follow the prompts' lengths: fine
on an eager runtime. A runtime that compiles graphs calls ``z_forward_fixed`` instead (below): the padded batch with
each row's caption bucket as data, equal to the list forward, one shape for every set of lengths (docs/families.md).

The tiny build (``build_tiny_z_image`` / ``ensure_tiny_z_image``, version ``TINY_Z_IMAGE_VERSION``: bump it when
anything below changes) is saved as a real checkpoint (``ZImagePipeline.save_pretrained``):
* ZImageTransformer2DModel at toy widths: dim 32, 2 heads of 16 (RoPE axes 8 + 4 + 4), 1 refiner and 2 main layers,
  16 latent channels, cap_feat_dim 32 (the tiny text encoder's width).
* AutoencoderKL: the tiny FLUX VAE (models/flux.py, 4x: 32x32 RGB <-> 16 x 8 x 8 latents) with FLUX's latent
  normalisation, its decoder passing latents through so a reward can be raised.
* Qwen3Model (2 layers, width 32; hidden_states[-2] is the first layer's output) over a byte-level Qwen2 tokenizer with
  a chat template giving Qwen3's format for one user turn with ``enable_thinking=True``.
* FlowMatchEulerDiscreteScheduler with Z-Image-Turbo's scheduler config (``Z_IMAGE_SCHEDULER``).
"""

from __future__ import annotations

import os
import pathlib
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from ddpo_tpu.models.loading import ModelLoadError, family_load_failure, frozen

TINY_Z_IMAGE_VERSION = "v1"
# Tongyi-MAI/Z-Image-Turbo scheduler/scheduler_config.json: a static shift of 3, no dynamic shifting (recalled from
# the published checkpoint; the hub is not reachable here: a real checkpoint's own config is what load reads)
Z_IMAGE_SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)
TEXT_TOKENS = 512  # ZImagePipeline's max_sequence_length (the template included)
_TINY_TEXT_WIDTH = 32
_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Qwen3's chat format for one user turn with add_generation_prompt and enable_thinking=True (Qwen3's template adds
# the empty think block only when enable_thinking is false)
CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
                 "{% endif %}")


# --------------------------------------------------------------------------------------
# the tiny build
# --------------------------------------------------------------------------------------


def _build_tokenizer():
    from ddpo_tpu.models.qwen_image import _build_tokenizer as qwen_tokenizer

    tok = qwen_tokenizer("<|im_start|>user\n<|im_end|>\n<|im_start|>assistant\n")
    tok.chat_template = CHAT_TEMPLATE
    tok.padding_side = "right"
    return tok


def _build_text_encoder(tokenizer):
    from transformers import Qwen3Config, Qwen3Model

    return Qwen3Model(Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=_TINY_TEXT_WIDTH, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=2048, rms_norm_eps=1e-6,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id))


def _build_transformer():
    from diffusers import ZImageTransformer2DModel

    return ZImageTransformer2DModel(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=32, n_layers=2, n_refiner_layers=1,
        n_heads=2, n_kv_heads=2, cap_feat_dim=_TINY_TEXT_WIDTH, axes_dims=[8, 4, 4], axes_lens=[1024, 64, 64])


def build_tiny_z_image(out_dir: str | os.PathLike, seed: int = 0) -> pathlib.Path:
    """Build the tiny Z-Image-shaped pipeline with random (seeded) weights into ``out_dir`` (ZImagePipeline's
    layout). Does not touch the caller's global RNG state."""
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline

    from ddpo_tpu.models.flux import _build_vae

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _build_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = _build_text_encoder(tokenizer)
        torch.manual_seed(seed + 1)
        transformer = _build_transformer()
        # Z-Image's final layer and pad tokens start at zero: random ones so the tiny velocity depends on its inputs
        with torch.no_grad():
            for p in transformer.parameters():
                if p.abs().sum() == 0:
                    p.normal_(0, 0.02)
        torch.manual_seed(seed + 2)
        vae = _build_vae()
    pipe = ZImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(**Z_IMAGE_SCHEDULER), vae=vae,
                          text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer)
    pipe.save_pretrained(str(out), safe_serialization=True)
    return out


def ensure_tiny_z_image(cache_dir: str | os.PathLike, seed: int = 0) -> pathlib.Path:
    """``cache_dir/tiny-z-image-{version}-seed{seed}``, built atomically on first use (proc/build_cache.py)."""
    from ddpo_tpu.catalog import family
    from ddpo_tpu.proc.build_cache import build_once, pipeline_files

    required = pipeline_files(family("z_image").subfolders)
    return build_once(cache_dir, f"tiny-z-image-{TINY_Z_IMAGE_VERSION}-seed{seed}", required,
                      lambda tmp: build_tiny_z_image(tmp, seed=seed))


# --------------------------------------------------------------------------------------
# loading
# --------------------------------------------------------------------------------------


@dataclass
class ZImageComponents:
    transformer: object   # ZImageTransformer2DModel
    vae: object           # AutoencoderKL (FLUX.1's)
    text_encoder: object  # Qwen3Model
    tokenizer: object     # Qwen2Tokenizer (Qwen3's)
    scheduler: object     # FlowMatchEulerDiscreteScheduler

    @property
    def vae_scale_factor(self) -> int:
        """Pixels per latent pixel: 2 ** (len(block_out_channels) - 1), as ZImagePipeline computes it."""
        return 2 ** (len(self.vae.config.block_out_channels) - 1)


def load_z_image(pretrained: str | os.PathLike, revision: str | None = None, local_files_only: bool = True, *,
                 dtype: torch.dtype = torch.float32, vae_dtype: torch.dtype = torch.float32) -> ZImageComponents:
    """Load a Z-Image checkpoint part by part with each class's ``from_pretrained(path, subfolder=...)``: the
    transformer and text encoder in ``dtype``, the VAE in ``vae_dtype``; all frozen in eval mode. Failures raise
    ModelLoadError naming the key and the fix."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImageTransformer2DModel
    from transformers import AutoModel, AutoTokenizer

    from ddpo_tpu.models.loading import load_parts

    def failure(rev, what, exc=None) -> ModelLoadError:
        return family_load_failure("z_image", "Z-Image", "tiny_z_image", os.fspath(pretrained), rev, what, exc)

    classes = dict(transformer=ZImageTransformer2DModel, vae=AutoencoderKL, text_encoder=AutoModel,
                   tokenizer=AutoTokenizer, scheduler=FlowMatchEulerDiscreteScheduler)
    parts = load_parts(pretrained, revision, local_files_only, classes,
                       dict(transformer=dtype, vae=vae_dtype, text_encoder=dtype), failure, "Z-Image")
    for name in ("transformer", "text_encoder"):
        parts[name] = frozen(parts[name], dtype)
    parts["vae"] = frozen(parts["vae"], vae_dtype)
    return ZImageComponents(**parts)


# --------------------------------------------------------------------------------------
# prompts, schedule, the model call, decoding
# --------------------------------------------------------------------------------------


def encode_prompts_z(c: ZImageComponents, prompts: Sequence[str], device,
                     max_sequence_length: int = TEXT_TOKENS) -> tuple[Tensor, Tensor]:
    """``(states (B, L, width), mask (B, L) bool)`` as ZImagePipeline._encode_prompt (pipeline_z_image.py:204-243):
    each prompt as one user turn in the chat template (enable_thinking), tokenized to ``max_sequence_length``
    (padded, cut), the text encoder's hidden_states[-2]. The pipeline keeps ``states[i][mask[i]]``; we keep the
    padded batch and the mask (``caption_list`` makes the pipeline's list), zeroing the padding."""
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    texts = [c.tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                             add_generation_prompt=True, enable_thinking=True) for p in prompts]
    tok = c.tokenizer(texts, padding="max_length", max_length=max_sequence_length, truncation=True,
                      return_tensors="pt")
    ids, mask = tok.input_ids.to(device), tok.attention_mask.to(device).bool()
    hidden = c.text_encoder(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[-2]
    return hidden * mask[..., None].to(hidden.dtype), mask


def caption_list(states: Tensor, mask: Tensor) -> list[Tensor]:
    """Each prompt's real tokens, the transformer's caption input (the pipeline's embeddings_list)."""
    return [s[m] for s, m in zip(states, mask)]


def z_tables(scheduler, num_steps: int, image_seq_len: int, device):
    """The schedule as ZImagePipeline sets it (pipeline_z_image.py:470-489): sigmas linspace(1, 1/N, N) and mu from
    the token count (used only by a scheduler with dynamic shifting; Z-Image's shift is static), then a final 0."""
    from ddpo_tpu.models.flux import flux_tables

    return flux_tables(scheduler, num_steps, image_seq_len, device)


def z_velocity(transformer, latents: Tensor, timestep: Tensor, caps: list[Tensor], neg_caps: list[Tensor] | None = None,
               guidance_scale: float = 1.0, detach_uncond: bool = False, dtype: torch.dtype | None = None) -> Tensor:
    """The velocity (B, C, H, W) float32 at latents (B, C, H, W) and the schedule's ``timestep`` (B,) (sigma x 1000):
    the transformer on the list of (C, 1, H, W) latents at time ``(1000 - timestep) / 1000`` with the caption list,
    negated (Z-Image predicts -v). With a negative caption list and ``guidance_scale`` s != 1: both halves in one call
    (cond first), ``neg + s (pos - neg)`` (the pipeline's ``pos + (s - 1)(pos - neg)``). ``detach_uncond``: no
    gradient through the negative half."""
    b = latents.shape[0]
    t = (1000 - timestep.reshape(-1).expand(b).to(latents.dtype)) / 1000
    # dtype: the transformer's, given by the caller where it is wrapped (DDP's wrapper has no `dtype`)
    x = latents.to(transformer.dtype if dtype is None else dtype).unsqueeze(2)
    guided = neg_caps is not None and guidance_scale != 1.0
    if guided:
        x, t, caps = torch.cat([x, x]), torch.cat([t, t]), list(caps) + list(neg_caps)
    out = torch.stack([o.float() for o in transformer(list(x.unbind(0)), t, caps, return_dict=False)[0]])
    return _guided_velocity(out.squeeze(2), b, guidance_scale if guided else None, detach_uncond)


def _guided_velocity(out: Tensor, b: int, guidance_scale: float | None, detach_uncond: bool) -> Tensor:
    """The transformer's output (cond rows first, then the negative's when guided) as the velocity: Z-Image predicts
    -v; guided, ``neg + s (pos - neg)`` with the negative half detached on request."""
    if guidance_scale is not None:
        pos, neg = out[:b], out[b:]
        if detach_uncond:
            neg = neg.detach()
        out = neg + guidance_scale * (pos - neg)
    return -out


def decode_z_image(vae, latents: Tensor) -> Tensor:
    """Latents (B, C, h, w) -> images in [0, 1], (B, 3, H, W) float32, as the pipeline: ``latents / scaling_factor +
    shift_factor``, decode, ``(x / 2 + 0.5).clamp(0, 1)`` (VaeImageProcessor.postprocess's denormalisation)."""
    z = latents.to(vae.dtype) / vae.config.scaling_factor + vae.config.shift_factor
    image = vae.decode(z, return_dict=False)[0]
    return (image.float() / 2 + 0.5).clamp(0, 1)


# --------------------------------------------------------------------------------------
# the fixed-shape forward (runtimes that compile graphs)
# --------------------------------------------------------------------------------------
# diffusers 0.42.1's ZImageTransformer2DModel.forward in basic mode (transformer_z_image.py: patchify_and_embed
# 590-625, _pad_with_ids 553-588, _prepare_sequence 766-810, _build_unified_sequence 812-895, forward 897-1080) pads
# each caption to its OWN multiple of 32 with cap_pad_token (attended: part of the row), starts the image tokens' RoPE
# frame index at that padded length + 1, and then pads the rows to the batch's longest sequence with a MASK (invisible
# to the row). A row's output therefore depends on its own caption bucket only, never on how much masked batch padding
# follows it. `z_forward_fixed` pads every row to the same length (the encoder's padded width rounded up to 32) and
# makes the per-row lengths data: the pad-token choice, the RoPE positions and the masks are computed from the mask's
# row sums with `where`/gathers, so one graph serves every set of prompt lengths. The order [image, caption] of the
# basic mode puts the fixed-length image tokens first, so the unified sequence is a plain concatenation.

SEQ_MULTI_OF = 32  # transformer_z_image.py's SEQ_MULTI_OF


def _patchify(x: Tensor, p: int) -> Tensor:
    """(B, C, H, W) -> (B, (H/p)(W/p), p p C), the token and channel order of _patchify_image (frames 1, pF 1)."""
    b, c, h, w = x.shape
    return x.view(b, c, h // p, p, w // p, p).permute(0, 2, 4, 3, 5, 1).reshape(b, (h // p) * (w // p), p * p * c)


def _unpatchify(tokens: Tensor, c: int, h: int, w: int, p: int) -> Tensor:
    """The inverse of `_patchify` (unpatchify's "f h w pf ph pw c -> c (f pf) (h ph) (w pw)" with one frame)."""
    b = tokens.shape[0]
    return tokens.view(b, h // p, w // p, p, p, c).permute(0, 5, 1, 3, 2, 4).reshape(b, c, h, w)


def _layer(model, layer, *args):
    """One block, through the model's own gradient checkpointing when it is on (as forward does)."""
    if torch.is_grad_enabled() and model.gradient_checkpointing:
        return model._gradient_checkpointing_func(layer, *args)
    return layer(*args)


def rope_tables_to(transformer, device) -> None:
    """Put the transformer's RoPE tables on ``device`` once. RopeEmbedder computes them on the host at its first call
    and keeps them as plain attributes (complex values), so moving the model leaves them behind: under torch_xla's
    dynamo bridge each compiled graph would hold them as CPU constants ("Found tensor with shape torch.Size([1024, 4])
    on cpu", seen on the z_image smoke). Once they are on the device, its per-call ``.to`` is skipped."""
    rope = transformer.rope_embedder
    if rope.freqs_cis is None:
        rope.freqs_cis = rope.precompute_freqs_cis(rope.axes_dims, rope.axes_lens, theta=rope.theta)
    rope.freqs_cis = [f.to(device) for f in rope.freqs_cis]


def z_forward_fixed(model, latents: Tensor, t: Tensor, states: Tensor, lengths: Tensor,
                    patch_size: int = 2, f_patch_size: int = 1) -> Tensor:
    """ZImageTransformer2DModel's basic-mode output (B, C, H, W) for latents (B, C, H, W) at its time ``t`` (B,) in
    [0, 1], with each row's caption the first ``lengths[i]`` rows of ``states`` (B, L, cap_feat_dim) -- in shapes
    that do not depend on ``lengths``. Runs the model's own submodules (embedders, refiners, layers, final layer:
    its weights and any LoRA layers on them)."""
    if f_patch_size != 1:
        raise ValueError("z_forward_fixed: image latents have one frame (f_patch_size 1)")
    b, c, h, w = latents.shape
    p, dev = patch_size, latents.device
    adaln = model.t_embedder(t * model.t_scale).type_as(latents)

    # image tokens: patches, x_embedder, x_pad_token up to a multiple of 32 (the same count in every row)
    n_img = (h // p) * (w // p)
    pad_img = (-n_img) % SEQ_MULTI_OF
    x = model.all_x_embedder[f"{p}-{f_patch_size}"](_patchify(latents, p))
    if pad_img:
        x = torch.cat([x, model.x_pad_token.to(x.dtype).expand(b, pad_img, -1)], dim=1)

    # caption tokens: padded to the caption's own multiple of 32 with cap_pad_token; rows past that are masked
    lengths = lengths.to(dev).long().reshape(b)
    bucket = (lengths + SEQ_MULTI_OF - 1) // SEQ_MULTI_OF * SEQ_MULTI_OF  # (B,) each row's padded caption length
    width = states.shape[1] + (-states.shape[1]) % SEQ_MULTI_OF
    if width > states.shape[1]:
        states = torch.cat([states, states.new_zeros(b, width - states.shape[1], states.shape[2])], dim=1)
    j = torch.arange(width, device=dev)
    cap = model.cap_embedder(states.to(adaln.dtype))
    cap = torch.where((j[None, :] >= lengths[:, None])[..., None], model.cap_pad_token.to(cap.dtype), cap)
    cap_mask = j[None, :] < bucket[:, None]  # (B, width)

    # RoPE positions (frame, row, column): captions (1 + j, 0, 0); image tokens (bucket + 1, r, c); image padding 0
    zeros = torch.zeros_like(j)
    cap_ids = torch.stack([1 + j, zeros, zeros], dim=-1)  # the same for every row
    rows, cols = torch.meshgrid(torch.arange(h // p, device=dev), torch.arange(w // p, device=dev), indexing="ij")
    grid = torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).reshape(1, n_img, 3)
    offset = torch.nn.functional.pad((bucket + 1)[:, None], (0, 2)).unsqueeze(1)  # (B, 1, 3): (bucket + 1, 0, 0)
    img_ids = torch.cat([grid + offset, torch.zeros(b, pad_img, 3, dtype=torch.long, device=dev)], dim=1)
    rope = model.rope_embedder
    x_freqs = rope(img_ids.reshape(-1, 3)).reshape(b, n_img + pad_img, -1)
    cap_freqs = rope(cap_ids).unsqueeze(0).expand(b, -1, -1)

    for layer in model.noise_refiner:  # every row's image sequence is full: no mask, as forward's
        x = _layer(model, layer, x, None, x_freqs, adaln)
    for layer in model.context_refiner:
        cap = _layer(model, layer, cap, cap_mask, cap_freqs)

    unified = torch.cat([x, cap], dim=1)
    freqs = torch.cat([x_freqs, cap_freqs], dim=1)
    mask = torch.cat([torch.ones(b, x.shape[1], dtype=torch.bool, device=dev), cap_mask], dim=1)
    for layer in model.layers:
        unified = _layer(model, layer, unified, mask, freqs, adaln)
    out = model.all_final_layer[f"{p}-{f_patch_size}"](unified, c=adaln)
    return _unpatchify(out[:, :n_img], model.out_channels, h, w, p)


def z_velocity_fixed(transformer, latents: Tensor, timestep: Tensor, cond: tuple[Tensor, Tensor],
                     neg: tuple[Tensor, Tensor] | None = None, guidance_scale: float = 1.0,
                     detach_uncond: bool = False) -> Tensor:
    """`z_velocity` in fixed shapes: the conditioning stays (states (B, L, D), mask (B, L)) and each row's caption
    length is the mask's row sum (the tokenizer pads on the right: the real tokens are a prefix)."""
    b = latents.shape[0]
    t = (1000 - timestep.reshape(-1).expand(b).to(latents.dtype)) / 1000
    x = latents.to(transformer.dtype)
    states, mask = cond
    guided = neg is not None and guidance_scale != 1.0
    if guided:
        n_states, n_mask = (u.expand(b, *u.shape[1:]) for u in neg)
        x, t = torch.cat([x, x]), torch.cat([t, t])
        states, mask = torch.cat([states, n_states]), torch.cat([mask, n_mask])
    out = z_forward_fixed(transformer, x, t, states, mask.long().sum(-1)).float()
    return _guided_velocity(out, b, guidance_scale if guided else None, detach_uncond)
