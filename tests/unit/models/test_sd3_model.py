"""Tests for the SD3 family (ddpo_tpu.models.sd3): the tiny build, loading through from_pretrained, prompt encoding
against diffusers' own StableDiffusion3Pipeline, the guided velocity, decoding, and a sampling loop on FlowTables."""

from __future__ import annotations

import json

import pytest
import torch
from diffusers import StableDiffusion3Pipeline

from ddpo_tpu.diffusion.flow import FlowTables
from ddpo_tpu.models.loading import ModelLoadError
from ddpo_tpu.models.sd3 import (
    SD35_VAE_SCALING_FACTOR,
    SD35_VAE_SHIFT_FACTOR,
    SD3Components,
    decode_sd3,
    encode_prompts_sd3,
    ensure_tiny_sd3,
    load_sd3,
    sd3_velocity,
)

PROMPTS = ["a photo of a cat", "an astronaut riding a horse on the moon, oil painting", ""]
T5_TOKENS = 16  # max_sequence_length: the T5 part of the sequence (zeros without T5); the pipeline's default is 256


@pytest.fixture(scope="module")
def tiny_path(model_cache):
    return ensure_tiny_sd3(model_cache)


@pytest.fixture(scope="module")
def comps(tiny_path) -> SD3Components:
    return load_sd3(str(tiny_path))


def pipeline_of(c: SD3Components) -> StableDiffusion3Pipeline:
    return StableDiffusion3Pipeline(
        transformer=c.transformer, scheduler=c.scheduler, vae=c.vae, text_encoder=c.text_encoder,
        tokenizer=c.tokenizer, text_encoder_2=c.text_encoder_2, tokenizer_2=c.tokenizer_2,
        text_encoder_3=c.text_encoder_3, tokenizer_3=c.tokenizer_3,
    )


