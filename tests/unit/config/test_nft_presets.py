"""The official DiffusionNFT presets as experiments (NVlabs/DiffusionNFT@24af5554898d85e93efa492f42b5e9cdf4156e9b,
config/nft.py and config/base.py): each composes and validates with the values of that file (machine checks aside:
they need SD 3.5 Medium and a TPU), and parity=nft_sd3 holds them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ddpo_tpu.catalog.algorithms import integer_rollout_timesteps
from ddpo_tpu.config import batch
from ddpo_tpu.config.compose import ConfigError, compose_and_validate

pytestmark = pytest.mark.torch_free  # no torch in the test or what it starts (tests/conftest.py)

DATA = Path(__file__).parents[2] / "data" / "flow_grpo"  # a few rows of the references' dataset folders (tests/data)


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> dict[str, Path]:
    """Placeholder files for the rewards' weights (HPSv2.1's .pt, Mask2Former's .pth): the checks look for the files."""
    root = tmp_path_factory.mktemp("weights")
    out = {"hps": root / "HPS_v2.1_compressed.pt", "m2f": root / "mask2former_swin-s-p4-w7-224_lsj_8x2_50e_coco.pth"}
    for path in out.values():
        path.write_bytes(b"placeholder")
    return out


NEEDS = {  # what each preset leaves to the user besides its dataset; this interpreter stands in for the reward envs
    "ocr": lambda w: [f"reward.process.python={sys.executable}"],
    "geneval": lambda w: [f"reward.process.python={sys.executable}", f"reward.detector_model={w['m2f']}"],
    "hpsv2": lambda w: [f"reward.checkpoint={w['hps']}"],
    "multi_reward": lambda w: [f"reward.components.2.checkpoint={w['hps']}"],
}


@pytest.fixture
def preset(weights):
    def compose(name: str, *overrides: str):
        data = DATA / ("geneval" if name == "geneval" else "ocr")  # pickscore's train.txt is read as ocr's is
        extra = NEEDS.get(name, lambda w: [])(weights)
        return compose_and_validate([f"+experiment=nft_sd3_{name}", f"prompts.path={data}", *extra,
                                     *overrides]).cfg

    return compose


@pytest.mark.parametrize("name,beta,steps,accum,decay,reward", [
    # nft.py:97-109, 82-94, 112-119: _get_config's values (beta 1: nft.py:61, decay_type 1: nft.py:60)
    ("pickscore", 1.0, 10, 144, (0, 0.001, 0.5), "pickscore"),
    ("geneval", 1.0, 10, 144, (0, 0.001, 0.5), "geneval"),
    ("hpsv2", 1.0, 10, 144, (0, 0.001, 0.5), "hpsv2"),
    # nft.py:70-79: beta 0.1, decay_type 2 (flat 75, uprate 0.0075, uphold 0.999), gradient_step_per_epoch 2
    ("ocr", 0.1, 10, 72, (75, 0.0075, 0.999), "ocr"),
    # nft.py:122-138: 25 steps, beta 0.1, PickScore + HPSv2 + CLIPScore
    ("multi_reward", 0.1, 25, 144, (0, 0.001, 0.5), "weighted"),
])
def test_presets_compose_with_the_official_values(preset, name, beta, steps, accum, decay, reward):
    cfg = preset(name)
    a, s, t = cfg.algorithm, cfg.sample, cfg.train
    assert (a.name, a.beta, a.kl_beta, a.adv_clip_max, a.group_size) == ("nft", beta, 1e-4, 5.0, 24)
    assert (a.decay_start, a.decay_rate, a.decay_max) == decay and a.ode_sampling and integer_rollout_timesteps(cfg)
    assert (s.name, s.ode_solver, s.num_steps, s.guidance_scale) == ("flow_sde", "dpm2", steps, 1.0)
    assert (t.learning_rate, t.timestep_fraction, t.cfg, t.max_grad_norm, t.num_inner_epochs) == (3e-4, 0.99, False,
                                                                                                  1.0, 1)
    assert (t.ema, t.ema_decay, t.ema_every) == (True, 0.9, 1)  # base.py:92, train_nft_sd3.py:567
    assert (cfg.model.name, cfg.model.resolution, cfg.model.lora.rank, cfg.model.lora.alpha) == ("sd35_medium", 512,
                                                                                                  32, 64)
    tot = batch.totals(cfg)
    assert tot.samples_per_epoch == 1152 == 48 * 24  # nft.py:28-29
    # one optimizer step an epoch; two for OCR (nft.py:43-45: accumulation = 16 batches / gradient_step_per_epoch)
    assert tot.total_train_batch == (576 if name == "ocr" else 1152)
    assert t.gradient_accumulation_steps == accum and cfg.reward.name == reward
    if name == "multi_reward":
        assert [c["name"] for c in cfg.reward.model_dump()["components"]] == ["pickscore", "clip_score", "hpsv2"]
    assert cfg.prompts.name == "dataset"  # the reference's dataset folder


def test_the_parity_group_holds_the_official_values(preset):
    for key in ("algorithm.beta=0.5", "algorithm.kl_beta=0.01", "sample.ode_solver=euler", "train.timestep_fraction=1"):
        with pytest.raises(ConfigError) as e:
            preset("pickscore", key)
        assert key.split("=")[0] in {p.key for p in e.value.problems}, e.value.problems
    assert preset("pickscore", "algorithm.beta=0.5", "parity=none").algorithm.beta == 0.5


@pytest.mark.parametrize("name,key,value", [
    ("geneval", "algorithm.beta", "0.5"), ("hpsv2", "algorithm.beta", "0.5"),  # their own pin is the reward's name
    ("ocr", "algorithm.decay_start", "0"), ("multi_reward", "sample.num_steps", "10"),
])
def test_each_presets_own_pins_refuse_a_change_and_parity_none_lifts_them(preset, name, key, value):
    """The presets' own pins live in parity groups (conf/parity/nft_sd3_<name>.yaml): pins set inside an experiment
    merged into whichever group was chosen, so parity=none, the fix the error names, kept refusing."""
    with pytest.raises(ConfigError) as e:
        preset(name, f"{key}={value}")
    assert key in {p.key for p in e.value.problems}, e.value.problems
    assert "parity=none" in str(e.value)
    cfg = preset(name, f"{key}={value}", "parity=none")
    assert cfg.parity.name == "none" and not cfg.parity.pinned


def test_no_experiment_pins_values_outside_a_parity_group():
    import yaml

    from ddpo_tpu.config.topology import conf_dir

    for path in sorted((conf_dir() / "experiment").glob("*.yaml")):
        assert "parity" not in (yaml.safe_load(path.read_text()) or {}), f"{path.name}: move its pins to conf/parity/"


def test_no_experiment_points_at_a_reward_server():
    """Every paper preset computes its reference's reward (in-process, or in an environment of its own through
    reward.process.python): none trains on a placeholder server URL (issue 38)."""
    import yaml

    from ddpo_tpu.config.topology import conf_dir

    def walk(node):
        if isinstance(node, dict):
            yield node
            for v in node.values():
                yield from walk(v)
        elif isinstance(node, list):
            for v in node:
                yield from walk(v)

    for path in sorted((conf_dir() / "experiment").glob("*.yaml")):
        text = path.read_text()
        tree = yaml.safe_load(text) or {}
        assert "/reward: remote" not in text, path.name
        assert not [n for n in walk(tree) if n.get("name") == "remote" or "url" in n], path.name
