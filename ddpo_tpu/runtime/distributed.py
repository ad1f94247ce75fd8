"""Plain PyTorch, one process per device: torch.distributed under torchrun, DDP or FSDP2 over a dp x fsdp DeviceMesh,
torch.compile on the step functions. The same code drives the host CPU (gloo: tests and CI), NVIDIA GPUs (nccl) and
TPUs through TorchTPU (`torch.device("tpu")`, its `tpu` compile backend and process-group backend).

How the global batch lies over the ranks (the same rows as SPMD's batch sharding, so every runtime trains the same
samples from the same seed): every rank draws the same global prompts and noise from the host generators; rank r
samples rows [r B/W, (r+1) B/W) of each global sampling batch of B and scores their images; rewards are gathered so
every rank computes the same advantages; the epoch's trajectories are gathered whole onto every rank (memory: one
epoch's latents and conditioning per device, e.g. 0.9 GiB at the DDPO parity shape), shuffled with the same
permutation there, and rank r trains rows [r T/W, (r+1) T/W) of each global train batch of T (with
distributed.keep_samples_on_rank each rank trains the samples it drew instead: training/epoch_data.py). Gradients are
averaged over the ranks (DDP's all-reduce, or FSDP2's reduce-scatter and all-reduce), so an update is that of the
global batch.
"""

from __future__ import annotations

import contextlib
import datetime

import numpy as np
import torch
import torch.distributed as dist

from ddpo_tpu.config.distributed import compile_backend
from ddpo_tpu.config.schema import RunConfig
from ddpo_tpu import env as envmod
from ddpo_tpu.waits import COLLECTIVE, waiting
from ddpo_tpu.runtime.base import Counters, Runtime, StateLayout


def _dtensor():
    from torch.distributed.tensor import DTensor

    return DTensor


def unreached_parameter_names(model: torch.nn.Module) -> list[str]:
    """The names of the weights under the modules a model declares its forward never reaches
    (``model.ddp_unreached_modules``: Qwen-Image's last block's text stream, models/qwen_image.py
    ``unreached_modules``), the base weights and any LoRA on them. A declared module the model lacks raises: a
    declaration that matched nothing would leave DDP waiting on those gradients again."""
    modules = tuple(getattr(model, "ddp_unreached_modules", ()))
    have = dict(model.named_modules())
    missing = [m for m in modules if m not in have]
    if missing:
        raise ValueError(f"{type(model).__name__}.ddp_unreached_modules names {missing}, which it does not have")
    return [n for n, _ in model.named_parameters() if any(n.startswith(m + ".") for m in modules)]


