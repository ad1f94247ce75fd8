"""The entrypoint: `python -m ddpo_tpu.train [+experiment=NAME] [overrides] [-m]` (console script `ddpo-train`).

The front end never imports torch. It
1. refuses environment variables that the config owns (launch/env.py),
2. composes and validates the config of every run (every point of a sweep) before anything is written or started,
3. lets Hydra create each job's run dir, saves the resolved config, the parity report and the exact environment there,
4. starts the training process (ddpo_tpu.worker) with that environment, one job at a time.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ddpo_tpu import storage
from ddpo_tpu.config.compose import Validated, conf_dir, overridden_keys, validate
from ddpo_tpu.problems import ConfigError
from ddpo_tpu.launch import env as envmod
from ddpo_tpu.launch import lora_targets, xla_flags
from ddpo_tpu.launch import process

_failures: list[str] = []
_last_code: list[int] = []


def _fail(lines: list[str], code: int = process.EXIT_CONFIG) -> None:
    for line in lines:
        print(f"error: {line}", file=sys.stderr)
    print("ddpo_tpu: nothing was started.", file=sys.stderr)
    sys.exit(code)


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


def compose_points(overrides: list[str], multirun: bool) -> list[Point]:
    """Compose and validate every run of a command (every sweep point), writing nothing: each point carries its
    validated config or its problems, one line each. Raises ConfigError when the sweep itself cannot be expanded (a
    malformed override, an interval sweep). Shared by the front end and the pod launcher (ddpo_tpu.launch.pod)."""
    from hydra.errors import OverrideParseException

    from ddpo_tpu.config.compose import compose_and_validate, grammar_problem

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
            point.validated = compose_and_validate(run)
        except ConfigError as e:
            if envmod.full_error_requested():
                raise
            point.problems = [point.where + str(p) for p in e.problems]
        else:  # what the model will be asked for, known from its family without loading it
            point.problems = [point.where + line for line in lora_targets.problems(point.validated.cfg.model)]
        points.append(point)
    return points


def preflight(argv: list[str]) -> None:
    """Everything that must hold before Hydra writes a single file."""
    from hydra._internal.utils import get_args_parser

    args = get_args_parser().parse_args(argv)
    if args.help or args.hydra_help or args.shell_completion:
        return
    legacy = envmod.legacy_problems()
    if legacy:
        _fail(legacy)
    if args.cfg or args.info:
        return  # showing the config is allowed even when it would not validate
    try:
        points = compose_points(args.overrides, args.multirun)
    except ConfigError as e:
        if envmod.full_error_requested():  # HYDRA_FULL_ERROR=1: the traceback, as Hydra gives it
            raise
        _fail([str(p) for p in e.problems] or [e.context])
    errors: list[str] = []
    for p in points:
        errors.extend(p.problems)
        if p.validated is not None:  # against this machine's XLA (not in compose_points: ddpo-pod's XLA is remote)
            cfg = p.validated.cfg
            errors.extend(p.where + line for line in xla_flags.problems(cfg.xla.flags, cfg.tpu_topology.execution))
        if (p.validated is not None and args.multirun
                and not any(o.startswith(("hydra.sweep", "+hydra.sweep")) for o in p.overrides)):
            errors.extend(p.where + line for line in _changed_sweep_point(p.validated, p.index))
    if errors:
        if args.multirun:
            errors.append(f"{len(points)} sweep point(s) checked; invalid ones are named above")
        _fail(errors)
    valid = [p.validated for p in points]
    locks = {envmod.accelerator_lock_path(v.cfg) for v in valid}
    roots = {v.cfg.output_root for v in valid}
    for root in roots:  # an unwritable output root is refused before Hydra tries to create a run dir there
        if storage.is_url(root):  # a bucket: gcsfs installed, the bucket there and writable (a probe object)
            problem = storage.check_writable(root)
            if problem is not None:
                _fail([f"output_root={root}: {problem[0]} ({problem[1]})"])
            continue
        existing = Path(root).expanduser().absolute()
        while not existing.exists():
            existing = existing.parent
        if not existing.is_dir() or not os.access(existing, os.W_OK):
            _fail([f"output_root={root}: {existing} is not a writable directory (set output_root=... to one)"])
    _fail_without_runtime_or_credentials(valid)
    # a busy accelerator is refused before a run dir exists (the training process takes the lock itself)
    from ddpo_tpu.launch.lock import AcceleratorBusy, AcceleratorLock

    for path in filter(None, locks):
        holder = AcceleratorLock.holder(path)
        if holder is not None:
            _fail([str(AcceleratorBusy(path, holder))], process.EXIT_BUSY)
    # one writer per run dir: its lock is taken here, before anything is written there (the same command twice is
    # refused at once, exit 3), and held for the run's life: by this process, and by the training process it is
    # handed over to (launch/process.py)
    for p in points:  # (a point that moves its dir with hydra.run.dir / hydra.sweep.* takes its lock in _job)
        if not any(o.lstrip("+~").startswith("hydra.") for o in p.overrides):
            _lock_run_dir(_run_dir_of(p.validated.cfg, p.index if args.multirun else None))


def _run_dir_of(cfg, job: int | None) -> Path:
    """The run dir Hydra will create (conf/config.yaml: hydra.run.dir and hydra.sweep.dir/subdir)."""
    root = Path(storage.local_root(cfg.output_root)).expanduser().absolute()
    return root / cfg.run_name if job is None else root / f"{cfg.run_name}-multirun" / str(job)


_run_dir_locks: dict[Path, object] = {}  # run dir -> the RunDirLock this front end holds


def _lock_run_dir(run_dir: Path):
    """The run dir's lock, taken now (or already held by this front end), or exit 3 naming its holder. Creates the
    run dir (the lock is a file in it) and nothing else."""
    from ddpo_tpu.launch.lock import RunDirBusy, RunDirLock

    key = Path(run_dir).resolve()
    if key not in _run_dir_locks:
        try:
            _run_dir_locks[key] = RunDirLock(key).acquire()
        except RunDirBusy as e:
            _fail([str(e)], process.EXIT_BUSY)
    return _run_dir_locks[key]


def _unlock_run_dir(run_dir: Path) -> None:
    lock = _run_dir_locks.pop(Path(run_dir).resolve(), None)
    if lock is not None:
        lock.release()


def _changed_sweep_point(validated, num: int) -> list[str]:
    """Multirun job dirs are numbered (output_root/run_name-multirun/N): a sweep run again with other values would
    send job N into the dir of an earlier, different point and overwrite its config.yaml. Refused by name."""
    from omegaconf import OmegaConf

    from ddpo_tpu.config import resume

    cfg = validated.cfg
    job_dir = Path(storage.local_root(cfg.output_root)).expanduser() / f"{cfg.run_name}-multirun" / str(num)
    saved_file = job_dir / "config.yaml"
    if cfg.force_resume or not saved_file.is_file():
        return []
    try:
        saved = OmegaConf.to_container(OmegaConf.load(saved_file))
    except Exception as e:  # noqa: BLE001 -- any unreadable file is reported the same way
        return [f"run_name={cfg.run_name}: {saved_file} cannot be read ({type(e).__name__}) (use a new run_name "
                f"for this sweep)"]
    then = resume.resume_relevant(saved)
    now = resume.resume_relevant(json.loads(json.dumps(validated.tree, default=str)))
    changed = resume.changed_keys(then, now)
    if not changed:
        return []
    key = changed[0]
    was = ", ".join(f"{k}={then.get(k)}" for k in changed[:4]) + (", ..." if len(changed) > 4 else "")
    return [f"{key}={now.get(key)}: job dir {job_dir} holds an earlier run of another sweep point ({was}) "
            f"(start this sweep under a new name, e.g. run_name={cfg.run_name}-2, or repeat the old values to "
            f"continue it)"]


def _fail_without_runtime_or_credentials(valid) -> None:
    """What a run needs from this machine, checked before a run dir exists (not at compose time: --cfg, the tests
    and the pod launcher (ddpo-pod) compose TPU configs on machines without a TPU)."""
    import importlib.util

    from ddpo_tpu.launch import machine

    errors = []
    for v in valid:
        topo, logger = v.cfg.tpu_topology, v.cfg.logger
        errors.extend(machine.distributed_problems(v.cfg))
        if topo.torchtpu:
            pass  # TorchTPU's own check above (libtpu comes with it)
        elif topo.accelerator.startswith("tpu") and importlib.util.find_spec("libtpu") is None:
            errors.append(f"tpu_topology={topo.name}: accelerator {topo.accelerator} needs the TPU runtime (libtpu), "
                          f"which is not installed here (on a TPU VM: pip install \"torch_xla[tpu]==2.9.0\"; "
                          f"elsewhere choose tpu_topology=cpu or tpu_topology=eager_cpu)")
        if logger.name == "wandb" and logger.mode == "online" and envmod.wandb_credentials() is None:
            errors.append("logger.mode=online: wandb has no API key (WANDB_API_KEY is unset and ~/.netrc has no "
                          "api.wandb.ai entry) (run `wandb login` or export WANDB_API_KEY=...; or set "
                          "logger.mode=offline and `wandb sync` later)")
    if errors:
        _fail(list(dict.fromkeys(errors)))


def _job(cfg) -> None:
    """One Hydra job: save what the run is, then run it in a fresh training process."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    from ddpo_tpu.console import print_start

    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    lock = _lock_run_dir(run_dir)  # taken by preflight; hydra.run.dir may be overridden: then taken here
    validated = validate(cfg, overridden_keys(hc.overrides.task))
    run_dir.mkdir(parents=True, exist_ok=True)
    url = storage.remote_run_dir(validated.cfg.output_root, run_dir)
    writer = envmod.tpu_worker_id() in (None, 0)  # on a pod only worker 0 writes the bucket's shared files
    if url is not None:  # the bucket decides where the run continues (a fresh VM has nothing here)
        try:
            storage.restore(run_dir, url, say=lambda line: print(line, flush=True))
        except Exception as e:  # noqa: BLE001 -- network, permission: one line, and the run does not start
            print(f"error: output_root={validated.cfg.output_root}: cannot read {url} ({type(e).__name__}: "
                  f"{str(e).splitlines()[0][:200] if str(e) else ''}) (check the bucket and credentials, then run "
                  f"the same command again)", file=sys.stderr)
            sys.exit(process.EXIT_FAILED)
    OmegaConf.save(OmegaConf.create(validated.tree), run_dir / "config.yaml")
    (run_dir / "parity.json").write_text(json.dumps(validated.report, indent=1) + "\n")
    child_env = envmod.child_environment(validated.cfg, run_dir.resolve())
    (run_dir / "env.json").write_text(json.dumps(envmod.redacted(child_env), indent=1) + "\n")
    if url is not None and writer:
        storage.upload_files(run_dir, url, ["config.yaml", "parity.json", "env.json"])
    print_start(validated, run_dir)
    code = process.run_training(child_env, run_dir / "train.log", lock, process.training_command(validated.cfg))
    if url is not None and writer:  # the exit the front end recorded, and the log's last lines
        try:
            storage.upload_files(run_dir, url, ["events.jsonl", "train.log"])
        except storage.StorageError as e:
            print(f"error: {e}", file=sys.stderr)
    _unlock_run_dir(run_dir)  # this run dir is done with (a sweep goes on to the next job's)
    _last_code.append(code)
    if code == process.EXIT_PREEMPTED:  # not a failure; a sweep stops here too (the same command continues it)
        print(f"ddpo_tpu: stopped by SIGTERM (exit {code}): the same command resumes", file=sys.stderr)
        sys.exit(code)
    if code != process.EXIT_OK:
        _failures.append(f"{' '.join(hc.overrides.task) or '(no overrides)'}: exit code {code}, log {run_dir / 'train.log'}")


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    preflight(argv)

    import hydra

    sys.argv = [sys.argv[0], *argv]
    hydra.main(config_path=str(conf_dir()), config_name="config", version_base="1.3")(_job)()
    if _failures:
        for f in _failures:
            print(f"ddpo_tpu: job failed: {f}", file=sys.stderr)
        sys.exit(_last_code[-1] if len(_last_code) == 1 else process.EXIT_FAILED)


if __name__ == "__main__":
    main()
