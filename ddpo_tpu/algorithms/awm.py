"""Advantage Weighted Matching (Xue et al., ICML 2026; scxue/advantage_weighted_matching) as `algorithm=awm`, for the
flow-matching families. Written from the reference's training script at be5137232e33a21b449ed65a533211d0deb97ed8,
advantage_weighted_matching/scripts/train_sd3_awm.py (lines cited below as awm:LINE) and its presets
(config/dgx_awm.py).

An epoch: the current policy samples (the family's ODE: training needs only the clean samples x0), rewards become
group advantages (as GRPO's, awm:1019), clipped to +-train.adv_clip_max and rescaled to +-advantage_max (awm:1293-1299).
Training runs on the forward process: each x0 is noised again at `train_timesteps` schedule times t, one drawn from each
of as many strata of the first int(num_steps x train.timestep_fraction) steps (awm:1172-1205; the same times for every
sample of a train batch), x_t = (1 - t) x0 + t eps with fresh eps (awm:1214-1220, 1232). The policy's "log-probability"
of a sample at t is its negative flow-matching error, optionally weighted (compute_log_prob_awm, awm:210-252):

    lp = -w(mse),  mse = mean((v(x_t, t) - (eps - x0))^2),  w: uniform | t | t2 | huber | ghuber,

and the loss is PPO's clipped surrogate of the ratio exp(lp - lp_old) with the advantage (exp_first, awm:1301-1327), a
mean over the batch's (time, sample) rows, plus beta x mean((v - v_ref)^2) to the adapter-off reference and, with it,
ema_beta x mean((v - v_ema)^2) to a slow copy of the policy (awm:1331-1352). On-policy the ratio is 1 in value, and its
gradient is the advantage-weighted gradient of the matching error: the paper's point.

lp_old comes from the weights that sampled the epoch: the batches of the first optimizer step use their own
detached lp (the weights have not moved yet, awm:1227-1229, 1283-1284); the others are scored once before training
(awm:1232-1238). The slow copy (TrainState.copies["awm_ema"], checkpointed with the optimizer) starts at the policy
(awm:655-658) and after each epoch becomes d copy + (1 - d) policy, d = min(0.001 x optimizer steps, kl_ema_decay)
(awm:1409-1419).

Not ported: the SA-Solver sampler (use_sa_solver; the family's ODE samples here), off-policy sampling with the slow
copy (off_policy, false in every preset), loss_type=sum_first, the continuous time types, CFG in training, and the
first two epochs the reference skips (awm:880, a workaround for its own prompt sampler). Float32 here where the
reference scores in float64 (awm:238): TPUs have no float64.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from ddpo_tpu.algorithms.groups import GroupAlgorithm
from ddpo_tpu.config.plan import RunPlan
from ddpo_tpu.random_streams import SHUFFLE, stream_seed
from ddpo_tpu.training.ppo_epoch import EpochTrainer
from ddpo_tpu.training.state import EMA

SLOW = "awm_ema"        # the slow copy's name in TrainState.copies
TINY = 1e-10            # the reference's floor inside the huber weightings (awm:247, 249)
KL_EMA_RATE = 0.001     # d = min(rate x step, kl_ema_decay): the rate is a constant there (awm:1413)


def matching_log_prob(v: Tensor, x0: Tensor, noise: Tensor, t: Tensor, weighting: str = "uniform",
                      ghuber_power: float = 0.25) -> Tensor:
    """compute_log_prob_awm (awm:236-252): minus the (weighted) flow-matching error of each row. v, x0, noise
    (R, ...); t (R,) the rows' times in [0, 1]."""
    mse = ((v.float() - (noise.float() - x0.float())) ** 2).mean(dim=tuple(range(1, v.dim())))
    t = t.reshape(-1).to(mse.dtype)
    if weighting == "uniform":
        return -mse
    if weighting == "t":
        return -mse * t
    if weighting == "t2":
        return -mse * t ** 2
    if weighting == "huber":
        return -(torch.sqrt(mse + TINY) - 1e-5) * t
    if weighting == "ghuber":
        p = ghuber_power
        return -((mse + TINY) ** p - TINY ** p) * t / p
    raise ValueError(f"unknown AWM weighting {weighting!r}")


def scaled_advantages(advantages: Tensor, adv_clip_max: float, advantage_max: float | None) -> Tensor:
    """awm:1293-1299: clip to +-adv_clip_max, then onto +-advantage_max (None: no rescale)."""
    a = advantages.clamp(-adv_clip_max, adv_clip_max)
    return a / adv_clip_max * advantage_max if advantage_max is not None else a


def velocity_kl(v: Tensor, v_other: Tensor, t: Tensor, kind: str) -> Tensor:
    """awm:1334-1339: the mean over rows of mean((v - v_other)^2), ELBO: over 2 std_t^2 with the reference's
    std_t = 0.7 sqrt(t / (1 - min(t, 0.99))) (awm:236)."""
    per = ((v.float() - v_other.float()) ** 2).mean(dim=tuple(range(1, v.dim())))
    if kind == "elbo":
        t = t.reshape(-1).to(per.dtype)
        std = torch.sqrt(t / (1 - t.clamp(0, 0.99))) * 0.7
        per = per / (2 * std ** 2)
    return per.mean()


