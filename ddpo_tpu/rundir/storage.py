"""Run dirs in a bucket: `output_root=gs://BUCKET/PREFIX` (through fsspec + gcsfs).

Decision (docs/operations.md, "Spot VMs and buckets"): the run dir stays a local directory, a staging copy derived
from the URL (`~/.cache/ddpo_tpu/runs/BUCKET/PREFIX/RUN_NAME`, ddpo_tpu/rundir/storage_url.py), so Hydra, the locks, the
heartbeat, train.log and every local writer work unchanged; the bucket (`gs://BUCKET/PREFIX/RUN_NAME`) is the
durable copy.

* The front end restores before it writes anything (`restore`): the run continues from the newest complete and
  verified checkpoint of either copy. A bucket checkpoint is put into the local checkpoints/ (downloaded and checked
  against its manifest); a newer local one (the bucket was away when it was written) is checked against the sha256
  sums in its state.json and uploaded, with every other local one the bucket lacks. Local checkpoints newer than the
  chosen one are damaged or (on a pod's other workers) not the writer's: removed, their epochs redone.
  metrics.jsonl, events.jsonl and train.log are downloaded when the local dir lacks them (a fresh VM).
* The training process's main process mirrors the run dir (`Mirror`): one background thread, a bounded queue.
  At the end of an epoch (`publish`) every local file changed since its last upload goes up, then, on a checkpoint
  epoch, the checkpoint: its files from the host copy the trainer made (rotation may delete the local ones first),
  then `MANIFEST.json` (size and sha256 of each file) last. An object store has no rename: a checkpoint is complete
  when its manifest exists and its files match it. Then the bucket's checkpoints are rotated (never the newest
  complete one; a manifest is deleted before its files). Between epochs the small live files go up every
  `LIVE_SYNC_S` seconds, so `ddpo-status gs://...` follows a run from anywhere.
* Requests retry while the bucket is unreachable, up to `storage_timeout_s` from the first try; a refusal is not
  retried (ddpo_tpu/rundir/storage_faults.py). An upload that gives up asks the trainer to stop at its next safe point,
  after a local checkpoint; the run ends with one `error:` line, exit 1.
* Only process 0 of a multi-host run writes to the bucket; every host's front end restores the same checkpoint.
* Credentials: gcsfs's default chain (GOOGLE_APPLICATION_CREDENTIALS, gcloud application-default login, the VM's
  service account); with STORAGE_EMULATOR_HOST set (tests: fake-gcs-server on 127.0.0.1) no credentials are used.

This module never imports torch (the front end and ddpo-status use it). gcsfs is imported only when a bucket is used.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ddpo_tpu.rundir.storage_faults import (FAILED, StorageError, default_timeout_s, gcsfs_missing, quiet_gcsfs, retry,
                                     unresolvable)
from ddpo_tpu.rundir import checkpoint_layout as layout
from ddpo_tpu.rundir.storage_url import SCHEME, Url, is_url, local_root, parse, remote_run_dir, url_problem  # noqa: F401

MANIFEST = "MANIFEST.json"
MANIFEST_FORMAT = 1
CHECKPOINTS = layout.CHECKPOINTS
# files the live sync sends between epochs (small, changing)
LIVE_FILES = ("events.jsonl", "heartbeat.json", "metrics.jsonl", "train.log")
LIVE_SYNC_S = 30.0
QUEUE_SIZE = 3                   # tasks: an epoch's files and checkpoint queued behind the one in flight
CHECK_TIMEOUT_S = 8.0            # the start's probe: a machine that cannot reach the bucket is told at once
SKIP_NAMES = {"lock"}            # local-only: the run dir's lock (per host)
INSTALL_FIX = "pip install gcsfs==2026.10.1, or bash scripts/setup.sh (requirements.txt pins it)"


# --- the bucket (fsspec + gcsfs) ----------------------------------------------------------------------------------

def filesystem():
    """The gs:// filesystem (fsspec caches the instance). Credentials: gcsfs's default chain, or none for an
    emulator (STORAGE_EMULATOR_HOST)."""
    # gcsfs's core filesystem (an fsspec AsyncFileSystem), not the experimental extension `gcsfs.GCSFileSystem`
    # names by default: that one first asks a gRPC service for the bucket's type (zonal / hierarchical namespace),
    # which an emulator does not serve (60 s timeouts per bucket) and plain buckets do not need
    from gcsfs.core import GCSFileSystem

    from ddpo_tpu.env import storage_emulator_host

    quiet_gcsfs()
    return GCSFileSystem(token="anon" if storage_emulator_host() else None)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def check_writable(value: str, timeout_s: float = CHECK_TIMEOUT_S) -> tuple[str, str] | None:
    """Before anything is written: the bucket exists and takes a write (a probe object, deleted again). Returns
    (reason, fix) or None."""
    if gcsfs_missing():
        return "gcsfs is not installed (needed for gs:// output roots)", INSTALL_FIX
    url = parse(value)
    if (dns := unresolvable()) is not None:  # said at once, not after the retries' deadline
        return dns
    try:
        fs = filesystem()
        fs.invalidate_cache()
        if not retry(f"gs://{url.bucket}", lambda t: fs.exists(url.bucket, timeout=t), timeout_s):
            return (f"bucket {url.bucket} does not exist (or these credentials cannot see it)",
                    f"create it: gcloud storage buckets create gs://{url.bucket} --location=REGION, or fix the name")
        probe = url.join(f".ddpo_tpu-write-check-{os.getpid()}-{time.time_ns()}")
        retry(f"write {probe}", lambda t: fs.pipe_file(probe.path, b"ok\n", timeout=t), timeout_s)
        retry(f"delete {probe}", lambda t: fs.rm_file(probe.path, timeout=t), timeout_s)
    except StorageError as e:
        return e.reason, e.fix
    return None


# --- checkpoints in the bucket (manifest logic is pure) ---------------------------------------------------------------

def manifest(epoch: int, files: dict[str, bytes]) -> bytes:
    """What marks a checkpoint complete, written after its files."""
    body = {"format": MANIFEST_FORMAT, "epoch": epoch, "time": round(time.time(), 3),
            "files": {name: {"size": len(data), "sha256": sha256(data)} for name, data in sorted(files.items())}}
    return (json.dumps(body, indent=1) + "\n").encode()


def parse_manifest(data: bytes) -> dict[str, Any] | None:
    """A manifest's content, or None when it is not one (torn, foreign, another format)."""
    try:
        body = json.loads(data)
    except ValueError:
        return None
    files = body.get("files") if isinstance(body, dict) and body.get("format") == MANIFEST_FORMAT else None
    ok = isinstance(files, dict) and files and all(isinstance(v, dict) and {"sha256", "size"} <= set(v)
                                                   for v in files.values())
    return body if ok else None


