"""ddpo_tpu.status: the state derived from events by a pure function (synthetic event lists, no files), then the
reading and the CLI on synthesized run dirs (config.yaml, events.jsonl, metrics.jsonl, train.log). No training run."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddpo_tpu.rundir import events as ev
from ddpo_tpu import status
from ddpo_tpu.status import RunFiles, Stamped
from tests.helpers import REPO

pytestmark = pytest.mark.torch_free  # no torch in the test or what it starts (tests/conftest.py)

NUM_BATCHES = 2
PHASES = ("sampling", "reward", "advantages", "training", "checkpoint")
NOW = 1_800_000_000.0


# --- building blocks ------------------------------------------------------------------------------------------------

def epoch_record(epoch: int, t: float, reward: float, compilations: int = 0, steps_per_epoch: int = 2) -> dict:
    phases = {p: {"seconds": s, "compilations": 0, "compile_seconds": 0.0, "host_transfers": 0}
              for p, s in zip(PHASES, (3.0, 0.5, 0.0, 4.5, 0.0))}
    phases["training"]["compilations"] = compilations
    return {"time": t, "kind": "epoch", "epoch": epoch, "global_step": (epoch + 1) * steps_per_epoch,
            "reward_mean": reward, "reward_std": 0.1 + epoch / 100, "num_samples": 16, "loss": 0.01,
            "approx_kl": 1e-4 * (epoch + 1), "clipfrac": 0.05, "new_compilations": compilations, "phases": phases}


def step_record(epoch: int, global_step: int, t: float) -> dict:
    return {"time": t, "kind": "step", "epoch": epoch, "global_step": global_step, "loss": 0.1,
            "approx_kl": 1e-4, "clipfrac": 0.0, "grad_norm": 0.5}


STAGES = ("sampling", "batch 1", "batch 2", "rewards", "training", "progress", "checkpoint", "done")


def epoch_events(epoch: int, upto: str = "done") -> list[ev.Event]:
    """The events of one epoch, as the training process writes them, up to and including `upto`."""
    every = [ev.PhaseStart(epoch, "sampling"), ev.SamplingBatch(epoch, 1, NUM_BATCHES),
             ev.SamplingBatch(epoch, 2, NUM_BATCHES), ev.RewardsGathered(epoch, 0.5, 0.1),
             ev.PhaseStart(epoch, "training"), ev.TrainingProgress(epoch, 4, 8, 1),
             ev.CheckpointSaved(epoch, 2 * epoch + 2, f"checkpoints/epoch_{epoch:04d}"),
             ev.EpochDone(epoch, 0.5, 0.1, 1e-4, 0.05, 2)]
    return every[:STAGES.index(upto) + 1]


def run_start(start_epoch: int = 0, num_epochs: int = 6) -> ev.RunStart:
    return ev.RunStart("eager_cpu", num_epochs, start_epoch, 8, NUM_BATCHES, 8, "LoRA", False)


def stamped(events: list[ev.Event], t0: float, step: float = 1.0) -> list[Stamped]:
    return [Stamped(t0 + i * step, e) for i, e in enumerate(events)]


def attempt(*events: ev.Event, pid: int = 100) -> list[ev.Event]:
    return [ev.WorkerStarted(pid), *events]


def metrics(epochs: int, t0: float = NOW - 1000, epoch_s: float = 8.0, rewards: list[float] | None = None,
            steps: list[tuple[int, int]] = ()) -> status.Metrics:
    rewards = rewards or [0.1 * (i + 1) for i in range(epochs)]
    recs = []
    for e in range(epochs):
        recs += [step_record(e, 2 * e + 1, t0 + e * epoch_s + 5), step_record(e, 2 * e + 2, t0 + e * epoch_s + 7),
                 epoch_record(e, t0 + (e + 1) * epoch_s, rewards[e], compilations=3 if e == 0 else 0)]
    recs += [step_record(e, g, t0 + epochs * epoch_s + 2) for e, g in steps]
    kinds: dict[str, int] = {}
    for r in recs:
        kinds[r["kind"]] = kinds.get(r["kind"], 0) + 1
    return status.Metrics(records=recs, kinds=kinds)


def facts_of(events: list[ev.Event] = (), *, t_last: float = NOW - 5, num_epochs: int = 6, epochs: int = 0,
             holder: status.Holder | None = None, heartbeat_age: float | None = None, log_age: float | None = None,
             stale_after: float = status.DEFAULT_STALE_S, **kw) -> status.Facts:
    """derive() on an in-memory run: `events` written one second apart, the last at t_last."""
    events = list(events)
    run = RunFiles(cfg={"run_name": "r", "num_epochs": num_epochs,
                        "sample": {"batch_size": 8, "num_batches_per_epoch": NUM_BATCHES}},
                   events=stamped(events, t_last - len(events) + 1), holder=holder,
                   metrics=kw.pop("metrics", metrics(epochs, t0=t_last - epochs * 8.0 - 1)),
                   heartbeat=None if heartbeat_age is None else status.Heartbeat(NOW - heartbeat_age, pid=7,
                                                                                 interval_s=10.0),
                   log=status.LogTail(mtime=None if log_age is None else NOW - log_age), **kw)
    return status.derive(run, now=NOW, stale_after=stale_after)


HOLDER = status.Holder(pid=4242, hostname="h", lock="run/lock", started=NOW - 99, this_host=True)
EPOCHS_2_5 = [e for k in (2, 3, 4, 5) for e in epoch_events(k)]

# (name, facts_of arguments, state, stop_reason, rule): every rule of the table, and the order between them
CASES = [
    ("error event", dict(events=attempt(run_start(), *epoch_events(0, "training"), ev.Failed("non-finite loss"))),
     "failed", None, "error_event"),
    ("error event beats a live lock holder", dict(events=attempt(run_start(), ev.Failed("disk full")), holder=HOLDER),
     "failed", None, "error_event"),
    ("killed: the front end recorded it", dict(events=attempt(run_start(), *epoch_events(0, "training"),
                                                              ev.WorkerExited(1, "was killed by SIGKILL"))),
     "failed", None, "exit_code"),
    ("traceback: exit 1 and nothing else", dict(events=attempt(run_start(), ev.WorkerExited(1))),
     "failed", None, "exit_code"),
    ("preempted event", dict(events=attempt(run_start(), *epoch_events(0, "batch 1"), ev.Preempted(-1, 0, "SIGTERM"))),
     "stopped", "preempted", "preempted"),
    ("preempted, exit recorded", dict(events=attempt(run_start(), ev.Preempted(0, 2, "x"), ev.WorkerExited(75))),
     "stopped", "preempted", "preempted"),
    ("exit 75 alone", dict(events=attempt(run_start(), ev.WorkerExited(75))), "stopped", "preempted", "preempted"),
    ("run complete", dict(events=attempt(run_start(), *epoch_events(0), ev.RunComplete(), ev.WorkerExited(0)),
                          epochs=1, num_epochs=1), "finished", None, "complete"),
    ("already complete", dict(events=attempt(ev.AlreadyComplete(6), ev.WorkerExited(0)), epochs=6),
     "finished", None, "complete"),
    ("exit 0 alone", dict(events=attempt(run_start(), ev.WorkerExited(0))), "finished", None, "complete"),
    ("lock holder, silent for hours", dict(events=attempt(run_start(), *epoch_events(0, "training")),
                                           t_last=NOW - 7200, holder=HOLDER), "running", None, "lock_holder"),
    ("dead heartbeat", dict(events=attempt(run_start(), *epoch_events(0, "training")), t_last=NOW - 70,
                            heartbeat_age=70), "stopped", "dead", "heartbeat_dead"),
    ("all epochs, no complete event", dict(epochs=3, num_epochs=3, t_last=NOW - 5000), "finished", None, "all_epochs"),
    ("nothing at all", dict(), "not started", None, "not_started"),
    ("nothing but an old train.log", dict(log_age=5000), "not started", None, "not_started"),
    ("loading, train.log being written", dict(log_age=3), "running", None, "recent_activity"),
    ("recent events, no lock seen", dict(events=attempt(run_start(), *epoch_events(0, "batch 1"))),
     "running", None, "recent_activity"),
    ("heartbeat beating, no lock seen", dict(events=attempt(run_start()), t_last=NOW - 5000, heartbeat_age=5),
     "running", None, "recent_activity"),
    ("silent, no heartbeat, no lock", dict(events=attempt(run_start(), *epoch_events(0, "training")),
                                           t_last=NOW - 7000), "stopped", "no activity", "no_activity"),
]


# --- the pure derivation: every state and rule ---------------------------------------------------------------------

@pytest.mark.parametrize("name,kw,state,reason,rule", CASES, ids=[c[0] for c in CASES])
def test_each_rule(name, kw, state, reason, rule):
    facts = facts_of(**kw)
    assert (facts.state, facts.stop_reason, facts.rule) == (state, reason, rule), facts.decided_by
    assert facts.state_label == (state if reason is None else f"{state} ({reason})")


def test_the_cases_cover_every_rule_and_state():
    assert {c[4] for c in CASES} == set(status.RULES)
    assert {c[2] for c in CASES} == {"finished", "failed", "stopped", "running", "not started"}


def test_what_decided_is_said():
    f = facts_of(attempt(run_start(), ev.WorkerExited(1, "was killed by SIGKILL")))
    assert "was killed by SIGKILL" in f.decided_by and "exit 1" in f.decided_by
    assert f.last_error == status.LastError("the training process was killed by SIGKILL", current_attempt=True)
    f = facts_of(attempt(run_start(), ev.Failed("reward.name=remote returned 2 non-finite value(s)"),
                         ev.WorkerExited(1)))
    assert f.rule == "error_event" and "returned 2 non-finite" in f.decided_by
    assert f.last_error.line == "error: reward.name=remote returned 2 non-finite value(s)"
    f = facts_of(attempt(run_start(), ev.Preempted(2, 6, "SIGTERM: checkpoint written")), holder=HOLDER)
    assert "SIGTERM: checkpoint written" in f.decided_by and "pid 4242 still holds the lock" in f.decided_by
    assert f.decided_by.count("the same command resumes") == 1
    # the trainer's message (training/checkpointing.py) already says how to resume: said once, not twice
    f = facts_of(attempt(run_start(), ev.Preempted(2, 6, "stopped after epoch 2; the same command resumes")))
    assert f.decided_by.count("the same command resumes") == 1, f.decided_by
    f = facts_of(attempt(run_start()), heartbeat_age=300)
    assert "heartbeat is 5 min 00 s old" in f.decided_by and f.heartbeat_age_s == 300
    f = facts_of(attempt(run_start()), holder=dataclasses.replace(HOLDER, this_host=False, hostname="w-3"))
    assert "pid 4242 on w-3 holds the lock" in f.decided_by


def test_only_the_last_attempt_decides():
    crashed = attempt(run_start(), *epoch_events(0, "training"), ev.Failed("crashed once"), ev.WorkerExited(1))
    finished = attempt(ev.Resumed(-1, 0, "none"), run_start(), *epoch_events(0), *epoch_events(1),
                       ev.RunComplete(0, 1, 2, 0.1, 0.5, 0.6, 4, "w", "m"), ev.WorkerExited(0), pid=200)
    f = facts_of(crashed + finished, epochs=2, num_epochs=2)
    assert (f.state, f.rule, f.attempts) == ("finished", "complete", 2)
    assert f.last_error == status.LastError("error: crashed once", current_attempt=False)

    # preempted, then started again: the new attempt is loading (its worker holds the lock), not stopped
    stopped = attempt(run_start(), *epoch_events(0), ev.Preempted(0, 2, "SIGTERM"), ev.WorkerExited(75))
    f = facts_of(stopped + attempt(pid=300), holder=HOLDER, epochs=1)
    assert (f.state, f.rule) == ("running", "lock_holder")
    assert (f.current_epoch, f.phase, f.phase_detail) == (1, "setup", "loading (no progress event yet)")
    assert f.last_error is None


def test_attempts_open_at_worker_started_or_a_second_run_start():
    a, b, c = run_start(), ev.PhaseStart(0, "sampling"), ev.WorkerExited(1)
    split = status.attempts(stamped([ev.WorkerStarted(1), a, b, c, ev.WorkerStarted(2), a, a, b, c, a], NOW))
    assert [[s.event.kind for s in one] for one in split] == [
        ["worker_started", "run_start", "phase_start", "worker_exited"],
        ["worker_started", "run_start"],
        ["run_start", "phase_start", "worker_exited"],  # a worker started without the front end
        ["run_start"]]
    assert status.attempts([]) == []


@pytest.mark.parametrize("upto,phase,detail", [
    ("sampling", "sampling", "sampling batch 1 (none done yet)"),
    ("batch 1", "sampling", "sampling batch 2/2 (1/2 done)"),
    ("batch 2", "reward", "all 2 sampling batches done, gathering rewards"),
    ("rewards", "advantages", "rewards gathered, computing advantages"),
    ("checkpoint", "saving", "checkpoint checkpoints/epoch_0002 in place"),
    ("done", "between epochs", "epoch 2 done, epoch 3 starting"),
])
def test_phase_from_the_last_epoch_event(upto, phase, detail):
    f = facts_of(attempt(run_start(2, 10), *epoch_events(2, upto)), epochs=2, num_epochs=10)
    assert f.state == "running"
    assert (f.current_epoch, f.phase, f.phase_detail) == (2, phase, detail)


def test_phase_ends_evaluation_and_the_last_epoch():
    pe = ev.PhaseEnd(1, "training", 4.5, 4.0, 0, 0.0)
    assert status.describe(pe, 10) == ("saving", "training done, saving the epoch")
    assert status.describe(ev.PhaseEnd(1, "sampling", 1.0, 1.0, 0, 0.0), 10)[0] == "reward"
    assert status.describe(ev.PhaseEnd(1, "new_phase", 1.0, 1.0, 0, 0.0), 10) == ("new_phase", "new_phase done")
    assert status.describe(ev.PhaseStart(1, "evaluation"), 10) == ("evaluation", "evaluating the held-out prompts")
    assert status.describe(ev.Evaluated(1, 0.25, 0.1), 10)[1] == "evaluation done (reward 0.2500), saving the epoch"
    assert status.describe(ev.EpochDone(9, 0.5, 0.1, 0.0, 0.0, 2), 10) == (
        "finishing", "epoch 9 done (the last one): saving and exiting")
    assert status.describe(run_start(), 10) is None and status.describe(ev.WorkerExited(0), 10) is None


def test_setup_phase_before_the_first_epoch_event():
    f = facts_of(attempt(ev.RunStart("xla", 10, 3, 8, 2, 8, "LoRA", True)), epochs=3, num_epochs=10)
    assert (f.current_epoch, f.phase) == (3, "setup")
    assert f.phase_detail == "training process started, epoch 3 next (compiling the graphs first)"
    f = facts_of(epochs=2, num_epochs=10, t_last=NOW - 20)  # a run from before events: metrics only
    assert (f.current_epoch, f.phase, f.phase_detail) == (2, "between epochs",
                                                                    "epoch 1 done (from metrics.jsonl)")


def test_training_detail_counts_optimizer_steps_and_timesteps():
    f = facts_of(attempt(run_start(3, 10), *epoch_events(3, "progress")), num_epochs=10,
                 metrics=metrics(3, t0=NOW - 40, steps=[(3, 7)]))
    assert f.phase == "training"
    assert (f.optimizer_steps_in_epoch, f.optimizer_steps_per_epoch) == (1, 2)
    assert f.phase_detail == "training, optimizer step 1/2 done (4/8 timesteps)"


def test_a_compile_in_progress_is_shown_with_its_time_so_far():
    compiling = attempt(ev.RunStart("xla", 6, 0, 8, 2, 8, "LoRA", True), ev.CompileStart(0, "sampling", 1, 2),
                        ev.PhaseStart(0, "sampling"), ev.CompileProgress(0, "sampling", 1, 2, 1.0, 1, 0.5))
    f = facts_of(compiling)  # one second apart, the last 5 s ago: the compile started 7 s ago
    assert f.state == "running" and f.phase == "sampling"
    assert f.phase_detail == "compiling the sampling graphs, 1st of 2, 7 s so far (1 graph(s) compiled)"
    assert f.compiling.seconds == pytest.approx(7.0) and f.compiling.stage == "sampling"
    f = facts_of(compiling + [ev.CompileEnd(0, "sampling", 1, 2, 3.0, 2, 1.0), ev.SamplingBatch(0, 1, 2)])
    assert f.compiling is None and f.phase_detail == "sampling batch 2/2 (1/2 done)"
    dead = facts_of(compiling + [ev.WorkerExited(1, "was killed by SIGKILL")], t_last=NOW - 500)
    assert dead.state == "failed" and dead.compiling.seconds == pytest.approx(3.0)  # up to its last event


def test_throughput_and_eta_leave_out_compiling_epochs():
    f = facts_of(attempt(run_start(3, 10), *epoch_events(3, "training")), num_epochs=10,
                 metrics=metrics(3, t0=NOW - 40))
    assert f.samples_per_s == pytest.approx(2.0) and f.epoch_seconds_mean == pytest.approx(8.0)
    assert f.rate_basis == "epochs 1-2 (1 with new compilations left out)"
    assert f.eta_s == pytest.approx(7 * 8.0) and f.eta_time == pytest.approx(NOW + 56.0)
    done = facts_of(attempt(ev.RunComplete(), ev.WorkerExited(0)), epochs=6)
    assert done.eta_s is None and done.rate_basis == "epochs 1-5"


def test_the_staleness_threshold_follows_the_longest_phase():
    m = metrics(2, t0=NOW - 3000)
    m.records[-1]["phases"]["training"]["seconds"] = 1000.0  # a long epoch: 1.5 x 1000 s > 900 s
    kw = dict(events=attempt(run_start()), t_last=NOW - 1200, num_epochs=10, metrics=m)
    assert facts_of(**kw).rule == "recent_activity" and facts_of(**kw).stale_after_s == 1500.0
    assert facts_of(**kw, stale_after=60).rule == "recent_activity"  # the longest phase still wins
    assert facts_of(**{**kw, "t_last": NOW - 1600}).rule == "no_activity"


def test_derive_is_pure(monkeypatch):
    """No clock and no files: the same inputs give equal facts, the inputs are left as they were, and neither
    time.time, open nor os.stat is called (the run dir does not even exist)."""
    import builtins
    import copy

    run = RunFiles(run_dir="/no/such/run", events=stamped(attempt(run_start(), *epoch_events(0, "batch 1")), NOW - 10),
                   metrics=metrics(0))
    before = copy.deepcopy(run)
    with monkeypatch.context() as m:
        for owner, name in ((time, "time"), (builtins, "open"), (os, "stat")):
            m.setattr(owner, name, lambda *a, _n=name, **k: pytest.fail(f"derive called {_n}"))
        a, b = status.derive(run, now=NOW), status.derive(run, now=NOW)
        later = status.derive(run, now=NOW + 5000)
    assert run == before
    assert a == b and a.now == NOW and a.last_event_age_s == pytest.approx(7.0)  # 4 events, 1 s apart
    assert later.rule == "no_activity" and later.last_event_age_s == pytest.approx(5007.0)


# --- reading a run dir and the CLI ---------------------------------------------------------------------------------

def write_config(run_dir: Path, num_epochs: int = 6, accelerator: str = "cpu") -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(
        f"run_name: {run_dir.name}\nnum_epochs: {num_epochs}\nlock_accelerator: auto\n"
        f"sample:\n  batch_size: 8\n  num_batches_per_epoch: {NUM_BATCHES}\n"
        f"tpu_topology:\n  name: test_topo\n  accelerator: {accelerator}\n")


def write_events(run_dir: Path, events: list[ev.Event], t_last: float, append: bool = False) -> None:
    lines = "".join(json.dumps({"time": s.time, "pid": 1, **s.event.record()}) + "\n"
                    for s in stamped(events, t_last - len(events) + 1))
    with open(run_dir / ev.EVENTS_FILE, "a" if append else "w") as f:
        f.write(lines)


def make_run(run_dir: Path, *, num_epochs: int = 6, done: int = 6, t0: float | None = None, epoch_s: float = 8.0,
             rewards: list[float] | None = None, tail: list[ev.Event] = (), extra_records: list = (),
             log: str = "Loading weights: 100%|##########| 36/36\n") -> Path:
    """A run dir whose first `done` epochs are complete (metrics and events); `tail` events follow."""
    write_config(run_dir, num_epochs)
    t0 = time.time() - done * epoch_s - 5 if t0 is None else t0
    m = metrics(done, t0=t0, epoch_s=epoch_s, rewards=rewards)
    recs = m.records + list(extra_records)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    events = attempt(run_start(0, num_epochs), *(e for k in range(done) for e in epoch_events(k)), *tail)
    write_events(run_dir, events, t_last=max([t0 + done * epoch_s] + [r["time"] for r in recs]))
    (run_dir / "train.log").write_text(log)
    return run_dir


def age_files(run_dir: Path, seconds_ago: float) -> None:
    t = time.time() - seconds_ago
    for p in run_dir.iterdir():
        os.utime(p, (t, t))


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    code = status.main([*map(str, args)])
    out = capsys.readouterr()
    return code, out.out, out.err


COMPLETE = [ev.RunComplete(0, 5, 6, 0.8, 0.1, 0.8, 12, "w", "m"), ev.WorkerExited(0)]


def test_finished_run_shows_all_epochs_and_reward_curve(tmp_path, capsys):
    rewards = [0.1, 0.2, 0.15, 0.4, 0.35, 0.8]
    run = make_run(tmp_path / "fin", rewards=rewards, tail=COMPLETE)
    code, out, _ = run_cli(capsys, run)
    assert code == 0
    assert "fin" in out and "finished" in out and "[complete]" in out
    assert "6/6 epochs done" in out
    spark = status.sparkline(rewards, 60)
    assert spark[0] == "▁" and spark[-1] == "█" and len(spark) == 6
    assert spark in out
    assert "first 0.1000 (epoch 0)" in out and "last 0.8000 (epoch 5)" in out and "best 0.8000 (epoch 5)" in out
    table_rows = [line.split() for line in out.splitlines() if line.split() and line.split()[0].isdigit()]
    assert [int(r[0]) for r in table_rows] == list(range(6))
    assert [float(r[1]) for r in table_rows] == rewards
    assert "ETA" not in out

    facts = status.collect(run, lock_paths=[])
    assert facts.state == "finished" and "run_complete" in facts.decided_by
    assert facts.epochs_done == 6 and facts.num_epochs == 6
    assert facts.reward_curve == tuple(rewards) and facts.reward.best_epoch == 5
    assert facts.last_error is None
    assert facts.last_event_kind == "worker_exited"


def test_running_run_in_training_phase(tmp_path, capsys):
    now = time.time()
    run = make_run(tmp_path / "run", num_epochs=10, done=3, t0=now - 3 * 8.0 - 10,
                   tail=epoch_events(3, "training"), extra_records=[step_record(3, 7, now - 5)])
    code, out, _ = run_cli(capsys, run)
    assert code == 0
    assert "running" in out and "3/10 epochs done; epoch 3" in out
    assert "training, optimizer step 1/2 done" in out
    assert "last event" in out and "ago" in out and "ETA" in out

    facts = status.collect(run, lock_paths=[], now=now)  # the clock the run was made with, however long that took
    assert (facts.state, facts.rule) == ("running", "recent_activity")
    assert facts.current_epoch == 3 and facts.phase == "training"
    assert facts.last_event_age_s == pytest.approx(5, abs=1e-3)
    assert facts.eta_s == pytest.approx(7 * 8.0)


def test_failed_run_shows_the_error_and_the_end_of_train_log(tmp_path, capsys):
    tb = ("[epoch 3] training start\nTraceback (most recent call last):\n"
          '  File "ddpo_tpu/worker.py", line 40, in main\n'
          "RuntimeError: XLA out of memory while allocating 12.0G\n")
    run = make_run(tmp_path / "bad", num_epochs=10, done=3, tail=[*epoch_events(3, "training"), ev.WorkerExited(1)],
                   log=tb)
    code, out, _ = run_cli(capsys, run)
    assert code == 0 and "failed" in out
    assert "exited with code 1" in out
    assert "train.log ends:" in out and "RuntimeError: XLA out of memory while allocating 12.0G" in out
    facts = status.collect(run, lock_paths=[])
    assert (facts.state, facts.rule) == ("failed", "exit_code")
    assert facts.train_log_tail[-1] == "RuntimeError: XLA out of memory while allocating 12.0G"
    assert facts.phase == "training" and facts.current_epoch == 3


def test_a_traceback_in_train_log_is_not_an_event(tmp_path):
    """The state never comes from console text: a running run whose train.log shows a traceback (a warning printed by
    a library, an earlier attempt's) is running; a failed one whose log looks clean is failed."""
    run = make_run(tmp_path / "tb", num_epochs=10, done=2, tail=epoch_events(2, "batch 1"),
                   log="Traceback (most recent call last):\nValueError: boom\nerror: something\n")
    assert status.collect(run, lock_paths=[]).state == "running"
    run = make_run(tmp_path / "quiet", num_epochs=10, done=2, tail=[ev.Failed("a reward server hung")],
                   log="[epoch 2] sampling start\n")
    assert status.collect(run, lock_paths=[]).state == "failed"


def test_preempted_with_checkpoints_and_unknown_kinds(tmp_path, capsys):
    now = time.time()
    extra = [{"time": now - 50, "kind": "mystery", "payload": [1, 2]}]
    run = make_run(tmp_path / "pre", num_epochs=10, done=3, t0=now - 100, extra_records=extra,
                   tail=[*epoch_events(3, "batch 1"), ev.Preempted(2, 6, "SIGTERM: checkpoint written, exiting (75)"),
                         ev.WorkerExited(75)])
    with open(run / ev.EVENTS_FILE, "a") as f:
        f.write(json.dumps({"time": now, "pid": 1, "event": "from_the_future", "x": 1}) + "\n")
    (run / "checkpoints" / "epoch_0002").mkdir(parents=True)
    code, out, _ = run_cli(capsys, run)
    assert code == 0
    assert "stopped (preempted)" in out and "epoch_0002" in out
    assert "mystery" in out and "from_the_future" in out  # noted, not fatal
    facts = status.collect(run, lock_paths=[])
    assert (facts.state, facts.stop_reason) == ("stopped", "preempted")
    assert facts.metrics.kinds["mystery"] == 1 and facts.epochs_done == 3
    assert facts.checkpoints.count == 1 and facts.checkpoints.latest == "epoch_0002"
    assert facts.checkpoints.last_event["path"] == "checkpoints/epoch_0002"
    assert facts.eta_s == pytest.approx(7 * 8.0)


def test_resumed_run_counts_a_repeated_epoch_once(tmp_path):
    run = make_run(tmp_path / "res", num_epochs=4, done=3)
    with open(run / "metrics.jsonl", "a") as f:
        f.write(json.dumps(epoch_record(2, time.time() - 1, reward=0.9)) + "\n")
    facts = status.collect(run, lock_paths=[])
    assert facts.epochs_done == 3
    assert facts.reward_curve == pytest.approx((0.1, 0.2, 0.9))


def test_live_lock_holder_means_running_however_quiet(tmp_path):
    from ddpo_tpu.proc.lock import AcceleratorLock

    now = time.time()
    run = make_run(tmp_path / "held", num_epochs=10, done=3, t0=now - 7200, tail=epoch_events(3, "training"))
    age_files(run, 7000)
    lock = AcceleratorLock(tmp_path / "tpu.lock", run).acquire()
    try:
        facts = status.collect(run, now=now, lock_paths=[tmp_path / "tpu.lock"])
    finally:
        lock.release()
    assert (facts.state, facts.rule) == ("running", "lock_holder")
    assert facts.live_process.pid == os.getpid() and f"pid {os.getpid()}" in facts.decided_by
    # released: the same dir reads as stopped
    assert status.collect(run, now=now, lock_paths=[tmp_path / "tpu.lock"]).state == "stopped"


def test_lock_of_another_run_is_not_this_run(tmp_path):
    from ddpo_tpu.proc.lock import AcceleratorLock

    now = time.time()
    run = make_run(tmp_path / "mine", num_epochs=10, done=3, t0=now - 7200)
    age_files(run, 7000)
    other = tmp_path / "other"
    other.mkdir()
    with AcceleratorLock(tmp_path / "tpu.lock", other).acquire():
        facts = status.collect(run, now=now, lock_paths=[tmp_path / "tpu.lock"])
    assert facts.state == "stopped" and facts.live_process is None


def test_heartbeat_file_and_run_dir_lock(tmp_path):
    """The heartbeat the training process writes (rundir.Heartbeat) is what status reads: over a minute old with no
    lock holder reads as dead; a held run dir lock as running; a fresh beat as running."""
    from ddpo_tpu.proc.lock import RunDirLock
    from ddpo_tpu.rundir.files import Heartbeat

    # SIGKILLed mid-epoch, front end killed too: no exit recorded; looked at 70 s after its last beat
    run = make_run(tmp_path / "run", num_epochs=6, done=3, t0=time.time() - 100, tail=epoch_events(3, "training"))
    age_files(run, 0)
    Heartbeat(run).beat()
    later = time.time() + 70
    facts = status.collect(run, now=later)  # the real probe: run_dir/lock and this host's accelerator lock
    assert (facts.state, facts.stop_reason, facts.rule) == ("stopped", "dead", "heartbeat_dead"), facts.decided_by
    assert facts.heartbeat_age_s == pytest.approx(70, abs=5) and f"pid {os.getpid()}" in facts.decided_by
    with RunDirLock(run):
        assert status.collect(run, now=later).rule == "lock_holder"
    assert status.collect(run).state == "running"  # the same beat, read now: alive


def test_not_started(tmp_path, capsys):
    write_config(tmp_path / "fresh")
    code, out, _ = run_cli(capsys, tmp_path / "fresh")
    assert code == 0 and "not started" in out
    assert status.collect(tmp_path / "fresh", lock_paths=[]).state == "not started"


def test_json_output_parses_and_has_the_fields(tmp_path, capsys):
    run = make_run(tmp_path / "js", num_epochs=8, done=4, tail=epoch_events(4, "training"),
                   extra_records=[{"time": time.time(), "kind": "epoch", "epoch": 99, "reward_mean": float("nan")}])
    code, out, _ = run_cli(capsys, run, "--json")
    assert code == 0
    facts = json.loads(out, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    assert list(facts) == [f.name for f in dataclasses.fields(status.Facts)]  # every field, by its name
    assert facts["run_name"] == "js" and facts["state"] == "running"
    assert facts["num_epochs"] == 8 and facts["current_epoch"] == 4 and facts["phase"] == "training"
    assert facts["epochs"][0]["reward_mean"] == pytest.approx(0.1)
    assert facts["epochs"][-1]["reward_mean"] is None  # the NaN one
    assert "\x1b[" not in out  # no terminal styling in --json


def test_brief_and_recent_events(tmp_path, capsys):
    run = make_run(tmp_path / "br", num_epochs=10, done=2, tail=epoch_events(2, "batch 1"))
    code, out, _ = run_cli(capsys, run, "--brief", "--events", "2")
    assert code == 0
    first, *rest = out.splitlines()
    assert first.startswith("br: running; 2/10 epochs done; epoch 2 (#3 of 10); sampling batch 2/2 (1/2 done)")
    assert rest == ["  [epoch 2] sampling start", "  [epoch 2] sampling batch 1/2 done"]
    run = make_run(tmp_path / "dead", num_epochs=10, done=2, tail=[ev.Failed("no space left on the disk")])
    code, out, _ = run_cli(capsys, run, "--brief")
    assert out.strip().endswith("error: no space left on the disk") and "failed" in out
    code, out, _ = run_cli(capsys, run, "--events", "1")
    assert "recent events" in out and "  error: no space left on the disk" in out


def test_missing_run_dir_exits_2(tmp_path, capsys):
    code, out, err = run_cli(capsys, tmp_path / "nope")
    assert code == 2 and out == "" and "no such directory" in err
    (tmp_path / "empty").mkdir()
    code, out, err = run_cli(capsys, tmp_path / "empty", "--json")
    assert code == 2 and out == "" and "no config.yaml" in err


def test_torn_lines_and_runs_from_before_events(tmp_path, capsys):
    run = make_run(tmp_path / "cut", num_epochs=10, done=3, tail=epoch_events(3, "training"))
    with open(run / "metrics.jsonl", "a") as f:
        f.write(json.dumps(epoch_record(3, time.time(), 0.9))[:57])  # killed mid-write: no closing brace, no newline
    with open(run / ev.EVENTS_FILE, "a") as f:
        f.write('{"time": 1, "event": "epoch_do')
    code, out, _ = run_cli(capsys, run)
    assert code == 0 and "truncated" in out
    facts = status.collect(run, lock_paths=[])
    assert facts.metrics.truncated_last_line is True and facts.metrics.bad_lines == 0
    assert facts.epochs_done == 3 and facts.state == "running" and facts.phase == "training"
    text = (run / "metrics.jsonl").read_text().splitlines()
    text.insert(2, '{"time": 1, "kind": "st')  # a garbled line in the middle is skipped and counted
    (run / "metrics.jsonl").write_text("\n".join(text))
    assert status.collect(run, lock_paths=[]).metrics.bad_lines == 1

    (run / ev.EVENTS_FILE).unlink()  # a run from before events.jsonl: numbers from metrics, state from the rest
    facts = status.collect(run, lock_paths=[])
    assert facts.epochs_done == 3 and facts.attempts == 0
    assert any("no events.jsonl" in n for n in facts.notes)


LAYOUT = {"tensors": 12, "sharded": 8, "bytes_total": 64 << 20, "bytes_per_device": 16 << 20}
OLD_LAYOUT = {"tensors": 3, "sharded": 0, "bytes_total": 2 << 20, "bytes_per_device": 2 << 20}


def _append(path: Path, *records: dict) -> None:
    with open(path, "a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in records))


@pytest.mark.parametrize("where", ["own event", "run_start field", "metrics only", "nowhere"])
def test_state_layout_from_events_else_metrics(tmp_path, capsys, where):
    """The trainer records the state layout in events.jsonl (its own event, or a field of run_start); run dirs of
    older versions have it only as a metrics.jsonl event line. events.jsonl wins where both are."""
    run = make_run(tmp_path / "lay", done=2, tail=COMPLETE)
    t = time.time()
    if where != "nowhere":  # an older layout in metrics.jsonl: read only when events.jsonl has none
        _append(run / "metrics.jsonl", {"time": t, "kind": "event", "event": "state_layout",
                                        **(LAYOUT if where == "metrics only" else OLD_LAYOUT)})
    if where == "own event":
        _append(run / ev.EVENTS_FILE, {"time": t, "pid": 1, "event": "state_layout", **LAYOUT})
    if where == "run_start field":
        _append(run / ev.EVENTS_FILE, {"time": t, "pid": 1, **run_start(2).record(), "state_layout": LAYOUT})
    facts = status.collect(run, lock_paths=[])
    if where == "nowhere":
        assert facts.state_layout is None and "\nlayout " not in run_cli(capsys, run)[1]
        return
    source = "metrics.jsonl" if where == "metrics only" else "events.jsonl"
    assert facts.state_layout == status.Layout(**LAYOUT, source=source)
    assert not any("does not know" in n for n in facts.notes)  # a layout event is read, not an unknown one
    out = run_cli(capsys, run)[1]
    assert f"layout      12 state tensors, 8 sharded: 16.0 MiB per device of 64.0 MiB (from {source})" in out


def test_sparkline_width_and_flat_curve():
    # 100 values into 10 buckets of 10 (means 4.5, 14.5, ..., 94.5), scaled onto the 8 blocks
    assert status.sparkline(list(range(100)), width=10) == "▁▂▃▃▄▅▆▆▇█"
    assert status.sparkline(list(range(5)), width=10) == "▁▃▅▆█"
    assert status.sparkline([1.0, 1.0, 1.0]) == "▄▄▄"
    assert status.sparkline([]) == ""
    assert status.sparkline([0.0, 1.0], blocks=status.ASCII_BLOCKS) == "_#"


def test_width_option_bounds_the_sparkline(tmp_path, capsys):
    run = make_run(tmp_path / "wide", num_epochs=40, done=40, rewards=[i / 40 for i in range(40)], tail=COMPLETE)
    code, out, _ = run_cli(capsys, run, "--width", "8", "--rows", "5")
    spark_line = next(line for line in out.splitlines() if line.startswith("reward "))
    assert spark_line.split()[-1] == "▁▂▃▄▅▆▇█"
    assert "last 5 of 40 epochs" in out


def test_status_never_imports_torch(tmp_path):
    run = make_run(tmp_path / "light", tail=COMPLETE)
    code = ("import sys, ddpo_tpu.status as s; rc = s.main([sys.argv[1], '--json']); "
            "bad = [m for m in ('torch', 'torch_xla', 'numpy', 'omegaconf', 'hydra') "
            "if sys.modules.get(m) is not None]; "
            "sys.exit(10 if bad else rc)")
    r = subprocess.run([sys.executable, "-c", code, str(run)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["state"] == "finished"


def test_host_time_per_phase_is_shown(tmp_path, capsys):
    """Each epoch line carries the main thread's CPU seconds per phase; status reports the newest epoch's share and
    calls a run whose host time is near its wall time host-bound."""
    run = make_run(tmp_path / "host", done=2, tail=COMPLETE)
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    for r in recs:
        if r["kind"] == "epoch":  # 3.0 s sampling, 4.5 s training of 8 s: 7.2 s of it on the host
            for name, p in r["phases"].items():
                p["host_seconds"] = {"sampling": 2.9, "training": 4.3}.get(name, 0.0)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    ht = status.collect(run, lock_paths=[]).host_time
    assert ht.epoch == 1 and ht.host_s == pytest.approx(7.2) and ht.wall_s == pytest.approx(8.0)
    assert ht.phases["training"] == status.HostPhase(host_s=4.3, wall_s=4.5)
    code, out, _ = run_cli(capsys, run)
    assert code == 0
    assert "90% of epoch 1 on the main thread" in out and "training 4.3/4.5 s" in out and "host-bound" in out
    old = make_run(tmp_path / "old", done=2, tail=COMPLETE)  # metrics of an older version: no host seconds
    assert status.collect(old, lock_paths=[]).host_time is None
    assert "host time" not in run_cli(capsys, old)[1]


@pytest.mark.parametrize("accelerator,execution,bound", [
    ("cpu", "eager", False), ("cpu", "distributed", False),  # the main thread is the device
    ("cpu", "xla", True), ("cpu", "xla_spmd", True), ("cuda", "distributed", True), ("tpu_v6e", "xla", True),
])
def test_host_bound_only_where_host_and_device_differ(tmp_path, capsys, accelerator, execution, bound):
    run = make_run(tmp_path / "host", done=2, tail=COMPLETE)
    with open(run / "config.yaml", "a") as f:
        f.write(f"  execution: {execution}\n")
    (run / "config.yaml").write_text((run / "config.yaml").read_text().replace("accelerator: cpu",
                                                                               f"accelerator: {accelerator}"))
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    for r in recs:
        if r["kind"] == "epoch":
            for name, p in r["phases"].items():
                p["host_seconds"] = p["seconds"]  # all of it on the main thread
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    out = run_cli(capsys, run)[1]
    assert "on the main thread" in out and ("host-bound" in out) == bound
    assert status.collect(run, lock_paths=[]).host_time.device_is_host == (not bound)


# --- end to end: the events a real run writes -----------------------------------------------------------------------

@pytest.mark.needs_torch
@pytest.mark.slow
def test_a_killed_then_resumed_run_read_from_its_events(tmp_path, model_cache):
    """A real smoke run: its training process SIGKILLed mid-epoch reads as failed (the front end recorded how it
    ended), the same command again as finished, with the kill reported as an earlier attempt's."""
    from tests.helpers import clean_env, run_train, wait_for_event

    args = ["+experiment=smoke", "num_epochs=2", "save_freq=1", "reward.host_workers=0",
            "sample.num_batches_per_epoch=2", f"model.cache_dir={model_cache}", "run_name=e2e"]
    run = tmp_path / "outputs" / "e2e"
    proc = subprocess.Popen([sys.executable, "-m", "ddpo_tpu.train", *args], cwd=tmp_path, env=clean_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        worker = wait_for_event(run, "worker_started", proc)["worker_pid"]
        wait_for_event(run, "sampling_batch", proc)
        running = status.collect(run)
        assert (running.state, running.rule) == ("running", "lock_holder")
        assert running.live_process.pid == worker and running.phase in ("sampling", "reward")
        os.kill(worker, 9)
        assert proc.wait(timeout=120) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
    killed = status.collect(run)
    assert (killed.state, killed.rule) == ("failed", "exit_code")
    assert killed.last_error == status.LastError("the training process was killed by SIGKILL", current_attempt=True)

    again = run_train(args, tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
    done = status.collect(run)
    assert (done.state, done.rule, done.attempts, done.epochs_done) == ("finished", "complete", 2, 2)
    assert done.last_error.current_attempt is False
    kinds = [r["event"] for r in ev.read_events(run)]
    assert kinds.count("worker_started") == kinds.count("worker_exited") == 2
    assert kinds[-2:] == ["run_complete", "worker_exited"] and kinds.count("epoch_done") >= 2


# --- arguments (issue 32): a bad one is one line and exit 2, never a traceback ----------------------------------------

@pytest.mark.parametrize("args,named", [(["--events", "-3"], "--events"), (["--stale-after", "-60"], "--stale-after"),
                                        (["--rows", "-1"], "--rows"), (["--events", "x"], "--events")])
def test_a_bad_argument_is_one_line(tmp_path, capsys, args, named):
    run = make_run(tmp_path / "fin", tail=COMPLETE)
    with pytest.raises(SystemExit) as e:
        status.main([str(run), *args])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("ddpo-status: error: argument " + named) and args[1] in err


def test_plot_into_a_directory_writes_inside_it_and_leaves_no_temporary_file(tmp_path, capsys):
    run = make_run(tmp_path / "fin", tail=COMPLETE)
    target = tmp_path / "figures"
    target.mkdir()
    code, out, err = run_cli(capsys, run, "--plot", target, "--brief")
    assert code == 0 and f"reward curve: {target / 'reward_curve.png'}" in out, err
    assert sorted(p.name for p in target.iterdir()) == ["reward_curve.png"]


def test_plot_where_it_cannot_be_written_is_one_line_and_leaves_nothing(tmp_path, capsys):
    run = make_run(tmp_path / "fin", tail=COMPLETE)
    figures = tmp_path / "figures"
    (figures / "curve.png").mkdir(parents=True)  # a directory that is not empty where the file would go
    (figures / "curve.png" / "x").write_text("")
    code, out, err = run_cli(capsys, run, "--plot", figures / "curve.png" / "x" / "c.png", "--brief")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    from ddpo_tpu.display import plot

    with pytest.raises(OSError):  # the final rename onto a directory fails: the temporary file is removed
        plot.draw(figures / "curve.png", [(0, 1.0, 0.1)], [])
    assert sorted(p.name for p in figures.iterdir()) == ["curve.png"]
