"""The package's import floors (docs/architecture.md, "The layers"), read from the code with `ast`: every import of
ddpo_tpu, lazy ones inside functions too, between parts (a subpackage, or a module at the package root).

The bottom package proc/ (locks, the rank watch, exit codes, CLI argument helpers, the build cache) imports only the
floor-1 modules it is allowed; models/, runtime/ and status/ reach none of launch/; the parts import each other in no
circle but the two known ones (KNOWN_UPWARD); and the floors are fewer than the 14 that issue 42 measured before
proc/ existed. Run this file with `-s` to print each part's floor:
`python -m pytest -q -s tests/unit/project/test_layers.py -k floors`."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

pytestmark = pytest.mark.torch_free  # no torch in the test or what it starts (tests/conftest.py)

REPO = Path(__file__).resolve().parents[3]
PACKAGE = REPO / "ddpo_tpu"
# what proc/ may import of the package besides itself: the floor-1 modules of stdlib-only code
PROC_MAY_IMPORT = {"problems", "waits", "env"}
# Imports allowed to run back up, each closing a circle of two parts: none since 2026-11-29 (issue 42). An entry
# added here is debt with an owner: the test fails while an entry names an import that is gone.
KNOWN_UPWARD: dict[tuple[str, str], str] = {}


def _part(dotted: str) -> str | None:
    """The part a dotted ddpo_tpu name belongs to: 'ddpo_tpu.launch.lock' -> 'launch', 'ddpo_tpu.env' -> 'env'."""
    names = dotted.split(".")
    if names[0] != "ddpo_tpu" or len(names) < 2:
        return None
    return names[1]


def _imports(path: Path) -> set[str]:
    """The parts one module imports (ddpo_tpu's only), at module level or inside a function."""
    parts: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            parts.update(p for a in node.names if (p := _part(a.name)))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "ddpo_tpu":  # from ddpo_tpu import env, waits
                parts.update(a.name for a in node.names)
            elif p := _part(node.module):
                parts.add(p)
    return parts


def _part_of_file(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


@functools.lru_cache(maxsize=1)
def _graph() -> dict[str, set[str]]:
    """part -> the other parts it imports."""
    graph: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.parent.name == "conf":
            continue
        me = _part_of_file(path)
        graph.setdefault(me, set()).update(_imports(path) - {me})
    for targets in list(graph.values()):
        for t in targets:
            graph.setdefault(t, set())
    return graph


def _module_imports(part: str) -> dict[str, set[str]]:
    return {str(p.relative_to(REPO)): _imports(p) - {part} for p in sorted((PACKAGE / part).rglob("*.py"))}


def test_proc_imports_nothing_above_it():
    above = {f: sorted(parts - PROC_MAY_IMPORT) for f, parts in _module_imports("proc").items()
             if parts - PROC_MAY_IMPORT}
    assert not above, f"proc/ must import only {sorted(PROC_MAY_IMPORT)} of the package: {above}"


def test_models_runtime_and_status_do_not_import_launch():
    reaching = {f: "launch" for part in ("models", "runtime", "status")
                for f, parts in _module_imports(part).items() if "launch" in parts}
    assert not reaching, f"process infrastructure belongs in proc/, not launch/: {reaching}"


def _floors(graph: dict[str, set[str]]) -> dict[str, int]:
    """Each part's floor: 1 for a part that imports no other, else one above the highest it imports. Raises on a
    circle, naming it."""
    floors: dict[str, int] = {}
    visiting: list[str] = []

    def floor(part: str) -> int:
        if part in floors:
            return floors[part]
        if part in visiting:
            raise AssertionError("parts import each other in a circle: " + " -> ".join(
                visiting[visiting.index(part):] + [part]))
        visiting.append(part)
        floors[part] = 1 + max((floor(t) for t in graph[part]), default=0)
        visiting.pop()
        return floors[part]

    for part in graph:
        floor(part)
    return floors


def test_the_parts_import_each_other_in_no_circle_but_the_known_ones_and_stand_on_fewer_than_14_floors():
    graph = {part: set(targets) for part, targets in _graph().items()}
    for (a, b), why in KNOWN_UPWARD.items():
        assert b in graph[a], f"{a}/ no longer imports {b}/ ({why}): drop it from KNOWN_UPWARD"
        graph[a].discard(b)
    floors = _floors(graph)  # raises on any other circle
    by_floor: dict[int, list[str]] = {}
    for part, f in floors.items():
        by_floor.setdefault(f, []).append(part)
    for f in sorted(by_floor, reverse=True):
        print(f"floor {f:2d}: {', '.join(sorted(by_floor[f]))}")
    assert floors["proc"] == 2, "proc/ stands right above the floor-1 modules it imports"
    assert max(floors.values()) < 14, f"{max(floors.values())} floors: issue 42 asks for fewer than 14"


def test_the_floor_counter_sees_a_circle_and_a_long_chain():
    # the helper itself: a circle is named, a chain of n parts stands on n floors
    try:
        _floors({"a": {"b"}, "b": {"c"}, "c": {"a"}})
    except AssertionError as e:
        assert "a -> b -> c -> a" in str(e)
    else:
        raise AssertionError("a circle went unseen")
    assert max(_floors({"a": {"b"}, "b": {"c"}, "c": set()}).values()) == 3


def _module_of(dotted: str) -> str | None:
    """The package file a dotted name is: 'ddpo_tpu.rewards.base' -> 'rewards/base.py', a package -> its __init__."""
    rel = Path(*dotted.split(".")[1:]) if dotted.startswith("ddpo_tpu.") else None
    if rel is None:
        return None
    if (PACKAGE / rel).with_suffix(".py").is_file():
        return str(rel.with_suffix(".py"))
    if (PACKAGE / rel / "__init__.py").is_file():
        return str(rel / "__init__.py")
    return None


def _file_graph() -> dict[str, set[str]]:
    """file -> the package files it imports (at module level or inside a function; `from a.b import c` counts
    a/b/c.py when c is a module, else a/b)."""
    graph: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        me = str(path.relative_to(PACKAGE))
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets.update(m for a in node.names if (m := _module_of(a.name)))
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                for a in node.names:
                    m = _module_of(f"{node.module}.{a.name}") or _module_of(node.module)
                    if m:
                        targets.add(m)
        graph[me] = targets - {me}
    return graph


def test_no_two_files_import_each_other_even_through_others():
    """Circles between files inside one part too (issue 42: 0 circles): a package's __init__ re-exporting its
    modules is not one (a module importing its own package's __init__ is not followed)."""
    graph = _file_graph()
    for me, targets in graph.items():
        graph[me] = {t for t in targets if not (t.endswith("__init__.py") and me.startswith(t[:-len("__init__.py")]))}
    _floors(graph)  # raises naming the first circle it meets
