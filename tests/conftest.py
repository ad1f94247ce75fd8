"""Shared fixtures. The training process is always started the real way (python -m ddpo_tpu.train), with an
environment free of the variables ddpo_tpu owns; torch_xla is never initialised in the pytest process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def clean_env(**extra: str) -> dict[str, str]:
    from ddpo_tpu.launch.env import OWNED_VARIABLES

    env = {k: v for k, v in os.environ.items() if k not in OWNED_VARIABLES and k != "HYDRA_FULL_ERROR"}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory) -> Path:
    """One tiny-model build for the whole session (each run loads it through from_pretrained)."""
    return tmp_path_factory.mktemp("models")


def run_train(args: list[str], cwd: Path, timeout: float = 600, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ddpo_tpu.train", *args], cwd=cwd, env=clean_env(**env),
                          capture_output=True, text=True, timeout=timeout)


def read_metrics(run_dir: Path, kind: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("kind") == kind]
