"""The managed reward process (ddpo_tpu/rewards/managed.py, rewards/serve.py): a reward scored by a process of another
Python, started, restarted once, and stopped by the trainer; the compose-time checks of reward.process.

The "other environment" is this venv's own interpreter (sys.executable); ddpo_tpu reaches it through the PYTHONPATH
the trainer sets. Every process binds 127.0.0.1 only. The probe reward (tests/helpers/probe_reward.py, imported only
by the reward process) reads metadata and reports extras; the expected values are computed here from its definition.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from ddpo_tpu.config.compose import ConfigError, compose_and_validate
from ddpo_tpu.rewards import RewardError
from ddpo_tpu.rewards.managed import ManagedReward, close_all

from tests.helpers import REPO, clean_env, read_metrics, run_train

pytestmark = pytest.mark.torch_free  # no torch in the test or what it starts (tests/conftest.py)

PROBE = {"name": "metadata_probe", "host_workers": 0, "scale": 2.0}
PROMPTS = ["a cat", "a dog", "a horse"]
METADATA = [{"bonus": 0.5, "tag": "counting"}, {"tag": "colors"}, {"bonus": -1.0}]


def _images(n: int = 3, size: int = 16, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, size, size, 3), dtype=np.uint8)


def _probe(tmp_path: Path, **kwargs) -> ManagedReward:
    return ManagedReward(PROBE, python=sys.executable, log_path=tmp_path / "reward_process.log", cache_dir=tmp_path,
                         imports=["tests.helpers.probe_reward"], startup_timeout_s=120, **kwargs)


def _running(pid: int) -> bool:
    """A process that exists and is not a zombie (an orphan's zombie waits for whoever adopted it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(") ", 1)[1][0] != "Z"


def _serve_processes(parent_pid: int) -> list[int]:
    """The reward processes started by `parent_pid` still running, from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"ddpo_tpu.rewards.serve" in argv and b"--parent-pid" in argv \
                and argv[argv.index(b"--parent-pid") + 1] == str(parent_pid).encode() and _running(int(entry.name)):
            found.append(int(entry.name))
    return found


def _wait_gone(pid: int, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while _running(pid):
        if time.monotonic() > end:
            return False
        time.sleep(0.05)
    return True


def _expected(images: np.ndarray, metadata) -> tuple[np.ndarray, np.ndarray]:
    base = PROBE["scale"] * images.reshape(len(images), -1).mean(axis=1) / 255.0
    bonus = np.asarray([m.get("bonus", np.nan) for m in metadata], dtype=np.float64)
    return (base + np.nan_to_num(bonus)).astype(np.float32), bonus.astype(np.float32)


def _kill(reward: ManagedReward) -> int:
    pid = reward.pid
    os.kill(pid, signal.SIGKILL)
    assert _wait_gone(pid)
    return pid


@pytest.fixture(autouse=True)
def _no_leftovers():
    yield
    close_all()
    assert _serve_processes(os.getpid()) == []


# --- the process --------------------------------------------------------------------------------------------------


def test_process_scores_with_metadata_returns_extras_and_is_gone_after_close(tmp_path):
    reward = _probe(tmp_path, batch_size=2)  # 3 images: two requests a call, the extras joined across them
    pid = reward.pid
    assert _running(pid) and _serve_processes(os.getpid()) == [pid]
    images = _images()
    scored = reward.score(images, PROMPTS, metadata=METADATA)
    values, bonus = _expected(images, METADATA)
    np.testing.assert_allclose(scored.values, values, rtol=0, atol=1e-6)
    assert set(scored.extras) == {"bonus"}
    np.testing.assert_array_equal(np.isnan(scored.extras["bonus"]), [False, True, False])  # null on the wire -> NaN
    np.testing.assert_allclose(scored.extras["bonus"][[0, 2]], bonus[[0, 2]])
    # no metadata: none on the wire, so no bonus and no extras
    plain = reward.score(images, PROMPTS)
    np.testing.assert_allclose(plain.values, PROBE["scale"] * images.reshape(3, -1).mean(1) / 255, atol=1e-6)
    assert plain.extras == {}
    np.testing.assert_allclose(reward(images, PROMPTS, metadata=METADATA), values, atol=1e-6)
    log = (tmp_path / "reward_process.log").read_text()
    assert "metadata_probe" in log and f"(pid {pid})" in log
    reward.close()
    assert not _running(pid) and "SIGTERM: stopping after 6 requests" in (tmp_path / "reward_process.log").read_text()
    with pytest.raises(RewardError, match="was stopped"):
        reward(images, PROMPTS)


def test_killed_between_calls_is_restarted_once_and_scoring_continues(tmp_path, capfd):
    reward = _probe(tmp_path)
    images = _images()
    before = reward.score(images, PROMPTS, metadata=METADATA).values
    first = _kill(reward)
    after = reward.score(images, PROMPTS, metadata=METADATA)
    np.testing.assert_array_equal(after.values, before)
    assert reward.restarts == 1 and reward.pid != first and _running(reward.pid)
    warning = [ln for ln in capfd.readouterr().err.splitlines() if "restarting" in ln]
    assert warning == [f"warning: reward.process.python={sys.executable}: the reward process of "
                       f"reward.name=metadata_probe (pid {first}) died (killed by SIGKILL); restarting it once "
                       f"(log: {tmp_path / 'reward_process.log'})"]
    assert (tmp_path / "reward_process.log").read_text().count("=== ") == 2  # both starts, appended to one log


def test_killed_twice_ends_with_one_line_and_no_orphan(tmp_path):
    reward = _probe(tmp_path)
    images = _images()
    _kill(reward)
    reward(images, PROMPTS)
    second = _kill(reward)
    with pytest.raises(RewardError) as e:
        reward(images, PROMPTS)
    message = str(e.value)
    assert "\n" not in message
    assert message == (f"reward.name='metadata_probe': reward.process.python={sys.executable}: the reward process "
                       f"(pid {second}) died again (killed by SIGKILL) after its one restart; the run stops here and "
                       f"the same command resumes from its last checkpoint; its log: {tmp_path / 'reward_process.log'}")
    assert _serve_processes(os.getpid()) == []
    with pytest.raises(RewardError, match="died again"):  # it stays dead: no third start
        reward(images, PROMPTS)
    assert _serve_processes(os.getpid()) == []


def test_dies_during_a_request_is_restarted_and_the_request_scored(tmp_path):
    """A process killed while it scores: the client sees the connection drop, the process is found dead, started
    again, and the same request answered by the new one."""
    import threading

    reward = ManagedReward({**PROBE, "delay_s": 1.0}, python=sys.executable, log_path=tmp_path / "reward_process.log",
                           cache_dir=tmp_path, imports=["tests.helpers.probe_reward"], startup_timeout_s=120)
    images, pid = _images(), reward.pid
    threading.Timer(0.3, lambda: os.kill(pid, signal.SIGKILL)).start()  # inside the 1 s the request sleeps
    start = time.monotonic()
    scored = reward.score(images, PROMPTS, metadata=METADATA)
    np.testing.assert_allclose(scored.values, _expected(images, METADATA)[0], atol=1e-6)
    assert not _running(pid) and reward.restarts == 1 and reward.pid != pid
    assert time.monotonic() - start >= 1.3  # the first try was cut off, the second one slept its second in full


@pytest.mark.needs_torch
@pytest.mark.slow  # 64 s on 2 busy cores: transformers imported and the tiny CLIP built and loaded twice
def test_a_model_reward_built_from_the_run_config_scores_as_in_the_trainer(tmp_path):
    """reward=pickscore on the tiny model (conf/reward_local/pickscore_tiny.yaml: `tiny` stand-ins, built in the
    process from the model cache) through rewards/from_config.py, in-process and in a process: the same scores."""
    import torch

    from ddpo_tpu.rewards.from_config import reward_from_config

    base = ["+experiment=smoke", "reward=pickscore"]
    inproc = compose_and_validate(base).cfg.reward
    managed_cfg = compose_and_validate([*base, f"reward.process.python={sys.executable}"]).cfg.reward
    images, cache = _images(n=3, size=32), tmp_path / "models"
    want = reward_from_config(inproc, model_cache_dir=str(cache), device=torch.device("cpu"))(images, PROMPTS)
    reward = reward_from_config(managed_cfg, model_cache_dir=str(cache), device=torch.device("cpu"),
                                log_dir=tmp_path, should_stop=lambda: False)
    assert isinstance(reward, ManagedReward) and reward.name == "pickscore"
    # the same weights and inputs; the two processes may run CPU kernels with different thread counts (the reward
    # process gets OMP_NUM_THREADS=1, the test worker whatever it has), so sums differ in their last bits: CI saw
    # 3.6e-7. The three images' scores here lie 0.1 to 1.1 apart, so a mixed-up image or prompt still fails.
    np.testing.assert_allclose(reward(images, PROMPTS), want, rtol=0, atol=1e-5)
    assert (tmp_path / "reward_process.log").is_file()


def test_trainer_killed_with_sigkill_leaves_no_reward_process(tmp_path):
    """The trainer's SIGKILL runs no finally, no atexit: the process sees its parent gone and exits."""
    script = (f"import sys, time\nfrom ddpo_tpu.rewards.managed import ManagedReward\n"
              f"r = ManagedReward({PROBE!r}, python=sys.executable, log_path={str(tmp_path / 'log')!r}, "
              f"cache_dir={str(tmp_path)!r}, imports=['tests.helpers.probe_reward'])\n"
              f"print(r.pid, flush=True)\ntime.sleep(120)\n")
    trainer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=clean_env(),
                               cwd=REPO)
    try:
        child = int(trainer.stdout.readline())
        assert _running(child)
        trainer.kill()
        trainer.wait(timeout=10)
        assert _wait_gone(child, timeout=5), f"reward process {child} outlived its trainer"
        assert "is gone: exiting" in (tmp_path / "log").read_text()
    finally:
        trainer.kill()
        trainer.stdout.close()


