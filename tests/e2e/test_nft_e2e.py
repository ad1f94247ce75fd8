"""DiffusionNFT end to end on the tiny SD3 model: a run killed mid-epoch and resumed ends byte-identical to an
uninterrupted one (the old policy, a separate copy of the weights, restored from the checkpoint), on XLA CPU nothing
compiles after epoch 0, and two distributed ranks train what one process trains."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import read_metrics, run_train
from tests.e2e.test_resume import kill_tree, start, wait_for

pytestmark = pytest.mark.slow

# 16 samples an epoch in groups of 4, 3 training times, 2 updates an epoch; the old policy lags the trained weights
# (decay 0.5 from the second update on), so a resume that lost it would sample and train differently
SMALL = ["+experiment=nft_smoke", "sample.batch_size=8", "sample.num_batches_per_epoch=2", "train.batch_size=4",
         "train.gradient_accumulation_steps=2", "algorithm.decay_rate=0.5", "reward.host_workers=0", "save_freq=1"]


def test_kill_then_resume_is_exact(tmp_path, model_cache):
    args = [*SMALL, "num_epochs=4", f"model.cache_dir={model_cache}"]
    ref_dir, cut_dir = tmp_path / "uninterrupted", tmp_path / "killed"
    ref_dir.mkdir(), cut_dir.mkdir()
    done = run_train(args, ref_dir)
    assert done.returncode == 0, done.stdout[-3000:]
    proc = start(args, cut_dir)
    wait_for(proc, "[epoch 2] training start")
    kill_tree(proc)
    final = run_train(args, cut_dir)
    assert final.returncode == 0 and final.stdout.count("resumed from") == 1, final.stdout[-3000:]
    ref, run = ref_dir / "outputs" / "nft_smoke", cut_dir / "outputs" / "nft_smoke"
    assert (run / "weights" / "final.safetensors").read_bytes() == (ref / "weights" / "final.safetensors").read_bytes()
    got, want = read_metrics(run, "epoch"), read_metrics(ref, "epoch")
    assert [e["epoch"] for e in got] == [0, 1, 2, 3]
    assert [e["reward_mean"] for e in got] == [e["reward_mean"] for e in want]
    assert [s["loss"] for s in read_metrics(run, "step")] == [s["loss"] for s in read_metrics(ref, "step")]
    # the old policy is checkpointed, and is not the trained weights (so restoring it is what the test checks)
    saved = torch.load(run / "checkpoints" / "epoch_0003" / "optimizer.pt", weights_only=False)
    from safetensors.torch import load_file

    trained = list(load_file(run / "checkpoints" / "epoch_0003" / "trainable.safetensors").values())
    assert len(saved["nft_old"]) == len(trained)
    assert not all(any(torch.equal(o, t) for t in trained) for o in saved["nft_old"])


@pytest.mark.xla
# ~270 s here: CI keeps NFT's numbers (tests/parity/test_nft_official.py) and DDPO's and GRPO's graph sets
@pytest.mark.extended
def test_xla_compiles_nothing_after_the_first_epoch(tmp_path, model_cache):
    proc = run_train([*SMALL, "num_epochs=3", "tpu_topology=cpu", f"model.cache_dir={model_cache}"], tmp_path,
                     timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:]
    epochs = read_metrics(tmp_path / "outputs" / "nft_smoke", "epoch")
    assert epochs[0]["new_compilations"] > 0
    for e in epochs[1:]:
        assert e["new_compilations"] == 0, e["phases"]


def test_two_distributed_ranks_train_what_one_process_trains(tmp_path, model_cache):
    # the same global batches: 2 ranks x (8 sampled, 4 trained) against one process with 16 and 8; each rank draws
    # the global train batch's noise and keeps its rows
    common = ["+experiment=nft_smoke", "sample.num_batches_per_epoch=2", "train.gradient_accumulation_steps=2",
              "reward.host_workers=0", "num_epochs=2", f"model.cache_dir={model_cache}"]
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir(), two.mkdir()
    for args, cwd in ((["sample.batch_size=16", "train.batch_size=8"], one),
                      (["sample.batch_size=8", "train.batch_size=4", "tpu_topology=cpu_dist2",
                        "distributed.compile=none"], two)):
        proc = run_train([*common, *args], cwd, timeout=900)
        assert proc.returncode == 0, proc.stdout[-3000:]
    got, want = (read_metrics(d / "outputs" / "nft_smoke", "step") for d in (two, one))
    assert len(got) == len(want) == 4
    assert [s["loss"] for s in got] == pytest.approx([s["loss"] for s in want], rel=1e-5)
