"""DiffusionNFT (Zheng et al. 2025, "DiffusionNFT: Online Diffusion Reinforcement with Forward Process", arXiv
2509.16117) as `algorithm=nft` for the flow-matching families, following NVlabs' code (NVlabs/DiffusionNFT@24af5554,
scripts/train_nft_sd3.py; docs/nft.md maps every key to it).

An epoch: the old policy samples (the ODE: sample.ode_solver, dpm2 in the official presets; algorithms/nft_rollout.py),
rewards become group advantages A (as GRPO's) and an optimality probability r = clip(clip(A, -c, c) / c / 2 + 1/2,
0, 1). Training runs on the forward process, not on the recorded steps: each clean final latent x0 is noised again,
x_t = (1 - t) x0 + t eps, at int(T x train.timestep_fraction) training times per sample drawn at random from the T
sampling sigmas (a per-sample permutation, as there), with fresh noise; the old policy's velocity v_old (no gradient)
and the current v on x_t give the implicit positive and negative policies

    v+ = beta v + (1 - beta) v_old,        v- = (1 + beta) v_old - beta v,

whose x0 predictions x_t - t v+- are pulled to x0, each squared error divided by its own detached mean absolute
error (clipped at 1e-5; float64 there, float32 here: TPUs have none), weighted r and 1 - r; plus the KL term to the
reference (the model with its LoRA adapter off), mean((v - v_ref)^2), weighted kl_beta (the official
`config.train.beta`, 1e-4; `beta` is the official `config.beta`):

    loss = c x mean(r L+ + (1 - r) L-) / beta + kl_beta x mean over samples of mean((v - v_ref)^2).

The old policy: a copy of the trained weights (TrainState.copies["nft_old"], checkpointed with the optimizer, so a
resume is exact) that samples the epoch and gives v_old; after each epoch old <- d old + (1 - d) current with
d = 0 for the first decay_start optimizer steps, then min(decay_rate x (steps - decay_start), decay_max)
(return_decay there; its decay_type 0, 1, 2 are (0, 0, 0), (0, 0.001, 0.5), (75, 0.0075, 0.999)). The EMA of the
trained weights (train.ema) steps once per optimizer step, as there.
"""

from __future__ import annotations


import numpy as np
import torch
from torch import Tensor

from ddpo_tpu.algorithms.ppo import weighted_mean
from ddpo_tpu.catalog.algorithms import integer_rollout_timesteps
from ddpo_tpu.algorithms.groups import GroupAlgorithm
from ddpo_tpu.config.plan import RunPlan
from ddpo_tpu.random_streams import SHUFFLE, stream_seed
from ddpo_tpu.training.ppo_epoch import EpochTrainer
from ddpo_tpu.training.state import EMA

OLD = "nft_old"            # the old policy's name in TrainState.copies (and in the checkpoint's optimizer state)
WEIGHT_FLOOR = 1e-5        # the reference's clip of the adaptive weight


def optimality(advantages: Tensor, adv_clip_max: float) -> Tensor:
    """r in [0, 1]: the clipped advantage mapped linearly, 0 advantage -> 1/2."""
    a = advantages.clamp(-adv_clip_max, adv_clip_max)
    return ((a / adv_clip_max) / 2 + 0.5).clamp(0, 1)


