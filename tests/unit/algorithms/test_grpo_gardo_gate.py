"""GARDO's uncertainty-gated KL and diversity-aware advantages as options of GRPO (`algorithm.kl_gate_rewards`,
`algorithm.kl_gate_share`, `algorithm.diversity_features`), against yifan123/flow_grpo at
94e23ee5405ab7241fc1f75d30cac8147e2b1f53. Line numbers are of that commit's text as the store serves it:

- scripts/train_sd3_gardo.py:218-237 `RiskCompensator` (base 0.1, alpha 0.1, beta in [0.02, 0.2], a window of 20
  epoch means); :826-836 the uncertainty (each sample's rank under the main reward minus the mean of its ranks under
  `aesthetic` and `imagereward`, ranks 1 = best over the whole gathered epoch), the compensator's update with the
  non-negative values, the threshold `np.percentile(those, 100 - beta * 100)` and the gate `u > threshold`;
  :953 `idx = sample["reward_std"] > 0`; :979-990 the loss: the policy loss's mean plus beta times the KL's mean over
  the gated samples only (the policy loss alone when none is gated); :1020 the logged KL is that gated mean.
- flow_grpo/stat_tracking.py:11-50 `update(..., type='gardo')`: features L2-normalised (:18), per prompt the group
  mean (:28), each sample's cosine distance to its nearest other sample of the group (:32-39), above-or-at-mean
  samples scaled by that distance over the group's mean distance, below-mean ones by 1 (:42), no std (:50).

The reference functions below are transcriptions of those lines; ours are ddpo_tpu/algorithms/guards.py, the
gated KL of ddpo_tpu/algorithms/grpo.py and its row weights (training/epoch_data.py's batch_mean_weights). The
stand-ins for the reference's models (aesthetic, ImageReward, DINOv3) are
the project's tiny CLIP-based entries (tiny aesthetic, tiny clip_score, tiny clip_features): see
tests/e2e/test_grpo_gardo_run.py."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ddpo_tpu.algorithms.guards import UncertaintyGate, diversity_advantages, rank_uncertainty
from ddpo_tpu.algorithms.grpo import grpo_loss, kl_to_reference
from ddpo_tpu.training.epoch_data import batch_mean_weights

CLIP, ADV_MAX, BETA = 0.2, 5.0, 0.04


# --- the reference, transcribed ---------------------------------------------------------------------------------------
class ReferenceCompensator:
    """train_sd3_gardo.py:218-237."""

    def __init__(self, base=0.1, beta=0.1):
        self.risk_buffer, self.base, self.alpha, self.beta = [], base, 0.1, beta
        self.beta_min, self.beta_max = 0.02, 0.2

    def update(self, pad_scores):
        if len(self.risk_buffer) == 0:
            self.beta = self.base
        elif np.mean(pad_scores) > max(self.risk_buffer):
            self.beta = self.beta * (1 + self.alpha)
        elif np.mean(pad_scores) < min(self.risk_buffer):
            self.beta = self.beta * (1 - self.alpha)
        self.beta = np.clip(self.beta, self.beta_min, self.beta_max)
        self.risk_buffer.append(np.mean(pad_scores))
        if len(self.risk_buffer) > 20:
            self.risk_buffer = self.risk_buffer[-20:]


def reference_uncertainty(main, aesthetic, imagereward):
    """train_sd3_gardo.py:825-833: ranks (1 = highest) under each score over all samples, main - mean(aux)."""
    ranks = []
    for scores in (aesthetic, imagereward, main):
        _, indices = torch.sort(torch.tensor(scores), descending=True)
        r = torch.empty_like(torch.tensor(scores)).long()
        r[indices] = torch.arange(1, len(scores) + 1)
        ranks.append(r.float())
    return ranks[-1] - (ranks[0] + ranks[1]) / 2


def reference_gate(u, compensator):
    """train_sd3_gardo.py:834-836."""
    nonneg = np.array([p for p in u.cpu().numpy() if p >= 0])
    compensator.update(nonneg)
    threshold = np.percentile(nonneg, 100 - compensator.beta * 100)
    return (u > threshold).numpy()


def reference_gardo_advantages(prompts, rewards, dists):
    """stat_tracking.py:11-50 with type='gardo' (one epoch: the tracker is cleared after each, :539)."""
    prompts, rewards = np.array(prompts), np.array(rewards, dtype=np.float64)
    advantages = np.empty_like(rewards) * 0.0
    dists = np.array(dists)
    dists = dists / np.linalg.norm(dists, ord=2, axis=1, keepdims=True)
    for prompt in np.unique(prompts):
        prompt_rewards = rewards[prompts == prompt]
        mean = np.mean(prompt_rewards, axis=0, keepdims=True)
        d = dists[prompts == prompt]
        distance = 1 - np.dot(d, d.T).clip(-1, 1)
        nearest = np.array([np.min(np.delete(distance[i], i)) for i in range(len(distance))])
        nearest = np.repeat(nearest[:, np.newaxis], prompt_rewards.shape[-1], axis=1)
        scale = np.where((prompt_rewards - mean) < 0, np.ones_like(nearest), nearest / np.mean(nearest))
        advantages[prompts == prompt] = (prompt_rewards - mean) * scale
    return advantages


def reference_loss(log_prob, old_log_prob, adv, mean, ref_mean, std, gate, beta=BETA):
    """train_sd3_gardo.py:953 and 966-990 for one step j of a batch (its std_dev_t factor is 1: one step, one std)."""
    idx = gate > 0
    adv = torch.clamp(adv, -ADV_MAX, ADV_MAX)
    ratio = torch.exp(log_prob - old_log_prob)
    policy_loss = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1.0 - CLIP, 1.0 + CLIP))
    kl_loss = torch.zeros_like(policy_loss)
    if True in idx:
        kl_loss = torch.mean(torch.square(mean[idx] - ref_mean[idx]) / (2 * std[idx] ** 2))
        loss = torch.mean(policy_loss) + beta * torch.mean(kl_loss)
    else:
        loss = torch.mean(policy_loss)
    return loss, torch.mean(kl_loss)


# --- the uncertainty and its gate -------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(3))
def test_the_uncertainty_is_the_main_rank_minus_the_mean_auxiliary_rank(seed):
    rng = np.random.default_rng(seed)
    main, aes, ir = rng.normal(size=(3, 24))
    want = reference_uncertainty(main, aes, ir).numpy()
    got = rank_uncertainty(main, np.stack([aes, ir], axis=1))
    assert np.array_equal(got, want)
    # ranks over the whole epoch, not per group: the values are the ranks' (n + 1) / 2-centred differences
    assert got.sum() == 0 and np.all(np.abs(got) <= 23)


def test_the_gate_and_its_share_follow_the_risk_compensator_over_45_epochs():
    # the non-negative uncertainties' mean rises for 12 epochs (the share grows by 10 % each to its 0.2 cap), then
    # falls below every level of the window for 30 (it shrinks by 10 % each to its 0.02 floor), then wanders inside
    # the window's range (unchanged)
    rng = np.random.default_rng(0)
    level = [10 + e for e in range(12)] + [9 - 0.25 * e for e in range(1, 31)] + [5.0, 6.0, 5.5]
    ours, ref = UncertaintyGate(0.1), ReferenceCompensator()
    shares = []
    for lv in level:
        u = np.concatenate([lv * (0.5 + 0.1 * rng.random(30)), -rng.random(10)])
        want = reference_gate(torch.tensor(u, dtype=torch.float32), ref)
        got = ours(u.astype(np.float32))
        assert np.array_equal(got, want) and ours.share == pytest.approx(float(ref.beta), rel=1e-12)
        shares.append(ours.share)
    assert max(shares) == pytest.approx(0.2) and min(shares) == pytest.approx(0.02)
    # about the top share of the non-negative ones pass (strictly above the percentile)
    assert 1 <= got.sum() <= 30


def test_the_gate_state_round_trips_through_the_checkpoint():
    rng = np.random.default_rng(1)
    a = UncertaintyGate(0.1)
    for _ in range(5):
        a(rng.normal(size=16))
    b = UncertaintyGate(0.1)
    b.load_state_dict(a.state_dict())
    u = rng.normal(size=16) + 3
    assert np.array_equal(a(u), b(u)) and a.share == b.share


# --- the diversity-aware advantages -----------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(3))
def test_diversity_advantages_equal_the_reference_stat_tracker(seed):
    rng = np.random.default_rng(seed)
    prompts = [f"p{i % 3}" for i in range(12)]  # three groups of four, interleaved as a shuffled batch is
    rewards = rng.normal(size=12)
    feats = rng.normal(size=(12, 8))
    T = 3  # the reference repeats each reward over the trained steps: every column is the same
    want = reference_gardo_advantages(prompts, np.repeat(rewards[:, None], T, axis=1), feats)
    got = diversity_advantages(rewards, prompts, feats)
    assert np.allclose(got, want[:, 0], rtol=1e-6, atol=1e-7) and np.allclose(want[:, 1:], want[:, :1])


def test_diversity_scales_above_mean_samples_by_their_distance_and_never_divides_by_the_std():
    # one group: two identical images (distance 0) and two far apart
    rewards = np.array([1.0, 3.0, 2.0, 10.0])
    feats = np.array([[1.0, 0.0], [0.0, 1.0], [0.0, 1.0], [-1.0, 0.0]])
    got = diversity_advantages(rewards, ["a"] * 4, feats)
    mean = rewards.mean()  # 4.0: samples 0-2 are below it, sample 3 above
    nearest = np.array([1.0, 0.0, 0.0, 1.0])  # cosine distances to the nearest other image
    assert np.allclose(got[:3], rewards[:3] - mean)  # below the mean: r - mean, unscaled and not over the std
    assert got[3] == pytest.approx((10.0 - mean) * nearest[3] / nearest.mean())
    # a duplicate above the mean gets nothing: its nearest distance is 0
    got = diversity_advantages(np.array([0.0, 1.0, 1.0, 0.0]), ["a"] * 4,
                               np.array([[1.0, 0.0], [0.0, 1.0], [0.0, 1.0], [-1.0, 0.0]]))
    assert got[1] == 0 and got[2] == 0 and got[0] == -0.5


def test_a_group_of_identical_images_keeps_r_minus_mean_where_the_reference_divides_by_zero():
    # the reference's nearest / mean(nearest) is 0 / 0 here (NaN advantages); ours keeps the scale at 1
    got = diversity_advantages(np.array([1.0, 2.0, 3.0]), ["a"] * 3, np.ones((3, 4)))
    assert np.allclose(got, [-1.0, 0.0, 1.0])


# --- the gated KL in the loss -----------------------------------------------------------------------------------------
def _batch(B, seed):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)
    mean = r(B, 4, 2, 2)
    return {"lp": -r(B).abs(), "old_lp": -r(B).abs(), "mean": mean, "ref": mean + 0.1 * r(B, 4, 2, 2),
            "std": torch.full((B, 1, 1, 1), 0.3, dtype=torch.float64), "adv": 3 * r(B)}


def _ours(b, mean, gate, weights=None, beta=BETA):
    """The loop's KL row weights (gate x loss weight, averaging 1 over the train batch, here the whole batch)."""
    kl = kl_to_reference(mean, b["ref"], b["std"])
    w = torch.ones_like(b["lp"]) if weights is None else weights
    kl_w = batch_mean_weights(gate * w, len(w)) if gate is not None else None
    return grpo_loss(b["lp"], b["old_lp"], b["adv"], CLIP, ADV_MAX, kl, beta, weights, kl_gate=kl_w)


