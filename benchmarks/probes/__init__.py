"""One module per benchmark probe; each runs on its own (`python -m benchmarks.probes.NAME --help`) and under
scripts/bench.py's flags. Which probe measured which memory-model constant is in each module's docstring."""
