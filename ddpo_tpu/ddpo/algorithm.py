"""What an RL algorithm adds to the loop: which prompts an epoch samples, advantages from rewards, and the loss of a
re-scored step. An algorithm owns its state and checkpoints it through state_dict/load_state_dict.

DDPO (Black et al. 2023): prompts drawn per batch, per-prompt reward normalisation over a history (or whole-batch),
the PPO-clip objective on randomly ordered timesteps.
GRPO as Flow-GRPO uses it (Liu et al. 2025): each prompt of an epoch sampled group_size times, advantages relative to
the group, PPO-clip plus a closed-form KL penalty to the reference policy, the first trained timesteps in order."""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
from torch import Tensor

from ddpo_tpu.ddpo.ppo import ppo_loss
from ddpo_tpu.ddpo.grpo import TrainPlan
from ddpo_tpu.ddpo.stat_tracking import PerPromptStatTracker, global_advantages
from ddpo_tpu.families.base import StepScore

class Algorithm(Protocol):
    """What the loop asks of an algorithm (DDPO and GRPO below follow it; a new one is registered in the catalog)."""

    name: str
    stat_names: tuple[str, ...]   # the scalars loss() returns, in order (logged per update)
    needs_reference: bool         # loss() takes the reference policy's step means (a KL term)
    key_tokens: int               # tokens of a prompt's key (per-prompt statistics, groups)
    shuffle_timesteps: bool       # each sample's trained timesteps in a random order
    epoch_metrics: dict[str, float | int]
    ode_sampling: bool            # sample with the family's noise-free step (no log-probs to re-score)

    def epoch_prompts(self, source, batches: int, batch_size: int, rng: np.random.Generator) -> list[list[str]]: ...
    def advantages(self, keys: list[str], rewards: np.ndarray) -> np.ndarray: ...
    def rekey(self, key_of) -> None: ...
    def train_plan(self, epoch: int, advantages: np.ndarray, keys: list[str], rewards: np.ndarray
                   ) -> TrainPlan | None: ...
    def loss(self, score: StepScore, old_log_prob: Tensor, advantages: Tensor, reference_mean: Tensor | None = None,
             weights: Tensor | None = None) -> tuple[Tensor, ...]: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...
    def make_epoch_trainer(self, trainer) -> Any: ...  # its own training of an epoch; None = the loop's PPO steps


PLAN_STREAM = 3  # the host generator of GRPO's zero-advantage plan: (seed, epoch, 3), apart from the loop's 0-2


class DDPO:
    ode_sampling = False            # the SDE samples: its steps are the policy's actions
    name = "ddpo"
    stat_names = ("loss", "approx_kl", "clipfrac")  # the scalars loss() returns, in order (logged per update)
    needs_reference = False                         # loss() does not compare with the reference policy
    # per-prompt statistics are keyed by the tokenizer's decoding of the prompt's ids, as ddpo-pytorch keys them
    # (pipeline.tokenizer, max_length = model_max_length, 77 for CLIP): lower-cased, whitespace-normalised, truncated
    key_tokens = 77

    def __init__(self, cfg):
        self.cfg = cfg
        self.epoch_metrics: dict[str, float | int] = {}  # the last epoch's figures for its metrics line
        st = cfg.stat_tracking
        self.tracker = PerPromptStatTracker(st.buffer_size, st.min_count)
        self.shuffle_timesteps = cfg.algorithm.shuffle_timesteps  # each sample's time axis in random order

    def epoch_prompts(self, source, batches: int, batch_size: int, rng: np.random.Generator) -> list[list[str]]:
        """Each batch's prompts, drawn batch by batch as the reference does."""
        return [source.sample(batch_size, rng) for _ in range(batches)]

    def advantages(self, keys: list[str], rewards: np.ndarray) -> np.ndarray:
        """`keys`: each sample's prompt key (prompt_keys of the family, key_tokens long)."""
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

    def make_epoch_trainer(self, trainer) -> None:
        return None  # the loop's clipped-objective micro-steps

    def state_dict(self) -> dict[str, Any]:
        return self.tracker.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.tracker.load_state_dict(state)


