"""Compose-time rules of the distributed execution (tpu_topology.execution=distributed: torchrun starts one process
per device; DDP or FSDP2 over a dp x fsdp DeviceMesh; torch.compile). A TPU topology with execution=distributed runs on
TorchTPU; its tpu_topology.pjrt_device is torch_xla's and not read. Pure Python: no torch, no devices. What needs
this machine (devices present, a free rendezvous port, TorchTPU installed) is checked by the front end
(launch/machine.py) before a run dir exists."""

from __future__ import annotations

import re
from pathlib import Path

from ddpo_tpu.catalog import ALGORITHMS
from ddpo_tpu.problems import Fix, Problem

ENDPOINT = re.compile(r"^(?P<host>[A-Za-z0-9_.\-]+|\[[0-9A-Fa-f:]+\]):(?P<port>\d{1,5})$")
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]+:/")  # gs://, s3://, and gs:/ (one slash: a typo of a URL)


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
    if d.hang_timeout_s >= d.timeout_s:
        # the collective's timeout fires first and fails the rank that waited, not the one that hung: the outcome
        # the rank watch (proc/rankwatch.py) exists to prevent. The key the user set is named.
        hang, wait = d.hang_timeout_s, d.timeout_s
        if "distributed.timeout_s" in overridden and "distributed.hang_timeout_s" not in overridden:
            key, value, fix = "distributed.timeout_s", wait, Fix.of({"distributed.timeout_s": max(10, int(hang) * 2)})
        else:
            key, value = "distributed.hang_timeout_s", hang
            fix = Fix.of({"distributed.hang_timeout_s": max(3, int(wait) // 2)},
                         {"distributed.timeout_s": int(hang) * 2})
        problems.append(Problem(key, f"{value:g}", f"the rank watch (distributed.hang_timeout_s={hang:g} s) must end "
                                f"a hung rank before a collective times out (distributed.timeout_s={wait:g} s), or "
                                f"the collective blames the rank that waited", fix))
    problems.extend(_cache_problems(d.compile_cache_dir))
    if d.keep_samples_on_rank:
        spec = ALGORITHMS.get(cfg.algorithm.name)
        if spec.own_epoch_trainer:
            problems.append(Problem("distributed.keep_samples_on_rank", True, f"algorithm={spec.name} trains its "
                                    "epochs itself over the whole epoch's samples, on every rank",
                                    Fix.of({"distributed.keep_samples_on_rank": False})))
    return problems


def _cache_problems(cache: str | None) -> list[Problem]:
    """torch.compile's caches are a local directory (TORCHINDUCTOR_CACHE_DIR): a bucket URL would become a relative
    `gs:` folder in the working directory. Checked as xla.compilation_cache_dir is (config/inputs.py)."""
    key = "distributed.compile_cache_dir"
    if cache in (None, "auto"):
        return []
    if not cache.strip():
        return [Problem(key, repr(cache), "empty path", "use auto, null or a directory")]
    if _SCHEME.match(cache) or "://" in cache:
        return [Problem(key, cache, "torch.compile's cache is a local directory, not a bucket",
                        "use a local directory, auto or null")]
    path = Path(cache).expanduser().absolute()
    while not path.exists():
        path = path.parent
    if not path.is_dir():
        return [Problem(key, cache, f"{path} is a file, not a directory",
                        "use a directory, created if missing; or auto or null")]
    return []
