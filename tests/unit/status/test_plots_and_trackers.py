"""The reward curve PNG (run dir, ddpo-status --plot) and the trackers: TensorBoard event files that TensorBoard's own
reader loads (scalars, images, the config as text), wandb and TensorBoard at once, and a gs:// run dir's files in
the bucket."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from ddpo_tpu.display import plot

from ddpo_tpu.display import tracking
from ddpo_tpu.config.schema import LoggerConfig
from tests.helpers import clean_env, run_train
from tests.helpers_gcs import fake_gcs, gcs_server  # noqa: F401 -- fixtures


def _logger(**kw) -> LoggerConfig:
    base = dict(name="none", mode="disabled", project="p", entity=None, group=None, tags=[], notes=None)
    return LoggerConfig(**{**base, **kw})


def _events(run_dir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / tracking.TENSORBOARD_DIR), size_guidance={"images": 0, "tensors": 0})
    acc.Reload()
    return acc


def test_curves_one_point_per_epoch_non_finite_left_out():
    recs = [{"kind": "epoch", "epoch": 0, "reward_mean": 1.0, "reward_std": 0.5},
            {"kind": "step", "epoch": 0, "loss": 3.0},
            {"kind": "epoch", "epoch": 1, "reward_mean": math.nan, "reward_std": 0.1},
            {"kind": "epoch", "epoch": 0, "reward_mean": 2.0, "reward_std": 0.25},  # an older file's repeat
            {"kind": "eval", "epoch": 1, "reward_mean": 3.0, "reward_std": None}]
    assert plot.curves(recs) == ([(0, 2.0, 0.25)], [(1, 3.0, 0.0)])


@pytest.mark.parametrize("n", [0, 1, 30])
def test_the_curve_is_a_png(tmp_path, n):
    train = [(e, -1.5 + 0.01 * e, 0.02) for e in range(n)]
    path = plot.draw(tmp_path / "c.png", train, train[::5], title="t")
    with Image.open(path) as img:
        assert img.format == "PNG" and img.size == (plot.W, plot.H)
        assert len(img.convert("RGB").getcolors(maxcolors=1 << 16) or ()) > 3  # something drawn: axes, text, the curve
    assert [p.name for p in tmp_path.iterdir()] == ["c.png"]  # written atomically: no temporary left


def test_ddpo_status_plot_writes_the_curve(tmp_path, capsys):
    from ddpo_tpu import status
    from tests.unit.status.test_status import COMPLETE, make_run

    run = make_run(tmp_path / "r", done=4, tail=COMPLETE)
    assert status.main([str(run), "--plot", "--brief"]) == 0
    assert (run / plot.CURVE_FILE).is_file() and "reward curve:" in capsys.readouterr().out
    assert status.main([str(run), "--plot", str(tmp_path / "elsewhere.png"), "--brief"]) == 0
    assert (tmp_path / "elsewhere.png").is_file()


def test_tensorboard_files_load_in_tensorboards_reader(tmp_path):
    t = tracking.make_tracker(_logger(name="tensorboard", tensorboard=True), tmp_path, "id", "run",
                              {"model": {"name": "tiny"}, "seed": 0}, is_main=True)
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"kind": "epoch", "epoch": 0, "reward_mean": 1.0,
                                                        "reward_std": 0.1}) + "\n")
    t.log({"train/loss": 0.5, "train/kind": "step"}, step=1)
    t.log({"epoch": 0, "reward_mean": 1.0, "reward_std": 0.1, "phases": {"sampling": {"seconds": 2.0}}}, step=2)
    t.log_images(2, np.zeros((4, 8, 8, 3), dtype=np.uint8), ["a cat | 1.0"] * 4)
    t.finish()
    acc = _events(tmp_path)
    tags = acc.Tags()
    assert {"train/loss", "reward_mean", "phases/sampling/seconds"} <= set(tags["scalars"])
    assert [(s.step, s.value) for s in acc.Scalars("reward_mean")] == [(2, 1.0)]
    assert "samples" in tags["images"] and acc.Images("samples")[0].step == 2
    config = [t for t in tags["tensors"] if t.startswith("config")]
    assert config and b"tiny" in acc.Tensors(config[0])[0].tensor_proto.string_val[0]
    assert (tmp_path / plot.CURVE_FILE).is_file()  # the curve comes with every tracker


def test_wandb_and_tensorboard_at_once(tmp_path, monkeypatch):
    calls = []

    class FakeWandb(tracking.Tracker):
        def __init__(self, *a):
            calls.append("init")

        def log(self, values, step):
            calls.append(("log", step))

    monkeypatch.setattr(tracking, "WandbTracker", FakeWandb)
    both = tracking.make_tracker(_logger(name="wandb", mode="offline", tensorboard=True), tmp_path, "id", "run", {},
                                 is_main=True)
    kinds = [type(t).__name__ for t in both.trackers]
    assert kinds == ["RewardCurve", "FakeWandb", "TensorBoardTracker"]
    both.log({"train/loss": 1.0}, step=3)
    both.finish()
    assert calls == ["init", ("log", 3)] and _events(tmp_path).Scalars("train/loss")[0].step == 3
    assert type(tracking.make_tracker(_logger(), tmp_path, "i", "r", {}, is_main=False)) is tracking.Tracker
    assert [type(t).__name__ for t in tracking.make_tracker(_logger(), tmp_path, "i", "r", {}, True).trackers] == [
        "RewardCurve"]


@pytest.mark.slow  # one smoke epoch with output_root=gs:// (~30 s)
def test_a_bucket_run_dir_gets_the_curve_and_tensorboard_files(tmp_path, model_cache, fake_gcs):
    from ddpo_tpu.rundir import storage

    args = ["+experiment=smoke", "num_epochs=2", "logger=tensorboard", f"model.cache_dir={model_cache}",
            f"output_root=gs://{fake_gcs}/runs"]  # the smoke's 2 sampling batches: the captions follow the grid
    r = run_train(args, tmp_path, XDG_CACHE_HOME=str(tmp_path / "cache"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    fs = storage.filesystem()
    fs.invalidate_cache()
    run = storage.Url(fake_gcs, "runs/smoke")
    names = [p.rsplit("/", 1)[-1] for p in fs.find(run.path)]
    assert plot.CURVE_FILE in names and any(n.startswith("events.out.tfevents") for n in names)
    local = tmp_path / "copy"
    fs.get(run.join(tracking.TENSORBOARD_DIR).path, str(local / tracking.TENSORBOARD_DIR), recursive=True)
    acc = _events(local)
    assert len(acc.Scalars("reward_mean")) == 2 and acc.Images("samples")
    # the captions beside the image name the images in it (the first sampling batch), not the epoch's other prompts
    captions = [t for t in acc.Tags()["tensors"] if t.startswith("samples/captions")]
    text = acc.Tensors(captions[0])[-1].tensor_proto.string_val[0].decode()
    grid = json.loads(fs.cat(run.join("samples/epoch_0001.json").path))
    assert text.count(" | ") == len(grid) == 8  # 2 batches of 8 prompts; the grid holds the first batch
    out = subprocess.run([sys.executable, "-m", "ddpo_tpu.status", f"gs://{fake_gcs}/runs/smoke", "--plot",
                          str(tmp_path / "b.png"), "--brief"], env=clean_env(), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "b.png").is_file()


def test_the_curve_has_round_ticks_a_legend_of_what_is_drawn_and_a_band_within_the_rewards():
    # a probability reward (in [0, 1]) near its floor: mean - std < 0 in every epoch
    train = [(e, 0.0882 + 0.01 * e, 0.2) for e in range(12)]
    bounds = plot.bounds_of([{"kind": "epoch", "epoch": e, "reward_min": 0.0, "reward_max": 0.9} for e in range(12)])
    fig = plot.figure(train, [], title="t", bounds=bounds)
    ax = fig.axes[0]
    labels = ax.get_legend_handles_labels()[1]
    assert not any("evaluation" in lab for lab in labels) and any("mean" in lab for lab in labels)
    band = ax.collections[0].get_paths()[0].vertices
    assert band[:, 1].min() >= 0.0  # clipped to the epoch's lowest reward, not mean - std = -0.11
    yticks = ax.get_yticks()
    step = float(np.diff(yticks)[0])
    mantissa = step / 10 ** math.floor(math.log10(step))
    assert any(math.isclose(mantissa, m) for m in (1, 2, 2.5, 5))  # round steps, not the data's extremes
    assert all(float(t).is_integer() for t in ax.get_xticks())  # whole epochs
    assert ax.get_xlabel() == "epoch" and ax.get_ylabel() == "reward"
    with_evals = plot.figure(train, [(5, 0.2, 0.05)])
    assert any("evaluation" in lab for lab in with_evals.axes[0].get_legend_handles_labels()[1])


def test_matplotlib_is_imported_only_where_a_curve_is_drawn():
    code = ("import sys, ddpo_tpu.display.plot, ddpo_tpu.display.tracking, ddpo_tpu.status; "
            "assert 'matplotlib' not in sys.modules, 'imported before a chart was drawn'")
    subprocess.run([sys.executable, "-c", code], check=True, env=clean_env())
