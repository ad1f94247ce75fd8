"""Run the same ddpo_tpu training command on every worker of a TPU VM slice (one training process per host).

    ddpo-pod --tpu NAME --zone ZONE [--project P] [--workdir DIR] [--venv .venv]
             [--dry-run] [--detach | --status | --stop] -- TRAIN OVERRIDES...

    ddpo-pod --tpu my-v6e-16 --zone europe-west4-a --dry-run -- \\
        +experiment=compressibility_parity tpu_topology=v6e-16 sample.num_batches_per_epoch=4 \\
        train.gradient_accumulation_steps=2 model.pretrained=/data/sd14

(`python -m ddpo_tpu.launch.pod` is the same.) A multi-host slice (v6e-16: 4 workers x 4 chips, v4-64: 8 x 4) needs
the training command on EVERY worker: launched on worker 0 only, a v6e-16 run sees 4 of its 16 chips (and ddpo_tpu's
runtime aborts: tpu_topology.processes does not match). This launcher
1. composes and validates the config of every run here, with the front end's own check (ddpo_tpu.launch.sweep);
   an invalid config prints one line per problem and exits 2 without touching the TPU. What only the workers can
   know is not judged here: the paths of launch/sweep.py WORKER_PATH_KEYS (a local model.pretrained, prompts.file,
   reward.mlp_path, resume=PATH, xla.compilation_cache_dir) and the workers' machine (xla.flags names against their
   XLA, libtpu, the Hugging Face cache, credentials, a busy TPU),
2. reads tpu_topology.hosts from it: multi-host topologies run on --worker=all (one process per worker), single-host
   ones on --worker=0 only,
3. checks on those workers first, `VENV/bin/python -m ddpo_tpu.train --check OVERRIDES` (the front end's whole
   validation, writing nothing): one worker's refusal (its lines prefixed with its hostname) starts nothing anywhere,
4. runs `cd WORKDIR && VENV/bin/python -m ddpo_tpu.train OVERRIDES` through
   `gcloud compute tpus tpu-vm ssh NAME --zone ZONE [--project P] --worker=... --command '...'`, each override
   shell-quoted. No environment variable is set: the ones ddpo_tpu reads (PJRT_DEVICE, XLA_FLAGS, ...) are config
   keys (ddpo_tpu/env.py) and the front end refuses them.

Actions (the default is to start training in the foreground, its output streamed back through SSH):
  --detach   start it under nohup + setsid, output appended to WORKDIR/logs/ddpo-pod-<hostname>.log on each worker,
             so a dropped SSH connection does not kill the run
  --status   on every worker: the training processes (pid, elapsed time, command) and `ddpo-status --brief` of the
             newest run dir under the output root (its state from events.jsonl, and the last --lines events)
  --stop     on every worker: SIGTERM to the training front end (it forwards the signal to its training process, which
             writes a checkpoint and exits 75; the same launch command resumes)
Training processes are found by their command line (VENV/bin/python -m ddpo_tpu.train) and working directory
(WORKDIR); a start refuses (exit 3 on that worker) while one already runs there.

--dry-run prints the gcloud command line(s), one per invocation (the workers' check, then the start) and ready to
paste into a shell, and runs nothing; paths that exist only on the workers are fine there.
SSH to TPU VMs is flaky: a gcloud exit code 255 (SSH connection failure) is retried up to --retries times with
exponential backoff (a foreground training run that had been going for longer than a minute is not re-run).
Exit code: gcloud's (the remote command's: 2 or 3 when a worker's check refuses), or 2 when the config or the
arguments are refused here.
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
import time

from ddpo_tpu.proc.cli_args import OneLineParser, at_least, non_empty
from ddpo_tpu.rundir.events import EVENTS_FILE
from ddpo_tpu.env import OWNED_VARIABLES

PROG = "ddpo-pod"
TRAIN_MODULE = "ddpo_tpu.train"
STATUS_MODULE = "ddpo_tpu.status"
SSH_FAILED = 255            # ssh's exit code for a connection failure (gcloud passes it through)
ALREADY_RUNNING = 3         # a worker's exit code when a start finds a training process already running there
EXIT_REFUSED = 2
LOG_DIR = "logs"            # under WORKDIR; the --detach log of each worker is ddpo-pod-<hostname>.log
NO_RETRY_AFTER_S = 60.0     # a foreground run whose SSH dropped after this long had started: never re-run it

# Training processes by command line, anchored at the start so the remote shell whose own command line *contains*
# "-m ddpo_tpu.train" (bash -c '... python -m ddpo_tpu.train ...') never matches: the front end (launched by us as
# VENV/bin/python -m ddpo_tpu.train) and the training process it starts (python -m ddpo_tpu.worker).
FRONT_END_PATTERN = r"^[^ ]*python[0-9.]* -m ddpo_tpu[.]train( |$)"
TRAINING_PATTERN = r"^[^ ]*python[0-9.]* -m ddpo_tpu[.](train|worker)( |$)"

# shell function: pids of the current user's processes matching $1 whose working directory is this one
_PIDS_HERE = ('pids_here() { here=$(pwd -P); for p in $(pgrep -u "$(id -u)" -f "$1"); do '
              '[ "$(readlink /proc/$p/cwd)" = "$here" ] && echo "$p"; done; return 0; }')
_PREFIX = 'sed "s|^|$(hostname): |"'  # every output line prefixed with the worker's hostname


# --- the remote commands (pure) ---------------------------------------------------------------------------------------

def shell_path(path: str) -> str:
    """A path for the remote shell: quoted, but a leading ~/ stays unquoted so it expands to the remote $HOME."""
    if path == "~":
        return "~"
    if path.startswith("~/"):
        rest = path[2:].strip("/")
        return "~/" + shlex.quote(rest) if rest else "~"
    return shlex.quote(path)


def _cd(workdir: str) -> str:
    return f"cd {shell_path(workdir)} || exit 1"


def _python(venv: str) -> str:
    return shell_path(venv.rstrip("/") + "/bin/python")


def _train_argv(overrides: list[str], venv: str) -> str:
    return " ".join([_python(venv), "-m", TRAIN_MODULE, *(shlex.quote(o) for o in overrides)])


def _guard() -> str:
    """Refuse to start a second training process in the same working directory (a retried SSH, a second launch)."""
    return (f"if [ -n \"$(pids_here {shlex.quote(FRONT_END_PATTERN)})\" ]; then "
            f"echo \"$(hostname): a ddpo_tpu training process is already running in $PWD "
            f"({PROG} --status shows it, --stop stops it)\" >&2; exit {ALREADY_RUNNING}; fi")


def build_remote_command(overrides: list[str], workdir: str = "~/ddpo_tpu", venv: str = ".venv",
                         detach: bool = False) -> str:
    """The shell command every worker runs to start training: `cd WORKDIR && VENV/bin/python -m ddpo_tpu.train ...`.

    Each override is one shell word (shlex.quote). VENV is relative to WORKDIR unless absolute. With detach the
    front end runs under nohup + setsid (no SIGHUP when the SSH session ends, no controlling terminal) with stdout and
    stderr appended to WORKDIR/logs/ddpo-pod-<hostname>.log, and the command returns at once.
    """
    train = _train_argv(overrides, venv)
    head = f"{_cd(workdir)}; {_PIDS_HERE}; {_guard()}"
    if not detach:
        return f"{head}; exec {train}"
    log = f"{LOG_DIR}/ddpo-pod-$(hostname).log"
    return (f"{head}; mkdir -p {LOG_DIR} || exit 1; log=\"{log}\"; "
            f"nohup setsid {train} >>\"$log\" 2>&1 </dev/null & "
            f"echo \"$(hostname): started {TRAIN_MODULE} (pid $!), log $PWD/$log\"")


def build_check_command(overrides: list[str], workdir: str = "~/ddpo_tpu", venv: str = ".venv") -> str:
    """The front end's whole check on a worker (`python -m ddpo_tpu.train --check-here ...`, this worker being the
    run's machine: worker-side paths, XLA flag
    names, libtpu, the model cache, a busy TPU), writing nothing: its error lines prefixed with the worker's
    hostname, its exit code passed on (0 when the worker can run it)."""
    check = " ".join([_python(venv), "-m", TRAIN_MODULE, "--check-here", *(shlex.quote(o) for o in overrides)])
    return (f"{_cd(workdir)}; out=$({check} 2>&1 >/dev/null); code=$?; "
            f"if [ -n \"$out\" ]; then printf '%s\\n' \"$out\" | {_PREFIX} >&2; fi; "
            f"if [ $code -eq 0 ]; then echo \"$(hostname): check passed\"; fi; exit $code")


def build_status_command(workdir: str = "~/ddpo_tpu", output_root: str = "outputs", lines: int = 5,
                         venv: str = ".venv") -> str:
    """Show the training processes of WORKDIR and `ddpo-status --brief --events LINES` of the newest run dir under
    the output root (the one whose events.jsonl changed last), each line prefixed with the worker's hostname."""
    body = (f"{_PIDS_HERE}; "
            f"pids=$(pids_here {shlex.quote(TRAINING_PATTERN)} | paste -sd, -); "
            # -ww: the whole command line (piped, ps cuts it at 80 columns: a long venv path hid the command)
            f"if [ -n \"$pids\" ]; then ps -ww -o pid,etime,args -p \"$pids\"; "
            f"else echo \"no training process in $PWD\"; fi; "
            f"run=$(find {shell_path(output_root)} -maxdepth 3 -name {EVENTS_FILE} -type f -printf '%T@ %h\\n' "
            f"2>/dev/null | sort -rn | head -n 1 | cut -d' ' -f2-); "
            f"if [ -n \"$run\" ]; then {_python(venv)} -m {STATUS_MODULE} --brief --events {int(lines)} \"$run\"; "
            f"else echo \"no run dir with {EVENTS_FILE} under {output_root} yet\"; fi")
    return f"{_cd(workdir)}; {{ {body}; }} 2>&1 | {_PREFIX}"


