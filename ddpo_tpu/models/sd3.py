"""The Stable Diffusion 3 / 3.5 family: loading its components through ``from_pretrained``, prompt encoding as
diffusers' ``StableDiffusion3Pipeline`` does it, the guided velocity call, decoding, and a tiny SD3-shaped build.

Components (as in stabilityai/stable-diffusion-3.5-medium): ``SD3Transformer2DModel`` (an MMDiT predicting a flow
velocity), the 16-channel ``AutoencoderKL`` (latents are ``(z - shift_factor) * scaling_factor``; SD 3.5: 0.0609 and
1.5305), two ``CLIPTextModelWithProjection`` + ``CLIPTokenizer`` (CLIP-L, CLIP-G), an optional T5
(``T5EncoderModel`` + ``T5TokenizerFast``, ``text_encoder_3`` / ``tokenizer_3``; SD3 runs without it), and
``FlowMatchEulerDiscreteScheduler`` with a static ``shift`` (SD 3.5 Medium: 3.0).

The tiny build (``build_tiny_sd3`` / ``ensure_tiny_sd3``, version ``TINY_SD3_VERSION``: bump it whenever anything
below changes) is saved exactly like a real checkpoint (``model_index.json`` plus ``transformer/``, ``vae/``,
``text_encoder/``, ``text_encoder_2/``, ``tokenizer/``, ``tokenizer_2/``, ``scheduler/``; ``text_encoder_3`` and
``tokenizer_3`` null), so tests and smoke runs load it through the same code as SD 3.5:

* SD3Transformer2DModel, SD 3.5 Medium's block types at toy widths: 2 joint blocks, the first with dual attention
  (MMDiT-X), RMS qk-norm, 2 heads of 16, patch 2, 16 latent channels, sample_size 8 (8x8 latents),
  pos_embed_max_size 16, joint_attention_dim 96, pooled_projection_dim 80.
* AutoencoderKL, 3 levels (32, 64, 64): 32x32 RGB <-> 16x8x8 latents, no quant convs (as SD3), SD 3.5's
  scaling_factor 1.5305 and shift_factor 0.0609; the decoder's residual branches start at zero, so images follow the
  latents (``_pass_latents_through``), and its GroupNorms have one group, so the latents' colour reaches the image too.
* Two CLIPTextModelWithProjection: widths 32 (quick_gelu, as CLIP-L) and 48 (gelu, as CLIP-G), 2 layers, 77
  positions; their penultimate hidden states concatenate to 80 features, zero-padded to 96 as SD3 pads CLIP's 2048 to
  T5's 4096. The byte-level tokenizer of ``models/tiny.py`` for both (tokenizer_2 pads with ``!``, as SD3's CLIP-G).
* FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0), SD 3.5 Medium's scheduler config.
* With ``t5=True`` also a T5EncoderModel (d_model 96 = joint_attention_dim, 1 layer) and a T5 tokenizer over a
  printable-ASCII Unigram vocabulary, to exercise the three-encoder path of SD 3.5.
"""

from __future__ import annotations

import os
import pathlib
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch
from torch import Tensor

from ddpo_tpu.catalog import family
from ddpo_tpu.models.loading import frozen

if TYPE_CHECKING:
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
    from transformers import CLIPTextModelWithProjection, CLIPTokenizer

__all__ = [
    "TINY_SD3_VERSION",
    "TINY_SD3_IMAGE_SIZE",
    "TINY_SD3_LATENT_SIZE",
    "SD3_LATENT_CHANNELS",
    "SD35_VAE_SCALING_FACTOR",
    "SD35_VAE_SHIFT_FACTOR",
    "SD35_SCHEDULER_SHIFT",
    "SD3_SUBFOLDERS",
    "SD3Components",
    "build_tiny_sd3",
    "ensure_tiny_sd3",
    "load_sd3",
    "encode_prompts_sd3",
    "sd3_velocity",
    "decode_sd3",
]

TINY_SD3_VERSION = "v3"
TINY_SD3_IMAGE_SIZE = 32
TINY_SD3_LATENT_SIZE = 8
SD3_LATENT_CHANNELS = 16
SD35_VAE_SCALING_FACTOR = 1.5305
SD35_VAE_SHIFT_FACTOR = 0.0609
SD35_SCHEDULER_SHIFT = 3.0
T5_MAX_SEQUENCE_LENGTH = 256  # StableDiffusion3Pipeline's default max_sequence_length (flow_grpo passes 128)

