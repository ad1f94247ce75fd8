"""Damaged entries of torch.compile's cache (distributed.compile_cache_dir), found and set aside before a run starts.

Measured with torch 2.9 (inductor, FX graph and AOTAutograd caches on, a compiled forward and backward; one entry of
a warm cache truncated to half or overwritten with random bytes, then the same compile in a fresh process):
- an FX graph or AOTAutograd entry (fxgraph/**, aotautograd/**: pickles): torch logs a warning with a traceback per
  entry, compiles again and writes the new entry beside the bad one, which stays and warns on every later run;
- a generated module (XX/cKEY.py): "RuntimeError: Failed to import ..." from inside dynamo, exit 1, every run (torch
  writes a module only when its path is missing, codecache.py write());
- a compiled kernel (XX/cKEY.so, XX/cKEY.main.so): truncated, the process dies of SIGBUS with no message at all
  (exit 135); random bytes, an ImportError traceback; every run. A SIGKILL while the C++ compiler writes one leaves
  exactly this (the compiler writes the .so in place, under inductor's lock locks/cKEY.lock);
- a C++ source beside its .so: never read while the .so exists;
- one of inductor's CPU-feature probes (XX/cKEY.so of a `__avx_chk_kernel` program, cpu_vec_isa.py, loaded in a
  subprocess) cut short: nothing crashes, inductor decides the CPU lacks that instruction set and compiles other
  kernels: with the AVX-512 probe truncated, exit 0 and a sum of 8.2e31 where it is 47.0; with every probe, a C++
  compile error (measured 2026-11-29, an AVX-512 machine).
So a damaged entry warns forever, crashes the same command again or changes its numbers. Each kind is checked here
without importing torch (the front end runs this before the training process starts):
- pickles are named by the sha256 of their bytes (codecache.py FxGraphCache._write_to_local_cache, autograd_cache.py
  AOTAutogradCache._write_to_local_cache, torch 2.9): a name that does not match its bytes is damaged, bit flips too;
- generated modules are named by the hash of their stripped source (codecache.py write() with code_hash): one that does
  not match and does not compile (an autotuning module's name also hashes its `extra`) is damaged;
- shared objects must be whole ELF files (the header's section and program tables inside the file);
- JSON files (triton's metadata) must parse.
A damaged entry is moved, never deleted, to <cache>/damaged/<UTC time>/<its path> (a .so with the sources and objects
of the same name, which torch writes again from the generated module), and the run says so in one warning line;
torch then builds those entries again. A kernel another process is building (its inductor lock held) is left alone.
An entry that cannot be moved (a read-only cache) refuses the run in one line naming it and the fix.
"""

from __future__ import annotations

import base64
import errno
import fcntl
import hashlib
import json
import os
import pickletools
import struct
import time
from dataclasses import dataclass
from pathlib import Path

DAMAGED_DIR = "damaged"  # inside the cache root: inductor reads only its own folders (XX/, fxgraph/, locks/, ...)
_PICKLE_DIRS = ("fxgraph", "aotautograd")
_SHOWN = 3  # entries named in the warning line; the rest are counted


class CompileCacheDamaged(RuntimeError):
    """A damaged entry that cannot be set aside; the message is the one line to print."""


@dataclass(frozen=True)
class Damage:
    rel: str  # the entry's path under the cache root
    reason: str


def torch_cache_dir(cfg) -> Path | None:
    """The torch.compile cache a run of this config uses (the directory TORCHINDUCTOR_CACHE_DIR names: env.py
    runtime_variables), or None when it compiles nothing there."""
    from ddpo_tpu import env as envmod
    from ddpo_tpu.config.distributed import compile_backend

    if not cfg.tpu_topology.spec.torch_compiles or compile_backend(cfg) == "none":
        return None
    value = envmod.torch_compile_cache_dir(cfg)
    return Path(value) if value else None


def check_before_start(cfg) -> list[str]:
    """For the front end, before the training process starts: set aside the damaged entries of this run's
    torch.compile cache. Returns the warning lines to print (none when all is well); raises CompileCacheDamaged
    (one line) when an entry cannot be moved."""
    root = torch_cache_dir(cfg)
    if root is None:
        return []
    line = repair(root, "distributed.compile_cache_dir")
    return [line] if line else []


def repair(root: Path, key: str) -> str | None:
    """Move the damaged entries of the inductor cache at root aside; the one warning line, or None."""
    damaged = find_damage(root)
    if not damaged:
        return None
    where = root / DAMAGED_DIR / time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    moved: list[Damage] = []
    for d in damaged:
        try:
            if _move_aside(root, d.rel, where):
                moved.append(d)
        except OSError as e:
            raise CompileCacheDamaged(
                f"{key}={root}: the entry {d.rel} is damaged ({d.reason}) and cannot be moved aside "
                f"({type(e).__name__}: {e.strerror or e}): remove it (rm {root / d.rel}) or set {key} to another "
                f"directory") from None
    if not moved:  # each was being rebuilt by another process
        return None
    shown = "; ".join(f"{d.rel}: {d.reason}" for d in moved[:_SHOWN])
    more = f"; and {len(moved) - _SHOWN} more" if len(moved) > _SHOWN else ""
    return (f"ddpo_tpu: warning: {key}={root}: {len(moved)} damaged entr{'y' if len(moved) == 1 else 'ies'} "
            f"({shown}{more}) moved to {where}; torch.compile builds {'it' if len(moved) == 1 else 'them'} again")


