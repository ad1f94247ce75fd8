"""prompts=dataset: flow_grpo's and NVlabs/DiffusionNFT's dataset folders read as they ship them, each prompt's
metadata handed to the reward by the loop, and the reward's extras logged per epoch.

The layouts and the rows are the references': yifan123/flow_grpo@ac4c86e8cae021841f1fde853d340e0db67690dd
scripts/train_sd3.py:41-76 (TextPromptDataset reads `<dataset>/<split>.txt`, one stripped line a prompt, metadata {};
GenevalPromptDataset reads `<dataset>/<split>_metadata.jsonl`, one JSON row a prompt, the row as its metadata) and
NVlabs/DiffusionNFT@24af5554898d85e93efa492f42b5e9cdf4156e9b scripts/train_nft_sd3.py:79-115 (the same). The fixtures
under tests/data/flow_grpo/ are verbatim lines of flow_grpo's dataset/geneval and dataset/ocr files
(tests/data/flow_grpo/README.md lists which). Expected metadata is computed here from the fixture files with json, as
the references' readers take it (the row), minus the prompt (which the reward gets as `prompts`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from ddpo_tpu.config.compose import ConfigError, compose_and_validate
from ddpo_tpu.prompts import DatasetSource, PromptError, make_prompt_source
from ddpo_tpu.rundir import events as ev
from tests.helpers import compose_and_validate_shared

DATA = Path(__file__).parents[2] / "data" / "flow_grpo"
GENEVAL, OCR = DATA / "geneval", DATA / "ocr"


def reference_rows(file: Path) -> list[tuple[str, dict]]:
    """(prompt, metadata) per row as the references read the file: a .txt line stripped with metadata {}; a JSONL
    row's "prompt" and the rest of the row."""
    if file.suffix == ".txt":
        return [(line.strip(), {}) for line in file.read_text(encoding="utf-8").splitlines() if line.strip()]
    rows = [json.loads(line) for line in file.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [(r["prompt"], {k: v for k, v in r.items() if k != "prompt"}) for r in rows]


# --- the reader ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("folder,split,file", [(GENEVAL, "train", "train_metadata.jsonl"),
                                               (GENEVAL, "test", "test_metadata.jsonl"),
                                               (OCR, "train", "train.txt"), (OCR, "test", "test.txt")])
def test_a_dataset_folder_reads_its_split_file_with_each_prompts_metadata(folder, split, file):
    source = make_prompt_source("dataset", path=str(folder), split=split)
    assert isinstance(source, DatasetSource) and source.file == folder / file
    rows = reference_rows(folder / file)
    assert list(source.parts[0]) == [p for p, _ in rows]  # every row, in file order (repeats kept as rows)
    assert source.metadata([p for p, _ in rows]) == [m for _, m in rows]


def test_geneval_rows_carry_tag_include_exclude_and_repeated_rows_stay_rows():
    source = make_prompt_source("dataset", path=str(GENEVAL), split="test")
    assert source.size == 12 and source.num_prompts == 6  # each prompt twice, as the reference repeats them
    meta = dict(zip(source.parts[0], source.metadata(source.parts[0])))
    assert meta["a photo of two wine glasses"] == {"tag": "counting", "include": [{"class": "wine glass", "count": 2}],
                                                   "exclude": [{"class": "wine glass", "count": 3}]}
    assert meta["a photo of a bowl"] == {"tag": "single_object", "include": [{"class": "bowl", "count": 1}]}
    assert {m["tag"] for m in meta.values()} == {"counting", "color_attr", "single_object", "position", "two_object",
                                                 "colors"}
    assert source.metadata(["not in the dataset"]) == [{}]  # an evaluation prompt of the config


def test_the_ocr_prompts_carry_their_quoted_text_and_no_metadata():
    source = make_prompt_source("dataset", path=str(OCR / "train.txt"))  # a file path works as the folder does
    assert all('"' in p for p in source.parts[0])  # flow_grpo's OCR reward reads the text between the quotes
    assert source.metadata(source.parts[0][:3]) == [{}, {}, {}]


