"""The runs of one command line, composed and validated before anything is written (no torch import).

A command is one run, or with -m a sweep: the cartesian product of its comma-separated overrides, in the order
Hydra's basic sweeper runs them. Each run becomes a `Point` carrying its validated config or its problems, one line
each. Used by the front end (ddpo_tpu/train.py) and the pod launcher (ddpo_tpu/launch/pod.py).

What a path names is known only on the machine that trains: the pod launcher composes on a laptop while
`model.pretrained=/data/sd14` lives on the TPU workers. With `defer_paths` the problems of WORKER_PATH_KEYS that name
a path are set aside (`Point.deferred`) instead of refusing the run; the workers check them before anything starts
(`python -m ddpo_tpu.train --check` on every worker, ddpo_tpu/launch/pod.py).
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field
from pathlib import Path

from ddpo_tpu.rundir import storage
from ddpo_tpu.config.compose import Validated
from ddpo_tpu.problems import ConfigError, Problem
from ddpo_tpu import env as envmod
from ddpo_tpu.launch import lora_targets

# keys whose value is a path on the machine that trains (each checked there: present, readable, the right kind)
WORKER_PATH_KEYS = (
    re.compile(r"model\.pretrained"),                                   # a local diffusers dir (a hub id is no path)
    re.compile(r"prompts\.(file|nouns_file|activities_file)"),          # prompt lists
    # the rewards' weights files: the run's reward, a weighted component, or GARDO's gate reward (the aesthetic MLP,
    # HPSv2's and ImageReward's checkpoints, ImageReward's med_config, GenEval's mmdet checkpoint and config)
    re.compile(r"(reward(\.components\.\d+)?|algorithm\.kl_gate_rewards\.\d+)\."
               r"(mlp_path|checkpoint|med_config|detector_model|detector_config)"),
    re.compile(r"reward\.process\.python"),                               # the reward environment's interpreter
    re.compile(r"(prompts|evaluation)\.path"),                          # a prompt dataset folder or file
    re.compile(r"resume"),                                              # resume=PATH: a checkpoint
    re.compile(r"(xla\.compilation_cache_dir|distributed\.compile_cache_dir)"),  # a directory, created if missing
)


def is_worker_path_problem(problem: Problem) -> bool:
    """A problem about what a path holds on this machine (not an empty or missing value, which is refused anywhere)."""
    return (isinstance(problem.value, str) and bool(problem.value.strip()) and not _URL.match(problem.value)
            and any(k.fullmatch(problem.key) for k in WORKER_PATH_KEYS))


_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]+:/")  # gs://...: no path on any machine, refused here as anywhere


def expand_sweep(overrides: list[str]) -> list[list[str]]:
    """The jobs Hydra's basic sweeper will run, in the same order (cartesian product of the sweep overrides)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    axes = []
    for o in parsed:
        if o.is_sweep_override():
            if o.is_interval_sweep():
                raise ConfigError([], f"{o.input_line}: interval sweeps need a sweeper plugin; list the values")
            key = o.get_key_element()
            axes.append([f"{key}={v}" for v in o.sweep_string_iterator()])
        else:
            axes.append([o.input_line])
    return [list(p) for p in itertools.product(*axes)]


@dataclass
class Point:
    """One run of a command line: the command itself, or one point of a sweep."""

    index: int
    overrides: list[str]
    where: str  # "[job N: overrides] " in a sweep, "" otherwise: what its problem lines start with
    validated: Validated | None = None
    problems: list[str] = field(default_factory=list)
    deferred: list[str] = field(default_factory=list)  # "key=path" of worker-side path problems set aside
    # --check on a machine without the run's accelerator: what the target machine must have, checked there
    on_target: list[str] = field(default_factory=list)


def compose_points(overrides: list[str], multirun: bool, defer_paths: bool = False) -> list[Point]:
    """Compose and validate every run of a command (every sweep point), writing nothing: each point carries its
    validated config or its problems, one line each. Raises ConfigError when the sweep itself cannot be expanded (a
    malformed override, an interval sweep)."""
    from hydra.errors import OverrideParseException

    from ddpo_tpu.config.compose import grammar_problem

    try:
        runs = expand_sweep(overrides) if multirun else [overrides]
    except OverrideParseException as e:  # a malformed sweep override, named like any other problem
        if envmod.full_error_requested():
            raise
        raise ConfigError([grammar_problem(e)]) from None
    points = []
    for i, run in enumerate(runs):
        point = Point(i, run, f"[job {i}: {' '.join(run)}] " if multirun else "")
        try:
            point.validated, deferred = _validated(run, defer_paths)
        except ConfigError as e:
            if envmod.full_error_requested():
                raise
            point.problems = [point.where + str(p) for p in e.problems]
        else:  # what the model will be asked for, known from its family without loading it
            point.deferred = [f"{point.where}{p.key}={p.value}" for p in deferred]
            point.problems = [point.where + line for line in lora_targets.problems(point.validated.cfg.model)]
        points.append(point)
    return points


def _validated(run: list[str], defer_paths: bool) -> tuple[Validated, list[Problem]]:
    """The run's validated config and the worker-side path problems set aside; ConfigError with the others."""
    from ddpo_tpu.config.compose import compose, overridden_keys, to_tree, validate_tree

    tree = to_tree(compose(run))
    try:
        return validate_tree(tree, overridden_keys(run)), []
    except ConfigError as e:
        if not defer_paths:
            raise
        deferred = [p for p in e.problems if is_worker_path_problem(p)]
        others = [p for p in e.problems if not is_worker_path_problem(p)]
        if others or not deferred:  # refused for what this machine can judge (the workers' paths are theirs)
            raise ConfigError(others, e.context) from None
    # every problem is about what a path holds there: the config is otherwise whole (the rules ran on all of it)
    from pydantic import ValidationError

    from ddpo_tpu.config import rules
    from ddpo_tpu.config.schema import RunConfig

    try:
        cfg = RunConfig.model_validate(tree)
    except ValidationError:
        raise ConfigError(deferred) from None
    return Validated(cfg, tree, rules.parity_report(cfg, tree)), deferred


def changed_sweep_point(validated: Validated, num: int) -> list[str]:
    """Multirun job dirs are numbered (output_root/run_name-multirun/N): a sweep run again with other values would
    send job N into the dir of an earlier, different point and overwrite its config.yaml. Refused by name
    (launch/saved_run.py)."""
    from ddpo_tpu.launch import saved_run

    cfg = validated.cfg
    job_dir = Path(storage.local_root(cfg.output_root)).expanduser() / f"{cfg.run_name}-multirun" / str(num)
    return saved_run.problems(validated, job_dir, sweep_job=num)
