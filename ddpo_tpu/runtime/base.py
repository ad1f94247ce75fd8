"""The small interface between the one epoch loop and a backend."""

from __future__ import annotations

import abc
import contextlib
from dataclasses import dataclass, field

import torch


# ops torch_xla may run on the host, with the reason; anything else in a phase's cpu_fallbacks is a regression
KNOWN_CPU_FALLBACKS = {
    "aten::upsample_nearest2d_backward": "PJRT CPU has no lowering for it (TPU lowers it); training only",
}


@dataclass
class Counters:
    """Cumulative counts since the runtime started. XLA backends fill them from torch_xla's metrics (exact)."""

    compilations: int = 0           # real (uncached) compilations of the graphs the loop builds
    replicate_compilations: int = 0  # programs torch_xla compiles to gather a sharded tensor for the host (a CPU
                                     # fallback's input, a .cpu()): not in UncachedCompile, each one a real compile
    compile_time_s: float = 0.0
    host_transfers: int = 0         # device-to-host copies
    cpu_fallbacks: dict[str, int] = field(default_factory=dict)  # aten::op -> count (ops XLA ran on the host)
    gathered_bytes: int = 0         # bytes of the whole tensors and arrays gather_batch / gather_rows left on this
                                    # process (distributed: what its all-gathers produced; exact, counted per call)

    def minus(self, earlier: "Counters") -> "Counters":
        fallbacks = {k: v - earlier.cpu_fallbacks.get(k, 0) for k, v in self.cpu_fallbacks.items()}
        return Counters(self.compilations - earlier.compilations,
                        self.replicate_compilations - earlier.replicate_compilations,
                        self.compile_time_s - earlier.compile_time_s, self.host_transfers - earlier.host_transfers,
                        {k: v for k, v in fallbacks.items() if v}, self.gathered_bytes - earlier.gathered_bytes)