def awm_loss(lp: Tensor, old_lp: Tensor, advantages: Tensor, clip_range: float, kl: Tensor | None = None,
             beta: float = 0.0, ema_kl: Tensor | None = None, ema_beta: float = 0.0) -> tuple[Tensor, ...]:
    """exp_first (awm:1305-1352): lp, old_lp, advantages (R,) per (time, sample) row, advantages already scaled.
    Returns (loss, policy loss, clipfrac)."""
    ratio = torch.exp(lp - old_lp.detach())
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_range, 1.0 + clip_range)
    policy = torch.maximum(unclipped, clipped).mean()
    loss = policy
    if beta > 0 and kl is not None:
        loss = loss + beta * kl
        if ema_beta > 0 and ema_kl is not None:  # nested under beta > 0 there (awm:1341)
            loss = loss + ema_beta * ema_kl
    clipfrac = ((ratio - 1.0).abs() > clip_range).float().mean()
    return loss, policy.detach(), clipfrac.detach()


def time_indices(kind: str, num_steps: int, fraction: float, k: int, u: Tensor) -> Tensor:
    """The training times' schedule indices of one train batch (awm:1172-1205): one from each of k strata of
    [lo, int(num_steps x fraction)] (lo = 0 "discrete", 1 "discrete_wo_init"), u (k,) uniform draws."""
    lo = {"discrete": 0, "discrete_wo_init": 1}[kind]
    bounds = torch.linspace(lo, int(num_steps * fraction), steps=k + 1)
    lower, upper = bounds[:-1].long(), bounds[1:].long()
    return lower + (u * (upper - lower)).long()


class SlowCopy(EMA):
    """The KL's slow copy: after each epoch copy <- d copy + (1 - d) policy, d = min(0.001 x step, kl_ema_decay)."""

    def weight(self, step: int) -> float:
        return 1.0 - min(KL_EMA_RATE * step, self.decay)


class AWM(GroupAlgorithm):
    """The algorithm's part of the loop: GRPO's prompts (groups) and group advantages (the reference's stat tracker is
    flow_grpo's); the training is AwmEpochTrainer's."""

    name = "awm"
    stat_names = ("loss", "policy_loss", "clipfrac", "kl", "ema_kl")
    ode_sampling = True             # training reads only the clean samples

    # needs_reference stays False: the reference velocity is AwmEpochTrainer's own forward

    def train_plan(self, epoch: int, advantages: np.ndarray, keys: list[str], rewards: np.ndarray) -> None:
        """Every sample with weight 1: the reference keeps zero-advantage samples (awm:1076-1078)."""
        self.note_zero_std(keys, rewards)

    def make_epoch_trainer(self, ctx) -> "AwmEpochTrainer":
        return AwmEpochTrainer(ctx, self.plan)


