"""Faults inside one epoch: a kill at any point leaves the epoch's outputs (metrics line, sample grid, weights) and
the checkpoint that marks it done either all there or the epoch redone; a damaged checkpoint falls back by name."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import read_metrics

BASE = ["+experiment=smoke", "num_epochs=2", "save_freq=1", "reward.host_workers=0", "sample.num_batches_per_epoch=1"]


class Killed(BaseException):
    """Stands for SIGKILL: nothing in the trainer catches it."""


def trainer(run_dir: Path, model_cache: Path, *extra: str):
    from ddpo_tpu.config.compose import compose_and_validate
    from ddpo_tpu.ddpo import loop
    from ddpo_tpu.rundir import RunDir
    from ddpo_tpu.runtime import make_runtime

    v = compose_and_validate([*BASE, f"model.cache_dir={model_cache}", *extra])
    run_dir.mkdir(exist_ok=True)
    return loop.Trainer(v.cfg, make_runtime(v.cfg), RunDir(run_dir), tree=v.tree, stop=SimpleNamespace(requested=False))


@pytest.mark.slow
def test_a_kill_around_the_checkpoint_neither_loses_nor_duplicates_an_epoch(tmp_path, model_cache, monkeypatch):
    from ddpo_tpu import checkpoint as ckpt

    trainer(tmp_path / "whole", model_cache).fit()
    want = (tmp_path / "whole" / "weights" / "final.safetensors").read_bytes()

    def kill_before_commit(self, limit):  # every output of epoch 0 written, its checkpoint not yet in place
        raise Killed

    def kill_after_rename(root, limit):  # the checkpoint just renamed into place (old code: before the metrics line)
        raise Killed

    for name, target, fault in (("before", ckpt.Pending, ("commit", kill_before_commit)),
                                ("after", ckpt, ("rotate", kill_after_rename))):
        run = tmp_path / name
        with monkeypatch.context() as m:
            m.setattr(target, *fault)
            with pytest.raises(Killed):
                trainer(run, model_cache).fit()
        trainer(run, model_cache).fit()
        assert [e["epoch"] for e in read_metrics(run, "epoch")] == [0, 1], name  # none lost, none twice
        assert [s["global_step"] for s in read_metrics(run, "step")] == [1, 2], name
        assert sorted(p.name for p in (run / "samples").glob("epoch_*.png")) == ["epoch_0000.png", "epoch_0001.png"]
        assert (run / "weights" / "epoch_0000.safetensors").is_file()
        assert (run / "weights" / "final.safetensors").read_bytes() == want, name
