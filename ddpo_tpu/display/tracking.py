"""Experiment tracking on the main process only: the reward curve PNG in the run dir (always), wandb (online,
offline, disabled), TensorBoard event files, or both trackers at once (`logger=wandb logger.tensorboard=true`, or
`logger=wandb_tensorboard`).

The run id is the trainer's (kept in checkpoints), so a resumed run continues the same wandb run. TensorBoard's
files go to run_dir/tensorboard/: for an output_root=gs://... run they reach the bucket with the rest of the run dir
(ddpo_tpu/rundir/storage.py's mirror), where `tensorboard --logdir gs://BUCKET/PREFIX` reads them.
"""

from __future__ import annotations

import json
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from ddpo_tpu.config.schema import LoggerConfig

TENSORBOARD_DIR = "tensorboard"
TB_VIDEOS = 4  # videos side by side in TensorBoard's animated GIF (a GIF holds every frame whole: keep it small)


class Tracker:
    def log(self, values: dict[str, Any], step: int) -> None:
        pass

    def log_images(self, step: int, images: np.ndarray, captions: list[str]) -> None:
        pass

    def log_videos(self, step: int, videos: np.ndarray, files: list[Path], captions: list[str]) -> None:
        """uint8 (N, F, H, W, 3) videos and the mp4 files the run dir holds of them (RunDir.save_videos)."""

    def finish(self) -> None:
        pass


class WandbTracker(Tracker):
    def __init__(self, cfg: LoggerConfig, run_dir: Path, run_id: str, run_name: str, config: dict[str, Any]):
        import wandb

        self._wandb = wandb
        self.run = wandb.init(project=cfg.project, entity=cfg.entity, group=cfg.group, tags=list(cfg.tags) or None,
                              notes=cfg.notes, name=run_name, id=run_id, resume="allow", mode=cfg.mode,
                              dir=str(run_dir), config=config)

    def log(self, values: dict[str, Any], step: int) -> None:
        self.run.log({k: v for k, v in _flat(values).items() if isinstance(v, (int, float))}, step=step)

    def log_images(self, step: int, images: np.ndarray, captions: list[str]) -> None:
        self.run.log({"samples": [self._wandb.Image(img, caption=c) for img, c in zip(images, captions)]}, step=step)

    def log_videos(self, step: int, videos: np.ndarray, files: list[Path], captions: list[str]) -> None:
        # the run dir's mp4 files, as flow_grpo's Wan script logs its own (wandb.Video of a path; from an array wandb
        # would encode them again, through moviepy)
        self.run.log({"videos": [self._wandb.Video(str(f), caption=c, format="mp4") for f, c in zip(files, captions)]},
                     step=step)

    def finish(self) -> None:
        self.run.finish()


class TensorBoardTracker(Tracker):
    """Scalars under their flat names (train/loss, reward_mean, phases/sampling/seconds, ...), the epoch's sample
    grid as one image with its captions as text, and the resolved config as text (at every start of the training
    process: a resumed run shows the config it resumed with). Flushed at each epoch's record, so the files are
    complete at the epoch's end (when the bucket copy is made)."""

    def __init__(self, run_dir: Path, config: dict[str, Any]):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(Path(run_dir) / TENSORBOARD_DIR))
        text = json.dumps(config, indent=2, default=str)
        self.writer.add_text("config", "```\n" + text + "\n```", 0)  # markdown: a code block keeps the layout
        self.writer.flush()

    def log(self, values: dict[str, Any], step: int) -> None:
        for k, v in _flat(values).items():
            if isinstance(v, (int, float)) and np.isfinite(v):
                self.writer.add_scalar(k, v, step)
        if "epoch" in values:
            self.writer.flush()

    def log_images(self, step: int, images: np.ndarray, captions: list[str]) -> None:
        if len(images):
            self.writer.add_images("samples", np.asarray(images), step, dataformats="NHWC")
            self.writer.add_text("samples/captions", "\n\n".join(f"{i}: {c}" for i, c in enumerate(captions)), step)

    def log_videos(self, step: int, videos: np.ndarray, files: list[Path], captions: list[str]) -> None:
        """The first TB_VIDEOS videos side by side as one animated GIF in an image summary: what
        SummaryWriter.add_video writes, without its moviepy (torch 2.9's make_video imports moviepy.editor, which
        moviepy 2 removed); TensorBoard's image dashboard plays it. The still contact sheet beside it."""
        from tensorboard.compat.proto.summary_pb2 import Summary

        from ddpo_tpu.display.video import contact_sheet, encode_gif, tiled

        if not len(videos):
            return
        clip = tiled(videos[:TB_VIDEOS])
        gif = Summary.Image(height=clip.shape[1], width=clip.shape[2], colorspace=3,
                            encoded_image_string=encode_gif(clip))
        self.writer._get_file_writer().add_summary(Summary(value=[Summary.Value(tag="videos", image=gif)]), step)
        sheet = contact_sheet(videos)
        self.writer.add_image("samples", sheet.reshape(-1, *sheet.shape[2:]), step, dataformats="HWC")
        self.writer.add_text("samples/captions", "\n\n".join(f"{i}: {c}" for i, c in enumerate(captions)), step)

    def finish(self) -> None:
        self.writer.close()


