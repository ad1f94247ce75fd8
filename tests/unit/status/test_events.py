"""ddpo_tpu.rundir.events: writing, reading and rendering events; and the front end's part (ddpo_tpu.launch.process):
the start and exit of the training process recorded as events, the live status line following events.jsonl."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import textwrap
import time

import pytest

from ddpo_tpu.rundir import events as ev
from ddpo_tpu.launch import process

# at least one event of every kind, with what a person is shown: True (a console line), False (machines only). The
# lines themselves may be reworded (the module's promise): tests check that they render, never their prose. A new
# kind without a row here fails test_every_kind_has_an_example.
EXAMPLES = [
    (ev.RunStart("eager_cpu on cpu", 6, 0, 8, 2, 8, "LoRA adapters", False), True),
    (ev.RunStart("xla on cpu", 6, 2, 8, 2, 8, "LoRA", True), True),
    (ev.Resumed(3, 8, "out/checkpoints/epoch_0003"), True),
    (ev.CheckpointDamaged("ck/epoch_0004", "ck/epoch_0004/optimizer.pt: checksum mismatch"), True),
    (ev.StateLayout(12, 0, 4096, 4096), False),
    (ev.AlreadyComplete(5), True),
    (ev.ExportFailed("final", "ValueError: no config.json", "outputs/run"), True),
    (ev.RunComplete(), True),
    (ev.RunComplete(0, 4, 5, 1.25, -1.5, -1.25, 10, "w/final.safetensors", "m.jsonl"), True),
    (ev.Preempted(2, 6, "SIGTERM: checkpoint written"), True),
    (ev.Failed("disk full"), True),
    (ev.WorkerExited(1, "was killed by SIGKILL"), False),
    (ev.WorkerStarted(4242), False),
    (ev.PhaseStart(3, "sampling"), True),
    (ev.PhaseStart(3, "training"), True),
    (ev.PhaseStart(3, "evaluation"), False),
    (ev.PhaseEnd(3, "sampling", 1.5, 1.25, 2, 0.5), False),
    (ev.SamplingBatch(3, 1, 2), True),
    (ev.RewardsGathered(3, 0.5, 0.25), True),
    (ev.RewardsGathered(3, 0.5, 0.25, 2), True),
    (ev.TrainingProgress(3, 16, 32, 1), True),
    (ev.TrainingBatch(3, 8, 32, 0), False),
    (ev.CompileStart(0, "sampling", 1, 2), True),
    (ev.CompileProgress(0, "training", 2, 2, 250.0, 6, 40.0), True),
    (ev.CompileEnd(0, "sampling", 1, 2, 45.25, 3, 12.75), True),
    (ev.Evaluated(3, 0.5, 0.125), True),
    (ev.CheckpointSaved(3, 8, "ck/epoch_0003"), True),
    (ev.EpochDone(3, 0.5, 0.125, 1.5e-4, 0.25, 2, {"sampling": {"seconds": 1.25, "compilations": 2},
                                                   "training": {"seconds": 2.0, "compilations": 0,
                                                                "replicate_compilations": 1}}), True),
]


@pytest.mark.parametrize("event,shown", EXAMPLES, ids=[f"{e.kind}-{i}" for i, (e, _) in enumerate(EXAMPLES)])
def test_each_kind_renders_its_line_or_none(event, shown):
    text = event.text()
    if not shown:
        assert text is None
        return
    assert isinstance(text, str) and text.strip()
    assert all(line.strip() for line in text.split("\n"))  # no empty lines
    assert "{" not in text.replace(str(getattr(event, "phases", "")), "")  # every template field was filled
    # the one-line discipline: a failure is one `error:` line, on stderr (test_emit_...)
    assert text.startswith("error: ") == isinstance(event, ev.Failed)
    assert "\n" not in text or isinstance(event, (ev.RunStart, ev.RunComplete, ev.RewardsGathered))


def test_a_line_follows_the_values_of_its_event():
    """What a line says comes from the event's fields: two events differing in one field render differently."""
    for a, b in [(ev.SamplingBatch(3, 1, 2), ev.SamplingBatch(3, 2, 2)), (ev.Failed("a"), ev.Failed("b")),
                 (ev.CheckpointSaved(3, 8, "ck/x"), ev.CheckpointSaved(4, 8, "ck/x")),
                 (ev.RewardsGathered(3, 0.5, 0.25), ev.RewardsGathered(3, 0.75, 0.25)),
                 (ev.CompileProgress(0, "training", 2, 2, 250.0, 6, 40.0),
                  ev.CompileProgress(0, "training", 2, 2, 250.0, 7, 40.0))]:
        assert a.text() != b.text()
    assert "ck/epoch_0003" in ev.CheckpointSaved(3, 8, "ck/epoch_0003").text()
    assert ev.Failed("disk full").text().endswith("disk full")


