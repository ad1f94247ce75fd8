"""pytest-xdist's `--dist loadgroup`, made to work with pytest 9.2 and to group on its own.

xdist 3.8 (the newest) groups by appending "@group" to an item's private `_nodeid`, which pytest 9.2 no longer reads
(a node's id is now `_id`): every test would be scheduled alone, and a module-scoped fixture (the end-to-end runs
several tests read, a loaded model) built once per worker. Here each worker writes, at collection, which tests belong
together (tests/conftest.py: those sharing a fixture of module, class or package scope, and any explicit
`xdist_group` mark) into a folder the controller names; the controller's scheduler reads it and sends each group to
one worker as one unit, every other test alone. Units go out longest first (the workers order their collection by
MEASURED_S; unknown tests count as short), so two workers end together rather than one waiting on a long test
scheduled last."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from xdist.scheduler import LoadScopeScheduling

GROUPS_DIR_KEY = "ddpo_tpu_test_groups_dir"  # in each worker's workerinput

# Seconds of the longest slow tests (setup + call: a module fixture's runs count on the test that built them), under
# `-n 2 --dist loadgroup`: this machine's clean-clone `.ci/run` of 2026-11-29 (bdae680, quiet), scaled for the runs
# shortened since by their own before/after runs; the extended tests keep their earlier figures for `-m extended` runs.
# Only the order depends on them: a stale or missing entry makes the end less even, never a test wrong.
MEASURED_S: dict[str, float] = {
    "tests/e2e/test_xla.py::test_no_new_compilations_after_the_first_epoch": 512,
    "tests/learning/test_learns.py::test_the_smoke_learns[nft_smoke]": 398,
    "tests/e2e/test_xla.py::test_fsdp_with_lora_resumes_split_and_compiles_nothing_after_its_first_epoch": 396,
    "tests/e2e/test_xla.py::test_sd14_topology_trains_on_xla_with_a_fixed_graph_set": 288,
    "tests/e2e/test_nft_e2e.py::test_xla_compiles_nothing_after_the_first_epoch": 265,
    "tests/e2e/test_training.py::test_compiled_and_fused_steps_equal_the_eager_path_over_an_epoch[cpu]": 241,
    "tests/e2e/test_flow_grpo_e2e.py::test_flow_grpo_under_spmd_over_4_devices": 196,
    "tests/learning/test_learns.py::test_the_smoke_learns[flow_grpo_smoke]": 192,
    "tests/learning/test_learns.py::test_the_smoke_learns[qwen_image_grpo_smoke]": 140,
    "tests/e2e/test_distributed.py::test_a_stopped_or_killed_rank_ends_the_job_naming_it_and_the_run_resumes_exactly":
        129,
    "tests/learning/test_learns.py::test_the_smoke_learns[wan_grpo_smoke]": 122,
    "tests/e2e/test_distributed_nodes.py::test_two_nodes_train_what_one_node_trains_and_a_lost_node_is_named": 120,
    "tests/e2e/test_resume.py::test_sigkill_at_three_points_then_resume_is_exact": 117,
    "tests/unit/status/test_events.py::test_an_xla_run_says_what_it_compiles_while_it_compiles": 115,
    "tests/e2e/test_bucket_e2e.py::test_sigkill_and_a_lost_disk_then_the_same_command_continues_from_the_bucket": 114,
    "tests/e2e/test_training.py::test_smoke_run_learns_jpeg_compressibility": 110,
    "tests/e2e/test_xla_families.py::test_a_flow_family_compiles_its_graphs_once_and_samples_on_the_device[qwen_image_grpo_smoke]":
        105,
    "tests/e2e/test_flow_grpo_e2e.py::test_flow_grpo_on_xla_cpu_compiles_nothing_after_epoch_0_whatever_moves": 100,
    "tests/e2e/test_distributed.py::test_compiled_steps_compile_in_epoch_0_only[sd1_ddpo]": 92,
    "tests/e2e/test_evaluation_e2e.py::test_every_test_prompt_is_evaluated_once_by_every_reward[xla]": 91,
    "tests/e2e/test_distributed.py::test_compiled_steps_compile_in_epoch_0_only[sd3_grpo]": 84,
    "tests/e2e/test_bucket_e2e.py::test_a_bucket_outage_past_the_deadline_ends_in_one_line_and_the_same_command_finishes":
        82,
    "tests/e2e/test_distributed.py::test_checkpoints_resume_across_world_sizes[one_then_two]": 78,
    "tests/e2e/test_exit_paths.py::test_a_killed_rank_is_one_line_and_the_same_command_resumes[two]": 72,
    "tests/e2e/test_rank_hang.py::test_a_rank_whose_reward_call_never_returns_is_named_and_the_same_command_resumes":
        68,
    "tests/e2e/test_distributed.py::test_two_processes_train_what_one_eager_process_trains[ddp_full]": 67,
    "tests/e2e/test_nft_e2e.py::test_kill_then_resume_is_exact": 66,
    "tests/e2e/test_xla_families.py::test_a_flow_family_compiles_its_graphs_once_and_samples_on_the_device[wan_grpo_smoke]":
        66,
    "tests/e2e/test_xla_families.py::test_a_flow_family_compiles_its_graphs_once_and_samples_on_the_device[flux_grpo_smoke]":
        65,
    "tests/e2e/test_exit_paths.py::test_a_disk_fault_mid_run_is_one_line_and_the_same_command_resumes[read_only-two]":
        63,
    "tests/e2e/test_distributed.py::test_two_processes_train_what_one_eager_process_trains[fsdp_full]": 59,
    "tests/e2e/test_flow_grpo_e2e.py::test_flow_grpo_resumes_after_sigkill_to_the_same_weights_and_ema": 58,
    "tests/learning/test_learns.py::test_the_smoke_learns[awm_smoke]": 58,
    "tests/e2e/test_xla.py::test_compiled_sampler_equals_eager_and_compiles_once": 57,
    "tests/unit/rewards/test_managed_reward.py::test_a_run_whose_reward_process_dies_twice_stops_resumable": 57,
    "tests/e2e/test_nft_e2e.py::test_two_distributed_ranks_train_what_one_process_trains": 57,
    "tests/unit/config/test_enablement.py::test_every_catalog_key_of_each_smoke_experiment_is_read_or_refused": 56,
    "tests/e2e/test_distributed.py::test_two_processes_train_what_one_eager_process_trains[ddp_lora]": 54,
    "tests/e2e/test_evaluation_e2e.py::test_every_test_prompt_is_evaluated_once_by_every_reward[dist]": 52,
    "tests/e2e/test_resume.py::test_front_end_sigkill_the_training_process_checkpoints_and_the_same_command_resumes":
        51,
    "tests/e2e/test_distributed.py::test_two_processes_train_what_one_eager_process_trains[fsdp_grpo_sd3]": 50,
    "tests/unit/rundir/test_cache_damage.py::test_a_truncated_kernel_crashes_the_same_compile_until_it_is_set_aside":
        50,
    "tests/e2e/test_evaluation_e2e.py::test_ddpo_eval_reproduces_the_last_evaluation_and_base_the_first": 47,
    "tests/unit/status/test_tracking.py::test_wandb_offline_run_with_images_and_the_same_id_after_resume": 46,
    "tests/e2e/test_exit_paths.py::test_a_killed_rank_is_one_line_and_the_same_command_resumes[one]": 46,
    "tests/e2e/test_resume.py::test_resume_refuses_a_changed_config_unless_forced": 45,
    "tests/e2e/test_resume.py::test_sigterm_checkpoints_exits_75_and_the_same_command_continues": 44,
    "tests/e2e/test_exit_paths.py::test_a_disk_fault_mid_run_is_one_line_and_the_same_command_resumes[full-one]": 42,
    "tests/unit/status/test_status.py::test_a_killed_then_resumed_run_read_from_its_events": 42,
    "tests/e2e/test_xla.py::test_lazy_checkpointing_puts_a_barrier_before_each_recomputation": 41,
    "tests/unit/status/test_console.py::test_a_smoke_run_on_a_terminal_and_through_a_pipe": 38,
    "tests/unit/launch/test_worker_imports.py::test_only_an_xla_execution_imports_torch_xla[tpu_topology=cpu-True]": 17,
}


def longest_first(items: list, groups: dict[str, str]) -> None:
    """Order a worker's items (in place) by their unit's measured seconds, longest first, a group's tests together;
    ties keep the collection order. Every worker orders the same collection the same way."""
    unit_of = {item.nodeid: groups.get(item.nodeid, item.nodeid) for item in items}
    seconds: dict[str, float] = {}
    count: dict[str, int] = {}
    first_seen: dict[str, int] = {}
    for i, item in enumerate(items):
        unit = unit_of[item.nodeid]
        seconds[unit] = seconds.get(unit, 0.0) + MEASURED_S.get(item.nodeid, 0.0)
        count[unit] = count.get(unit, 0) + 1
        first_seen.setdefault(unit, i)
    # unmeasured: the larger groups first (xdist's own order for loadscope)
    def key(item):
        unit = unit_of[item.nodeid]
        return -seconds[unit], -count[unit], first_seen[unit]

    items.sort(key=key)


def write_groups(workerinput: dict, groups: dict[str, str]) -> None:
    """On a worker: its nodeid -> group table, where the controller reads it."""
    folder = workerinput.get(GROUPS_DIR_KEY)
    if folder is None:
        return
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-")
    with os.fdopen(fd, "w") as f:
        json.dump(groups, f)
    os.replace(tmp, Path(folder) / f"{workerinput['workerid']}.json")


class FixtureGroupScheduling(LoadScopeScheduling):
    """xdist's loadscope scheduling with the workers' groups as scopes (a test in no group is its own scope)."""

    def __init__(self, config, log, folder: str):
        super().__init__(config, log)
        config.option.loadscopereorder = False  # the units' order is the workers' (longest_first), not by test count
        self._folder = Path(folder)
        self._groups: dict[str, str] | None = None

    def _split_scope(self, nodeid: str) -> str:
        if self._groups is None:  # first called once every worker has collected (and written its table)
            self._groups = {}
            for table in sorted(self._folder.glob("*.json")):
                self._groups.update(json.loads(table.read_text()))
        return self._groups.get(nodeid, nodeid)
