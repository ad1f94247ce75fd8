"""Build a directory once into a cache, atomically: the build goes into a temporary sibling that is os.replace'd into
place only when complete, so a killed or concurrent build never leaves a half-written directory at the final path.
Concurrent builders take turns: a lock per build (the flock of launch/lock.py, freed by the kernel however its holder
ends; under the host's lock dir, ~/.cache/ddpo_tpu/locks/, so the cache folder holds only builds) makes a second process (another run on the same machine, another rank) say whom it
waits for and then reuse the finished build instead of building it again beside the first (two digits-model builds
at once took 70x longer on a 2-core machine). Used by the tiny local models and the reward stand-ins."""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterable

from ddpo_tpu.env import cache_root
from ddpo_tpu.launch.lock import AcceleratorBusy, AcceleratorLock
from ddpo_tpu.rundir.files import current_umask

STALE_TMP_SECONDS = 15 * 60  # temporary dirs older than this were left by a killed build


def build_once(cache_dir: str | os.PathLike, name: str, required: Iterable[str], build: Callable[[Path], object]) -> Path:
    """Return cache_dir/name, calling build(tmp_dir) first if it is missing or incomplete."""
    required = tuple(required)
    cache = Path(cache_dir).expanduser()
    final = cache / name
    if _complete(final, required):
        return final
    cache.mkdir(parents=True, exist_ok=True)
    where = hashlib.sha256(str(final.resolve()).encode()).hexdigest()[:16]
    lock = AcceleratorLock(cache_root() / "locks" / f"build-{name}-{where}.lock", cache, command=f"building {name}")
    try:
        lock.acquire()
    except AcceleratorBusy as e:
        who = f"pid {e.holder.pid}, started {e.holder.started_utc}" if e.holder else "another process"
        print(f"ddpo_tpu: {final} is being built by {who}: waiting for it, then using it", file=sys.stderr,
              flush=True)
        lock.acquire(timeout=None)
    try:
        return final if _complete(final, required) else _build(cache, name, required, build)
    finally:
        lock.release()


def _build(cache: Path, name: str, required: tuple[str, ...], build: Callable[[Path], object]) -> Path:
    final = cache / name
    prefix = f".{name}.tmp-"
    _remove_stale(cache, prefix)
    if final.exists():  # incomplete and not ours (our builds appear atomically): move it aside, rebuild
        trash = Path(tempfile.mkdtemp(dir=cache, prefix=prefix))
        try:
            os.replace(final, trash / "old")
        except FileNotFoundError:
            pass
        shutil.rmtree(trash, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(dir=cache, prefix=prefix))
    try:
        build(tmp)
        os.chmod(tmp, 0o777 & ~current_umask())  # mkdtemp makes it 0700
        try:
            os.replace(tmp, final)
        except OSError:  # another host sharing the cache (flock is per host) renamed its build into place first
            if not _complete(final, required):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _complete(path: Path, required: tuple[str, ...]) -> bool:
    return all((path / f).is_file() for f in required)


def _remove_stale(cache: Path, prefix: str) -> None:
    now = time.time()
    for p in cache.glob(prefix + "*"):
        try:
            if p.is_dir() and now - p.stat().st_mtime > STALE_TMP_SECONDS:
                shutil.rmtree(p, ignore_errors=True)
        except OSError:
            pass