_TINY_CLIP_WIDTHS = (32, 48)  # CLIP-L, CLIP-G stand-ins
_TINY_JOINT_ATTENTION_DIM = 96  # > 32 + 48: the CLIP features are zero-padded, as SD3 pads 2048 to 4096
_TINY_HEADS, _TINY_HEAD_DIM = 2, 16

SD3_SUBFOLDERS = family("sd3").subfolders  # what a local SD 3 checkpoint dir holds (the catalog's)
_REQUIRED_FILES = (
    "model_index.json",
    "transformer/config.json",
    "vae/config.json",
    "text_encoder/config.json",
    "text_encoder_2/config.json",
    "scheduler/scheduler_config.json",
    "tokenizer/tokenizer_config.json",
    "tokenizer_2/tokenizer_config.json",
)
_EXPECTED = "expected " + ", ".join(f"{s}/" for s in SD3_SUBFOLDERS) + " (text_encoder_3/, tokenizer_3/ optional)"
_HUB_ID = re.compile(r"^(?![./~])[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)?$")


# --------------------------------------------------------------------------------------
# the tiny build
# --------------------------------------------------------------------------------------


def _build_clip(width: int, act: str, vocab_size: int, bos_id: int, eos_id: int, pad_id: int):
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    from ddpo_tpu.models.tiny import TOKENIZER_MAX_LENGTH

    config = CLIPTextConfig(
        vocab_size=vocab_size,
        hidden_size=width,
        intermediate_size=2 * width,
        projection_dim=width,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=TOKENIZER_MAX_LENGTH,
        hidden_act=act,
        layer_norm_eps=1e-5,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )
    return CLIPTextModelWithProjection(config)


def _build_transformer():
    from diffusers import SD3Transformer2DModel

    return SD3Transformer2DModel(
        # geometry: 8x8 latents of 16 channels in 2x2 patches, positions up to 16
        sample_size=TINY_SD3_LATENT_SIZE, patch_size=2, pos_embed_max_size=16,
        in_channels=SD3_LATENT_CHANNELS, out_channels=SD3_LATENT_CHANNELS,
        # blocks: SD 3.5 Medium's kinds (dual attention in 0, ..., 12 there; in the first of two here), rms qk-norm
        num_layers=2, dual_attention_layers=(0,), qk_norm="rms_norm",
        num_attention_heads=_TINY_HEADS, attention_head_dim=_TINY_HEAD_DIM,
        # conditioning: padded CLIP tokens, pooled CLIP features; the caption projection equals the inner width
        joint_attention_dim=_TINY_JOINT_ATTENTION_DIM, caption_projection_dim=_TINY_HEADS * _TINY_HEAD_DIM,
        pooled_projection_dim=sum(_TINY_CLIP_WIDTHS),
    )


def _build_vae():
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        # 3 levels (4x down-sampling) of one layer each: 32x32 RGB <-> 16x8x8 latents
        in_channels=3, out_channels=3, latent_channels=SD3_LATENT_CHANNELS, sample_size=TINY_SD3_IMAGE_SIZE,
        down_block_types=("DownEncoderBlock2D",) * 3, up_block_types=("UpDecoderBlock2D",) * 3,
        block_out_channels=(32, 64, 64), layers_per_block=1,
        # one group: the decoder's last norm keeps the latents' colour (32 groups over its 32 channels normalised
        # each channel on its own, so only the spatial pattern reached the image: see _pass_latents_through)
        norm_num_groups=1,
        # SD 3.5's latent normalisation, and no quant convs (as SD 3)
        scaling_factor=SD35_VAE_SCALING_FACTOR, shift_factor=SD35_VAE_SHIFT_FACTOR,
        use_quant_conv=False, use_post_quant_conv=False,
    )


