"""The training process of an execution that does not run on torch_xla never imports it, though it is installed:
diffusers, accelerate and transformers import an installed torch_xla at their own import (worker.keep_torch_xla_out).
Measured in a fresh interpreter, as the worker starts: the config validated, then the libraries the Trainer uses."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import REPO, clean_env

PROBE = """
import sys
from ddpo_tpu.config.compose import compose_and_validate
from ddpo_tpu.worker import keep_torch_xla_out
keep_torch_xla_out(compose_and_validate([sys.argv[1]]).cfg)
import accelerate.utils, diffusers, transformers, peft
from diffusers import AutoencoderKL, UNet2DConditionModel
from diffusers.utils import is_torch_xla_available
print(sys.modules.get("torch_xla") is not None, is_torch_xla_available(), accelerate.utils.is_torch_xla_available())
"""


@pytest.mark.slow  # each case starts a fresh interpreter that imports torch and diffusers: 13-17 s here, over the
# fast tier's ~2 s a test (docs/testing.md)
@pytest.mark.requires("torch_xla")
@pytest.mark.parametrize("topology, imported", [("tpu_topology=eager_cpu", False), ("tpu_topology=cpu", True)])
def test_only_an_xla_execution_imports_torch_xla(topology, imported):
    out = subprocess.run([sys.executable, "-c", PROBE, topology], cwd=REPO, env=clean_env(), capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [str(imported)] * 3, out.stdout
