"""Build a directory once into a cache, atomically: the build goes into a temporary sibling that is os.replace'd into
place only when complete, so a killed or concurrent build never leaves a half-written directory at the final path.
Concurrent builders race harmlessly (the first rename wins, the others discard their copy). Used by the tiny local
model (models/tiny.py) and the tiny aesthetic stand-ins (rewards/tiny_clip.py)."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterable

STALE_TMP_SECONDS = 15 * 60  # temporary dirs older than this were left by a killed build


def build_once(cache_dir: str | os.PathLike, name: str, required: Iterable[str], build: Callable[[Path], object]) -> Path:
    """Return cache_dir/name, calling build(tmp_dir) first if it is missing or incomplete."""
    required = tuple(required)
    cache = Path(cache_dir).expanduser()
    final = cache / name
    if _complete(final, required):
        return final
    cache.mkdir(parents=True, exist_ok=True)
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
        os.chmod(tmp, 0o777 & ~_current_umask())  # mkdtemp makes it 0700
        try:
            os.replace(tmp, final)
        except OSError:  # another process renamed its finished build into place first
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


def _current_umask() -> int:
    """The process umask, read without changing it (os.umask would, briefly, for every thread)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022