def _pass_latents_through(decoder) -> None:
    """Zero the last layer of every residual branch of the decoder (resnets' conv2, attention's output projection),
    so each block starts as the identity and the image is a (random) function of the latents. A decoder with every
    weight random draws one texture whatever the latents (measured: the JPEG size of its images varies 1.53-1.58 kB
    between zero, constant and random latents), so no reward could be raised through it; with the residual branches
    zeroed, smooth latents decode to smooth images (1.04-1.5 kB). Zero-initialised residual branches are the usual
    start of diffusion networks; the trained SD 3.5 VAE of course needs none of this.

    The norm before the output then decides what of the latents is seen. With 32 groups of one channel each (v2) it
    removed every channel's mean and scale, so the JPEG size was a nearly even function of any shift of the latents
    (measured: the odd part of the size change for a +-0.5 shift along a random latent colour is 0.002 kB, a sixth
    of one sample's spread) and Flow-GRPO's gradient had no direction: gradients of 16-sample epochs at the initial
    policy were uncorrelated (cosine -0.003 +- 0.13 over 12 epochs) and a step along their mean did not change the
    reward. With one group (v3) the colour of the latents survives (odd part 0.0095 kB) and the smoke, with
    128 samples an epoch, learns (`tests/learning/test_learns.py[flow_grpo_smoke]`)."""
    with torch.no_grad():
        for name, module in decoder.named_modules():
            if name.endswith(".conv2") or name.endswith(".to_out.0"):
                module.weight.zero_()
                module.bias.zero_()


def _build_scheduler():
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=SD35_SCHEDULER_SHIFT)


def _build_t5():
    from transformers import T5Config, T5EncoderModel, T5TokenizerFast

    # Unigram over printable ASCII and the word-start marker: any text tokenizes (other characters become <unk>).
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -1.0)]
    vocab += [(chr(c), -2.0) for c in range(33, 127)]
    tokenizer = T5TokenizerFast(vocab=vocab, extra_ids=0)
    config = T5Config(vocab_size=len(vocab), d_model=_TINY_JOINT_ATTENTION_DIM, d_kv=16, d_ff=64, num_layers=1,
                      num_heads=2, relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1,
                      decoder_start_token_id=0)
    return T5EncoderModel(config), tokenizer


def build_tiny_sd3(out_dir: str | os.PathLike, seed: int = 0, t5: bool = False) -> pathlib.Path:
    """Build the tiny SD3-shaped pipeline with random (seeded, deterministic) weights and save it into ``out_dir``.
    ``t5=True`` adds a tiny T5 encoder (``text_encoder_3`` / ``tokenizer_3``).

    Does not touch the caller's global RNG state. Returns ``out_dir`` as a Path.
    """
    from diffusers import StableDiffusion3Pipeline

    from ddpo_tpu.models.tiny import BOS_TOKEN, EOS_TOKEN, _build_tokenizer, _write_tokenizer_files

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = _build_tokenizer(out)
    tokenizer_2 = _build_tokenizer(out)
    tokenizer_2.pad_token = "!"  # SD3's CLIP-G tokenizer pads with "!" (CLIP-L's with <|endoftext|>)
    tokenizer_2.init_kwargs["pad_token"] = "!"
    vocab_size = len(tokenizer)
    bos, eos = tokenizer.convert_tokens_to_ids(BOS_TOKEN), tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    pad_2 = tokenizer_2.convert_tokens_to_ids("!")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = _build_clip(_TINY_CLIP_WIDTHS[0], "quick_gelu", vocab_size, bos, eos, eos)
        torch.manual_seed(seed + 1)
        text_encoder_2 = _build_clip(_TINY_CLIP_WIDTHS[1], "gelu", vocab_size, bos, eos, pad_2)
        torch.manual_seed(seed + 2)
        transformer = _build_transformer()
        torch.manual_seed(seed + 3)
        vae = _build_vae()
        _pass_latents_through(vae.decoder)
        text_encoder_3, tokenizer_3 = None, None
        if t5:
            torch.manual_seed(seed + 4)
            text_encoder_3, tokenizer_3 = _build_t5()

    pipe = StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=_build_scheduler(),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        text_encoder_3=text_encoder_3,
        tokenizer_3=tokenizer_3,
    )
    pipe.save_pretrained(str(out), safe_serialization=True)
    for sub in ("tokenizer", "tokenizer_2"):  # plain vocab/merges too, as models/tiny.py does
        tok_dir = out / sub
        if not (tok_dir / "vocab.json").exists() or not (tok_dir / "merges.txt").exists():
            _write_tokenizer_files(tok_dir)
    return out


