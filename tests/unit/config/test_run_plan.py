"""The run plan (ddpo_tpu/config/plan.py): decided once by validation, printed by `--check --json`, stored in
parity.json, and the same plan the training process hands the loop (issue 42 item 4, "Done when": the plan printed
by --check equals what the loop uses, on every smoke experiment).

The expected values are written from the references' batch arithmetic, not from config/plan.py: trained timesteps are
int(num_steps x timestep_fraction) and an optimizer step comes every gradient_accumulation_steps x trained timesteps
backward passes, as in kvablack/ddpo-pytorch@18294d8d7a838c24424caf6ac10b0d39af10cbdc scripts/train.py (its
`num_train_timesteps` and the Accelerator's `gradient_accumulation_steps`); with an SDE window every step of the window
is trained (flow_grpo's fast trainer, as diffusion/window.py cites it); samples per epoch and the total train batch
are per-device sizes x processes there, x replicas here.
"""

from __future__ import annotations

import dataclasses
import json
import os
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from ddpo_tpu import train
from ddpo_tpu.catalog.executions import execution
from ddpo_tpu.config.compose import compose, compose_and_validate, conf_dir, overridden_keys, to_tree, validate
from ddpo_tpu.config.plan import PLAN_ROW, RunPlan, plan_of_rows, run_plan

SMOKES = sorted(p.stem for p in (conf_dir() / "experiment").glob("*.yaml") if "smoke" in p.stem)


def check_json(capsys, *overrides: str) -> list[dict]:
    """`--check --json` in this process: one JSON object per run, nothing else on stdout. The environment is the one a
    user's shell gives (tests.helpers.clean_env): an earlier test in this worker that imported torch_xla left
    PJRT_DEVICE and XLA_FLAGS here, which the front end refuses."""
    from unittest import mock

    from tests.helpers import clean_env

    capsys.readouterr()
    with mock.patch.dict(os.environ, clean_env(), clear=True):
        train.main([*overrides, "--check", "--json"])
    lines = capsys.readouterr().out.splitlines()
    return [json.loads(line) for line in lines]


def worker_plan(tmp_path: Path, overrides: list[str]) -> RunPlan:
    """The plan the training process builds the Trainer with: the config saved as the front end's job saves it
    (config.yaml), validated by the worker's own path (worker.load_validated)."""
    from ddpo_tpu.worker import load_validated

    tree = validate(compose(overrides), overridden_keys(overrides)).tree
    OmegaConf.save(OmegaConf.create(tree), tmp_path / "config.yaml")
    return load_validated(tmp_path).plan


def test_every_smoke_experiment_is_covered():
    assert "smoke" in SMOKES and len(SMOKES) >= 8, SMOKES


