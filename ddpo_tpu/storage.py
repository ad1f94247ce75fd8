"""Run dirs in a bucket: `output_root=gs://BUCKET/PREFIX` (through fsspec + gcsfs).

Decision (docs/operations.md, "Spot VMs and buckets"): the run dir stays a local directory, a staging copy derived
from the URL (`~/.cache/ddpo_tpu/runs/BUCKET/PREFIX/RUN_NAME`, `local_root`), so Hydra, the locks, the heartbeat,
train.log and every local writer work unchanged; the bucket (`gs://BUCKET/PREFIX/RUN_NAME`) is the durable copy.

* The front end restores before it writes anything (`restore`): the bucket decides where a run continues. The
  newest complete checkpoint in the bucket is put into the local checkpoints/ (downloaded and checked when it is not
  there already), local checkpoints the bucket does not have are removed (their epochs are redone: the bucket has no
  outputs of them either), and metrics.jsonl, events.jsonl and train.log are downloaded when the local dir lacks them
  (a fresh VM). Then the trainer's resume() runs as on a local run dir.
* The training process's main process mirrors the run dir (`Mirror`): one background thread, a bounded queue.
  At the end of an epoch (`publish`) every local file changed since its last upload goes up (weights, sample grids,
  metrics.jsonl, events.jsonl, train.log, heartbeat.json), then, on a checkpoint epoch, the checkpoint: its files
  from the host copy the trainer made (bytes in the queue, not the local files, which rotation may delete first),
  then `MANIFEST.json` (size and sha256 of each file) last. An object store has no rename: a checkpoint is complete
  when its manifest exists and its files match it. Then the bucket's checkpoints are rotated (never the newest
  complete one; a manifest is deleted before its files). Between epochs the small live files go up every
  `LIVE_SYNC_S` seconds, so `ddpo-status gs://...` follows a run from anywhere.
* Training waits for uploads only when the queue is full (an epoch's files and checkpoint wait behind
  the one uploading), and at the end of the process (run end,
  SIGTERM, failure: the queue is drained, because the next start on a fresh VM resumes from the bucket). A SIGKILL
  or a lost VM loses at most what was not uploaded: the epoch in flight and any epoch whose upload was still queued
  (at most two), all of them redone by the next start, which continues from the newest complete checkpoint.
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
import re
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

SCHEME = "gs"
MANIFEST = "MANIFEST.json"
MANIFEST_FORMAT = 1
CHECKPOINTS = "checkpoints"
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$", re.S)
# Google's bucket naming rules (the common case: no dotted names over 63 characters)
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9._-]{1,61}[a-z0-9]$")
_CKPT = re.compile(r"^epoch_(\d{4,})$")
# files the live sync sends between epochs (small, changing)
LIVE_FILES = ("events.jsonl", "heartbeat.json", "metrics.jsonl", "train.log")
LIVE_SYNC_S = 30.0
QUEUE_SIZE = 3                   # tasks: an epoch's files and checkpoint queued behind the one in flight
RETRIES = 4                      # tries of one upload after the first, with 1, 2, 4, 8 s between them
SKIP_NAMES = {"lock"}            # local-only: the run dir's lock (per host)
INSTALL_FIX = "pip install gcsfs==2026.10.1, or bash scripts/setup.sh (requirements.txt pins it)"


class StorageError(RuntimeError):
    """The bucket refused or lost a write that a resume needs (after retries)."""


# --- URLs (pure) ------------------------------------------------------------------------------------------------------

def is_url(value: str) -> bool:
    return bool(_URL.match(str(value).strip()))


@dataclass(frozen=True)
class Url:
    bucket: str
    prefix: str = ""  # no leading or trailing "/"

    @property
    def path(self) -> str:
        """The fsspec path (no scheme)."""
        return f"{self.bucket}/{self.prefix}" if self.prefix else self.bucket

    def join(self, *parts: str) -> Url:
        extra = "/".join(p.strip("/") for p in parts if p.strip("/"))
        return Url(self.bucket, f"{self.prefix}/{extra}".strip("/") if extra else self.prefix)

    def __str__(self) -> str:
        return f"{SCHEME}://{self.path}"


def url_problem(value: str) -> tuple[str, str] | None:
    """Why `value` is not a usable gs:// URL, as (reason, fix); None when it is one (or is not a URL at all)."""
    m = _URL.match(str(value).strip())
    if not m:
        return None
    scheme, rest = m.group(1), m.group(2)
    example = "gs://my-bucket/ddpo-runs"
    if scheme.lower() != SCHEME:
        return f"{scheme}:// is not supported (only gs:// buckets and local directories)", f"e.g. output_root={example}"
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        return "no bucket name after gs://", f"e.g. output_root={example}"
    if not _BUCKET.match(bucket) or ".." in bucket:
        return (f"{bucket!r} is not a valid bucket name (3-63 characters: lowercase letters, digits, '-', '_', '.'; "
                f"starting and ending with a letter or digit)", f"e.g. output_root={example}")
    parts = prefix.rstrip("/").split("/") if prefix.rstrip("/") else []
    if any(p in ("", ".", "..") for p in parts):
        return "the path after the bucket has an empty, '.' or '..' part", f"e.g. output_root={example}"
    if any(ord(c) < 32 or c in "#[]*?" for c in prefix):
        return "the path after the bucket has a control character or one of # [ ] * ?", f"e.g. output_root={example}"
    return None


