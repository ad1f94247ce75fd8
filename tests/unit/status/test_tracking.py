"""wandb on the main process: an offline run with scalars and captioned images; a resumed run keeps its run id."""

from __future__ import annotations

import pytest

from tests.helpers import run_train

pytestmark = pytest.mark.slow


def test_wandb_offline_run_with_images_and_the_same_id_after_resume(tmp_path, model_cache):
    args = ["+experiment=smoke", "num_epochs=1", "sample.num_batches_per_epoch=1", "reward.host_workers=0",
            "logger=wandb", "logger.mode=offline", f"model.cache_dir={model_cache}"]
    first = run_train(args, tmp_path, WANDB_SILENT="true")
    assert first.returncode == 0, first.stdout[-3000:]
    wandb_dir = tmp_path / "outputs" / "smoke" / "wandb"
    runs = sorted(wandb_dir.glob("offline-run-*"))
    assert len(runs) == 1
    assert list(runs[0].glob("files/media/images/samples_*.png"))
    assert list(runs[0].glob("run-*.wandb"))  # the offline history (scalars), synced later with `wandb sync`
    again = run_train([*args, "num_epochs=2"], tmp_path, WANDB_SILENT="true")
    assert again.returncode == 0, again.stdout[-3000:]
    ids = {p.name.rsplit("-", 1)[-1] for p in wandb_dir.glob("offline-run-*")}
    assert len(list(wandb_dir.glob("offline-run-*"))) == 2 and len(ids) == 1  # one wandb run, continued