class AwmEpochTrainer(EpochTrainer):
    """Trains an epoch on the forward process: per train batch one forward of K x B rows (time-major, as the
    reference concatenates them), times and noise drawn on the host from (seed, epoch, SHUFFLE) and uploaded as data,
    each function compiled once (rt.compile_step); the optimizer steps are the Stepper's (training/stepper.py), a
    micro-step counting the K timesteps of one train batch, an optimizer step every gradient_accumulation_steps
    train batches. K (the plan's train_timesteps, all fused: catalog AlgorithmSpec.one_forward), the train batch and
    the window are the run plan's (`plan`, config/plan.py), not recomputed from the config."""

    def __init__(self, ctx, plan: RunPlan):
        self.ctx, self.plan = ctx, plan
        cfg, rt, fam = ctx.cfg, ctx.rt, ctx.family
        a = self.a = cfg.algorithm
        if plan.fused_timesteps != plan.train_timesteps:
            raise ValueError(f"AWM trains a sample's {plan.train_timesteps} timesteps in one forward; the plan fuses "
                             f"{plan.fused_timesteps}")
        self.K = plan.train_timesteps
        self.slow = (ctx.state.copies.setdefault(SLOW, SlowCopy(ctx.state.params, a.kl_ema_decay, 1, rt))
                     if a.kl_beta > 0 and a.ema_beta > 0 else None)
        velocity = fam.make_velocity(ctx.autocast)
        K = self.K

        def rows(x0, noise, idx, cond):
            """(B, ...) samples x K times -> K x B rows, time-major: row k B + b is sample b at time k."""
            rep = lambda x: x.repeat(K, *([1] * (x.dim() - 1)))
            return (rep(x0), noise.reshape(-1, *noise.shape[2:]), idx.repeat_interleave(x0.shape[0]),
                    tuple(map(rep, cond)))

        def forward(x0, noise, idx, cond):
            x, z, i, c = rows(x0, noise, idx, cond)
            return velocity(x, z, i, c)  # v, x_t, t

        def score(x0, noise, idx, cond):
            x, z, i, c = rows(x0, noise, idx, cond)
            v, _, t = velocity(x, z, i, c)
            return matching_log_prob(v, x, z, t, a.weighting, a.ghuber_power)

        def step_loss(x0, noise, idx, cond, adv, old_lp, own, v_ref=None, v_slow=None):
            x, z, i, c = rows(x0, noise, idx, cond)
            v, _, t = velocity(x, z, i, c)
            lp = matching_log_prob(v, x, z, t, a.weighting, a.ghuber_power)
            old = torch.where(own, lp.detach(), old_lp)  # the first step's batches: their own lp (awm:1283)
            A = scaled_advantages(adv, cfg.train.adv_clip_max, a.advantage_max).repeat(K)
            kl = velocity_kl(v, v_ref, t, a.kl_weight) if v_ref is not None else lp.new_zeros(())
            ema_kl = velocity_kl(v, v_slow, t, a.kl_weight) if v_slow is not None else lp.new_zeros(())
            loss, policy, clipfrac = awm_loss(lp, old, A, a.clip_range, kl, a.kl_beta, ema_kl, a.ema_beta)
            return loss, policy, clipfrac, kl.detach(), ema_kl.detach()

        self.forward, self.score = rt.compile_step(forward), rt.compile_step(score)
        self.step_loss = rt.compile_step(step_loss)

    # sampling_policy: the current weights sample (on-policy: off_policy=False in every preset)

    def draws(self, epoch: int, n_batches: int, B: int, latent_shape) -> tuple[Tensor, Tensor, Tensor]:
        """The epoch's sample order (N,), each train batch's time indices (n_batches, K) and noise
        (n_batches, K, B, ...), from the host generator of (seed, epoch, SHUFFLE)."""
        cfg = self.ctx.cfg
        gen = torch.Generator().manual_seed(stream_seed(cfg.seed, epoch, SHUFFLE))
        perm = torch.argsort(torch.rand(n_batches * B, generator=gen))
        u = torch.rand((n_batches, self.K), generator=gen)
        idx = torch.stack([time_indices(self.a.time_type, self.ctx.family.num_steps, cfg.train.timestep_fraction,
                                        self.K, u[b]) for b in range(n_batches)])
        noise = torch.randn((n_batches, self.K, B, *latent_shape), generator=gen)
        return perm, idx, noise

    def train_epoch(self, epoch: int, s) -> list[dict[str, float]]:
        ctx, a = self.ctx, self.a
        rt, fam, dev, stepper = ctx.rt, ctx.family, ctx.rt.device, ctx.stepper
        x0_all = s.latents[:, -1]
        # G: the train batches of an optimizer step (the first G score their own lp_old, awm:1283)
        N, B, G = x0_all.shape[0], self.plan.global_train_batch, self.plan.gradient_accumulation_steps
        nb = N // B
        perm, idx_all, noise_all = self.draws(epoch, nb, B, x0_all.shape[1:])
        perm = perm.to(dev)
        rt.sync()  # the permutation materialised before it indexes (ppo_epoch.py: torch_xla 2.9)
        x0, adv = x0_all.index_select(0, perm), s.advantages.index_select(0, perm)
        cond = tuple(c.index_select(0, perm) for c in s.cond)
        rt.sync()

        def batch(b):
            sel = torch.arange(b * B, (b + 1) * B)[rt.local_rows(B)].to(dev)  # this process's rows
            pick = lambda x: x.index_select(0, sel)
            z = noise_all[b][:, rt.local_rows(B)]
            return (pick(x0), z.to(dev, dtype=x0.dtype), idx_all[b].to(dev), tuple(map(pick, cond)), pick(adv))

        fam.model.train()
        # lp_old of the batches after the first optimizer step, under the weights that sampled the epoch (awm:1232)
        old = {}
        with torch.no_grad():
            for b in range(G, nb):
                xb, zb, ib, cb, _ = batch(b)
                old[b] = self.score(xb, zb, ib, cb)
        rt.sync()
        # the plan's window of G train batches x K timesteps: accelerate's accumulation, each batch's loss over G
        stepper.begin(epoch, window=self.plan.accumulation_window, total=nb * self.K)
        for b in range(nb):
            xb, zb, ib, cb, ab = batch(b)
            extra = {}
            if a.kl_beta > 0:
                with torch.no_grad(), fam.reference():
                    extra["v_ref"] = self.forward(xb, zb, ib, cb)[0]
                if self.slow is not None:
                    with torch.no_grad(), self.slow.swapped_in():
                        extra["v_slow"] = self.forward(xb, zb, ib, cb)[0]
            own = torch.tensor(b < G).to(dev)
            old_lp = old.pop(b) if b in old else torch.zeros(self.K * xb.shape[0]).to(dev)
            stepper.micro_step(lambda: self.step_loss(xb, zb, ib, cb, ab, old_lp, own, **extra), units=self.K)
            ctx.state.end_batch()
        stepper.batch_done()
        if self.slow is not None:
            self.slow.update(ctx.state.global_step)  # after the epoch (awm:1409-1418)
        return stepper.finish()