def build_stop_command(workdir: str = "~/ddpo_tpu") -> str:
    """SIGTERM to the training front end(s) of WORKDIR, which forward it to the training process (it checkpoints and
    exits 75). Only when no front end is left is the training process signalled directly (never both: one signal)."""
    body = (f"{_PIDS_HERE}; "
            f"pids=$(pids_here {shlex.quote(FRONT_END_PATTERN)}); "
            f"[ -n \"$pids\" ] || pids=$(pids_here {shlex.quote(TRAINING_PATTERN)}); "
            f"if [ -n \"$pids\" ]; then kill -TERM $pids && echo \"sent SIGTERM to\" $pids; "
            f"else echo \"no training process in $PWD\"; fi")
    return f"{_cd(workdir)}; {{ {body}; }} 2>&1 | {_PREFIX}"


def worker_flag(hosts: int | None) -> str:
    """--worker=all on a multi-host slice (or when the topology is not known), --worker=0 on a single host."""
    return "--worker=0" if hosts == 1 else "--worker=all"


def build_gcloud_commands(args: argparse.Namespace, hosts: int | None) -> list[list[str]]:
    """The gcloud invocations of this action in order, each as an argv list (run without a local shell): a start is
    the workers' check, then the start."""
    if args.status:
        remotes = [build_status_command(args.workdir, getattr(args, "output_root", "outputs"), args.lines, args.venv)]
    elif args.stop:
        remotes = [build_stop_command(args.workdir)]
    else:
        remotes = [build_check_command(args.overrides, args.workdir, args.venv),
                   build_remote_command(args.overrides, args.workdir, args.venv, args.detach)]
    commands = []
    for remote in remotes:
        check_no_owned_variables(remote)
        cmd = ["gcloud", "compute", "tpus", "tpu-vm", "ssh", args.tpu, "--zone", args.zone]
        if args.project:
            cmd += ["--project", args.project]
        commands.append(cmd + [worker_flag(hosts), *args.gcloud_flag, "--command", remote])
    return commands


