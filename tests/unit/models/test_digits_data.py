"""The digits demo's data, shipped in ddpo_tpu/models/assets (its README says why: no scikit-learn in the training
venvs): the UCI handwritten digits test set as scikit-learn 1.9.1's `load_digits()` reads it."""

from __future__ import annotations

import hashlib

import numpy as np

# the bytes of scikit-learn 1.9.1's sklearn/datasets/data/digits.csv.gz (checked equal to load_digits()'s images and
# targets when it was copied, 2026-11-29)
SHA256 = "09f66e6debdee2cd2b5ae59e0d6abbb73fc2b0e0185d2e1957e9ebb51e23aa22"
# UCI "Optical Recognition of Handwritten Digits", optdigits.tes: its documented class distribution (digits 0-9)
UCI_TEST_SET_CLASSES = [178, 182, 177, 183, 181, 182, 181, 179, 174, 180]


def test_the_shipped_file_is_the_uci_test_set():
    from ddpo_tpu.models.digits import DIGITS_FILE, digit_images

    assert hashlib.sha256(DIGITS_FILE.read_bytes()).hexdigest() == SHA256
    x, y = digit_images(size=8)
    assert x.shape == (1797, 8, 8) and x.dtype == np.float32 and y.dtype == np.int64
    assert np.bincount(y).tolist() == UCI_TEST_SET_CLASSES
    levels = x * 16  # the 4x4-block counts of the original 32x32 bitmaps: whole numbers 0-16
    assert np.array_equal(levels, np.round(levels)) and levels.min() == 0 and levels.max() == 16


def test_the_images_are_upscaled_white_on_black():
    from ddpo_tpu.models.digits import digit_images

    x, _ = digit_images()
    assert x.shape == (1797, 32, 32) and 0.0 <= x.min() and x.max() <= 1.0
    # UCI's 32x32 bitmaps are normalised to fill the frame's height: the side columns stay dark, ink in the middle
    assert x[:, :, :3].mean() < 0.05 and x[:, 12:20, 12:20].mean() > 0.4

