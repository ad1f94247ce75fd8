"""The smoke experiments' learning tests (tests/test_*_learns.py): one in-process run of an experiment on eager CPU
and the z-score of a reward rise."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from tests.helpers import read_metrics


def smoke_rewards(tmp_path: Path, model_cache, experiment: str, epochs: int, kl_max: float, *overrides: str,
                  check=lambda cfg: None) -> np.ndarray:
    """Each epoch's mean reward of `+experiment=NAME` run to the end in this process (one torch thread, pytest's
    signal handlers kept); every epoch's KL finite and in [0, kl_max); `check(cfg)` asserts what the run is."""
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
    assert all(math.isfinite(e["kl"]) and 0 <= e["kl"] < kl_max for e in rows), [e["kl"] for e in rows]
    return np.array([e["reward_mean"] for e in rows])


def z(a: np.ndarray, b: np.ndarray) -> float:
    """(mean of b - mean of a) in standard errors of the difference of the two means."""
    return (b.mean() - a.mean()) / math.sqrt(a.var(ddof=1) / len(a) + b.var(ddof=1) / len(b))


def assert_rises_over_frozen_control(name: str, trained: np.ndarray, frozen: np.ndarray, window: int,
                                     min_z: float) -> None:
    """The trained run's last `window` epochs beat its first by `min_z` standard errors and the frozen control's last
    by as many; the control (the same prompts and noise, a policy that does not move) moves under a quarter of the
    trained rise (a few epochs a side are too few to hold it to a z)."""
    print(f"{name} rewards {np.round(trained, 4).tolist()}, frozen {np.round(frozen, 4).tolist()}; "
          f"z trained {z(trained[:window], trained[-window:]):.1f}, over the control "
          f"{z(frozen[-window:], trained[-window:]):.1f}, control {z(frozen[:window], frozen[-window:]):.1f}")
    assert trained[0] == frozen[0]  # the same first epoch: the control differs only in what training does
    assert z(trained[:window], trained[-window:]) > min_z, trained.tolist()
    assert z(frozen[-window:], trained[-window:]) > min_z, (trained.tolist(), frozen.tolist())
    rise = lambda r: r[-window:].mean() - r[:window].mean()
    assert abs(rise(frozen)) < rise(trained) / 4, (trained.tolist(), frozen.tolist())
