"""Run dirs in a bucket (ddpo_tpu/rundir/storage.py), fast: gs:// URLs, the manifest that marks a checkpoint complete,
rotation, the mirror against a real GCS-compatible server (fake-gcs-server on 127.0.0.1), compose-time checks.
End-to-end runs are in test_bucket_e2e.py."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ddpo_tpu.rundir import storage
from tests.helpers import REPO, clean_env, front_end_in_process, run_train
from tests.helpers_gcs import fake_gcs, gcs_server  # noqa: F401 -- fixtures

pytestmark = pytest.mark.torch_free  # no torch in the test or what it starts (tests/conftest.py)


# --- URLs -------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value", ["gs://my-bucket", "gs://my-bucket/", "gs://my_bucket.x/a/b-c/d_e/"])
def test_good_urls_parse(value):
    assert storage.url_problem(value) is None
    url = storage.parse(value)
    assert str(url).startswith("gs://my") and not str(url).endswith("/")


@pytest.mark.parametrize("value, words", [
    ("gs://", "no bucket"), ("gs:///x", "no bucket"), ("gs://Upper/x", "not a valid bucket name"),
    ("gs://ab/x", "not a valid bucket name"), ("gs://b-ok/a//c", "empty"), ("gs://b-ok/a/../c", "'..'"),
    ("s3://b-ok/x", "s3:// is not supported"), ("gs://b-ok/a*b", "# [ ] * ?")])
def test_bad_urls_are_named(value, words):
    reason, fix = storage.url_problem(value)
    assert words in reason and "output_root=gs://" in fix


def test_local_paths_are_not_urls_and_keep_their_run_dir():
    assert storage.url_problem("outputs") is None and not storage.is_url("outputs")
    assert storage.local_root("outputs") == "outputs"  # local runs: hydra.run.dir exactly as before


def test_bucket_run_dirs_map_to_a_staging_dir_and_back(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    root = storage.local_root("gs://bkt/a/b")
    assert root == str(tmp_path / "ddpo_tpu" / "runs" / "bkt" / "a" / "b")
    assert str(storage.remote_run_dir("gs://bkt/a/b", Path(root) / "smoke-multirun" / "3")) == \
        "gs://bkt/a/b/smoke-multirun/3"
    assert storage.remote_run_dir("outputs", tmp_path) is None


# --- manifests and rotation (pure) ------------------------------------------------------------------------------------

def test_manifest_lists_every_file_and_catches_a_changed_one():
    files = {"a.bin": b"x" * 10, "state.json": b"{}"}
    body = storage.parse_manifest(storage.manifest(3, files))
    assert body["epoch"] == 3 and set(body["files"]) == set(files)
    assert storage.mismatch(body, files) is None
    assert "a.bin" in storage.mismatch(body, {**files, "a.bin": b"x" * 9})
    assert "missing" in storage.mismatch(body, {"state.json": b"{}"})
    assert storage.parse_manifest(b'{"format": 1, "files"') is None  # torn


def test_only_checkpoints_with_a_manifest_are_complete_and_rotation_keeps_the_newest():
    names = ["epoch_0000/MANIFEST.json", "epoch_0000/t.bin", "epoch_0001/MANIFEST.json", "epoch_0001/t.bin",
             "epoch_0002/t.bin", "junk/x", ".tmp/x"]
    listing = storage.group_checkpoints(names)
    assert sorted(listing.complete) == [0, 1] and sorted(listing.incomplete) == [2]
    assert storage.rotation(listing, 1) == ["epoch_0000", "epoch_0002"]
    assert storage.rotation(listing, 0) == ["epoch_0000", "epoch_0002"]  # a limit below 1 still keeps the newest
    assert storage.rotation(storage.group_checkpoints(["epoch_0002/t.bin"]), 1) == ["epoch_0002"]


def test_check_writable_names_a_missing_gcsfs(monkeypatch):
    monkeypatch.setattr(storage, "gcsfs_missing", lambda: True)
    reason, fix = storage.check_writable("gs://bkt/x")
    assert "gcsfs is not installed" in reason and "pip install gcsfs==" in fix


# --- against fake-gcs-server ------------------------------------------------------------------------------------------

def test_the_mirror_uploads_files_then_the_manifest_and_rotates(fake_gcs, tmp_path):
    fs = storage.filesystem()
    url = storage.Url(fake_gcs, "runs/m")
    (tmp_path / "metrics.jsonl").write_text('{"kind": "epoch", "epoch": 0}\n')
    (tmp_path / "lock").write_text("local only")
    mirror = storage.Mirror(tmp_path, url, limit=1)
    for epoch in range(3):
        mirror.publish((f"epoch_{epoch:04d}", {"w.bin": bytes([epoch]) * 100, "state.json": b"{}"}, epoch))
    mirror.close()
    mirror.check()
    listing = storage.list_checkpoints(fs, url)
    assert sorted(listing.complete) == [2] and not listing.incomplete  # limit 1: the newest only
    body, files = storage.read_checkpoint(fs, url, "epoch_0002")
    assert files["w.bin"] == b"\x02" * 100 and body["epoch"] == 2
    assert fs.cat_file(url.join("metrics.jsonl").path).startswith(b'{"kind"')
    assert not fs.exists(url.join("lock").path)


def test_restore_takes_the_newest_complete_checkpoint_and_removes_local_ones_the_bucket_lacks(fake_gcs, tmp_path):
    fs = storage.filesystem()
    url = storage.Url(fake_gcs, "runs/r")
    for epoch in (0, 1):
        files = {"trainable.safetensors": b"w%d" % epoch, "state.json": b"{}"}
        for name, data in files.items():
            fs.pipe_file(url.join("checkpoints", f"epoch_{epoch:04d}", name).path, data)
        fs.pipe_file(url.join("checkpoints", f"epoch_{epoch:04d}", storage.MANIFEST).path,
                     storage.manifest(epoch, files))
    fs.pipe_file(url.join("checkpoints", "epoch_0002", "trainable.safetensors").path, b"half")  # no manifest
    fs.pipe_file(url.join("metrics.jsonl").path, b'{"kind": "epoch", "epoch": 0}\n')
    run = tmp_path / "run"
    (run / "checkpoints" / "epoch_0003").mkdir(parents=True)
    (run / "checkpoints" / "epoch_0003" / "state.json").write_text("{}")  # local work the bucket never got
    got = storage.restore(run, url)
    assert got.checkpoint.endswith("epoch_0001") and got.removed == ["epoch_0003"]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["epoch_0001"]
    assert (run / "checkpoints" / "epoch_0001" / "trainable.safetensors").read_bytes() == b"w1"
    assert (run / "metrics.jsonl").read_text().startswith('{"kind"')
    # a damaged newest one (a file changed after its manifest) is passed over for the previous
    fs.pipe_file(url.join("checkpoints", "epoch_0001", "trainable.safetensors").path, b"xx")
    got = storage.restore(tmp_path / "fresh", url)
    assert got.checkpoint.endswith("epoch_0000") and got.skipped == ["epoch_0001"]


_KILLED_UPLOAD = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from ddpo_tpu.rundir import storage
    url = storage.Url(sys.argv[1], "runs/k")
    fs = storage.filesystem()
    mirror = storage.Mirror(Path(sys.argv[2]), url, limit=3)
    files = lambda e: {"trainable.safetensors": b"w%d" % e * 1000, "state.json": b"{}"}
    mirror.publish(("epoch_0000", files(0), 0))
    mirror.close()
    put = fs.pipe_file
    def slow(path, data, **kw):
        if path.endswith("epoch_0001/" + storage.MANIFEST):
            print("manifest next", flush=True)
            time.sleep(600)
        return put(path, data, **kw)
    fs.pipe_file = slow
    mirror = storage.Mirror(Path(sys.argv[2]), url, limit=3, fs=fs)
    mirror.publish(("epoch_0001", files(1), 1))
    mirror.close()
""")


