"""What a distributed run needs from this machine, checked by the front end before a run dir exists (no torch
import): the devices its processes will use, TorchTPU where a TPU topology runs on it, and a free rendezvous port.
One line each, naming the key and the fix."""

from __future__ import annotations

import glob
import importlib.util
import socket

from ddpo_tpu.launch import env as envmod

LOCAL_HOSTS = {"localhost", "127.0.0.1", "::1", "[::1]"}


def nvidia_gpus() -> int:
    """NVIDIA GPUs this process may use: the driver's list, narrowed by CUDA_VISIBLE_DEVICES."""
    found = len(glob.glob("/proc/driver/nvidia/gpus/*"))
    visible = envmod.cuda_visible_devices()
    return found if visible is None else min(found, len(visible))


def tpu_chips() -> int:
    """TPU chips attached to this VM (v4/v5p expose /dev/accel*, v5e/v6e /dev/vfio/<n>)."""
    return len(glob.glob("/dev/accel[0-9]*")) + len(glob.glob("/dev/vfio/[0-9]*"))


def _port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host.strip("[]"), port))
        except OSError:
            return True
    return False


def _devices_problems(topo, found: int, what: str, why: str, fix: str) -> list[str]:
    """None of the devices a topology's processes need, or fewer than its processes per node."""
    if found == 0:
        return [f"tpu_topology={topo.name}: no {what} is visible on this machine ({why}) ({fix})"]
    if topo.chips_per_host > found:
        return [f"tpu_topology.chips_per_host={topo.chips_per_host}: {topo.chips_per_host} processes per node but "
                f"this node has {found} {what}(s) (set tpu_topology.chips_per_host={found} with tpu_topology.chips "
                f"and tpu_topology.mesh to match, or choose the tpu_topology of this machine)"]
    return []


def distributed_problems(cfg) -> list[str]:
    topo, d = cfg.tpu_topology, cfg.distributed
    if topo.execution != "distributed":
        return []
    out = []
    if topo.accelerator == "cuda":
        out += _devices_problems(topo, nvidia_gpus(), "NVIDIA GPU", "no driver, or CUDA_VISIBLE_DEVICES hides them",
                                 "run on a GPU machine, or tpu_topology=cpu_dist2 here")
    elif topo.torchtpu:
        if importlib.util.find_spec("torch_tpu") is None or importlib.util.find_spec("libtpu") is None:
            out.append(f"tpu_topology.execution=distributed: tpu_topology={topo.name} then runs on TorchTPU, which is "
                       f"not installed in this environment (bash scripts/setup.sh --torchtpu builds .venv-torchtpu; "
                       f"or set tpu_topology.execution=xla_spmd for torch_xla)")
        else:
            out += _devices_problems(topo, tpu_chips(), "TPU chip", "TorchTPU is installed",
                                     "run on a TPU VM; here use tpu_topology=cpu_dist2")
    if d.rdzv_endpoint is not None:
        host, _, port = d.rdzv_endpoint.rpartition(":")
        local = host in LOCAL_HOSTS or host == socket.gethostname()
        if local and envmod.node_rank(cfg) == 0 and _port_in_use(host, int(port)):
            out.append(f"distributed.rdzv_endpoint={d.rdzv_endpoint}: port {port} is in use on this host (another "
                       f"run or service) (choose a free port, or distributed.rdzv_endpoint=null on one node: torchrun "
                       f"then picks one)")
    return out
