"""Rewards for DDPO: interface, registry and the built-in rewards.

Usage::

    from ddpo_tpu.rewards import make_reward, to_uint8_images
    reward = make_reward("jpeg_compressibility")
    rewards = reward(to_uint8_images(images), prompts)   # float32 (B,)

Other reward modules register themselves with ``@register_reward("name")`` when they are imported. A run's reward
comes from its typed config (ddpo_tpu/config/schema.py) through ``rewards.from_config.reward_from_config``.
"""

from ddpo_tpu.rewards.base import REWARDS, Reward, RewardError, make_reward, register_reward, to_uint8_images

# importing a reward module registers it: JPEG (numpy + PIL), the CLIP-based ones (torch and transformers are imported
# when one is built), remote (stdlib) and weighted
from ddpo_tpu.rewards.jpeg import JpegCompressibility, JpegIncompressibility  # noqa: E402
from ddpo_tpu.rewards import aesthetic, clip_score, frame_consistency, pickscore, remote, weighted  # noqa: E402,F401
from ddpo_tpu.rewards import imagereward  # noqa: E402,F401 -- BLIP + MLP head (torch, transformers when built)
from ddpo_tpu.rewards import hpsv2  # noqa: E402,F401 -- HPSv2 on transformers' CLIP (torch on first use)
# a feature model in the same registry (GRPO's diversity_features), not a score
from ddpo_tpu.rewards import clip_features  # noqa: E402,F401
from ddpo_tpu.rewards import digits  # noqa: E402,F401 -- the digits demo's classifier (torch on first use)
# OCR (numpy; its recogniser imported when built) and GenEval (numpy rules; detector and colour models when built)
from ddpo_tpu.rewards import geneval, ocr  # noqa: E402,F401
# GenEval's built-in detectors and colour classifiers (mmdet, transformers; open_clip, clip) register themselves
from ddpo_tpu.rewards import geneval_backends  # noqa: E402,F401
from ddpo_tpu.rewards import vlm_judge  # noqa: E402,F401 -- VLM judges over a chat endpoint (stdlib + PIL)
from ddpo_tpu.rewards import edit_consistency  # noqa: E402,F401 -- the edit task's stand-in (numpy; sees the sources)

__all__ = ["REWARDS", "Reward", "RewardError", "make_reward", "register_reward", "to_uint8_images",
           "JpegCompressibility", "JpegIncompressibility"]