class RewardCurve(Tracker):
    """reward_curve.png in the run dir, redrawn from metrics.jsonl at each epoch's record (which the loop writes to
    metrics.jsonl just before it logs it here) and at each evaluation. Drawn on one background thread (matplotlib
    takes ~0.1-0.6 s a chart on 2 cores, more than a tiny model's epoch can spare): a request made while another
    waits is dropped (the waiting one reads the newer metrics); finish(), and the interpreter's exit, wait for the
    last one."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self._pool: ThreadPoolExecutor | None = None
        self._waiting: Future | None = None
        self._warned = False

    def log(self, values: dict[str, Any], step: int) -> None:
        if "reward_mean" in values or "eval/reward_mean" in values:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward-curve")
            w = self._waiting
            if w is None or w.running() or w.done():
                self._waiting = self._pool.submit(self._draw)

    def _draw(self) -> None:
        from ddpo_tpu.display.plot import write_run_curve

        try:
            write_run_curve(self.run_dir)
        except OSError:
            pass  # a full disk is reported by the writes that matter; a plot is not one of them
        except Exception as e:  # noqa: BLE001 -- a chart never stops a run; say so once
            if not self._warned:
                self._warned = True
                print(f"ddpo_tpu: warning: reward_curve.png not drawn: {type(e).__name__}: {e}", file=sys.stderr)

    def finish(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


class Trackers(Tracker):
    def __init__(self, trackers: list[Tracker]):
        self.trackers = trackers

    def log(self, values: dict[str, Any], step: int) -> None:
        for t in self.trackers:
            t.log(values, step)

    def log_images(self, step: int, images: np.ndarray, captions: list[str]) -> None:
        for t in self.trackers:
            t.log_images(step, images, captions)

    def log_videos(self, step: int, videos: np.ndarray, files: list[Path], captions: list[str]) -> None:
        for t in self.trackers:
            t.log_videos(step, videos, files, captions)

    def finish(self) -> None:
        for t in self.trackers:
            t.finish()


def _flat(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in values.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}/"))
        elif not isinstance(v, bool):
            out[f"{prefix}{k}"] = v
    return out


def uses_wandb(cfg: LoggerConfig) -> bool:
    return cfg.name == "wandb" and cfg.mode != "disabled"


def uses_tensorboard(cfg: LoggerConfig) -> bool:
    return cfg.name == "tensorboard" or bool(getattr(cfg, "tensorboard", False))


def make_tracker(cfg: LoggerConfig, run_dir: Path, run_id: str, run_name: str, config: dict[str, Any],
                 is_main: bool) -> Tracker:
    if not is_main:
        return Tracker()
    trackers: list[Tracker] = [RewardCurve(run_dir)]
    if uses_wandb(cfg):
        trackers.append(WandbTracker(cfg, run_dir, run_id, run_name, config))
    if uses_tensorboard(cfg):
        trackers.append(TensorBoardTracker(run_dir, config))
    return Trackers(trackers)
