"""The runtime interface the epoch loop is written against, and its backends.

eager.py: plain torch on CPU or CUDA. distributed.py: plain torch, one process per device under torchrun (gloo, nccl,
TorchTPU), DDP or FSDP2, torch.compile. xla.py: torch_xla on one device or SPMD over a mesh (one process per host);
it is the only module of ddpo_tpu that imports torch_xla.
"""

from __future__ import annotations

from ddpo_tpu.catalog import load_object
from ddpo_tpu.config.schema import RunConfig
from ddpo_tpu.runtime.base import Runtime


def make_runtime(cfg: RunConfig) -> Runtime:
    """The backend the execution's spec names (catalog/executions.py `backend`), imported only now: torch_xla only
    where an XLA execution runs."""
    return load_object(cfg.tpu_topology.spec.backend)(cfg)


__all__ = ["Runtime", "make_runtime"]
