"""Helpers the tests import (`from tests.helpers import ...`; pyproject's pytest `pythonpath` puts the repo root on
sys.path). The training process is always started the real way (python -m ddpo_tpu.train), with an environment free
of the variables ddpo_tpu owns; torch_xla is never initialised in the pytest process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# For end-to-end runs on torch_xla's PJRT CPU device: most of their first epoch is LLVM optimising the compiled graphs
# for the host CPU. What the tests assert (graph and transfer counts, results against eager PyTorch or one device)
# does not depend on that, and TPUs compile with another backend. Measured on 2 cores: a 3-epoch tiny-model XLA run
# 260 s -> 112 s, the sd14_topology run 410 s -> 214 s.
FAST_XLA_FLAGS = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true")
FAST_XLA_CPU = "xla.flags=[" + ",".join(f'"{f}"' for f in FAST_XLA_FLAGS) + "]"


def clean_env(**extra: str) -> dict[str, str]:
    """os.environ without the variables ddpo_tpu owns (and HYDRA_FULL_ERROR), the repo on PYTHONPATH, plus extra.
    Under pytest-xdist with several workers, torch in the processes the tests start computes with one intra-op
    thread (OMP_NUM_THREADS=1, unless extra says otherwise): two workers' runs each spinning two OpenMP threads on 2
    cores collapse (tests/conftest.py's _one_torch_thread_in_pytest measured it), and the tiny models gain nothing
    from a second thread."""
    from ddpo_tpu.env import OWNED_VARIABLES

    env = {k: v for k, v in os.environ.items() if k not in OWNED_VARIABLES and k != "HYDRA_FULL_ERROR"}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
        env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def timed_run(cmd: list[str], **kwargs) -> tuple[subprocess.CompletedProcess, float, float]:
    """subprocess.run(cmd, capture_output=True, text=True, **kwargs), with its wall seconds and the CPU seconds the
    process (and what it waited for) used. Tests that a command answers quickly (a refusal before torch is imported)
    assert on the CPU seconds: on a quiet machine they are its wall time, and a busy machine (other tests on the
    other pytest-xdist worker, other people) stretches the wall time but not them."""
    import resource

    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    wall, after = time.monotonic() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return proc, wall, cpu


HEAVY = ("torch", "torch_xla", "diffusers", "transformers", "peft", "safetensors")


def heavy_imports(proc) -> set[str]:
    """The heavy packages the front end imported, from -X importtime's "import time: self | cumulative | name" lines
    (exact, whatever the machine's load; what CPU-second bounds approximated)."""
    names = {ln.rsplit("|", 1)[1].strip().split(".")[0] for ln in proc.stderr.splitlines()
             if ln.startswith("import time:") and ln.count("|") == 2}
    assert "ddpo_tpu" in names, "no -X importtime lines: was the front end run by front_end()?"
    return names & set(HEAVY)


def front_end_in_process(tmp: Path, args: list[str], monkeypatch, capsys, heavy: tuple[str, ...] = HEAVY,
                         **env: str):
    """The front end's `main(argv)` in this process, run as `python -m ddpo_tpu.train` would be in tmp/cwd with
    clean_env(): (a process-like result: returncode, stdout, stderr; error lines; CPU seconds; the heavy packages it
    newly imported).
    A refusal is decided before Hydra's own main() runs, so nothing a subprocess adds matters to these cases but the
    process's start (~0.8 CPU s of imports each). Keep one real process per path a test covers (what proves the
    exit code and the console); heavy: the packages counted as heavy imports;
    env: variables set for the call. A refusal or a --check only: a command
    that passes them would start its run in this process."""
    from ddpo_tpu import train
    from types import SimpleNamespace
    from ddpo_tpu.env import OWNED_VARIABLES

    cwd = tmp / "cwd"
    cwd.mkdir(exist_ok=True)
    monkeypatch.chdir(cwd)
    for k in (*OWNED_VARIABLES, "HYDRA_FULL_ERROR"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():  # clean_env(**env)'s extra
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(sys, "argv", [train.__file__])
    capsys.readouterr()
    before, start = set(sys.modules), time.process_time()
    try:
        train.main(list(args))
        code = 0
    except SystemExit as e:
        code = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
    cpu = time.process_time() - start
    new = {m.split(".")[0] for m in set(sys.modules) - before}
    out = capsys.readouterr()
    proc = SimpleNamespace(returncode=code, stdout=out.out, stderr=out.err)
    return proc, [ln for ln in out.err.splitlines() if ln.startswith("error: ")], cpu, new & set(heavy)


def run_train(args: list[str], cwd: Path, timeout: float = 600, **env: str) -> subprocess.CompletedProcess:
    """`python -m ddpo_tpu.train *args` in cwd, to completion, output captured."""
    return subprocess.run([sys.executable, "-m", "ddpo_tpu.train", *args], cwd=cwd, env=clean_env(**env),
                          capture_output=True, text=True, timeout=timeout)


def read_metrics(run_dir: Path, kind: str) -> list[dict]:
    """The records of one kind ("epoch", "step", "event", "eval") of a run dir's metrics.jsonl, in order."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("kind") == kind]


def wait_for_event(run_dir: Path, kind: str, proc: subprocess.Popen, timeout: float = 600, **fields) -> dict:
    """The last event of `kind` (with these field values) in a running run's events.jsonl, waiting for it: tests act
    on a run's events, never on its console lines. Fails if the run ends first or none comes within `timeout` s."""
    from ddpo_tpu.rundir import events as ev

    end = time.monotonic() + timeout
    while True:
        found = [r for r in ev.read_events(run_dir)
                 if r["event"] == kind and all(r.get(k) == v for k, v in fields.items())]
        if found:
            return found[-1]
        assert proc.poll() is None, f"the run ended ({proc.returncode}) before a {kind} event {fields or ''}"
        assert time.monotonic() < end, f"no {kind} event {fields or ''} within {timeout} s"
        time.sleep(0.2)


_BASES: dict[tuple[str, tuple[str, ...]], object] = {}
_HYDRA_COMPOSE: list = []  # ddpo_tpu.config.compose.compose as the package defines it (share_compositions keeps it)


def hydra_compose(overrides: list[str]):
    """ddpo_tpu.config.compose.compose itself: Hydra's whole composition, whatever share_compositions installed."""
    import ddpo_tpu.config.compose as module

    return (_HYDRA_COMPOSE[0] if _HYDRA_COMPOSE else module.compose)(overrides)


def _is_choice(override: str, groups: set[str]) -> bool:
    """A config group choice (`model=sd14`, `+experiment=smoke`, `~logger`, `reward_local/x=y`): what Hydra's
    defaults list reads; a dotted key (`model.lora.rank=8`) is a value."""
    head = override.split("=", 1)[0].lstrip("+~").split("@", 1)[0]
    return "." not in head and head.split("/", 1)[0] in groups


def shared_compose(overrides: list[str]):
    """compose(overrides), its composition shared: the group choices (`model=sd14`, `+experiment=smoke`: what Hydra's
    defaults list reads) are composed by Hydra once per test process and conf/, and the value overrides (`a.b=v`,
    `resume=x`) applied to a copy of that with Hydra's own parser and the step Hydra's compose ends with
    (ConfigLoaderImpl._apply_overrides_to_config, after the defaults are merged: the same config), an error of theirs
    becoming the ConfigError compose() makes of it. Hydra's own node (`hydra.*`), a sweep (`a=1,2`, which compose
    refuses outside -m) and a grammar error go to Hydra's compose whole. ~0.02 CPU-s against ~0.25 for a composition
    (measured 2026-11-29); test_config.py's test_shared_composition_is_hydras holds the two equal."""
    import copy

    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from ddpo_tpu.config.compose import ConfigError, _compose_problem, conf_dir, moved

    overrides = moved(overrides)
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception:  # the grammar problem, worded by compose
        return hydra_compose(overrides)
    if any(o.key_or_group.startswith("hydra") or o.is_sweep_override() for o in parsed):
        return hydra_compose(overrides)
    root = conf_dir()
    groups = {p.name for p in root.iterdir() if p.is_dir()}
    choice = [_is_choice(o, groups) for o in overrides]
    choices = tuple(o for o, c in zip(overrides, choice) if c)
    values = [p for p, c in zip(parsed, choice) if not c]
    key = (str(root), choices)
    if key not in _BASES:
        _BASES[key] = hydra_compose(list(choices))
    cfg = copy.deepcopy(_BASES[key])
    try:
        ConfigLoaderImpl._apply_overrides_to_config(values, cfg)
    except Exception as e:  # what compose() turns into one problem line
        raise ConfigError([_compose_problem(e, overrides)]) from e
    return cfg


def compose_and_validate_shared(overrides: list[str]):
    """compose_and_validate(overrides) through shared_compose (whether or not share_compositions is on)."""
    from ddpo_tpu.config.compose import overridden_keys, validate

    return validate(shared_compose(overrides), overridden_keys(overrides))


def share_compositions() -> None:
    """Every composition made in this test process goes through shared_compose: the front end's main(argv) run
    in-process, compose_and_validate, the sweep's points (tests/conftest.py, pytest_configure). The processes the
    tests start compose with Hydra whole, as does a test marked `hydra_compose` (the tests of composition itself)."""
    import ddpo_tpu.config.compose as module

    if not _HYDRA_COMPOSE:
        _HYDRA_COMPOSE.append(module.compose)
    module.compose = shared_compose


__all__ = ["FAST_XLA_CPU", "FAST_XLA_FLAGS", "HEAVY", "REPO", "clean_env", "compose_and_validate_shared",
           "hydra_compose", "share_compositions", "shared_compose",
           "front_end_in_process", "heavy_imports", "read_metrics", "run_train", "timed_run", "wait_for_event"]


def run_in_pty(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float = 600,
               columns: int = 120) -> tuple[int, str]:
    """Run cmd with its stdout and stderr on a pseudo-terminal (what a person's terminal gives it); returns its exit
    code and everything it wrote, escape sequences included."""
    import fcntl
    import pty
    import select
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave,
                            close_fds=True)
    os.close(slave)
    out, end = bytearray(), time.monotonic() + timeout
    try:
        while True:
            ready, _, _ = select.select([master], [], [], 0.2)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:  # EIO: every writer of the terminal is gone
                    data = b""
                if not data:
                    break
                out += data
            elif proc.poll() is not None and not select.select([master], [], [], 0.5)[0]:
                break
            assert time.monotonic() < end, f"{cmd} did not end within {timeout} s"
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
    return proc.wait(), out.decode(errors="replace")


def family_with_trained_adapter(overrides: list[str]):
    """The model family of a composed config, loaded on eager CPU, its LoRA adapter moved off its start (peft's
    gaussian init leaves lora_B at zero, where the adapter is invisible): for parity tests of step and KL."""
    import torch

    from ddpo_tpu.config.compose import compose_and_validate
    from ddpo_tpu.families import load_family
    from ddpo_tpu.runtime import make_runtime

    v = compose_and_validate(overrides)
    torch.manual_seed(0)
    fam = load_family(v.cfg, make_runtime(v.cfg))
    with torch.no_grad():
        for name, p in fam.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    return fam


def block_layers(model, family_name: str) -> set[str]:
    """The paths of a denoiser's adaptable layers (what peft adds LoRA to: Linear, Conv, Embedding) below its
    numbered block containers: what the family's catalog lora_layers must list. Asserts each full path is a known
    target of the family (launch/lora_targets.py)."""
    import torch

    from ddpo_tpu.launch import lora_targets

    adaptable = (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d, torch.nn.Embedding)
    out = set()
    for name, module in model.named_modules():
        if isinstance(module, adaptable):
            assert lora_targets.is_known(name, family_name), name
            parts, cut = name.split("."), 0
            for i, p in enumerate(parts):
                if p in lora_targets.CONTAINERS:
                    cut = i + 1 + (i + 1 < len(parts) and parts[i + 1].isdigit())
            out.add(".".join(parts[cut:]))
    return out
