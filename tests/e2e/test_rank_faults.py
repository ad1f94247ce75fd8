"""Fast checks of the pieces that name a stopped, frozen or lost rank and keep one error line per failure
(ddpo_tpu/proc/rankwatch.py, ddpo_tpu/torchrun.py), on real child processes; the end-to-end runs are in
tests/test_distributed_faults.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import types

import pytest

from ddpo_tpu import torchrun
from ddpo_tpu.proc import rankwatch
from tests.helpers.beats import wait_for, write_beat

pytestmark = pytest.mark.torch_free  # no torch in the test or what it starts (tests/conftest.py)


def _rank_child(rank: int = 1) -> subprocess.Popen:
    """A child of this process with a torchrun rank's environment (what RankWatch looks for), sleeping."""
    env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "TORCHELASTIC_RUN_ID": "t"}
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env)


def test_a_stopped_rank_is_named_within_the_bound_and_killed(tmp_path):
    child = _rank_child()
    try:
        watch = rankwatch.RankWatch(tmp_path, bound_s=1.0)
        write_beat(tmp_path, 1, child.pid)
        time.sleep(0.3)
        write_beat(tmp_path, 1, child.pid)  # beaten again: a busy machine may stretch the 0.3 s past the 1 s bound
        assert watch.check() is None  # running and beating
        child.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        line = wait_for(watch.check, 10)
        waited = time.monotonic() - t0
        assert line is not None and 1.0 <= waited < 3.0, (line, waited)
        assert f"rank 1 (pid {child.pid}) has been stopped" in line and "distributed.hang_timeout_s=1" in line
        assert child.wait(timeout=5) == -signal.SIGKILL  # no 30 s grace for a process that cannot act on SIGTERM
        assert watch.check() is None  # fires once
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_a_rank_whose_beat_stopped_is_called_frozen(tmp_path):
    child = _rank_child(rank=3)
    try:
        write_beat(tmp_path, 3, child.pid, age_s=30)
        line = wait_for(rankwatch.RankWatch(tmp_path, bound_s=20).check, 10)
        assert line is not None and f"rank 3 (pid {child.pid}) has not beaten for 3" in line
        assert child.wait(timeout=5) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_once_a_rank_has_ended_a_silent_one_is_killed_without_a_line(tmp_path):
    """Rank 1 died (torchrun names it); rank 0, tearing down, stopped beating: killed at once, not blamed."""
    ranks = [_rank_child(0), _rank_child(1)]
    try:
        watch = rankwatch.RankWatch(tmp_path, bound_s=1)
        write_beat(tmp_path, 0, ranks[0].pid)
        assert watch.check() is None
        ranks[1].kill()
        ranks[1].wait()
        write_beat(tmp_path, 0, ranks[0].pid, age_s=30)
        assert watch.check() is None and watch.ending and watch.fired is None
        assert ranks[0].wait(timeout=5) == -signal.SIGKILL
    finally:
        for child in ranks:
            if child.poll() is None:
                child.kill()
                child.wait()


def test_a_rank_that_ended_its_work_is_left_to_torchrun(tmp_path):
    """A rank tearing down after its work (the interpreter stops its beat thread) is neither named nor killed."""
    child = _rank_child()
    try:
        write_beat(tmp_path, 1, child.pid, age_s=30)
        path = rankwatch.beat_path(tmp_path, 1)
        path.write_text(json.dumps({"pid": child.pid, "host": os.uname().nodename, "ended": True}))
        then = time.time() - 30
        os.utime(path, (then, then))
        watch = rankwatch.RankWatch(tmp_path, bound_s=1)
        time.sleep(0.3)
        assert watch.check() is None and child.poll() is None
        assert rankwatch.lost_peers(tmp_path, world=2, me=0, wait_s=0.1) == []  # alive, tearing down
    finally:
        child.kill()
        child.wait()


def test_another_nodes_rank_that_stops_beating_ends_the_job_here(tmp_path):
    """Rank 1 is another node's (not a child here); its beat, in the shared run dir, went stale after beating in
    this job: named within the bound, this node's ranks killed. A file left by a previous attempt is not a beat."""
    ours = _rank_child(0)
    try:
        write_beat(tmp_path, 1, 4242, age_s=600)  # the previous attempt's
        watch = rankwatch.RankWatch(tmp_path, bound_s=1, world=2)
        time.sleep(0.3)
        write_beat(tmp_path, 0, ours.pid)  # after the pause: a busy machine may stretch 0.3 s past the 1 s bound
        assert watch.check() is None
        write_beat(tmp_path, 1, 4242)  # beating in this job ...
        assert watch.check() is None
        line = wait_for(lambda: (write_beat(tmp_path, 0, ours.pid), watch.check())[1], 10)  # ... then no more
        assert line is not None and line.startswith("rank 1 (pid 4242 on ") and "its node is gone" in line
        assert "distributed.hang_timeout_s=1" in line and ours.wait(timeout=5) == -signal.SIGKILL
    finally:
        if ours.poll() is None:
            ours.kill()
            ours.wait()


