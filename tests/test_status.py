"""ddpo_tpu.status on synthesized run dirs (config.yaml + metrics.jsonl + train.log): no training run needed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddpo_tpu import status

REPO = Path(__file__).resolve().parent.parent
NUM_BATCHES = 2
PHASES = ("sampling", "reward", "advantages", "training", "checkpoint")


def write_config(run_dir: Path, num_epochs: int = 6, accelerator: str = "cpu") -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(
        f"run_name: {run_dir.name}\nnum_epochs: {num_epochs}\nlock_accelerator: auto\n"
        f"sample:\n  batch_size: 8\n  num_batches_per_epoch: {NUM_BATCHES}\n"
        f"tpu_topology:\n  name: test_topo\n  accelerator: {accelerator}\n")


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


def epoch_log(epoch: int, upto: str = "done") -> list[str]:
    lines = [f"[epoch {epoch}] sampling start"]
    order = ["sampling start"] + [f"sampling batch {b}/{NUM_BATCHES} done" for b in range(1, NUM_BATCHES + 1)] + [
        "rewards gathered", "training start", "done"]
    for stage in order[1:order.index(upto) + 1]:
        if stage == "rewards gathered":
            lines.append(f"[epoch {epoch}] rewards gathered: mean 0.5000 std 0.1000")
        elif stage == "done":
            lines.append(f"[epoch {epoch}] done: reward 0.5000 +- 0.1000, 2 updates, sampling 3.0s/0c, "
                         "reward 0.5s/0c, advantages 0.0s/0c, training 4.5s/0c, checkpoint 0.0s/0c")
        else:
            lines.append(f"[epoch {epoch}] {stage}")
    return lines


HEADER = "ddpo_tpu: eager_cpu on cpu (1 replica(s), process 0/1); {n} epochs of 8 x 2 samples, 8 train timesteps"


def make_run(run_dir: Path, *, num_epochs: int = 6, done: int = 6, t0: float | None = None, epoch_s: float = 8.0,
             rewards: list[float] | None = None, tail: list[str] | None = None, extra_records: list = (),
             accelerator: str = "cpu") -> Path:
    """A run dir whose first `done` epochs are complete; `tail` lines follow in train.log."""
    write_config(run_dir, num_epochs, accelerator)
    t0 = time.time() - done * epoch_s - 5 if t0 is None else t0
    rewards = rewards or [0.1 * (i + 1) for i in range(done)]
    recs, log = [], ["Loading weights: 100%|##########| 36/36", HEADER.format(n=num_epochs)]
    for e in range(done):
        recs.append(step_record(e, 2 * e + 1, t0 + e * epoch_s + 5))
        recs.append(step_record(e, 2 * e + 2, t0 + e * epoch_s + 7))
        recs.append(epoch_record(e, t0 + (e + 1) * epoch_s, rewards[e], compilations=3 if e == 0 else 0))
        log += epoch_log(e)
    recs += list(extra_records)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    log += list(tail or [])
    (run_dir / "train.log").write_text("\n".join(log) + "\n")
    return run_dir


def age_files(run_dir: Path, seconds_ago: float) -> None:
    t = time.time() - seconds_ago
    for p in run_dir.iterdir():
        os.utime(p, (t, t))


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    code = status.main([*map(str, args)])
    out = capsys.readouterr()
    return code, out.out, out.err


# --- the states -------------------------------------------------------------------------------------------------

def test_finished_run_shows_all_epochs_and_reward_curve(tmp_path, capsys):
    rewards = [0.1, 0.2, 0.15, 0.4, 0.35, 0.8]
    run = make_run(tmp_path / "fin", rewards=rewards, tail=["ddpo_tpu: run complete"])
    code, out, _ = run_cli(capsys, run)
    assert code == 0
    assert "fin" in out and "finished" in out
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
    assert facts["state"] == "finished" and "run complete" in facts["decided_by"]
    assert facts["epochs_done"] == 6 and facts["num_epochs"] == 6
    assert facts["reward_curve"] == rewards
    assert facts["reward"]["best_epoch"] == 5
    assert facts["last_error"] is None
    # 16 samples in 8 s of phases per epoch, over the last 5 epochs
    assert facts["samples_per_s"] == pytest.approx(2.0)
    assert facts["epoch_seconds_mean"] == pytest.approx(8.0)
    assert facts["rate_basis"] == "epochs 1-5"


def test_running_run_in_training_phase(tmp_path, capsys):
    now = time.time()
    t0 = now - 3 * 8.0 - 10
    run = make_run(tmp_path / "run", num_epochs=10, done=3, t0=t0, tail=epoch_log(3, upto="training start"),
                   extra_records=[step_record(3, 7, now - 5)])
    code, out, _ = run_cli(capsys, run)
    assert code == 0
    assert "running" in out
    assert "3/10 epochs done; epoch 3" in out
    assert "training, optimizer step 1/2 done" in out
    assert "last event" in out and "ago" in out
    assert "ETA" in out

    facts = status.collect(run, lock_paths=[])
    assert facts["state"] == "running"
    assert facts["current_epoch"] == 3 and facts["phase"] == "training"
    assert facts["optimizer_steps_in_epoch"] == 1 and facts["optimizer_steps_per_epoch"] == 2
    assert "last event" in facts["decided_by"] and "s ago" in facts["decided_by"]
    assert facts["last_event_age_s"] == pytest.approx(5, abs=5)
    assert facts["eta_s"] == pytest.approx(7 * 8.0)  # 7 epochs left x 8 s
    # epoch 0 compiled (3 new compilations): left out of the rate while compile-free epochs exist
    assert facts["rate_basis"] == "epochs 1-2 (1 with new compilations left out)"
    assert facts["last_error"] is None


@pytest.mark.parametrize("upto,phase,detail", [
    ("sampling start", "sampling", "sampling batch 1 (none done yet)"),
    ("sampling batch 1/2 done", "sampling", "sampling batch 2/2 (1/2 done)"),
    ("sampling batch 2/2 done", "reward", "all 2 sampling batches done, gathering rewards"),
    ("rewards gathered", "advantages", "rewards gathered, computing advantages"),
    ("done", "between epochs", "epoch 2 done, epoch 3 starting"),
])
def test_phase_from_last_epoch_line(tmp_path, upto, phase, detail):
    run = make_run(tmp_path / "p", num_epochs=10, done=2, tail=epoch_log(2, upto=upto))
    facts = status.collect(run, lock_paths=[])
    assert facts["state"] == "running"
    assert (facts["current_epoch"], facts["phase"], facts["phase_detail"]) == (2, phase, detail)


def test_failed_run_shows_last_error_line(tmp_path, capsys):
    tb = ["Traceback (most recent call last):",
          '  File "ddpo_tpu/ddpo/loop.py", line 200, in train_epoch',
          "    loss.backward()",
          "ValueError: first problem",
          "",
          "During handling of the above exception, another exception occurred:",
          "",
          "Traceback (most recent call last):",
          '  File "ddpo_tpu/worker.py", line 40, in main',
          "    return run(validated, run_dir)",
          "           ^^^^^^^^^^^^^^^^^^^^^^^",
          "RuntimeError: XLA out of memory while allocating 12.0G [epoch 3]"]
    run = make_run(tmp_path / "bad", num_epochs=10, done=3, tail=epoch_log(3, upto="training start") + tb)
    code, out, _ = run_cli(capsys, run)
    assert code == 0
    assert "failed" in out
    assert "RuntimeError: XLA out of memory while allocating 12.0G [epoch 3]" in out
    facts = status.collect(run, lock_paths=[])
    assert facts["state"] == "failed"
    assert facts["last_error"] == {"line": "RuntimeError: XLA out of memory while allocating 12.0G [epoch 3]",
                                   "current_attempt": True}
    assert facts["phase"] == "training" and facts["current_epoch"] == 3


def test_failed_run_error_line_and_xla_fatal(tmp_path):
    run = make_run(tmp_path / "err", done=1, tail=["error: the accelerator of this host is held by pid 4242"])
    facts = status.collect(run, lock_paths=[])
    assert facts["state"] == "failed"
    assert facts["last_error"]["line"] == "error: the accelerator of this host is held by pid 4242"

    fatal = "2026-11-21 09:57:33.553414: F external/xla/xla/shape.h:848] Check failed: buffer != nullptr"
    run = make_run(tmp_path / "fatal", done=1, tail=epoch_log(1, upto="training start") + [fatal])
    facts = status.collect(run, lock_paths=[])
    assert facts["state"] == "failed" and facts["last_error"]["line"] == fatal


def test_error_of_an_earlier_attempt_does_not_fail_a_finished_run(tmp_path, capsys):
    crash = ["[epoch 0] training start", "Traceback (most recent call last):", '  File "x.py", line 1, in <module>',
             "RuntimeError: crashed once"]
    run = make_run(tmp_path / "retry", num_epochs=2, done=2, tail=["ddpo_tpu: run complete"])
    log = (run / "train.log").read_text()
    (run / "train.log").write_text(HEADER.format(n=2) + "\n" + "\n".join(crash) + "\n" + log)
    facts = status.collect(run, lock_paths=[])
    assert facts["state"] == "finished"
    assert facts["last_error"] == {"line": "RuntimeError: crashed once", "current_attempt": False}
    code, out, _ = run_cli(capsys, run)
    assert "RuntimeError: crashed once" in out and "earlier attempt" in out


def test_stale_run_without_exit_message_is_stopped(tmp_path):
    now = time.time()
    run = make_run(tmp_path / "stale", num_epochs=10, done=3, t0=now - 7200,
                   tail=epoch_log(3, upto="training start"))
    age_files(run, 7000)
    facts = status.collect(run, now=now, lock_paths=[])
    assert facts["state"] == "stopped" and facts["stop_reason"] == "no activity"
    assert "no event for" in facts["decided_by"]
    # the same dir, looked at shortly after its last write, is running
    facts = status.collect(run, now=now - 7000 + 30, lock_paths=[])
    assert facts["state"] == "running"


def test_preempted_event_and_unknown_kinds(tmp_path, capsys):
    now = time.time()
    extra = [{"time": now - 50, "kind": "mystery", "payload": [1, 2]},
             {"time": now - 40, "kind": "event", "event": "checkpoint", "epoch": 2, "path": "checkpoints/epoch_0002"},
             {"time": now - 30, "kind": "event", "event": "preempted", "epoch": 3}]
    run = make_run(tmp_path / "pre", num_epochs=10, done=3, t0=now - 100, extra_records=extra,
                   tail=epoch_log(3, upto="sampling batch 1/2 done"))
    (run / "checkpoints" / "epoch_0002").mkdir(parents=True)
    code, out, _ = run_cli(capsys, run)
    assert code == 0
    assert "stopped (preempted)" in out
    assert "epoch_0002" in out
    assert "mystery" in out  # noted, not fatal
    facts = status.collect(run, lock_paths=[])
    assert (facts["state"], facts["stop_reason"]) == ("stopped", "preempted")
    assert facts["metrics"]["kinds"]["mystery"] == 1 and facts["epochs_done"] == 3
    assert facts["checkpoints"]["count"] == 1 and facts["checkpoints"]["latest"] == "epoch_0002"
    assert facts["eta_s"] == pytest.approx(7 * 8.0)


def test_resumed_run_counts_a_repeated_epoch_once(tmp_path):
    run = make_run(tmp_path / "res", num_epochs=4, done=3)
    again = epoch_record(2, time.time() - 1, reward=0.9)
    with open(run / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"time": time.time() - 2, "kind": "event", "event": "resumed", "epoch": 2}) + "\n")
        f.write(json.dumps(again) + "\n")
    facts = status.collect(run, lock_paths=[])
    assert facts["epochs_done"] == 3
    assert facts["reward_curve"] == pytest.approx([0.1, 0.2, 0.9])


def test_live_lock_holder_means_running_however_quiet(tmp_path):
    from ddpo_tpu.launch.lock import AcceleratorLock

    now = time.time()
    run = make_run(tmp_path / "held", num_epochs=10, done=3, t0=now - 7200,
                   tail=epoch_log(3, upto="training start"))
    age_files(run, 7000)
    lock = AcceleratorLock(tmp_path / "tpu.lock", run).acquire()
    try:
        facts = status.collect(run, now=now, lock_paths=[tmp_path / "tpu.lock"])
    finally:
        lock.release()
    assert facts["state"] == "running"
    assert facts["live_process"]["pid"] == os.getpid()
    assert f"pid {os.getpid()}" in facts["decided_by"]
    # released: the same dir reads as stopped
    assert status.collect(run, now=now, lock_paths=[tmp_path / "tpu.lock"])["state"] == "stopped"


def test_lock_of_another_run_is_not_this_run(tmp_path):
    from ddpo_tpu.launch.lock import AcceleratorLock

    now = time.time()
    run = make_run(tmp_path / "mine", num_epochs=10, done=3, t0=now - 7200)
    age_files(run, 7000)
    other = tmp_path / "other"
    other.mkdir()
    with AcceleratorLock(tmp_path / "tpu.lock", other).acquire():
        facts = status.collect(run, now=now, lock_paths=[tmp_path / "tpu.lock"])
    assert facts["state"] == "stopped" and facts["live_process"] is None


def test_not_started(tmp_path, capsys):
    write_config(tmp_path / "fresh")
    code, out, _ = run_cli(capsys, tmp_path / "fresh")
    assert code == 0 and "not started" in out
    assert status.collect(tmp_path / "fresh", lock_paths=[])["state"] == "not started"


def test_all_epochs_logged_without_complete_line_is_finished(tmp_path):
    run = make_run(tmp_path / "nolog", num_epochs=3, done=3)
    age_files(run, 5000)
    facts = status.collect(run, lock_paths=[])
    assert facts["state"] == "finished" and "all 3 epochs" in facts["decided_by"]


# --- the CLI contract --------------------------------------------------------------------------------------------

def test_json_output_parses_and_has_the_fields(tmp_path, capsys):
    run = make_run(tmp_path / "js", num_epochs=8, done=4, tail=epoch_log(4, upto="training start"),
                   extra_records=[{"time": time.time(), "kind": "epoch", "epoch": 99, "reward_mean": float("nan")}])
    code, out, _ = run_cli(capsys, run, "--json")
    assert code == 0
    facts = json.loads(out)  # strict JSON: NaN would not parse with a strict reader either
    for key in ("run_name", "state", "decided_by", "num_epochs", "epochs_done", "current_epoch", "phase",
                "phase_detail", "last_event_time", "samples_per_s", "eta_s", "reward", "reward_curve", "epochs",
                "last_error", "notes"):
        assert key in facts
    assert facts["run_name"] == "js" and facts["state"] == "running"
    assert facts["num_epochs"] == 8 and facts["current_epoch"] == 4 and facts["phase"] == "training"
    assert facts["epochs"][0]["reward_mean"] == pytest.approx(0.1)
    assert facts["epochs"][-1]["reward_mean"] is None  # the NaN one
    assert "\x1b[" not in out  # no terminal styling in --json
    json.loads(out, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))


def test_missing_run_dir_exits_2(tmp_path, capsys):
    code, out, err = run_cli(capsys, tmp_path / "nope")
    assert code == 2 and out == ""
    assert "no such directory" in err
    (tmp_path / "empty").mkdir()
    code, out, err = run_cli(capsys, tmp_path / "empty", "--json")
    assert code == 2 and out == ""
    assert "no config.yaml" in err


def test_truncated_last_metrics_line(tmp_path, capsys):
    run = make_run(tmp_path / "cut", num_epochs=10, done=3, tail=epoch_log(3, upto="training start"))
    with open(run / "metrics.jsonl", "a") as f:
        f.write(json.dumps(epoch_record(3, time.time(), 0.9))[:57])  # killed mid-write: no closing brace, no newline
    code, out, _ = run_cli(capsys, run)
    assert code == 0 and "truncated" in out
    facts = status.collect(run, lock_paths=[])
    assert facts["metrics"]["truncated_last_line"] is True and facts["metrics"]["bad_lines"] == 0
    assert facts["epochs_done"] == 3 and facts["reward_curve"] == pytest.approx([0.1, 0.2, 0.3])
    assert facts["state"] == "running"
    # a garbled line in the middle is skipped and counted, the rest still read
    text = (run / "metrics.jsonl").read_text().splitlines()
    text.insert(2, '{"time": 1, "kind": "st')
    (run / "metrics.jsonl").write_text("\n".join(text))
    facts = status.collect(run, lock_paths=[])
    assert facts["metrics"]["bad_lines"] == 1 and facts["epochs_done"] == 3


def test_sparkline_width_and_flat_curve():
    # 100 values into 10 buckets of 10 (means 4.5, 14.5, ..., 94.5), scaled onto the 8 blocks
    assert status.sparkline(list(range(100)), width=10) == "▁▂▃▃▄▅▆▆▇█"
    assert status.sparkline(list(range(5)), width=10) == "▁▃▅▆█"
    assert status.sparkline([1.0, 1.0, 1.0]) == "▄▄▄"
    assert status.sparkline([]) == ""
    assert status.sparkline([0.0, 1.0], blocks=status.ASCII_BLOCKS) == "_#"


def test_width_option_bounds_the_sparkline(tmp_path, capsys):
    run = make_run(tmp_path / "wide", num_epochs=40, done=40, rewards=[i / 40 for i in range(40)],
                   tail=["ddpo_tpu: run complete"])
    code, out, _ = run_cli(capsys, run, "--width", "8", "--rows", "5")
    spark_line = next(line for line in out.splitlines() if line.startswith("reward "))
    assert spark_line.split()[-1] == "▁▂▃▄▅▆▇█"
    assert "last 5 of 40 epochs" in out


def test_status_never_imports_torch(tmp_path):
    run = make_run(tmp_path / "light", tail=["ddpo_tpu: run complete"])
    code = ("import sys, ddpo_tpu.status as s; rc = s.main([sys.argv[1], '--json']); "
            "bad = [m for m in ('torch', 'torch_xla', 'numpy', 'omegaconf', 'hydra') if m in sys.modules]; "
            "sys.exit(10 if bad else rc)")
    r = subprocess.run([sys.executable, "-c", code, str(run)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["state"] == "finished"


def test_preempted_in_train_log_then_resumed(tmp_path):
    run = make_run(tmp_path / "prelog", num_epochs=10, done=3,
                   tail=epoch_log(3, upto="sampling start") + ["ddpo_tpu: SIGTERM: checkpoint written, exiting (75)"])
    facts = status.collect(run, lock_paths=[])
    assert (facts["state"], facts["stop_reason"]) == ("stopped", "preempted")
    assert "SIGTERM" in facts["decided_by"]
    with open(run / "train.log", "a") as f:
        f.write(HEADER.format(n=10) + "\n[epoch 3] sampling start\n")
    facts = status.collect(run, lock_paths=[])
    assert facts["state"] == "running" and facts["phase"] == "sampling"


def test_host_time_per_phase_is_shown(tmp_path, capsys):
    """Each epoch line carries the main thread's CPU seconds per phase; status reports the newest epoch's share and
    calls a run whose host time is near its wall time host-bound."""
    run = make_run(tmp_path / "host", done=2, tail=["ddpo_tpu: run complete"])
    lines = (run / "metrics.jsonl").read_text().splitlines()
    recs = [json.loads(x) for x in lines]
    for r in recs:
        if r["kind"] == "epoch":  # 3.0 s sampling, 4.5 s training of 8 s: 7.2 s of it on the host
            for name, p in r["phases"].items():
                p["host_seconds"] = {"sampling": 2.9, "training": 4.3}.get(name, 0.0)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    facts = status.collect(run, lock_paths=[])
    ht = facts["host_time"]
    assert ht["epoch"] == 1 and ht["host_s"] == pytest.approx(7.2) and ht["wall_s"] == pytest.approx(8.0)
    assert ht["phases"]["training"] == {"host_s": 4.3, "wall_s": 4.5}
    code, out, _ = run_cli(capsys, run)
    assert code == 0
    assert "90% of epoch 1 on the main thread" in out and "training 4.3/4.5 s" in out and "host-bound" in out


def test_no_host_time_row_without_host_seconds(tmp_path, capsys):
    run = make_run(tmp_path / "old", done=2, tail=["ddpo_tpu: run complete"])  # metrics of an older version
    assert status.collect(run, lock_paths=[])["host_time"] is None
    assert "host time" not in run_cli(capsys, run)[1]


def _heartbeat(run_dir: Path, age: float) -> None:
    (run_dir / "heartbeat.json").write_text(json.dumps({"time": time.time() - age, "pid": 4242, "hostname": "h",
                                                        "interval_s": 10.0}))


def test_a_stale_heartbeat_without_a_lock_holder_is_dead_within_a_minute(tmp_path):
    # SIGKILLed mid-epoch 70 s ago: metrics and train.log are recent enough for the 15-minute staleness rule
    run = make_run(tmp_path / "run", num_epochs=6, done=3, tail=epoch_log(3, "training start"))
    t = time.time() - 70
    for name in ("metrics.jsonl", "train.log"):
        os.utime(run / name, (t, t))
    _heartbeat(run, age=70)
    facts = status.collect(run, lock_paths=[run / "lock"])
    assert (facts["state"], facts["stop_reason"]) == ("stopped", "dead"), facts["decided_by"]
    assert "heartbeat" in facts["decided_by"] and facts["heartbeat_age_s"] > 60

    _heartbeat(run, age=5)  # beating: running, whatever else is quiet
    assert status.collect(run, lock_paths=[run / "lock"])["state"] == "running"


def test_a_stale_heartbeat_with_a_live_lock_holder_is_running(tmp_path):
    from ddpo_tpu.launch.lock import RunDirLock

    run = make_run(tmp_path / "run", num_epochs=6, done=3, tail=epoch_log(3, "training start"))
    _heartbeat(run, age=300)
    with RunDirLock(run):
        assert status.collect(run, lock_paths=[run / "lock"])["state"] == "running"
    assert status.collect(run, lock_paths=[run / "lock"])["stop_reason"] == "dead"
