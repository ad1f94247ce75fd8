"""GDPO advantages (algorithms/multi_reward.py) from X-GenGroup/Flow-Factory@a0b2bc5
src/flow_factory/advantage/advantage_processor.py `compute_gdpo` (lines 403-475): each reward normalised inside each
group with max(std, 1e-6), weighted, summed, then the sum normalised over the batch with max(std, 1e-6)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ddpo_tpu.algorithms.grpo import group_advantages
from ddpo_tpu.algorithms.multi_reward import gdpo_advantages

# two prompts, interleaved so grouping by label (not by position) is what is tested
GROUPS = ["p0", "p1", "p0", "p1", "p0", "p1"]
A = [1.0, 10.0, 2.0, 10.0, 3.0, 10.0]   # p0: 1, 2, 3 (std sqrt(2/3)); p1: all 10 (std 0 -> the floor -> 0)
B = [0.5, 0.1, 0.5, 0.3, 0.5, 0.2]      # p0: all 0.5 -> 0; p1: 0.1, 0.3, 0.2 (std sqrt(0.02/3))


def test_the_worked_example_of_flow_factorys_formula():
    # per reward and group: A's p0 -> (-1, 0, 1) * sqrt(3/2); B's p1 -> (-1, 1, 0) * sqrt(3/2), weighted 2
    # combined, in sample order: -sqrt(1.5), -2 sqrt(1.5), 0, 2 sqrt(1.5), sqrt(1.5), 0: mean 0, std sqrt(2.5)
    got = gdpo_advantages({"a": A, "b": B}, {"a": 1.0, "b": 2.0}, GROUPS)
    want = [-math.sqrt(0.6), -math.sqrt(2.4), 0.0, math.sqrt(2.4), math.sqrt(0.6), 0.0]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    assert got.dtype == np.float32


def test_a_rewards_scale_does_not_decide_the_ranking_as_it_does_in_the_weighted_sum():
    rng = np.random.default_rng(0)
    groups = np.repeat(np.arange(4), 6)
    a, b = rng.normal(size=24), rng.normal(size=24)
    base = gdpo_advantages({"a": a, "b": b}, {"a": 1.0, "b": 1.0}, groups)
    scaled = gdpo_advantages({"a": 1000.0 * a, "b": b}, {"a": 1.0, "b": 1.0}, groups)
    np.testing.assert_allclose(scaled, base, rtol=1e-5, atol=1e-6)
    # GRPO on the sum: a's spread decides; the advantages follow a alone
    summed = group_advantages(1000.0 * a + b, groups)
    only_a = group_advantages(a, groups)
    assert np.corrcoef(summed, only_a)[0, 1] > 0.999
    assert np.corrcoef(base, only_a)[0, 1] < 0.95


def test_equal_values_in_a_group_give_zero_not_a_division_by_zero():
    got = gdpo_advantages({"a": [1.0, 1.0, 2.0, 4.0]}, {"a": 1.0}, ["x", "x", "y", "y"])
    assert np.isfinite(got).all()
    # the constant group: exactly 0 (no signal; GRPO's drop_zero_advantage drops it), the other z-scored over the batch
    assert got[0] == 0.0 and got[1] == 0.0
    np.testing.assert_allclose(got[2:], [-math.sqrt(2), math.sqrt(2)], rtol=1e-6)


def test_bad_inputs_name_the_reward():
    with pytest.raises(ValueError, match="no weight for reward"):
        gdpo_advantages({"a": A}, {}, GROUPS)
    with pytest.raises(ValueError, match="reward 'a'"):
        gdpo_advantages({"a": A[:3]}, {"a": 1.0}, GROUPS)


# --- in the loop: reward=weighted's components reach the advantages --------------------------------------------------

GDPO_RUN = ["+experiment=flow_grpo_smoke", "num_epochs=1", "sample.batch_size=8", "sample.num_batches_per_epoch=2",
            "train.batch_size=8", "train.gradient_accumulation_steps=2", "algorithm.group_size=4",
            "sample.num_steps=3", "reward=weighted", "algorithm.advantage_aggregation=gdpo",
            "reward.components=[{name: jpeg_compressibility, weight: 1.0}, "
            "{name: jpeg_incompressibility, weight: 0.5}]"]


def test_the_loops_advantages_are_gdpo_of_the_weighted_rewards_components(tmp_path, model_cache):
    from types import SimpleNamespace

    from ddpo_tpu.config.compose import compose_and_validate
    from ddpo_tpu.rundir.files import RunDir
    from ddpo_tpu.runtime import make_runtime
    from ddpo_tpu.training import loop

    v = compose_and_validate([*GDPO_RUN, f"model.cache_dir={model_cache}", "reward.host_workers=0"])
    tr = loop.Trainer(v.cfg, make_runtime(v.cfg), RunDir(tmp_path), tree=v.tree, stop=SimpleNamespace(requested=False))
    sampled = tr.sample_epoch(0)
    rewards = tr.gather_rewards(0, sampled)
    samples = tr.epoch_samples(0, sampled, rewards)
    comp, incomp = sampled.extras["jpeg_compressibility"], sampled.extras["jpeg_incompressibility"]
    np.testing.assert_allclose(rewards, comp + 0.5 * incomp, rtol=1e-5)  # the run trains on the weighted sum's groups
    keys = tr.family.prompt_keys(sampled.prompts, tr.algorithm.key_tokens)
    want = gdpo_advantages({"a": comp, "b": incomp}, {"a": 1.0, "b": 0.5}, keys)
    np.testing.assert_allclose(samples.advantages.cpu().numpy(), want, rtol=1e-5, atol=1e-6)
    # and not GRPO's on the sum: the two differ on these rewards
    assert np.abs(want - group_advantages(rewards, keys, global_std=True)).max() > 1e-2


def test_gdpo_is_refused_without_a_weighted_reward():
    from ddpo_tpu.config.compose import ConfigError, compose_and_validate

    with pytest.raises(ConfigError) as e:
        compose_and_validate(["+experiment=flow_grpo_smoke", "algorithm.advantage_aggregation=gdpo"])
    lines = [p.key for p in e.value.problems]
    assert lines == ["algorithm.advantage_aggregation"]
