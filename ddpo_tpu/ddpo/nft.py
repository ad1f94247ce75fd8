"""DiffusionNFT (Zheng et al. 2025, "DiffusionNFT: Online Diffusion Reinforcement with Forward Process", arXiv
2509.16117; NVlabs/DiffusionNFT) as `algorithm=nft`, for the flow-matching families.

An epoch: the old policy samples (the family's ODE by default: no log-probs are needed), rewards become group
advantages A (as GRPO's) and an optimality probability r = clip(clip(A, -c, c) / c / 2 + 1/2, 0, 1). Training runs on
the forward process, not on the recorded steps: each clean final latent x0 is noised again, x_t = (1 - t) x0 + t eps,
at the training times t (the first int(T x train.timestep_fraction) sigmas of the sampling schedule, each sample at
each, with fresh noise); the old policy's velocity v_old (no gradient) and the current v on x_t give the implicit
positive and negative policies

    v+ = beta v + (1 - beta) v_old,        v- = (1 + beta) v_old - beta v,

whose x0 predictions x_t - t v+- are pulled to x0, each squared error divided by its own detached mean absolute
error (the paper's adaptive weighting), weighted r and 1 - r:

    loss = c x mean over samples of (r L+ + (1 - r) L-) / beta,    L+- = mean((x0+- - x0)^2) / mean|x0+- - x0|.

The factor c (adv_clip_max) is the reference's (X-GenGroup/Flow-Factory src/flow_factory/trainers/nft.py, which
follows the official code: `policy_loss = (ori_policy_loss * adv_clip_range[1]).mean()`); the mean absolute error is
computed in float32 here (float64 there: TPUs have none), clipped at 1e-5 as there.

The old policy: a copy of the trained weights (TrainState.copies["nft_old"], checkpointed with the optimizer, so a
resume is exact) that samples the epoch and gives v_old; after each epoch old <- d old + (1 - d) current with
d = min(decay_rate x optimizer steps, decay_max), the paper's soft update of the old policy. The defaults (0.001 and
0.5) are the official code's default schedule as we know it; its source was not at hand to check (Flow-Factory's
guidance/algorithms.md recommends the same shape for NFT: a low decay first, rising to 0.5). decay_max 0: the weights
that sampled the epoch (on-policy). Training times: the schedule's own sigmas (Flow-Factory's "discrete" time
sampling), so every sample trains at the same fixed set of times and the shapes never change.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ddpo_tpu import events as ev
from ddpo_tpu.ddpo.ppo import weighted_mean
from ddpo_tpu.ddpo.state import EMA

OLD = "nft_old"            # the old policy's name in TrainState.copies (and in the checkpoint's optimizer state)
WEIGHT_FLOOR = 1e-5        # the reference's clip of the adaptive weight


def optimality(advantages: Tensor, adv_clip_max: float) -> Tensor:
    """r in [0, 1]: the clipped advantage mapped linearly, 0 advantage -> 1/2."""
    a = advantages.clamp(-adv_clip_max, adv_clip_max)
    return ((a / adv_clip_max) / 2 + 0.5).clamp(0, 1)


def nft_loss(v: Tensor, v_old: Tensor, xt: Tensor, x0: Tensor, t: Tensor, advantages: Tensor, beta: float,
             adv_clip_max: float, weights: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """DiffusionNFT's loss of a batch: v, v_old, xt, x0 (B, ...); t broadcastable against them; advantages (B,);
    weights (B,) a loss weight per sample (None = 1). Returns (loss, mean positive term, mean negative term)."""
    dims = tuple(range(1, x0.dim()))
    v_old = v_old.detach()

    def term(velocity: Tensor) -> Tensor:
        err = xt - t * velocity - x0
        scale = err.detach().abs().mean(dim=dims, keepdim=True).clamp(min=WEIGHT_FLOOR)
        return (err ** 2 / scale).mean(dim=dims)

    positive = term(beta * v + (1 - beta) * v_old)
    negative = term((1 + beta) * v_old - beta * v)
    r = optimality(advantages.to(positive.dtype), adv_clip_max)
    per_sample = (r * positive + (1 - r) * negative) / beta * adv_clip_max
    return (weighted_mean(per_sample, weights), weighted_mean(positive.detach(), weights),
            weighted_mean(negative.detach(), weights))


class OldPolicy(EMA):
    """The old policy's weights: old <- d old + (1 - d) current once an epoch, d = min(rate x step, max)."""

    def __init__(self, params, rate: float, max_decay: float, rt):
        super().__init__(params, max_decay, 1, rt)
        self.rate = rate

    def weight(self, step: int) -> float:
        return 1.0 - min(self.rate * step, self.decay)


