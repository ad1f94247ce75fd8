"""The Wan 2.1 text-to-video family: loading its components through ``from_pretrained``, prompt encoding, the guided
transformer call, decoding video latents, and a tiny Wan-shaped build -- as diffusers' ``WanPipeline`` (0.42) holds
them and yifan123/flow_grpo's Wan script (``scripts/train_wan2_1.py``, ``flow_grpo/diffusers_patch/
wan_pipeline_with_logprob.py`` and ``wan_prompt_embedding.py`` at 9745241, first added in 11caf1b) calls them.

Components (as in Wan-AI/Wan2.1-T2V-1.3B-Diffusers): ``WanTransformer3DModel`` (a DiT over (frames, h, w) latents in
1x2x2 patches with cross-attention to the text), ``AutoencoderKLWan`` (a causal 3-D VAE: 16 latent channels, 8x
spatial and 4x temporal compression, so F frames are (F - 1) / 4 + 1 latent frames; latents are normalised per
channel with ``latents_mean`` / ``latents_std``), ``UMT5EncoderModel`` + its tokenizer (umt5-xxl), and
``UniPCMultistepScheduler`` with flow sigmas and a static ``flow_shift``. flow_grpo samples and trains with its own
SDE on the scheduler's sigmas (``diffusion/wan_sde.py``), never with UniPC's multistep update.

The tiny build (``build_tiny_wan`` / ``ensure_tiny_wan``, version ``TINY_WAN_VERSION``: bump it whenever anything below
changes) is saved exactly like a real checkpoint (``WanPipeline.save_pretrained``), so tests and smoke runs load it
through the same code:

* WanTransformer3DModel with Wan 2.1's block kind at toy widths: 2 blocks, 2 heads of 16 (rms qk-norm across heads,
  cross-attention norm), ffn 64, text_dim 32 (the tiny UMT5's width), freq_dim 32, patch (1, 2, 2), 16 channels.
* AutoencoderKLWan at base_dim 8 with Wan 2.1's 4 levels, temporal downsampling and latent mean/std (the class's
  defaults are Wan 2.1's): 5 frames of 32x32 RGB <-> 16 x 2 x 4 x 4 latents. The decoder's residual branches start at
  zero (as the tiny SD3's, ``models/sd3.py::_pass_latents_through``), so the video follows the latents and a reward
  can be raised through it. (At base_dim 4 decoding took a third less time, but wan_grpo_smoke did not learn in 8
  epochs: -1.0029 -> -0.9976 kB, inside its noise.)
* UMT5EncoderModel (d_model 32, 1 layer) over the tiny SD3's printable-ASCII T5 tokenizer.
* UniPCMultistepScheduler with Wan 2.1-T2V's scheduler config (flow_prediction, use_flow_sigmas, flow_shift 3.0).

Wan 2.2 (diffusers 0.42.1 ``WanPipeline``: ``transformer_2``, ``boundary_ratio``, ``expand_timesteps``) is two more
builds of the same family, loaded by the same ``load_wan``:

* ``tiny_wan22`` (``build_tiny_wan22``), T2V-A14B's layout: two experts of the tiny transformer's shape (seeded apart),
  ``transformer`` for the high-noise steps (timestep >= boundary_ratio x num_train_timesteps) and ``transformer_2``
  for the rest, ``boundary_ratio`` 0.875 (Wan-AI/Wan2.2-T2V-A14B-Diffusers model_index.json), Wan 2.1's VAE (A14B
  keeps it). :class:`WanExperts` holds the two as one trainable module; families/wan.py picks the expert per step.
* ``tiny_wan22_ti2v`` (``build_tiny_wan22_ti2v``), TI2V-5B's text-to-video path: the Wan 2.2 VAE (AutoencoderKLWan
  with z_dim 48, ``is_residual``, pixels patched 2x2 into 12 channels, 16x spatial compression, Wan 2.2's
  latents_mean / latents_std from Wan-AI/Wan2.2-TI2V-5B-Diffusers vae/config.json) at base_dim 8, a 48-channel
  transformer, ``expand_timesteps`` (WanPipeline then gives the transformer a timestep per video token) and
  flow_shift 5.0 (the checkpoint's scheduler config).
"""

