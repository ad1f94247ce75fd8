"""Run a reference's own train script, unmodified, and time its phases from outside (scripts/bench_accelerator.py
--side-by-side starts it: `python benchmarks/reference_harness.py --json OUT [--stop-after N] -- SCRIPT ARGS...`,
from the reference's clone, with the reference's own diffusers first on PYTHONPATH).

Both references (kvablack/ddpo-pytorch scripts/train.py, yifan123/flow_grpo scripts/train_sd3.py) print no timings,
but wrap every phase of an epoch in a tqdm bar with a fixed description: "Epoch N: sampling", "Waiting for rewards",
"Epoch N.M: training" (and flow_grpo's "Eval: "). They bind `tqdm.tqdm` at import, so replacing it first lets each
bar's loop be timed: the device is synchronized before the first item and after the last, and the wall interval is
recorded under the bar's description. Nothing else of the script changes. flow_grpo loops forever (`while True`), so
`--stop-after N` ends the run when the bar "Epoch N: sampling" would start. Python 3.12 has no `imp` module, which
both references' config files import for `imp.load_source`: a stand-in with that one function is provided when the
interpreter lacks it.

The JSON written: the phases (description, start, end: seconds since the harness started), the seconds until the
first phase (loading, moving to the device), the device's peak allocated memory, the device, and the versions of
torch, CUDA, diffusers, transformers, accelerate and peft the script ran with.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import runpy
import sys
import time
import traceback
import types
from pathlib import Path

T0 = time.perf_counter()


class StopBench(BaseException):
    """Raised inside the script's sampling loop after the epochs asked for (a BaseException: no `except Exception`
    in the script swallows it)."""


def _sync() -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def install_imp() -> None:
    """`imp.load_source` for Python >= 3.12 (removed there), as the references' config files call it."""
    if importlib.util.find_spec("imp") is not None:
        return
    imp = types.ModuleType("imp")

    def load_source(name: str, path: str):
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module

    imp.load_source = load_source
    sys.modules["imp"] = imp


def time_tqdm_bars(phases: list[dict], stop_after: int | None) -> None:
    """Replace tqdm.tqdm with a subclass whose iteration records (desc, start, end) for every bar but the inner
    per-timestep ones."""
    import tqdm

    base = tqdm.tqdm

    class TimedBar(base):
        def __iter__(self):
            desc = str(self.desc or "")
            if desc.startswith("Timestep"):
                yield from super().__iter__()
                return
            if stop_after is not None and desc == f"Epoch {stop_after}: sampling":
                raise StopBench
            _sync()
            start = time.perf_counter() - T0
            yield from super().__iter__()
            _sync()
            phases.append({"desc": desc, "start": round(start, 3), "end": round(time.perf_counter() - T0, 3)})

    tqdm.tqdm = TimedBar


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    import torch

    out = {"torch": torch.__version__, "cuda": torch.version.cuda}
    for name in ("diffusers", "transformers", "accelerate", "peft"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    out["diffusers_from"] = str(Path(importlib.util.find_spec("diffusers").origin).parent.parent)
    return out


def device_facts() -> dict:
    import torch

    if not torch.cuda.is_available():
        return {"device": "cpu", "peak_device_gib": None}
    return {"device": torch.cuda.get_device_name(0),
            "peak_device_gib": round(torch.cuda.max_memory_allocated() / 2 ** 30, 2),
            "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2 ** 30, 2)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, required=True, help="where the phases and facts are written")
    ap.add_argument("--stop-after", type=int, help="end the run when epoch N's sampling would start")
    ap.add_argument("script", help="the reference's train script (run as `python SCRIPT ARGS`)")
    ap.add_argument("args", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    phases: list[dict] = []
    install_imp()
    time_tqdm_bars(phases, a.stop_after)
    script = str(Path(a.script).resolve())
    sys.argv = [a.script, *[x for x in a.args if x != "--"]]
    sys.path[0] = str(Path(script).parent)  # as `python SCRIPT` sets it
    outcome, code = "completed", 0
    try:
        runpy.run_path(script, run_name="__main__")
    except StopBench:
        outcome = f"stopped before epoch {a.stop_after}"
    except SystemExit as stop:  # absl's app.run exits
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        outcome = "completed" if code == 0 else f"exited {stop.code}"
    except BaseException as exc:  # noqa: BLE001  (recorded in the JSON, traceback on stderr)
        traceback.print_exc()
        outcome, code = f"failed: {type(exc).__name__}: {exc}"[:2000], 1
    record = {"outcome": outcome, "phases": phases, "wall_s": round(time.perf_counter() - T0, 3),
              **device_facts(), "versions": versions()}
    a.json.write_text(json.dumps(record, indent=1))
    print(f"reference_harness: {outcome}; {len(phases)} phases timed -> {a.json}", file=sys.stderr, flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