def check_no_owned_variables(remote: str) -> None:
    """The launcher never sets a variable ddpo_tpu owns (config keys carry them); a guard against future edits."""
    for name in OWNED_VARIABLES:
        if re.search(rf"(^|[\s;&|(]){name}=|\bexport\s+{name}\b", remote):
            raise RuntimeError(f"{PROG} would set {name}, which ddpo_tpu owns: set {OWNED_VARIABLES[name]} instead")


# --- config -----------------------------------------------------------------------------------------------------------

class Refused(Exception):
    """Arguments or config refused: one message per line, exit 2, nothing run."""

    def __init__(self, lines: list[str]):
        self.lines = lines
        super().__init__("\n".join(lines))


def split_overrides(tokens: list[str]) -> tuple[list[str], bool]:
    """The Hydra overrides and whether -m/--multirun was given; other Hydra flags make no sense on a pod."""
    multirun = False
    overrides = []
    for t in tokens:
        if t in ("-m", "--multirun"):
            multirun = True
        elif t.startswith("-"):
            raise Refused([f"{t}: {PROG} passes Hydra overrides only (run `python -m {TRAIN_MODULE} ... {t}` "
                           f"locally to inspect a config)"])
        else:
            overrides.append(t)
    return overrides, multirun


def validated_topology(overrides: list[str], multirun: bool):
    """The front end's validation of every run (every sweep point); returns (topology, output_root, the worker-side
    paths left to the workers' check). What it checks about the machine (libtpu, credentials, the model cache, locks,
    earlier job dirs) and what the paths hold belong to the workers: their check runs before anything starts."""
    from ddpo_tpu.problems import ConfigError
    from ddpo_tpu.launch.sweep import compose_points

    try:
        points = compose_points(overrides, multirun, defer_paths=True)
    except ConfigError as e:
        raise Refused([str(p) for p in e.problems] or [e.context]) from None
    errors = [line for p in points for line in p.problems]
    if errors:
        raise Refused(errors)
    pinned = [f"{p.where}distributed.node_rank={p.validated.cfg.distributed.node_rank}: every worker of the pod runs "
              f"the same command, so all {p.validated.cfg.tpu_topology.hosts} would be that node (remove it: auto "
              f"reads each worker's TPU_WORKER_ID)" for p in points
              if p.validated.cfg.distributed.node_rank != "auto" and p.validated.cfg.tpu_topology.hosts > 1]
    if pinned:
        raise Refused(pinned)
    found = [(p.validated.cfg.tpu_topology, p.validated.cfg.output_root) for p in points]
    hosts = {topo.hosts for topo, _ in found}
    if len(hosts) > 1:
        names = ", ".join(sorted({f"{t.name} ({t.hosts} hosts)" for t, _ in found}))
        raise Refused([f"tpu_topology: the sweep mixes topologies with different host counts ({names}); one slice "
                       f"has one; launch each topology on its own slice"])
    return (*found[0], list(dict.fromkeys(line for p in points for line in p.deferred)))


