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

EPOCHS, WINDOW = 20, 5  # epochs of the smoke; epochs at each end of the run
# Measured (seed 0, eager CPU, the smoke as configured): the trained run rose +0.0088 kB (-1.3636 -> -1.3506, epoch 0
# to 19; the last 5 epochs' mean over the first 5's, z 7.5), its last 5 epochs 8.7 standard errors above the control's;
# the control (learning rate 1e-9) -0.0006 kB, z -1.4. The mask: 1-6% of the rows an epoch in 9 of the 20 epochs
# (kl_mask_fraction 0.1 there: one trained step of 5 at the second update), mean D 2e-6..5e-5, the KL to the
# reference at most 0.003. The test took 629 s (both runs, one after the other) at load 5-8 on the 2-core machine.
# At verl-omni's kl_mask_threshold 1e-5 the rise was +0.0031 kB (z 4.5): conf/experiment/dppo_smoke.yaml.
MIN_Z = 4.0


def run(tmp_path, model_cache, *overrides) -> np.ndarray:
    def check(cfg):
        assert cfg.algorithm.name == "dppo" and cfg.sample.name == "flow_sde" and cfg.model.family == "sd3"

    return smoke_rewards(tmp_path, model_cache, "dppo_smoke", EPOCHS, 0.05, *overrides, check=check)


def test_dppo_smoke_raises_jpeg_compressibility_over_a_frozen_control(tmp_path, model_cache):
    trained = run(tmp_path / "trained", model_cache)
    frozen = run(tmp_path / "frozen", model_cache, "train.learning_rate=1e-9")
    assert_rises_over_frozen_control("dppo_smoke", trained, frozen, WINDOW, MIN_Z)
    epochs = read_metrics(tmp_path / "trained", "epoch")
    # the trust region acted: rows were masked (from each epoch's second update on, which compares moved weights),
    # only rows outside it, and never all of them
    assert sum(e["clipfrac"] for e in epochs) > 0 and all(e["clipfrac"] < 1 for e in epochs), epochs
    assert all(e["kl_mask_fraction"] >= e["clipfrac"] and e["kl_new_old"] > 0 for e in epochs), epochs
