"""The typed reward configs (ddpo_tpu/config/schema.py): one model per reward, a union keyed on `name`; they match the
reward constructors, round-trip the group's YAML, keep configs saved before them valid and resumable, and build the
reward (rewards/from_config.py) with `tiny` resolved in one place."""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path
from typing import get_args

import pytest
from omegaconf import OmegaConf
from pydantic import TypeAdapter, ValidationError

from ddpo_tpu.config.compose import compose, compose_and_validate, to_tree, validate
from ddpo_tpu.config.resume import changed_keys, resume_relevant
from ddpo_tpu.catalog import REWARDS as SPECS
from ddpo_tpu.catalog import TINY
from ddpo_tpu.config.schema import RewardComponent, RewardConfig, WeightedConfig
from ddpo_tpu.rewards import REWARDS
from ddpo_tpu.rewards.from_config import reward_from_config, reward_kwargs

pytestmark = pytest.mark.torch_free  # no torch in the test or what it starts (tests/conftest.py)

REPO = Path(__file__).resolve().parents[3]
REWARD_CONFIGS = {m.model_fields["name"].annotation.__args__[0]: m for m in get_args(get_args(RewardConfig)[0])}
COMPONENTS = {m.model_fields["name"].annotation.__args__[0]: m for m in get_args(get_args(RewardComponent)[0])}
NOT_CONSTRUCTOR_KEYS = {"name", "host_workers", "weight", "frame_reduction",  # frame_reduction: rewards/video.py
                        "process"}  # process: where the run's reward runs (rewards/managed.py)

# the reward group of configs saved before the typed union (the YAML of conf/reward/ then): no reward.quality,
# reward.batch_size for aesthetic or reward.headers; a resume must accept them and see no change
OLD_REWARD_GROUPS = {
    "jpeg_compressibility": {"name": "jpeg_compressibility", "host_workers": 2},
    "aesthetic": {"name": "aesthetic", "host_workers": 0, "clip_model": "tiny", "mlp_path": "tiny"},
    "remote": {"name": "remote", "host_workers": 2, "url": "http://127.0.0.1:8765/score", "timeout_s": 30.0,
               "retries": 3, "backoff_s": 0.5, "batch_size": 16, "image_format": "png"},
    "weighted": {"name": "weighted", "host_workers": 2, "components": [
        {"name": "jpeg_compressibility", "weight": 1.0},
        {"name": "remote", "weight": 1.0, "url": "http://127.0.0.1:8765/score", "timeout_s": 30.0, "retries": 3,
         "batch_size": 16}]},
}


def test_one_model_per_registered_reward_with_the_constructors_keys():
    # feature models (catalog entries with features=True) are registered beside the rewards but score nothing
    features = {r.name for r in SPECS if r.features}
    builtin = {n for n in REWARDS if not n.startswith("_")} - features
    assert set(REWARD_CONFIGS) == builtin and "clip_features" in features
    assert set(COMPONENTS) == builtin - {"weighted"}  # a weighted sum of weighted sums is one weighted sum
    for name, model in REWARD_CONFIGS.items():
        params = inspect.signature(REWARDS[name]).parameters
        keys = set(model.model_fields) - NOT_CONSTRUCTOR_KEYS
        assert keys <= set(params), (name, keys - set(params))
        assert "host_workers" in model.model_fields
        if name in COMPONENTS:
            # an image reward has frame_reduction (how a video model reduces its frames' scores), a video reward not
            assert ("frame_reduction" in model.model_fields) == (SPECS.get(name).takes == "images")
            assert set(COMPONENTS[name].model_fields) == keys | {"name", "weight"} | (
                {"frame_reduction"} & set(model.model_fields))
            for key in keys:  # a component's defaults are the constructor's (its YAML file gives the run's)
                default = params[key].default
                if default is not inspect.Parameter.empty:
                    assert COMPONENTS[name].model_fields[key].default == default, (name, key)


def test_strict_frozen_and_finite():
    adapter = TypeAdapter(RewardConfig)
    cfg = adapter.validate_python({"name": "remote", "host_workers": 1, "url": "http://h:1/s"})
    with pytest.raises(ValidationError):
        cfg.url = "http://other:1/s"  # frozen
    for bad in ({"timeout_s": "30"}, {"retries": 1.5}, {"backoff_s": float("nan")}, {"bogus": 1}):
        with pytest.raises(ValidationError):
            adapter.validate_python({"name": "remote", "host_workers": 1, "url": "http://h:1/s", **bad})
    with pytest.raises(ValidationError):
        adapter.validate_python({"name": "weighted", "host_workers": 1,
                                 "components": [{"name": "jpeg_compressibility", "weight": float("inf")}]})


