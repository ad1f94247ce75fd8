"""GRPO beside DDPO and SD 3 beside SD 1.x: compose-time rules, group sampling, which config keys a resume compares,
and the GRPO micro-step on the tiny SD3 model (ratio 1 and KL 0 at the first inner step)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from ddpo_tpu.config import batch, memory, resume
from ddpo_tpu.config.compose import ConfigError, compose_and_validate

FLOW_SMOKE = ["+experiment=flow_grpo_smoke"]


def problems(overrides: list[str]) -> dict[str, str]:
    with pytest.raises(ConfigError) as e:
        compose_and_validate(overrides)
    return {p.key: f"{p.reason}; {p.fix}" for p in e.value.problems}


@pytest.mark.parametrize("topology,replicas", [("eager_cpu", 1), ("cpu", 1), ("cpu_spmd4", 4)])
def test_flow_grpo_smoke_composes_on_its_topologies(topology, replicas):
    v = compose_and_validate([*FLOW_SMOKE, f"tpu_topology={topology}"])
    cfg = v.cfg
    assert cfg.model.family == "sd3" and cfg.sample.name == "flow_sde" and cfg.algorithm.name == "grpo"
    assert cfg.tpu_topology.replicas == replicas
    assert batch.totals(cfg).samples_per_epoch % cfg.algorithm.group_size == 0


def test_grpo_draws_whole_groups_in_each_sampling_batch_shuffled_over_the_epoch():
    small = [*FLOW_SMOKE, "sample.batch_size=8", "sample.num_batches_per_epoch=2", "train.batch_size=4",
             "train.gradient_accumulation_steps=2"]
    found = problems([*small, "algorithm.group_size=5"])
    assert "16 samples per epoch" in found["algorithm.group_size"]
    assert "try algorithm.group_size=4" in found["algorithm.group_size"]
    # the fix works
    compose_and_validate([*small, "algorithm.group_size=4"])
    # over 4 replicas the epoch has 64 samples: 16 divides it
    compose_and_validate([*small, "tpu_topology=cpu_spmd4", "algorithm.group_size=16"])


def test_family_sampler_and_builder_must_agree():
    assert "sample.name" in problems([*FLOW_SMOKE, "sampler=ddim_short"])
    assert "sample.name" in problems(["+experiment=smoke", "sampler=flow_sde10"])
    assert "model.builder" in problems(["+experiment=smoke", "model.family=sd3", "sampler=flow_sde10"])
    assert "sample.noise_level" in problems([*FLOW_SMOKE, "sample.noise_level=null"])
    assert "model.text_encoder_3" in problems(["+experiment=smoke", "model.text_encoder_3=true"])


def test_grpo_settings_need_grpo_and_its_reference():
    assert "algorithm.group_size" in problems(["+experiment=smoke", "+algorithm.group_size=4"])
    assert "algorithm.kl_beta" in problems([*FLOW_SMOKE, "model.lora.enabled=false"])
    compose_and_validate([*FLOW_SMOKE, "model.lora.enabled=false", "algorithm.kl_beta=0"])
    # CPS: the last step is deterministic, its KL term 0/0; training it with a KL penalty is refused
    found = problems([*FLOW_SMOKE, "sample.sde_type=cps", "train.timestep_fraction=1.0"])
    assert "timestep_fraction=0.99" in found["train.timestep_fraction"]


def test_grpo_samples_each_prompt_of_an_epoch_group_size_times():
    from ddpo_tpu.algorithms.grpo import GRPO
    from ddpo_tpu.prompts import make_prompt_source

    cfg = compose_and_validate(FLOW_SMOKE).cfg
    source = make_prompt_source("imagenet_animals", file=None, nouns_file=None, activities_file=None)
    # each sampling batch holds whole groups (flow_grpo's DistributedKRepeatSampler;
    # tests/parity/test_flow_grpo_parity.py)
    plan = GRPO(cfg).epoch_prompts(source, batches=4, batch_size=8, rng=np.random.default_rng(0))
    assert [len(b) for b in plan] == [8, 8, 8, 8]
    counts = {p: sum(b.count(p) for b in plan) for b in plan for p in b}
    assert all(c % 4 == 0 for c in counts.values()) and sum(counts.values()) == 32
    # shuffled over the epoch, not group after group: some prompt's copies are not next to each other
    flat = [p for b in plan for p in b]
    spans = {p: max(i for i, q in enumerate(flat) if q == p) - flat.index(p) for p in counts}
    assert any(span > counts[p] - 1 for p, span in spans.items()), flat
    again = GRPO(cfg).epoch_prompts(source, batches=4, batch_size=8, rng=np.random.default_rng(0))
    assert again == plan


def test_a_resume_compares_only_what_is_trained_and_only_keys_both_have():
    base = compose_and_validate(["+experiment=smoke"]).tree
    relevant = resume.resume_relevant(base)
    assert "train.learning_rate" in relevant and "sample.num_steps" in relevant and "seed" in relevant
    assert "algorithm.shuffle_timesteps" in relevant and "algorithm.name" in relevant
    for key in ("num_epochs", "evaluation.every_n_epochs", "xla.sync_every_n_denoising_steps", "logger.name",
                "train.timesteps_per_micro_step", "train.activation_checkpointing", "model.cache_dir",
                "on_nonfinite_reward"):
        assert key not in relevant, key
    then = dict(relevant)
    now = {**relevant, "algorithm.kl_beta": 0.5}  # a key an upgrade added
    del then["train.clip_range"]                   # a key an upgrade removed
    assert resume.changed_keys(then, now) == []
    assert resume.changed_keys(then, {**now, "train.learning_rate": 1.0}) == ["train.learning_rate"]


def test_grpo_micro_step_at_the_first_inner_step_has_ratio_1_and_kl_0(tmp_path):
    """Sample a trajectory with the tiny SD3 model, re-score it with the GRPO micro-step: the policy is the sampling
    policy (log-prob ratio 1) and, with the LoRA adapter freshly initialised (B = 0), equals the reference (KL 0).
    After the adapter moves, the logged KL is the closed form on the two policies' means."""
    import torch

    from ddpo_tpu.algorithms.grpo import GRPO
    from ddpo_tpu.training.ppo_epoch import make_micro_step_loss, make_reference_mean
    from ddpo_tpu.diffusion.sampling import sample_trajectory
    from ddpo_tpu.families.sd3 import SD3Family
    from ddpo_tpu.runtime import make_runtime

    cfg = compose_and_validate([*FLOW_SMOKE, f"model.cache_dir={tmp_path}"]).cfg
    rt = make_runtime(cfg)
    torch.manual_seed(0)
    family = SD3Family.load(cfg, rt)
    grpo = GRPO(cfg)
    B, T = 2, family.num_steps
    cond, uncond = family.encode(["a cat", "a dog"]), family.encode(["", ""])
    uncond_train = family.encode([""] * B * 3)  # one per fused sample (B samples x 3 timesteps)
    g = torch.Generator().manual_seed(1)
    traj = sample_trajectory(family.make_denoise_step(None), T, cond, uncond,
                             torch.randn((B, *family.latent_shape), generator=g),
                             torch.randn((T, B, *family.latent_shape), generator=g), rt=rt, sync_every=0)
    lat = traj.latents
    args = (lat[:, :-1], lat[:, 1:], traj.log_probs, traj.step_indices, cond, torch.tensor([1.0, -1.0]))
    cols = torch.arange(0, 3)
    score = family.make_score_step(None)
    loss_fn, ref_fn = make_micro_step_loss(score, grpo.loss), make_reference_mean(score)

    def step():
        with torch.no_grad(), family.reference():
            ref = ref_fn(*args, cols, uncond_train)
        return ref, loss_fn(*args, cols, uncond_train, ref)

    _, (loss, approx_kl, clipfrac, kl) = step()
    assert float(approx_kl) < 1e-12 and float(clipfrac) == 0.0  # ratio exp(lp - lp_old) = 1
    assert abs(float(kl)) < 1e-6
    with torch.no_grad():  # move the adapter: the policy leaves the reference
        for name, p in family.model.named_parameters():
            if "lora_B" in name:
                p.add_(0.05 * torch.randn(p.shape, generator=g))
    ref, (loss, approx_kl, clipfrac, kl) = step()
    x, i, x_prev = (t.index_select(1, cols).reshape(B * 3, *t.shape[2:]) for t in (args[0], args[3], args[1]))
    c = tuple(t.repeat_interleave(3, dim=0) for t in cond)
    now = score(x, i, x_prev, c, uncond_train)
    direct = (((now.mean - ref) ** 2).mean(dim=(1, 2, 3)) / (2 * now.std.reshape(-1) ** 2)).mean()
    assert float(kl) > 0 and float(kl) == pytest.approx(float(direct), rel=1e-5)
    assert float(approx_kl) > 0


