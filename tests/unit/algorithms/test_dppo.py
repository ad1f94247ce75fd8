"""Flow-DPPO (`algorithm=dppo`) against verl-project/verl-omni@a1139bafffb5b9711f0a6b6edff8ecaa60bfff30:
`FlowDPPOLoss.compute_loss` (verl_omni/trainer/diffusion/diffusion_algos.py:361-443) and its check
`test_compute_policy_loss_flow_dppo_applies_asymmetric_kl_mask` with `_reference_flow_dppo_loss`
(tests/trainer/diffusion/test_diffusion_core_algos_on_cpu.py:161-270). The expected values below are that code's
formulas in its order of operations, restated here; then the compose-time refusals and one epoch on the tiny SD3."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ddpo_tpu.algorithms.dppo import dppo_divergence, dppo_loss
from ddpo_tpu.config.compose import ConfigError, compose_and_validate


def reference_compute_loss(old_log_prob, log_prob, advantages, old_prev_sample_mean, prev_sample_mean, std_dev_t,
                           sqrt_dt, kl_mask_threshold, add_kl_coefficient=True):
    """FlowDPPOLoss.compute_loss (diffusion_algos.py:375-443), its steps in its order: unclamped advantages, the KL
    per element divided before the mean, `>=` the threshold, the two removal masks, a plain mean of the kept terms."""
    advantages = advantages.detach()
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    unclipped_loss = -advantages * ratio
    mean_diff_sq = (prev_sample_mean - old_prev_sample_mean).pow(2)
    if add_kl_coefficient:
        sq = sqrt_dt.reshape(1, *([1] * (std_dev_t.ndim - 1))) if sqrt_dt.ndim == 0 else \
            sqrt_dt.reshape(sqrt_dt.shape[0], *([1] * (std_dev_t.ndim - 1)))
        kl_per_elem = mean_diff_sq / (2 * (std_dev_t * sq).pow(2))
    else:
        kl_per_elem = mean_diff_sq / 2
    kl_per_sample = kl_per_elem.mean(dim=tuple(range(1, kl_per_elem.ndim)))
    high = kl_per_sample >= kl_mask_threshold
    pos = high & (ratio > 1.0) & (advantages > 0)
    neg = high & (ratio < 1.0) & (advantages < 0)
    rm = pos | neg
    loss = torch.where(~rm, unclipped_loss, torch.zeros((), dtype=unclipped_loss.dtype)).mean()
    return loss, {"kl_per_sample": kl_per_sample, "high": high, "pos": pos, "neg": neg, "rm": rm,
                  "approx_kl": (0.5 * log_ratio.pow(2)).mean()}


def the_references_case():
    """The inputs of the reference's own check (test_diffusion_core_algos_on_cpu.py:197-207)."""
    return dict(old_log_prob=torch.zeros(4), log_prob=torch.log(torch.tensor([1.2, 0.8, 1.2, 0.8])),
                advantages=torch.tensor([10.0, -10.0, -8.0, 8.0]), old_prev_sample_mean=torch.zeros(4, 2, 2, 2),
                prev_sample_mean=torch.full((4, 2, 2, 2), 0.2), std_dev_t=torch.full((4, 1, 1, 1), 0.5),
                sqrt_dt=torch.full((4,), 0.5))


def ours(b, threshold, add_kl_coefficient=True, weights=None):
    return dppo_loss(b["log_prob"], b["old_log_prob"], b["prev_sample_mean"], b["old_prev_sample_mean"],
                     b["std_dev_t"], b["sqrt_dt"], b["advantages"], threshold, add_kl_coefficient, weights)


