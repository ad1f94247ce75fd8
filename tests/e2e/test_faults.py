"""Faults inside one epoch: a kill at any point leaves the epoch's outputs (metrics line, sample grid, weights) and
the checkpoint that marks it done either all there or the epoch redone; a damaged checkpoint falls back by name."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.helpers import read_metrics

BASE = ["+experiment=smoke", "num_epochs=2", "save_freq=1", "reward.host_workers=0", "sample.num_batches_per_epoch=1"]


class Killed(BaseException):
    """Stands for SIGKILL: nothing in the trainer catches it."""


def trainer(run_dir: Path, model_cache: Path, *extra: str):
    from ddpo_tpu.config.compose import compose_and_validate
    from ddpo_tpu.training import loop
    from ddpo_tpu.rundir.files import RunDir
    from ddpo_tpu.runtime import make_runtime

    v = compose_and_validate([*BASE, f"model.cache_dir={model_cache}", *extra])
    run_dir.mkdir(exist_ok=True)
    t = loop.Trainer(v.cfg, make_runtime(v.cfg), RunDir(run_dir), tree=v.tree, stop=SimpleNamespace(requested=False))
    t.resume()
    return t


@pytest.mark.slow
def test_a_kill_around_the_checkpoint_neither_loses_nor_duplicates_an_epoch(tmp_path, model_cache, monkeypatch):
    from ddpo_tpu.training import checkpoint_files as ckpt

    trainer(tmp_path / "whole", model_cache).fit()
    want = (tmp_path / "whole" / "weights" / "final.safetensors").read_bytes()

    def kill_before_commit(self, limit):  # every output of epoch 0 written, its checkpoint not yet in place
        raise Killed

    def kill_after_rename(root, limit):  # the checkpoint just renamed into place (old code: before the metrics line)
        raise Killed

    for name, target, fault in (("before", ckpt.Pending, ("commit", kill_before_commit)),
                                ("after", ckpt, ("rotate", kill_after_rename))):
        run = tmp_path / name
        with monkeypatch.context() as m:
            m.setattr(target, *fault)
            with pytest.raises(Killed):
                trainer(run, model_cache).fit()
        trainer(run, model_cache).fit()
        assert [e["epoch"] for e in read_metrics(run, "epoch")] == [0, 1], name  # none lost, none twice
        assert [s["global_step"] for s in read_metrics(run, "step")] == [1, 2], name
        assert sorted(p.name for p in (run / "samples").glob("epoch_*.png")) == ["epoch_0000.png", "epoch_0001.png"]
        assert (run / "weights" / "epoch_0000.safetensors").is_file()
        assert (run / "weights" / "final.safetensors").read_bytes() == want, name


def _two_checkpoints(root: Path) -> dict:
    import torch

    from ddpo_tpu.training import checkpoint_files as ckpt
    from ddpo_tpu.config.compose import compose_and_validate

    tree = compose_and_validate(BASE).tree
    for epoch in (0, 1):
        w = torch.full((4, 4), float(epoch))
        ckpt.prepare(root / "checkpoints", epoch=epoch, global_step=epoch + 1, trainable={"w": w},
                     optimizer={"state": {0: {"exp_avg": w.clone()}}, "param_groups": []}, tracker={}, run_id="r",
                     tree=tree).commit(limit=5)
    return tree


# a SIGKILL during the final weights write: the data is written, the rename (and the write's own cleanup) never comes
_KILLED_WEIGHTS_WRITE = """
import os, signal, sys
from pathlib import Path
import torch
from ddpo_tpu.rundir.files import RunDir
os.replace = lambda *args: os.kill(os.getpid(), signal.SIGKILL)
RunDir(Path(sys.argv[1])).save_weights("final", {"w": torch.ones(64, 64)})
"""


def test_the_next_start_removes_what_killed_writes_left_and_nothing_else(tmp_path):
    """A kill during the final weights write or a checkpoint write leaves the write's temporary file or directory
    (3.4 GB each for an SD 1.4 fine-tune). The next start removes those, and only those, then resumes as usual."""
    import subprocess
    import sys

    import torch

    from ddpo_tpu.training import checkpoint_files as ckpt
    from ddpo_tpu.rundir import events as ev
    from ddpo_tpu.config.compose import compose_and_validate
    from ddpo_tpu.training.checkpointing import CheckpointManager
    from ddpo_tpu.rundir.files import RunDir
    from tests.helpers import REPO, clean_env

    run = tmp_path / "run"
    tree = _two_checkpoints(run)
    (run / "metrics.jsonl").write_text('{"kind": "epoch", "epoch": 0}\n{"kind": "epoch", "epoch": 1}\n')
    (run / "weights").mkdir()
    (run / "weights" / "epoch_0001.safetensors").write_bytes(b"weights of epoch 1")
    (run / ".hidden_note").write_text("not a temporary file of ours")
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}

    child = subprocess.run([sys.executable, "-c", _KILLED_WEIGHTS_WRITE, str(run)], cwd=REPO, env=clean_env())
    assert child.returncode == -9, child
    with pytest.MonkeyPatch.context() as m:  # a checkpoint write cut short before its rename: no cleanup either
        m.setattr(ckpt.layout, "fsync_dir", lambda path: (_ for _ in ()).throw(Killed()))
        with pytest.raises(Killed):
            ckpt.prepare(run / "checkpoints", epoch=2, global_step=3, trainable={"w": torch.ones(4, 4)},
                         optimizer={}, tracker={}, run_id="r", tree=tree)
    left = sorted(str(p.relative_to(run)) for p in run.rglob("*") if p.is_file() and p not in before)
    assert len(left) == 4 and left[-1].startswith("weights/.final.safetensors.")  # and the checkpoint's 3 files
    assert all(name.startswith("checkpoints/.tmp-epoch_0002-") for name in left[:3]), left

    cfg = compose_and_validate(BASE).cfg
    restored = {}
    manager = CheckpointManager(
        cfg, SimpleNamespace(is_main=True, place_like=lambda v, like: v, sync=lambda: None), RunDir(run),
        ev.EventLog(run), tree, SimpleNamespace(requested=False),
        family=SimpleNamespace(trainable_state=lambda: {"w": torch.zeros(4, 4)}, load_trainable_state=restored.update),
        state=SimpleNamespace(global_step=0, load_state_dict=lambda d: None, parameter_bytes=lambda: 64),
        algorithm=SimpleNamespace(load_state_dict=lambda d: None))
    manager.resume()
    after = {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != ev.EVENTS_FILE}
    assert after == before  # the leftovers are gone; every other file is as it was
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".")]
    assert manager.start_epoch == 2 and float(restored["w"][0, 0]) == 1.0  # and the run resumes from epoch 1


@pytest.mark.parametrize("name", ["trainable.safetensors", "optimizer.pt", "state.json"])
def test_a_damaged_newest_checkpoint_is_named_and_the_previous_one_used(tmp_path, name):
    from ddpo_tpu.training import checkpoint_files as ckpt

    tree = _two_checkpoints(tmp_path)
    bad = tmp_path / "checkpoints" / "epoch_0001"
    data = (bad / name).read_bytes()
    (bad / name).write_bytes(data[: len(data) // 2])  # truncated, as by a full disk or a copy cut short
    seen = []
    loaded = ckpt.load_resume(tmp_path, "auto", tree, on_damaged=seen.append)
    assert loaded.epoch == 0 and float(loaded.trainable["w"][0, 0]) == 0.0
    assert [e.path for e in seen] == [bad] and name in str(seen[0])

    other = tmp_path / "checkpoints" / "epoch_0000" / name  # none intact: refused with the fix, naming the dir
    other.write_bytes(other.read_bytes()[:10])
    with pytest.raises(ckpt.ResumeRefused) as e:
        ckpt.load_resume(tmp_path, "auto", tree)
    msg = str(e.value)
    assert str(tmp_path / "checkpoints") in msg and "rm -r" in msg and "resume=never" in msg and "\n" not in msg


def test_a_checkpoint_without_checksums_still_loads(tmp_path):
    import json

    from ddpo_tpu.training import checkpoint_files as ckpt

    tree = _two_checkpoints(tmp_path)
    state_file = tmp_path / "checkpoints" / "epoch_0001" / "state.json"
    state = json.loads(state_file.read_text())
    assert set(state.pop("sha256")) == {"trainable.safetensors", "optimizer.pt"}
    state_file.write_text(json.dumps(state))  # as written before checksums existed
    assert ckpt.load_resume(tmp_path, "auto", tree).epoch == 1
    weights = state_file.with_name("trainable.safetensors")
    weights.write_bytes(weights.read_bytes()[:20])  # damage is still found, by loading
    assert ckpt.load_resume(tmp_path, "auto", tree, on_damaged=lambda e: None).epoch == 0


@pytest.mark.slow
def test_a_killed_training_process_exits_1_with_one_line(tmp_path, model_cache):
    import signal
    import subprocess
    import sys

    import psutil

    from tests.helpers import clean_env, wait_for_event

    args = [*BASE, f"model.cache_dir={model_cache}"]
    proc = subprocess.Popen([sys.executable, "-m", "ddpo_tpu.train", *args], cwd=tmp_path, env=clean_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_for_event(tmp_path / "outputs" / "smoke", "phase_start", proc, phase="sampling")
    (worker,) = psutil.Process(proc.pid).children()
    worker.send_signal(signal.SIGKILL)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1, out[-2000:]  # not 247 (-9 leaking through)
    # one `error:` line and no traceback, as test_exit_paths' assert_one_line (its one-process kill is extended)
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "training process was killed by SIGKILL" in errors[0], out[-2000:]
    assert "Traceback" not in out, out[-2000:]
    assert "killed by SIGKILL" in (tmp_path / "outputs" / "smoke" / "train.log").read_text()


def test_a_nonfinite_stop_before_any_checkpoint_does_not_claim_one():
    from ddpo_tpu.training.checkpointing import CheckpointManager

    assert "no checkpoint was written yet" in CheckpointManager.saved_state(SimpleNamespace(last_saved_epoch=-1))
    assert "checkpoint (epoch 2) is intact" in CheckpointManager.saved_state(SimpleNamespace(last_saved_epoch=2))


def test_a_stop_request_ends_a_hanging_remote_reward_within_a_second():
    import socket
    import threading
    import time

    import numpy as np

    from ddpo_tpu.rewards.remote import RemoteReward, RewardInterrupted

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)  # accepts connections, never answers
    try:
        reward = RemoteReward(url=f"http://127.0.0.1:{server.getsockname()[1]}/score", timeout_s=30, retries=3)
        stop = threading.Event()
        reward.should_stop = stop.is_set
        threading.Timer(0.5, stop.set).start()  # SIGTERM arrives half a second into the hang
        t0 = time.monotonic()
        with pytest.raises(RewardInterrupted):
            reward(np.zeros((2, 8, 8, 3), dtype=np.uint8), ["a", "b"])
        assert time.monotonic() - t0 < 10  # was timeout_s x (retries + 1) = 120 s; ~0.5 s quiet, 10 for a busy one
    finally:
        server.close()


@pytest.mark.slow
@pytest.mark.parametrize("err", ["ENOSPC", "EROFS"])
def test_a_full_or_read_only_disk_is_one_line_naming_the_path(tmp_path, model_cache, monkeypatch, capsys, err):
    """A write the run dir's disk refuses mid-run (disk full, a read-only remount) ends with exit 1 and one line that
    names the path and the fix; no traceback. Root ignores permissions, so the refusal is injected at the write."""
    import errno

    from ddpo_tpu import worker
    from ddpo_tpu.config.compose import compose_and_validate
    from ddpo_tpu.proc.exit_codes import EXIT_FAILED
    from ddpo_tpu.rundir.files import RunDir

    code = getattr(errno, err)

    def refuse(self, epoch, *args, **kwargs):
        target = self.path / "samples" / f"epoch_{epoch:04d}.png"
        raise OSError(code, __import__("os").strerror(code), str(target))

    monkeypatch.setattr(RunDir, "save_image_grid", refuse)
    v = compose_and_validate([*BASE, f"model.cache_dir={model_cache}", "num_epochs=1"])
    (tmp_path / "run").mkdir()
    assert worker.run(v, tmp_path / "run") == EXIT_FAILED
    stderr = capsys.readouterr().err  # also holds the libraries' loading noise
    err_lines = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(err_lines) == 1 and "Traceback" not in stderr, err_lines
    line = err_lines[0]
    assert str(tmp_path / "run" / "samples" / "epoch_0000.png") in line
    assert ("no space left" in line) == (err == "ENOSPC") and "output_root=" in line


XLA_OOM = ("Bad StatusOr access: RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory "
           "space hbm. Used 35.21G of 31.25G hbm. Exceeded hbm capacity by 3.96G.\n\nTotal hbm usage >= 35.96G:\n"
           "    reserved        530.00M\n    program          34.69G")


@pytest.mark.slow  # two trainers built on the tiny model (13 s on a busy machine)
def test_a_device_out_of_memory_is_one_line_naming_the_keys_that_ask_less(tmp_path, model_cache, monkeypatch,
                                                                           capsys):
    """The HBM estimate picks the fused timesteps and activation checkpointing but a real chip can still refuse the
    graph: XLA's RESOURCE_EXHAUSTED (a RuntimeError from torch_xla) ends the run with exit 1 and one line naming what
    was asked and the keys that ask less; any other RuntimeError is still a traceback."""
    from ddpo_tpu import worker
    from ddpo_tpu.config.compose import compose_and_validate
    from ddpo_tpu.training import loop
    from ddpo_tpu.proc.exit_codes import EXIT_FAILED

    def fit(self):
        raise RuntimeError(XLA_OOM)

    monkeypatch.setattr(loop.Trainer, "fit", fit)
    v = compose_and_validate([*BASE, f"model.cache_dir={model_cache}", "train.timesteps_per_micro_step=4"])
    (tmp_path / "run").mkdir()
    assert worker.run(v, tmp_path / "run") == EXIT_FAILED
    err_lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err_lines) == 1, err_lines
    line = err_lines[0]
    assert "ran out of memory (Bad StatusOr access: RESOURCE_EXHAUSTED" in line and "Used 35.21G of 31.25G" in line
    assert "train.timesteps_per_micro_step=4," in line  # what was asked
    # the smoke trains 8 timesteps a batch: the next K below 4 that divides 8 is 2
    assert "Fix: train.timesteps_per_micro_step=2, or train.activation_checkpointing=true, or half" in line
    assert line.endswith("no checkpoint was written yet (the same command starts over)")

    def fit_other(self):
        raise RuntimeError("a bug, not the device's memory")

    monkeypatch.setattr(loop.Trainer, "fit", fit_other)
    (tmp_path / "run2").mkdir()
    with pytest.raises(RuntimeError, match="a bug"):
        worker.run(v, tmp_path / "run2")
