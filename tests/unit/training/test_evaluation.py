"""The evaluation's plan (config/eval_plan.py), its compose-time refusals, its files' helpers and ddpo-eval's front
end: fast, without a model. The end-to-end runs are tests/e2e/test_evaluation_e2e.py.

The padding rule is flow_grpo's evaluation loader's (yifan123/flow_grpo@ac4c86e8cae021841f1fde853d340e0db67690dd
scripts/train_sd3.py:217-313: the test set through accelerate's prepared loader, whose DistributedSampler pads the
index list with its first indices so every process gets as many): here the last global batch is padded with the
first items again and their results are dropped."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from tests.helpers import REPO, clean_env

from ddpo_tpu.config.compose import ConfigError, compose_and_validate
from ddpo_tpu.config.eval_plan import image_seed, make_plan, prompt_key

TEST_PROMPTS = ["a red cat", "a blue dog", "a green horse", "a small rabbit", "a tall giraffe", "a happy frog",
                "a sleepy owl", "a fast fox", "a big bear", "a tiny mouse"]


def dataset(tmp_path: Path, test_rows: list[str] = TEST_PROMPTS) -> Path:
    d = tmp_path / "ds"
    d.mkdir(exist_ok=True)
    (d / "train.txt").write_text("a cat\na dog\n")
    (d / "test.txt").write_text("\n".join(test_rows) + "\n")
    return d


def cfg_of(seed=7, prompts=("a", "b"), split=None, path=None, ipp=1):
    e = SimpleNamespace(seed=seed, prompts=list(prompts), split=split, path=path, images_per_prompt=ipp)
    return SimpleNamespace(evaluation=e, prompts=SimpleNamespace(name="simple_animals", path=None))


def test_the_last_batch_is_padded_with_the_first_items_and_marked():
    plan = make_plan(cfg_of(prompts=[f"p{i}" for i in range(10)]), 4)
    assert plan.batches == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 1]]
    assert plan.real == [4, 4, 2]
    real = [i for b, n in zip(plan.batches, plan.real) for i in b[:n]]
    assert real == list(range(10))  # every item once once the padding is dropped
    assert all(len(b) == 4 for b in plan.batches)  # one shape: one compiled graph


def test_repeated_rows_and_images_per_prompt_are_image_indices_of_one_prompt(tmp_path):
    rows = ["a cat", "a dog", "a cat", "a cat"]  # flow_grpo's geneval test split repeats each prompt 4 times
    (tmp_path / "test.txt").write_text("\n".join(rows) + "\n")
    cfg = cfg_of(split="test", path=str(tmp_path), ipp=2)
    plan = make_plan(cfg, 8)
    assert [(it.prompt, it.index) for it in plan.items] == [("a cat", i) for i in range(6)] + [("a dog", 0),
                                                                                           ("a dog", 1)]
    assert plan.num_prompts == 2 and plan.num_images == 8 and plan.source == str(tmp_path / "test.txt")
    assert len({it.seed for it in plan.items}) == 8


def test_an_images_seed_is_its_prompts_and_index_whatever_the_batch():
    a = make_plan(cfg_of(prompts=["x", "y", "z"]), 2)
    b = make_plan(cfg_of(prompts=["z", "y"]), 8)  # another order, other batch size: the same seeds per prompt
    seeds = lambda p: {it.prompt: it.seed for it in p.items}
    assert seeds(a)["z"] == seeds(b)["z"] and seeds(a)["y"] == seeds(b)["y"]
    assert image_seed(7, "z", 0) != image_seed(7, "z", 1) != image_seed(8, "z", 1)
    assert prompt_key("z") == prompt_key("z") and prompt_key("z") != prompt_key("Z")
    assert all(0 <= it.seed < 2**63 for it in a.items)


def test_fixed_prompts_get_their_metadata_from_the_training_source():
    plan = make_plan(cfg_of(prompts=["a", "b"]), 4, metadata_of=lambda ps: [{"tag": p} for p in ps])
    assert [it.metadata for it in plan.items] == [{"tag": "a"}, {"tag": "b"}]


@pytest.mark.parametrize("overrides, key", [
    (["evaluation.split=test"], "evaluation.split"),  # a split of no dataset
    (["evaluation.path=/nonexistent/ds"], "evaluation.path"),  # a path without a split
    (["evaluation.split=test", "evaluation.path=/nonexistent/ds"], "evaluation.path"),
    (["evaluation.images_per_prompt=0"], "evaluation.images_per_prompt"),
    (["evaluation.batch_size=0"], "evaluation.batch_size"),
    (["evaluation.rewards=[{name: no_such_reward}]"], "evaluation.rewards"),
    # a panel reward's own prompt checks, on the prompts it scores (the digits reward needs a digit in each)
    (["evaluation.rewards=[{name: jpeg_compressibility}, {name: digit_classifier, target: null}]"],
     "evaluation.rewards.1.target"),
])
def test_bad_evaluation_keys_are_refused_naming_the_key(overrides, key):
    with pytest.raises(ConfigError) as e:
        compose_and_validate(["+experiment=smoke", "evaluation.every_n_epochs=1", *overrides])
    assert key in str(e.value)


def test_evaluation_keys_with_evaluation_off_are_refused():
    with pytest.raises(ConfigError) as e:
        compose_and_validate(["+experiment=smoke", "evaluation.split=test"])
    assert "evaluation.split" in str(e.value) and "evaluation.every_n_epochs" in str(e.value)


def test_a_split_of_the_training_dataset_and_a_panel_compose(tmp_path):
    d = dataset(tmp_path)
    v = compose_and_validate(["+experiment=smoke", "evaluation.every_n_epochs=1", "prompts=dataset",
                              f"prompts.path={d}", "evaluation.split=test", "evaluation.batch_size=4",
                              "evaluation.guidance_scale=3.0",
                              "evaluation.rewards=[{name: jpeg_compressibility}, {name: jpeg_incompressibility}]"])
    assert [r.name for r in v.cfg.evaluation.rewards] == ["jpeg_compressibility", "jpeg_incompressibility"]
    plan = make_plan(v.cfg, 4)
    assert [it.prompt for it in plan.items] == TEST_PROMPTS and plan.real == [4, 4, 2]


def test_panel_labels_and_summary():
    from ddpo_tpu.training.evaluation import panel_labels, summarise

    assert panel_labels(["a", "b", "a", "a"]) == ["a", "b", "a_2", "a_3"]
    s = summarise({"r": np.array([1.0, 3.0, np.nan])}, {"r": {"ocr": np.array([1.0, np.nan, 0.0])}})
    assert s["rewards"]["r"] == {"mean": 2.0, "std": 1.0, "min": 1.0, "max": 3.0, "n": 2}
    assert s["extras"]["ocr"] == {"mean": 0.5, "n": 2}  # over the images it applies to; one reward: its own names
    two = summarise({"r": np.ones(3), "q": np.zeros(3)}, {"r": {"ocr": np.array([1.0, np.nan, 0.0])}, "q": {}})
    assert set(two["extras"]) == {"r/ocr"}  # a panel: each extra under its reward's label
    # GenEval's summary: each task's (tag's) accuracy and their mean (not the mean over images)
    g = summarise({"geneval": np.array([1.0, 0.0, 0.0, 1.0, 1.0])}, {"geneval": {}},
                  ["counting", "counting", "counting", "colors", None])
    assert g["by_tag"]["colors"] == {"geneval": 1.0}
    assert g["by_tag"]["counting"]["geneval"] == pytest.approx(1 / 3)
    assert g["tag_mean"]["geneval"] == pytest.approx(2 / 3) and g["rewards"]["geneval"]["mean"] == 0.6
    assert "by_tag" not in summarise({"r": np.ones(2)}, {"r": {}}, [None, None])


def test_recorded_evaluations_are_not_due_again(tmp_path):
    """The evaluation before training, recorded by an attempt stopped before its first checkpoint, is kept by the
    resume's truncation (epochs <= -1) and must not run (and be recorded) a second time (issue 43)."""
    from ddpo_tpu.rundir import events as ev
    from ddpo_tpu.rundir.files import RunDir
    from ddpo_tpu.training.evaluation import evaluation_due

    out = RunDir(tmp_path)
    rt = SimpleNamespace(is_main=True, gather_rows=lambda a: a)
    t = SimpleNamespace(cfg=SimpleNamespace(num_epochs=5, evaluation=SimpleNamespace(every_n_epochs=2)), rt=rt,
                        out=out)
    assert evaluation_due(t, ev.BEFORE_TRAINING)
    assert [e for e in range(5) if evaluation_due(t, e)] == [1, 3, 4]  # every 2 epochs and the last
    out.log({"kind": "eval", "epoch": ev.BEFORE_TRAINING, "global_step": 0, "reward_mean": 0.0})
    out.truncate_after_epoch(-1)  # what a resume without a checkpoint does
    assert not evaluation_due(t, ev.BEFORE_TRAINING)
    assert evaluation_due(t, 1)