def test_every_kind_has_an_example():
    assert {type(e) for e, _ in EXAMPLES} == set(ev._KINDS.values())
    assert len({cls.kind for cls in ev._KINDS.values()}) == len(ev._KINDS)  # no two classes share a kind


def test_emit_appends_a_line_and_prints_the_text(tmp_path, capsys):
    log = ev.EventLog(tmp_path)
    before = time.time()
    rec = log.emit(ev.SamplingBatch(0, 1, 2))
    log.emit(ev.WorkerExited(75))
    log.emit(ev.Failed("no space left"))
    lines = (tmp_path / ev.EVENTS_FILE).read_text().splitlines()
    assert len(lines) == 3 and json.loads(lines[0]) == rec
    assert rec == {"time": rec["time"], "pid": os.getpid(), "event": "sampling_batch", "epoch": 0, "batch": 1, "of": 2}
    assert before - 0.01 <= rec["time"] <= time.time() + 0.01
    out = capsys.readouterr()
    assert out.out == ev.SamplingBatch(0, 1, 2).text() + "\n"  # worker_exited has no text
    assert out.err == ev.Failed("no space left").text() + "\n"  # errors go to stderr


def test_round_trip_through_the_file(tmp_path):
    log = ev.EventLog(tmp_path, echo=lambda *a: None)
    sent = [e for e, _ in EXAMPLES]
    for e in sent:
        log.emit(e)
    got = [ev.parse(r) for r in ev.read_events(tmp_path)]  # a run dir or the file itself
    assert got == sent
    assert [ev.parse(r) for r in ev.read_events(tmp_path / ev.EVENTS_FILE)] == sent


def test_torn_and_foreign_lines_are_skipped(tmp_path):
    path = tmp_path / ev.EVENTS_FILE
    log = ev.EventLog(tmp_path, echo=lambda *a: None)
    log.emit(ev.PhaseStart(0, "sampling"))
    with open(path, "a") as f:
        f.write('[1, 2]\n{"time": 1, "no_event": true}\n{"time": 1, "event": 7}\nnot json\n')
    log.emit(ev.SamplingBatch(0, 1, 2))
    with open(path, "a") as f:
        f.write('{"time": 2, "event": "sampling_batch", "epo')  # killed mid-write
    assert [r["event"] for r in ev.read_events(path)] == ["phase_start", "sampling_batch"]
    assert ev.read_events(tmp_path / "missing") == []


def test_an_append_after_a_torn_line_starts_on_a_fresh_line(tmp_path):
    """A kill mid-line leaves no newline: the next attempt's first record must not be glued onto the torn line (and
    lost with it); the torn line stays one line that readers skip. Likewise metrics.jsonl."""
    from ddpo_tpu.rundir.files import RunDir

    path = tmp_path / ev.EVENTS_FILE
    log = ev.EventLog(tmp_path, echo=lambda *a: None)
    log.emit(ev.PhaseStart(0, "sampling"))
    with open(path, "a") as f:
        f.write('{"time": 2, "event": "sampling_batch", "epo')  # killed mid-write
    log.emit(ev.WorkerExited(1, "was killed by SIGKILL"))  # the front end records the kill
    ev.EventLog(tmp_path, echo=lambda *a: None).emit(ev.Resumed(0, 1, "ck"))  # the next attempt
    assert [r["event"] for r in ev.read_events(path)] == ["phase_start", "worker_exited", "resumed"]
    assert len(path.read_text().splitlines()) == 4 and path.read_text().endswith("\n")

    out = RunDir(tmp_path)
    out.log({"kind": "epoch", "epoch": 0})
    with open(out.metrics_path, "a") as f:
        f.write('{"kind": "epoch", "ep')
    out.log({"kind": "epoch", "epoch": 1})
    lines = out.metrics_path.read_text().splitlines()
    assert len(lines) == 3 and json.loads(lines[2])["epoch"] == 1
    out.truncate_after_epoch(1)
    assert [json.loads(x)["epoch"] for x in out.metrics_path.read_text().splitlines()] == [0, 1]


