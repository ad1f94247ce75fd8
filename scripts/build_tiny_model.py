#!/usr/bin/env python
"""Build the tiny random-weight Stable-Diffusion-shaped pipeline into OUT_DIR.

    python scripts/build_tiny_model.py OUT_DIR [--seed N]

OUT_DIR then loads like a real checkpoint: model.pretrained=OUT_DIR (ddpo_tpu.models.load_components).
"""

from __future__ import annotations

import argparse
import pathlib
import sys

try:
    import ddpo_tpu  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("out_dir", metavar="OUT_DIR", help="directory to write the diffusers checkpoint into")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    args = parser.parse_args(argv)

    from ddpo_tpu.models.tiny import TINY_MODEL_VERSION, build_tiny_pipeline

    out = build_tiny_pipeline(args.out_dir, seed=args.seed)
    print(f"tiny SD pipeline {TINY_MODEL_VERSION} (seed {args.seed}) written to {out.resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
