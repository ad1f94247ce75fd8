"""The distributed execution before any process starts: its compose-time rules, the front end's machine checks (one
line, exit 2, nothing written), the torchrun command, how torchrun's rank failures become one line and an exit code,
and what a resume compares across world sizes. No torch.distributed process runs here
(tests/e2e/test_distributed.py)."""

from __future__ import annotations

import socket
import types

import pytest

from ddpo_tpu.config.compose import compose_and_validate
from ddpo_tpu.problems import ConfigError
from ddpo_tpu.config.resume import changed_keys, resume_relevant
from ddpo_tpu import torchrun
from ddpo_tpu.launch.process import training_command
from tests.helpers import front_end_in_process
from tests.unit.config.test_bad_input import assert_refused

pytestmark = pytest.mark.torch_free  # no torch in the test or what it starts (tests/conftest.py)


def problems(*overrides: str) -> str:
    with pytest.raises(ConfigError) as e:
        compose_and_validate(list(overrides))
    return str(e.value)


def test_two_processes_on_the_cpu_are_two_replicas():
    cfg = compose_and_validate(["+experiment=smoke", "tpu_topology=cpu_dist2"]).cfg
    assert cfg.tpu_topology.replicas == 2 and cfg.tpu_topology.expected_processes == 2
    assert not cfg.tpu_topology.torchtpu


def test_a_tpu_topology_on_the_distributed_execution_is_torchtpu():
    cfg = compose_and_validate(["+experiment=compressibility_parity", "tpu_topology.execution=distributed"]).cfg
    assert cfg.tpu_topology.torchtpu and cfg.tpu_topology.expected_processes == 8


def test_fsdp_not_dividing_the_devices_is_refused_with_a_mesh_that_does():
    text = problems("+experiment=smoke", "tpu_topology=cpu_dist2", "tpu_topology.mesh.fsdp=3")
    assert "tpu_topology.mesh.fsdp=3" in text and "tpu_topology.mesh.fsdp=1" in text


def test_a_world_size_that_does_not_divide_the_parity_batch_is_refused():
    text = problems("+experiment=compressibility_parity", "tpu_topology=gpu-8", "tpu_topology.chips_per_host=3",
                    "tpu_topology.chips=3", "tpu_topology.mesh.dp=3")
    assert "sample.batch_size" in text and "not divisible by 3 replicas" in text


def test_several_nodes_need_a_rendezvous_and_a_valid_node_rank():
    text = problems("+experiment=smoke", "tpu_topology=gpu-8", "tpu_topology.hosts=2", "tpu_topology.chips=16",
                    "tpu_topology.mesh.dp=16", "sample.batch_size=1", "train.batch_size=1")
    assert "distributed.rdzv_endpoint=null" in text and "HOST:PORT" in text
    text = problems("+experiment=smoke", "tpu_topology=gpu-8", "tpu_topology.hosts=2", "tpu_topology.chips=16",
                    "tpu_topology.mesh.dp=16", "distributed.rdzv_endpoint=10.0.0.2:29500", "distributed.node_rank=2")
    assert "distributed.node_rank=2" in text
    assert "distributed.rdzv_endpoint=nohost" in problems("+experiment=smoke", "tpu_topology=cpu_dist2",
                                                          "distributed.rdzv_endpoint=nohost")


def test_compile_backends_must_fit_the_device():
    assert "distributed.compile=tpu" in problems("+experiment=smoke", "tpu_topology=cpu_dist2",
                                                 "distributed.compile=tpu")
    assert "distributed.compile=inductor" in problems("+experiment=compressibility_parity",
                                                      "tpu_topology.execution=distributed",
                                                      "distributed.compile=inductor")


def test_an_explicit_process_count_is_checked():
    text = problems("+experiment=smoke", "tpu_topology=cpu_dist2", "tpu_topology.processes=1")
    assert "tpu_topology.processes=1" in text and "per device" in text


def test_the_torchrun_command():
    one = training_command(compose_and_validate(["+experiment=smoke", "tpu_topology=cpu_dist2"]).cfg)
    assert one[1:3] == ["-m", "ddpo_tpu.torchrun"] and one[-2:] == ["-m", "ddpo_tpu.worker"]
    assert one[one.index("--nproc-per-node") + 1] == "2" and "--standalone" in one
    assert one[one.index("--max-restarts") + 1] == "0"
    two = training_command(compose_and_validate(
        ["+experiment=smoke", "tpu_topology=gpu-8", "tpu_topology.hosts=2", "tpu_topology.chips=16",
         "tpu_topology.mesh.dp=16", "distributed.rdzv_endpoint=10.0.0.2:29500", "distributed.node_rank=1"]).cfg)
    assert two[two.index("--rdzv-endpoint") + 1] == "10.0.0.2:29500" and two[two.index("--node-rank") + 1] == "1"
    assert two[two.index("--nnodes") + 1] == "2" and two[two.index("--nproc-per-node") + 1] == "8"
    eager = training_command(compose_and_validate(["+experiment=smoke"]).cfg)
    assert eager[1:] == ["-m", "ddpo_tpu.worker"]


def failure(code: int, at: float, pid: int = 100):
    return types.SimpleNamespace(exitcode=code, timestamp=at, pid=pid)


