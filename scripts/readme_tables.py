"""The README's tables that list what exists, written from what exists: the options of each config group (the YAML
files under conf/) and the model families and algorithms (the catalog's registries). People write the "what it sets"
prose; this script writes the names, so a new family, algorithm or preset cannot be missing from the README.

    python scripts/readme_tables.py            # rewrite README.md's generated cells and block
    python scripts/readme_tables.py --check    # exit 1, saying what differs, if README.md is not what it writes

tests/unit/project/test_docs.py runs the check. Torch-free: the catalog is what the front end reads."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ddpo_tpu.catalog import ALGORITHMS, FAMILIES  # noqa: E402

CONF = REPO / "conf"
README = REPO / "README.md"
BEGIN, END = "<!-- catalog tables: written by scripts/readme_tables.py -->", "<!-- end of catalog tables -->"
# a group row of the "Config groups" table: | `group` [(package `x`)] | options | what it sets |
ROW = re.compile(r"^\| `(?P<group>[a-z_]+)`(?P<package> \(package `[a-z_]+`\))? \| (?P<options>.*?) \| "
                 r"(?P<what>.*) \|$")
# listed in words rather than by name: one is composed per run from other choices
NOT_LISTED = {"reward_local": "chosen automatically as `${reward}_${model}`"}


def _names(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def _family_of(model: str) -> str:
    for line in (CONF / "model" / f"{model}.yaml").read_text().splitlines():
        if line.startswith("family:"):
            return line.split(":", 1)[1].split("#", 1)[0].strip()
    raise SystemExit(f"conf/model/{model}.yaml names no family")


def options(group: str) -> str:
    """The options cell: the group's YAML names; models by family in the catalog's order (local builds first)."""
    if group in NOT_LISTED:
        return NOT_LISTED[group]
    if group == "model":
        by_family: dict[str, list[str]] = {}
        for model in _names("model"):
            by_family.setdefault(_family_of(model), []).append(model)
        order = [f.name for f in FAMILIES] + sorted(set(by_family) - set(FAMILIES.names()))
        cells = []
        for family in order:
            models = sorted(by_family.get(family, []), key=lambda m: (not m.startswith("tiny"), m))
            if models:
                cells.append(", ".join(f"`{m}`" for m in models))
        return "; ".join(cells)
    return ", ".join(f"`{n}`" for n in _names(group))


def catalog_block() -> str:
    """The families and algorithms tables, from the registries."""
    models: dict[str, list[str]] = {}
    for model in _names("model"):
        models.setdefault(_family_of(model), []).append(model)
    lines = [BEGIN, "", "| `model.family` | what | sampler | configs |", "|---|---|---|---|"]
    for f in FAMILIES:
        configs = ", ".join(f"`{m}`" for m in sorted(models.get(f.name, [])))
        lines.append(f"| `{f.name}` | {f.title} | `{f.sampler}` | {configs} |")
    lines += ["", "| `algorithm` | what | implementation |", "|---|---|---|"]
    for a in ALGORITHMS:
        module = a.module.split(":", 1)[0].replace(".", "/") + ".py"
        lines.append(f"| `{a.name}` | {a.title} | `{module}` |")
    lines += ["", END]
    return "\n".join(lines)


def render(text: str) -> str:
    """README text with the generated cells and block rewritten; everything else as it was."""
    out = []
    for line in text.split("\n"):
        m = ROW.match(line)
        if m and (CONF / m["group"]).is_dir():
            line = f"| `{m['group']}`{m['package'] or ''} | {options(m['group'])} | {m['what']} |"
        out.append(line)
    text = "\n".join(out)
    if BEGIN not in text or END not in text:
        raise SystemExit(f"README.md has no generated block: put the two lines {BEGIN!r} and {END!r} where it goes")
    head, rest = text.split(BEGIN, 1)
    return head + catalog_block() + rest.split(END, 1)[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if README.md would change")
    args = parser.parse_args()
    text = README.read_text()
    new = render(text)
    if args.check:
        if new != text:
            print("README.md's generated tables are stale: run python scripts/readme_tables.py", file=sys.stderr)
            return 1
        return 0
    README.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
