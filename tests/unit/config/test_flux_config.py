"""Compose-time rules of the FLUX.1 family (model.family=flux), read from its catalog spec: its sampler, guidance as an
embedding (no train.cfg), its builds and keys, its LoRA targets, and the HBM estimate on v6e / v5p-sized / GPU chips
(refusals offer per-replica values that fit). Also: its two experiments compose, the parity one pinning flow_grpo's
FLUX run on a v6e-8."""

from __future__ import annotations

from pathlib import Path

import pytest

from ddpo_tpu.config import memory
from ddpo_tpu.config.compose import ConfigError, compose_and_validate

pytestmark = pytest.mark.torch_free  # no torch in the test or what it starts (tests/conftest.py)

SMOKE = ["+experiment=flux_grpo_smoke"]
DATA = Path(__file__).parents[2] / "data" / "flow_grpo" / "ocr"  # any dataset folder: the path is the user's
PARITY = ["+experiment=flux_grpo_pickscore", f"prompts.path={DATA}"]


def problems(overrides: list[str]) -> dict:
    with pytest.raises(ConfigError) as e:
        compose_and_validate(overrides)
    return {p.key: p for p in e.value.problems}


@pytest.mark.parametrize("topology,replicas", [("eager_cpu", 1), ("cpu", 1), ("cpu_spmd4", 4)])
def test_the_smoke_composes_on_its_topologies(topology, replicas):
    cfg = compose_and_validate([*SMOKE, f"tpu_topology={topology}"]).cfg
    assert cfg.model.family == "flux" and cfg.model.builder == "tiny_flux" and cfg.sample.name == "flow_sde"
    assert cfg.algorithm.name == "grpo" and not cfg.train.cfg and cfg.sample.guidance_scale == 3.5
    assert cfg.tpu_topology.replicas == replicas


def test_guidance_is_an_embedding_so_train_cfg_is_refused():
    for key in ("cfg", "cfg_detach_uncond"):
        p = problems([*SMOKE, f"train.{key}=true"])[f"train.{key}"]
        assert "guidance-distilled" in p.reason and "no unconditional pass" in p.reason
        assert p.suggested() == [f"train.{key}=false"]
    # guidance 3.5 without train.cfg is what the other families refuse (off-policy CFG); here it is the model's input
    compose_and_validate([*SMOKE, "sample.guidance_scale=3.5", "train.cfg=false"])
    assert "train.cfg" in problems(["+experiment=flow_grpo_smoke", "sample.guidance_scale=4.5", "train.cfg=false"])


def test_the_family_samples_with_flow_sde_and_keeps_to_its_builds_and_keys():
    p = problems([*SMOKE, "sampler=ddim_short"])["sample.name"]
    assert "model.family=flux samples with flow_sde" in p.reason and p.suggested() == ["sampler=flow_sde10"]
    assert "a model.family=flux build" in problems([*SMOKE, "model.family=sd3"])["model.builder"].reason
    assert "model.builder" in problems(["+experiment=flow_grpo_smoke", "model.family=flux"])
    assert "sd3" in problems([*SMOKE, "+model.text_encoder_3=true"])["model.text_encoder_3"].reason
    p = problems([*SMOKE, "model.resolution=40"])["model.resolution"]
    assert "multiples of 16" in p.reason and p.suggested() == ["model.resolution=32"]


def test_lora_targets_are_checked_against_the_flux_transformer():
    from ddpo_tpu.launch import lora_targets

    model = compose_and_validate(SMOKE).cfg.model
    assert lora_targets.problems(model) == []
    bad = model.model_copy(update={"lora": model.lora.model_copy(update={"target_modules": ["attn1.to_q", "to_q"]})})
    (line,) = lora_targets.problems(bad)
    assert "attn1.to_q is not a layer of the flux family's denoiser" in line and "proj_mlp" in line


def test_the_parity_experiment_pins_flow_grpos_flux_run_on_a_v6e_8():
    v = compose_and_validate(PARITY)
    cfg = v.cfg
    assert cfg.parity.name == "flow_grpo_flux" and cfg.model.pretrained == "black-forest-labs/FLUX.1-dev"
    assert (cfg.sample.num_steps, cfg.sample.noise_level, cfg.sample.guidance_scale) == (6, 0.9, 3.5)
    assert (cfg.algorithm.group_size, cfg.algorithm.kl_beta, cfg.model.lora.rank, cfg.model.resolution) == (24, 0, 64,
                                                                                                           512)
    rows = {r["constraint"]: r for r in v.report}
    assert rows["samples per epoch"]["effective"] == 1152 and rows["total train batch"]["effective"] == 576
    assert rows["train timesteps per sample"]["effective"] == 5  # int(6 x 0.99)
    assert not [r for r in v.report if not r["ok"]]
    # the parity holds what the reference runs: no CFG at train time, its step count
    assert "parity" in problems([*PARITY, "sample.num_steps=10"])["sample.num_steps"].reason


def test_a_v6e_chip_needs_fsdp_for_the_transformer_and_the_refusal_says_which():
    # 12B bf16 transformer + T5-XXL + LoRA state on one 32 GiB chip: refused, with an fsdp that fits
    p = problems([*PARITY, "tpu_topology.mesh.fsdp=1", "tpu_topology.mesh.dp=8"])["tpu_topology.name"]
    assert "alone need about 36.0 GiB" in p.reason
    fix = p.suggested()
    assert "tpu_topology.mesh.fsdp=2" in fix and "tpu_topology.mesh.dp=4" in fix
    compose_and_validate([*PARITY, *fix])  # the offered values fit
    # at fsdp 2, one sample fits only with activation checkpointing (auto turns it on); without it, the fix says so
    fixed = compose_and_validate(PARITY).cfg
    assert fixed.tpu_topology.mesh.fsdp == 2 and memory.activation_checkpointing(fixed)
    p = problems([*PARITY, "train.activation_checkpointing=false"])["tpu_topology.name"]
    assert "one sample needs about 14.6 GiB" in p.reason
    assert ("tpu_topology.mesh.fsdp=8" in p.fix.overrides(0)
            and "train.activation_checkpointing=true" in p.fix.overrides(1))
    # a full fine-tune does not fit a v6e chip with any fsdp of a host
    p = problems(["+experiment=flux_grpo_pickscore", f"prompts.path={DATA}", "parity=none",
                  "model.lora.enabled=false"])["model.lora.enabled"]
    assert "full transformer fine-tune" in p.reason and p.suggested() == ["model.lora.enabled=true"]


@pytest.mark.parametrize("overrides", [
    ["tpu_topology.hbm_gib_per_chip=95"],    # a v5p chip's HBM: the whole model on every chip
    ["tpu_topology=gpu-8"],                  # 80 GiB GPUs, the distributed execution
], ids=["v5p-sized", "gpu-8"])
def test_larger_chips_hold_flux_without_fsdp(overrides):
    cfg = compose_and_validate([*PARITY, "tpu_topology.mesh.fsdp=1", "tpu_topology.mesh.dp=8", *overrides]).cfg
    assert memory.resident_gib(cfg) == pytest.approx(36.0, abs=0.1)
    assert memory.activation_budget(cfg) > memory.training_activation_gib(cfg, 1)


def test_the_parity_trains_every_sample_as_train_flux_does():
    assert compose_and_validate(PARITY).cfg.algorithm.drop_zero_advantage is False
    assert "parity" in problems([*PARITY, "algorithm.drop_zero_advantage=true"])["algorithm.drop_zero_advantage"].reason
