"""GRPO-Guard's RatioNorm and gradient reweighting as `algorithm.ratio_norm` of GRPO, against
scripts/train_sd3_GRPO_Guard.py (config `grpo_guard.py:general_ocr_sd3_rationorm`) read in the fork
zhtmike/flow_grpo@2e2f712e9feb19246fa0db9527878e2766b5353f (the store holds no yifan123 commit of the file; its README
at 94e23ee5 points to it): inside the training loop's `if config.rationorm:` blocks, per step j of a batch. Off by
default: flow_grpo's train_sd3.py (the parity runs) uses the plain ratio."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ddpo_tpu.config.compose import ConfigError, compose_and_validate
from ddpo_tpu.algorithms.grpo import ratio_norm_loss
from ddpo_tpu.algorithms.ppo import ppo_loss

CLIP, ADV_MAX = 0.2, 5.0


def reference_step(log_prob, old_log_probs, prev_sample_mean, old_prev_sample_mean, std_dev_t, sqrt_dt, advantages,
                   clip_range=CLIP, adv_clip_max=ADV_MAX):
    """The loop body of one step j with config.rationorm, transcribed (the kept samples of one batch)."""
    advantages = torch.clamp(advantages, -adv_clip_max, adv_clip_max)
    sigma_t = std_dev_t.mean()
    ratio_mean_bias = (prev_sample_mean - old_prev_sample_mean).pow(2).mean(dim=tuple(range(1, log_prob.ndim)))
    ratio_mean_bias = ratio_mean_bias / (2 * (sqrt_dt.mean() * sigma_t) ** 2)
    ratio = torch.exp((log_prob - old_log_probs + ratio_mean_bias) * (sqrt_dt.mean() * sigma_t))
    unclipped_loss = -advantages * ratio
    clipped_loss = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    policy_loss = torch.mean(torch.maximum(unclipped_loss, clipped_loss))
    policy_loss = policy_loss / (sqrt_dt.mean() ** 2)
    clipfrac = torch.mean((torch.abs(ratio - 1.0) > clip_range).float())
    return policy_loss, clipfrac


def batch(B, seed, std=0.3, dt=0.1):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)
    mean = r(B, 4, 2, 2)
    return {"lp": -r(B).abs(), "old_lp": -r(B).abs(), "mean": mean, "old_mean": mean + 0.05 * r(B, 4, 2, 2),
            "std": torch.full((B, 1, 1, 1), std, dtype=torch.float64),
            "sqrt_dt": torch.full((B,), dt ** 0.5, dtype=torch.float64), "adv": 3 * r(B)}


def ours(b, steps, weights=None):
    return ratio_norm_loss(b["lp"], b["old_lp"], b["mean"], b["old_mean"], b["std"], b["sqrt_dt"], steps, b["adv"],
                           CLIP, ADV_MAX, weights)


def test_one_step_batch_equals_the_reference_loss_gradient_and_clipfrac():
    b = batch(6, 0)
    lp, mean = b["lp"].clone().requires_grad_(), b["mean"].clone().requires_grad_()
    want, clipfrac = reference_step(lp, b["old_lp"], mean, b["old_mean"], b["std"], b["sqrt_dt"].view(-1, 1, 1, 1),
                                    b["adv"])
    want.backward()
    lp2, mean2 = b["lp"].clone().requires_grad_(), b["mean"].clone().requires_grad_()
    loss, info = ours({**b, "lp": lp2, "mean": mean2}, torch.zeros(6, dtype=torch.long))
    loss.backward()
    assert loss.item() == pytest.approx(want.item(), rel=1e-12)
    assert torch.allclose(lp2.grad, lp.grad, rtol=1e-12) and torch.allclose(mean2.grad, mean.grad, rtol=1e-12)
    assert info["clipfrac"].item() == clipfrac.item()


def test_fused_steps_are_each_the_reference_batch_of_their_step():
    # two steps fused, rows sample-major (b K + k) as the loop flattens them: the mean of the two steps' losses
    a, c = batch(4, 1, std=0.3, dt=0.1), batch(4, 2, std=0.7, dt=0.05)
    per_step = [reference_step(x["lp"], x["old_lp"], x["mean"], x["old_mean"], x["std"],
                               x["sqrt_dt"].view(-1, 1, 1, 1), x["adv"])[0] for x in (a, c)]
    fused = {k: torch.stack([a[k], c[k]], dim=1).reshape(8, *a[k].shape[1:]) for k in a}
    loss, _ = ours(fused, torch.tensor([3, 5] * 4))
    assert loss.item() == pytest.approx(sum(per_step).item() / 2, rel=1e-12)


def test_dropped_samples_leave_the_batch_as_the_reference_filters_them():
    # flow_grpo drops zero-advantage samples before batching (samples = samples[mask]); here a weight of 0, the kept
    # ones N / kept: the same loss as the reference's on the kept rows alone, the bias a mean over them only
    b = batch(6, 3)
    keep = torch.tensor([1, 0, 1, 1, 0, 1], dtype=torch.bool)
    want, _ = reference_step(*(b[k][keep] for k in ("lp", "old_lp", "mean", "old_mean", "std")),
                             b["sqrt_dt"][keep].view(-1, 1, 1, 1), b["adv"][keep])
    w = keep.double() * 6 / 4
    loss, _ = ours(b, torch.zeros(6, dtype=torch.long), w)
    assert loss.item() == pytest.approx(want.item(), rel=1e-12)


def test_it_changes_the_ratio_and_the_step_weight_of_the_plain_objective():
    b = batch(6, 4)
    plain, _ = ppo_loss(b["lp"], b["old_lp"], b["adv"], CLIP, ADV_MAX)
    guard, _ = ours(b, torch.zeros(6, dtype=torch.long))
    assert abs(guard.item() - plain.item()) > 1e-3
    # on-policy (mu_old = mu, lp_old = lp): both ratios are 1 in value, and the gradient through lp is the plain
    # one times s (the exponent's scale) over dt (the reweighting): sqrt(dt) std / dt
    on = {**b, "old_mean": b["mean"], "old_lp": b["lp"]}
    lp1, lp2 = b["lp"].clone().requires_grad_(), b["lp"].clone().requires_grad_()
    ppo_loss(lp1, b["lp"], b["adv"], CLIP, ADV_MAX)[0].backward()
    loss, info = ours({**on, "lp": lp2}, torch.zeros(6, dtype=torch.long))
    loss.backward()
    s, dt = b["sqrt_dt"][0] * b["std"][0, 0, 0, 0], b["sqrt_dt"][0] ** 2
    assert torch.allclose(lp2.grad, lp1.grad * s / dt, rtol=1e-12) and info["clipfrac"].item() == 0


def test_an_epoch_with_ratio_norm_compares_with_the_sampling_weights(tmp_path, model_cache):
    from ddpo_tpu.training import loop
    from ddpo_tpu.rundir.files import RunDir
    from ddpo_tpu.runtime import make_runtime

    v = compose_and_validate(["+experiment=flow_grpo_smoke", f"model.cache_dir={model_cache}",
                              "algorithm.ratio_norm=true",
                              "sample.batch_size=8", "sample.num_batches_per_epoch=1", "train.batch_size=4",
                              "train.gradient_accumulation_steps=1", "algorithm.drop_zero_advantage=false"])
    tr = loop.Trainer(v.cfg, make_runtime(v.cfg), RunDir(tmp_path), tree=v.tree, stop=SimpleNamespace(requested=False))
    tr.report.step = lambda rec: None  # the reporter's tracker starts in fit()
    assert tr.algorithm.needs_old_mean and "sampling_policy" in tr.state.copies
    sampled = tr.sample_epoch(0)
    before = [p.detach().clone() for p in tr.state.params]
    logs = tr.train_epoch(0, tr.epoch_samples(0, sampled, tr.gather_rewards(0, sampled)))
    assert len(logs) == 2 and all(torch.isfinite(torch.tensor(r["loss"])) for r in logs)
    # the copy holds the weights that sampled (taken when training began), not the trained ones
    copy = tr.state.copies["sampling_policy"].shadow
    assert all(torch.equal(c, p) for c, p in zip(copy, before))
    assert any(not torch.equal(c, p) for c, p in zip(copy, tr.state.params))
    assert logs[0]["clipfrac"] == 0  # the first update: the sampling weights' own means, ratio 1 up to rounding


def test_ratio_norm_needs_a_flow_sampler():
    with pytest.raises(ConfigError) as e:
        compose_and_validate(["+experiment=smoke", "algorithm=grpo", "algorithm.group_size=2", "algorithm.kl_beta=0",
                              "algorithm.ratio_norm=true"])
    assert any(p.key == "algorithm.ratio_norm" for p in e.value.problems)