from __future__ import annotations

import os
import pathlib
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import Tensor

from ddpo_tpu.catalog.wan_memory import DEFAULT_FRAME, TEXT_TOKENS
from ddpo_tpu.models.loading import ModelLoadError, family_load_failure, frozen
from ddpo_tpu.models.vae_ops import xla_safe_vae

TINY_WAN_VERSION = "v1"
TINY_WAN22_VERSION = "v1"  # tiny_wan22 and tiny_wan22_ti2v (bump on any change to their builders)
EXPERTS = ("high", "low")  # model.train_experts' names: WanPipeline's transformer, transformer_2
# Wan-AI/Wan2.2-T2V-A14B-Diffusers model_index.json (diffusers' own two-expert test uses it too)
A14B_BOUNDARY_RATIO = 0.875
# Wan-AI/Wan2.2-TI2V-5B-Diffusers vae/config.json: the 48-channel Wan 2.2 VAE's latent statistics
WAN22_LATENTS_MEAN = [
    -0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557, -0.1382, 0.0542, 0.2813, 0.0891, 0.1570,
    -0.0098, 0.0375, -0.1825, -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502, -0.2055, -0.0322,
    0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230, -0.0313, -0.1649, 0.0117, 0.0723, -0.2839, -0.2083, -0.0520,
    0.3748, 0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667]
WAN22_LATENTS_STD = [
    0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013, 0.8158, 1.0344, 0.5894, 1.0901, 0.6885, 0.6165,
    0.8454, 0.4978, 0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659, 0.7069, 0.5338, 0.4889, 0.4917,
    0.4069, 0.4999, 0.6866, 0.4093, 0.5709, 0.6065, 0.6415, 0.4944, 0.5726, 1.2042, 0.5458, 1.6887, 0.3971, 1.0600,
    0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744]
# Wan-AI/Wan2.1-T2V-1.3B-Diffusers scheduler/scheduler_config.json (the keys that decide its sigmas and timesteps)
WAN_SCHEDULER = dict(num_train_timesteps=1000, prediction_type="flow_prediction", use_flow_sigmas=True,
                     flow_shift=3.0, final_sigmas_type="zero", timestep_spacing="linspace", solver_order=2)
_TINY_TEXT_WIDTH = 32

# The frame size a family config samples, (height, width) in pixels, unless model.resolution (a square) is set; the
# frame count is model.num_frames (conf/model/*wan*.yaml: 33 for the real models, 5 for the tiny build).
FLOW_GRPO_FRAME = DEFAULT_FRAME  # flow_grpo's general_ocr_wan2_1 (config/grpo.py): height 240, width 416
TINY_FRAME = (32, 32)           # 4x4 latents


# --------------------------------------------------------------------------------------
# the tiny build
# --------------------------------------------------------------------------------------


def _build_transformer(channels: int = 16):
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(
        patch_size=(1, 2, 2), in_channels=channels, out_channels=channels,
        num_attention_heads=2, attention_head_dim=16, ffn_dim=64, num_layers=2,  # Wan 2.1 1.3B: 12 x 128, 8960, 30
        text_dim=_TINY_TEXT_WIDTH, freq_dim=32, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
        rope_max_seq_len=64,
    )


def _build_vae():
    from diffusers import AutoencoderKLWan

    return AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=1,
                            temperal_downsample=[False, True, True])


def _build_vae22():
    """The Wan 2.2 VAE's structure (Wan-AI/Wan2.2-TI2V-5B-Diffusers vae/config.json: base_dim 160, decoder_base_dim
    256, z_dim 48, in/out 12 channels, patch_size 2, is_residual, 16x spatial) at base width 8."""
    from diffusers import AutoencoderKLWan

    return AutoencoderKLWan(base_dim=8, decoder_base_dim=8, z_dim=48, dim_mult=[1, 2, 4, 4], num_res_blocks=1,
                            temperal_downsample=[False, True, True], is_residual=True, in_channels=12,
                            out_channels=12, patch_size=2, scale_factor_spatial=16, scale_factor_temporal=4,
                            latents_mean=WAN22_LATENTS_MEAN, latents_std=WAN22_LATENTS_STD)


