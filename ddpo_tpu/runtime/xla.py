"""torch_xla backends: one device, or SPMD over a mesh of every device of every host (one process per host).

The only module of ddpo_tpu that imports torch_xla; it is imported by the training process after the launcher has
fixed PJRT_DEVICE, XLA_FLAGS, LIBTPU_INIT_ARGS, CPU_NUM_DEVICES (env.py).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
import torch
import torch_xla
import torch_xla.debug.metrics as met
import torch_xla.runtime as xr

from ddpo_tpu.config.schema import RunConfig
from ddpo_tpu import env as envmod
from ddpo_tpu.runtime.base import Counters, Runtime, StateLayout


class LaunchMismatch(RuntimeError):
    """The processes or devices found do not match the configured topology."""


class XlaRuntime(Runtime):
    compiles_graphs = True

    def __init__(self, cfg: RunConfig):
        topo = cfg.tpu_topology
        self.spmd = topo.execution == "xla_spmd"
        cache = envmod.compilation_cache_dir(cfg)
        if cache:
            # before any computation, as torch_xla requires
            Path(cache).mkdir(parents=True, exist_ok=True)
            xr.initialize_cache(cache, readonly=False)
        if self.spmd:
            xr.use_spmd()  # before any XLA tensor exists
        self.device = torch_xla.device()
        self.process_index = xr.process_index() if hasattr(xr, "process_index") else xr.global_ordinal()
        self.process_count = xr.process_count()
        self.name = "xla_spmd" if self.spmd else "xla"
        self._check_launch(cfg)
        self.mesh = None
        self.replicas = 1
        self.fsdp = topo.mesh.fsdp if self.spmd else 1
        if self.spmd:
            import torch_xla.distributed.spmd as xs

            self._xs = xs
            n = xr.global_runtime_device_count()
            mesh_shape = (topo.mesh.dp, topo.mesh.fsdp)
            self.mesh = xs.Mesh(np.arange(n), mesh_shape, ("dp", "fsdp"))
            self.replicas = n
        self.cache_dir = cache
        self.gather = cfg.xla.gather
        self.step_compiler = cfg.xla.step_compiler

    def _check_launch(self, cfg: RunConfig) -> None:
        topo = cfg.tpu_topology
        if self.process_count != topo.expected_processes:
            worker = envmod.tpu_worker_id()
            raise LaunchMismatch(
                f"tpu_topology={topo.name} expects {topo.expected_processes} training processes (one per host) but "
                f"this run has {self.process_count}{f' (this is worker {worker})' if worker is not None else ''}: "
                f"launch the same command on all workers (ddpo-pod --tpu NAME --zone ZONE -- OVERRIDES...), not only "
                f"worker 0")
        if self.spmd:
            n = xr.global_runtime_device_count()
            if n != topo.chips:
                raise LaunchMismatch(f"tpu_topology={topo.name} expects {topo.chips} devices but PJRT sees {n}: "
                                     f"choose the tpu_topology of this machine")

    # --- execution ----------------------------------------------------------------------------------------------
    def sync(self) -> None:
        torch_xla.sync()

    def shard_batch(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.spmd:
            spec = (("dp", "fsdp"),) + (None,) * (tensor.dim() - 1)
            self._xs.mark_sharding(tensor, self.mesh, spec)
        return tensor

    def replicate(self, tensor: torch.Tensor) -> torch.Tensor:
        """Annotate a pending result as replicated, so its host copy is one plain transfer (a sharded tensor's
        .cpu() compiles a new graph every call)."""
        if self.spmd:
            self._xs.mark_sharding(tensor, self.mesh, (None,) * tensor.dim())
        return tensor

    def place_state(self, tensors) -> None:
        if not self.spmd:
            return
        split = []
        for t in tensors:
            if t.device.type == "xla" and t.dim() > 0:
                self._xs.mark_sharding(t, self.mesh, self._state_spec(t))
                split += [t] if self._is_split(t) else []
        if split and not self._checked_locality:
            # checkpoints assemble split tensors from this host's shards: find out now, not at the first save,
            # whether this host holds every piece (PJRT numbers devices host by host on TPU VMs)
            self._checked_locality = True
            torch_xla.sync(wait=True)
            self._assemble(min(split, key=lambda t: t.numel()))

    _checked_locality = False

    def state_layout(self, tensors) -> StateLayout:
        tensors = [t for t in tensors if t.device.type == "xla" and t.dim() > 0]
        return StateLayout.of(tensors, self._is_split, self.fsdp)

    def _state_spec(self, t: torch.Tensor) -> tuple:
        """fsdp: weights (2-D and up) split along dim 0 over the fsdp axis (replicated over dp) where it divides;
        biases, norms and the rest stay replicated (small, and 1-D splits buy nothing)."""
        if self.fsdp > 1 and t.dim() >= 2 and t.shape[0] % self.fsdp == 0:
            return ("fsdp",) + (None,) * (t.dim() - 1)
        return (None,) * t.dim()

    def _is_split(self, t: torch.Tensor) -> bool:
        return self.spmd and t.device.type == "xla" and "devices=" in self._xs.XLAShardedTensor(t).sharding_spec

    def _assemble(self, t: torch.Tensor) -> torch.Tensor:
        """The host copy of a split tensor, put together from this host's shards: plain copies, no program. (Its .cpu()
        would compile and run a program that replicates it first, on every call.) With fsdp inside a host
        (config rule) this host holds every piece."""
        out = torch.empty(t.shape, dtype=t.dtype)
        seen = torch.zeros(t.shape, dtype=torch.bool)
        for shard in self._xs.XLAShardedTensor(t).local_shards:
            where = Ellipsis if shard.indices is Ellipsis else tuple(shard.indices)  # Ellipsis: a whole copy
            out[where] = shard.unpadded_data
            seen[where] = True
        if not bool(seen.all()):
            raise RuntimeError(f"process {self.process_index} holds only part of a {tuple(t.shape)} tensor split on "
                               f"fsdp: keep tpu_topology.mesh.fsdp within one host")
        return out

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """xla.gather=device: all-gather on the device (a replicated result), then one plain copy.
        xla.gather=host: each device's batch shard is copied to the host and concatenated there (single host)."""
        tensor = tensor.detach()
        if self.spmd and self.gather == "host" and tensor.dim() > 0:
            sharded = self._xs.mark_sharding(tensor, self.mesh, (("dp", "fsdp"),) + (None,) * (tensor.dim() - 1))
            torch_xla.sync(wait=True)  # local shards are read directly: the computation must have finished
            shards = sorted(sharded.local_shards, key=lambda s: s.indices[0].start if isinstance(s.indices[0], slice)
                            else 0)
            return torch.cat([s.unpadded_data for s in shards])
        tensor = self.replicate(tensor)
        torch_xla.sync()
        return tensor.cpu()

    def state_to_host(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        split = {k: self._is_split(v) for k, v in state.items()}
        # shards are read directly: whatever computes them must have finished, not just been dispatched
        torch_xla.sync(wait=any(split.values()))
        # device data after the sync: replicated tensors are one plain .cpu() each, split ones are assembled from
        # their shards; neither runs a program
        with torch.no_grad():
            return {k: (self._assemble(v) if split[k] else v.detach().cpu()).contiguous() for k, v in state.items()}

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()
        torch_xla.sync()

    def compile_step(self, fn):
        """xla.step_compiler=dynamo: torch.compile with torch_xla's openxla backend. Dynamo captures the step once
        (forward, and backward through AOTAutograd), XLA compiles it, and every later call replays the cached
        executable after a guard check: a few ms of host time where lazy tracing re-records thousands of IR nodes
        per call. Shapes are static (dynamic=False): every call of a step has the same shapes, so the set of graphs
        stays fixed. xla.step_compiler=lazy: the function as it is, traced again by torch_xla at every call."""
        if self.step_compiler == "dynamo":
            return torch.compile(fn, backend="openxla", dynamic=False)
        return fn

    def checkpoint_function(self):
        """Activation checkpointing per block. dynamo: torch's own (None), captured as a region AOTAutograd's
        partitioner recomputes in the backward graph. lazy: the forward and backward are one XLA graph, where torch's
        checkpoint has no device module (it fails) and XLA would merge a plain recomputation with the forward (CSE),
        keeping every activation; torch_xla's checkpoint puts an optimization barrier before the recomputation."""
        if self.step_compiler == "dynamo":
            return None
        from torch_xla.utils.checkpoint import checkpoint

        def lazy_checkpoint(module, *args):
            # re-entrant: a block joins the autograd graph only through an input that needs a gradient. The first
            # blocks' inputs are all frozen, and every later block takes its input from them: without a leaf that
            # needs one, the loss had no gradient at all
            if torch.is_grad_enabled() and not any(torch.is_tensor(a) and a.requires_grad for a in args):
                first = next((i for i, a in enumerate(args) if torch.is_tensor(a) and a.is_floating_point()), None)
                if first is not None:
                    args = (*args[:first], args[first].detach().requires_grad_(), *args[first + 1:])
            # no RNG state to keep for the recomputation: the denoisers train without dropout
            return checkpoint(module.__call__, *args, preserve_rng_state=False)

        return lazy_checkpoint

    # --- telemetry ----------------------------------------------------------------------------------------------
    def counters(self) -> Counters:
        compile_data = met.metric_data("CompileTime")
        transfer_data = met.metric_data("TransferFromDeviceTime")
        fallbacks = {name: met.counter_value(name) for name in met.counter_names() if name.startswith("aten::")}
        graphs = met.counter_value("UncachedCompile") or 0
        return Counters(
            compilations=graphs,
            # every XLA compile records a CompileTime sample; the ones that are not graphs of the loop are
            # ReplicateShardedData programs (the counter of that name also counts free, already replicated cases)
            replicate_compilations=(compile_data[0] if compile_data else 0) - graphs,
            compile_time_s=(compile_data[1] / 1e9) if compile_data else 0.0,
            host_transfers=transfer_data[0] if transfer_data else 0,
            cpu_fallbacks={k: v for k, v in fallbacks.items() if v},
        )

    def device_peak_gib(self) -> float | None:
        """The allocator's peak on this process's first device (TPU: HBM in use at its highest, XLA's buffers and
        the runtime's); None where PJRT keeps no allocator statistics (CPU)."""
        import torch_xla.core.xla_model as xm

        try:
            peak = xm.get_memory_info(self.device).get("peak_bytes_used")
        except RuntimeError:  # PJRT CPU: GetAllocatorStats is not supported
            return None
        return None if peak is None else round(peak / 2**30, 3)

    def profile(self, run_dir, step: int):
        import torch_xla.debug.profiler as xp

        @contextlib.contextmanager
        def trace():
            out = Path(run_dir) / "profile" / f"step_{step}"
            out.mkdir(parents=True, exist_ok=True)
            server = getattr(self, "_profiler_server", None) or xp.start_server(9012)
            self._profiler_server = server
            xp.start_trace(str(out))
            try:
                yield
            finally:
                torch_xla.sync()
                xp.stop_trace()

        return trace()
