"""The EMA of the trained weights (flow_grpo's EMAModuleWrapper arithmetic, swapped in for evaluation, checkpointed
with the training state) and evaluation's own sampler (another step count, the noise-free step of each family)."""

from __future__ import annotations

import pytest
import torch

from ddpo_tpu.config.compose import compose_and_validate
from ddpo_tpu.training.state import EMA, TrainState
from ddpo_tpu.runtime import make_runtime


def reference_decay(step: int, decay: float) -> float:
    """flow_grpo's EMAModuleWrapper.get_current_decay, written from its formula."""
    return min((1 + step) / (10 + step), decay)


@pytest.fixture
def rt():
    return make_runtime(compose_and_validate(["+experiment=smoke"]).cfg)


def test_ema_follows_the_reference_schedule(rt):
    g = torch.Generator().manual_seed(0)
    w = torch.nn.Parameter(torch.randn(3, 4, generator=g))
    ema = EMA([w], decay=0.9, every=8, rt=rt)
    shadow = w.detach().clone()
    for step in range(40):
        with torch.no_grad():
            w.add_(torch.randn(3, 4, generator=g))
        ema.update(step)
        if (step + 1) % 8 == 0:  # the reference: shadow += (1 - d) (w - shadow) on these steps only
            shadow += (1 - reference_decay(step, 0.9)) * (w.detach() - shadow)
        assert torch.equal(ema.shadow[0], shadow), step
    assert ema.weight(6) == 0.0 and ema.weight(7) == pytest.approx(1 - 8 / 17)
    assert ema.weight(79) == pytest.approx(1 - 80 / 89) and ema.weight(87) == pytest.approx(0.1)  # warmed up


def test_ema_is_swapped_in_and_the_trained_weights_come_back_exactly(rt):
    w = torch.nn.Parameter(torch.arange(6.0).reshape(2, 3))
    ema = EMA([w], decay=0.5, every=1, rt=rt)
    with torch.no_grad():
        w.mul_(3)
    trained = w.detach().clone()
    ema.update(100)  # decay 0.5: shadow = (w0 + 3 w0) / 2
    with ema.swapped_in():
        assert torch.equal(w.detach(), 2 * torch.arange(6.0).reshape(2, 3))
    assert torch.equal(w.detach(), trained)
    with pytest.raises(RuntimeError):  # and after an error inside the block too
        with ema.swapped_in():
            raise RuntimeError
    assert torch.equal(w.detach(), trained)


def _train_state(rt, ema: bool):
    # (train.ema_every only with the EMA on: config/enablement.py refuses it otherwise)
    cfg = compose_and_validate(["+experiment=smoke", f"train.ema={str(ema).lower()}",
                                *(["train.ema_every=1"] if ema else [])]).cfg
    model = torch.nn.Linear(3, 2)
    return TrainState(model, cfg.train, rt), model


def test_the_ema_is_part_of_the_checkpointed_training_state(rt):
    state, model = _train_state(rt, ema=True)
    for _ in range(3):
        model(torch.randn(4, 3)).sum().backward()
        state.update(1.0)
        state.end_batch()
    saved = state.state_dict()
    assert [t.shape for t in saved["ema"]] == [p.shape for p in model.parameters()]
    assert not torch.equal(saved["ema"][0], model.weight.detach())  # an average, not the weights

    fresh, fresh_model = _train_state(rt, ema=True)
    fresh_model.load_state_dict(model.state_dict())
    fresh.load_state_dict(saved)
    assert all(torch.equal(a, b) for a, b in zip(fresh.ema.shadow, state.ema.shadow))
    # a checkpoint written without an EMA (train.ema turned on at a resume): the average starts at the weights
    plain, _ = _train_state(rt, ema=False)
    assert "ema" not in plain.state_dict()
    fresh.load_state_dict(plain.state_dict())
    assert all(torch.equal(e, p.detach()) for e, p in zip(fresh.ema.shadow, fresh_model.parameters()))


def test_without_ema_evaluation_uses_the_trained_weights(rt):
    state, model = _train_state(rt, ema=False)
    before = model.weight.detach().clone()
    with state.ema_weights():
        assert torch.equal(model.weight.detach(), before)
    state.end_batch()  # nothing to update
    assert state.ema is None


def _family(name: str, tmp_path, overrides=()):
    from ddpo_tpu.families import load_family

    experiment = {"sd1": "smoke", "sd3": "flow_grpo_smoke"}[name]
    cfg = compose_and_validate([f"+experiment={experiment}", f"model.cache_dir={tmp_path}", *overrides]).cfg
    rt = make_runtime(cfg)
    torch.manual_seed(0)
    return load_family(cfg, rt), rt


