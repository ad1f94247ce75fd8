#!/usr/bin/env python
"""Benchmark the XLA discipline and speed on this machine; prints a table and appends it, dated, with the machine, to
benchmarks/RESULTS.md.

Part 1, through the real launcher (one training process per run): for eager CPU, XLA CPU (one device) and XLA CPU SPMD
x4, and sample.num_steps in {10, 20, 50}: compilations in epoch 0 and in epochs 1-2, host transfers per epoch,
sampling ms per denoising step and training ms per micro-step (both from epoch 2, after compilation), and the training
state (weights, gradients, Adam moments) one device holds; plus SPMD x4 as a dp 2 x fsdp 2 mesh.
Part 2: our recording sampler against diffusers' StableDiffusionPipeline on the same tiny model (same steps, eta,
guidance, batch), eager and XLA, time per image after a warm-up call, as a ratio measured in the same process.

Host overhead at SD 1.4's topology (--host-overhead, docs/performance.md): training runs of model=sd14_topology on
XLA CPU, lazy tracing vs compiled steps and fused timesteps, main-thread CPU and wall seconds per steady-state epoch;
then host ms per step at the parity batch sizes against SD 1.4's FLOPs on a v6e chip, and the v6e-8 images/s implied.
Full width (--full-width): one epoch of model=sd14_random (SD 1.4 at 860M UNet parameters) on eager and XLA CPU.

    python scripts/bench.py                  # parts 1 and 2 (about 35 minutes on 2 CPU cores)
    python scripts/bench.py --steps 10 --backends eager_cpu cpu --no-pipeline
    python scripts/bench.py --host-overhead  # about 50 minutes
    python scripts/bench.py --host-overhead --variants   # only the per-step estimate (about 12 minutes)
    python scripts/bench.py --full-width     # about 20 minutes, ~10 GiB of memory
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

RUN_ARGS = ["+experiment=smoke", "num_epochs=3", "save_freq=3", "reward.host_workers=0",
            "sample.num_batches_per_epoch=1", "train.gradient_accumulation_steps=2"]
PER_BACKEND = {  # global batch 8 for sampling, 4 for training on every backend
    "eager_cpu": ["tpu_topology=eager_cpu"],
    "cpu": ["tpu_topology=cpu"],
    "cpu_spmd4": ["tpu_topology=cpu_spmd4", "sample.batch_size=2", "train.batch_size=1"],
    # the same mesh as dp 2 x fsdp 2: weights, gradients and Adam moments split in two
    "cpu_spmd4_fsdp2": ["tpu_topology=cpu_spmd4", "tpu_topology.mesh.dp=2", "tpu_topology.mesh.fsdp=2",
                        "sample.batch_size=2", "train.batch_size=1"],
}


def clean_env() -> dict[str, str]:
    from ddpo_tpu.launch.env import OWNED_VARIABLES

    env = {k: v for k, v in os.environ.items() if k not in OWNED_VARIABLES}
    env["PYTHONPATH"] = str(REPO)
    return env


def run_point(backend: str, steps: int, root: Path) -> dict:
    args = [*RUN_ARGS, *PER_BACKEND[backend], f"sample.num_steps={steps}", f"output_root={root}",
            f"run_name={backend}_{steps}"]
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "ddpo_tpu.train", *args], env=clean_env(), cwd=REPO,
                          capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode:
        return {"backend": backend, "steps": steps, "error": proc.stdout[-500:] + proc.stderr[-500:]}
    recs = [json.loads(line) for line in (root / f"{backend}_{steps}" / "metrics.jsonl").read_text().splitlines()]
    epochs = [r for r in recs if r["kind"] == "epoch"]
    layout = next(r for r in recs if r.get("event") == "state_layout")
    last = epochs[-1]["phases"]
    micro = (8 // 4) * steps  # train batches per epoch x train timesteps
    return {
        "backend": backend, "steps": steps, "wall_s": round(wall, 1),
        "compilations_epoch0": epochs[0]["new_compilations"],
        "compilations_epochs1_2": sum(e["new_compilations"] for e in epochs[1:]),
        # programs torch_xla compiles to replicate a sharded tensor (on CPU: the inputs of the allowed fallback)
        "replicate_compilations_epochs1_2": sum(e.get("new_replicate_compilations", 0) for e in epochs[1:]),
        "state_mib_per_device": round(layout["bytes_per_device"] / 2**20, 2),
        "host_transfers_per_epoch": sum(p["host_transfers"] for p in last.values()),
        "sampling_ms_per_step": round(1000 * last["sampling"]["seconds"] / steps, 2),
        "training_ms_per_microstep": round(1000 * last["training"]["seconds"] / micro, 2),
    }


PIPELINE_PROBE = r"""
import json, sys, time
import torch
from ddpo_tpu.config.compose import compose_and_validate
from ddpo_tpu.runtime import make_runtime
steps, topo = int(sys.argv[1]), sys.argv[2]
v = compose_and_validate(["+experiment=smoke", f"tpu_topology={topo}", f"sample.num_steps={steps}"])
rt = make_runtime(v.cfg)
from diffusers import DDIMScheduler, StableDiffusionPipeline
from ddpo_tpu.diffusion.ddim import DDIMTables
from ddpo_tpu.diffusion.sampling import decode_to_uint8, make_denoise_step, sample_trajectory
from ddpo_tpu.models.tiny import ensure_tiny_model
from pathlib import Path
path = ensure_tiny_model(Path(v.cfg.model.cache_dir).expanduser())
pipe = StableDiffusionPipeline.from_pretrained(str(path), safety_checker=None, requires_safety_checker=False)
pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config)
pipe = pipe.to(rt.device)
pipe.set_progress_bar_config(disable=True)
B, prompts = 8, ["a cat"] * 8
g = torch.Generator().manual_seed(0)

