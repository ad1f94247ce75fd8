"""What the compiled backward keeps on XLA, with and without activation checkpointing (part of `python
scripts/bench.py --checkpointing`): one compiled forward + backward (xla.step_compiler=dynamo, as the training
micro-step runs) of SD 1.4's UNet topology at narrow widths (model=sd14_topology's build: 32-64 channels but SD 1.4's
8 heads, so its attention scores are full size at latent^2 tokens), batch 1, float32, on XLA CPU through ddpo_tpu's
runtime, LoRA-like trainable to_q projections; two calls (the second replays). The process's peak resident memory
holds XLA's buffers: what the compiled backward keeps, which the eager probes cannot see.

Memory-model constants (ddpo_tpu/catalog/families.py): CKPT_XLA_SCORES_RATIO (0.51: peak RSS above the process's
~1.9 GiB baseline at 4096 tokens, 11.0 -> 5.6 GiB, checkpointed / not).

    python scripts/bench.py --checkpointing
    python -m benchmarks.probes.xla_checkpointing --latent 64
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from benchmarks import runner

# the tests' fast XLA CPU flags (tests/helpers FAST_XLA_FLAGS): compile time, not what the graphs keep
FAST_FLAGS = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true")


def xla_args(*flags: str) -> list[str]:
    """The probes' config: the smoke experiment on XLA CPU with sd14_topology and the fast flags (+ `flags`)."""
    return ["+experiment=smoke", "model=sd14_topology", "tpu_topology=cpu",
            "xla.flags=[" + ",".join(f'"{f}"' for f in (*FAST_FLAGS, *flags)) + "]"]


def xla_env(tmp: Path, *flags: str) -> dict[str, str]:
    """The training process's environment for xla_args(*flags): torch_xla in the child set up as the trainer's."""
    from ddpo_tpu.config.compose import compose_and_validate
    from ddpo_tpu.env import child_environment

    env = child_environment(compose_and_validate(xla_args(*flags)).cfg, tmp)
    return env | {"PYTHONPATH": runner.clean_env()["PYTHONPATH"]}


def add_arguments(ap) -> None:
    runner.add_shared(ap, "--latent", type=int, default=64, help="latent side (tokens = latent^2; 64: 512 px)")


def xla_probe(latent: int, checkpointed: bool) -> dict:
    """The child: two compiled forward + backward calls; the peak RSS, graphs, seconds, loss and gradient."""
    import torch

    from ddpo_tpu.config.compose import compose_and_validate
    from ddpo_tpu.models.tiny import SPECS, _build_unet
    from ddpo_tpu.runtime import make_runtime

    rt = make_runtime(compose_and_validate(xla_args()).cfg)
    torch.manual_seed(0)
    unet = _build_unet(SPECS["sd14_topology"]).requires_grad_(False)
    for name, param in unet.named_parameters():
        param.requires_grad_("to_q" in name)
    if checkpointed:
        unet.enable_gradient_checkpointing()
    unet.to(rt.device)
    x, t, text = (v.to(rt.device) for v in (torch.randn(1, 4, latent, latent), torch.tensor([500]),
                                             torch.randn(1, 77, 64)))
    loss_fn = rt.compile_step(lambda x, t, text: unet(x, t, text).sample.square().mean())
    seconds = []
    for _ in range(2):  # the second call replays the compiled graphs
        t0 = time.perf_counter()
        loss = loss_fn(x, t, text)
        loss.backward()
        rt.sync()
        grad = sum(float(p.grad.abs().sum()) for p in unet.parameters() if p.grad is not None)
        seconds.append(round(time.perf_counter() - t0, 1))
        unet.zero_grad(set_to_none=True)
    return {"model": "sd14_topology UNet (XLA CPU)", "tokens": latent ** 2, "checkpointed": checkpointed,
            "peak_rss_gib": runner.peak_rss_gib(), "graphs": rt.counters().compilations, "seconds": seconds,
            "loss": round(float(loss), 6), "grad_abs_sum": f"{grad:.6e}"}


CHILD = xla_probe


def probe_rows(latent: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        env = xla_env(Path(tmp))
        return [runner.run_child(__spec__.name, env, latent=latent, checkpointed=c) for c in (False, True)]


def describe(latent: int) -> str:
    return (f"XLA CPU (xla_probe: the compiled forward + backward of SD 1.4's UNet topology at narrow widths, 8 heads "
            f"at {latent ** 2} tokens, batch 1, two calls; the process's peak RSS holds XLA's buffers)")


def run(args, report: runner.Report) -> None:
    report.add(f"{describe(args.latent)}:\n\n{runner.table(probe_rows(args.latent))}")


if __name__ == "__main__":
    runner.main(sys.modules[__name__])
