"""What an evaluation samples, decided before any model loads: the prompts (a fixed list, or every row of a dataset
split), how many images of each, the seed of each image, and the fixed-size batches they are drawn in. Standard
library and numpy only: the front end's compose-time checks and `ddpo-eval` import it without torch.

The whole pass (issue 39, items 1-2):

- items: each distinct prompt, in the order it first appears, with `images_per_prompt` images for each row that
  holds it. flow_grpo's geneval test split lists each of its 553 prompts 4 times (2212 rows) and evaluates every row
  once (yifan123/flow_grpo@ac4c86e8cae021841f1fde853d340e0db67690dd scripts/train_sd3.py:217-313, its test loader
  over the whole dataset); here those 4 rows are image indices 0-3 of one prompt, so `images_per_prompt=1` is that
  pass, and a prompt file of 553 distinct lines with `images_per_prompt=4` is the same pass.
- seeds: image i of prompt p is drawn from its own generator seeded by (evaluation.seed, sha256(p), i): the same
  image for the same prompt and weights whichever process, batch or row draws it (Flow-Factory seeds each prompt's
  generator from the prompt; the references' evaluations otherwise depend on the process count).
- batches: fixed-size global batches (one compiled graph on XLA); the last one is padded with the first items again,
  as torch's DistributedSampler pads the dataset flow_grpo's accelerate test loader shards, and the padding's
  results are dropped after the gather, so no image is counted twice.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ddpo_tpu.random_streams import EVALUATION


@dataclass(frozen=True)
class EvalItem:
    prompt: str
    metadata: dict[str, Any]
    index: int      # the image's index among its prompt's images
    seed: int       # its noise generator's seed


@dataclass
class EvalPlan:
    items: list[EvalItem]
    global_batch: int
    source: str                     # where the prompts came from: "evaluation.prompts" or the dataset file
    num_prompts: int = 0
    batches: list[list[int]] = field(default_factory=list)  # item indices of each batch, padding included
    real: list[int] = field(default_factory=list)           # per batch: how many of its rows are real items

    @property
    def num_images(self) -> int:
        return len(self.items)


def prompt_key(prompt: str) -> int:
    """A stable integer of the prompt's text (the first 8 bytes of its UTF-8 sha256): Python's hash() is salted per
    process."""
    return int.from_bytes(hashlib.sha256(prompt.encode("utf-8")).digest()[:8], "little")


def image_seed(seed: int, prompt: str, index: int) -> int:
    """The noise seed of image `index` of `prompt` under evaluation.seed (a 63-bit torch generator seed)."""
    return int(np.random.SeedSequence([seed, EVALUATION, prompt_key(prompt), index])
               .generate_state(1, dtype=np.uint64)[0] >> 1)


def eval_source(cfg):
    """The evaluation's prompt source: the dataset split `evaluation.split` names (of `evaluation.path`, or of
    prompts.path when that is null), or None for the fixed `evaluation.prompts`. Raises PromptError naming the key."""
    from ddpo_tpu.prompts import PromptError, read_dataset

    e = cfg.evaluation
    if e.split is None:
        return None
    path = e.path if e.path is not None else (cfg.prompts.path if cfg.prompts.name == "dataset" else None)
    if path is None:
        raise PromptError("evaluation.split", e.split, "a split of which dataset? prompts is not a dataset and "
                          "evaluation.path is null", "set evaluation.path=DIR (a flow_grpo / DiffusionNFT dataset "
                          "folder or a .txt / .jsonl file), or use prompts=dataset")
    try:
        return read_dataset(path, e.split, "evaluation")
    except PromptError as err:  # the dataset reader names prompts.*; these are evaluation's keys
        key = "evaluation.split" if err.key == "prompts.split" else "evaluation.path"
        raise PromptError(key, err.value, err.reason, err.fix.replace("prompts.", "evaluation.")) from err


def make_plan(cfg, global_batch: int, source=None, metadata_of=None) -> EvalPlan:
    """The evaluation of this config in global batches of `global_batch`. `source`: eval_source(cfg) (read again when
    None); `metadata_of`: the metadata of a fixed prompt (the training prompt source's, {} when not a dataset row)."""
    e = cfg.evaluation
    if source is None:
        source = eval_source(cfg)
    if source is None:
        rows, where = list(e.prompts), "evaluation.prompts"
        metas = metadata_of(rows) if metadata_of is not None else [{} for _ in rows]
    else:
        rows, where = list(source.parts[0]), str(source.file)
        metas = source.metadata(rows)
    count: dict[str, int] = {}
    meta: dict[str, dict] = {}
    for p, m in zip(rows, metas):
        count[p] = count.get(p, 0) + 1
        meta.setdefault(p, m)
    items = [EvalItem(p, meta[p], i, image_seed(e.seed, p, i))
             for p in count for i in range(count[p] * e.images_per_prompt)]
    plan = EvalPlan(items, global_batch, where, num_prompts=len(count))
    n = len(items)
    for start in range(0, n, global_batch):
        idx = list(range(start, min(start + global_batch, n)))
        plan.real.append(len(idx))
        idx += [i % n for i in range(global_batch - len(idx))]  # pad with the first items again (dropped later)
        plan.batches.append(idx)
    return plan


def evaluation_problems(cfg) -> list:
    """Compose-time refusals of the evaluation block: a split without a dataset, a dataset that cannot be read."""
    from ddpo_tpu.problems import Problem
    from ddpo_tpu.prompts import PromptError

    e = cfg.evaluation
    if not e.every_n_epochs:
        return []
    problems = []
    if e.path is not None and e.split is None:
        problems.append(Problem("evaluation.path", e.path, "read only with evaluation.split",
                                "add evaluation.split=test (or train), or drop evaluation.path"))
    try:
        source = eval_source(cfg)
    except PromptError as err:
        problems.append(Problem(err.key, err.value, err.reason, err.fix))
        return problems
    # each panel reward's own checks (its files, its keys), and what it needs of the prompts it scores: the
    # evaluation's (catalog/rewards.py `problems=` / `prompt_problems=`, as for the run's reward)
    from ddpo_tpu.catalog import REWARDS
    from ddpo_tpu.config.components import reward_problems

    parts = source.parts if source is not None else (tuple(e.prompts),)
    for i, r in enumerate(e.rewards or []):
        key = f"evaluation.rewards.{i}"
        problems.extend(reward_problems(r, key))
        problems.extend(REWARDS.get(r.name).prompt_problems(r, key, parts, []))
    return problems