def mismatch(body: dict[str, Any], files: dict[str, bytes]) -> str | None:
    """The first file that does not match its manifest entry, or None."""
    for name, want in body["files"].items():
        data = files.get(name)
        if data is None or len(data) != want["size"] or sha256(data) != want["sha256"]:
            return f"{name} is missing" if data is None else f"{name} does not match its sha256 in {MANIFEST}"
    return None


@dataclass(frozen=True)
class Listing:
    """The bucket's checkpoints/ by epoch: those with a manifest (complete) and those without (leftovers)."""

    complete: dict[int, str]    # epoch -> dir name
    incomplete: dict[int, str]


def group_checkpoints(names: list[str]) -> Listing:
    """From object names relative to checkpoints/ ("epoch_0003/MANIFEST.json", ...)."""
    dirs: dict[int, tuple[str, set[str]]] = {}
    for name in names:
        head, _, tail = name.partition("/")
        epoch = layout.epoch_of(head)
        if epoch is not None and tail:
            dirs.setdefault(epoch, (head, set()))[1].add(tail)
    complete = {e: d for e, (d, files) in dirs.items() if MANIFEST in files}
    return Listing(complete, {e: d for e, (d, _files) in dirs.items() if e not in complete})


def rotation(listing: Listing, limit: int) -> list[str]:
    """Checkpoint dirs to delete: complete ones older than the newest `limit` (at least one, the newest, is kept
    always), and leftovers without a manifest (the one writer has nothing in flight while it rotates)."""
    keep = sorted(listing.complete)[-max(limit, 1):]
    old = [listing.complete[e] for e in sorted(listing.complete) if e not in keep]
    return old + [listing.incomplete[e] for e in sorted(listing.incomplete)]


