"""The reward of a run's `reward` config group, built for the device the run trains on."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from ddpo_tpu.rewards.base import Reward, make_reward

_TORCH_REWARDS = ("aesthetic", "clip_score", "pickscore")  # rewards that run a torch model and take a `device`


def reward_from_config(cfg, *, model_cache_dir: str, device, should_stop: Callable[[], bool] | None = None
                       ) -> Reward:
    """The reward's own keys of the group (clip_model, mlp_path, url, ...) go to its constructor.
    clip_model=tiny (conf/reward_local, paired with model=tiny) is the local stand-in, built once in the model
    cache. Torch rewards stay on a CUDA device; on XLA and the CPU they run on the host CPU (an XLA device would
    compile their graphs beside the training ones). Remote rewards get `should_stop`, so a SIGTERM ends a hanging
    request within a second."""
    extra = cfg.model_dump(exclude={"name", "host_workers"}, exclude_none=True)
    if extra.get("clip_model") == "tiny" and cfg.name == "pickscore":  # its own tiny CLIP model + processor
        from ddpo_tpu.rewards.tiny_pickscore import ensure_tiny_pickscore

        processor, model = ensure_tiny_pickscore(Path(model_cache_dir).expanduser())
        extra.update(clip_model=str(model), processor=str(processor))
    elif extra.get("clip_model") == "tiny":
        from ddpo_tpu.rewards.tiny_clip import ensure_tiny_aesthetic

        clip, mlp = ensure_tiny_aesthetic(Path(model_cache_dir).expanduser())
        extra.update(clip_model=str(clip), **({"mlp_path": str(mlp)} if "mlp_path" in extra else {}))
    if cfg.name in _TORCH_REWARDS and getattr(device, "type", None) == "cuda":
        extra["device"] = str(device)
    reward = make_reward(cfg.name, **extra)
    if should_stop is not None:
        for r in (reward, *getattr(reward, "components", ())):
            if hasattr(r, "should_stop"):
                r.should_stop = should_stop
    return reward
