"""What a run leaves in its directory: metrics.jsonl (one line per optimizer step and one per epoch), sample image
grids, and trained weights as .safetensors. Files are written whole (temp name, fsync, rename) so a killed run never
leaves a half-written one."""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ddpo_tpu.env import current_umask
from ddpo_tpu.rundir.events import append_line  # torch- and numpy-free: ddpo-status imports this module

if TYPE_CHECKING:  # annotations only: the module stays importable without numpy
    import numpy as np


def atomic_write_bytes(path: Path, data: bytes) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as e:  # a disk that refuses (read-only, full): the error line names the file, not a temp name
        raise OSError(e.errno, e.strerror, str(path)) from e
    try:
        # mkstemp makes 0600; the run's files follow the umask, so colleagues and TensorBoard read weights and samples
        os.fchmod(fd, 0o666 & ~current_umask())
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def interrupted_writes(directory: Path) -> list[Path]:
    """The temporary files of atomic_write_bytes in `directory` that a kill left behind (its cleanup never ran)."""
    return sorted(Path(directory).glob(".*.*.tmp"))


VIDEO_SAMPLES = 8  # videos of an epoch written as mp4 and shown on its contact sheet (the image grid's 16 would
                  # make a sheet 16 videos tall)

HEARTBEAT_FILE = "heartbeat.json"
HEARTBEAT_INTERVAL_S = 10.0
# run dir -> the write its heartbeat thread was last refused (cleared by a beat that lands); a thread cannot end the
# run, so the trainer's next metrics line raises it (RunDir.log) and the run ends in its one `error:` line
_HEARTBEAT_REFUSED: dict[Path, OSError] = {}


class Heartbeat:
    """run_dir/heartbeat.json, rewritten every `interval` seconds by a daemon thread while the training process
    lives (whatever its main thread is doing: a long compile, a hanging reward). A SIGKILLed process stops beating,
    so ddpo-status can call the run dead within a minute instead of waiting out its staleness threshold."""

    def __init__(self, run_dir: Path, interval: float = HEARTBEAT_INTERVAL_S):
        import socket
        import threading

        self.path = Path(run_dir) / HEARTBEAT_FILE
        self.interval = interval
        self._info = {"pid": os.getpid(), "hostname": socket.gethostname(), "interval_s": interval}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ddpo-heartbeat", daemon=True)

    def beat(self) -> None:
        data = json.dumps({**self._info, "time": round(time.time(), 3)}) + "\n"
        try:
            atomic_write_bytes(self.path, data.encode())
            _HEARTBEAT_REFUSED.pop(self.path.parent.absolute(), None)
        except OSError as e:
            _HEARTBEAT_REFUSED[self.path.parent.absolute()] = OSError(e.errno, e.strerror, str(self.path))

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.beat()

    def start(self) -> Heartbeat:
        self.beat()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()