def ensure_tiny_sd3(cache_dir: str | os.PathLike, seed: int = 0, t5: bool = False) -> pathlib.Path:
    """Return ``cache_dir/tiny-sd3-{version}-seed{seed}`` (``...-t5`` with the T5 encoder), building it on first use
    (atomically, as ``ensure_tiny_model``: a temporary sibling renamed into place when complete)."""
    from ddpo_tpu.proc.build_cache import build_once

    required = _REQUIRED_FILES + (("text_encoder_3/config.json", "tokenizer_3/tokenizer_config.json") if t5 else ())
    name = f"tiny-sd3-{TINY_SD3_VERSION}-seed{seed}" + ("-t5" if t5 else "")
    return build_once(cache_dir, name, required, lambda tmp: build_tiny_sd3(tmp, seed=seed, t5=t5))


# --------------------------------------------------------------------------------------
# loading
# --------------------------------------------------------------------------------------


@dataclass
class SD3Components:
    transformer: SD3Transformer2DModel
    vae: AutoencoderKL
    text_encoder: CLIPTextModelWithProjection
    text_encoder_2: CLIPTextModelWithProjection
    tokenizer: CLIPTokenizer
    tokenizer_2: CLIPTokenizer
    scheduler: FlowMatchEulerDiscreteScheduler
    text_encoder_3: object | None = None  # T5EncoderModel
    tokenizer_3: object | None = None  # T5TokenizerFast

    @property
    def vae_scale_factor(self) -> int:
        """Image pixels per latent pixel (the pipeline's ``2 ** (len(block_out_channels) - 1)``)."""
        return 2 ** (len(self.vae.config.block_out_channels) - 1)

    @property
    def latent_channels(self) -> int:
        return int(self.transformer.config.in_channels)


def _short_reason(exc: BaseException, limit: int = 300) -> str:
    from ddpo_tpu.models.loading import _short_reason as short

    return short(exc, limit)


def _load_error(pretrained: str, revision: str | None, message: str, exc: BaseException | None = None):
    from ddpo_tpu.models.loading import ModelLoadError

    key = f"model.pretrained={pretrained}" + (f" (model.revision={revision})" if revision is not None else "")
    err = ModelLoadError(f"{key}: {message}" + (f" [{_short_reason(exc)}]" if exc is not None else ""))
    err.original = exc
    return err


def _fix(local: bool) -> str:
    where = (
        "re-download or rebuild that checkpoint (a diffusers Stable Diffusion 3 layout: " + _EXPECTED + ")"
        if local
        else "on a machine with network run `hf download <repo id> --local-dir /path/to/sd3` (a gated repo needs a "
        "token), copy that directory here and set model.pretrained=/path/to/sd3"
    )
    return f" Fix: {where}, or use the tiny local SD3 build."


