"""The smoke experiments' learning tests (tests/learning/test_learns.py): one in-process run of an experiment on eager
CPU and the z-score of a reward rise."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from tests.helpers import read_metrics


def smoke_rewards(tmp_path: Path, model_cache, experiment: str, epochs: int, kl_max: float | None, *overrides: str,
                  check=lambda cfg: None) -> np.ndarray:
    """Each epoch's mean reward of `+experiment=NAME` run to the end in this process (one torch thread, pytest's
    signal handlers kept); every epoch's KL finite and in [0, kl_max) unless kl_max is None; `check(cfg)` asserts
    what the run is."""
    import torch

    from ddpo_tpu.config.compose import compose_and_validate
    from ddpo_tpu.training import loop
    from ddpo_tpu.rundir.files import RunDir
    from ddpo_tpu.runtime import make_runtime

    torch.set_num_threads(1)
    v = compose_and_validate([f"+experiment={experiment}", f"model.cache_dir={model_cache}", *overrides])
    assert v.cfg.num_epochs == epochs
    check(v.cfg)
    tmp_path.mkdir(exist_ok=True)
    trainer = loop.Trainer(v.cfg, make_runtime(v.cfg), RunDir(tmp_path), tree=v.tree,
                           stop=SimpleNamespace(requested=False))
    trainer.fit()
    rows = read_metrics(tmp_path, "epoch")
    assert [e["epoch"] for e in rows] == list(range(epochs))
    if kl_max is not None:
        assert all(math.isfinite(e["kl"]) and 0 <= e["kl"] < kl_max for e in rows), [e["kl"] for e in rows]
    return np.array([e["reward_mean"] for e in rows])


def z(a: np.ndarray, b: np.ndarray) -> float:
    """(mean of b - mean of a) in standard errors of the difference of the two means."""
    return (b.mean() - a.mean()) / math.sqrt(a.var(ddof=1) / len(a) + b.var(ddof=1) / len(b))


def paired_z(control: np.ndarray, trained: np.ndarray) -> float:
    """The mean of the per-epoch differences trained - control in standard errors of that mean: the same epoch of
    both runs samples the same prompts and noise, so the difference removes what they do to the reward."""
    gain = trained - control
    return float(gain.mean() / (gain.std(ddof=1) / math.sqrt(len(gain))))
