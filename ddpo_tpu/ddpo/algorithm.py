"""What an RL algorithm adds to the loop: advantages from rewards, and the loss of a re-scored step. DDPO
(Black et al. 2023): per-prompt reward normalisation (or whole-batch) and the PPO-clip objective. An algorithm
owns its state (the stat tracker) and checkpoints it through state_dict/load_state_dict."""

from __future__ import annotations

from typing import Any

import numpy as np
from torch import Tensor

from ddpo_tpu.ddpo.ppo import ppo_loss
from ddpo_tpu.ddpo.stat_tracking import PerPromptStatTracker, global_advantages
from ddpo_tpu.families.base import StepScore


class DDPO:
    name = "ddpo"
    stat_names = ("loss", "approx_kl", "clipfrac")  # the scalars loss() returns, in order (logged per update)
    needs_reference = False                         # loss() does not compare with the reference policy

    def __init__(self, cfg):
        self.cfg = cfg
        st = cfg.stat_tracking
        self.tracker = PerPromptStatTracker(st.buffer_size, st.min_count)

    def advantages(self, prompts: list[str], rewards: np.ndarray) -> np.ndarray:
        if self.cfg.stat_tracking.per_prompt:
            return self.tracker.update(prompts, rewards)
        return global_advantages(rewards)

    def loss(self, score: StepScore, old_log_prob: Tensor, advantages: Tensor,
             reference: StepScore | None = None) -> tuple[Tensor, ...]:
        """(loss, *statistics): each a mean over the batch's terms, on the device."""
        t = self.cfg.train
        loss, info = ppo_loss(score.log_prob, old_log_prob, advantages, t.clip_range, t.adv_clip_max)
        return loss, info["approx_kl"], info["clipfrac"]

    def state_dict(self) -> dict[str, Any]:
        return self.tracker.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.tracker.load_state_dict(state)


def make_algorithm(cfg) -> DDPO:
    return DDPO(cfg)


__all__ = ["DDPO", "make_algorithm"]
