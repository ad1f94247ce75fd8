"""The execution kinds are catalog specs (ddpo_tpu/catalog/executions.py): no module outside the catalog and the
runtime backends spells a kind's name out, and each spec's capabilities are what the code that reads them does
(the topologies of conf/tpu_topology composed and validated; nothing is trained here)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from ddpo_tpu.catalog import EXECUTIONS, execution
from ddpo_tpu.catalog.executions import execution_or_none, multi_device_names
from ddpo_tpu.config.compose import compose_and_validate
from ddpo_tpu.problems import ConfigError

pytestmark = pytest.mark.torch_free  # no torch in the test or what it starts (tests/conftest.py)

REPO = Path(__file__).resolve().parents[3]
PACKAGE = REPO / "ddpo_tpu"
# the registered names, and the two other spellings the package has used for a kind (SPMD, torchrun)
KIND_NAMES = frozenset({*EXECUTIONS.names(), "spmd", "torchrun"})
ALLOWED = ("catalog", "runtime")  # the specs themselves, and the backends they name
# one conf/tpu_topology option of each kind, all on the CPU
TOPOLOGY_OF = {"eager": "eager_cpu", "xla": "cpu", "xla_spmd": "cpu_spmd4", "distributed": "cpu_dist2"}


def kind_literals(source: str) -> list[tuple[int, str]]:
    """(line, name) of every string constant of the source that is exactly a kind's name."""
    return [(node.lineno, node.value) for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in KIND_NAMES]


def test_the_scan_finds_the_compares_it_forbids():
    source = ('if topo.execution == "distributed":\n    pass\n'
              'ok = cfg.execution in ("eager", "xla")\n'
              'Fix.of({"tpu_topology.execution": "xla_spmd"})\n'
              '"""the distributed execution: torchrun"""\n'
              'f"tpu_topology.execution=distributed: {x}"\n')
    assert kind_literals(source) == [(1, "distributed"), (3, "eager"), (3, "xla"), (4, "xla_spmd")]


def test_no_execution_kind_is_spelled_outside_the_catalog_and_the_runtime():
    """Whether a run is eager, XLA, SPMD or torchrun is a capability read (topology.spec.torchrun, .multi_device,
    .torch_xla, ...), never a compare of tpu_topology.execution with a name (issue 42, item 3)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if rel.parts[0] in ALLOWED:
            continue
        found += [f"ddpo_tpu/{rel}:{line} spells out {name!r}" for line, name in kind_literals(path.read_text())]
    assert not found, "\n".join(found)


def test_every_kind_is_registered_once_and_the_schema_accepts_exactly_them():
    from typing import get_args

    from ddpo_tpu.config.schema import TopologyConfig

    assert set(EXECUTIONS.names()) == set(TOPOLOGY_OF)
    assert get_args(TopologyConfig.model_fields["execution"].annotation) == EXECUTIONS.names()
    import yaml

    used = {yaml.safe_load(p.read_text())["execution"] for p in (REPO / "conf" / "tpu_topology").glob("*.yaml")}
    assert used <= set(EXECUTIONS.names()) and set(TOPOLOGY_OF) <= used
    with pytest.raises(KeyError, match="no execution named 'spmd'"):
        execution("spmd")
    assert execution_or_none("spmd") is None and execution_or_none(None) is None
    assert execution_or_none("xla_spmd") is execution("xla_spmd")


def _imports(tree: ast.AST) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module.split(".")[0])
    return out


@pytest.mark.parametrize("name", sorted(TOPOLOGY_OF))
def test_the_backend_is_a_runtime_of_ddpo_tpu_runtime_and_imports_torch_xla_iff_the_spec_says(name):
    """Read, not imported (importing torch_xla here would start PJRT in the test process): the backend's module is
    in runtime/, defines the class as a Runtime, and only the torch_xla kinds' backend imports torch_xla."""
    spec = execution(name)
    module, _, cls = spec.backend.partition(":")
    assert module.startswith("ddpo_tpu.runtime.")
    tree = ast.parse((REPO / (module.replace(".", "/") + ".py")).read_text())
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    assert cls in classes and "Runtime" in {getattr(b, "id", None) for b in classes[cls].bases}
    assert ("torch_xla" in _imports(tree)) == spec.torch_xla


