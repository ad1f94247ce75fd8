"""ddpo-pod (ddpo_tpu.launch.pod): one training command on every worker of a TPU VM slice.

No network and no gcloud: the CLI runs with --dry-run (or with a fake `gcloud` first on PATH that records being
called), the run path with subprocess.run monkeypatched, and the remote shell commands are executed here with bash in
a temporary WORKDIR whose `ddpo_tpu.train` is a stand-in (a few lines of Python that record their argv and write a
run dir's events the way the training process does; the rest of ddpo_tpu, ddpo_tpu.status included, is the real
one), so quoting, --detach, --status and --stop are checked by running them, not by reading them."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ddpo_tpu.launch import pod as lp
from ddpo_tpu.env import OWNED_VARIABLES
from tests.helpers import REPO, clean_env

pytestmark = pytest.mark.torch_free  # no torch in the test or what it starts (tests/conftest.py)

TIMEOUT = 60

V6E_16 = ["+experiment=compressibility_parity", "tpu_topology=v6e-16", "sample.num_batches_per_epoch=4",
          "train.gradient_accumulation_steps=2"]
V4_64 = ["+experiment=compressibility_parity", "tpu_topology=v4-64", "sample.num_batches_per_epoch=2",
         "train.gradient_accumulation_steps=1"]
V6E_8 = ["+experiment=compressibility_parity"]  # the experiment's own topology
# overrides that a careless join would break: spaces, both quote kinds, $, ;, globs, a command substitution
TRICKY = ['run_name="my run"', "prompts.file=it's here.txt", 'xla.flags=["--xla_a=1", "--xla_b=x y"]',
          "output_root=$HOME/out;rm -rf ~", "run_name=$(touch pwned)", "model.pretrained=/data/*", "seed=7"]


def cli(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ddpo_tpu.launch.pod", *args], env=env or clean_env(),
                          cwd=cwd or REPO, capture_output=True, text=True, timeout=TIMEOUT)


def pod(capsys, *args: str) -> subprocess.CompletedProcess:
    """The CLI in this process (its config composition is the costly part of a subprocess)."""
    code = lp.main(list(args))
    out = capsys.readouterr()
    return subprocess.CompletedProcess(["ddpo-pod", *args], code, out.out, out.err)


def gcloud_lines(stdout: str) -> list[list[str]]:
    return [shlex.split(line) for line in stdout.splitlines() if line.startswith("gcloud ")]


def remote_of(argv: list[str]) -> str:
    return argv[argv.index("--command") + 1]


def check_argv(remote: str) -> list[str]:
    """What the workers' check passes to `python -m ddpo_tpu.train --check-here` (this worker must be the run's)."""
    words = shlex.split(remote)
    i = words.index("--check-here")
    assert words[i - 2:i] == ["-m", "ddpo_tpu.train"]
    return words[i + 1:words.index("2>&1", i)].copy() if "2>&1" in words else words[i + 1:]


def train_argv(remote: str) -> list[str]:
    """What the remote shell passes to `python -m ddpo_tpu.train` (a foreground command ends with it)."""
    words = shlex.split(remote)
    i = max(i for i in range(len(words) - 1) if words[i:i + 2] == ["-m", "ddpo_tpu.train"])
    return words[i + 2:]


def args_for(*extra: str, overrides: list[str] = ()):
    return lp.parse_args(["--tpu", "pod", "--zone", "europe-west4-a", *extra, "--", *overrides])


# --- the dry run through the CLI -------------------------------------------------------------------------------------

def test_dry_run_v6e_16_runs_on_all_workers():
    proc = cli("--tpu", "my-v6e-16", "--zone", "europe-west4-a", "--dry-run", "--", *V6E_16)
    assert proc.returncode == 0, proc.stderr
    lines = gcloud_lines(proc.stdout)
    assert len(lines) == 2 and len(proc.stdout.strip().splitlines()) == 2  # stdout is exactly the commands
    check, argv = lines  # the workers' check first, then the start, on the same workers
    for cmd in lines:
        assert cmd[:8] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "my-v6e-16", "--zone", "europe-west4-a"]
        assert "--worker=all" in cmd and "--project" not in cmd
    assert check_argv(remote_of(check)) == V6E_16
    assert "expecting 4 processes (one per worker)" in proc.stderr
    remote = remote_of(argv)
    assert remote.startswith("cd ~/ddpo_tpu ")
    assert train_argv(remote) == V6E_16
    assert "exec .venv/bin/python -m ddpo_tpu.train " in remote


def test_dry_run_v4_64_expects_8_processes_and_passes_the_project(capsys):
    proc = pod(capsys, "--tpu", "big", "--zone", "us-central2-b", "--project", "my-proj", "--dry-run", "--", *V4_64)
    assert proc.returncode == 0, proc.stderr
    _, argv = gcloud_lines(proc.stdout)
    assert "--worker=all" in argv and "expecting 8 processes" in proc.stderr
    assert argv[argv.index("--project") + 1] == "my-proj"
    assert train_argv(remote_of(argv)) == V4_64


def test_dry_run_single_host_targets_worker_0(capsys):
    proc = pod(capsys, "--tpu", "v8", "--zone", "europe-west4-a", "--dry-run", "--", *V6E_8)
    assert proc.returncode == 0, proc.stderr
    for argv in gcloud_lines(proc.stdout):  # the check and the start
        assert "--worker=0" in argv and "--worker=all" not in argv
    assert "v6e-8 is single-host" in proc.stderr and "--worker=0 only" in proc.stderr
    assert "expecting" not in proc.stderr


def test_dry_run_workdir_and_venv(capsys):
    proc = pod(capsys, "--tpu", "p", "--zone", "z", "--workdir", "/srv/ddpo tpu", "--venv", "/opt/venv", "--dry-run",
               "--", *V6E_16)
    assert proc.returncode == 0, proc.stderr
    words = shlex.split(remote_of(gcloud_lines(proc.stdout)[-1]))
    assert words[:2] == ["cd", "/srv/ddpo tpu"]
    assert "/opt/venv/bin/python" in words


def test_overrides_with_spaces_survive_the_cli(capsys):
    tricky = V6E_16 + ['xla.flags=["--xla_a=1", "--xla_b=2"]', 'model.cache_dir="/data/it\'s my cache"',
                       'xla.compilation_cache_dir="$HOME/x c"']
    proc = pod(capsys, "--tpu", "p", "--zone", "z", "--dry-run", "--", *tricky)
    assert proc.returncode == 0, proc.stderr
    assert train_argv(remote_of(gcloud_lines(proc.stdout)[-1])) == tricky


def test_invalid_config_exits_2_and_names_the_key(tmp_path):
    # not a dry run, with a recording `gcloud` first on PATH: it must never be called
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "gcloud").write_text(f"#!/bin/sh\ntouch {tmp_path / 'gcloud_was_called'}\n")
    (fake / "gcloud").chmod(0o755)
    env = clean_env(PATH=f"{fake}{os.pathsep}{os.environ['PATH']}")
    proc = cli("--tpu", "p", "--zone", "z", "--", "+experiment=compressibility_parity", "sample.batch_size=3", env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "error: sample.batch_size=3" in proc.stderr and "try sample.batch_size=4" in proc.stderr
    assert "nothing was run" in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stdout == "" and not (tmp_path / "gcloud_was_called").exists()


@pytest.mark.parametrize("overrides,message", [
    (["PJRT_DEVICE=TPU"], "PJRT_DEVICE"),                      # an owned variable is not an override either
    (["tpu_topology=v6e-16", "--cfg", "job"], "--cfg"),        # Hydra flags other than -m make no sense here
    ([], "no training overrides"),
    (["-m", "tpu_topology=v6e-8,v6e-16"], "different host counts"),
])
def test_refused_arguments_exit_2(capsys, overrides, message):
    proc = pod(capsys, "--tpu", "p", "--zone", "z", "--dry-run", "--", *overrides)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr and proc.stdout == "" and "Traceback" not in proc.stderr


def test_multirun_is_validated_per_point_and_passed_on(capsys):
    proc = pod(capsys, "--tpu", "p", "--zone", "z", "--dry-run", "--", "-m", *V6E_16, "seed=1,2",
               "train.clip_range=0.0001,-1")
    assert proc.returncode == 2 and "[job 1:" in proc.stderr and "[job 0:" not in proc.stderr
    proc = pod(capsys, "--tpu", "p", "--zone", "z", "--dry-run", "--", "-m", *V6E_16, "seed=1,2")
    assert proc.returncode == 0, proc.stderr
    assert train_argv(remote_of(gcloud_lines(proc.stdout)[-1])) == ["-m", *V6E_16, "seed=1,2"]


def test_stop_and_status_dry_run_target_all_workers(capsys):
    for action, needle in (("--stop", "kill -TERM"), ("--status", "-m ddpo_tpu.status --brief --events 5")):
        proc = pod(capsys, "--tpu", "p", "--zone", "z", "--dry-run", action)
        assert proc.returncode == 0, proc.stderr
        (argv,) = gcloud_lines(proc.stdout)
        assert "--worker=all" in argv and needle in remote_of(argv)
        assert "ddpo_tpu.train " not in remote_of(argv).replace("-m ddpo_tpu[.]train", "")  # nothing is started


# --- the pure functions ----------------------------------------------------------------------------------------------

def test_build_remote_command_quotes_every_override():
    remote = lp.build_remote_command(TRICKY, "~/ddpo_tpu", ".venv", detach=False)
    assert train_argv(remote) == TRICKY
    # and once more through gcloud's argv as a shell would see the printed line
    check, argv = lp.build_gcloud_commands(args_for(overrides=TRICKY), hosts=4)
    assert train_argv(remote_of(shlex.split(shlex.join(argv)))) == TRICKY
    assert check_argv(remote_of(shlex.split(shlex.join(check)))) == TRICKY


def test_detach_wraps_in_nohup_setsid_with_a_log_per_worker():
    remote = lp.build_remote_command(V6E_16, "~/ddpo_tpu", ".venv", detach=True)
    words = shlex.split(remote)
    i = words.index("nohup")
    assert words[i + 1:i + 5] == ["setsid", ".venv/bin/python", "-m", "ddpo_tpu.train"]
    assert words[i + 5:i + 5 + len(V6E_16)] == V6E_16
    assert 'log="logs/ddpo-pod-$(hostname).log"' in remote  # one log per worker: each has its own hostname
    assert '>>"$log" 2>&1 </dev/null &' in remote
    _, argv = lp.build_gcloud_commands(args_for("--detach", overrides=V6E_16), hosts=4)
    assert remote_of(argv) == remote


def test_stop_and_status_commands():
    stop = lp.build_stop_command("~/ddpo_tpu")
    assert "kill -TERM" in stop and shlex.quote(lp.FRONT_END_PATTERN) in stop and "ddpo_tpu.train " not in stop
    status = lp.build_status_command("~/ddpo_tpu", "outputs", lines=7)
    assert ".venv/bin/python -m ddpo_tpu.status --brief --events 7" in status and "ps -ww -o pid,etime,args" in status
    assert "grep -F" not in status and "[epoch" not in status  # the state comes from events, not log lines
    (argv,) = lp.build_gcloud_commands(args_for("--stop"), hosts=None)
    assert remote_of(argv) == stop and "--worker=all" in argv
    (argv,) = lp.build_gcloud_commands(args_for("--status", "--lines", "7"), hosts=None)
    assert remote_of(argv) == status
    # the process patterns match a launched front end and its training process, never the remote shell
    shell = "bash -c cd ~/ddpo_tpu || exit 1; exec .venv/bin/python -m ddpo_tpu.train +experiment=smoke"
    assert re.search(lp.FRONT_END_PATTERN, ".venv/bin/python -m ddpo_tpu.train +experiment=smoke")
    assert re.search(lp.TRAINING_PATTERN, "/home/u/ddpo_tpu/.venv/bin/python3.12 -m ddpo_tpu.worker")
    assert not re.search(lp.FRONT_END_PATTERN, "/home/u/ddpo_tpu/.venv/bin/python -m ddpo_tpu.worker")
    assert not re.search(lp.TRAINING_PATTERN, shell) and not re.search(lp.TRAINING_PATTERN, "vim ddpo_tpu/train.py")


@pytest.mark.parametrize("action", [(), ("--detach",), ("--status",), ("--stop",)])
def test_no_owned_variable_in_any_command(action):
    for argv in lp.build_gcloud_commands(args_for(*action, overrides=V6E_16 + TRICKY), hosts=4):
        text = " ".join(argv)
        for name in OWNED_VARIABLES:
            assert name not in text, name
        assert not re.search(r"(^|[\s;&|])export\s", remote_of(argv))
    with pytest.raises(RuntimeError, match="PJRT_DEVICE"):
        lp.check_no_owned_variables("export PJRT_DEVICE=TPU; cd x")
    with pytest.raises(RuntimeError, match="XLA_FLAGS"):
        lp.check_no_owned_variables("cd x && XLA_FLAGS=--xla_foo python -m ddpo_tpu.train")


def test_worker_flag():
    assert lp.worker_flag(1) == "--worker=0"
    assert lp.worker_flag(4) == lp.worker_flag(8) == lp.worker_flag(None) == "--worker=all"


# --- the run path (subprocess.run recorded, no gcloud) ---------------------------------------------------------------

class FakeRun:
    def __init__(self, codes: list[int]):
        self.codes = list(codes)
        self.calls: list[list[str]] = []

    def __call__(self, cmd, *a, **kw):
        self.calls.append(list(cmd))
        return subprocess.CompletedProcess(cmd, self.codes.pop(0))


@pytest.fixture
def fake_run(monkeypatch):
    sleeps: list[float] = []
    monkeypatch.setattr(lp, "_sleep", sleeps.append)

    def install(codes):
        fake = FakeRun(codes)
        monkeypatch.setattr(lp.subprocess, "run", fake)
        fake.sleeps = sleeps
        return fake
    return install


def test_run_retries_ssh_failure(fake_run):
    fake = fake_run([0, 255, 0])  # the check passes, the start's SSH fails once
    code = lp.main(["--tpu", "my-v6e-16", "--zone", "europe-west4-a", "--", *V6E_16])
    assert code == 0
    assert len(fake.calls) == 3 and fake.calls[1] == fake.calls[2]
    assert check_argv(remote_of(fake.calls[0])) == V6E_16
    assert fake.calls[1][:6] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "my-v6e-16"]
    assert "--worker=all" in fake.calls[1] and train_argv(remote_of(fake.calls[1])) == V6E_16
    assert fake.sleeps == [5.0]


def test_run_gives_up_after_3_retries_with_backoff(fake_run):
    fake = fake_run([255] * 10)
    assert lp.main(["--tpu", "p", "--zone", "z", "--detach", "--", *V6E_16]) == 255
    assert len(fake.calls) == 4 and fake.sleeps == [5.0, 10.0, 20.0]  # the check's SSH: nothing else was tried


def test_run_does_not_retry_other_failures(fake_run):
    fake = fake_run([0, 75])  # the remote command's own exit code (here: stopped after a checkpoint) is passed on
    assert lp.main(["--tpu", "p", "--zone", "z", "--", *V6E_16]) == 75
    assert len(fake.calls) == 2 and fake.sleeps == []


def test_a_workers_refusal_starts_nothing(fake_run, capsys):
    fake = fake_run([2])  # one worker's check exits 2 (say its /data/sd14 is missing): gcloud passes that on
    assert lp.main(["--tpu", "p", "--zone", "z", "--detach", "--", *V6E_16, "model.pretrained=/data/sd14"]) == 2
    assert len(fake.calls) == 1 and check_argv(remote_of(fake.calls[0]))[-1] == "model.pretrained=/data/sd14"
    err = capsys.readouterr().err
    assert "model.pretrained=/data/sd14: not on this machine; the workers' check looks for it" in err
    assert "a worker's check refused the run (exit 2" in err and "nothing was started" in err


def test_run_does_not_rerun_a_foreground_run_that_had_started(fake_run, monkeypatch):
    fake = fake_run([0, 255, 0])
    clock = iter([0.0, 0.0, 3600.0, 3600.0, 3600.0])  # the check (0 s), then the start, dropped after an hour
    monkeypatch.setattr(lp, "_clock", lambda: next(clock))
    assert lp.main(["--tpu", "p", "--zone", "z", "--", *V6E_16]) == 255
    assert len(fake.calls) == 2


def test_dry_run_runs_nothing(fake_run):
    fake = fake_run([])
    assert lp.main(["--tpu", "p", "--zone", "z", "--dry-run", "--", *V6E_16]) == 0
    assert fake.calls == []


# --- the remote commands, executed here with bash against a stand-in ddpo_tpu.train ----------------------------------

FAKE_TRAIN = textwrap.dedent("""
    import json, os, signal, sys, time
    from pathlib import Path
    # a stand-in for the front end: records its argv and pid, prints a line, writes a run dir's events the way the
    # training process does (holding its lock), and on SIGTERM records a preemption and exits 75
    from ddpo_tpu.rundir import events as ev  # the real modules, through the stand-in package's __path__
    from ddpo_tpu.proc.lock import RunDirLock

    json.dump(sys.argv[1:], open("argv.json", "w"))
    run = Path("outputs/run")
    run.mkdir(parents=True, exist_ok=True)
    (run / "config.yaml").write_text("run_name: run\\nnum_epochs: 3\\n")
    lock = RunDirLock(run).acquire()
    log = ev.EventLog(run)
    log.emit(ev.WorkerStarted(os.getpid()))
    log.emit(ev.RunStart("stand-in", 3, 0, 8, 2, 8, "LoRA", False))
    log.emit(ev.PhaseStart(0, "sampling"))
    log.emit(ev.SamplingBatch(0, 1, 2))

    def stop(*_):
        open("sigterm", "w").close()
        log.emit(ev.Preempted(-1, 0, "SIGTERM before the first checkpoint"))
        log.emit(ev.WorkerExited(75))
        sys.exit(75)

    signal.signal(signal.SIGTERM, stop)
    open("train.pid", "w").write(str(os.getpid()))
    if os.environ.get("FAKE_WAIT"):
        time.sleep(float(os.environ["FAKE_WAIT"]))
