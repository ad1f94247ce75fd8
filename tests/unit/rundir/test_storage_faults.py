"""Bucket faults (ddpo_tpu/rundir/storage.py, storage_faults.py): an unreachable bucket and a refusing one are told
apart in one line, quickly, with nothing of gcsfs's log on the console; an outage longer than storage_timeout_s stops
the mirror and asks the trainer to stop, a shorter one is waited out; a resume takes the newest verified checkpoint of
either copy and uploads what the bucket lacks. Against fake-gcs-server behind a relay a test can shut
(tests/helpers_gcs.py)."""

from __future__ import annotations

import json
import threading
import time

import pytest

from ddpo_tpu.rundir import storage
from ddpo_tpu.rundir.storage_faults import DENIED, FAILED, UNREACHABLE, StorageError, classify, retry
from tests.helpers_gcs import Refusing, _free_port, fake_gcs, gate, gcs_server  # noqa: F401 -- fixtures

pytestmark = pytest.mark.torch_free  # no torch in the test or what it starts (tests/conftest.py)


def test_exceptions_are_judged_by_what_they_mean():
    import aiohttp
    from gcsfs.retry import HttpError
    from google.auth.exceptions import DefaultCredentialsError

    assert classify(ConnectionRefusedError(111, "Connection refused")) == UNREACHABLE
    assert classify(aiohttp.ServerDisconnectedError()) == UNREACHABLE
    assert classify(HttpError({"code": 503, "message": "unavailable"})) == UNREACHABLE
    assert classify(TimeoutError()) == UNREACHABLE
    assert classify(OSError("Forbidden: b/x\nno access")) == DENIED
    assert classify(HttpError({"code": 401, "message": "Invalid Credentials"})) == DENIED
    assert classify(DefaultCredentialsError("no credentials")) == DENIED
    assert classify(ValueError("Bad Request: b/x")) == FAILED


def test_retry_waits_out_a_blip_and_gives_up_at_the_deadline():
    now = [0.0]
    calls = []

    def flaky(left):
        calls.append(left)
        if len(calls) < 3:
            raise ConnectionResetError("reset")
        return "ok"

    assert retry("upload x", flaky, 60, sleep=lambda s: now.__setitem__(0, now[0] + s), clock=lambda: now[0]) == "ok"
    assert len(calls) == 3 and calls[0] == 60  # each try is given what is left of the deadline

    def down(left):
        raise ConnectionRefusedError(111, "Connection refused")

    now[0] = 0.0
    with pytest.raises(StorageError) as got:
        retry("upload gs://b/x", down, 20, sleep=lambda s: now.__setitem__(0, now[0] + s), clock=lambda: now[0])
    assert got.value.kind == UNREACHABLE and now[0] <= 20
    assert "upload gs://b/x" in got.value.reason and "unreachable" in got.value.reason
    assert "storage_timeout_s" in got.value.fix
    tries = []
    with pytest.raises(StorageError) as got:  # a refusal is not retried
        retry("upload gs://b/x", lambda left: tries.append(1) or (_ for _ in ()).throw(OSError("Forbidden: x")), 20)
    assert got.value.kind == DENIED and tries == [1] and "roles/storage.objectAdmin" in got.value.fix


