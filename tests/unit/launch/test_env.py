"""ddpo_tpu.env: legacy variables are refused with their config key, the training process's environment is built
from config only, secrets are redacted, and no other module touches the environment."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ddpo_tpu.config.batch import MISSING, lookup
from ddpo_tpu.config.compose import compose_and_validate
from ddpo_tpu import env as envmod
from ddpo_tpu.env import OWNED_VARIABLES, RUN_DIR_VARIABLE

pytestmark = pytest.mark.torch_free  # no torch in the test or what it starts (tests/conftest.py)

REPO = Path(__file__).resolve().parents[3]

# the field notes' variables (BRIEF section 1) and torch_xla's own: every one must be owned by a config key
FIELD_NOTE_VARIABLES = ["DDPO_TPU_SYNC_EVERY_STEP", "DDPO_TPU_SYNC_EVERY_BATCH", "DDPO_TPU_USE_ACCELERATE_GATHER",
                        "DDPO_TPU_SHUFFLE_TIMESTEPS", "PJRT_DEVICE", "XLA_FLAGS", "LIBTPU_INIT_ARGS",
                        "CPU_NUM_DEVICES", "XLA_USE_BF16", "PT_XLA_DEBUG_LEVEL"]


def cfg(*overrides):
    return compose_and_validate(list(overrides)).cfg


def dirty_environ() -> dict[str, str]:
    environ = {name: "stale" for name in OWNED_VARIABLES}
    environ.update({"HOME": "/home/u", "PATH": "/usr/bin", "WANDB_API_KEY": "secret-key", "LANG": "C.UTF-8"})
    return environ


# --- legacy variables ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", FIELD_NOTE_VARIABLES)
def test_field_note_variables_are_owned(name):
    assert name in OWNED_VARIABLES


@pytest.mark.parametrize("name", sorted(OWNED_VARIABLES))
def test_legacy_problems_names_variable_and_key(name):
    lines = envmod.legacy_problems({name: "2", "HOME": "/home/u", "DDPO_TPU_RUN_DIR": "/x"})
    assert len(lines) == 1
    assert name in lines[0] and OWNED_VARIABLES[name] in lines[0] and "'2'" in lines[0]
    assert f"unset {name}" in lines[0]


def test_legacy_problems_all_and_none():
    assert envmod.legacy_problems({"HOME": "/home/u", "PATH": "/bin", "TPU_WORKER_ID": "0"}) == []
    lines = envmod.legacy_problems({n: "1" for n in OWNED_VARIABLES})
    assert len(lines) == len(OWNED_VARIABLES)
    assert envmod.legacy_problems({"DDPO_TPU_SYNC_EVERY_STEP": "2"})[0].count("xla.sync_every_n_denoising_steps") == 1


@pytest.mark.parametrize("name", sorted(OWNED_VARIABLES))
def test_owned_variable_points_at_an_existing_key(name):
    key = re.match(r"[\w.]+", OWNED_VARIABLES[name]).group(0)
    tree = compose_and_validate([]).tree
    assert lookup(tree, key) is not MISSING, f"{name} points at {key!r}, which the config lacks"


def test_xla_flags_hint_is_valid_override_syntax():
    example = re.search(r"xla\.flags=\[[^\]]*\]", OWNED_VARIABLES["XLA_FLAGS"]).group(0)
    assert cfg("tpu_topology=v6e-8", example).xla.flags == ["--xla_foo=1"]


# --- the training process's environment ---------------------------------------------------------------------------


def test_child_environment_cpu_spmd4(tmp_path):
    environ = dirty_environ()
    before = dict(environ)
    env = envmod.child_environment(cfg("+experiment=smoke", "tpu_topology=cpu_spmd4"), tmp_path, environ)
    assert environ == before  # the caller's mapping is not modified
    assert env["PJRT_DEVICE"] == "CPU" and env["CPU_NUM_DEVICES"] == "4"
    assert env[RUN_DIR_VARIABLE] == str(tmp_path)
    for name in OWNED_VARIABLES:  # nothing of the caller's owned variables survives
        assert env.get(name) != "stale", name
    assert {k for k in OWNED_VARIABLES if k in env} == {"PJRT_DEVICE", "CPU_NUM_DEVICES"}
    assert env["HOME"] == "/home/u" and env["PATH"] == "/usr/bin" and env["WANDB_API_KEY"] == "secret-key"
    assert env["PYTHONUNBUFFERED"] == "1"


def test_child_environment_single_xla_cpu(tmp_path):
    env = envmod.child_environment(cfg("tpu_topology=cpu"), tmp_path, dirty_environ())
    assert env["PJRT_DEVICE"] == "CPU" and env["CPU_NUM_DEVICES"] == "1"


def test_child_environment_eager_pins_pjrt_to_cpu_and_ignores_xla_knobs(tmp_path):
    # the rules refuse xla.* keys on an eager topology (config/enablement.py); the environment ignores them anyway
    c = cfg()
    c = c.model_copy(update={"xla": c.xla.model_copy(update={"flags": ["--xla_foo"], "debug_level": 2})})
    env = envmod.child_environment(c, tmp_path, dirty_environ())
    assert env["PJRT_DEVICE"] == "CPU"
    for name in ("CPU_NUM_DEVICES", "XLA_FLAGS", "LIBTPU_INIT_ARGS", "PT_XLA_DEBUG_LEVEL", "XLA_IR_DEBUG"):
        assert name not in env, name


def test_child_environment_v6e_8_flags(tmp_path):
    c = cfg("tpu_topology=v6e-8", "xla.flags=['--xla_dump_to=/tmp/dump','--xla_foo=1']",
            "xla.libtpu_init_args=['--xla_tpu_enable_async_collective_fusion=true','--xla_bar=2']")
    env = envmod.child_environment(c, tmp_path, dirty_environ())
    assert env["PJRT_DEVICE"] == "TPU" and "CPU_NUM_DEVICES" not in env
    assert env["XLA_FLAGS"] == "--xla_dump_to=/tmp/dump --xla_foo=1"
    assert env["LIBTPU_INIT_ARGS"] == "--xla_tpu_enable_async_collective_fusion=true --xla_bar=2"
    assert "PT_XLA_DEBUG_LEVEL" not in env


def test_child_environment_no_flags_drops_callers_flags(tmp_path):
    env = envmod.child_environment(cfg("tpu_topology=v6e-8"), tmp_path,
                                   {"XLA_FLAGS": "--stale", "LIBTPU_INIT_ARGS": "--stale", "HOME": "/h"})
    assert "XLA_FLAGS" not in env and "LIBTPU_INIT_ARGS" not in env and env["HOME"] == "/h"


@pytest.mark.parametrize("level,expected", [
    (0, {}),
    (1, {"PT_XLA_DEBUG_LEVEL": "1"}),
    (2, {"PT_XLA_DEBUG_LEVEL": "1", "XLA_IR_DEBUG": "1", "XLA_HLO_DEBUG": "1"}),
])
def test_debug_level(tmp_path, level, expected):
    env = envmod.child_environment(cfg("tpu_topology=cpu", f"xla.debug_level={level}"), tmp_path,
                                   {"PT_XLA_DEBUG_LEVEL": "5", "XLA_IR_DEBUG": "1", "XLA_HLO_DEBUG": "1"})
    got = {k: env[k] for k in ("PT_XLA_DEBUG_LEVEL", "XLA_IR_DEBUG", "XLA_HLO_DEBUG") if k in env}
    assert got == expected
    assert env["TF_CPP_MIN_LOG_LEVEL"] == ("2" if level == 0 else "0")


def test_child_environment_defaults_to_os_environ(tmp_path, monkeypatch):
    monkeypatch.setenv("DDPO_TPU_SYNC_EVERY_STEP", "2")
    monkeypatch.setenv("DDPO_TPU_TEST_MARKER", "kept")
    env = envmod.child_environment(cfg(), tmp_path)
    assert "DDPO_TPU_SYNC_EVERY_STEP" not in env and env["DDPO_TPU_TEST_MARKER"] == "kept"
    assert any("DDPO_TPU_SYNC_EVERY_STEP" in line for line in envmod.legacy_problems())


# --- redaction, compilation cache ---------------------------------------------------------------------------------


def test_redacted_hides_secrets(tmp_path):
    env = envmod.child_environment(cfg(), tmp_path, {
        "WANDB_API_KEY": "s1", "HF_TOKEN": "s2", "AWS_SECRET_ACCESS_KEY": "s3", "DB_PASSWORD": "s4",
        "GOOGLE_APPLICATION_CREDENTIALS": "/k.json", "HOME": "/home/u", "PATH": "/usr/bin"})
    before = dict(env)
    red = envmod.redacted(env)
    assert env == before
    for k in ("WANDB_API_KEY", "HF_TOKEN", "AWS_SECRET_ACCESS_KEY", "DB_PASSWORD", "GOOGLE_APPLICATION_CREDENTIALS"):
        assert red[k] == "<redacted>", k
    assert red["HOME"] == "/home/u" and red["PATH"] == "/usr/bin" and red["PJRT_DEVICE"] == "CPU"
    assert list(red) == sorted(red) and set(red) == set(env)
    assert not any(v.startswith("s") and len(v) == 2 for v in red.values())


@pytest.mark.parametrize("topology,on", [("v6e-8", True), ("v4-8", True), ("v6e-1", True),
                                         ("cpu", False), ("cpu_spmd4", False), ("eager_cpu", False)])
def test_compilation_cache_auto(monkeypatch, tmp_path, topology, on):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    got = envmod.compilation_cache_dir(cfg(f"tpu_topology={topology}"))
    if on:
        assert got is not None and Path(got).is_relative_to(tmp_path / "ddpo_tpu")
    else:
        assert got is None


def test_compilation_cache_explicit(tmp_path):
    assert envmod.compilation_cache_dir(cfg("tpu_topology=v6e-8", "xla.compilation_cache_dir=null")) is None
    assert envmod.compilation_cache_dir(cfg("tpu_topology=cpu", f"xla.compilation_cache_dir={tmp_path}/cc")) == \
        f"{tmp_path}/cc"
    home = str(Path("~").expanduser())
    assert envmod.compilation_cache_dir(cfg("tpu_topology=cpu", "xla.compilation_cache_dir='~/cc'")) == f"{home}/cc"


# --- only env.py touches the environment --------------------------------------------------------------------

_ENV_ACCESS = re.compile(r"os\.environ|os\.getenv|putenv|from\s+os\s+import[^\n]*\b(environ|getenv)\b")


def test_only_env_module_touches_the_environment():
    package = REPO / "ddpo_tpu"
    modules = sorted(package.rglob("*.py"))
    assert package / "env.py" in modules and len(modules) > 5
    offenders = []
    for path in modules:
        if path == package / "env.py":
            continue
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if _ENV_ACCESS.search(line):
                offenders.append(f"{path.relative_to(REPO)}:{n}: {line.strip()}")
    assert not offenders, "environment access outside ddpo_tpu/env.py:\n" + "\n".join(offenders)


def test_env_access_pattern_catches_the_spellings():
    for line in ("x = os.environ['A']", "os.getenv('A')", "os.putenv('A', '1')", "from os import environ",
                 "from os import path, getenv"):
        assert _ENV_ACCESS.search(line), line
    assert not _ENV_ACCESS.search("from os import path")


def test_torch_compile_caches_live_under_the_cache_root_across_restarts(tmp_path, monkeypatch):
    """distributed.compile_cache_dir: inductor's and AOTAutograd's caches in the user's cache dir (auto), a path, or
    torch's own /tmp default (null); an eager run sets nothing."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    env = envmod.child_environment(cfg("tpu_topology=cpu_dist2"), tmp_path, dirty_environ())
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "xdg" / "ddpo_tpu" / "torch_compile")
    assert env["TORCHINDUCTOR_FX_GRAPH_CACHE"] == env["TORCHINDUCTOR_AUTOGRAD_CACHE"] == "1"
    there = envmod.child_environment(cfg("tpu_topology=cpu_dist2", f"distributed.compile_cache_dir={tmp_path}/c"),
                                     tmp_path, {})
    assert there["TORCHINDUCTOR_CACHE_DIR"] == f"{tmp_path}/c"
    assert "TORCHINDUCTOR_CACHE_DIR" not in envmod.child_environment(
        cfg("tpu_topology=cpu_dist2", "distributed.compile_cache_dir=null"), tmp_path, {})
    assert "TORCHINDUCTOR_CACHE_DIR" not in envmod.child_environment(cfg(), tmp_path, {})