def list_checkpoints(fs, url: Url, timeout_s: float | None = None) -> Listing:
    root = url.join(CHECKPOINTS).path
    fs.invalidate_cache()
    try:
        found = retry(f"list {url.join(CHECKPOINTS)}", lambda t: fs.find(root, timeout=t),
                       timeout_s or default_timeout_s())
    except FileNotFoundError:
        found = []
    return group_checkpoints([f[len(root) + 1:] for f in found if f.startswith(root + "/")])


def _cat(fs, url: Url, timeout_s: float) -> bytes:
    return retry(f"read {url}", lambda t: fs.cat_file(url.path, timeout=t), timeout_s)


def read_checkpoint(fs, url: Url, name: str, timeout_s: float | None = None) -> tuple[dict, dict[str, bytes]]:
    """The files of a complete checkpoint, checked against its manifest; raises StorageError naming what is wrong
    (kind FAILED: damaged; UNREACHABLE / DENIED: the bucket did not answer)."""
    timeout_s = timeout_s or default_timeout_s()
    base = url.join(CHECKPOINTS, name)
    body = parse_manifest(_cat(fs, base.join(MANIFEST), timeout_s))
    if body is None:
        raise StorageError(f"{base}/{MANIFEST} is not a manifest")
    files = {}
    for fname in body["files"]:
        try:
            files[fname] = _cat(fs, base.join(fname), timeout_s)
        except FileNotFoundError:
            raise StorageError(f"{base}/{fname} is listed in its manifest but missing") from None
    bad = mismatch(body, files)
    if bad:
        raise StorageError(f"{base}: {bad}")
    return body, files


def upload_checkpoint(fs, url: Url, name: str, files: dict[str, bytes], epoch: int, timeout_s: float) -> None:
    """Its files, then the manifest (now it is complete)."""
    for fname, data in sorted({**files, MANIFEST: manifest(epoch, files)}.items(), key=lambda kv: kv[0] == MANIFEST):
        target = url.join(CHECKPOINTS, name, fname)
        retry(f"upload {target}", lambda t: fs.pipe_file(target.path, data, timeout=t), timeout_s)


def delete_checkpoint(fs, url: Url, name: str, timeout: float | None = None) -> None:
    """The manifest first (the checkpoint stops being complete in one step), then its files."""
    base = url.join(CHECKPOINTS, name)
    for path, kw in ((base.join(MANIFEST).path, {}), (base.path, {"recursive": True})):
        try:
            fs.rm(path, timeout=timeout, **kw)
        except FileNotFoundError:  # gone already: what deleting wants
            continue


# --- restore (front end, before anything of this attempt is written) --------------------------------------------------

def _local_complete(ckpt_root: Path) -> dict[int, Path]:
    return {layout.epoch_of(p.name): p for p in layout.complete(ckpt_root)}


def local_checkpoint(path: Path) -> dict[str, bytes] | None:
    """The files of a local checkpoint whose state.json parses and whose other files match the sha256 sums it
    holds (ddpo_tpu/training/checkpoint_files.py writes them), or None. Torch-free: the front end checks before a
    resume."""
    try:
        files = {p.name: p.read_bytes() for p in Path(path).iterdir() if p.is_file()}
        sums = json.loads(files["state.json"]).get("sha256")
    except (OSError, KeyError, ValueError, AttributeError):
        return None
    ok = isinstance(sums, dict) and all(n in files and sha256(files[n]) == s for n, s in sums.items())
    return files if ok else None


