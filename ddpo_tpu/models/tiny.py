"""A tiny Stable-Diffusion-shaped pipeline with random weights.

It is saved exactly like a real diffusers checkpoint (the CompVis/stable-diffusion-v1-4 layout:
``model_index.json`` plus ``unet/``, ``vae/``, ``text_encoder/``, ``tokenizer/``, ``scheduler/``), so tests
and the CPU smoke run load it through the same ``from_pretrained`` code as the real model.

Architecture (``TINY_MODEL_VERSION`` names it; bump the version whenever anything below changes):

* UNet2DConditionModel, ~0.8M params: block_out_channels (32, 64), one layer per block,
  CrossAttnDownBlock2D + DownBlock2D / UpBlock2D + CrossAttnUpBlock2D, cross-attention mid block,
  cross_attention_dim 32, 4 latent channels, sample_size 8 (8x8 latents).
* AutoencoderKL, 3 levels (32, 64, 64) -> 4x down-sampling: 32x32 RGB images <-> 4x8x8 latents,
  scaling_factor 0.18215 (as SD 1.x).
* CLIPTextModel: hidden 32, 2 layers, 4 heads, intermediate 37, 77 positions, vocab 514.
* CLIPTokenizer: byte-level vocabulary (every byte symbol and its ``</w>`` form, plus
  ``<|startoftext|>``/``<|endoftext|>``), no merges, so it tokenizes any text; model_max_length 77,
  pad token ``<|endoftext|>`` (as SD).
* DDIMScheduler with the SD 1.x settings.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil

import torch

TINY_MODEL_VERSION = "v1"

TINY_IMAGE_SIZE = 32  # RGB images are TINY_IMAGE_SIZE x TINY_IMAGE_SIZE
TINY_LATENT_SIZE = 8  # latents are 4 x TINY_LATENT_SIZE x TINY_LATENT_SIZE
TINY_LATENT_CHANNELS = 4
TINY_TEXT_HIDDEN = 32
TOKENIZER_MAX_LENGTH = 77
VAE_SCALING_FACTOR = 0.18215

BOS_TOKEN = "<|startoftext|>"
EOS_TOKEN = "<|endoftext|>"

# Files whose presence makes a saved pipeline directory loadable by load_components.
_REQUIRED_FILES = (
    "model_index.json",
    "unet/config.json",
    "vae/config.json",
    "text_encoder/config.json",
    "scheduler/scheduler_config.json",
    "tokenizer/tokenizer_config.json",
)

# Temp build dirs older than this are leftovers of killed builds and get removed.


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2 / CLIP byte -> printable unicode character table (the one byte-level BPE uses)."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(2**8):
        if b not in bs:
            bs.append(b)
            cs.append(2**8 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def tiny_vocab() -> dict[str, int]:
    """Byte-level CLIP-style vocabulary: 256 byte symbols, their ``</w>`` forms, then the 2 specials."""
    symbols = list(_bytes_to_unicode().values())
    tokens = symbols + [s + "</w>" for s in symbols] + [BOS_TOKEN, EOS_TOKEN]
    return {tok: i for i, tok in enumerate(tokens)}


def _write_tokenizer_files(directory: pathlib.Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "vocab.json").write_text(json.dumps(tiny_vocab(), ensure_ascii=False), encoding="utf-8")
    # No merges: every word is spelled byte by byte (last byte carries </w>), which covers any text.
    (directory / "merges.txt").write_text("#version: 0.2\n", encoding="utf-8")


def _build_tokenizer(workdir: pathlib.Path):
    from transformers import CLIPTokenizer

    src = workdir / "_tokenizer_src"
    _write_tokenizer_files(src)
    tok = CLIPTokenizer.from_pretrained(
        str(src),
        model_max_length=TOKENIZER_MAX_LENGTH,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
    )
    shutil.rmtree(src)
    # Loading bookkeeping that some transformers versions would otherwise write into tokenizer_config.json.
    for key in ("is_local", "local_files_only", "name_or_path"):
        tok.init_kwargs.pop(key, None)
    return tok


def _build_text_encoder(vocab_size: int, bos_id: int, eos_id: int):
    from transformers import CLIPTextConfig, CLIPTextModel

    config = CLIPTextConfig(
        vocab_size=vocab_size,
        hidden_size=TINY_TEXT_HIDDEN,
        intermediate_size=37,
        projection_dim=TINY_TEXT_HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=TOKENIZER_MAX_LENGTH,
        hidden_act="quick_gelu",
        layer_norm_eps=1e-5,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )
    return CLIPTextModel(config)


def _build_unet():
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel(
        sample_size=TINY_LATENT_SIZE,
        in_channels=TINY_LATENT_CHANNELS,
        out_channels=TINY_LATENT_CHANNELS,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        mid_block_type="UNetMidBlock2DCrossAttn",
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        block_out_channels=(32, 64),
        layers_per_block=1,
        cross_attention_dim=TINY_TEXT_HIDDEN,
        attention_head_dim=8,  # as SD 1.x: (legacy name) 8 heads
        norm_num_groups=32,
        act_fn="silu",
        flip_sin_to_cos=True,
        freq_shift=0,
    )


def _build_vae():
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 3,
        up_block_types=("UpDecoderBlock2D",) * 3,
        block_out_channels=(32, 64, 64),  # 3 levels -> 2 down-samplings -> factor 4
        layers_per_block=1,
        latent_channels=TINY_LATENT_CHANNELS,
        norm_num_groups=32,
        sample_size=TINY_IMAGE_SIZE,
        scaling_factor=VAE_SCALING_FACTOR,
    )


def _build_scheduler():
    from diffusers import DDIMScheduler

    return DDIMScheduler(
        num_train_timesteps=1000,
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        steps_offset=1,
        clip_sample=False,
        set_alpha_to_one=False,
        prediction_type="epsilon",
        timestep_spacing="leading",
    )


def build_tiny_pipeline(out_dir: str | os.PathLike, seed: int = 0) -> pathlib.Path:
    """Build the tiny SD pipeline with random (seeded, deterministic) weights and save it into ``out_dir``.

    Does not touch the caller's global RNG state. Returns ``out_dir`` as a Path.
    """
    from diffusers import StableDiffusionPipeline

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = _build_tokenizer(out)
    vocab_size = len(tokenizer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = _build_text_encoder(
            vocab_size, tokenizer.convert_tokens_to_ids(BOS_TOKEN), tokenizer.convert_tokens_to_ids(EOS_TOKEN)
        )
        torch.manual_seed(seed + 1)
        unet = _build_unet()
        torch.manual_seed(seed + 2)
        vae = _build_vae()
    if text_encoder.config.vocab_size != vocab_size:  # pragma: no cover - guards future edits
        raise AssertionError("tiny text encoder vocab_size does not match the tokenizer")

    pipe = StableDiffusionPipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=unet,
        scheduler=_build_scheduler(),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.save_pretrained(str(out), safe_serialization=True)

    # Also keep the plain vocab.json/merges.txt next to the tokenizer config (like the SD 1.4 repo), so
    # transformers versions whose save_pretrained only writes tokenizer.json still find them.
    tok_dir = out / "tokenizer"
    if not (tok_dir / "vocab.json").exists() or not (tok_dir / "merges.txt").exists():
        _write_tokenizer_files(tok_dir)
    return out


def ensure_tiny_model(cache_dir: str | os.PathLike, seed: int = 0) -> pathlib.Path:
    """Return ``cache_dir/tiny-sd-{TINY_MODEL_VERSION}-seed{seed}``, building it on first use.

    The build goes into a temporary sibling directory that is ``os.replace``d into place only when complete,
    so a concurrent or killed build never leaves a half-written model at the final path. Concurrent builders
    race harmlessly: the first rename wins, the others discard their copy.
    """
    from ddpo_tpu.models.build_cache import build_once

    return build_once(cache_dir, f"tiny-sd-{TINY_MODEL_VERSION}-seed{seed}", _REQUIRED_FILES,
                      lambda tmp: build_tiny_pipeline(tmp, seed=seed))