@pytest.mark.parametrize("reward", sorted(p.stem for p in (REPO / "conf" / "reward").glob("*.yaml")))
def test_each_reward_group_validates_to_its_model_and_dumps_back_the_same_tree(reward, tmp_path):
    overrides = ["+experiment=smoke", f"reward={reward}"]
    if SPECS.get(reward).takes_sources:  # it scores against the prompts' source pictures: an edit dataset's
        overrides += ["prompts=dataset", "prompts.path=edit_tiny"]
    if SPECS.get(reward).takes == "videos":  # a video model (the real one: reward_local has no tiny keys for it)
        overrides = ["+experiment=wan_grpo_smoke", f"reward={reward}", "model=wan21_t2v_1_3b",
                     "train.mixed_precision=bf16"]
    if reward == "aesthetic":  # the group's own keys, not reward_local's tiny stand-ins
        (tmp_path / "mlp.pth").write_bytes(b"")
        overrides += ["model=sd14_random", f"reward.mlp_path={tmp_path / 'mlp.pth'}"]
    if reward in ("ocr", "geneval"):
        # their defaults are the references' backends (PaddleOCR; mmdet + a checkpoint) and need quoted / metadata
        # prompts: refused here by design (tests/unit/rewards/test_ocr_reward.py, test_geneval_reward.py); the group
        # itself is read
        tree = to_tree(compose(overrides))
        reward_cfg = TypeAdapter(RewardConfig).validate_python(tree["reward"])
    else:
        v = compose_and_validate(overrides)
        reward_cfg, tree = v.cfg.reward, v.tree
    assert type(reward_cfg) is REWARD_CONFIGS[reward]
    # what is saved (config.yaml, the tree) and what the union reads back are the same, key for key
    assert TypeAdapter(RewardConfig).dump_python(reward_cfg, exclude_unset=True) == tree["reward"]
    assert set(tree["reward"]) == set(REWARD_CONFIGS[reward].model_fields)  # the YAML lists every key


@pytest.mark.parametrize("reward", sorted(OLD_REWARD_GROUPS))
def test_a_config_saved_before_the_typed_union_still_validates_and_resumes(tmp_path, reward):
    overrides = ["+experiment=smoke", f"reward={reward}"]
    now = compose_and_validate(overrides).tree
    old = {**now, "reward": OLD_REWARD_GROUPS[reward]}
    saved = tmp_path / "config.yaml"
    OmegaConf.save(OmegaConf.create(old), saved)
    again = validate(OmegaConf.load(saved))  # what the training process does with a run dir's config.yaml
    assert again.cfg.reward.name == reward
    # the checkpoint stores resume_relevant(tree) of the run that saved it; a resume compares the new tree with it
    assert changed_keys(resume_relevant(old), resume_relevant(now)) == []
    # a real change still counts
    bumped = {**now, "reward": {**now["reward"], "host_workers": 1, "name": "jpeg_incompressibility"}}
    assert "reward.name" in changed_keys(resume_relevant(old), resume_relevant(bumped))


class _Device:
    def __init__(self, kind: str):
        self.type = kind

    def __str__(self) -> str:
        return f"{self.type}:0"


def test_kwargs_resolve_tiny_in_components_and_pass_cuda_to_torch_rewards_only(tmp_path, monkeypatch):
    import ddpo_tpu.rewards.tiny_clip as tiny_clip

    built = []
    monkeypatch.setattr(tiny_clip, "ensure_tiny_aesthetic",
                        lambda cache: built.append(cache) or (cache / "clip", cache / "mlp.safetensors"))
    cfg = WeightedConfig(name="weighted", host_workers=0, components=[
        {"name": "jpeg_compressibility", "weight": 0.5},
        {"name": "aesthetic", "weight": 2.0, "clip_model": TINY, "mlp_path": TINY},
        {"name": "remote", "url": "http://127.0.0.1:1/s", "headers": {"X-A": "b"}},
    ])
    kwargs = reward_kwargs(cfg, tmp_path, _Device("cuda"))
    assert set(kwargs) == {"components"}
    jpeg, aesthetic, remote = kwargs["components"]
    assert jpeg == {"name": "jpeg_compressibility", "weight": 0.5, "quality": 95}
    assert aesthetic == {"name": "aesthetic", "weight": 2.0, "clip_model": str(tmp_path / "clip"),
                         "mlp_path": str(tmp_path / "mlp.safetensors"), "batch_size": None, "device": "cuda:0"}
    assert remote["headers"] == {"X-A": "b"} and remote["weight"] == 1.0 and "device" not in remote
    assert built == [tmp_path]
    assert "device" not in reward_kwargs(cfg.components[1], tmp_path, _Device("xla"))  # XLA and CPU: the host CPU


def test_the_built_reward_of_a_weighted_config(tmp_path):
    import numpy as np

    v = compose_and_validate(["+experiment=smoke", "reward=weighted", "reward.components=[{name:jpeg_compressibility,"
                              "weight:2.0},{name:jpeg_incompressibility,weight:0.5,quality:50}]"])
    reward = reward_from_config(v.cfg.reward, model_cache_dir=str(tmp_path), device=_Device("cpu"),
                                should_stop=lambda: False)
    assert [c.quality for c in reward.components] == [95, 50] and reward.weights == (2.0, 0.5)
    images = np.random.default_rng(0).integers(0, 256, (2, 16, 16, 3), dtype=np.uint8)
    parts = [c(images, ["a", "b"]).astype(np.float64) for c in reward.components]
    np.testing.assert_array_equal(reward(images, ["a", "b"]), (2.0 * parts[0] + 0.5 * parts[1]).astype(np.float32))


def test_the_schema_imports_neither_torch_nor_numpy():
    code = ("import sys\nimport ddpo_tpu.config.schema\n"
            "heavy = [m for m in ('torch', 'numpy', 'PIL') if sys.modules.get(m) is not None]\n"
            "assert not heavy, heavy\n")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)
