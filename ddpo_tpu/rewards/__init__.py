"""Rewards for DDPO: interface, registry and the built-in rewards.

Usage::

    from ddpo_tpu.rewards import make_reward, to_uint8_images
    reward = make_reward("jpeg_compressibility")
    rewards = reward(to_uint8_images(images), prompts)   # float32 (B,)

Other reward modules register themselves with ``@register_reward("name")``
when they are imported.
"""

from ddpo_tpu.rewards.base import (
    REWARDS,
    Reward,
    RewardError,
    make_reward,
    register_reward,
    to_uint8_images,
)

# Built-in rewards (numpy + PIL only); importing registers them.
from ddpo_tpu.rewards import jpeg as _jpeg  # noqa: F401,E402
from ddpo_tpu.rewards.jpeg import JpegCompressibility, JpegIncompressibility  # noqa: E402

# CLIP + LAION MLP; imports torch/transformers only when built
from ddpo_tpu.rewards import aesthetic as _aesthetic  # noqa: F401,E402
from ddpo_tpu.rewards import clip_score as _clip_score  # noqa: F401,E402  (prompt-image alignment)
from ddpo_tpu.rewards import pickscore as _pickscore  # noqa: F401,E402  (PickScore, Flow-GRPO's)
from ddpo_tpu.rewards import remote as _remote  # noqa: F401,E402  (HTTP reward server; stdlib only)
from ddpo_tpu.rewards import weighted as _weighted  # noqa: F401,E402  (weighted sum of rewards)

__all__ = [
    "REWARDS",
    "Reward",
    "RewardError",
    "make_reward",
    "register_reward",
    "to_uint8_images",
    "JpegCompressibility",
    "JpegIncompressibility",
]
