"""What an RL algorithm adds to the loop, as the loop asks it: which prompts an epoch samples, advantages from
rewards, which samples an epoch trains (TrainPlan) and the loss of a re-scored step. An algorithm owns its state and
checkpoints it through state_dict/load_state_dict. Each algorithm is a module of this package (ddpo.py, grpo.py,
nft.py, awm.py), registered in ddpo_tpu/catalog/algorithms.py; the loop finds the run's through the catalog
(training/loop.py, make_algorithm), so nothing below this package names one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from torch import Tensor

from ddpo_tpu.config.plan import RunPlan, run_plan
from ddpo_tpu.families.base import StepScore


@dataclass
class TrainPlan:
    """Which samples an epoch trains, in which order, with which loss weight (static shapes: every sample runs)."""

    orders: np.ndarray     # (inner epochs, N) int64: the sample at each train position of each inner epoch
    weights: np.ndarray    # (N,) float32 per sample: N / kept for a kept sample, 0 for a dropped one
    kept: int              # samples trained (after the re-inclusion), the reference's mask.sum()
    num_batches: int       # the reference's rebatching: kept / num_batches samples in each of its batches

    @property
    def metrics(self) -> dict[str, float | int]:
        n = self.weights.shape[0]
        # flow_grpo logs actual_batch_size = mask.sum() // num_batches_per_epoch (a per-process figure there)
        return {"kept_fraction": self.kept / n if n else 0.0, "actual_batch_size": self.kept // self.num_batches}


class Algorithm:
    """What the loop asks of an algorithm. Subclass it (DDPO, GRPO below; a new one is registered in the catalog) and
    override what the algorithm does; every hook here has a default that does nothing, so the loop calls them all
    without asking which exist. `ctx` is the run's training/stepper.py EpochContext (config, runtime, family,
    state, events, stepper).

    `plan` is the run's RunPlan (config/plan.py): the decisions validation made. An algorithm reads every quantity
    the plan holds from it (batches, accumulation, updates per inner epoch, trained timesteps) and never recomputes
    one from the config; `cfg` keeps the user's knobs (clip range, group size, KL weight). make_algorithm hands it
    the Trainer's plan; built without one (a test, a tool), it is run_plan(cfg), computed when first read."""

    name: str = ""
    stat_names: tuple[str, ...] = ("loss",)  # the scalars a micro-step returns, in order (logged per update)
    needs_reference: bool = False  # loss() takes the reference policy's step means (a KL term)
    needs_old_mean: bool = False   # loss() takes the sampling policy's step means (GRPO-Guard)
    key_tokens: int = 77           # tokens of a prompt's key (per-prompt statistics, groups)
    shuffle_timesteps: bool = False  # each sample's trained timesteps in a random order
    ode_sampling: bool = False     # sample with the family's noise-free step (no log-probs to re-score)

    def __init__(self, cfg, plan: RunPlan | None = None):
        self.cfg = cfg
        self._plan = plan
        self.epoch_metrics: dict[str, float | int] = {}  # the last epoch's figures for its metrics line

    @property
    def plan(self) -> RunPlan:
        if self._plan is None:  # computed when first read: a loss-only test builds one from a partial config
            self._plan = run_plan(self.cfg)
        return self._plan

    # --- sampling and advantages ------------------------------------------------------------------------------
    def epoch_prompts(self, source, batches: int, batch_size: int, rng: np.random.Generator) -> list[list[str]]:
        """Each sampling batch's prompts."""
        raise NotImplementedError

    def advantages(self, keys: list[str], rewards: np.ndarray, scores: dict | None = None,
                   components: dict | None = None) -> np.ndarray:
        """(N,) advantages of an epoch's rewards; `keys` each sample's prompt key, `scores` what image_scores gave
        the samples, `components` reward=weighted's unweighted components (GDPO)."""
        raise NotImplementedError

    def rekey(self, key_of) -> None:
        """A statistic restored from a checkpoint keyed by raw text takes the tokenizer's keys."""

    def train_plan(self, epoch: int, advantages: np.ndarray, keys: list[str], rewards: np.ndarray
                   ) -> TrainPlan | None:
        """Which samples the epoch trains, in which order, with which weight; None: all, shuffled, weight 1."""
        return None

    def image_scores(self, ctx):
        """A scorer (images, prompts) -> {name: rows} the loop runs beside the reward (GARDO), or None."""
        return None

    def kl_gate(self, rewards: np.ndarray, scores: dict | None) -> np.ndarray | None:
        """(N,) 1 where a sample carries the KL (GARDO's gate), None: every sample."""
        return None

    # --- training ---------------------------------------------------------------------------------------------
    def make_epoch_trainer(self, ctx):
        """Its own training of an epoch (training/ppo_epoch.py EpochTrainer); None: PPO's re-scoring of the recorded
        steps (PpoEpochTrainer), which calls loss()."""
        return None

    def loss(self, score: StepScore, old_log_prob: Tensor, advantages: Tensor, reference_mean: Tensor | None = None,
             weights: Tensor | None = None) -> tuple[Tensor, ...]:
        """(loss, *statistics) of re-scored steps, each a mean over the terms (PpoEpochTrainer). A subclass may add
        keyword options after these (GRPO's old_mean, sqrt_dt, steps, kl_gate)."""
        raise NotImplementedError(f"algorithm={self.name} does not re-score recorded steps: its epochs are its "
                                  f"epoch trainer's")

    def reference_policy(self, ctx):
        """The KL reference's context (GARDO's reset copy), or None: the family's adapter-off model."""
        return None

    def after_training(self, epoch: int, steps: list[dict]) -> None:
        """After an epoch's updates (GARDO: their KL decides the next reset)."""

    # --- checkpoints ------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


__all__ = ["Algorithm", "TrainPlan"]
