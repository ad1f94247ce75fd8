"""The default epoch trainer: PPO's re-scoring of the recorded sampling steps (DDPO, Flow-GRPO and their options).

Per inner epoch the samples and each sample's time axis are shuffled on the device (or follow the algorithm's train
order: GRPO's zero-advantage plan); each micro-step re-scores K recorded steps of one train batch under the current
weights (one fused forward of B x K rows), the algorithm turns the new and the recorded log-probs into its clipped
loss, and the Stepper (training/stepper.py) accumulates the window and steps the optimizer. An algorithm with another
way of training (DiffusionNFT, AWM) supplies its own epoch trainer through `make_epoch_trainer`."""

from __future__ import annotations

import contextlib

import torch

from ddpo_tpu.random_streams import SHUFFLE, stream_seed
from ddpo_tpu.training.epoch_data import EpochSamples, batch_mean_weights, train_batches
from ddpo_tpu.training.state import EMA
from ddpo_tpu.training.stepper import EpochContext


class EpochTrainer:
    """What the loop asks of an epoch trainer. `sampling_step`: a replacement for the family's denoising step while
    sampling (DiffusionNFT's ODE solver), None keeps the family's."""

    sampling_step = None

    def sampling_policy(self):
        """The weights that sample the epoch (a context): the current ones unless the algorithm keeps others."""
        return contextlib.nullcontext()

    def train_epoch(self, epoch: int, s: EpochSamples) -> list[dict[str, float]]:
        raise NotImplementedError


def _repeat(x, K: int):
    """Each row K times (sample-major), as repeat_interleave; at K = 1 the tensor itself: repeat_interleave(1) is a
    full copy (for the conditioning, a B x tokens x width tensor every micro-step: benchmarks/step_ops.py counted it
    as ddpo_tpu's one extra pool-sized op a step against flow_grpo's)."""
    return x if K == 1 else x.repeat_interleave(K, dim=0)


def _flat_step_inputs(cur, nxt, idx, cond, cols):
    """Columns `cols` (K timesteps) of a train batch of B samples as B x K samples, sample-major (so each
    data-parallel shard keeps its own samples)."""
    B, K = cur.shape[0], cols.shape[0]
    flat = lambda x: x.index_select(1, cols).reshape(B * K, *x.shape[2:])
    return flat(cur), flat(idx), flat(nxt), tuple(_repeat(c, K) for c in cond), flat


def make_micro_step_loss(score_step, loss, sqrt_dt=None):
    """The clipped-objective loss of K timesteps (columns `cols` of the time axis) of one train batch, fused into
    one guided forward of B x K samples. Returns the algorithm's (loss, *statistics), each a mean over the B x K
    terms. A plain function of tensors: the runtime compiles it once."""

    def micro_step_loss(cur, nxt, old_lp, idx, cond, adv, cols, uncond, reference_mean=None, w=None, old_mean=None,
                        kl_gate=None):
        x, i, x_prev, c, flat = _flat_step_inputs(cur, nxt, idx, cond, cols)
        K = cols.shape[0]
        # old_mean: the sampling policy's step means (GRPO-Guard), with each row's sqrt(-dt) from the flow tables
        guard = {} if old_mean is None else {"old_mean": old_mean, "sqrt_dt": sqrt_dt(i), "steps": i}
        if kl_gate is not None:  # (B,) GARDO: the KL's row weights (0 on the samples that do not carry it)
            guard["kl_gate"] = _repeat(kl_gate, K)
        # w (B,): each sample's loss weight (EpochSamples.weights), None = 1
        return loss(score_step(x, i, x_prev, c, uncond), flat(old_lp), _repeat(adv, K), reference_mean,
                    _repeat(w, K) if w is not None else None, **guard)

    return micro_step_loss


def make_reference_mean(score_step):
    """The step means of the same B x K samples under the reference policy (run inside family.reference())."""

    def reference_mean(cur, nxt, old_lp, idx, cond, adv, cols, uncond):
        x, i, x_prev, c, _ = _flat_step_inputs(cur, nxt, idx, cond, cols)
        return score_step(x, i, x_prev, c, uncond).mean

    return reference_mean


