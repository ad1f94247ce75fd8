"""The compute AWM needs against Flow-GRPO for the same reward (`python scripts/bench.py --awm-vs-grpo`): the
awm_smoke and flow_grpo_smoke experiments (the tiny SD3 model, JPEG compressibility, eager CPU, one process each, as
each is configured) to their ends; the target is the reward GRPO reaches (the mean of its last 3 epochs); for each, the
first epoch whose 2-epoch mean reward reaches it, the samples drawn until then and the transformer FLOPs spent (counted
per sample-forward and per forward+backward with torch's FlopCounterMode on the tiny transformer, times the forwards
each algorithm runs an epoch: sampling steps, trained times, AWM's lp_old pass, GRPO's reference forward), and the
seconds of sampling + training until then (both runs in the probe's process on one thread, one after the other).
The VAE decode and the reward are the same per sample for both and left out.

The AWM paper's figure (24-34x less compute than Flow-GRPO for the same reward) is on SD 3.5 with real rewards; this
is the tiny random model on a toy reward, on this machine: a smoke-sized check of the direction, not the paper's figure.

Memory-model constants: none (compute counts and speed).

    python scripts/bench.py --awm-vs-grpo          # about 4 minutes on 2 quiet cores
    python -m benchmarks.probes.awm_vs_grpo --awm-epochs 10
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from benchmarks import runner

COMMON = ["reward.host_workers=0", "model.cache_dir={cache}"]


def add_arguments(ap) -> None:
    runner.add_shared(ap, "--awm-epochs", type=int, default=10, help="epochs of awm_smoke (its own: 10)")
    runner.add_shared(ap, "--grpo-epochs", type=int, default=20, help="epochs of flow_grpo_smoke (its own: 20)")


def forward_flops(cache: str) -> tuple[float, float]:
    """(FLOPs of one sample's transformer forward, of its forward + backward through the LoRA weights), tiny SD3."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from ddpo_tpu.config.compose import compose_and_validate
    from ddpo_tpu.families import load_family
    from ddpo_tpu.runtime import make_runtime

    cfg = compose_and_validate(["+experiment=awm_smoke", f"model.cache_dir={cache}"]).cfg
    fam = load_family(cfg, make_runtime(cfg))
    velocity = fam.make_velocity(None)
    x0 = torch.randn(1, *fam.latent_shape)
    cond = fam.encode(["a cat"])
    with torch.no_grad(), FlopCounterMode(display=False) as fwd:
        velocity(x0, torch.randn_like(x0), torch.tensor([2]), cond)
    with FlopCounterMode(display=False) as both:
        velocity(x0, torch.randn_like(x0), torch.tensor([2]), cond)[0].square().mean().backward()
    return float(fwd.get_total_flops()), float(both.get_total_flops())


def epoch_costs(cfg, algo: str, F: float, FB: float) -> tuple[int, float]:
    """(samples an epoch, transformer FLOPs an epoch) from the run's config."""
    s, t, a = cfg["sample"], cfg["train"], cfg["algorithm"]
    n = s["batch_size"] * s["num_batches_per_epoch"]
    sampling = n * s["num_steps"] * F  # guidance 1 in both smokes: one forward a step
    if algo == "awm":
        K, B, G = a["train_timesteps"], t["batch_size"], t["gradient_accumulation_steps"]
        old = max(n - G * B, 0) * K * F  # lp_old of the batches after the first optimizer step
        ref = n * K * F * ((a["kl_beta"] > 0) + (a["kl_beta"] > 0 and a["ema_beta"] > 0))
        return n, sampling + n * K * FB + old + ref
    T = int(s["num_steps"] * t["timestep_fraction"])
    return n, sampling + n * T * FB + n * T * F * (a["kl_beta"] > 0)


def run_point(algo: str, epochs: int, root: Path, cache: str) -> dict:
    """One smoke run in this process on one thread (as the tests run them: the training process's default threads
    contend badly on a loaded machine), to its end."""
    import time
    from types import SimpleNamespace

    import torch

    from ddpo_tpu.config.compose import compose_and_validate
    from ddpo_tpu.training import loop
    from ddpo_tpu.rundir.files import RunDir
    from ddpo_tpu.runtime import make_runtime

    torch.set_num_threads(1)
    experiment = {"awm": "awm_smoke", "grpo": "flow_grpo_smoke"}[algo]
    v = compose_and_validate([f"+experiment={experiment}", f"num_epochs={epochs}", f"save_freq={epochs}",
                              *(o.format(cache=cache) for o in COMMON)])
    (root / algo).mkdir(parents=True)
    t0 = time.perf_counter()
    loop.Trainer(v.cfg, make_runtime(v.cfg), RunDir(root / algo), tree=v.tree,
                 stop=SimpleNamespace(requested=False)).fit()
    wall = time.perf_counter() - t0
    epochs_ = runner.read_records(root / algo, "epoch")
    seconds = [e["phases"]["sampling"]["seconds"] + e["phases"]["training"]["seconds"] for e in epochs_]
    return {"algorithm": algo, "wall_s": round(wall, 1), "rewards": [e["reward_mean"] for e in epochs_],
            "seconds": seconds, "cfg": v.cfg.model_dump()}


def reached(rewards: list[float], rise: float) -> int | None:
    """The first epoch e >= 1 whose mean of epochs e-1 and e is `rise` above epoch 0's reward."""
    return next((e for e in range(1, len(rewards)) if (rewards[e - 1] + rewards[e]) / 2 - rewards[0] >= rise), None)


def table(points: dict, F: float, FB: float) -> tuple[list[dict], str]:
    """The rows and the ratio line from the two runs' per-epoch rewards and configs."""
    g = points["grpo"]["rewards"]
    rise = sum(g[-3:]) / 3 - g[0]
    rows = []
    for algo, p in points.items():
        n, flops = epoch_costs(p["cfg"], algo, F, FB)
        e = reached(p["rewards"], rise)
        row = {"algorithm": algo, "samples_per_epoch": n, "gflops_per_epoch": round(flops / 1e9, 2),
               "epoch_0_reward": round(p["rewards"][0], 4), "last_reward": round(p["rewards"][-1], 4),
               "target_rise": round(rise, 4), "reached_at_epoch": e if e is not None else "no"}
        if e is not None:
            row.update({"samples": n * (e + 1), "gflops": round(flops * (e + 1) / 1e9, 1),
                        "seconds": round(sum(p["seconds"][:e + 1]), 1)})
        rows.append(row)
    g_, a = rows
    ratio = ""
    if "gflops" in a and "gflops" in g_:
        ratio = (f"\n\nTo GRPO's rise: AWM drew {g_['samples'] / a['samples']:.1f}x fewer samples and spent "
                 f"{g_['gflops'] / a['gflops']:.1f}x fewer transformer FLOPs ({g_['seconds'] / a['seconds']:.1f}x "
                 f"fewer sampling + training seconds).")
    return rows, ratio


def run(args, report: runner.Report) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        cache = str(Path(tmp) / "models")
        points = {a: runner.progress(run_point(a, n, Path(tmp), cache))
                  for a, n in (("grpo", args.grpo_epochs), ("awm", args.awm_epochs))}
        F, FB = forward_flops(cache)
    rows, ratio = table(points, F, FB)
    report.add("AWM vs Flow-GRPO to the same reward (awm_smoke and flow_grpo_smoke as configured: tiny SD3, JPEG "
               f"compressibility, eager CPU; GRPO samples with the SDE, AWM with the ODE, so their epoch-0 rewards "
               f"differ: the target is a rise, GRPO's (its last 3 epochs' mean over its epoch 0); reached: the first "
               f"epoch whose 2-epoch mean is that far above the run's epoch 0; {F / 1e6:.1f} MFLOPs a "
               f"sample-forward, {FB / 1e6:.1f} a forward+backward):\n\n{runner.table(rows)}{ratio}")


if __name__ == "__main__":
    import sys

    runner.main(sys.modules[__name__])
