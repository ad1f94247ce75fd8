"""The Wan family's video length and memory model (catalog/wan_memory.py, config/memory.py): model.num_frames checked
at compose time against the VAE's 4k + 1 rule; the parameter count from the config against the real classes on the
meta device; the saved-activation formula against what autograd saves in the tiny build's blocks; and the HBM rule
on Wan 2.1 14B: refused on a v6e chip without fsdp, with an override that composes."""

from __future__ import annotations

import pytest
import torch

from ddpo_tpu.catalog import family
from ddpo_tpu.catalog import wan_memory as wm
from ddpo_tpu.catalog.families import memory_of
from ddpo_tpu.config import memory
from ddpo_tpu.config.compose import ConfigError, compose_and_validate

SMOKE = ["+experiment=wan_grpo_smoke"]
# flow_grpo's Wan setting (config/grpo.py general_ocr_wan2_1: guidance 4.5 with CFG at train time, bf16)
REAL = [*SMOKE, "train.mixed_precision=bf16", "sample.guidance_scale=4.5", "train.cfg=true", "train.batch_size=1",
        "sample.batch_size=8", "train.gradient_accumulation_steps=4"]


def problems(overrides: list[str]) -> dict:
    with pytest.raises(ConfigError) as e:
        compose_and_validate(overrides)
    return {p.key: p for p in e.value.problems}


def test_num_frames_is_the_video_length_and_must_be_4k_plus_1():
    # diffusers 0.42.1 pipelines/wan/pipeline_wan.py:494-498: WanPipeline warns unless num_frames % 4 == 1
    assert compose_and_validate(SMOKE).cfg.model.num_frames == 5
    real = compose_and_validate([*SMOKE, "model=wan21_t2v_1_3b", "train.mixed_precision=bf16"]).cfg
    assert real.model.num_frames == 33
    assert compose_and_validate([*SMOKE, "model.num_frames=9"]).cfg.model.num_frames == 9
    p = problems([*SMOKE, "model.num_frames=8"])["model.num_frames"]
    assert "4k + 1 frames" in p.reason and p.fix.overrides(0) == ["model.num_frames=5"]
    assert p.fix.overrides(1) == ["model.num_frames=9"]
    assert "needs their length" in problems([*SMOKE, "model.num_frames=null"])["model.num_frames"].reason
    # an image family does not read it: named as the wan family's key
    p = problems(["+experiment=flow_grpo_smoke", "model.num_frames=5"])["model.num_frames"]
    assert "wan" in p.reason


def test_the_family_samples_model_num_frames():
    from types import SimpleNamespace

    from ddpo_tpu.families.wan import video_size

    model = SimpleNamespace(builder="tiny_wan", resolution=None, num_frames=9)
    assert video_size(model, (32, 32), (240, 416)) == (9, 32, 32)
    model = SimpleNamespace(builder=None, resolution=64, num_frames=17)
    assert video_size(model, (32, 32), (240, 416)) == (17, 64, 64)


@pytest.mark.parametrize("hub_id", sorted(wm.WAN21_T2V))
def test_parameter_count_from_the_config_equals_the_class(hub_id):
    from diffusers import WanTransformer3DModel

    config = wm.WAN21_T2V[hub_id]
    with torch.device("meta"):
        model = WanTransformer3DModel(**config)
    assert wm.transformer_parameters(config) == sum(p.numel() for p in model.parameters())


def test_text_encoder_and_vae_counts_equal_the_classes():
    from diffusers import AutoencoderKLWan
    from transformers import UMT5Config, UMT5EncoderModel

    # Wan-AI/Wan2.1-T2V-1.3B-Diffusers text_encoder/config.json (umt5-xxl's encoder); the VAE's class defaults
    with torch.device("meta"):
        umt5 = UMT5EncoderModel(UMT5Config(vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24,
                                           num_heads=64, feed_forward_proj="gated-gelu"))
        vae = AutoencoderKLWan()
    assert sum(p.numel() for p in umt5.parameters()) / 1e9 == pytest.approx(wm.UMT5_XXL_BILLIONS, abs=5e-4)
    assert sum(p.numel() for p in vae.parameters()) / 1e9 == pytest.approx(wm.VAE_BILLIONS, abs=5e-4)


