"""The front end as users run it: `python -m ddpo_tpu.train ...` in a subprocess, in an empty directory, with the
environment's owned variables removed. None of these tests starts a training run: an invalid config must be refused
before anything is written or started.

One real process per path the front end has proves its exit code and console: a refusal before Hydra
(test_invalid_config_is_refused_fast_and_writes_nothing, and the first legacy variable), HYDRA_FULL_ERROR's traceback,
--help, Hydra's own commands (--cfg job), and --check. The other cases of those paths call the front end's main() in
this process (tests.helpers.front_end_in_process: the same code, where only the process start differs, ~0.8 CPU s
of imports each): the other refusals, the second --check, --hydra-help and --info."""

from __future__ import annotations

import logging
import re
import sys
from pathlib import Path

import pytest
import yaml

from ddpo_tpu.config.compose import conf_dir
from tests.helpers import clean_env, front_end_in_process, timed_run

pytestmark = pytest.mark.torch_free  # no torch in the test or what it starts (tests/conftest.py)

REPO = Path(__file__).resolve().parents[3]
TIMEOUT = 60


def cli(cwd: Path, *args: str, env: dict[str, str] | None = None):
    """The front end's process and the CPU seconds it took (its wall time on a quiet machine;
    tests.helpers.timed_run)."""
    proc, _, cpu = timed_run([sys.executable, "-m", "ddpo_tpu.train", *args], cwd=cwd, env=env or clean_env(),
                             timeout=TIMEOUT)
    return proc, cpu


def written(cwd: Path) -> list[str]:
    return sorted(str(p.relative_to(cwd)) for p in cwd.rglob("*"))


def cli_in_process(tmp: Path, monkeypatch, capsys, *args: str):
    """The front end's main(args) in this process, in tmp/cwd (a process-like result, and that cwd). Hydra's own
    commands configure logging (handlers on this test's captured stderr): the loggers are put back afterwards, or
    a later test's log line would go to a closed stream."""
    loggers = [logging.getLogger(), *(lg for lg in logging.Logger.manager.loggerDict.values()
                                      if isinstance(lg, logging.Logger))]
    saved = {id(lg): (lg.handlers[:], lg.level, lg.disabled, lg.propagate) for lg in loggers}
    try:
        proc, *_ = front_end_in_process(tmp, list(args), monkeypatch, capsys)
    finally:
        for lg in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]:
            if isinstance(lg, logging.Logger):
                lg.handlers[:], lg.level, lg.disabled, lg.propagate = saved.get(id(lg), ([], logging.NOTSET,
                                                                                          False, True))
    return proc, tmp / "cwd"


def test_cfg_job_prints_the_composed_config(tmp_path):
    proc, _ = cli(tmp_path, "+experiment=compressibility_parity", "--cfg", "job")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "pretrained: CompVis/stable-diffusion-v1-4" in out
    assert re.search(r"^  batch_size: 4$", out, re.M)
    assert re.search(r"^  num_batches_per_epoch: 8$", out, re.M)
    assert re.search(r"^  gradient_accumulation_steps: 4$", out, re.M)
    assert "name: v6e-8" in out and "num_steps: 50" in out
    assert "hydra:" not in out  # job config only
    assert written(tmp_path) == []


def test_invalid_config_is_refused_fast_and_writes_nothing(tmp_path):
    proc, cpu = cli(tmp_path, "+experiment=compressibility_parity", "sample.batch_size=3")
    print(f"refusal took {cpu:.2f} CPU s")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    err = proc.stderr
    assert "sample.batch_size=3" in err and "try sample.batch_size=4" in err
    assert "192 samples/epoch" in err and "needs 256" in err
    assert "Traceback" not in err + proc.stdout
    assert "nothing was started" in err
    assert not (tmp_path / "outputs").exists() and written(tmp_path) == []


def test_full_error_on_request(tmp_path):
    proc, _ = cli(tmp_path, "+experiment=compressibility_parity", "sample.batch_size=3",
                  env=clean_env(HYDRA_FULL_ERROR="1"))
    assert proc.returncode != 0
    assert "Traceback" in proc.stderr and "ConfigError" in proc.stderr and "sample.batch_size=3" in proc.stderr
    assert written(tmp_path) == []


