"""The catalog is the one place a model family is known: a family registered from this test module (its spec, its
torch class, no YAML and no edit under ddpo_tpu/config/ or ddpo_tpu/launch/) composes, validates, passes the LoRA
check and trains an eager epoch. The front end reads every table from the catalog, without torch."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from ddpo_tpu.catalog import FAMILIES, REWARDS, SAMPLERS, family
from ddpo_tpu.config.compose import compose_and_validate
from ddpo_tpu.problems import ConfigError

pytestmark = pytest.mark.torch_free  # no torch in the test or what it starts (tests/conftest.py)

REPO = Path(__file__).resolve().parents[3]
TOY = "toy_family_of_a_test"


@pytest.fixture()
def toy_family():
    spec = dataclasses.replace(family("sd1"), name=TOY, title="a test-only family",
                               module="tests.helpers.toy_family:ToyFamily", memory=None)
    FAMILIES.register(spec)
    yield spec
    FAMILIES.unregister(TOY)


def test_an_unregistered_family_is_refused_naming_the_registered_ones():
    with pytest.raises(ConfigError) as e:
        compose_and_validate([f"model.family={TOY}"])
    p = e.value.problems[0]
    assert p.key == "model.family" and "no model family of this name" in p.reason
    assert "sd1" in str(p.fix) and "sd3" in str(p.fix)


def test_a_family_registered_by_a_test_composes_and_validates(toy_family):
    v = compose_and_validate(["+experiment=smoke", f"model.family={TOY}", "model.lora.enabled=true"])
    assert v.cfg.model.family == TOY
    from ddpo_tpu.launch import lora_targets

    assert lora_targets.problems(v.cfg.model) == []  # its LoRA layers are the spec's
    bad = v.cfg.model.model_copy(update={"lora": v.cfg.model.lora.model_copy(update={"target_modules": ["nope"]})})
    assert "toy_family_of_a_test family's denoiser" in lora_targets.problems(bad)[0]
    # its rules come from the spec: the sampler it samples with
    with pytest.raises(ConfigError) as e:
        compose_and_validate(["+experiment=smoke", f"model.family={TOY}", "sampler=flow_sde10"])
    assert any(p.key == "sample.name" and f"model.family={TOY} samples with ddim" in p.reason
               for p in e.value.problems)


@pytest.mark.needs_torch
@pytest.mark.slow
def test_a_family_registered_by_a_test_trains_an_eager_epoch(toy_family, tmp_path, model_cache):
    from ddpo_tpu.training import loop
    from ddpo_tpu.rundir.files import RunDir
    from ddpo_tpu.runtime import make_runtime

    v = compose_and_validate(["+experiment=smoke", f"model.family={TOY}", "num_epochs=1", "reward.host_workers=0",
                              "sample.num_batches_per_epoch=1", f"model.cache_dir={model_cache}"])
    trainer = loop.Trainer(v.cfg, make_runtime(v.cfg), RunDir(tmp_path), tree=v.tree,
                           stop=SimpleNamespace(requested=False))
    trainer.resume()
    trainer.fit()
    assert type(trainer.family).__name__ == "ToyFamily" and type(trainer.family).encoded >= 8
    assert (tmp_path / "weights" / "final.safetensors").is_file()


def test_config_and_launch_name_no_family_reward_or_sampler():
    """What a family, reward or sampler is lives in the catalog: no module of the front end spells one out."""
    # (reward=weighted's schema is the one the schema builds from the others: its name is the schema's)
    names = [*(f.name for f in FAMILIES), *(r.name for r in REWARDS if not r.composite), *(s.name for s in SAMPLERS),
             *(b for f in FAMILIES for b in f.builders)]
    for folder in ("config", "launch"):
        for path in (REPO / "ddpo_tpu" / folder).glob("*.py"):
            text = path.read_text()
            for name in names:
                assert f'"{name}"' not in text and f"'{name}'" not in text, \
                    f"{path.relative_to(REPO)} spells out {name!r}"


def test_the_catalog_and_the_front_end_do_not_import_torch():
    code = ("import sys, ddpo_tpu.catalog, ddpo_tpu.config.compose, ddpo_tpu.config.rules;"
            "assert sys.modules.get('torch') is None, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)
