"""The state of a run, decided from evidence by the first rule that holds (the table in ddpo_tpu/status/__init__.py).
Pure: no I/O, no clock."""

from __future__ import annotations

from dataclasses import dataclass

from ddpo_tpu.rundir import events as ev
from ddpo_tpu.proc.exit_codes import EXIT_PREEMPTED
from ddpo_tpu.status.read import Heartbeat, Holder, Stamped

HEARTBEAT_DEAD_S = 60.0  # the training process rewrites heartbeat.json every 10 s, even while compiling


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    s = int(round(seconds))
    if s < 90:
        return f"{seconds:.0f} s" if seconds >= 10 else f"{seconds:.1f} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    if s < 86400:
        return f"{s // 3600} h {s % 3600 // 60:02d} min"
    return f"{s // 86400} d {s % 86400 // 3600} h"


def ago(seconds: float | None) -> str:
    return "?" if seconds is None else f"{duration(max(0.0, seconds))} ago"


def attempts(events: list[Stamped]) -> list[list[Stamped]]:
    """The events split by attempt: one opens at `worker_started`, or at a `run_start` after another attempt's
    `run_start` or `worker_exited` (a training process started without the front end, or by an older one)."""
    out: list[list[Stamped]] = []
    for s in events:
        e = s.event
        opens = not out or isinstance(e, ev.WorkerStarted) or (
            isinstance(e, ev.RunStart) and any(isinstance(x.event, (ev.RunStart, ev.WorkerExited)) for x in out[-1]))
        if opens:
            out.append([s])
        else:
            out[-1].append(s)
    return out


def last_of(attempt: list[Stamped], *kinds: type) -> ev.Event | None:
    """The attempt's newest event of one of `kinds`."""
    return next((s.event for s in reversed(attempt) if isinstance(s.event, kinds)), None)


@dataclass(frozen=True)
class Decision:
    state: str                 # finished | failed | stopped | running | not started
    rule: str                  # which rule fired (the table in the package docstring)
    decided_by: str            # the same, for people
    stop_reason: str | None = None


@dataclass(frozen=True)
class Evidence:
    """What the state is decided from."""

    last_attempt: list[Stamped]
    holder: Holder | None
    heartbeat: Heartbeat | None
    heartbeat_age: float | None
    epochs_done: int
    num_epochs: int | None
    has_data: bool                   # any event or metrics record
    activity_age: float | None       # since anything was last written
    activity_source: str | None
    stale_limit: float


def decide(x: Evidence) -> Decision:
    """The state: the first rule of the table that holds."""
    for rule in _RULES:
        d = rule(x)
        if d is not None:
            return d
    raise AssertionError("no_activity always holds")  # pragma: no cover


def _rule_error_event(x: Evidence) -> Decision | None:
    err = last_of(x.last_attempt, ev.Failed)
    if err is None:
        return None
    return Decision("failed", "error_event", f"the training process reported an error: {err.message}")


def _rule_exit_code(x: Evidence) -> Decision | None:
    ended = last_of(x.last_attempt, ev.WorkerExited)
    if ended is None or ended.code in (0, EXIT_PREEMPTED):
        return None
    how = ended.message or f"exited with code {ended.code}"
    return Decision("failed", "exit_code", f"the training process {how} (exit {ended.code}, recorded by the front "
                                           "end; train.log has the reason)")


def _rule_preempted(x: Evidence) -> Decision | None:
    pre = last_of(x.last_attempt, ev.Preempted)
    ended = last_of(x.last_attempt, ev.WorkerExited)
    if pre is None and (ended is None or ended.code != EXIT_PREEMPTED):
        return None
    why = f"preempted: {pre.message}" if pre is not None else f"the training process exited {EXIT_PREEMPTED}"
    if "the same command resumes" not in why:  # the trainer's own message already says it
        why += " (the same command resumes)"
    if x.holder is not None and ended is None:
        why += f"; pid {x.holder.pid} still holds the lock (writing its checkpoint?)"
    return Decision("stopped", "preempted", why, "preempted")


def _rule_complete(x: Evidence) -> Decision | None:
    done = last_of(x.last_attempt, ev.RunComplete, ev.AlreadyComplete)
    ended = last_of(x.last_attempt, ev.WorkerExited)
    if done is not None:
        return Decision("finished", "complete", f"the last attempt ended with a {done.kind} event")
    if ended is not None and ended.code == 0:
        return Decision("finished", "complete", "the training process exited 0")
    return None


def _rule_lock_holder(x: Evidence) -> Decision | None:
    h = x.holder
    if h is None:
        return None
    where = "" if h.this_host else f" on {h.hostname}"
    return Decision("running", "lock_holder", f"pid {h.pid}{where} holds the lock {h.lock}; last write "
                                              f"{ago(x.activity_age)} ({x.activity_source})")


def _rule_heartbeat_dead(x: Evidence) -> Decision | None:
    if x.heartbeat_age is None or x.heartbeat_age <= HEARTBEAT_DEAD_S:
        return None
    hb = x.heartbeat or Heartbeat(0.0)
    return Decision("stopped", "heartbeat_dead",
                    f"the training process's heartbeat is {duration(x.heartbeat_age)} old (written every "
                    f"{duration(hb.interval_s)} while it lives; pid {hb.pid}) and no live "
                    "process holds the run's lock: killed (SIGKILL, OOM, a lost host) without an exit recorded",
                    "dead")


def _rule_all_epochs(x: Evidence) -> Decision | None:
    if x.num_epochs is None or x.epochs_done < max(1, x.num_epochs):
        return None
    return Decision("finished", "all_epochs", f"all {x.num_epochs} epochs have a metrics line (no run_complete "
                                              "event)")


def _rule_not_started(x: Evidence) -> Decision | None:
    if x.has_data or (x.activity_age is not None and x.activity_age <= x.stale_limit):
        return None
    return Decision("not started", "not_started", "no event and no metrics written yet")


def _rule_recent_activity(x: Evidence) -> Decision | None:
    if x.activity_age is None or x.activity_age > x.stale_limit:
        return None
    return Decision("running", "recent_activity",
                    f"last write {ago(x.activity_age)} ({x.activity_source}; within the {duration(x.stale_limit)} "
                    "staleness threshold); no live lock holder seen on this host")


def _rule_no_activity(x: Evidence) -> Decision:
    return Decision("stopped", "no_activity",
                    f"nothing written for {duration(x.activity_age)} (threshold {duration(x.stale_limit)}), no exit "
                    "recorded and no live lock holder on this host: killed, hung, or running on another host",
                    "no activity")


_RULES = (_rule_error_event, _rule_exit_code, _rule_preempted, _rule_complete, _rule_lock_holder,
          _rule_heartbeat_dead, _rule_all_epochs, _rule_not_started, _rule_recent_activity, _rule_no_activity)
RULES = tuple(r.__name__.removeprefix("_rule_") for r in _RULES)
