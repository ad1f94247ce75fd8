"""Tests for the DDIM step with log-probability (ddpo_tpu.diffusion.ddim)."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from diffusers import DDIMScheduler

from ddpo_tpu.diffusion import DDIMTables, ddim_step_with_logprob

NUM_STEPS = 50
PRED_TYPES = ("epsilon", "v_prediction", "sample")
SHAPE = (5, 4, 6, 6)


def make_scheduler(prediction_type="epsilon", num_steps=NUM_STEPS, **overrides):
    """SD 1.x's DDIM settings (the scheduler the local models ship, models/tiny.py) with `overrides`."""
    from ddpo_tpu.models.tiny import _build_scheduler

    sched = DDIMScheduler.from_config(_build_scheduler().config, prediction_type=prediction_type, **overrides)
    sched.set_timesteps(num_steps)
    return sched


def float64_scheduler(sched):
    """Same scheduler with float64 alphas so diffusers' own step runs fully in float64."""
    sched.alphas_cumprod = sched.alphas_cumprod.double()
    sched.final_alpha_cumprod = torch.as_tensor(sched.final_alpha_cumprod).double()
    return sched


def reference_step(sched, prediction_type, model_output, timesteps, sample, eta, prev_sample=None,
                   noise=None, clip_range=None):
    """Straightforward float64 numpy evaluation of the DDPO DDIM step, one sample at a time.

    Returns (prev_sample, mean, sigma (per sample), log_prob (per sample)).
    """
    T = sched.config.num_train_timesteps
    gap = T // sched.num_inference_steps
    ac = sched.alphas_cumprod.double().numpy()
    mo = model_output.double().numpy()
    xt = sample.double().numpy()
    B = xt.shape[0]
    out_prev = np.empty_like(xt)
    out_mean = np.empty_like(xt)
    sigmas = np.empty(B)
    logps = np.empty(B)
    for i in range(B):
        t = int(timesteps[i])
        tp = min(max(t - gap, 0), T - 1)
        a_t, a_p = float(ac[t]), float(ac[tp])
        if prediction_type == "epsilon":
            x0 = (xt[i] - math.sqrt(1 - a_t) * mo[i]) / math.sqrt(a_t)
            eps = mo[i]
        elif prediction_type == "sample":
            x0 = mo[i]
            eps = (xt[i] - math.sqrt(a_t) * x0) / math.sqrt(1 - a_t)
        else:  # v_prediction
            x0 = math.sqrt(a_t) * xt[i] - math.sqrt(1 - a_t) * mo[i]
            eps = math.sqrt(a_t) * mo[i] + math.sqrt(1 - a_t) * xt[i]
        if clip_range is not None:
            x0 = np.clip(x0, -clip_range, clip_range)
        sigma = eta * math.sqrt((1 - a_p) / (1 - a_t)) * math.sqrt(1 - a_t / a_p)
        mean = math.sqrt(a_p) * x0 + math.sqrt(1 - a_p - sigma**2) * eps
        if prev_sample is not None:
            xp = prev_sample[i].double().numpy()
        else:
            xp = mean + sigma * noise[i].double().numpy()
        lp = -((xp - mean) ** 2) / (2 * sigma**2) - math.log(sigma) - math.log(math.sqrt(2 * math.pi))
        out_prev[i], out_mean[i], sigmas[i], logps[i] = xp, mean, sigma, lp.mean()
    return out_prev, out_mean, sigmas, logps


def random_inputs(seed, dtype=torch.float64, shape=SHAPE):
    g = torch.Generator().manual_seed(seed)
    model_output = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    sample = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    prev_sample = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    return model_output, sample, prev_sample


def mixed_timesteps(sched):
    # first (noisiest), middle ones, second-to-last and the last step (prev clamps to 0)
    ts = sched.timesteps
    idx = torch.tensor([0, 7, 25, 48, 49])
    return idx, ts[idx]