def test_a_refused_events_write_ends_the_trainer_in_one_line(tmp_path, monkeypatch):
    """The training process's log (raise_errors) raises the first refused write from the main thread, naming the
    file, so the trainer ends with its one `error:` line; the error event itself never raises."""
    import errno

    log = ev.EventLog(tmp_path, echo=lambda *a: None, raise_errors=True)
    log.emit(ev.PhaseStart(0, "sampling"))

    def read_only(path, line, fsync=False):
        raise OSError(errno.EROFS, "Read-only file system")  # as a failed flush: no file name

    monkeypatch.setattr(ev, "append_line", read_only)
    with pytest.raises(OSError) as got:
        log.emit(ev.SamplingBatch(0, 1, 2))
    assert got.value.errno == errno.EROFS and got.value.filename == str(tmp_path / ev.EVENTS_FILE)
    log.emit(ev.Failed("cannot write"))  # does not raise
    log.emit(ev.SamplingBatch(0, 2, 2))  # reported once: later refusals are kept, not raised
    monkeypatch.undo()
    assert [r["event"] for r in ev.read_events(tmp_path)] == ["phase_start"]
    # from the front end (no raise_errors): kept, never raised
    quiet = ev.EventLog(tmp_path / "gone", echo=lambda *a: None)
    quiet.emit(ev.WorkerExited(1))
    assert quiet.write_error is not None


def test_unknown_kinds_and_missing_fields_parse_as_none():
    assert ev.parse({"time": 1, "event": "from_a_newer_version", "x": 1}) is None
    assert ev.parse({"time": 1, "event": "sampling_batch", "epoch": 0}) is None  # batch and of missing
    assert ev.parse({"time": 1, "pid": 3, "event": "worker_exited", "code": 1, "extra": "ignored"}) == \
        ev.WorkerExited(1)


def test_only_the_main_process_writes_or_prints(tmp_path, capsys):
    """Other ranks write no events; their own `error:` line goes to their stderr (ranks/rank<N>.log), which the
    launcher quotes when that rank ends the job (ddpo_tpu/torchrun.py)."""
    log = ev.EventLog(tmp_path, is_main=False)
    assert log.emit(ev.PhaseStart(1, "training"))["event"] == "phase_start"
    assert capsys.readouterr() == ("", "")
    rec = log.emit(ev.Failed("boom"))
    assert rec["event"] == "error" and rec["message"] == "boom"
    assert not (tmp_path / ev.EVENTS_FILE).exists()
    assert capsys.readouterr() == ("", "error: boom\n")


def test_an_unwritable_events_file_does_not_stop_the_run(tmp_path, capsys):
    log = ev.EventLog(tmp_path / "gone")  # the directory does not exist: open() fails
    log.emit(ev.PhaseStart(1, "training"))
    assert capsys.readouterr().out == ev.PhaseStart(1, "training").text() + "\n"
    assert log.write_error is not None and log.write_error.filename == str(tmp_path / "gone" / ev.EVENTS_FILE)


def test_events_are_frozen_records():
    e = ev.PhaseStart(1, "sampling")
    with pytest.raises(dataclasses.FrozenInstanceError):
        e.epoch = 2
    assert e.record() == {"event": "phase_start", "epoch": 1, "phase": "sampling"}


# --- the front end: its events, the live status line --------------------------------------------------------------

