"""The benchmarks' shared runner: the command line every probe shares (--out, --no-append, --note), a probe's fresh
process (`python -m benchmarks.probes.NAME --child JSON`: a module function, its row printed as JSON), the trainer
run as a user runs it, the process's resident memory, the table printer, and the report that appends a dated section
(machine, command, load before and after) to benchmarks/RESULTS.md.

A probe module has a docstring (what it measures; which memory-model constants of ddpo_tpu/catalog/families.py it is the
source of), `add_arguments(parser)`, `run(args, report)`, and, when it needs a process of its own, `CHILD` (the
function `--child` calls). `main(module)` runs one on its own; scripts/bench.py runs them under today's flags.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "RESULTS.md"
RESULTS_HEADER = "# Benchmark results\n\nAppended by `scripts/bench.py`; newest last.\n"
# A core's worth of other work (1-minute load average) when a benchmark starts: its timings shared the machine.
BUSY_LOAD = 1.0


def clean_env(**extra: str) -> dict[str, str]:
    """os.environ without the variables ddpo_tpu owns (and HYDRA_FULL_ERROR), the repo first on PYTHONPATH, plus
    extra: what a training process or a probe's child starts from."""
    from ddpo_tpu.env import OWNED_VARIABLES

    env = {k: v for k, v in os.environ.items() if k not in OWNED_VARIABLES and k != "HYDRA_FULL_ERROR"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env.update(extra)
    return env


def run_train(overrides: list[str], env: dict[str, str] | None = None,
              cwd: Path = REPO) -> tuple[subprocess.CompletedProcess, float]:
    """`python -m ddpo_tpu.train *overrides`, as a user runs it, to completion: the process and its wall seconds."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "ddpo_tpu.train", *overrides], env=env or clean_env(), cwd=cwd,
                          capture_output=True, text=True)
    return proc, time.perf_counter() - t0


def read_records(run_dir: Path, kind: str | None = None) -> list[dict]:
    """A run dir's metrics.jsonl records (of one kind: "epoch", "event", ...), in order."""
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if kind is None or r.get("kind") == kind]


def failure(proc: subprocess.CompletedProcess, chars: int = 600) -> str:
    """The tail of a failed process's output on one line, fit for a table cell."""
    return " ".join((proc.stdout[-chars:] + proc.stderr[-chars:]).split()).replace("|", "/")


class ChildFailed(RuntimeError):
    pass


