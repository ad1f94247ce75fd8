"""The Z-Image family's model pieces (ddpo_tpu.models.z_image, families/z_image.py): the tiny build loaded through
from_pretrained (and by diffusers' own ZImagePipeline), prompt encoding against ZImagePipeline._encode_prompt (what
Flow-Factory's ZImageAdapter._encode_prompt copies, z_image.py:79-124 at a0b2bc5a), the catalog's LoRA layer table and
parameter counts against the tiny and the published transformer configs on the meta device, the compose-time rules
(LoRA names, the memory rule on real chips), load errors, and one eager GRPO and one DiffusionNFT epoch."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ddpo_tpu.config.compose import compose_and_validate
from ddpo_tpu.models.z_image import caption_list, encode_prompts_z, ensure_tiny_z_image, load_z_image
from ddpo_tpu.problems import ConfigError

PROMPTS = ["a photo of a cat", "an astronaut riding a horse on the moon, oil painting", ""]


@pytest.fixture(scope="module")
def tiny_path(model_cache):
    return ensure_tiny_z_image(model_cache)


@pytest.fixture(scope="module")
def comps(tiny_path):
    return load_z_image(str(tiny_path))


@pytest.fixture(scope="module")
def pipe(tiny_path):
    from diffusers import ZImagePipeline

    return ZImagePipeline.from_pretrained(str(tiny_path))  # how Flow-Factory loads it: the pipeline whole


def test_build_is_cached_and_loads_through_from_pretrained(model_cache, tiny_path, comps, pipe):
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImageTransformer2DModel
    from transformers import Qwen3Model

    assert ensure_tiny_z_image(model_cache) == tiny_path
    assert json.loads((tiny_path / "model_index.json").read_text())["_class_name"] == "ZImagePipeline"
    assert isinstance(comps.transformer, ZImageTransformer2DModel) and isinstance(comps.vae, AutoencoderKL)
    assert isinstance(comps.text_encoder, Qwen3Model) and isinstance(pipe.text_encoder, Qwen3Model)
    assert isinstance(comps.scheduler, FlowMatchEulerDiscreteScheduler)
    c = comps.scheduler.config
    assert (c.shift, c.use_dynamic_shifting) == (3.0, False)
    assert not any(p.requires_grad for m in (comps.transformer, comps.text_encoder, comps.vae) for p in m.parameters())
    assert comps.vae_scale_factor == pipe.vae_scale_factor == 4
    assert (comps.vae.config.scaling_factor, comps.vae.config.shift_factor) == (0.3611, 0.1159)  # FLUX.1's VAE


def test_the_chat_template_is_qwen3s_user_turn(comps):
    text = comps.tokenizer.apply_chat_template([{"role": "user", "content": "a cat"}], tokenize=False,
                                               add_generation_prompt=True, enable_thinking=True)
    assert text == "<|im_start|>user\na cat<|im_end|>\n<|im_start|>assistant\n"
    off = comps.tokenizer.apply_chat_template([{"role": "user", "content": "a cat"}], tokenize=False,
                                              add_generation_prompt=True, enable_thinking=False)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_prompt_states_equal_the_pipelines_encode_prompt(comps, pipe):
    """Our padded states with their mask give exactly the pipeline's list of real-token states (the second to last
    hidden state); the padding is zeros; prompts of different lengths give different lengths."""
    states, mask = encode_prompts_z(comps, PROMPTS, "cpu")
    assert states.shape == (3, 512, 32) and mask.dtype == torch.bool
    with torch.no_grad():
        ref = pipe._encode_prompt(list(PROMPTS), device="cpu")
    ours = caption_list(states, mask)
    assert [len(r) for r in ref] == [len(o) for o in ours] and len({len(o) for o in ours}) == 3
    for r, o in zip(ref, ours):
        assert torch.equal(r, o)
    assert not states[~mask].any()


def test_lora_layer_table_and_parameter_counts_match_the_tiny_and_the_published_transformers():
    """Every Linear of ZImageTransformer2DModel (tiny, and the published config on the meta device), its block prefix
    (layers / noise_refiner / context_refiner .N.) cut, is in the catalog's lora_layers, and the catalog's billions are
    the published configs' counts (diffusers' defaults are Z-Image's config; Qwen3-4B's; FLUX.1's VAE)."""
    from diffusers import AutoencoderKL, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    from ddpo_tpu.catalog import family
    from ddpo_tpu.catalog.families import Z_IMAGE_BILLIONS
    from ddpo_tpu.models.z_image import _build_transformer

    def layers(model):
        out = set()
        for name, m in model.named_modules():
            if isinstance(m, torch.nn.Linear):
                parts = name.split(".")
                out.add(".".join(parts[2:]) if parts[0] in ("layers", "noise_refiner", "context_refiner") else name)
        return out

    with torch.device("meta"):
        real = ZImageTransformer2DModel()
        text = Qwen3Model(Qwen3Config(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                                      num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                                      tie_word_embeddings=True))
        vae = AutoencoderKL(latent_channels=16, block_out_channels=(128, 256, 512, 512), layers_per_block=2,
                            down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                            use_quant_conv=False, use_post_quant_conv=False)
    table = set(family("z_image").lora_layers)
    assert layers(_build_transformer()) == layers(real) == table
    real_cfg = real.config
    assert (real_cfg.dim, real_cfg.n_layers, real_cfg.n_refiner_layers, real_cfg.cap_feat_dim) == (3840, 30, 2, 2560)
    count = {k: round(sum(p.numel() for p in m.parameters()) / 1e9, 3)
             for k, m in (("transformer", real), ("text_encoder", text), ("vae", vae))}
    assert count == Z_IMAGE_BILLIONS