def maxabs(a, b):
    a = a.detach().double().numpy() if isinstance(a, torch.Tensor) else a
    b = b.detach().double().numpy() if isinstance(b, torch.Tensor) else b
    return float(np.max(np.abs(a - b)))


# --------------------------------------------------------------------------------------
# 1. agreement with an independent float64 evaluation
# --------------------------------------------------------------------------------------


def policy_like_prev_sample(sched, prediction_type, mo, ts, x, eta, seed):
    """x_prev = mean + sigma * w computed by the float64 reference: what DDPO actually scores."""
    w = torch.randn(mo.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    prev, _, _, _ = reference_step(sched, prediction_type, mo, ts, x, eta, noise=w)
    return torch.from_numpy(prev)


@pytest.mark.parametrize("prediction_type", PRED_TYPES)
@pytest.mark.parametrize("eta", [0.5, 1.0])
@pytest.mark.parametrize("where", ["policy", "far"])
def test_matches_float64_formula_prev_sample_given(prediction_type, eta, where):
    sched = make_scheduler(prediction_type)
    mo, x, xp = random_inputs(0)
    _, ts = mixed_timesteps(sched)
    if where == "policy":
        xp = policy_like_prev_sample(sched, prediction_type, mo, ts, x, eta, seed=99)
    got_prev, got_lp = ddim_step_with_logprob(sched, mo, ts, x, eta, prev_sample=xp)
    exp_prev, _, _, exp_lp = reference_step(sched, prediction_type, mo, ts, x, eta, prev_sample=xp)
    assert got_lp.shape == (SHAPE[0],)
    assert got_lp.dtype == torch.float64 and got_prev.dtype == torch.float64
    assert maxabs(got_prev, exp_prev) == 0.0  # returned unchanged
    if where == "policy":  # log-probs O(1)
        assert np.all(np.abs(exp_lp) < 20)
        assert maxabs(got_lp, exp_lp) < 1e-10
    else:  # a random x_prev far from the mean: log-probs up to ~1e4 at the last steps (tiny sigma)
        assert np.max(np.abs(got_lp.numpy() - exp_lp) / np.maximum(1.0, np.abs(exp_lp))) < 1e-12


@pytest.mark.parametrize("prediction_type", PRED_TYPES)
@pytest.mark.parametrize("eta", [0.5, 1.0])
def test_matches_float64_formula_noise_drawn(prediction_type, eta):
    sched = make_scheduler(prediction_type)
    mo, x, _ = random_inputs(1)
    _, ts = mixed_timesteps(sched)
    got_prev, got_lp = ddim_step_with_logprob(
        sched, mo, ts, x, eta, generator=torch.Generator().manual_seed(123)
    )
    z = torch.randn(SHAPE, generator=torch.Generator().manual_seed(123), dtype=torch.float64)
    exp_prev, exp_mean, exp_sigma, exp_lp = reference_step(sched, prediction_type, mo, ts, x, eta, noise=z)
    assert maxabs(got_prev, exp_prev) < 1e-10
    assert maxabs(got_lp, exp_lp) < 1e-10
    # sanity: the drawn sample is not the mean, and log_prob equals -z^2/2 - log(sigma) - log sqrt(2pi)
    assert maxabs(got_prev, exp_mean) > 1e-3
    closed_form = ((-(z.numpy() ** 2) / 2).reshape(SHAPE[0], -1).mean(1) - np.log(exp_sigma)
                   - 0.5 * math.log(2 * math.pi))
    assert maxabs(got_lp, closed_form) < 1e-10


@pytest.mark.parametrize("prediction_type", PRED_TYPES)
def test_float32_close_to_float64_formula(prediction_type):
    sched = make_scheduler(prediction_type)
    mo, x, _ = random_inputs(2)
    _, ts = mixed_timesteps(sched)
    xp = policy_like_prev_sample(sched, prediction_type, mo, ts, x, 1.0, seed=7)
    got_prev, got_lp = ddim_step_with_logprob(sched, mo.float(), ts, x.float(), 1.0, prev_sample=xp.float())
    assert got_lp.dtype == torch.float32 and got_prev.dtype == torch.float32
    _, _, _, exp_lp = reference_step(sched, prediction_type, mo.float(), ts, x.float(), 1.0, prev_sample=xp.float())
    # float32 error is dominated by sigma at the last steps (1 - a_t/a_prev cancels), ~1e-5 in log_prob
    assert maxabs(got_lp, exp_lp) < 1e-4


def test_clip_sample_is_honoured():
    sched = make_scheduler("sample", clip_sample=True, clip_sample_range=0.5)
    mo, x, xp = random_inputs(3)
    mo = 3 * mo  # make sure clipping is active
    _, ts = mixed_timesteps(sched)
    got_prev, got_lp = ddim_step_with_logprob(sched, mo, ts, x, 1.0, prev_sample=xp)
    _, _, _, exp_lp = reference_step(sched, "sample", mo, ts, x, 1.0, prev_sample=xp, clip_range=0.5)
    _, _, _, unclipped = reference_step(sched, "sample", mo, ts, x, 1.0, prev_sample=xp)
    assert maxabs(got_lp, exp_lp) < 1e-10
    assert maxabs(got_lp, unclipped) > 1e-3


def test_scalar_timestep_broadcasts():
    sched = make_scheduler()
    mo, x, xp = random_inputs(4)
    t = sched.timesteps[10]
    per_sample = t.repeat(SHAPE[0])
    _, lp_vec = ddim_step_with_logprob(sched, mo, per_sample, x, 1.0, prev_sample=xp)
    _, lp_0d = ddim_step_with_logprob(sched, mo, t, x, 1.0, prev_sample=xp)
    _, lp_int = ddim_step_with_logprob(sched, mo, int(t), x, 1.0, prev_sample=xp)
    assert lp_0d.shape == lp_int.shape == (SHAPE[0],)
    assert torch.equal(lp_vec, lp_0d) and torch.equal(lp_vec, lp_int)


def test_argument_errors():
    sched = make_scheduler()
    mo, x, xp = random_inputs(5)
    ts = sched.timesteps[:SHAPE[0]]
    with pytest.raises(ValueError):
        ddim_step_with_logprob(sched, mo, ts, x, 1.0, prev_sample=xp, generator=torch.Generator())
    with pytest.raises(ValueError):
        ddim_step_with_logprob(sched, mo, ts[:2], x, 1.0, prev_sample=xp)
    with pytest.raises(ValueError):
        ddim_step_with_logprob(make_scheduler("bogus"), mo, ts, x, 1.0, prev_sample=xp)
    fresh = DDIMScheduler(num_train_timesteps=1000)
    with pytest.raises(ValueError):
        ddim_step_with_logprob(fresh, mo, ts, x, 1.0, prev_sample=xp)
    tables = DDIMTables.from_scheduler(make_scheduler(), NUM_STEPS, "cpu", torch.float64)
    with pytest.raises(ValueError):
        tables.step(mo, torch.zeros(SHAPE[0], dtype=torch.long), x, 1.0)


# --------------------------------------------------------------------------------------
# 2. agreement with diffusers' DDIMScheduler.step
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("prediction_type", PRED_TYPES)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float64, 1e-12)])
@pytest.mark.parametrize("eta", [0.5, 1.0])
def test_prev_sample_matches_diffusers_step(prediction_type, dtype, tol, eta):
    sched = make_scheduler(prediction_type)
    if dtype == torch.float64:
        float64_scheduler(sched)
    tables = DDIMTables.from_scheduler(sched, NUM_STEPS, "cpu", dtype)
    mo, x, _ = random_inputs(6, dtype=dtype)
    worst = 0.0
    for step_index in [0, 1, 10, 25, 40, 48, 49]:  # 49 = last step (t=1): see test below
        t = sched.timesteps[step_index]
        seed = 1000 + step_index
        z = torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed), dtype=dtype)
        expected = sched.step(mo, t, x, eta=eta, variance_noise=z).prev_sample
        ours, _ = ddim_step_with_logprob(sched, mo, t, x, eta, generator=torch.Generator().manual_seed(seed))
        ours_tab, _ = tables.step(mo, torch.tensor(step_index), x, eta, noise=z)
        assert ours.dtype == dtype and ours_tab.dtype == dtype
        worst = max(worst, maxabs(ours, expected), maxabs(ours_tab, expected))
    assert worst < tol, worst


