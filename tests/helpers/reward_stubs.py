"""Stand-ins for the OCR reward's recogniser and GenEval's detector and colour classifier, reached through the
rewards' `module:function` keys (tests/unit/rewards/test_ocr_reward.py, tests/unit/rewards/test_geneval_reward.py). Each
test states what the stand-in returns: the scoring is then tested on given recognitions / detections, as the references'
rules read them."""

from __future__ import annotations

from collections import deque

import numpy as np

TEXTS: deque = deque()       # what `read` recognises, one string per image, in order
DETECTIONS: deque = deque()  # what `detect` finds, one {class: [(box, score, mask or None)]} per image, in order
SEEN: list = []              # the images each stand-in was handed (shape, dtype)

# the colours `colour_of` tells apart; #999 grey (GenEval's crop background) is not one of them and is never counted
PALETTE = {"red": (255, 0, 0), "green": (0, 255, 0), "blue": (0, 0, 255), "white": (255, 255, 255),
           "black": (0, 0, 0)}


def read(images):
    SEEN.extend((im.shape, im.dtype) for im in images)
    return [TEXTS.popleft() for _ in images]


def detect(images):
    SEEN.extend((im.shape, im.dtype) for im in images)
    return [DETECTIONS.popleft() for _ in images]


def colour_of(crop: np.ndarray) -> str:
    """The palette colour most of the crop's pixels are exactly (grey background pixels ignored)."""
    pixels = crop.reshape(-1, 3)
    counts = {name: int(np.all(pixels == rgb, axis=1).sum()) for name, rgb in PALETTE.items()}
    return max(counts, key=counts.get)


def colours(crops, classname):
    return [colour_of(c) for c in crops]


def not_callable():
    pass


NOT_CALLABLE = 3


def detect_everything(images):
    """Every GenEval class once per image, over the whole image, at score 0.95 (above both thresholds)."""
    from ddpo_tpu.rewards.geneval import CLASSNAMES

    return [{c: [(np.array([0, 0, im.shape[1] - 1, im.shape[0] - 1], float), 0.95, None)] for c in CLASSNAMES}
            for im in images]


def all_brown(crops, classname):
    return ["brown"] * len(crops)
