"""The digits demo, measured: `+experiment=digits` trained, and the same run with a frozen policy (learning rate
1e-9: the same prompts and noise, a policy that does not move) as the control; prints the reward before and after
and the minutes each took, and draws the README's figures (before/after grid from the evaluation batches, which use
fixed prompts and fixed noise in both runs, and the reward curves of both).

    python scripts/digits_demo.py --out /tmp/digits [--algorithm grpo] [--epochs 15] [overrides ...]

Runs in this process on one CPU thread (as tests/learning/test_digits_learns.py does): on a shared 2-core machine that
is faster than the training process's default threads. The first call builds the model and the classifier once.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GRPO = ["algorithm=grpo", "algorithm.group_size=8", "algorithm.kl_beta=0", "sample.num_batches_per_epoch=4"]


def train(out: Path, overrides: list[str]) -> dict:
    """One in-process run into `out`; its epoch rewards, eval rewards and minutes."""
    import torch

    from ddpo_tpu.config.compose import compose_and_validate
    from ddpo_tpu.training import loop
    from ddpo_tpu.display.plot import curves, read_metrics
    from ddpo_tpu.rundir.files import RunDir
    from ddpo_tpu.runtime import make_runtime

    torch.set_num_threads(1)
    v = compose_and_validate(["+experiment=digits", *overrides])
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    trainer = loop.Trainer(v.cfg, make_runtime(v.cfg), RunDir(out), tree=v.tree,
                           stop=SimpleNamespace(requested=False))
    trainer.fit()
    train_pts, eval_pts = curves(read_metrics(out / "metrics.jsonl"))
    return {"minutes": round((time.monotonic() - t0) / 60, 2), "epochs": train_pts, "evals": eval_pts}


def side_by_side(before: Path, after: Path, out: Path, labels=("frozen policy", "after training"), scale=4) -> Path:
    from PIL import Image, ImageDraw, ImageFont

    a, b = Image.open(before).convert("RGB"), Image.open(after).convert("RGB")
    a = a.resize((a.width * scale, a.height * scale), Image.NEAREST)
    b = b.resize((b.width * scale, b.height * scale), Image.NEAREST)
    pad, top = 16, 28
    img = Image.new("RGB", (a.width + b.width + 3 * pad, max(a.height, b.height) + top + pad), (255, 255, 255))
    img.paste(a, (pad, top))
    img.paste(b, (2 * pad + a.width, top))
    d = ImageDraw.Draw(img)
    font = ImageFont.load_default(size=15)
    d.text((pad, 6), labels[0], fill=(0, 0, 0), font=font)
    d.text((2 * pad + a.width, 6), labels[1], fill=(0, 0, 0), font=font)
    img.save(out)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--algorithm", choices=("ddpo", "grpo"), default="ddpo")
    p.add_argument("--figures", type=Path, default=None, help="write the README figures into this directory")
    p.add_argument("--no-control", action="store_true")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    extra = (GRPO if args.algorithm == "grpo" else []) + args.overrides
    runs = {"trained": train(args.out / "trained", extra)}
    if not args.no_control:
        runs["control"] = train(args.out / "control", [*extra, "train.learning_rate=1e-9"])
    for name, r in runs.items():
        e = r["epochs"]
        print(f"{name}: {r['minutes']} min, reward epoch {e[0][0]} {e[0][1]:.3f} -> epoch {e[-1][0]} {e[-1][1]:.3f} "
              f"(last 3 epochs {sum(x[1] for x in e[-3:]) / 3:.3f}); eval "
              + ", ".join(f"{ep}: {m:.3f}" for ep, m, _ in r["evals"]))
    (args.out / "summary.json").write_text(json.dumps(runs, indent=1) + "\n")
    if args.figures is not None and "control" in runs:
        from ddpo_tpu.display import plot

        args.figures.mkdir(parents=True, exist_ok=True)
        last = runs["trained"]["evals"][-1][0]
        side_by_side(args.out / "control" / "samples" / f"eval_{last:04d}.png",
                     args.out / "trained" / "samples" / f"eval_{last:04d}.png",
                     args.figures / f"digits_{args.algorithm}_before_after.png",
                     labels=("frozen policy (the pretrained model)",
                             f"after {last + 1} epochs of {args.algorithm.upper()}"))
        plot.draw(args.figures / f"digits_{args.algorithm}_reward_curve.png", runs["trained"]["epochs"],
                  runs["trained"]["evals"], title=f"+experiment=digits ({args.algorithm})",
                  control=runs["control"]["epochs"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