def ours():
    ids = pipe.tokenizer(prompts, padding="max_length", max_length=pipe.tokenizer.model_max_length,
                         truncation=True, return_tensors="pt").input_ids.to(rt.device)
    neg = pipe.tokenizer([""] * B, padding="max_length", max_length=pipe.tokenizer.model_max_length,
                         return_tensors="pt").input_ids.to(rt.device)
    with torch.no_grad():
        cond, uncond = pipe.text_encoder(ids)[0], pipe.text_encoder(neg)[0]
    tables = DDIMTables.from_scheduler(pipe.scheduler, steps, rt.device)
    shape = (B, 4, 8, 8)
    step = make_denoise_step(pipe.unet, tables, eta=1.0, guidance_scale=5.0)
    traj = sample_trajectory(step, steps, cond, uncond, torch.randn(shape, generator=g),
                             torch.randn((steps, *shape), generator=g), rt=rt,
                             sync_every=v.cfg.xla.sync_every_n_denoising_steps if topo != "eager_cpu" else 0)
    return rt.to_host(decode_to_uint8(pipe.vae, traj.latents[:, -1]))

def theirs():
    out = pipe(prompts, num_inference_steps=steps, guidance_scale=5.0, eta=1.0, output_type="pt", generator=g).images
    return rt.to_host((out * 255).round().to(torch.uint8))

res = {}
for name, fn in (("ours", ours), ("diffusers", theirs)):
    fn()  # warm-up (XLA: compilation)
    t0 = time.perf_counter()
    for _ in range(3):
        fn()
    res[name] = (time.perf_counter() - t0) / (3 * B) * 1000
