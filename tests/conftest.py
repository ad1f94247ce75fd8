"""Shared fixtures only; helpers live in tests/helpers (`from tests.helpers import ...`)."""

from __future__ import annotations

from pathlib import Path

import pytest

# Re-exported for the test files that still import them from conftest (test_status.py, test_launch_pod.py) until
# they import from tests.helpers; nothing else should.
from tests.helpers import REPO, clean_env, read_metrics, run_train  # noqa: F401


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory) -> Path:
    """One tiny-model build for the whole session (each run loads it through from_pretrained)."""
    return tmp_path_factory.mktemp("models")
