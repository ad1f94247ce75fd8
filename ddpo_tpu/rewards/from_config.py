"""The reward of a run: built from its typed config (the `reward` group, ddpo_tpu/config/schema.py) for the device
the run trains on."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Callable

from ddpo_tpu.catalog import REWARDS, TINY, RewardSpec
from ddpo_tpu.rewards.base import REWARDS as IMPLEMENTATIONS
from ddpo_tpu.rewards.base import Reward, make_reward
# frame_reduction: how a video family reduces an image reward's frames (rewards/video.py), not the reward's own
# process: where the reward runs (rewards/managed.py), not one of its settings
_NOT_CONSTRUCTOR_KEYS = {"name", "host_workers", "weight", "components", "frame_reduction", "process"}


def reward_from_config(cfg, *, model_cache_dir: str, device, should_stop: Callable[[], bool] | None = None,
                       log_dir: str | Path | None = None) -> Reward:
    """The reward a typed reward config describes (the run's reward, or with reward=weighted, its components).

    Torch rewards stay on a CUDA device; on XLA and the CPU they run on the host CPU (an XLA device would compile
    their graphs beside the training ones). Remote rewards get `should_stop`, so a SIGTERM ends a hanging request
    within a second.

    With `reward.process.python` set the reward runs in that interpreter's process (rewards/managed.py), started
    here and logging to `log_dir` (default: the run dir of this training process)."""
    process = getattr(cfg, "process", None)
    if process is not None and process.python is not None:
        reward = _managed(cfg, model_cache_dir, device, log_dir)
        if should_stop is not None:
            reward.should_stop = should_stop
        return reward
    for spec in _specs(cfg):  # importing a reward's module registers its implementation
        if spec.name not in IMPLEMENTATIONS:
            importlib.import_module(spec.module)
    reward = make_reward(cfg.name, **reward_kwargs(cfg, Path(model_cache_dir).expanduser(), device))
    if should_stop is not None:
        for r in (reward, *getattr(reward, "components", ())):
            if hasattr(r, "should_stop"):
                r.should_stop = should_stop
    return reward


def _managed(cfg, model_cache_dir: str, device, log_dir: str | Path | None) -> Reward:
    """The reward in its own process: its config with the process block cleared (the process builds it in-process),
    on reward.process.device, or the run's CUDA device for a torch reward, else the CPU."""
    from ddpo_tpu.env import run_dir_from_environment
    from ddpo_tpu.rewards.managed import ManagedReward, log_path_for

    p = cfg.process
    config = cfg.model_dump()
    config["process"] = {}
    where = p.device
    if where is None and any(s.torch for s in _specs(cfg)) and getattr(device, "type", None) == "cuda":
        where = str(device)
    run_dir = Path(log_dir) if log_dir is not None else run_dir_from_environment()
    return ManagedReward(config, python=p.python, log_path=log_path_for(run_dir), device=where, port=p.port,
                         cache_dir=Path(model_cache_dir).expanduser(), startup_timeout_s=p.startup_timeout_s,
                         request_timeout_s=p.request_timeout_s)


def _specs(cfg) -> list[RewardSpec]:
    return [REWARDS.get(cfg.name), *(REWARDS.get(c.name) for c in getattr(cfg, "components", ()))]


def reward_kwargs(cfg, cache_dir: Path, device) -> dict[str, Any]:
    """The constructor arguments of a reward config: its own keys (the schema's fields are the constructor's
    parameters), `tiny` values replaced by the local stand-ins, a CUDA device passed on."""
    kwargs = cfg.model_dump(exclude=_NOT_CONSTRUCTOR_KEYS)
    if cfg.name == "weighted":
        kwargs["components"] = [{"name": c.name, "weight": c.weight, **reward_kwargs(c, cache_dir, device)}
                                for c in cfg.components]
    kwargs.update(_stand_ins(cfg, cache_dir))
    if REWARDS.get(cfg.name).torch and getattr(device, "type", None) == "cuda":
        kwargs["device"] = str(device)
    return kwargs


def _stand_ins(cfg, cache_dir: Path) -> dict[str, str]:
    """`tiny` as clip_model, mlp_path or processor, imagereward's checkpoint, med_config and tokenizer, hpsv2's
    checkpoint, architecture and tokenizer, or geneval's detector_model (conf/reward_local, paired with model=tiny /
    tiny_sd3): tiny random-weight models built once in the model cache and loaded through the same code as the real
    ones. The only place that value is read (the catalog's problems hooks check that the tiny keys of a reward come
    together)."""
    if cfg.name == "geneval":  # the transformers detector's tiny Mask2Former and the colour classifier's tiny CLIP
        paths = {}
        if getattr(cfg, "detector_model", None) == TINY:
            from ddpo_tpu.rewards.tiny_mask2former import ensure_tiny_mask2former

            paths["detector_model"] = str(ensure_tiny_mask2former(cache_dir))
        if getattr(cfg, "clip_model", None) == TINY:
            from ddpo_tpu.rewards.tiny_clip import ensure_tiny_aesthetic

            paths["clip_model"] = str(ensure_tiny_aesthetic(cache_dir)[0])
        return paths
    if cfg.name == "imagereward":  # its tiny checkpoint in the released layout, med_config.json and tokenizer
        tiny = [k for k in ("checkpoint", "med_config", "tokenizer") if getattr(cfg, k, None) == TINY]
        if not tiny:
            return {}
        from ddpo_tpu.rewards.tiny_imagereward import ensure_tiny_imagereward

        paths = dict(zip(("checkpoint", "med_config", "tokenizer"), ensure_tiny_imagereward(cache_dir)))
        return {k: str(paths[k]) for k in tiny}
    if cfg.name == "hpsv2":  # its tiny open_clip-layout checkpoint, open_clip config and tokenizer
        tiny = [k for k in ("checkpoint", "architecture", "tokenizer") if getattr(cfg, k, None) == TINY]
        if not tiny:
            return {}
        from ddpo_tpu.rewards.tiny_hpsv2 import ensure_tiny_hpsv2

        paths = dict(zip(("checkpoint", "architecture", "tokenizer"), ensure_tiny_hpsv2(cache_dir)))
        return {k: str(paths[k]) for k in tiny}
    tiny = [k for k in ("clip_model", "mlp_path", "processor") if getattr(cfg, k, None) == TINY]
    if not tiny:
        return {}
    if cfg.name == "pickscore":  # its own tiny CLIP model + processor
        from ddpo_tpu.rewards.tiny_pickscore import ensure_tiny_pickscore

        processor, model = ensure_tiny_pickscore(cache_dir)
        paths = {"clip_model": model, "processor": processor}
    else:  # aesthetic, clip_score, frame_consistency: the tiny CLIP (+ the LAION-shaped MLP on its embeddings)
        from ddpo_tpu.rewards.tiny_clip import ensure_tiny_aesthetic

        clip, mlp = ensure_tiny_aesthetic(cache_dir)
        paths = {"clip_model": clip, "mlp_path": mlp}
    return {k: str(paths[k]) for k in tiny}