@pytest.mark.parametrize("gate", [[1, 0, 0, 1, 1, 0], [0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1]])
def test_the_gated_kl_loss_and_its_gradient_equal_the_reference(gate):
    b, g = _batch(6, 0), torch.tensor(gate, dtype=torch.float64)
    m1, m2 = b["mean"].clone().requires_grad_(), b["mean"].clone().requires_grad_()
    want, want_kl = reference_loss(b["lp"], b["old_lp"], b["adv"], m1, b["ref"], b["std"], g)
    if any(gate):  # with none gated the reference's loss does not involve the means at all
        want.backward()
    loss, info = _ours(b, m2, g)
    loss.backward()
    assert loss.item() == pytest.approx(want.item(), rel=1e-12)
    assert info["kl"].item() == pytest.approx(want_kl.item(), rel=1e-12, abs=1e-300)  # the KL the reset compares
    if any(gate):
        assert torch.allclose(m2.grad, m1.grad, rtol=1e-12)
    else:
        assert m1.grad is None and (m2.grad is None or not m2.grad.any())  # nothing pulls to the reference


def test_the_gate_changes_only_the_kl_term_and_only_its_gated_samples_feel_it():
    b, g = _batch(6, 1), torch.tensor([1, 0, 0, 1, 0, 0], dtype=torch.float64)
    m_on, m_off = b["mean"].clone().requires_grad_(), b["mean"].clone().requires_grad_()
    on, i_on = _ours(b, m_on, g)
    off, i_off = _ours(b, m_off, None)  # today's GRPO: the KL over every sample
    on.backward()
    off.backward()
    assert i_on["policy_loss"] == i_off["policy_loss"]
    kl = kl_to_reference(b["mean"], b["ref"], b["std"])
    assert (on - off).item() == pytest.approx(BETA * (kl[[0, 3]].mean() - kl.mean()).item(), rel=1e-10)
    assert not m_on.grad[[1, 2, 4, 5]].any() and m_on.grad[[0, 3]].abs().sum() > 0
    assert m_off.grad[[1, 2, 4, 5]].abs().sum() > 0


