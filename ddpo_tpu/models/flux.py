"""The FLUX.1 family: loading its components through ``from_pretrained``, prompt encoding, packed latents and their
position ids, the schedule with its resolution-dependent shift, the transformer call with the guidance embedding,
decoding, and a tiny FLUX-shaped build -- each as diffusers' ``FluxPipeline`` (0.42) does it.

Components (as in black-forest-labs/FLUX.1-dev): ``FluxTransformer2DModel`` (19 double-stream and 38 single-stream
blocks, 3072 wide, guidance-distilled: ``guidance_embeds`` true), the 16-channel ``AutoencoderKL`` (latents are
``(z - shift_factor) * scaling_factor``; FLUX.1: 0.1159 and 0.3611), ``CLIPTextModel`` + ``CLIPTokenizer`` (CLIP-L:
only its pooled output is used), ``T5EncoderModel`` + ``T5TokenizerFast`` (T5-XXL: the token sequence), and
``FlowMatchEulerDiscreteScheduler`` with dynamic shifting (``mu`` from the image's token count, ``calculate_shift``).

Latents are *packed*: the (C, H, W) VAE latent becomes (H/2 * W/2, 4C) tokens of 2x2 patches (``pack_latents``);
everything the sampler and the trainer hold is packed, as in flow_grpo's FLUX script. RoPE positions come from
``latent_image_ids`` (row, column per token) and zero text ids.

The tiny build (``build_tiny_flux`` / ``ensure_tiny_flux``, version ``TINY_FLUX_VERSION``: bump it whenever anything
below changes) is saved exactly like a real checkpoint, so tests and smoke runs load it through the same code:

* FluxTransformer2DModel with FLUX.1-dev's block kinds at toy widths: 1 double and 1 single block, 2 heads of 16
  (RoPE axes 4 + 6 + 6), 64 packed channels, joint_attention_dim 96 (the tiny T5's width), pooled_projection_dim 32
  (the tiny CLIP's), guidance_embeds true.
* AutoencoderKL as the tiny SD3's (3 levels, 32x32 RGB <-> 16x8x8 latents, residual branches zeroed so images follow
  the latents) with FLUX.1's scaling_factor 0.3611 and shift_factor 0.1159: 8x8 latents = 16 packed tokens.
* CLIPTextModel (width 32, 2 layers, quick_gelu) over the byte-level tokenizer of ``models/tiny.py``; the tiny SD3's
  T5 encoder (d_model 96, 1 layer) and tokenizer.
* FlowMatchEulerDiscreteScheduler with FLUX.1-dev's scheduler config (shift 3.0, use_dynamic_shifting, base/max
  shift 0.5/1.15 over 256..4096 image tokens).
"""

from __future__ import annotations

import os
import pathlib
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from ddpo_tpu.catalog import family
from ddpo_tpu.diffusion.flow import FlowTables
from ddpo_tpu.models.loading import ModelLoadError, family_load_failure, frozen

TINY_FLUX_VERSION = "v1"
FLUX_VAE_SCALING_FACTOR = 0.3611
FLUX_VAE_SHIFT_FACTOR = 0.1159
FLUX_SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                      base_image_seq_len=256, max_image_seq_len=4096)  # FLUX.1-dev scheduler/scheduler_config.json
T5_MAX_SEQUENCE_LENGTH = 512  # FluxPipeline's default (flow_grpo passes 128)
FLUX_SUBFOLDERS = family("flux").subfolders
_TINY_CLIP_WIDTH = 32


# --------------------------------------------------------------------------------------
# packing, positions, the schedule
# --------------------------------------------------------------------------------------