def parse(value: str) -> Url:
    problem = url_problem(value)
    if problem is not None or not is_url(value):
        raise ValueError(f"{value!r}: {problem[0] if problem else 'not a gs:// URL'}")
    rest = _URL.match(str(value).strip()).group(2)
    bucket, _, prefix = rest.partition("/")
    return Url(bucket, prefix.strip("/"))


def local_root(output_root: str) -> str:
    """Where run dirs of `output_root` live on this machine: itself for a local path, the staging dir of a bucket
    URL (also Hydra's `hydra.run.dir` root, through the `ddpo_local_root` resolver)."""
    if not is_url(output_root) or url_problem(output_root) is not None:
        return output_root
    from ddpo_tpu.launch.env import cache_root  # the one module that reads the environment

    url = parse(output_root)
    return str(cache_root() / "runs" / url.bucket / url.prefix) if url.prefix else str(cache_root() / "runs" /
                                                                                      url.bucket)


def remote_run_dir(output_root: str, run_dir: Path) -> Url | None:
    """The bucket copy of a local run dir (None for a local output_root): the same path below the root."""
    if not is_url(output_root):
        return None
    rel = Path(run_dir).resolve().relative_to(Path(local_root(output_root)).expanduser().resolve())
    return parse(output_root).join(*rel.parts)


# --- the bucket (fsspec + gcsfs) ----------------------------------------------------------------------------------

def gcsfs_missing() -> bool:
    import importlib.util

    return importlib.util.find_spec("gcsfs") is None


def filesystem():
    """The gs:// filesystem (fsspec caches the instance). Credentials: gcsfs's default chain, or none for an
    emulator (STORAGE_EMULATOR_HOST)."""
    # gcsfs's core filesystem (an fsspec AsyncFileSystem), not the experimental extension `gcsfs.GCSFileSystem`
    # names by default: that one first asks a gRPC service for the bucket's type (zonal / hierarchical namespace),
    # which an emulator does not serve (60 s timeouts per bucket) and plain buckets do not need
    from gcsfs.core import GCSFileSystem

    from ddpo_tpu.launch.env import storage_emulator_host

    return GCSFileSystem(token="anon" if storage_emulator_host() else None)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def check_writable(value: str) -> tuple[str, str] | None:
    """Before anything is written: the bucket exists and takes a write (a probe object, deleted again). Returns
    (reason, fix) or None."""
    if gcsfs_missing():
        return "gcsfs is not installed (needed for gs:// output roots)", INSTALL_FIX
    url = parse(value)
    try:
        fs = filesystem()
        fs.invalidate_cache()
        if not fs.exists(url.bucket):
            return (f"bucket {url.bucket} does not exist (or these credentials cannot see it)",
                    f"create it: gcloud storage buckets create gs://{url.bucket} --location=REGION, or fix the name")
        probe = url.join(f".ddpo_tpu-write-check-{os.getpid()}-{time.time_ns()}").path
        fs.pipe_file(probe, b"ok\n")
        fs.rm_file(probe)
    except Exception as e:  # noqa: BLE001 -- auth, permission and network errors all end here, named
        return (f"cannot write to {url} ({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''})",
                "grant this VM's service account roles/storage.objectAdmin on the bucket, or run `gcloud auth "
                "application-default login` / set GOOGLE_APPLICATION_CREDENTIALS")
    return None