class GRPO:
    ode_sampling = False            # the SDE samples: its steps are the policy's actions
    name = "grpo"
    stat_names = ("loss", "approx_kl", "clipfrac", "kl")

    # flow_grpo keys groups by tokenizers[0]'s decoding of the prompt ids padded/truncated to 256 tokens
    key_tokens = 256

    def __init__(self, cfg):
        self.cfg = cfg
        self.epoch_metrics: dict[str, float | int] = {}
        self.needs_reference = cfg.algorithm.kl_beta > 0
        # GRPO-Guard's RatioNorm compares with the sampling policy's step means (the loop keeps its weights)
        self.needs_old_mean = bool(getattr(cfg.algorithm, "ratio_norm", False))
        # flow_grpo trains the first int(T x timestep_fraction) steps in order (the last, least noisy, are left out)
        self.shuffle_timesteps = False
        a = cfg.algorithm
        self.adaptive = (AdaptiveReference(a.reference_reset_kl, a.reference_reset_every)
                         if getattr(a, "reference_reset_kl", None) is not None else None)

    def epoch_prompts(self, source, batches: int, batch_size: int, rng: np.random.Generator) -> list[list[str]]:
        """flow_grpo's DistributedKRepeatSampler, batch by batch: batch_size / group_size distinct prompts, each
        repeated group_size times, shuffled over the batch (and so over the replicas, which take contiguous slices
        of it). Every group lies inside one sampling batch; batches draw independently (a prompt drawn again in
        another batch joins its group, as the reference's per-epoch stat tracker merges it)."""
        g = self.cfg.algorithm.group_size
        if batch_size % g:
            raise ValueError(f"algorithm.group_size={g} does not divide the sampling batch of {batch_size}")
        out = []
        for _ in range(batches):
            distinct = source.sample_distinct(batch_size // g, rng)
            order = rng.permutation(batch_size)
            out.append([distinct[i // g] for i in order])
        return out

    def advantages(self, keys: list[str], rewards: np.ndarray) -> np.ndarray:
        from ddpo_tpu.ddpo.grpo import group_advantages

        return group_advantages(rewards, keys, global_std=self.cfg.algorithm.global_std)

    def rekey(self, key_of) -> None:
        pass  # no state across epochs

    def train_plan(self, epoch: int, advantages: np.ndarray, keys: list[str], rewards: np.ndarray) -> TrainPlan | None:
        """flow_grpo's zero-advantage filter as an order and loss weights (algorithm.drop_zero_advantage), from a
        host generator of (seed, epoch); the epoch's kept fraction and share of zero-std groups for its metrics."""
        from ddpo_tpu.ddpo.grpo import zero_advantage_plan, zero_std_ratio

        cfg = self.cfg
        finite = np.isfinite(rewards)
        self.epoch_metrics = {"zero_std_ratio": zero_std_ratio(rewards[finite], [k for k, f in zip(keys, finite) if f])}
        if self.adaptive is not None and self.adaptive.due(epoch):  # after sampling, as train_sd3_gardo.py resets
            self.epoch_metrics["reference_reset"] = 1
        if not cfg.algorithm.drop_zero_advantage:
            return None
        s, t = cfg.sample, cfg.train
        # optimizer steps per inner epoch: (batch x batches) / (train batch x accumulation); the replicas cancel
        updates = (s.batch_size * s.num_batches_per_epoch) // (t.batch_size * t.gradient_accumulation_steps)
        rng = np.random.default_rng([cfg.seed, epoch, PLAN_STREAM])
        plan = zero_advantage_plan(advantages, s.num_batches_per_epoch, updates, t.num_inner_epochs, rng)
        self.epoch_metrics.update(plan.metrics)
        return plan

    def loss(self, score: StepScore, old_log_prob: Tensor, advantages: Tensor,
             reference_mean: Tensor | None = None, weights: Tensor | None = None, old_mean: Tensor | None = None,
             sqrt_dt: Tensor | None = None, steps: Tensor | None = None) -> tuple[Tensor, ...]:
        """old_mean, sqrt_dt, steps (GRPO-Guard's ratio_norm): the sampling policy's step means, each row's sqrt(-dt)
        and schedule step."""
        from ddpo_tpu.ddpo.grpo import grpo_loss, kl_to_reference, ratio_norm_loss

        t = self.cfg.train
        kl = kl_to_reference(score.mean, reference_mean, score.std) if reference_mean is not None else None
        guard = None
        if old_mean is not None:
            guard = lambda w: ratio_norm_loss(score.log_prob, old_log_prob, score.mean, old_mean, score.std, sqrt_dt,
                                              steps, advantages, t.clip_range, t.adv_clip_max, w)
        loss, info = grpo_loss(score.log_prob, old_log_prob, advantages, t.clip_range, t.adv_clip_max, kl,
                               self.cfg.algorithm.kl_beta, weights, guard)
        return loss, info["approx_kl"], info["clipfrac"], info["kl"]

    def make_epoch_trainer(self, trainer) -> None:
        return None

    def reference_policy(self, trainer):
        """The KL's reference context: GARDO's reset copy of the policy, or None (the family's adapter-off model)."""
        return self.adaptive.attach(trainer) if self.adaptive is not None else None

    def after_training(self, epoch: int, steps: list[dict]) -> None:
        if self.adaptive is not None:
            self.adaptive.observe(steps)

    def state_dict(self) -> dict[str, Any]:
        # no history: each epoch's groups stand alone; GARDO's reset schedule (its copy is TrainState.copies')
        return self.adaptive.state_dict() if self.adaptive is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.adaptive is not None and state:
            self.adaptive.load_state_dict(state)


class AdaptiveReference:
    """GARDO's adaptive KL reference (yifan123/flow_grpo@94e23ee5405ab7241fc1f75d30cac8147e2b1f53,
    scripts/train_sd3_gardo.py, cited by statement: the store serves that commit's text, not a checkout to number):
    an "old" copy of the trained weights, equal to them at the start (the copy loop before `while True`), that the
    KL compares with (`transformer.module.set_adapter("old")` around the reference's compute_log_prob) in place of
    the adapter-off base model; reset to the current weights after an epoch's sampling (`if (epoch !=0 and
    reset==True) or (epoch - prev_epoch)>config.reset_freq`) when an update of the previous epoch logged a KL above
    `threshold` (`if info["kl_loss"] > thres: reset=True`, config.kl_thres) or more than `every` epochs passed since
    the last reset (config.reset_freq). Only with a KL term (`if config.train.beta>0`)."""

    NAME = "gardo_reference"   # its name in TrainState.copies (checkpointed with the optimizer)

    def __init__(self, threshold: float, every: int):
        self.threshold, self.every = threshold, every
        self.flagged, self.last = False, 0
        self.copy = None

    def attach(self, trainer):
        from ddpo_tpu.ddpo.state import EMA

        self.copy = trainer.state.copies.setdefault(self.NAME, EMA(trainer.state.params, 0.0, 1, trainer.rt))
        return self.copy.swapped_in

    def observe(self, steps: list[dict]) -> None:
        """After an epoch's training: any update's KL over the threshold flags a reset (gardo:683)."""
        self.flagged = self.flagged or any(s.get("kl", 0.0) > self.threshold for s in steps)

    def due(self, epoch: int) -> bool:
        """After sampling epoch `epoch`: reset the copy now? (gardo:471: (epoch != 0 and reset) or epoch - prev_epoch
        > reset_freq)"""
        if not ((epoch != 0 and self.flagged) or epoch - self.last > self.every):
            return False
        if self.copy is not None:
            self.copy.reset()
        self.flagged, self.last = False, epoch
        return True

    def state_dict(self) -> dict[str, Any]:
        return {"gardo_flagged": self.flagged, "gardo_last_reset": self.last}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.flagged, self.last = bool(state["gardo_flagged"]), int(state["gardo_last_reset"])


def make_algorithm(cfg) -> Algorithm:
    """The run's algorithm, found through its catalog spec (ddpo_tpu/catalog/algorithms.py)."""
    from ddpo_tpu.catalog import ALGORITHMS, load_object

    return load_object(ALGORITHMS.get(cfg.algorithm.name).module)(cfg)


__all__ = ["Algorithm", "DDPO", "GRPO", "make_algorithm"]
