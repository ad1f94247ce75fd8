"""Tests for ddpo_tpu.algorithms.stat_tracking (per-prompt advantages)."""

import json
from collections import deque

import numpy as np
import pytest

from ddpo_tpu.algorithms.stat_tracking import (
    PerPromptStatTracker,
    clip_advantages,
    global_advantages,
)

pytestmark = pytest.mark.torch_free  # no torch in the test or what it starts (tests/conftest.py)


def _reference_update(stats, buffer_size, min_count, prompts, rewards):
    """Straightforward re-statement of the reference algorithm (float64)."""
    prompts = np.array(prompts)
    rewards = np.asarray(rewards, dtype=np.float64)
    adv = np.empty_like(rewards)
    for prompt in np.unique(prompts):
        pr = rewards[prompts == prompt]
        stats.setdefault(str(prompt), deque(maxlen=buffer_size)).extend(pr)
        buf = stats[str(prompt)]
        if len(buf) < min_count:
            mean, std = np.mean(rewards), np.std(rewards) + 1e-6
        else:
            mean, std = np.mean(buf), np.std(buf) + 1e-6
        adv[prompts == prompt] = (pr - mean) / std
    return adv


def test_batch_stats_below_min_count():
    t = PerPromptStatTracker(buffer_size=10, min_count=4)
    prompts = ["a", "a", "b"]
    rewards = np.array([1.0, 3.0, 8.0], dtype=np.float32)
    adv = t.update(prompts, rewards)
    mean, std = 4.0, np.std([1.0, 3.0, 8.0])
    np.testing.assert_allclose(adv, (np.array([1.0, 3.0, 8.0]) - mean) / (std + 1e-6), rtol=1e-6)
    assert adv.dtype == np.float32 and adv.shape == (3,)


def test_switch_to_buffer_stats_at_min_count():
    t = PerPromptStatTracker(buffer_size=10, min_count=4)
    t.update(["a", "a", "b"], np.array([1.0, 3.0, 100.0]))  # a has 2 (< 4)
    # a reaches exactly 4 now -> buffer stats for a; b has 2 -> batch stats for b
    rewards = np.array([5.0, 7.0, 50.0])
    adv = t.update(["a", "a", "b"], rewards)
    buf_a = np.array([1.0, 3.0, 5.0, 7.0])
    exp_a = (rewards[:2] - buf_a.mean()) / (buf_a.std() + 1e-6)
    exp_b = (50.0 - rewards.mean()) / (rewards.std() + 1e-6)
    np.testing.assert_allclose(adv[:2], exp_a, rtol=1e-6)
    np.testing.assert_allclose(adv[2], exp_b, rtol=1e-6)
    stats = t.get_stats()
    assert stats["a"]["count"] == 4 and stats["b"]["count"] == 2
    assert stats["a"]["mean"] == pytest.approx(4.0)
    assert stats["a"]["std"] == pytest.approx(buf_a.std())


def test_buffer_bounded_oldest_dropped():
    t = PerPromptStatTracker(buffer_size=3, min_count=1)
    t.update(["p", "p"], np.array([1.0, 2.0]))
    t.update(["p", "p"], np.array([3.0, 4.0]))
    assert list(t.state_dict()["stats"]["p"]) == [2.0, 3.0, 4.0]
    adv = t.update(["p"], np.array([10.0]))
    buf = np.array([3.0, 4.0, 10.0])
    assert t.get_stats()["p"]["count"] == 3
    np.testing.assert_allclose(adv, (10.0 - buf.mean()) / (buf.std() + 1e-6), rtol=1e-6)


def test_hand_computation_mixed_prompts():
    t = PerPromptStatTracker(buffer_size=4, min_count=2)
    prompts = np.array(["cat", "dog", "cat", "dog", "cow"])
    r = np.array([2.0, 10.0, 4.0, 14.0, 7.0])
    adv = t.update(prompts, r)
    # cat: buffer [2, 4] mean 3 std 1; dog: [10, 14] mean 12 std 2; cow: 1 < 2 -> batch
    bm, bs = r.mean(), r.std()
    expected = np.array(
        [
            (2 - 3) / (1 + 1e-6),
            (10 - 12) / (2 + 1e-6),
            (4 - 3) / (1 + 1e-6),
            (14 - 12) / (2 + 1e-6),
            (7 - bm) / (bs + 1e-6),
        ]
    )
    np.testing.assert_allclose(adv, expected, rtol=1e-6)


