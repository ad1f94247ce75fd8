"""What an RL algorithm adds to the loop, as the loop asks it: which prompts an epoch samples, advantages from
rewards, which samples an epoch trains (TrainPlan) and the loss of a re-scored step. An algorithm owns its state and
checkpoints it through state_dict/load_state_dict. Each algorithm is a module of this package (ddpo.py, grpo.py,
nft.py, awm.py), registered in ddpo_tpu/catalog/algorithms.py; the loop finds the run's through the catalog
(training/loop.py, make_algorithm), so nothing below this package names one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from torch import Tensor

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
    # optional (GRPO's GARDO options; docs/architecture.md): reference_policy(trainer), after_training(epoch, steps),
    # image_scores(trainer) -> (images, prompts) -> {name: rows} | None; with it, advantages(..., scores=) and
    # kl_gate(rewards, scores) -> (N,) | None, the gate reaching loss(..., kl_gate=) as the KL's row weights


__all__ = ["Algorithm", "TrainPlan"]