print(json.dumps(res))
"""


def pipeline_point(topo: str, steps: int) -> dict:
    from ddpo_tpu.config.compose import compose_and_validate
    from ddpo_tpu.launch.env import runtime_variables

    env = clean_env()
    env.update(runtime_variables(compose_and_validate(["+experiment=smoke", f"tpu_topology={topo}"]).cfg))
    proc = subprocess.run([sys.executable, "-c", PIPELINE_PROBE, str(steps), topo], env=env, cwd=REPO,
                          capture_output=True, text=True)
    if proc.returncode:
        return {"backend": topo, "steps": steps, "error": proc.stderr[-800:]}
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"backend": topo, "steps": steps, "ours_ms_per_image": round(res["ours"], 2),
            "diffusers_ms_per_image": round(res["diffusers"], 2),
            "diffusers_over_ours": round(res["diffusers"] / res["ours"], 2)}


# --- host overhead at Stable Diffusion 1.4's topology (model=sd14_topology) -------------------------------------------
# The workload: 8 denoising steps, 4 x 2 samples, train batch 2 with 2 accumulation steps, LoRA: 16 sampling
# steps and 32 trained timesteps per epoch, on XLA CPU (one device).
HOST_ARGS = ["model=sd14_topology", "tpu_topology=cpu", "sample.num_steps=8", "sample.batch_size=4",
             "sample.num_batches_per_epoch=2", "train.batch_size=2", "train.gradient_accumulation_steps=2",
             "num_epochs=3", "save_freq=3", "prompts=simple_animals", "reward=jpeg_compressibility"]
HOST_VARIANTS = {  # name -> overrides
    "lazy_k1": ["xla.step_compiler=lazy", "train.timesteps_per_micro_step=1"],   # before this change
    "lazy_k8": ["xla.step_compiler=lazy", "train.timesteps_per_micro_step=8"],
    "dynamo_k1": ["xla.step_compiler=dynamo", "train.timesteps_per_micro_step=1"],
    "dynamo_k2": ["xla.step_compiler=dynamo", "train.timesteps_per_micro_step=2"],
    "dynamo_k8": ["xla.step_compiler=dynamo", "train.timesteps_per_micro_step=8"],
}


def host_run(name: str, root: Path) -> dict:
    """One training process; per steady-state epoch (1 and 2): wall seconds and the main thread's CPU seconds
    (time.thread_time() around each phase in the trainer: tracing, dispatch, Python; XLA executes on other threads)."""
    args = [*HOST_ARGS, *HOST_VARIANTS[name], f"output_root={root}", f"run_name={name}"]
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "ddpo_tpu.train", *args], env=clean_env(), cwd=REPO,
                          capture_output=True, text=True)
    if proc.returncode:
        return {"variant": name, "error": proc.stdout[-800:] + proc.stderr[-800:]}
    recs = [json.loads(line) for line in (root / name / "metrics.jsonl").read_text().splitlines()]
    epochs = [r for r in recs if r["kind"] == "epoch"]
    steady = epochs[1:]
    work = ("sampling", "reward", "advantages", "training")  # the checkpoint of the last epoch is left out
    med = lambda xs: round(statistics.median(xs), 2)
    return {
        "variant": name, "run_wall_s": round(time.perf_counter() - t0, 1),
        "epoch0_compile_s": round(sum(p["compile_seconds"] for p in epochs[0]["phases"].values()), 1),
        "epoch0_compilations": epochs[0]["new_compilations"],
        "compilations_epochs1_2": sum(e["new_compilations"] for e in steady),
        "host_s_per_epoch": med([sum(e["phases"][k]["host_seconds"] for k in work) for e in steady]),
        "wall_s_per_epoch": med([sum(e["phases"][k]["seconds"] for k in work) for e in steady]),
        "host_ms_per_sampling_step": med([1000 * e["phases"]["sampling"]["host_seconds"] / 16 for e in steady]),
        "host_ms_per_trained_timestep": med([1000 * e["phases"]["training"]["host_seconds"] / 32 for e in steady]),
        "reward_epoch2": round(epochs[-1]["reward_mean"], 5),
    }


STEP_PROBE = r"""
# Host ms per step at the parity batch sizes on sd14_topology: a sampling step (4 samples, CFG) and a training
# micro-step (2 samples x K timesteps, CFG, forward + backward, LoRA), lazy and dynamo; the main thread's CPU time per
# call (thread_time), median of 8 calls after 2 warm-up calls. The call is handed to the runtime (torch_xla.sync()
# without waiting; dynamo: the replay is dispatched), so execution on XLA's threads is not counted.
import json, statistics, sys, time, torch
from ddpo_tpu.config.compose import compose_and_validate
from ddpo_tpu.runtime import make_runtime
from ddpo_tpu.models.from_config import load_from_config
from ddpo_tpu.models.lora import make_trainable
from ddpo_tpu.diffusion.ddim import DDIMTables
from ddpo_tpu.diffusion.sampling import make_denoise_step, guided_noise_pred
from ddpo_tpu.ddpo.ppo import ppo_loss
compiler = sys.argv[1]
ks = [int(k) for k in sys.argv[2].split(",")]
cfg = compose_and_validate(["model=sd14_topology", "tpu_topology=cpu", f"xla.step_compiler={compiler}"]).cfg
rt = make_runtime(cfg)
c = load_from_config(cfg.model)
make_trainable(c.unet, cfg.model)
unet = c.unet.to(rt.device)
params = [p for p in unet.parameters() if p.requires_grad]
for p in params:
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
        __import__("torch_xla").sync(wait=True)
    return round(1000 * statistics.median(out[2:]), 2)
