"""`+experiment=wan_grpo_smoke` learns: Flow-GRPO on the tiny Wan text-to-video model (5-frame videos, video latents,
flow_grpo's Wan SDE on UniPC's flow sigmas, JPEG compressibility per frame averaged over the frames) raises the mean
reward over its 8 epochs on eager CPU, by several standard errors, and ends above a frozen-policy control (the same run
at learning rate 1e-9: the same prompts and noise, a policy that does not move). Run in-process, as
tests/test_flux_learns.py."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

from tests.helpers import read_metrics

pytestmark = pytest.mark.slow

EPOCHS, WINDOW = 8, 3  # epochs of the smoke; epochs at each end of the run
# Measured here (rise of the last 3 epochs' mean reward over the first 3, in pooled standard errors), seed 0: the
# trained run z = 6.5 (+0.0155 kB: -1.0317 -> -1.0104), its last 3 epochs 16.2 standard errors above the control's;
# the control (learning rate 1e-9) +0.0021 kB (z = 2.6: three epochs a side are few, and each epoch samples new prompts
# and noise), so the control is held to a small fraction of the trained rise rather than to a z.
MIN_Z = 4.0


def run(tmp_path, model_cache, *overrides) -> np.ndarray:
    import torch

    from ddpo_tpu.config.compose import compose_and_validate
    from ddpo_tpu.training import loop
    from ddpo_tpu.rundir.files import RunDir
    from ddpo_tpu.runtime import make_runtime

    torch.set_num_threads(1)
    v = compose_and_validate(["+experiment=wan_grpo_smoke", f"model.cache_dir={model_cache}", *overrides])
    assert v.cfg.num_epochs == EPOCHS and v.cfg.model.family == "wan" and v.cfg.sample.name == "wan_sde"
    tmp_path.mkdir(exist_ok=True)
    trainer = loop.Trainer(v.cfg, make_runtime(v.cfg), RunDir(tmp_path), tree=v.tree,
                           stop=SimpleNamespace(requested=False))  # keep pytest's own signal handlers
    trainer.fit()
    epochs = read_metrics(tmp_path, "epoch")
    assert [e["epoch"] for e in epochs] == list(range(EPOCHS))
    # Wan's KL divides by the step's std std_dev_t sqrt(-dt) (train_wan2_1.py), not SD 3's std_dev_t: at 6 steps about
    # 6x the scale of flux_grpo_smoke's bound (0.05); measured peak 0.11 (epoch 4)
    assert all(math.isfinite(e["kl"]) and 0 <= e["kl"] < 0.3 for e in epochs), [e["kl"] for e in epochs]
    return np.array([e["reward_mean"] for e in epochs])


def z(a: np.ndarray, b: np.ndarray) -> float:
    """(mean of b - mean of a) in standard errors of the difference of the two means."""
    return (b.mean() - a.mean()) / math.sqrt(a.var(ddof=1) / len(a) + b.var(ddof=1) / len(b))


def test_wan_grpo_smoke_raises_per_frame_jpeg_compressibility_over_a_frozen_control(tmp_path, model_cache):
    trained = run(tmp_path / "trained", model_cache)
    frozen = run(tmp_path / "frozen", model_cache, "train.learning_rate=1e-9")
    print(f"wan_grpo_smoke rewards {np.round(trained, 4).tolist()}, frozen {np.round(frozen, 4).tolist()}; "
          f"z trained {z(trained[:WINDOW], trained[-WINDOW:]):.1f}, over the control "
          f"{z(frozen[-WINDOW:], trained[-WINDOW:]):.1f}, control {z(frozen[:WINDOW], frozen[-WINDOW:]):.1f}")
    assert trained[0] == frozen[0]  # the same first epoch: the control differs only in what training does
    assert z(trained[:WINDOW], trained[-WINDOW:]) > MIN_Z, trained.tolist()
    assert z(frozen[-WINDOW:], trained[-WINDOW:]) > MIN_Z, (trained.tolist(), frozen.tolist())
    rise = lambda r: r[-WINDOW:].mean() - r[:WINDOW].mean()
    assert abs(rise(frozen)) < rise(trained) / 4, (trained.tolist(), frozen.tolist())
