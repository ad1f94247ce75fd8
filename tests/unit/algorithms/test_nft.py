"""DiffusionNFT (`algorithm=nft`): the loss against the paper's formula on hand-made inputs, the compose-time rules,
and the old policy's soft update."""

from __future__ import annotations

import math

import pytest
import torch

from ddpo_tpu.catalog.algorithms import integer_rollout_timesteps
from ddpo_tpu.config import batch
from ddpo_tpu.config.compose import ConfigError, compose_and_validate
from ddpo_tpu.algorithms.nft import nft_loss, optimality

NFT_SMOKE = ["+experiment=nft_smoke"]


def problems(overrides: list[str]) -> dict[str, str]:
    with pytest.raises(ConfigError) as e:
        compose_and_validate(overrides)
    return {p.key: f"{p.reason}; {p.fix}" for p in e.value.problems}


# --- the loss, from the formula ---------------------------------------------------------------------------------


def test_one_element_loss_and_gradient_worked_by_hand():
    # x0 = 1, x_t = 0.5 at t = 0.5, v = 0.2, v_old = 0.4, beta = 1, A = 2.5, c = 5:
    # r = (2.5 / 5) / 2 + 1/2 = 0.75; v+ = 0.2, v- = 2 x 0.4 - 0.2 = 0.6
    # x0+ = 0.5 - 0.5 x 0.2 = 0.4: error -0.6, L+ = 0.36 / 0.6 = 0.6; x0- = 0.5 - 0.3 = 0.2: error -0.8, L- = 0.64 / 0.8
    # loss = c (r L+ + (1 - r) L-) / beta = 5 (0.45 + 0.2) = 3.25
    # d/dv with the weights held fixed: dL+/dv = 2 (-0.6)(-t beta) / 0.6 = 1, dL-/dv = 2 (-0.8)(t beta) / 0.8 = -1,
    # so 5 (0.75 x 1 + 0.25 x -1) = 2.5 (a gradient through the weights would give another number)
    v = torch.tensor([[0.2]], dtype=torch.float64, requires_grad=True)
    one = lambda x: torch.tensor([[x]], dtype=torch.float64)
    loss, pos, neg, _ = nft_loss(v, one(0.4), one(0.5), one(1.0), one(0.5), torch.tensor([2.5], dtype=torch.float64),
                              beta=1.0, adv_clip_max=5.0)
    assert loss.item() == pytest.approx(3.25, abs=1e-12)
    assert (pos.item(), neg.item()) == pytest.approx((0.6, 0.8), abs=1e-12)
    loss.backward()
    assert v.grad.item() == pytest.approx(2.5, abs=1e-12)


def _formula(v, v_old, xt, x0, t, adv, beta, c):
    """The paper's objective written out sample by sample, element by element, in Python floats."""
    total = 0.0
    for i in range(len(x0)):
        r = min(max((max(-c, min(c, adv[i])) / c) / 2 + 0.5, 0.0), 1.0)
        terms = []
        for sign in (+1, -1):
            # v+ = beta v + (1 - beta) v_old; v- = (1 + beta) v_old - beta v
            vel = [beta * a + (1 - beta) * b if sign > 0 else (1 + beta) * b - beta * a for a, b in zip(v[i], v_old[i])]
            err = [x - t[i] * u - y for x, u, y in zip(xt[i], vel, x0[i])]
            mse = sum(e * e for e in err) / len(err)
            mae = max(sum(abs(e) for e in err) / len(err), 1e-5)
            terms.append(mse / mae)
        total += (r * terms[0] + (1 - r) * terms[1]) / beta
    return c * total / len(x0)


