"""Compose-time checks of the edit task (issue 40 item 3): an edit family's prompts must name their input pictures,
and its reward must see them (true CFG is the family's: each row's negative prompt is encoded with the row's
pictures, families/qwen_image_edit.py, so sample.guidance_scale is free). Its own module: it reads the reward catalog
(catalog/rewards.py), which imports catalog/reward_checks.py, so it cannot live there.

DDP is not refused (it was until 2026-11-29): its update differed from one process's because the last transformer
block's text-stream weights get no gradient and DDP's reducer then reduced nothing; the model now declares them and
DDP leaves them out (models/qwen_image.py ``unreached_modules``, runtime/distributed.py ``wrap_ddp``), measured equal
to one process (tests/e2e/test_distributed.py ``ddp_qwen_image_edit``)."""

from __future__ import annotations

from typing import Any

from ddpo_tpu.catalog.rewards import REWARDS
from ddpo_tpu.problems import Problem


def edit_family_problems(cfg: Any) -> list[Problem]:
    """model.family=qwen_image_edit (families/qwen_image_edit.py): its prompts must name their input pictures, its
    reward (or a reward=weighted component) must see them."""
    if cfg.model.family != "qwen_image_edit":
        return []
    problems: list[Problem] = []
    if cfg.prompts.name != "dataset":
        problems.append(Problem("prompts", cfg.prompts.name, "model.family=qwen_image_edit edits each prompt's input "
                                "pictures and these prompts name none", "set prompts=dataset prompts.path=DIR on an "
                                "edit dataset (flow_grpo's layout), e.g. prompts.path=edit_tiny"))
    r = cfg.reward
    names = [c.name for c in r.components] if r.name == "weighted" else [r.name]
    if not any(REWARDS.get(n).takes_sources for n in names):
        problems.append(Problem("reward.name", r.name, "model.family=qwen_image_edit makes edits, and this reward "
                                "cannot see the source pictures (an edit scored without them rewards any image)",
                                "use a reward that takes them, e.g. reward=edit_consistency (or as a reward=weighted "
                                "component)"))
    return problems
