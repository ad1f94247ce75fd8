"""Shared fixtures only; helpers live in tests/helpers (`from tests.helpers import ...`)."""

from __future__ import annotations

import importlib.util
import os
import runpy
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

if importlib.util.find_spec("torch_tpu") is not None:  # the TorchTPU environment, on a machine without a TPU
    from ddpo_tpu.env import keep_torchtpu_unloaded

    keep_torchtpu_unloaded()

# Re-exported for the test files that still import them from conftest (test_status.py, test_launch_pod.py) until
# they import from tests.helpers; nothing else should.
from tests.helpers import REPO, clean_env, read_metrics, run_train  # noqa: F401


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory, worker_id) -> Path:
    """One tiny-model build for the whole session (each run loads it through from_pretrained). Under pytest-xdist
    (-n 2) the workers share it: it sits beside their own temporary dirs, and proc/build_cache.py's lock makes the
    second worker that needs a model wait for the first one's build and reuse it."""
    if worker_id == "master":  # one process (no -n)
        return tmp_path_factory.mktemp("models")
    shared = tmp_path_factory.getbasetemp().parent / "models"  # the run's dir, above each worker's own
    shared.mkdir(exist_ok=True)
    return shared


@pytest.fixture(scope="session")
def worker_id(request) -> str:
    """pytest-xdist's worker name (gw0, gw1, ...), "master" without -n; the same as xdist's fixture of this name,
    defined here so the tests also run where pytest-xdist is not installed."""
    return getattr(request.config, "workerinput", {}).get("workerid", "master")


@pytest.fixture(autouse=True)
def _one_torch_thread_in_pytest():
    """torch in the pytest process computes with one intra-op thread. The tiny models gain nothing from two, and two
    spinning OpenMP threads collapse when anything else uses the 2 cores (measured: the fused micro-step gradient test
    70 s with two threads next to another test process, 11 s with one). Training processes the tests start keep
    torch's default; torch is not imported here for tests that check it stays unimported."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.get_num_threads() != 1:
        torch.set_num_threads(1)
    yield



@pytest.fixture(autouse=True)
def _hydra_compose_where_marked(request, monkeypatch):
    """A test marked `hydra_compose` composes with Hydra whole (the tests of composition itself)."""
    if request.node.get_closest_marker("hydra_compose") is not None:
        import ddpo_tpu.config.compose as module
        from tests.helpers import hydra_compose

        monkeypatch.setattr(module, "compose", hydra_compose)
    yield


NO_TORCH_DIR = Path(__file__).resolve().parent / "helpers" / "no_torch"


def pytest_addoption(parser):
    parser.addoption(
        "--torch-free", choices=("only", "skip"), default=None,
        help="only: run the tests marked torch_free, with torch unimportable in pytest and every process it starts "
             "(a test that imports torch fails: the mark is checked as it is used); skip: deselect them (the "
             "TorchTPU tier: they exercise no torch, and the two lockfiles pin the same other packages)")


def pytest_ignore_collect(collection_path, config):
    """`--torch-free=only` does not import the test modules that carry no torch_free mark: most import torch."""
    if config.getoption("torch_free") == "only" and collection_path.suffix == ".py" \
            and collection_path.name.startswith("test_"):
        return "mark.torch_free" not in collection_path.read_text()
    return None


def _torch_free(item) -> bool:
    return item.get_closest_marker("torch_free") is not None and item.get_closest_marker("needs_torch") is None


def pytest_configure(config):
    """Compositions in this process shared (tests.helpers.share_compositions: most fast tests compose a variant of a
    few configs; Hydra's whole composition was ~90% of tests/unit/config's time). `--torch-free=only`: torch made
    unimportable here (this process: the hook runs before any test module is imported) and in every process the tests
    start (tests/helpers/no_torch/sitecustomize.py, first on PYTHONPATH)."""
    from tests.helpers import share_compositions

    share_compositions()
    if config.getoption("torch_free") != "only":
        return
    loaded = [m for m in ("torch", "diffusers", "transformers") if sys.modules.get(m) is not None]
    if loaded:
        raise pytest.UsageError(f"--torch-free=only: {', '.join(loaded)} already imported by a plugin or conftest")
    runpy.run_path(str(NO_TORCH_DIR / "sitecustomize.py"))  # by path: python may have imported its own already

    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(NO_TORCH_DIR), os.environ.get("PYTHONPATH")) if p)


GROUPS_DIR = pytest.StashKey[str]()


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """The controller (pytest-xdist): a folder for the workers' test groups (tests/helpers/xdist_groups.py)."""
    from tests.helpers.xdist_groups import GROUPS_DIR_KEY

    if GROUPS_DIR not in node.config.stash:
        node.config.stash[GROUPS_DIR] = tempfile.mkdtemp(prefix="ddpo_tpu-test-groups-")
    node.workerinput[GROUPS_DIR_KEY] = node.config.stash[GROUPS_DIR]


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadgroup`: the groups the workers wrote (xdist's own loadgroup does not group under pytest 9.2)."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from tests.helpers.xdist_groups import FixtureGroupScheduling

    return FixtureGroupScheduling(config, log, config.stash[GROUPS_DIR])


def pytest_unconfigure(config):
    if GROUPS_DIR in config.stash:
        shutil.rmtree(config.stash[GROUPS_DIR], ignore_errors=True)


SHARED_SCOPES = ("module", "class", "package")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Tests that share a fixture of module scope (one set of end-to-end runs several tests read, a loaded model) run
    on one pytest-xdist worker (`-n 2 --dist loadgroup`; tests/helpers/xdist_groups.py), so the fixture is built once
    rather than once per worker; an explicit `xdist_group` mark groups too. In the TorchTPU environment
    (requirements-torchtpu.txt: torch 2.15, no torch_xla) the tests of torch_xla's runtime skip, saying why, as does
    a test marked `requires(module, ...)` where a module is missing; everything else runs there too. `--torch-free`
    keeps or drops the tests marked torch_free (pytest_addoption) before the groups are made."""
    mode = config.getoption("torch_free")
    if mode is not None:
        keep = [i for i in items if _torch_free(i) == (mode == "only")]
        if len(keep) != len(items):
            config.hook.pytest_deselected(items=[i for i in items if i not in keep])
            items[:] = keep
    groups = {}
    for item in items:
        marks = [m.args[0] if m.args else m.kwargs.get("name", "default") for m in item.iter_markers("xdist_group")]
        defs = getattr(item, "_fixtureinfo", None)
        if defs is not None and any(d[-1].scope in SHARED_SCOPES for d in defs.name2fixturedefs.values() if d):
            marks.append(item.nodeid.split("::")[0])
        if marks:
            groups[item.nodeid] = "_".join(sorted(set(marks)))
    if hasattr(config, "workerinput"):
        from tests.helpers.xdist_groups import longest_first, write_groups

        longest_first(items, groups)
        write_groups(config.workerinput, groups)
    for item in items:
        needed = [m for mark in item.iter_markers("requires") for m in mark.args]
        if "xla" in item.keywords:
            needed.append("torch_xla")
        missing = [m for m in dict.fromkeys(needed) if not _installed(m)]
        if missing:
            item.add_marker(pytest.mark.skip(reason=f"needs {', '.join(missing)}, which this environment does not "
                                                    f"have (the TorchTPU lockfile has no torch_xla)"))


def _installed(module: str) -> bool:
    """`requires(...)`'s test (and the `xla` mark's: torch_xla): the module can be imported here."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or blocked (--torch-free=only)
        return False