def test_dropped_samples_leave_the_gated_mean_as_the_reference_filters_them():
    # the zero-advantage filter: the reference trains the kept rows only (samples[mask], :897); here weights N / K
    b = _batch(6, 2)
    keep = torch.tensor([1, 1, 0, 1, 0, 1], dtype=torch.bool)
    g = torch.tensor([1, 0, 1, 1, 0, 0], dtype=torch.float64)
    want, want_kl = reference_loss(*(b[k][keep] for k in ("lp", "old_lp", "adv", "mean", "ref", "std")), g[keep])
    w = keep.double() * 6 / 4
    loss, info = _ours(b, b["mean"], g, w)
    assert loss.item() == pytest.approx(want.item(), rel=1e-12)
    assert info["kl"].item() == pytest.approx(want_kl.item(), rel=1e-12)


def test_grpo_loss_with_the_gate_through_the_algorithm():
    from ddpo_tpu.algorithms.grpo import GRPO

    cfg = SimpleNamespace(algorithm=SimpleNamespace(kl_beta=BETA, reference_reset_kl=None, ratio_norm=False,
                                                    kl_gate_rewards=[{"name": "aesthetic"}], kl_gate_share=0.1,
                                                    diversity_features=None, group_size=2, global_std=True),
                          train=SimpleNamespace(clip_range=CLIP, adv_clip_max=ADV_MAX))
    b, g = _batch(4, 3), torch.tensor([0, 1, 0, 0], dtype=torch.float64)
    score = SimpleNamespace(log_prob=b["lp"], mean=b["mean"], std=b["std"])
    loss, _, _, kl = GRPO(cfg).loss(score, b["old_lp"], b["adv"], b["ref"], None, kl_gate=batch_mean_weights(g, 4))
    want, want_kl = reference_loss(b["lp"], b["old_lp"], b["adv"], b["mean"], b["ref"], b["std"], g)
    assert loss.item() == pytest.approx(want.item(), rel=1e-12) and kl.item() == pytest.approx(want_kl.item())


