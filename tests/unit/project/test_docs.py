"""The README and docs/ follow the catalog and the tree (issue 42, item 5: docs that drift).

The README's config-groups table names every option of every group folder in conf/ (and only those) and every
registered model family, sampler, algorithm and reward (ddpo_tpu/catalog); every `docs/*.md` page and every
`ddpo_tpu/...py` path that README.md or docs/*.md mention exists. Text and the torch-free catalog only: fast.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ddpo_tpu.catalog import ALGORITHMS, FAMILIES, REWARDS, SAMPLERS

pytestmark = pytest.mark.torch_free  # no torch in the test or what it starts (tests/conftest.py)

REPO = Path(__file__).resolve().parents[3]
CONF = REPO / "conf"
DOCS = sorted((REPO / "docs").glob("*.md"))
TEXTS = [REPO / "README.md", *DOCS]
# chosen by the config itself (`${reward}_${model}`), not by the user: the table says so instead of listing them
AUTOMATIC = {"reward_local"}


def groups_table() -> dict[str, tuple[set[str], str]]:
    """group -> (the backticked names of its options cell, the whole row), from the README's "Config groups"."""
    text = (REPO / "README.md").read_text()
    section = text.split("## Config groups", 1)[1].split("\n## ", 1)[0].split("<!-- catalog tables", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`"):
            continue
        group = re.match(r"`([^`]+)`", cells[0]).group(1)
        rows[group] = (set(re.findall(r"`([^`]+)`", cells[1])), line)
    return rows


def yaml_stems(group: str) -> set[str]:
    return {p.stem for p in (CONF / group).glob("*.yaml")}


def test_the_table_has_a_row_for_every_group_folder():
    folders = {p.name for p in CONF.iterdir() if p.is_dir()}
    assert set(groups_table()) == folders


@pytest.mark.parametrize("group", sorted(p.name for p in CONF.iterdir() if p.is_dir() and p.name not in AUTOMATIC))
def test_a_groups_options_are_its_yaml_files(group):
    """Every model config, algorithm, reward, sampler, topology, experiment... is listed, and nothing that is gone."""
    options, _ = groups_table()[group]
    assert options == yaml_stems(group), (f"README's `{group}` row: missing {sorted(yaml_stems(group) - options)}, "
                                          f"not in conf/{group}/: {sorted(options - yaml_stems(group))}")


@pytest.mark.parametrize("registry, group", [(FAMILIES, "model"), (SAMPLERS, "sampler"), (ALGORITHMS, "algorithm"),
                                             (REWARDS, "algorithm")])
def test_every_registered_name_is_in_its_row(registry, group):
    """Families by their `model.family` name in the model row, samplers by spec name in the sampler row, algorithms
    in theirs; a reward that is a feature model (never a run's reward, so no conf/reward file) in the algorithm row,
    where GRPO's diversity_features takes it. Run rewards are conf/reward's files, checked above."""
    rows = groups_table()
    specs = [s for s in registry if registry is not REWARDS or s.features]
    assert specs, registry.what
    _, row = rows[group]
    missing = [s.name for s in specs if f"`{s.name}`" not in row]
    assert not missing, f"README's `{group}` row does not name the registered {registry.what}s {missing}"


def test_the_generated_tables_are_what_the_conf_folder_and_the_catalog_say():
    """README's options cells and its family and algorithm tables are written by scripts/readme_tables.py: a new
    YAML file or registered spec changes them, and the README must have been regenerated."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("readme_tables", REPO / "scripts" / "readme_tables.py")
    tables = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tables)
    text = (REPO / "README.md").read_text()
    assert tables.render(text) == text, "README.md's generated tables are stale: run python scripts/readme_tables.py"
    block = text.split(tables.BEGIN, 1)[1].split(tables.END, 1)[0]
    for f in FAMILIES:
        assert f"| `{f.name}` | {f.title} |" in block
    for a in ALGORITHMS:
        assert f"| `{a.name}` | {a.title} |" in block


def test_every_run_reward_has_its_conf_file():
    """So the reward row (checked against conf/reward) names every registered reward a run can pick."""
    run_rewards = {s.name for s in REWARDS if not s.features}
    assert run_rewards == yaml_stems("reward")
    assert {s.name for s in ALGORITHMS} == yaml_stems("algorithm")


def mentioned(pattern: str) -> set[tuple[str, str]]:
    return {(t.relative_to(REPO).as_posix(), m) for t in TEXTS for m in re.findall(pattern, t.read_text())}


def test_every_docs_page_mentioned_exists():
    missing = {(where, page) for where, page in mentioned(r"docs/[\w.-]+\.md") if not (REPO / page).is_file()}
    assert not missing, sorted(missing)


def test_every_package_module_path_mentioned_exists():
    """`ddpo_tpu/x/y.py`, and the same written from inside the package (`rundir/checkpoint.py`, a name that once
    stood in the README for a module that was never there)."""
    missing = {(where, path) for where, path in mentioned(r"ddpo_tpu/[\w/]+\.py") if not (REPO / path).is_file()}
    # a relative `config/x.py` is left out: flow_grpo, DiffusionNFT and AWM keep their presets in config/*.py, which
    # the docs cite by that name
    packages = {p.name for p in (REPO / "ddpo_tpu").iterdir() if p.is_dir() and not p.name.startswith("_")}
    packages -= {"config"}
    for where, path in mentioned(r"(?<![\w/.])([a-z_]+/[\w/]+\.py)"):
        if path.split("/", 1)[0] in packages and not (REPO / "ddpo_tpu" / path).is_file():
            missing.add((where, path))
    assert not missing, sorted(missing)


def test_the_readme_is_one_a_newcomer_finishes():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) < 300
    # one package map: docs/architecture.md's; the README points there
    assert "## Layout" not in text and "docs/architecture.md" in text
