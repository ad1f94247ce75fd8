"""The benchmarks (benchmarks/runner.py, benchmarks/probes/, scripts/bench*.py): every probe module imports, says what
it measures and parses its arguments; scripts/bench.py still takes the commands the docs quote and picks the same
probes; the report's format; and the cheapest probe end to end, into a temporary results file (never the real one)."""

from __future__ import annotations

import importlib
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, clean_env

sys.path.insert(0, str(REPO / "scripts"))
import bench  # noqa: E402  (scripts/bench.py)

from benchmarks import probes, runner  # noqa: E402

PROBES = [importlib.import_module(f"benchmarks.probes.{m.name}") for m in pkgutil.iter_modules(probes.__path__)]
HEADING = re.compile(r"^## \d{4}-\d\d-\d\d \d\d:\d\d UTC — \S+, \d+ CPU cores, Python [\d.]+, torch \S+$")


@pytest.mark.parametrize("probe", PROBES, ids=lambda m: m.__name__.rsplit(".", 1)[1])
def test_each_probe_imports_says_what_it_measured_and_parses_its_help(probe, capsys):
    assert re.search(r"^Memory-model constants", probe.__doc__, re.M), "the docstring names its constants (or none)"
    assert callable(probe.run) and callable(probe.add_arguments)
    with pytest.raises(SystemExit) as stop:
        runner.main(probe, ["--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert "--out" in out and "--no-append" in out and probe.__doc__.split()[0] in out
    assert ("--child" in out) is False  # internal: a probe's fresh process, not a user's flag


def test_the_probes_are_all_reachable_from_a_script():
    """Every probe runs under some command of scripts/bench.py, bench_accelerator.py or bench_bucket.py."""
    fronted = {p.__name__ for p in bench.PROBES} | {"benchmarks.probes.accelerator", "benchmarks.probes.bucket"}
    fronted |= {"benchmarks.probes.xla_checkpointing"}  # in --checkpointing
    assert {p.__name__ for p in PROBES} == fronted


def quoted_commands() -> set[str]:
    """The `python scripts/bench.py ...` commands quoted in the README, docs/, benchmarks/RESULTS.md and its
    docstring: each still has to parse."""
    texts = [REPO / "README.md", REPO / "benchmarks" / "RESULTS.md", *sorted((REPO / "docs").glob("*.md"))]
    found = {m.group(1).strip() for t in texts for m in re.finditer(r"python scripts/bench\.py([^`\n]*)`",
                                                                        t.read_text())}
    found |= {m.group(1).split("#")[0].strip() for m in re.finditer(r"python scripts/bench\.py(.*)", bench.__doc__)}
    return found


def test_the_commands_the_docs_quote_still_parse():
    commands = quoted_commands()
    assert {"", "--checkpointing", "--sd3-activations --precisions float32", "--lazy-checkpointing",
            "--host-overhead --variants --ks 2 --checkpointed"} <= commands
    for command in commands:
        assert bench.selected(bench.parse(command.split())), command


@pytest.mark.parametrize("command, expected", [
    ("", ["training_runs", "pipeline"]),
    ("--no-pipeline --backends eager_cpu", ["training_runs"]),
    ("--host-overhead", ["host_overhead", "step_estimate"]),
    ("--host-overhead --no-estimate --variants eager_k1", ["host_overhead"]),
    ("--full-width --backends cpu --overrides train.mixed_precision=bf16", ["full_width"]),
    ("--sd3-activations --precisions float32", ["sd3_activations"]),
    ("--checkpointing", ["checkpointing"]),
    ("--lazy-checkpointing", ["lazy_checkpointing"]),
    ("--sd3-parameters", ["sd3_parameters"]),
    ("--sd14-activations --batches 1", ["sd14_activations"]),
])
def test_bench_py_runs_the_probes_its_flags_name(command, expected):
    assert [p.__name__.rsplit(".", 1)[1] for p in bench.selected(bench.parse(command.split()))] == expected


def test_bench_py_flags_keep_their_values():
    args = bench.parse("--host-overhead --variants --ks 2 --checkpointed".split())
    assert args.variants == [] and args.ks == [2] and args.checkpointed
    args = bench.parse("--steps 10 --backends eager_cpu cpu --no-pipeline".split())
    assert args.steps == [10] and args.backends == ["eager_cpu", "cpu"] and args.no_pipeline
    with pytest.raises(SystemExit):
        bench.parse(["--backends", "tpu"])  # not a topology the benchmark knows


def test_table_has_a_column_for_every_key_in_first_seen_order():
    text = runner.table([{"a": 1, "b": 2}, {"a": 3, "c": "x"}])
    assert text.splitlines() == ["| a | b | c |", "|---|---|---|", "| 1 | 2 |  |", "| 3 |  | x |"]
    assert runner.table([]) == ""


@pytest.mark.parametrize("load, verdict", [(0.2, "quiet when it started"), (3.5, "busy: ")])
def test_a_report_appends_a_dated_section_with_the_machine_and_its_load(tmp_path, monkeypatch, load, verdict):
    monkeypatch.setattr(runner.os, "getloadavg", lambda: (load, 0.0, 0.0))
    out = tmp_path / "sub" / "RESULTS.md"
    for note in ("", "a test ran beside it"):
        report = runner.Report("python scripts/bench.py --x", out, note)
        report.add("A table:\n\n" + runner.table([{"k": 1}]))
        report.finish()
    text = out.read_text()
    assert text.startswith(runner.RESULTS_HEADER)
    sections = text[len(runner.RESULTS_HEADER):].split("\n## ")[1:]
    assert len(sections) == 2
    for section in sections:
        lines = section.splitlines()
        assert HEADING.match("## " + lines[0]), lines[0]
        assert lines[2] == "`python scripts/bench.py --x`"
        assert "| k |" in lines and "| 1 |" in lines
        assert re.search(rf"Machine load \(1-minute load average, \d+ cores\): {load:.2f} at the start, .*{verdict}",
                         section)
    assert sections[1].rstrip().endswith("Note: a test ran beside it") and "Note:" not in sections[0]


def test_no_append_prints_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "RESULTS.md"
    runner.Report("cmd", None).finish()
    assert not out.exists() and "`cmd`" in capsys.readouterr().out


def table_rows(text: str) -> list[dict]:
    """The rows of the first Markdown table in text, as dicts of strings."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| ") and lines[i + 1].startswith("|---"))
    cells = lambda line: [c.strip() for c in line.strip()[1:-1].split("|")]
    cols, rows = cells(lines[start]), []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append(dict(zip(cols, cells(line))))
    return rows


def test_the_cheapest_probe_through_bench_py_into_a_results_file(tmp_path, capsys):
    """scripts/bench.py --sd3-parameters (SD 3.5 Medium built on the meta device: seconds) writes a section to the
    given file (never the real one) whose figures are the memory model's SD35_MEDIUM_BILLIONS."""
    from ddpo_tpu.catalog.families import SD35_MEDIUM_BILLIONS

    out = tmp_path / "RESULTS.md"
    bench.main(["--sd3-parameters", "--out", str(out)])
    text = out.read_text()
    assert text.startswith(runner.RESULTS_HEADER) and text.count("\n## ") == 1
    assert HEADING.match("## " + text.split("\n## ")[1].splitlines()[0])
    assert f"`python scripts/bench.py --sd3-parameters --out {out}`" in text
    (row,) = table_rows(text)
    got = {k: float(v) for k, v in row.items()}
    assert got["clip_l"] + got["clip_g"] == pytest.approx(SD35_MEDIUM_BILLIONS["clips"], abs=1.5e-3)
    for part in ("transformer", "pos_embed", "t5", "vae"):  # both rounded to 3 decimals (pos_embed 0.2265)
        assert got[part] == pytest.approx(SD35_MEDIUM_BILLIONS[part], abs=1.5e-3), part
    assert text[len(runner.RESULTS_HEADER):] in capsys.readouterr().out  # printed as appended


@pytest.mark.slow
@pytest.mark.xla
def test_the_cheapest_child_probe_end_to_end(tmp_path):
    """scripts/bench.py --lazy-checkpointing on the 4-attention-block model only: two probes, each in a fresh
    process of its own (`python -m benchmarks.probes.lazy_checkpointing --child ...`) on XLA CPU; the section lands in
    the given results file with the rows the graphs imply (one barrier per checkpointed block before optimisation)."""
    out = tmp_path / "RESULTS.md"
    proc = subprocess.run([sys.executable, "scripts/bench.py", "--lazy-checkpointing", "--models", "blocks",
                           "--out", str(out)], cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    text = out.read_text()
    assert text.startswith(runner.RESULTS_HEADER) and text.count("\n## ") == 1
    assert "`python scripts/bench.py --lazy-checkpointing --models blocks --out " in text
    rows = table_rows(text)
    assert [(r["model"], r["checkpointed"], r["barriers_before_opt"]) for r in rows] == [
        ("blocks", "False", "0"), ("blocks", "True", "4")]
    assert "Machine load" in text


def test_the_derived_attention_scores_are_the_memory_models():
    """The softmaxes XLA keeps, as the probes derive them (SD 1.4: token counts read off a meta-device forward of
    the UNet), are the figures the HBM rule adds."""
    from ddpo_tpu.catalog.families import SD1_ATTENTION_SCORES_GIB_512, SD3_ATTENTION_SCORES_GIB_512

    from benchmarks.probes import sd3_activations, sd14_activations

    assert sd14_activations.attention_scores_gib() == pytest.approx(SD1_ATTENTION_SCORES_GIB_512, abs=0.05)
    assert sd3_activations.attention_scores_gib() == pytest.approx(SD3_ATTENTION_SCORES_GIB_512, rel=1e-9)
