"""DDPO (Black et al. 2023) as kvablack/ddpo-pytorch trains it: prompts drawn per batch, per-prompt reward
normalisation over a history (or whole-batch), the PPO-clip objective on randomly ordered timesteps."""

from __future__ import annotations

from typing import Any

import numpy as np
from torch import Tensor

from ddpo_tpu.algorithms.base import Algorithm, TrainPlan
from ddpo_tpu.algorithms.ppo import ppo_loss
from ddpo_tpu.algorithms.stat_tracking import PerPromptStatTracker, global_advantages
from ddpo_tpu.config.plan import RunPlan
from ddpo_tpu.families.base import StepScore


class DDPO(Algorithm):
    ode_sampling = False            # the SDE samples: its steps are the policy's actions
    name = "ddpo"
    stat_names = ("loss", "approx_kl", "clipfrac")  # the scalars loss() returns, in order (logged per update)
    needs_reference = False                         # loss() does not compare with the reference policy
    # per-prompt statistics are keyed by the tokenizer's decoding of the prompt's ids, as ddpo-pytorch keys them
    # (pipeline.tokenizer, max_length = model_max_length, 77 for CLIP): lower-cased, whitespace-normalised, truncated
    key_tokens = 77

    def __init__(self, cfg, plan: RunPlan | None = None):
        super().__init__(cfg, plan)
        st = cfg.stat_tracking
        self.tracker = PerPromptStatTracker(st.buffer_size, st.min_count)
        self.shuffle_timesteps = cfg.algorithm.shuffle_timesteps  # each sample's time axis in random order

    def epoch_prompts(self, source, batches: int, batch_size: int, rng: np.random.Generator) -> list[list[str]]:
        """Each batch's prompts, drawn batch by batch as the reference does."""
        return [source.sample(batch_size, rng) for _ in range(batches)]

    def advantages(self, keys: list[str], rewards: np.ndarray, scores: dict | None = None,
                   components: dict | None = None) -> np.ndarray:
        """`keys`: each sample's prompt key (prompt_keys of the family, key_tokens long); DDPO reads neither `scores`
        nor `components` (Algorithm.advantages' signature)."""
        if self.cfg.stat_tracking.per_prompt:
            return self.tracker.update(keys, rewards)
        return global_advantages(rewards)

    def rekey(self, key_of) -> None:
        """A tracker restored from a checkpoint keyed by raw text takes the tokenizer's keys (key_of: texts -> keys)."""
        self.tracker.rekey(key_of)

    def train_plan(self, epoch: int, advantages: np.ndarray, keys: list[str], rewards: np.ndarray) -> TrainPlan | None:
        """Every sample trained with weight 1, in the loop's random order."""
        self.epoch_metrics = {}
        return None

    def loss(self, score: StepScore, old_log_prob: Tensor, advantages: Tensor,
             reference_mean: Tensor | None = None, weights: Tensor | None = None) -> tuple[Tensor, ...]:
        """(loss, *statistics): each a mean over the batch's terms of weight x term, on the device."""
        t = self.cfg.train
        loss, info = ppo_loss(score.log_prob, old_log_prob, advantages, t.clip_range, t.adv_clip_max, weights)
        return loss, info["approx_kl"], info["clipfrac"]

    def state_dict(self) -> dict[str, Any]:
        return self.tracker.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.tracker.load_state_dict(state)


__all__ = ["DDPO"]
