"""Start the training process with the environment built from config, tee its output into the run dir, forward
signals to it, and report how it ended. One process per job: the XLA runtime lives once per process and the
accelerator is exclusive, so sweep points never share one."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

WORKER_MODULE = "ddpo_tpu.worker"

# exit codes of the training process (documented in the README)
EXIT_OK = 0
EXIT_FAILED = 1
EXIT_CONFIG = 2
EXIT_BUSY = 3        # another training process holds this host's accelerator
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: stopped on SIGTERM after writing a checkpoint; the same command resumes
DOCUMENTED = (EXIT_OK, EXIT_FAILED, EXIT_CONFIG, EXIT_BUSY, EXIT_PREEMPTED)


def _terminate_with_parent() -> None:
    """In the child, before exec: if the front end dies (SIGKILL, a dropped SSH session), the training process gets
    SIGTERM, so it checkpoints and stops instead of running on as an orphan that holds the accelerator."""
    try:
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:  # not Linux: no such guard
        pass


def run_training(env: dict[str, str], log_path: Path) -> int:
    cmd = [sys.executable, "-m", WORKER_MODULE]
    # a new session: a terminal's Ctrl-C reaches only us, and we forward it once (no double interrupt)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=_terminate_with_parent if sys.platform.startswith("linux") else None)

    def forward(signum, _frame):
        if proc.poll() is None:
            proc.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with open(log_path, "ab", buffering=0) as log, _LiveStatus() as live:
            assert proc.stdout is not None
            for line in iter(proc.stdout.readline, b""):
                log.write(line)
                live.show(line)
            code = proc.wait()
            if code in DOCUMENTED:
                return code
            # killed by a signal (Popen gives -N, which would leak out as 256-N) or an undocumented exit: 1, and
            # one line saying how it ended, in train.log and on the console
            how = (f"was killed by {signal.Signals(-code).name}" if code < 0 and -code in signal.valid_signals()
                   else f"exited with code {code}")
            line = (f"error: the training process {how} (see {log_path}; the same command resumes from the last "
                    f"checkpoint)\n").encode()
            log.write(line)
            live.show(line)
            return EXIT_FAILED
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


class _LiveStatus:
    """Pass the training process's lines through; on a terminal, also keep a live status line with the latest
    phase ("[epoch 3] sampling batch 2/8 done"). Built from the lines the trainer prints anyway, so it never touches
    the device or forces a sync."""

    def __enter__(self):
        self.status, self.gone = None, False
        if sys.stdout.isatty():
            from rich.console import Console

            self.console = Console(highlight=False)
            self.status = self.console.status("starting the training process")
            self.status.start()
        return self

    def show(self, raw: bytes) -> None:
        """Never raises: a console that is gone (closed terminal, broken pipe) is dropped, train.log goes on."""
        if self.gone:
            return
        try:
            self._show(raw)
        except (OSError, ValueError):
            self.gone = True

    def _show(self, raw: bytes) -> None:
        if self.status is None:
            sys.stdout.buffer.write(raw)
            sys.stdout.flush()
            return
        text = raw.decode(errors="replace").rstrip("\n")
        self.console.print(text, markup=False)
        if text.startswith("[epoch"):
            from rich.markup import escape

            self.status.update(escape(text))  # "[epoch 3]" is not rich markup

    def __exit__(self, *exc):
        if self.status is not None:
            try:
                self.status.stop()
            except (OSError, ValueError):
                pass
        return False
