"""The algorithms read the run plan (config/plan.py), not the config, for what validation decided (issue 42 item 4,
"Decide once"): each test hands an algorithm a plan that differs from what the config's own arithmetic would give and
checks the algorithm follows the plan. An algorithm that recomputed the quantity from cfg.sample / cfg.train would
follow the config instead and fail here. No training process, no XLA: numpy plans and a stubbed epoch trainer.

The expected layouts are flow_grpo's rebatching (yifan123/flow_grpo@ac4c86e8, scripts/train_sd3.py:796-834: the
zero-advantage mask, grown until the kept count divides the epoch's batches; here lcm(batches, optimizer steps), as
algorithms/grpo.py `zero_advantage_plan` explains) and AWM's accumulation (scxue/advantage_weighted_matching@be51372,
advantage_weighted_matching/scripts/train_sd3_awm.py:1226-1238: lp_old is scored before training for every batch
after the first gradient_accumulation_steps batches, the first optimizer step).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ddpo_tpu.config.compose import compose_and_validate
from ddpo_tpu.config.plan import run_plan


@pytest.fixture(scope="module")
def grpo_smoke():
    """flow_grpo_smoke: 8 sampling batches of 16, train batch 16, 4 accumulated: 2 optimizer steps an inner epoch."""
    return compose_and_validate(["+experiment=flow_grpo_smoke"])


def _advantages(n: int, kept: int) -> np.ndarray:
    """(n,) advantages with `kept` nonzero ones (the others a group of equal rewards)."""
    adv = np.zeros(n, dtype=np.float32)
    adv[np.random.default_rng(0).permutation(n)[:kept]] = 1.0
    return adv


def test_make_algorithm_hands_the_algorithm_its_plan(grpo_smoke):
    from ddpo_tpu.training.loop import make_algorithm

    plan = dataclasses.replace(grpo_smoke.plan, updates_per_inner_epoch=8)
    assert make_algorithm(grpo_smoke.cfg, plan).plan is plan
    assert make_algorithm(grpo_smoke.cfg).plan == grpo_smoke.plan == run_plan(grpo_smoke.cfg)  # none handed: cfg's


def test_grpo_rebatches_by_the_plans_optimizer_steps(grpo_smoke):
    """The zero-advantage filter grows the kept count to a multiple of lcm(sampling batches, optimizer steps per inner
    epoch). The config gives 2 steps (lcm 8); a plan of 16 steps (lcm 16) must be what GRPO uses."""
    from ddpo_tpu.algorithms.grpo import GRPO

    cfg, planned = grpo_smoke.cfg, grpo_smoke.plan
    s, t = cfg.sample, cfg.train
    n, batches = planned.samples_on_rank, s.num_batches_per_epoch
    naive = (s.batch_size * s.num_batches_per_epoch) // (t.batch_size * t.gradient_accumulation_steps)
    assert planned.updates_per_inner_epoch == naive == 2  # the validated plan agrees with the reference's arithmetic
    other = dataclasses.replace(planned, updates_per_inner_epoch=16)
    adv, keys, rewards = _advantages(n, 40), [f"p{i // 4}" for i in range(n)], np.arange(n, dtype=np.float64)

    by_cfg = GRPO(cfg).train_plan(3, adv, keys, rewards)           # run_plan(cfg): 2 steps, lcm(8, 2) = 8
    by_plan = GRPO(cfg, other).train_plan(3, adv, keys, rewards)   # the handed plan: lcm(8, 16) = 16
    assert by_cfg is not None and by_plan is not None
    assert by_cfg.kept == 40                                       # 40 is a multiple of 8: nothing re-included
    assert by_plan.kept == 48 and by_plan.kept % math.lcm(batches, 16) == 0
    assert by_plan.orders.shape == (t.num_inner_epochs, n)
    assert np.isclose(by_plan.weights.sum(), n)                    # N / K on each of the K kept: a mean over them


class _Stepper:
    """Records what the epoch trainer asks of the optimizer step (training/stepper.py's interface)."""

    def __init__(self):
        self.begun, self.micro, self.units = None, 0, set()

    def begin(self, epoch, window, total):
        self.begun = (window, total)

    def micro_step(self, fn, units=1):
        fn()
        self.micro += 1
        self.units.add(units)

    def batch_done(self):
        pass

    def finish(self):
        return []


def test_awm_trains_the_plans_batch_and_window():
    """AWM's epoch trainer takes its train batch, its times per sample and its accumulation window from the plan: a
    plan of train batch 8, 2 timesteps a sample and 2 accumulated batches on a config of 16, 3 and 1 gives 8 batches
    of 8, each one forward of 2 x 8 rows (awm:1212-1220), lp_old scored before training for the 6 after the first
    optimizer step (awm:1232), and a window of 2 batches x 2 timesteps, each micro-step counting its 2."""
    from ddpo_tpu.algorithms.awm import AWM

    v = compose_and_validate(["+experiment=awm_smoke"])
    cfg = v.cfg
    assert (cfg.train.batch_size, cfg.train.gradient_accumulation_steps, cfg.algorithm.train_timesteps) == (16, 1, 3)
    plan = dataclasses.replace(v.plan, global_train_batch=8, gradient_accumulation_steps=2, train_timesteps=2,
                               fused_timesteps=2, accumulation_window=4)
    scored, rows = [], set()

    def velocity_of(autocast):
        def velocity(x, z, i, c):
            rows.add(x.shape[0])
            t = i.float() / 6
            return x * 0.5 + z * 0.5, x, t
        return velocity

    rt = SimpleNamespace(device=torch.device("cpu"), compile_step=lambda f: f, sync=lambda: None,
                         local_rows=lambda B: slice(None))
    fam = SimpleNamespace(make_velocity=velocity_of, num_steps=6, model=SimpleNamespace(train=lambda: None),
                          reference=contextlib.nullcontext)
    stepper = _Stepper()
    state = SimpleNamespace(copies={}, params=[], global_step=0, end_batch=lambda: None)
    ctx = SimpleNamespace(cfg=cfg, rt=rt, family=fam, state=state, stepper=stepper, autocast=contextlib.nullcontext,
                          shape=None)
    trainer = AWM(cfg, plan).make_epoch_trainer(ctx)
    score = trainer.score
    trainer.score = lambda *args: scored.append(1) or score(*args)
    N = 64
    s = SimpleNamespace(latents=torch.randn(N, 2, 1, 2, 2), advantages=torch.randn(N), cond=(torch.randn(N, 3),))
    trainer.train_epoch(0, s)
    assert stepper.begun == (4, N // 8 * 2)       # the plan's window, over the plan's batches x timesteps
    assert stepper.micro == N // 8 and stepper.units == {2} and len(scored) == N // 8 - 2
    assert rows == {2 * 8}                         # the plan's K x train batch rows in each forward
    with pytest.raises(ValueError, match="one forward"):  # a plan that fuses fewer than it trains is not AWM's
        AWM(cfg, dataclasses.replace(plan, fused_timesteps=1)).make_epoch_trainer(ctx)


def test_grpo_plans_a_ranks_own_samples_with_the_plans_steps():
    """distributed.keep_samples_on_rank on two ranks: each rank plans the samples it drew (flow_grpo's mask is per
    process), with the optimizer steps one process takes: flow_grpo's samples_per_epoch over its
    total_train_batch_size (train_sd3.py:566-575, both x num_processes, which cancel), the plan's number, on half the
    samples."""
    from ddpo_tpu.algorithms.grpo import GRPO

    v = compose_and_validate(["+experiment=flow_grpo_smoke", "tpu_topology=cpu_dist2", "distributed.compile=none",
                              "distributed.keep_samples_on_rank=true"])
    plan, s, t = v.plan, v.cfg.sample, v.cfg.train
    assert plan.keep_samples_on_rank and plan.samples_on_rank * 2 == plan.samples_per_epoch
    per_process_steps = s.batch_size * s.num_batches_per_epoch // (t.batch_size * t.gradient_accumulation_steps)
    assert plan.updates_per_inner_epoch == per_process_steps == 2
    n = plan.samples_on_rank
    got = GRPO(v.cfg, plan).train_plan(0, _advantages(n, 37), [f"p{i // 4}" for i in range(n)], np.zeros(n))
    assert got is not None and got.orders.shape == (t.num_inner_epochs, n)
    assert got.kept == 40  # 37 grown to a multiple of lcm(8 batches, 2 steps)
