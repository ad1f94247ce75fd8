"""ddpo_tpu's benchmarks: one module per probe under benchmarks/probes/, a shared runner (benchmarks/runner.py) that
parses arguments, prints the tables and appends them, dated, with the machine and its load, to benchmarks/RESULTS.md.

    python scripts/bench.py --help                     # today's commands, a thin front over the probes
    python -m benchmarks.probes.sd3_activations --help # one probe on its own

Not shipped in the wheel (pyproject lists ddpo_tpu's packages only); run from the repo root.
"""