def test_follower_reads_complete_new_lines_only(tmp_path):
    path = tmp_path / ev.EVENTS_FILE
    log = ev.EventLog(tmp_path, echo=lambda *a: None)
    log.emit(ev.PhaseStart(0, "sampling"))  # before the follower starts: not shown
    follow = process.EventFollower(path, start=path.stat().st_size)
    assert follow.poll() == []
    log.emit(ev.SamplingBatch(0, 1, 2))
    with open(path, "a") as f:
        f.write('{"time": 1, "event": "from_the_future"}\n{"time": 1, "event": "sampling_batch", "epoch": 0, ')
    assert follow.poll() == [ev.SamplingBatch(0, 1, 2)]
    with open(path, "a") as f:
        f.write('"batch": 2, "of": 2}\n')  # the rest of the line being written
    assert follow.poll() == [ev.SamplingBatch(0, 2, 2)]
    assert follow.poll() == []
    path.write_text("")  # rewritten: followed from the start again
    log.emit(ev.Failed("x"))
    assert follow.poll() == [ev.Failed("x")]
    assert process.EventFollower(tmp_path / "none").poll() == []


@pytest.mark.parametrize("returncode,reported,how", [
    (0, 0, ""), (1, 1, ""), (2, 2, ""), (3, 3, ""), (75, 75, ""),
    (-signal.SIGKILL, 1, "was killed by SIGKILL"), (-signal.SIGSEGV, 1, "was killed by SIGSEGV"),
    (247, 1, "exited with code 247"),
])
def test_reported_exit(returncode, reported, how):
    assert process.reported_exit(returncode) == (reported, how)


FAKE_WORKER = textwrap.dedent("""
    import json, os, signal, sys, time
    from pathlib import Path
    # a stand-in for ddpo_tpu.worker: prints, writes one event the way the training process does, then ends as asked
    run_dir = Path(os.environ["FAKE_RUN_DIR"])
    print("loading", flush=True)
    with open(run_dir / "events.jsonl", "a") as f:
        f.write(json.dumps({"time": time.time(), "pid": os.getpid(), "event": "phase_start", "epoch": 0,
                            "phase": "sampling"}) + "\\n")
    print("[epoch 0] sampling start", flush=True)
    how = os.environ["FAKE_END"]
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(int(how))
""")


@pytest.mark.parametrize("end,code,message", [("0", 0, ""), ("75", 75, ""), ("kill", 1, "was killed by SIGKILL")])
def test_the_front_end_records_start_and_exit(tmp_path, monkeypatch, end, code, message):
    (tmp_path / "fake_worker.py").write_text(FAKE_WORKER)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    monkeypatch.setattr(process, "WORKER_MODULE", "fake_worker")
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "FAKE_RUN_DIR": str(run_dir), "FAKE_END": end}
    assert process.run_training(env, run_dir / "train.log") == code
    recs = ev.read_events(run_dir)
    assert [r["event"] for r in recs] == ["worker_started", "phase_start", "worker_exited"]
    assert recs[0]["pid"] == os.getpid() and recs[1]["pid"] == recs[0]["worker_pid"] != os.getpid()
    assert ev.parse(recs[2]) == ev.WorkerExited(code, message)
    log = (run_dir / "train.log").read_text()
    assert log.startswith("loading\n[epoch 0] sampling start\n")  # the output, unchanged
    assert (f"error: the training process {message}" in log) == bool(message)


class _Tty:
    """A terminal stand-in for sys.stdout."""

    def __init__(self):
        self.parts: list[str] = []

    def write(self, s: str) -> int:
        self.parts.append(s)
        return len(s)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return True

    encoding = "utf-8"


