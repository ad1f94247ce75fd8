"""`+experiment=dppo_smoke` learns: Flow-DPPO (flow_grpo_smoke's group sampling and advantages, trained with the
trust-region mask on the Gaussian KL to the sampling policy in place of PPO-clip) on the tiny SD3 model raises the mean
JPEG compressibility over its epochs on eager CPU by several standard errors, and ends above a frozen-policy control
(the same run at learning rate 1e-9: the same prompts and noise, a policy that does not move), with the mask at work
(rows masked in every epoch). Run in-process, as tests/test_qwen_image_learns.py."""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers import read_metrics
from tests.helpers.learning import assert_rises_over_frozen_control, smoke_rewards

# the extended tier (docs/testing.md): CI holds the loss to verl-omni's (tests/test_dppo.py); this curve runs with
# -m extended
pytestmark = [pytest.mark.slow, pytest.mark.extended]

EPOCHS, WINDOW = 10, 3  # epochs of the smoke; epochs at each end of the run
# Measured: see conf/experiment/dppo_smoke.yaml and the report of the commit that added this test.
MIN_Z = 4.0


def run(tmp_path, model_cache, *overrides) -> np.ndarray:
    def check(cfg):
        assert cfg.algorithm.name == "dppo" and cfg.sample.name == "flow_sde" and cfg.model.family == "sd3"

    return smoke_rewards(tmp_path, model_cache, "dppo_smoke", EPOCHS, 1.0, *overrides, check=check)


def test_dppo_smoke_raises_jpeg_compressibility_over_a_frozen_control(tmp_path, model_cache):
    trained = run(tmp_path / "trained", model_cache)
    frozen = run(tmp_path / "frozen", model_cache, "train.learning_rate=1e-9")
    assert_rises_over_frozen_control("dppo_smoke", trained, frozen, WINDOW, MIN_Z)
    epochs = read_metrics(tmp_path / "trained", "epoch")
    # the trust region acted: rows were masked (from each epoch's second update on, which compares moved weights),
    # only rows outside it, and never all of them
    assert sum(e["clipfrac"] for e in epochs) > 0 and all(e["clipfrac"] < 1 for e in epochs), epochs
    assert all(e["kl_mask_fraction"] >= e["clipfrac"] and e["kl_new_old"] > 0 for e in epochs), epochs