res = {}
B = 4
cond, uncond = torch.randn(B, L, D).to(rt.device), torch.randn(B, L, D).to(rt.device)
step = rt.compile_step(make_denoise_step(unet, tables, eta=1.0, guidance_scale=5.0))
x = torch.randn(B, *shape).to(rt.device)
def sample_call(i):
    global x
    with torch.no_grad():
        idx = torch.full((B,), i % T, dtype=torch.long).to(rt.device)
        x, _ = step(x, idx, torch.randn(B, *shape).to(rt.device), cond, uncond)
unet.eval()
res["sampling_step_b4"] = timed(sample_call)
unet.train()
for K in ks:
    B = 2
    emb, unc = torch.randn(B, L, D).to(rt.device), torch.randn(B * K, L, D).to(rt.device)
    def loss_fn(cur, nxt, lp_old, idx, cols):
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
print(json.dumps(res))
"""

V6E_PEAK_FLOPS = 918e12  # bf16, per chip


def sd14_flops(ks: list[int]) -> dict:
    """FLOPs at SD 1.4's full widths and 512 px (FlopCounterMode on the meta device: no memory, no compute)."""
    import torch
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from peft import LoraConfig
    from torch.utils.flop_counter import FlopCounterMode

    from ddpo_tpu.models import tiny

    spec = tiny.SPECS["sd14_random"]
    with torch.device("meta"):
        unet = tiny._build_unet(spec)
        vae = tiny._build_vae(spec)
    unet.requires_grad_(False)
    unet.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"]))

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


