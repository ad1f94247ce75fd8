"""A spot VM's life with output_root=gs://...: SIGKILL mid-epoch, the VM's disk gone (every local file of the run
deleted), the same command on the empty disk continues from the bucket and ends with the weights of an
uninterrupted run; metrics.jsonl in the bucket has each epoch once. On fake-gcs-server (tests/helpers_gcs.py)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time

import psutil
import pytest

from ddpo_tpu.rundir import storage
from tests.helpers import clean_env, run_train, wait_for_event
from tests.helpers_gcs import fake_gcs, gcs_server  # noqa: F401 -- fixtures

pytestmark = pytest.mark.slow

BASE = ["+experiment=smoke", "num_epochs=4", "save_freq=1", "sample.num_batches_per_epoch=1", "reward.host_workers=0"]


def test_sigkill_and_a_lost_disk_then_the_same_command_continues_from_the_bucket(tmp_path, model_cache, fake_gcs):
    (tmp_path / "ref").mkdir()
    ref = run_train([*BASE, f"model.cache_dir={model_cache}", "output_root=local"], tmp_path / "ref")
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-2000:]
    want = (tmp_path / "ref" / "local" / "smoke" / "weights" / "final.safetensors").read_bytes()

    vm = tmp_path / "vm"  # the VM's disk: launch dir and cache (the staging run dir lives under XDG_CACHE_HOME)
    vm.mkdir()
    env = {"XDG_CACHE_HOME": str(vm / "cache")}
    args = [*BASE, f"model.cache_dir={model_cache}", f"output_root=gs://{fake_gcs}/runs"]
    proc = subprocess.Popen([sys.executable, "-m", "ddpo_tpu.train", *args], cwd=vm, env=clean_env(**env),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    staging = vm / "cache" / "ddpo_tpu" / "runs" / fake_gcs / "runs" / "smoke"  # storage.local_root on the VM
    wait_for_event(staging, "sampling_batch", proc, epoch=2)  # mid-epoch 2: checkpoints 0 and 1 committed
    for child in psutil.Process(proc.pid).children(recursive=True):
        child.kill()  # the training process first: no chance to checkpoint or drain its uploads
    proc.kill()
    proc.wait()
    shutil.rmtree(vm)  # the preempted spot VM is deleted with its disk
    vm.mkdir()

    again = run_train(args, vm, **env)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-2000:]
    assert "continuing from gs://" in again.stdout and "resumed from" in again.stdout
    fs = storage.filesystem()
    fs.invalidate_cache()
    run = storage.Url(fake_gcs, "runs/smoke")
    assert fs.cat_file(run.join("weights", "final.safetensors").path) == want  # byte-identical
    records = [json.loads(x) for x in fs.cat_file(run.join("metrics.jsonl").path).decode().splitlines()]
    assert [r["epoch"] for r in records if r.get("kind") == "epoch"] == [0, 1, 2, 3]  # each epoch once
    listing = storage.list_checkpoints(fs, run)
    assert 3 in listing.complete and not listing.incomplete
    events = fs.cat_file(run.join("events.jsonl").path).decode()
    assert '"worker_exited"' in events and '"run_complete"' in events
    # ddpo-status reads the run from the bucket alone
    status = subprocess.run([sys.executable, "-m", "ddpo_tpu.status", "--json", f"gs://{fake_gcs}/runs/smoke"],
                            env=clean_env(**env), capture_output=True, text=True, cwd=vm, timeout=120)
    assert status.returncode == 0, status.stderr
    facts = json.loads(status.stdout)
    assert facts["state"] == "finished" and facts["run_dir"] == f"gs://{fake_gcs}/runs/smoke"


# The outage starts once epoch 0's checkpoint is in the bucket; the deadline must pass after epoch 1's local
# checkpoint (what the resume then continues from and uploads), so it is the longest epoch 1 can take on a busy
# machine, not a quiet machine's: with 3 s, a run whose epoch took 26 s (CI, the slow tier beside other work) stopped
# inside epoch 1 with nothing newer than the bucket's epoch 0. Where the run finishes its epochs first, it waits for
# the deadline at its end (storage.Mirror.close) and ends the same way, one error line and exit 1.
OUTAGE_DEADLINE_S = 30


def test_a_bucket_outage_past_the_deadline_ends_in_one_line_and_the_same_command_finishes(tmp_path, model_cache,
                                                                                        fake_gcs, gcs_server):
    """The bucket goes away after epoch 0's checkpoint went up and stays away longer than storage_timeout_s: the run
    ends with one `error:` line naming the unreachable bucket, exit 1, its later checkpoints kept locally. The bucket
    returns: the same command continues from the newest local checkpoint (not the bucket's epoch 0), uploads the
    checkpoints the bucket lacks, and finishes with every epoch's metrics in the bucket once."""
    from ddpo_tpu.rundir import events as ev
    from tests.helpers_gcs import Gate

    gate = Gate(gcs_server)  # the training processes reach the bucket through it; this test process directly
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache"), "STORAGE_EMULATOR_HOST": gate.url}
    args = [*(a for a in BASE if not a.startswith("num_epochs=")), "num_epochs=3", f"model.cache_dir={model_cache}",
            f"output_root=gs://{fake_gcs}/runs", f"storage_timeout_s={OUTAGE_DEADLINE_S}"]
    staging = tmp_path / "cache" / "ddpo_tpu" / "runs" / fake_gcs / "runs" / "smoke"
    fs = storage.filesystem()
    run = storage.Url(fake_gcs, "runs/smoke")
    proc = subprocess.Popen([sys.executable, "-m", "ddpo_tpu.train", *args], cwd=tmp_path, env=clean_env(**env),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_event(staging, "checkpoint", proc, epoch=0)
        while 0 not in storage.list_checkpoints(fs, run).complete:  # epoch 0 is in the bucket
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.1)
        gate.shut()
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
        gate.open()
    errors = [line for line in (out + err).splitlines() if line.startswith("error:")]
    assert proc.returncode == 1, out[-2000:] + err[-2000:]
    assert len(errors) == 1 and "unreachable" in errors[0] and "local checkpoint" in errors[0], out[-3000:]
    assert "Traceback" not in out + err + (staging / "train.log").read_text()
    local = sorted(p.name for p in (staging / "checkpoints").iterdir() if p.name.startswith("epoch_"))
    assert local[-1] > "epoch_0000" and sorted(storage.list_checkpoints(fs, run).complete) == [0]
    assert [r["event"] for r in ev.read_events(staging)][-2:] == ["error", "worker_exited"]

    again = run_train(args, tmp_path, **env)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-2000:]
    assert f"continuing from {staging / 'checkpoints' / local[-1]}" in again.stdout
    assert "uploaded local checkpoint(s) the bucket lacked" in again.stdout
    gate.shut()
    fs.invalidate_cache()
    assert 2 in storage.list_checkpoints(fs, run).complete
    records = [json.loads(x) for x in fs.cat_file(run.join("metrics.jsonl").path).decode().splitlines()]
    assert [r["epoch"] for r in records if r.get("kind") == "epoch"] == [0, 1, 2]  # each epoch once
    assert fs.exists(run.join("weights", "final.safetensors").path)