@dataclass
class Restored:
    checkpoint: str | None            # the checkpoint the run continues from (None: from the start)
    downloaded: list[str]             # files fetched into the local dir
    removed: list[str]                # local checkpoints past the chosen one (their epochs are redone)
    skipped: list[str]                # damaged checkpoints passed over (bucket or local)
    uploaded: list[str]               # local checkpoints the bucket lacked, uploaded


def _choose(fs, url, listing, local, writer, timeout_s, out):
    """The newest checkpoint of either copy that verifies: (epoch, "bucket", files) or (epoch, "local", files)."""
    epochs = sorted(set(listing.complete) | (set(local) if writer else set()), reverse=True)
    for epoch in epochs:
        files = local_checkpoint(local[epoch]) if writer and epoch in local else None
        if files is not None:
            return epoch, "local", files
        if epoch in listing.complete:
            try:
                return epoch, "bucket", read_checkpoint(fs, url, listing.complete[epoch], timeout_s)[1]
            except StorageError as e:
                if e.kind != FAILED:
                    raise
                out.skipped.append(listing.complete[epoch])
                continue
        out.skipped.append(local[epoch].name)
    return None


def restore(run_dir: Path, url: Url, say: Callable[[str], None] = lambda line: None, timeout_s: float | None = None,
            writer: bool | None = None) -> Restored:
    """Make the local run dir continue from the newest verified checkpoint of either copy (the module docstring).
    `writer`: this host uploads (default: worker 0 of a pod, or a single VM); others take the bucket's newest."""
    from ddpo_tpu.env import tpu_worker_id

    timeout_s = timeout_s or default_timeout_s()
    writer = tpu_worker_id() in (None, 0) if writer is None else writer
    fs = filesystem()
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    out = Restored(None, [], [], [], [])
    listing = list_checkpoints(fs, url, timeout_s)
    local_ckpts = run_dir / CHECKPOINTS
    local = _local_complete(local_ckpts)
    chosen = _choose(fs, url, listing, local, writer, timeout_s, out)
    keep = None
    if chosen is not None:
        keep, source, files = chosen
        name = layout.name(keep)
        have = local.get(keep)
        out.checkpoint = str(url.join(CHECKPOINTS, name)) if source == "bucket" else str(local_ckpts / name)
        if source == "bucket" and not (have is not None and local_checkpoint(have) == files):
            tmp = layout.temporary(local_ckpts, keep, "restore")
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            for fname, data in files.items():
                layout.write_synced(tmp / fname, data)
            if have is not None:
                shutil.rmtree(have)
            os.replace(tmp, local_ckpts / name)
            out.downloaded.append(f"{CHECKPOINTS}/{name}")
        newest_up = max(listing.complete, default=-1)
        for epoch, path in sorted(local.items()):  # what the bucket lacks: verified local ones up to the chosen
            if writer and newest_up < epoch <= keep and (data := local_checkpoint(path)) is not None:
                upload_checkpoint(fs, url, path.name, data, epoch, timeout_s)
                out.uploaded.append(path.name)
    for epoch, path in sorted(local.items()):
        if keep is None or epoch > keep:  # past the resume point: redone
            shutil.rmtree(path, ignore_errors=True)
            out.removed.append(path.name)
    for name in LIVE_FILES:
        if name == "heartbeat.json" or (run_dir / name).exists():
            continue
        try:
            data = _cat(fs, url.join(name), timeout_s)
        except FileNotFoundError:
            continue
        layout.write_synced(run_dir / name, data)
        out.downloaded.append(name)
    if out.checkpoint or out.downloaded or out.removed:
        say(f"ddpo_tpu: bucket {url}: continuing from {out.checkpoint or 'the start (no complete checkpoint)'}"
            + (f"; fetched {', '.join(out.downloaded)}" if out.downloaded else "")
            + (f"; uploaded local checkpoint(s) the bucket lacked: {', '.join(out.uploaded)}" if out.uploaded else "")
            + (f"; local checkpoint(s) past it removed: {', '.join(out.removed)}" if out.removed else ""))
    return out


