"""`+experiment=qwen_image_grpo_smoke` learns: Flow-GRPO on the tiny Qwen-Image model (packed latents, Qwen2.5-VL
prompt states, flow_grpo's Qwen-Image sampler: the SDE on all steps but the last) raises the mean JPEG compressibility
over its 10 epochs on eager CPU, by several standard errors, and ends above a frozen-policy control (the same run at
learning rate 1e-9: the same prompts and noise, a policy that does not move). Run in-process, as
tests/test_wan_learns.py."""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers.learning import assert_rises_over_frozen_control, smoke_rewards

# the extended tier (docs/testing.md): CI holds Qwen-Image's parts to the reference (test_qwen_image_parity.py)
# and its graphs on XLA (test_xla_families.py)
pytestmark = [pytest.mark.slow, pytest.mark.extended]

EPOCHS, WINDOW = 10, 3  # epochs of the smoke; epochs at each end of the run
# Measured here (rise of the last 3 epochs' mean reward over the first 3, in pooled standard errors), seed 0: the
# trained run z = 8.7 (+0.096 kB: -1.2948 -> -1.1747; the rise starts slowly, LoRA's B starting at zero), its last 3
# epochs 9.3 standard errors above the control's; the control (learning rate 1e-9) z = -1.5 (-0.0007 kB), held to a
# small fraction of the trained rise rather than to a z. 8 epochs were too few (z 3.4: the rise is still
# accelerating there). About 70 s of CPU for both runs (192 s wall at load 5 on 2 cores).
MIN_Z = 4.0


def run(tmp_path, model_cache, *overrides) -> np.ndarray:
    def check(cfg):
        assert cfg.model.family == "qwen_image" and cfg.sample.name == "flow_sde"

    return smoke_rewards(tmp_path, model_cache, "qwen_image_grpo_smoke", EPOCHS, 0.1, *overrides, check=check)


def test_qwen_image_grpo_smoke_raises_jpeg_compressibility_over_a_frozen_control(tmp_path, model_cache):
    trained = run(tmp_path / "trained", model_cache)
    frozen = run(tmp_path / "frozen", model_cache, "train.learning_rate=1e-9")
    assert_rises_over_frozen_control("qwen_image_grpo_smoke", trained, frozen, WINDOW, MIN_Z)