def host_vs_device(ks: list[int]) -> list[dict]:
    """Per step at parity batch sizes: host ms (sd14_topology, XLA CPU, lazy and dynamo) against device ms (SD 1.4
    FLOPs at v6e peak and at 40%); and the v6e-8 images/s of +experiment=compressibility_parity that follow."""
    from ddpo_tpu.config.compose import compose_and_validate
    from ddpo_tpu.launch.env import runtime_variables

    flops = sd14_flops(ks)
    host = {}
    for compiler in ("lazy", "dynamo"):
        env = clean_env()
        env.update(runtime_variables(compose_and_validate(["tpu_topology=cpu"]).cfg))
        # lazy tracing, the "before", only unfused: each lazy training graph compiles for minutes here
        probe_ks = [1] if compiler == "lazy" else ks
        proc = subprocess.run([sys.executable, "-c", STEP_PROBE, compiler, ",".join(map(str, probe_ks))], env=env,
                              cwd=REPO, capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(proc.stderr[-2000:])
        host[compiler] = json.loads(proc.stdout.strip().splitlines()[-1])
    rows = []
    # per chip and epoch at parity on a v6e-8: 4 x 8 batches x 50 steps = 400 sampling steps; 32 samples / 2 per
    # train batch x 50 timesteps = 800 trained timesteps; 32 VAE decodes; 256 images per epoch over 8 chips
    for compiler in ("lazy", "dynamo"):
        for k in ([1] if compiler == "lazy" else ks):
            tkey = f"train_micro_step_b2_k{k}"
            dev_s = lambda u: (400 * flops["sampling_step_b4"] + 800 / k * flops[tkey]
                               + 32 * flops["vae_decode_per_image"]) / (V6E_PEAK_FLOPS * u)
            host_s = 400 * host[compiler]["sampling_step_b4"] / 1000 + 800 / k * host[compiler][tkey] / 1000
            dev_ms = lambda key, u: flops[key] / (V6E_PEAK_FLOPS * u) * 1000
            rows.append({
                "compiler": compiler, "timesteps_per_micro_step": k,
                "sampling_host_ms": host[compiler]["sampling_step_b4"],
                "sampling_device_ms_peak_40%": f"{dev_ms('sampling_step_b4', 1):.1f} / {dev_ms('sampling_step_b4', .4):.1f}",
                "sampling_host/device_40%": round(host[compiler]["sampling_step_b4"] / dev_ms("sampling_step_b4", .4), 2),
                "train_host_ms": host[compiler][tkey],
                "train_device_ms_peak_40%": f"{dev_ms(tkey, 1):.1f} / {dev_ms(tkey, .4):.1f}",
                "train_host/device_40%": round(host[compiler][tkey] / dev_ms(tkey, .4), 2),
                "epoch_host_s": round(host_s, 1), "epoch_device_s_40%": round(dev_s(.4), 1),
                "v6e8_images_per_s_40%": round(256 / max(host_s, dev_s(.4)), 2),
                "v6e8_images_per_s_peak": round(256 / max(host_s, dev_s(1)), 2),
            })
    tf = {k: round(v / 1e12, 2) for k, v in flops.items()}
    return rows, tf


def table(rows: list[dict]) -> str:
    if not rows:
        return ""
    cols = list(dict.fromkeys(k for r in rows for k in r))
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, nargs="+", default=[10, 20, 50])
    ap.add_argument("--backends", nargs="+", default=list(PER_BACKEND), choices=list(PER_BACKEND))
    ap.add_argument("--no-pipeline", action="store_true", help="skip the diffusers pipeline comparison")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "RESULTS.md")
    ap.add_argument("--host-overhead", action="store_true",
                    help="only the host-overhead benchmark at SD 1.4's topology (model=sd14_topology)")
    ap.add_argument("--full-width", action="store_true",
                    help="only one epoch of SD 1.4 at full width (model=sd14_random) on eager and XLA CPU")
    ap.add_argument("--overrides", nargs="*", default=[], help="--full-width: extra config overrides for its runs")
    ap.add_argument("--variants", nargs="*", default=list(HOST_VARIANTS), choices=list(HOST_VARIANTS),
                    help="training runs of the host-overhead benchmark (none: only the per-step estimate)")
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 2, 5], help="fused timesteps for the parity estimate")
    args = ap.parse_args()
    if args.host_overhead:
        return host_overhead(args)
    if args.full_width:
        return full_width(args)
    runs, pipes = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for backend in args.backends:
            for steps in args.steps:
                runs.append(run_point(backend, steps, Path(tmp)))
                print(json.dumps(runs[-1]), flush=True)
    if not args.no_pipeline:
        for topo in [b for b in args.backends if b in ("eager_cpu", "cpu")]:
            for steps in args.steps:
                pipes.append(pipeline_point(topo, steps))
                print(json.dumps(pipes[-1]), flush=True)
    import torch

    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    machine = (f"{platform.machine()}, {os.cpu_count()} CPU cores, Python {platform.python_version()}, "
               f"torch {torch.__version__}")
    text = (f"\n## {stamp} — {machine}\n\n`python scripts/bench.py {' '.join(sys.argv[1:])}`\n\n"
            f"Training runs (smoke experiment, 8 samples and 2 x 4-sample train batches per epoch, 3 epochs):\n\n"
            f"{table(runs)}\n")
    if pipes:
        text += f"\nSampler vs diffusers StableDiffusionPipeline (tiny model, batch 8, CFG 5, eta 1):\n\n{table(pipes)}\n"
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if not args.out.exists():
        args.out.write_text("# Benchmark results\n\nAppended by `scripts/bench.py`; newest last.\n")
    with open(args.out, "a") as f:
        f.write(text)



FULL_WIDTH_ARGS = ["model=sd14_random", "sample.batch_size=1", "sample.num_batches_per_epoch=1", "sample.num_steps=2",
                   "train.batch_size=1", "train.gradient_accumulation_steps=1", "num_epochs=1", "save_freq=1",
                   "reward.host_workers=0"]