def _retry(what: str, fn: Callable[[], Any], sleep: Callable[[float], None] = time.sleep) -> Any:
    for attempt in range(RETRIES + 1):
        try:
            return fn()
        except FileNotFoundError:
            raise
        except Exception as e:  # noqa: BLE001 -- gcsfs raises OSError, aiohttp and google-auth errors
            if attempt == RETRIES:
                raise StorageError(f"{what}: {type(e).__name__}: {e}") from e
            sleep(2 ** attempt)


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
    if not isinstance(body, dict) or body.get("format") != MANIFEST_FORMAT or not isinstance(body.get("files"), dict):
        return None
    files = body["files"]
    if not files or not all(isinstance(v, dict) and "sha256" in v and "size" in v for v in files.values()):
        return None
    return body


def mismatch(body: dict[str, Any], files: dict[str, bytes]) -> str | None:
    """The first file that does not match its manifest entry, or None."""
    for name, want in body["files"].items():
        data = files.get(name)
        if data is None:
            return f"{name} is missing"
        if len(data) != want["size"] or sha256(data) != want["sha256"]:
            return f"{name} does not match its sha256 in {MANIFEST}"
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
        m = _CKPT.match(head)
        if m and tail:
            dirs.setdefault(int(m.group(1)), (head, set()))[1].add(tail)
    complete = {e: d for e, (d, files) in dirs.items() if MANIFEST in files}
    return Listing(complete, {e: d for e, (d, _files) in dirs.items() if e not in complete})


def rotation(listing: Listing, limit: int) -> list[str]:
    """Checkpoint dirs to delete: complete ones older than the newest `limit` (at least one, the newest, is kept
    always), and leftovers without a manifest (the one writer has nothing in flight while it rotates)."""
    keep = sorted(listing.complete)[-max(limit, 1):]
    old = [listing.complete[e] for e in sorted(listing.complete) if e not in keep]
    return old + [listing.incomplete[e] for e in sorted(listing.incomplete)]


def list_checkpoints(fs, url: Url) -> Listing:
    root = url.join(CHECKPOINTS).path
    fs.invalidate_cache()
    try:
        found = fs.find(root)
    except FileNotFoundError:
        found = []
    return group_checkpoints([f[len(root) + 1:] for f in found if f.startswith(root + "/")])


def read_checkpoint(fs, url: Url, name: str) -> tuple[dict[str, Any], dict[str, bytes]]:
    """The files of a complete checkpoint, checked against its manifest; raises StorageError naming what is wrong."""
    base = url.join(CHECKPOINTS, name)
    body = parse_manifest(fs.cat_file(base.join(MANIFEST).path))
    if body is None:
        raise StorageError(f"{base}/{MANIFEST} is not a manifest")
    files = {}
    for fname in body["files"]:
        try:
            files[fname] = fs.cat_file(base.join(fname).path)
        except FileNotFoundError:
            raise StorageError(f"{base}/{fname} is listed in its manifest but missing") from None
    bad = mismatch(body, files)
    if bad:
        raise StorageError(f"{base}: {bad}")
    return body, files


def delete_checkpoint(fs, url: Url, name: str) -> None:
    """The manifest first (the checkpoint stops being complete in one step), then its files."""
    base = url.join(CHECKPOINTS, name)
    try:
        fs.rm_file(base.join(MANIFEST).path)
    except FileNotFoundError:
        pass
    try:
        fs.rm(base.path, recursive=True)
    except FileNotFoundError:
        pass