def test_a_plain_jsonl_file_gives_any_fields_besides_the_prompt(tmp_path):
    f = tmp_path / "mixed.jsonl"
    f.write_text('{"prompt": "a sign that reads \\"OPEN\\"", "text": "OPEN", "weight": 2}\n\n'
                 '{"prompt": "a photo of a cat", "tag": "single_object", "include": [{"class": "cat", "count": 1}]}\n')
    source = make_prompt_source("dataset", path=str(f))
    assert source.parts[0] == ('a sign that reads "OPEN"', "a photo of a cat")
    assert source.metadata(['a sign that reads "OPEN"', "a photo of a cat"]) == [
        {"text": "OPEN", "weight": 2}, {"tag": "single_object", "include": [{"class": "cat", "count": 1}]}]


def test_metadata_is_a_copy_a_reward_cannot_change_the_dataset():
    source = make_prompt_source("dataset", path=str(GENEVAL), split="test")
    first = source.metadata(["a photo of a bowl"])[0]
    first["include"].append("edited")
    assert source.metadata(["a photo of a bowl"])[0]["include"] == [{"class": "bowl", "count": 1}]


def test_sampling_draws_rows_reproducibly_and_sample_distinct_draws_distinct_rows():
    source = make_prompt_source("dataset", path=str(GENEVAL), split="test")
    a = source.sample_distinct(8, np.random.default_rng(7))
    assert a == source.sample_distinct(8, np.random.default_rng(7))
    assert a != source.sample_distinct(8, np.random.default_rng(8))
    # all 12 rows: each of the 6 prompts exactly as often as its rows (twice), as randperm(len(dataset)) would
    every = source.sample_distinct(12, np.random.default_rng(0))
    assert sorted(every) == sorted(source.parts[0])
    with pytest.raises(ValueError, match="12 prompts, fewer than the 13"):
        source.sample_distinct(13, np.random.default_rng(0))


def test_grpo_groups_of_a_dataset_share_a_prompt_and_its_metadata():
    from ddpo_tpu.algorithms.grpo import GRPO

    cfg = compose_and_validate(["+experiment=flow_grpo_smoke", "prompts=dataset", f"prompts.path={GENEVAL}"]).cfg
    source = make_prompt_source("dataset", path=str(GENEVAL))
    batches = GRPO(cfg).epoch_prompts(source, 2, 16, np.random.default_rng(3))
    for batch in batches:
        assert all(batch.count(p) % 4 == 0 for p in batch)  # whole groups of group_size=4 in each batch
    rows = dict(reference_rows(GENEVAL / "train_metadata.jsonl"))
    flat = [p for b in batches for p in b]
    assert source.metadata(flat) == [rows[p] for p in flat]


# --- refusals at compose time: one line, the key, the reason, the fix --------------------------------------------

def refusal(*overrides: str) -> str:
    """The one prompts.* problem of these overrides; the composition shares its group choices'
    (tests.helpers.compose_and_validate_shared: the same config, tests/unit/config/test_config.py holds them equal)."""
    with pytest.raises(ConfigError) as e:
        compose_and_validate_shared(["+experiment=flow_grpo_smoke", "prompts=dataset", *overrides])
    found = [str(p) for p in e.value.problems if p.key.startswith("prompts.")]
    assert len(found) == 1 and "\n" not in found[0], e.value.render()
    return found[0]