@pytest.mark.parametrize("beta,c", [(1.0, 5.0), (0.1, 1.0), (2.0, 3.0)])
def test_batch_loss_equals_the_formula(beta, c):
    g = torch.Generator().manual_seed(0)
    B, shape = 4, (2, 3, 3)
    v, v_old, x0, noise = (torch.randn((B, *shape), generator=g, dtype=torch.float64) for _ in range(4))
    t = torch.tensor([0.9, 0.5, 0.2, 1.0], dtype=torch.float64)
    xt = (1 - t.view(-1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1) * noise
    adv = torch.tensor([7.0, -0.3, 0.0, -9.0], dtype=torch.float64)  # clipped at +-c on both sides
    loss, _, _, _ = nft_loss(v, v_old, xt, x0, t.view(-1, 1, 1, 1), adv, beta, c)
    flat = lambda x: x.reshape(B, -1).tolist()
    want = _formula(flat(v), flat(v_old), flat(xt), flat(x0), t.tolist(), adv.tolist(), beta, c)
    assert loss.item() == pytest.approx(want, rel=1e-12)


def test_optimality_maps_advantages_into_0_1():
    r = optimality(torch.tensor([-10.0, -5.0, 0.0, 2.5, 5.0, 10.0]), 5.0)
    assert r.tolist() == [0.0, 0.0, 0.5, 0.75, 1.0, 1.0]


def test_on_policy_zero_advantage_has_no_gradient():
    # v = v_old and r = 1/2: the positive and negative terms pull equally and oppositely
    g = torch.Generator().manual_seed(1)
    x0, xt, v_old = (torch.randn(3, 4, generator=g) for _ in range(3))
    v = v_old.clone().requires_grad_(True)
    loss, pos, neg, _ = nft_loss(v, v_old, xt, x0, torch.full((3, 1), 0.7), torch.zeros(3), 1.0, 5.0)
    loss.backward()
    assert torch.allclose(pos, neg) and v.grad.abs().max() < 1e-6


# --- compose-time rules ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("topology,replicas", [("eager_cpu", 1), ("cpu", 1), ("cpu_spmd4", 4)])
def test_nft_smoke_composes_on_its_topologies(topology, replicas):
    cfg = compose_and_validate([*NFT_SMOKE, f"tpu_topology={topology}"]).cfg
    assert cfg.algorithm.name == "nft" and cfg.model.family == "sd3" and not cfg.train.cfg
    assert cfg.sample.guidance_scale == 1 and cfg.tpu_topology.replicas == replicas
    assert batch.totals(cfg).samples_per_epoch % cfg.algorithm.group_size == 0


def test_nft_needs_a_flow_family():
    found = problems(["+experiment=smoke", "algorithm=nft", "algorithm.group_size=4"])
    assert "not a flow family" in found["algorithm.name"] and "algorithm=ddpo" in found["algorithm.name"]


def test_nft_is_cfg_free():
    found = problems([*NFT_SMOKE, "train.cfg=true", "sample.guidance_scale=4.5"])
    assert "CFG-free" in found["train.cfg"] and "train.cfg=false sample.guidance_scale=1" in found["train.cfg"]
    found = problems([*NFT_SMOKE, "sample.guidance_scale=4.5"])
    assert "sample.guidance_scale=1" in found["sample.guidance_scale"]


def test_nft_runs_on_flux_with_its_embedded_guidance_and_without_an_sde_window():
    flux = ["+experiment=flux_grpo_smoke", "algorithm=nft", "~algorithm.kl_beta"]
    # trunc(sigma x 1000) is the SD3 transformer's timestep (NVlabs' pipeline), not FLUX's: asked for, it is refused;
    # left to its default it resolves to the float on FLUX and the cast on SD3
    found = problems([*flux, "algorithm.integer_rollout_timesteps=true"])
    assert "SD3 transformer" in found["algorithm.integer_rollout_timesteps"]
    assert "algorithm.integer_rollout_timesteps=false" in found["algorithm.integer_rollout_timesteps"]
    cfg = compose_and_validate(flux).cfg
    assert cfg.algorithm.integer_rollout_timesteps is None and not integer_rollout_timesteps(cfg)
    assert integer_rollout_timesteps(compose_and_validate(NFT_SMOKE).cfg)
    # guidance_scale 3.5 is FLUX's embedding input, not CFG
    assert cfg.algorithm.name == "nft" and cfg.model.family == "flux" and cfg.sample.guidance_scale == 3.5
    found = problems([*NFT_SMOKE, "sample.sde_window.size=2"])
    assert "no window to train" in found["sample.sde_window.size"]


def test_nft_groups_split_the_epoch_and_each_sampling_batch():
    found = problems([*NFT_SMOKE, "algorithm.group_size=5"])
    assert "do not split into groups of 5" in found["algorithm.group_size"]
    found = problems([*NFT_SMOKE, "algorithm.group_size=32"])  # 128 samples, but a batch of 16
    assert "whole groups of 32" in found["algorithm.group_size"]


def test_nft_keys_belong_to_nft():
    assert "algorithm.beta" in problems([*NFT_SMOKE, "algorithm=grpo", "+algorithm.beta=1.0"])
    assert "algorithm.beta" in problems([*NFT_SMOKE, "algorithm.beta=0"])


def test_settings_nft_does_not_read_are_refused_naming_the_fix():
    # issue 32: each of these started a run and took no effect
    found = problems([*NFT_SMOKE, "train.adv_clip_max=2"])
    assert "algorithm.adv_clip_max" in found["train.adv_clip_max"]
    assert "no PPO ratio" in problems([*NFT_SMOKE, "train.clip_range=0.2"])["train.clip_range"]
    found = problems([*NFT_SMOKE, "sample.noise_level=0.5"])
    assert "ODE" in found["sample.noise_level"] and "algorithm.ode_sampling=false" in found["sample.noise_level"]
    compose_and_validate([*NFT_SMOKE, "sample.noise_level=0.5", "algorithm.ode_sampling=false",
                          "sample.ode_solver=euler"])  # the SDE reads it
    found = problems([*NFT_SMOKE, "algorithm.decay_rate=0", "algorithm.decay_max=0.3"])
    assert ("decay_rate=0" in found["algorithm.decay_max"]
            and "algorithm.decay_rate=0.001" in found["algorithm.decay_max"])
    assert "algorithm.decay_start" in problems([*NFT_SMOKE, "algorithm.decay_rate=0", "algorithm.decay_start=5"])
    # the dpm2 solver only where an ODE rollout reads it
    found = problems([*NFT_SMOKE, "algorithm.ode_sampling=false"])
    assert "sample.ode_solver=euler" in found["sample.ode_solver"]
    found = problems(["+experiment=flow_grpo_smoke", "sample.ode_solver=dpm2"])
    assert "GRPO samples with the SDE" in found["sample.ode_solver"]
    found = problems(["+experiment=smoke", "+sample.ode_solver=dpm2"])  # DDIM reads no such key
    assert "does not read it" in found["sample.ode_solver"]


def test_the_kl_term_needs_the_adapter():
    found = problems([*NFT_SMOKE, "model.lora.enabled=false"])
    assert "LoRA" in found["algorithm.kl_beta"] and "algorithm.kl_beta=0" in found["algorithm.kl_beta"]
    assert compose_and_validate([*NFT_SMOKE, "model.lora.enabled=false", "algorithm.kl_beta=0"]).cfg


# --- the old policy ---------------------------------------------------------------------------------------------


def test_old_policy_soft_update_follows_its_decay_schedule():
    from types import SimpleNamespace

    from ddpo_tpu.algorithms.nft import OldPolicy

    rt = SimpleNamespace(device=torch.device("cpu"), place_state=lambda *a: None, sync=lambda: None)  # all EMA uses
    p = torch.zeros(3)
    old = OldPolicy([p], rate=0.001, max_decay=0.5, rt=rt)  # decay_start 0
    p += 1.0
    old.update(0)  # d = 0: the old policy becomes the current weights
    assert old.shadow[0].tolist() == [1.0] * 3
    p += 1.0
    old.update(200)  # d = 0.2: 0.2 x 1 + 0.8 x 2
    assert old.shadow[0].tolist() == pytest.approx([1.8] * 3)
    p += 1.0
    old.update(10_000)  # d capped at 0.5: 0.5 x 1.8 + 0.5 x 3
    assert old.shadow[0].tolist() == pytest.approx([2.4] * 3)
    assert math.isclose(old.weight(10**6), 0.5)
