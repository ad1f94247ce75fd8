"""Two nodes on one machine: two front ends, each starting a torchrun agent (`--nnodes 2`, the c10d rendezvous on
127.0.0.1), one rank each, sharing the run dir as nodes share a file system (docs/distributed.md, "Several nodes").
A node killed mid-run ends the job on the other in bounded time, naming the lost rank; the same two commands resume,
to the weights of one node running both ranks (the same world size, ranks and global batch: the same arithmetic)."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest

from ddpo_tpu.rundir import events as ev
from tests.helpers import clean_env, wait_for_event
from tests.e2e.test_distributed import DIST, final_weights, relative_difference, train

pytestmark = pytest.mark.slow

# the bound on a lost node: its ranks' beats stop, and the other node's launcher ends the job within it (a collective
# with the lost ranks may come sooner, or not for a whole accumulation window)
HANG = ["distributed.hang_timeout_s=10"]
COMMON = ["+experiment=smoke", "sample.batch_size=2", "train.batch_size=1", "num_epochs=2", "save_freq=1", *DIST, *HANG]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(args: list[str], cwd) -> subprocess.Popen:
    """One node's front end. One thread per process, as the one-node run's two processes get (env.py sets it for
    several processes a node): the same kernels in the same order, so the same weights to the last bit."""
    return subprocess.Popen([sys.executable, "-m", "ddpo_tpu.train", *args], cwd=cwd,
                            env=clean_env(OMP_NUM_THREADS="1"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def _kill_node(front_end: subprocess.Popen) -> None:
    """SIGKILL a node's every process at once: the front end, its torchrun agent and the agent's rank."""
    procs = [psutil.Process(front_end.pid), *psutil.Process(front_end.pid).children(recursive=True)]
    for p in procs:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.Error:
            pass


def test_two_nodes_train_what_one_node_trains_and_a_lost_node_is_named(tmp_path):
    one = train(tmp_path, "one_node", COMMON)
    endpoint = f"127.0.0.1:{_free_port()}"
    nodes = [[*COMMON, "tpu_topology.hosts=2", "tpu_topology.chips_per_host=1", f"distributed.rdzv_endpoint={endpoint}",
              f"distributed.node_rank={n}", "run_name=nodes", f"output_root={tmp_path}/runs"] for n in (0, 1)]
    run_dir = tmp_path / "runs" / "nodes"
    first = [_start(nodes[0], tmp_path)]
    try:
        time.sleep(3)  # node 0 first: it hosts the rendezvous
        first.append(_start(nodes[1], tmp_path))
        wait_for_event(run_dir, "checkpoint", first[0], timeout=600, epoch=0)
        wait_for_event(run_dir, "phase_start", first[0], timeout=600, epoch=1, phase="training")
        _kill_node(first[1])
        killed = time.monotonic()
        out, _ = first[0].communicate(timeout=120)
        took = time.monotonic() - killed
    finally:
        for p in first:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert first[0].returncode == 1, out[-3000:]
    assert took < 10 + 20, f"node 0 took {took:.0f} s to end after node 1 was killed"
    errors = [ln for ln in out.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: rank 1 (pid "), out[-3000:]
    assert "went away" in errors[0] or "its node is gone" in errors[0], out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    # node 1 keeps its own files beside node 0's: no lock or log taken from the other
    assert {"config.yaml", "config-node1.yaml", "train.log", "train-node1.log", "lock", "lock-node1"} <= {
        p.name for p in run_dir.iterdir()}
    # the same two commands resume from epoch 0's checkpoint and finish
    again = [_start(nodes[0], tmp_path)]
    time.sleep(3)
    again.append(_start(nodes[1], tmp_path))
    outs = [p.communicate(timeout=900)[0] for p in again]
    assert [p.returncode for p in again] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    assert [e["epoch"] for e in ev.read_events(run_dir) if e["event"] == "resumed"] == [0]
    assert relative_difference(final_weights(one), final_weights(run_dir)) == 0.0