@pytest.mark.parametrize("add_kl_coefficient", [True, False])
def test_the_references_own_case(add_kl_coefficient):
    """Rows 0 and 1 move further along their advantage outside the region (masked), rows 2 and 3 move back (kept);
    the advantages are not clamped (the reference asserts the loss differs from the clamped one)."""
    b = the_references_case()
    loss, info = ours(b, 1e-5, add_kl_coefficient)
    want, masks = reference_compute_loss(**b, kl_mask_threshold=1e-5, add_kl_coefficient=add_kl_coefficient)
    torch.testing.assert_close(loss, want)
    assert masks["pos"].tolist() == [True, False, False, False] and masks["neg"].tolist() == [False, True, False, False]
    assert info["clipfrac"].item() == pytest.approx(0.5)  # the reference's masked_fraction
    assert info["kl_mask_fraction"].item() == 1.0
    # D: 0.2^2 / (2 (0.5 x 0.5)^2) = 0.32 with the coefficient, 0.2^2 / 2 = 0.02 without
    assert info["kl_new_old"].item() == pytest.approx(0.32 if add_kl_coefficient else 0.02, rel=1e-6)
    # kept: rows 2 and 3, -(-8)(1.2) and -(8)(0.8), over the 4 rows
    assert loss.item() == pytest.approx((8 * 1.2 - 8 * 0.8) / 4, rel=1e-6)
    clamped, _ = reference_compute_loss(**{**b, "advantages": b["advantages"].clamp(-5, 5)}, kl_mask_threshold=1e-5,
                                        add_kl_coefficient=add_kl_coefficient)
    assert not torch.isclose(loss, clamped)


def random_batch(B, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=dtype)
    old_mean = r(B, 4, 3, 3)
    # per-row drifts spread over three decades, so a threshold in the middle splits the rows
    drift = torch.logspace(-4, -1, B, dtype=dtype)[torch.randperm(B, generator=g)]
    return dict(old_log_prob=-r(B).abs(), log_prob=-r(B).abs(), advantages=2 * r(B), old_prev_sample_mean=old_mean,
                prev_sample_mean=old_mean + drift.view(B, 1, 1, 1) * r(B, 4, 3, 3),
                std_dev_t=(0.2 + r(B).abs()).view(B, 1, 1, 1), sqrt_dt=(0.05 + 0.3 * torch.rand(B, generator=g,
                                                                                              dtype=dtype)).sqrt())


@pytest.mark.parametrize("add_kl_coefficient", [True, False])
def test_loss_gradient_and_metrics_equal_the_reference_on_a_random_batch(add_kl_coefficient):
    b = random_batch(32, 1)
    d = reference_compute_loss(**b, kl_mask_threshold=0.0, add_kl_coefficient=add_kl_coefficient)[1]["kl_per_sample"]
    threshold = d.median().item()
    lp_ref = b["log_prob"].clone().requires_grad_()
    want, masks = reference_compute_loss(**{**b, "log_prob": lp_ref}, kl_mask_threshold=threshold,
                                         add_kl_coefficient=add_kl_coefficient)
    want.backward()
    assert masks["pos"].any() and masks["neg"].any() and (~masks["rm"] & masks["high"]).any() and (~masks["high"]).any()
    lp = b["log_prob"].clone().requires_grad_()
    loss, info = ours({**b, "log_prob": lp}, threshold, add_kl_coefficient)
    loss.backward()
    assert loss.item() == pytest.approx(want.item(), rel=1e-12)
    torch.testing.assert_close(lp.grad, lp_ref.grad, rtol=1e-12, atol=0)
    torch.testing.assert_close(info["kl_new_old"], masks["kl_per_sample"].mean(), rtol=1e-12, atol=0)
    assert info["clipfrac"].item() == masks["rm"].double().mean().item()
    assert info["kl_mask_fraction"].item() == masks["high"].double().mean().item()
    torch.testing.assert_close(info["approx_kl"], masks["approx_kl"], rtol=1e-12, atol=0)


def test_the_gradient_is_zero_exactly_where_masked_and_none_flows_through_the_divergence():
    b = random_batch(32, 2)
    lp, mean = b["log_prob"].clone().requires_grad_(), b["prev_sample_mean"].clone().requires_grad_()
    threshold = dppo_divergence(mean, b["old_prev_sample_mean"], b["std_dev_t"], b["sqrt_dt"]).median().item()
    loss, _ = ours({**b, "log_prob": lp, "prev_sample_mean": mean}, threshold)
    loss.backward()
    masks = reference_compute_loss(**b, kl_mask_threshold=threshold)[1]
    rm = masks["rm"]
    assert rm.any() and (~rm).any()
    assert torch.all(lp.grad[rm] == 0)
    # d/dlogp of -A exp(logp - logp_old) / B on the kept rows
    ratio = torch.exp(b["log_prob"] - b["old_log_prob"])
    torch.testing.assert_close(lp.grad[~rm], (-b["advantages"] * ratio / 32)[~rm], rtol=1e-12, atol=0)
    assert torch.all(lp.grad[~rm] != 0)
    assert mean.grad is None  # the mask is a constant of the step: no gradient through D


