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
    assert got[0] == got[1]  # the constant group contributes 0 to both, then the batch normalisation shifts them


def test_bad_inputs_name_the_reward():
    with pytest.raises(ValueError, match="no weight for reward"):
        gdpo_advantages({"a": A}, {}, GROUPS)
    with pytest.raises(ValueError, match="reward 'a'"):
        gdpo_advantages({"a": A[:3]}, {"a": 1.0}, GROUPS)