def upload_files(run_dir: Path, url: Url, names: list[str], timeout_s: float | None = None) -> None:
    """Copy local files of the run dir to the bucket now (the front end's config, parity, env and final logs)."""
    fs = filesystem()
    for name in names:
        path = Path(run_dir) / name
        if path.is_file():
            data = path.read_bytes()
            retry(f"upload {url.join(name)}", lambda t: fs.pipe_file(url.join(name).path, data, timeout=t),
                   timeout_s or default_timeout_s())


# --- the mirror (training process, main process only) -----------------------------------------------------------------

class Mirror:
    """Uploads the run dir to the bucket from one background thread (see the module docstring). When an upload
    gives up (after `timeout_s`), the thread stops uploading, keeps the error for `check`, and calls `on_give_up`
    once (the trainer: stop at the next safe point, after a local checkpoint)."""

    def __init__(self, run_dir: Path, url: Url, limit: int, queue_size: int = QUEUE_SIZE,
                 live_every: float = LIVE_SYNC_S, fs=None, sleep: Callable[[float], None] = time.sleep,
                 timeout_s: float | None = None, on_give_up: Callable[[], None] | None = None):
        self.run_dir, self.url, self.limit, self.live_every = Path(run_dir), url, limit, live_every
        self.fs = fs if fs is not None else filesystem()
        self.timeout_s = timeout_s or default_timeout_s()
        self._sleep = sleep
        self._on_give_up = on_give_up
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._sent: dict[str, tuple[int, int]] = {}  # relative path -> (size, mtime_ns) uploaded
        self.error: str | None = None
        self.seconds = 0.0  # time spent uploading (for the benchmark)
        self.uploaded_bytes = 0
        self._thread = threading.Thread(target=self._run, name="ddpo-bucket-mirror", daemon=True)
        self._thread.start()

    # called by the trainer's main thread
    def publish(self, checkpoint: tuple[str, dict[str, bytes], int] | None = None) -> None:
        """Queue the changed files of the run dir, then (name, files, epoch) of a committed checkpoint. Blocks only
        when the queue is full. After a give-up: nothing is queued; without `on_give_up`, raises StorageError."""
        if self.error is not None:
            if self._on_give_up is None:
                self.check()
            return
        self._queue.put(("files", None))
        if checkpoint is not None:
            self._queue.put(("checkpoint", checkpoint))

    def check(self) -> None:
        if self.error is not None:
            raise StorageError(self.error)

    def close(self, timeout: float | None = None) -> None:
        """Send what is queued and the changed files, then stop the thread (the end of the process)."""
        if not self._thread.is_alive():
            return
        self._queue.put(("files", None))
        self._queue.put(("stop", None))
        self._thread.join(timeout)

    # the thread
    def _run(self) -> None:
        while True:
            try:
                kind, arg = self._queue.get(timeout=self.live_every)
            except queue.Empty:
                kind, arg = "live", None
            try:
                t0 = time.perf_counter()
                if kind == "stop":
                    return
                if self.error is not None:
                    continue  # given up: the queue drains without waiting on the bucket again
                if kind == "files":
                    self._send_changed()
                elif kind == "live":
                    self._send_changed(LIVE_FILES)
                elif kind == "checkpoint":
                    self._send_checkpoint(*arg)
                self.seconds += time.perf_counter() - t0
            except Exception as e:  # noqa: BLE001 -- kept for the main thread (check), never kills the thread
                self._give_up(e)
            finally:
                if kind != "live":
                    self._queue.task_done()

    def _give_up(self, e: Exception) -> None:
        if self.error is not None:
            return
        reason, fix = (e.reason, e.fix) if isinstance(e, StorageError) else (f"{type(e).__name__}: {e}", "")
        self.error = (f"{reason}: the bucket copy of this run is behind; the run stops after a local checkpoint "
                      f"({fix + '; ' if fix else ''}the same command then resumes from the newest checkpoint, local "
                      f"or in the bucket, and uploads what the bucket lacks)")
        if self._on_give_up is not None:
            self._on_give_up()

    def _changed(self, only: tuple[str, ...] | None) -> list[tuple[str, Path, tuple[int, int]]]:
        out = []
        paths = ((self.run_dir / n for n in only) if only is not None else self.run_dir.rglob("*"))
        for path in paths:
            rel = path.relative_to(self.run_dir)
            if (rel.parts[0] in (CHECKPOINTS, *SKIP_NAMES) or any(p.startswith(".") for p in rel.parts)):
                continue
            try:
                st = path.stat()
            except FileNotFoundError:
                continue
            if not path.is_file():
                continue
            key = (st.st_size, st.st_mtime_ns)
            if self._sent.get(rel.as_posix()) != key:
                out.append((rel.as_posix(), path, key))
        return sorted(out)

    def _send_changed(self, only: tuple[str, ...] | None = None) -> None:
        for rel, path, key in self._changed(only):
            try:
                data = path.read_bytes()
            except FileNotFoundError:
                continue
            target = self.url.join(rel)
            retry(f"upload {target}", lambda t: self.fs.pipe_file(target.path, data, timeout=t), self.timeout_s,
                   self._sleep)
            self.uploaded_bytes += len(data)
            self._sent[rel] = key

    def _send_checkpoint(self, name: str, files: dict[str, bytes], epoch: int) -> None:
        upload_checkpoint(self.fs, self.url, name, files, epoch, self.timeout_s)
        self.uploaded_bytes += sum(len(d) for d in files.values())
        for doomed in rotation(list_checkpoints(self.fs, self.url, self.timeout_s), self.limit):
            retry(f"delete {self.url.join(CHECKPOINTS, doomed)}",
                   lambda t: delete_checkpoint(self.fs, self.url, doomed, t), self.timeout_s, self._sleep)


