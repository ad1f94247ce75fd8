"""What an SDE window saves (`python scripts/bench.py --sde-window`): Flow-GRPO on the tiny SD3 model (the
flow_grpo_smoke experiment, eager CPU, one process per run) with every step the SDE's and trained, then with windows
of a few steps (the ODE elsewhere, only the window trained, Flow-GRPO-Fast's random placement): training seconds of
the last epoch (after the first epoch's warm-up), trained timesteps per sample, and the training-time ratio to no
window. Sampling runs every step either way (the ODE costs what the SDE does), so only training shrinks.

Memory-model constants: none (speed).

    python scripts/bench.py --sde-window                  # about 12 minutes on 2 quiet cores
    python -m benchmarks.probes.sde_window --sizes 1 2 --steps 6
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from benchmarks import runner

RUN_ARGS = ["+experiment=flow_grpo_smoke", "num_epochs=2", "save_freq=2", "reward.host_workers=0",
            "sample.batch_size=8", "sample.num_batches_per_epoch=2", "train.batch_size=8",
            "train.gradient_accumulation_steps=2"]


def add_arguments(ap) -> None:
    runner.add_shared(ap, "--sizes", type=int, nargs="+", default=[1, 2, 3], help="window sizes (beside no window)")
    runner.add_shared(ap, "--window-steps", type=int, default=10, help="sample.num_steps of the window runs")
    runner.add_shared(ap, "--repeats", type=int, default=3,
                      help="rounds over the sizes, interleaved (a load that drifts hits every size alike); medians")


def run_point(size: int | None, steps: int, root: Path) -> dict:
    name = f"window_{size or 'none'}"
    window = [f"sample.sde_window.size={size}"] if size else []
    proc, wall = runner.run_train([*RUN_ARGS, f"sample.num_steps={steps}", *window, f"output_root={root}",
                                   f"run_name={name}"])
    if proc.returncode:
        return {"window": size or "none", "error": runner.failure(proc, 500)}
    last = runner.read_records(root / name, "epoch")[-1]
    trained = size or int(steps * 0.99)  # the experiment's train.timestep_fraction
    return {"window": size or "none", "steps": steps, "trained_timesteps": trained, "wall_s": round(wall, 1),
            "sampling_s": round(last["phases"]["sampling"]["seconds"], 2),
            "training_s": round(last["phases"]["training"]["seconds"], 2)}


def run(args, report: runner.Report) -> None:
    import statistics

    sizes = (None, *args.sizes)
    rounds: dict = {size: [] for size in sizes}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):  # none, 1, 2, none, 1, 2, ...
            for size in sizes:
                rounds[size].append(runner.progress(run_point(size, args.window_steps, Path(tmp) / str(r))))
    rows = []
    for size, runs in rounds.items():
        ok = [x for x in runs if "training_s" in x]
        if not ok:
            rows.append(runs[-1])
            continue
        median = lambda k: round(statistics.median(x[k] for x in ok), 2)
        rows.append({**ok[0], "runs": len(ok), "wall_s": median("wall_s"), "sampling_s": median("sampling_s"),
                     "training_s": median("training_s")})
    base = next((r for r in rows if r["window"] == "none" and "training_s" in r), None)
    for r in rows:
        if base and "training_s" in r:
            r["training_vs_none"] = round(r["training_s"] / base["training_s"], 3)
            r["trained_vs_none"] = round(r["trained_timesteps"] / base["trained_timesteps"], 3)
    report.add("SDE windows (flow_grpo_smoke on the tiny SD3 model, eager CPU, 16 samples and 2 optimizer steps an "
               f"epoch, {args.window_steps} steps; the last of 2 epochs, median of {args.repeats} interleaved "
               f"rounds):\n\n{runner.table(rows)}")


if __name__ == "__main__":
    import sys

    runner.main(sys.modules[__name__])
