"""What a checkpoint directory is, written once (torch-free: the front end's checks, the bucket copy and the trainer
all read it).

A run dir keeps its checkpoints in `checkpoints/`, one directory per saved epoch, named `epoch_NNNN` (at least four
digits). A checkpoint is written under a temporary name beside them (`.tmp-epoch_NNNN-TAG`) and renamed into place
whole, so a directory with the final name that holds `state.json` is complete; a replaced or rotated one is renamed
to `.old-epoch_NNNN-TAG` before it is deleted. Leftovers of either kind are what a killed write or delete left.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

CHECKPOINTS = "checkpoints"   # the run dir's folder of checkpoints
STATE_FILE = "state.json"     # written last inside a checkpoint: epoch, step, tracker, config, checksums
_NAME = re.compile(r"^epoch_(\d{4,})$")
_LEFTOVER = (".tmp-epoch_", ".old-epoch_")


def name(epoch: int) -> str:
    return f"epoch_{epoch:04d}"


def epoch_of(dir_name: str) -> int | None:
    """The epoch a checkpoint directory's name stands for, or None for any other name."""
    m = _NAME.match(dir_name)
    return int(m.group(1)) if m else None


def temporary(root: Path, epoch: int, tag: str) -> Path:
    """Where checkpoint `epoch` is written before its rename into place (`tag`: the writer, e.g. its pid)."""
    return root / f".tmp-{name(epoch)}-{tag}"


def retired(path: Path, tag: str) -> Path:
    """Where a complete checkpoint goes to be deleted: out of the complete set in one rename."""
    return path.with_name(f".old-{path.name}-{tag}")


def is_complete(path: Path) -> bool:
    return epoch_of(path.name) is not None and path.is_dir() and (path / STATE_FILE).is_file()


def complete(root: Path) -> list[Path]:
    """The complete checkpoints in `root`, oldest first."""
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if is_complete(p)), key=lambda p: epoch_of(p.name))


def leftovers(root: Path) -> list[Path]:
    """Directories of checkpoint writes and deletes that a kill cut short."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.name.startswith(_LEFTOVER))


def holds_checkpoint(path: Path) -> bool:
    """What resume=PATH accepts: a checkpoint dir, or a dir whose checkpoints/ (or itself) holds a complete one."""
    return (path / STATE_FILE).is_file() or bool(complete(path)) or bool(complete(path / CHECKPOINTS))


def write_synced(path: Path, data: bytes) -> None:
    """Write a checkpoint file and fsync it (the trainer's write and the bucket copy's download both use it): a
    checkpoint is renamed into place only after every file in it is on disk."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    """Make a rename inside `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