def test_the_live_view_follows_events_not_output(tmp_path, monkeypatch):
    """On a terminal the bars follow events.jsonl: a line that is no event's text is printed, a line an event stands
    for (a sampling batch) is drawn instead, and each finished epoch prints one summary line."""
    monkeypatch.setattr(sys, "stdout", _Tty())
    monkeypatch.setattr(process._LiveStatus, "POLL_S", 0.05)
    log = ev.EventLog(tmp_path, echo=lambda *a: None)
    with process._LiveStatus(process.EventFollower(tmp_path / ev.EVENTS_FILE)) as live:
        assert live.progress is not None
        live.show(b"[epoch 9] a console line that is not an event\n")
        log.emit(ev.RunStart("eager", 3, 0, 8, 2, 8, "layout", False))
        log.emit(ev.PhaseStart(0, "sampling"))
        log.emit(ev.SamplingBatch(0, 1, 2))
        live.show((ev.SamplingBatch(0, 1, 2).text() + "\n").encode())
        assert live.view.phase == "sampling" and live.view.done == 1
        log.emit(ev.EpochDone(0, 0.5, 0.25, 0.01, 0.1, 2, {"sampling": {"seconds": 1.0, "compilations": 0}}))
        deadline = time.monotonic() + 10
        while live.view.epochs_done != 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
    assert not live._thread.is_alive()
    out = "".join(sys.stdout.parts)
    assert "a console line that is not an event" in out and ev.SamplingBatch(0, 1, 2).text() not in out
    assert out.count("0.5000") == 1  # the epoch's reward mean, in its one summary line


