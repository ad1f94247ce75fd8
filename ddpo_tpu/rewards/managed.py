"""A reward in a Python environment of its own: the trainer starts it, talks to it over loopback, restarts it once,
stops it with the run.

`reward.process.python: /opt/geneval-env/bin/python` (ddpo_tpu/config/schema.py `RewardProcessConfig`) makes the
run's reward a ManagedReward (built by rewards/from_config.py). It starts ``PYTHON -m ddpo_tpu.rewards.serve``
(rewards/serve.py) with the reward's config on stdin, waits for its one ready line and its ``/health`` (bounded by
``startup_timeout_s``), and scores through RemoteReward's client (the wire of rewards/remote.py: metadata in,
extras out). Lifecycle:

* log: the process's stdout and stderr (model loading, warnings, tracebacks) are appended to the run dir's
  ``reward_process.log`` (``reward_process-rank<N>.log`` for rank N > 0 of a distributed run, which starts its own);
* restart policy: the process found dead (before a call, or a call that failed because it died) is started again
  once in the whole run, with one warning line on stderr naming its exit; found dead a second time, the call raises
  a RewardError whose one line names the process, its exit and its log, and the run stops resumable (worker.py turns
  a RewardError into one `error:` line and exit 1; a reward error ends an epoch before its checkpoint, so the last
  checkpoint is intact and the same command resumes from it);
* stop: ``close()`` (SIGTERM, then SIGKILL after 10 s), called by the worker when the run ends (close_all), at
  interpreter exit (a weakref finalizer), and, when the trainer dies without either (SIGKILL, os._exit), by the
  process itself: it polls its parent pid and exits when the trainer is gone (rewards/serve.py);
* it runs in a session of its own, so a Ctrl-C in the trainer's terminal does not kill it mid-epoch: the trainer
  stops at its next safe point and then stops the process.

ddpo_tpu is imported in that environment from this checkout: the package's parent directory goes first on the
process's PYTHONPATH (decision: no install in the other environment, so it always runs the trainer's own code).
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import weakref
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from ddpo_tpu.env import process_rank, reward_process_environment
from ddpo_tpu.rewards.base import Metadata, Reward, RewardError, RewardScores

# the one line rewards/serve.py prints on stdout once its reward is built and its socket listens, then the port
READY_PREFIX = "ddpo_tpu reward process listening on 127.0.0.1:"

__all__ = ["ManagedReward", "close_all", "describe_exit", "log_path_for"]

LOG_NAME = "reward_process.log"
_TERM_GRACE_S = 10.0
_LIVE: "weakref.WeakSet[ManagedReward]" = weakref.WeakSet()
_PACKAGE_PARENT = str(Path(__file__).resolve().parents[2])


def describe_exit(code: int | None) -> str:
    """A process's return code in words: "killed by SIGKILL", "exit code 1"."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def log_path_for(run_dir: Path | None) -> Path:
    """Where this process's reward process logs: the run dir (this rank's file under torchrun), else the cwd."""
    rank = process_rank()
    name = LOG_NAME if rank == 0 else LOG_NAME.replace(".log", f"-rank{rank}.log")
    return (run_dir if run_dir is not None else Path.cwd()) / name


def close_all() -> None:
    """Stop every reward process this process started (the worker's `finally`)."""
    for reward in list(_LIVE):
        reward.close()


def _terminate(box: dict) -> None:
    """SIGTERM, a grace period, SIGKILL; reaped. `box["proc"]` (not the reward) so a finalizer can hold it."""
    proc = box.get("proc")
    if proc is None or proc.poll() is not None:
        return
    try:
        proc.terminate()
        proc.wait(timeout=_TERM_GRACE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=_TERM_GRACE_S)
    except OSError:
        pass


