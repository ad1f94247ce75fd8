"""models/vae_ops.xla_safe_vae on the CPU: every rewrite gives eager torch's values, and what it cannot rewrite
exactly it leaves alone (the decode of a real VAE under it: tests/unit/models/test_wan_model.py; on XLA:
test_xla_families.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ddpo_tpu.models.vae_ops import xla_safe_vae


class Modes(torch.overrides.TorchFunctionMode):
    """Entered before xla_safe_vae: records the interpolate mode that reaches the kernel."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.interpolate:
            self.seen.append(kwargs["mode"])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("factor,rewritten", [(2, True), (4, True), ((2.0, 2.0), True), (3, False), (41, False),
                                              (1.5, False)])
def test_nearest_exact_becomes_nearest_only_where_the_values_are_the_same(factor, rewritten):
    x = torch.randn(1, 2, 50, 60)
    want = F.interpolate(x, scale_factor=factor, mode="nearest-exact")
    with Modes() as modes, xla_safe_vae():
        got = F.interpolate(x, scale_factor=factor, mode="nearest-exact")
    assert torch.equal(got, want) and modes.seen == ["nearest" if rewritten else "nearest-exact"]


def test_at_factor_41_nearest_is_not_nearest_exact():
    """Why odd factors stay as they are: float32's 1/41 makes nearest pick the pixel before (ATen, CPU and CUDA)."""
    x = torch.arange(3.0).view(1, 1, 3)
    assert not torch.equal(F.interpolate(x, scale_factor=41, mode="nearest"),
                           F.interpolate(x, scale_factor=41, mode="nearest-exact"))


@pytest.mark.parametrize("index", [
    (slice(None), slice(-2, None)),                          # the VAEs' cache slice on a one-frame axis
    (slice(-5, -3), slice(None), slice(-7, None, 2)),        # a stop and a start past the axis, a step
    (0, slice(-9, None)),                                     # an int, then a clamped slice
    (True, slice(-2, None)),                                  # a bool adds an axis: the slice is axis 0's, not 1's
    (None, slice(-4, None)),                                  # so does None
    (Ellipsis, slice(-3, None)),
])
def test_indexing_inside_is_eager_indexing(index):
    x = torch.randn(3, 1, 2)
    with xla_safe_vae():
        got = x[index]
    assert torch.equal(got, x[index])


def test_too_many_indices_still_raise():
    x = torch.randn(3, 2)
    with pytest.raises(IndexError), xla_safe_vae():
        x[0, 0, 0]
