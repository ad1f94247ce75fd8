"""Prompt datasets as flow_grpo and NVlabs/DiffusionNFT ship them (`prompts=dataset`): each prompt with its row's
other fields (its metadata), which the loop hands to the reward (`reward(images, prompts, metadata=...)`).

What is read (yifan123/flow_grpo@ac4c86e8cae021841f1fde853d340e0db67690dd scripts/train_sd3.py:41-76,
TextPromptDataset and GenevalPromptDataset; NVlabs/DiffusionNFT@24af5554898d85e93efa492f42b5e9cdf4156e9b
scripts/train_nft_sd3.py:79-115, the same two classes; their `dataset/<name>/` folders: ocr, pickscore, drawbench,
geneval):

``prompts.path`` a folder
    ``<split>.txt`` (one prompt a line: ocr, pickscore, drawbench) or ``<split>_metadata.jsonl`` (one JSON object a
    line with a ``prompt`` field: geneval's ``tag``, ``include``, ``exclude``), ``<split>`` being ``prompts.split``
    (train | test). A folder holding both files for the split is refused: name the file to read.
``prompts.path`` a ``.txt`` or ``.jsonl`` file
    read as above; ``prompts.split`` chooses only among a folder's files.
``prompts.path`` a bare name that is no path here
    a dataset folder shipped in ``ddpo_tpu/prompts/assets/`` (``edit_tiny``: 8 edit rows over 32 x 32 PNGs, for
    tests and the edit smoke).

A prompt's metadata is its row minus ``prompt`` (the references hand the whole row, prompt included; the prompt is
the reward's ``prompts`` argument here); ``{}`` for a ``.txt`` line. Blank lines are skipped (the references keep
a blank line of a ``.txt`` as an empty prompt; none of their files has one).

One prompt text, one metadata: GRPO and the per-prompt trackers group samples by prompt text (flow_grpo keys its
stat tracker by the prompt too), so rows with the same text must mean the same task. Rows that repeat a prompt with
the same metadata are kept as rows (flow_grpo's geneval test_metadata.jsonl lists each of its 553 prompts 4 times:
2212 rows); the same text with different metadata is refused, naming the file and both lines. Sampling draws rows,
as the references' samplers draw dataset indices (``PromptSource.sample`` / ``sample_distinct``).

Edit datasets (model.family=qwen_image_edit): flow_grpo's edit layout as its scripts/train_qwenimage_edit_plus.py
(yifan123/flow_grpo@9dcdc35b211205511f171a4f3566e40786575bc3, class GenevalPromptImageDataset) reads it: a
``<split>_metadata.jsonl`` whose rows carry, beside ``prompt``, the image paths ``ref_image``, ``ctrl_image`` and
``sup_image`` relative to the dataset folder. Its sampler hands the pipeline ``[ref_image, ctrl_image]`` (in that
order: "Picture 1" is the reference) and the reward the reference; ``sup_image`` is read and never used. A row may
instead name its pictures in an ``image`` field (a path or a list of paths: the layout of that script's commented-out
first dataset class). A file whose rows name images is an edit dataset (``EditDatasetSource``): every row must name
them, the same number, and each file must exist (refused naming file:line). Each prompt's metadata then holds
``source_images``: its pictures as uint8 (H, W, 3) arrays, loaded (with PIL, on use) as stored; the model family
resizes them as its pipeline does and the rewards that take sources see them there (docs/rewards.md).

Standard library and numpy only (the config validation imports it; PIL only when an edit row's images are loaded).
"""

from __future__ import annotations

import copy
import json
import pathlib
from typing import Any, Mapping, Sequence

from ddpo_tpu.prompts.base import PromptError, PromptSource

SPLITS: tuple[str, ...] = ("train", "test")
SUFFIXES: tuple[str, ...] = (".txt", ".jsonl")


class DatasetSource(PromptSource):
    """A dataset's rows: a single list of prompts (so sampling and `sample_distinct` draw rows) and each prompt's
    metadata, looked up by prompt text (one metadata per text: the reader refuses a conflict)."""

    def __init__(self, name: str, rows: Sequence[tuple[str, Mapping[str, Any]]], file: pathlib.Path):
        super().__init__(name, [[p for p, _ in rows]])
        self.file = file
        self._metadata: dict[str, Mapping[str, Any]] = {}
        for prompt, meta in rows:
            self._metadata.setdefault(prompt, meta)

    def metadata(self, prompts: Sequence[str]) -> list[dict[str, Any]]:
        """Each prompt's row fields besides the prompt (a copy: a reward that edits its rows changes nothing here);
        {} for a prompt the dataset does not hold (an evaluation prompt of the config)."""
        return [copy.deepcopy(dict(self._metadata.get(p, {}))) for p in prompts]

    def __repr__(self) -> str:
        return f"DatasetSource(file={str(self.file)!r}, rows={self.size})"