def _grpo(gate: bool, diversity: bool):
    from ddpo_tpu.algorithms.grpo import GRPO

    a = SimpleNamespace(kl_beta=BETA, reference_reset_kl=None, ratio_norm=False, group_size=4, global_std=True,
                        kl_gate_rewards=[{"name": "aesthetic"}] if gate else [], kl_gate_share=0.1,
                        diversity_features={"name": "clip_features"} if diversity else None)
    return GRPO(SimpleNamespace(algorithm=a, train=SimpleNamespace(clip_range=CLIP, adv_clip_max=ADV_MAX)))


def test_each_option_changes_only_its_part_of_grpo():
    from ddpo_tpu.algorithms.grpo import group_advantages

    rng = np.random.default_rng(4)
    keys, rewards = [f"p{i % 2}" for i in range(8)], rng.normal(size=8)
    scores = {"features": rng.normal(size=(8, 5)), "kl_gate_rewards": rng.normal(size=(8, 2))}
    plain, gated, diverse = _grpo(False, False), _grpo(True, False), _grpo(False, True)
    # advantages: GRPO's unless diversity_features; the gate leaves them alone
    want_plain = group_advantages(rewards, keys, global_std=True)
    assert np.array_equal(plain.advantages(keys, rewards), want_plain)
    assert np.array_equal(gated.advantages(keys, rewards, scores), want_plain)
    want = reference_gardo_advantages(keys, rewards[:, None], scores["features"])[:, 0]
    assert np.allclose(diverse.advantages(keys, rewards, scores), want, rtol=1e-6)
    # the gate: None (every sample) unless kl_gate_rewards; a non-finite reward is neither ranked nor gated
    assert plain.kl_gate(rewards, scores) is None and diverse.kl_gate(rewards, scores) is None
    bad = rewards.copy()
    bad[5] = np.nan
    got = gated.kl_gate(bad, scores)
    ok = np.isfinite(bad)
    u = reference_uncertainty(bad[ok], *scores["kl_gate_rewards"][ok].T)
    assert got[5] == 0 and np.array_equal(got[ok] > 0, reference_gate(u, ReferenceCompensator()))
    assert gated.epoch_metrics["kl_gate_share"] == 0.1
    assert set(gated.state_dict()) == {"gardo_gate_share", "gardo_gate_window"} and plain.state_dict() == {}


def test_the_gated_mean_is_the_same_however_a_train_batch_splits_over_processes():
    # the reference takes the mean per GPU; here the KL's row weights make it one mean over the whole train batch,
    # which two processes' halves (each a plain mean, then averaged as DDP averages) reproduce
    b, g = _batch(8, 5), torch.tensor([1, 0, 0, 1, 1, 0, 0, 0], dtype=torch.float64)
    kl = kl_to_reference(b["mean"], b["ref"], b["std"])
    w = batch_mean_weights(g, 8)
    halves = [kl[i:i + 4] @ w[i:i + 4] / 4 for i in (0, 4)]
    assert (sum(halves) / 2).item() == pytest.approx(kl[g > 0].mean().item(), rel=1e-12)
    # two train batches of 4: each its own mean; a batch with none gated gets no KL
    w2 = batch_mean_weights(torch.tensor([1, 0, 1, 0, 0, 0, 0, 0], dtype=torch.float64), 4)
    assert w2[:4].tolist() == [2, 0, 2, 0] and not w2[4:].any()
