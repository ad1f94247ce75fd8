"""benchmarks/step_ops.py's counters (issue 41 item 2): what it calls a host read and an op is what the report says."""

from __future__ import annotations

import torch

from benchmarks.step_ops import Count, allocations, op_diff


def test_host_reads_are_item_bool_nonzero_and_tolist_and_ops_are_every_aten_call():
    x = torch.arange(6.0)
    with Count() as c:
        y = x * 2 + 1            # mul, add: 2 ops, no read
    assert c.reads == 0 and c.ops["aten.mul"] == 1 and c.ops["aten.add"] == 1
    with Count() as c:
        y.sum().item()           # a scalar read
        bool(y[0] > 0)           # a data-dependent branch
        torch.nonzero(y > 3)     # an output shape read from the values
        y.tolist()               # a whole-tensor read
    assert c.reads == 4, (c.ops, c.tolist)
    assert c.total >= 6
    # patched methods are restored
    assert torch.Tensor.tolist(torch.ones(1)) == [1.0]


def test_allocations_count_new_tensors_and_op_diff_lists_the_differing_ops():
    x = torch.ones(1000)
    assert allocations(lambda: [x + i for i in range(3)]) >= 3
    y = torch.ones(1000)
    assert allocations(lambda: x.add_(y)) == 0  # in place: nothing allocated
    a = {"side": "a", "_n": 2, "_ops": {"aten.add": 4, "aten.mul": 2}}
    b = {"side": "b", "_n": 1, "_ops": {"aten.add": 2, "aten.mul": 3}}
    text = op_diff([a, b])
    assert "| aten.mul | 1.0 | 3.0 |" in text and "aten.add" not in text  # 2.0 per step on both sides


def test_parallel_ops_are_matrix_products_and_ops_over_a_grain_of_elements():
    small, large = torch.ones(8, 8), torch.ones(40000)
    with Count() as c:
        small + 1                # under the grain: one thread
        large * 2                # over it: at::parallel_for splits it
        small @ small            # a matrix product: BLAS threads whatever its size
    assert dict(c.parallel) == {"aten.mul": 1, "aten.mm": 1}
