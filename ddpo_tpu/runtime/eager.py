"""Plain PyTorch on the host CPU or one CUDA GPU."""

from __future__ import annotations

import torch

from ddpo_tpu.config.schema import RunConfig
from ddpo_tpu.runtime.base import Runtime


class EagerRuntime(Runtime):
    def __init__(self, cfg: RunConfig):
        acc = cfg.tpu_topology.accelerator
        if acc == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("tpu_topology=cuda but no CUDA device is visible: use tpu_topology=eager_cpu")
        self.device = torch.device("cuda" if acc == "cuda" else "cpu")
        self.name = f"eager_{self.device.type}"
        self.replicas = 1
        self._transfers = 0

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.device.type != "cpu":
            self._transfers += 1
        return tensor.detach().to("cpu")

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