def test_captioned_grid(tmp_path):
    from PIL import Image

    from ddpo_tpu.rundir.files import save_captioned_grid

    images = np.random.default_rng(0).integers(0, 255, (6, 16, 16, 3), dtype=np.uint8)
    out = save_captioned_grid(tmp_path / "g.png", images, [f"prompt {i}\nr: {i}" for i in range(6)],
                              [{"prompt": f"prompt {i}"} for i in range(6)], cols=4, tile=64)
    img = np.asarray(Image.open(out))
    assert img.shape == (2 * (64 + 2 * 12 + 6), 4 * 64, 3)  # two caption lines under each row of images
    assert np.array_equal(img[:64, :64], np.repeat(np.repeat(images[0], 4, 0), 4, 1))  # the image, scaled
    strip = img[64:64 + 30, :64]
    assert (strip < 128).any()  # a caption is drawn under it
    assert json.loads(out.with_suffix(".json").read_text())[5] == {"prompt": "prompt 5"}


def test_ddpo_eval_is_a_console_script():
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["ddpo-eval"] == "ddpo_tpu.eval:main"


def _eval(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ddpo_tpu.eval", *args], cwd=cwd, env=clean_env(),
                          capture_output=True, text=True, timeout=120)


def _eval_in_process(args: list[str], cwd: Path, monkeypatch, capsys) -> SimpleNamespace:
    """ddpo-eval's main(argv) in this process (what `python -m ddpo_tpu.eval` runs): a process-like result."""
    from ddpo_tpu import eval as ddpo_eval

    monkeypatch.chdir(cwd)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        ddpo_eval.main(list(args))
    out = capsys.readouterr()
    return SimpleNamespace(returncode=e.value.code, stdout=out.out, stderr=out.err)