# --- running ----------------------------------------------------------------------------------------------------------

_sleep = time.sleep
_clock = time.monotonic


def run_with_retry(cmd: list[str], retries: int = 3, backoff_s: float = 5.0,
                   no_retry_after_s: float | None = None) -> int:
    """Run one gcloud command; on exit code 255 (SSH connection failure) retry up to `retries` times, waiting
    backoff_s, 2 x backoff_s, 4 x backoff_s, ... in between. When no_retry_after_s is given, a 255 after the command
    had run that long is not retried (a foreground run whose connection dropped mid-way)."""
    attempt = 0
    while True:
        start = _clock()
        code = subprocess.run(cmd).returncode
        if code != SSH_FAILED:
            return code
        if no_retry_after_s is not None and _clock() - start > no_retry_after_s:
            _say(f"the SSH connection dropped after {_clock() - start:.0f} s, so the run had started: not re-running "
                 f"it (see --status; --detach keeps a run alive across SSH drops)")
            return code
        if attempt >= retries:
            _say(f"SSH failed (exit {SSH_FAILED}) {attempt + 1} times; giving up")
            return code
        delay = backoff_s * 2 ** attempt
        attempt += 1
        _say(f"SSH failed (exit {SSH_FAILED}); retry {attempt}/{retries} in {delay:g} s")
        _sleep(delay)


def _say(msg: str) -> None:
    print(f"{PROG}: {msg}", file=sys.stderr, flush=True)


# --- CLI --------------------------------------------------------------------------------------------------------------

