"""Host ms per step at the parity batch sizes against the chip's FLOP time (`python scripts/bench.py
--host-overhead`, its second part): a sampling step (4 samples, CFG) and a training micro-step (2 samples x K fused
timesteps, CFG, forward + backward, LoRA) of model=sd14_topology on XLA CPU, lazy and dynamo, the main thread's CPU
time per call; SD 1.4's FLOPs at full width and 512 px (FlopCounterMode on the meta device) at a v6e chip's peak and
at 40%; the v6e-8 images/s of +experiment=compressibility_parity that follow.

Memory-model constants: AUTO_CHECKPOINT_BELOW (the host/device ratio per K: 1.9 at K = 1, 1.29 at K = 2, 0.75 at
K = 5: `python scripts/bench.py --host-overhead --variants`; with checkpointing: `... --ks 2 --checkpointed`).

    python scripts/bench.py --host-overhead --variants --ks 1 2 5
    python -m benchmarks.probes.step_estimate --ks 1
"""

from __future__ import annotations

import statistics
import sys
import time

from benchmarks import runner

V6E_PEAK_FLOPS = 918e12  # bf16, per chip


def add_arguments(ap) -> None:
    runner.add_shared(ap, "--ks", type=int, nargs="+", default=[1, 2, 5],
                      help="fused timesteps for the parity estimate")
    runner.add_shared(ap, "--checkpointed", action="store_true",
                      help="the per-step estimate with activation checkpointing (dynamo only)")


def step_times(compiler: str, ks: list[int], checkpointed: bool = False) -> dict:
    """The child, on XLA CPU: host ms (thread_time) of a sampling step and of a training micro-step per K, median of
    8 calls after 2 warm-up calls. A call is handed to the runtime (torch_xla.sync() without waiting; dynamo: the
    replay is dispatched), so execution on XLA's threads is not counted."""
    import torch
    import torch_xla

    from ddpo_tpu.config.compose import compose_and_validate
    from ddpo_tpu.algorithms.ppo import ppo_loss
    from ddpo_tpu.diffusion.ddim import DDIMTables
    from ddpo_tpu.diffusion.sampling import guided_noise_pred, make_denoise_step
    from ddpo_tpu.models.from_config import load_from_config
    from ddpo_tpu.models.lora import make_trainable
    from ddpo_tpu.runtime import make_runtime

    cfg = compose_and_validate(["model=sd14_topology", "tpu_topology=cpu", f"xla.step_compiler={compiler}"]).cfg
    rt = make_runtime(cfg)
    c = load_from_config(cfg.model)
    make_trainable(c.unet, cfg.model)
    unet = c.unet.to(rt.device)
    for p in unet.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    T = 50
    tables = DDIMTables.from_scheduler(c.scheduler, T, rt.device)
    L, D = 77, unet.config.cross_attention_dim
    shape = (4, 8, 8)

    def timed(call, n=10):
        out = []
        for i in range(n):
            t0 = time.thread_time()
            call(i)
            rt.sync()
            out.append(time.thread_time() - t0)
            torch_xla.sync(wait=True)
        return round(1000 * statistics.median(out[2:]), 2)

    res = {}
    B = 4
    cond, uncond = torch.randn(B, L, D).to(rt.device), torch.randn(B, L, D).to(rt.device)
    step = rt.compile_step(make_denoise_step(unet, tables, eta=1.0, guidance_scale=5.0))
    x = [torch.randn(B, *shape).to(rt.device)]

    def sample_call(i):
        with torch.no_grad():
            idx = torch.full((B,), i % T, dtype=torch.long).to(rt.device)
            x[0], _ = step(x[0], idx, torch.randn(B, *shape).to(rt.device), cond, uncond)

    unet.eval()
    res["sampling_step_b4"] = timed(sample_call)
    unet.train()
    if checkpointed:
        unet.enable_gradient_checkpointing()
    B = 2
    for K in ks:
        emb, unc = torch.randn(B, L, D).to(rt.device), torch.randn(B * K, L, D).to(rt.device)

        def loss_fn(cur, nxt, lp_old, idx, cols):  # called within this iteration: K, emb, unc are its own
            f = lambda t: t.index_select(1, cols).reshape(B * K, *t.shape[2:])
            xj, nj, lpo, ij = f(cur), f(nxt), f(lp_old), f(idx)
            eps = guided_noise_pred(unet, xj, tables.timestep_at(ij), emb.repeat_interleave(K, dim=0), unc, 5.0)
            _, lp = tables.step(eps.float(), ij, xj, 1.0, prev_sample=nj)
            return ppo_loss(lp, lpo, torch.ones(B * K, device=lp.device), 1e-4, 5.0)[0]

        fn = rt.compile_step(loss_fn)
        cur, nxt = torch.randn(B, T, *shape).to(rt.device), torch.randn(B, T, *shape).to(rt.device)
        lp_old = torch.randn(B, T).to(rt.device)
        idx = torch.arange(T).expand(B, T).contiguous().to(rt.device)

        def train_call(i):
            cols = torch.arange((i * K) % T, (i * K) % T + K).to(rt.device)
            (fn(cur, nxt, lp_old, idx, cols) / 4).backward()

        res[f"train_micro_step_b2_k{K}"] = timed(train_call)
    return res


CHILD = step_times