""")


# how long a detached stand-in runs unless stopped: longer than the test can take on a busy machine (each step starts
# a Python process or two), so it is still running where the test says so; the workdir fixture kills it after the test
STAND_IN_S = "600"


def worker_dir(tmp_path: Path) -> Path:
    """WORKDIR on a worker: .venv/bin/python (this Python, with its packages) and a ddpo_tpu package that `-m` finds
    first (cwd) whose modules are this checkout's."""
    wd = tmp_path / "work dir"  # a space, so the cd is quoted
    (wd / ".venv" / "bin").mkdir(parents=True)
    python = wd / ".venv" / "bin" / "python"
    python.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} \"$@\"\n")
    python.chmod(0o755)
    (wd / "ddpo_tpu").mkdir()
    (wd / "ddpo_tpu" / "__init__.py").write_text(f"__path__.append({str(REPO / 'ddpo_tpu')!r})\n")
    return wd


@pytest.fixture
def workdir(tmp_path):
    """A worker's WORKDIR whose train module is the stand-in (the other modules are the real ones)."""
    wd = worker_dir(tmp_path)
    (wd / "ddpo_tpu" / "train.py").write_text(FAKE_TRAIN)
    yield wd
    pid_file = wd / "train.pid"
    if pid_file.exists():  # never leave the stand-in running: by its own pid, and only while it is still ours
        pid = int(pid_file.read_text())
        try:
            if alive(pid) and os.readlink(f"/proc/{pid}/cwd") == str(wd):
                os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, FileNotFoundError, PermissionError):
            pass