class PpoEpochTrainer(EpochTrainer):
    """Re-scores the recorded steps (see the module docstring). `uncond_train`: the unconditional prompt expanded to a
    fused train batch (classifier-free guidance), built once by the Trainer."""

    def __init__(self, ctx: EpochContext, algorithm, uncond_train):
        self.ctx, self.algorithm, self.uncond_train = ctx, algorithm, uncond_train
        rt, fam = ctx.rt, ctx.family
        score_step = fam.make_score_step(ctx.autocast)
        old_mean = algorithm.needs_old_mean
        tables = fam.tables if old_mean else None
        sqrt_dt = (lambda i: torch.sqrt(tables.sigmas_at(i)[0] - tables.sigmas_at(i)[1])) if tables else None
        self.micro_step_loss = rt.compile_step(make_micro_step_loss(score_step, algorithm.loss, sqrt_dt))
        # GRPO's KL term: the same forward with the adapter off (a graph of its own, forward only)
        step_mean = (rt.compile_step(make_reference_mean(score_step))
                     if algorithm.needs_reference or old_mean else None)
        self.reference_mean = step_mean if algorithm.needs_reference else None
        # GRPO-Guard: the step means of the weights that sampled the epoch (a copy taken when training starts)
        self.sampling_copy = (ctx.state.copies.setdefault("sampling_policy", EMA(ctx.state.params, 0.0, 1, rt))
                              if old_mean else None)
        self.old_mean = step_mean if old_mean else None
        # the reference's context: the algorithm's own (GARDO's reset copy) or the adapter-off model
        self.reference_policy = algorithm.reference_policy(ctx) or fam.reference

    def train_epoch(self, epoch: int, s: EpochSamples) -> list[dict[str, float]]:
        ctx = self.ctx
        cfg, rt, shape, stepper = ctx.cfg, ctx.rt, ctx.shape, ctx.stepper
        ctx.family.model.train()
        if self.sampling_copy is not None:  # nothing has trained since sampling: these are the sampling weights
            self.sampling_copy.reset()
        N, T = s.log_probs.shape
        dev = rt.device
        batches, rows_of = train_batches(s, rt, shape.train_batch)  # this process's rows of each train batch
        stepper.begin(epoch, window=shape.window,
                      total=cfg.train.num_inner_epochs * batches * shape.train_timesteps)
        for inner in range(cfg.train.num_inner_epochs):
            # own rows: a shuffle of this process's samples, its own (as the references' per-process randperm)
            rank = (rt.process_index,) if s.own_rows else ()
            gen = torch.Generator().manual_seed(stream_seed(cfg.seed, epoch, SHUFFLE, inner, *rank))
            # shuffles: random keys from the host generator, argsort + gather on the device (fixed shapes)
            perm = torch.argsort(torch.rand(N, generator=gen).to(dev))
            if s.orders is not None:  # the algorithm's batches (GRPO: flow_grpo's, zero-advantage samples off)
                perm = s.orders[inner]
            if self.algorithm.shuffle_timesteps:
                tperm = torch.argsort(torch.rand((N, T), generator=gen).to(dev), dim=1)
            else:
                tperm = torch.arange(T).expand(N, T).contiguous().to(dev)
            # materialise the permutations first: on torch_xla 2.9 (PJRT CPU) an index_select whose index is a
            # pending sort aborts the process (xla/shape.h "buffer != nullptr"); one small graph, same every epoch
            rt.sync()
            lat = s.latents.index_select(0, perm)
            gat = lambda x: torch.gather(x, 1, tperm.view(N, T, *([1] * (x.dim() - 2))).expand(N, T, *x.shape[2:]))
            cur, nxt = gat(lat[:, :-1]), gat(lat[:, 1:])
            old_lp = gat(s.log_probs.index_select(0, perm))
            idx = gat(s.step_indices.index_select(0, perm))
            cond = tuple(c.index_select(0, perm) for c in s.cond)
            adv = s.advantages.index_select(0, perm)
            w = s.weights.index_select(0, perm)
            # GARDO: the KL's mean over each train batch's gated (kept) samples, as a plain weighted mean; own rows:
            # over this process's part of the batch, as each of flow_grpo's processes takes it
            span = shape.train_batch // rt.process_count if s.own_rows else shape.train_batch
            gate = batch_mean_weights(s.kl_gate.index_select(0, perm) * w, span) if s.kl_gate is not None else None
            rt.sync()
            uncond = self.uncond_train if cfg.train.cfg else None
            K = shape.fused
            for b in range(batches):
                sel = rows_of(b).to(dev)  # this process's rows of the train batch (all of them unless distributed)
                pick = lambda x: x.index_select(0, sel)
                batch = (pick(cur), pick(nxt), pick(old_lp), pick(idx), tuple(map(pick, cond)), pick(adv))
                wb, gb = pick(w), (pick(gate) if gate is not None else None)
                for j in range(0, shape.train_timesteps, K):
                    # this micro-step's K timesteps, uploaded as data: one graph for every j
                    cols = torch.arange(j, j + K).to(dev)
                    ref = None
                    if self.reference_mean is not None:
                        with torch.no_grad(), self.reference_policy():
                            ref = self.reference_mean(*batch, cols, uncond)
                    old = None
                    if self.old_mean is not None:
                        with torch.no_grad(), self.sampling_copy.swapped_in():
                            old = self.old_mean(*batch, cols, uncond)
                    # the loss is a mean over K x B terms: the stepper weighs it as K of the window's timesteps
                    stepper.micro_step(lambda: self.micro_step_loss(*batch, cols, uncond, ref, wb, old, gb), units=K)
                ctx.state.end_batch()
                stepper.batch_done()
        return stepper.finish()


__all__ = ["EpochTrainer", "PpoEpochTrainer", "make_micro_step_loss", "make_reference_mean"]