class NFT:
    """The algorithm's part of the loop: GRPO's prompts and group advantages; the training is NftEpochTrainer's."""

    name = "nft"
    stat_names = ("loss", "positive_loss", "negative_loss")
    needs_reference = False
    key_tokens = 256                # groups keyed as GRPO's
    shuffle_timesteps = False

    def __init__(self, cfg):
        from ddpo_tpu.ddpo.algorithm import GRPO

        self.cfg = cfg
        self.epoch_metrics: dict[str, float | int] = {}
        self.ode_sampling = cfg.algorithm.ode_sampling
        self._groups = GRPO.epoch_prompts  # the same group sampling (reads only cfg.algorithm.group_size)

    def epoch_prompts(self, source, batches: int, batch_size: int, rng: np.random.Generator) -> list[list[str]]:
        return self._groups(self, source, batches, batch_size, rng)

    def advantages(self, keys: list[str], rewards: np.ndarray) -> np.ndarray:
        from ddpo_tpu.ddpo.grpo import group_advantages

        return group_advantages(rewards, keys, global_std=self.cfg.algorithm.global_std)

    def rekey(self, key_of) -> None:
        pass

    def train_plan(self, epoch: int, advantages: np.ndarray, keys: list[str], rewards: np.ndarray) -> None:
        from ddpo_tpu.ddpo.grpo import zero_std_ratio

        finite = np.isfinite(rewards)
        self.epoch_metrics = {"zero_std_ratio": zero_std_ratio(rewards[finite], [k for k, f in zip(keys, finite) if f])}
        return None  # every sample, weight 1 (a zero advantage is r = 1/2, still a term)

    def loss(self, *args, **kwargs):
        raise NotImplementedError("DiffusionNFT does not re-score recorded steps: its epochs are NftEpochTrainer's")

    def make_epoch_trainer(self, trainer) -> "NftEpochTrainer":
        return NftEpochTrainer(trainer)

    def state_dict(self) -> dict[str, Any]:
        return {}  # the old policy is checkpointed with the optimizer (TrainState.copies)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def _flat(x0: Tensor, noise: Tensor, cols: Tensor, cond) -> tuple[Tensor, Tensor, Tensor, tuple]:
    """Columns `cols` (K training times) of B samples as B x K samples, sample-major."""
    B, K = x0.shape[0], cols.shape[0]
    return (x0.repeat_interleave(K, dim=0), noise.index_select(1, cols).reshape(B * K, *noise.shape[2:]),
            cols.repeat(B), tuple(c.repeat_interleave(K, dim=0) for c in cond))