class RunDir:
    def __init__(self, path: Path, mirror=None):
        self.path = Path(path)
        self.metrics_path = self.path / "metrics.jsonl"
        self.mirror = mirror  # a storage.Mirror when output_root is a bucket (main process only), else None

    def publish(self, checkpoint=None) -> None:
        """The epoch's files (and a committed checkpoint: (name, files' bytes, epoch)) to the bucket copy, in the
        background; nothing for a local run dir."""
        if self.mirror is not None:
            self.mirror.publish(checkpoint)

    def close(self) -> None:
        """Wait for the bucket copy to have everything written so far (the end of the process)."""
        if self.mirror is not None:
            self.mirror.close()
            self.mirror.check()

    @property
    def bucket_failed(self) -> bool:
        """The bucket copy gave up (storage.Mirror): the run stops after a local checkpoint, and close() says why."""
        return self.mirror is not None and self.mirror.error is not None

    def log(self, record: dict[str, Any]) -> None:
        """One metrics.jsonl line. A refused write raises OSError naming the file, and so does a heartbeat the disk
        refused since its last beat that landed: the trainer turns either into its one error line."""
        refused = _HEARTBEAT_REFUSED.pop(self.path.absolute(), None)
        if refused is not None:
            raise refused
        record = {"time": round(time.time(), 3), **record}
        append_line(self.metrics_path, json.dumps(record, default=_jsonable) + "\n", fsync=True)

    def truncate_after_epoch(self, epoch: int) -> None:
        """Drop records of epochs after `epoch` (work a killed run did past its last checkpoint), atomically, so
        each epoch is logged once in a resumed run."""
        if not self.metrics_path.exists():
            return
        keep = []
        for line in self.metrics_path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by a kill
            if rec.get("kind") == "event" or rec.get("epoch", -1) <= epoch:
                keep.append(line)
        atomic_write_bytes(self.metrics_path, ("\n".join(keep) + "\n" if keep else "").encode())

    def save_image_grid(self, epoch: int, images: np.ndarray, prompts: list[str], rewards: np.ndarray,
                        name: str = "epoch", cols: int = 4, files: list[str] | None = None) -> Path:
        """A grid of an epoch's first images (uint8, B x H x W x 3), `cols` a row, with a caption file of prompts and
        rewards (and `files`: the file each image stands for)."""
        import numpy as np  # here, not at the top: ddpo-status imports HEARTBEAT_FILE without numpy
        from PIL import Image

        n = min(len(images), 16)
        cols = min(n, cols)
        rows = math.ceil(n / cols)
        h, w = images.shape[1:3]
        grid = np.zeros((rows * h, cols * w, 3), dtype=np.uint8)
        for i in range(n):
            r, c = divmod(i, cols)
            grid[r * h:(r + 1) * h, c * w:(c + 1) * w] = images[i]
        out = self.path / "samples" / f"{name}_{epoch:04d}.png"
        import io

        buf = io.BytesIO()
        Image.fromarray(grid).save(buf, format="PNG")
        atomic_write_bytes(out, buf.getvalue())
        captions = [{"prompt": p, "reward": float(r), **({"file": files[i]} if files else {})}
                    for i, (p, r) in enumerate(zip(prompts[:n], rewards[:n]))]
        atomic_write_bytes(out.with_suffix(".json"), (json.dumps(captions, indent=1) + "\n").encode())
        return out

    def save_videos(self, epoch: int, videos: np.ndarray, prompts: list[str], rewards: np.ndarray,
                    name: str = "epoch") -> list[Path]:
        """An epoch's first VIDEO_SAMPLES videos (uint8, B x F x H x W x 3) as mp4 files samples/NAME_EPOCH_I.mp4,
        and their contact sheet as the grid samples/NAME_EPOCH.png: a row per video, up to 8 of its frames from the
        first to the last (rundir/video.py), with the caption file naming each row's mp4. Returns the mp4 paths."""
        from ddpo_tpu.rundir.video import contact_sheet, encode_mp4

        n = min(len(videos), VIDEO_SAMPLES)
        paths = [self.path / "samples" / f"{name}_{epoch:04d}_{i:02d}.mp4" for i in range(n)]
        for video, path in zip(videos, paths):
            atomic_write_bytes(path, encode_mp4(video))
        self.save_image_grid(epoch, contact_sheet(videos[:n]), prompts, rewards, name=name, cols=1,
                             files=[p.name for p in paths])
        return paths

    def save_weights(self, name: str, state: dict, metadata: dict[str, str] | None = None) -> Path:
        from safetensors.torch import save

        out = self.path / "weights" / f"{name}.safetensors"
        atomic_write_bytes(out, save(state, metadata=metadata))
        return out


def save_captioned_grid(out: Path, images, captions: list[str], records: list[dict], cols: int = 4,
                        tile: int = 160, max_lines: int = 5) -> Path:
    """A grid of the first 16 images (uint8, B x H x W x 3), `cols` a row, each scaled (nearest) to `tile` pixels
    wide with its caption drawn in the strip under it (its lines wrapped, at most `max_lines`), and `records` beside
    it as out.with_suffix(".json"). The caption is readable in the picture itself (an evaluation grid is looked at, not
    parsed); the JSON keeps the exact values."""
    import io
    import textwrap

    import numpy as np
    from PIL import Image, ImageDraw

    n = min(len(images), 16)
    cols = max(1, min(n, cols))
    rows = math.ceil(n / cols)
    h, w = images.shape[1:3]
    th = max(1, round(h * tile / w))
    chars = max(8, tile // 6)
    wrapped = [[w for line in c.split("\n") for w in textwrap.wrap(line, chars)][:max_lines] for c in captions[:n]]
    strip = max((len(x) for x in wrapped), default=0) * 12 + 6
    sheet = Image.new("RGB", (cols * tile, rows * (th + strip)), "white")
    draw = ImageDraw.Draw(sheet)
    for i in range(n):
        r, c = divmod(i, cols)
        x, y = c * tile, r * (th + strip)
        sheet.paste(Image.fromarray(np.asarray(images[i])).resize((tile, th), Image.NEAREST), (x, y))
        draw.multiline_text((x + 3, y + th + 2), "\n".join(wrapped[i]), fill="black", spacing=2)
    buf = io.BytesIO()
    sheet.save(buf, format="PNG")
    atomic_write_bytes(out, buf.getvalue())
    atomic_write_bytes(out.with_suffix(".json"), (json.dumps(records[:n], indent=1) + "\n").encode())
    return out


def _jsonable(x: Any) -> Any:
    import numpy as np

    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    raise TypeError(f"not JSON serialisable: {type(x)}")
