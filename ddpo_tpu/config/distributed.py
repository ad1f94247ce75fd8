"""Compose-time rules of the distributed execution (tpu_topology.execution=distributed: torchrun starts one process
per device; DDP or FSDP2 over a dp x fsdp DeviceMesh; torch.compile). A TPU topology with execution=distributed runs on
TorchTPU; its tpu_topology.pjrt_device is torch_xla's and not read. Pure Python: no torch, no devices. What needs
this machine (devices present, a free rendezvous port, TorchTPU installed) is checked by the front end
(launch/machine.py) before a run dir exists."""

from __future__ import annotations

import re

from ddpo_tpu.catalog import ALGORITHMS
from ddpo_tpu.problems import Fix, Problem

ENDPOINT = re.compile(r"^(?P<host>[A-Za-z0-9_.\-]+|\[[0-9A-Fa-f:]+\]):(?P<port>\d{1,5})$")


def compile_backend(cfg) -> str:
    """distributed.compile as the runtime uses it: auto = `tpu` on TorchTPU, inductor on CPU and CUDA."""
    value = cfg.distributed.compile
    if value != "auto":
        return value
    return "tpu" if cfg.tpu_topology.torchtpu else "inductor"


def distributed_problems(cfg, overridden: frozenset[str] = frozenset()) -> list[Problem]:
    topo, d = cfg.tpu_topology, cfg.distributed
    problems: list[Problem] = []
    backend = compile_backend(cfg)
    if backend == "tpu" and not topo.torchtpu:
        problems.append(Problem("distributed.compile", d.compile, f"the tpu backend is TorchTPU's and "
                                f"accelerator {topo.accelerator} is not a TPU", "set distributed.compile=auto"))
    if backend == "inductor" and topo.torchtpu:
        problems.append(Problem("distributed.compile", d.compile, "inductor does not generate TPU code",
                                "set distributed.compile=auto (TorchTPU's tpu backend)"))
    if d.rdzv_endpoint is not None:
        m = ENDPOINT.match(d.rdzv_endpoint)
        if m is None or not 1 <= int(m["port"]) <= 65535:
            problems.append(Problem("distributed.rdzv_endpoint", d.rdzv_endpoint, "not HOST:PORT",
                                    "e.g. distributed.rdzv_endpoint=10.0.0.2:29500 (the first node's address)"))
    elif topo.hosts > 1:
        problems.append(Problem("distributed.rdzv_endpoint", None,
                                f"{topo.hosts} nodes meet at one rendezvous: every node needs its address",
                                "set distributed.rdzv_endpoint=HOST:PORT (the first node's address and a free port)"))
    if d.node_rank != "auto" and d.node_rank >= topo.hosts:
        problems.append(Problem("distributed.node_rank", d.node_rank, f"there are {topo.hosts} node(s), ranks "
                                f"0..{topo.hosts - 1}", f"set distributed.node_rank to one of 0..{topo.hosts - 1}"))
    if d.keep_samples_on_rank:
        spec = ALGORITHMS.get(cfg.algorithm.name)
        if spec.own_epoch_trainer:
            problems.append(Problem("distributed.keep_samples_on_rank", True, f"algorithm={spec.name} trains its "
                                    "epochs itself over the whole epoch's samples, on every rank",
                                    Fix.of({"distributed.keep_samples_on_rank": False})))
    return problems