def _pass_latents_through(decoder, prefix: str = "Wan") -> None:
    """Zero the last conv of every residual branch of the decoder (and its attention's projection): each block starts
    as the identity (plus its shortcut), so the decoded video is a function of the latents, not one random texture.
    ``prefix`` names the block classes: "Wan" (AutoencoderKLWan), "QwenImage" (AutoencoderKLQwenImage: Wan's blocks
    under its own names)."""
    with torch.no_grad():
        for name, module in decoder.named_modules():
            if type(module).__name__ == f"{prefix}ResidualBlock":
                last = [m for m in module.conv2.modules() if hasattr(m, "weight")][-1]
                last.weight.zero_()
                last.bias.zero_()
            elif type(module).__name__ == f"{prefix}AttentionBlock":
                module.proj.weight.zero_()
                module.proj.bias.zero_()


def _build_text_encoder(vocab_size: int):
    from transformers import UMT5Config, UMT5EncoderModel

    return UMT5EncoderModel(UMT5Config(vocab_size=vocab_size, d_model=_TINY_TEXT_WIDTH, d_kv=16, d_ff=64,
                                       num_layers=1, num_heads=2, relative_attention_num_buckets=8, pad_token_id=0,
                                       eos_token_id=1, decoder_start_token_id=0))


def build_tiny_wan(out_dir: str | os.PathLike, seed: int = 0) -> pathlib.Path:
    """Build the tiny Wan-shaped pipeline with random (seeded) weights into ``out_dir`` (WanPipeline's layout).
    Does not touch the caller's global RNG state."""
    from diffusers import UniPCMultistepScheduler, WanPipeline

    from ddpo_tpu.models.sd3 import _build_t5

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng(devices=[]):
        _, tokenizer = _build_t5()  # the tiny T5 tokenizer (umt5-xxl is a T5 tokenizer too)
        torch.manual_seed(seed)
        text_encoder = _build_text_encoder(len(tokenizer))
        torch.manual_seed(seed + 1)
        transformer = _build_transformer()
        torch.manual_seed(seed + 2)
        vae = _build_vae()
        _pass_latents_through(vae.decoder)
    pipe = WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer,
                       scheduler=UniPCMultistepScheduler(**WAN_SCHEDULER))
    pipe.save_pretrained(str(out), safe_serialization=True)
    return out


def build_tiny_wan22(out_dir: str | os.PathLike, seed: int = 0, ti2v: bool = False) -> pathlib.Path:
    """A tiny Wan 2.2 pipeline in WanPipeline's layout (module docstring): ``ti2v`` False: T2V-A14B's two experts
    with boundary_ratio 0.875; True: TI2V-5B's 48-channel VAE and transformer with expand_timesteps."""
    from diffusers import UniPCMultistepScheduler, WanPipeline

    from ddpo_tpu.models.sd3 import _build_t5

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng(devices=[]):
        _, tokenizer = _build_t5()
        torch.manual_seed(seed)
        text_encoder = _build_text_encoder(len(tokenizer))
        torch.manual_seed(seed + 1)
        transformer = _build_transformer(48 if ti2v else 16)
        torch.manual_seed(seed + 2)
        vae = _build_vae22() if ti2v else _build_vae()
        _pass_latents_through(vae.decoder)
        torch.manual_seed(seed + 3)
        transformer_2 = None if ti2v else _build_transformer(16)
    scheduler = UniPCMultistepScheduler(**dict(WAN_SCHEDULER, flow_shift=5.0 if ti2v else 3.0))
    pipe = WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer,
                       scheduler=scheduler, transformer_2=transformer_2,
                       boundary_ratio=None if ti2v else A14B_BOUNDARY_RATIO, expand_timesteps=ti2v)
    pipe.save_pretrained(str(out), safe_serialization=True)
    return out


def ensure_tiny_wan22(cache_dir: str | os.PathLike, seed: int = 0, ti2v: bool = False) -> pathlib.Path:
    """``cache_dir/tiny-wan22[-ti2v]-{version}-seed{seed}``, built atomically on first use."""
    from ddpo_tpu.catalog import family
    from ddpo_tpu.proc.build_cache import build_once, pipeline_files

    subfolders = family("wan").subfolders + (() if ti2v else ("transformer_2",))
    name = f"tiny-wan22{'-ti2v' if ti2v else ''}-{TINY_WAN22_VERSION}-seed{seed}"
    return build_once(cache_dir, name, pipeline_files(subfolders), lambda tmp: build_tiny_wan22(tmp, seed, ti2v))