def test_an_event_kind_is_declared_once_with_its_text():
    """Events are frozen dataclasses declared by their kind and console template (no repeated boilerplate)."""
    e = ev.SamplingBatch(1, 2, 3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        e.epoch = 5
    assert ev.parse(e.record()) == e and ev.CompileEnd.kind == "compile_end"
    with pytest.raises(TypeError, match="name of its own"):
        class Again(ev.Event, kind="sampling_batch"):  # noqa: F841 -- a kind that is taken
            epoch: int


def test_compile_progress_from_a_thread_while_the_main_thread_is_busy(tmp_path):
    """The first pass through a stage is watched: start, progress every `every` s from a thread (with the graphs the
    counters show so far), end with the totals; a later pass, and an unknown stage, are not."""
    from ddpo_tpu.runtime.base import Counters
    from ddpo_tpu.runtime.watch import CompileWatch

    graphs = [0]
    counters = lambda: Counters(compilations=graphs[0], compile_time_s=2.0 * graphs[0])  # noqa: E731
    watch = CompileWatch(counters, every=0.05)
    log = ev.EventLog(tmp_path, echo=lambda *a: None)
    with watch.stage("sampling", 0, log):
        for n in range(1, 4):
            time.sleep(0.12)  # the main thread "compiles"
            graphs[0] += 1
            # and stays busy until the thread has reported the graph (not a fixed time, which a busy machine can
            # spend without the thread being scheduled): progress with the graphs compiled so far, from the thread
            deadline = time.monotonic() + 30
            while not any(r["event"] == "compile_progress" and r["compilations"] == n
                          for r in ev.read_events(tmp_path)):
                assert time.monotonic() < deadline, f"no compile_progress with {n} graph(s) in 30 s"
                time.sleep(0.01)
    with watch.stage("sampling", 1, log), watch.stage("reward", 0, log):
        pass
    kinds = [r["event"] for r in ev.read_events(tmp_path)]
    assert kinds[0] == "compile_start" and kinds[-1] == "compile_end" and kinds.count("compile_progress") >= 3
    assert kinds.count("compile_start") == 1 and kinds.count("compile_end") == 1
    end = ev.parse(ev.read_events(tmp_path)[-1])
    assert (end.stage, end.index, end.of, end.compilations, end.compile_seconds) == ("sampling", 1, 2, 3, 6.0)
    assert end.seconds >= 0.3


def test_a_stage_that_fails_has_no_compile_end(tmp_path):
    from ddpo_tpu.runtime.base import Counters
    from ddpo_tpu.runtime.watch import CompileWatch

    log = ev.EventLog(tmp_path, echo=lambda *a: None)
    with pytest.raises(KeyboardInterrupt):
        with CompileWatch(Counters, every=0.05).stage("training", 0, log):
            raise KeyboardInterrupt
    assert [r["event"] for r in ev.read_events(tmp_path)] == ["compile_start"]


def test_the_live_view_counts_a_compile_up_every_poll():
    from ddpo_tpu.display.console import ProgressView

    view = ProgressView()
    view.feed([ev.RunStart("xla", 2, 0, 8, 2, 8, "layout", True), ev.PhaseStart(0, "sampling"),
               ev.CompileStart(0, "sampling", 1, 2)], now=100.0)
    assert "compile sampling 1/2  0:00" in view.bars(now=100.0)[-1].info
    view.feed([ev.SamplingBatch(0, 1, 2)], now=145.0)  # still compiling: the clock, not the batch
    assert "0:45" in view.bars(now=145.0)[-1].info
    view.feed([ev.CompileProgress(0, "sampling", 1, 2, 60.0, 2, 10.0)], now=160.0)
    assert "5:00  2 graphs" in view.bars(now=400.0)[-1].info
    view.feed([ev.CompileEnd(0, "sampling", 1, 2, 301.0, 3, 20.0)], now=401.0)
    assert view.bars(now=401.0)[-1].info.startswith("sampling 1/2")


@pytest.mark.slow  # one XLA run of one epoch
@pytest.mark.extended  # ~115 s here: CI checks the compile events on tests/e2e/test_xla.py's runs
def test_an_xla_run_says_what_it_compiles_while_it_compiles(tmp_path, model_cache):
    """Epoch 0 on XLA: each stage's compile is announced and ended in events.jsonl and on the console, and while one
    is open ddpo-status shows it as the phase with its time so far."""
    import subprocess

    from ddpo_tpu import status
    from tests.helpers import FAST_XLA_CPU, clean_env

    args = ["+experiment=smoke", "tpu_topology=cpu", FAST_XLA_CPU, "num_epochs=1", "sample.num_steps=2",
            "reward.host_workers=0", f"model.cache_dir={model_cache}", "run_name=c"]
    run = tmp_path / "outputs" / "c"
    proc = subprocess.Popen([sys.executable, "-m", "ddpo_tpu.train", *args], cwd=tmp_path, env=clean_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    try:
        while proc.poll() is None:
            if (run / ev.EVENTS_FILE).is_file():
                facts = status.collect(run, lock_paths=[])
                if facts.compiling is not None:
                    seen.append(facts.phase_detail)
            time.sleep(0.5)
        out = proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:]
    recs = [r for r in ev.read_events(run) if r["event"].startswith("compile_")]
    assert [(r["event"], r["stage"], r["index"], r["of"]) for r in recs if r["event"] != "compile_progress"] == [
        ("compile_start", "sampling", 1, 2), ("compile_end", "sampling", 1, 2),
        ("compile_start", "training", 2, 2), ("compile_end", "training", 2, 2)]
    ends = [r for r in recs if r["event"] == "compile_end"]
    assert all(r["compilations"] > 0 and 0 < r["compile_seconds"] <= r["seconds"] for r in ends), ends
    assert ev.CompileStart(0, "sampling", 1, 2).text() in out and ev.parse(ends[-1]).text() in out
    assert seen and all(("sampling" in d) != ("training" in d) for d in seen), seen  # the stage compiling


def test_a_refused_heartbeat_ends_the_trainer_at_its_next_metrics_line(tmp_path, monkeypatch):
    """The heartbeat is written from a thread, which cannot end the run: a beat the disk refuses is raised by the
    trainer's next metrics line, naming heartbeat.json (the trainer's one `error:` line); a beat that lands clears
    it."""
    import errno

    from ddpo_tpu.rundir import files as rundir

    out = rundir.RunDir(tmp_path)
    beat = rundir.Heartbeat(tmp_path)
    real = rundir.atomic_write_bytes

    def full(path, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(rundir, "atomic_write_bytes", full)
    beat.beat()
    monkeypatch.setattr(rundir, "atomic_write_bytes", real)
    with pytest.raises(OSError) as got:
        out.log({"kind": "step", "epoch": 0})
    assert got.value.errno == errno.ENOSPC and got.value.filename == str(tmp_path / rundir.HEARTBEAT_FILE)
    monkeypatch.setattr(rundir, "atomic_write_bytes", full)
    beat.beat()
    monkeypatch.setattr(rundir, "atomic_write_bytes", real)
    beat.beat()  # the disk has room again: nothing to report
    out.log({"kind": "step", "epoch": 0})
    assert len(out.metrics_path.read_text().splitlines()) == 1