def test_bad_datasets_are_refused_in_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "train.txt").write_text("\n  \n")
    (tmp_path / "only_test").mkdir()
    (tmp_path / "only_test" / "test.txt").write_text("a cat\n")
    (tmp_path / "both").mkdir()
    (tmp_path / "both" / "train.txt").write_text("a cat\n")
    (tmp_path / "both" / "train_metadata.jsonl").write_text('{"prompt": "a cat"}\n')
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a cat"}\n{"prompt": "a dog",\n')
    (tmp_path / "noprompt.jsonl").write_text('{"prompt": "a cat"}\n\n{"text": "OPEN"}\n')
    (tmp_path / "list.jsonl").write_text('["a cat"]\n')
    (tmp_path / "clash.jsonl").write_text('{"prompt": "a cat", "tag": "single_object"}\n{"prompt": "a dog"}\n'
                                          '{"prompt": "a cat", "tag": "counting"}\n')
    (tmp_path / "prompts.csv").write_text("a cat\n")
    (tmp_path / "binary.txt").write_bytes(b"\xff\xfe\x00a")

    line = refusal()
    assert line.startswith("prompts.path=???") and "prompts.path=" in line  # required
    line = refusal(f"prompts.path={tmp_path}/nowhere")
    assert line.startswith(f"prompts.path={tmp_path}/nowhere: no such folder or file")
    assert "empty" in refusal(f"prompts.path={tmp_path}/empty")
    line = refusal(f"prompts.path={tmp_path}/only_test")
    assert "no train.txt or train_metadata.jsonl" in line and "test.txt" in line and "prompts.split" in line
    line = refusal(f"prompts.path={tmp_path}/both")
    assert "both train_metadata.jsonl and train.txt" in line and f"prompts.path={tmp_path}/both/train.txt" in line
    line = refusal(f"prompts.path={tmp_path}/bad.jsonl")
    assert f"{tmp_path}/bad.jsonl:2: invalid JSON" in line and "(one JSON object per line" in line
    assert f"{tmp_path}/noprompt.jsonl:3: no \"prompt\" field" in refusal(f"prompts.path={tmp_path}/noprompt.jsonl")
    assert "list.jsonl:1: a JSON list, not an object" in refusal(f"prompts.path={tmp_path}/list.jsonl")
    line = refusal(f"prompts.path={tmp_path}/clash.jsonl")
    assert f"{tmp_path}/clash.jsonl:1 and line 3" in line and "'a cat' different metadata" in line
    assert "not a prompt dataset" in refusal(f"prompts.path={tmp_path}/prompts.csv")
    assert "not UTF-8" in refusal(f"prompts.path={tmp_path}/binary.txt")
    assert refusal(f"prompts.path={GENEVAL}", "prompts.split=val").startswith("prompts.split=val")
    # the dataset's key elsewhere, and another source's key here
    with pytest.raises(ConfigError) as e:
        compose_and_validate(["+experiment=flow_grpo_smoke", f"prompts.path={GENEVAL}"])
    assert "only used with prompts.name=dataset" in str(e.value)
    assert "only used with prompts.name=from_file" in refusal(f"prompts.path={GENEVAL}", "prompts.file=x.txt")


def test_a_good_dataset_composes():
    cfg = compose_and_validate(["+experiment=flow_grpo_smoke", "prompts=dataset", f"prompts.path={GENEVAL}",
                                "prompts.split=test"]).cfg
    assert (cfg.prompts.name, cfg.prompts.path, cfg.prompts.split) == ("dataset", str(GENEVAL), "test")


def test_reader_errors_name_their_key():
    with pytest.raises(PromptError) as e:
        make_prompt_source("dataset", path=None)
    assert e.value.key == "prompts.path"


# --- extras: gathered, averaged where they apply, on the console line --------------------------------------------

def test_extras_are_gathered_per_batch_and_averaged_where_they_apply():
    from ddpo_tpu.rewards.base import RewardScores
    from ddpo_tpu.training.epoch_data import extras_means, gather_extras

    rt = SimpleNamespace(gather_rows=lambda a: a)
    a = RewardScores(np.zeros(2, np.float32), {"x": np.array([1.0, np.nan]), "y": np.array([np.nan, np.nan])})
    b = RewardScores(np.zeros(3, np.float32), {"x": np.array([3.0, 5.0, np.nan])})  # no y: NaN there
    got = gather_extras(rt, [a, b])
    assert list(got) == ["x", "y"] and got["x"].shape == (5,) and np.isnan(got["y"]).all()
    assert extras_means(got) == {"x": 3.0, "y": None}
    assert gather_extras(rt, [RewardScores(np.zeros(2))]) == {} and extras_means(None) == {}


def test_the_epoch_line_shows_the_first_extras():
    done = ev.EpochDone(2, 0.5, 0.1, 1e-3, 0.25, 2, {}, {"pickscore": 0.22, "ocr": None, "aesthetic": 5.5, "hps": 0.3})
    assert "reward 0.5000 +- 0.1000 (pickscore 0.2200, ocr n/a, aesthetic 5.5000, +1 more), approx_kl" in done.text()
    assert ev.parse(done.record()) == done
    plain = ev.EpochDone(2, 0.5, 0.1, 1e-3, 0.25, 2)
    assert "reward 0.5000 +- 0.1000, approx_kl" in plain.text()


# --- the loop: each image's metadata is its prompt's; extras in metrics.jsonl ---------------------------------------

SMALL = ["+experiment=flow_grpo_smoke", "num_epochs=1", "sample.batch_size=8", "sample.num_batches_per_epoch=2",
         "train.batch_size=8", "train.gradient_accumulation_steps=2", "algorithm.group_size=4", "sample.num_steps=3",
         "prompts=dataset", f"prompts.path={GENEVAL}"]