def ensure_tiny_wan_build(builder: str, cache_dir: str | os.PathLike) -> pathlib.Path:
    """The local build a model.builder of the Wan family names."""
    if builder == "tiny_wan":
        return ensure_tiny_wan(cache_dir)
    if builder in ("tiny_wan22", "tiny_wan22_ti2v"):
        return ensure_tiny_wan22(cache_dir, ti2v=builder == "tiny_wan22_ti2v")
    raise ValueError(f"model.builder={builder}: not a Wan build")


def ensure_tiny_wan(cache_dir: str | os.PathLike, seed: int = 0) -> pathlib.Path:
    """``cache_dir/tiny-wan-{version}-seed{seed}``, built atomically on first use (proc/build_cache.py)."""
    from ddpo_tpu.catalog import family
    from ddpo_tpu.proc.build_cache import build_once, pipeline_files

    required = pipeline_files(family("wan").subfolders)  # the catalog's list, as the loader checks
    return build_once(cache_dir, f"tiny-wan-{TINY_WAN_VERSION}-seed{seed}", required,
                      lambda tmp: build_tiny_wan(tmp, seed=seed))


# --------------------------------------------------------------------------------------
# loading
# --------------------------------------------------------------------------------------


@dataclass
class WanComponents:
    transformer: object   # WanTransformer3DModel
    vae: object           # AutoencoderKLWan
    text_encoder: object  # UMT5EncoderModel
    tokenizer: object     # T5TokenizerFast (umt5-xxl)
    scheduler: object     # UniPCMultistepScheduler with flow sigmas: only its sigmas and timesteps are used
    transformer_2: object | None = None  # Wan 2.2 A14B: the low-noise expert (WanPipeline's transformer_2)
    boundary_ratio: float | None = None  # its switch: transformer for timesteps >= boundary_ratio x train steps
    expand_timesteps: bool = False       # Wan 2.2 TI2V: a timestep per video token (WanPipeline.expand_timesteps)

    @property
    def boundary_timestep(self) -> float | None:
        """WanPipeline.__call__'s ``boundary_ratio * scheduler.config.num_train_timesteps`` (None: one transformer)."""
        if self.transformer_2 is None or self.boundary_ratio is None:
            return None
        return self.boundary_ratio * self.scheduler.config.num_train_timesteps

    @property
    def scale_factors(self) -> tuple[int, int]:
        """(temporal, spatial) pixels per latent pixel (WanPipeline.vae_scale_factor_temporal / _spatial)."""
        c = self.vae.config
        return int(c.scale_factor_temporal), int(c.scale_factor_spatial)

    def latent_shape(self, frames: int, height: int, width: int) -> tuple[int, int, int, int]:
        """(C, latent frames, h, w) of a video, as WanPipeline.prepare_latents."""
        t, s = self.scale_factors
        return int(self.transformer.config.in_channels), (frames - 1) // t + 1, height // s, width // s


def _load_failure(pretrained: str, revision: str | None, what: str, exc: BaseException | None = None) -> ModelLoadError:
    return family_load_failure("wan", "Wan 2.1", "tiny_wan", pretrained, revision, what, exc)