@dataclass
class StateLayout:
    """How the training state lies on the devices: counts and bytes (whole, and held by one device)."""

    tensors: int
    sharded: int
    bytes_total: int
    bytes_per_device: int

    @classmethod
    def of(cls, tensors, is_sharded, ways: int) -> "StateLayout":
        tensors = list(tensors)
        sizes = [(t.numel() * t.element_size(), bool(is_sharded(t))) for t in tensors]
        return cls(len(tensors), sum(s for _, s in sizes), sum(n for n, _ in sizes),
                   sum(n // ways if s else n for n, s in sizes))

    def describe(self) -> str:
        return (f"{self.tensors} state tensors, {self.sharded} sharded: {self.bytes_per_device / 2**20:.1f} MiB per "
                f"device of {self.bytes_total / 2**20:.1f} MiB")


class Runtime(abc.ABC):
    """What the loop needs from a backend: where tensors live, when work is materialised, how results reach the
    host, and how the global batch is laid out over devices. The loop always works on the global batch
    (per-replica batch x replicas); SPMD backends shard it, single-device backends just hold it."""

    name: str
    device: torch.device
    replicas: int = 1          # devices the global batch is split over
    process_index: int = 0     # this process among all hosts' processes
    process_count: int = 1
    compiles_graphs: bool = False  # the first epoch compiles the step graphs (XLA)

    @property
    def is_main(self) -> bool:
        return self.process_index == 0

    def sync(self) -> None:
        """Materialise pending work (XLA: cut and run the graph). A no-op for eager backends."""

    def shard_batch(self, tensor: torch.Tensor) -> torch.Tensor:
        """Lay a tensor whose dim 0 is the global batch out over the data-parallel devices."""
        return tensor

    # --- processes: one for the whole global batch here; the distributed runtime has one per device --------------
    def local_rows(self, n: int) -> slice:
        """The rows of a global batch of n this process computes (all of them unless distributed)."""
        return slice(0, n)

    def gather_batch(self, tensor: torch.Tensor) -> torch.Tensor:
        """This process's rows of a batch -> the whole batch, on every process (distributed: an all-gather)."""
        return tensor

    def gather_rows(self, array):
        """Host rows of this process -> the global rows in process order, on every process."""
        return array

    def mean_over_replicas(self, tensor: torch.Tensor) -> torch.Tensor:
        """A statistic computed on this process's rows -> its mean over all processes (equal row counts)."""
        return tensor

    def any_process(self, flag: bool) -> bool:
        """True on every process when `flag` is true on any: a stop all processes take at the same point."""
        return flag

    def barrier(self) -> None:
        pass

    def close(self) -> None:
        """At the end of the run (distributed: the process group)."""

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """What the step functions call: the model itself, or a data-parallel wrapper of it (DDP)."""
        return model

    def no_gradient_sync(self, model: torch.nn.Module):
        """A context for micro-steps that are not the last of an accumulation window (distributed: no reduction)."""
        return contextlib.nullcontext()

    def zeros_like_state(self, p: torch.Tensor) -> torch.Tensor:
        """Zeros shaped as a parameter, uploaded as data (on XLA a pending constant would join the next graph)."""
        return torch.zeros(p.shape, dtype=p.dtype).to(self.device)

    def to_full(self, tensor: torch.Tensor) -> torch.Tensor:
        """A whole tensor (distributed FSDP2: gathered from the ranks' shards)."""
        return tensor

    def place_like(self, value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """A host tensor on the device in the layout of `like`."""
        return value.to(self.device)

    def epoch_layout(self, tensor: torch.Tensor) -> torch.Tensor:
        """A tensor of the whole epoch (dim 0: its samples) as training holds it: SPMD lays it over the devices like
        the trajectories; a distributed rank holds it whole (it trains its slice of each train batch)."""
        return self.shard_batch(tensor)

    def place_state(self, tensors) -> None:
        """Pin weights, gradients and optimizer moments to their layout on the devices. SPMD backends replicate
        them, or with mesh.fsdp > 1 split each one of 2+ dims whose dim 0 divides over the fsdp axis. Pinned on
        purpose: left to the partitioner, an update's outputs may get another sharding than its inputs, which makes
        the next update a new graph. Called as tensors are made, so split state is never whole on a device.
        Single-device backends hold every tensor whole."""

    def state_layout(self, tensors) -> "StateLayout":
        """What place_state did: counts and bytes, read from the tensors' actual shardings."""
        return StateLayout.of([t for t in tensors if t.dim() > 0], lambda t: False, 1)

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """One device-to-host copy of a (replicated) result."""
        return tensor.detach().to("cpu")

    def state_to_host(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Host copies of materialised tensors (weights, optimizer state): plain copies, no computation, so saving
        never compiles a graph whenever it first happens."""
        self.sync()
        return {k: self.to_host(v).contiguous() for k, v in state.items()}

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()

    def compile_step(self, fn):
        """The loop's per-step functions (a denoising step, a training micro-step's loss) as this backend runs them
        best: as they are here (eager), compiled once and replayed on XLA (see XlaRuntime)."""
        return fn

    def checkpoint_function(self):
        """What diffusers' gradient checkpointing (train.activation_checkpointing) calls per block: None for its
        default, torch.utils.checkpoint without re-entry, which eager devices and dynamo's capture handle."""
        return None

    def out_of_memory(self, error: BaseException) -> bool:
        """Whether `error` is the device running out of memory: torch's OutOfMemoryError (CUDA, the host's
        allocator), or XLA's RESOURCE_EXHAUSTED status, which torch_xla raises as a RuntimeError (TPU HBM, when a
        graph is compiled or run)."""
        return isinstance(error, torch.OutOfMemoryError) or "RESOURCE_EXHAUSTED" in str(error)

    def lost_peers(self, error: BaseException, run_dir) -> list[tuple[str, bool]]:
        """The other processes whose loss made `error` (a failed collective): (described, whether this process's
        launcher reports it); [] for one process."""
        return []

    def counters(self) -> Counters:
        return Counters(host_transfers=self._transfers)

    def device_peak_gib(self) -> float | None:
        """The most memory this process's device has held so far (the HBM estimate's check on a real chip), where
        the backend can say: CUDA and TPU; None on the host CPU (see host_peak_rss_gib there)."""
        if self.device.type == "cuda":
            return round(torch.cuda.max_memory_allocated(self.device) / 2**30, 3)
        return None

    def compiling(self, stage: str, epoch: int, events):
        """A context around a phase: on backends that compile (XLA), the first pass through a stage whose graphs it
        compiles is reported as compile_start, compile_progress every 30 s and compile_end events (runtime/watch.py);
        otherwise nothing."""
        if not self.compiles_graphs:
            return contextlib.nullcontext()
        if self._watch is None:
            from ddpo_tpu.runtime.watch import CompileWatch

            self._watch = CompileWatch(self.counters)
        return self._watch.stage(stage, epoch, events)

    _watch = None

    _transfers: int = 0

    def autocast(self, enabled: bool):
        if not enabled:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)

    def describe(self) -> str:
        return (f"{self.name} on {self.device} ({self.replicas} replica(s), "
                f"process {self.process_index}/{self.process_count})")

    def profile(self, run_dir, step: int):
        """A context capturing a profiler trace of one step into the run dir (XLA backends)."""
        return contextlib.nullcontext()