def test_a_process_that_fails_to_start_names_its_exit_and_log(tmp_path):
    bad = {**PROBE, "scale": -1.0}  # the schema refuses it in the process: it exits before it is ready
    with pytest.raises(RewardError) as e:
        ManagedReward(bad, python=sys.executable, log_path=tmp_path / "r.log", cache_dir=tmp_path,
                      imports=["tests.helpers.probe_reward"], startup_timeout_s=120)
    message = str(e.value)
    assert "\n" not in message and "ended before it was ready (exit code 1)" in message
    assert f"its log: {tmp_path / 'r.log'}" in message and "ValidationError" in (tmp_path / "r.log").read_text()


# --- config -------------------------------------------------------------------------------------------------------


def _problems(*overrides: str) -> dict[str, str]:
    with pytest.raises(ConfigError) as e:
        compose_and_validate(["+experiment=smoke", *overrides])
    return {p.key: str(p) for p in e.value.problems}


def test_reward_process_keys_compose_and_are_checked(tmp_path):
    cfg = compose_and_validate(["+experiment=smoke", f"reward.process.python={sys.executable}",
                                "reward.process.device=cpu", "reward.process.port=8123"]).cfg
    assert (cfg.reward.process.python, cfg.reward.process.device, cfg.reward.process.port) == \
        (sys.executable, "cpu", 8123)
    assert compose_and_validate(["+experiment=smoke"]).cfg.reward.process.python is None  # default: in-process
    missing = _problems(f"reward.process.python={tmp_path}/nope/bin/python")["reward.process.python"]
    assert missing.startswith(f"reward.process.python={tmp_path}/nope/bin/python: no such file (point it at")
    plain = tmp_path / "python"
    plain.write_text("#!/bin/sh\n")
    assert ": not executable (" in _problems(f"reward.process.python={plain}")["reward.process.python"]
    assert "not a device" in _problems(f"reward.process.python={sys.executable}",
                                       "reward.process.device=gpu1")["reward.process.device"]
    # its settings without its interpreter: not read, refused
    ignored = _problems("reward.process.device=cuda:1")["reward.process.device"]
    assert "not read" in ignored and "reward.process.python=null" in ignored
    # a component has no process block: the weighted reward runs where the run's reward runs
    assert "reward.components.0.process" in " ".join(_problems(
        "reward=weighted", "reward.components=[{name: jpeg_compressibility, process: {python: x}}]"))


