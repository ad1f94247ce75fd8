"""Topology rules: chips, hosts and processes that add up, the execution that drives them, and a mesh that covers
them. The distributed execution's own rules are in config/distributed.py."""

from __future__ import annotations

from pathlib import Path

from ddpo_tpu.config.batch import pick
from ddpo_tpu.config.distributed import distributed_problems
from ddpo_tpu.catalog.executions import multi_device_names
from ddpo_tpu.config.schema import RunConfig
from ddpo_tpu.problems import Fix, Problem


def topology_problems(cfg: RunConfig, overridden: frozenset[str]) -> list[Problem]:
    problems: list[Problem] = []
    topo = cfg.tpu_topology
    spec = topo.spec
    if topo.hosts * topo.chips_per_host != topo.chips:
        problems.append(Problem("tpu_topology.chips", topo.chips,
                                f"{topo.hosts} hosts x {topo.chips_per_host} chips per host = "
                                f"{topo.hosts * topo.chips_per_host}",
                                Fix.of({"tpu_topology.chips": topo.hosts * topo.chips_per_host})))
    if topo.processes != "auto" and topo.processes != topo.expected_processes:
        per = spec.process_per
        problems.append(Problem("tpu_topology.processes", topo.processes,
                                f"one training process runs per {per} and there are {topo.expected_processes} "
                                f"{per}s", Fix.of({"tpu_topology.processes": topo.expected_processes},
                                                  note="(or auto)")))
    if spec.torchrun:
        problems.extend(distributed_problems(cfg, overridden))
    elif not spec.torch_xla:
        if topo.pjrt_device is not None and not topo.accelerator.startswith("tpu"):
            problems.append(Problem("tpu_topology.pjrt_device", topo.pjrt_device,
                                    "eager execution does not use PJRT", Fix.of({"tpu_topology.pjrt_device": None})))
        if topo.accelerator.startswith("tpu"):
            problems.append(Problem("tpu_topology.execution", topo.execution,
                                    "TPUs run through XLA or TorchTPU",
                                    "set tpu_topology.execution=xla_spmd (or xla for one chip), or distributed for "
                                    "TorchTPU"))
    else:
        want = {"cpu": "CPU", "cuda": "CUDA"}.get(topo.accelerator, "TPU")
        if topo.pjrt_device != want:
            problems.append(Problem("tpu_topology.pjrt_device", topo.pjrt_device,
                                    f"accelerator {topo.accelerator} runs on PJRT device {want}",
                                    Fix.of({"tpu_topology.pjrt_device": want})))
    if not spec.multi_device and topo.chips != 1:
        problems.append(Problem("tpu_topology.execution", topo.execution,
                                f"{topo.execution} drives one device but the topology has {topo.chips} chips",
                                Fix.of(*({"tpu_topology.execution": name} for name in multi_device_names()),
                                       note="to use them all")))
    if spec.multi_device and topo.hosts * topo.chips_per_host == topo.chips:
        problems.extend(_mesh_problems(cfg, overridden))
    return problems


def _mesh_problems(cfg: RunConfig, overridden: frozenset[str]) -> list[Problem]:
    problems: list[Problem] = []
    topo = cfg.tpu_topology
    mesh = topo.mesh
    if mesh.dp * mesh.fsdp != topo.chips:
        if topo.chips % mesh.fsdp == 0:
            fix = Fix.of({"tpu_topology.mesh.dp": topo.chips // mesh.fsdp})
        else:
            fix = Fix.of({"tpu_topology.mesh.dp": topo.chips, "tpu_topology.mesh.fsdp": 1})
        k = pick(("tpu_topology.mesh.dp", "tpu_topology.mesh.fsdp"), overridden)
        problems.append(Problem(k, mesh.dp if k.endswith(".dp") else mesh.fsdp,
                                f"mesh dp {mesh.dp} x fsdp {mesh.fsdp} = {mesh.dp * mesh.fsdp} devices but the "
                                f"topology has {topo.chips} chips", fix))
    if mesh.layout == "host_local" and (mesh.dp, mesh.fsdp) != (topo.hosts, topo.chips_per_host):
        problems.append(Problem("tpu_topology.mesh.layout", mesh.layout,
                                "host_local puts dp across hosts and fsdp within one",
                                Fix.of({"tpu_topology.mesh.dp": topo.hosts,
                                        "tpu_topology.mesh.fsdp": topo.chips_per_host})))
    if topo.hosts > 1 and mesh.fsdp > 1 and topo.chips_per_host % mesh.fsdp:
        # a checkpoint is put together from one host's shards, so every fsdp group must sit inside a host
        problems.append(Problem("tpu_topology.mesh.fsdp", mesh.fsdp,
                                f"fsdp groups must fit inside one host ({topo.chips_per_host} chips) so each host "
                                f"holds whole parameters",
                                Fix.of({"tpu_topology.mesh.fsdp": topo.chips_per_host,
                                        "tpu_topology.mesh.dp": topo.chips // topo.chips_per_host})))
    if cfg.xla.gather == "host" and topo.hosts > 1 and topo.spec.spmd:
        problems.append(Problem("xla.gather", "host", "a host-side gather sees only this host's shards on a pod",
                                Fix.of({"xla.gather": "device"})))
    if topo.accelerator == "cpu" and topo.hosts != 1 and topo.spec.spmd:
        problems.append(Problem("tpu_topology.hosts", topo.hosts, "PJRT CPU runs on one host",
                                Fix.of({"tpu_topology.hosts": 1})))
    return problems


def conf_dir() -> Path:
    """conf/ of a checkout, or the copy shipped in the wheel as ddpo_tpu/conf."""
    here = Path(__file__).resolve().parent.parent  # ddpo_tpu/
    for candidate in (here / "conf", here.parent / "conf"):
        if (candidate / "config.yaml").is_file():
            return candidate
    raise FileNotFoundError(f"ddpo_tpu's conf/ directory is missing (looked in {here / 'conf'} and "
                            f"{here.parent / 'conf'})")


def single_host_of(topo) -> tuple[str, int] | None:
    """The 8-chip single-host topology of a single chip's kind with its HBM (v6e-1 -> v6e-8), if conf has one."""
    import yaml

    name = f"{topo.name.rsplit('-', 1)[0]}-8"
    path = conf_dir() / "tpu_topology" / f"{name}.yaml"
    if name == topo.name or not path.is_file():
        return None
    t = yaml.safe_load(path.read_text())
    same = t.get("accelerator") == topo.accelerator and t.get("hbm_gib_per_chip") == topo.hbm_gib_per_chip
    whole = same and t.get("hosts") == 1 and t.get("chips") == t["chips_per_host"]
    return (name, t["chips_per_host"]) if whole else None