def test_matches_reference_algorithm_over_many_steps():
    rng = np.random.default_rng(0)
    t = PerPromptStatTracker(buffer_size=16, min_count=8)
    ref_stats = {}
    names = ["a photo of a cat", "dog", "horse", "zebra"]
    for _ in range(25):
        prompts = list(rng.choice(names, size=12))
        rewards = rng.normal(size=12).astype(np.float64) * 3 + 1
        got = t.update(prompts, rewards)
        want = _reference_update(ref_stats, 16, 8, prompts, rewards)
        np.testing.assert_array_equal(got, want.astype(np.float32))
    assert {k: list(v) for k, v in ref_stats.items()} == t.state_dict()["stats"]


def test_state_dict_round_trip_exact_and_json():
    rng = np.random.default_rng(1)
    a = PerPromptStatTracker(buffer_size=5, min_count=3)
    batches = [
        (list(rng.choice(["x", "y", "z"], size=6)), rng.normal(size=6).astype(np.float32))
        for _ in range(8)
    ]
    for p, r in batches[:4]:
        a.update(p, r)

    blob = json.dumps(a.state_dict())
    b = PerPromptStatTracker(buffer_size=5, min_count=3)
    b.load_state_dict(json.loads(blob))
    assert b.state_dict() == a.state_dict()
    assert b.get_stats() == a.get_stats()
    for p, r in batches[4:]:
        np.testing.assert_array_equal(a.update(p, r), b.update(p, r))
    assert a.state_dict() == b.state_dict()


def test_load_state_dict_keeps_buffer_bound():
    a = PerPromptStatTracker(buffer_size=5, min_count=1)
    a.update(["p"] * 5, np.arange(5.0))
    b = PerPromptStatTracker(buffer_size=2, min_count=1)
    b.load_state_dict(a.state_dict())
    assert b.state_dict()["stats"]["p"] == [3.0, 4.0]


def test_prompts_as_list_and_array_agree():
    r = np.array([1.0, 2.0, 5.0, 9.0])
    p = ["a", "b", "a", "b"]
    a = PerPromptStatTracker(8, 2).update(p, r)
    b = PerPromptStatTracker(8, 2).update(np.array(p), r)
    np.testing.assert_array_equal(a, b)
    assert np.all(np.isfinite(a))


def test_input_validation():
    t = PerPromptStatTracker(4, 2)
    with pytest.raises(ValueError):
        t.update(["a", "b"], np.array([1.0]))
    with pytest.raises(ValueError):
        t.update(["a"], np.zeros((1, 1)))
    with pytest.raises(ValueError):
        PerPromptStatTracker(0, 1)
    assert t.update([], np.zeros(0)).shape == (0,)


def test_global_advantages():
    r = np.array([1.0, 2.0, 3.0, 10.0], dtype=np.float32)
    adv = global_advantages(r)
    r64 = r.astype(np.float64)
    np.testing.assert_allclose(adv, (r64 - r64.mean()) / (r64.std() + 1e-8), rtol=1e-6)
    assert adv.dtype == np.float32 and adv.shape == (4,)
    assert abs(float(adv.mean())) < 1e-6
    # constant rewards -> zero advantages, not NaN
    np.testing.assert_array_equal(global_advantages(np.full(3, 2.0)), np.zeros(3, np.float32))


def test_clip_advantages():
    adv = np.array([-7.0, -5.0, -0.5, 0.0, 4.9, 5.0, 12.0])
    out = clip_advantages(adv, 5.0)
    np.testing.assert_array_equal(out, np.array([-5.0, -5.0, -0.5, 0.0, 4.9, 5.0, 5.0], np.float32))
    assert out.dtype == np.float32
    with pytest.raises(ValueError):
        clip_advantages(adv, -1.0)
