"""edit_consistency (rewards/edit_consistency.py): the edit task's stand-in reward reads the source pictures from each
image's metadata (rewards/base.py's contract) and scores closeness to the first one plus the colour the prompt asks."""

from __future__ import annotations

import numpy as np
import pytest

from ddpo_tpu.catalog import REWARDS
from ddpo_tpu.rewards import RewardError, make_reward


def test_closer_to_the_source_and_the_asked_colour_score_higher():
    r = make_reward("edit_consistency", color_weight=0.5)
    src = np.full((8, 8, 3), 100, np.uint8)
    same, far = np.full((16, 16, 3), 100, np.uint8), np.full((16, 16, 3), 200, np.uint8)
    reddish = same.copy()
    reddish[..., 0] = 140
    rows = [{"source_images": [src]}] * 3
    s = r.score(np.stack([same, far, reddish]), ["keep it", "keep it", "make it red"], rows)
    np.testing.assert_allclose(s.values[:2], [0.0, -100 / 255], rtol=1e-6)
    # red: keep -40/3/255 and colour (140 - 100) / 255
    np.testing.assert_allclose(s.values[2], -40 / 3 / 255 + 0.5 * 40 / 255, rtol=1e-5)
    assert np.isnan(s.extras["asked_color"][0]) and s.extras["asked_color"][2] > 0
    assert s.values[2] > s.values[1]


def test_without_sources_it_says_what_is_missing():
    with pytest.raises(RewardError, match="source_images"):
        make_reward("edit_consistency")(np.zeros((1, 4, 4, 3), np.uint8), ["p"], [{}])


def test_catalog_flags_it_as_taking_sources():
    assert REWARDS.get("edit_consistency").takes_sources and not REWARDS.get("jpeg_compressibility").takes_sources


def test_the_grid_compares_block_means_and_grid_0_every_pixel():
    src = np.zeros((4, 4, 3), np.uint8)
    src[:, 2:] = 200  # left half 0, right half 200
    out = np.full((1, 4, 4, 3), 100, np.uint8)  # the same overall mean, another layout
    rows = [{"source_images": [src]}]
    one = make_reward("edit_consistency", color_weight=0.0, grid=1).score(out, ["p"], rows).values
    two = make_reward("edit_consistency", color_weight=0.0, grid=2).score(out, ["p"], rows).values
    pixels = make_reward("edit_consistency", color_weight=0.0, grid=0).score(out, ["p"], rows).values
    np.testing.assert_allclose([one[0], two[0], pixels[0]], [0.0, -100 / 255, -100 / 255], atol=1e-7)
    flipped = out.copy()
    flipped[0, :, :2], flipped[0, :, 2:] = 0, 200
    assert make_reward("edit_consistency", color_weight=0.0, grid=2).score(flipped, ["p"], rows).values[0] == 0