def full_width(args) -> None:
    """One epoch of SD 1.4 at full width (random weights, 512 px; LoRA) on eager CPU and on XLA CPU: does it run,
    how long, and the training process's peak resident memory."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for topo in [b for b in args.backends if b in ("eager_cpu", "cpu")]:
            name = f"full_{topo}"
            t0 = time.perf_counter()
            proc = subprocess.run([sys.executable, "-m", "ddpo_tpu.train", *FULL_WIDTH_ARGS, *args.overrides,
                                   f"tpu_topology={topo}",
                                   f"output_root={tmp}", f"run_name={name}"], env=clean_env(), cwd=REPO,
                                  capture_output=True, text=True)
            if proc.returncode:
                rows.append({"backend": topo, "overrides": " ".join(args.overrides), "error": " ".join((proc.stdout[-600:] + proc.stderr[-600:]).split()).replace("|", "/")})
                continue
            (epoch,) = [r for r in map(json.loads, (Path(tmp) / name / "metrics.jsonl").read_text().splitlines())
                        if r["kind"] == "epoch"]
            ph = epoch["phases"]
            rows.append({"backend": topo, "overrides": " ".join(args.overrides),
                         "run_wall_s": round(time.perf_counter() - t0, 1),
                         "sampling_s": ph["sampling"]["seconds"], "training_s": ph["training"]["seconds"],
                         "compile_s": round(sum(p["compile_seconds"] for p in ph.values()), 1),
                         "compilations": epoch["new_compilations"], "peak_rss_gib": epoch["host_peak_rss_gib"],
                         "loss": epoch["loss"]})
            print(json.dumps(rows[-1]), flush=True)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    text = (f"\n## {stamp} — {platform.machine()}, {os.cpu_count()} CPU cores\n\n`python scripts/bench.py "
            f"{' '.join(sys.argv[1:])}`\n\nOne epoch of SD 1.4 at full width (model=sd14_random: 860M-param UNet, "
            f"512 px, random weights; LoRA; 1 sample, 2 denoising steps, train batch 1): wall seconds and the training "
            f"process's peak resident memory (on XLA CPU it holds the device buffers too):\n\n{table(rows)}\n")
    print(text)
    with open(args.out, "a") as f:
        f.write(text)


def host_overhead(args) -> None:
    import torch

    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.variants:
            runs.append(host_run(name, Path(tmp)))
            print(json.dumps(runs[-1]), flush=True)
    est, tf = host_vs_device(args.ks)
    for r in est:
        print(json.dumps(r), flush=True)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    machine = (f"{platform.machine()}, {os.cpu_count()} CPU cores, Python {platform.python_version()}, "
               f"torch {torch.__version__}")
    text = (f"\n## {stamp} — {machine}\n\n`python scripts/bench.py {' '.join(sys.argv[1:])}`\n\n"
            f"Host overhead at SD 1.4's topology (model=sd14_topology, XLA CPU, LoRA; 8 denoising steps, 4 x 2 "
            f"samples, train batch 2 x 2 accumulation: 16 sampling steps and 32 trained timesteps per epoch). "
            f"Medians of the steady-state epochs 1 and 2; host = CPU time of the training process's main thread "
            f"(time.thread_time around each phase; XLA executes on other threads):\n\n{table(runs)}\n\n"
            f"Per step at the parity batch sizes (sd14_topology host time, median of 8 calls; device time from "
            f"SD 1.4's FLOPs at 512 px, TFLOP {tf}, on one v6e chip at 918 TFLOP/s bf16 peak and at 40%; an "
            f"estimate, no TPU measured). The v6e-8 images/s of +experiment=compressibility_parity are 256 / "
            f"max(host-bound s, FLOP-bound s) per epoch (400 sampling steps, 800 trained timesteps, 32 VAE decodes "
            f"per chip); the 8xA100 reference runs 1.8 images/s:\n\n{table(est)}\n")
    print(text)
    with open(args.out, "a") as f:
        f.write(text)


if __name__ == "__main__":
    main()
