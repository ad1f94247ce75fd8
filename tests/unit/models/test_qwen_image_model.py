"""The Qwen-Image family's model pieces (ddpo_tpu.models.qwen_image, families/qwen_image.py): the tiny build loaded
through from_pretrained (and by diffusers' own QwenImagePipeline), its tokenizer and the pipeline's prompt template,
prompt encoding against QwenImagePipeline.encode_prompt (what flow_grpo's Qwen-Image pipeline calls), the catalog's
LoRA layer table against the tiny and the real Qwen-Image transformers on the meta device, the compose-time rules of
the family (its sampler, its LoRA names, the memory rule on real chips), load errors, and one eager epoch."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ddpo_tpu.catalog import family
from ddpo_tpu.config.compose import compose_and_validate
from ddpo_tpu.models.qwen_image import (PROMPT_TEMPLATE, TEMPLATE_START, encode_prompts_qwen, ensure_tiny_qwen_image,
                                        load_qwen_image)
from ddpo_tpu.problems import ConfigError

PROMPTS = ["a photo of a cat", "an astronaut riding a horse on the moon, oil painting", " "]


@pytest.fixture(scope="module")
def tiny_path(model_cache):
    return ensure_tiny_qwen_image(model_cache)


@pytest.fixture(scope="module")
def comps(tiny_path):
    return load_qwen_image(str(tiny_path))


@pytest.fixture(scope="module")
def pipe(tiny_path):
    from diffusers import QwenImagePipeline

    return QwenImagePipeline.from_pretrained(str(tiny_path))  # how flow_grpo loads it: the pipeline whole


def test_build_is_cached_and_loads_through_from_pretrained(model_cache, tiny_path, comps, pipe):
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer

    assert ensure_tiny_qwen_image(model_cache) == tiny_path
    assert json.loads((tiny_path / "model_index.json").read_text())["_class_name"] == "QwenImagePipeline"
    assert isinstance(comps.transformer, QwenImageTransformer2DModel)
    assert isinstance(comps.vae, AutoencoderKLQwenImage)
    assert isinstance(comps.text_encoder, Qwen2_5_VLForConditionalGeneration)
    assert isinstance(comps.tokenizer, Qwen2Tokenizer)
    assert isinstance(comps.scheduler, FlowMatchEulerDiscreteScheduler)
    c = comps.scheduler.config  # Qwen-Image's schedule: dynamic exponential shifting to a terminal sigma
    assert (c.use_dynamic_shifting, c.time_shift_type, c.shift_terminal, c.max_shift) == (True, "exponential", 0.02,
                                                                                         0.9)
    assert not any(p.requires_grad for m in (comps.transformer, comps.text_encoder, comps.vae) for p in m.parameters())
    assert comps.vae_scale_factor == pipe.vae_scale_factor == 4
    # the decoder's residual branches start at zero (models/wan._pass_latents_through): images follow the latents
    blocks = [m for m in comps.vae.decoder.modules() if type(m).__name__ == "QwenImageResidualBlock"]
    assert blocks and not any(b.conv2.weight.any() for b in blocks)
    assert torch.equal(pipe.transformer.proj_out.weight, comps.transformer.proj_out.weight)


def test_the_prompt_template_is_the_pipelines_and_its_system_part_is_34_tokens(comps, pipe):
    assert (PROMPT_TEMPLATE, TEMPLATE_START) == (pipe.prompt_template_encode, pipe.prompt_template_encode_start_idx)
    ids = comps.tokenizer(PROMPT_TEMPLATE.format("a cat")).input_ids
    system, rest = comps.tokenizer.decode(ids[:TEMPLATE_START]), comps.tokenizer.decode(ids[TEMPLATE_START:])
    assert system == PROMPT_TEMPLATE.split("{}")[0]  # the drop removes the system part and "user", nothing else
    assert rest == "a cat<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("tokens", [128, 12])
def test_prompt_states_equal_the_pipelines_encode_prompt_padded_with_their_mask(comps, pipe, tokens):
    with torch.no_grad():
        embeds, mask = encode_prompts_qwen(comps, PROMPTS, "cpu", max_sequence_length=tokens)
        ref, ref_mask = pipe.encode_prompt(PROMPTS, device="cpu", max_sequence_length=tokens)
    n = ref.shape[1]
    assert embeds.shape == (3, tokens, 32) and mask.shape == (3, tokens) and mask.dtype == torch.long
    # float32 rounding, not exact: ours tokenizes to a fixed TEMPLATE_START + tokens (one shape for XLA), the pipeline
    # to the batch's longest; causal attention makes the kept states the same sums over a differently shaped batch
    torch.testing.assert_close(embeds[:, :n], ref, rtol=1.3e-6, atol=1e-6)
    assert torch.equal(mask[:, :n], ref_mask.long()) and not mask[:, n:].any() and not embeds[:, n:].any()
    # each prompt's tokens (bytes, or a template word such as " of") + the 5 of "<|im_end|>\n<|im_start|>assistant\n",
    # cut at max_sequence_length
    assert mask.sum(1).tolist() == ([17, 50, 6] if tokens == 128 else [12, 12, 6])
    assert (embeds.abs().sum(-1) > 0).long().equal(mask)  # real states, zeros past each prompt


def test_the_family_encodes_the_empty_prompt_as_flow_grpos_negative_and_each_distinct_prompt_once(model_cache):
    from tests.helpers import family_with_trained_adapter

    fam = family_with_trained_adapter(["+experiment=qwen_image_grpo_smoke", f"model.cache_dir={model_cache}"])
    prompts = ["a cat", "a dog", "a cat", ""]
    embeds, mask = fam.encode(prompts)
    alone = [encode_prompts_qwen(fam.c, [p], "cpu") for p in ["a cat", "a dog", "a cat", " "]]
    for i, (e, m) in enumerate(alone):
        torch.testing.assert_close(embeds[i], e[0], rtol=1e-6, atol=1e-6)
        assert torch.equal(mask[i], m[0])
    assert fam.prompt_keys(["a  Cat"], 256) == ["a  Cat"]  # the Qwen tokenizer keeps case and spaces


def test_lora_layer_table_matches_the_tiny_and_the_real_transformers():
    from diffusers import QwenImageTransformer2DModel

    from benchmarks.probes.qwen_image_activations import QWEN_IMAGE_TRANSFORMER
    from ddpo_tpu.launch import lora_targets
    from ddpo_tpu.models import qwen_image
    from tests.helpers import block_layers

    with torch.device("meta"):
        tiny = block_layers(qwen_image._build_transformer(), "qwen_image")
        real = block_layers(QwenImageTransformer2DModel(**QWEN_IMAGE_TRANSFORMER), "qwen_image")
    assert tiny == real == set(family("qwen_image").lora_layers)
    assert lora_targets.is_known("transformer_blocks.59.img_mlp.net.2", "qwen_image")
    assert not lora_targets.is_known("ff.net.2", "qwen_image") and not lora_targets.is_known("attn1.to_q", "qwen_image")


def test_memory_figures_are_qwen_images_parameter_counts():
    """The catalog's QWEN_IMAGE_BILLIONS are what `scripts/bench.py --qwen-image-activations` counts on the meta
    device, and its attention-score figure the probe's arithmetic."""
    from benchmarks.probes.qwen_image_activations import attention_scores_gib, billions
    from ddpo_tpu.catalog.families import QWEN_IMAGE_ATTENTION_SCORES_GIB_512, QWEN_IMAGE_BILLIONS

    assert billions() == QWEN_IMAGE_BILLIONS
    assert QWEN_IMAGE_ATTENTION_SCORES_GIB_512 == pytest.approx(attention_scores_gib(), rel=1e-12)


