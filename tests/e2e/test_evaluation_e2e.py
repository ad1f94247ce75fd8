"""The held-out evaluation end to end (issue 39's "done when"): `+experiment=smoke evaluation.every_n_epochs=1` on
a test split of 10 prompts, more than one evaluation batch holds, with a two-reward panel, on one eager process, on
two processes (tpu_topology=cpu_dist2) and on XLA CPU (tpu_topology=cpu); then `python -m ddpo_tpu.eval` on the
finished run. Each run is 1 epoch of a 3-step tiny SD1 (evaluated before training and after its epoch: the XLA
run's evaluation after training, with moved weights, reuses the graphs compiled before it).

What is proved: results.jsonl has one line per test prompt and image, no padding row counted; a prompt's image is the
same byte for byte whichever process count and batch draws it (its own seeded noise); on XLA the evaluation compiles
in the evaluation before training and never again (the padded last batch has the same shape); ddpo-eval reproduces
the run's last in-training evaluation exactly (images and scores) and --base the evaluation before training, also
when run on another topology than the run's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import FAST_XLA_CPU, clean_env, read_metrics, run_train
from tests.unit.training.test_evaluation import TEST_PROMPTS, dataset

pytestmark = pytest.mark.slow

PANEL = "evaluation.rewards=[{name: jpeg_compressibility}, {name: jpeg_incompressibility}]"
LABELS = ["jpeg_compressibility", "jpeg_incompressibility"]
ONE = ["sample.batch_size=4", "train.batch_size=2", "evaluation.batch_size=4"]
# two processes, and another global evaluation batch (6): other batch compositions, the same images
TWO = ["sample.batch_size=2", "train.batch_size=1", "evaluation.batch_size=3", "tpu_topology=cpu_dist2",
       "distributed.compile=none"]


def common(ds: Path, cache: Path) -> list[str]:
    return ["+experiment=smoke", "num_epochs=1", "sample.num_batches_per_epoch=1", "sample.num_steps=3",
            "train.gradient_accumulation_steps=2", "evaluation.every_n_epochs=1", "prompts=dataset",
            f"prompts.path={ds}", "evaluation.split=test", PANEL, "reward.host_workers=0", f"model.cache_dir={cache}"]


# XLA CPU with the cheap backend passes (tests/helpers: the graphs and their count are the same)
RUNS = {"eager": [*ONE, "tpu_topology=eager_cpu"], "dist": TWO, "xla": [*ONE, "tpu_topology=cpu", FAST_XLA_CPU]}


class Runs(dict):
    """Each run trained on first use, once per module (a test that needs one run does not wait for the others)."""

    def __init__(self, tmp: Path, cache: Path):
        super().__init__()
        self.tmp, self.cache, self.ds = tmp, cache, dataset(tmp)

    def __missing__(self, name: str) -> Path:
        proc = run_train([*common(self.ds, self.cache), *RUNS[name], f"run_name={name}",
                          f"output_root={self.tmp}/runs"], cwd=self.tmp, timeout=900)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        self[name] = self.tmp / "runs" / name
        return self[name]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, model_cache):
    return Runs(tmp_path_factory.mktemp("evaluation"), model_cache)


def results(run: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (run / "eval" / name / "results.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("name", ["eager", "dist", "xla"])
def test_every_test_prompt_is_evaluated_once_by_every_reward(runs, name):
    run = runs[name]
    evals = read_metrics(run, "eval")
    assert [e["epoch"] for e in evals] == [-1, 0]  # before training, each epoch (the last one included)
    for e, d in zip(evals, ["before_training", "epoch_0000"]):
        rows = results(run, d)
        assert [r["prompt"] for r in rows] == TEST_PROMPTS  # one line each: the last batch's padding dropped
        assert len({(r["prompt"], r["image_index"]) for r in rows}) == len(rows)
        assert all(set(r["scores"]) == set(LABELS) for r in rows)
        assert all((run / "eval" / d / r["image"]).is_file() for r in rows)
        summary = json.loads((run / "eval" / d / "summary.json").read_text())
        assert summary["num_images"] == 10 and [summary["rewards"][k]["n"] for k in LABELS] == [10, 10]
        assert summary["source"].endswith("test.txt")
        # jpeg_incompressibility is minus jpeg_compressibility: two rewards really scored the same images
        assert summary["rewards"][LABELS[0]]["mean"] == pytest.approx(-summary["rewards"][LABELS[1]]["mean"])
        assert e["rewards"][LABELS[0]]["mean"] == pytest.approx(summary["rewards"][LABELS[0]]["mean"])
        assert e["reward_mean"] == e["rewards"][LABELS[0]]["mean"] and e["num_images"] == 10
        assert (run / "eval" / d / "grid.png").is_file() and (run / "eval" / d / "grid.json").is_file()


def test_a_prompts_image_is_the_same_on_one_and_two_processes(runs):
    a, b = results(runs["eager"], "before_training"), results(runs["dist"], "before_training")
    assert [r["seed"] for r in a] == [r["seed"] for r in b]
    for ra, rb in zip(a, b):  # the same frozen model and seeds: the same bytes, in batches of 4 vs 2 x 3
        assert (runs["eager"] / "eval/before_training" / ra["image"]).read_bytes() == \
            (runs["dist"] / "eval/before_training" / rb["image"]).read_bytes(), ra["prompt"]
        assert ra["scores"] == rb["scores"]


def test_on_xla_the_evaluation_compiles_once(runs):
    for e in read_metrics(runs["xla"], "epoch"):
        assert e["phases"]["evaluation"]["compilations"] == 0, e["phases"]  # compiled before training, reused
    first = read_metrics(runs["xla"], "epoch")[0]["phases"]
    assert first["evaluation_before"]["compilations"] > 0  # ... where it did compile (the count can fail)


def _eval(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    p = subprocess.run([sys.executable, "-m", "ddpo_tpu.eval", *args], cwd=cwd, env=clean_env(),
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p


def same_evaluation(a: Path, b: Path) -> None:
    read = lambda d: [json.loads(line) for line in (d / "results.jsonl").read_text().splitlines()]
    ra, rb = read(a), read(b)
    assert [(r["prompt"], r["image_index"], r["scores"]) for r in ra] == \
        [(r["prompt"], r["image_index"], r["scores"]) for r in rb]
    for x, y in zip(ra, rb):
        assert (a / x["image"]).read_bytes() == (b / y["image"]).read_bytes(), x["prompt"]


def test_ddpo_eval_reproduces_the_last_evaluation_and_base_the_first(runs, tmp_path):
    run = runs["eager"]
    _eval([str(run)], tmp_path)  # the newest checkpoint: epoch 0's, the run's last (trained: not the base)
    same_evaluation(run / "eval/epoch_0000", run / "eval/checkpoint_epoch_0000")
    rec = json.loads((run / "eval" / "checkpoint_epoch_0000" / "metrics.jsonl").read_text().splitlines()[0])
    assert (rec["epoch"], rec["global_step"]) == (0, read_metrics(run, "eval")[-1]["global_step"])
    # the frozen model, evaluated on two processes into a directory of the user's: the evaluation before training
    _eval([str(run), "--base", "--out", str(tmp_path / "mine"), *TWO[-2:], "sample.batch_size=2",
           "train.batch_size=1"], tmp_path)
    same_evaluation(run / "eval/before_training", tmp_path / "mine/base")


def test_ddpo_eval_of_a_weights_file_is_the_evaluation_of_those_weights(runs, tmp_path):
    """weights/final.safetensors (the smoke keeps no EMA: the weights the last evaluation sampled with) gives the
    run's last evaluation; the record names the epoch the file stands for."""
    run = runs["eager"]
    _eval([str(run / "weights" / "final.safetensors"), "--out", str(tmp_path / "w")], tmp_path)
    same_evaluation(run / "eval/epoch_0000", tmp_path / "w" / "weights_final")
    assert json.loads((tmp_path / "w" / "weights_final" / "summary.json").read_text())["epoch"] == 0
