"""Experiment tracking on the main process only: wandb (online, offline, disabled) or nothing.

The run id is the trainer's (kept in checkpoints), so a resumed run continues the same wandb run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ddpo_tpu.config.schema import LoggerConfig


class Tracker:
    def log(self, values: dict[str, Any], step: int) -> None:
        pass

    def log_images(self, step: int, images: np.ndarray, captions: list[str]) -> None:
        pass

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

    def finish(self) -> None:
        self.run.finish()


def _flat(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in values.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}/"))
        elif not isinstance(v, bool):
            out[f"{prefix}{k}"] = v
    return out


def make_tracker(cfg: LoggerConfig, run_dir: Path, run_id: str, run_name: str, config: dict[str, Any],
                 is_main: bool) -> Tracker:
    if not is_main or cfg.name == "none" or cfg.mode == "disabled":
        return Tracker()
    return WandbTracker(cfg, run_dir, run_id, run_name, config)
