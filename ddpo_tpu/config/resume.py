"""What a checkpoint must agree on with the run that continues it: the keys that change what is trained (an
allow-list: the sections below, less the keys of how it runs). Everything else (epochs, paths, logging, evaluation,
how steps are compiled, fused or synced, the topology) may change between a checkpoint and its resume. Only keys
both configs have are compared, so a key added by an upgrade (whose default keeps the old behaviour) never blocks a
resume."""

from __future__ import annotations

from typing import Any

from ddpo_tpu.catalog.executions import execution_or_none
from ddpo_tpu.config.batch import flatten

TRAINED_KEYS = ("seed", "sample.", "train.", "algorithm.", "stat_tracking.", "model.", "reward.", "prompts.",
                "parity.")
RUN_CONTROL_KEYS = ("train.timesteps_per_micro_step", "train.activation_checkpointing", "reward.host_workers",
                    "reward.process.",  # where the reward runs, not what it scores (rewards/managed.py)
                    "model.cache_dir", "model.local_files_only", "model.pretrained")
# what is trained does not depend on how the global batch is split: these per-replica keys are compared as their
# global values (x the topology's replicas), and the topology itself not at all, so a run resumes on any runtime and
# any number of devices that give the same global batches (2 processes resume a 1-process checkpoint and the reverse)
PER_REPLICA_KEYS = {"sample.batch_size": "sample.global_batch_size", "train.batch_size": "train.global_batch_size"}
# keys that moved: a config saved before the move compares under the new name
MOVED_KEYS = {"xla.shuffle_timesteps": "algorithm.shuffle_timesteps"}


def _replicas_of(flat: dict[str, Any]) -> int:
    spec = execution_or_none(flat.get("tpu_topology.execution"))
    if spec is None or not spec.multi_device:  # (a config without one, or of a kind no longer known: one device)
        return 1
    return int(flat.get("tpu_topology.mesh.dp", 1)) * int(flat.get("tpu_topology.mesh.fsdp", 1))


def resume_relevant(tree: dict[str, Any]) -> dict[str, Any]:
    """The flat keys of a config (a plain tree) that a resume compares, per-replica sizes as global ones."""
    flat = flatten(tree)
    for old, new in MOVED_KEYS.items():
        if old in flat and new not in flat and (new != "algorithm.shuffle_timesteps"
                                                or flat.get("algorithm.name") == "ddpo"):
            flat[new] = flat[old]  # (GRPO never read the shuffle knob: it trains its timesteps in order)
    replicas = _replicas_of(flat)
    out = {k: v for k, v in flat.items()
           if k.startswith(TRAINED_KEYS) and not k.startswith(RUN_CONTROL_KEYS) and k not in PER_REPLICA_KEYS}
    for key, name in PER_REPLICA_KEYS.items():
        if isinstance(flat.get(key), int):
            out[name] = flat[key] * replicas
    return dict(sorted(out.items()))


def changed_keys(then: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """Keys of two resume_relevant() configs whose values differ; a key only one of them has is not a change."""
    return sorted(k for k in set(then) & set(now) if then[k] != now[k])