def test_where_the_reward_runs_is_no_change_for_a_resume():
    """A checkpoint trained in-process resumes with the reward in a process, and the reverse (resume.py compares what
    is trained, not where the reward runs)."""
    from ddpo_tpu.config.resume import changed_keys, resume_relevant

    inproc = compose_and_validate(["+experiment=smoke"]).tree
    managed = compose_and_validate(["+experiment=smoke", f"reward.process.python={sys.executable}",
                                    "reward.process.device=cpu"]).tree
    assert changed_keys(resume_relevant(inproc), resume_relevant(managed)) == []
    assert not any(k.startswith("reward.process") for k in resume_relevant(managed))


def test_pod_leaves_the_interpreter_path_to_the_workers(tmp_path):
    from ddpo_tpu.launch.sweep import is_worker_path_problem

    with pytest.raises(ConfigError) as e:
        compose_and_validate(["+experiment=smoke", f"reward.process.python={tmp_path}/venv/bin/python"])
    assert [is_worker_path_problem(p) for p in e.value.problems] == [True]


# --- end to end ---------------------------------------------------------------------------------------------------


@pytest.mark.needs_torch
@pytest.mark.slow
# extended (~39 s here): CI's are test_a_model_reward_built_from_the_run_config_scores_as_in_the_trainer (the same
# scores) and test_a_run_whose_reward_process_dies_twice_stops_resumable (a run with its reward in a process)
@pytest.mark.extended
def test_smoke_run_with_its_reward_in_a_process_equals_the_in_process_run(tmp_path, model_cache):
    args = ["+experiment=smoke", "num_epochs=2", "sample.num_batches_per_epoch=1", "save_freq=1",
            f"model.cache_dir={model_cache}"]
    runs = {}
    for name, extra in (("inproc", []), ("managed", [f"reward.process.python={sys.executable}"])):
        proc = run_train([*args, *extra, f"run_name={name}"], tmp_path)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
        runs[name] = tmp_path / "outputs" / name
    epochs = {k: [(r["epoch"], r["reward_mean"], r["reward_std"]) for r in read_metrics(d, "epoch")]
              for k, d in runs.items()}
    assert len(epochs["managed"]) == 2 and epochs["managed"] == epochs["inproc"]  # the same rewards, exactly
    log = (runs["managed"] / "reward_process.log").read_text()
    assert not (runs["inproc"] / "reward_process.log").exists()
    pid = int(log.split("(pid ", 1)[1].split(")", 1)[0])
    assert "SIGTERM: stopping after" in log and not _running(pid)  # stopped by the run, not left behind


