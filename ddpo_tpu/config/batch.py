"""Batch and parity arithmetic: how a per-replica config adds up to an epoch and an optimizer step, the reference's
divisibility rules, and the parity group's targets and pinned values. Pure Python."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from ddpo_tpu.catalog import ALGORITHMS
from ddpo_tpu.config.schema import RunConfig
from ddpo_tpu.problems import Fix, Problem, as_typed


def num_train_timesteps(cfg: RunConfig) -> int:
    """Timesteps trained per sample: the algorithm's own count where its catalog entry names one (AWM's
    algorithm.train_timesteps: catalog AlgorithmSpec.trained_timesteps), else the sampled steps' (fraction_steps)."""
    own = ALGORITHMS.get(cfg.algorithm.name).own_timesteps(cfg)
    return fraction_steps(cfg) if own is None else own


def fraction_steps(cfg: RunConfig) -> int:
    """Denoising steps of a rollout the training draws on: an SDE window's steps (flow_grpo's fast trainer trains all
    of them), else int(steps x train.timestep_fraction) as the references do (int, not round). What DDPO, GRPO and NFT
    train per sample; the range AWM draws its own count of times from."""
    if cfg.sample.sde_window.size is not None:
        return cfg.sample.sde_window.size
    return int(cfg.sample.num_steps * cfg.train.timestep_fraction)


@dataclass(frozen=True)
class Totals:
    replicas: int
    samples_per_epoch: int
    total_train_batch: int
    updates_per_epoch: float
    train_timesteps: int


def totals(cfg: RunConfig) -> Totals:
    r = cfg.tpu_topology.replicas
    s = cfg.sample.batch_size * cfg.sample.num_batches_per_epoch * r
    t = cfg.train.batch_size * cfg.train.gradient_accumulation_steps * r
    return Totals(r, s, t, s * cfg.train.num_inner_epochs / t, num_train_timesteps(cfg))


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


MISSING = object()


def lookup(tree: dict[str, Any], dotted: str) -> Any:
    """The value at a dotted key of a plain config tree, or MISSING."""
    node: Any = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return MISSING
        node = node[part]
    return node


