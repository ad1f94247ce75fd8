"""GARDO's official presets as experiments (yifan123/flow_grpo@94e23ee5405ab7241fc1f75d30cac8147e2b1f53,
config/grpo_gardo.py, grpo_gardo.py:N below; config/base.py read at 54809b5, the store's only copy; the scripts
scripts/train_sd3_gardo.py (gardo:N, as docs/algorithms.md counts them) and scripts/train_flux_gardo.py): each composes
and validates with that file's values (machine checks aside: they need SD 3.5 Medium or FLUX.1-dev and a TPU), and its
parity group holds them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ddpo_tpu.config import batch
from ddpo_tpu.config.compose import ConfigError, compose_and_validate

pytestmark = pytest.mark.torch_free  # no torch in the test or what it starts (tests/conftest.py)

DATA = Path(__file__).parents[2] / "data" / "flow_grpo"  # a few rows of flow_grpo's dataset folders (tests/data)
FILES: dict[str, Path] = {}


@pytest.fixture(autouse=True, scope="module")
def placeholder_files(tmp_path_factory):
    """The rewards' weights have no hub default here (the LAION MLP, ImageReward.pt, Mask2Former's .pth, HPSv2's .pt):
    placeholder files stand in; the compose-time checks look for the files, not into them."""
    root = tmp_path_factory.mktemp("weights")
    for key, name in [("mlp", "sac+logos+ava1-l14-linearMSE.pth"), ("imagereward", "ImageReward.pt"),
                      ("m2f", "mask2former_swin-s-p4-w7-224_lsj_8x2_50e_coco.pth"), ("hps", "HPS_v2.1_compressed.pt")]:
        FILES[key] = root / name
        FILES[key].write_bytes(b"placeholder")
    (root / "med_config.json").write_text("{}")


def needs(name: str) -> list[str]:
    """What each preset leaves to the user: its dataset, the gate's weights, and its trained reward's environment
    (this interpreter stands in for the PaddleOCR / mmdet environment) and weights."""
    data = {"gardo_sd3_ocr": "ocr", "gardo_sd3_geneval": "geneval"}.get(name, "ocr")  # pickscore's is a txt as ocr's
    out = [f"prompts.path={DATA / data}", f"algorithm.kl_gate_rewards.0.mlp_path={FILES['mlp']}",
           f"algorithm.kl_gate_rewards.1.checkpoint={FILES['imagereward']}"]
    if name in ("gardo_sd3_ocr", "gardo_sd3_geneval"):
        out.append(f"reward.process.python={sys.executable}")
    if name == "gardo_sd3_geneval":
        out.append(f"reward.components.0.detector_model={FILES['m2f']}")
    if name == "gardo_flux_hps":
        out.append(f"reward.components.0.checkpoint={FILES['hps']}")
    return out


def preset(name: str, *overrides: str):
    return compose_and_validate([f"+experiment={name}", *needs(name), *overrides])


# name, model, steps, guidance, noise, timestep_fraction, kl_beta, per-device sample batch and batches (8 chips),
# drop_zero_advantage, num_epochs, the trained reward's component (name, weight)
PRESETS = [
    # general_ocr_sd3 (grpo_gardo.py:32-94): SD 3.5 M (:36), 10 steps (:37), guidance 4.5 (:39), noise 0.7 (base.py),
    # timestep_fraction 0.89 (:60), beta 0.04 (:62), 9 a GPU x 16 batches (:50-54), 100000 epochs (:73), the OCR
    # score alone (main_reward 'ocr', :79; gardo:799-801), the zero-advantage mask (gardo:877)
    ("gardo_sd3_ocr", "sd35_medium", 10, 4.5, 0.7, 0.89, 0.04, (9, 16), True, 100000, ("ocr", 1.0)),
    # geneval_sd3 (:97-138): general_ocr_sd3's values but beta 0.07 (:118), main_reward 'geneval' (:134)
    ("gardo_sd3_geneval", "sd35_medium", 10, 4.5, 0.7, 0.89, 0.07, (9, 16), True, 100000, ("geneval", 1.0)),
    # compressibility (:7-30): jpeg_compressibility (:27) at flow_grpo's -kB / 500 (flow_grpo/rewards.py), 100
    # epochs (:13); the rest general_ocr_sd3's (compressibility() alone does not run train_sd3_gardo.py)
    ("gardo_sd3_compressibility", "sd35_medium", 10, 4.5, 0.7, 0.89, 0.04, (9, 16), True, 100,
     ("jpeg_compressibility", 0.002)),
    # hps_flux (:141-186): FLUX.1-dev (:146), 6 steps (:147), guidance 3.5 (:149), noise 0.9 (:171),
    # timestep_fraction 0.7 (:161), beta 0.01 (:162), 3 a GPU x int(48 / (8 x 3 / 24)) = 48 batches (:144, 153-155),
    # 100000 epochs (:167), HPSv2 alone (main_reward 'hpsv2_score', :182); train_flux_gardo.py has no mask
    ("gardo_flux_hps", "flux1_dev", 6, 3.5, 0.9, 0.7, 0.01, (3, 48), False, 100000, ("hpsv2", 1.0)),
]


@pytest.mark.parametrize("name,model,steps,guidance,noise,fraction,beta,layout,drop,epochs,trained", PRESETS)
def test_presets_compose_with_the_official_values(name, model, steps, guidance, noise, fraction, beta, layout, drop,
                                                  epochs, trained):
    v = preset(name)
    cfg = v.cfg
    a, s, t = cfg.algorithm, cfg.sample, cfg.train
    assert (cfg.model.name, cfg.model.resolution, cfg.num_epochs) == (model, 512, epochs)  # resolution: :51, 108, 152
    assert (s.name, s.num_steps, s.guidance_scale, s.noise_level, s.sde_type) == ("flow_sde", steps, guidance, noise,
                                                                                 "sde")
    assert (s.batch_size, s.num_batches_per_epoch) == layout
    # base.py: learning rate 3e-4, clip_range 1e-4 (the scripts clip with train.clip_range, gardo:975-976; the
    # presets' clip_range_low/high, :75-76, are never read), adv_clip_max 5, max_grad_norm 1; one inner epoch
    # (:59, 116, 160); EMA on (:71, 121, 165) at decay 0.9 every 8 (gardo:470)
    assert (t.learning_rate, t.clip_range, t.adv_clip_max, t.max_grad_norm, t.num_inner_epochs) == (3e-4, 1e-4, 5.0,
                                                                                                    1.0, 1)
    assert (t.timestep_fraction, t.ema, t.ema_decay, t.ema_every) == (fraction, True, 0.9, 8)
    assert t.cfg == (model == "sd35_medium")  # base.py train.cfg True; FLUX.1-dev is guidance-distilled
    assert (a.name, a.group_size, a.kl_beta, a.drop_zero_advantage) == ("grpo", 24, beta, drop)  # 24: :53, 110, 154
    # compressibility(): kl_thres 3e-4 (:29), reset_freq 15 (:22; train_flux_gardo.py's literal 15); RiskCompensator's
    # base 0.1 (gardo:218, 632)
    assert (a.reference_reset_kl, a.reference_reset_every, a.kl_gate_share) == (3e-4, 15, 0.1)
    # the gate ranks the trained reward against aesthetic and imagereward (gardo:826); the features: DINOv3's stand-in
    assert [e.name for e in a.kl_gate_rewards] == ["aesthetic", "imagereward"]
    assert a.diversity_features.name == "clip_features"
    # the trained reward: main_reward's raw score alone, one component (the weights of reward_fn reach no loss)
    components = cfg.reward.model_dump()["components"]
    assert cfg.reward.name == "weighted" and [(c["name"], c["weight"]) for c in components] == [trained]
    # 8 GPUs (:50, 100, 144): 1152 samples an epoch = 48 prompts x 24, two optimizer steps of 576 (:57-58, 114-115,
    # 158-159: accumulation = batches // 2)
    tot = batch.totals(cfg)
    assert (tot.samples_per_epoch, tot.total_train_batch) == (1152, 576)
    assert not [r for r in v.report if not r["ok"]]


@pytest.mark.parametrize("name,key,value", [
    ("gardo_sd3_ocr", "algorithm.kl_beta", "0.01"),                 # flow_grpo's PickScore beta: GARDO's OCR is 0.04
    ("gardo_sd3_ocr", "train.timestep_fraction", "0.99"),
    ("gardo_sd3_ocr", "algorithm.reference_reset_kl", "5e-4"),      # gardo:633's commented-out value
    ("gardo_sd3_geneval", "algorithm.kl_beta", "0.04"),
    ("gardo_sd3_compressibility", "algorithm.reference_reset_every", "10"),
    ("gardo_flux_hps", "algorithm.kl_beta", "0.04"),                # general_ocr_sd3's value, not hps_flux's
    ("gardo_flux_hps", "train.timestep_fraction", "0.99"),
])
def test_the_parity_group_holds_the_official_values(name, key, value):
    with pytest.raises(ConfigError) as e:
        preset(name, f"{key}={value}")
    assert key in {p.key for p in e.value.problems}, e.value.problems
    assert preset(name, f"{key}={value}", "parity=none").tree is not None


def test_the_presets_name_real_rewards_and_leave_weights_and_environments_to_the_user():
    with pytest.raises(ConfigError) as e:  # the weights have no hub default: named by their keys
        compose_and_validate(["+experiment=gardo_flux_hps", f"prompts.path={DATA / 'ocr'}"])
    assert {p.key for p in e.value.problems} >= {"algorithm.kl_gate_rewards.0.mlp_path",
                                                 "algorithm.kl_gate_rewards.1.checkpoint"}, e.value.render()
    # the OCR and GenEval backends (PaddleOCR, mmdet) run in an environment of their own: required
    for name in ("gardo_sd3_ocr", "gardo_sd3_geneval"):
        with pytest.raises(ConfigError) as e:
            compose_and_validate([f"+experiment={name}", *[o for o in needs(name) if "process" not in o]])
        assert "reward.process.python" in e.value.render(), name
    # no preset scores through a reward server: each trained reward and gate reward is computed by the run
    for name, *_ in PRESETS:
        cfg = preset(name).cfg
        names = [c["name"] for c in cfg.reward.model_dump()["components"]]
        names += [g.name for g in cfg.algorithm.kl_gate_rewards]
        assert "remote" not in names, (name, names)
