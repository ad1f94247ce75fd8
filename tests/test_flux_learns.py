"""`+experiment=flux_grpo_smoke` learns: Flow-GRPO on the tiny FLUX model (packed latents, the guidance embedding, the
shifted schedule) raises the mean JPEG compressibility over its 20 epochs on eager CPU, by several standard errors,
and ends above a frozen-policy control (the same run at learning rate 1e-9: the same prompts and noise, a policy that
does not move). Run in-process: about 1.5 minutes for each run on one thread of a quiet machine."""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers.learning import smoke_rewards, z

# FLUX's learning curve is the extended tier's (docs/testing.md): CI runs GRPO's on SD 3 (test_flow_grpo_learns.py)
# and FLUX's own parts against diffusers (test_flux_parity.py) and compiled on XLA (test_xla_families.py)
pytestmark = [pytest.mark.slow, pytest.mark.extended]

WINDOW = 5  # epochs at each end of the run
# Measured here (rise of the last 5 epochs' mean reward over the first 5, in pooled standard errors): seed 0 z = 5.6
# (+0.0106 kB), seed 1 z = 10.3 (+0.0136 kB); the control (seed 0, learning rate 1e-9) z = 0.4 (+0.0004 kB), its last
# 5 epochs 0.0113 kB below the trained run's (6.4 standard errors).
MIN_Z = 4.0


def run(tmp_path, model_cache, *overrides) -> np.ndarray:
    def check(cfg):
        assert cfg.model.family == "flux" and not cfg.train.cfg

    return smoke_rewards(tmp_path, model_cache, "flux_grpo_smoke", 20, 0.05, *overrides, check=check)


def test_flux_grpo_smoke_raises_jpeg_compressibility_over_a_frozen_control(tmp_path, model_cache):
    trained = run(tmp_path / "trained", model_cache)
    frozen = run(tmp_path / "frozen", model_cache, "train.learning_rate=1e-9")
    print(f"flux_grpo_smoke rewards {np.round(trained, 4).tolist()}, frozen {np.round(frozen, 4).tolist()}")
    assert trained[0] == frozen[0]  # the same first epoch: the control differs only in what training does
    assert z(trained[:WINDOW], trained[-WINDOW:]) > MIN_Z, trained.tolist()
    assert z(frozen[-WINDOW:], trained[-WINDOW:]) > MIN_Z, (trained.tolist(), frozen.tolist())
    assert abs(z(frozen[:WINDOW], frozen[-WINDOW:])) < MIN_Z / 2, frozen.tolist()
