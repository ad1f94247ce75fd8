"""Where an epoch's samples live (training/epoch_data.py), without processes: the rows a rank drew in the epoch's
global order, and the rows it trains in each train batch. Two ranks end to end: tests/e2e/test_distributed.py."""

from __future__ import annotations

import numpy as np
import torch

from ddpo_tpu.runtime.base import Counters
from ddpo_tpu.runtime.distributed import DistributedRuntime
from ddpo_tpu.training.epoch_data import EpochSamples, drawn_rows, train_batches


def rank(r: int, world: int) -> DistributedRuntime:
    """The distributed runtime's batch layout of rank r of `world` (no process group: layout methods only)."""
    rt = DistributedRuntime.__new__(DistributedRuntime)
    rt.process_index, rt.process_count = r, world
    return rt


def test_a_rank_draws_the_rows_the_gathered_epoch_holds_its_samples_at():
    """sample_epoch scores rows local_rows(B) of each global batch on each rank; gather_rows concatenates each
    batch's ranks in order, batch after batch. drawn_rows names, per rank, where its samples sit in that order."""
    world, batches, B = 4, 3, 8
    prompts = [[f"p{b}.{i}" for i in range(B)] for b in range(batches)]
    per_rank = {r: [p for batch in prompts for p in batch[rank(r, world).local_rows(B)]] for r in range(world)}
    gathered = [p for batch in prompts for r in range(world) for p in batch[rank(r, world).local_rows(B)]]
    for r in range(world):
        assert [gathered[i] for i in drawn_rows(rank(r, world), batches, B)] == per_rank[r]
    assert sorted(np.concatenate([drawn_rows(rank(r, world), batches, B) for r in range(world)])) == \
        list(range(batches * B))


def test_with_one_batch_a_ranks_rows_are_ddpo_pytorchs_slice():
    """kvablack/ddpo-pytorch@1958463 scripts/train.py:437-442 keeps `advantages.reshape(num_processes, -1)
    [process_index]` of the gathered epoch (there gathered process-major); one sampling batch lays out the same."""
    for r in range(4):
        assert list(drawn_rows(rank(r, 4), 1, 12)) == list(np.arange(12).reshape(4, -1)[r])


def _samples(n: int, own: bool) -> EpochSamples:
    z = torch.zeros(n, 2)
    return EpochSamples(z, z, z, (z,), torch.zeros(n), torch.ones(n), own_rows=own)


def test_own_rows_train_as_many_batches_of_a_ranks_share():
    """A train batch of 8 over 2 ranks: from the whole epoch of 32 each rank takes its 4 rows of each of 4 batches;
    from its own 16 samples, 4 consecutive ones per batch. The same updates, the same samples per update."""
    rt = rank(1, 2)
    whole_n, whole_rows = train_batches(_samples(32, False), rt, 8)
    own_n, own_rows = train_batches(_samples(16, True), rt, 8)
    assert whole_n == own_n == 4
    assert whole_rows(2).tolist() == [20, 21, 22, 23] and own_rows(2).tolist() == [8, 9, 10, 11]


def test_the_gathered_bytes_are_counted_per_phase():
    later, earlier = Counters(gathered_bytes=1000), Counters(gathered_bytes=232)
    assert later.minus(earlier).gathered_bytes == 768