def _served_pids(run_dir: Path) -> list[int]:
    """The pids of the reward processes of a run that became ready, in order, from its reward_process.log."""
    try:
        text = (run_dir / "reward_process.log").read_text()
    except OSError:
        return []
    return [int(line.rsplit("(pid ", 1)[1].rstrip(")")) for line in text.splitlines()
            if line.startswith("reward ") and "; serving 127.0.0.1:" in line]


@pytest.mark.needs_torch
@pytest.mark.slow
def test_a_run_whose_reward_process_dies_twice_stops_resumable(tmp_path, model_cache):
    """Killed once mid-run: restarted, the run goes on. Killed again: one error line naming it, exit 1, no process
    left; the same command resumes from the last checkpoint and finishes."""
    from ddpo_tpu.rundir import events as ev
    from tests.helpers import wait_for_event

    args = ["+experiment=smoke", "num_epochs=6", "sample.num_batches_per_epoch=1", "save_freq=1",
            f"model.cache_dir={model_cache}", f"reward.process.python={sys.executable}", "run_name=dies"]
    run_dir = tmp_path / "outputs" / "dies"
    proc = subprocess.Popen([sys.executable, "-m", "ddpo_tpu.train", *args], cwd=tmp_path, env=clean_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for_event(run_dir, "epoch_done", proc, timeout=600, epoch=0)
        first = _served_pids(run_dir)[-1]
        os.kill(first, signal.SIGKILL)
        end = time.monotonic() + 300
        while len(_served_pids(run_dir)) < 2:  # started again at the next reward call
            assert proc.poll() is None and time.monotonic() < end, "no restart"
            time.sleep(0.1)
        time.sleep(2)  # past its health check: a kill now is a death, not a failed start
        os.kill(_served_pids(run_dir)[-1], signal.SIGKILL)
        out, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 1, out[-3000:]
    errors = [r["message"] for r in ev.read_events(run_dir) if r["event"] == "error"]
    assert len(errors) == 1 and "\n" not in errors[0], errors
    assert "reward process (pid" in errors[0] and "died again (killed by SIGKILL) after its one restart" in errors[0]
    assert f"its log: {run_dir / 'reward_process.log'}" in errors[0]
    assert (run_dir / "train.log").read_text().count("died (killed by SIGKILL); restarting it once") == 1
    assert len(_served_pids(run_dir)) == 2 and not any(_running(p) for p in _served_pids(run_dir))
    done = [r["epoch"] for r in read_metrics(run_dir, "epoch")]
    assert done and done[0] == 0
    again = run_train(args, tmp_path)  # the same command
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-2000:]
    resumed = [r for r in ev.read_events(run_dir) if r["event"] == "resumed"]
    assert resumed and [r["epoch"] for r in read_metrics(run_dir, "epoch")][-1] == 5
    assert not any(_running(p) for p in _served_pids(run_dir))