def test_each_other_node_of_a_multi_node_run_keeps_its_own_files(tmp_path):
    """Nodes share the run dir (docs/distributed.md, "Several nodes"): node N > 0 has its own config, lock, log and
    environment file; node 0, a one-node run and any other execution the usual ones."""
    nodes = ["tpu_topology=cpu_dist2", "tpu_topology.hosts=2", "tpu_topology.chips_per_host=1",
             "distributed.rdzv_endpoint=127.0.0.1:29500"]
    one = cfg(*nodes, "distributed.node_rank=1")
    assert envmod.node_suffix(one) == "-node1"
    assert envmod.child_environment(one, tmp_path, {})[envmod.CONFIG_FILE_VARIABLE] == "config-node1.yaml"
    for c in (cfg(*nodes, "distributed.node_rank=0"), cfg("tpu_topology=cpu_dist2"), cfg()):
        assert envmod.node_suffix(c) == ""
        assert envmod.child_environment(c, tmp_path, {})[envmod.CONFIG_FILE_VARIABLE] == "config.yaml"
    from ddpo_tpu.proc.lock import RunDirLock

    with RunDirLock(tmp_path), RunDirLock(tmp_path, suffix="-node1"):  # two nodes, two locks, neither refused
        assert {p.name for p in tmp_path.iterdir()} >= {"lock", "lock-node1"}
