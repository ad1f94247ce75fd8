"""conf/ ships inside the wheel (as ddpo_tpu/conf) and is found there, not only in a checkout."""

from __future__ import annotations

import subprocess
import sys
import zipfile

import pytest

from tests.helpers import REPO, clean_env

pytestmark = pytest.mark.slow  # builds a wheel with pip (7-12 s)

PROBE = """
import sys
sys.path.insert(0, sys.argv[1])
from ddpo_tpu.config.compose import compose_and_validate, conf_dir
assert str(conf_dir()).startswith(sys.argv[1]), conf_dir()
v = compose_and_validate(["+experiment=compressibility_parity"])
print(conf_dir(), v.cfg.parity.name)
"""


def test_wheel_ships_conf_and_uses_it(tmp_path):
    out = tmp_path / "wheel"
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w",
                            str(out), str(REPO)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert build.returncode == 0, build.stderr[-2000:]
    # a data folder missing from pyproject's packages list: setuptools prints a 25-line warning box per folder
    assert "is absent from the `packages` configuration" not in build.stdout + build.stderr
    wheel = next(out.glob("ddpo_tpu-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    shipped_conf = {f"ddpo_tpu/conf/{p.relative_to(REPO / 'conf').as_posix()}" for p in (REPO / "conf").rglob("*.yaml")}
    assert shipped_conf - set(names) == set(), "conf/ files missing from the wheel"
    # every module ships: a subpackage left out of pyproject's `packages` list is missing from a wheel install (the
    # probe below cannot see that where an editable install of this checkout answers the import in its place)
    modules = {p.relative_to(REPO).as_posix() for p in (REPO / "ddpo_tpu").rglob("*.py")}
    assert modules - set(names) == set(), "modules missing from the wheel: add their package to pyproject.toml"
    for required in ("ddpo_tpu/conf/config.yaml", "ddpo_tpu/conf/experiment/compressibility_parity.yaml",
                     "ddpo_tpu/conf/tpu_topology/v6e-16.yaml", "ddpo_tpu/conf/reward_local/aesthetic_tiny.yaml",
                     "ddpo_tpu/prompts/assets/imagenet_classes.txt", "ddpo_tpu/env.py",
                     "ddpo_tpu/prompts/assets/edit_tiny/train_metadata.jsonl",
                     "ddpo_tpu/prompts/assets/edit_tiny/images/0_ref.png", "ddpo_tpu/models/assets/digits.csv.gz"):
        assert required in names, required
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    env = clean_env()
    env.pop("PYTHONPATH", None)
    probe = subprocess.run([sys.executable, "-c", PROBE, str(site)], capture_output=True, text=True, timeout=120,
                           cwd=tmp_path, env=env)
    assert probe.returncode == 0, probe.stderr[-2000:]
    assert probe.stdout.split() == [str(site / "ddpo_tpu" / "conf"), "ddpo_pytorch_compressibility"]
