"""DiffusionNFT on the Wan family (`algorithm=nft` with model.family=wan): it composes with the settings the family
needs (the wan_sde sampler's ODE solver, Wan's own transformer timesteps, CFG-free), and one eager epoch on the tiny
Wan samples videos with the old policy's ODE, trains on the forward process of the video latents and moves the LoRA
weights. Short on purpose: 4 videos of 5 frames, 3 steps, one optimizer step."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ddpo_tpu.config.compose import ConfigError, compose_and_validate

NFT_WAN = ["+experiment=wan_grpo_smoke", "algorithm=nft", "algorithm.beta=0.1", "algorithm.adv_clip_max=1",
           "algorithm.group_size=2"]
ONE_EPOCH = ["num_epochs=1", "sample.batch_size=4", "sample.num_batches_per_epoch=1", "sample.num_steps=3",
             "train.batch_size=4", "train.gradient_accumulation_steps=1"]


def test_nft_composes_on_wan_and_keeps_its_rules():
    cfg = compose_and_validate(NFT_WAN).cfg
    assert (cfg.algorithm.name, cfg.model.family, cfg.sample.name) == ("nft", "wan", "wan_sde")
    assert cfg.sample.ode_solver == "euler" and not cfg.train.cfg and cfg.sample.guidance_scale == 1
    with pytest.raises(ConfigError) as e:  # trunc(sigma x 1000) is SD3's rollout timestep, Wan takes UniPC's own
        compose_and_validate([*NFT_WAN, "algorithm.integer_rollout_timesteps=true"])
    assert [p.key for p in e.value.problems] == ["algorithm.integer_rollout_timesteps"]
    with pytest.raises(ConfigError) as e:  # CFG-free, as on every family
        compose_and_validate([*NFT_WAN, "sample.guidance_scale=4.5"])
    assert "sample.guidance_scale" in [p.key for p in e.value.problems]
    # GRPO on the same family: the sampler's ODE solver is set and unread, as flow_sde's
    assert compose_and_validate(["+experiment=wan_grpo_smoke"]).cfg.sample.ode_solver == "euler"


@pytest.mark.parametrize("solver", ["euler", pytest.param("dpm2", marks=pytest.mark.slow)])  # the official solver
def test_one_nft_epoch_on_the_tiny_wan_moves_the_weights(tmp_path, model_cache, solver):
    from ddpo_tpu.rundir.files import RunDir
    from ddpo_tpu.runtime import make_runtime
    from ddpo_tpu.training import loop
    from tests.helpers import read_metrics

    v = compose_and_validate([*NFT_WAN, *ONE_EPOCH, f"model.cache_dir={model_cache}", f"sample.ode_solver={solver}"])
    trainer = loop.Trainer(v.cfg, make_runtime(v.cfg), RunDir(tmp_path), tree=v.tree,
                           stop=SimpleNamespace(requested=False))
    before = [p.detach().clone() for p in trainer.state.params]
    trainer.fit()
    (epoch,) = read_metrics(tmp_path, "epoch")
    assert np.isfinite(epoch["reward_mean"]) and epoch["reward_mean"] < 0  # minus kilobytes per frame
    (step,) = read_metrics(tmp_path, "step")
    assert np.isfinite(step["loss"]) and step["positive_loss"] > 0 and step["negative_loss"] > 0
    moved = [not torch.equal(b, p.detach()) for b, p in zip(before, trainer.state.params)]
    assert any(moved) and all(torch.isfinite(p).all() for p in trainer.state.params)
    assert tuple(trainer.family.latent_shape) == (16, 2, 4, 4)  # 5 frames: two latent frames
