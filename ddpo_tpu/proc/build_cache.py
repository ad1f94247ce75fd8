"""Build a directory once into a cache, atomically: the build goes into a temporary sibling that is os.replace'd into
place only when complete, so a killed or concurrent build never leaves a half-written directory at the final path.
Concurrent builders take turns: a lock per build (the flock of proc/lock.py, freed by the kernel however its holder
ends; under the host's lock dir, ~/.cache/ddpo_tpu/locks/, so the cache folder holds only builds) makes a second process
(another run on the same machine, another rank) say whom it waits for and then reuse the finished build instead of
building it again beside the first (two digits-model builds at once took 70x longer on a 2-core machine). Used by the
tiny local models and the reward stand-ins.

A finished entry can still be damaged afterwards (a disk fault, a partial copy of the cache, an edit): before this
check a truncated safetensors file or a config that does not parse passed the "required files exist" test, and
from_pretrained failed on it in every run. An entry is used only when its required files exist, every JSON file in it
parses and every safetensors file is whole (its header parses and its size is the header's 8 + N bytes plus the end of
the last tensor's data, as the format lays them out). Otherwise it is renamed to NAME.damaged-<UTC time> beside it
(never deleted), one warning line names it and why, and it is built again; an entry that cannot be renamed (a
read-only cache) ends the run in one line naming it and the fix."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterable

from ddpo_tpu.env import cache_root, current_umask
from ddpo_tpu.proc.lock import AcceleratorBusy, AcceleratorLock

STALE_TMP_SECONDS = 15 * 60


class ModelLoadError(RuntimeError):
    """A model could not be loaded: the configured one (model.pretrained / model.revision, models/loading.py) or an
    entry of this cache that can be neither used nor set aside; the message says how to fix it. Defined here, on the
    bottom floor, because the build cache raises it too; models/loading.py hands it on as the loaders' error, and the
    training process ends on it in one line."""  # temporary dirs older than this were left by a killed build


def pipeline_files(subfolders: Iterable[str]) -> tuple[str, ...]:
    """What a saved diffusers pipeline with these subfolders must hold to count as complete: model_index.json and
    each part's own config (a scheduler's scheduler_config.json, a tokenizer's tokenizer_config.json, a model's
    config.json)."""
    def config(sub: str) -> str:
        kind = "scheduler" if sub.startswith("scheduler") else "tokenizer" if sub.startswith("tokenizer") else ""
        return f"{sub}/{kind}{'_' if kind else ''}config.json"

    return ("model_index.json", *(config(s) for s in subfolders))


def build_once(cache_dir: str | os.PathLike, name: str, required: Iterable[str],
               build: Callable[[Path], object]) -> Path:
    """Return cache_dir/name, calling build(tmp_dir) first if it is missing, incomplete or damaged (set aside)."""
    required = tuple(required)
    cache = Path(cache_dir).expanduser()
    final = cache / name
    if _damage(final, required) is None:
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
        return final if _damage(final, required) is None else _build(cache, name, required, build)
    finally:
        lock.release()


def _build(cache: Path, name: str, required: tuple[str, ...], build: Callable[[Path], object]) -> Path:
    final = cache / name
    prefix = f".{name}.tmp-"
    _remove_stale(cache, prefix)
    reason = _damage(final, required)
    if final.exists() and reason:  # our builds appear whole and atomically: damaged since, or not ours
        _set_aside(final, reason)
    tmp = Path(tempfile.mkdtemp(dir=cache, prefix=prefix))
    try:
        build(tmp)
        os.chmod(tmp, 0o777 & ~current_umask())  # mkdtemp makes it 0700
        try:
            os.replace(tmp, final)
        except OSError:  # another host sharing the cache (flock is per host) renamed its build into place first
            if _damage(final, required) is not None:
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _damage(path: Path, required: tuple[str, ...]) -> str | None:
    """Why the entry at path cannot be used (missing, incomplete, a damaged file), or None when it can."""
    if not path.is_dir():
        return "missing"
    missing = [f for f in required if not (path / f).is_file()]
    if missing:
        return f"incomplete: no {missing[0]}"
    for f in sorted(path.rglob("*")):
        try:
            if f.suffix == ".json" and f.is_file():
                json.loads(f.read_bytes())
            elif f.suffix == ".safetensors" and f.is_file():
                problem = _safetensors_damage(f)
                if problem:
                    return f"{f.relative_to(path)}: {problem}"
        except ValueError as e:
            return f"{f.relative_to(path)}: JSON that does not parse ({str(e)[:60]})"
        except OSError as e:
            return f"{f.relative_to(path)}: unreadable ({e.strerror or e})"
    return None


def _safetensors_damage(path: Path) -> str | None:
    """A safetensors file is 8 bytes (little-endian u64 N), an N-byte JSON header, then the tensors' bytes, the last
    ending where the file ends (huggingface/safetensors docs, "Format")."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"not a safetensors file ({size} bytes)"
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            return f"truncated ({size} bytes, its header alone says {8 + n})"
        header = json.loads(f.read(n))
    if not isinstance(header, dict):
        return "not a safetensors header"
    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)
            and isinstance(v.get("data_offsets"), list) and len(v["data_offsets"]) == 2]
    want = 8 + n + max(ends, default=0)
    return None if want == size else f"{'truncated' if size < want else 'longer than its tensors'} ({size} bytes, " \
                                     f"its header says {want})"


def _set_aside(final: Path, reason: str) -> None:
    """Rename a damaged entry to NAME.damaged-<UTC time> beside it, saying so in one line; refuse in one line when it
    cannot be renamed."""
    aside = final.with_name(f"{final.name}.damaged-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}")
    try:
        os.replace(final, aside)
    except FileNotFoundError:  # another host sharing the cache moved it first
        return
    except OSError as e:
        raise ModelLoadError(f"the model cache entry {final} is damaged ({reason}) and cannot be moved aside "
                             f"({e.strerror or e}): remove it (rm -r {final}) or give the run a writable cache "
                             f"directory, then run the same command again") from None
    print(f"ddpo_tpu: warning: the model cache entry {final} is damaged ({reason}): moved to {aside.name} beside it "
          f"and built again", file=sys.stderr, flush=True)


def _remove_stale(cache: Path, prefix: str) -> None:
    now = time.time()
    for p in cache.glob(prefix + "*"):
        try:
            if p.is_dir() and now - p.stat().st_mtime > STALE_TMP_SECONDS:
                shutil.rmtree(p, ignore_errors=True)
        except OSError:
            pass
