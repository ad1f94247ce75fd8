"""The FLUX.2-klein family: loading its components through ``from_pretrained``, prompt encoding with Qwen3, packed
latents with their batch-norm normalisation, position ids, the schedule (``compute_empirical_mu``), the transformer
call with classifier-free guidance, decoding, and a tiny FLUX.2-klein-shaped build -- each as diffusers 0.42.1's
``Flux2KleinPipeline`` (pipelines/flux2/pipeline_flux2_klein.py) does it, and as X-GenGroup/Flow-Factory@a0b2bc5
(src/flow_factory/models/flux/flux2_klein.py) samples and trains it.

Components (as in black-forest-labs/FLUX.2-klein-4B and -9B): ``Flux2Transformer2DModel`` (4B: 5 double-stream and
20 single-stream blocks, 24 heads of 128; 9B: 8 and 24, 32 heads; no guidance embedding, shared modulations, SwiGLU
feed-forwards, fused QKV+MLP in single blocks, 4-axis RoPE), ``AutoencoderKLFlux2`` (32 latent channels, 8x; a
``bn`` BatchNorm over the 2x2-patchified 128 channels normalises latents), ``Qwen3ForCausalLM`` (Qwen3-4B / 8B) +
``Qwen2TokenizerFast``, and ``FlowMatchEulerDiscreteScheduler`` with dynamic shifting.

Differences from FLUX.1 (models/flux.py): the prompt is one Qwen3 pass over the chat-templated prompt padded to 512
tokens, and the conditioning is three of its hidden states (layers 9, 18, 27) concatenated on the channels (no pooled
vector, no attention mask: the padding tokens are conditioning too); guidance is true CFG with the negative prompt ""
(two passes; the step-distilled checkpoints, ``is_distilled``, ignore it); latents are patchified 2x2 (``(C, H, W)``
-> ``(4C, H/2, W/2)``), normalised by the VAE's batch-norm statistics and packed as ``(H/2 * W/2, 4C)`` tokens (the
same token layout as FLUX.1's packing); positions are (t, h, w, l) ids; the schedule's shift mu is
``compute_empirical_mu(tokens, steps)``, which depends on the step count too.

The tiny build (``build_tiny_flux2`` / ``ensure_tiny_flux2``, version ``TINY_FLUX2_VERSION``: bump it whenever anything
below changes) is saved exactly like a real checkpoint (``Flux2KleinPipeline.save_pretrained``):

* Flux2Transformer2DModel with klein's block kinds at toy widths: 1 double and 1 single block, 2 heads of 16 (RoPE
  axes 4 + 4 + 4 + 4), 32 packed channels (8 latent channels x 2x2), joint_attention_dim 48 (3 x the tiny Qwen3's
  width 16), no guidance embedding.
* AutoencoderKLFlux2 with 3 levels (4x: 32x32 RGB <-> 8 x 8 x 8 latents = 16 packed tokens of 32 channels), one norm
  group and the decoder's residual branches zeroed (models/sd3.py::_pass_latents_through: images follow the latents),
  its batch-norm running statistics drawn at random (seeded) so the normalisation is not the identity.
* Qwen3ForCausalLM at width 16 with 28 layers (the pipeline reads hidden states 9, 18 and 27: the last is an inner
  layer, as in the 36-layer Qwen3-4B/8B) over the tiny byte-level Qwen2 tokenizer of models/qwen_image.py with a
  Qwen3-style chat template (``enable_thinking=False`` adds the empty think block).
* FlowMatchEulerDiscreteScheduler with dynamic shifting (``FLUX2_SCHEDULER``; mu is given by the pipeline).
"""

from __future__ import annotations

import os
import pathlib
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from ddpo_tpu.diffusion.flow import FlowTables
from ddpo_tpu.models.loading import ModelLoadError, family_load_failure, frozen

TINY_FLUX2_VERSION = "v1"
TEXT_TOKENS = 512             # Flux2KleinPipeline's max_sequence_length (Flow-Factory's too): prompts pad to it
TEXT_LAYERS = (9, 18, 27)     # the pipeline's text_encoder_out_layers
NEGATIVE_PROMPT = ""          # the pipeline's (and Flow-Factory's) negative prompt
# FlowMatchEulerDiscreteScheduler with dynamic shifting: the pipeline passes mu (compute_empirical_mu), so only
# use_dynamic_shifting and the (default exponential) time shift decide the sigmas
FLUX2_SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                       base_image_seq_len=256, max_image_seq_len=4096)
_TINY_TEXT_WIDTH = 16
_TINY_TEXT_LAYERS = 28
_TINY_LATENT_CHANNELS = 8
# a Qwen3-style chat template (one user turn, the generation prompt, and with enable_thinking false the empty think
# block), enough for Flux2KleinPipeline's apply_chat_template call
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
_TEMPLATE_TEXT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


