"""Tests for the GRPO pieces (ddpo_tpu.algorithms.grpo): group advantages, the closed-form KL, the loss."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from ddpo_tpu.algorithms.grpo import GROUP_STD_EPS, group_advantages, grpo_loss, kl_to_reference
from ddpo_tpu.algorithms.ppo import ppo_loss
from ddpo_tpu.diffusion.flow import FlowTables


def grouped_rewards(seed=0, groups=4, size=6):
    rng = np.random.default_rng(seed)
    prompts = [f"prompt {g}" for g in range(groups) for _ in range(size)]
    order = rng.permutation(len(prompts))  # groups interleaved, as a shuffled epoch is
    prompts = [prompts[i] for i in order]
    rewards = rng.normal(loc=rng.normal(size=groups).repeat(size)[order], scale=2.0)
    return np.array(prompts), rewards


def test_group_advantages_are_standardised_within_each_group():
    prompts, rewards = grouped_rewards()
    adv = group_advantages(rewards, prompts)
    assert adv.shape == rewards.shape and adv.dtype == np.float32
    for p in np.unique(prompts):
        a, r = adv[prompts == p].astype(np.float64), rewards[prompts == p]
        assert abs(a.mean()) < 1e-6
        # population std (np.std, ddof 0), so the group's std is std / (std + eps)
        assert a.std() == pytest.approx(r.std() / (r.std() + GROUP_STD_EPS), rel=1e-6)
        assert a.std() == pytest.approx(1.0, abs=1e-3)
        np.testing.assert_allclose(a, (r - r.mean()) / (np.std(r) + 1e-4), rtol=1e-6, atol=1e-6)
    # the group statistics are not the batch's
    assert not np.allclose(adv, (rewards - rewards.mean()) / (rewards.std() + 1e-4), atol=1e-3)


def test_constant_group_gives_zero_advantage_and_ints_work_as_group_ids():
    rewards = np.array([1.0, 1.0, 1.0, 0.2, 0.8, 5.0, 5.0])
    ids = [0, 0, 0, 1, 1, 2, 2]
    adv = group_advantages(rewards, ids)
    assert np.array_equal(adv[[0, 1, 2, 5, 6]], np.zeros(5, dtype=np.float32))
    np.testing.assert_allclose(adv[3:5], [-0.3 / (0.3 + 1e-4), 0.3 / (0.3 + 1e-4)], rtol=1e-6)


def test_per_timestep_rewards_clip_and_global_std():
    prompts, rewards = grouped_rewards(seed=1)
    per_step = np.repeat(rewards[:, None], 3, axis=1)  # the reference repeats each reward over the trained steps
    adv2 = group_advantages(per_step, prompts)
    adv1 = group_advantages(rewards, prompts)
    assert adv2.shape == (len(rewards), 3)
    for j in range(3):
        assert np.array_equal(adv2[:, j], adv1)

    clipped = group_advantages(rewards * 0 + np.arange(len(rewards)) ** 3, prompts, clip=0.5)
    assert clipped.max() == pytest.approx(0.5) and clipped.min() == pytest.approx(-0.5)

    g = group_advantages(rewards, prompts, global_std=True)
    for p in np.unique(prompts):
        r = rewards[prompts == p]
        np.testing.assert_allclose(g[prompts == p], (r - r.mean()) / (rewards.std() + 1e-4), rtol=1e-6, atol=1e-6)

    with pytest.raises(ValueError, match="group_ids"):
        group_advantages(rewards, prompts[:-1])


def test_first_inner_step_ratio_is_one_and_kl_is_zero():
    """At the first inner step the policy is the sampling policy and (LoRA B = 0) the reference: the re-scored
    log-prob equals the sampled one, the ratio is 1, and the KL is 0."""
    tables = FlowTables.from_scheduler(FlowMatchEulerDiscreteScheduler(shift=3.0), 10, "cpu")
    gen = torch.Generator().manual_seed(0)
    # not the last step (9): CPS has std 0 there, so its KL is 0 / 0; flow_grpo never trains it (timestep_fraction
    # 0.99 -> int(0.99 * 10) = 9 trained steps)
    idx = torch.tensor([0, 3, 6, 8])
    x = torch.randn(4, 16, 4, 4, generator=gen)
    v = torch.randn(4, 16, 4, 4, generator=gen)
    z = torch.randn(4, 16, 4, 4, generator=gen)
    for sde_type in ("sde", "cps"):
        with torch.no_grad():  # sampling
            prev, old_logp, _, _ = tables.step(v, idx, x, 0.7, sde_type=sde_type, noise=z)
        v_train = v.clone().requires_grad_(True)  # training: the same weights re-score the recorded step
        _, logp, mean, std = tables.step(v_train, idx, x, 0.7, sde_type=sde_type, prev_sample=prev)
        with torch.no_grad():  # the reference (adapter disabled): the same model at this point
            _, _, ref_mean, _ = tables.step(v, idx, x, 0.7, sde_type=sde_type, prev_sample=prev)
        ratio = torch.exp(logp - old_logp)
        torch.testing.assert_close(ratio, torch.ones_like(ratio), rtol=0, atol=1e-6)
        kl = kl_to_reference(mean, ref_mean, std)
        assert kl.shape == (4,) and torch.all(kl.abs() <= 1e-6)
        adv = torch.tensor([1.0, -2.0, 0.5, 7.0])
        loss, info = grpo_loss(logp, old_logp, adv, clip_range=1e-4, adv_clip_max=5.0, kl=kl, beta=0.04)
        assert float(info["clipfrac"]) == 0.0 and float(info["approx_kl"]) < 1e-12 and float(info["kl"]) <= 1e-6
        assert float(loss.detach()) == pytest.approx(-float(adv.clamp(-5, 5).mean()), abs=1e-5)
        loss.backward()  # the KL's gradient is 0 here; the policy term's is not
        assert v_train.grad is not None and v_train.grad.abs().sum() > 0


def test_kl_matches_the_reference_formula():
    gen = torch.Generator().manual_seed(1)
    mean = torch.randn(3, 16, 4, 4, generator=gen, dtype=torch.float64)
    ref = mean + 0.1 * torch.randn(3, 16, 4, 4, generator=gen, dtype=torch.float64)
    std = torch.tensor([0.5, 1.0, 2.0], dtype=torch.float64).reshape(3, 1, 1, 1)
    kl = kl_to_reference(mean, ref, std)
    for b in range(3):  # sum of squares over the latent elements / their count / (2 std^2)
        expected = float(((mean[b] - ref[b]) ** 2).sum()) / mean[b].numel() / (2 * float(std[b]) ** 2)
        assert float(kl[b]) == pytest.approx(expected, rel=1e-12)
    # flow_grpo: ((m - r)^2).mean(dim=(1,2,3), keepdim=True) / (2 * std_dev_t ** 2), then torch.mean
    ref_loss = torch.mean(((mean - ref) ** 2).mean(dim=(1, 2, 3), keepdim=True) / (2 * std**2))
    assert float(kl.mean()) == pytest.approx(float(ref_loss), rel=1e-12)
    # a (1, 1, 1, 1) std (the pipeline's t.unsqueeze(0) step) and a scalar broadcast over the batch
    one = torch.full((1, 1, 1, 1), 0.5, dtype=torch.float64)
    assert torch.allclose(kl_to_reference(mean, ref, one), kl_to_reference(mean, ref, 0.5))
    assert float(kl_to_reference(mean, ref, one)[0]) == pytest.approx(float(kl[0]), rel=1e-12)
    with pytest.raises(ValueError, match="std"):
        kl_to_reference(mean, ref, torch.ones(2))


def test_grpo_loss_with_beta_zero_is_ppo_loss_and_beta_adds_the_kl():
    gen = torch.Generator().manual_seed(2)
    logp = torch.randn(8, generator=gen) * 0.01
    old = logp + torch.randn(8, generator=gen) * 0.01
    adv = torch.randn(8, generator=gen) * 3
    kl = torch.rand(8, generator=gen)
    expected, expected_info = ppo_loss(logp, old, adv, 1e-4, 5.0)
    for kl_arg in (None, kl):
        loss, info = grpo_loss(logp, old, adv, 1e-4, 5.0, kl=kl_arg, beta=0.0)
        assert torch.equal(loss, expected)
        assert torch.equal(info["approx_kl"], expected_info["approx_kl"])
        assert torch.equal(info["clipfrac"], expected_info["clipfrac"])
    assert float(grpo_loss(logp, old, adv, 1e-4, 5.0, kl=kl)[1]["kl"]) == pytest.approx(float(kl.mean()))
    assert float(grpo_loss(logp, old, adv, 1e-4, 5.0)[1]["kl"]) == 0.0

    loss_b, info_b = grpo_loss(logp, old, adv, 1e-4, 5.0, kl=kl, beta=0.04)
    assert float(loss_b) == pytest.approx(float(expected) + 0.04 * float(kl.mean()), rel=1e-6)
    assert float(info_b["policy_loss"]) == pytest.approx(float(expected))
    with pytest.raises(ValueError, match="kl"):
        grpo_loss(logp, old, adv, 1e-4, 5.0, beta=0.04)


def test_kl_gradient_pulls_the_mean_towards_the_reference():
    mean = torch.zeros(2, 4, 2, 2, requires_grad=True)
    ref = torch.ones(2, 4, 2, 2)
    std = torch.tensor([1.0, 2.0]).reshape(2, 1, 1, 1)
    loss, _ = grpo_loss(torch.zeros(2), torch.zeros(2), torch.zeros(2), 1e-4, 5.0,
                        kl=kl_to_reference(mean, ref, std), beta=0.5)
    loss.backward()
    # d/dmean of 0.5 * mean_b[ mean_e (m - r)^2 / (2 s_b^2) ] = 0.5 * (1/2) * (1/16) * 2 (m - r) / (2 s_b^2)
    expected = torch.stack([torch.full((4, 2, 2), -0.5 / 16 / (2 * s**2)) for s in (1.0, 2.0)])
    torch.testing.assert_close(mean.grad, expected)