def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = OneLineParser(
        prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="%(prog)s --tpu NAME --zone ZONE [options] [--detach | --status | --stop] -- TRAIN OVERRIDES...")
    parser.add_argument("--tpu", required=True, type=non_empty, metavar="NAME", help="the TPU VM (slice) name")
    parser.add_argument("--zone", required=True, type=non_empty, help="its zone, e.g. europe-west4-a")
    parser.add_argument("--project", help="the GCP project (default: gcloud's configured one)")
    parser.add_argument("--workdir", default="~/ddpo_tpu",
                        help="the ddpo_tpu checkout on every worker (default ~/ddpo_tpu; the run dirs go under it)")
    parser.add_argument("--venv", default=".venv",
                        help="its virtual environment, relative to --workdir (default .venv)")
    parser.add_argument("--dry-run", action="store_true", help="print the gcloud command line(s) and run nothing")
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--detach", action="store_true",
                        help="run under nohup + setsid with a log per worker (WORKDIR/logs/ddpo-pod-HOST.log)")
    action.add_argument("--status", action="store_true",
                        help="show the training processes and the newest run's state (ddpo-status --brief) on every "
                             "worker")
    action.add_argument("--stop", action="store_true",
                        help="SIGTERM the training on every worker (it checkpoints and exits 75)")
    parser.add_argument("--lines", type=at_least(0), default=5, help="--status: recent events to show (default 5)")
    parser.add_argument("--retries", type=at_least(0), default=3, help="retries on SSH failure, exit 255 (default 3)")
    parser.add_argument("--backoff", type=at_least(0, float), default=5.0,
                        help="first retry delay in seconds, doubling (default 5)")
    parser.add_argument("--gcloud-flag", action="append", default=[], metavar="FLAG",
                        help="extra gcloud flag, repeatable (e.g. --gcloud-flag=--internal-ip)")
    if "--" in argv:
        i = argv.index("--")
        args = parser.parse_args(argv[:i])
        args.overrides = argv[i + 1:]
    else:  # overrides without `--`: everything argparse does not know, as long as it is not an option
        args, rest = parser.parse_known_args(argv)
        args.overrides = rest
    return args


def _announce(args: argparse.Namespace, topo) -> None:
    """Which workers this action targets, and why."""
    if topo is None:
        _say("no overrides: the topology is unknown, targeting --worker=all")
        return
    hosts = topo.hosts
    if args.status or args.stop:
        _say(f"tpu_topology={topo.name}: targeting {worker_flag(hosts)}")
    elif hosts > 1:
        _say(f"tpu_topology={topo.name} is multi-host ({hosts} hosts x {topo.chips_per_host} chips = {topo.chips} "
             f"chips): running on --worker=all, expecting {hosts} processes (one per worker)")
    else:
        _say(f"tpu_topology={topo.name} is single-host ({topo.chips} chip{'s' if topo.chips != 1 else ''}): "
             f"running on --worker=0 only")
    if not topo.accelerator.startswith("tpu"):
        _say(f"warning: tpu_topology={topo.name} is not a TPU topology (accelerator {topo.accelerator})")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        overrides, multirun = split_overrides(args.overrides)
        if not overrides and not (args.status or args.stop):
            raise Refused(["no training overrides given (e.g. -- +experiment=compressibility_parity "
                           "tpu_topology=v6e-16 ...); the topology decides which workers run"])
        topo, args.output_root, worker_paths = None, "outputs", []
        if overrides or multirun:
            topo, args.output_root, worker_paths = validated_topology(overrides, multirun)
        args.overrides = (["-m"] if multirun else []) + overrides
    except Refused as e:
        for line in e.lines:
            print(f"error: {line}", file=sys.stderr)
        _say("nothing was run.")
        return EXIT_REFUSED
    _announce(args, topo)
    for path in worker_paths:
        _say(f"{path}: not on this machine; the workers' check looks for it before anything starts")
    commands = build_gcloud_commands(args, None if topo is None else topo.hosts)
    if args.dry_run:
        for cmd in commands:
            _say(f"each worker runs: {cmd[-1]}")
            print(shlex.join(cmd))
        return 0
    starting = not (args.status or args.stop)
    code = 0
    for i, cmd in enumerate(commands):
        is_start = starting and i == len(commands) - 1
        code = run_with_retry(cmd, retries=args.retries, backoff_s=args.backoff,
                              no_retry_after_s=NO_RETRY_AFTER_S if is_start and not args.detach else None)
        if code != 0:
            if starting and not is_start:
                _say(f"a worker's check refused the run (exit {code}; its lines are above): nothing was started")
            break
    if code == 0 and args.detach:
        where = ["--tpu", args.tpu, "--zone", args.zone] + (["--project", args.project] if args.project else [])
        if args.workdir != "~/ddpo_tpu":
            where += ["--workdir", args.workdir]
        _say(f"started; follow it with: {shlex.join([PROG, *where, '--status'])}")
    return code


if __name__ == "__main__":
    sys.exit(main())
