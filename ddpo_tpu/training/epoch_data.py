"""Where an epoch's samples live between sampling and training, on the distributed execution
(`distributed.keep_samples_on_rank`; one process and SPMD hold the whole epoch either way).

Rank r samples rows [r B/W, (r+1) B/W) of each global sampling batch of B (W ranks), and its rewards are gathered so
every rank computes the advantages of the whole epoch; every rank knows every prompt already (they come from the
same host generator), so nothing else is needed for the advantages. Then:

- whole (the default): every part of every trajectory is gathered onto every rank, which shuffles the epoch with the
  permutation one process would draw and trains rows [r T/W, (r+1) T/W) of each global train batch of T: the run
  trains exactly what one process trains. Each rank holds the whole epoch.
- own rows (keep_samples_on_rank=true): each rank keeps the trajectories it sampled, takes its own samples'
  advantages out of the whole epoch's (as kvablack/ddpo-pytorch@1958463 scripts/train.py:437-442 and
  yifan123/flow_grpo@ac4c86e scripts/train_sd3.py:784-789 take theirs), plans and shuffles them with a generator of
  its own (seed, epoch, inner epoch, rank) and trains T/W of them per train batch. Every rank trains the same samples
  with the same advantages as the whole mode, and each update still averages T samples' gradients over the ranks;
  which samples share an update differs (each rank's shuffle stays within its samples). An algorithm's train plan
  (GRPO's zero-advantage filter) is then drawn per rank over its own samples, as flow_grpo draws its mask per process
  (train_sd3.py:796-817). Each rank holds 1/W of the epoch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from ddpo_tpu.families import Cond
from ddpo_tpu.rewards.base import RewardScores
from ddpo_tpu.runtime import Runtime


@dataclass
class EpochSamples:
    """One epoch's trajectories with their advantages, on the device: the whole epoch (global order) or, with
    own_rows, the samples this process drew (in the order it drew them)."""

    latents: torch.Tensor       # (N, T+1, C, h, w)
    log_probs: torch.Tensor     # (N, T)
    step_indices: torch.Tensor  # (N, T)
    cond: Cond                  # each (N, ...)
    advantages: torch.Tensor    # (N,)
    weights: torch.Tensor       # (N,) loss weight of each sample (GRPO's zero-advantage filter; else 1)
    orders: tuple[torch.Tensor, ...] | None = None  # per inner epoch (N,): the algorithm's train order, else shuffled
    own_rows: bool = False      # this process's samples only (distributed.keep_samples_on_rank)
    kl_gate: torch.Tensor | None = None  # (N,) 1 where a sample carries the KL (GARDO's gate), None: every sample


def drawn_rows(rt: Runtime, batches: int, batch: int) -> np.ndarray:
    """The positions in the epoch's global order (batch after batch, each batch's processes in order: how gather_rows
    and gather_batch lay out what they gather) of the samples this process drew, in the order it drew them."""
    mine = rt.local_rows(batch)
    return np.concatenate([np.arange(b * batch + mine.start, b * batch + mine.stop) for b in range(batches)])


def epoch_samples(rt: Runtime, trajectories, conds, adv: np.ndarray, weights: np.ndarray, orders,
                  own_rows: bool, kl_gate: np.ndarray | None = None) -> EpochSamples:
    """The epoch's samples beside `adv`, `weights`, `orders` and `kl_gate` (this process's rows of them when own_rows,
    else the whole epoch's): whole = every part gathered onto every process, else this process's parts as they are."""
    join = (lambda parts: torch.cat(list(parts))) if own_rows else (
        lambda parts: torch.cat([rt.gather_batch(x) for x in parts]))
    layout = (lambda x: x) if own_rows else rt.epoch_layout
    return EpochSamples(
        latents=join(t.latents for t in trajectories),
        log_probs=join(t.log_probs for t in trajectories),
        step_indices=join(t.step_indices for t in trajectories),
        cond=tuple(join(parts) for parts in zip(*conds)),
        advantages=layout(torch.as_tensor(adv, dtype=torch.float32).to(rt.device)),
        weights=layout(torch.as_tensor(weights, dtype=torch.float32).to(rt.device)),
        orders=tuple(torch.as_tensor(o).to(rt.device) for o in orders) if orders is not None else None,
        own_rows=own_rows,
        kl_gate=layout(torch.as_tensor(kl_gate).to(rt.device)) if kl_gate is not None else None,
    )


def train_batches(s: EpochSamples, rt: Runtime, train_batch: int) -> tuple[int, Callable[[int], torch.Tensor]]:
    """(train batches per inner epoch, b -> the positions in the shuffled epoch this process trains in batch b).
    Whole epoch: its rows of each global train batch of `train_batch`; own rows: its next train_batch / processes."""
    n = s.advantages.shape[0]
    if s.own_rows:
        per = train_batch // rt.process_count
        return n // per, lambda b: torch.arange(b * per, (b + 1) * per)
    return n // train_batch, lambda b: torch.arange(b * train_batch, (b + 1) * train_batch)[rt.local_rows(train_batch)]


def batch_mean_weights(x: torch.Tensor, batch: int) -> torch.Tensor:
    """Row weights `x` (N,) of an epoch in its train order, rescaled in each train batch of `batch` rows to average 1
    (a batch of zeros stays 0): a batch's plain mean of these x a term is then the x-weighted mean of the term over the
    batch, the same however the batch splits over processes or devices. GARDO's gated KL: x = gate x loss weight."""
    xb = x.reshape(-1, batch)
    return (xb * batch / xb.sum(dim=1, keepdim=True).clamp_min(torch.finfo(x.dtype).tiny)).reshape(-1)


def gather_extras(rt: Runtime, scored: list[RewardScores]) -> dict[str, np.ndarray]:
    """The extras of an epoch's reward calls (this process's rows, batch by batch), each gathered over the processes
    like the rewards: name -> (N,) float, NaN where it does not apply. A name missing from a batch is NaN there.
    Every process gathers the same names in the same (sorted) order: a reward reports the same extras on every call
    (rewards/base.py), so the processes agree."""
    names = sorted({k for s in scored for k in s.extras})
    if not names:
        return {}
    # one gather per batch: its extras side by side, (local rows, names) -> (global rows, names)
    nan = lambda s: np.full(len(s.values), np.nan)
    table = np.concatenate([rt.gather_rows(np.stack([np.asarray(s.extras.get(k, nan(s)), dtype=np.float64)
                                                     for k in names], axis=1)) for s in scored])
    return {k: table[:, j] for j, k in enumerate(names)}


def extras_means(extras: dict[str, np.ndarray] | None) -> dict[str, float | None]:
    """Each extra's mean over the images it applies to (finite values: NaN = does not apply); None where it applies
    to none (metrics.jsonl stays valid JSON)."""
    out = {}
    for k, v in (extras or {}).items():
        ok = np.isfinite(v)
        out[k] = float(v[ok].mean()) if ok.any() else None
    return out
