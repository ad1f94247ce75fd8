"""A rank that stops answering, named in bounded time (torch-free: the launcher and the ranks both use it).

Why not a short collective timeout (torchtitan lowers it after the first step): the rank whose collective times out
is the one that waited, not the one that hung (gloo's traceback then blames rank 0), and a legitimately long step
(rank 0 writing a 10 GB checkpoint while the others wait at a barrier) must not end the job. So each rank proves it
is alive instead, whatever its main thread is doing:

- Every rank runs a daemon thread that rewrites `ranks/rank<N>.alive` (its pid and host inside) every
  RANK_BEAT_S seconds. A compile, a long step or a wait in a collective keeps beating; a stopped process (SIGSTOP, a
  debugger) or a frozen one does not.
- The beat also carries what the rank's main thread waits on (a reward call, a collective, a checkpoint write) and the
  seconds since its last progress (ddpo_tpu/waits.py). A main thread stuck in a wait while its process beats (a
  reward server that never answers) ends the job once it has made no progress for the bound, named with that wait;
  its peers, waiting for it in a collective just as long, are not blamed (RankWatch._check_waits).
- Each node's launcher (ddpo_tpu/torchrun.py) looks at its ranks every half second, and at the other nodes' ranks'
  beats in the shared run dir: a rank stopped, or whose beat is older than `distributed.hang_timeout_s`, ends the
  job at once, in one line naming the rank, its pid and the key
  (and an `error` event); every rank of the node gets SIGKILL (a stopped process cannot act on torchrun's SIGTERM,
  which would otherwise wait out its 30 s grace; a rank blocked in a collective has nothing to save: checkpoints are
  written whole, so the last one is intact).
- A rank whose collective fails because a peer went away (a node killed, a rank killed by another node's launcher)
  names that peer from the same beats: the rank whose process is gone or whose beat stopped (`lost_peers`). A peer
  of the same launcher is left to that launcher, which knows how it ended (its exit code or signal): one line.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from pathlib import Path

RANK_BEAT_S = 2.0
HANG_KEY = "distributed.hang_timeout_s"


def beat_path(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / "ranks" / f"rank{rank}.alive"


class RankBeat:
    """This rank's heartbeat file, written by a daemon thread while the process runs: its pid, host and launcher,
    and what its main thread waits on with the seconds since its last progress (ddpo_tpu/waits.py's snapshot)."""

    def __init__(self, run_dir: Path, rank: int, interval: float = RANK_BEAT_S):
        self.path, self.interval = beat_path(run_dir, rank), interval
        self._stop = threading.Event()
        self._lock = threading.Lock()  # the thread's beat and end()'s last word never interleave

    def _write(self, **extra) -> None:
        from ddpo_tpu.waits import snapshot

        info = {"pid": os.getpid(), "host": socket.gethostname(), "launcher": os.getppid(), **snapshot(), **extra}
        # whole or not at all (the watch reads it any time); one fixed name per rank, not the `.*.*.tmp` of
        # interrupted writes, which rank 0's start clears while the other ranks already beat
        tmp = self.path.with_name(f".{self.path.name}.next")
        tmp.write_text(json.dumps(info) + "\n")
        os.replace(tmp, self.path)

    def start(self) -> RankBeat:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._write()
        threading.Thread(target=self._run, name="ddpo-rank-beat", daemon=True).start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            with self._lock:
                if self._stop.is_set():
                    return
                try:
                    self._write()
                except OSError:  # a full disk takes no new file but may take a touch
                    try:
                        os.utime(self.path)
                    except OSError:  # a disk that refuses it: the launcher may then call the rank silent, which it is
                        pass

    def end(self) -> None:
        """The rank's work is done: from here its teardown (the process group's, the interpreter's, which stops
        daemon threads such as this one) is torchrun's to time, not a hang."""
        with self._lock:
            self._stop.set()
            try:
                self._write(ended=True)
            except OSError:
                pass


def read_state(run_dir: Path, rank: int) -> dict | None:
    """A rank's beat file as of now, or None before its first beat: pid, host, launcher, ended, age (seconds since
    its last beat), and what its main thread waits on: wait (its kind, None outside a wait), what, and idle (seconds
    since its last progress: as written, plus the file's age)."""
    path = beat_path(run_dir, rank)
    try:
        info = json.loads(path.read_text())
        age = time.time() - path.stat().st_mtime
        return {"pid": int(info["pid"]), "host": str(info["host"]), "launcher": int(info.get("launcher", 0)),
                "ended": bool(info.get("ended", False)), "age": age, "wait": info.get("wait"),
                "what": str(info.get("what", "")), "idle": float(info.get("idle_s", 0.0)) + max(age, 0.0),
                "bound": float(info.get("bound_s", 0.0))}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def read_beat(run_dir: Path, rank: int) -> tuple[int, str, float, int, bool] | None:
    """(pid, host, seconds since its last beat, its launcher's pid, whether it has ended its work) of a rank, or
    None before its first beat."""
    state = read_state(run_dir, rank)
    if state is None:
        return None
    return state["pid"], state["host"], state["age"], state["launcher"], state["ended"]


def _gone(pid: int, host: str) -> bool:
    if host != socket.gethostname():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    from ddpo_tpu.proc.lock import proc_state

    state = proc_state(pid)  # a zombie, or a stopped process, is gone too
    return state is not None and state[0] in ("Z", "X", "T", "t")


STALE_S = 2.5 * RANK_BEAT_S  # a beat this old has stopped


def lost_peers(run_dir: Path, world: int, me: int, wait_s: float = 3 * RANK_BEAT_S) -> list[tuple[str, bool]]:
    """The ranks that went away, as seen from rank `me` after a collective failed: (a description, "rank 2 (pid 123
    on host)"; whether it had this rank's launcher, which then reports how it ended), gone from this host's process
    table, stopped, or with a stale beat; waits up to `wait_s` for one to show (the living keep beating from their
    threads while their main threads fail)."""
    deadline = time.monotonic() + wait_s
    host_here, launcher = socket.gethostname(), os.getppid()
    while True:
        out = []
        for rank in range(world):
            beat = read_beat(run_dir, rank)
            if rank == me or beat is None:
                continue
            pid, host, age, its_launcher, ended = beat
            if _gone(pid, host) or (age > STALE_S and not ended):  # a rank tearing down beats no more
                out.append((f"rank {rank} (pid {pid} on {host})", host == host_here and its_launcher == launcher))
        if out or time.monotonic() >= deadline:
            return out
        time.sleep(0.25)


class RankWatch:
    """The launcher's look at its own ranks (the children running the worker), every call to `check`."""

    def __init__(self, run_dir: Path, bound_s: float, world: int = 0):
        self.run_dir, self.bound_s, self.world = Path(run_dir), float(bound_s), world
        self._start = time.time()
        self._fresh: set[int] = set()  # other nodes' ranks seen beating in this job (their files are shared)
        self._stopped_since: dict[int, float] = {}
        self._seen: set[int] = set()  # pids of this node's ranks seen alive
        self.ending = False  # one of them has ended: the job is ending
        self.fired: str | None = None

    def _ranks(self) -> list:
        import psutil

        from ddpo_tpu.env import torchrun_ranks

        out = []
        for child in psutil.Process().children(recursive=False):
            try:
                ranks = torchrun_ranks(child.environ())
                if ranks is not None:
                    out.append((ranks[0], child))
            except psutil.Error:
                continue
        return out

    def check(self) -> str | None:
        """The line naming a rank that has stopped or gone silent for longer than the bound, after ending every rank
        of this node (once); None while all answer. Once a rank has ended (the job is ending, and torchrun names
        that rank), a rank left stopped or silent is killed without a line: its silence is a consequence (a
        process tearing down stops its daemon threads), and torchrun's SIGTERM grace would wait 30 s for it."""
        import psutil

        if self.fired is not None:
            return None
        now, ranks = time.monotonic(), self._ranks()
        live = []
        for rank, proc in ranks:
            try:
                status = proc.status()
            except psutil.Error:
                continue
            if status not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
                live.append((rank, proc, status))
        self.ending = self.ending or bool(self._seen - {proc.pid for _, proc, _ in live})
        self._seen |= {proc.pid for _, proc, _ in live}
        for rank, proc, status in live:
            beat = read_beat(self.run_dir, rank)
            if beat is not None and beat[0] == proc.pid and beat[4]:
                continue  # its work is done: its exit is torchrun's to wait for
            if self.ending:
                if status in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP) or (
                        beat is not None and beat[0] == proc.pid and beat[2] > STALE_S):
                    _kill(proc)
                continue
            why = None
            if status in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP):
                since = self._stopped_since.setdefault(proc.pid, now)
                if now - since >= self.bound_s:
                    why = f"has been stopped (SIGSTOP or a debugger) for {now - since:.0f} s"
            else:
                self._stopped_since.pop(proc.pid, None)
                if beat is not None and beat[0] == proc.pid and beat[2] > self.bound_s:
                    why = f"has not beaten for {beat[2]:.0f} s (frozen{_last_wait(self.run_dir, rank)})"
            if why is None:
                continue
            self.fired = (f"rank {rank} (pid {proc.pid}) {why}, over {HANG_KEY}={self.bound_s:g}: the job was ended "
                          f"(every rank of this node killed); the same command resumes from the last checkpoint")
            for _, other in ranks:
                _kill(other)
            return self.fired
        if not self.ending:
            return (self._check_other_nodes({proc.pid for _, proc, _ in live}, ranks)
                    or self._check_waits({rank: proc.pid for rank, proc, _ in live}, ranks))
        return None

    def _check_waits(self, ours: dict[int, int], ranks: list) -> str | None:
        """A rank whose main thread has made no progress inside a wait (ddpo_tpu/waits.py) for longer than the
        bound, its process still beating: a reward call or a checkpoint write that never returns. Its peers then wait
        for it in a collective, just as long: a rank in a collective is named only when every rank of the job is
        (nobody can move: the one that has waited longest), otherwise the rank stuck elsewhere is (the longest
        stuck, when several are). Time outside a wait (a compile, a long step) is never a hang here."""
        from ddpo_tpu.waits import COLLECTIVE, describe

        known = set(ours) | set(range(self.world))
        stuck = {}
        for rank in sorted(known):
            state = read_state(self.run_dir, rank)
            if state is None or state["ended"] or state["age"] > STALE_S:
                continue  # no beat of this job yet, its work done, or silent: the beat checks above judge it
            if rank in ours and state["pid"] != ours[rank]:
                continue  # a previous attempt's file
            # a wait may allow itself longer (a reward that gives up by its own timeouts: ddpo_tpu/waits.py)
            if state["wait"] and state["idle"] > max(self.bound_s, state["bound"]):
                stuck[rank] = state
        blocking = {r: s for r, s in stuck.items() if s["wait"] != COLLECTIVE}
        if not blocking and len(stuck) < len(known):
            return None
        rank, state = max((blocking or stuck).items(), key=lambda kv: (kv[1]["idle"], -kv[0]))
        here = rank in ours
        who = f"rank {rank} (pid {state['pid']}" + (")" if here else f" on {state['host']})")
        over = (f"{HANG_KEY}={self.bound_s:g}" if state["bound"] <= self.bound_s
                else f"the {state['bound']:g} s its own timeouts allow one request")
        self.fired = (f"{who} made no progress for {state['idle']:.0f} s, waiting on "
                      f"{describe(state['wait'], state['what'])}, over {over}: the job was "
                      f"ended (every rank of this node killed); the same command{'' if here else 's'} "
                      f"resume{'s' if here else ''} from the last checkpoint")
        for _, other in ranks:
            _kill(other)
        return self.fired

    def _check_other_nodes(self, ours: set[int], ranks: list) -> str | None:
        """Another node's rank whose beat (read from the shared run dir) went stale: its node was killed, stopped or
        cut off. Named here within the bound, whether or not a collective with it comes first (a long accumulation
        window has none)."""
        for rank in range(self.world):
            beat = read_beat(self.run_dir, rank)
            if beat is None or beat[0] in ours or beat[4]:
                continue
            pid, host, age, _, _ = beat
            if time.time() - age >= self._start:
                self._fresh.add(rank)
            if rank in self._fresh and age > self.bound_s:
                self.fired = (f"rank {rank} (pid {pid} on {host}) has not beaten for {age:.0f} s (its node is gone, "
                              f"stopped or cut off), over {HANG_KEY}={self.bound_s:g}: the job was ended (every rank "
                              f"of this node killed); the same commands resume from the last checkpoint")
                for _, other in ranks:
                    _kill(other)
                return self.fired
        return None


def _last_wait(run_dir: Path, rank: int) -> str:
    """', last seen waiting on the reward call (...)' from a silent rank's last beat, or ''."""
    from ddpo_tpu.waits import describe

    state = read_state(run_dir, rank)
    if state is None or not state["wait"]:
        return ""
    return f", last seen waiting on {describe(state['wait'], state['what'])}"


def _kill(proc) -> None:
    import psutil

    try:
        proc.send_signal(signal.SIGKILL)
    except psutil.Error:
        pass