def test_build_is_cached_and_loads_through_from_pretrained(model_cache, tiny_path, comps):
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
    from transformers import CLIPTextModelWithProjection

    assert ensure_tiny_sd3(model_cache) == tiny_path  # second call: the cached build
    index = json.loads((tiny_path / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusion3Pipeline"
    assert index["text_encoder_3"] == [None, None] and index["tokenizer_3"] == [None, None]

    assert isinstance(comps.transformer, SD3Transformer2DModel)
    assert isinstance(comps.vae, AutoencoderKL)
    assert isinstance(comps.text_encoder, CLIPTextModelWithProjection)
    assert isinstance(comps.text_encoder_2, CLIPTextModelWithProjection)
    assert isinstance(comps.scheduler, FlowMatchEulerDiscreteScheduler)
    assert comps.text_encoder_3 is None and comps.tokenizer_3 is None
    assert comps.scheduler.config.shift == 3.0 and not comps.scheduler.config.use_dynamic_shifting
    assert comps.vae.config.scaling_factor == SD35_VAE_SCALING_FACTOR == 1.5305
    assert comps.vae.config.shift_factor == SD35_VAE_SHIFT_FACTOR == 0.0609
    assert comps.vae.config.latent_channels == comps.latent_channels == 16
    cfg = comps.transformer.config
    width_1, width_2 = comps.text_encoder.config.hidden_size, comps.text_encoder_2.config.hidden_size
    assert cfg.pooled_projection_dim == width_1 + width_2 and cfg.joint_attention_dim > width_1 + width_2
    for m in (comps.transformer, comps.vae, comps.text_encoder, comps.text_encoder_2):
        assert not m.training and not any(p.requires_grad for p in m.parameters())
    # the whole directory also loads as diffusers' own pipeline (which wants the absent T5 named, as for SD3 without T5)
    pipe = StableDiffusion3Pipeline.from_pretrained(str(tiny_path), local_files_only=True, text_encoder_3=None,
                                                    tokenizer_3=None)
    assert pipe.text_encoder_3 is None and pipe.vae_scale_factor == comps.vae_scale_factor == 4


def test_encode_equals_the_pipelines_encode_prompt(comps):
    pipe = pipeline_of(comps)
    embeds, pooled = encode_prompts_sd3(comps, PROMPTS, "cpu", max_sequence_length=T5_TOKENS)
    neg, neg_pooled = encode_prompts_sd3(comps, [""] * len(PROMPTS), "cpu", max_sequence_length=T5_TOKENS)
    with torch.no_grad():
        e_embeds, e_neg, e_pooled, e_neg_pooled = pipe.encode_prompt(
            prompt=PROMPTS, prompt_2=None, prompt_3=None, device=torch.device("cpu"),
            do_classifier_free_guidance=True, max_sequence_length=T5_TOKENS,
        )
    assert embeds.shape == (3, 77 + T5_TOKENS, comps.transformer.config.joint_attention_dim)
    assert pooled.shape == (3, comps.transformer.config.pooled_projection_dim)
    for got, expected in ((embeds, e_embeds), (pooled, e_pooled), (neg, e_neg), (neg_pooled, e_neg_pooled)):
        assert got.shape == expected.shape and torch.equal(got, expected)
    # the layout: CLIP-L | CLIP-G | zero padding on the features, then the (absent) T5 tokens as zeros
    w1, w2 = comps.text_encoder.config.hidden_size, comps.text_encoder_2.config.hidden_size
    assert torch.all(embeds[:, :77, w1 + w2:] == 0) and torch.all(embeds[:, 77:] == 0)
    assert embeds[:, :77, :w1 + w2].abs().sum() > 0
    assert not torch.equal(embeds[0], embeds[1]) and not torch.equal(pooled[0], pooled[1])


def test_velocity_shapes_and_guidance(comps):
    embeds, pooled = encode_prompts_sd3(comps, PROMPTS[:2], "cpu", max_sequence_length=T5_TOKENS)
    neg, neg_pooled = encode_prompts_sd3(comps, ["", ""], "cpu", max_sequence_length=T5_TOKENS)
    x = torch.randn(2, 16, 8, 8, generator=torch.Generator().manual_seed(0))
    t = torch.tensor([1000.0, 437.5])
    with torch.no_grad():
        cond = sd3_velocity(comps.transformer, x, t, embeds, pooled)
        uncond = sd3_velocity(comps.transformer, x, t, neg, neg_pooled)
        guided = sd3_velocity(comps.transformer, x, t, embeds, pooled, neg, neg_pooled, guidance_scale=4.5)
    assert cond.shape == x.shape == guided.shape
    torch.testing.assert_close(guided, uncond + 4.5 * (cond - uncond), rtol=1e-4, atol=1e-5)
    assert not torch.allclose(cond, uncond)
    with torch.no_grad():  # the timestep matters
        other_t = sd3_velocity(comps.transformer, x, torch.tensor([10.0, 10.0]), embeds, pooled)
    assert not torch.allclose(cond, other_t)


def test_decode_applies_scaling_and_shift(comps):
    latents = torch.randn(2, 16, 8, 8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        images = decode_sd3(comps.vae, latents)
        raw = comps.vae.decode(latents / 1.5305 + 0.0609, return_dict=False)[0]
        unshifted = comps.vae.decode(latents / 1.5305, return_dict=False)[0]
    assert images.shape == (2, 3, 32, 32) and images.dtype == torch.float32
    assert images.min() >= 0 and images.max() <= 1
    expected = pipeline_of(comps).image_processor.postprocess(raw, output_type="pt")  # the pipeline's last step
    torch.testing.assert_close(images, expected)
    assert not torch.allclose(images, (unshifted / 2 + 0.5).clamp(0, 1))


def test_ode_sampling_loop_reproduces_the_pipeline(comps):
    """FlowTables (timesteps, Euler step) + sd3_velocity (CFG) + decode_sd3 == StableDiffusion3Pipeline.__call__."""
    steps, scale = 3, 4.5
    prompts = PROMPTS[:2]
    latents = torch.randn(2, 16, 8, 8, generator=torch.Generator().manual_seed(2))
    pipe = pipeline_of(comps)
    with torch.no_grad():
        expected = pipe(prompt=prompts, num_inference_steps=steps, guidance_scale=scale, height=32, width=32,
                        latents=latents.clone(), output_type="pt", max_sequence_length=T5_TOKENS).images
        embeds, pooled = encode_prompts_sd3(comps, prompts, "cpu", max_sequence_length=T5_TOKENS)
        neg, neg_pooled = encode_prompts_sd3(comps, ["", ""], "cpu", max_sequence_length=T5_TOKENS)
        tables = FlowTables.from_scheduler(comps.scheduler, steps, "cpu")
        x = latents
        for i in range(steps):
            idx = torch.full((2,), i, dtype=torch.long)
            v = sd3_velocity(comps.transformer, x, tables.timestep_at(idx), embeds, pooled, neg, neg_pooled, scale)
            x = tables.ode_step(v, idx, x)
        images = decode_sd3(comps.vae, x)
    torch.testing.assert_close(images, expected, rtol=1e-5, atol=1e-5)


def test_t5_path_matches_the_pipeline(tmp_path):
    path = ensure_tiny_sd3(tmp_path, t5=True)
    c = load_sd3(str(path))
    assert c.text_encoder_3 is not None and c.tokenizer_3 is not None
    embeds, pooled = encode_prompts_sd3(c, PROMPTS, "cpu", max_sequence_length=T5_TOKENS)
    with torch.no_grad():
        e_embeds, _, e_pooled, _ = pipeline_of(c).encode_prompt(
            prompt=PROMPTS, prompt_2=None, prompt_3=None, device=torch.device("cpu"),
            do_classifier_free_guidance=False, max_sequence_length=T5_TOKENS,
        )
    assert torch.equal(embeds, e_embeds) and torch.equal(pooled, e_pooled)
    assert embeds[:, 77:].abs().sum() > 0  # real T5 states, not zeros
    assert load_sd3(str(path), load_t5=False).text_encoder_3 is None


def test_load_errors_name_the_problem(tmp_path, tiny_path):
    with pytest.raises(ModelLoadError, match="missing: transformer/"):
        load_sd3(str(tmp_path))
    with pytest.raises(ModelLoadError, match="path does not exist"):
        load_sd3(str(tmp_path / "nope"))
    broken = tmp_path / "broken"
    broken.mkdir()
    for sub in tiny_path.iterdir():
        target = broken / sub.name
        target.symlink_to(sub, target_is_directory=sub.is_dir())
    (broken / "transformer").unlink()
    (broken / "transformer").mkdir()  # present but empty
    with pytest.raises(ModelLoadError, match=r"transformer/ \(SD3Transformer2DModel\) could not be loaded"):
        load_sd3(str(broken))