@pytest.mark.parametrize("latent", [(2, 4, 4), (3, 16, 16)])  # 5 frames of 32 px (the smoke's), 9 frames of 128 px
def test_saved_activations_per_block_follow_the_formula_on_the_tiny_build(latent):
    """One block's saved values (3 blocks less 2, the bytes autograd saves over a forward: saved_tensors_hooks) of the
    tiny build's transformer, against the catalog's formula at the tiny widths (fitted on other token counts:
    scripts/bench.py --wan-memory)."""
    from benchmarks.probes.wan_memory import block_row

    from ddpo_tpu.models import wan

    row = block_row(2, 16, 64, latent, wm.TEXT_TOKENS)  # the tiny build's widths: 2 heads of 16, ffn 64
    config = dict(wan._build_transformer().config)
    assert (row["dim"], row["ffn"], row["heads"]) == (config["num_attention_heads"] * config["attention_head_dim"],
                                                      config["ffn_dim"], config["num_attention_heads"])
    assert row["values_per_block"] == wm.saved_values_per_block(config, S=row["S"])  # exact, as the fit


def test_wan_14b_without_fsdp_is_refused_with_an_override_that_composes():
    over = [*REAL, "model=wan21_t2v_14b", "tpu_topology=v6e-8", "tpu_topology.mesh.fsdp=1", "tpu_topology.mesh.dp=8"]
    p = problems(over)["tpu_topology.name"]
    assert "alone need about 40.6 GiB per chip" in p.reason and "v6e-8 chip has 32 GiB" in p.reason
    fix = p.suggested()
    assert {"tpu_topology.mesh.fsdp=8", "tpu_topology.mesh.dp=1", "train.activation_checkpointing=true",
            "train.batch_size=1"} <= set(fix)
    assert [f for f in fix if f.startswith("model.num_frames=")] == ["model.num_frames=25"]  # 33 does not fit
    cfg = compose_and_validate([*over, *fix]).cfg
    assert memory.activation_budget(cfg) >= memory.training_activation_gib(cfg, 1) > 0
    # one chip (v6e-1): its 8-chip host with fsdp 8 (the transformer alone is 26.6 GiB in bf16)
    p = problems([*REAL, "model=wan21_t2v_14b", "tpu_topology=v6e-1"])["tpu_topology.name"]
    assert p.suggested()[0] == "tpu_topology=v6e-8" and set(fix) <= set(p.suggested())
    assert compose_and_validate([*REAL, "model=wan21_t2v_14b", *p.suggested()]).cfg.tpu_topology.mesh.fsdp == 8


def test_wan_1_3b_fits_a_v6e_chip_with_checkpointing_and_larger_chips_hold_14b():
    cfg = compose_and_validate([*REAL, "model=wan21_t2v_1_3b", "tpu_topology=v6e-8"]).cfg
    assert memory.activation_checkpointing(cfg)  # auto: the sample does not fit without it
    assert memory.training_activation_gib(cfg, 1, checkpointed=False) > memory.activation_budget(cfg)
    big = compose_and_validate([*REAL, "model=wan21_t2v_14b", "tpu_topology=gpu-8"]).cfg
    assert memory.resident_gib(big) == pytest.approx(40.6, abs=0.1) and memory.activation_checkpointing(big)


def test_tokens_follow_the_video_and_the_figures_grow_with_them():
    cfg = compose_and_validate([*REAL, "model=wan21_t2v_1_3b", "tpu_topology=gpu-8"]).cfg
    assert wm.tokens(cfg.model) == 9 * 15 * 26  # flow_grpo's 33 x 240 x 416: 9 latent frames of 15 x 26 patches
    short = cfg.model.model_copy(update={"num_frames": 17})
    assert wm.tokens(short) == 5 * 15 * 26
    full, shorter = memory_of(family("wan"), cfg.model), memory_of(family("wan"), short)
    assert shorter.activation_gib_per_eval_512["bf16"] < full.activation_gib_per_eval_512["bf16"]
    assert full.checkpointed_gib_per_eval_512["bf16"] < full.activation_gib_per_eval_512["bf16"]


def test_the_figures_read_a_local_checkpoints_transformer_config(tmp_path):
    import json
    from types import SimpleNamespace

    small = wm.WAN21_T2V["Wan-AI/Wan2.1-T2V-1.3B-Diffusers"]
    (tmp_path / "transformer").mkdir()
    (tmp_path / "transformer" / "config.json").write_text(json.dumps(dict(small, patch_size=list(small["patch_size"]))))
    local = wm.transformer_config(SimpleNamespace(pretrained=str(tmp_path)))
    assert wm.transformer_parameters(local) == wm.transformer_parameters(small)
    # an unknown hub id: the class defaults, the 14B's widths (a refusal errs toward safety)
    assert wm.transformer_config(SimpleNamespace(pretrained="someone/wan-finetune")) == wm.DEFAULT_CONFIG
