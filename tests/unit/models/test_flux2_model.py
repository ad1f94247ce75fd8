"""The FLUX.2-klein family's model pieces (ddpo_tpu.models.flux2, families/flux2.py): the tiny build loaded through
from_pretrained (and by diffusers' own Flux2KleinPipeline), prompt encoding against the pipeline's encode_prompt,
packing and the schedule against the pipeline's own functions, the catalog's LoRA layer table and parameter counts
against klein 4B's and 9B's published configs on the meta device, the compose-time rules (LoRA names, the memory rule
on real chips), load errors, and one eager GRPO (with CFG) and DiffusionNFT epoch."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ddpo_tpu.catalog import family
from ddpo_tpu.config.compose import compose_and_validate
from ddpo_tpu.models.flux2 import encode_prompts_flux2, ensure_tiny_flux2, load_flux2
from ddpo_tpu.problems import ConfigError

PROMPTS = ["a photo of a cat", "an astronaut riding a horse on the moon, oil painting", ""]
# black-forest-labs/FLUX.2-klein-4B and -9B transformer/config.json (the keys that differ from diffusers' defaults)
# and their text encoders' (Qwen/Qwen3-4B, Qwen/Qwen3-8B) config.json
KLEIN_TRANSFORMER = {
    "4b": dict(num_layers=5, num_single_layers=20, num_attention_heads=24, joint_attention_dim=7680,
               guidance_embeds=False),
    "9b": dict(num_layers=8, num_single_layers=24, num_attention_heads=32, joint_attention_dim=12288,
               guidance_embeds=False),
}
QWEN3 = {
    "4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    "9b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False),
}
FF_TARGETS = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
              "attn.add_v_proj", "attn.to_add_out", "ff.linear_in", "ff.linear_out", "ff_context.linear_in",
              "ff_context.linear_out", "attn.to_qkv_mlp_proj"]  # Flow-Factory@a0b2bc5 flux2_klein.py:91-104
# Flow-Factory's klein settings (examples/grpo/lora/flux2_klein/default.yaml): 4 steps, groups of 16, one sample a
# micro-step, one SDE step
REAL = ["+experiment=flux2_grpo_smoke", "train.mixed_precision=bf16", "sample.num_steps=4", "sample.batch_size=16",
        "sample.num_batches_per_epoch=3", "algorithm.group_size=16", "train.batch_size=1",
        "train.gradient_accumulation_steps=24", "sample.sde_window.size=1"]


@pytest.fixture(scope="module")
def tiny_path(model_cache):
    return ensure_tiny_flux2(model_cache)


@pytest.fixture(scope="module")
def comps(tiny_path):
    return load_flux2(str(tiny_path))


@pytest.fixture(scope="module")
def pipe(tiny_path):
    from diffusers import Flux2KleinPipeline

    return Flux2KleinPipeline.from_pretrained(str(tiny_path))  # how Flow-Factory loads it: the pipeline whole


def test_build_is_cached_and_loads_through_from_pretrained(model_cache, tiny_path, comps, pipe):
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel
    from transformers import Qwen3ForCausalLM

    assert ensure_tiny_flux2(model_cache) == tiny_path
    index = json.loads((tiny_path / "model_index.json").read_text())
    assert index["_class_name"] == "Flux2KleinPipeline" and index["is_distilled"] is False
    assert comps.is_distilled is False
    assert isinstance(comps.transformer, Flux2Transformer2DModel) and not comps.transformer.config.guidance_embeds
    assert isinstance(comps.vae, AutoencoderKLFlux2) and isinstance(comps.text_encoder, Qwen3ForCausalLM)
    assert isinstance(comps.scheduler, FlowMatchEulerDiscreteScheduler) and comps.scheduler.config.use_dynamic_shifting
    assert not any(p.requires_grad for m in (comps.transformer, comps.text_encoder, comps.vae) for p in m.parameters())
    assert comps.vae_scale_factor == pipe.vae_scale_factor == 4
    # the batch-norm statistics are not the identity's, so the test of the denormalisation can fail
    assert comps.vae.bn.running_mean.abs().min() > 0 and (comps.vae.bn.running_var - 1).abs().max() > 0.1
    assert torch.equal(pipe.transformer.proj_out.weight, comps.transformer.proj_out.weight)
    # the text layers the pipeline reads are inner layers of the tiny Qwen3, as of the 36-layer real ones
    assert comps.text_encoder.config.num_hidden_layers > 27


def test_prompt_states_equal_the_pipelines_encode_prompt(comps, pipe):
    with torch.no_grad():
        ours = encode_prompts_flux2(comps, PROMPTS, "cpu")
        ref, ref_ids = pipe.encode_prompt(PROMPTS, device="cpu")
    assert ours.shape == (3, 512, 48)  # 512 tokens, three layers of width 16
    assert torch.equal(ours, ref)
    assert torch.equal(ref_ids[0, :, 3], torch.arange(512))
    # the states of layers 9, 18 and 27 side by side
    with torch.no_grad():
        h = comps.text_encoder(**comps.tokenizer(comps.tokenizer.apply_chat_template(
            [{"role": "user", "content": "a cat"}], tokenize=False, add_generation_prompt=True,
            enable_thinking=False), return_tensors="pt", padding="max_length", max_length=512),
            output_hidden_states=True).hidden_states
        one = encode_prompts_flux2(comps, ["a cat"], "cpu")
    torch.testing.assert_close(one[0, :, 16:32], h[18][0], rtol=0, atol=0)


def test_packing_ids_and_schedule_are_the_pipelines(comps, pipe):
    from ddpo_tpu.models.flux2 import (compute_empirical_mu, flux2_tables, latent_ids, pack, patchify, unpack,
                                       unpatchify)
    from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu as theirs

    z = torch.randn(2, 8, 8, 8)
    p = patchify(z)
    assert torch.equal(p, pipe._patchify_latents(z)) and torch.equal(unpatchify(p), z)
    packed = pack(p)
    assert torch.equal(packed, pipe._pack_latents(p))
    ids = pipe._prepare_latent_ids(p)
    assert torch.equal(ids[0], latent_ids(4, 4))
    assert torch.equal(unpack(packed, 4, 4), pipe._unpack_latents_with_ids(packed, ids))
    for tokens, steps in [(16, 4), (1024, 8), (4096, 50), (5000, 28)]:
        assert compute_empirical_mu(tokens, steps) == theirs(tokens, steps)
    t = flux2_tables(comps.scheduler, 4, 16, "cpu")
    pipe.scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / 4, 4), mu=theirs(16, 4))
    assert torch.equal(t.sigmas, pipe.scheduler.sigmas.float()) and float(t.sigmas[-1]) == 0.0


def test_lora_layer_table_matches_the_tiny_and_the_real_transformers():
    from diffusers import Flux2Transformer2DModel

    from ddpo_tpu.launch import lora_targets
    from ddpo_tpu.models import flux2
    from tests.helpers import block_layers

    with torch.device("meta"):
        tiny = block_layers(flux2._build_transformer(), "flux2")
        real = [block_layers(Flux2Transformer2DModel(**KLEIN_TRANSFORMER[s]), "flux2") for s in ("4b", "9b")]
    assert tiny == real[0] == real[1] == set(family("flux2").lora_layers)
    assert lora_targets.is_known("single_transformer_blocks.19.attn.to_qkv_mlp_proj", "flux2")
    assert not lora_targets.is_known("ff.net.2", "flux2")
    for path in ("tiny_flux2", "flux2_klein_4b", "flux2_klein_9b"):  # Flow-Factory's default targets, each a layer
        v = compose_and_validate((REAL + ["tpu_topology=gpu-8"] if path != "tiny_flux2" else
                                  ["+experiment=flux2_grpo_smoke"]) + [f"model={path}"])
        assert sorted(v.cfg.model.lora.target_modules) == sorted(FF_TARGETS)
        assert lora_targets.problems(v.cfg.model) == []


def _qwen3_billions(cfg) -> float:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    with torch.device("meta"):
        m = Qwen3ForCausalLM(Qwen3Config(**cfg))
    n = sum(p.numel() for p in m.parameters())
    if cfg["tie_word_embeddings"] and m.lm_head.weight is not m.model.embed_tokens.weight:
        n -= m.lm_head.weight.numel()  # tied when loaded: one matrix
    return n / 1e9


def test_memory_figures_are_klein_parameter_counts():
    from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel

    from ddpo_tpu.catalog.families import FLUX2_KLEIN_BILLIONS, FLUX2_LORA_MILLIONS

    with torch.device("meta"):
        vae = sum(p.numel() for p in AutoencoderKLFlux2().parameters()) / 1e9
    for size in ("4b", "9b"):
        with torch.device("meta"):
            t = Flux2Transformer2DModel(**KLEIN_TRANSFORMER[size])
        want = {"transformer": sum(p.numel() for p in t.parameters()) / 1e9,
                "text_encoder": _qwen3_billions(QWEN3[size]), "vae": vae}
        assert FLUX2_KLEIN_BILLIONS[size] == pytest.approx(want, abs=5e-4)
        lora = sum(64 * (m.in_features + m.out_features) for n, m in t.named_modules()
                   if isinstance(m, torch.nn.Linear) and any(n.endswith("." + k) for k in FF_TARGETS))
        assert FLUX2_LORA_MILLIONS[size] == pytest.approx(lora / 1e6, abs=5e-3)


def test_the_memory_rule_refuses_the_chips_klein_does_not_fit():
    from ddpo_tpu.config import memory

    real = REAL
    small = compose_and_validate(real + ["model=flux2_klein_4b", "tpu_topology=v6e-1"]).cfg
    # 3.876B + 4.022B bf16, the float32 VAE, LoRA's 76.7M x 20 bytes, 1.3 GiB of buffers and runtime
    assert memory.resident_gib(small) == pytest.approx((7.898 * 2 + 0.084 * 4) * 1e9 / 2**30
                                                       + 76.68e6 * 20 / 2**30 + 1.3, abs=0.01)
    with pytest.raises(ConfigError) as e:  # 9B whole: 36.4 GiB on a 32 GiB chip
        compose_and_validate(real + ["model=flux2_klein_9b", "tpu_topology=v6e-1"])
    (p,) = e.value.problems
    assert p.key == "tpu_topology.name" and "36.4 GiB" in p.reason
    split = compose_and_validate(real + ["model=flux2_klein_9b", "tpu_topology=v6e-8", "tpu_topology.mesh.fsdp=8",
                                         "tpu_topology.mesh.dp=1"]).cfg
    assert memory.resident_gib(split) < 32 and memory.resident_gib(split) < memory.resident_gib(
        compose_and_validate(real + ["model=flux2_klein_9b", "tpu_topology=gpu-8"]).cfg)
    with pytest.raises(ConfigError) as e:  # 4B whole on a 16 GiB v5e chip
        compose_and_validate(real + ["model=flux2_klein_4b", "tpu_topology=v5e-8"])
    assert any(p.key == "tpu_topology.name" and "17.8 GiB" in p.reason for p in e.value.problems)


def test_a_directory_that_is_not_a_flux2_checkpoint_is_named_with_the_fix(tmp_path):
    from ddpo_tpu.models.loading import ModelLoadError

    (tmp_path / "transformer").mkdir()
    with pytest.raises(ModelLoadError, match=r"model.pretrained=.*missing vae/, text_encoder/.*model=tiny_flux2"):
        load_flux2(str(tmp_path))


def test_a_distilled_checkpoint_never_runs_the_unconditional_pass(model_cache):
    from tests.helpers import family_with_trained_adapter

    fam = family_with_trained_adapter(["+experiment=flux2_grpo_smoke", f"model.cache_dir={model_cache}",
                                       "sample.guidance_scale=4", "train.cfg=true"])
    cond, uncond = fam.encode(["a cat"]), fam.encode([""])
    x = torch.randn(1, *fam.latent_shape)
    idx = torch.zeros(1, dtype=torch.long)
    with torch.no_grad():
        guided, plain = fam.velocity(x, idx, cond, uncond), fam.velocity(x, idx, cond, None)
        assert (guided - plain).abs().max() > 1e-4
        fam.c.is_distilled = True  # model_index.json's flag (Flux2KleinPipeline.do_classifier_free_guidance)
        try:
            assert torch.equal(fam.velocity(x, idx, cond, uncond), plain)
        finally:
            fam.c.is_distilled = False


def test_one_grpo_epoch_with_cfg_samples_scores_and_trains(tmp_path, model_cache):
    from PIL import Image

    from ddpo_tpu.rundir.files import RunDir
    from ddpo_tpu.runtime import make_runtime
    from ddpo_tpu.training import loop
    from tests.helpers import read_metrics

    v = compose_and_validate(["+experiment=flux2_grpo_smoke", f"model.cache_dir={model_cache}", "num_epochs=1",
                              "sample.batch_size=4", "sample.num_batches_per_epoch=1", "sample.num_steps=3",
                              "sample.sde_window.size=2", "algorithm.group_size=2", "train.batch_size=4",
                              "train.gradient_accumulation_steps=1", "sample.guidance_scale=4", "train.cfg=true"])
    loop.Trainer(v.cfg, make_runtime(v.cfg), RunDir(tmp_path), tree=v.tree,
                 stop=SimpleNamespace(requested=False)).fit()
    (epoch,) = read_metrics(tmp_path, "epoch")
    assert np.isfinite(epoch["reward_mean"]) and epoch["reward_mean"] < 0  # minus kilobytes
    (step,) = read_metrics(tmp_path, "step")
    assert np.isfinite(step["loss"]) and step["kl"] >= 0
    assert Image.open(tmp_path / "samples" / "epoch_0000.png").size == (4 * 32, 32)


def test_one_diffusion_nft_epoch_trains_on_the_velocity(tmp_path, model_cache):
    """DiffusionNFT (ODE rollouts, FlowFamily's forward-process velocity) on flux2 (Flow-Factory has klein-base NFT
    examples: examples/nft/lora/flux2_klein_base/default.yaml)."""
    from ddpo_tpu.rundir.files import RunDir
    from ddpo_tpu.runtime import make_runtime
    from ddpo_tpu.training import loop
    from tests.helpers import read_metrics

    v = compose_and_validate(["+experiment=nft_smoke", "model=tiny_flux2", f"model.cache_dir={model_cache}",
                              "num_epochs=1", "sample.num_batches_per_epoch=1"])
    assert v.cfg.model.family == "flux2"
    loop.Trainer(v.cfg, make_runtime(v.cfg), RunDir(tmp_path), tree=v.tree,
                 stop=SimpleNamespace(requested=False)).fit()
    (epoch,) = read_metrics(tmp_path, "epoch")
    assert np.isfinite(epoch["reward_mean"]) and len(read_metrics(tmp_path, "step")) >= 1
    assert all(np.isfinite(s["loss"]) for s in read_metrics(tmp_path, "step"))


def test_memory_figures_follow_the_resolution_and_the_size():
    """The spec's figures are a function of the model config (4B or 9B), scaled here to its resolution as the memory
    rule scales a table (config/memory.py): at 1024 px the sequence is 4096 image + 512 text tokens."""
    from ddpo_tpu.catalog.families import FLUX2_ATTENTION_SCORES_GIB_512, FLUX2_EAGER_F32_GIB, memory_of
    from ddpo_tpu.catalog.memory_figures import GIB
    from ddpo_tpu.config.schema import ModelConfig

    v = compose_and_validate(REAL + ["model=flux2_klein_9b", "tpu_topology=gpu-8"])
    m512 = v.cfg.model
    spec = family("flux2")
    at_512 = memory_of(spec, m512)
    assert at_512.activation_gib_per_eval_512["no"] == pytest.approx(10.19 + 32 * 32 * 1536 ** 2 * 4 / GIB)
    at_1024 = memory_of(spec, m512.model_copy(update={"resolution": 1024}))
    s = (4096 + 512) / (1024 + 512)
    assert at_1024.activation_gib_per_eval_512["no"] == pytest.approx(FLUX2_EAGER_F32_GIB["9b"] * s
                                                                      + FLUX2_ATTENTION_SCORES_GIB_512["9b"] * s ** 2)
    native = memory_of(spec, m512.model_copy(update={"resolution": None}))  # the pipeline's 1024 px
    assert native.activation_gib_per_eval_512 == pytest.approx(at_1024.activation_gib_per_eval_512)
    four = memory_of(spec, ModelConfig.model_validate({**m512.model_dump(), "name": "flux2_klein_4b",
                                                       "pretrained": "black-forest-labs/FLUX.2-klein-base-4B"}))
    assert four.activation_gib_per_eval_512["no"] == pytest.approx(5.84 + 25 * 24 * 1536 ** 2 * 4 / GIB)
