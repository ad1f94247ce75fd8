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

# Seconds of the 20 longest slow tests (setup + call: a module fixture's runs count on the test that built them), from
# the slow tier under `-n 2 --dist loadgroup` on the shared 2-core machine, 2026-11-26 (load 6-9; docs/testing.md).
# Only the order depends on them: a stale or missing entry makes the end less even, never a test wrong.
MEASURED_S: dict[str, float] = {
    "tests/test_xla.py::test_no_new_compilations_after_the_first_epoch": 820,
    "tests/test_digits_learns.py::test_the_digits_demo_learns_far_above_a_frozen_control[grpo]": 545,
    "tests/test_training.py::test_compiled_and_fused_steps_equal_the_eager_path_over_an_epoch[cpu]": 352,
    "tests/test_digits_learns.py::test_the_digits_demo_learns_far_above_a_frozen_control[ddpo]": 328,
    "tests/test_nft_learns.py::test_nft_smoke_raises_jpeg_compressibility_over_a_frozen_policy": 266,
    "tests/test_distributed.py::test_checkpoints_resume_across_world_sizes": 248,
    "tests/test_flux_learns.py::test_flux_grpo_smoke_raises_jpeg_compressibility_over_a_frozen_control": 242,
    "tests/test_distributed_nodes.py::test_two_nodes_train_what_one_node_trains_and_a_lost_node_is_named": 217,
    "tests/test_distributed.py::test_a_stopped_or_killed_rank_ends_the_job_naming_it_and_the_run_resumes_exactly": 204,
    "tests/test_resume.py::test_sigkill_at_three_points_then_resume_is_exact": 184,
    "tests/test_flow_grpo_learns.py::test_flow_grpo_smoke_raises_jpeg_compressibility": 140,
    "tests/test_faults.py::test_a_kill_around_the_checkpoint_neither_loses_nor_duplicates_an_epoch": 135,
    "tests/test_bucket_e2e.py::test_sigkill_and_a_lost_disk_then_the_same_command_continues_from_the_bucket": 123,
    "tests/test_distributed.py::test_two_processes_train_what_one_eager_process_trains[fsdp_grpo_sd3]": 116,
    "tests/test_events.py::test_an_xla_run_says_what_it_compiles_while_it_compiles": 116,
    "tests/test_bucket_e2e.py::test_a_bucket_outage_past_the_deadline_ends_in_one_line_and_the_same_command_finishes":
        109,
    "tests/test_xla.py::test_sd14_topology_trains_on_xla_with_a_fixed_graph_set": 99,
    "tests/test_awm_learns.py::test_awm_smoke_raises_jpeg_compressibility_over_a_frozen_policy": 96,
    "tests/test_flow_grpo_e2e.py::test_flow_grpo_under_spmd_over_4_devices": 93,
    "tests/test_resume.py::test_sigterm_checkpoints_exits_75_and_the_same_command_continues": 92,
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