def sd14_flops(ks: list[int], checkpointed: bool = False) -> dict:
    """FLOPs at SD 1.4's full widths and 512 px (FlopCounterMode on the meta device: no memory, no compute);
    `checkpointed`: with diffusers' gradient checkpointing (the backward's recomputation counted)."""
    import torch
    from peft import LoraConfig
    from torch.utils.flop_counter import FlopCounterMode

    from ddpo_tpu.models import tiny

    spec = tiny.SPECS["sd14_random"]
    with torch.device("meta"):
        unet = tiny._build_unet(spec)
        vae = tiny._build_vae(spec)
    unet.requires_grad_(False)
    unet.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    if checkpointed:
        unet.enable_gradient_checkpointing()

    def count(fn) -> float:
        with FlopCounterMode(display=False) as fc:
            fn()
        return float(fc.get_total_flops())

    def unet_eval(n: int, backward: bool = False):
        x = torch.randn(n, 4, 64, 64, device="meta")
        emb = torch.randn(n, 77, 768, device="meta")
        with torch.set_grad_enabled(backward):
            out = unet(x, torch.full((n,), 500, device="meta"), encoder_hidden_states=emb).sample
            if backward:
                out.float().square().mean().backward()

    res = {"sampling_step_b4": count(lambda: unet_eval(8))}  # 4 samples with CFG
    for k in ks:
        res[f"train_micro_step_b2_k{k}"] = count(lambda: unet_eval(4 * k, backward=True))  # 2 x k x CFG
    with torch.no_grad():
        res["vae_decode_per_image"] = count(lambda: vae.decode(torch.randn(1, 4, 64, 64, device="meta")))
    return res


def host_vs_device(ks: list[int], checkpointed: bool = False) -> tuple[list[dict], dict]:
    """Per step at parity batch sizes: host ms (sd14_topology, XLA CPU, lazy and dynamo) against device ms (SD 1.4
    FLOPs at v6e peak and at 40%); and the v6e-8 images/s of +experiment=compressibility_parity that follow."""
    from ddpo_tpu.config.compose import compose_and_validate
    from ddpo_tpu.env import runtime_variables

    flops = sd14_flops(ks, checkpointed)
    env = runner.clean_env(**runtime_variables(compose_and_validate(["tpu_topology=cpu"]).cfg))
    compilers = ("dynamo",) if checkpointed else ("lazy", "dynamo")  # lazy: the "before", unchecked
    # lazy tracing, the "before", only unfused: each lazy training graph compiles for minutes here
    probe_ks = {c: [1] if c == "lazy" else ks for c in compilers}
    host = {c: runner.run_child(__spec__.name, env, compiler=c, ks=probe_ks[c], checkpointed=checkpointed)
            for c in compilers}
    rows = []
    # per chip and epoch at parity on a v6e-8: 4 x 8 batches x 50 steps = 400 sampling steps; 32 samples / 2 per
    # train batch x 50 timesteps = 800 trained timesteps; 32 VAE decodes; 256 images per epoch over 8 chips
    for compiler in compilers:
        for k in probe_ks[compiler]:
            tkey = f"train_micro_step_b2_k{k}"
            dev_s = lambda u: (400 * flops["sampling_step_b4"] + 800 / k * flops[tkey]
                               + 32 * flops["vae_decode_per_image"]) / (V6E_PEAK_FLOPS * u)
            host_s = 400 * host[compiler]["sampling_step_b4"] / 1000 + 800 / k * host[compiler][tkey] / 1000
            dev_ms = lambda key, u: flops[key] / (V6E_PEAK_FLOPS * u) * 1000
            s_key = "sampling_step_b4"
            rows.append({
                "compiler": compiler, "timesteps_per_micro_step": k, "activation_checkpointing": checkpointed,
                "sampling_host_ms": host[compiler][s_key],
                "sampling_device_ms_peak_40%": f"{dev_ms(s_key, 1):.1f} / {dev_ms(s_key, .4):.1f}",
                "sampling_host/device_40%": round(host[compiler][s_key] / dev_ms(s_key, .4), 2),
                "train_host_ms": host[compiler][tkey],
                "train_device_ms_peak_40%": f"{dev_ms(tkey, 1):.1f} / {dev_ms(tkey, .4):.1f}",
                "train_host/device_40%": round(host[compiler][tkey] / dev_ms(tkey, .4), 2),
                "epoch_host_s": round(host_s, 1), "epoch_device_s_40%": round(dev_s(.4), 1),
                "v6e8_images_per_s_40%": round(256 / max(host_s, dev_s(.4)), 2),
                "v6e8_images_per_s_peak": round(256 / max(host_s, dev_s(1)), 2),
            })
    return rows, {k: round(v / 1e12, 2) for k, v in flops.items()}


def run(args, report: runner.Report) -> None:
    rows, tf = host_vs_device(args.ks, args.checkpointed)
    for row in rows:
        runner.progress(row)
    report.add(
        f"Per step at the parity batch sizes (sd14_topology host time, median of 8 calls; device time from SD 1.4's "
        f"FLOPs at 512 px, TFLOP {tf}, on one v6e chip at 918 TFLOP/s bf16 peak and at 40%; an estimate, no TPU "
        f"measured). The v6e-8 images/s of +experiment=compressibility_parity are 256 / max(host-bound s, FLOP-bound "
        f"s) per epoch (400 sampling steps, 800 trained timesteps, 32 VAE decodes per chip); the 8xA100 reference "
        f"runs 1.8 images/s:\n\n{runner.table(rows)}")


if __name__ == "__main__":
    runner.main(sys.modules[__name__])
