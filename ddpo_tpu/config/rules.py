"""The rules checked at compose time, after the schema, before any device is touched: one function per concern,
each in its module. Pure Python: no torch, no devices.

  batch.py       batch and parity arithmetic against the topology's replicas, the reference's divisibility rules
  topology.py    chips, hosts, processes, executions and meshes (distributed.py: the distributed execution's)
  memory.py      the per-chip memory model (also what the trainer fuses and checkpoints)
  components.py  the model family, sampler, algorithm, reward and guidance, read from the catalog
  enablement.py  keys that only matter when another key enables them
  inputs.py      names, paths, URLs and flags
  resume.py      the keys a resume compares
"""

from __future__ import annotations

import copy
from typing import Any

from ddpo_tpu.config import batch, components, enablement, inputs, memory, topology
from ddpo_tpu.config.batch import flatten, lookup, same, totals
from ddpo_tpu.config.schema import RunConfig
from ddpo_tpu.problems import Fix, Problem


def check(cfg: RunConfig, tree: dict[str, Any], overridden: frozenset[str] = frozenset()) -> list[Problem]:
    """All rule violations of a schema-valid config. `tree` is the same config as plain dicts (for parity lookups);
    `overridden` the keys the user set (a problem on two keys names the one the user touched)."""
    tot = totals(cfg)
    problems = topology.topology_problems(cfg, overridden)
    problems += batch.parity_problems(cfg, tree, overridden, lambda b: memory.train_batch_fits(cfg, b))
    # the reference's batch rules, unless a parity problem on the same keys already carries a fix
    if not any(p.key.startswith(("sample.", "train.")) and "parity" in p.reason for p in problems):
        problems += batch.batch_problems(cfg, tree, overridden)
    elif batch.fraction_steps(cfg) < 1:
        problems += [p for p in batch.batch_problems(cfg, tree, overridden) if p.key == "train.timestep_fraction"]
    problems += memory.memory_problems(cfg)
    problems += components.family_problems(cfg)
    problems += components.algorithm_problems(cfg, tot)
    problems += components.reward_problems(cfg.reward)
    problems += components.reward_input_problems(cfg)
    problems += components.guidance_problems(cfg)
    problems += one_frame_problems(cfg)
    problems += enablement.ignored_problems(cfg, tree, overridden)
    problems += inputs.input_problems(cfg, tot)
    return problems


def one_frame_problems(cfg: RunConfig) -> list[Problem]:
    """A video reward (catalog RewardSpec.takes="videos") scores a video's frames against each other
    (rewards/frame_consistency.py: F >= 2, else an empty mean after the run started): one frame has none to compare."""
    from ddpo_tpu.catalog import REWARDS, family

    frames, spec = cfg.model.num_frames, family(cfg.model.family)
    if frames is None or frames >= 2 or spec.frame_step is None:
        return []
    r = cfg.reward
    leaves = [(f"reward.components.{i}", c.name) for i, c in enumerate(r.components)] if r.name == "weighted" \
        else [("reward", r.name)]
    temporal = [(key, name) for key, name in leaves if REWARDS.get(name).takes == "videos"]
    if not temporal:
        return []
    key, name = temporal[0]
    return [Problem("model.num_frames", frames, f"{key}={name} is a video reward: it compares a video's frames, and "
                    "one frame has none to compare with", Fix.of({"model.num_frames": 1 + spec.frame_step},
                                                                 verb="try", note="(or more, 4k + 1)"))]


def _leftover(p: Problem, overridden: frozenset[str]) -> bool:
    """An "unknown key" a preset set for the option of a group the command line replaced (not a key the user typed)."""
    group = p.key.split(".", 1)[0]
    return (p.reason == "unknown key" and "." in p.key and group in overridden
            and not any(p.key == k or p.key.startswith(k + ".") for k in overridden if k != group))


def drop_null_leftovers(problems: list[Problem], tree: dict[str, Any], overridden: frozenset[str]
                        ) -> dict[str, Any] | None:
    """The tree without the preset's leftover keys that are null (unset: `+experiment=flow_grpo_geneval_sd35
    reward=pickscore` leaves the preset's `reward.detector_model: null` under pickscore, which nothing would read and
    Hydra's `~key` cannot remove), when those are the only problems with a value; else None (group_leftovers names
    the rest in one line)."""
    pruned, dropped = copy.deepcopy(tree), False
    for p in problems:
        if not _leftover(p, overridden) or lookup(tree, p.key) is not None:
            continue
        *parents, last = p.key.split(".")
        node: Any = pruned
        for k in parents:
            node = node.get(k) if isinstance(node, dict) else None
        if isinstance(node, dict) and last in node:
            del node[last]
            dropped = True
    return pruned if dropped else None


def group_leftovers(problems: list[Problem], tree: dict[str, Any], overridden: frozenset[str]) -> list[Problem]:
    """The schema's "unknown key" lines of keys a preset set for the option the command line replaced
    (`+experiment=flow_grpo_geneval_sd35 reward=pickscore`: the preset's remote reward keys url, timeout_s, ... under
    pickscore), as one line about the option the user chose. The user's own unknown keys keep their lines."""
    out: list[Problem] = []
    left: dict[str, list[Problem]] = {}
    for p in problems:
        if _leftover(p, overridden):
            left.setdefault(p.key.split(".", 1)[0], []).append(p)
        else:
            out.append(p)
    for group, extra in left.items():
        chosen = lookup(tree, f"{group}.name")
        keys = [p.key for p in extra]
        out.append(Problem(group, chosen, f"the preset sets {', '.join(keys)} for its own {group}, and {group}="
                           f"{chosen} does not take {'them' if len(keys) > 1 else 'it'}",
                           f"remove {'them' if len(keys) > 1 else 'it'} with {' '.join('~' + k for k in keys)}, "
                           f"or use a preset made for {group}={chosen}"))
    return out


def parity_report(cfg: RunConfig, tree: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows of (constraint, target, effective, ok) for the console and the run dir."""
    tot = totals(cfg)
    par = cfg.parity
    rows: list[dict[str, Any]] = [
        {"constraint": "replicas (tpu_topology)", "target": None, "effective": tot.replicas, "ok": True},
        {"constraint": "samples per epoch", "target": par.samples_per_epoch, "effective": tot.samples_per_epoch},
        {"constraint": "total train batch", "target": par.total_train_batch, "effective": tot.total_train_batch},
        {"constraint": "optimizer updates per epoch",
         "target": (par.samples_per_epoch * cfg.train.num_inner_epochs / par.total_train_batch
                    if par.samples_per_epoch and par.total_train_batch else None),
         "effective": tot.updates_per_epoch},
        {"constraint": "train timesteps per sample", "target": None, "effective": tot.train_timesteps},
        {"constraint": "timesteps per micro-step", "target": None,
         "effective": memory.fused_timesteps(cfg) if tot.train_timesteps >= 1 else None},
        {"constraint": "activation checkpointing", "target": None, "effective": memory.activation_checkpointing(cfg)},
    ]
    for key, target in flatten(par.pinned).items():
        rows.append({"constraint": key, "target": target, "effective": lookup(tree, key),  # (a pinned null too)
                     "ok": same(lookup(tree, key), target)})
    for row in rows:
        row.setdefault("ok", row["target"] is None or same(row["effective"], row["target"]))
    return rows
