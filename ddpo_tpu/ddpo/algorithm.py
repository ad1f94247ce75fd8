"""What an RL algorithm adds to the loop: which prompts an epoch samples, advantages from rewards, and the loss of a
re-scored step. An algorithm owns its state and checkpoints it through state_dict/load_state_dict.

DDPO (Black et al. 2023): prompts drawn per batch, per-prompt reward normalisation over a history (or whole-batch),
the PPO-clip objective on randomly ordered timesteps.
GRPO as Flow-GRPO uses it (Liu et al. 2025): each prompt of an epoch sampled group_size times, advantages relative to
the group, PPO-clip plus a closed-form KL penalty to the reference policy, the first trained timesteps in order."""

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
        self.shuffle_timesteps = cfg.xla.shuffle_timesteps  # each sample's time axis in random order (ddpo-pytorch)

    def epoch_prompts(self, source, batches: int, batch_size: int, rng: np.random.Generator) -> list[list[str]]:
        """Each batch's prompts, drawn batch by batch as the reference does."""
        return [source.sample(batch_size, rng) for _ in range(batches)]

    def advantages(self, prompts: list[str], rewards: np.ndarray) -> np.ndarray:
        if self.cfg.stat_tracking.per_prompt:
            return self.tracker.update(prompts, rewards)
        return global_advantages(rewards)

    def loss(self, score: StepScore, old_log_prob: Tensor, advantages: Tensor,
             reference_mean: Tensor | None = None) -> tuple[Tensor, ...]:
        """(loss, *statistics): each a mean over the batch's terms, on the device."""
        t = self.cfg.train
        loss, info = ppo_loss(score.log_prob, old_log_prob, advantages, t.clip_range, t.adv_clip_max)
        return loss, info["approx_kl"], info["clipfrac"]

    def state_dict(self) -> dict[str, Any]:
        return self.tracker.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.tracker.load_state_dict(state)


class GRPO:
    name = "grpo"
    stat_names = ("loss", "approx_kl", "clipfrac", "kl")

    def __init__(self, cfg):
        self.cfg = cfg
        self.needs_reference = cfg.algorithm.kl_beta > 0
        # flow_grpo trains the first int(T x timestep_fraction) steps in order (the last, least noisy, are left out)
        self.shuffle_timesteps = False

    def epoch_prompts(self, source, batches: int, batch_size: int, rng: np.random.Generator) -> list[list[str]]:
        """N / group_size prompts, each group_size times, in random order over the epoch's batches (and so over
        the replicas: a group's advantages are computed on the host over the whole epoch)."""
        n, g = batches * batch_size, self.cfg.algorithm.group_size
        distinct = source.sample(n // g, rng)
        order = rng.permutation(n)
        flat = [distinct[i // g] for i in order]
        return [flat[b * batch_size:(b + 1) * batch_size] for b in range(batches)]

    def advantages(self, prompts: list[str], rewards: np.ndarray) -> np.ndarray:
        from ddpo_tpu.ddpo.grpo import group_advantages

        return group_advantages(rewards, prompts, global_std=self.cfg.algorithm.global_std)

    def loss(self, score: StepScore, old_log_prob: Tensor, advantages: Tensor,
             reference_mean: Tensor | None = None) -> tuple[Tensor, ...]:
        from ddpo_tpu.ddpo.grpo import grpo_loss, kl_to_reference

        t = self.cfg.train
        kl = kl_to_reference(score.mean, reference_mean, score.std) if reference_mean is not None else None
        loss, info = grpo_loss(score.log_prob, old_log_prob, advantages, t.clip_range, t.adv_clip_max, kl,
                               self.cfg.algorithm.kl_beta)
        return loss, info["approx_kl"], info["clipfrac"], info["kl"]

    def state_dict(self) -> dict[str, Any]:
        return {}  # no history: each epoch's groups stand alone

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def make_algorithm(cfg) -> DDPO | GRPO:
    return GRPO(cfg) if cfg.algorithm.name == "grpo" else DDPO(cfg)


__all__ = ["DDPO", "GRPO", "make_algorithm"]
