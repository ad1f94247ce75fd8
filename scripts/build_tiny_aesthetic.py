#!/usr/bin/env python
"""Build the tiny random-weight CLIP + LAION-shaped aesthetic MLP into OUT_DIR.

    python scripts/build_tiny_aesthetic.py OUT_DIR [--seed N]

Then: reward=aesthetic reward.clip_model=OUT_DIR/clip reward.mlp_path=OUT_DIR/aesthetic_mlp.safetensors
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
    parser.add_argument("out_dir", metavar="OUT_DIR",
                        help="directory to write clip/ and aesthetic_mlp.safetensors into")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    args = parser.parse_args(argv)

    from ddpo_tpu.rewards.tiny_clip import TINY_AESTHETIC_VERSION, build_tiny_aesthetic

    clip_dir, mlp_path = build_tiny_aesthetic(args.out_dir, seed=args.seed)
    print(f"tiny aesthetic {TINY_AESTHETIC_VERSION} (seed {args.seed}) written:")
    print(f"  reward.clip_model={clip_dir.resolve()}")
    print(f"  reward.mlp_path={mlp_path.resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