def same(a: Any, b: Any) -> bool:
    """Equal as config values: a bool is not an int, floats equal to 12 digits."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b or a == b and type(a) is type(b)
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-12, abs_tol=0.0)
    return a == b


def pick(keys: tuple[str, ...], overridden: frozenset[str]) -> str:
    """Name the key the user touched, if any of the involved ones; else the first."""
    return next((k for k in keys if k in overridden), keys[0])


def product_fix(target: int, replicas: int, first: tuple[str, int], second: tuple[str, int],
                ok_first: Callable[[int], bool] = lambda v: True, keep_first: bool = True) -> Fix | str:
    """Per-replica settings a x b with a x b x replicas == target: one-key changes first, then a pair.
    keep_first=False: the first key's value itself is not ok, so no option keeps it."""
    (ka, a), (kb, b) = first, second
    if target % replicas:
        return f"{target} is not divisible by {replicas} replicas: use parity=none or another tpu_topology"
    per = target // replicas
    options: list[dict[str, int]] = []
    if per % b == 0 and ok_first(per // b):
        options.append({ka: per // b})
    if per % a == 0 and keep_first:
        options.append({kb: per // a})
    if not options:
        for cand in sorted((d for d in range(1, per + 1) if per % d == 0), key=lambda d: abs(d - a)):
            if ok_first(cand):
                options.append({ka: cand, kb: per // cand})
                break
    return Fix.of(*options, verb="try") if options else f"no per-replica split of {per} fits"


def parity_problems(cfg: RunConfig, tree: dict[str, Any], overridden: frozenset[str],
                    train_batch_fits: Callable[[int], bool]) -> list[Problem]:
    """The parity group's samples per epoch, total train batch and pinned values."""
    problems: list[Problem] = []
    tot, par, sample, train = totals(cfg), cfg.parity, cfg.sample, cfg.train
    R = tot.replicas
    if par.samples_per_epoch is not None and tot.samples_per_epoch != par.samples_per_epoch:
        k = pick(("sample.batch_size", "sample.num_batches_per_epoch"), overridden)
        fix = product_fix(par.samples_per_epoch, R, ("sample.batch_size", sample.batch_size),
                          ("sample.num_batches_per_epoch", sample.num_batches_per_epoch),
                          ok_first=lambda v: v >= train.batch_size and v % train.batch_size == 0)
        problems.append(Problem(k, lookup(tree, k),
                                f"{sample.batch_size} x {sample.num_batches_per_epoch} batches x {R} replicas = "
                                f"{tot.samples_per_epoch} samples/epoch, parity {par.name} needs "
                                f"{par.samples_per_epoch}", fix))
    if par.total_train_batch is not None and tot.total_train_batch != par.total_train_batch:
        k = pick(("train.gradient_accumulation_steps", "train.batch_size"), overridden)
        fix = product_fix(par.total_train_batch, R, ("train.batch_size", train.batch_size),
                          ("train.gradient_accumulation_steps", train.gradient_accumulation_steps),
                          ok_first=lambda v: v <= sample.batch_size and sample.batch_size % v == 0
                          and train_batch_fits(v), keep_first=train_batch_fits(train.batch_size))
        problems.append(Problem(k, lookup(tree, k),
                                f"{train.batch_size} x {train.gradient_accumulation_steps} accumulation x {R} replicas "
                                f"= {tot.total_train_batch} per optimizer step, parity {par.name} needs "
                                f"{par.total_train_batch}", fix))
    for key, target in flatten(par.pinned).items():
        got = lookup(tree, key)
        if got is MISSING:
            problems.append(Problem(f"parity.pinned.{key}", target, "pins a key the config does not have",
                                    "fix the parity config"))
        elif not same(got, target):
            problems.append(Problem(key, got, f"parity {par.name} pins {as_typed(target)}",
                                    Fix.of({key: target}, note="or parity=none to leave the reference")))
    return problems


def batch_problems(cfg: RunConfig, tree: dict[str, Any], overridden: frozenset[str]) -> list[Problem]:
    """The reference's batch rules: whole train batches in a sampling batch, whole optimizer steps in an epoch, at
    least one trained timestep."""
    problems: list[Problem] = []
    tot, sample, train = totals(cfg), cfg.sample, cfg.train
    if sample.batch_size < train.batch_size or sample.batch_size % train.batch_size:
        k = pick(("train.batch_size", "sample.batch_size"), overridden)
        divisors = [d for d in range(sample.batch_size, 0, -1) if sample.batch_size % d == 0]
        fix_tbs = next((d for d in divisors if d <= train.batch_size), 1)
        problems.append(Problem(k, train.batch_size if k == "train.batch_size" else sample.batch_size,
                                f"per-replica sample batch {sample.batch_size} must be >= and divisible by the "
                                f"train batch {train.batch_size}", Fix.of({"train.batch_size": fix_tbs}, verb="try")))
    elif tot.samples_per_epoch % tot.total_train_batch:
        k = pick(("train.gradient_accumulation_steps", "train.batch_size"), overridden)
        batches = sample.batch_size * sample.num_batches_per_epoch // train.batch_size
        good = [d for d in range(1, batches + 1) if batches % d == 0]
        fix_acc = min(good, key=lambda d: abs(d - train.gradient_accumulation_steps))
        problems.append(Problem(k, lookup(tree, k),
                                f"{tot.samples_per_epoch} samples/epoch is not a multiple of the total train batch "
                                f"{tot.total_train_batch}: an optimizer step would straddle epochs",
                                Fix.of({"train.gradient_accumulation_steps": fix_acc}, verb="try")))
    if fraction_steps(cfg) < 1:  # nothing to train, or (AWM) no steps to draw its times from
        problems.append(Problem("train.timestep_fraction", train.timestep_fraction,
                                f"int({sample.num_steps} steps x {train.timestep_fraction}) = 0 timesteps to train",
                                Fix.of({"train.timestep_fraction": min_fraction(sample.num_steps)}, verb="use",
                                       note="or more")))
    return problems


def min_fraction(num_steps: int) -> float:
    """The smallest 3-decimal fraction that trains at least one timestep (rounded up, checked)."""
    v = math.ceil(1000 / num_steps) / 1000
    while int(num_steps * v) < 1:
        v += 0.001
    return round(min(v, 1.0), 3)
