"""Activation checkpointing on the lazy path (`python scripts/bench.py --lazy-checkpointing`; xla.step_compiler=lazy:
forward and backward in one XLA graph) with the runtime's checkpoint function (torch_xla's: an optimization barrier
before each block's recomputation): what XLA CPU's compiler does with it. Barriers and exponentials (one per
softmax) in the gradient graph before and after optimisation, and the peak of XLA's buffer assignment, for 4
attention blocks and for SD 1.4's topology at 1024 tokens, with and without; one process each, XLA dumping its
graphs into a fresh directory.

Memory-model constants: none (it shows XLA CPU removes the barriers, so the lazy path's saving is not measurable
here; CKPT_XLA_SCORES_RATIO comes from the dynamo path, benchmarks/probes/xla_checkpointing.py).

    python scripts/bench.py --lazy-checkpointing  # about 5 minutes
    python -m benchmarks.probes.lazy_checkpointing --models blocks   # the cheapest probe: seconds
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

from benchmarks import runner
from benchmarks.probes.xla_checkpointing import xla_args, xla_env

MODELS = ("blocks", "sd14_topology")


def add_arguments(ap) -> None:
    runner.add_shared(ap, "--models", nargs="+", default=list(MODELS), choices=MODELS,
                      help="--lazy-checkpointing: blocks (4 attention blocks) and/or sd14_topology")


def lazy_probe(model: str, checkpointed: bool, dump: str) -> dict:
    """The child: one forward + backward on the lazy path (one XLA graph) through ddpo_tpu's runtime, its checkpoint
    function when `checkpointed`; XLA dumps the graph (xla.flags: --xla_dump_to=`dump`) before and after optimisation
    with its buffer assignment. model: "blocks" (4 residual self-attention blocks, 512 tokens, 16 wide) or
    "sd14_topology" (SD 1.4's UNet topology at narrow widths, 8 heads at 1024 tokens, trainable to_q)."""
    import torch

    from ddpo_tpu.config.compose import compose_and_validate
    from ddpo_tpu.runtime import make_runtime

    rt = make_runtime(compose_and_validate([*xla_args(), "xla.step_compiler=lazy"]).cfg)
    torch.manual_seed(0)
    if model == "blocks":
        class Block(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.q = torch.nn.Linear(16, 16)

            def forward(self, x):
                return x + (self.q(x) @ x.transpose(-1, -2)).softmax(-1) @ x

        blocks = torch.nn.ModuleList(Block() for _ in range(4)).to(rt.device)
        x = torch.randn(512, 16).to(rt.device)
        call = rt.checkpoint_function() if checkpointed else (lambda block, h: block(h))
        for block in blocks:
            x = call(block, x)
        x.square().mean().backward()
    else:
        from ddpo_tpu.models.tiny import SPECS, _build_unet

        unet = _build_unet(SPECS["sd14_topology"]).requires_grad_(False)
        for name, param in unet.named_parameters():
            param.requires_grad_("to_q" in name)
        if checkpointed:
            unet.enable_gradient_checkpointing(rt.checkpoint_function())
        unet.to(rt.device)
        x, t, text = (v.to(rt.device) for v in (torch.randn(1, 4, 32, 32), torch.tensor([500]),
                                                 torch.randn(1, 77, 64)))
        unet(x, t, text).sample.square().mean().backward()
    rt.sync()
    files = sorted(Path(dump).iterdir())
    largest = lambda suffix: max((f for f in files if f.name.endswith(suffix)), key=lambda f: f.stat().st_size)
    before, after = largest(".before_optimizations.txt").read_text(), largest("after_optimizations.txt").read_text()
    count = lambda text, op: len(re.findall(rf"\b{op}\(", text))
    peak = re.search(r"peak usage: ([\d ]+) bytes", largest("after_optimizations-buffer-assignment.txt").read_text())
    return {"model": model, "checkpointed": checkpointed,
            "barriers_before_opt": count(before, "opt-barrier"),
            "exponentials_before_opt": count(before, "exponential"),
            "barriers_after_opt": count(after, "opt-barrier"), "exponentials_after_opt": count(after, "exponential"),
            "buffer_peak_mib": round(int(peak.group(1).replace(" ", "")) / 2**20, 1)}


CHILD = lazy_probe


def run(args, report: runner.Report) -> None:
    rows = []
    for model in args.models:
        for checkpointed in (False, True):
            with tempfile.TemporaryDirectory() as tmp:
                dump = Path(tmp) / "dump"
                env = xla_env(Path(tmp), f"--xla_dump_to={dump}", "--xla_dump_hlo_as_text")
                rows.append(runner.run_child(__spec__.name, env, model=model, checkpointed=checkpointed,
                                             dump=str(dump)))
    report.add(
        "Activation checkpointing on the lazy path (xla.step_compiler=lazy: forward and backward in one XLA graph) "
        "with the runtime's checkpoint function (torch_xla's: an optimization barrier before each block's "
        "recomputation), XLA CPU with the tests' fast flags; counts in the largest graph (the gradients') before and "
        "after XLA's optimisation passes, and the peak of its buffer assignment (XLA's own liveness figure for the "
        "compiled program). Exponentials count softmaxes, but also SiLU/GELU's and the copies XLA makes when it "
        f"fuses: a clean count for the blocks only:\n\n{runner.table(rows)}")


if __name__ == "__main__":
    runner.main(sys.modules[__name__])
