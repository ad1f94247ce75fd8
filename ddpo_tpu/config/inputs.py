"""Inputs named by the config, checked before a run dir exists: the run's name and output root, a checkpoint to
resume, prompt files, XLA flags, the compilation cache, profile steps. Paths that live on other machines (a pod's
workers) are checked there (launch/pod.py)."""

from __future__ import annotations

import re
from pathlib import Path

from ddpo_tpu.rundir.checkpoint_layout import holds_checkpoint
from ddpo_tpu.config.batch import Totals
from ddpo_tpu.config.schema import RunConfig
from ddpo_tpu.problems import Fix, Problem
from ddpo_tpu.catalog.edit_checks import edit_family_problems

# what XLA_FLAGS and LIBTPU_INIT_ARGS accept: space-separated --name or --name=value (anything else aborts the runtime)
_FLAG = re.compile(r"--[A-Za-z0-9_]+(=\S*)?")
_ONE_SLASH = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):/(?!/)")


def input_problems(cfg: RunConfig, tot: Totals) -> list[Problem]:
    problems: list[Problem] = []
    if set(cfg.run_name) <= {"."}:  # "." is output_root itself and ".." its parent (the launch directory)
        problems.append(Problem("run_name", cfg.run_name, "names the output root or its parent, not a run dir",
                                "use a name with a letter or digit, e.g. run_name=ddpo"))
    if not cfg.output_root.strip():  # an empty root puts the run dir at the filesystem root
        problems.append(Problem("output_root", repr(cfg.output_root), "empty path",
                                Fix.of({"output_root": "outputs"}, note="or another directory")))
    url = storage_url_problem(cfg.output_root)  # gs://BUCKET/PREFIX (the bucket itself is checked before a run starts)
    if url is not None:
        problems.append(Problem("output_root", cfg.output_root, *url))
    elif _ONE_SLASH.match(cfg.output_root):  # gs:/bucket would become a local directory named "gs:"
        problems.append(Problem("output_root", cfg.output_root, "a URL needs two slashes after its scheme",
                                Fix.of({"output_root": _ONE_SLASH.sub(r"\1://", cfg.output_root, count=1)},
                                       verb="did you mean")))
    problems.extend(resume_problems(cfg.resume))
    problems.extend(prompt_problems(cfg))
    problems.extend(edit_family_problems(cfg))  # the edit family's prompts, reward and guidance
    problems.extend(reward_process_problems(cfg))
    problems.extend(evaluation_problems(cfg))
    problems.extend(_xla_problems(cfg, tot))
    return problems


_REWARD_DEVICE = re.compile(r"cpu|cuda(:[0-9]+)?")


def reward_process_problems(cfg: RunConfig) -> list[Problem]:
    """reward.process (rewards/managed.py): an interpreter that exists and runs, a device it can name. On a pod the
    path is the workers' (launch/sweep.py WORKER_PATH_KEYS): they check it."""
    import os
    import shutil

    p = cfg.reward.process
    problems: list[Problem] = []
    if p.device is not None and not _REWARD_DEVICE.fullmatch(p.device):
        problems.append(Problem("reward.process.device", p.device, "not a device the reward process can use",
                                "use cpu, cuda or cuda:N, or null (the run's CUDA device, else cpu)"))
    if p.python is None:
        return problems
    fix = ("point it at the interpreter of the reward's environment, e.g. /opt/reward-env/bin/python "
           "(scripts/reward_envs/ builds one), or set reward.process.python=null to score in the trainer")
    if not p.python.strip():
        return problems + [Problem("reward.process.python", repr(p.python), "empty path", fix)]
    path = Path(p.python).expanduser()
    if os.sep not in p.python and shutil.which(p.python):  # a bare name found on PATH
        return problems
    if not path.exists():
        problems.append(Problem("reward.process.python", p.python, "no such file", fix))
    elif path.is_dir() or not os.access(path, os.X_OK):
        problems.append(Problem("reward.process.python", p.python,
                                "a directory, not an interpreter" if path.is_dir() else "not executable", fix))
    return problems
def evaluation_problems(cfg: RunConfig) -> list[Problem]:
    from ddpo_tpu.config.eval_plan import evaluation_problems as problems

    return problems(cfg)