def test_the_family_composes_and_the_memory_rule_reads_its_figures(model_cache):
    from ddpo_tpu.config import memory
    from ddpo_tpu.launch import lora_targets

    v = compose_and_validate(["+experiment=z_image_grpo_smoke", f"model.cache_dir={model_cache}"])
    assert (v.cfg.model.family, v.cfg.sample.name) == ("z_image", "flow_sde")
    assert lora_targets.problems(v.cfg.model) == []
    bad = compose_and_validate(["+experiment=z_image_grpo_smoke", "model.lora.target_modules=[attn.to_q]"])
    (line,) = lora_targets.problems(bad.cfg.model)
    assert "attn.to_q is not a layer of the z_image family's denoiser" in line
    for model, guidance in (("z_image_turbo", 1), ("z_image", 5)):
        real = ["+experiment=z_image_grpo_smoke", f"model={model}", "train.mixed_precision=bf16",
                f"sample.guidance_scale={guidance}", f"train.cfg={guidance > 1}", "sample.batch_size=4",
                "sample.num_batches_per_epoch=4", "algorithm.group_size=16", "train.batch_size=1",
                "train.gradient_accumulation_steps=16"]
        h100 = compose_and_validate(real + ["tpu_topology=gpu-8"]).cfg
        # 6.155B + 4.022B in bf16, the VAE in float32, LoRA's state (2.96 + 1.1)
        expected = ((6.155 + 4.022) * 2 + 0.084 * 4) * 1e9 / 2 ** 30 + 0.1588 * 20 * 1e9 / 2 ** 30 + 1.1
        assert memory.resident_gib(h100) == pytest.approx(expected, abs=0.05)
        with pytest.raises(ConfigError) as e:  # a 16 GiB v5e chip holds neither part whole
            compose_and_validate(real + ["tpu_topology=v5e-8", "tpu_topology.mesh.fsdp=1", "tpu_topology.mesh.dp=8"])
        assert any(p.key.startswith("tpu_topology") for p in e.value.problems), e.value.problems


def test_a_directory_that_is_not_a_z_image_checkpoint_is_named_with_the_fix(tmp_path):
    from ddpo_tpu.models.loading import ModelLoadError

    (tmp_path / "transformer").mkdir()
    with pytest.raises(ModelLoadError, match=r"model.pretrained=.*missing vae/, text_encoder/.*Tongyi-MAI/Z-Image-Turbo"
                                             r".*model=tiny_z_image"):
        load_z_image(str(tmp_path))


def _one_epoch(tmp_path, overrides):
    from ddpo_tpu.rundir.files import RunDir
    from ddpo_tpu.runtime import make_runtime
    from ddpo_tpu.training import loop
    from tests.helpers import read_metrics

    v = compose_and_validate(overrides)
    loop.Trainer(v.cfg, make_runtime(v.cfg), RunDir(tmp_path), tree=v.tree,
                 stop=SimpleNamespace(requested=False)).fit()
    return read_metrics(tmp_path, "epoch"), read_metrics(tmp_path, "step")