def test_the_family_composes_and_the_memory_rule_reads_its_figures(model_cache):
    from ddpo_tpu.config import memory
    from ddpo_tpu.launch import lora_targets

    v = compose_and_validate(["+experiment=qwen_image_grpo_smoke", f"model.cache_dir={model_cache}"])
    assert (v.cfg.model.family, v.cfg.sample.name, v.cfg.sample.noise_level) == ("qwen_image", "flow_sde", 1.2)
    assert lora_targets.problems(v.cfg.model) == []
    bad = compose_and_validate(["+experiment=qwen_image_grpo_smoke", "model.lora.target_modules=[ff.net.2]"])
    (line,) = lora_targets.problems(bad.cfg.model)
    assert "ff.net.2 is not a layer of the qwen_image family's denoiser" in line and "add_q_proj" in line
    with pytest.raises(ConfigError) as e:  # another family's sampler
        compose_and_validate(["+experiment=qwen_image_grpo_smoke", "sampler=wan_sde20"])
    assert any(p.key == "sample.name" for p in e.value.problems)
    # the real model: flow_grpo's 8-GPU settings (4 a device, 1 a micro-step with CFG, a 2-step window)
    real = ["+experiment=qwen_image_grpo_smoke", "model=qwen_image", "train.mixed_precision=bf16",
            "sample.num_steps=10", "sample.guidance_scale=4", "train.cfg=true", "sample.batch_size=4",
            "sample.num_batches_per_epoch=16", "algorithm.group_size=16", "train.batch_size=1",
            "train.gradient_accumulation_steps=16", "sample.sde_window.size=2", "sample.sde_window.placement=random",
            "sample.sde_window.range=[0,5]"]
    h100 = compose_and_validate(real + ["tpu_topology=gpu-8"]).cfg
    assert memory.resident_gib(h100) == pytest.approx(63.0, abs=0.1)  # 20.4B + 8.3B bf16, the VAE, LoRA's state
    assert memory.activation_checkpointing(h100)  # 2 x 17.7 GiB unchecked > 17 left; 2 x 6.4 checkpointed fits
    split = compose_and_validate(real + ["tpu_topology=gpu-8", "tpu_topology.mesh.fsdp=2",
                                         "tpu_topology.mesh.dp=4"]).cfg
    assert memory.resident_gib(split) == pytest.approx(44.0, abs=0.1) and not memory.activation_checkpointing(split)
    from tests.helpers import REPO

    prompts = f"prompts.path={REPO / 'tests' / 'data' / 'flow_grpo' / 'ocr'}"  # any dataset folder
    pickscore = compose_and_validate(["+experiment=qwen_image_grpo_pickscore", prompts]).cfg
    assert memory.activation_checkpointing(pickscore)  # flow_grpo's run: 8 x 80 GiB GPUs, checkpointed as it does
    assert (pickscore.sample.noise_level, pickscore.sample.sde_window.size, pickscore.train.cfg) == (1.2, 2, True)
    with pytest.raises(ConfigError) as e:  # a 32 GiB chip holds neither the models whole nor one sample at fsdp 8
        compose_and_validate(real + ["tpu_topology=v6e-8", "tpu_topology.mesh.fsdp=8", "tpu_topology.mesh.dp=1"])
    (p,) = e.value.problems
    assert p.key == "tpu_topology.name" and "29.7 hold the models" in p.reason


