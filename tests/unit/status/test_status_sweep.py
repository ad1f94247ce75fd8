"""ddpo-status SWEEP_DIR: a Hydra multirun dir (outputs/<run_name>-multirun/<n>, one run dir per point, as
ddpo_tpu/train.py places them) summarised as one table. Sweep dirs built by hand, no training run."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml

from ddpo_tpu.rundir import events as ev
from ddpo_tpu import status
from tests.helpers_gcs import fake_gcs, gcs_server  # noqa: F401 -- fixtures
from tests.unit.status.test_status import COMPLETE, age_files, epoch_events, make_run, run_cli

pytestmark = pytest.mark.torch_free  # no torch in the test or what it starts (tests/conftest.py)

COMMON = ["+experiment=smoke", "num_epochs=4"]


def make_point(sweep: Path, job: int, lr: float, *, hydra: bool = True, **kw) -> Path:
    """Job `job` of a sweep over train.learning_rate: its run dir (make_run), the config.yaml the front end saves
    (one run_name for every point) and the overrides file Hydra writes."""
    run = make_run(sweep / str(job), num_epochs=4, **kw)
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    cfg["run_name"] = "sw"
    cfg["train"] = {"learning_rate": lr, "batch_size": 2}
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    if hydra:
        (run / ".hydra").mkdir()
        (run / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump([*COMMON, f"train.learning_rate={lr}"]))
    return run


def make_sweep(root: Path, hydra: bool = True) -> Path:
    """Three points: finished, failed in epoch 2, and one whose dir the front end created (its lock) but whose job
    has not started."""
    sweep = root / "sw-multirun"
    make_point(sweep, 0, 0.0001, hydra=hydra, done=4, rewards=[0.1, 0.2, 0.3, 0.25], tail=COMPLETE)
    make_point(sweep, 1, 0.0003, hydra=hydra, done=2, rewards=[0.5, 0.4],
               tail=[*epoch_events(2, "batch 1"), ev.Failed("non-finite loss"), ev.WorkerExited(1)])
    (sweep / "2").mkdir()
    (sweep / "2" / "lock").write_text("")
    (sweep / "multirun.yaml").write_text("hydra: {}\n")
    return sweep


def test_one_row_per_point_with_its_overrides_state_and_reward(tmp_path):
    s = status.summarise(make_sweep(tmp_path), lock_paths=[])
    assert s.common == tuple(COMMON)
    assert [(p.job, p.overrides, p.state, p.rule, p.epochs_done, p.num_epochs) for p in s.points] == [
        (0, ("train.learning_rate=0.0001",), "finished", "complete", 4, 4),
        (1, ("train.learning_rate=0.0003",), "failed", "error_event", 2, 4),
        (2, (), "not started", "no_config", 0, None)]
    assert [p.reward_last for p in s.points] == [pytest.approx(0.25), pytest.approx(0.4), None]
    assert (s.points[0].reward_best, s.points[0].best_epoch) == (pytest.approx(0.3), 2)


def test_without_overrides_files_the_differing_config_keys_name_the_points(tmp_path):
    """A sweep whose .hydra/ is gone (a bucket keeps only the run's files): the keys whose values differ."""
    s = status.summarise(make_sweep(tmp_path, hydra=False), lock_paths=[])
    assert s.common == ()
    assert [p.overrides for p in s.points] == [("train.learning_rate=0.0001",), ("train.learning_rate=0.0003",), ()]


def test_the_state_of_a_point_is_its_run_dirs_state(tmp_path):
    """A point is decided like any run: its run dir's lock held means running, however quiet it is."""
    from ddpo_tpu.proc.lock import RunDirLock

    sweep = make_sweep(tmp_path)
    age_files(make_point(sweep, 3, 0.001, done=1, t0=time.time() - 7200, tail=epoch_events(1, "training")), 7000)
    with RunDirLock(sweep / "3"):
        s = status.summarise(sweep)
    assert (s.points[3].state, s.points[3].rule, s.points[3].current_epoch) == ("running", "lock_holder", 1)
    assert status.summarise(sweep).points[3].state == "stopped"  # released, and silent for two hours


def test_cli_table_brief_and_json(tmp_path, capsys):
    sweep = make_sweep(tmp_path)
    code, out, _ = run_cli(capsys, sweep)
    assert code == 0
    assert out.startswith(f"sweep of 3 point(s) (1 finished, 1 failed, 1 not started)  {sweep}\n")
    assert "every point: +experiment=smoke num_epochs=4" in out
    rows = {line.split()[0]: line for line in out.splitlines() if line.split() and line.split()[0].isdigit()}
    assert set(rows) == {"0", "1", "2"}
    assert "train.learning_rate=0.0001" in rows["0"] and "finished" in rows["0"] and "4/4" in rows["0"]
    assert rows["0"].split()[-3:-1] == ["0.2500", "0.3000"]  # the last reward mean, the best
    assert "train.learning_rate=0.0003" in rows["1"] and "failed" in rows["1"] and "2/4" in rows["1"]
    assert "not started" in rows["2"]

    code, out, _ = run_cli(capsys, sweep, "--brief")
    assert code == 0 and out.splitlines()[1:] == [
        "  0 train.learning_rate=0.0001: finished; 4/4 epochs; last reward 0.2500",
        "  1 train.learning_rate=0.0003: failed; 2/4 epochs; last reward 0.4000",
        "  2 -: not started; 0/? epochs"]

    code, out, _ = run_cli(capsys, sweep, "--json")
    data = json.loads(out, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    assert code == 0 and data["sweep_dir"] == str(sweep) and data["common"] == COMMON
    assert [(p["job"], p["state"], p["epochs_done"]) for p in data["points"]] == [(0, "finished", 4), (1, "failed", 2),
                                                                                 (2, "not started", 0)]


def test_overrides_are_shown_whole_however_narrow_the_console(tmp_path, capsys, monkeypatch):
    """A cut or folded override would name another point; brackets are a value, not rich markup."""
    monkeypatch.setenv("COLUMNS", "60")
    sweep = make_sweep(tmp_path)
    lora = "model.lora.target_modules=[to_q,to_k,to_v,to_out.0]"
    (sweep / "1" / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump([*COMMON, lora, "seed=7"]))
    out = run_cli(capsys, sweep)[1]
    lines = out.splitlines()
    row = next(i for i, line in enumerate(lines) if line.split()[:1] == ["1"])
    assert lora in lines[row] and "failed" in lines[row] and lines[row + 1].split() == ["seed=7"]


def test_a_point_dir_is_still_one_run_and_a_dir_of_neither_exits_2(tmp_path, capsys):
    sweep = make_sweep(tmp_path)
    code, out, _ = run_cli(capsys, sweep / "0", "--brief")
    assert code == 0 and out.startswith("sw: finished; 4/4 epochs done")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes").mkdir()  # not numbered: not a job dir
    code, out, err = run_cli(capsys, tmp_path / "other")
    assert code == 2 and out == "" and "no config.yaml" in err
    code, out, err = run_cli(capsys, sweep, "--plot")
    assert code == 2 and "--plot draws one run" in err and not list(sweep.glob("*.png"))


def test_a_sweep_in_a_bucket(fake_gcs, tmp_path, capsys):  # noqa: F811 -- fixture
    """gs://.../<run_name>-multirun: the points listed from the bucket, each read as a bucket run dir."""
    from ddpo_tpu.rundir import storage

    local = make_sweep(tmp_path)
    fs = storage.filesystem()
    base = storage.Url(fake_gcs, "runs/sw-multirun")
    for job in ("0", "1"):
        for name in storage.STATUS_FILES:
            if (local / job / name).is_file():
                fs.pipe(base.join(job, name).path, (local / job / name).read_bytes())
    code, out, err = run_cli(capsys, str(base), "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["sweep_dir"] == str(base)
    assert [(p["job"], p["overrides"], p["state"]) for p in data["points"]] == [
        (0, ["train.learning_rate=0.0001"], "finished"), (1, ["train.learning_rate=0.0003"], "failed")]
    code, out, err = run_cli(capsys, str(base.join("nothing-here")))
    assert code == 2 and "no config.yaml" in err
