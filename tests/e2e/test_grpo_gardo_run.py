"""GARDO's gated KL and diversity-aware advantages in the loop, on the tiny SD3 (yifan123/flow_grpo@94e23ee5,
scripts/train_sd3_gardo.py; tests/unit/algorithms/test_grpo_gardo_gate.py has the formulas). The reference's auxiliary
rewards (LAION aesthetic, ImageReward) and its feature model (DINOv3) are hub models; here the project's tiny local
stand-ins, as reward-registry entries: the tiny aesthetic (tiny CLIP + LAION-shaped MLP) and the tiny clip_score as the
two auxiliary rewards, the tiny CLIP's image embeddings (`clip_features`) as the features. Plus the compose-time
refusals of combinations that cannot take effect."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from ddpo_tpu.config.compose import ConfigError, compose_and_validate
from tests.unit.algorithms.test_grpo_gardo_gate import (ReferenceCompensator, reference_gardo_advantages,
                                                         reference_gate, reference_uncertainty)

AUX = "[{name:aesthetic,clip_model:tiny,mlp_path:tiny},{name:clip_score,clip_model:tiny}]"
FEATURES = "{name:clip_features,clip_model:tiny}"
SMALL = ["+experiment=flow_grpo_smoke", "sample.batch_size=8", "sample.num_batches_per_epoch=1",
         "train.batch_size=8", "train.gradient_accumulation_steps=1", "algorithm.group_size=4"]
GARDO = [f"algorithm.kl_gate_rewards={AUX}", f"algorithm.diversity_features={FEATURES}"]


def _trainer(tmp_path, model_cache, *overrides):
    from ddpo_tpu.rundir.files import RunDir
    from ddpo_tpu.runtime import make_runtime
    from ddpo_tpu.training import loop

    v = compose_and_validate([*SMALL, f"model.cache_dir={model_cache}", *overrides])
    tr = loop.Trainer(v.cfg, make_runtime(v.cfg), RunDir(tmp_path), tree=v.tree, stop=SimpleNamespace(requested=False))
    tr.report.step = lambda rec: None  # the reporter's tracker starts in fit()
    return v.cfg, tr


def test_an_epoch_gates_the_kl_and_scales_advantages_as_the_reference(tmp_path, model_cache):
    from ddpo_tpu.rewards.base import make_reward
    from ddpo_tpu.rewards.from_config import reward_kwargs

    cfg, tr = _trainer(tmp_path, model_cache, *GARDO)
    sampled = tr.sample_epoch(0)
    rewards = tr.gather_rewards(0, sampled)
    aux, feats = sampled.scores["kl_gate_rewards"], sampled.scores["features"]
    assert aux.shape == (8, 2) and feats.shape[0] == 8 and feats.ndim == 2
    # the registry entries, built as any reward is, score the images the loop scored
    images = sampled.first_images
    for j, entry in enumerate(cfg.algorithm.kl_gate_rewards):
        r = make_reward(entry.name, **reward_kwargs(entry, Path(model_cache), "cpu"))
        assert np.allclose(r(images, sampled.prompts), aux[:, j], rtol=1e-5, atol=1e-6)
    s = tr.epoch_samples(0, sampled, rewards)
    keys = tr.family.prompt_keys(sampled.prompts, tr.algorithm.key_tokens)
    want_adv = reference_gardo_advantages(keys, rewards[:, None], feats)[:, 0]
    assert np.allclose(s.advantages.cpu().numpy(), want_adv, rtol=1e-5, atol=1e-6)
    # the reference's main reward ranked against its aesthetic and ImageReward: here the tiny stand-ins
    u = reference_uncertainty(rewards, aux[:, 0], aux[:, 1])
    want_gate = reference_gate(u, ReferenceCompensator())
    assert np.array_equal(s.kl_gate.cpu().numpy() > 0, want_gate) and want_gate.any()
    assert tr.algorithm.epoch_metrics["kl_gate_share"] == pytest.approx(0.1)
    logs = tr.train_epoch(0, s)
    assert len(logs) == 1 and np.isfinite(logs[0]["kl"]) and np.isfinite(logs[0]["loss"])


def test_off_by_default_nothing_extra_is_scored():
    from ddpo_tpu.algorithms.grpo import GRPO

    v = compose_and_validate(SMALL)
    a = v.cfg.algorithm
    assert a.kl_gate_rewards == [] and a.diversity_features is None
    grpo = GRPO(v.cfg)  # the loop then scores the reward alone and trains today's GRPO
    assert grpo.image_scores(None) is None and grpo.kl_gate(np.zeros(8), None) is None


@pytest.mark.parametrize("overrides, key", [
    # a gate with no KL term to gate
    ([f"algorithm.kl_gate_rewards={AUX}", "algorithm.kl_beta=0"], "algorithm.kl_gate_rewards"),
    # the gate's share with no gate
    (["algorithm.kl_gate_share=0.15"], "algorithm.kl_gate_share"),
    # an auxiliary reward equal to the trained one never disagrees with it
    (["algorithm.kl_gate_rewards=[{name:jpeg_compressibility}]"], "algorithm.kl_gate_rewards.0"),
    # a feature model is not a reward, a reward is not a feature model
    (["algorithm.kl_gate_rewards=[{name:clip_features,clip_model:tiny}]"], "algorithm.kl_gate_rewards.0"),
    (["algorithm.diversity_features={name:clip_score,clip_model:tiny}"], "algorithm.diversity_features"),
    # an auxiliary reward's own keys are checked as the run's reward's are
    (["algorithm.kl_gate_rewards=[{name:aesthetic,clip_model:tiny}]"], "algorithm.kl_gate_rewards.0.mlp_path"),
    # GARDO's advantages are not divided by a std
    ([f"algorithm.diversity_features={FEATURES}", "algorithm.global_std=false"], "algorithm.global_std"),
    # the feature model stands in for DINOv3: reward=weighted's components and the run's reward cannot be one
    (["reward=clip_features"], "reward"),
])
def test_nonsense_combinations_are_refused_in_one_line(overrides, key):
    with pytest.raises(ConfigError) as e:
        compose_and_validate([*SMALL, *overrides])
    assert any(p.key.startswith(key) for p in e.value.problems), [str(p) for p in e.value.problems]


def test_a_video_family_is_refused():
    with pytest.raises(ConfigError) as e:
        compose_and_validate(["+experiment=wan_grpo_smoke", f"algorithm.diversity_features={FEATURES}"])
    assert any(p.key == "algorithm.diversity_features" and "videos" in p.reason for p in e.value.problems)