@pytest.mark.parametrize("name,value,key", [
    ("DDPO_TPU_SYNC_EVERY_STEP", "2", "xla.sync_every_n_denoising_steps"),
    ("PJRT_DEVICE", "TPU", "tpu_topology"),
    ("XLA_FLAGS", "--xla_dump_to=/tmp/x", "xla.flags"),
    ("TORCH_TPU_TOPOLOGY", "2x4", "tpu_topology"),               # TorchTPU reads it at `import torch`
    ("PET_NPROC_PER_NODE", "4", "tpu_topology.chips_per_host"),  # torchrun's, which the front end starts
])
def test_legacy_variable_is_refused(tmp_path, name, value, key, monkeypatch, capsys):
    """The first case in a real process; the others call the front end's main() in-process (the same refusal path,
    tests.helpers.front_end_in_process), where only the process start differs."""
    if name == "DDPO_TPU_SYNC_EVERY_STEP":
        proc, _ = cli(tmp_path, "+experiment=smoke", env=clean_env(**{name: value}))
        cwd = tmp_path
    else:
        proc, *_ = front_end_in_process(tmp_path, ["+experiment=smoke"], monkeypatch, capsys, **{name: value})
        cwd = tmp_path / "cwd"
    assert proc.returncode != 0
    assert name in proc.stderr and key in proc.stderr
    assert "Traceback" not in proc.stderr and "nothing was started" in proc.stderr
    assert written(cwd) == []


def test_multirun_validates_every_point_before_starting(tmp_path, monkeypatch, capsys):
    """In-process: the refusal path of test_invalid_config_is_refused_fast_and_writes_nothing, for a sweep."""
    proc, tmp_path = cli_in_process(tmp_path, monkeypatch, capsys, "-m", "+experiment=smoke",
                                    "train.clip_range=0.0001,-1")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "train.clip_range=-1" in proc.stderr and "greater than 0" in proc.stderr
    assert "job 1" in proc.stderr and "job 0" not in proc.stderr  # only the invalid point is named
    assert "2 sweep point(s) checked" in proc.stderr
    assert "Launching" not in out and "Traceback" not in out
    assert not (tmp_path / "outputs").exists() and written(tmp_path) == []


def test_unknown_group_option_is_refused(tmp_path, monkeypatch, capsys):
    """In-process: the refusal path of test_invalid_config_is_refused_fast_and_writes_nothing."""
    proc, tmp_path = cli_in_process(tmp_path, monkeypatch, capsys, "model=nope")
    assert proc.returncode == 2
    assert "error: model=" in proc.stderr and "no such option" in proc.stderr
    assert "Traceback" not in proc.stderr and written(tmp_path) == []


def test_help_says_what_to_run(tmp_path):
    proc, cpu = cli(tmp_path, "--help")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    sections = dict(re.findall(r"^(\S[^\n]*):\n((?:  [^\n]*\n)+)", out + "\n", re.M))
    # the first command, the other commands, the modes and every documented exit code
    assert "  python -m ddpo_tpu.train +experiment=smoke" in out.split("Experiments")[0]
    assert "ddpo-status" in out and "ddpo-pod" in out and "--check" in out and "--cfg job" in out
    codes = next(v for k, v in sections.items() if k.startswith("Exit codes"))
    from ddpo_tpu.proc.exit_codes import DOCUMENTED
    assert sorted(int(c) for c in re.findall(r"^  (\d+) ", codes, re.M)) == sorted(DOCUMENTED)
    # every experiment with one line, every group with its options (what is in conf/, not a copied list)
    experiments = next(v for k, v in sections.items() if k.startswith("Experiments"))
    listed = dict(re.findall(r"^  (\w+) +(.+)$", experiments, re.M))
    assert sorted(listed) == sorted(f.stem for f in (conf_dir() / "experiment").glob("*.yaml"))
    assert listed["smoke"] == "A seeded end-to-end run of the whole DDPO loop on the tiny local model and the host CPU"
    assert all(len(v) <= 100 for v in listed.values())
    assert all(v.count("(") == v.count(")") for v in listed.values()), listed  # never cut inside a parenthesis
    # every registered algorithm is named in the description (from the catalog, not a copied list)
    from ddpo_tpu.catalog import ALGORITHMS
    description = " ".join(out.split("Start here")[0].split())
    assert all(a.title in description for a in ALGORITHMS) and len(list(ALGORITHMS)) >= 4, description
    groups_text = next(v for k, v in sections.items() if k.startswith("Config groups"))
    listed = dict(re.findall(r"^  (\w+): (.+)$", groups_text, re.M))
    groups = {p.name: sorted(f.stem for f in p.glob("*.yaml")) for p in conf_dir().iterdir() if p.is_dir()}
    assert {"model", "tpu_topology", "parity", "prompts", "reward", "sampler", "xla"} <= set(groups)
    for group, options in groups.items():
        if group != "experiment":
            assert sorted(o.strip() for o in listed[group].split(",")) == options, group
    assert "Traceback" not in proc.stderr and written(tmp_path) == []
    print(f"--help took {cpu:.2f} CPU s")