DATA = Path(__file__).parents[2] / "data" / "flow_grpo"  # a few rows of flow_grpo's dataset folders


@pytest.mark.parametrize("experiment,reward,beta", [("flow_grpo_pickscore_sd35", "pickscore", 0.01),
                                                    ("flow_grpo_geneval_sd35", "geneval", 0.04),
                                                    ("flow_grpo_ocr_sd35", "ocr", 0.04)])
def test_flow_grpo_sd35_experiments_pin_the_reference_on_a_v6e_8(tmp_path, experiment, reward, beta):
    if reward == "geneval":  # the dataset with its metadata; mmdet's checkpoint; this interpreter as mmdet's env
        (tmp_path / "m2f.pth").write_bytes(b"placeholder")
        prompts = [f"prompts.path={DATA / 'geneval'}", f"reward.detector_model={tmp_path / 'm2f.pth'}",
                   f"reward.process.python={sys.executable}"]
    elif reward == "ocr":  # this interpreter as PaddleOCR's env
        prompts = [f"prompts.path={DATA / 'ocr'}", f"reward.process.python={sys.executable}"]
    else:
        (tmp_path / "prompts.txt").write_text("a photo of a cat\na photo of a dog\n")
        prompts = [f"prompts.path={tmp_path / 'prompts.txt'}"]
    v = compose_and_validate([f"+experiment={experiment}", *prompts])
    cfg = v.cfg
    # flow_grpo's values are pinned by the parity group (a report row each, all ok below); what is derived from them:
    assert cfg.parity.name.startswith("flow_grpo") and cfg.reward.name == reward
    assert batch.totals(cfg).samples_per_epoch == 1152 and batch.totals(cfg).total_train_batch == 576
    assert batch.num_train_timesteps(cfg) == 9
    assert not [r for r in v.report if not r["ok"]]
    # per chip: flow_grpo's 9 samples a sampling batch, but 1 per training micro-step (x 72 accumulation = 576 on 8
    # chips): one sample with CFG needs ~13 GiB of activations on XLA by the estimate, beside ~17 GiB of models
    assert cfg.sample.batch_size == 9 and cfg.train.batch_size == 1 and cfg.train.gradient_accumulation_steps == 72
    assert memory.fused_timesteps(cfg) == 1
    assert 15 < memory.resident_gib(cfg) < 19
    assert memory.training_activation_gib(cfg, 1) <= memory.activation_budget(cfg) < 2 * memory.training_activation_gib(
        cfg, 1)
    # the reference's 9 per device is refused with per-replica values that fit and keep the 576
    run = [f"+experiment={experiment}", *prompts]
    found = problems([*run, "train.batch_size=9", "train.gradient_accumulation_steps=8"])
    assert list(found) == ["train.batch_size"]
    assert "GiB of activations per chip (estimate)" in found["train.batch_size"]
    # (with activation checkpointing, which auto turns on here, 2 fit; 1 is what divides the sampling batch of 9)
    assert "samples fit; try train.batch_size=1 train.gradient_accumulation_steps=72" in found["train.batch_size"]
    found = problems([*run, "train.batch_size=3", "train.gradient_accumulation_steps=24"])
    assert found["train.batch_size"].endswith("try train.batch_size=1 train.gradient_accumulation_steps=72")
    # the same run on a v6e-16 is refused with per-replica values that keep the totals (and fit)
    found = problems([*run, "tpu_topology=v6e-16"])
    assert any("sample." in k for k in found)
    assert found["train.gradient_accumulation_steps"].endswith("try train.gradient_accumulation_steps=36")


@pytest.mark.parametrize("overrides,reason,fix", [
    # a v5e chip (16 GiB) cannot hold SD 3.5 Medium with T5-XXL in bf16 at all
    (["tpu_topology=v5e-8"], "alone need about 17", "use chips with more HBM"),
    # float32 weights on a v6e chip: 32 GiB before any activation; bf16 weights fit
    (["model.dtype=float32", "train.mixed_precision=no"], "alone need about 32",
     "model.dtype=bfloat16 train.mixed_precision=bf16 train.batch_size=1"),
])
def test_sd35_that_cannot_fit_one_sample_is_refused_with_what_would(tmp_path, overrides, reason, fix):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a photo of a cat\n")
    found = problems(["+experiment=flow_grpo_pickscore_sd35", f"prompts.path={prompts}", *overrides])
    assert reason in found["tpu_topology.name"] and fix in found["tpu_topology.name"]