def load_wan(pretrained: str | os.PathLike, revision: str | None = None, local_files_only: bool = True, *,
             dtype: torch.dtype = torch.float32, vae_dtype: torch.dtype = torch.float32) -> WanComponents:
    """Load a Wan 2.1 text-to-video checkpoint part by part with each class's ``from_pretrained(path,
    subfolder=...)``: transformer and text encoder in ``dtype``, the VAE in ``vae_dtype`` (float32, as flow_grpo
    keeps it); all frozen in eval mode. The scheduler must be UniPC with flow sigmas (Wan 2.1's): flow_grpo's SDE
    reads its sigmas. Failures raise ModelLoadError naming the key and the fix."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel
    from transformers import AutoTokenizer, UMT5EncoderModel

    from ddpo_tpu.models.loading import load_parts

    classes = dict(transformer=WanTransformer3DModel, vae=AutoencoderKLWan, text_encoder=UMT5EncoderModel,
                   tokenizer=AutoTokenizer, scheduler=UniPCMultistepScheduler)
    index = _model_index(pretrained, revision, local_files_only)
    two = (index.get("transformer_2") or [None])[0] is not None  # Wan 2.2 A14B: [library, class] of the 2nd expert
    if two:
        classes["transformer_2"] = WanTransformer3DModel
    parts = load_parts(pretrained, revision, local_files_only, classes,
                       dict(transformer=dtype, transformer_2=dtype, vae=vae_dtype),
                       lambda rev, what, exc: _load_failure(os.fspath(pretrained), rev, what, exc), "Wan")
    if not parts["scheduler"].config.get("use_flow_sigmas", False):
        raise _load_failure(os.fspath(pretrained), revision, "scheduler/ has no flow sigmas (use_flow_sigmas false): "
                            "not Wan 2.1's flow-matching schedule")
    for name in ("transformer", "text_encoder", "transformer_2"):
        if name in parts:
            parts[name] = frozen(parts[name], dtype)
    parts["vae"] = frozen(parts["vae"], vae_dtype)
    boundary = index.get("boundary_ratio")
    if two and boundary is None:
        raise _load_failure(os.fspath(pretrained), revision, "model_index.json names a transformer_2 but no "
                            "boundary_ratio: WanPipeline would never call it")
    return WanComponents(**parts, boundary_ratio=boundary if two else None,
                         expand_timesteps=bool(index.get("expand_timesteps", False)))


def _model_index(pretrained, revision, local_files_only) -> dict:
    """The checkpoint's model_index.json (WanPipeline's config: transformer_2, boundary_ratio, expand_timesteps); {}
    when it cannot be read (the parts' own loading then names what is missing)."""
    source = os.path.expanduser(os.fspath(pretrained))
    if os.path.isdir(source):
        try:
            import json

            return json.loads(pathlib.Path(source, "model_index.json").read_text())
        except (OSError, ValueError):
            return {}
    try:
        from huggingface_hub import hf_hub_download
        import json

        path = hf_hub_download(os.fspath(pretrained), "model_index.json", revision=revision,
                               local_files_only=local_files_only)
        return json.loads(pathlib.Path(path).read_text())
    except Exception:  # noqa: BLE001 -- not in the cache: the parts' loading reports it with the fix
        return {}


class WanExperts(torch.nn.Module):
    """Wan 2.2 A14B's two experts as the one module a run trains: ``high`` (WanPipeline's ``transformer``, the
    high-noise steps) and ``low`` (``transformer_2``). Its parameters, train/eval, LoRA switches and gradient
    checkpointing are both experts'; which expert a step calls is the family's (``families/wan.py``), from the step
    indices and the fixed schedule, never from a tensor inside a graph."""

    def __init__(self, high, low):
        super().__init__()
        self.high, self.low = high, low

    @property
    def dtype(self) -> torch.dtype:
        return self.high.dtype

    @property
    def config(self):
        return self.high.config

    def expert(self, name: str):
        return {"high": self.high, "low": self.low}[name]

    def _each(self, method: str, *args) -> None:
        for m in (self.high, self.low):
            if method in ("disable_adapters", "enable_adapters") and not getattr(m, "_hf_peft_config_loaded", False):
                continue  # an expert trained without an adapter (model.train_experts left it out)
            getattr(m, method)(*args)

    def disable_adapters(self) -> None:
        self._each("disable_adapters")

    def enable_adapters(self) -> None:
        self._each("enable_adapters")

    def enable_gradient_checkpointing(self, *args) -> None:
        self._each("enable_gradient_checkpointing", *args)

    # DDP (runtime/distributed.py prepare_model): a step whose rows all call one expert leaves the other's trained
    # weights out of its graph, which DDP's reducer must be told to expect (families/wan.py: the decision and cost)
    ddp_find_unused_parameters = True

    @property
    def fsdp_units(self) -> tuple[torch.nn.Module, torch.nn.Module]:
        """FSDP2 shards each expert as its own unit (runtime/distributed.py prepare_model): a step gathers the
        weights of the expert it calls, not both (A14B: one 14B expert's gathered copy at a time)."""
        return self.high, self.low

    def forward(self, run: Callable[["WanExperts"], Tensor]) -> Tensor:
        """``run(self)``: the family's velocity on these experts (it calls ``.high`` / ``.low`` as the step needs),
        called through a data-parallel wrapper's forward so the wrapper sees one forward per velocity: DDP arms its
        gradient reduction from the output, FSDP2 gathers the experts' shards before and frees them after."""
        return run(self)


# --------------------------------------------------------------------------------------
# prompts, the model call, decoding
# --------------------------------------------------------------------------------------


def encode_prompts_wan(c: WanComponents, prompts: Sequence[str], device, max_sequence_length: int = TEXT_TOKENS
                       ) -> Tensor:
    """(B, max_sequence_length, text width) as flow_grpo's ``wan_prompt_embedding._get_t5_prompt_embeds``: UMT5's last
    hidden state over the padded tokens with their attention mask, each prompt's states past its own length zeroed
    (WanPipeline does the same after ftfy/whitespace cleaning, which flow_grpo skips; so do we), in UMT5's dtype."""
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    tok = c.tokenizer(prompts, padding="max_length", max_length=max_sequence_length, truncation=True,
                      add_special_tokens=True, return_attention_mask=True, return_tensors="pt")
    mask = tok.attention_mask.to(device)
    embeds = c.text_encoder(tok.input_ids.to(device), mask).last_hidden_state.to(c.text_encoder.dtype)
    # the reference keeps u[:len] and pads with zeros: the same as zeroing every position past the prompt's length
    keep = torch.arange(max_sequence_length, device=device)[None, :] < mask.gt(0).sum(dim=1, keepdim=True)
    return embeds * keep[..., None].to(embeds.dtype)


def wan_velocity(transformer, latents: Tensor, timestep: Tensor, prompt_embeds: Tensor,
                 neg_prompt_embeds: Tensor | None = None, guidance_scale: float = 1.0,
                 detach_uncond: bool = False) -> Tensor:
    """The transformer's flow velocity with classifier-free guidance as flow_grpo's Wan code: a conditional pass, then
    (guidance on) an unconditional pass, ``uncond + guidance_scale * (cond - uncond)``. ``timestep`` (B,) is the
    schedule's ``sigma * 1000`` (integer-valued: UniPC's timesteps are int64; the transformer's sinusoidal embedding
    reads them as floats either way). ``detach_uncond``: the unconditional pass without gradient."""
    cond = transformer(hidden_states=latents, timestep=timestep, encoder_hidden_states=prompt_embeds,
                       return_dict=False)[0]
    if neg_prompt_embeds is None or guidance_scale == 1.0:
        return cond
    uncond = transformer(hidden_states=latents, timestep=timestep, encoder_hidden_states=neg_prompt_embeds,
                         return_dict=False)[0]
    if detach_uncond:
        uncond = uncond.detach()
    return uncond + guidance_scale * (cond - uncond)


def decode_wan(vae, latents: Tensor) -> Tensor:
    """(B, C, f, h, w) latents -> video in [0, 1], (B, F, 3, H, W) float32, as WanPipeline with ``output_type="pt"``:
    ``latents / (1 / latents_std) + latents_mean`` per channel, ``vae.decode``, then the video processor's
    ``(x / 2 + 0.5).clamp(0, 1)`` with frames before channels."""
    cfg = vae.config
    shape = (1, cfg.z_dim, 1, 1, 1)
    mean = torch.tensor(cfg.latents_mean, device=latents.device, dtype=torch.float32).view(shape)
    inv_std = 1.0 / torch.tensor(cfg.latents_std, device=latents.device, dtype=torch.float32).view(shape)
    z = latents.float() / inv_std + mean  # the pipeline's order of operations (it holds 1 / std)
    with xla_safe_vae():
        video = vae.decode(z.to(vae.dtype), return_dict=False)[0]
    return (video.float() / 2 + 0.5).clamp(0, 1).permute(0, 2, 1, 3, 4)