@pytest.mark.parametrize("name", sorted(TOPOLOGY_OF))
def test_each_specs_capabilities_are_what_the_launch_and_the_training_process_get(name):
    from ddpo_tpu import env as envmod
    from ddpo_tpu.compile_caches import torch_cache_dir
    from ddpo_tpu.launch.process import TORCHRUN_MODULE, WORKER_MODULE, training_command

    spec = execution(name)
    cfg = compose_and_validate(["+experiment=smoke", f"tpu_topology={TOPOLOGY_OF[name]}"]).cfg
    topo = cfg.tpu_topology
    assert topo.execution == name and topo.spec is spec
    # the batch is split over the mesh only by the multi-device kinds (cpu_spmd4: 4 x 1, cpu_dist2: 2 x 1)
    assert topo.replicas == (topo.mesh.dp * topo.mesh.fsdp if spec.multi_device else 1)
    assert (topo.replicas > 1) == spec.multi_device
    # torchrun starts one process per device; the worker runs alone otherwise (one per host)
    cmd = training_command(cfg)
    assert (TORCHRUN_MODULE in cmd) == spec.torchrun and cmd[-1] == WORKER_MODULE
    assert topo.expected_processes == (topo.chips if spec.process_per == "device" else topo.hosts)
    # plain torch keeps PJRT on the host; torch_xla gets the topology's device and the XLA flags
    variables = envmod.runtime_variables(cfg)
    assert (variables["PJRT_DEVICE"] == topo.pjrt_device) == spec.torch_xla
    assert ("CPU_NUM_DEVICES" in variables) == spec.torch_xla
    # torch.compile's cache is kept (and checked for damage) only where torch.compile runs
    assert (torch_cache_dir(cfg) is not None) == spec.torch_compiles == ("TORCHINDUCTOR_CACHE_DIR" in variables)
    assert spec.compiles_graphs == (spec.compiler != "none") and spec.compiles_graphs == (name != "eager")


@pytest.mark.parametrize("name", sorted(TOPOLOGY_OF))
def test_xla_flags_reach_only_the_kinds_that_take_them(name):
    from ddpo_tpu import env as envmod
    from ddpo_tpu.launch import xla_flags

    spec = execution(name)
    overrides = ["+experiment=smoke", f"tpu_topology={TOPOLOGY_OF[name]}", 'xla.flags=["--xla_dump_to=/tmp/x"]']
    if spec.takes_xla_flags:
        cfg = compose_and_validate(overrides).cfg
        assert envmod.runtime_variables(cfg)["XLA_FLAGS"] == "--xla_dump_to=/tmp/x"
    else:  # refused at compose time, naming the key (config/enablement.py), rather than silently dropped
        with pytest.raises(ConfigError, match="xla.flags.*the topology does not run torch_xla"):
            compose_and_validate(overrides)
        cfg = compose_and_validate(overrides[:2]).cfg
        assert "XLA_FLAGS" not in envmod.runtime_variables(cfg)
    # the front end's check of the flag names against this machine's XLA: only where XLA reads them
    if xla_flags.library() is not None:
        assert bool(xla_flags.problems(["--xla_nonexistent_flag=1"], name)) == spec.takes_xla_flags


def test_a_one_device_kind_on_several_chips_offers_every_multi_device_kind():
    assert multi_device_names() == ("xla_spmd", "distributed")
    with pytest.raises(ConfigError) as e:
        compose_and_validate(["+experiment=smoke", "tpu_topology=cpu_spmd4", "tpu_topology.execution=xla"])
    text = str(e.value)
    assert "xla drives one device but the topology has 4 chips" in text
    assert "tpu_topology.execution=xla_spmd, or tpu_topology.execution=distributed" in text


def test_saved_configs_read_their_kind_through_the_catalog():
    """A run dir's config (a plain tree) of a kind the catalog does not know, or of none, is one device, not an
    error: status and resume read old runs."""
    from ddpo_tpu.config.resume import resume_relevant
    from ddpo_tpu.status.facts import device_is_host

    tree = {"sample": {"batch_size": 4}, "tpu_topology": {"mesh": {"dp": 2, "fsdp": 2}, "accelerator": "cpu"}}
    for kind, replicas in ((None, 1), ("retired_kind", 1), ("xla", 1), ("xla_spmd", 4), ("distributed", 4)):
        t = {**tree, "tpu_topology": {**tree["tpu_topology"], **({"execution": kind} if kind else {})}}
        assert resume_relevant(t)["sample.global_batch_size"] == 4 * replicas, kind
        # the host CPU is the device only for plain torch on the CPU (no XLA runtime threads)
        spec = execution_or_none(kind)
        assert device_is_host(t) == (spec is not None and not spec.torch_xla), kind
