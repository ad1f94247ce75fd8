"""Shared fixtures only; helpers live in tests/helpers (`from tests.helpers import ...`)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("torch_tpu") is not None:  # the TorchTPU environment, on a machine without a TPU
    from ddpo_tpu.env import keep_torchtpu_unloaded

    keep_torchtpu_unloaded()

# Re-exported for the test files that still import them from conftest (test_status.py, test_launch_pod.py) until
# they import from tests.helpers; nothing else should.
from tests.helpers import REPO, clean_env, read_metrics, run_train  # noqa: F401


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory) -> Path:
    """One tiny-model build for the whole session (each run loads it through from_pretrained)."""
    return tmp_path_factory.mktemp("models")


@pytest.fixture(autouse=True)
def _one_torch_thread_in_pytest():
    """torch in the pytest process computes with one intra-op thread. The tiny models gain nothing from two, and two
    spinning OpenMP threads collapse when anything else uses the 2 cores (measured: the fused micro-step gradient test
    70 s with two threads next to another test process, 11 s with one). Training processes the tests start keep
    torch's default; torch is not imported here for tests that check it stays unimported."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.get_num_threads() != 1:
        torch.set_num_threads(1)
    yield


HAS_TORCH_XLA = importlib.util.find_spec("torch_xla") is not None


def pytest_collection_modifyitems(config, items):
    """In the TorchTPU environment (requirements-torchtpu.txt: torch 2.15, no torch_xla) the tests of torch_xla's
    runtime skip, saying why; everything else runs there too."""
    if HAS_TORCH_XLA:
        return
    skip = pytest.mark.skip(reason="needs torch_xla, which this environment (the TorchTPU lockfile) does not have")
    for item in items:
        if "xla" in item.keywords:
            item.add_marker(skip)
