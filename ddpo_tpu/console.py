"""What the front end shows: the config tree and the parity table (rich). Never touches a device."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.tree import Tree

from ddpo_tpu.config.compose import Validated

SECTIONS = ("model", "reward", "sample", "train", "prompts", "tpu_topology", "parity", "xla", "stat_tracking", "logger")


def config_tree(tree: dict) -> Tree:
    root = Tree("config")
    top = root.add("run")
    for k, v in tree.items():
        if not isinstance(v, dict):
            top.add(f"{k}: {v}")
    for section in SECTIONS:
        if section in tree:
            _add(root.add(f"[bold]{section}[/bold]"), tree[section])
    return root


def _add(node: Tree, value: dict) -> None:
    for k, v in value.items():
        if isinstance(v, dict) and v:
            _add(node.add(str(k)), v)
        else:
            node.add(f"{k}: {v}")


def parity_table(validated: Validated) -> Table:
    table = Table(title=f"parity: {validated.cfg.parity.name}", show_lines=False)
    for col in ("constraint", "target", "effective", "ok"):
        table.add_column(col)
    for row in validated.report:
        target = "-" if row["target"] is None else str(row["target"])
        table.add_row(row["constraint"], target, str(row["effective"]), "yes" if row["ok"] else "NO")
    return table


def print_start(validated: Validated, run_dir: Path) -> None:
    console = Console(highlight=False)
    console.print(config_tree(validated.tree))
    console.print(parity_table(validated))
    with open(run_dir / "parity.txt", "w") as f:
        Console(file=f, width=120, no_color=True).print(parity_table(validated))
    console.print(f"run dir: {run_dir}")
