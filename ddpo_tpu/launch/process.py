"""Start the training process with the environment built from config, tee its output into the run dir, forward
signals to it, and report how it ended. One process per job: the XLA runtime lives once per process and the
accelerator is exclusive, so sweep points never share one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

# every code, not only those used here: the front end (train.py, eval.py) reads them as `process.EXIT_*`
from ddpo_tpu.proc.exit_codes import (DOCUMENTED, EXIT_BUSY, EXIT_CONFIG, EXIT_FAILED, EXIT_OK,  # noqa: F401
                                     EXIT_PREEMPTED, EXIT_RANK_SAID_WHY)
from ddpo_tpu.rundir.events import EVENTS_FILE, Event, EventLog, WorkerExited, WorkerStarted, parse

WORKER_MODULE = "ddpo_tpu.worker"


def terminate_with_parent() -> None:
    """In the child, before exec (and in each distributed rank, for torchrun): if the parent dies (SIGKILL, a dropped
    SSH session), this process gets SIGTERM, so it checkpoints and stops instead of running on as an orphan that holds
    the accelerator."""
    try:
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:  # not Linux: no such guard
        pass


TORCHRUN_MODULE = "ddpo_tpu.torchrun"


def training_command(cfg=None) -> list[str]:
    """The training process's command: the worker itself, or for the distributed execution torchrun (through
    ddpo_tpu/torchrun.py, which reports its ranks' ends as one line and an exit code) starting one worker per device
    of this node."""
    if cfg is None or not cfg.tpu_topology.spec.torchrun:
        return [sys.executable, "-m", WORKER_MODULE]
    from ddpo_tpu.env import node_rank

    topo, d = cfg.tpu_topology, cfg.distributed
    if d.rdzv_endpoint is None:  # one node: torchrun's c10d store on this host, on a port it picks
        rendezvous = ["--standalone"]
    else:
        rendezvous = ["--rdzv-backend", "c10d", "--rdzv-endpoint", d.rdzv_endpoint, "--rdzv-id", cfg.run_name,
                      "--node-rank", str(node_rank(cfg))]
    return [sys.executable, "-m", TORCHRUN_MODULE, "--nnodes", str(topo.hosts),
            "--nproc-per-node", str(topo.chips_per_host), *rendezvous, "--max-restarts", "0",
            "--monitor-interval", "0.5", "-m", WORKER_MODULE]


def run_training(env: dict[str, str], log_path: Path, run_dir_lock=None, cmd: list[str] | None = None,
                 main_node: bool = True) -> int:
    """Run the training process to its end; its output goes to the console and to log_path (train.log), and its start
    and exit code to events.jsonl beside it. Returns the documented exit code. `run_dir_lock`, the run dir's lock the
    front end holds, is handed over: the training process adopts it (ddpo_tpu/proc/lock.py), so the lock stays held
    while either process lives. `main_node` False (another node of a multi-node run): no events written here."""
    from ddpo_tpu.display.console import third_party_line  # here: ddpo-status imports this module, not the console
    from ddpo_tpu.env import RUN_DIR_LOCK_FD_VARIABLE

    run_dir = Path(log_path).parent
    record = EventLog(run_dir, is_main=main_node, echo=_silent)
    follow = EventFollower(run_dir / EVENTS_FILE, start=_size(run_dir / EVENTS_FILE))
    cmd = cmd or [sys.executable, "-m", WORKER_MODULE]
    handed = run_dir_lock.handover_fd() if run_dir_lock is not None else None
    if handed is not None:
        env = {**env, RUN_DIR_LOCK_FD_VARIABLE: str(handed)}
    # a new session: a terminal's Ctrl-C reaches only us, and we forward it once (no double interrupt)
    try:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True, pass_fds=() if handed is None else (handed,),
                                preexec_fn=terminate_with_parent if sys.platform.startswith("linux") else None)
    finally:
        if handed is not None:
            os.close(handed)  # the child has its copy; ours is the lock's own descriptor
    record.emit(WorkerStarted(worker_pid=proc.pid))  # long before the worker's first event (it imports torch first)

    def forward(signum, _frame):
        if proc.poll() is None:
            proc.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with _Tee(log_path) as log, _LiveStatus(follow) as live:
            assert proc.stdout is not None
            disk_failed, said_why = False, False
            for line in iter(proc.stdout.readline, b""):
                if not log.write(line):  # the run dir's disk failed (read-only, full): stop the run
                    disk_failed = True
                    if proc.poll() is None:  # it checkpoints at its next safe point, if its disk lets it
                        proc.send_signal(signal.SIGTERM)
                said_why = said_why or line.startswith(b"error: ")
                if not third_party_line(line):
                    live.show(line)
            returncode = proc.wait()
            if disk_failed and not said_why:  # one line per failure: the training process's own, else ours
                live.show(log.failure_line())
            code, how = reported_exit(returncode)
            if how:  # one line saying how it ended, in train.log and on the console
                hint = ""
                if returncode == -signal.SIGABRT and env.get("XLA_FLAGS"):  # the front end checks names, not values
                    hint = (f"; XLA aborts on an XLA_FLAGS entry it cannot parse: check xla.flags "
                            f"({env['XLA_FLAGS']})")
                line = (f"error: the training process {how} (see {log_path}{hint}; the same command resumes from the "
                        f"last checkpoint)\n").encode()
                log.write(line)
                live.show(line)
            record.emit(WorkerExited(code=code, message=how or log.reason()))
            return code
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


class _Tee:
    """train.log, appended a line at a time. A write the disk refuses (read-only, full, gone) is not the front end's
    crash: the first one is kept in `error`, write() says False once, and later lines only reach the console."""

    def __init__(self, path: Path):
        self.path, self.file, self.error = Path(path), None, None

    def __enter__(self):
        try:
            self.file = open(self.path, "ab", buffering=0)
        except OSError as e:
            self.error = e
            self._reported = False
        return self

    def write(self, line: bytes) -> bool:
        """False the first time the log cannot be written (opened or appended); True otherwise."""
        if self.error is None:
            try:
                self.file.write(line)
                return True
            except OSError as e:
                self.error, self._reported = e, False
        if self._reported:
            return True
        self._reported = True
        return False

    def reason(self) -> str:
        return "" if self.error is None else f"{self.path} could not be written ({self.error.strerror or self.error})"

    def failure_line(self) -> bytes:
        return (f"error: {self.reason()}: the training process was sent SIGTERM, to stop at its next safe point and "
                f"checkpoint if its disk allows (make the run dir's disk writable or free space, then run the same "
                f"command: it resumes from the last checkpoint)\n").encode()

    def __exit__(self, *exc):
        if self.file is not None:
            try:
                self.file.close()
            except OSError:
                pass
        return False


def reported_exit(returncode: int) -> tuple[int, str]:
    """(the exit code the front end reports, how the process ended when that is not a documented code). A process
    killed by a signal (Popen gives -N, which would leak out as 256-N) or ending with an undocumented code gives 1."""
    if returncode in DOCUMENTED:
        return returncode, ""
    if returncode < 0 and -returncode in signal.valid_signals():
        return EXIT_FAILED, f"was killed by {signal.Signals(-returncode).name}"
    return EXIT_FAILED, f"exited with code {returncode}"


def _silent(*_args) -> None:
    """The front end's events have no console text; the worker's are printed by the worker."""


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


class EventFollower:
    """The events appended to an events file since `start` (a byte offset), complete lines only: what the live
    status line shows. A line being written is kept until its newline arrives."""

    def __init__(self, path: Path, start: int = 0):
        self.path, self.offset, self._partial = Path(path), start, b""

    def poll(self) -> list[Event]:
        try:
            with open(self.path, "rb") as f:
                if f.seek(0, 2) < self.offset:  # rewritten shorter: read it from the start
                    self.offset, self._partial = 0, b""
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        *lines, self._partial = (self._partial + data).split(b"\n")
        out = []
        for line in lines:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and isinstance(rec.get("event"), str):
                event = parse(rec)
                if event is not None:
                    out.append(event)
        return out


class _LiveStatus:
    """Pass the training process's lines through. On a terminal, also draw live progress bars (rich) from the events
    of events.jsonl, read every half second (never from the lines, so rewording a console line changes nothing here;
    never touching the device or forcing a sync): the run's epochs with elapsed time and ETA, and the current phase
    with its batches or timesteps, samples/s and ETA, or a compile with its elapsed time (ddpo_tpu/display/console.py,
    ProgressView). The lines that those events stand for are then dropped from the console (train.log keeps every
    line), and each finished epoch gets one summary line. Not on a terminal (CI, nohup, a pod's log), the lines pass
    through as they are."""

    POLL_S = 0.5

    def __init__(self, follow: EventFollower):
        self.follow = follow

    def __enter__(self):
        from ddpo_tpu.display.console import LineMatcher, ProgressView

        self.progress, self.gone = None, False
        self.view, self.matcher = ProgressView(), LineMatcher()
        self._lock = threading.Lock()  # the follower, the view and the matcher: the poll thread and show()
        if sys.stdout.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TextColumn

            self.console = Console(highlight=False)
            self.progress = Progress(TextColumn("{task.description}"), BarColumn(bar_width=24),
                                     TextColumn("{task.fields[info]}"), console=self.console, transient=True,
                                     refresh_per_second=4, redirect_stdout=False, redirect_stderr=False)
            self._tasks: list = []
            self.progress.start()
            self._draw()
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._follow, name="ddpo-live-status", daemon=True)
            self._thread.start()
        return self

    def _follow(self) -> None:
        while not self._stop.wait(self.POLL_S):
            self._poll()
            self._draw()

    def _poll(self) -> None:
        with self._lock:
            events = self.follow.poll()
            self.update(events)
            self.matcher.expect(events)
            summaries, self.view.summaries = self.view.summaries, []
        for line in summaries:
            self._print(line)

    def update(self, events: list[Event], now: float | None = None) -> None:
        self.view.feed(events, now)

    def _draw(self, now: float | None = None) -> None:
        if self.progress is None or self.gone:
            return
        from rich.markup import escape

        with self._lock:
            bars = self.view.bars(now)
        try:
            while len(self._tasks) < len(bars):
                self._tasks.append(self.progress.add_task("", total=None, info=""))
            while len(self._tasks) > len(bars):
                self.progress.remove_task(self._tasks.pop())
            for task, bar in zip(self._tasks, bars):
                self.progress.update(task, description=escape(bar.label), completed=bar.done or 0,
                                     total=bar.total, info=escape(bar.info))
        except (OSError, ValueError):
            self.gone = True

    def _print(self, text: str) -> None:
        try:
            self.console.print(text, markup=False, soft_wrap=True)  # the terminal wraps it, rich does not
        except (OSError, ValueError):
            self.gone = True

    def show(self, raw: bytes) -> None:
        """Never raises: a console that is gone (closed terminal, broken pipe) is dropped, train.log goes on."""
        if self.gone:
            return
        try:
            if self.progress is None:
                sys.stdout.buffer.write(raw)
                sys.stdout.flush()
                return
        except (OSError, ValueError):
            self.gone = True
            return
        self._poll()  # the event behind this line is in events.jsonl already (written before it is printed)
        line = raw.decode(errors="replace").rstrip("\n").rstrip("\r")
        with self._lock:
            drawn = self.matcher.take(line)
        if not drawn:
            self._print(line)
        self._draw()

    def __exit__(self, *exc):
        if self.progress is not None:
            self._stop.set()
            self._thread.join()
            self._poll()
            try:
                self.progress.stop()
            except (OSError, ValueError):
                pass
        return False