def test_ddpo_eval_refuses_bad_input_in_one_line_without_torch(tmp_path, monkeypatch, capsys):
    """The first bad input in a real process (what proves the exit code and the console); the others call ddpo-eval's
    main() in this process (the same refusal path, where only the process start differs). The config refusal runs in
    a real process too: only a fresh interpreter can show that torch was not imported."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text("run_name: x\n")
    (tmp_path / "w.bin").write_text("x")
    cases = [([str(tmp_path / "missing")], "no such run dir"),
             ([str(tmp_path)], "neither a run dir"),
             ([str(run)], "no complete checkpoint"),
             ([str(tmp_path / "w.bin")], "not a run's weights file"),
             ([str(run), str(run)], "a second target"),
             ([str(run), "--bogus"], "unknown option")]
    for i, (args, said) in enumerate(cases):
        p = _eval(args, tmp_path) if i == 0 else _eval_in_process(args, tmp_path, monkeypatch, capsys)
        assert p.returncode == 2, (args, p.stderr)
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("ddpo-eval: error: ") and said in lines[0], (args, p.stderr)
    # the config is checked as the trainer checks it, before anything starts (the run's config plus the overrides)
    probe = ("import sys, runpy; sys.argv=['ddpo_tpu.eval', sys.argv[1], '--base', 'evaluation.num_steps=0']\n"
             "try:\n    runpy.run_module('ddpo_tpu.eval', run_name='__main__')\n"
             "except SystemExit as e:\n    print('torch' in sys.modules, e.code)\n")
    v = compose_and_validate(["+experiment=smoke"])
    from omegaconf import OmegaConf

    OmegaConf.save(OmegaConf.create(v.tree), run / "config.yaml")
    p = subprocess.run([sys.executable, "-c", probe, str(run)], cwd=tmp_path, env=clean_env(), capture_output=True,
                       text=True, timeout=120)
    assert p.stdout.split() == ["False", "2"], p.stdout + p.stderr
    assert "evaluation.num_steps=0" in p.stderr and len(p.stderr.strip().splitlines()) == 1
    assert not (run / "eval").exists()  # refused before anything was written


def test_ddpo_status_shows_every_finished_evaluation_side_by_side(tmp_path):
    """Training's evaluations and ddpo-eval's (two checkpoints, the base model) in one table, by epoch; one without
    its summary.json (still being written) is not shown."""
    import io

    from rich.console import Console

    from ddpo_tpu.status.facts import eval_table
    from ddpo_tpu.status.read import read_evaluations
    from ddpo_tpu.status.render import _render_evaluations

    def write(name, epoch, mean, n=10):
        d = tmp_path / "eval" / name
        d.mkdir(parents=True)
        (d / "summary.json").write_text(json.dumps({"epoch": epoch, "global_step": max(epoch, 0) * 2,
                                                    "num_images": n, "rewards": {"aesthetic": {
                                                        "mean": mean, "std": 0.5}}}))
    write("checkpoint_epoch_0009", 9, 6.25)
    write("base", -1, 5.0)
    write("checkpoint_epoch_0004", 4, 5.75)
    (tmp_path / "eval" / "epoch_0010").mkdir()  # unfinished
    rows = eval_table(read_evaluations(tmp_path / "eval"))
    assert [(r.name, r.epoch, r.rewards["aesthetic"][0]) for r in rows] == [
        ("base", -1, 5.0), ("checkpoint_epoch_0004", 4, 5.75), ("checkpoint_epoch_0009", 9, 6.25)]
    out = io.StringIO()
    _render_evaluations(SimpleNamespace(evaluations=rows), Console(file=out, width=120))
    text = out.getvalue()
    assert "6.2500 ± 0.5000" in text and "checkpoint_epoch_0004" in text and "epoch_0010" not in text


def test_ddpo_epochs_report_the_zero_std_group_share():
    """flow_grpo's calculate_zero_std_ratio (yifan123/flow_grpo@ac4c86e scripts/train_sd3.py): the share of prompt
    groups whose rewards are all equal; non-finite rewards left out, as the algorithms leave them out."""
    from ddpo_tpu.training.reporting import prompt_zero_std_ratio

    r = np.array([1.0, 1.0, 2.0, 3.0, 5.0, np.nan])
    assert prompt_zero_std_ratio(r, ["a", "a", "b", "b", "c", "c"]) == pytest.approx(2 / 3)  # a and c (one value)
    assert prompt_zero_std_ratio(r, ["a"] * 5) is None


def _evaluated_images(tmp_path: Path, model_cache: Path, *extra: str) -> tuple[np.ndarray, object]:
    """The images of one evaluation pass of a freshly built Trainer (the tiny SD1, 2 steps) and the trainer."""
    from ddpo_tpu.rundir.files import RunDir
    from ddpo_tpu.runtime import make_runtime
    from ddpo_tpu.training import loop

    v = compose_and_validate(["+experiment=smoke", f"model.cache_dir={model_cache}", "sample.num_steps=2",
                              "evaluation.every_n_epochs=1", "reward.host_workers=0", "evaluation.batch_size=2",
                              "evaluation.prompts=[a cat, a dog, an owl]", *extra])
    tmp_path.mkdir(parents=True)
    t = loop.Trainer(v.cfg, make_runtime(v.cfg), RunDir(tmp_path), tree=v.tree, stop=SimpleNamespace(requested=False))
    t.report.tracker = SimpleNamespace(log=lambda *a, **k: None)
    seen = []
    t.reward = lambda images, prompts: (seen.append(images), np.zeros(len(prompts)))[1]
    rec = t.evaluate(0)
    assert rec["num_images"] == 3 and len(seen) == 2  # 3 prompts in batches of 2: the last one padded
    return np.concatenate(seen)[:3], t


def test_evaluation_samples_with_its_own_guidance_scale(tmp_path, model_cache):
    """evaluation.guidance_scale gives evaluation a step of its own, traced with that scale; the family's config is
    the run's again afterwards (training samples with sample.guidance_scale)."""
    same, t0 = _evaluated_images(tmp_path / "a", model_cache)
    assert t0.evaluator.step is t0.denoise_step  # nothing differs from sampling: its graph
    other, t1 = _evaluated_images(tmp_path / "b", model_cache, "evaluation.guidance_scale=1.0")
    assert t1.evaluator.step is not t1.denoise_step and t1.evaluator.view.sample.guidance_scale == 1.0
    assert t1.family.cfg.sample.guidance_scale == t1.cfg.sample.guidance_scale == 5.0
    assert not np.array_equal(same, other)
    # the same scale given explicitly: the same images as the default (the per-image seeds do not depend on it)
    again, _ = _evaluated_images(tmp_path / "c", model_cache, "evaluation.guidance_scale=5.0")
    assert np.array_equal(same, again)
    files = sorted(p.name for p in (tmp_path / "a" / "eval" / "epoch_0000" / "images").iterdir())
    assert files == ["00000.png", "00001.png", "00002.png"]