# --- reading a bucket run dir (ddpo-status) --------------------------------------------------------------------------

STATUS_FILES = ("config.yaml", "events.jsonl", "metrics.jsonl", "heartbeat.json", "parity.json", "train.log")


def snapshot(value: str, into: Path, timeout_s: float = CHECK_TIMEOUT_S) -> Path:
    """The files ddpo-status reads, copied from the bucket run dir `value` into the local dir `into` (complete
    checkpoints as empty dirs, with the manifest's time as their mtime). Raises FileNotFoundError when the bucket
    has no run there, StorageError when it cannot be read."""
    url = parse(value)
    fs = filesystem()
    fs.invalidate_cache()
    into = Path(into)
    into.mkdir(parents=True, exist_ok=True)
    for name in STATUS_FILES:
        try:
            data = _cat(fs, url.join(name), timeout_s)
        except FileNotFoundError:
            continue
        (into / name).write_bytes(data)
        if name in ("heartbeat.json", "train.log", "events.jsonl", "metrics.jsonl"):
            try:  # what the status derives from file times: their times in the bucket
                mtime = fs.info(url.join(name).path).get("mtime") or fs.modified(url.join(name).path)
                t = mtime.timestamp() if hasattr(mtime, "timestamp") else float(mtime)
                os.utime(into / name, (t, t))
            except Exception:  # noqa: BLE001 -- a missing time only makes the activity rule less precise
                pass
    if not (into / "config.yaml").is_file():
        raise FileNotFoundError(f"{url}: no config.yaml there, so not a ddpo_tpu run dir in the bucket")
    listing = list_checkpoints(fs, url, timeout_s)
    for epoch, name in sorted(listing.complete.items()):
        (into / CHECKPOINTS / name).mkdir(parents=True, exist_ok=True)
        try:
            body = parse_manifest(_cat(fs, url.join(CHECKPOINTS, name, MANIFEST), timeout_s)) or {}
            t = float(body.get("time") or time.time())
            os.utime(into / CHECKPOINTS / name, (t, t))
        except (OSError, ValueError, StorageError):
            pass
    return into