def test_a_divergence_equal_to_the_threshold_is_outside_the_region():
    """`kl_per_sample >= kl_mask_threshold` (diffusion_algos.py:414): at equality the row is masked."""
    b = the_references_case()
    b["prev_sample_mean"] = torch.full((4, 2, 2, 2), 0.125)  # D = 0.125^2 / 2 = 2^-7, exact
    _, at = ours(b, 2.0 ** -7, add_kl_coefficient=False)
    _, above = ours(b, 2.0 ** -7 * (1 + 2 ** -20), add_kl_coefficient=False)
    assert at["clipfrac"].item() == 0.5 and above["clipfrac"].item() == 0


def test_inside_the_region_it_is_the_unclipped_policy_gradient():
    """With every D below the threshold no row is masked: the loss is mean(-A r), no ratio clip, no advantage clamp."""
    b = random_batch(16, 3)
    loss, info = ours(b, 1e9)
    ratio = torch.exp(b["log_prob"] - b["old_log_prob"])
    assert loss.item() == pytest.approx((-b["advantages"] * ratio).mean().item(), rel=1e-12)
    assert info["clipfrac"].item() == 0 and info["kl_mask_fraction"].item() == 0


def test_zero_weight_rows_drop_out_as_the_reference_filters_them():
    """The zero-advantage filter's weights (N / K on the K kept rows): the reference on the kept rows alone."""
    b = random_batch(16, 4)
    keep = torch.arange(16) % 4 != 0
    threshold = 1e-5
    want, masks = reference_compute_loss(**{k: v[keep] for k, v in b.items()}, kl_mask_threshold=threshold)
    w = keep.double() * 16 / keep.sum()
    loss, info = ours(b, threshold, weights=w)
    assert loss.item() == pytest.approx(want.item(), rel=1e-12)
    assert info["clipfrac"].item() == pytest.approx(masks["rm"].double().mean().item(), rel=1e-12)
    assert info["kl_new_old"].item() == pytest.approx(masks["kl_per_sample"].mean().item(), rel=1e-12)


def test_the_step_std_may_come_per_row_or_as_one_value():
    b = random_batch(8, 5)
    full = dppo_divergence(b["prev_sample_mean"], b["old_prev_sample_mean"], b["std_dev_t"], b["sqrt_dt"])
    flat = dppo_divergence(b["prev_sample_mean"], b["old_prev_sample_mean"], b["std_dev_t"].reshape(8), b["sqrt_dt"])
    torch.testing.assert_close(full, flat, rtol=0, atol=0)
    one = dppo_divergence(b["prev_sample_mean"], b["old_prev_sample_mean"], torch.tensor(0.7, dtype=torch.float64),
                          torch.tensor(0.3, dtype=torch.float64))
    sq = (b["prev_sample_mean"] - b["old_prev_sample_mean"]).pow(2)
    torch.testing.assert_close(one, (sq / (2 * 0.21 ** 2)).mean(dim=(1, 2, 3)), rtol=1e-12, atol=0)


SMOKE = ["+experiment=smoke", "algorithm=dppo", "algorithm.group_size=2", "algorithm.kl_beta=0"]


@pytest.mark.parametrize("overrides, key", [
    (SMOKE, "algorithm.name"),  # the DDIM sampler: no flow_sde step means
    (["+experiment=dppo_smoke", "algorithm.ratio_norm=true"], "algorithm.ratio_norm"),
    (["+experiment=dppo_smoke", "sample.sde_type=cps"], "sample.sde_type"),
    (["+experiment=dppo_smoke", "algorithm.kl_mask_threshold=0"], "algorithm.kl_mask_threshold"),
    # keys nothing reads under dppo: the ratio clip and the advantage clamp (FlowDPPOLoss has neither), and GARDO's
    # gate share without a gate (as for grpo)
    (["+experiment=dppo_smoke", "train.clip_range=0.1"], "train.clip_range"),
    (["+experiment=dppo_smoke", "train.adv_clip_max=3"], "train.adv_clip_max"),
    (["+experiment=dppo_smoke", "algorithm.kl_gate_share=0.2"], "algorithm.kl_gate_share"),
    (["+experiment=flow_grpo_smoke", "algorithm.kl_gate_share=0.2"], "algorithm.kl_gate_share"),
])
def test_compose_time_refusals(overrides, key):
    with pytest.raises(ConfigError) as e:
        compose_and_validate(overrides)
    assert key in str(e.value), str(e.value)