# --------------------------------------------------------------------------------------
# packing, positions, the schedule
# --------------------------------------------------------------------------------------


def patchify(latents: Tensor) -> Tensor:
    """(B, C, H, W) -> (B, 4C, H/2, W/2): 2x2 patches onto the channels (Flux2KleinPipeline._patchify_latents)."""
    b, c, h, w = latents.shape
    x = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4)
    return x.reshape(b, c * 4, h // 2, w // 2)


def unpatchify(latents: Tensor) -> Tensor:
    """(B, 4C, h, w) -> (B, C, 2h, 2w) (Flux2KleinPipeline._unpatchify_latents)."""
    b, c4, h, w = latents.shape
    x = latents.reshape(b, c4 // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3)
    return x.reshape(b, c4 // 4, h * 2, w * 2)


def pack(latents: Tensor) -> Tensor:
    """(B, C, h, w) -> (B, h * w, C) (Flux2KleinPipeline._pack_latents)."""
    b, c, h, w = latents.shape
    return latents.reshape(b, c, h * w).permute(0, 2, 1)


def unpack(packed: Tensor, h: int, w: int) -> Tensor:
    """(B, h * w, C) -> (B, C, h, w): the inverse of ``pack``. The pipeline scatters tokens by their ids
    (``_unpack_latents_with_ids``); its ids are row-major over (h, w), so that scatter is this reshape."""
    b, _, c = packed.shape
    return packed.reshape(b, h, w, c).permute(0, 3, 1, 2)


def latent_ids(h: int, w: int, device=None) -> Tensor:
    """(h * w, 4) RoPE positions of the packed tokens: (0, row, column, 0) (Flux2KleinPipeline._prepare_latent_ids;
    int64 as there: the transformer reads one batch row)."""
    return torch.cartesian_prod(torch.arange(1), torch.arange(h), torch.arange(w), torch.arange(1)).to(device)


def text_ids(num_tokens: int, device=None) -> Tensor:
    """(num_tokens, 4) positions of the text tokens: (0, 0, 0, l) (Flux2KleinPipeline._prepare_text_ids)."""
    return torch.cartesian_prod(torch.arange(1), torch.arange(1), torch.arange(1), torch.arange(num_tokens)).to(device)


def compute_empirical_mu(image_seq_len: int, num_steps: int) -> float:
    """The schedule's shift mu (diffusers' pipeline_flux2.compute_empirical_mu, the same two fitted lines): linear in
    the token count at 10 and 200 steps, interpolated linearly in the step count; above 4300 tokens the 200-step
    line alone."""
    a1, b1 = 8.73809524e-05, 1.89833333
    a2, b2 = 0.00016927, 0.45666666
    if image_seq_len > 4300:
        return float(a2 * image_seq_len + b2)
    m_200, m_10 = a2 * image_seq_len + b2, a1 * image_seq_len + b1
    slope = (m_200 - m_10) / 190.0
    return float(slope * num_steps + (m_200 - 200.0 * slope))


def flux2_tables(scheduler, num_steps: int, image_seq_len: int, device) -> FlowTables:
    """The device tables of a FLUX.2 schedule as Flux2KleinPipeline sets it: sigmas linspace(1, 1/N, N) shifted by
    ``compute_empirical_mu(tokens, N)`` inside ``set_timesteps``, then a final 0."""
    mu = compute_empirical_mu(image_seq_len, int(num_steps))
    sigmas = None if scheduler.config.get("use_flow_sigmas") else np.linspace(1.0, 1 / num_steps, num_steps)
    scheduler.set_timesteps(int(num_steps), sigmas=sigmas, mu=mu)
    s = scheduler.sigmas.detach().to("cpu", torch.float32)
    t = scheduler.timesteps.detach().to("cpu", torch.float32)
    return FlowTables(s.to(device), t.to(device))


# --------------------------------------------------------------------------------------
# the tiny build
# --------------------------------------------------------------------------------------


def _build_tokenizer():
    from ddpo_tpu.models.qwen_image import _build_tokenizer as qwen_tokenizer

    tok = qwen_tokenizer(_TEMPLATE_TEXT)  # the template's words as single tokens, prompts byte by byte
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _build_text_encoder(tokenizer):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=_TINY_TEXT_WIDTH, intermediate_size=32,
        num_hidden_layers=_TINY_TEXT_LAYERS, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
        max_position_embeddings=1024, tie_word_embeddings=True, bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"), pad_token_id=tokenizer.pad_token_id))


def _build_transformer():
    from diffusers import Flux2Transformer2DModel

    return Flux2Transformer2DModel(
        patch_size=1, in_channels=4 * _TINY_LATENT_CHANNELS,  # patchified 2x2 (klein: 4 x 32 = 128)
        num_layers=1, num_single_layers=1,                    # klein 4B: 5 and 20
        attention_head_dim=16, num_attention_heads=2, axes_dims_rope=(4, 4, 4, 4),
        joint_attention_dim=len(TEXT_LAYERS) * _TINY_TEXT_WIDTH, timestep_guidance_channels=32,
        guidance_embeds=False,                                # klein has no guidance embedding
    )


def _build_vae():
    from diffusers import AutoencoderKLFlux2

    from ddpo_tpu.models.sd3 import _pass_latents_through

    vae = AutoencoderKLFlux2(
        in_channels=3, out_channels=3, latent_channels=_TINY_LATENT_CHANNELS, sample_size=32,
        down_block_types=("DownEncoderBlock2D",) * 3, up_block_types=("UpDecoderBlock2D",) * 3,
        block_out_channels=(16, 32, 32), layers_per_block=1, norm_num_groups=1)
    _pass_latents_through(vae.decoder)
    with torch.no_grad():  # a non-trivial normalisation (a trained VAE's statistics are far from 0 and 1)
        vae.bn.running_mean.copy_(0.2 * torch.randn_like(vae.bn.running_mean))
        vae.bn.running_var.copy_(0.5 + torch.rand_like(vae.bn.running_var))
    return vae


def build_tiny_flux2(out_dir: str | os.PathLike, seed: int = 0) -> pathlib.Path:
    """Build the tiny FLUX.2-klein-shaped pipeline with random (seeded) weights into ``out_dir`` (Flux2KleinPipeline's
    layout). Does not touch the caller's global RNG state."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _build_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = _build_text_encoder(tokenizer)
        torch.manual_seed(seed + 1)
        transformer = _build_transformer()
        torch.manual_seed(seed + 2)
        vae = _build_vae()
    pipe = Flux2KleinPipeline(scheduler=FlowMatchEulerDiscreteScheduler(**FLUX2_SCHEDULER), vae=vae,
                              text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer,
                              is_distilled=False)
    pipe.save_pretrained(str(out), safe_serialization=True)
    return out


def ensure_tiny_flux2(cache_dir: str | os.PathLike, seed: int = 0) -> pathlib.Path:
    """``cache_dir/tiny-flux2-{version}-seed{seed}``, built atomically on first use (proc/build_cache.py)."""
    from ddpo_tpu.catalog import family
    from ddpo_tpu.proc.build_cache import build_once, pipeline_files

    required = pipeline_files(family("flux2").subfolders)
    return build_once(cache_dir, f"tiny-flux2-{TINY_FLUX2_VERSION}-seed{seed}", required,
                      lambda tmp: build_tiny_flux2(tmp, seed=seed))


# --------------------------------------------------------------------------------------
# loading
# --------------------------------------------------------------------------------------


@dataclass
class Flux2Components:
    transformer: object   # Flux2Transformer2DModel
    vae: object           # AutoencoderKLFlux2
    text_encoder: object  # Qwen3ForCausalLM
    tokenizer: object     # Qwen2TokenizerFast
    scheduler: object     # FlowMatchEulerDiscreteScheduler (dynamic shifting)
    is_distilled: bool = False  # model_index.json's flag: a step-distilled checkpoint ignores guidance

    @property
    def vae_scale_factor(self) -> int:
        return 2 ** (len(self.vae.config.block_out_channels) - 1)


def _load_failure(pretrained: str, revision: str | None, what: str, exc: BaseException | None = None) -> ModelLoadError:
    return family_load_failure("flux2", "FLUX.2-klein", "tiny_flux2", pretrained, revision, what, exc)


def _is_distilled(pretrained, revision, local_files_only) -> bool:
    """model_index.json's ``is_distilled`` (Flux2KleinPipeline's config; absent: false)."""
    import json

    source = os.path.expanduser(os.fspath(pretrained))
    try:
        if os.path.isdir(source):
            path = os.path.join(source, "model_index.json")
        else:
            from huggingface_hub import hf_hub_download

            path = hf_hub_download(os.fspath(pretrained), "model_index.json", revision=revision,
                                   local_files_only=local_files_only)
        with open(path) as f:
            return bool(json.load(f).get("is_distilled", False))
    except Exception:  # the parts' own loading reports a missing checkpoint
        return False


def load_flux2(pretrained: str | os.PathLike, revision: str | None = None, local_files_only: bool = True, *,
               dtype: torch.dtype = torch.float32, vae_dtype: torch.dtype = torch.float32) -> Flux2Components:
    """Load a FLUX.2-klein checkpoint part by part with each class's ``from_pretrained(path, subfolder=...)``: the
    transformer and text encoder in ``dtype``, the VAE in ``vae_dtype`` (float32); all frozen in eval mode. Failures
    raise ModelLoadError naming the key and the fix."""
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    from ddpo_tpu.models.loading import load_parts

    classes = dict(transformer=Flux2Transformer2DModel, vae=AutoencoderKLFlux2, text_encoder=Qwen3ForCausalLM,
                   tokenizer=AutoTokenizer, scheduler=FlowMatchEulerDiscreteScheduler)
    parts = load_parts(pretrained, revision, local_files_only, classes,
                       dict(transformer=dtype, vae=vae_dtype, text_encoder=dtype),
                       lambda rev, what, exc: _load_failure(os.fspath(pretrained), rev, what, exc), "FLUX.2-klein")
    for name in ("transformer", "text_encoder"):
        parts[name] = frozen(parts[name], dtype)
    parts["vae"] = frozen(parts["vae"], vae_dtype)
    return Flux2Components(**parts, is_distilled=_is_distilled(pretrained, revision, local_files_only))


# --------------------------------------------------------------------------------------
# prompts, the model call, decoding
# --------------------------------------------------------------------------------------


def encode_prompts_flux2(c: Flux2Components, prompts: Sequence[str], device, max_sequence_length: int = TEXT_TOKENS,
                         layers: Sequence[int] = TEXT_LAYERS) -> Tensor:
    """``(B, max_sequence_length, len(layers) x width)`` as Flux2KleinPipeline._get_qwen3_prompt_embeds: each prompt in
    the chat template (enable_thinking false) padded to ``max_sequence_length`` tokens, one Qwen3 pass with the
    attention mask, the hidden states of ``layers`` stacked and laid side by side per token, in the encoder's
    dtype. The padding tokens' states are kept: the transformer sees them (it takes no mask)."""
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    texts = [c.tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                             add_generation_prompt=True, enable_thinking=False) for p in prompts]
    # one call for the batch: each row padded to max_length on its own, as the pipeline's per-prompt calls
    tok = c.tokenizer(texts, return_tensors="pt", padding="max_length", truncation=True,
                      max_length=max_sequence_length)
    out = c.text_encoder(input_ids=tok.input_ids.to(device), attention_mask=tok.attention_mask.to(device),
                         output_hidden_states=True, use_cache=False)
    h = torch.stack([out.hidden_states[k] for k in layers], dim=1).to(c.text_encoder.dtype)  # (B, K, L, D)
    b, k, n, d = h.shape
    return h.permute(0, 2, 1, 3).reshape(b, n, k * d)


def flux2_velocity(transformer, packed: Tensor, timestep: Tensor, embeds: Tensor, img_ids: Tensor, txt_ids: Tensor,
                   neg_embeds: Tensor | None = None, guidance_scale: float = 1.0,
                   detach_uncond: bool = False) -> Tensor:
    """The transformer's velocity on packed latents. ``timestep`` (B,) is the schedule's ``sigma * 1000``, cast to
    the latents' dtype and divided by 1000 as the pipeline does (the model multiplies it back). With a negative
    prompt and a scale other than 1: the pipeline's CFG ``uncond + g (cond - uncond)``, both passes as one batch of
    2B (cond first; the pipeline runs them one after the other, on the same ids). ``detach_uncond``: the
    unconditional half without gradient."""
    t = timestep.to(packed.dtype) / 1000
    if neg_embeds is None or guidance_scale == 1.0:
        return transformer(hidden_states=packed, timestep=t, guidance=None, encoder_hidden_states=embeds,
                           txt_ids=txt_ids, img_ids=img_ids, return_dict=False)[0]
    both = transformer(hidden_states=torch.cat([packed, packed]), timestep=torch.cat([t, t]), guidance=None,
                       encoder_hidden_states=torch.cat([embeds, neg_embeds]), txt_ids=txt_ids, img_ids=img_ids,
                       return_dict=False)[0]
    cond, uncond = both.chunk(2, dim=0)
    if detach_uncond:
        uncond = uncond.detach()
    return uncond + guidance_scale * (cond - uncond)


def decode_flux2(vae, packed: Tensor, h: int, w: int) -> Tensor:
    """Packed latents of (h, w) tokens -> images in [0, 1], (B, 3, 2h x 8, 2w x 8) float32, as the pipeline: unpack,
    ``x * sqrt(bn.running_var + eps) + bn.running_mean`` per patchified channel, unpatchify, decode,
    ``(x / 2 + 0.5).clamp(0, 1)``."""
    z = unpack(packed, h, w).to(vae.dtype)
    mean = vae.bn.running_mean.view(1, -1, 1, 1).to(z.device, z.dtype)
    std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(z.device, z.dtype)
    image = vae.decode(unpatchify(z * std + mean), return_dict=False)[0]
    return (image.float() / 2 + 0.5).clamp(0, 1)