# --- restore (front end, before anything of this attempt is written) --------------------------------------------------

def _local_complete(ckpt_root: Path) -> dict[int, Path]:
    if not ckpt_root.is_dir():
        return {}
    out = {}
    for p in ckpt_root.iterdir():
        m = _CKPT.match(p.name)
        if m and p.is_dir() and (p / "state.json").is_file():
            out[int(m.group(1))] = p
    return out


def _write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


@dataclass
class Restored:
    checkpoint: str | None            # the bucket checkpoint the run continues from (None: from the start)
    downloaded: list[str]             # files fetched into the local dir
    removed: list[str]                # local checkpoints the bucket does not have (their epochs are redone)
    skipped: list[str]                # damaged bucket checkpoints passed over


def restore(run_dir: Path, url: Url, say: Callable[[str], None] = lambda line: None) -> Restored:
    """Make the local run dir continue where the bucket is (see the module docstring)."""
    fs = filesystem()
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    out = Restored(None, [], [], [])
    listing = list_checkpoints(fs, url)
    local_ckpts = run_dir / CHECKPOINTS
    local = _local_complete(local_ckpts)
    chosen = None
    for epoch in sorted(listing.complete, reverse=True):
        name = listing.complete[epoch]
        try:
            body, files = read_checkpoint(fs, url, name)
        except StorageError as e:
            out.skipped.append(name)
            say(f"ddpo_tpu: skipping damaged checkpoint in the bucket: {e}")
            continue
        chosen = (epoch, name, body, files)
        break
    keep = None
    if chosen is not None:
        epoch, name, body, files = chosen
        keep = epoch
        out.checkpoint = str(url.join(CHECKPOINTS, name))
        have = local.get(epoch)
        same = have is not None and all((have / f).is_file() and (have / f).read_bytes() == d
                                        for f, d in files.items())
        if not same:
            tmp = local_ckpts / f".tmp-{name}-restore"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            for fname, data in files.items():
                _write_file(tmp / fname, data)
            if have is not None:
                shutil.rmtree(have)
            os.replace(tmp, local_ckpts / name)
            out.downloaded.append(f"{CHECKPOINTS}/{name}")
    for epoch, path in sorted(local.items()):
        if keep is None or epoch > keep:  # not in the bucket: redone, as its outputs are not there either
            shutil.rmtree(path, ignore_errors=True)
            out.removed.append(path.name)
    for name in LIVE_FILES:
        if name == "heartbeat.json" or (run_dir / name).exists():
            continue
        try:
            data = fs.cat_file(url.join(name).path)
        except FileNotFoundError:
            continue
        _write_file(run_dir / name, data)
        out.downloaded.append(name)
    if out.checkpoint or out.downloaded or out.removed:
        say(f"ddpo_tpu: bucket {url}: continuing from {out.checkpoint or 'the start (no complete checkpoint)'}"
            + (f"; fetched {', '.join(out.downloaded)}" if out.downloaded else "")
            + (f"; local checkpoint(s) not in the bucket removed: {', '.join(out.removed)}" if out.removed else ""))
    return out


def upload_files(run_dir: Path, url: Url, names: list[str]) -> None:
    """Copy local files of the run dir to the bucket now (the front end's config, parity, env and final logs)."""
    fs = filesystem()
    for name in names:
        path = Path(run_dir) / name
        if path.is_file():
            data = path.read_bytes()
            _retry(f"upload {url.join(name)}", lambda: fs.pipe_file(url.join(name).path, data))


# --- the mirror (training process, main process only) -----------------------------------------------------------------