def nft_loss(v: Tensor, v_old: Tensor, xt: Tensor, x0: Tensor, t: Tensor, advantages: Tensor, beta: float,
             adv_clip_max: float, weights: Tensor | None = None, v_ref: Tensor | None = None,
             kl_beta: float = 0.0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """DiffusionNFT's loss of a batch: v, v_old, xt, x0 (B, ...); t broadcastable against them; advantages (B,);
    weights (B,) a loss weight per sample (None = 1); v_ref the reference's velocity (None: no KL term). Returns
    (loss, mean positive term, mean negative term, mean KL term)."""
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
    loss = weighted_mean(per_sample, weights)
    kl = torch.zeros((), dtype=loss.dtype, device=loss.device)
    if v_ref is not None:
        kl = weighted_mean(((v - v_ref.detach()) ** 2).mean(dim=dims), weights)
        loss = loss + kl_beta * kl
    return (loss, weighted_mean(positive.detach(), weights), weighted_mean(negative.detach(), weights), kl.detach())


class OldPolicy(EMA):
    """The old policy's weights: old <- d old + (1 - d) current once an epoch, d = 0 before `start` optimizer steps,
    then min(rate x (step - start), max) (return_decay, train_nft_sd3.py:169)."""

    def __init__(self, params, rate: float, max_decay: float, rt, start: int = 0):
        super().__init__(params, max_decay, 1, rt)
        self.rate, self.start = rate, start

    def weight(self, step: int) -> float:
        d = 0.0 if step < self.start else min(self.rate * (step - self.start), self.decay)
        return 1.0 - d


class NFT(GroupAlgorithm):
    """The algorithm's part of the loop: GRPO's prompts and group advantages; the training is NftEpochTrainer's. Its
    old policy is checkpointed with the optimizer (TrainState.copies), so it has no state of its own."""

    name = "nft"
    stat_names = ("loss", "positive_loss", "negative_loss", "kl")

    def __init__(self, cfg, plan: RunPlan | None = None):
        super().__init__(cfg, plan)
        self.ode_sampling = cfg.algorithm.ode_sampling

    def train_plan(self, epoch: int, advantages: np.ndarray, keys: list[str], rewards: np.ndarray) -> None:
        self.note_zero_std(keys, rewards)
        return None  # every sample, weight 1 (a zero advantage is r = 1/2, still a term)

    def make_epoch_trainer(self, ctx) -> "NftEpochTrainer":
        return NftEpochTrainer(ctx)


def _flat(x0: Tensor, noise: Tensor, times: Tensor, cols: Tensor, cond) -> tuple[Tensor, Tensor, Tensor, tuple]:
    """Columns `cols` (K of the T training positions) of B samples as B x K samples, sample-major: x0, noise (B, T,
    ...) and the schedule indices `times` (B, T) of each sample's training times."""
    B, K = x0.shape[0], cols.shape[0]
    return (x0.repeat_interleave(K, dim=0), noise.index_select(1, cols).reshape(B * K, *noise.shape[2:]),
            times.index_select(1, cols).reshape(B * K), tuple(c.repeat_interleave(K, dim=0) for c in cond))


def draw_training_times(gen: torch.Generator, n: int, steps: int, train: int) -> Tensor:
    """(n, train) schedule indices: each sample's own random `train` of the `steps` sampling sigmas, in random order
    (train_nft_sd3.py:810, a randperm per sample whose first int(steps x timestep_fraction) are trained)."""
    return torch.argsort(torch.rand(n, steps, generator=gen), dim=1)[:, :train]


class NftEpochTrainer(EpochTrainer):
    """Trains an epoch on the forward process: fixed shapes, times (schedule indices) and noise uploaded as data from
    the host generator of (seed, epoch, SHUFFLE, inner), each function compiled once (rt.compile_step); the
    optimizer steps are the Stepper's (training/stepper.py), a micro-step counting its K timesteps."""

    def __init__(self, ctx):
        from ddpo_tpu.algorithms.nft_rollout import integer_timesteps, make_rollout_step

        self.ctx = ctx
        cfg, rt, fam = ctx.cfg, ctx.rt, ctx.family
        a = cfg.algorithm
        self.old = ctx.state.copies.setdefault(
            OLD, OldPolicy(ctx.state.params, a.decay_rate, a.decay_max, rt, a.decay_start))
        velocity = fam.make_velocity(ctx.autocast)
        if a.ode_sampling:  # the rollouts: the official solver and timesteps (the loop's sampling step otherwise)
            tables = integer_timesteps(fam.tables) if integer_rollout_timesteps(cfg) else fam.tables
            step = rt.compile_step(make_rollout_step(fam, ctx.autocast, tables, cfg.sample.ode_solver))
            step.multistep = True
            self.sampling_step = step

        def old_velocity(x0, noise, times, cond):
            cols = torch.arange(times.shape[1], device=times.device)
            x, z, i, c = _flat(x0, noise, times, cols, cond)
            return velocity(x, z, i, c)[0].reshape(x0.shape[0], times.shape[1], *x0.shape[1:])

        def ref_velocity(x0, noise, times, cols, cond):
            return velocity(*_flat(x0, noise, times, cols, cond))[0]

        def step_loss(x0, noise, v_old, times, cols, cond, adv, w, v_ref):
            x, z, i, c = _flat(x0, noise, times, cols, cond)
            K = cols.shape[0]
            v, xt, t = velocity(x, z, i, c)
            vo = v_old.index_select(1, cols).reshape(v.shape)
            return nft_loss(v, vo, xt, x.float(), t, adv.repeat_interleave(K), a.beta, a.adv_clip_max,
                            w.repeat_interleave(K), v_ref, a.kl_beta)

        self.old_velocity, self.step_loss = rt.compile_step(old_velocity), rt.compile_step(step_loss)
        # the KL term's reference: the same forward with the adapter off (a graph of its own, forward only)
        self.ref_velocity = rt.compile_step(ref_velocity) if a.kl_beta > 0 else None

    def sampling_policy(self):
        """The old policy samples the epoch."""
        return self.old.swapped_in()

    def train_epoch(self, epoch: int, s) -> list[dict[str, float]]:
        ctx = self.ctx
        cfg, rt, dev, shape, stepper = ctx.cfg, ctx.rt, ctx.rt.device, ctx.shape, ctx.stepper
        ctx.family.model.train()
        x0_all = s.latents[:, -1]
        N, T, K, S = x0_all.shape[0], shape.train_timesteps, shape.fused, ctx.family.num_steps
        B = shape.train_batch
        stepper.begin(epoch, window=shape.window, total=cfg.train.num_inner_epochs * N * T // B)
        for inner in range(cfg.train.num_inner_epochs):
            gen = torch.Generator().manual_seed(stream_seed(cfg.seed, epoch, SHUFFLE, inner))
            perm = torch.argsort(torch.rand(N, generator=gen).to(dev))
            noise = torch.randn((N, T, *x0_all.shape[1:]), generator=gen)  # per train position, on the host
            times_all = draw_training_times(gen, N, S, T)                   # per shuffled sample
            rt.sync()  # the permutation materialised before it indexes (ppo_epoch.py: torch_xla 2.9)
            x0, adv, w = (x.index_select(0, perm) for x in (x0_all, s.advantages, s.weights))
            cond = tuple(c.index_select(0, perm) for c in s.cond)
            rt.sync()
            for b in range(N // B):
                # this process's rows of the global train batch (all of them unless distributed)
                rows = slice(b * B, (b + 1) * B)
                sel = torch.arange(rows.start, rows.stop)[rt.local_rows(B)].to(dev)
                pick = lambda x: x.index_select(0, sel)
                xb, cb, ab, wb = pick(x0), tuple(map(pick, cond)), pick(adv), pick(w)
                zb = rt.shard_batch(noise[rows].to(dev, dtype=x0.dtype))  # the global batch's noise -> its layout
                tb = rt.shard_batch(times_all[rows].to(dev))
                with torch.no_grad(), self.old.swapped_in():  # v_old of every training time, one forward
                    v_old = self.old_velocity(xb, zb, tb, cb)
                rt.sync()
                for j in range(0, T, K):
                    cols = torch.arange(j, j + K).to(dev)  # data: one graph for every j
                    v_ref = None
                    if self.ref_velocity is not None:
                        with torch.no_grad(), ctx.family.reference():
                            v_ref = self.ref_velocity(xb, zb, tb, cols, cb)
                    stepper.micro_step(lambda: self.step_loss(xb, zb, v_old, tb, cols, cb, ab, wb, v_ref), units=K)
                if stepper.window_closed:  # the EMA steps once per optimizer step (train_nft_sd3.py:1024)
                    ctx.state.end_batch()
                stepper.batch_done()
        self.old.update(ctx.state.global_step)  # the next epoch's sampling (and old) policy
        return stepper.finish()