def test_rank_failures_become_one_line_and_the_documented_code():
    # every rank stopped after its checkpoint (one may have been ended by torchrun right after)
    assert torchrun.outcome({0: failure(75, 2), 1: failure(75, 1)}) == (75, "")
    assert torchrun.outcome({0: failure(-15, 2), 1: failure(75, 1)}) == (75, "")
    assert torchrun.outcome({0: failure(3, 1)})[0] == 3
    code, line = torchrun.outcome({0: failure(-15, 5, 10), 1: failure(-9, 3, 11)})  # rank 1 died first
    assert code == 1 and "rank 1 (pid 11) was killed by SIGKILL" in line and "ranks/rank1.log" in line
    code, line = torchrun.outcome({0: failure(1, 1, 10)})
    assert code == 1 and "rank 0 (pid 10) exited with code 1" in line and "train.log" in line


def test_a_resume_compares_the_global_batch_not_how_it_is_split():
    one = compose_and_validate(["+experiment=smoke", "sample.batch_size=4", "train.batch_size=2"]).tree
    two = compose_and_validate(["+experiment=smoke", "tpu_topology=cpu_dist2", "sample.batch_size=2",
                                "train.batch_size=1"]).tree
    assert changed_keys(resume_relevant(one), resume_relevant(two)) == []
    other = compose_and_validate(["+experiment=smoke", "tpu_topology=cpu_dist2", "sample.batch_size=4",
                                  "train.batch_size=2"]).tree
    assert changed_keys(resume_relevant(one), resume_relevant(other)) == ["sample.global_batch_size",
                                                                          "train.global_batch_size"]


# --- the front end's machine checks: one line, exit 2, no run dir ----------------------------------------------------
# These call the front end's main() in-process (tests.helpers.front_end_in_process): the machine-check path's real
# process is test_bad_input.py's test_tpu_topology_without_libtpu_is_refused.
def test_a_gpu_topology_without_gpus_is_refused(tmp_path, monkeypatch, capsys):
    proc, errors, cpu, heavy = front_end_in_process(tmp_path, ["+experiment=smoke", f"output_root={tmp_path}/out",
                                                               "tpu_topology=gpu-8"], monkeypatch, capsys)
    assert_refused(tmp_path, proc, errors, "tpu_topology", "no NVIDIA GPU", cpu, heavy)


def test_a_torchtpu_topology_without_torchtpu_or_a_tpu_is_refused(tmp_path, monkeypatch, capsys):
    proc, errors, cpu, heavy = front_end_in_process(
        tmp_path, ["+experiment=smoke", f"output_root={tmp_path}/out", "tpu_topology=v6e-8",
                   "tpu_topology.execution=distributed", "sample.batch_size=1", "train.batch_size=1"],
        monkeypatch, capsys)
    import importlib.util

    if importlib.util.find_spec("torch_tpu") is None:  # .venv: TorchTPU is not installed
        assert_refused(tmp_path, proc, errors, "tpu_topology.execution", "setup.sh --torchtpu", cpu, heavy)
    else:  # .venv-torchtpu: installed, and this machine has no TPU
        assert_refused(tmp_path, proc, errors, "tpu_topology", "no TPU chip", cpu, heavy)


def test_a_rendezvous_port_in_use_is_refused(tmp_path, monkeypatch, capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc, errors, cpu, heavy = front_end_in_process(
            tmp_path, ["+experiment=smoke", f"output_root={tmp_path}/out", "tpu_topology=cpu_dist2",
                       f"distributed.rdzv_endpoint=127.0.0.1:{port}"], monkeypatch, capsys)
    assert_refused(tmp_path, proc, errors, "distributed.rdzv_endpoint", "in use", cpu, heavy)


def test_more_processes_per_node_than_devices_is_refused():
    """The branch a GPU or TPU machine takes (this one has neither): 8 processes per node on a node of 4 devices."""
    from ddpo_tpu.launch.machine import _devices_problems

    topo = compose_and_validate(["+experiment=smoke", "tpu_topology=gpu-8"]).cfg.tpu_topology
    (line,) = _devices_problems(topo, 4, "NVIDIA GPU", "why", "fix")
    assert line.startswith("tpu_topology.chips_per_host=8:") and "has 4 NVIDIA GPU(s)" in line
    assert "set tpu_topology.chips_per_host=4" in line
    assert _devices_problems(topo, 8, "NVIDIA GPU", "why", "fix") == []
    assert "no NVIDIA GPU" in _devices_problems(topo, 0, "NVIDIA GPU", "why", "fix")[0]


@pytest.mark.parametrize("experiment", ["nft_smoke", "awm_smoke"])
def test_keeping_samples_on_their_rank_is_refused_where_the_algorithm_trains_the_whole_epoch(experiment):
    """DiffusionNFT and AWM train their epochs themselves over the whole epoch on every rank: the key would be
    silently ignored, so it is refused, naming the fix."""
    text = problems(f"+experiment={experiment}", "tpu_topology=cpu_dist2", "distributed.keep_samples_on_rank=true")
    assert "distributed.keep_samples_on_rank=true: algorithm=" in text
    assert "set distributed.keep_samples_on_rank=false" in text
    # ... and only the distributed execution reads it (the enablement table's distributed.* row)
    text = problems("+experiment=smoke", "distributed.keep_samples_on_rank=true")
    assert "distributed.keep_samples_on_rank" in text and "tpu_topology=cpu_dist2" in text
    for ok in ("smoke", "flow_grpo_smoke"):
        cfg = compose_and_validate([f"+experiment={ok}", "tpu_topology=cpu_dist2",
                                    "distributed.keep_samples_on_rank=true"]).cfg
        assert cfg.distributed.keep_samples_on_rank