def pack_latents(latents: Tensor) -> Tensor:
    """(B, C, H, W) -> (B, H/2 * W/2, 4C): 2x2 patches as tokens (FluxPipeline._pack_latents)."""
    b, c, h, w = latents.shape
    x = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(packed: Tensor, height: int, width: int) -> Tensor:
    """(B, H/2 * W/2, 4C) -> (B, C, H, W) for latent height/width H, W (FluxPipeline._unpack_latents)."""
    b, _, channels = packed.shape
    x = packed.view(b, height // 2, width // 2, channels // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, channels // 4, height, width)


def latent_image_ids(height: int, width: int, device=None, dtype=torch.float32) -> Tensor:
    """(H/2 * W/2, 3) RoPE positions of the packed tokens: (0, row, column) (FluxPipeline._prepare_latent_image_ids)."""
    ids = torch.zeros(height // 2, width // 2, 3)
    ids[..., 1] += torch.arange(height // 2)[:, None]
    ids[..., 2] += torch.arange(width // 2)[None, :]
    return ids.reshape(-1, 3).to(device=device, dtype=dtype)


def calculate_shift(image_seq_len: int, base_seq_len: int = 256, max_seq_len: int = 4096, base_shift: float = 0.5,
                    max_shift: float = 1.15) -> float:
    """The schedule's shift mu, linear in the image's token count (diffusers' calculate_shift)."""
    m = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    return image_seq_len * m + base_shift - m * base_seq_len


def flux_tables(scheduler, num_steps: int, image_seq_len: int, device) -> FlowTables:
    """The device tables of a FLUX schedule as FluxPipeline sets it: sigmas linspace(1, 1/N, N) shifted by
    mu(image_seq_len) inside ``set_timesteps`` (the scheduler's dynamic shifting), then a final 0."""
    c = scheduler.config
    mu = calculate_shift(image_seq_len, c.get("base_image_seq_len", 256), c.get("max_image_seq_len", 4096),
                         c.get("base_shift", 0.5), c.get("max_shift", 1.15))
    scheduler.set_timesteps(int(num_steps), sigmas=np.linspace(1.0, 1 / num_steps, num_steps), mu=mu)
    sigmas = scheduler.sigmas.detach().to("cpu", torch.float32)
    timesteps = scheduler.timesteps.detach().to("cpu", torch.float32)
    return FlowTables(sigmas.to(device), timesteps.to(device))


# --------------------------------------------------------------------------------------
# the tiny build
# --------------------------------------------------------------------------------------


def _build_transformer():
    from diffusers import FluxTransformer2DModel

    from ddpo_tpu.models.sd3 import _TINY_JOINT_ATTENTION_DIM

    return FluxTransformer2DModel(
        patch_size=1, in_channels=64,              # packed 2x2 patches of 16 channels, as FLUX.1
        num_layers=1, num_single_layers=1,         # one block of each kind (FLUX.1-dev: 19 and 38)
        num_attention_heads=2, attention_head_dim=16, axes_dims_rope=(4, 6, 6),
        joint_attention_dim=_TINY_JOINT_ATTENTION_DIM, pooled_projection_dim=_TINY_CLIP_WIDTH,
        guidance_embeds=True,
    )


def _build_vae():
    from ddpo_tpu.models.sd3 import _build_vae as sd3_vae

    vae = sd3_vae()
    vae.register_to_config(scaling_factor=FLUX_VAE_SCALING_FACTOR, shift_factor=FLUX_VAE_SHIFT_FACTOR)
    return vae


def _build_clip(tokenizer):
    from transformers import CLIPTextConfig, CLIPTextModel

    from ddpo_tpu.models.tiny import BOS_TOKEN, EOS_TOKEN, TOKENIZER_MAX_LENGTH

    bos, eos = tokenizer.convert_tokens_to_ids(BOS_TOKEN), tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    return CLIPTextModel(CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=_TINY_CLIP_WIDTH, intermediate_size=2 * _TINY_CLIP_WIDTH,
        num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=TOKENIZER_MAX_LENGTH,
        hidden_act="quick_gelu", bos_token_id=bos, eos_token_id=eos, pad_token_id=eos))


def build_tiny_flux(out_dir: str | os.PathLike, seed: int = 0) -> pathlib.Path:
    """Build the tiny FLUX-shaped pipeline with random (seeded) weights into ``out_dir`` (FluxPipeline's layout).
    Does not touch the caller's global RNG state."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline

    from ddpo_tpu.models.sd3 import _build_t5, _pass_latents_through
    from ddpo_tpu.models.tiny import _build_tokenizer, _write_tokenizer_files

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _build_tokenizer(out)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = _build_clip(tokenizer)
        torch.manual_seed(seed + 1)
        text_encoder_2, tokenizer_2 = _build_t5()
        torch.manual_seed(seed + 2)
        transformer = _build_transformer()
        torch.manual_seed(seed + 3)
        vae = _build_vae()
        _pass_latents_through(vae.decoder)
    pipe = FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(**FLUX_SCHEDULER), vae=vae,
                        text_encoder=text_encoder, tokenizer=tokenizer, text_encoder_2=text_encoder_2,
                        tokenizer_2=tokenizer_2, transformer=transformer)
    pipe.save_pretrained(str(out), safe_serialization=True)
    if not (out / "tokenizer" / "vocab.json").exists():
        _write_tokenizer_files(out / "tokenizer")
    return out


def ensure_tiny_flux(cache_dir: str | os.PathLike, seed: int = 0) -> pathlib.Path:
    """``cache_dir/tiny-flux-{version}-seed{seed}``, built atomically on first use (proc/build_cache.py)."""
    from ddpo_tpu.proc.build_cache import build_once, pipeline_files

    required = pipeline_files(FLUX_SUBFOLDERS)
    return build_once(cache_dir, f"tiny-flux-{TINY_FLUX_VERSION}-seed{seed}", required,
                      lambda tmp: build_tiny_flux(tmp, seed=seed))


# --------------------------------------------------------------------------------------
# loading
# --------------------------------------------------------------------------------------


@dataclass
class FluxComponents:
    transformer: object      # FluxTransformer2DModel
    vae: object              # AutoencoderKL
    text_encoder: object     # CLIPTextModel (CLIP-L)
    text_encoder_2: object   # T5EncoderModel
    tokenizer: object        # CLIPTokenizer
    tokenizer_2: object      # T5TokenizerFast
    scheduler: object        # FlowMatchEulerDiscreteScheduler (dynamic shifting)

    @property
    def vae_scale_factor(self) -> int:
        return 2 ** (len(self.vae.config.block_out_channels) - 1)


def _load_failure(pretrained: str, revision: str | None, what: str, exc: BaseException | None = None) -> ModelLoadError:
    return family_load_failure("flux", "FLUX.1", "tiny_flux", pretrained, revision, what, exc, gated=True)


def load_flux(pretrained: str | os.PathLike, revision: str | None = None, local_files_only: bool = True, *,
              dtype: torch.dtype = torch.float32, vae_dtype: torch.dtype = torch.float32) -> FluxComponents:
    """Load a FLUX.1 checkpoint (a local diffusers directory or a hub id) part by part with each class's
    ``from_pretrained(path, subfolder=...)``. Transformer and text encoders in ``dtype``, the VAE in ``vae_dtype``
    (float32, as flow_grpo keeps it); all frozen in eval mode. Failures raise ModelLoadError naming the key and fix."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import CLIPTextModel, CLIPTokenizer, T5EncoderModel, T5TokenizerFast

    from ddpo_tpu.models.loading import load_parts

    classes = dict(transformer=FluxTransformer2DModel, vae=AutoencoderKL, text_encoder=CLIPTextModel,
                   text_encoder_2=T5EncoderModel, tokenizer=CLIPTokenizer, tokenizer_2=T5TokenizerFast,
                   scheduler=FlowMatchEulerDiscreteScheduler)
    parts = load_parts(pretrained, revision, local_files_only, classes, dict(transformer=dtype, vae=vae_dtype),
                       lambda rev, what, exc: _load_failure(os.fspath(pretrained), rev, what, exc), "FLUX.1")
    for name in ("transformer", "text_encoder", "text_encoder_2"):
        parts[name] = frozen(parts[name], dtype)
    parts["vae"] = frozen(parts["vae"], vae_dtype)
    return FluxComponents(**parts)


# --------------------------------------------------------------------------------------
# prompts, the model call, decoding
# --------------------------------------------------------------------------------------


def encode_prompts_flux(c: FluxComponents, prompts: Sequence[str], device,
                        max_sequence_length: int = T5_MAX_SEQUENCE_LENGTH) -> tuple[Tensor, Tensor]:
    """``(prompt_embeds (B, max_sequence_length, T5 width), pooled (B, CLIP width))`` as FluxPipeline.encode_prompt
    (one image per prompt, the same prompt for both encoders): T5's last hidden state over ``max_sequence_length``
    padded tokens, in T5's dtype; CLIP's ``pooler_output`` over 77 padded tokens, in CLIP's dtype. The text ids are
    zeros (``text_ids``)."""
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    clip_ids = c.tokenizer(prompts, padding="max_length", max_length=int(c.tokenizer.model_max_length),
                           truncation=True, return_tensors="pt").input_ids
    pooled = c.text_encoder(clip_ids.to(device), output_hidden_states=False).pooler_output
    t5_ids = c.tokenizer_2(prompts, padding="max_length", max_length=max_sequence_length, truncation=True,
                           return_tensors="pt").input_ids
    embeds = c.text_encoder_2(t5_ids.to(device), output_hidden_states=False)[0]
    return embeds.to(c.text_encoder_2.dtype), pooled.to(c.text_encoder.dtype)


def text_ids(num_tokens: int, device=None, dtype=torch.float32) -> Tensor:
    """(num_tokens, 3) zeros: the text tokens' RoPE positions."""
    return torch.zeros(num_tokens, 3, device=device, dtype=dtype)


def flux_velocity(transformer, packed: Tensor, timestep: Tensor, guidance: Tensor | None, prompt_embeds: Tensor,
                  pooled: Tensor, img_ids: Tensor, txt_ids: Tensor) -> Tensor:
    """The transformer's velocity on packed latents (one pass: the guidance is an input). ``timestep`` (B,) is the
    schedule's ``sigma * 1000``: cast to the latents' dtype and divided by 1000 as the pipeline does (the model
    multiplies it back); ``guidance`` (B,) the guidance scale (None for a model without guidance_embeds)."""
    return transformer(hidden_states=packed, timestep=timestep.to(packed.dtype) / 1000, guidance=guidance,
                       pooled_projections=pooled, encoder_hidden_states=prompt_embeds, txt_ids=txt_ids,
                       img_ids=img_ids, return_dict=False)[0]


def decode_flux(vae, packed: Tensor, height: int, width: int) -> Tensor:
    """Packed latents of a (height, width) latent -> images in [0, 1], (B, 3, H, W) float32, as the pipeline:
    unpack, ``latents / scaling_factor + shift_factor``, decode, ``(x / 2 + 0.5).clamp(0, 1)``."""
    z = unpack_latents(packed, height, width) / vae.config.scaling_factor + vae.config.shift_factor
    image = vae.decode(z.to(vae.dtype), return_dict=False)[0]
    return (image.float() / 2 + 0.5).clamp(0, 1)