def find_damage(root: Path) -> list[Damage]:
    """Every damaged entry of the inductor cache at root (see the module docstring), in path order."""
    if not root.is_dir():
        return []
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        if here == root:  # never the set-aside entries or inductor's lock files
            dirnames[:] = [d for d in dirnames if d not in (DAMAGED_DIR, "locks")]
        dirnames.sort()
        rel_dir = here.relative_to(root)
        for name in sorted(filenames):
            if name.startswith(".") or name.endswith((".tmp", ".lock")):  # a write in progress (write_atomic)
                continue
            path = here / name
            try:
                reason = _damage(path, rel_dir)
            except OSError:  # gone meanwhile (another process set it aside), or unreadable: not ours to judge
                continue
            if reason:
                out.append(Damage(str(rel_dir / name), reason))
    return out


def _damage(path: Path, rel_dir: Path) -> str | None:
    top = rel_dir.parts[0] if rel_dir.parts else ""
    if top in _PICKLE_DIRS:
        return _pickle_damage(path)
    if path.suffix == ".so":
        return _elf_damage(path)
    if path.suffix == ".py" and len(rel_dir.parts) == 1:
        return _module_damage(path)
    if path.suffix == ".json":
        try:
            json.loads(path.read_bytes())
        except ValueError as e:
            return f"JSON that does not parse ({str(e)[:60]})"
    return None


def _sha256_name(data: bytes) -> str:
    """inductor's sha256_hash (torch/_inductor/codecache.py): base32 of the sha256, 51 characters, lower case."""
    return base64.b32encode(hashlib.sha256(data).digest())[:51].decode().lower()


def _pickle_damage(path: Path) -> str | None:
    data = path.read_bytes()
    if len(path.name) == 51:  # named by its bytes' hash: an exact check
        return None if _sha256_name(data) == path.name else f"its {len(data)} bytes do not match its name"
    try:  # another layout: at least a whole pickle stream
        ops = list(pickletools.genops(data))
    except Exception as e:  # noqa: BLE001 -- ValueError for a bad opcode or a truncated stream, others for garbage
        return f"not a whole pickle ({type(e).__name__})"
    return None if ops and ops[-1][0].name == "STOP" else "not a whole pickle"


def _module_damage(path: Path) -> str | None:
    data = path.read_bytes()
    try:
        source = data.decode("utf-8")
    except UnicodeDecodeError:
        return "not UTF-8 text"
    if "c" + _sha256_name(source.strip().encode()) == path.stem:
        return None
    if not source.strip():
        return "an empty module"
    try:
        compile(source, str(path), "exec", dont_inherit=True)
    except (SyntaxError, ValueError) as e:
        return f"Python that does not compile ({type(e).__name__} at line {getattr(e, 'lineno', '?')})"
    return None


def _elf_damage(path: Path) -> str | None:
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(64)
        if len(head) < 52 or head[:4] != b"\x7fELF" or head[4] not in (1, 2) or head[5] not in (1, 2):
            return f"not an ELF shared object ({size} bytes)"
        end = "<" if head[5] == 1 else ">"
        if head[4] == 2:  # 64-bit
            phoff, shoff = struct.unpack(end + "QQ", head[32:48])
            phentsize, phnum, shentsize, shnum = struct.unpack(end + "HHHH", head[54:62])
            ph_fmt, ph_at = end + "IIQQQQQQ", (2, 5)  # p_offset, p_filesz
        else:
            phoff, shoff = struct.unpack(end + "II", head[28:36])
            phentsize, phnum, shentsize, shnum = struct.unpack(end + "HHHH", head[42:50])
            ph_fmt, ph_at = end + "IIIIIIII", (1, 4)
        need = max(shoff + shnum * shentsize, phoff + phnum * phentsize)
        if need <= size and phentsize >= struct.calcsize(ph_fmt):
            f.seek(phoff)
            table = f.read(phnum * phentsize)
            for i in range(phnum):
                fields = struct.unpack_from(ph_fmt, table, i * phentsize)
                need = max(need, fields[ph_at[0]] + fields[ph_at[1]])
    return None if need <= size else f"a truncated ELF file ({size} of at least {need} bytes)"


def _move_aside(root: Path, rel: str, where: Path) -> bool:
    """Move one entry (a .so with its sources and objects) under `where`; False when another process is building it
    (inductor's lock for it is held)."""
    path = root / rel
    stem = path.name.split(".")[0]
    lock = root / "locks" / f"{stem}.lock" if path.suffix == ".so" else None
    fd = None
    if lock is not None and lock.exists():  # inductor's FileLock is an flock on this file (filelock's UnixFileLock)
        fd = os.open(lock, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                return False
            raise
    try:
        group = [path] + ([p for p in path.parent.iterdir() if p != path and p.name.split(".")[0] == stem]
                          if path.suffix == ".so" else [])
        for p in group:
            target = where / p.relative_to(root)
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.replace(p, target)
            except FileNotFoundError:  # another front end moved it first
                pass
        return True
    finally:
        if fd is not None:
            os.close(fd)  # closing the descriptor frees the flock