@pytest.mark.parametrize("host_workers", [0, 2])  # inline, and in the thread pool while the next batch samples
def test_the_loop_hands_each_image_its_prompts_metadata_and_logs_extras(tmp_path, model_cache, host_workers):
    from ddpo_tpu.rundir.files import RunDir
    from ddpo_tpu.runtime import make_runtime
    from ddpo_tpu.training import loop
    from tests.helpers import read_metrics
    from tests.helpers.metadata_reward import MetadataRecorder

    # evaluation prompts are looked up in the dataset too: a train row (counting), and one of the test split only ({})
    evals = ["a photo of four stop signs", "a photo of a bowl"]
    v = compose_and_validate([*SMALL, f"model.cache_dir={model_cache}", f"reward.host_workers={host_workers}",
                              "evaluation.every_n_epochs=1", f"evaluation.prompts=[{','.join(evals)}]"])
    tr = loop.Trainer(v.cfg, make_runtime(v.cfg), RunDir(tmp_path), tree=v.tree, stop=SimpleNamespace(requested=False))
    tr.reward = recorder = MetadataRecorder()
    tr.fit()

    every = dict(reference_rows(GENEVAL / "train_metadata.jsonl"))  # prompts.split=train
    assert evals[0] in every and evals[1] not in every
    assert len(recorder.calls) == 1 + 2 + 1  # evaluation before training, 2 sampling batches, evaluation after
    for prompts, metadata, _ in recorder.calls:
        assert metadata == [every.get(p, {}) for p in prompts]  # image i's metadata is its prompt's row
    train = [c for c in recorder.calls if set(c[0]) - set(evals)]
    assert len(train) == 2 and all(m for c in train for m in c[1])  # every training row carries its metadata
    before = dict(zip(*recorder.calls[0][:2]))  # the evaluation before training: its prompts' rows, or {}
    assert before == {evals[0]: every[evals[0]], evals[1]: {}}

    epoch = read_metrics(tmp_path, "epoch")[0]
    values = np.concatenate([c[2] for c in train]).astype(np.float64)
    counting = np.array([m["tag"] == "counting" for c in train for m in c[1]])
    assert math.isclose(epoch["reward_mean"], values.mean(), rel_tol=1e-6)
    extras = epoch["reward_extras"]
    assert math.isclose(extras["brightness"], 2 * values.mean(), rel_tol=1e-6)
    if counting.any():
        assert math.isclose(extras["counting_brightness"], values[counting].mean(), rel_tol=1e-6)
    else:
        assert extras["counting_brightness"] is None
    assert extras["never"] is None  # applied to no image: null, not NaN
    last = read_metrics(tmp_path, "eval")[-1]
    assert last["reward_extras"]["counting_brightness"] is not None  # "four stop signs" is a counting prompt
    done = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()
            if '"epoch_done"' in line]
    assert done[-1]["extras"] == extras


@pytest.mark.slow  # the real launcher: a process of its own (~40 s on 2 busy cores)
def test_the_launcher_trains_on_an_ocr_dataset_and_logs_a_weighted_rewards_components(tmp_path, model_cache):
    """`+experiment=flow_grpo_smoke prompts=dataset prompts.path=<flow_grpo's ocr folder>` end to end with
    reward=weighted: each component's unweighted epoch mean is logged (issue 38 item 4) and they make up the
    weighted mean."""
    from tests.helpers import read_metrics, run_train

    components = "reward.components=[{name:jpeg_compressibility,weight:0.5},{name:jpeg_incompressibility,weight:2.0}]"
    proc = run_train([*SMALL[:-1], f"prompts.path={OCR}", "reward=weighted", components,
                      f"model.cache_dir={model_cache}"], tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    epoch = read_metrics(tmp_path / "outputs" / "flow_grpo_smoke", "epoch")[0]
    extras = epoch["reward_extras"]
    assert set(extras) == {"jpeg_compressibility", "jpeg_incompressibility"}
    want = 0.5 * extras["jpeg_compressibility"] + 2.0 * extras["jpeg_incompressibility"]
    assert math.isclose(epoch["reward_mean"], want, rel_tol=1e-5), (epoch["reward_mean"], want)
    line = next(x for x in proc.stdout.splitlines() if x.startswith("[epoch 0] done:"))
    assert f"(jpeg_compressibility {extras['jpeg_compressibility']:.4f}, jpeg_incompressibility " in line
