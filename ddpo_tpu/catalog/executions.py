"""Executions: how a topology's devices are driven (tpu_topology.execution), one frozen spec per kind.

Each spec says what the rest of the package asks of an execution (how many devices it splits the batch over, whether
torch_xla drives them, what starts its processes, what compiles its step, which XLA settings it reads, which runtime
backend runs it), so the config rules, the launcher, the worker, the loop and the status read a capability instead
of comparing the kind's name. Only the catalog and runtime/ (the backends themselves) spell a kind out:
tests/unit/config/test_executions.py keeps every other module of ddpo_tpu free of those names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ddpo_tpu.catalog.registry import Registry


@dataclass(frozen=True)
class ExecutionSpec:
    name: str                  # the tpu_topology.execution value
    title: str
    # splits the global batch over the topology's dp x fsdp mesh (tpu_topology.mesh is read; replicas = dp x fsdp);
    # the others drive one device
    multi_device: bool
    # torch_xla and its PJRT device drive the devices (tpu_topology.pjrt_device, the xla.* keys); the others run
    # plain torch, which keeps PJRT pinned to the host so diffusers' import of torch_xla claims no accelerator
    torch_xla: bool
    # what the front end starts: "worker" = one training process on this host (ddpo_tpu.worker); "torchrun" = torchrun
    # (ddpo_tpu/torchrun.py) starting one worker per device, its ranks, rendezvous and own config section
    # (`distributed.*`: config/distributed.py)
    launcher: Literal["worker", "torchrun"]
    # what the step is compiled by: nothing (eager), XLA's graphs (torch_xla), or torch.compile (with its own cache,
    # distributed.compile_cache_dir)
    compiler: Literal["none", "xla", "torch.compile"]
    # reads xla.flags / libtpu_init_args (XLA_FLAGS, LIBTPU_INIT_ARGS in the training process's environment)
    takes_xla_flags: bool
    backend: str               # "module:Class" of its runtime in ddpo_tpu/runtime/ (imported only by the worker)

    @property
    def torchrun(self) -> bool:
        """torchrun starts one process per device (DDP / FSDP2 over a DeviceMesh, the `distributed.*` keys)."""
        return self.launcher == "torchrun"

    @property
    def process_per(self) -> Literal["host", "device"]:
        """What one training process drives: a host (its devices, if several, as one program) or one device."""
        return "device" if self.torchrun else "host"

    @property
    def compiles_graphs(self) -> bool:
        return self.compiler != "none"

    @property
    def torch_compiles(self) -> bool:
        """Compiles with torch.compile (inductor's caches across restarts: env.py, compile_caches.py)."""
        return self.compiler == "torch.compile"

    @property
    def spmd(self) -> bool:
        """One XLA program per host sharded over the mesh (a host-side gather sees only the host's shards)."""
        return self.torch_xla and self.multi_device


EXECUTIONS: Registry[ExecutionSpec] = Registry("execution")

EXECUTIONS.register(ExecutionSpec(
    "eager", "plain torch on one device (CPU or CUDA), no compilation: the references' way of running",
    multi_device=False, torch_xla=False, launcher="worker", compiler="none", takes_xla_flags=False,
    backend="ddpo_tpu.runtime.eager:EagerRuntime"))
EXECUTIONS.register(ExecutionSpec(
    "xla", "torch_xla on one device (PJRT CPU, TPU or CUDA)",
    multi_device=False, torch_xla=True, launcher="worker", compiler="xla", takes_xla_flags=True,
    backend="ddpo_tpu.runtime.xla:XlaRuntime"))
EXECUTIONS.register(ExecutionSpec(
    "xla_spmd", "torch_xla SPMD: one program per host sharded over a dp x fsdp mesh",
    multi_device=True, torch_xla=True, launcher="worker", compiler="xla", takes_xla_flags=True,
    backend="ddpo_tpu.runtime.xla:XlaRuntime"))
EXECUTIONS.register(ExecutionSpec(
    "distributed", "plain torch under torchrun, one process per device (DDP or FSDP2; gloo, nccl or TorchTPU), "
    "torch.compile",
    multi_device=True, torch_xla=False, launcher="torchrun", compiler="torch.compile", takes_xla_flags=False,
    backend="ddpo_tpu.runtime.distributed:DistributedRuntime"))


def execution(name: str) -> ExecutionSpec:
    """The spec of a tpu_topology.execution value (KeyError naming the known ones)."""
    return EXECUTIONS.get(name)


def execution_or_none(name: object) -> ExecutionSpec | None:
    """The spec of a value read from a saved config (an older run's, or a hand-edited one), None when unknown."""
    return EXECUTIONS.get(name) if isinstance(name, str) and name in EXECUTIONS else None


def multi_device_names() -> tuple[str, ...]:
    """The executions that use every chip of a topology of several (what a one-device execution's fix offers)."""
    return tuple(s.name for s in EXECUTIONS if s.multi_device)
