"""The entrypoint: `python -m ddpo_tpu.train [+experiment=NAME] [overrides] [-m] [--check]` (console script
`ddpo-train`); `--help` says what to run first.

The front end never imports torch. It
1. refuses environment variables that the config owns (env.py),
2. composes and validates the config of every run (every point of a sweep, launch/sweep.py) and checks what the runs
   need from this machine (launch/machine.py, the output roots, the locks) before anything is written or started;
   `--check` stops here and prints each run's decisions (`--check --json`: each run's plan, config/plan.py, as one
   JSON object per line and nothing else),
3. lets Hydra create each job's run dir, saves the resolved config, the parity report with the run plan and the exact
   environment there,
4. starts the training process (ddpo_tpu.worker) with that environment, one job at a time (launch/process.py).
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

from ddpo_tpu.rundir import storage
from ddpo_tpu.catalog import ALGORITHMS
from ddpo_tpu.config.compose import conf_dir, moved, overridden_keys, validate
from ddpo_tpu.problems import ConfigError
from ddpo_tpu import compile_caches, env as envmod
from ddpo_tpu.launch import machine, process, saved_run, xla_flags
from ddpo_tpu.launch.sweep import Point, changed_sweep_point, compose_points
from ddpo_tpu.proc.lock import accelerator_lock_path

CHECK_FLAGS = ("--check", "--validate")  # compose, validate and check this machine; print the decisions; write nothing
# the same, where this machine must be the run's target (a pod worker's check, launch/pod.py): a missing accelerator
# is refused, not previewed
CHECK_HERE = "--check-here"
# with --check: print each run's plan as JSON, one object per line ({"job", "overrides", "run_dir", "plan"}), instead
# of the screen (what a script or tests/unit/config/test_run_plan.py reads)
JSON_FLAG = "--json"

_failures: list[str] = []
_last_code: list[int] = []


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("--help", "-h") for a in argv):
        print(help_text())
        return
    here = CHECK_HERE in argv
    check_only = here or any(a in CHECK_FLAGS for a in argv)
    as_json = JSON_FLAG in argv
    if as_json and not check_only:
        _fail([f"{JSON_FLAG} goes with --check (it prints each run's plan instead of the check's screen)"])
    # keys that moved, under their new names
    argv = moved([a for a in argv if a not in (*CHECK_FLAGS, CHECK_HERE, JSON_FLAG)])
    points = preflight(argv, check_only, preview=check_only and not here)
    if check_only and points:  # (with --cfg or --info there are none: Hydra shows what was asked, runs nothing)
        print_check_json(points) if as_json else print_check(points)
        return
    _preflight_points[:] = points  # each job reuses its point's validation (_validated_job)

    import hydra

    sys.argv = [sys.argv[0], *argv]
    hydra.main(config_path=str(conf_dir()), config_name="config", version_base="1.3")(_job)()
    if _failures:
        for f in _failures:
            print(f"ddpo_tpu: job failed: {f}", file=sys.stderr)
        sys.exit(_last_code[-1] if len(_last_code) == 1 else process.EXIT_FAILED)


def _fail(lines: list[str], code: int = process.EXIT_CONFIG) -> None:
    for line in lines:
        print(f"error: {line}", file=sys.stderr)
    print("ddpo_tpu: nothing was started.", file=sys.stderr)
    sys.exit(code)


# --- before anything is written ---------------------------------------------------------------------------------------

def preflight(argv: list[str], check_only: bool = False, preview: bool = False) -> list[Point]:
    """Everything that must hold before Hydra writes a single file; the runs, validated. With check_only nothing is
    written at all (the run dirs' locks, which create the run dirs, are not taken); with preview a run whose
    accelerator this machine lacks is checked as a run for another machine (--check)."""
    from hydra._internal.utils import get_args_parser

    args = get_args_parser().parse_args(argv)
    if args.hydra_help or args.shell_completion:
        return []
    legacy = envmod.legacy_problems()
    if legacy:
        _fail(legacy)
    if args.cfg or args.info:
        return []  # showing the config is allowed even when it would not validate
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
        # the run already in its dir: what this command may change there (launch/saved_run.py)
        if p.validated is not None and not any(o.lstrip("+~").startswith("hydra.") for o in p.overrides):
            if args.multirun:
                errors.extend(p.where + line for line in changed_sweep_point(p.validated, p.index))
            elif not storage.is_url(p.validated.cfg.output_root):  # (a bucket's run is restored in its job)
                errors.extend(saved_run.problems(p.validated, _run_dir_of(p.validated.cfg, None),
                                                 overridden=tuple(o.split("=", 1)[0].lstrip("+~")
                                                                  for o in p.overrides)))
    if errors:
        if args.multirun:
            errors.append(f"{len(points)} sweep point(s) checked; invalid ones are named above")
        _fail(errors)
    _fail_on_output_roots({p.validated.cfg.output_root for p in points})
    _fail_on_this_machine(points, preview)
    _fail_on_busy_accelerators({accelerator_lock_path(p.validated.cfg) for p in points if not p.on_target})
    if not check_only:
        # one writer per run dir: its lock is taken here, before anything is written there (the same command twice is
        # refused at once, exit 3), and held for the run's life: by this process, and by the training process it is
        # handed over to (launch/process.py)
        for p in points:  # (a point that moves its dir with hydra.run.dir / hydra.sweep.* takes its lock in _job)
            if not any(o.lstrip("+~").startswith("hydra.") for o in p.overrides):
                _lock_run_dir(_run_dir_of(p.validated.cfg, p.index if args.multirun else None),
                              envmod.node_suffix(p.validated.cfg))
    return points


def _fail_on_output_roots(roots: set[str]) -> None:
    """An unwritable output root is refused before Hydra tries to create a run dir there."""
    for root in roots:
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


def _fail_on_this_machine(points: list[Point], preview: bool = False) -> None:
    """What the runs need from this machine (devices, runtimes, the model cache, tracker names and credentials).
    --check on a machine without a run's accelerator is a preview for another machine: what that run needs from a
    machine is set aside (Point.on_target) and shown as what its target must have, not refused here."""
    errors = []
    for p in points:
        lines = machine.problems(p.validated.cfg, p.overrides)
        if preview and machine.device_problems(p.validated.cfg):
            p.on_target = machine.target_checks(p.validated.cfg)
        else:
            errors.extend(p.where + line for line in lines)
    if errors:
        _fail(list(dict.fromkeys(errors)))


def _fail_on_busy_accelerators(locks: set) -> None:
    """A busy accelerator is refused before a run dir exists (the training process takes the lock itself)."""
    from ddpo_tpu.proc.lock import AcceleratorBusy, AcceleratorLock

    for path in filter(None, locks):
        holder = AcceleratorLock.holder(path)
        if holder is not None:
            _fail([str(AcceleratorBusy(path, holder))], process.EXIT_BUSY)


def print_check(points: list[Point]) -> None:
    """--check: each run's decisions (what it trains, where, the parity table), and that nothing was written."""
    from rich.console import Console
    from rich.text import Text

    from ddpo_tpu.display.console import parity_table, start_lines

    console = Console(highlight=False)
    multirun = len(points) > 1 or any(p.where for p in points)
    for p in points:
        run_dir = _run_dir_of(p.validated.cfg, p.index if multirun else None)
        console.print(Text(p.where.strip() or "ddpo_tpu", style="bold"), soft_wrap=True)
        rows = [(label, text) for label, text in start_lines(p.validated, run_dir) if label != "config"]
        width = max(len(label) for label, _ in rows)
        for label, text in rows:
            console.print(f"  {label:<{width}}  {text}", markup=False, soft_wrap=True)
        console.print(parity_table(p.validated))
        if p.on_target:  # this machine is not the run's target: what the target is checked for when it starts there
            console.print(Text(f"  checked on the target machine when the run starts there (this machine lacks "
                               f"tpu_topology={p.validated.cfg.tpu_topology.name}'s accelerator, so not here):",
                               style="bold"), soft_wrap=True)
            for line in p.on_target:
                console.print(f"    - {line}", markup=False, soft_wrap=True)
    elsewhere = sum(bool(p.on_target) for p in points)
    if elsewhere:
        console.print(f"ddpo_tpu: {len(points)} run(s) valid; {elsewhere} of them for another machine (its checks are "
                      f"listed above, run again there); nothing was written", markup=False, soft_wrap=True)
        return
    console.print(f"ddpo_tpu: {len(points)} run(s) valid and this machine has what they need; nothing was written "
                  f"(the same command without --check starts {'them' if len(points) > 1 else 'it'})", markup=False,
                  soft_wrap=True)


def print_check_json(points: list[Point]) -> None:
    """--check --json: one JSON object per run, the run plan validation made (config/plan.py), nothing else."""
    multirun = len(points) > 1 or any(p.where for p in points)
    for p in points:
        run_dir = _run_dir_of(p.validated.cfg, p.index if multirun else None)
        print(json.dumps({"job": p.index, "overrides": p.overrides, "run_dir": str(run_dir),
                          "plan": p.validated.plan.as_dict()}), flush=True)


def _run_dir_of(cfg, job: int | None) -> Path:
    """The run dir Hydra will create (conf/config.yaml: hydra.run.dir and hydra.sweep.dir/subdir)."""
    root = Path(storage.local_root(cfg.output_root)).expanduser().absolute()
    return root / cfg.run_name if job is None else root / f"{cfg.run_name}-multirun" / str(job)


_run_dir_locks: dict[Path, object] = {}  # run dir -> the RunDirLock this front end holds


def _lock_run_dir(run_dir: Path, suffix: str = ""):
    """The run dir's lock (this node's: `suffix`, env.node_suffix), taken now (or already held by this front end),
    or exit 3 naming its holder. Creates the run dir (the lock is a file in it) and nothing else."""
    from ddpo_tpu.proc.lock import RunDirBusy, RunDirLock

    key = Path(run_dir).resolve()
    if key not in _run_dir_locks:
        try:
            _run_dir_locks[key] = RunDirLock(key, suffix=suffix).acquire()
            _probe_write(key)
        except RunDirBusy as e:
            _fail([str(e)], process.EXIT_BUSY)
        except OSError as e:
            _fail_on_disk(e, key)
    return _run_dir_locks[key]


PROBE_BYTES = 1 << 16  # more than the files the front end and Hydra write before the training process starts


def _probe_write(run_dir: Path) -> None:
    """A run dir whose disk refuses writes (read-only, full) is refused before Hydra writes its files there (its
    error would be a traceback): a probe file of PROBE_BYTES, written, synced and removed."""
    from ddpo_tpu.rundir.files import atomic_write_bytes

    probe = run_dir / ".write_probe"
    try:
        atomic_write_bytes(probe, b"\0" * PROBE_BYTES)
    finally:
        try:
            probe.unlink()
        except OSError:
            pass


def _fail_on_disk(e: OSError, run_dir: Path) -> None:
    """A write of the front end's that the run dir's disk refused (read-only, full): one line, exit 2 (nothing was
    started). Any other OSError is not the disk's answer and keeps its traceback."""
    from ddpo_tpu.worker import STORAGE_ERRORS, storage_error_line

    if e.errno not in STORAGE_ERRORS:
        raise e
    _fail([storage_error_line(e, run_dir)])


def _unlock_run_dir(run_dir: Path) -> None:
    lock = _run_dir_locks.pop(Path(run_dir).resolve(), None)
    if lock is not None:
        lock.release()


# --- one job ---------------------------------------------------------------------------------------------------------

_preflight_points: list[Point] = []  # the runs preflight validated, for the jobs to reuse


def _validated_job(cfg, hc):
    """The job's validated config: its preflight point's when Hydra composed the same tree (one validation, one plan,
    per run in this process), else validated here (a point whose worker-side paths were set aside, or a tree that
    differs)."""
    from ddpo_tpu.config.compose import migrate, to_tree

    num = hc.job.num if getattr(hc.mode, "name", None) == "MULTIRUN" else 0
    point = next((p for p in _preflight_points if p.index == num), None)
    if point is not None and point.validated is not None and not point.deferred:
        try:
            same = migrate(to_tree(cfg)) == point.validated.tree
        except ConfigError:
            same = False
        if same:
            return point.validated
    return validate(cfg, overridden_keys(hc.overrides.task))


def _job(cfg) -> None:
    """One Hydra job: save what the run is, then run it in a fresh training process."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    from ddpo_tpu.display.console import print_start

    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    validated = _validated_job(cfg, hc)
    node = envmod.node_suffix(validated.cfg)  # another node of a multi-node run: its own files beside node 0's
    lock = _lock_run_dir(run_dir, node)  # taken by preflight; hydra.run.dir may be overridden: then taken here
    run_dir.mkdir(parents=True, exist_ok=True)
    url = storage.remote_run_dir(validated.cfg.output_root, run_dir)
    # on a pod only worker 0 writes the bucket's shared files
    writer = envmod.tpu_worker_id() in (None, 0) and not node
    if url is not None:  # the bucket decides where the run continues (a fresh VM has nothing here)
        try:
            storage.restore(run_dir, url, say=lambda line: print(line, flush=True),
                            timeout_s=validated.cfg.storage_timeout_s)
        except storage.StorageError as e:  # unreachable or refused, named (ddpo_tpu/rundir/storage_faults.py)
            print(f"error: output_root={validated.cfg.output_root}: {e}", file=sys.stderr)
            sys.exit(process.EXIT_FAILED)
        except Exception as e:  # noqa: BLE001 -- network, permission: one line, and the run does not start
            print(f"error: output_root={validated.cfg.output_root}: cannot read {url} ({type(e).__name__}: "
                  f"{str(e).splitlines()[0][:200] if str(e) else ''}) (check the bucket and credentials, then run "
                  f"the same command again)", file=sys.stderr)
            sys.exit(process.EXIT_FAILED)
    # torch.compile's cache on this node: a damaged entry is set aside (one warning line) before the training process
    # meets it; one that cannot be moved is one error line, nothing started (ddpo_tpu/compile_caches.py)
    try:
        for line in compile_caches.check_before_start(validated.cfg):
            print(line, file=sys.stderr, flush=True)
    except compile_caches.CompileCacheDamaged as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(process.EXIT_FAILED)
    try:
        # settings a resume changed, kept in resumes.jsonl (node 0's config.yaml is the run's; other nodes keep theirs)
        resumed = saved_run.record_changes(run_dir, validated.tree) if not node else None
        OmegaConf.save(OmegaConf.create(validated.tree), run_dir / f"config{node}.yaml")
        if not node:
            # the parity rows, then the run plan as one more row (config/plan.py `parity_row`)
            rows = [*validated.report, validated.plan.parity_row()]
            (run_dir / "parity.json").write_text(json.dumps(rows, indent=1) + "\n")
        child_env = envmod.child_environment(validated.cfg, run_dir.resolve())
        (run_dir / f"env{node}.json").write_text(json.dumps(envmod.redacted(child_env), indent=1) + "\n")
    except OSError as e:  # the disk turned read-only or full since the probe: one line, nothing started
        _fail_on_disk(e, run_dir)
    if url is not None and writer:
        try:
            storage.upload_files(run_dir, url, ["config.yaml", "parity.json", "env.json"],
                                 validated.cfg.storage_timeout_s)
        except storage.StorageError as e:  # the bucket went away since the check: one line, nothing started
            print(f"error: output_root={validated.cfg.output_root}: {e}", file=sys.stderr)
            sys.exit(process.EXIT_FAILED)
    print_start(validated, run_dir)
    if resumed:
        print(f"ddpo_tpu: {resumed}", flush=True)
    code = process.run_training(child_env, run_dir / f"train{node}.log", lock, process.training_command(validated.cfg),
                                main_node=not node)
    if url is not None and writer:  # the exit the front end recorded, and the log's last lines
        try:  # after a failed run (the bucket may be what failed) a short try, and its line was said already
            storage.upload_files(run_dir, url, ["events.jsonl", "train.log"], timeout_s=storage.CHECK_TIMEOUT_S
                                 if code != process.EXIT_OK else validated.cfg.storage_timeout_s)
        except storage.StorageError as e:
            if code == process.EXIT_OK:
                print(f"error: {e}", file=sys.stderr)
    _unlock_run_dir(run_dir)  # this run dir is done with (a sweep goes on to the next job's)
    _last_code.append(code)
    if code == process.EXIT_PREEMPTED:  # not a failure; a sweep stops here too (the same command continues it)
        print(f"ddpo_tpu: stopped by SIGTERM (exit {code}): the same command resumes", file=sys.stderr)
        sys.exit(code)
    if code != process.EXIT_OK:
        _failures.append(f"{' '.join(hc.overrides.task) or '(no overrides)'}: exit code {code}, "
                         f"log {run_dir / 'train.log'}")



# --- --help ----------------------------------------------------------------------------------------------------------

def help_text() -> str:
    """What a newcomer needs: the first command, the experiments, the modes, the other commands, the exit codes."""
    groups = {d.name: sorted(f.stem for f in d.glob("*.yaml")) for d in sorted(conf_dir().iterdir())
              if d.is_dir() and d.name != "experiment"}
    width = max(len(name) for name, _ in experiments())
    lines = [
        "usage: python -m ddpo_tpu.train [+experiment=NAME] [key=value ...] [-m] [--check [--json] | --cfg job]",
        "       (ddpo-train is the same command)",
        "",
        *textwrap.wrap(f"Fine-tune a diffusion model with RL ({', '.join(a.title for a in ALGORITHMS)}). The config "
                       "is composed with Hydra from conf/ and validated before anything is written; the run dir is "
                       "outputs/<run_name>, and the same command again resumes it.", 115),
        "",
        "Start here (the tiny local model on the CPU, about a minute):",
        "  python -m ddpo_tpu.train +experiment=smoke",
        "",
        "Experiments (+experiment=NAME; each is a file in conf/experiment/):",
        *(f"  {name:<{width}}  {summary}" for name, summary in experiments()),
        "",
        "Config groups (group=option; reward_local is chosen for you), each option a file conf/<group>/<option>.yaml:",
        *(f"  {group}: {', '.join(options)}" for group, options in groups.items()),
        "",
        "Overrides: any key, e.g. seed=1 num_epochs=10 tpu_topology=v6e-8 model.pretrained=/data/sd14 run_name=try2",
        "(every key and its comment: --cfg job and conf/).",
        "",
        "Modes:",
        "  --check       compose and validate every run (every sweep point) and check this machine; print each run's",
        "                decisions and parity table; start and write nothing (exit 0 when all is well). A run for",
        "                another machine (a GPU or TPU topology here) lists what its machine is checked for instead",
        "  --check-here  the same, and this machine must be the run's (ddpo-pod's check on every worker)",
        "  --check --json  each run's plan (the decisions the training uses) as one JSON object per line, nothing else",
        "  --cfg job     print the composed config and run nothing",
        "  -m            a sweep: key=a,b runs one job per value, each validated before the first starts",
        "  --hydra-help  Hydra's own help",
        "",
        "Other commands:",
        "  ddpo-status RUN_DIR|gs://...   where a run stands (--brief, --json, --events N, --plot)",
        "  ddpo-pod --tpu NAME --zone Z -- OVERRIDES   the same command on every worker of a TPU pod (--detach,",
        "                                 --status, --stop, --dry-run); docs/operations.md takes you there",
        "",
        "Exit codes:",
        "  0   done (or --check: valid)",
        "  1   the training process failed or was killed (train.log has the reason)",
        "  2   invalid config, refused environment variable, or something this machine lacks: nothing started",
        "  3   the accelerator or the run dir is held by another run (pid and start time named)",
        "  75  stopped by SIGTERM after a checkpoint: the same command resumes",
        "",
        "HYDRA_FULL_ERROR=1 shows a traceback instead of the one-line errors. README.md and docs/ have the rest.",
    ]
    return "\n".join(lines)


def _closed(phrase: str) -> str:
    """A phrase cut short never ends inside a parenthesis: an unclosed one is dropped with what follows it."""
    opened: list[int] = []
    for i, ch in enumerate(phrase):
        if ch == "(":
            opened.append(i)
        elif ch == ")" and opened:
            opened.pop()
    return phrase[:opened[0]].rstrip(" ,") if opened else phrase


def experiments() -> list[tuple[str, str]]:
    """(name, first phrase of its header comment) of each conf/experiment/*.yaml."""
    import re

    out = []
    for path in sorted((conf_dir() / "experiment").glob("*.yaml")):
        comment = []
        for line in path.read_text().splitlines():
            if not line.startswith("#"):
                break
            if "@package" not in line:
                comment.append(line.lstrip("# ").rstrip())
        first = re.split(r"[.:;](?:\s|$)", " ".join(comment), maxsplit=1)[0]
        cut = first.rfind(", ", 0, 80) if len(first) > 80 else -1
        if len(first) > 80:  # one line: up to a comma that keeps it short
            cut = cut if cut > 0 else first.find(", ")
            first = first[:cut] if cut > 0 else first
        out.append((path.stem, _closed(first)))
    return out


if __name__ == "__main__":
    main()