@pytest.mark.parametrize("experiment", SMOKES)
def test_check_prints_the_plan_the_worker_hands_the_loop(experiment, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # output_root is relative: --check writes nothing, but resolves it here
    overrides = [f"+experiment={experiment}"]
    (printed,) = check_json(capsys, *overrides)
    assert printed["job"] == 0 and printed["overrides"] == overrides
    plan = worker_plan(tmp_path, overrides)
    assert printed["plan"] == json.loads(json.dumps(plan.as_dict()))  # as JSON, field by field
    assert RunPlan.from_dict(printed["plan"]) == plan  # and back: the same frozen plan

    # the loop's view of it (training/loop.py step_shape), from the printed plan and from the worker's
    from ddpo_tpu.training.loop import step_shape

    assert step_shape(RunPlan.from_dict(printed["plan"])) == step_shape(plan)

    # the values, from the references' arithmetic over the config's keys
    tree = to_tree(compose(overrides))
    s, t, topo, a = tree["sample"], tree["train"], tree["tpu_topology"], tree["algorithm"]
    window = (s.get("sde_window") or {}).get("size")
    T = window if window is not None else int(s["num_steps"] * t["timestep_fraction"])
    # AWM trains its own count of times per sample, all in one forward of K x B rows
    # (scxue/advantage_weighted_matching@be51372 advantage_weighted_matching/scripts/train_sd3_awm.py:1172-1180,
    # 1212-1220, 1265-1270: config.train.train_timesteps strata, the batch repeated that many times)
    awm = a["name"] == "awm"
    if awm:
        T = a["train_timesteps"]
    R = topo["mesh"]["dp"] * topo["mesh"]["fsdp"] if execution(topo["execution"]).multi_device else 1
    assert (plan.rollout_steps, plan.train_timesteps, plan.replicas) == (s["num_steps"], T, R)
    assert plan.global_sample_batch == s["batch_size"] * R and plan.global_train_batch == t["batch_size"] * R
    assert plan.accumulation_window == t["gradient_accumulation_steps"] * T
    assert plan.samples_per_epoch == s["batch_size"] * s["num_batches_per_epoch"] * R
    assert math.isclose(plan.updates_per_epoch, plan.samples_per_epoch * t["num_inner_epochs"]
                        / (plan.global_train_batch * t["gradient_accumulation_steps"]))
    # flow_grpo's optimizer steps per inner epoch: per-device samples over per-device train batch x accumulation
    assert plan.updates_per_inner_epoch == (s["batch_size"] * s["num_batches_per_epoch"]
                                            // (t["batch_size"] * t["gradient_accumulation_steps"]))
    assert T % plan.fused_timesteps == 0
    if awm:
        assert plan.fused_timesteps == T
    if t["timesteps_per_micro_step"] != "auto":
        assert plan.fused_timesteps == t["timesteps_per_micro_step"]
    if t["activation_checkpointing"] != "auto":
        assert plan.activation_checkpointing == t["activation_checkpointing"]
    assert (plan.sde_window is None) == (window is None)

    # the parity table shows the same decisions (rules.parity_report)
    rows = {r["constraint"]: r["effective"] for r in compose_and_validate(overrides).report}
    assert rows["train timesteps per sample"] == plan.train_timesteps
    assert rows["timesteps per micro-step"] == plan.fused_timesteps
    assert rows["activation checkpointing"] == plan.activation_checkpointing


def test_the_sde_window_schedule_is_the_samplers(capsys, tmp_path, monkeypatch):
    """qwen_image_grpo_smoke's window: the plan places it where diffusion/window.py places the config's."""
    from ddpo_tpu.diffusion.window import sde_window_at

    monkeypatch.chdir(tmp_path)
    v = compose_and_validate(["+experiment=qwen_image_grpo_smoke", "sample.sde_window.placement=sliding",
                              "sample.sde_window.shift_every=2"])
    w, steps = v.plan.sde_window, v.cfg.sample.num_steps
    assert w is not None and w.size == v.cfg.sample.sde_window.size == v.plan.train_timesteps
    for epoch in range(12):
        assert sde_window_at(w, steps, 0, epoch, 0) == sde_window_at(v.cfg.sample.sde_window, steps, 0, epoch, 0)


def test_samples_on_rank_follow_keep_samples_on_rank():
    """distributed.keep_samples_on_rank on two ranks: each trains the half it drew; off: every rank the whole epoch."""
    base = ["+experiment=smoke", "tpu_topology=cpu_dist2", "distributed.compile=none"]
    kept = compose_and_validate([*base, "distributed.keep_samples_on_rank=true"]).plan
    whole = compose_and_validate([*base, "distributed.keep_samples_on_rank=false"]).plan
    assert (kept.processes, kept.replicas) == (2, 2) and kept.keep_samples_on_rank
    assert kept.samples_on_rank * 2 == kept.samples_per_epoch
    assert not whole.keep_samples_on_rank and whole.samples_on_rank == whole.samples_per_epoch
    assert kept.global_sample_batch == 2 * 8  # smoke's sample.batch_size x 2 replicas


def test_check_json_of_a_sweep_is_one_line_per_point(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = check_json(capsys, "-m", "+experiment=smoke", "train.gradient_accumulation_steps=1,2")
    assert [o["job"] for o in out] == [0, 1]
    assert [o["plan"]["accumulation_window"] for o in out] == [8, 16]  # smoke: int(8 x 1.0) timesteps
    assert not any(tmp_path.iterdir()), "--check wrote something"


def test_json_without_check_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        train.main(["+experiment=smoke", "--json"])
    assert e.value.code == 2 and "--json goes with --check" in capsys.readouterr().err


def test_the_out_of_memory_line_reads_the_plan():
    """The line names the fused K and checkpointing the run trained with, and offers a smaller K dividing T."""
    from ddpo_tpu.worker import out_of_memory_line

    v = compose_and_validate(["+experiment=smoke"])
    plan = dataclasses.replace(v.plan, fused_timesteps=4, activation_checkpointing=True)
    line = out_of_memory_line(RuntimeError("RESOURCE_EXHAUSTED: out of memory"), v.cfg, "nothing saved", plan)
    assert "train.timesteps_per_micro_step=4" in line and "train.activation_checkpointing=true," in line
    assert "Fix: train.timesteps_per_micro_step=2" in line  # the largest K < 4 dividing smoke's 8 trained timesteps
    assert "Fix: train.activation_checkpointing=true" in out_of_memory_line(RuntimeError("oom"), v.cfg, "x")
    # AWM's one forward holds its algorithm.train_timesteps (3 in awm_smoke): that key is what it offers to lower
    awm = compose_and_validate(["+experiment=awm_smoke"])
    line = out_of_memory_line(RuntimeError("oom"), awm.cfg, "x", awm.plan)
    assert "at algorithm.train_timesteps=3," in line and "Fix: algorithm.train_timesteps=2" in line
    assert "timesteps_per_micro_step" not in line


def test_parity_json_keeps_its_rows_and_an_old_one_without_a_plan_still_reads(tmp_path):
    from ddpo_tpu.launch import saved_run
    from ddpo_tpu.status.facts import parity_summary

    v = compose_and_validate(["+experiment=smoke", f"output_root={tmp_path}"])
    rows = [*v.report, v.plan.parity_row()]
    assert json.loads(json.dumps(rows))[:-1] == json.loads(json.dumps(v.report))  # every earlier row, unchanged
    assert plan_of_rows(json.loads(json.dumps(rows))) == v.plan
    assert parity_summary(rows).failing == ()  # the plan row is no constraint that can fail
    old = json.loads(json.dumps(v.report))
    assert plan_of_rows(old) is None and plan_of_rows(None) is None
    assert plan_of_rows([{"constraint": PLAN_ROW, "effective": {"fused_timesteps": 1}}]) is None  # damaged: none
    # an old run dir (config.yaml and a parity.json without the plan): the same command may continue it
    run_dir = tmp_path / "smoke"
    run_dir.mkdir()
    OmegaConf.save(OmegaConf.create(v.tree), run_dir / "config.yaml")
    (run_dir / "parity.json").write_text(json.dumps(old))
    assert saved_run.problems(v, run_dir) == []


def test_a_plan_row_from_before_a_field_was_added_still_reads():
    """A run dir whose parity.json holds a plan written before `updates_per_inner_epoch` existed (2026-11-29): the
    row reads, the missing field derived from the row's own batches (samples / (train batch x accumulation)), equal
    to the plan validation makes today; its other fields are the row's, not recomputed."""
    v = compose_and_validate(["+experiment=flow_grpo_smoke", "train.num_inner_epochs=2"])
    old = json.loads(json.dumps(v.plan.parity_row()))
    del old["effective"]["updates_per_inner_epoch"]
    assert plan_of_rows([old]) == v.plan and v.plan.updates_per_inner_epoch == 2  # 8 x 16 / (16 x 4)
    old["effective"]["samples_per_epoch"] = 256  # the row's own figures, not the config's
    assert plan_of_rows([old]).updates_per_inner_epoch == 4


def test_a_trainer_uses_the_plan_it_is_handed(model_cache, tmp_path):
    """The Trainer's step shape, batches and checkpointing are the plan's: a plan that differs from the config's own
    decisions (here: fused K 4 and checkpointing on, which smoke's config resolves to 1 and off) is what it builds."""
    from ddpo_tpu.rundir.files import RunDir
    from ddpo_tpu.runtime import make_runtime
    from ddpo_tpu.training import loop

    v = compose_and_validate(["+experiment=smoke", f"model.cache_dir={model_cache}", "reward.host_workers=0",
                              "sample.batch_size=4", "train.batch_size=2"])
    assert (v.plan.fused_timesteps, v.plan.activation_checkpointing) == (1, False)
    plan = dataclasses.replace(v.plan, fused_timesteps=4, activation_checkpointing=True)
    tr = loop.Trainer(v.cfg, make_runtime(v.cfg), RunDir(tmp_path), tree=v.tree, plan=plan,
                      stop=SimpleNamespace(requested=False))
    assert tr.plan is plan and tr.shape == loop.step_shape(plan) and tr.ctx.shape.fused == 4
    assert tr.algorithm.plan is plan  # make_algorithm(cfg, plan): the algorithm reads the same decisions
    assert tr.global_batch == plan.global_sample_batch and tr.keep_samples_on_rank is False
    assert tr.family.model.is_gradient_checkpointing
    with pytest.raises(ValueError, match="replica"):  # a plan for other devices than the runtime's is refused
        loop.Trainer(v.cfg, make_runtime(v.cfg), RunDir(tmp_path), tree=v.tree,
                     plan=dataclasses.replace(v.plan, replicas=2), stop=SimpleNamespace(requested=False))


@pytest.mark.slow
def test_a_run_stores_the_checked_plan_and_an_old_run_dir_resumes(tmp_path, model_cache, capsys, monkeypatch):
    """One eager epoch of smoke: parity.json holds the plan --check printed; with that row removed (a run dir from
    before the plan) the same command with one more epoch resumes it."""
    from tests.helpers import read_metrics, run_train

    args = ["+experiment=smoke", "num_epochs=1", "sample.num_batches_per_epoch=1", "sample.batch_size=4",
            "train.batch_size=4", "train.gradient_accumulation_steps=1", "reward.host_workers=0", "save_freq=1",
            f"model.cache_dir={model_cache}"]
    monkeypatch.chdir(tmp_path)
    (printed,) = check_json(capsys, *args)
    proc = run_train(args, tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = tmp_path / "outputs" / "smoke"
    rows = json.loads((run_dir / "parity.json").read_text())
    assert plan_of_rows(rows) == RunPlan.from_dict(printed["plan"])
    (run_dir / "parity.json").write_text(json.dumps([r for r in rows if r["constraint"] != PLAN_ROW]))
    args[1] = "num_epochs=2"
    proc = run_train(args, tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [r["epoch"] for r in read_metrics(run_dir, "epoch")] == [0, 1]
    assert plan_of_rows(json.loads((run_dir / "parity.json").read_text())) == run_plan(
        compose_and_validate(args).cfg)


def test_a_job_reuses_its_preflight_validation(monkeypatch):
    """The front end validates each run once: Hydra's job takes its preflight point's Validated (plan included) when
    it composed the same tree, and validates anew when the tree differs."""
    from ddpo_tpu.launch.sweep import Point

    overrides = ["+experiment=smoke", "seed=3"]
    point = Point(0, overrides, "", compose_and_validate(overrides))
    monkeypatch.setattr(train, "_preflight_points", [point])
    hc = SimpleNamespace(job=SimpleNamespace(num=0), mode=SimpleNamespace(name="RUN"),
                         overrides=SimpleNamespace(task=overrides))
    assert train._validated_job(compose(overrides), hc) is point.validated
    other = train._validated_job(compose(["+experiment=smoke", "seed=4"]), hc)
    assert other is not point.validated and other.cfg.seed == 4 and other.plan == point.validated.plan


# --- an algorithm that counts its own trained timesteps (catalog AlgorithmSpec.trained_timesteps / one_forward) -----
# AWM (scxue/advantage_weighted_matching@be51372 advantage_weighted_matching/scripts/train_sd3_awm.py) draws
# config.train.train_timesteps times per sample, one per stratum of the first int(num_steps x timestep_fraction)
# steps (:1172-1180), repeats the train batch that many times (:1212-1220) and trains all K x B rows in one forward
# inside accelerate's accumulation of gradient_accumulation_steps train batches (:539, 1265-1270).

def test_awm_smoke_plans_awms_own_timesteps_in_one_forward(capsys, tmp_path, monkeypatch):
    """awm_smoke: 3 times a sample (algorithm.train_timesteps), not int(6 x 0.9) = 5; all 3 in the one forward; an
    optimizer step per train batch of 3 timesteps. The same numbers on --check's plan line."""
    monkeypatch.chdir(tmp_path)
    plan = compose_and_validate(["+experiment=awm_smoke"]).plan
    assert (plan.rollout_steps, plan.train_timesteps, plan.fused_timesteps) == (6, 3, 3)
    assert (plan.gradient_accumulation_steps, plan.accumulation_window) == (1, 3)
    capsys.readouterr()
    from unittest import mock

    from tests.helpers import clean_env

    with mock.patch.dict(os.environ, clean_env(), clear=True):
        train.main(["+experiment=awm_smoke", "--check"])
    out = capsys.readouterr().out
    assert "6 rollout steps, 3 trained x 3 per micro-step" in out and "1 train batch(es) x 3 timesteps" in out, out


def test_awm_plans_its_key_where_the_fraction_would_give_another_count():
    """algorithm.train_timesteps=4 with int(6 x 0.5) = 3 and 2 accumulated batches: 4 trained and fused, a window of
    2 x 4; the fraction still bounds AWM's strata, so a fraction that leaves no step is still refused."""
    from ddpo_tpu.problems import ConfigError

    base = ["+experiment=awm_smoke", "algorithm.train_timesteps=4", "train.timestep_fraction=0.5",
            "train.gradient_accumulation_steps=2"]
    plan = compose_and_validate(base).plan
    assert (plan.train_timesteps, plan.fused_timesteps, plan.accumulation_window) == (4, 4, 8)
    with pytest.raises(ConfigError) as e:
        compose_and_validate(["+experiment=awm_smoke", "train.timestep_fraction=0.1"])  # int(6 x 0.1) = 0
    assert "train.timestep_fraction" in {p.key for p in e.value.problems}


def test_only_awm_counts_its_own_timesteps_and_nft_keeps_the_fraction():
    """DiffusionNFT trains int(num_steps x timestep_fraction) times per sample (NVlabs/DiffusionNFT@24af5554
    scripts/train_nft_sd3.py:569, accumulating gradient_accumulation_steps x that many backward passes, :801, one
    timestep a forward, :855; here fused by train.timesteps_per_micro_step), so its catalog entry counts none of its
    own; an entry that fuses all in one forward names the key that sets them, a key of its own."""
    from ddpo_tpu.catalog import ALGORITHMS

    assert {a.name for a in ALGORITHMS if a.trained_timesteps is not None} == {"awm"}
    for a in ALGORITHMS:
        if a.one_forward:
            assert a.trained_timesteps.removeprefix("algorithm.") in a.keys.model_fields
    plan = compose_and_validate(["+experiment=nft_smoke", "train.timesteps_per_micro_step=1"]).plan
    cfg = compose_and_validate(["+experiment=nft_smoke"]).cfg
    assert plan.train_timesteps == int(cfg.sample.num_steps * cfg.train.timestep_fraction) and plan.fused_timesteps == 1


# SD 3.5 Medium at 512 px in bf16 on one v6e chip: the estimate's budget holds one timestep of 2 samples without
# checkpointing, not two (config/memory.py; catalog/families.py's SD3 figures)
AWM_V6E = ["+experiment=awm_smoke", "model=sd35_medium", "+model.resolution=512", "model.dtype=bfloat16",
           "train.mixed_precision=bf16", "tpu_topology=v6e-1", "train.batch_size=2"]


def test_awm_checkpoints_by_its_one_forwards_shape():
    """activation_checkpointing=auto decides on AWM's forward of train_timesteps x B rows: 2 x 2 rows do not fit
    without checkpointing where 1 x 2 do, so 2 times a sample turn it on and 1 leaves it off (deciding on the
    fraction's int(6 x 0.9) = 5 timesteps fused auto, 1 at a time here, left it off for both); 3 x 2 rows do not fit
    even checkpointed: refused on
    algorithm.train_timesteps with the count that fits."""
    from ddpo_tpu.config import memory
    from ddpo_tpu.problems import ConfigError

    one, two = (compose_and_validate([*AWM_V6E, f"algorithm.train_timesteps={k}"]) for k in (1, 2))
    budget = memory.activation_budget(two.cfg)
    assert budget is not None
    assert memory.training_activation_gib(two.cfg, 1, checkpointed=False) <= budget  # one timestep fits plain
    assert memory.training_activation_gib(two.cfg, 2, checkpointed=False) > budget   # AWM's forward does not
    assert (one.plan.fused_timesteps, one.plan.activation_checkpointing) == (1, False)
    assert (two.plan.fused_timesteps, two.plan.activation_checkpointing) == (2, True)
    with pytest.raises(ConfigError) as e:
        compose_and_validate([*AWM_V6E, "algorithm.train_timesteps=3"])
    (p,) = [p for p in e.value.problems if p.key == "algorithm.train_timesteps"]
    assert p.value == 3 and "3 timesteps x 2 samples in one forward" in p.reason
    assert p.fix.overrides() == ["algorithm.train_timesteps=2"]
