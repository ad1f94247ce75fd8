"""`+experiment=z_image_grpo_smoke` learns: Flow-GRPO on the tiny Z-Image model (Qwen3 prompt states, the negated
velocity, Flow-Factory's Flow-SDE step, sampled as Turbo without guidance) raises the mean JPEG compressibility over
its 10 epochs on eager CPU, by several standard errors, and ends above a frozen-policy control (the same run at
learning rate 1e-9: the same prompts and noise, a policy that does not move). Run in-process, as
tests/test_qwen_image_learns.py."""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers.learning import assert_rises_over_frozen_control, smoke_rewards

# the extended tier (docs/testing.md): CI holds Z-Image's parts to the references (test_z_image_parity.py)
pytestmark = [pytest.mark.slow, pytest.mark.extended]

EPOCHS, WINDOW = 10, 3  # epochs of the smoke; epochs at each end of the run
MIN_Z = 4.0  # the rise of the last 3 epochs' mean reward over the first 3, in pooled standard errors


def run(tmp_path, model_cache, *overrides) -> np.ndarray:
    def check(cfg):
        assert cfg.model.family == "z_image" and cfg.sample.name == "flow_sde"

    return smoke_rewards(tmp_path, model_cache, "z_image_grpo_smoke", EPOCHS, 0.1, *overrides, check=check)


def test_z_image_grpo_smoke_raises_jpeg_compressibility_over_a_frozen_control(tmp_path, model_cache):
    trained = run(tmp_path / "trained", model_cache)
    frozen = run(tmp_path / "frozen", model_cache, "train.learning_rate=1e-9")
    assert_rises_over_frozen_control("z_image_grpo_smoke", trained, frozen, WINDOW, MIN_Z)
