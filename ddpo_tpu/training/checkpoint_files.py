"""Checkpoints that survive SIGKILL at any point, and exact resume.

A checkpoint is a directory checkpoints/epoch_NNNN/ holding the trained weights (trainable.safetensors), the optimizer
state (optimizer.pt), and state.json (epoch, global step, stat-tracker buffers, run id, the parity-relevant config).
It is written under a temporary name, every file fsynced, then renamed into place: a directory with the final name is
always complete (ddpo_tpu/rundir/checkpoint_layout.py: the names, and what makes one complete). Host and device RNG
states are not stored because there are none to store: all randomness is drawn from host generators seeded by (seed,
epoch, stream) (training/loop.py), so a run restarted at an epoch boundary draws exactly what the uninterrupted run
drew.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ddpo_tpu.rundir import checkpoint_layout as layout
from ddpo_tpu.rundir.checkpoint_layout import STATE_FILE, complete
from ddpo_tpu.config.resume import changed_keys, resume_relevant  # one copy of what a resume compares

FORMAT = 1


def config_hash(tree: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(resume_relevant(tree), sort_keys=True, default=str).encode()).hexdigest()[:16]


class ResumeRefused(RuntimeError):
    pass


class CheckpointDamaged(RuntimeError):
    """A checkpoint whose files do not match their checksums or cannot be read (truncated, overwritten)."""

    def __init__(self, path: Path, problem: str):
        self.path, self.problem = Path(path), problem
        super().__init__(f"checkpoint {path} is damaged: {problem}")


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass
class Loaded:
    path: Path
    epoch: int
    global_step: int
    trainable: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    tracker: dict[str, Any]
    run_id: str


@dataclass
class Pending:
    """A checkpoint written and fsynced under its temporary name: not a checkpoint until commit() renames it.
    The epoch loop writes the epoch's outputs (metrics line, sample grid, weights) between the two, so the
    checkpoint that marks an epoch done comes after everything the epoch produced."""

    ckpt_root: Path
    tmp: Path
    final: Path
    # the files' bytes (the host copy): what a bucket mirror uploads, whatever rotation does to the local dirs
    data: dict[str, bytes] = field(default_factory=dict, repr=False)

    def commit(self, limit: int) -> Path:
        final, ckpt_root = self.final, self.ckpt_root
        if final.exists():  # the same epoch saved again (e.g. after SIGTERM): replace it whole
            old = layout.retired(final, str(os.getpid()))
            os.replace(final, old)
            os.replace(self.tmp, final)
            shutil.rmtree(old)
        else:
            os.replace(self.tmp, final)
        layout.fsync_dir(ckpt_root)
        rotate(ckpt_root, limit)
        return final


def prepare(ckpt_root: Path, *, epoch: int, global_step: int, trainable: dict[str, torch.Tensor],
            optimizer: dict[str, Any], tracker: dict[str, Any], run_id: str, tree: dict[str, Any]) -> Pending:
    """Write the files of checkpoints/epoch_NNNN under a temporary name (see Pending). Tensors must be on the host."""
    from safetensors.torch import save as st_save

    ckpt_root.mkdir(parents=True, exist_ok=True)
    final = ckpt_root / layout.name(epoch)
    tmp = layout.temporary(ckpt_root, epoch, str(os.getpid()))
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    files = {"trainable.safetensors": st_save(trainable)}
    buf = io.BytesIO()
    torch.save(optimizer, buf)
    files["optimizer.pt"] = buf.getvalue()
    for name, data in files.items():
        layout.write_synced(tmp / name, data)
    # state.json guards itself (it must parse and hold every key); the other files by their sha256
    state = {"format": FORMAT, "epoch": epoch, "global_step": global_step, "run_id": run_id, "tracker": tracker,
             "config_hash": config_hash(tree), "config": resume_relevant(tree),
             "sha256": {name: _sha256(data) for name, data in files.items()}}
    files[STATE_FILE] = (json.dumps(state, indent=1, default=str) + "\n").encode()
    layout.write_synced(tmp / STATE_FILE, files[STATE_FILE])  # last: the guard of the others
    layout.fsync_dir(tmp)
    return Pending(ckpt_root, tmp, final, files)


def clear_leftovers(ckpt_root: Path) -> list[Path]:
    """Remove what killed checkpoint writes and deletes left (none of this process's own are in flight: it runs at
    the start and after a commit). Returns what was removed."""
    gone = layout.leftovers(ckpt_root)
    for leftover in gone:
        shutil.rmtree(leftover, ignore_errors=True)
    return gone


def rotate(ckpt_root: Path, limit: int) -> None:
    """Keep the newest `limit` complete checkpoints (never the newest one), and clear leftovers of killed writes."""
    clear_leftovers(ckpt_root)
    done = complete(ckpt_root)
    for old in done[:-max(limit, 1)]:
        doomed = layout.retired(old, str(os.getpid()))
        os.replace(old, doomed)  # out of the complete set in one step, then deleted
        shutil.rmtree(doomed, ignore_errors=True)


_STATE_KEYS = ("format", "epoch", "global_step", "run_id", "tracker", "config")


def _read_state(path: Path) -> dict[str, Any]:
    try:
        state = json.loads((path / STATE_FILE).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointDamaged(path, f"state.json cannot be read ({type(e).__name__}: truncated or overwritten?)")
    missing = [k for k in _STATE_KEYS if not isinstance(state, dict) or k not in state]
    if missing:
        raise CheckpointDamaged(path, f"state.json lacks {', '.join(missing)}")
    return state


def verify(path: Path) -> dict[str, Any]:
    """state.json of an intact checkpoint; raises CheckpointDamaged naming the first bad file. Checkpoints written
    before checksums existed have none: their files are checked by loading them (load())."""
    state = _read_state(path)
    for name, want in (state.get("sha256") or {}).items():
        try:
            got = _sha256((path / name).read_bytes())
        except OSError as e:
            raise CheckpointDamaged(path, f"{name} cannot be read ({type(e).__name__})")
        if got != want:
            raise CheckpointDamaged(path, f"{name} does not match its sha256 in state.json (truncated or damaged)")
    return state


def load(path: Path, tree: dict[str, Any], force: bool = False) -> Loaded:
    from safetensors.torch import load_file

    state = verify(path)
    if state.get("format") != FORMAT:
        raise ResumeRefused(f"resume={path}: checkpoint format {state.get('format')} is not {FORMAT}")
    now = resume_relevant(json.loads(json.dumps(tree, default=str)))
    then = resume_relevant(state["config"])
    changed = changed_keys(then, now)
    if changed and not force:
        shown = ", ".join(f"{k}: {then.get(k)!r} -> {now.get(k)!r}" for k in changed[:8])
        raise ResumeRefused(f"resume: the checkpoint {path} was trained with a different config ({shown}"
                            f"{', ...' if len(changed) > 8 else ''}). Fix: restore those keys, start a new run "
                            f"(run_name=...), or set force_resume=true")
    try:
        optimizer = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 -- whatever a damaged pickle raises
        raise CheckpointDamaged(path, f"optimizer.pt cannot be loaded ({type(e).__name__})") from e
    try:
        trainable = load_file(str(path / "trainable.safetensors"))
    except Exception as e:  # noqa: BLE001 -- whatever a damaged file raises
        raise CheckpointDamaged(path, f"trainable.safetensors cannot be loaded ({type(e).__name__})") from e
    return Loaded(path, state["epoch"], state["global_step"], trainable, optimizer, state["tracker"],
                  state["run_id"])


def load_resume(run_dir: Path, resume: str, tree: dict[str, Any], force: bool = False,
                on_damaged=lambda damaged: None) -> Loaded | None:
    """The newest intact checkpoint to continue from (None: start fresh). A damaged one is passed to
    `on_damaged` and the previous one is tried; when none is intact the run is refused with the fix."""
    candidates = resume_candidates(run_dir, resume)
    damaged: list[CheckpointDamaged] = []
    for path in reversed(candidates):
        try:
            return load(path, tree, force)
        except CheckpointDamaged as e:
            damaged.append(e)
            on_damaged(e)
    if not damaged:
        return None
    where = damaged[0].path.parent if resume == "auto" or len(candidates) > 1 else damaged[0].path
    names = " ".join(str(e.path) for e in damaged)
    raise ResumeRefused(f"resume={resume}: no intact checkpoint in {where} ({damaged[0]}). Fix: delete the damaged "
                        f"checkpoint(s) (rm -r {names}) to start again from the previous one or from scratch, or "
                        f"start a new run (resume=never run_name=NEW_NAME)")


def resume_candidates(run_dir: Path, resume: str) -> list[Path]:
    """Checkpoints to continue from, oldest first: resume=auto -> the complete ones in the run dir; a path -> that
    checkpoint (or the complete ones inside it); never -> none."""
    if resume == "never":
        return []
    if resume == "auto":
        return complete(run_dir / layout.CHECKPOINTS)
    path = Path(resume).expanduser()
    if (path / STATE_FILE).is_file():
        return [path]
    done = complete(path) or complete(path / layout.CHECKPOINTS)
    if not done:
        raise ResumeRefused(f"resume={resume}: no complete checkpoint there")
    return done