def test_a_directory_that_is_not_a_qwen_image_checkpoint_is_named_with_the_fix(tmp_path):
    from ddpo_tpu.models.loading import ModelLoadError

    (tmp_path / "transformer").mkdir()
    with pytest.raises(ModelLoadError, match=r"model.pretrained=.*missing vae/, text_encoder/.*Qwen/Qwen-Image.*"
                                             r"model=tiny_qwen_image"):
        load_qwen_image(str(tmp_path))


def test_one_epoch_samples_scores_and_trains(tmp_path, model_cache):
    """One eager GRPO epoch with flow_grpo's guidance (true CFG at sampling and training) and the smoke's window."""
    from PIL import Image

    from ddpo_tpu.training import loop
    from ddpo_tpu.rundir.files import RunDir
    from ddpo_tpu.runtime import make_runtime
    from tests.helpers import read_metrics

    v = compose_and_validate(["+experiment=qwen_image_grpo_smoke", f"model.cache_dir={model_cache}", "num_epochs=1",
                              "sample.batch_size=4", "sample.num_batches_per_epoch=1", "sample.num_steps=3",
                              "sample.sde_window.size=2", "algorithm.group_size=2", "train.batch_size=4",
                              "train.gradient_accumulation_steps=1", "sample.guidance_scale=4", "train.cfg=true"])
    trainer = loop.Trainer(v.cfg, make_runtime(v.cfg), RunDir(tmp_path), tree=v.tree,
                           stop=SimpleNamespace(requested=False))
    trainer.fit()
    (epoch,) = read_metrics(tmp_path, "epoch")
    assert np.isfinite(epoch["reward_mean"]) and epoch["reward_mean"] < 0  # minus kilobytes
    (step,) = read_metrics(tmp_path, "step")
    assert np.isfinite(step["loss"]) and step["kl"] >= 0
    assert Image.open(tmp_path / "samples" / "epoch_0000.png").size == (4 * 32, 32)


def test_one_diffusion_nft_epoch_trains_on_the_velocity(tmp_path, model_cache):
    """DiffusionNFT (ODE rollouts, the forward-process velocity SD3Family gives the family) runs its epoch here too."""
    from ddpo_tpu.rundir.files import RunDir
    from ddpo_tpu.runtime import make_runtime
    from ddpo_tpu.training import loop
    from tests.helpers import read_metrics

    base = ["+experiment=nft_smoke", "model=tiny_qwen_image", f"model.cache_dir={model_cache}", "num_epochs=1",
            "sample.num_batches_per_epoch=1"]
    v = compose_and_validate(base)
    loop.Trainer(v.cfg, make_runtime(v.cfg), RunDir(tmp_path), tree=v.tree,
                 stop=SimpleNamespace(requested=False)).fit()
    (epoch,) = read_metrics(tmp_path, "epoch")
    assert np.isfinite(epoch["reward_mean"]) and len(read_metrics(tmp_path, "step")) >= 1
