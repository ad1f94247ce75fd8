"""Locally built Stable-Diffusion-shaped pipelines with random weights: the tiny model (below), SD 1.4's topology at
narrow widths (``sd14_topology``) and SD 1.4 at full widths (``sd14_random``); see ``SPECS``.

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
from dataclasses import dataclass

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


@dataclass(frozen=True)
class LocalModelSpec:
    """The shape of a locally built SD-1.x-layout pipeline (random weights). The tiny model is the default."""

    name: str
    version: str
    unet_blocks: tuple[int, ...] = (32, 64)
    unet_down: tuple[str, ...] = ("CrossAttnDownBlock2D", "DownBlock2D")
    unet_up: tuple[str, ...] = ("UpBlock2D", "CrossAttnUpBlock2D")
    unet_layers: int = 1
    latent_size: int = TINY_LATENT_SIZE
    vae_blocks: tuple[int, ...] = (32, 64, 64)
    vae_layers: int = 1
    text_hidden: int = TINY_TEXT_HIDDEN
    text_layers: int = 2
    text_heads: int = 4
    text_intermediate: int = 37

    @property
    def image_size(self) -> int:
        return self.latent_size * 2 ** (len(self.vae_blocks) - 1)


# SD 1.4's UNet, VAE and text-encoder topology (every block, layer and attention of CompVis/stable-diffusion-v1-4)
_SD14_TOPOLOGY = dict(
    unet_down=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
    unet_up=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
    unet_layers=2,
    vae_layers=2,
    text_layers=12,
)

SPECS = {
    "tiny": LocalModelSpec("tiny", TINY_MODEL_VERSION),
    # SD 1.4's topology at narrow widths: tracing (host) cost of SD 1.4 per step, the compute of a toy; 64 px images
    "sd14_topology": LocalModelSpec("sd14_topology", "v1", unet_blocks=(32, 32, 64, 64), latent_size=8,
                                    vae_blocks=(32, 32, 64, 64), text_hidden=64, text_heads=4,
                                    text_intermediate=128, **_SD14_TOPOLOGY),
    # SD 1.4 at its full widths (860M-param UNet, 512 px) with random weights: memory and FLOP figures. The byte-level
    # tokenizer keeps its 514-token vocabulary (SD's has 49,408): only the embedding table is smaller.
    "sd14_random": LocalModelSpec("sd14_random", "v1", unet_blocks=(320, 640, 1280, 1280), latent_size=64,
                                  vae_blocks=(128, 256, 512, 512), text_hidden=768, text_heads=12,
                                  text_intermediate=3072, **_SD14_TOPOLOGY),
}


def _build_text_encoder(spec: LocalModelSpec, vocab_size: int, bos_id: int, eos_id: int):
    from transformers import CLIPTextConfig, CLIPTextModel

    config = CLIPTextConfig(
        vocab_size=vocab_size,
        hidden_size=spec.text_hidden,
        intermediate_size=spec.text_intermediate,
        projection_dim=spec.text_hidden,
        num_hidden_layers=spec.text_layers,
        num_attention_heads=spec.text_heads,
        max_position_embeddings=TOKENIZER_MAX_LENGTH,
        hidden_act="quick_gelu",
        layer_norm_eps=1e-5,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )
    return CLIPTextModel(config)


def _build_unet(spec: LocalModelSpec):
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel(
        sample_size=spec.latent_size,
        in_channels=TINY_LATENT_CHANNELS,
        out_channels=TINY_LATENT_CHANNELS,
        down_block_types=spec.unet_down,
        mid_block_type="UNetMidBlock2DCrossAttn",
        up_block_types=spec.unet_up,
        block_out_channels=spec.unet_blocks,
        layers_per_block=spec.unet_layers,
        cross_attention_dim=spec.text_hidden,
        attention_head_dim=8,  # as SD 1.x: (legacy name) 8 heads
        norm_num_groups=32,
        act_fn="silu",
        flip_sin_to_cos=True,
        freq_shift=0,
    )


def _build_vae(spec: LocalModelSpec):
    from diffusers import AutoencoderKL

    levels = len(spec.vae_blocks)
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * levels,
        up_block_types=("UpDecoderBlock2D",) * levels,
        block_out_channels=spec.vae_blocks,  # n levels -> n-1 down-samplings
        layers_per_block=spec.vae_layers,
        latent_channels=TINY_LATENT_CHANNELS,
        norm_num_groups=32,
        sample_size=spec.image_size,
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


def build_tiny_pipeline(out_dir: str | os.PathLike, seed: int = 0, spec: str = "tiny") -> pathlib.Path:
    """Build the local SD pipeline `spec` (default: tiny) with random (seeded, deterministic) weights and save it into
    ``out_dir``.

    Does not touch the caller's global RNG state. Returns ``out_dir`` as a Path.
    """
    from diffusers import StableDiffusionPipeline

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    shape = SPECS[spec]
    tokenizer = _build_tokenizer(out)
    vocab_size = len(tokenizer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = _build_text_encoder(
            shape, vocab_size, tokenizer.convert_tokens_to_ids(BOS_TOKEN), tokenizer.convert_tokens_to_ids(EOS_TOKEN)
        )
        torch.manual_seed(seed + 1)
        unet = _build_unet(shape)
        torch.manual_seed(seed + 2)
        vae = _build_vae(shape)
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


def ensure_tiny_model(cache_dir: str | os.PathLike, seed: int = 0, spec: str = "tiny") -> pathlib.Path:
    """Return ``cache_dir/{spec}-sd-{version}-seed{seed}`` (the tiny model: ``tiny-sd-v1-seed0``), building it on
    first use.

    The build goes into a temporary sibling directory that is ``os.replace``d into place only when complete,
    so a concurrent or killed build never leaves a half-written model at the final path. Concurrent builders
    race harmlessly: the first rename wins, the others discard their copy.
    """
    from ddpo_tpu.proc.build_cache import build_once

    shape = SPECS[spec]
    return build_once(cache_dir, f"{shape.name}-sd-{shape.version}-seed{seed}", _REQUIRED_FILES,
                      lambda tmp: build_tiny_pipeline(tmp, seed=seed, spec=spec))
