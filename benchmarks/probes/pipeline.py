"""Our recording sampler against diffusers' StableDiffusionPipeline on the same tiny model (`python
scripts/bench.py`, part 2): the same steps, eta, guidance and batch, eager CPU and XLA CPU, ms per image after a
warm-up call (XLA: the compilation), both measured in one process, and their ratio.

Memory-model constants: none (speed).

    python scripts/bench.py --steps 10 --backends eager_cpu cpu
    python -m benchmarks.probes.pipeline --steps 2 --backends eager_cpu
"""

from __future__ import annotations

import sys
import time

from benchmarks import runner
from benchmarks.probes.training_runs import add_backends, add_overrides

TOPOLOGIES = ("eager_cpu", "cpu")  # the --backends it runs on


def add_arguments(ap) -> None:
    runner.add_shared(ap, "--steps", type=int, nargs="+", default=[10, 20, 50], help="sample.num_steps values")
    add_backends(ap)
    add_overrides(ap)


def compare(steps: int, topo: str, overrides: list[str] = ()) -> dict:
    """The child: ms per image of ours and of diffusers' pipeline, batch 8, CFG 5, eta 1, 3 calls after a warm-up."""
    from pathlib import Path

    import torch
    from diffusers import DDIMScheduler, StableDiffusionPipeline

    from ddpo_tpu.config.compose import compose_and_validate
    from ddpo_tpu.diffusion.ddim import DDIMTables
    from ddpo_tpu.diffusion.sampling import decode_to_uint8, make_denoise_step, sample_trajectory
    from ddpo_tpu.models.tiny import ensure_tiny_model
    from ddpo_tpu.runtime import make_runtime

    cfg = compose_and_validate(["+experiment=smoke", f"tpu_topology={topo}", f"sample.num_steps={steps}",
                                *overrides]).cfg
    rt = make_runtime(cfg)
    path = ensure_tiny_model(Path(cfg.model.cache_dir).expanduser())
    pipe = StableDiffusionPipeline.from_pretrained(str(path), safety_checker=None, requires_safety_checker=False)
    pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config)
    pipe = pipe.to(rt.device)
    pipe.set_progress_bar_config(disable=True)
    B, prompts = 8, ["a cat"] * 8
    g = torch.Generator().manual_seed(0)

    def ours():
        tok = lambda texts: pipe.tokenizer(texts, padding="max_length", max_length=pipe.tokenizer.model_max_length,
                                           truncation=True, return_tensors="pt").input_ids.to(rt.device)
        with torch.no_grad():
            cond, uncond = pipe.text_encoder(tok(prompts))[0], pipe.text_encoder(tok([""] * B))[0]
        tables = DDIMTables.from_scheduler(pipe.scheduler, steps, rt.device)
        shape = (B, 4, 8, 8)
        step = make_denoise_step(pipe.unet, tables, eta=1.0, guidance_scale=5.0)
        traj = sample_trajectory(step, steps, cond, uncond, torch.randn(shape, generator=g),
                                 torch.randn((steps, *shape), generator=g), rt=rt,
                                 sync_every=cfg.xla.sync_every_n_denoising_steps if topo != "eager_cpu" else 0)
        return rt.to_host(decode_to_uint8(pipe.vae, traj.sample))

    def theirs():
        out = pipe(prompts, num_inference_steps=steps, guidance_scale=5.0, eta=1.0, output_type="pt",
                   generator=g).images
        return rt.to_host((out * 255).round().to(torch.uint8))

    ms = {}
    for name, fn in (("ours", ours), ("diffusers", theirs)):
        fn()  # warm-up (XLA: compilation)
        t0 = time.perf_counter()
        for _ in range(3):
            fn()
        ms[name] = (time.perf_counter() - t0) / (3 * B) * 1000
    return {"backend": topo, "steps": steps, "ours_ms_per_image": round(ms["ours"], 2),
            "diffusers_ms_per_image": round(ms["diffusers"], 2),
            "diffusers_over_ours": round(ms["diffusers"] / ms["ours"], 2)}


CHILD = compare


def point(topo: str, steps: int, overrides: list[str] = ()) -> dict:
    """compare() in a process with the training process's variables for `topo`; a failure is a row."""
    from ddpo_tpu.config.compose import compose_and_validate
    from ddpo_tpu.env import runtime_variables

    env = runner.clean_env(**runtime_variables(compose_and_validate(["+experiment=smoke", f"tpu_topology={topo}",
                                                                     *overrides]).cfg))
    try:
        return runner.run_child(__spec__.name, env, steps=steps, topo=topo, overrides=list(overrides))
    except runner.ChildFailed as e:
        error = " ".join(str(e)[-800:].split()).replace("|", "/")
        return runner.progress({"backend": topo, "steps": steps, "error": error})


def run(args, report: runner.Report) -> None:
    rows = [point(topo, steps, args.overrides) for topo in args.backends if topo in TOPOLOGIES for steps in args.steps]
    report.add(f"Sampler vs diffusers StableDiffusionPipeline (tiny model, batch 8, CFG 5, eta 1):\n\n"
               f"{runner.table(rows)}")


if __name__ == "__main__":
    runner.main(sys.modules[__name__])
