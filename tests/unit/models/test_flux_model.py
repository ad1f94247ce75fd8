"""The FLUX.1 family's model pieces (ddpo_tpu.models.flux) against diffusers' own FluxPipeline: the tiny build loaded
through from_pretrained, prompt encoding, packing and its round trip, the latent ids, the shifted schedule, an ODE
sampling loop equal to FluxPipeline.__call__; the catalog's LoRA layer table and parameter counts against the real
FLUX.1-dev configs built on the meta device."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from diffusers import FluxPipeline

from ddpo_tpu.catalog import family
from ddpo_tpu.models.flux import (
    FLUX_VAE_SCALING_FACTOR,
    FLUX_VAE_SHIFT_FACTOR,
    FluxComponents,
    decode_flux,
    encode_prompts_flux,
    ensure_tiny_flux,
    flux_tables,
    flux_velocity,
    latent_image_ids,
    load_flux,
    pack_latents,
    text_ids,
    unpack_latents,
)

PROMPTS = ["a photo of a cat", "an astronaut riding a horse on the moon, oil painting", ""]
T5_TOKENS = 16


@pytest.fixture(scope="module")
def tiny_path(model_cache):
    return ensure_tiny_flux(model_cache)


@pytest.fixture(scope="module")
def comps(tiny_path) -> FluxComponents:
    return load_flux(str(tiny_path))


def pipeline_of(c: FluxComponents) -> FluxPipeline:
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler.from_config(c.scheduler.config), vae=c.vae,
                        text_encoder=c.text_encoder, tokenizer=c.tokenizer, text_encoder_2=c.text_encoder_2,
                        tokenizer_2=c.tokenizer_2, transformer=c.transformer)


def test_build_is_cached_and_loads_through_from_pretrained(model_cache, tiny_path, comps):
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import CLIPTextModel, T5EncoderModel

    assert ensure_tiny_flux(model_cache) == tiny_path
    assert json.loads((tiny_path / "model_index.json").read_text())["_class_name"] == "FluxPipeline"
    assert isinstance(comps.transformer, FluxTransformer2DModel) and comps.transformer.config.guidance_embeds
    assert isinstance(comps.vae, AutoencoderKL) and isinstance(comps.text_encoder, CLIPTextModel)
    assert isinstance(comps.text_encoder_2, T5EncoderModel)
    assert isinstance(comps.scheduler, FlowMatchEulerDiscreteScheduler) and comps.scheduler.config.use_dynamic_shifting
    assert comps.vae.config.scaling_factor == FLUX_VAE_SCALING_FACTOR and comps.vae.config.shift_factor == \
        FLUX_VAE_SHIFT_FACTOR
    assert comps.transformer.config.in_channels == 4 * comps.vae.config.latent_channels == 64
    for m in (comps.transformer, comps.vae, comps.text_encoder, comps.text_encoder_2):
        assert not m.training and not any(p.requires_grad for p in m.parameters())
    pipe = FluxPipeline.from_pretrained(str(tiny_path), local_files_only=True)  # diffusers' own loader agrees
    assert pipe.vae_scale_factor == comps.vae_scale_factor == 4


def test_a_directory_without_the_family_folders_is_refused_naming_the_key(tmp_path):
    from ddpo_tpu.models.loading import ModelLoadError

    (tmp_path / "transformer").mkdir()
    with pytest.raises(ModelLoadError) as e:
        load_flux(str(tmp_path))
    assert f"model.pretrained={tmp_path}" in str(e.value) and "missing vae/" in str(e.value)
    assert "model=tiny_flux" in str(e.value)


def test_encode_equals_the_pipelines_encode_prompt(comps):
    embeds, pooled = encode_prompts_flux(comps, PROMPTS, "cpu", max_sequence_length=T5_TOKENS)
    with torch.no_grad():
        e_embeds, e_pooled, e_text_ids = pipeline_of(comps).encode_prompt(
            prompt=PROMPTS, prompt_2=None, device=torch.device("cpu"), max_sequence_length=T5_TOKENS)
    assert embeds.shape == (3, T5_TOKENS, comps.transformer.config.joint_attention_dim)
    assert pooled.shape == (3, comps.transformer.config.pooled_projection_dim)
    assert torch.equal(embeds, e_embeds) and torch.equal(pooled, e_pooled)
    assert torch.equal(text_ids(T5_TOKENS), e_text_ids)
    assert not torch.equal(embeds[0], embeds[1]) and not torch.equal(pooled[0], pooled[1])


def test_packing_round_trips_and_equals_the_pipelines():
    x = torch.randn(3, 16, 8, 12, generator=torch.Generator().manual_seed(0))
    packed = pack_latents(x)
    assert packed.shape == (3, 4 * 6, 64)
    assert torch.equal(packed, FluxPipeline._pack_latents(x, 3, 16, 8, 12))
    assert torch.equal(unpack_latents(packed, 8, 12), x)
    # the pipeline unpacks from pixel sizes (latent x VAE factor 8)
    assert torch.equal(unpack_latents(packed, 8, 12), FluxPipeline._unpack_latents(packed, 64, 96, 8))
    # a token is one 2x2 patch of all channels, channel-major
    assert torch.equal(packed[1, 6 * 1 + 2].view(16, 2, 2), x[1, :, 2:4, 4:6])
    ids = latent_image_ids(8, 12)
    assert torch.equal(ids, FluxPipeline._prepare_latent_image_ids(3, 4, 6, "cpu", torch.float32))
    assert ids[6 * 1 + 2].tolist() == [0.0, 1.0, 2.0]


def test_the_schedule_is_the_pipelines_shifted_by_the_image_size(comps):
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift, retrieve_timesteps

    sched = pipeline_of(comps).scheduler
    for tokens in (16, 1024, 4096):
        mu = calculate_shift(tokens, 256, 4096, 0.5, 1.15)
        timesteps, _ = retrieve_timesteps(sched, 6, "cpu", sigmas=np.linspace(1.0, 1 / 6, 6), mu=mu)
        tables = flux_tables(comps.scheduler, 6, tokens, "cpu")
        assert torch.equal(tables.timesteps, timesteps.float()) and torch.equal(tables.sigmas, sched.sigmas.float())
        assert tables.sigmas[0] == 1 and tables.sigmas[-1] == 0
    # more tokens, more shift: every intermediate sigma of a 1024 px image is above a 512 px image's
    small, large = flux_tables(comps.scheduler, 6, 1024, "cpu"), flux_tables(comps.scheduler, 6, 4096, "cpu")
    assert bool((large.sigmas[1:-1] > small.sigmas[1:-1]).all())


def test_ode_sampling_loop_reproduces_the_pipeline(comps):
    """flux_tables + flux_velocity (the guidance embedding) + the Euler step + decode_flux == FluxPipeline.__call__."""
    steps, scale, prompts = 3, 3.5, PROMPTS[:2]
    latents = pack_latents(torch.randn(2, 16, 8, 8, generator=torch.Generator().manual_seed(2)))
    with torch.no_grad():
        expected = pipeline_of(comps)(prompt=prompts, num_inference_steps=steps, guidance_scale=scale, height=32,
                                      width=32, latents=latents.clone(), output_type="pt",
                                      max_sequence_length=T5_TOKENS).images
        embeds, pooled = encode_prompts_flux(comps, prompts, "cpu", max_sequence_length=T5_TOKENS)
        tables = flux_tables(comps.scheduler, steps, latents.shape[1], "cpu")
        guidance = torch.full((2,), scale)
        x = latents
        for i in range(steps):
            idx = torch.full((2,), i, dtype=torch.long)
            v = flux_velocity(comps.transformer, x, tables.timestep_at(idx), guidance, embeds, pooled,
                              latent_image_ids(8, 8), text_ids(T5_TOKENS))
            x = tables.ode_step(v, idx, x)
        images = decode_flux(comps.vae, x, 8, 8)
        other = flux_velocity(comps.transformer, latents, tables.timestep_at(idx), torch.full((2,), 1.0), embeds,
                              pooled, latent_image_ids(8, 8), text_ids(T5_TOKENS))
    torch.testing.assert_close(images, expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(other, v)  # the guidance embedding is read


# --- the catalog's figures against the real configs (meta device) --------------------------------------------------

def test_memory_figures_are_flux1_devs_parameter_counts():
    """The catalog's FLUX1_DEV_BILLIONS are what `scripts/bench.py --flux-activations` counts on the meta device, and
    its attention-score figure the probe's arithmetic."""
    from benchmarks.probes.flux_activations import attention_scores_gib, billions
    from ddpo_tpu.catalog.families import FLUX1_DEV_BILLIONS, FLUX_ATTENTION_SCORES_GIB_512

    assert billions() == FLUX1_DEV_BILLIONS
    assert FLUX_ATTENTION_SCORES_GIB_512 == pytest.approx(attention_scores_gib(), rel=1e-12)


def test_lora_layer_table_matches_the_tiny_and_the_real_transformer():
    from benchmarks.probes.flux_activations import parts
    from ddpo_tpu.launch import lora_targets
    from ddpo_tpu.models import flux

    from tests.helpers import block_layers

    layers = lambda model: block_layers(model, "flux")

    with torch.device("meta"):
        tiny = layers(flux._build_transformer())
    assert tiny == layers(parts()["transformer"]) == set(family("flux").lora_layers)
    assert not lora_targets.is_known("attn1.to_q", "flux") and lora_targets.is_known("proj_mlp", "flux")