def alive(pid: int) -> bool:
    """Running (not gone, not a zombie waiting for a reaper)."""
    try:
        return "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False


def bash(command: str, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in clean_env(**env).items() if k != "PYTHONPATH"}
    return subprocess.run(["bash", "-c", command], env=environ, capture_output=True, text=True, timeout=TIMEOUT,
                          cwd="/")


def wait_for(path: Path, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < end, f"{path} did not appear"
        time.sleep(0.05)


def test_foreground_command_runs_train_with_the_exact_overrides(workdir):
    proc = bash(lp.build_remote_command(TRICKY, str(workdir), ".venv", detach=False))
    assert proc.returncode == 0, proc.stderr
    assert json.loads((workdir / "argv.json").read_text()) == TRICKY
    assert "[epoch 0]" in proc.stdout
    assert not (Path("/") / "pwned").exists() and not (workdir / "pwned").exists()


def test_detach_status_guard_and_stop_on_a_worker(workdir):
    host = socket.gethostname()
    # start detached: the command returns at once, the stand-in keeps running, its output goes to the worker's log
    start = lp.build_remote_command(V6E_16, str(workdir), ".venv", detach=True)
    proc = bash(start, FAKE_WAIT=STAND_IN_S)
    assert proc.returncode == 0, proc.stderr
    assert f"{host}: started ddpo_tpu.train (pid " in proc.stdout
    wait_for(workdir / "train.pid")
    pid = int((workdir / "train.pid").read_text())
    assert json.loads((workdir / "argv.json").read_text()) == V6E_16
    assert os.getsid(pid) == pid  # setsid: its own session, no controlling terminal to hang up
    log = workdir / "logs" / f"ddpo-pod-{host}.log"
    end = time.monotonic() + 20
    while "[epoch 0] sampling batch 1/2 done" not in (log.read_text() if log.exists() else ""):
        assert time.monotonic() < end, "the events' text is not in the detached log"
        time.sleep(0.05)

    # status: the process (found by command line and working directory) and the run's state from its events,
    # host-prefixed
    status = bash(lp.build_status_command(str(workdir), "outputs", lines=2))
    assert status.returncode == 0, status.stderr
    assert re.search(rf"^{re.escape(host)}: +{pid} .*python -m ddpo_tpu\.train \+experiment", status.stdout,
                     re.M), status.stdout
    assert (f"{host}: run: running; 0/3 epochs done; epoch 0 (#1 of 3); sampling batch 2/2 (1/2 done); "
            "last event") in status.stdout, status.stdout
    assert f"{host}:   [epoch 0] sampling start\n{host}:   [epoch 0] sampling batch 1/2 done\n" in status.stdout

    # a second start on the same worker is refused while it runs (a retried SSH never starts a second copy)
    again = bash(start, FAKE_WAIT=STAND_IN_S)
    assert again.returncode == lp.ALREADY_RUNNING and "already running" in again.stderr

    # stop: SIGTERM to it, which exits 75 after "checkpointing"
    stop = bash(lp.build_stop_command(str(workdir)))
    assert stop.returncode == 0, stop.stderr
    assert f"{host}: sent SIGTERM to {pid}" in stop.stdout
    wait_for(workdir / "sigterm")
    end = time.monotonic() + 20
    while alive(pid):
        assert time.monotonic() < end, "the stand-in did not exit on SIGTERM"
        time.sleep(0.05)
    status = bash(lp.build_status_command(str(workdir), "outputs"))
    assert f"{host}: no training process in" in status.stdout
    assert f"{host}: run: stopped (preempted); 0/3 epochs done" in status.stdout, status.stdout
    stop = bash(lp.build_stop_command(str(workdir)))
    assert stop.returncode == 0 and "no training process" in stop.stdout


def test_status_and_stop_ignore_training_in_other_directories(workdir, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    empty = bash(lp.build_status_command(str(other), "outputs")).stdout
    assert "no training process" in empty and "no run dir with events.jsonl under outputs yet" in empty
    proc = bash(lp.build_remote_command(["seed=1"], str(workdir), ".venv", detach=True), FAKE_WAIT=STAND_IN_S)
    assert proc.returncode == 0, proc.stderr
    wait_for(workdir / "train.pid")
    assert "no training process" in bash(lp.build_stop_command(str(other))).stdout
    pid = int((workdir / "train.pid").read_text())
    assert alive(pid) and not (workdir / "sigterm").exists()


def test_the_validation_is_the_front_ends(monkeypatch):
    """The pod launcher validates with the front end's compose_points (ddpo_tpu.launch.sweep): the same problems, the
    same lines, except the paths only the workers can judge."""
    from ddpo_tpu.launch import sweep

    seen = []
    real = sweep.compose_points
    monkeypatch.setattr(sweep, "compose_points", lambda o, m, **kw: seen.append((o, m, kw)) or real(o, m, **kw))
    topo, root, worker_paths = lp.validated_topology(V6E_16, False)
    assert seen == [(V6E_16, False, {"defer_paths": True})]
    assert (topo.name, topo.hosts, root, worker_paths) == ("v6e-16", 4, "outputs", [])
    with pytest.raises(lp.Refused) as e:
        lp.validated_topology(["seed=[1,2"], False)  # a Hydra grammar error, named like any other problem
    assert len(e.value.lines) == 1 and e.value.lines[0].startswith("seed=[1,2: not a valid override")


WORKER_PATHS = ["model.pretrained=/nowhere/sd14", "resume=/nowhere/ckpt", "xla.compilation_cache_dir=/dev/null/c",
                "parity=none", "prompts=from_file", "prompts.file=/nowhere/prompts.txt"]


def test_worker_side_paths_are_left_to_the_workers(capsys):
    proc = pod(capsys, "--tpu", "p", "--zone", "z", "--dry-run", "--", *V6E_16, *WORKER_PATHS)
    assert proc.returncode == 0, proc.stderr
    for kv in ("model.pretrained=/nowhere/sd14", "resume=/nowhere/ckpt", "prompts.file=/nowhere/prompts.txt",
               "xla.compilation_cache_dir=/dev/null/c"):
        assert f"{kv}: not on this machine; the workers' check looks for it before anything starts" in proc.stderr
    check, start = gcloud_lines(proc.stdout)
    assert check_argv(remote_of(check)) == train_argv(remote_of(start)) == V6E_16 + WORKER_PATHS
    # what this machine can judge is still refused here, and only that: not the paths beside it
    proc = pod(capsys, "--tpu", "p", "--zone", "z", "--dry-run", "--", *V6E_16, *WORKER_PATHS, "sample.batch_size=3")
    assert proc.returncode == 2 and "error: sample.batch_size=3" in proc.stderr
    assert "/nowhere" not in proc.stderr and proc.stdout == ""
    # an empty value is no path: refused anywhere
    proc = pod(capsys, "--tpu", "p", "--zone", "z", "--dry-run", "--", *V6E_16, "parity=none", "prompts=from_file",
               "prompts.file=")
    assert proc.returncode == 2 and "error: prompts.file=: prompts=from_file needs a file" in proc.stderr


def test_gardo_s_gate_reward_and_the_compile_cache_are_the_workers_paths(capsys):
    """Issue 43: GARDO's gate reward's MLP (algorithm.kl_gate_rewards.N.mlp_path) was judged on the laptop ("file not
    found", exit 2) while prompts.file beside it was left to the workers; the same for distributed.compile_cache_dir.
    A bucket URL is no path on any machine: refused here."""
    gardo = ["+experiment=gardo_sd3_ocr", "prompts.path=/nowhere/ocr",
             "algorithm.kl_gate_rewards.0.mlp_path=/nowhere/sac+logos+ava1-l14-linearMSE.pth",
             "algorithm.kl_gate_rewards.1.checkpoint=/nowhere/ImageReward.pt",
             "reward.process.python=/nowhere/paddle-env/bin/python"]
    proc = pod(capsys, "--tpu", "p", "--zone", "z", "--dry-run", "--", *gardo)
    assert proc.returncode == 0, proc.stderr
    for kv in gardo[1:]:
        assert f"{kv}: not on this machine; the workers' check looks for it before anything starts" in proc.stderr
    check, start = gcloud_lines(proc.stdout)
    assert check_argv(remote_of(check)) == train_argv(remote_of(start)) == gardo
    dist = ["+experiment=smoke", "tpu_topology=v6e-8", "tpu_topology.execution=distributed", "sample.batch_size=1",
            "train.batch_size=1"]
    cache = f"distributed.compile_cache_dir={Path(__file__)}/cache"  # under a file here; a directory on the workers
    proc = pod(capsys, "--tpu", "p", "--zone", "z", "--dry-run", "--", *dist, cache)
    assert proc.returncode == 0 and f"{cache}: not on this machine" in proc.stderr, proc.stderr
    proc = pod(capsys, "--tpu", "p", "--zone", "z", "--dry-run", "--", *dist, "distributed.compile_cache_dir=gs://b/c")
    assert proc.returncode == 2 and "error: distributed.compile_cache_dir=gs://b/c" in proc.stderr, proc.stderr


@pytest.fixture
def real_workdir(tmp_path):
    """A worker's WORKDIR whose ddpo_tpu is this checkout's, front end included."""
    return worker_dir(tmp_path)


def test_the_workers_check_runs_the_front_ends_check(real_workdir):
    host = socket.gethostname()
    before = sorted(p.name for p in real_workdir.iterdir())
    smoke = ["+experiment=smoke", "num_epochs=2"]
    proc = bash(lp.build_check_command(smoke + ["prompts=from_file", "prompts.file=/nowhere/prompts.txt"],
                                       str(real_workdir), ".venv"))
    assert proc.returncode == 2 and proc.stdout == ""
    assert re.search(rf"^{re.escape(host)}: error: prompts\.file=/nowhere/prompts\.txt: ", proc.stderr, re.M), \
        proc.stderr
    assert f"{host}: ddpo_tpu: nothing was started." in proc.stderr
    proc = bash(lp.build_check_command(smoke, str(real_workdir), ".venv"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"{host}: check passed\n" and proc.stderr == ""
    assert sorted(p.name for p in real_workdir.iterdir()) == before  # no run dir, no outputs/


def test_the_old_script_name_still_works():
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "launch_pod.py"), "--tpu", "p", "--zone", "z",
                           "--dry-run", "--stop"], env=clean_env(), cwd=REPO, capture_output=True, text=True,
                          timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr
    (argv,) = gcloud_lines(proc.stdout)
    assert remote_of(argv) == lp.build_stop_command("~/ddpo_tpu")


# --- arguments (issue 32) ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv,named", [
    (["--tpu=", "--zone", "z"], "--tpu: an empty name"),
    (["--tpu", "t", "--zone", "z", "--lines", "-5"], "--lines: -5 is below 0"),
    (["--tpu", "t", "--zone", "z", "--backoff", "-5"], "--backoff: -5 is below 0"),
    (["--tpu", "t", "--zone", "z", "--retries", "-1"], "--retries: -1 is below 0"),
])
def test_a_bad_argument_is_one_line_and_exit_2(capsys, argv, named):
    with pytest.raises(SystemExit) as e:
        lp.main([*argv, "--dry-run", "--", "+experiment=smoke"])
    err = capsys.readouterr().err
    assert (e.value.code == 2
            and err.strip().splitlines() == [f"ddpo-pod: error: argument {named} (see ddpo-pod --help)"])


def test_a_node_rank_pinned_on_a_pod_is_refused(capsys):
    pod = ["+experiment=smoke", "tpu_topology=v6e-16", "tpu_topology.execution=distributed",
           "distributed.rdzv_endpoint=10.0.0.2:29500", "sample.batch_size=1", "train.batch_size=1",
           "train.gradient_accumulation_steps=1"]
    assert lp.main(["--tpu", "t", "--zone", "z", "--dry-run", "--", *pod, "distributed.node_rank=0"]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith("error: distributed.node_rank=0: every worker of the pod"), err
    assert "auto" in errors[0]
    assert lp.main(["--tpu", "t", "--zone", "z", "--dry-run", "--", *pod]) == 0  # auto: each worker's own rank