class Mirror:
    """Uploads the run dir to the bucket from one background thread (see the module docstring)."""

    def __init__(self, run_dir: Path, url: Url, limit: int, queue_size: int = QUEUE_SIZE,
                 live_every: float = LIVE_SYNC_S, fs=None, sleep: Callable[[float], None] = time.sleep):
        self.run_dir, self.url, self.limit = Path(run_dir), url, limit
        self.fs = fs if fs is not None else filesystem()
        self.live_every = live_every
        self._sleep = sleep
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._sent: dict[str, tuple[int, int]] = {}  # relative path -> (size, mtime_ns) uploaded
        self._lock = threading.Lock()
        self.error: str | None = None
        self.seconds = 0.0  # time spent uploading (for the benchmark)
        self.uploaded_bytes = 0
        self._thread = threading.Thread(target=self._run, name="ddpo-bucket-mirror", daemon=True)
        self._thread.start()

    # called by the trainer's main thread
    def publish(self, checkpoint: tuple[str, dict[str, bytes], int] | None = None) -> None:
        """Queue the changed files of the run dir, then (name, files, epoch) of a committed checkpoint. Blocks only
        when the queue is full. Raises StorageError when an earlier upload failed for good."""
        self.check()
        self._queue.put(("files", None))
        if checkpoint is not None:
            self._queue.put(("checkpoint", checkpoint))

    def check(self) -> None:
        if self.error is not None:
            raise StorageError(f"{self.error}: the bucket copy of this run is behind (check the bucket and its "
                               f"permissions; the same command then resumes from the newest complete checkpoint "
                               f"there)")

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
                if kind == "files":
                    self._send_changed()
                elif kind == "live":
                    self._send_changed(LIVE_FILES)
                elif kind == "checkpoint":
                    self._send_checkpoint(*arg)
                self.seconds += time.perf_counter() - t0
            except Exception as e:  # noqa: BLE001 -- kept for the main thread (check), never kills the thread
                if self.error is None:
                    self.error = str(e)
            finally:
                if kind != "live":
                    self._queue.task_done()

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
            self._put(rel, data)
            self._sent[rel] = key

    def _put(self, rel: str, data: bytes) -> None:
        target = self.url.join(rel)
        _retry(f"upload {target}", lambda: self.fs.pipe_file(target.path, data), self._sleep)
        self.uploaded_bytes += len(data)

    def _send_checkpoint(self, name: str, files: dict[str, bytes], epoch: int) -> None:
        for fname, data in sorted(files.items()):
            self._put(f"{CHECKPOINTS}/{name}/{fname}", data)
        self._put(f"{CHECKPOINTS}/{name}/{MANIFEST}", manifest(epoch, files))  # last: now it is complete
        listing = _retry(f"list {self.url.join(CHECKPOINTS)}", lambda: list_checkpoints(self.fs, self.url),
                         self._sleep)
        for doomed in rotation(listing, self.limit):
            _retry(f"delete {self.url.join(CHECKPOINTS, doomed)}",
                   lambda: delete_checkpoint(self.fs, self.url, doomed), self._sleep)


# --- reading a bucket run dir (ddpo-status) --------------------------------------------------------------------------

STATUS_FILES = ("config.yaml", "events.jsonl", "metrics.jsonl", "heartbeat.json", "parity.json", "train.log")


def snapshot(value: str, into: Path) -> Path:
    """The files ddpo-status reads, copied from the bucket run dir `value` into the local dir `into` (complete
    checkpoints as empty dirs, with the manifest's time as their mtime). Raises FileNotFoundError when the bucket
    has no run there."""
    url = parse(value)
    fs = filesystem()
    fs.invalidate_cache()
    into = Path(into)
    into.mkdir(parents=True, exist_ok=True)
    for name in STATUS_FILES:
        try:
            data = fs.cat_file(url.join(name).path)
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
    listing = list_checkpoints(fs, url)
    for epoch, name in sorted(listing.complete.items()):
        (into / CHECKPOINTS / name).mkdir(parents=True, exist_ok=True)
        try:
            body = parse_manifest(fs.cat_file(url.join(CHECKPOINTS, name, MANIFEST).path)) or {}
            t = float(body.get("time") or time.time())
            os.utime(into / CHECKPOINTS / name, (t, t))
        except (OSError, ValueError):
            pass
    return into