def test_what_composes():
    import yaml

    from ddpo_tpu.catalog.algorithms import DppoKeys
    from ddpo_tpu.config.compose import conf_dir

    # conf/algorithm/dppo.yaml's and the keys' defaults are verl-omni's (diffusion_actor.yaml:51-54, actor.py:47)
    conf = yaml.safe_load((conf_dir() / "algorithm" / "dppo.yaml").read_text())
    assert (conf["name"], conf["kl_mask_threshold"], conf["add_kl_coefficient"]) == ("dppo", 1e-5, True)
    keys = DppoKeys.model_fields
    assert (keys["kl_mask_threshold"].default, keys["add_kl_coefficient"].default) == (1e-5, True)
    assert compose_and_validate(["+experiment=dppo_smoke"]).cfg.algorithm.name == "dppo"
    # a CPS step without the coefficient: D is then the plain mean drift, no noise scale to misread (with the KL
    # and no SDE window: the CPS-window rule once failed there on the window's unset size, for grpo too)
    compose_and_validate(["+experiment=dppo_smoke", "sample.sde_type=cps", "algorithm.add_kl_coefficient=false"])
    compose_and_validate(["+experiment=flow_grpo_smoke", "sample.sde_type=cps"])
    # GRPO's keys keep their meaning: grpo still composes with its defaults, and does not take dppo's keys
    assert compose_and_validate(["+experiment=flow_grpo_smoke"]).cfg.algorithm.name == "grpo"
    with pytest.raises(ConfigError):
        compose_and_validate(["+experiment=flow_grpo_smoke", "algorithm.kl_mask_threshold=1e-4"])


@pytest.mark.slow  # 18-45 s on the 2-core machine (load 3-8), the tiny SD3's build included
def test_an_epoch_of_dppo_on_tiny_sd3_trains_against_the_sampling_weights(tmp_path, model_cache):
    """Two updates of one epoch: the first compares the policy with itself (D 0: nothing masked), the second with
    the weights that sampled (kept in a copy); with a threshold of 1e-12 every row of it is outside the region."""
    from ddpo_tpu.training import loop
    from ddpo_tpu.rundir.files import RunDir
    from ddpo_tpu.runtime import make_runtime

    torch.set_num_threads(1)
    v = compose_and_validate(["+experiment=dppo_smoke", f"model.cache_dir={model_cache}", "algorithm.kl_beta=0.01",
                              "algorithm.kl_mask_threshold=1e-12", "sample.batch_size=8",
                              "sample.num_batches_per_epoch=1", "sample.num_steps=4", "train.batch_size=4",
                              "train.gradient_accumulation_steps=1",
                              "algorithm.drop_zero_advantage=false"])
    tr = loop.Trainer(v.cfg, make_runtime(v.cfg), RunDir(tmp_path), tree=v.tree, stop=SimpleNamespace(requested=False))
    tr.report.step = lambda rec: None  # the reporter's tracker starts in fit()
    assert tr.algorithm.needs_old_mean and "sampling_policy" in tr.state.copies
    sampled = tr.sample_epoch(0)
    before = [p.detach().clone() for p in tr.state.params]
    logs = tr.train_epoch(0, tr.epoch_samples(0, sampled, tr.gather_rewards(0, sampled)))
    assert len(logs) == 2
    assert all(torch.isfinite(torch.tensor([r[k] for k in tr.algorithm.stat_names])).all() for r in logs), logs
    first, second = logs
    assert first["kl_new_old"] < 1e-12 and first["clipfrac"] == 0 and first["kl_mask_fraction"] == 0
    assert second["kl_new_old"] > 1e-12 and second["kl_mask_fraction"] == 1 and 0 < second["clipfrac"] <= 1
    assert second["kl"] > 0  # GRPO's KL to the adapter-off reference rides along
    copy = tr.state.copies["sampling_policy"].shadow
    assert all(torch.equal(c, p) for c, p in zip(copy, before))
    assert any(not torch.equal(c, p) for c, p in zip(copy, tr.state.params))