class NftEpochTrainer:
    """Trains an epoch on the forward process: fixed shapes, times (schedule indices) and noise uploaded as data from
    the host generator of (seed, epoch, STREAM_SHUFFLE, inner), each function compiled once (rt.compile_step)."""

    def __init__(self, trainer):
        self.tr = trainer
        cfg, rt, fam = trainer.cfg, trainer.rt, trainer.family
        a = cfg.algorithm
        self.old = trainer.state.copies.setdefault(OLD, OldPolicy(trainer.state.params, a.decay_rate, a.decay_max, rt))
        velocity = fam.make_velocity(lambda: rt.autocast(trainer.mixed))

        def old_velocity(x0, noise, cols, cond):
            x, z, i, c = _flat(x0, noise, cols, cond)
            return velocity(x, z, i, c)[0].reshape(x0.shape[0], cols.shape[0], *x0.shape[1:])

        def step_loss(x0, noise, v_old, cols, cond, adv, w):
            x, z, i, c = _flat(x0, noise, cols, cond)
            K = cols.shape[0]
            v, xt, t = velocity(x, z, i, c)
            vo = v_old.index_select(1, cols).reshape(v.shape)
            return nft_loss(v, vo, xt, x.float(), t, adv.repeat_interleave(K), a.beta, a.adv_clip_max,
                            w.repeat_interleave(K))

        self.old_velocity, self.step_loss = rt.compile_step(old_velocity), rt.compile_step(step_loss)

    def sampling_policy(self):
        """The old policy samples the epoch."""
        return self.old.swapped_in()

    def train_epoch(self, epoch: int, s) -> list[dict[str, float]]:
        from ddpo_tpu.ddpo.loop import PROGRESS_EVERY_S, STREAM_SHUFFLE, stream_seed

        tr = self.tr
        cfg, rt, dev = tr.cfg, tr.rt, tr.rt.device
        tr.family.model.train()
        x0_all = s.latents[:, -1]
        N, T, K = x0_all.shape[0], tr.train_timesteps, tr.fused
        logs, micro, said = [], 0, time.monotonic()
        total = cfg.train.num_inner_epochs * N * T // tr.train_batch
        stats = torch.zeros(len(NFT.stat_names)).to(dev)
        for inner in range(cfg.train.num_inner_epochs):
            gen = torch.Generator().manual_seed(stream_seed(cfg.seed, epoch, STREAM_SHUFFLE, inner))
            perm = torch.argsort(torch.rand(N, generator=gen).to(dev))
            noise = torch.randn((N, T, *x0_all.shape[1:]), generator=gen)  # per train position, on the host
            rt.sync()  # the permutation materialised before it indexes (loop.train_epoch: torch_xla 2.9)
            x0, adv, w = (x.index_select(0, perm) for x in (x0_all, s.advantages, s.weights))
            cond = tuple(c.index_select(0, perm) for c in s.cond)
            rt.sync()
            for b in range(N // tr.train_batch):
                # this process's rows of the global train batch (all of them unless distributed)
                rows = slice(b * tr.train_batch, (b + 1) * tr.train_batch)
                sel = torch.arange(rows.start, rows.stop)[rt.local_rows(tr.train_batch)].to(dev)
                pick = lambda x: x.index_select(0, sel)
                xb, cb, ab, wb = pick(x0), tuple(map(pick, cond)), pick(adv), pick(w)
                zb = rt.shard_batch(noise[rows].to(dev, dtype=x0.dtype))  # the global batch's noise -> its layout
                all_cols = torch.arange(T).to(dev)
                with torch.no_grad(), self.old.swapped_in():  # v_old of every training time, one forward
                    v_old = self.old_velocity(xb, zb, all_cols, cb)
                rt.sync()
                for j in range(0, T, K):
                    cols = torch.arange(j, j + K).to(dev)  # data: one graph for every j
                    last = (micro + K) % tr.window == 0
                    with contextlib.nullcontext() if last else rt.no_gradient_sync(tr.family.model):
                        loss, *rest = self.step_loss(xb, zb, v_old, cols, cb, ab, wb)
                        (loss / (tr.window // K)).backward()  # as loop.train_epoch: each time weighs 1 / window
                    stats = stats + K * torch.stack([loss.detach(), *rest])
                    micro += K
                    if micro % tr.window == 0:
                        logs.append(tr._update(epoch, stats / tr.window))
                        stats = torch.zeros(len(NFT.stat_names)).to(dev)
                    else:
                        rt.sync()
                    if time.monotonic() - said > PROGRESS_EVERY_S:
                        said = time.monotonic()
                        tr.events.emit(ev.TrainingProgress(epoch, micro, total, len(logs)))
                tr.state.end_batch()
                tr.events.emit(ev.TrainingBatch(epoch, micro, total, len(logs)))
        self.old.update(tr.state.global_step)  # the next epoch's sampling (and old) policy
        return logs
