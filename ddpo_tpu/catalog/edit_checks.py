"""Compose-time checks of the edit task (issue 40 item 3): an edit family's prompts must name their input pictures,
and its reward must see them (true CFG is the family's: each row's negative prompt is encoded with the row's
pictures, families/qwen_image_edit.py, so sample.guidance_scale is free). Its own module: it reads the reward catalog
(catalog/rewards.py), which imports catalog/reward_checks.py, so it cannot live there."""

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
    topo = cfg.tpu_topology
    if topo.spec.torchrun and topo.expected_processes > 1 and topo.mesh.fsdp == 1:
        # measured 2026-11-29 (tests/e2e/test_distributed.py's shrunk smoke, two gloo ranks against one eager process):
        # under DDP the same samples and rewards, re-scoring exact (approx_kl 0), but another update (grad norm
        # 0.00133 against 0.00104; the LoRA B weights 97% of the update apart); under FSDP2 the same update (2.8e-7
        # of it). Likely cause, not proven: LoRA weights a step leaves without a gradient, which DDP (without
        # find_unused_parameters) never reduces when no later forward checks. Refused rather than trained differently
        problems.append(Problem("tpu_topology.mesh.fsdp", topo.mesh.fsdp, "model.family=qwen_image_edit under DDP "
                                "(several processes, fsdp=1) trains other updates than one process (measured; FSDP2 "
                                "trains the same)", f"tpu_topology.mesh.fsdp={topo.expected_processes} "
                                "tpu_topology.mesh.dp=1 (FSDP2), or one process"))
    return problems