def test_one_guided_grpo_epoch_samples_scores_and_trains(tmp_path, model_cache):
    """One eager GRPO epoch as Z-Image base (guidance at sampling and training)."""
    from PIL import Image

    (epoch,), (step,) = _one_epoch(tmp_path, [
        "+experiment=z_image_grpo_smoke", f"model.cache_dir={model_cache}", "num_epochs=1", "sample.batch_size=4",
        "sample.num_batches_per_epoch=1", "sample.num_steps=3", "algorithm.group_size=2", "train.batch_size=4",
        "train.gradient_accumulation_steps=1", "sample.guidance_scale=5", "train.cfg=true"])
    assert np.isfinite(epoch["reward_mean"]) and epoch["reward_mean"] < 0  # minus kilobytes
    assert np.isfinite(step["loss"]) and step["kl"] >= 0
    assert Image.open(tmp_path / "samples" / "epoch_0000.png").size == (4 * 32, 32)


def test_one_diffusion_nft_epoch_trains_on_the_velocity(tmp_path, model_cache):
    """DiffusionNFT (ODE rollouts, FlowFamily's forward-process velocity) runs its epoch on z_image too."""
    epochs, steps = _one_epoch(tmp_path, ["+experiment=nft_smoke", "model=tiny_z_image",
                                          f"model.cache_dir={model_cache}", "num_epochs=1",
                                          "sample.num_batches_per_epoch=1"])
    (epoch,) = epochs
    assert np.isfinite(epoch["reward_mean"]) and len(steps) >= 1 and all(np.isfinite(s["loss"]) for s in steps)


@pytest.mark.parametrize("topology", ["cpu", "cpu_spmd4", "cpu_dist2"])
def test_torch_xla_executions_compose(topology):
    """The family keeps one shape for every set of prompt lengths where the runtime compiles graphs (catalog
    fixed_shapes; models/z_image.py::z_forward_fixed), so torch_xla's executions compose as torchrun's does (before
    2026-11-29 they were refused at compose time)."""
    v = compose_and_validate(["+experiment=z_image_grpo_smoke", f"tpu_topology={topology}"])
    assert v.cfg.model.family == "z_image"


def test_torch_xla_takes_the_fixed_shape_velocity_equal_to_the_other_runtimes(comps):
    """ZImageFamily.velocity on torch_xla goes through z_velocity_fixed on the padded prompt
    batch (no caption list is cut from the mask) and equals the diffusers call of the other runtimes (torchrun's
    compiled ones included: there the wrapper's forward must run), guided and not; its
    RoPE tables were put on the runtime's device at construction."""
    from ddpo_tpu.families.z_image import ZImageFamily
    from ddpo_tpu.models.z_image import encode_prompts_z

    def cfg(torch_xla: bool):  # the fixed path is torch_xla's (ZImageFamily.__init__), not any compiling runtime's
        return SimpleNamespace(model=SimpleNamespace(resolution=None, builder="tiny_z_image"),
                               sample=SimpleNamespace(num_steps=3, guidance_scale=5.0),
                               tpu_topology=SimpleNamespace(spec=SimpleNamespace(torch_xla=torch_xla)))

    rt = SimpleNamespace(compiles_graphs=True, device=torch.device("cpu"))
    eager, fixed = ZImageFamily(cfg(False), rt, comps), ZImageFamily(cfg(True), rt, comps)
    assert fixed.c.transformer.rope_embedder.freqs_cis is not None
    with torch.no_grad():
        cond = encode_prompts_z(comps, ["a cat", "a much longer prompt about a dog in a field of flowers " * 3], "cpu")
        uncond = encode_prompts_z(comps, ["", ""], "cpu")
    buckets = (cond[1].sum(1) + 31) // 32
    assert buckets[0] != buckets[1], buckets  # two caption buckets
    x = torch.randn(2, *eager.latent_shape, generator=torch.Generator().manual_seed(0))
    idx = torch.tensor([0, 1])
    with torch.no_grad():
        for u in (None, uncond):
            ref = eager.velocity(x, idx, cond, u)
            torch.testing.assert_close(fixed.velocity(x, idx, cond, u), ref, rtol=1e-5, atol=1e-5)
    assert fixed._caption_memo == [] and eager._caption_memo != []