# flow_grpo's edit rows: the pictures the pipeline gets, in its order (train_qwenimage_edit_plus.py; see the docstring)
EDIT_IMAGE_FIELDS: tuple[str, ...] = ("ref_image", "ctrl_image")
SOURCE_IMAGES = "source_images"  # the metadata field holding a row's pictures (uint8 arrays)


def row_image_paths(row: Mapping[str, Any]) -> list[str] | None:
    """The pictures a row names (paths as written), or None for a row that names none."""
    image = row.get("image")
    if image is not None:
        return [image] if isinstance(image, str) else list(image)
    named = [row[k] for k in EDIT_IMAGE_FIELDS if k in row]
    return named or None


class EditDatasetSource(DatasetSource):
    """An edit dataset: each prompt's metadata also holds its pictures, loaded from the folder of the file."""

    has_source_images = True

    def __init__(self, name: str, rows: Sequence[tuple[str, Mapping[str, Any]]], file: pathlib.Path):
        super().__init__(name, rows, file)
        self.folder = file.parent

    def image_paths(self, prompt: str) -> list[pathlib.Path]:
        return [self.folder / p for p in row_image_paths(self._metadata.get(prompt, {})) or []]

    def metadata(self, prompts: Sequence[str]) -> list[dict[str, Any]]:
        import numpy as np
        from PIL import Image

        rows = super().metadata(prompts)
        for prompt, row in zip(prompts, rows):
            paths = self.image_paths(prompt)
            if paths:
                row[SOURCE_IMAGES] = [np.asarray(Image.open(p).convert("RGB")) for p in paths]
        return rows

    def __repr__(self) -> str:
        return f"EditDatasetSource(file={str(self.file)!r}, rows={self.size})"


def _edit_rows_problem(file: pathlib.Path, rows: list[tuple[int, str, dict[str, Any]]], value: object) -> None:
    """Every row names the same number of pictures, each an existing file (paths relative to the file's folder)."""
    count = None
    for n, _, meta in rows:
        paths = row_image_paths(meta)
        where = f"{file}:{n}"
        if not paths:
            raise _fail(value, f"{where}: no input images, while other rows of this edit dataset name theirs",
                        f"give every row its pictures ({', '.join(EDIT_IMAGE_FIELDS)} or \"image\")")
        if count is None:
            count = len(paths)
        elif len(paths) != count:
            raise _fail(value, f"{where}: {len(paths)} input images, the first row {count} (a batch shares one "
                        "picture count)", "give every row the same number of pictures")
        for p in paths:
            if not isinstance(p, str) or not (file.parent / p).is_file():
                raise _fail(value, f"{where}: the picture {p!r} is not a file under {file.parent}",
                            "paths in an edit dataset are relative to its folder (flow_grpo's layout)")


def _fail(value: object, reason: str, fix: str) -> PromptError:
    return PromptError("prompts.path", value, reason, fix)