def load_sd3(
    pretrained: str | os.PathLike,
    revision: str | None = None,
    local_files_only: bool = True,
    *,
    dtype: torch.dtype = torch.float32,
    vae_dtype: torch.dtype = torch.float32,
    load_t5: bool = True,
) -> SD3Components:
    """Load an SD 3 / 3.5 checkpoint (a local diffusers directory or a hub id) part by part with each class's
    ``from_pretrained(path, subfolder=...)``.

    The T5 encoder (``text_encoder_3`` / ``tokenizer_3``) is loaded when the checkpoint's ``model_index.json`` names
    it and ``load_t5`` is set; otherwise both are None and prompts are encoded with the CLIPs only (zeros in T5's
    place, as StableDiffusion3Pipeline does). Transformer and text encoders are cast to ``dtype``; the VAE to
    ``vae_dtype`` (float32 by default, as flow_grpo keeps it). Every model is in eval mode with requires_grad False.
    Failures raise ``ModelLoadError`` naming the part, the reason and the fix.
    """
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import CLIPTextModelWithProjection, CLIPTokenizer

    pretrained = os.fspath(pretrained)
    if not pretrained or not pretrained.strip():
        raise _load_error(repr(pretrained), revision,
                          f"no Stable Diffusion 3 checkpoint there (empty value).{_fix(True)}")
    local_path = os.path.expanduser(pretrained)
    is_local = os.path.isdir(local_path)
    if is_local:
        missing = [s for s in SD3_SUBFOLDERS if not os.path.isdir(os.path.join(local_path, s))]
        if missing:
            raise _load_error(pretrained, None, "no Stable Diffusion 3 checkpoint there (" + _EXPECTED + "; missing: "
                              + ", ".join(f"{s}/" for s in missing) + ")." + _fix(True))
        source = local_path
    elif os.path.exists(local_path) or not _HUB_ID.match(pretrained):
        detail = "it is a file, not a directory" if os.path.exists(local_path) else "path does not exist"
        raise _load_error(pretrained, None, f"no Stable Diffusion 3 checkpoint there ({detail}; {_EXPECTED})."
                          + _fix(True))
    else:
        source = pretrained

    common = dict(revision=revision, local_files_only=local_files_only)

    def load(sub: str, cls, **kwargs):
        try:
            return cls.from_pretrained(source, subfolder=sub, **common, **kwargs)
        except Exception as exc:  # any failure inside from_pretrained is a load failure of this part
            what = f"{sub}/ ({cls.__name__}) could not be loaded"
            if not is_local:
                what += (" (not in the local Hugging Face cache and local_files_only is set)" if local_files_only
                         else " from the Hugging Face Hub")
            raise _load_error(pretrained, revision, what + "." + _fix(is_local), exc) from None

    try:
        index = StableDiffusion3Pipeline.load_config(source, **common)
    except Exception as exc:
        raise _load_error(pretrained, revision, "model_index.json could not be read." + _fix(is_local), exc) from None
    t5_entry = index.get("text_encoder_3")
    has_t5 = isinstance(t5_entry, (list, tuple)) and len(t5_entry) == 2 and t5_entry[1] is not None

    parts = dict(
        transformer=load("transformer", SD3Transformer2DModel, torch_dtype=dtype),
        vae=load("vae", AutoencoderKL, torch_dtype=vae_dtype),
        text_encoder=load("text_encoder", CLIPTextModelWithProjection),
        text_encoder_2=load("text_encoder_2", CLIPTextModelWithProjection),
        tokenizer=load("tokenizer", CLIPTokenizer),
        tokenizer_2=load("tokenizer_2", CLIPTokenizer),
        scheduler=load("scheduler", FlowMatchEulerDiscreteScheduler),
    )
    if has_t5 and load_t5:
        from transformers import T5EncoderModel, T5TokenizerFast

        parts["text_encoder_3"] = load("text_encoder_3", T5EncoderModel)
        parts["tokenizer_3"] = load("tokenizer_3", T5TokenizerFast)

    for name in ("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3"):
        if parts.get(name) is not None:
            parts[name] = frozen(parts[name], vae_dtype if name == "vae" else dtype)
    return SD3Components(**parts)


# --------------------------------------------------------------------------------------
# prompts, the model call, decoding
# --------------------------------------------------------------------------------------


def _clip_embeds(tokenizer, text_encoder, prompts: list[str], device, max_length: int) -> tuple[Tensor, Tensor]:
    ids = tokenizer(prompts, padding="max_length", max_length=max_length, truncation=True,
                    return_tensors="pt").input_ids
    out = text_encoder(ids.to(device), output_hidden_states=True)
    return out.hidden_states[-2], out[0]  # penultimate layer; the projected pooled output (text_embeds)


