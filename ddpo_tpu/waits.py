"""What this rank's main thread is waiting on, and when it last made progress (torch-free, stdlib only).

The rank watch (proc/rankwatch.py) sees a stopped or frozen process from its heartbeat, but a main thread blocked
forever while its process runs (a reward server that never answers, a write on a hung disk) keeps beating: today
the job then ends only when a peer's collective times out, and the traceback blames that peer. So the main thread
labels its waits, at a few places:

    with waiting(REWARD, "reward.name=ocr", bound_s=...):  ...  # training/loop.py: a reward call, or its future
    with waiting(COLLECTIVE, "all_gather_object"): ...  # runtime/distributed.py: the runtime's collectives
    with waiting(CHECKPOINT, "epoch 3"): ...            # training/checkpointing.py: the checkpoint's writes

Entering and leaving a wait is progress, and so is each request a reward completes (`advanced()` from its
chunk loop, its HTTP client, its chat client). A wait may carry its own bound (`bound_s`): a reward that gives up by
its own timeouts (a server's timeout_s x its retries, a managed process's request and restart) is given that long for
one request before the watch calls it a hang, when that is longer than distributed.hang_timeout_s. The rank's beat
thread (RankBeat) copies `snapshot()` into its beat file every beat: the innermost wait, how long it has lasted, and
seconds since the last progress. The launcher's watch then ends the job naming the rank whose main thread has made no
progress within a wait for `distributed.hang_timeout_s`, and that wait. Time outside any wait (a compile, a long step)
is never called a hang here: the beat covers a process that stops, and a busy main thread is busy.

Progress inside a long wait, besides its entry and exit:
- the reward pool's calls (`marked`): each start and end; the main thread's wait for the pool's futures counts from
  the last of them (`pool_activity`), so a call stuck since before that wait is measured from its start;
- inside a reward call or a checkpoint write, read by the beat thread every beat: the CPU time the process spent
  (CPU_PROGRESS_S or more since the last look: a reward scored in this process, a checkpoint serialised or hashed)
  and, for a write, the bytes it read or wrote (/proc/self/io; write_bytes grows as pages are dirtied, within one
  large write call). A 10 GB checkpoint on a slow disk or a detector scoring for minutes keeps progressing; a
  socket that never answers, a write stuck on a hung disk do not. Never for a collective: a rank spinning in one
  (CUDA's spin-wait) is not moving, and the peer it waits for is the one to name.

Cost on the main thread: a lock, a monotonic clock read and a list append/pop per wait; no I/O.
"""

from __future__ import annotations

import os
import threading
import time

COLLECTIVE = "collective"
REWARD = "reward"
CHECKPOINT = "checkpoint"

# how each kind reads in the watch's line ("waiting on ...")
PHRASES = {COLLECTIVE: "a collective", REWARD: "the reward call", CHECKPOINT: "the checkpoint write"}
_IO = {CHECKPOINT}  # waits whose progress the bytes this process reads or writes show
_CPU = {CHECKPOINT, REWARD}  # ... and the CPU time it spends (a reward scored in this process, a hash, a serialisation)
CPU_PROGRESS_S = 0.2  # CPU seconds between two looks of the beat thread (2 s apart) that count as work
IO_PROGRESS_BYTES = 1 << 20  # bytes read or written between two looks that count (the beat's own file is < 8 KiB)

_lock = threading.Lock()
# (kind, what, since, bound_s) of the main thread's waits, innermost last
_stack: list[tuple[str, str, float, float]] = []
_progress = time.monotonic()
_seen: tuple[int | None, float] | None = None  # (I/O bytes, CPU seconds) at the beat thread's last look


def _on_main() -> bool:
    return threading.current_thread() is threading.main_thread()


