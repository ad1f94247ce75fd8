"""SDE windows (sample.sde_window: MixGRPO, Flow-GRPO-Fast): the SDE inside a window of the denoising steps, the ODE
elsewhere; only the window's steps are stored and trained; its position is a pure function of (seed, epoch, batch)
so every backend and every resume places the same windows; the same graphs serve every position."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ddpo_tpu.config.compose import compose_and_validate
from ddpo_tpu.config.schema import SdeWindowConfig
from ddpo_tpu.diffusion.window import sde_window_at
from ddpo_tpu.problems import ConfigError

FLOW = ["+experiment=flow_grpo_smoke"]  # 6 steps


def refused(overrides: list[str]) -> dict[str, str]:
    with pytest.raises(ConfigError) as e:
        compose_and_validate([*FLOW, *overrides])
    return {p.key: f"{p.reason}; {p.fix}" for p in e.value.problems}


# --- where the window stands ------------------------------------------------------------------------------------------

def test_a_fixed_window_stays_and_a_sliding_one_moves_then_wraps():
    fixed = SdeWindowConfig(size=2, placement="fixed", start=3)
    assert {sde_window_at(fixed, 10, 0, e, b) for e in range(5) for b in range(3)} == {(3, 5)}
    # from start 1, 2 steps every 2 epochs, inside [1, 7): starts 1, 3, 5 (a window of 2 fits up to 5), then 1 again
    sliding = SdeWindowConfig(size=2, placement="sliding", start=1, range=[1, 7], shift_every=2, stride=2)
    assert [sde_window_at(sliding, 10, 0, e, 0)[0] for e in range(8)] == [1, 1, 3, 3, 5, 5, 1, 1]
    assert sde_window_at(SdeWindowConfig(), 10, 0, 0, 0) is None  # no window: every step is the SDE's


def test_a_random_window_is_drawn_per_batch_inside_its_range_from_the_seed():
    w = SdeWindowConfig(size=2, placement="random", range=[1, 6])
    starts = [sde_window_at(w, 10, 7, e, b)[0] for e in range(20) for b in range(4)]
    assert set(starts) == {1, 2, 3, 4}  # every start in [lo, hi - size], nothing else
    assert starts == [sde_window_at(w, 10, 7, e, b)[0] for e in range(20) for b in range(4)]  # a resume draws the same
    assert starts != [sde_window_at(w, 10, 8, e, b)[0] for e in range(20) for b in range(4)]  # another seed does not


# --- compose-time rules -----------------------------------------------------------------------------------------------

def test_the_window_is_refused_where_it_cannot_be():
    assert "no SDE window" in compose_and_validate_fails(["sample.sde_window.size=2"], ddim=True)[
        "sample.sde_window.size"]
    assert "larger than the 6 steps" in refused(["sample.sde_window.size=7"])["sample.sde_window.size"]
    assert "lo < hi <= 6" in refused(["sample.sde_window.size=2", "sample.sde_window.range=[0,8]"])[
        "sample.sde_window.range"]
    assert "leaves [0, 6)" in refused(["sample.sde_window.size=2", "sample.sde_window.placement=fixed",
                                       "sample.sde_window.start=5"])["sample.sde_window.start"]
    # keys that only matter with a window (or a sliding one), and the fraction a window replaces
    assert "not read" in refused(["sample.sde_window.stride=2"])["sample.sde_window.stride"]
    assert "does not slide" in refused(["sample.sde_window.size=2", "sample.sde_window.stride=2"])[
        "sample.sde_window.stride"]
    assert "trains its own steps" in refused(["sample.sde_window.size=2", "train.timestep_fraction=0.5"])[
        "train.timestep_fraction"]


def compose_and_validate_fails(overrides: list[str], ddim: bool) -> dict[str, str]:
    with pytest.raises(ConfigError) as e:
        compose_and_validate([f"+{o}" if ddim else o for o in overrides])
    return {p.key: p.reason for p in e.value.problems}


def test_a_window_trains_its_steps():
    from ddpo_tpu.config.batch import num_train_timesteps

    cfg = compose_and_validate([*FLOW, "sample.sde_window.size=2"]).cfg
    assert num_train_timesteps(cfg) == 2  # flow_grpo's fast trainer: the window's steps, whatever the fraction
    assert num_train_timesteps(compose_and_validate(FLOW).cfg) == 5  # int(6 x 0.99) without one


# --- sampling and training through the Trainer ------------------------------------------------------------------------

# GRPO with windows on an image family and on video (Wan: 5-D latents, its own SDE step, the Euler ODE outside)
@pytest.fixture(scope="module", params=[FLOW, ["+experiment=wan_grpo_smoke"]], ids=["sd3", "wan"])
def trainer(tmp_path_factory, model_cache, request):
    from ddpo_tpu.rundir.files import RunDir
    from ddpo_tpu.training import loop
    from ddpo_tpu.runtime import make_runtime

    v = compose_and_validate([*request.param, f"model.cache_dir={model_cache}", "reward.host_workers=0",
                              "num_epochs=1", "sample.num_steps=6", "algorithm.group_size=2",
                              "sample.batch_size=4", "sample.num_batches_per_epoch=2", "train.batch_size=4",
                              "train.gradient_accumulation_steps=1", "sample.sde_window.size=2",
                              "sample.sde_window.placement=fixed", "sample.sde_window.start=2"])
    return loop.Trainer(v.cfg, make_runtime(v.cfg), RunDir(tmp_path_factory.mktemp("run")), tree=v.tree,
                        stop=SimpleNamespace(requested=False))


def test_only_the_window_is_stochastic_and_recorded(trainer):
    import torch

    from ddpo_tpu.diffusion.sampling import sample_trajectory

    t = trainer
    T, B, shape = t.family.num_steps, 4, t.family.latent_shape
    gen = torch.Generator().manual_seed(0)
    init, noise = torch.randn((B, *shape), generator=gen), torch.randn((T, B, *shape), generator=gen)
    cond = t.family.encode(["a cat"] * B)
    run = lambda z: sample_trajectory(t.denoise_step, T, cond, t.uncond_sample, init, z, rt=t.rt, sync_every=0,
                                      window=(2, 4), ode_step=t.ode_step)
    traj = run(noise)
    assert traj.latents.shape[1] == 3 and traj.log_probs.shape == (B, 2)
    assert traj.step_indices.tolist() == [[2, 3]] * B and bool(torch.isfinite(traj.log_probs).all())
    outside, inside = noise.clone(), noise.clone()
    outside[[0, 1, 4, 5]] = torch.randn((4, B, *shape), generator=gen)
    inside[3] = torch.randn((B, *shape), generator=gen)
    assert torch.equal(run(outside).sample, traj.sample)      # the ODE outside ignores its noise
    assert not torch.equal(run(inside).sample, traj.sample)   # the SDE inside does not
    # the window ends before the last step: the sample is x_0, not the window's last latents
    assert not torch.equal(traj.sample, traj.latents[:, -1])


def test_an_epoch_trains_only_the_window_steps(trainer, monkeypatch):
    t = trainer
    calls = []
    real = t.epoch_trainer.micro_step_loss

    def counting(cur, nxt, old_lp, idx, cond, adv, cols, *rest):
        calls.append(sorted(set(idx.index_select(1, cols).flatten().tolist())))
        return real(cur, nxt, old_lp, idx, cond, adv, cols, *rest)

    t.epoch_trainer.micro_step_loss = counting
    t.report.tracker = SimpleNamespace(log=lambda *a, **k: None)  # (no tracker: the run was not started)
    sampled = t.sample_epoch(0)
    rewards = t.gather_rewards(0, sampled)
    t.train_epoch(0, t.epoch_samples(0, sampled, rewards))
    # 8 samples in 2 train batches of 4, 2 window steps each (1 fused per micro-step off TPU): 4 micro-steps, steps 2-3
    assert len(calls) == 4 and {s for c in calls for s in c} == {2, 3}


# On XLA a sliding window compiles nothing after epoch 0: tests/e2e/test_flow_grpo_e2e.py's XLA run slides it
# beside the other things that move between epochs.


@pytest.mark.slow
def test_a_random_window_run_resumes_to_the_same_weights(tmp_path, model_cache):
    """Stopped after epoch 1 and resumed, a run with random windows ends where an uninterrupted one ends: the windows
    of epoch 2 are drawn from the seed, not from anything the first process held."""
    import torch
    from safetensors.torch import load_file

    from ddpo_tpu.training import loop
    from ddpo_tpu.rundir.files import RunDir
    from ddpo_tpu.runtime import make_runtime

    def fit(run_dir, epochs: int):
        v = compose_and_validate([*FLOW, f"model.cache_dir={model_cache}", "reward.host_workers=0",
                                  f"num_epochs={epochs}", "save_freq=1", "sample.batch_size=8",
                                  "sample.num_batches_per_epoch=1", "train.batch_size=4",
                                  "train.gradient_accumulation_steps=2", "sample.sde_window.size=2",
                                  "sample.sde_window.range=[0,5]"])
        run_dir.mkdir(exist_ok=True)
        t = loop.Trainer(v.cfg, make_runtime(v.cfg), RunDir(run_dir), tree=v.tree,
                         stop=SimpleNamespace(requested=False))
        t.resume()
        t.fit()

    fit(tmp_path / "whole", 3)
    fit(tmp_path / "split", 2)
    fit(tmp_path / "split", 3)  # resumes after epoch 1
    whole, split = (load_file(tmp_path / d / "weights" / "final.safetensors") for d in ("whole", "split"))
    assert whole.keys() == split.keys() and all(torch.equal(whole[k], split[k]) for k in whole)