class ManagedReward(Reward):
    """The reward of `config` scored by a process of `python` (see the module docstring).

    Args:
        config: the reward's config as a plain mapping (the `reward` section, its `process` block cleared).
        python: the other environment's interpreter.
        log_path: the file the process's output is appended to.
        cache_dir: the model cache the process builds `tiny` stand-ins in.
        device: where the process runs the reward (cpu, cuda:1), or None (cpu).
        port: the loopback port, or None (a free one).
        startup_timeout_s: seconds to become ready; request_timeout_s: seconds a request may take.
        batch_size: images per request.
        imports: modules the process imports first (rewards registered outside ddpo_tpu; tests).
    """

    def __init__(self, config: Mapping[str, Any], *, python: str, log_path: str | Path, cache_dir: str | Path,
                 device: str | None = None, port: int | None = None, startup_timeout_s: float = 600.0,
                 request_timeout_s: float = 600.0, batch_size: int = 64, imports: Sequence[str] = ()):
        self.name = str(config["name"])
        self.config = json.loads(json.dumps(dict(config)))  # plain JSON (a copy): what the process is sent
        self.python, self.log_path, self.cache_dir = str(python), Path(log_path), str(cache_dir)
        self.device, self.port = device, port
        self.startup_timeout_s, self.request_timeout_s = float(startup_timeout_s), float(request_timeout_s)
        self.batch_size, self.imports = int(batch_size), tuple(imports)
        self._lock = threading.Lock()
        self._box: dict[str, Any] = {}  # proc, client (what the finalizer needs, without a reference to self)
        self._restarts = 0
        self._closed = False
        self._start()
        weakref.finalize(self, _terminate, self._box)  # at exit too (finalize's atexit)
        _LIVE.add(self)

    # set by the trainer (rewards/from_config.py): a request waiting on the process gives up once it returns True
    should_stop = staticmethod(lambda: False)

    @property
    def pid(self) -> int | None:
        proc = self._box.get("proc")
        return proc.pid if proc is not None else None

    @property
    def restarts(self) -> int:
        return self._restarts

    def _where(self) -> str:
        return f"reward.process.python={self.python}"

    # -- the process -------------------------------------------------------------------------------------------

    def _start(self) -> None:
        from ddpo_tpu.rewards.remote import RemoteReward

        cmd = [self.python, "-m", "ddpo_tpu.rewards.serve", "--port", str(self.port or 0),
               "--parent-pid", str(os.getpid()), "--cache-dir", self.cache_dir]
        if self.device:
            cmd += ["--device", self.device]
        for module in self.imports:
            cmd += ["--import", module]
        env = reward_process_environment(_PACKAGE_PARENT)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} starting: {' '.join(cmd)}\n".encode())
            log.flush()
            try:
                proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env,
                                        close_fds=True, start_new_session=True)
            except OSError as exc:
                raise self._error(f"{self._where()}: cannot start it: {exc}. Fix: point reward.process.python at "
                                  "an existing interpreter (e.g. /opt/env/bin/python)") from None
        self._box["proc"] = proc
        try:
            proc.stdin.write(json.dumps(self.config).encode())
            proc.stdin.close()
        except OSError:
            pass  # it died at once: the wait below says how
        port = self._wait_ready(proc)
        client = RemoteReward(f"http://127.0.0.1:{port}/score", timeout_s=self.request_timeout_s, retries=0,
                              batch_size=self.batch_size, image_format="raw")
        self._box["client"] = client
        self._wait_health(proc, port)

    def _startup_failure(self, proc: subprocess.Popen, what: str) -> RewardError:
        _terminate({"proc": proc})
        return self._error(f"{self._where()}: the reward process (pid {proc.pid}) {what}; its log: {self.log_path}"
                           f"{self._log_tail()}")

    def _wait_ready(self, proc: subprocess.Popen) -> int:
        deadline = time.monotonic() + self.startup_timeout_s
        line = b""
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            while not line.endswith(b"\n"):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise self._startup_failure(proc, f"was not ready within reward.process.startup_timeout_s="
                                                f"{self.startup_timeout_s:g} (raise it for a slow model load)")
                if self.should_stop():
                    raise self._startup_failure(proc, "was stopped: the run was asked to stop while it started")
                if sel.select(timeout=min(left, 0.5)):
                    chunk = os.read(proc.stdout.fileno(), 4096)
                    if not chunk:
                        proc.wait(timeout=_TERM_GRACE_S)
                        raise self._startup_failure(
                            proc, f"ended before it was ready ({describe_exit(proc.returncode)})")
                    line += chunk
        proc.stdout.close()

        text = line.decode(errors="replace").strip()
        if not text.startswith(READY_PREFIX) or not text[len(READY_PREFIX):].isdigit():
            raise self._startup_failure(proc, f"printed {text[:200]!r} instead of its ready line")
        return int(text[len(READY_PREFIX):])

    def _wait_health(self, proc: subprocess.Popen, port: int) -> None:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never a proxy
        deadline = time.monotonic() + min(self.startup_timeout_s, 60.0)
        last = ""
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise self._startup_failure(proc, f"ended after it was ready ({describe_exit(proc.returncode)})")
            try:
                with opener.open(f"http://127.0.0.1:{port}/health", timeout=5) as reply:
                    if json.loads(reply.read()).get("ok"):
                        return
            except Exception as exc:  # noqa: BLE001 -- retried until the deadline
                last = f"{type(exc).__name__}: {exc}"
            time.sleep(0.1)
        raise self._startup_failure(proc, f"did not answer GET /health on 127.0.0.1:{port} ({last})")

    def _log_tail(self, lines: int = 3) -> str:
        try:
            tail = [ln.strip() for ln in self.log_path.read_text(errors="replace").splitlines() if ln.strip()]
        except OSError:
            return ""
        tail = [ln for ln in tail if not ln.startswith("=== ")][-lines:]
        return f" (its last line: {tail[-1][:300]})" if tail else ""

    def _running_client(self):
        """The client of a live process: a dead one is started again once in the run; a second death raises."""
        with self._lock:
            if self._closed:
                raise self._error(f"{self._where()}: the reward process was stopped (the run is ending)")
            proc = self._box["proc"]
            if proc.poll() is None:
                return self._box["client"]
            exit_text = describe_exit(proc.returncode)
            if self._restarts >= 1:
                raise self._error(
                    f"{self._where()}: the reward process (pid {proc.pid}) died again ({exit_text}) after its one "
                    f"restart; the run stops here and the same command resumes from its last checkpoint; its log: "
                    f"{self.log_path}")
            self._restarts += 1
            print(f"warning: {self._where()}: the reward process of reward.name={self.name} (pid {proc.pid}) "
                  f"died ({exit_text}); restarting it once (log: {self.log_path})", file=sys.stderr, flush=True)
            self._start()
            return self._box["client"]

    # -- scoring -----------------------------------------------------------------------------------------------

    def score(self, images: np.ndarray, prompts: list[str], metadata: Metadata = None) -> RewardScores:
        images = self._check_host_images(images, prompts)
        while True:  # bounded: each pass either returns, raises, or used the one restart
            client = self._running_client()
            proc = self._box["proc"]
            client.should_stop = self.should_stop
            try:
                return client.score(images, list(prompts), metadata=metadata)
            except RewardError as exc:
                try:
                    proc.wait(timeout=2.0)  # a reset connection comes a moment before the exit status
                except subprocess.TimeoutExpired:
                    pass
                if proc.poll() is None:  # alive: the reward itself failed (its traceback is in the log)
                    message = str(exc).split(": ", 1)[-1]
                    raise self._error(f"{self._where()}: {message}; the reward process's log: {self.log_path}"
                                      ) from None
                # it died during the call: the next pass restarts it (once) or names the second death

    def __call__(self, images: np.ndarray, prompts: list[str], metadata: Metadata = None) -> np.ndarray:
        return self.score(images, prompts, metadata=metadata).values

    def close(self) -> None:
        """Stop the process (SIGTERM, then SIGKILL); later calls raise."""
        with self._lock:
            self._closed = True
            _terminate(self._box)
        _LIVE.discard(self)

    def __repr__(self) -> str:
        return f"ManagedReward(name={self.name!r}, python={self.python!r}, pid={self.pid}, device={self.device!r})"