def wrap_ddp(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """DDP over all ranks, told what the model declares about the weights its forward leaves without a gradient.

    DDP's reducer (find_unused_parameters off) all-reduces a gradient bucket when every weight in it has been marked
    ready by its gradient hook, and writes the reduced gradients back only when every bucket has. A trained weight
    the forward never reaches has no hook call, so its bucket never launches, the backward ends with every rank's
    gradients its own rows' (no error: the optimizer steps on them), and the next forward under gradient raises
    "Expected to have finished reduction in the prior iteration" (measured on two gloo ranks and a two-layer toy
    whose second layer is unused: rank 0's gradient 4.0 and rank 1's 8.0 where the mean is 6.0, then that error at the
    next update). Two ways out, chosen per model:

    * weights that are never reached by construction (``ddp_unreached_modules``: Qwen-Image's last block's text
      stream, whose output the transformer discards) are left out of DDP altogether
      (``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model``): nothing to wait for, no per-forward
      cost, and one process leaves them at a None gradient too (their LoRA never moves either way). DDP then skips
      them in its start-up broadcast too: each rank keeps its own seeded draw, which no output reads. The call is
      torch's provisional hook for this (its source calls it a workaround until the API is final);
      tests/unit/models/test_qwen_image_ddp.py fails if it stops working;
    * weights that a step may or may not reach (Wan 2.2's experts: the idle expert's LoRA, models/wan.py
      WanExperts) need ``ddp_find_unused_parameters``: a walk of the autograd graph from the output per forward.

    Every other model keeps DDP's default."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    unreached = unreached_parameter_names(model)
    if unreached:
        DDP._set_params_and_buffers_to_ignore_for_model(model, unreached)
    return DDP(model, device_ids=None if device.type == "cpu" else [device.index], broadcast_buffers=False,
               find_unused_parameters=bool(getattr(model, "ddp_find_unused_parameters", False)))


class DistributedRuntime(Runtime):
    def __init__(self, cfg: RunConfig):
        topo = cfg.tpu_topology
        ranks = envmod.torchrun_ranks()
        if ranks is None:
            raise RuntimeError("tpu_topology.execution=distributed runs under torchrun (the front end starts it): "
                               "run `python -m ddpo_tpu.train ...`, not the worker directly")
        self.process_index, self.process_count, self.local_rank = ranks
        if self.process_count != topo.expected_processes:
            raise RuntimeError(f"tpu_topology={topo.name} expects {topo.expected_processes} processes (one per "
                               f"device) but torchrun started {self.process_count}")
        self.device = self._device(topo)
        dist.init_process_group(timeout=datetime.timedelta(seconds=cfg.distributed.timeout_s),
                                device_id=None if self.device.type == "cpu" else self.device)
        from torch.distributed.device_mesh import init_device_mesh

        self.mesh = init_device_mesh(self.device.type, (topo.mesh.dp, topo.mesh.fsdp), mesh_dim_names=("dp", "fsdp"))
        self.replicas = self.process_count
        self.fsdp = topo.mesh.fsdp
        self.backend = compile_backend(cfg)
        self.compiles_graphs = self.backend != "none"
        self.name = f"distributed_{self.device.type}"
        self._ddp = None
        self._transfers = 0
        self._gathered = 0  # bytes the gathers produced here (Counters.gathered_bytes)
        if self.backend == "tpu":
            import torch_tpu  # noqa: F401  (registers the tpu compile backend; loaded by `import torch` already)

    @staticmethod
    def _device(topo) -> torch.device:
        """This rank's device: the host CPU, or the accelerator torch finds (cuda, tpu) at index LOCAL_RANK."""
        if topo.accelerator == "cpu":
            return torch.device("cpu")
        acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        want = "cuda" if topo.accelerator == "cuda" else "tpu"
        if acc is None or acc.type != want:
            raise RuntimeError(f"tpu_topology={topo.name} needs {want} devices but torch finds "
                               f"{acc.type if acc is not None else 'no accelerator'}")
        count = torch.accelerator.device_count()
        local = envmod.torchrun_ranks()[2]
        if local >= count:
            raise RuntimeError(f"local rank {local} but this node has {count} {want} device(s): lower "
                               f"tpu_topology.chips_per_host to {count}")
        torch.accelerator.set_device_index(local)
        return torch.device(want, local)

    # --- layout of the batch ------------------------------------------------------------------------------------
    def local_rows(self, n: int) -> slice:
        per = n // self.process_count
        return slice(self.process_index * per, (self.process_index + 1) * per)

    def shard_batch(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a global batch (tensors of one sample, dim 0 of 1, are the same for every rank)."""
        if tensor.dim() == 0 or tensor.shape[0] == 1:
            return tensor
        if tensor.shape[0] % self.process_count:
            raise ValueError(f"a batch of {tensor.shape[0]} does not split over {self.process_count} ranks")
        return tensor[self.local_rows(tensor.shape[0])]

    def epoch_layout(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def gather_batch(self, tensor: torch.Tensor) -> torch.Tensor:
        out = torch.empty((tensor.shape[0] * self.process_count, *tensor.shape[1:]), dtype=tensor.dtype,
                          device=tensor.device)
        with waiting(COLLECTIVE, "all_gather_into_tensor"):  # the rank watch names what it waits on
            dist.all_gather_into_tensor(out, tensor.contiguous())
        self._gathered += out.numel() * out.element_size()
        return out

    def gather_rows(self, array: np.ndarray) -> np.ndarray:
        """Host arrays of this rank's rows -> the global rows in rank order, on every rank."""
        parts: list = [None] * self.process_count
        with waiting(COLLECTIVE, "all_gather_object"):
            dist.all_gather_object(parts, np.asarray(array))
        whole = np.concatenate(parts)
        self._gathered += whole.nbytes
        return whole

    def mean_over_replicas(self, tensor: torch.Tensor) -> torch.Tensor:
        out = tensor.detach().clone()
        with waiting(COLLECTIVE, "all_reduce"):
            dist.all_reduce(out, op=dist.ReduceOp.SUM)  # gloo has no AVG
        return out / self.process_count

    def any_process(self, flag: bool) -> bool:
        t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=self.device)
        with waiting(COLLECTIVE, "all_reduce"):
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            return bool(t.item())

    def barrier(self) -> None:
        with waiting(COLLECTIVE, "barrier"):
            dist.barrier()

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    # --- the trained model --------------------------------------------------------------------------------------
    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """What the step functions call. mesh.fsdp > 1: FSDP2's fully_shard on the 2-D mesh (HSDP when dp > 1 too),
        in place: every weight (frozen ones too) is split over the fsdp ranks and gathered per forward, gradients
        reduce-scattered. Otherwise DDP over all ranks (``wrap_ddp``: what the model declares about weights its
        forward leaves without a gradient): the trainable weights replicated, gradients all-reduced; the model is
        called through the DDP wrapper (its forward arms the gradient hooks)."""
        if self.fsdp > 1:
            from torch.distributed.fsdp import fully_shard

            mesh = self.mesh if self.mesh.shape[0] > 1 else self.mesh["fsdp"]
            # a model of parts a step calls one at a time shards each as its own unit, so a forward gathers only the
            # part it calls (Wan 2.2's experts: models/wan.py WanExperts.fsdp_units); every other model is one unit
            for unit in getattr(model, "fsdp_units", ()):
                fully_shard(unit, mesh=mesh)
            fully_shard(model, mesh=mesh)
            return model
        if self.process_count == 1:
            return model
        self._ddp = wrap_ddp(model, self.device)
        return self._ddp

    def no_gradient_sync(self, model: torch.nn.Module):
        """Inside an accumulation window but its last micro-step: gradients stay local (one reduction per update)."""
        if self._ddp is not None:
            return self._ddp.no_sync()
        if self.fsdp > 1:
            @contextlib.contextmanager
            def unsynced():
                model.set_requires_gradient_sync(False)
                try:
                    yield
                finally:
                    model.set_requires_gradient_sync(True)

            return unsynced()
        return contextlib.nullcontext()

    def zeros_like_state(self, p: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(p)

    def state_layout(self, tensors) -> StateLayout:
        DTensor = _dtensor()
        tensors = [t for t in tensors if t.dim() > 0]
        return StateLayout.of(tensors, lambda t: isinstance(t, DTensor), self.fsdp)

    def to_full(self, tensor: torch.Tensor) -> torch.Tensor:
        """A whole tensor from a (possibly FSDP-split) one: DTensor.full_tensor(), a collective every rank runs."""
        if not isinstance(tensor, _dtensor()):
            return tensor
        with waiting(COLLECTIVE, "full_tensor"):  # one per tensor: each gathered one is progress
            return tensor.full_tensor()

    def place_like(self, value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """A whole host tensor laid out as `like` (split over the fsdp ranks when like is an FSDP2 DTensor)."""
        value = value.to(device=self.device, dtype=like.dtype)
        if isinstance(like, _dtensor()):
            from torch.distributed.tensor import distribute_tensor

            return distribute_tensor(value, like.device_mesh, like.placements)
        return value

    def state_to_host(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Whole host copies: FSDP2's split tensors gathered with DTensor.full_tensor() (what
        torch.distributed.checkpoint.state_dict's full_state_dict option does per tensor), on every rank; only the
        main process writes them. Keeps the checkpoint format every runtime reads (any world size resumes it)."""
        with torch.no_grad():
            return {k: self.to_full(v).detach().to("cpu").contiguous() for k, v in state.items()}

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.device.type != "cpu":
            self._transfers += 1
        return self.to_full(tensor).detach().to("cpu")

    def sync(self) -> None:
        if self.device.type != "cpu":
            torch.accelerator.synchronize()

    # --- compilation ----------------------------------------------------------------------------------------------
    def compile_step(self, fn):
        """torch.compile with distributed.compile's backend, static shapes: every call of a step has the same
        shapes, so after epoch 0 nothing compiles again (counted from dynamo's counters)."""
        if self.backend == "none":
            return fn
        return torch.compile(fn, backend=self.backend, dynamic=False)

    def counters(self) -> Counters:
        from torch._dynamo.utils import compilation_time_metrics, counters

        seconds = sum(sum(v) for k, v in compilation_time_metrics.items() if k.endswith("compile_inner"))
        return Counters(compilations=int(counters["stats"]["unique_graphs"]), compile_time_s=float(seconds),
                        host_transfers=self._transfers, gathered_bytes=self._gathered)

    def device_peak_gib(self) -> float | None:
        if self.device.type == "cpu":
            return None
        return round(torch.accelerator.max_memory_allocated(self.device) / 2**30, 3)

    def out_of_memory(self, error: BaseException) -> bool:
        return super().out_of_memory(error) or "out of memory" in str(error).lower()

    def lost_peers(self, error: BaseException, run_dir) -> list[tuple[str, bool]]:
        """The ranks that went away (killed, a node gone) when a collective fails, from their heartbeats
        (proc/rankwatch.py): the failing collective's own message names only the connection."""
        if not isinstance(error, (RuntimeError, dist.DistError)) or self.process_count == 1:
            return []
        from ddpo_tpu.proc.rankwatch import lost_peers

        return lost_peers(run_dir, self.process_count, self.process_index)

    def describe(self) -> str:
        how = (f"FSDP2 over fsdp {self.fsdp}" + (f" x dp {self.replicas // self.fsdp}" if self.replicas > self.fsdp
                                                 else "")) if self.fsdp > 1 else "DDP"
        return (f"{self.name}: rank {self.process_index} of {self.process_count} on {self.device}, {how}, "
                f"torch.compile {self.backend}")