def run_child(module: str, env: dict[str, str], **call) -> dict:
    """`module`.CHILD(**call) in a process of its own (its peak resident memory its own; torch_xla set up by env's
    variables), started as `python -m module --child JSON`; the row it printed last. Echoes the row (progress)."""
    proc = subprocess.run([sys.executable, "-m", module, "--child", json.dumps(call)], env=env, cwd=REPO,
                          capture_output=True, text=True)
    if proc.returncode:
        raise ChildFailed(f"{module} {call} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    return progress(json.loads(proc.stdout.strip().splitlines()[-1]))


def progress(row: dict) -> dict:
    """A row as it comes, one JSON line on stdout (a long benchmark shows its progress; nothing is lost if it stops)."""
    print(json.dumps(row), flush=True)
    return row


def vm_bytes(field: str) -> int:
    """A /proc/self/status figure in bytes (VmRSS now, VmHWM the peak since the last reset_peak_rss())."""
    return int(re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024


def reset_peak_rss() -> None:
    """VmHWM := VmRSS, so the next peak is the step's own."""
    Path("/proc/self/clear_refs").write_text("5")


def peak_rss_gib() -> float:
    """This process's peak resident memory since it started (ru_maxrss), GiB."""
    import resource

    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20, 2)


def table(rows: list[dict]) -> str:
    """A Markdown table of rows; the columns are the union of their keys, in first-seen order."""
    if not rows:
        return ""
    cols = list(dict.fromkeys(k for r in rows for k in r))
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def machine() -> str:
    """This machine, for a section's heading (torch's version from its metadata: importing torch here could load an
    accelerator's plugin in the front process)."""
    from importlib.metadata import version

    return (f"{platform.machine()}, {os.cpu_count()} CPU cores, Python {platform.python_version()}, "
            f"torch {version('torch')}")


class Report:
    """One RESULTS.md section: probes add their paragraphs and tables; finish() prints it and appends it to `out`
    (None: print only) after the heading (date, machine, command) and a line on the machine's load, measured before
    the first probe started and after the last ended, so a figure taken on a busy machine says so."""

    def __init__(self, command: str, out: Path | None, note: str = ""):
        self.command, self.out, self.note = command, out, note
        self.started = dt.datetime.now(dt.timezone.utc)
        self.load_before = os.getloadavg()[0]
        self.parts: list[str] = []

    @classmethod
    def for_args(cls, args: argparse.Namespace, command: str) -> Report:
        return cls(command, None if args.no_append else args.out, args.note)

    def add(self, text: str) -> None:
        self.parts.append(text.strip("\n"))

    def load_line(self, load_after: float) -> str:
        cores = os.cpu_count()
        verdict = (f"busy: other work shared the {cores} cores when it started, so its times may be inflated"
                   if self.load_before >= BUSY_LOAD else "quiet when it started")
        return (f"Machine load (1-minute load average, {cores} cores): {self.load_before:.2f} at the start, "
                f"{load_after:.2f} at the end (its own processes included): {verdict}.")

    def text(self) -> str:
        stamp = self.started.strftime("%Y-%m-%d %H:%M UTC")
        body = "\n\n".join([*self.parts, self.load_line(os.getloadavg()[0])]
                           + ([f"Note: {self.note}"] if self.note else []))
        return f"\n## {stamp} — {machine()}\n\n`{self.command}`\n\n{body}\n"

    def finish(self) -> str:
        text = self.text()
        print(text)
        if self.out is not None:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            if not self.out.exists():
                self.out.write_text(RESULTS_HEADER)
            with open(self.out, "a") as f:
                f.write(text)
        return text


def parser(doc: str | None) -> argparse.ArgumentParser:
    """The flags every benchmark command has."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=RESULTS, help="the results file appended to (default: %(default)s)")
    ap.add_argument("--no-append", action="store_true", help="print the section, append it nowhere")
    ap.add_argument("--note", default="", help="a sentence appended to the section (e.g. what else ran)")
    return ap


def add_shared(ap: argparse.ArgumentParser, *flags: str, **kw) -> None:
    """An argument several probes read with one meaning (--backends, --steps): added by the first probe that asks,
    so scripts/bench.py can put every probe's arguments on one parser."""
    try:
        ap.add_argument(*flags, **kw)
    except argparse.ArgumentError:
        pass


def run_probes(probes: list[ModuleType], args: argparse.Namespace, command: str) -> None:
    """Run probes in order into one section, print it and append it; a probe's run() may return a row, printed as
    JSON after the section (the last line: what a calling script reads)."""
    report = Report.for_args(args, command)
    rows = [probe.run(args, report) for probe in probes]
    report.finish()
    for row in rows:
        if row is not None:
            print(json.dumps(row))


def main(probe: ModuleType, argv: list[str] | None = None, command: str | None = None) -> None:
    """Run one probe module on its own: `python -m benchmarks.probes.NAME [flags]` (or `command`, a script that
    fronts it), or `--child JSON` (its CHILD called with those keyword arguments in this process; the row printed as
    JSON on the last line)."""
    ap = parser(probe.__doc__)
    if hasattr(probe, "CHILD"):
        ap.add_argument("--child", help=argparse.SUPPRESS)
    probe.add_arguments(ap)
    argv = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(argv)
    if getattr(args, "child", None):
        print(json.dumps(probe.CHILD(**json.loads(args.child))))
        return
    command = command or f"python -m {probe.__spec__.name if probe.__spec__ else probe.__name__}"
    run_probes([probe], args, shlex.join([*shlex.split(command), *argv]))
