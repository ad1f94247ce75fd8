"""Edit datasets (prompts/datasets.py, model.family=qwen_image_edit): flow_grpo's edit layout read as its
scripts/train_qwenimage_edit_plus.py reads it (yifan123/flow_grpo@9dcdc35b211205511f171a4f3566e40786575bc3,
class GenevalPromptImageDataset: ``<split>_metadata.jsonl`` rows with ``prompt``, ``ctrl_image``,
``ref_image``, ``sup_image`` paths under the dataset folder; the pipeline gets ``[ref, ctrl]``, pipeline_with_logprob in
qwenimage_edit_plus_pipeline_with_logprob.py), the pictures handed on in the metadata, and the refusals."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from ddpo_tpu.prompts import EditDatasetSource, PromptError, read_dataset


def _png(path, value):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((6, 8, 3), value, np.uint8)).save(path)


def _dataset(root, rows, split="train"):
    (root / f"{split}_metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def _row(i, **extra):
    return {"prompt": f"edit {i}", "ctrl_image": f"imgs/{i}_c.png", "ref_image": f"imgs/{i}_r.png",
            "sup_image": f"imgs/{i}_s.png", "tag": "x", **extra}


def test_reads_flow_grpos_edit_layout_with_the_reference_picture_first(tmp_path):
    for i in range(2):
        for k, v in (("c", 10), ("r", 200), ("s", 99)):
            _png(tmp_path / "imgs" / f"{i}_{k}.png", v + i)
    src = read_dataset(str(_dataset(tmp_path, [_row(0), _row(1)])), "train")
    assert isinstance(src, EditDatasetSource) and src.size == 2
    meta = src.metadata(["edit 1", "edit 0"])
    pics = meta[0]["source_images"]
    assert [p.shape for p in pics] == [(6, 8, 3)] * 2 and pics[0].dtype == np.uint8
    assert int(pics[0][0, 0, 0]) == 201 and int(pics[1][0, 0, 0]) == 11  # [ref, ctrl], sup unused
    assert meta[1]["tag"] == "x" and meta[1]["ref_image"] == "imgs/0_r.png"  # the row's other fields as they are


def test_an_image_field_names_the_pictures(tmp_path):
    _png(tmp_path / "a.png", 5)
    src = read_dataset(str(_dataset(tmp_path, [{"prompt": "p", "image": "a.png"}])), "train")
    assert [int(p[0, 0, 0]) for p in src.metadata(["p"])[0]["source_images"]] == [5]


def test_the_shipped_edit_dataset_is_found_by_name():
    src = read_dataset("edit_tiny", "train")
    assert isinstance(src, EditDatasetSource) and src.size == 8
    assert all(len(m["source_images"]) == 2 for m in src.metadata(list(src.parts[0])))


@pytest.mark.parametrize("rows, why", [
    ([_row(0), {"prompt": "plain"}], ":2: no input images"),
    ([_row(0), {"prompt": "one", "image": "imgs/0_r.png"}], ":2: 1 input images, the first row 2"),
    ([_row(0, ref_image="imgs/missing.png")], ":1: the picture 'imgs/missing.png' is not a file"),
])
def test_refusals_name_file_and_line(tmp_path, rows, why):
    for k in "crs":
        _png(tmp_path / "imgs" / f"0_{k}.png", 1)
    with pytest.raises(PromptError) as e:
        read_dataset(str(_dataset(tmp_path, rows)), "train")
    assert e.value.key == "prompts.path" and why in str(e.value)