def test_a_beat_of_a_previous_attempt_is_not_this_rank(tmp_path):
    child = _rank_child()
    try:
        write_beat(tmp_path, 1, child.pid + 100000, age_s=300)  # an old file: another pid
        watch = rankwatch.RankWatch(tmp_path, bound_s=1)
        time.sleep(0.3)
        assert watch.check() is None and child.poll() is None
    finally:
        child.kill()
        child.wait()


def test_the_rank_beat_thread_keeps_the_file_fresh(tmp_path):
    beat = rankwatch.RankBeat(tmp_path, 0, interval=0.1).start()
    try:
        then = time.time() - 50
        os.utime(beat.path, (then, then))
        time.sleep(0.5)
        pid, _host, age, launcher, ended = rankwatch.read_beat(tmp_path, 0)
        assert pid == os.getpid() and age < 1.0 and launcher == os.getppid() and not ended
    finally:
        beat.end()
    assert rankwatch.read_beat(tmp_path, 0)[4]  # ended: its teardown is not a hang


def test_lost_peers_names_the_rank_whose_process_is_gone(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    write_beat(tmp_path, 0, os.getpid())
    write_beat(tmp_path, 1, gone.pid)
    write_beat(tmp_path, 2, os.getpid(), age_s=120)  # another host's rank that stopped beating: only its age says so
    host = os.uname().nodename
    assert rankwatch.lost_peers(tmp_path, world=3, me=0, wait_s=0.5) == [
        (f"rank 1 (pid {gone.pid} on {host})", False), (f"rank 2 (pid {os.getpid()} on {host})", False)]
    # a peer of this process's own launcher (its parent): that launcher reports it
    rankwatch.beat_path(tmp_path, 1).write_text(json.dumps({"pid": gone.pid, "host": host,
                                                            "launcher": os.getppid()}))
    assert rankwatch.lost_peers(tmp_path, world=2, me=0, wait_s=0.5) == [(f"rank 1 (pid {gone.pid} on {host})", True)]
    write_beat(tmp_path, 1, os.getpid())
    write_beat(tmp_path, 2, os.getpid())
    t0 = time.monotonic()
    assert rankwatch.lost_peers(tmp_path, world=3, me=0, wait_s=0.5) == []  # all alive: waited, nobody named
    assert time.monotonic() - t0 >= 0.5


def failure(code: int, at: float, pid: int = 100):
    return types.SimpleNamespace(exitcode=code, timestamp=at, pid=pid)


def test_a_rank_that_reported_its_cause_gets_no_second_line():
    assert torchrun.outcome({0: failure(1, 1, 10)}, reported=True) == (1, "")
    code, line = torchrun.outcome({0: failure(1, 2, 10), 1: failure(1, 1, 11)},
                                  own=lambda r: {1: "the reward server refused"}.get(r, ""))
    assert code == 1 and line == "error: rank 1 (pid 11): the reward server refused (its output: ranks/rank1.log)"
    code, line = torchrun.outcome({1: failure(-9, 1, 11)}, own=lambda r: "")
    assert "rank 1 (pid 11) was killed by SIGKILL" in line


def test_the_launcher_quotes_only_this_jobs_part_of_a_rank_log(tmp_path):
    log = tmp_path / "ranks" / "rank1.log"
    log.parent.mkdir()
    log.write_text("error: from the previous attempt\n")
    mark = log.stat().st_size
    assert torchrun._own_line(tmp_path, 1, mark) == ""
    with open(log, "a") as f:
        f.write("Traceback ...\nerror: no space left on the disk\nbye\n")
    assert torchrun._own_line(tmp_path, 1, mark) == "no space left on the disk"


def test_an_error_event_of_this_job_counts_as_reported(tmp_path):
    from ddpo_tpu.rundir import events as ev

    ev.EventLog(tmp_path, echo=lambda *a: None).emit(ev.Failed("old"))
    start = time.time() + 0.01
    assert not torchrun._reported_since(tmp_path, start)
    time.sleep(0.02)
    ev.EventLog(tmp_path, echo=lambda *a: None).emit(ev.Failed("disk full"))
    assert torchrun._reported_since(tmp_path, start)


@pytest.mark.parametrize("mask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_run_files_follow_the_umask(tmp_path, mask, mode):
    from ddpo_tpu.rundir.files import atomic_write_bytes

    old = os.umask(mask)
    try:
        atomic_write_bytes(tmp_path / "w.safetensors", b"x")
    finally:
        os.umask(old)
    assert (tmp_path / "w.safetensors").stat().st_mode & 0o777 == mode
