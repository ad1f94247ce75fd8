"""Advantage Weighted Matching (`algorithm=awm`) against the reference's code: scxue/advantage_weighted_matching at
be5137232e33a21b449ed65a533211d0deb97ed8, advantage_weighted_matching/scripts/train_sd3_awm.py (awm:LINE below).
The `reference_*` functions here are transcriptions of that script's formulas and order of operations (in float64,
as it scores); ours run in float32 on the tiny SD3 model and must agree to float32 rounding."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from ddpo_tpu.config.compose import ConfigError, compose_and_validate
from ddpo_tpu.algorithms.awm import (KL_EMA_RATE, SlowCopy, awm_loss, matching_log_prob, scaled_advantages,
                                     time_indices, velocity_kl)

AWM_SMOKE = ["+experiment=awm_smoke"]


def reference_log_prob(model_output, random_noise, clean_latents, timestep, weighting, ghuber_power=0.25):
    """compute_log_prob_awm after the transformer call (awm:236-251)."""
    model_output = model_output.double()
    log_prob = -(model_output - (random_noise.double() - clean_latents.double())) ** 2
    log_prob = log_prob.mean(dim=tuple(range(1, log_prob.ndim)))
    t = timestep.view(-1).double()
    if weighting == "t":
        log_prob = log_prob * t
    elif weighting == "t2":  # the reference's 't**2'
        log_prob = log_prob * t ** 2
    elif weighting == "huber":
        log_prob = -(torch.sqrt(-log_prob + 1e-10) - 1e-5) * t
    elif weighting == "ghuber":
        tiny = torch.tensor(1e-10, dtype=log_prob.dtype)
        log_prob = -(torch.pow(-log_prob + 1e-10, ghuber_power) - torch.pow(tiny, ghuber_power)) * t / ghuber_power
    return log_prob


def reference_policy_loss(log_probs, old_log_probs, sample_advantages, K, adv_clip_max, advantage_max, clip_range):
    """awm:1292-1327, loss_type exp_first: log_probs/old (K, B), sample_advantages (B,)."""
    advantages = torch.clamp(sample_advantages, -adv_clip_max, adv_clip_max)
    if advantage_max is not None:
        advantages = advantages / adv_clip_max * advantage_max
    ratio = torch.exp(log_probs.reshape(-1) - old_log_probs.reshape(-1).detach())
    advantages = advantages.unsqueeze(0).repeat(K, 1).view(-1)
    unclipped_loss = -advantages * ratio
    clipped_loss = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    return torch.mean(torch.maximum(unclipped_loss, clipped_loss)), ratio


def reference_kl(model_output, model_output_ref):
    """awm:1336-1340 (kl_weight Uniform): outputs (K, B, C, h, w)."""
    kl_loss = ((model_output - model_output_ref) ** 2).mean(dim=(2, 3, 4), keepdim=True)
    return kl_loss.mean(dim=0).mean()


def reference_time_indices(time_type, num_steps, timestep_fraction, train_timesteps, rand_u):
    """awm:1172-1178 (discrete) and awm:1197-1203 (discrete_wo_init)."""
    lo = 0 if time_type == "discrete" else 1
    boundaries = torch.linspace(lo, int(num_steps * timestep_fraction), steps=train_timesteps + 1)
    lower_bounds = boundaries[:-1].long()
    upper_bounds = boundaries[1:].long()
    return lower_bounds + (rand_u * (upper_bounds - lower_bounds)).long()


# --- the formulas ----------------------------------------------------------------------------------------------


def test_one_element_log_probs_worked_by_hand():
    # v = 1, eps - x0 = 0.5: mse = 0.25; t = 0.5; ghuber p = 0.5: -((0.25 + 1e-10)^0.5 - 1e-5) x 0.5 / 0.5
    one = lambda x: torch.tensor([[x]])
    v, eps, x0, t = one(1.0), one(0.3), one(-0.2), torch.tensor([0.5])
    got = {w: matching_log_prob(v, x0, eps, t, w, 0.5).item() for w in ("uniform", "t", "t2", "huber", "ghuber")}
    assert got == pytest.approx({"uniform": -0.25, "t": -0.125, "t2": -0.0625, "huber": -(0.5 - 1e-5) * 0.5,
                                 "ghuber": -(0.5 - 1e-5)}, abs=1e-6)


@pytest.mark.parametrize("weighting", ["uniform", "t", "t2", "huber", "ghuber"])
def test_log_prob_equals_the_reference(weighting):
    g = torch.Generator().manual_seed(1)
    v, eps, x0 = (torch.randn((6, 4, 3, 3), generator=g) for _ in range(3))
    t = torch.rand(6, generator=g)
    want = reference_log_prob(v, eps, x0, t.view(-1, 1, 1, 1), weighting, 0.25)
    assert matching_log_prob(v, x0, eps, t, weighting, 0.25).double() == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("advantage_max,clip_range", [(1.0, 1.0), (None, 0.2), (2.0, 0.05)])
def test_policy_loss_and_gradient_equal_the_reference(advantage_max, clip_range):
    g = torch.Generator().manual_seed(2)
    K, B = 3, 4
    lp0 = -torch.rand((K, B), generator=g, dtype=torch.float64)
    old = lp0 + 0.3 * torch.randn((K, B), generator=g, dtype=torch.float64)  # ratios inside and outside the clip
    adv = torch.tensor([7.0, -0.4, 0.0, -9.0], dtype=torch.float64)        # beyond +-5 on both sides
    lp_ref = lp0.clone().requires_grad_()
    want, ratio = reference_policy_loss(lp_ref, old, adv, K, 5.0, advantage_max, clip_range)
    want.backward()
    lp = lp0.clone().requires_grad_()
    A = scaled_advantages(adv, 5.0, advantage_max).repeat(K)  # time-major rows, as the reference repeats them
    loss, policy, clipfrac = awm_loss(lp.reshape(-1), old.reshape(-1), A, clip_range)
    loss.backward()
    assert loss.item() == pytest.approx(want.item(), rel=1e-12) and policy.item() == loss.item()
    assert torch.allclose(lp.grad, lp_ref.grad, rtol=1e-12, atol=0)
    assert clipfrac.item() == pytest.approx(((ratio - 1).abs() > clip_range).double().mean().item())


def test_on_policy_gradient_is_the_advantage_weighted_matching_gradient():
    # ratio = exp(lp - lp.detach()) = 1: d loss / d lp_i = -A_i / R (the paper's advantage-weighted matching)
    lp = torch.tensor([-0.2, -0.5, -0.1], requires_grad=True)
    A = torch.tensor([1.0, -2.0, 0.5])
    loss, _, _ = awm_loss(lp, lp.detach(), A, clip_range=1.0)
    loss.backward()
    assert lp.grad.tolist() == pytest.approx((-A / 3).tolist())


def test_kl_terms_equal_the_reference():
    g = torch.Generator().manual_seed(3)
    K, B = 2, 3
    v, v_ref = torch.randn((K, B, 4, 2, 2), generator=g), torch.randn((K, B, 4, 2, 2), generator=g)
    t = torch.rand(K * B, generator=g)
    ours = velocity_kl(v.reshape(K * B, 4, 2, 2), v_ref.reshape(K * B, 4, 2, 2), t, "uniform")
    assert ours.item() == pytest.approx(reference_kl(v.double(), v_ref.double()).item(), rel=1e-6)
    # ELBO (awm:1335): over 2 std^2, std = sqrt(t / (1 - clamp(t, 0, 0.99))) x 0.7 (awm:237)
    std = (torch.sqrt(t / (1 - t.clamp(0, 0.99))) * 0.7).view(K, B, 1, 1, 1).double()
    elbo = (((v - v_ref).double() ** 2).mean(dim=(2, 3, 4), keepdim=True) / (2 * std ** 2)).mean(dim=0).mean()
    assert velocity_kl(v.reshape(K * B, 4, 2, 2), v_ref.reshape(K * B, 4, 2, 2), t, "elbo").item() == \
        pytest.approx(elbo.item(), rel=1e-5)


@pytest.mark.parametrize("kind", ["discrete", "discrete_wo_init"])
@pytest.mark.parametrize("num_steps,fraction,k", [(14, 0.9, 6), (6, 0.9, 3), (10, 1.0, 6), (6, 0.9, 6)])
def test_time_strata_equal_the_reference(kind, num_steps, fraction, k):
    g = torch.Generator().manual_seed(num_steps * k)
    for _ in range(20):
        u = torch.rand(k, generator=g)
        got = time_indices(kind, num_steps, fraction, k, u)
        assert got.tolist() == reference_time_indices(kind, num_steps, fraction, k, u).tolist()
        assert got.max() < num_steps


def test_slow_copy_follows_the_reference_decay():
    # awm:1409-1418: decay = min(kl_ema_decay, 0.001 x global_step); tgt = tgt decay + src (1 - decay)
    rt = SimpleNamespace(device="cpu", place_state=lambda xs: None, sync=lambda: None)
    p = torch.nn.Parameter(torch.zeros(2))
    slow = SlowCopy([p], 0.3, 1, rt)
    want = 0.0
    for step in (1, 200, 1000):
        with torch.no_grad():
            p.add_(1.0)
        slow.update(step)
        d = min(0.3, KL_EMA_RATE * step)
        want = want * d + p[0].item() * (1 - d)
        assert slow.shadow[0][0].item() == pytest.approx(want, rel=1e-6)


# --- one epoch on the tiny SD3 model against the reference's procedure ------------------------------------------


def _reference_epoch(model, slow, opt, scheduler, x0, cond, adv, perm, idx, noise, cfg):
    """train_sd3_awm.py's training of one epoch (awm:1107-1406) on the same order, times and noise: lp_old of the
    batches after the first optimizer step under the sampling weights (awm:1225-1238), then per batch the loss with
    the first step's batches using their own detached lp (awm:1283), backward, clip, AdamW step."""
    a, t_cfg = cfg.algorithm, cfg.train
    B, G, K = t_cfg.batch_size, t_cfg.gradient_accumulation_steps, a.train_timesteps
    params = [p for p in model.parameters() if p.requires_grad]
    x0, adv, cond = x0[perm], adv[perm], tuple(c[perm] for c in cond)
    batches = []
    for i in range(len(perm) // B):
        rows = slice(i * B, (i + 1) * B)
        timesteps = scheduler.timesteps[torch.repeat_interleave(idx[i], repeats=B)].view(-1, 1, 1, 1) / 1000
        batches.append({"timesteps": timesteps, "clean_latents": torch.cat([x0[rows]] * K),
                        "train_random_noise": noise[i].reshape(K * B, *x0.shape[1:]),
                        "embeds": torch.cat([cond[0][rows]] * K), "pooled": torch.cat([cond[1][rows]] * K),
                        "advantages": adv[rows]})

    def forward(net, s):
        t = s["timesteps"]
        noised = (1 - t) * s["clean_latents"] + t * s["train_random_noise"]
        out = net(hidden_states=noised, timestep=t.view(-1) * 1000, encoder_hidden_states=s["embeds"],
                  pooled_projections=s["pooled"], return_dict=False)[0]
        return out, reference_log_prob(out, s["train_random_noise"], s["clean_latents"], t, a.weighting,
                                       a.ghuber_power)

    for i, s in enumerate(batches):
        if i >= G:
            with torch.no_grad():
                s["old_log_probs"] = forward(model, s)[1].reshape(K, B)
    losses = []
    for i, s in enumerate(batches):
        model_output, log_prob = forward(model, s)
        with torch.no_grad():
            model.disable_adapters()
            model_output_ref, _ = forward(model, s)
            model.enable_adapters()
            model_output_ema, _ = forward(slow, s)
        if i < G:
            s["old_log_probs"] = log_prob.reshape(K, B).detach()
        policy_loss, _ = reference_policy_loss(log_prob.reshape(K, B), s["old_log_probs"], s["advantages"].double(),
                                               K, t_cfg.adv_clip_max, a.advantage_max, a.clip_range)
        shape = lambda x: x.double().reshape(K, B, *x.shape[1:])
        kl_loss = reference_kl(shape(model_output), shape(model_output_ref))
        ema_kl_loss = reference_kl(shape(model_output), shape(model_output_ema))
        loss = policy_loss + a.kl_beta * kl_loss + a.ema_beta * ema_kl_loss
        (loss / G).backward()  # accelerate's accumulate divides by its steps
        losses.append(loss.item())
        if (i + 1) % G == 0:
            torch.nn.utils.clip_grad_norm_(params, t_cfg.max_grad_norm)
            opt.step()
            opt.zero_grad()
    return losses


@pytest.mark.parametrize("weighting,grad_acc", [("ghuber", 1), ("uniform", 2)])
def test_one_epoch_on_tiny_sd3_equals_the_reference(tmp_path, model_cache, weighting, grad_acc):
    from ddpo_tpu.training import loop
    from ddpo_tpu.rundir.files import RunDir
    from ddpo_tpu.runtime import make_runtime

    n_batches = 2 * grad_acc  # two optimizer steps: the second's lp_old recorded before the first moved the weights
    v = compose_and_validate([*AWM_SMOKE, f"model.cache_dir={model_cache}", "sample.batch_size=4",
                              f"sample.num_batches_per_epoch={n_batches // 2}", "algorithm.group_size=2",
                              "train.batch_size=2", f"train.gradient_accumulation_steps={grad_acc}",
                              "algorithm.train_timesteps=2", f"algorithm.weighting={weighting}",
                              "algorithm.kl_beta=0.5", "algorithm.ema_beta=1.0", "algorithm.clip_range=0.002",
                              "train.learning_rate=5e-2"])
    cfg = v.cfg
    tr = loop.Trainer(cfg, make_runtime(cfg), RunDir(tmp_path), tree=v.tree, stop=SimpleNamespace(requested=False))
    fam, et = tr.family, tr.epoch_trainer
    tr.report.step = lambda rec: None  # the reporter's tracker starts in fit(); the updates' records are returned
    N = 4 * n_batches // 2
    g = torch.Generator().manual_seed(5)
    x0 = torch.randn((N, *fam.latent_shape), generator=g)
    cond = fam.encode([f"a photo of animal {i}" for i in range(N)])
    adv = torch.tensor([1.5, -0.5, 7.0, -2.0, 0.3, -6.0, 0.0, 2.0][:N])
    ref_model, slow = copy.deepcopy(fam.model), copy.deepcopy(fam.model)  # the slow copy starts at the policy
    t = cfg.train
    opt = torch.optim.AdamW([p for p in ref_model.parameters() if p.requires_grad], lr=t.learning_rate,
                            betas=(t.adam_beta1, t.adam_beta2), weight_decay=t.adam_weight_decay, eps=t.adam_epsilon)
    scheduler = copy.deepcopy(fam.c.scheduler)
    scheduler.set_timesteps(cfg.sample.num_steps)  # as the pipeline sets it (retrieve_timesteps)
    perm, idx, noise = et.draws(0, N // t.batch_size, t.batch_size, fam.latent_shape)
    want = _reference_epoch(ref_model, slow, opt, scheduler, x0, cond, adv, perm, idx, noise, cfg)

    latents = x0[:, None].expand(N, cfg.sample.num_steps + 1, *x0.shape[1:])  # only the last (clean) one is read
    s = SimpleNamespace(latents=latents, cond=cond, advantages=adv, weights=torch.ones(N))
    logs = et.train_epoch(0, s)
    assert len(logs) == 2
    # each update's logged loss is the mean of its batches' losses
    per_update = [sum(want[i * grad_acc:(i + 1) * grad_acc]) / grad_acc for i in range(2)]
    assert [r["loss"] for r in logs] == pytest.approx(per_update, rel=1e-4, abs=1e-6)
    # the first step scores its own lp (ratio 1, nothing clipped); the second the recorded lp_old, which the moved
    # weights leave behind: some of its ratios fall outside the (narrow) clip
    assert logs[0]["clipfrac"] == 0 and logs[1]["clipfrac"] > 0, logs
    ours = [p for p in fam.model.parameters() if p.requires_grad]
    theirs = [p for p in ref_model.parameters() if p.requires_grad]
    assert len(ours) == len(theirs)
    for p, q in zip(ours, theirs):
        # AdamW divides by the root of the second moment: where a gradient is near 0 a float32 rounding of it moves
        # the step by a visible fraction of the learning rate (5e-2), so the weights agree to 1e-4, not to 1e-7
        assert torch.allclose(p, q, rtol=0, atol=1e-4), (p - q).abs().max().item()
    start = [p for p in slow.parameters() if p.requires_grad]
    assert max((p - q).abs().max().item() for p, q in zip(ours, start)) > 1e-4  # the weights moved


# --- the rules ----------------------------------------------------------------------------------------------------


def problems(overrides: list[str]) -> dict[str, str]:
    with pytest.raises(ConfigError) as e:
        compose_and_validate(overrides)
    return {p.key: f"{p.reason}; {p.fix}" for p in e.value.problems}


def test_awm_smoke_composes_with_the_reference_defaults():
    a = compose_and_validate(AWM_SMOKE).cfg.algorithm
    assert (a.name, a.weighting, a.ghuber_power, a.advantage_max, a.clip_range, a.time_type) == \
        ("awm", "ghuber", 0.25, 1.0, 1.0, "discrete")


def test_awm_needs_a_flow_family():
    assert "flow-matching" in problems(["+experiment=smoke", "algorithm=awm", "algorithm.group_size=2"])[
        "algorithm.name"]


@pytest.mark.parametrize("override,key", [("train.cfg=true", "train.cfg"),
                                          ("train.num_inner_epochs=2", "train.num_inner_epochs"),
                                          ("sample.sde_window.size=2", "sample.sde_window.size"),
                                          ("sample.ode_solver=dpm2", "sample.ode_solver")])
def test_awm_refuses_what_it_cannot_train(override, key):
    assert key in problems([*AWM_SMOKE, override])


def test_awm_kl_needs_the_lora_adapter():
    got = problems([*AWM_SMOKE, "algorithm.kl_beta=0.001", "model.lora.enabled=false"])
    assert "adapter off" in got["algorithm.kl_beta"]