def test_sigkill_during_a_checkpoint_upload_leaves_the_previous_checkpoint_as_the_resume_point(fake_gcs, tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_UPLOAD, fake_gcs, str(tmp_path)], cwd=REPO,
                            env=clean_env(), stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "manifest next"  # epoch 1's files are up, its manifest is not
    proc.kill()
    proc.wait()
    fs = storage.filesystem()
    url = storage.Url(fake_gcs, "runs/k")
    assert fs.exists(url.join("checkpoints", "epoch_0001", "trainable.safetensors").path)
    got = storage.restore(tmp_path / "fresh-vm", url)
    assert got.checkpoint == f"gs://{fake_gcs}/runs/k/checkpoints/epoch_0000"
    assert [p.name for p in (tmp_path / "fresh-vm" / "checkpoints").iterdir()] == ["epoch_0000"]


# --- compose-time and start checks: one line, exit 2, nothing written -------------------------------------------------

@pytest.mark.parametrize("root, words", [("gs://Bad_Bucket/x", "not a valid bucket name"),
                                         ("gs://", "no bucket name"), ("s3://bkt/x", "s3:// is not supported")])
def test_a_gs_url_that_does_not_parse_is_refused_before_anything_is_written(tmp_path, root, words, monkeypatch,
                                                                            capsys):
    """The first case in a real process (what proves the exit code and the console); the others call the front end's
    main() in this process (tests.helpers.front_end_in_process: the same refusal path, only the process start
    differs)."""
    t0 = time.monotonic()
    if root == "gs://Bad_Bucket/x":
        proc, cwd = run_train(["+experiment=smoke", f"output_root={root}"], tmp_path,
                              XDG_CACHE_HOME=str(tmp_path / "cache")), tmp_path
    else:
        proc, cwd = _in_process(["+experiment=smoke", f"output_root={root}"], tmp_path, monkeypatch, capsys)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(errors) == 1 and errors[0].startswith(f"error: output_root={root}: ") and words in errors[0]
    assert list(cwd.iterdir()) == [], "nothing may be written"
    assert time.monotonic() - t0 < 60


def _in_process(args: list[str], tmp_path: Path, monkeypatch, capsys):
    """The front end's main(args) in this process, in tmp_path/cwd, with the cache there as run_train's: (a
    process-like result, that cwd); nothing else may appear beside it in tmp_path."""
    proc, *_ = front_end_in_process(tmp_path, args, monkeypatch, capsys, XDG_CACHE_HOME=str(tmp_path / "cwd" / "c"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cwd"]
    return proc, tmp_path / "cwd"


def test_a_missing_bucket_is_refused_before_anything_is_written(fake_gcs, tmp_path, monkeypatch, capsys):
    """In-process: the refusal path whose real process is test_a_gs_url_that_does_not_parse's first case."""
    proc, cwd = _in_process(["+experiment=smoke", "output_root=gs://no-such-bucket/runs"], tmp_path, monkeypatch,
                            capsys)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(errors) == 1 and "bucket no-such-bucket does not exist" in errors[0]
    assert "gcloud storage buckets create" in errors[0]
    assert list(cwd.iterdir()) == []
    assert not storage.filesystem().exists("no-such-bucket")