def _noise_free_setup(kind: str, tmp_path, num_steps: int, seed: int):
    """A family's noise-free evaluation step on a `num_steps` schedule, a fresh copy of its diffusers scheduler set to
    the same steps, seeded latents and the conditioning of two prompts (and of the empty prompt)."""
    family, _ = _family(kind, tmp_path)
    step = family.make_denoise_step(None, family.schedule(num_steps), deterministic=True)
    scheduler = family.c.scheduler if kind == "sd3" else family.scheduler
    sched = type(scheduler).from_config(scheduler.config)
    sched.set_timesteps(num_steps)
    x = torch.randn((2, *family.latent_shape), generator=torch.Generator().manual_seed(seed))
    return family, step, sched, x, family.encode(["a cat", "a dog"]), family.encode(["", ""])


def test_the_flow_ode_step_is_the_schedulers_euler_step(tmp_path):
    """SD 3's noise-free evaluation step over 12 steps equals diffusers' FlowMatchEulerDiscreteScheduler.step."""
    family, step, sched, x, cond, uncond = _noise_free_setup("sd3", tmp_path, 12, seed=3)
    for i in (0, 5, 11):
        idx = torch.full((2,), i)
        prev, log_prob = step(x, idx, torch.randn_like(x), cond, uncond)
        v = family.velocity(x, idx, cond, uncond, family.schedule(12))
        want = sched.step(v, sched.timesteps[i], x, return_dict=False)[0]
        sched._step_index = None  # step() advances its own index; each check starts from timestep i
        torch.testing.assert_close(prev, want, rtol=1e-6, atol=1e-6)
        assert torch.equal(log_prob, torch.zeros(2))


def test_the_ddim_eval_step_with_eta_0_is_diffusers_deterministic_ddim(tmp_path):
    from ddpo_tpu.diffusion.sampling import guided_noise_pred

    family, step, sched, x, cond, uncond = _noise_free_setup("sd1", tmp_path, 7, seed=4)
    assert type(sched).__name__ == "DDIMScheduler"
    tables = family.schedule(7)
    for i in (0, 3, 6):
        idx = torch.full((2,), i)
        prev, _ = step(x, idx, torch.randn_like(x), cond, uncond)
        t = sched.timesteps[i]
        eps = guided_noise_pred(family.model, x, tables.timestep_at(idx), cond[0], uncond[0],
                                family.cfg.sample.guidance_scale)
        want = sched.step(eps, t, x, eta=0.0).prev_sample
        torch.testing.assert_close(prev, want, rtol=1e-5, atol=1e-6)


def test_evaluation_samples_its_own_steps_noise_free_with_the_ema_weights(tmp_path, model_cache, monkeypatch):
    """evaluation.num_steps and evaluation.deterministic give evaluation a sampler of its own (3 noise-free steps
    where training samples 2 with noise), and train.ema makes it sample with the average: weights trained since the
    average last moved change the training samples, not evaluation's."""
    from types import SimpleNamespace

    import numpy as np

    from ddpo_tpu.training import loop
    from ddpo_tpu.rundir.files import RunDir

    v = compose_and_validate(["+experiment=smoke", f"model.cache_dir={model_cache}", "sample.num_steps=2",
                              "evaluation.every_n_epochs=1", "evaluation.num_steps=3", "evaluation.deterministic=true",
                              "train.ema=true", "reward.host_workers=0"])
    t = loop.Trainer(v.cfg, make_runtime(v.cfg), RunDir(tmp_path), tree=v.tree, stop=SimpleNamespace(requested=False))
    t.report.tracker = SimpleNamespace(log=lambda *a, **k: None)
    steps, other_noise, images = [], [False], []
    real = loop.sample_trajectory

    def spy(step, T, cond, uncond, init, noise, **kw):  # the steps asked for; optionally other per-step noise
        steps.append(T)
        return real(step, T, cond, uncond, init, torch.randn_like(noise) if other_noise[0] else noise, **kw)

    monkeypatch.setattr(loop, "sample_trajectory", spy)
    t.reward = lambda batch, prompts: (images.append(batch), np.zeros(len(prompts)))[1]

    def sample(evaluation: bool, noise: bool = False) -> np.ndarray:
        other_noise[0] = noise
        if evaluation:
            t.evaluate(0)
            return images[-1]
        return t._sample_batch(["a cat"] * t.global_batch, torch.Generator().manual_seed(0))[2]

    evaluated, trained = sample(True), sample(False)
    assert steps == [3, 2]
    assert np.array_equal(sample(True, noise=True), evaluated)  # noise-free ...
    assert not np.array_equal(sample(False, noise=True), trained)  # ... where sampling is not
    with torch.no_grad():  # training moves the weights; the average has not been updated since
        for param in t.state.params:
            param.add_(0.5 * torch.randn_like(param))
    moved = [param.detach().clone() for param in t.state.params]
    assert not np.array_equal(sample(False), trained)
    assert np.array_equal(sample(True), evaluated)  # the average
    assert all(torch.equal(param, m) for param, m in zip(t.state.params, moved))  # the trained weights came back


def test_evaluation_keys_are_checked():
    from ddpo_tpu.config.compose import ConfigError

    for bad in ("evaluation.num_steps=0", "train.ema_decay=1.0", "train.ema_every=0"):
        with pytest.raises(ConfigError) as e:
            compose_and_validate(["+experiment=flow_grpo_smoke", bad])
        assert bad.split("=")[0] in str(e.value)