def encode_prompts_sd3(
    components: SD3Components,
    prompts: Sequence[str],
    device,
    max_length: int | None = None,
    max_sequence_length: int = T5_MAX_SEQUENCE_LENGTH,
) -> tuple[Tensor, Tensor]:
    """``(prompt_embeds (B, max_length + max_sequence_length, joint_attention_dim), pooled (B, sum of CLIP widths))``.

    Follows ``StableDiffusion3Pipeline.encode_prompt`` (diffusers 0.42; one image per prompt, no clip_skip, no LoRA
    scale, the same prompt for all three encoders):

    * each CLIP (``_get_clip_prompt_embeds``): tokens padded / truncated to ``max_length`` (default the tokenizer's
      ``model_max_length``, 77, the pipeline's ``tokenizer_max_length``), ``hidden_states[-2]`` (the penultimate
      layer) as the sequence and ``output[0]`` (the projected pooled ``text_embeds``) as the pooled vector, cast to
      ``text_encoder``'s dtype;
    * the two sequences concatenated on the feature dim (CLIP-L first), zero-padded on the right to the T5 width
      (``joint_attention_dim``), then T5's sequence appended on the token dim: T5's ``last_hidden_state`` over
      ``max_sequence_length`` tokens, or, with no T5, zeros of that shape (``_get_t5_prompt_embeds``);
    * pooled: the two pooled vectors concatenated (CLIP-L first).

    ``max_sequence_length`` is the pipeline's (default 256); flow_grpo passes 128.
    Negative prompts for guidance are this function applied to ``[""] * B``, as the pipeline does with no
    negative_prompt.
    """
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    c = components
    if max_length is None:
        max_length = int(c.tokenizer.model_max_length)
    dtype = c.text_encoder.dtype
    embed_1, pooled_1 = _clip_embeds(c.tokenizer, c.text_encoder, prompts, device, max_length)
    embed_2, pooled_2 = _clip_embeds(c.tokenizer_2, c.text_encoder_2, prompts, device, max_length)
    clip_embeds = torch.cat([embed_1.to(dtype), embed_2.to(dtype)], dim=-1)

    if c.text_encoder_3 is None:
        t5_embeds = torch.zeros((len(prompts), max_sequence_length, c.transformer.config.joint_attention_dim),
                                device=device, dtype=dtype)
    else:
        ids = c.tokenizer_3(prompts, padding="max_length", max_length=max_sequence_length, truncation=True,
                            add_special_tokens=True, return_tensors="pt").input_ids
        t5_embeds = c.text_encoder_3(ids.to(device))[0].to(dtype=c.text_encoder_3.dtype)
    clip_embeds = torch.nn.functional.pad(clip_embeds, (0, t5_embeds.shape[-1] - clip_embeds.shape[-1]))
    prompt_embeds = torch.cat([clip_embeds, t5_embeds], dim=-2)
    pooled = torch.cat([pooled_1, pooled_2], dim=-1)
    return prompt_embeds, pooled


def sd3_velocity(
    transformer,
    latents: Tensor,
    timestep: Tensor,
    prompt_embeds: Tensor,
    pooled: Tensor,
    neg_prompt_embeds: Tensor | None = None,
    neg_pooled: Tensor | None = None,
    guidance_scale: float = 1.0,
    detach_uncond: bool = False,
) -> Tensor:
    """The SD3 transformer's velocity, with classifier-free guidance when negative embeddings are given.

    As the pipeline (and flow_grpo's ``compute_log_prob``): one forward on ``cat([uncond, cond])``, then
    ``uncond + guidance_scale * (cond - uncond)``. ``timestep`` (B,) is the float ``sigma * 1000``
    (``FlowTables.timestep_at``). Guidance 1 is the conditional velocity: no unconditional half is run.
    ``detach_uncond``: the unconditional half without gradient (flow_grpo's compute_log_prob at ac4c86e): the same
    value, gradient ``guidance_scale x d cond``.
    """
    if neg_prompt_embeds is None or guidance_scale == 1.0:
        return transformer(hidden_states=latents, timestep=timestep, encoder_hidden_states=prompt_embeds,
                           pooled_projections=pooled, return_dict=False)[0]
    if neg_pooled is None:
        raise ValueError("neg_prompt_embeds needs neg_pooled")
    out = transformer(
        hidden_states=torch.cat([latents, latents]),
        timestep=torch.cat([timestep, timestep]),
        encoder_hidden_states=torch.cat([neg_prompt_embeds, prompt_embeds]),
        pooled_projections=torch.cat([neg_pooled, pooled]),
        return_dict=False,
    )[0]
    uncond, cond = out.chunk(2)
    if detach_uncond:
        uncond = uncond.detach()
    return uncond + guidance_scale * (cond - uncond)


def decode_sd3(vae, latents: Tensor) -> Tensor:
    """Latents -> images in [0, 1], (B, 3, H, W) float32, as the pipeline with ``output_type="pt"``:
    ``vae.decode(latents / scaling_factor + shift_factor)``, then ``(x / 2 + 0.5).clamp(0, 1)``."""
    shift = vae.config.shift_factor or 0.0
    z = latents / vae.config.scaling_factor + shift
    image = vae.decode(z.to(vae.dtype), return_dict=False)[0]
    return (image.float() / 2 + 0.5).clamp(0, 1)