def resume_problems(resume: str) -> list[Problem]:
    if resume in ("auto", "never"):
        return []
    path = Path(resume).expanduser()
    if not path.exists():
        return [Problem("resume", resume, "no such checkpoint",
                        Fix.of({"resume": "auto"}, {"resume": "never"}, verb="use",
                               note="or an existing checkpoint path"))]
    if not holds_checkpoint(path):
        return [Problem("resume", resume, "not a checkpoint: neither a checkpoints/epoch_NNNN dir with state.json "
                        "nor a run dir or checkpoints dir holding one",
                        "use resume=auto, resume=never, or the path of a checkpoint")]
    return []


def prompt_problems(cfg: RunConfig) -> list[Problem]:
    """Build the prompt source as the training process will (same reader): missing, binary or empty files; a
    dataset's missing folder or split file, invalid JSON rows (file:line), rows without a prompt, one prompt text with
    two metadata (prompts/datasets.py)."""
    from ddpo_tpu.prompts import PromptError, source_from_config

    p = cfg.prompts
    if p.name == "from_file" and not p.file:
        return [Problem("prompts.file", p.file, "prompts=from_file needs a file", "set prompts.file=PATH")]
    try:
        source = source_from_config(p)
    except PromptError as e:
        return [Problem(e.key, e.value, e.reason, e.fix)]
    return _reward_prompt_problems(cfg, source)


def _reward_prompt_problems(cfg: RunConfig, source) -> list[Problem]:
    """What the run's reward (or each reward=weighted component) needs of its prompts (catalog/rewards.py)."""
    from ddpo_tpu.catalog import REWARDS

    r = cfg.reward
    rewards = [(f"reward.components.{i}", c) for i, c in enumerate(r.components)] if r.name == "weighted" \
        else [("reward", r)]
    # the fixed evaluation prompts, when evaluation reads them (a split's rows are checked as the evaluation's own)
    evals = cfg.evaluation.prompts if cfg.evaluation.every_n_epochs > 0 and cfg.evaluation.split is None else []
    return [p for prefix, reward in rewards
            for p in [*REWARDS.get(reward.name).prompt_problems(reward, prefix, source.parts, evals),
                      *REWARDS.get(reward.name).source_problems(reward, prefix, cfg.prompts, source, evals)]]


def _xla_problems(cfg: RunConfig, tot: Totals) -> list[Problem]:
    problems: list[Problem] = []
    xla = cfg.xla
    examples = {"flags": "--xla_dump_to=/tmp/dump", "libtpu_init_args": "--xla_enable_async_all_gather=true"}
    for key, example in examples.items():
        for i, flag in enumerate(getattr(xla, key)):
            if not _FLAG.fullmatch(flag):
                problems.append(Problem(f"xla.{key}[{i}]", repr(flag), "not a flag of the form --name or "
                                        "--name=value (no spaces)", f"e.g. 'xla.{key}=[\"{example}\"]'"))
    cache = xla.compilation_cache_dir
    if cache not in (None, "auto"):
        if not cache.strip():
            problems.append(Problem("xla.compilation_cache_dir", repr(cache), "empty path",
                                    "use auto, null or a directory"))
        elif (url := storage_url_problem(cache)) is not None or _ONE_SLASH.match(cache) or "://" in cache:
            problems.append(Problem("xla.compilation_cache_dir", cache, url[0] if url else
                                    "the compilation cache is a local directory, not a bucket",
                                    "use a local directory, auto or null"))
        else:
            blocker = _nearest_existing(Path(cache).expanduser())
            if not blocker.is_dir():
                problems.append(Problem("xla.compilation_cache_dir", cache, f"{blocker} is a file, not a directory",
                                        "use a directory, created if missing; or auto or null"))
    if any(s < 0 for s in xla.profile_steps):
        problems.append(Problem("xla.profile_steps", xla.profile_steps, "steps are >= 0", "list step numbers"))
    elif xla.profile_steps and tot.samples_per_epoch % tot.total_train_batch == 0:  # else a batch rule fires
        steps = int(tot.updates_per_epoch) * cfg.num_epochs
        late = [s for s in xla.profile_steps if s >= steps]
        if late:
            problems.append(Problem("xla.profile_steps", xla.profile_steps,
                                    f"step(s) {late} never run: {int(tot.updates_per_epoch)} optimizer steps per "
                                    f"epoch x {cfg.num_epochs} epochs = global steps 0-{steps - 1}",
                                    f"list steps below {steps}"))
    return problems


def storage_url_problem(value: str) -> tuple[str, str] | None:
    from ddpo_tpu.rundir.storage_url import url_problem

    return url_problem(value)


def _nearest_existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path