def resolve_dataset_file(path: str | None, split: str) -> pathlib.Path:
    """The file `prompts.path` and `prompts.split` name: the path itself, or the folder's split file."""
    if path is None or not str(path).strip():
        raise _fail(repr(path), "prompts=dataset needs a dataset folder or file",
                    "set prompts.path=DIR (flow_grpo's dataset/<name>/) or prompts.path=FILE.txt|FILE.jsonl")
    if split not in SPLITS:
        raise PromptError("prompts.split", split, "unknown split", f"use one of {', '.join(SPLITS)}")
    p = pathlib.Path(str(path)).expanduser()
    if not p.exists() and p.name == str(path):  # a bare name: a shipped dataset folder (assets/edit_tiny)
        from importlib import resources

        shipped = resources.files("ddpo_tpu.prompts").joinpath("assets").joinpath(str(path))
        if isinstance(shipped, pathlib.Path) and shipped.is_dir():
            p = shipped
    if p.is_dir():
        candidates = [p / f"{split}_metadata.jsonl", p / f"{split}.txt"]
        found = [c for c in candidates if c.is_file()]
        if len(found) == 2:
            raise _fail(path, f"the folder holds both {found[0].name} and {found[1].name} for split {split}",
                        f"name the one to read: prompts.path={found[0]} or prompts.path={found[1]}")
        if not found:
            held = sorted(c.name for c in p.iterdir() if c.is_file() and c.suffix in SUFFIXES)
            raise _fail(path, f"no {candidates[1].name} or {candidates[0].name} in the folder "
                        f"(it holds: {', '.join(held) or 'no .txt or .jsonl file'})",
                        "use the folder of a flow_grpo / DiffusionNFT dataset, another prompts.split "
                        f"({', '.join(SPLITS)}), or the path of a .txt / .jsonl file")
        return found[0]
    if p.is_file():
        if p.suffix not in SUFFIXES:
            raise _fail(path, f"a {p.suffix or 'suffix-less'} file: not a prompt dataset",
                        "give a .txt file (one prompt a line), a .jsonl file (one {\"prompt\": ...} object a "
                        "line) or a dataset folder")
        return p
    if p.exists():
        raise _fail(path, "neither a folder nor a regular file", "give a dataset folder or a .txt / .jsonl file")
    raise _fail(path, "no such folder or file", "give an existing dataset folder (flow_grpo's dataset/<name>/) "
                "or a .txt / .jsonl file")


def _lines(file: pathlib.Path, value: object) -> list[tuple[int, str]]:
    """(1-based line number, stripped line) of each non-blank line (stripped as the references strip a .txt line)."""
    try:
        with open(file, encoding="utf-8") as f:
            return [(i, s) for i, line in enumerate(f, 1) if (s := line.strip())]
    except UnicodeDecodeError as e:
        raise _fail(value, f"{file} is not UTF-8 text ({e.reason} at byte {e.start})",
                    "save the file as UTF-8") from e
    except OSError as e:
        raise _fail(value, f"{file} cannot be read ({e.strerror})", "check the path and its permissions") from e


def _jsonl_rows(file: pathlib.Path, value: object) -> list[tuple[int, str, dict[str, Any]]]:
    rows = []
    for n, line in _lines(file, value):
        where = f"{file}:{n}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise _fail(value, f"{where}: invalid JSON ({e.msg}, column {e.colno})",
                        "one JSON object per line, e.g. {\"prompt\": \"a photo of a cat\", \"tag\": \"single_object\"}"
                        ) from e
        if not isinstance(row, dict):
            raise _fail(value, f"{where}: a JSON {type(row).__name__}, not an object",
                        "one JSON object per line with a \"prompt\" field")
        prompt = row.get("prompt")
        if not isinstance(prompt, str) or not prompt.strip():
            got = "no \"prompt\" field" if "prompt" not in row else f"\"prompt\" is {json.dumps(prompt)[:40]}"
            raise _fail(value, f"{where}: {got}", "give every row a non-empty \"prompt\" string")
        rows.append((n, prompt, {k: v for k, v in row.items() if k != "prompt"}))
    return rows


def read_dataset(path: str | None, split: str = "train", name: str = "dataset") -> DatasetSource:
    """The rows of the dataset `prompts.path` / `prompts.split` name. Raises PromptError (key prompts.path or
    prompts.split) for a missing folder or split file, an empty file, invalid JSON, a row without a prompt, or one
    prompt text with two metadata."""
    file = resolve_dataset_file(path, split)
    if file.suffix == ".txt":
        rows = [(n, line, {}) for n, line in _lines(file, path)]
    else:
        rows = _jsonl_rows(file, path)
    if not rows:
        raise _fail(path, f"{file} is empty (no non-blank line)",
                    "one prompt a line (.txt) or one {\"prompt\": ...} object a line (.jsonl)")
    first: dict[str, tuple[int, dict[str, Any]]] = {}
    for n, prompt, meta in rows:
        seen = first.setdefault(prompt, (n, meta))
        if seen[1] != meta:
            raise _fail(path, f"{file}:{seen[0]} and line {n} give the prompt {prompt[:60]!r} different metadata, "
                        "and samples are grouped by prompt text (GRPO, per-prompt statistics)",
                        "make rows with one prompt text carry the same fields, or drop one of them")
    if any(row_image_paths(m) for _, _, m in rows):
        _edit_rows_problem(file, rows, path)
        return EditDatasetSource(name, [(p, m) for _, p, m in rows], file)
    return DatasetSource(name, [(p, m) for _, p, m in rows], file)
