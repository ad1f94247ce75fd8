"""`algorithm=nft` against NVlabs' code (NVlabs/DiffusionNFT@24af5554898d85e93efa492f42b5e9cdf4156e9b) on the tiny
SD3 model, CPU, float32. The reference side of each test is written from that code, not from ours:

* the rollout: flow_grpo/diffusers_patch/solver.py (run_sampling with solver "dpm2", determistic=True: DPMState,
  dpm_step, convert_model_output, ddim_update, multistep_dpm_solver_second_order_update) driven as
  pipeline_with_logprob.py:207-254 drives it (sigmas = scheduler.sigmas.float(); the transformer called with
  torch.full(..., sigma * 1000, dtype=torch.long));
* one epoch's training: scripts/train_nft_sd3.py:797-1039 (the per-sample time permutation, the forward process, the
  old/current/reference forwards, the loss with its float64 adaptive weights, the KL term, the scaling by
  gradient_accumulation_steps x num_train_timesteps, clip_grad_norm_, AdamW, then return_decay's old-policy update).

The random draws (sample order, times, noise) are ours, handed to both sides: the reference draws its own from the
global generator, so only the arithmetic can be compared."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from ddpo_tpu.random_streams import SHUFFLE, stream_seed
from ddpo_tpu.algorithms.nft import draw_training_times

pytestmark = pytest.mark.slow

# 8 samples in groups of 4, one optimizer step an epoch (2 train batches of 4), 2 training times of 3 sigmas
BASE = ["+experiment=nft_smoke", "sample.batch_size=8", "sample.num_batches_per_epoch=1", "sample.num_steps=3",
        "train.batch_size=4", "train.gradient_accumulation_steps=2", "train.timestep_fraction=0.7",
        "reward.host_workers=0"]


def make_trainer(tmp_path, model_cache, *overrides):
    from ddpo_tpu.config.compose import compose_and_validate
    from ddpo_tpu.training import loop
    from ddpo_tpu.rundir.files import RunDir
    from ddpo_tpu.runtime import make_runtime

    v = compose_and_validate([*BASE, f"model.cache_dir={model_cache}", *overrides])
    return loop.Trainer(v.cfg, make_runtime(v.cfg), RunDir(tmp_path), tree=v.tree)


# --- the reference's solver (solver.py), written out ----------------------------------------------------------


def official_dpm2(v_pred_fn, z, sigma_schedule):
    """run_sampling(v_pred_fn, z, sigma_schedule, solver="dpm2", determistic=True) (solver.py:14-75)."""
    order, outputs, lower_order_nums = 2, [None, None], 0
    timesteps = sigma_schedule[:-1]
    sig64 = sigma_schedule.to(torch.float64)
    dtype = z.dtype
    for i in range(len(sigma_schedule) - 1):
        pred = v_pred_fn(z.to(dtype), sigma_schedule[i]).float()
        sample = z.float()
        lower_order_final = i == len(timesteps) - 1
        m = sample - sigma_schedule[i] * pred                     # convert_model_output
        outputs = [outputs[1], m]                                 # DPMState.update
        if order == 1 or lower_order_nums < 1 or lower_order_final:
            assert i == 0 or lower_order_final                     # order 2: the first-order update is never reached
            t, s = sig64[i + 1], sig64[i]                          # ddim_update, eta 0
            rho = 0.0 * t * torch.sqrt(1.0 - t**2 * (1 - s) ** 2 / (s**2 * (1 - t) ** 2))
            noise_pred = (sample - (1 - s) * m) / s
            z = (1 - t) * m + torch.sqrt(t**2 - rho**2) * noise_pred
        else:                                                      # multistep_dpm_solver_second_order_update
            st, s0, s1 = sig64[i + 1], sig64[i], sig64[i - 1]
            lam = lambda s: torch.log(1 - s) - torch.log(s)        # noqa: E731 (_sigma_to_alpha_sigma_t)
            h, h0 = lam(st) - lam(s0), lam(s0) - lam(s1)
            r0 = h0 / h
            d0, d1 = outputs[-1], (1.0 / r0) * (outputs[-1] - outputs[-2])
            z = ((st / s0) * sample - ((1 - st) * (torch.exp(-h) - 1.0)) * d0
                 - 0.5 * ((1 - st) * (torch.exp(-h) - 1.0)) * d1)
        lower_order_nums = min(lower_order_nums + 1, order)
        z = z.to(m.dtype).to(dtype)
    return z


def test_dpm2_rollout_equals_the_official_solver(tmp_path, model_cache):
    tr = make_trainer(tmp_path, model_cache, "sampler=flow_dpm2", "sample.num_steps=6", "sample.batch_size=8")
    fam, prompts = tr.family, ["a cat"] * 4 + ["a dog"] * 4
    gen = torch.Generator().manual_seed(7)
    traj, cond, _ = tr._sample_batch(prompts, gen)  # draws the initial latents first (loop._sample_batch)
    init = torch.randn((8, *fam.latent_shape), generator=torch.Generator().manual_seed(7))
    embeds, pooled = fam.encode(prompts)
    sched = fam.c.scheduler
    sched.set_timesteps(6)

    def v_pred_fn(z, sigma):  # pipeline_with_logprob.py:209-222, guidance 1 (no CFG)
        timesteps = torch.full([z.shape[0]], sigma * 1000, dtype=torch.long)
        with torch.no_grad():
            return fam.model(hidden_states=z, timestep=timesteps, encoder_hidden_states=embeds,
                             pooled_projections=pooled, return_dict=False)[0]

    want = official_dpm2(v_pred_fn, init, sched.sigmas.float())
    got = traj.sample
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), (got - want).abs().max()
    # Euler all the way (the flow ODE's other solver) ends elsewhere: the comparison can fail
    z, sig = init, sched.sigmas.float()
    for i in range(6):
        z = z + (sig[i + 1] - sig[i]) * v_pred_fn(z, sig[i])
    assert (got - z).abs().max() > 100 * (got - want).abs().max()


# --- one epoch of training (train_nft_sd3.py), written out --------------------------------------------------


def return_decay(step, decay_type):  # train_nft_sd3.py:169-189
    flat, uprate, uphold = {0: (0, 0.0, 0.0), 1: (0, 0.001, 0.5), 2: (75, 0.0075, 0.999)}[decay_type]
    return 0.0 if step < flat else min((step - flat) * uprate, uphold)


def official_epoch(model, old_model, cfg, samples, timesteps_all, draws):
    """One epoch's training from train_nft_sd3.py:797-1039 on `model` (its trainable LoRA weights), `old_model`
    holding the old adapter. Returns (the pre-clip gradient of the one optimizer step, the logged loss terms)."""
    a, t_cfg = cfg.algorithm, cfg.train
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=t_cfg.learning_rate, betas=(t_cfg.adam_beta1, t_cfg.adam_beta2),
                                  weight_decay=t_cfg.adam_weight_decay, eps=t_cfg.adam_epsilon)
    perm, perms_time, noise = draws
    N = perm.shape[0]
    num_train_timesteps = int(cfg.sample.num_steps * t_cfg.timestep_fraction)
    effective = t_cfg.gradient_accumulation_steps * num_train_timesteps
    x0_all, embeds_all, pooled_all, adv_all = (x[perm] for x in samples)
    ts_all = timesteps_all[perm]
    ts_all = ts_all[torch.arange(N)[:, None], perms_time]             # shuffle each sample's timesteps
    noise_all = noise  # (N, num_train_timesteps, ...): the noise of each sample's j-th trained time
    accumulated, grads, info = 0, None, {"total_loss": [], "kl_div": []}
    bs = t_cfg.batch_size
    for b in range(N // bs):
        rows = slice(b * bs, (b + 1) * bs)
        x0, embeds, pooled = x0_all[rows], embeds_all[rows], pooled_all[rows]
        for j in range(num_train_timesteps):
            ts = ts_all[rows, j]
            t = ts / 1000.0
            t_expanded = t.view(-1, *([1] * (len(x0.shape) - 1)))
            xt = (1 - t_expanded) * x0 + t_expanded * noise_all[rows, j]
            call = lambda m: m(hidden_states=xt, timestep=ts, encoder_hidden_states=embeds,  # noqa: E731
                               pooled_projections=pooled, return_dict=False)[0]
            with torch.no_grad():
                old_prediction = call(old_model).detach()
            forward_prediction = call(model)
            with torch.no_grad():
                model.disable_adapters()
                ref_forward_prediction = call(model)
                model.enable_adapters()
            advantages_clip = torch.clamp(adv_all[rows], -a.adv_clip_max, a.adv_clip_max)
            r = torch.clamp((advantages_clip / a.adv_clip_max) / 2.0 + 0.5, 0, 1)
            positive_prediction = a.beta * forward_prediction + (1 - a.beta) * old_prediction.detach()
            implicit_negative_prediction = (1.0 + a.beta) * old_prediction.detach() - a.beta * forward_prediction
            dims = tuple(range(1, x0.ndim))
            x0_prediction = xt - t_expanded * positive_prediction
            with torch.no_grad():
                weight_factor = torch.abs(x0_prediction.double() - x0.double()).mean(dim=dims, keepdim=True).clip(
                    min=0.00001)
            positive_loss = ((x0_prediction - x0) ** 2 / weight_factor).mean(dim=dims)
            negative_x0_prediction = xt - t_expanded * implicit_negative_prediction
            with torch.no_grad():
                negative_weight_factor = torch.abs(negative_x0_prediction.double() - x0.double()).mean(
                    dim=dims, keepdim=True).clip(min=0.00001)
            negative_loss = ((negative_x0_prediction - x0) ** 2 / negative_weight_factor).mean(dim=dims)
            ori_policy_loss = r * positive_loss / a.beta + (1.0 - r) * negative_loss / a.beta
            loss = (ori_policy_loss * a.adv_clip_max).mean()
            kl_div_loss = ((forward_prediction - ref_forward_prediction) ** 2).mean(dim=dims)
            loss = loss + a.kl_beta * torch.mean(kl_div_loss)
            info["total_loss"].append(loss.detach())
            info["kl_div"].append(torch.mean(kl_div_loss).detach())
            (loss / effective).backward()
            accumulated += 1
            if accumulated % effective == 0:
                grads = [p.grad.detach().clone() for p in params]
                torch.nn.utils.clip_grad_norm_(model.parameters(), t_cfg.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad()
    return grads, {k: torch.stack(v).mean().item() for k, v in info.items()}


@pytest.mark.parametrize("fused", [1, 2])
def test_one_epoch_loss_gradient_and_update_equal_the_official_code(tmp_path, model_cache, fused):
    # beta, the KL weight and the clip far from 1 and from each other, so a mix-up of the two betas shows
    tr = make_trainer(tmp_path, model_cache, "algorithm.beta=0.3", "algorithm.kl_beta=0.5",
                      "algorithm.adv_clip_max=2.0", "algorithm.decay_rate=0.25", "train.learning_rate=1e-3",
                      f"train.timesteps_per_micro_step={fused}")
    fam, cfg, state = tr.family, tr.cfg, tr.state
    torch.manual_seed(3)
    with torch.no_grad():  # trained weights and an old policy away from the base model and from each other
        for p in state.params:
            p.add_(0.05 * torch.randn_like(p))
        old = tr.epoch_trainer.old
        for e, p in zip(old.shadow, state.params):
            e.copy_(p + 0.05 * torch.randn_like(p))
    sampled = tr.sample_epoch(0)
    s = tr.epoch_samples(0, sampled, tr.gather_rewards(0, sampled))
    s.advantages = torch.tensor([3.0, -0.5, 0.0, -4.0, 1.2, -1.9, 2.5, 0.7])  # clipped at +-2 on both sides
    N, S, T = 8, cfg.sample.num_steps, tr.shape.train_timesteps
    assert T == 2 and tr.shape.window == 4

    # the official side: the current weights and the old adapter as separate models, before ours trains
    model, old_model = copy.deepcopy(fam.model), copy.deepcopy(fam.model)
    with torch.no_grad():
        for e, p in zip(old.shadow, [p for p in old_model.parameters() if p.requires_grad]):
            p.copy_(e)
    gen = torch.Generator().manual_seed(stream_seed(cfg.seed, 0, SHUFFLE, 0))
    perm = torch.argsort(torch.rand(N, generator=gen))
    noise = torch.randn((N, T, *fam.latent_shape), generator=gen)
    perms_time = draw_training_times(gen, N, S, T)
    sched = fam.c.scheduler
    sched.set_timesteps(S)
    timesteps_all = sched.timesteps.float().repeat(N, 1)
    x0 = s.latents[:, -1]
    want_grads, want_info = official_epoch(model, old_model, cfg, (x0, *s.cond, s.advantages), timesteps_all,
                                           (perm, perms_time, noise))
    old_before = [e.clone() for e in old.shadow]

    got_grads = []
    update = state.update

    def recording_update(max_grad_norm):
        got_grads.extend(p.grad.detach().clone() for p in state.params)
        return update(max_grad_norm)

    state.update = recording_update
    tr.report.step = lambda rec: None  # no tracker: fit() was not started
    logs = tr.train_epoch(0, s)
    assert len(logs) == 1 and state.global_step == 1
    assert logs[0]["loss"] == pytest.approx(want_info["total_loss"], rel=1e-5)
    assert logs[0]["kl"] == pytest.approx(want_info["kl_div"], rel=1e-5) and want_info["kl_div"] > 0
    scale = max(g.abs().max().item() for g in want_grads)
    for g, w in zip(got_grads, want_grads, strict=True):
        assert torch.allclose(g, w, rtol=1e-4, atol=1e-5 * scale), (g - w).abs().max()
    trained = [p for p in model.parameters() if p.requires_grad]
    for p, w in zip(state.params, trained, strict=True):
        assert torch.allclose(p, w, rtol=1e-5, atol=1e-6), (p - w).abs().max()
    # after the epoch the old adapter moves: decay = min(0.25 x 1, 0.5) (return_decay's shape, rate 0.25)
    d = 0.25
    for e, o, w in zip(old.shadow, old_before, trained, strict=True):
        assert torch.allclose(e, o * d + w * (1.0 - d), rtol=1e-5, atol=1e-6)


def test_old_policy_schedules_are_the_official_decay_types():
    from types import SimpleNamespace

    from ddpo_tpu.algorithms.nft import OldPolicy

    rt = SimpleNamespace(device=torch.device("cpu"), place_state=lambda *a: None, sync=lambda: None)
    # decay_type -> (decay_start, decay_rate, decay_max) as docs/nft.md and the presets set them
    ours = {0: (0, 0.0, 0.0), 1: (0, 0.001, 0.5), 2: (75, 0.0075, 0.999)}
    for decay_type, (start, rate, top) in ours.items():
        old = OldPolicy([torch.zeros(1)], rate, top, rt, start)
        for step in (0, 1, 50, 74, 75, 76, 100, 208, 500, 10_000):
            assert 1.0 - old.weight(step) == pytest.approx(return_decay(step, decay_type), abs=1e-12)
    assert math.isclose(return_decay(100, 2), 25 * 0.0075)