def test_an_unreachable_bucket_and_a_refusing_one_get_distinct_lines_quickly(monkeypatch, capfd):
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{_free_port()}")  # nothing listens there
    # what storage.filesystem() imports, imported before the clock starts: the bounds below time the checks, not a
    # worker's first gcsfs import (1 s on a quiet machine; the first bound was missed by 6 s at load 8-12 with it)
    from gcsfs.core import GCSFileSystem  # noqa: F401

    t0 = time.monotonic()
    reason, fix = storage.check_writable("gs://bkt/runs", timeout_s=3)
    assert time.monotonic() - t0 < 8  # retried up to the 3 s deadline only (gcsfs's retry_request sleeps 31 s)
    assert "unreachable" in reason and "gs://bkt" in reason and "network" in fix
    assert "permission" not in reason + fix

    import socket

    def no_dns(host, *args, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    with monkeypatch.context() as m:  # a machine whose DNS cannot resolve the endpoint: said at once, as DNS
        m.setenv("STORAGE_EMULATOR_HOST", "http://gcs.example.invalid:4443")
        m.setattr(socket, "getaddrinfo", no_dns)
        t0 = time.monotonic()
        reason, fix = storage.check_writable("gs://bkt/runs", timeout_s=30)
        assert time.monotonic() - t0 < 10  # not retried for 30 s (instant on a quiet machine; a busy one stretches it)
    assert "unreachable" in reason and "DNS cannot resolve gcs.example.invalid" in reason and "DNS" in fix

    refusing = Refusing()
    try:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", refusing.url)
        t0 = time.monotonic()
        reason, fix = storage.check_writable("gs://bkt/runs", timeout_s=30)
        assert time.monotonic() - t0 < 5  # not retried
    finally:
        refusing.close()
    assert "permission denied" in reason and "unreachable" not in reason
    assert "roles/storage.objectAdmin" in fix
    out, err = capfd.readouterr()
    assert out == "" and err == "", "gcsfs's own log must not reach the console"


def test_a_blip_shorter_than_the_deadline_is_waited_out(fake_gcs, gate, tmp_path):
    url = storage.Url(fake_gcs, "runs/blip")
    mirror = storage.Mirror(tmp_path, url, limit=2, timeout_s=30)
    gate.shut()
    threading.Timer(2.0, gate.open).start()
    mirror.publish(("epoch_0000", {"w.bin": b"w" * 100, "state.json": b"{}"}, 0))
    mirror.close(60)
    mirror.check()  # no error
    assert sorted(storage.list_checkpoints(storage.filesystem(), url).complete) == [0]


def test_an_outage_longer_than_the_deadline_stops_the_mirror_and_asks_the_trainer_to_stop(fake_gcs, gate, tmp_path):
    url = storage.Url(fake_gcs, "runs/outage")
    stop = threading.Event()
    mirror = storage.Mirror(tmp_path, url, limit=2, timeout_s=2, on_give_up=stop.set)
    (tmp_path / "metrics.jsonl").write_text('{"kind": "epoch", "epoch": 0}\n')
    gate.shut()
    t0 = time.monotonic()
    mirror.publish(("epoch_0000", {"w.bin": b"w" * 100, "state.json": b"{}"}, 0))
    assert stop.wait(30), "the mirror never gave up"
    assert time.monotonic() - t0 < 20
    for epoch in (1, 2, 3):  # the trainer's epochs until its next safe point: never blocked, never raised
        mirror.publish((f"epoch_{epoch:04d}", {"w.bin": b"x", "state.json": b"{}"}, epoch))
    mirror.close(10)
    assert time.monotonic() - t0 < 25
    with pytest.raises(StorageError) as got:
        mirror.check()
    line = str(got.value)
    assert "\n" not in line and "unreachable" in line and "local checkpoint" in line and "same command" in line
    gate.open()


def _local_checkpoint(root, epoch: int, damaged: bool = False) -> dict[str, bytes]:
    files = {"trainable.safetensors": b"w%d" % epoch * 50, "optimizer.pt": b"o%d" % epoch * 50}
    state = {"format": 1, "epoch": epoch, "sha256": {n: storage.sha256(d) for n, d in files.items()}}
    files["state.json"] = json.dumps(state).encode()
    d = root / "checkpoints" / f"epoch_{epoch:04d}"
    d.mkdir(parents=True)
    for name, data in files.items():
        (d / name).write_bytes(data[:-1] if damaged and name == "optimizer.pt" else data)
    return files


def test_the_resume_takes_the_newer_local_copy_and_uploads_what_the_bucket_lacks(fake_gcs, tmp_path):
    """The bucket went away after epoch 0 went up; epochs 1-3 were checkpointed locally (4 is torn). The bucket is
    back: the run continues from local epoch 3, not the bucket's epoch 0, and the bucket gets 1-3."""
    fs = storage.filesystem()
    url = storage.Url(fake_gcs, "runs/back")
    run = tmp_path / "run"
    storage.upload_checkpoint(fs, url, "epoch_0000", _local_checkpoint(run, 0), 0, 10)
    want = {e: _local_checkpoint(run, e) for e in (1, 2, 3)}
    _local_checkpoint(run, 4, damaged=True)
    got = storage.restore(run, url, writer=True, timeout_s=10)
    assert got.checkpoint == str(run / "checkpoints" / "epoch_0003")
    assert got.uploaded == ["epoch_0001", "epoch_0002", "epoch_0003"] and got.removed == ["epoch_0004"]
    assert got.skipped == ["epoch_0004"] and not got.downloaded
    listing = storage.list_checkpoints(fs, url)
    assert sorted(listing.complete) == [0, 1, 2, 3] and not listing.incomplete
    assert storage.read_checkpoint(fs, url, "epoch_0003")[1] == want[3]  # verified against its manifest
    # a pod's other worker (not the writer) takes the bucket's newest: now epoch 3, the same as worker 0
    other = storage.restore(tmp_path / "worker1", url, writer=False, timeout_s=10)
    assert other.checkpoint == f"gs://{fake_gcs}/runs/back/checkpoints/epoch_0003"
    # a newer complete checkpoint in the bucket (another VM went on) beats the local ones
    storage.upload_checkpoint(fs, url, "epoch_0005", _local_checkpoint(tmp_path / "vm2", 5), 5, 10)
    again = storage.restore(run, url, writer=True, timeout_s=10)
    assert again.checkpoint.endswith("checkpoints/epoch_0005") and again.checkpoint.startswith("gs://")
    assert (run / "checkpoints" / "epoch_0005" / "state.json").is_file() and not again.uploaded


def test_a_bucket_that_cannot_be_read_at_the_start_is_one_error(monkeypatch, tmp_path):
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{_free_port()}")
    with pytest.raises(StorageError) as got:
        storage.restore(tmp_path / "run", storage.Url("bkt", "runs/x"), timeout_s=2)
    assert got.value.kind == UNREACHABLE and "\n" not in str(got.value)