def test_last_step_clamps_like_reference_not_like_diffusers():
    """At the last step t_prev < 0. diffusers uses final_alpha_cumprod; the reference (and we)
    clamp t_prev to 0 and use alphas_cumprod[0]. With set_alpha_to_one=False those coincide
    (covered above); with set_alpha_to_one=True they differ and we must follow the clamp."""
    sched = float64_scheduler(make_scheduler("epsilon", set_alpha_to_one=True))
    mo, x, xp = random_inputs(7)
    t_last = sched.timesteps[-1]
    assert int(t_last) == 1
    z = torch.randn(SHAPE, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    ours, lp = ddim_step_with_logprob(sched, mo, t_last, x, 1.0, generator=torch.Generator().manual_seed(9))
    ts = t_last.repeat(SHAPE[0])
    exp_prev, _, exp_sigma, exp_lp = reference_step(sched, "epsilon", mo, ts, x, 1.0, noise=z)
    assert maxabs(ours, exp_prev) < 1e-10 and maxabs(lp, exp_lp) < 1e-10
    # sigma uses alpha_prev = alphas_cumprod[0] < 1, so it is strictly positive (finite log-prob)
    assert np.all(exp_sigma > 0) and torch.isfinite(lp).all()
    diffusers_prev = sched.step(mo, t_last, x, eta=1.0, variance_noise=z).prev_sample
    assert maxabs(ours, diffusers_prev) > 1e-4
    # also the given-prev_sample path at the last step
    _, lp_given = ddim_step_with_logprob(sched, mo, t_last, x, 1.0, prev_sample=xp)
    _, _, _, exp_lp_given = reference_step(sched, "epsilon", mo, ts, x, 1.0, prev_sample=xp)
    assert maxabs(lp_given, exp_lp_given) < 1e-10


def test_thresholding_matches_diffusers():
    sched = float64_scheduler(
        make_scheduler("sample", thresholding=True, dynamic_thresholding_ratio=0.9, sample_max_value=2.0)
    )
    mo, x, _ = random_inputs(8)
    mo = 3 * mo
    for step_index in [0, 20, 45]:
        t = sched.timesteps[step_index]
        z = torch.randn(SHAPE, generator=torch.Generator().manual_seed(step_index), dtype=torch.float64)
        expected = sched.step(mo, t, x, eta=1.0, variance_noise=z).prev_sample
        ours, _ = ddim_step_with_logprob(
            sched, mo, t, x, 1.0, generator=torch.Generator().manual_seed(step_index)
        )
        assert maxabs(ours, expected) < 1e-12


def test_timestep_zero_in_schedule_warns():
    # steps_offset=0 puts t=0 in the schedule; the clamp then gives alpha_prev == alpha_t, sigma = 0
    sched = make_scheduler("epsilon", steps_offset=0)
    with pytest.warns(UserWarning, match="sigma_t is 0"):
        DDIMTables.from_scheduler(sched, NUM_STEPS, "cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        DDIMTables.from_scheduler(make_scheduler(), NUM_STEPS, "cpu")


# --------------------------------------------------------------------------------------
# 3. DDIMTables == ddim_step_with_logprob
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("prediction_type", PRED_TYPES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_tables_match_functional(prediction_type, dtype):
    sched = make_scheduler(prediction_type)
    tables = DDIMTables.from_scheduler(sched, NUM_STEPS, "cpu", dtype)
    assert tables.num_steps == NUM_STEPS
    assert tables.timesteps.dtype == torch.long
    assert torch.equal(tables.timesteps, sched.timesteps)
    mo, x, xp = random_inputs(10, dtype=dtype)
    idx, ts = mixed_timesteps(sched)
    assert torch.equal(tables.timestep_at(idx), ts)
    assert tables.timestep_at(torch.tensor(3)).shape == ()
    for eta in (0.5, 1.0):
        # prev_sample given
        p_f, lp_f = ddim_step_with_logprob(sched, mo, ts, x, eta, prev_sample=xp)
        p_t, lp_t = tables.step(mo, idx, x, eta, prev_sample=xp)
        assert torch.equal(p_f, p_t)
        assert torch.equal(lp_f, lp_t)
        # noise drawn
        p_f, lp_f = ddim_step_with_logprob(sched, mo, ts, x, eta, generator=torch.Generator().manual_seed(5))
        z = torch.randn(SHAPE, generator=torch.Generator().manual_seed(5), dtype=dtype)
        p_t, lp_t = tables.step(mo, idx, x, eta, noise=z)
        assert torch.equal(p_f, p_t)
        assert torch.equal(lp_f, lp_t)
    # 0-d step index broadcasts
    _, lp0 = tables.step(mo, torch.tensor(12), x, 1.0, prev_sample=xp)
    _, lpv = tables.step(mo, torch.full((SHAPE[0],), 12), x, 1.0, prev_sample=xp)
    assert lp0.shape == (SHAPE[0],) and torch.equal(lp0, lpv)


def test_tables_reduced_precision_inputs():
    sched = make_scheduler()
    tables = DDIMTables.from_scheduler(sched, NUM_STEPS, "cpu", torch.float32)
    mo, x, xp = random_inputs(11)
    idx, ts = mixed_timesteps(sched)
    z = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    p, lp = tables.step(mo.bfloat16(), idx, x.bfloat16(), 1.0, noise=z.bfloat16())
    assert p.dtype == torch.bfloat16 and lp.dtype == torch.float32
    # log_prob is evaluated at the returned (rounded) sample, so re-scoring it gives the same value
    _, lp_again = tables.step(mo.bfloat16(), idx, x.bfloat16(), 1.0, prev_sample=p)
    assert torch.equal(lp, lp_again)
    _, _, _, exp_lp = reference_step(sched, "epsilon", mo.bfloat16(), ts, x.bfloat16(), 1.0, prev_sample=p)
    assert maxabs(lp, exp_lp) < 1e-3


# --------------------------------------------------------------------------------------
# 4. log_prob shape of the density: maximal at the mean; a mean, not a sum
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("prediction_type", PRED_TYPES)
def test_log_prob_maximal_at_mean(prediction_type):
    sched = make_scheduler(prediction_type)
    tables = DDIMTables.from_scheduler(sched, NUM_STEPS, "cpu", torch.float64)
    mo, x, _ = random_inputs(12)
    idx, ts = mixed_timesteps(sched)
    mean, lp_mean = tables.step(mo, idx, x, 1.0, noise=torch.zeros(SHAPE, dtype=torch.float64))
    _, _, sigma, _ = reference_step(sched, prediction_type, mo, ts, x, 1.0, prev_sample=mean)
    assert maxabs(lp_mean, -np.log(sigma) - 0.5 * math.log(2 * math.pi)) < 1e-10
    g = torch.Generator().manual_seed(0)
    for scale in (1e-3, 0.1, 1.0):
        perturbed = mean + scale * torch.randn(SHAPE, generator=g, dtype=torch.float64)
        _, lp_pert = tables.step(mo, idx, x, 1.0, prev_sample=perturbed)
        assert torch.all(lp_pert < lp_mean)


def test_log_prob_is_a_mean_not_a_sum():
    sched = make_scheduler()
    tables = DDIMTables.from_scheduler(sched, NUM_STEPS, "cpu", torch.float64)
    idx = torch.tensor([0, 10, 49])
    results = []
    for shape in [(3, 1, 2, 2), (3, 4, 8, 8), (3, 4, 32, 32)]:
        mo, x, _ = random_inputs(13, shape=shape)
        mean, _ = tables.step(mo, idx, x, 1.0, noise=torch.zeros(shape, dtype=torch.float64))
        # the same standardized residual (+-0.7 sigma everywhere) at every size
        signs = torch.where(torch.arange(mean[0].numel()) % 2 == 0, 1.0, -1.0).reshape(shape[1:]).double()
        prev, lp = tables.step(mo, idx, x, 1.0, noise=0.7 * signs.expand(shape).contiguous())
        results.append(lp)
    for lp in results[1:]:
        assert maxabs(lp, results[0]) < 1e-10
    assert torch.all(results[0].abs() < 10)


# --------------------------------------------------------------------------------------
# 5. gradients
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("use_tables", [False, True])
def test_gradient_through_mean_not_prev_sample(use_tables):
    sched = make_scheduler("epsilon")
    mo, x, xp = random_inputs(14)
    idx, ts = mixed_timesteps(sched)
    mo = mo.clone().requires_grad_(True)
    xp = xp.clone().requires_grad_(True)
    if use_tables:
        tables = DDIMTables.from_scheduler(sched, NUM_STEPS, "cpu", torch.float64)
        prev, lp = tables.step(mo, idx, x, 1.0, prev_sample=xp)
    else:
        prev, lp = ddim_step_with_logprob(sched, mo, ts, x, 1.0, prev_sample=xp)
    lp.sum().backward()
    assert xp.grad is None
    assert mo.grad is not None and mo.grad.abs().max() > 0
    # analytic: d lp_i / d eps = (x_prev - mean)/sigma^2 / N * d mean/d eps,
    # d mean/d eps = -sqrt(a_prev) sqrt(1-a_t)/sqrt(a_t) + sqrt(1 - a_prev - sigma^2)
    _, mean, sigma, _ = reference_step(sched, "epsilon", mo.detach(), ts, x, 1.0, prev_sample=xp.detach())
    ac = sched.alphas_cumprod.double().numpy()
    n = np.prod(SHAPE[1:])
    for i in range(SHAPE[0]):
        t = int(ts[i])
        a_t, a_p = ac[t], ac[max(t - 20, 0)]
        dmean = -math.sqrt(a_p) * math.sqrt(1 - a_t) / math.sqrt(a_t) + math.sqrt(1 - a_p - sigma[i] ** 2)
        expected = (xp[i].detach().numpy() - mean[i]) / sigma[i] ** 2 / n * dmean
        assert np.max(np.abs(mo.grad[i].numpy() - expected)) < 1e-12


def test_gradient_with_drawn_sample():
    sched = make_scheduler("v_prediction")
    tables = DDIMTables.from_scheduler(sched, NUM_STEPS, "cpu", torch.float64)
    mo, x, _ = random_inputs(15)
    mo.requires_grad_(True)
    idx = torch.tensor([0, 5, 10, 30, 49])
    prev, lp = tables.step(mo, idx, x, 1.0, noise=torch.randn(SHAPE, dtype=torch.float64))
    # the drawn sample is returned with its graph (it is mean + sigma z) ...
    assert prev.requires_grad
    # ... but the log-prob treats it as a constant: d lp / d mo = (x_prev - mean)/sigma^2/N * dmean/dmo != 0
    (g,) = torch.autograd.grad(lp.sum(), mo)
    assert g.abs().max() > 0
    # were prev_sample not detached, d lp/d mo would be exactly 0 (x_prev - mean = sigma z is model-free)