class waiting:  # a context manager, named as one
    """The main thread waits on `kind` (COLLECTIVE, REWARD, CHECKPOINT) for `what` (a short detail: the call, the
    key, the epoch). Other threads' waits are not the main thread's: ignored."""

    __slots__ = ("_mine", "bound_s", "kind", "since", "what")

    def __init__(self, kind: str, what: str = "", since: float | None = None, bound_s: float = 0.0):
        self.kind, self.what, self.since, self.bound_s, self._mine = kind, what, since, bound_s, False

    def __enter__(self) -> None:
        """`since`: the last progress of what this wait is for, when it began before the wait (pool_activity())."""
        global _progress
        if _on_main():
            self._mine = True
            now = time.monotonic()
            with _lock:
                _stack.append((self.kind, self.what, now, self.bound_s))
                _progress = now if self.since is None else min(now, self.since)

    def __exit__(self, *exc) -> None:
        global _progress
        if self._mine:
            with _lock:
                if _stack:
                    _stack.pop()
                _progress = time.monotonic()


def advanced() -> None:
    """What the main thread waits on moved (a pooled reward call finished): progress, from any thread."""
    global _progress
    with _lock:
        _progress = time.monotonic()


_pool_t = time.monotonic()  # the last start or end of a pooled call (marked)
_pending = 0  # pooled calls submitted and not yet ended


def marked(fn):
    """`fn` about to be submitted to a pool whose results the main thread will wait for (the reward calls): pending
    from here; its start and its end are the pool's activity, its end progress."""
    global _pending
    with _lock:
        _pending += 1

    def call(*args, **kwargs):
        global _pool_t, _pending
        _pool_t = time.monotonic()
        try:
            return fn(*args, **kwargs)
        finally:
            with _lock:
                _pending -= 1
                _pool_t = time.monotonic()
            advanced()

    return call


def pool_activity() -> float | None:
    """When a pooled call last started or ended, while one is pending (else None): the main thread's wait for the
    pool has made no progress since (a call that hung in the pool before that wait counts from its start)."""
    with _lock:
        return _pool_t if _pending > 0 else None


def _io_bytes() -> int | None:
    """Bytes this process has read and written so far (/proc/self/io: rchar and wchar per call, read_bytes and
    write_bytes as the disk sees them), None where there is none."""
    try:
        with open("/proc/self/io") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return sum(int(fields[k]) for k in ("rchar", "wchar", "read_bytes", "write_bytes"))
    except (OSError, KeyError, ValueError):
        return None


def _cpu_s() -> float:
    t = os.times()  # every thread of this process
    return t.user + t.system


def snapshot() -> dict:
    """What the beat file carries: {"idle_s": seconds since the last progress} plus, inside a wait, "wait" (its
    kind), "what" and "wait_s" (how long it has lasted). Called by the beat thread: inside a reward call or a
    checkpoint write, the CPU time the process spent since its last call (and for a write, the bytes it read or
    wrote) count as progress."""
    global _seen
    with _lock:
        top = _stack[-1] if _stack else None
    if top is not None and top[0] in _CPU:
        seen = (_io_bytes() if top[0] in _IO else None, _cpu_s())
        if _seen is not None and ((seen[0] is not None and seen[0] - _seen[0] >= IO_PROGRESS_BYTES)
                                  or seen[1] - _seen[1] >= CPU_PROGRESS_S):
            advanced()  # the process is reading, writing or computing: the wait is moving
        _seen = seen
    else:
        _seen = None  # the first look inside the next such wait only takes its counts
    now = time.monotonic()
    with _lock:
        out = {"idle_s": round(now - _progress, 2)}
        if _stack:
            kind, what, since, bound = _stack[-1]
            out.update(wait=kind, what=what, wait_s=round(now - since, 2))
            if bound:
                out["bound_s"] = bound
    return out


def describe(kind: str, what: str = "") -> str:
    """'the reward call (reward.name=ocr)': a wait as the watch's line names it."""
    phrase = PHRASES.get(kind, kind)
    return f"{phrase} ({what})" if what else phrase


def reset() -> None:
    """Forget every wait (tests; a forked child starts clean)."""
    global _progress, _seen, _pool_t, _pending
    with _lock:
        _stack.clear()
        _progress = _pool_t = time.monotonic()
        _seen, _pending = None, 0
