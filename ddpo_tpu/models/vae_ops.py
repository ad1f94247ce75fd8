"""The causal video VAEs of Wan and Qwen-Image (diffusers' AutoencoderKLWan, AutoencoderKLQwenImage) written for
eager torch, decoded on XLA with the same values.

Two idioms in their code do not lower to XLA as written, and each has an exact equivalent that does:
- ``x[:, :, -2:]`` on a time axis of one frame (the decoder's frame cache): eager torch clamps a negative bound past
  the axis's length, XLA's slice raises "Value out of range (expected to be in range of [-1, 0], but got -2)".
  diffusers fixed this slice in AutoencoderKLQwenImage (huggingface/diffusers#13480), not in AutoencoderKLWan (0.42.1).
- ``interpolate(mode="nearest-exact")`` by a factor of 2 (their 2x upsampling): XLA has no kernel for it, so each
  call ran on the host (aten::_upsample_nearest_exact2d, a device -> host -> device round trip per upsampling layer
  and frame). For an integer factor k, nearest-exact picks the source pixel floor((i + 0.5) / k) = floor(i / k),
  which is what mode="nearest" picks: the same values, from an op XLA compiles. Kernels compute both with the float
  32 reciprocal 1/k, exact only for a power of two (at k = 41, nearest's floor(41 * float(1/41)) is 0, not 1), so
  only power-of-two factors are rewritten.

``xla_safe_vae()`` is a torch function mode applying both rewrites inside a decode, on every device (on CPU and CUDA
the results are bit-identical: tests/unit/models/test_wan_model.py checks it), so one code path serves all runtimes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


class xla_safe_vae(torch.overrides.TorchFunctionMode):  # noqa: N801 - used as a context manager, like torch.no_grad
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is Tensor.__getitem__ and isinstance(args[1], tuple):
            args = (args[0], _clamped(args[1], args[0].shape))
        elif func is F.interpolate and kwargs.get("mode") == "nearest-exact" and _power_of_two_factors(kwargs):
            kwargs = {**kwargs, "mode": "nearest"}
        return func(*args, **kwargs)


def _clamped(index: tuple, shape) -> tuple:
    """A tuple of slices and ints with each negative bound past its axis clamped to the axis (eager's semantics)."""
    plain = all(isinstance(i, slice) or (isinstance(i, int) and not isinstance(i, bool)) for i in index)
    if not plain or len(index) > len(shape):
        return index  # not one item per axis (None, ..., bools, tensors) or too many: as it is, so eager's error stays

    def bound(b, size):
        return -size if isinstance(b, int) and b < -size else b

    return tuple(slice(bound(i.start, n), bound(i.stop, n), i.step) if isinstance(i, slice) else i
                 for i, n in zip(index, shape))


def _power_of_two_factors(kwargs: dict) -> bool:
    factor = kwargs.get("scale_factor")
    if factor is None or kwargs.get("size") is not None or kwargs.get("recompute_scale_factor"):
        return False
    factors = factor if isinstance(factor, (tuple, list)) else (factor,)
    return all(float(f).is_integer() and f >= 1 and (int(f) & (int(f) - 1)) == 0 for f in factors)  # 1, 2, 4, ...
