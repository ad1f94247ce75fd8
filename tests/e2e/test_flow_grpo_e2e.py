"""Flow-GRPO end to end on the tiny SD3 model through the real launcher: on XLA CPU one run compiles nothing after
epoch 0 while everything that could change a graph moves between epochs (the SDE window slides, groups of equal
rewards come and go, evaluation and the EMA update run every epoch); SPMD does the same (extended); the KL stays
bounded, the EMA weights are written beside the trained ones, and a SIGKILL resumes to the same weights (EMA included)
as a run that was never interrupted."""

from __future__ import annotations

import base64
import hashlib
import math

import pytest
from safetensors.torch import load_file

from tests.helpers import FAST_XLA_CPU, read_metrics, run_train
from tests.helpers.reward_server import recording_server

pytestmark = pytest.mark.slow

FLOW = ["+experiment=flow_grpo_smoke", "reward.host_workers=0", "save_freq=1",
        # 16 samples an epoch (4 prompts x 4) in 2 batches, 2 updates: the graphs of the smoke, at a fraction of
        # its size
        "sample.batch_size=8", "sample.num_batches_per_epoch=2", "train.batch_size=4",
        "train.gradient_accumulation_steps=2",
        # evaluation every epoch, so its graphs compile in epoch 0 too; EMA updated after every batch
        "evaluation.every_n_epochs=1", "evaluation.num_steps=8", "evaluation.deterministic=true",
        "train.ema=true", "train.ema_every=1"]


def _check_run(run, epochs_expected: int, late: int = 0) -> list[dict]:
    """`late`: graphs allowed to compile in epoch 1's training (none in any other phase or later epoch)."""
    epochs = read_metrics(run, "epoch")
    assert [e["epoch"] for e in epochs] == list(range(epochs_expected))
    assert epochs[0]["new_compilations"] > 0
    for e in epochs[1:]:
        allowed = late if e["epoch"] == 1 else 0
        assert e["new_compilations"] == e["phases"]["training"]["compilations"] <= allowed, e["phases"]
    assert all(math.isfinite(e["kl"]) and 0 <= e["kl"] < 1.0 for e in epochs)
    evals = read_metrics(run, "eval")
    assert [e["epoch"] for e in evals] == [-1, *range(epochs_expected)]  # -1: before training (the frozen policy)
    final, ema = load_file(run / "weights" / "final.safetensors"), load_file(run / "weights" / "final_ema.safetensors")
    assert final.keys() == ema.keys()
    assert any(not (final[k] == ema[k]).all() for k in final)  # an average of the steps, not the last weights
    return epochs


# per sampling batch (2 an epoch, one scoring request each): True = one reward per prompt, so all its groups have std 0
EQUAL = {2: True, 6: True, 7: True}  # epoch 1's batch 0; both batches of epoch 3


def scheduled_rewards(request: dict, index: int) -> dict:
    """The requests EQUAL names get one reward per prompt, the others a different value per image."""
    if EQUAL.get(index):
        return {"rewards": [int(hashlib.sha256(p.encode()).hexdigest()[:4], 16) / 65536 for p in request["prompts"]]}
    return {"rewards": [int(hashlib.sha256(base64.b64decode(im["data"])).hexdigest()[:6], 16) / 2**24
                        for im in request["images"]]}


@pytest.mark.xla
def test_flow_grpo_on_xla_cpu_compiles_nothing_after_epoch_0_whatever_moves(tmp_path, model_cache):
    """Four epochs on XLA CPU, each different from the one before: the SDE window slides one step an epoch (steps 0-1,
    1-2, 2-3, 3-4); zero-advantage groups come and go (none, half the epoch, none, all: GRPO's filter weights them 0
    and keeps the train batch's shape, so the same graphs run even when nothing is trained); evaluation (its own ODE,
    scored by a local reward so the server's schedule counts training batches only) and the EMA update run every
    epoch. Epoch 0 compiles; no later epoch compiles anything, in any phase."""
    with recording_server(scheduled_rewards) as (url, _):
        proc = run_train([*FLOW, "tpu_topology=cpu", "num_epochs=4", "reward=remote", f"reward.url={url}",
                          "reward.retries=0", "evaluation.rewards=[{name: jpeg_compressibility}]",
                          "sample.sde_window.size=2", "sample.sde_window.placement=sliding",
                          f"model.cache_dir={model_cache}", FAST_XLA_CPU], tmp_path, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    epochs = _check_run(tmp_path / "outputs" / "flow_grpo_smoke", 4)
    kept = [e["kept_fraction"] for e in epochs]
    zero_std = [e["zero_std_ratio"] for e in epochs]
    assert kept[0] == kept[2] == 1.0 and zero_std[0] == zero_std[2] == 0.0, (kept, zero_std)
    assert 0 < kept[1] < 1 and zero_std[1] > 0, (kept, zero_std)  # half the epoch's groups had equal rewards
    assert kept[3] == 0.0 and zero_std[3] == 1.0, (kept, zero_std)  # every group: nothing trained, the same graphs
    assert all(math.isfinite(e["loss"]) for e in epochs)


@pytest.mark.xla
@pytest.mark.extended  # ~200 s here: CI keeps SPMD's graph set and its equality with one device (tests/e2e/test_xla.py)
def test_flow_grpo_under_spmd_over_4_devices(tmp_path, model_cache):
    # 2 samples per replica and batch over 4 replicas: the smoke's 16 samples an epoch (4 prompts x 4), spread out
    proc = run_train([*FLOW, "tpu_topology=cpu_spmd4", "num_epochs=3", "sample.batch_size=2", "train.batch_size=1",
                      f"model.cache_dir={model_cache}", FAST_XLA_CPU], tmp_path, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    # the EMA update after the first evaluation's weight exchange compiles once more under SPMD (EMA.swapped_in)
    epochs = _check_run(tmp_path / "outputs" / "flow_grpo_smoke", 3, late=1)
    assert epochs[0]["num_samples"] == 16


def test_flow_grpo_resumes_after_sigkill_to_the_same_weights_and_ema(tmp_path, model_cache):
    """SIGKILLed (training process first, then the front end) once its epoch-1 checkpoint is in place, the same
    command finishes with the weights and the EMA of a run that was never interrupted, byte for byte (eager CPU)."""
    import subprocess
    import sys
    import time

    import psutil

    from tests.helpers import clean_env

    # without FLOW's evaluation keys (config/enablement.py refuses them with evaluation off)
    args = [*(a for a in FLOW if not a.startswith("evaluation.")), "num_epochs=3", f"model.cache_dir={model_cache}"]
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    whole.mkdir()
    cut.mkdir()
    proc = run_train(args, whole, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]

    run = cut / "outputs" / "flow_grpo_smoke"
    p = subprocess.Popen([sys.executable, "-m", "ddpo_tpu.train", *args], cwd=cut, env=clean_env(),
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 900
    while not (run / "checkpoints" / "epoch_0001").exists():
        assert p.poll() is None and time.monotonic() < deadline, "the run ended before its epoch-1 checkpoint"
        time.sleep(0.1)
    for child in psutil.Process(p.pid).children(recursive=True):
        child.kill()
    p.kill()
    p.wait()
    again = run_train(args, cut, timeout=1200)
    assert again.returncode == 0, again.stdout[-4000:] + again.stderr[-2000:]
    assert "resumed from" in (run / "train.log").read_text()
    for name in ("final", "final_ema"):
        a = (whole / "outputs" / "flow_grpo_smoke" / "weights" / f"{name}.safetensors").read_bytes()
        assert (run / "weights" / f"{name}.safetensors").read_bytes() == a, name
