"""Tiny SD pipeline builder + load_components (the real from_pretrained path)."""

from __future__ import annotations

import hashlib
import json
import os
import time

import pytest
import torch

from ddpo_tpu.models import (
    TINY_IMAGE_SIZE,
    TINY_LATENT_SIZE,
    TINY_MODEL_VERSION,
    TOKENIZER_MAX_LENGTH,
    Components,
    ModelLoadError,
    build_tiny_pipeline,
    ensure_tiny_model,
    load_components,
)
from ddpo_tpu.models import tiny as tiny_mod

SUBFOLDERS = ("unet", "vae", "text_encoder", "tokenizer", "scheduler")


def _sha(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_pipeline(tmp_path_factory.mktemp("tiny") / "sd", seed=0)


@pytest.fixture(scope="module")
def comps(tiny_dir) -> Components:
    return load_components(str(tiny_dir), local_files_only=True)


def test_layout_matches_sd14(tiny_dir):
    index = json.loads((tiny_dir / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusionPipeline"
    assert index["unet"] == ["diffusers", "UNet2DConditionModel"]
    assert index["vae"] == ["diffusers", "AutoencoderKL"]
    assert index["text_encoder"] == ["transformers", "CLIPTextModel"]
    assert index["tokenizer"] == ["transformers", "CLIPTokenizer"]
    assert index["scheduler"] == ["diffusers", "DDIMScheduler"]
    assert index["safety_checker"] == [None, None]
    assert index["requires_safety_checker"] is False
    for sub in SUBFOLDERS:
        assert (tiny_dir / sub).is_dir(), sub
    assert (tiny_dir / "unet" / "diffusion_pytorch_model.safetensors").is_file()
    assert (tiny_dir / "vae" / "diffusion_pytorch_model.safetensors").is_file()
    assert (tiny_dir / "text_encoder" / "model.safetensors").is_file()
    assert (tiny_dir / "tokenizer" / "vocab.json").is_file()
    assert (tiny_dir / "tokenizer" / "merges.txt").is_file()
    sched = json.loads((tiny_dir / "scheduler" / "scheduler_config.json").read_text())
    expected = dict(
        num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
        steps_offset=1, clip_sample=False, set_alpha_to_one=False, prediction_type="epsilon",
    )
    for k, v in expected.items():
        assert sched[k] == v, k


def test_load_components_end_to_end(comps):
    from diffusers import DDIMScheduler

    assert isinstance(comps.scheduler, DDIMScheduler)
    for name in ("unet", "vae", "text_encoder"):
        m = getattr(comps, name)
        assert not m.training, name
        assert not any(p.requires_grad for p in m.parameters()), name
        assert all(p.dtype == torch.float32 for p in m.parameters()), name

    tok = comps.tokenizer
    assert tok.model_max_length == TOKENIZER_MAX_LENGTH == 77
    assert tok.pad_token == "<|endoftext|>"
    assert comps.text_encoder.config.vocab_size == len(tok)
    assert comps.vae.config.scaling_factor == pytest.approx(0.18215)

    prompts = ["a photo of a cat", "Ünïcödé ☃ 日本 🐱 — horse riding an astronaut, 4k!!", "", "dog"]
    ids = tok(prompts, padding="max_length", max_length=tok.model_max_length, truncation=True,
              return_tensors="pt").input_ids
    assert ids.shape == (4, 77)
    assert (ids[:, 0] == tok.bos_token_id).all()
    # Byte-level vocabulary: any text round-trips (lower-cased by CLIP normalisation; CLIP decoding puts
    # spaces between pre-tokenized words, so compare without whitespace) and nothing maps to unk.
    decoded = tok.batch_decode(ids, skip_special_tokens=True)
    nows = lambda s: "".join(s.split())  # noqa: E731
    assert [nows(d) for d in decoded] == [nows(p.lower()) for p in prompts]
    n_real = (ids != tok.pad_token_id).sum(1)
    assert n_real[2] == 1 and n_real[0] == 1 + len("aphotoofacat")  # bos + one token per byte, no merges
    with torch.no_grad():
        emb = comps.text_encoder(ids)[0]
    assert emb.shape == (4, 77, comps.unet.config.cross_attention_dim)
    assert torch.isfinite(emb).all()

    lat = TINY_LATENT_SIZE
    x = torch.randn(4, 4, lat, lat)
    t = torch.tensor([999, 500, 10, 1])
    with torch.no_grad():
        eps = comps.unet(x, t, encoder_hidden_states=emb).sample
        img = comps.vae.decode(torch.randn(4, 4, lat, lat) / comps.vae.config.scaling_factor).sample
        back = comps.vae.encode(img).latent_dist.mean
    assert eps.shape == x.shape and torch.isfinite(eps).all()
    assert img.shape == (4, 3, TINY_IMAGE_SIZE, TINY_IMAGE_SIZE) == (4, 3, 32, 32)
    assert back.shape == (4, 4, lat, lat)
    # Cross-attention is real: different prompts give different noise predictions.
    assert not torch.allclose(eps[0], comps.unet(x[:1], t[:1], encoder_hidden_states=emb[1:2]).sample[0])


def test_unet_size_and_topology(comps):
    """The tiny UNet is small and SD-shaped (its speed is a benchmark's, not a test's)."""
    n_unet = sum(p.numel() for p in comps.unet.parameters())
    assert 500_000 <= n_unet <= 1_500_000, n_unet
    cfg = comps.unet.config
    assert cfg.in_channels == cfg.out_channels == 4
    assert "CrossAttnDownBlock2D" in cfg.down_block_types and "CrossAttnUpBlock2D" in cfg.up_block_types
    assert cfg.cross_attention_dim == comps.text_encoder.config.hidden_size


def test_bf16_load(tiny_dir):
    c = load_components(str(tiny_dir), dtype=torch.bfloat16, local_files_only=True)
    for name in ("unet", "vae", "text_encoder"):
        m = getattr(c, name)
        assert all(p.dtype == torch.bfloat16 for p in m.parameters()), name
        assert not any(p.requires_grad for p in m.parameters()), name
    ids = c.tokenizer(["a cat"], padding="max_length", max_length=77, return_tensors="pt").input_ids
    with torch.no_grad():
        emb = c.text_encoder(ids)[0]
        out = c.unet(torch.randn(1, 4, TINY_LATENT_SIZE, TINY_LATENT_SIZE, dtype=torch.bfloat16), 10,
                     encoder_hidden_states=emb).sample
    assert emb.dtype == out.dtype == torch.bfloat16


def test_loads_as_a_diffusers_pipeline(tiny_dir):
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(str(tiny_dir), local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    out = pipe("a cat", num_inference_steps=2, guidance_scale=5.0, output_type="np",
               generator=torch.Generator().manual_seed(0))
    assert out.images.shape == (1, TINY_IMAGE_SIZE, TINY_IMAGE_SIZE, 3)


def test_build_is_deterministic_and_rng_neutral(tmp_path, tiny_dir):
    state = torch.get_rng_state()
    a = build_tiny_pipeline(tmp_path / "a", seed=0)
    assert torch.equal(state, torch.get_rng_state()), "build must not consume the caller's global RNG"
    b = build_tiny_pipeline(tmp_path / "b", seed=1)
    for f in ("unet/diffusion_pytorch_model.safetensors", "vae/diffusion_pytorch_model.safetensors",
              "text_encoder/model.safetensors"):
        assert _sha(a / f) == _sha(tiny_dir / f), f
        assert _sha(a / f) != _sha(b / f), f


def _leftovers(cache):
    return [p.name for p in cache.iterdir() if p.name.startswith(".") or "tmp" in p.name]


def test_ensure_tiny_model_builds_once(tmp_path):
    cache = tmp_path / "cache"
    p1 = ensure_tiny_model(cache, seed=0)
    assert p1 == cache / f"tiny-sd-{TINY_MODEL_VERSION}-seed0"
    assert (p1 / "model_index.json").is_file()
    marker = p1 / "unet" / "diffusion_pytorch_model.safetensors"
    mtime = marker.stat().st_mtime_ns
    p2 = ensure_tiny_model(str(cache), seed=0)
    assert p2 == p1
    assert marker.stat().st_mtime_ns == mtime, "second call must reuse, not rebuild"
    assert _leftovers(cache) == []
    assert sorted(p.name for p in cache.iterdir()) == [p1.name]


def test_ensure_tiny_model_killed_build_leaves_nothing_loadable(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    real_build = tiny_mod.build_tiny_pipeline

    def dying_build(out_dir, seed=0, **kw):
        real_build(out_dir, seed, **kw)
        (out_dir / "vae" / "diffusion_pytorch_model.safetensors").unlink()  # half written ...
        raise KeyboardInterrupt  # ... and killed

    monkeypatch.setattr(tiny_mod, "build_tiny_pipeline", dying_build)
    with pytest.raises(KeyboardInterrupt):
        ensure_tiny_model(cache, seed=3)
    assert not (cache / f"tiny-sd-{TINY_MODEL_VERSION}-seed3").exists()
    assert _leftovers(cache) == []

    # A stale temp dir from a build killed with SIGKILL (no cleanup ran) is removed by the next call,
    # and a non-atomic leftover at the final path is replaced by a complete build.
    stale = cache / f".tiny-sd-{TINY_MODEL_VERSION}-seed3.tmp-dead"
    (stale / "unet").mkdir(parents=True)
    old = time.time() - 3600
    os.utime(stale, (old, old))
    (cache / f"tiny-sd-{TINY_MODEL_VERSION}-seed3" / "unet").mkdir(parents=True)
    monkeypatch.setattr(tiny_mod, "build_tiny_pipeline", real_build)
    p = ensure_tiny_model(cache, seed=3)
    assert _leftovers(cache) == []
    assert load_components(str(p), local_files_only=True).unet is not None


def test_missing_path_raises_clear_error(tmp_path):
    with pytest.raises(ModelLoadError) as ei:
        load_components("/nope")
    msg = str(ei.value)
    assert msg.startswith("model.pretrained=/nope: no Stable Diffusion checkpoint there")
    assert "unet/" in msg and "scheduler/" in msg and "Fix:" in msg and "model=tiny" in msg
    assert "Traceback" not in msg

    with pytest.raises(ModelLoadError, match=r"model\.pretrained=.*missing: .*vae/"):
        (tmp_path / "partial" / "unet").mkdir(parents=True)
        load_components(str(tmp_path / "partial"))


def test_missing_subfolder_of_real_checkpoint(tmp_path, tiny_dir):
    import shutil

    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_dir, ckpt)
    shutil.rmtree(ckpt / "scheduler")
    with pytest.raises(ModelLoadError, match=r"missing: scheduler/"):
        load_components(str(ckpt))
    # Subfolder present but weights gone: still a ModelLoadError naming the part, not a raw OSError.
    shutil.copytree(tiny_dir / "scheduler", ckpt / "scheduler")
    (ckpt / "vae" / "diffusion_pytorch_model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"model\.pretrained=.*vae/"):
        load_components(str(ckpt))


def test_hub_id_offline_raises_quickly():
    # load_components imports these first; imported here, before the clock starts, the bound times the offline
    # lookup alone, not a worker's first diffusers import (9 s on a quiet 2-core machine, 72 s measured at load 8-12)
    from diffusers import AutoencoderKL, DDIMScheduler, UNet2DConditionModel  # noqa: F401
    from transformers import CLIPTextModel, CLIPTokenizer  # noqa: F401

    start = time.perf_counter()
    with pytest.raises(ModelLoadError) as ei:
        load_components("ddpo-tpu-test/definitely-not-cached-sd", revision="main", local_files_only=True)
    assert time.perf_counter() - start < 10
    msg = str(ei.value)
    assert "model.pretrained=ddpo-tpu-test/definitely-not-cached-sd" in msg
    assert "model.revision=main" in msg
    assert "huggingface-cli download ddpo-tpu-test/definitely-not-cached-sd --revision main" in msg
    assert "Traceback" not in msg and "\n" not in msg


# --- SD 1.4's topology: narrow (sd14_topology) and full width (sd14_random) -----------------------------------------

def _count(model, cls_name: str) -> int:
    return sum(type(m).__name__ == cls_name for m in model.modules())


@pytest.fixture(scope="module")
def sd14_topology(tmp_path_factory) -> Components:
    path = ensure_tiny_model(tmp_path_factory.mktemp("cache"), spec="sd14_topology")
    assert path.name == "sd14_topology-sd-v1-seed0"
    return load_components(str(path), local_files_only=True)


def test_sd14_topology_has_every_block_of_sd14(sd14_topology):
    """The ops torch_xla traces per step are SD 1.4's: the same blocks, layers and attentions, narrower."""
    unet, vae, text = sd14_topology.unet, sd14_topology.vae, sd14_topology.text_encoder
    c = unet.config
    assert tuple(c.down_block_types) == ("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",)
    assert tuple(c.up_block_types) == ("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3
    assert c.mid_block_type == "UNetMidBlock2DCrossAttn" and c.layers_per_block == 2 and c.attention_head_dim == 8
    # SD 1.4: 16 transformer blocks (2 x 3 down, 1 mid, 3 x 3 up), 32 attentions, 22 ResNet blocks in the UNet
    assert _count(unet, "Transformer2DModel") == 16
    assert _count(unet, "Attention") == 32
    assert _count(unet, "ResnetBlock2D") == 22
    assert len(vae.config.block_out_channels) == 4 and vae.config.layers_per_block == 2  # 8x down-sampling
    assert vae.config.sample_size == 8 * c.sample_size
    assert text.config.num_hidden_layers == 12
    assert sum(p.numel() for p in unet.parameters()) < 5e6  # the compute of a toy


def test_sd14_random_spec_is_sd14_at_full_width():
    """Built on the meta device (no memory): the UNet of SD 1.4 has 859,520,964 parameters."""
    spec = tiny_mod.SPECS["sd14_random"]
    with torch.device("meta"):
        unet = tiny_mod._build_unet(spec)
        vae = tiny_mod._build_vae(spec)
    assert sum(p.numel() for p in unet.parameters()) == 859_520_964
    assert tuple(unet.config.block_out_channels) == (320, 640, 1280, 1280) and unet.config.sample_size == 64
    assert unet.config.cross_attention_dim == 768
    assert tuple(vae.config.block_out_channels) == (128, 256, 512, 512) and vae.config.sample_size == 512
    assert spec.image_size == 512