def test_hydra_help_is_still_there(tmp_path, monkeypatch, capsys):
    """In-process: Hydra's own commands' path, whose real process is test_cfg_job_prints_the_composed_config's."""
    proc, tmp_path = cli_in_process(tmp_path, monkeypatch, capsys, "--hydra-help")
    assert proc.returncode == 0, proc.stderr
    assert "Hydra (" in proc.stdout and written(tmp_path) == []


def test_check_validates_every_point_and_writes_nothing(tmp_path):
    proc, cpu = cli(tmp_path, "-m", "+experiment=smoke", "seed=1,2", "--check")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "[job 0: +experiment=smoke seed=1]" in out and "[job 1: +experiment=smoke seed=2]" in out
    assert out.count("samples per epoch") == 2 and "activation checkpointing" in out  # the decisions, per point
    assert str(tmp_path / "outputs" / "smoke-multirun" / "1") in out  # where it would run
    assert "2 run(s) valid" in out and "nothing was written" in out
    assert written(tmp_path) == [], "--check wrote something"
    print(f"--check of 2 points took {cpu:.2f} CPU s")


def test_check_refuses_an_invalid_point_as_without_it(tmp_path, monkeypatch, capsys):
    """An invalid point: the same one-line errors and exit 2 as without --check (in-process: the refusal path of
    test_invalid_config_is_refused_fast_and_writes_nothing; --check's real process is the test above's)."""
    proc, tmp_path = cli_in_process(tmp_path, monkeypatch, capsys, "+experiment=compressibility_parity",
                                    "sample.batch_size=3", "--check")
    assert proc.returncode == 2 and "error: sample.batch_size=3" in proc.stderr and proc.stdout == ""
    assert written(tmp_path) == []


def test_info(tmp_path, monkeypatch, capsys):
    """In-process: Hydra's own commands' path, whose real process is test_cfg_job_prints_the_composed_config's."""
    proc, tmp_path = cli_in_process(tmp_path, monkeypatch, capsys, "--info")
    assert proc.returncode == 0, proc.stderr
    assert "Hydra" in proc.stdout and str(conf_dir()) in proc.stdout
    assert written(tmp_path) == []


@pytest.mark.needs_torch
@pytest.mark.slow
def test_multirun_runs_each_point_in_its_own_process_and_dir(tmp_path, model_cache):
    from tests.helpers import run_train

    proc = run_train(["-m", "+experiment=smoke", "num_epochs=1", "sample.num_batches_per_epoch=1",
                      "reward.host_workers=0", f"model.cache_dir={model_cache}", "train.learning_rate=1e-4,3e-4"],
                     tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    jobs = sorted(p for p in (tmp_path / "outputs" / "smoke-multirun").iterdir() if p.is_dir())
    assert [j.name.split("_")[0] for j in jobs] == ["0", "1"]
    rates = []
    for job in jobs:
        assert (job / "metrics.jsonl").is_file() and (job / "weights" / "final.safetensors").is_file()
        rates.append(yaml.safe_load((job / "config.yaml").read_text())["train"]["learning_rate"])
    assert rates == [1e-4, 3e-4]
    # one fresh training process per job, one after the other
    assert proc.stdout.count("ddpo_tpu: run complete") == 2
    assert proc.stdout.index("run complete") < proc.stdout.rindex("sampling start")


def test_unwritable_output_root_is_refused_before_anything_starts(tmp_path, monkeypatch, capsys):
    """In-process: the refusal path of test_invalid_config_is_refused_fast_and_writes_nothing."""
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    proc, _ = cli_in_process(tmp_path, monkeypatch, capsys, "+experiment=smoke", f"output_root={blocker}/runs")
    assert proc.returncode == 2
    assert "output_root=" in proc.stderr and "not a writable directory" in proc.stderr
    assert "Traceback" not in proc.stderr
