"""A reward that reads its prompts' metadata and reports extras, for tests/unit/rewards/test_managed_reward.py: imported
only by the reward process those tests start (`serve --import tests.helpers.probe_reward`), never by pytest itself, so
the catalog of the test session keeps only the real rewards. Registered in the catalog before ddpo_tpu.config.schema is
imported there, so the schema's reward union includes it.

    value  = scale * mean(pixels) / 255 + metadata["bonus"]   (bonus 0 when the row has none or there is no metadata)
    extras = {"bonus": the row's bonus, NaN where it has none}   (only when metadata is given)

after sleeping `delay_s` seconds (a request long enough to kill the process in).
"""

from __future__ import annotations

import time
from typing import Literal

import numpy as np
from pydantic import Field

from ddpo_tpu.catalog import REWARDS as SPECS
from ddpo_tpu.catalog.rewards import Keys, RewardSpec
from ddpo_tpu.rewards.base import Reward, RewardScores, register_reward

NAME = "metadata_probe"


class ProbeKeys(Keys):
    name: Literal["metadata_probe"]
    scale: float = Field(default=1.0, gt=0)
    delay_s: float = Field(default=0.0, ge=0)  # seconds each call sleeps first (a request to die in)


if NAME not in SPECS:
    SPECS.register(RewardSpec(NAME, "metadata probe (tests)", ProbeKeys, __name__))


@register_reward(NAME)
class MetadataProbe(Reward):
    def __init__(self, scale: float = 1.0, delay_s: float = 0.0):
        self.scale, self.delay_s = scale, delay_s

    def score(self, images, prompts, metadata=None) -> RewardScores:
        time.sleep(self.delay_s)
        images = self._check_host_images(images, prompts)
        base = self.scale * images.reshape(len(images), -1).mean(axis=1) / 255.0
        if metadata is None:
            return RewardScores(base.astype(np.float32))
        bonus = np.asarray([row.get("bonus", np.nan) for row in metadata], dtype=np.float64)
        return RewardScores((base + np.nan_to_num(bonus)).astype(np.float32), {"bonus": bonus.astype(np.float32)})

    def __call__(self, images, prompts, metadata=None):
        return self.score(images, prompts, metadata).values
