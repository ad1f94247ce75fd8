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
SD 3.5 activations (--sd3-activations): SD 3.5 Medium's transformer at full width and 512 px, 2 and 3 layers deep,
one forward + backward each on eager CPU: what the backward keeps per sample and layer, extrapolated to 24 layers,
plus the attention softmaxes XLA keeps (the HBM rule's SD 3 figure, ddpo_tpu/config/rules.py).
Activation checkpointing (--checkpointing): the same eager probes (SD 1.4's UNet at full width, SD 3.5 Medium's
transformer 2-3 layers deep) with and without diffusers' gradient checkpointing, and SD 1.4's UNet topology at 4096
attention tokens compiled on XLA CPU (peak RSS): the HBM rule's checkpointed figures.
Lazy checkpointing (--lazy-checkpointing): on the lazy path (xla.step_compiler=lazy), what XLA CPU's compiler does
with the runtime's checkpoint (torch_xla's, an optimization barrier before each recomputation): barriers and
exponentials (one per softmax) in the gradient graph before and after optimisation, and the peak of XLA's buffer
assignment, for 4 attention blocks and for SD 1.4's topology at 1024 tokens, with and without.

    python scripts/bench.py                  # parts 1 and 2 (about 35 minutes on 2 CPU cores)
    python scripts/bench.py --steps 10 --backends eager_cpu cpu --no-pipeline
    python scripts/bench.py --host-overhead  # about 50 minutes
    python scripts/bench.py --host-overhead --variants   # only the per-step estimate (about 12 minutes)
    python scripts/bench.py --full-width     # about 20 minutes, ~10 GiB of memory
    python scripts/bench.py --sd3-activations --precisions float32   # about 15 minutes, ~3 GiB (bf16: slow here)
    python scripts/bench.py --checkpointing  # about 30 minutes, ~14 GiB
    python scripts/bench.py --lazy-checkpointing  # about 5 minutes
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
    # plain PyTorch on the host CPU: the device is the main thread itself, so "host" time is all of the compute (an
    # upper bound of the dispatch overhead a GPU or TPU would see)
    "eager_k1": ["tpu_topology=eager_cpu", "train.timesteps_per_micro_step=1"],
    # the distributed runtime with one process (torchrun, the process group, DDP of one, torch.compile)
    **{f"dist_{backend}_k1": ["tpu_topology=cpu_dist2", "tpu_topology.chips_per_host=1", "tpu_topology.chips=1",
                              "tpu_topology.mesh.dp=1", f"distributed.compile={backend}",
                              "train.timesteps_per_micro_step=1"] for backend in ("none", "aot_eager", "inductor")},
}


def _with_variant(args: list[str], variant: list[str]) -> list[str]:
    """HOST_ARGS with a variant's overrides; a variant's key replaces the same key of HOST_ARGS (Hydra refuses a
    config group given twice)."""
    keys = {o.split("=", 1)[0] for o in variant}
    return [a for a in args if a.split("=", 1)[0] not in keys] + list(variant)


def host_run(name: str, root: Path) -> dict:
    """One training process; per steady-state epoch (1 and 2): wall seconds and the main thread's CPU seconds
    (time.thread_time() around each phase in the trainer: tracing, dispatch, Python; XLA executes on other threads)."""
    args = [*_with_variant(HOST_ARGS, HOST_VARIANTS[name]), f"output_root={root}", f"run_name={name}"]
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
checkpointed = sys.argv[3:] == ["checkpointed"]  # train.activation_checkpointing
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
if checkpointed:
    unet.enable_gradient_checkpointing()
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


def sd14_flops(ks: list[int], checkpointed: bool = False) -> dict:
    """FLOPs at SD 1.4's full widths and 512 px (FlopCounterMode on the meta device: no memory, no compute);
    `checkpointed`: with diffusers' gradient checkpointing (the backward's recomputation counted)."""
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


def host_vs_device(ks: list[int], checkpointed: bool = False) -> list[dict]:
    """Per step at parity batch sizes: host ms (sd14_topology, XLA CPU, lazy and dynamo) against device ms (SD 1.4
    FLOPs at v6e peak and at 40%); and the v6e-8 images/s of +experiment=compressibility_parity that follow."""
    from ddpo_tpu.config.compose import compose_and_validate
    from ddpo_tpu.launch.env import runtime_variables

    flops = sd14_flops(ks, checkpointed)
    host = {}
    compilers = ("dynamo",) if checkpointed else ("lazy", "dynamo")  # lazy: the "before", unchecked
    for compiler in compilers:
        env = clean_env()
        env.update(runtime_variables(compose_and_validate(["tpu_topology=cpu"]).cfg))
        # lazy tracing, the "before", only unfused: each lazy training graph compiles for minutes here
        probe_ks = [1] if compiler == "lazy" else ks
        proc = subprocess.run([sys.executable, "-c", STEP_PROBE, compiler, ",".join(map(str, probe_ks)),
                               *(["checkpointed"] if checkpointed else [])], env=env,
                              cwd=REPO, capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(proc.stderr[-2000:])
        host[compiler] = json.loads(proc.stdout.strip().splitlines()[-1])
    rows = []
    # per chip and epoch at parity on a v6e-8: 4 x 8 batches x 50 steps = 400 sampling steps; 32 samples / 2 per
    # train batch x 50 timesteps = 800 trained timesteps; 32 VAE decodes; 256 images per epoch over 8 chips
    for compiler in compilers:
        for k in ([1] if compiler == "lazy" else ks):
            tkey = f"train_micro_step_b2_k{k}"
            dev_s = lambda u: (400 * flops["sampling_step_b4"] + 800 / k * flops[tkey]
                               + 32 * flops["vae_decode_per_image"]) / (V6E_PEAK_FLOPS * u)
            host_s = 400 * host[compiler]["sampling_step_b4"] / 1000 + 800 / k * host[compiler][tkey] / 1000
            dev_ms = lambda key, u: flops[key] / (V6E_PEAK_FLOPS * u) * 1000
            rows.append({
                "compiler": compiler, "timesteps_per_micro_step": k, "activation_checkpointing": checkpointed,
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


def heading() -> str:
    """A RESULTS.md section's start: the date, this machine and the command."""
    import torch

    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    machine = (f"{platform.machine()}, {os.cpu_count()} CPU cores, Python {platform.python_version()}, "
               f"torch {torch.__version__}")
    return f"\n## {stamp} — {machine}\n\n`python scripts/bench.py {' '.join(sys.argv[1:])}`\n\n"


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
    ap.add_argument("--no-estimate", action="store_true",
                    help="--host-overhead: only the training runs, not the per-step XLA probe and device estimate")
    ap.add_argument("--full-width", action="store_true",
                    help="only one epoch of SD 1.4 at full width (model=sd14_random) on eager and XLA CPU")
    ap.add_argument("--overrides", nargs="*", default=[], help="--full-width: extra config overrides for its runs")
    ap.add_argument("--variants", nargs="*", default=list(HOST_VARIANTS), choices=list(HOST_VARIANTS),
                    help="training runs of the host-overhead benchmark (none: only the per-step estimate)")
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 2, 5], help="fused timesteps for the parity estimate")
    ap.add_argument("--checkpointed", action="store_true",
                    help="--host-overhead: the per-step estimate with activation checkpointing (dynamo only)")
    ap.add_argument("--sd3-activations", action="store_true",
                    help="only the SD 3.5 Medium training-activation probes (full width, 2-3 layers, eager CPU)")
    ap.add_argument("--precisions", nargs="+", default=["float32", "bf16"], choices=["float32", "bf16"],
                    help="--sd3-activations: the precisions probed")
    ap.add_argument("--checkpointing", action="store_true",
                    help="only the activation checkpointing probes (SD 1.4 and SD 3.5 Medium eager, SD 1.4's "
                         "topology on XLA CPU, with and without)")
    ap.add_argument("--lazy-checkpointing", action="store_true",
                    help="only the lazy path's checkpointing probes (HLO dumps of XLA CPU, with and without)")
    ap.add_argument("--probe", help=argparse.SUPPRESS)  # one probe (PROBES; a JSON call), in a process of its own
    args = ap.parse_args()
    if args.probe:
        call = json.loads(args.probe)
        return print(json.dumps(PROBES[call.pop("probe")](**call)))
    if args.sd3_activations:
        return sd3_activations(args)
    if args.checkpointing:
        return checkpointing(args)
    if args.lazy_checkpointing:
        return lazy_checkpointing(args)
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

    text = (heading() +
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
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.variants:
            runs.append(host_run(name, Path(tmp)))
            print(json.dumps(runs[-1]), flush=True)
    est, tf = ([], None) if args.no_estimate else host_vs_device(args.ks, args.checkpointed)
    for r in est:
        print(json.dumps(r), flush=True)
    text = (heading() +
            f"Host overhead at SD 1.4's topology (model=sd14_topology, LoRA; lazy_/dynamo_: XLA CPU; eager_ and "
            f"dist_<torch.compile backend>_: plain PyTorch on the CPU, where the main thread also computes, so their "
            f"host time is an upper bound of the dispatch cost; 8 denoising steps, 4 x 2 "
            f"samples, train batch 2 x 2 accumulation: 16 sampling steps and 32 trained timesteps per epoch). "
            f"Medians of the steady-state epochs 1 and 2; host = CPU time of the training process's main thread "
            f"(time.thread_time around each phase; XLA executes on other threads):\n\n{table(runs)}\n\n")
    if est:
        text += (
            f"Per step at the parity batch sizes (sd14_topology host time, median of 8 calls; device time from "
            f"SD 1.4's FLOPs at 512 px, TFLOP {tf}, on one v6e chip at 918 TFLOP/s bf16 peak and at 40%; an "
            f"estimate, no TPU measured). The v6e-8 images/s of +experiment=compressibility_parity are 256 / "
            f"max(host-bound s, FLOP-bound s) per epoch (400 sampling steps, 800 trained timesteps, 32 VAE decodes "
            f"per chip); the 8xA100 reference runs 1.8 images/s:\n\n{table(est)}\n")
    print(text)
    with open(args.out, "a") as f:
        f.write(text)



# --- SD 3.5 Medium training activations (--sd3-activations) ----------------------------------------------------------

# SD 3.5 Medium's transformer (stabilityai/stable-diffusion-3.5-medium transformer/config.json, diffusers
# SD3Transformer2DModel): 24 layers of 24 heads x 64, dual attention (MMDiT-X) in layers 0-12, RMS qk-norm
SD35_MEDIUM_TRANSFORMER = dict(sample_size=128, patch_size=2, in_channels=16, num_layers=24, attention_head_dim=64,
                               num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536,
                               pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=384,
                               dual_attention_layers=tuple(range(13)), qk_norm="rms_norm")
SD3_TEXT_TOKENS = 77 + 128  # CLIP's 77 + T5's 128 (flow_grpo's max_sequence_length; families/sd3.T5_TOKENS)
SD3_LATENT = 64  # 512 px / 8
# (layers, dual-attention layers). The first layer keeps less than the others (its input needs no gradient: a frozen
# part, e.g. layer 0's dual attention, keeps nothing) and the last is context_pre_only (its text stream ends in the
# attention), so the ordinary layer measured is a middle one: 3 layers - 2 layers, joint or dual
SD3_PROBES = [(2, ()), (3, ()), (3, (1,))]
# bf16 matmuls are ~20x slower than float32 on this CPU (no bf16 units): bf16 at batch 1 only, without a warm-up
# call (float32 shows the cost linear in the batch: its batch-0 intercept is under 2% of a sample)
SD3_BATCHES = {"float32": (1, 2), "bf16": (1,)}


def _vm(field: str) -> int:
    """A /proc/self/status figure in bytes (VmRSS now, VmHWM the peak since the last reset)."""
    import re

    return int(re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024


def measure_backward(model, forward, precision: str, warmup: bool) -> dict:
    """What one forward + backward of `forward()` (-> output tensor) keeps for the backward, eager CPU. Two
    accountings: the bytes of the distinct storages autograd saves (saved_tensors_hooks, weights and buffers excluded;
    blind inside checkpointed blocks, whose own hooks take over) and the process's peak resident memory over the step
    (VmHWM, reset just before) minus the resident memory before it."""
    import contextlib
    import gc

    import torch

    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    weights |= {b.untyped_storage().data_ptr() for b in model.buffers()}
    saved: dict[int, int] = {}
    squares = []

    def pack(tensor):
        st = tensor.untyped_storage()
        if st.data_ptr() not in weights:
            saved[st.data_ptr()] = st.nbytes()
            if tensor.dim() >= 2 and tensor.shape[-1] == tensor.shape[-2] and tensor.shape[-1] >= 1024:
                squares.append(tuple(tensor.shape))
        return tensor

    autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext())

    def step(hooks: bool):
        with autocast, (torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if hooks
                        else contextlib.nullcontext()):
            out = forward()
        return out.float().square().mean()

    if warmup:
        step(False).backward()  # LoRA gradients, kernels' scratch
    gc.collect()
    before = _vm("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    t0 = time.perf_counter()
    loss = step(True)
    after_forward = _vm("VmRSS")
    loss.backward()
    peak = _vm("VmHWM")
    G = 2 ** 30
    return {"saved_gib": round(sum(saved.values()) / G, 4),
            "rss_after_forward_gib": round((after_forward - before) / G, 4),
            "peak_rss_delta_gib": round((peak - before) / G, 4), "score_matrices_saved": len(squares),
            "seconds": round(time.perf_counter() - t0, 1)}


def _random_weights(model, dtype):
    """A model built on the meta device, materialised on the CPU with N(0, 0.02) values (the initialisers' cost
    saved: the values do not matter for memory), frozen, eval mode."""
    import torch

    model = model.to_empty(device="cpu").to(dtype).eval().requires_grad_(False)
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            tensor.normal_(0.0, 0.02)
    return model


def sd3_probe(layers: int, dual: tuple[int, ...], batch: int, precision: str, checkpointed: bool = False) -> dict:
    """One forward + backward of SD 3.5 Medium's transformer at full width, `layers` deep (`dual` with dual
    attention), 512 px, LoRA as model=sd35_medium, eager CPU, as a training micro-step runs it (frozen weights in
    bfloat16 under bf16 autocast, float32 otherwise; LoRA weights float32); `checkpointed`: diffusers' gradient
    checkpointing on (train.activation_checkpointing)."""
    import torch
    from diffusers import SD3Transformer2DModel
    from peft import LoraConfig

    torch.manual_seed(0)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    cfg = dict(SD35_MEDIUM_TRANSFORMER, num_layers=layers, dual_attention_layers=tuple(dual))
    with torch.device("meta"):
        model = SD3Transformer2DModel(**cfg)
    model = _random_weights(model, dtype)
    target = ["attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out", "attn.to_k",
              "attn.to_out.0", "attn.to_q", "attn.to_v"]
    model.add_adapter(LoraConfig(r=32, lora_alpha=64, init_lora_weights="gaussian", target_modules=target))
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    if checkpointed:
        model.enable_gradient_checkpointing()
    x = torch.randn(batch, 16, SD3_LATENT, SD3_LATENT, dtype=dtype)
    t = torch.rand(batch).to(dtype) * 1000
    text = torch.randn(batch, SD3_TEXT_TOKENS, 4096, dtype=dtype)
    pooled = torch.randn(batch, 2048, dtype=dtype)
    tokens = (SD3_LATENT // 2) ** 2 + SD3_TEXT_TOKENS
    forward = lambda: model(hidden_states=x, timestep=t, encoder_hidden_states=text, pooled_projections=pooled,
                            return_dict=False)[0]
    row = {"precision": precision, "layers": layers, "dual_layers": "+".join(map(str, dual)) or "-",
           "batch": batch, "checkpointed": checkpointed, "warm_up": precision == "float32", "tokens": tokens}
    return row | measure_backward(model, forward, precision, warmup=row["warm_up"])  # SD3_BATCHES


def sd14_probe(batch: int, checkpointed: bool) -> dict:
    """One forward + backward of SD 1.4's UNet at full width (model=sd14_random's build: 860M parameters, random
    weights), 512 px (64x64 latents), LoRA as model=sd14 (rank 4 on the attention projections), float32, eager CPU;
    `checkpointed`: diffusers' gradient checkpointing on (train.activation_checkpointing)."""
    import torch
    from peft import LoraConfig

    from ddpo_tpu.models.tiny import SPECS, _build_unet

    torch.manual_seed(0)
    with torch.device("meta"):
        unet = _build_unet(SPECS["sd14_random"])
    unet = _random_weights(unet, torch.float32)
    unet.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian",
                                target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    if checkpointed:
        unet.enable_gradient_checkpointing()
    x = torch.randn(batch, 4, 64, 64)
    t = torch.full((batch,), 500)
    text = torch.randn(batch, 77, 768)
    row = {"model": "sd14_random UNet", "batch": batch, "checkpointed": checkpointed}
    return row | measure_backward(unet, lambda: unet(x, t, text).sample, "float32", warmup=True)


FAST_FLAGS = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true")
XLA_PROBE_ARGS = ["+experiment=smoke", "model=sd14_topology", "tpu_topology=cpu",
                  "xla.flags=[" + ",".join(f'"{f}"' for f in FAST_FLAGS) + "]"]


def xla_probe(latent: int, checkpointed: bool) -> dict:
    """One compiled forward + backward (xla.step_compiler=dynamo, as the training micro-step runs) of SD 1.4's UNet
    topology at narrow widths (model=sd14_topology's build: 32-64 channels, but SD 1.4's 8 heads, so its attention
    scores are full size at `latent`^2 tokens), batch 1, float32, on XLA CPU through ddpo_tpu's runtime; LoRA-like
    trainable to_q projections. The process's peak resident memory holds XLA's buffers: what the compiled backward
    keeps, which the eager probes cannot see. Run in a process of its own with the training process's environment."""
    import resource

    import torch

    from ddpo_tpu.config.compose import compose_and_validate
    from ddpo_tpu.models.tiny import SPECS, _build_unet
    from ddpo_tpu.runtime import make_runtime

    rt = make_runtime(compose_and_validate(XLA_PROBE_ARGS).cfg)
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
            "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20, 2),
            "graphs": rt.counters().compilations, "seconds": seconds, "loss": round(float(loss), 6),
            "grad_abs_sum": f"{grad:.6e}"}


def sd3_attention_scores_gib() -> float:
    """What XLA keeps that eager CPU does not, per sample and evaluation: XLA lowers attention to matmul + softmax and
    keeps each softmax for the backward, heads x S^2 x 4 bytes (float32 under autocast too): the joint attention of
    all 24 layers over image + text tokens, and the second (image-only) attention of dual-attention layers 1-12
    (layer 0's has no LoRA and a frozen input: nothing of it needs a gradient, so nothing is kept)."""
    c = SD35_MEDIUM_TRANSFORMER
    image = (SD3_LATENT // c["patch_size"]) ** 2
    joint = c["num_layers"] * c["num_attention_heads"] * (image + SD3_TEXT_TOKENS) ** 2 * 4
    dual = (len(c["dual_attention_layers"]) - 1) * c["num_attention_heads"] * image ** 2 * 4
    return (joint + dual) / 2 ** 30


def sd3_estimate(rows: list[dict], field: str) -> list[dict]:
    """Per precision: per-sample costs of the first and last layers with the embeddings (2 layers), of a middle joint
    layer and of a middle dual-attention layer (3 layers - 2 layers); per sample = batch 2 - batch 1 where both were
    run, else batch 1. 24 layers: the first (layer 0, dual, whose second attention keeps nothing, as measured: a
    first-layer dual attention adds 0), the last, 10 joint and 12 dual middle layers; plus the scores XLA keeps."""
    out = []
    scores = sd3_attention_scores_gib()
    n_dual = len(SD35_MEDIUM_TRANSFORMER["dual_attention_layers"]) - 1
    n_joint = SD35_MEDIUM_TRANSFORMER["num_layers"] - 2 - n_dual
    for precision in dict.fromkeys(r["precision"] for r in rows):
        v = {(r["layers"], r["dual_layers"], r["batch"]): r[field] for r in rows if r["precision"] == precision}

        def per_sample(layers, dual):
            return v[layers, dual, 2] - v[layers, dual, 1] if (layers, dual, 2) in v else v[layers, dual, 1]

        ends = per_sample(2, "-")
        joint = per_sample(3, "-") - ends
        dual = per_sample(3, "1") - ends
        eager = ends + n_joint * joint + n_dual * dual
        out.append({"precision": precision, "accounting": field, "first_last_and_embeddings": round(ends, 3),
                    "joint_layer": round(joint, 3), "dual_attention_layer": round(dual, 3),
                    f"24_layers_eager (2 + {n_joint} x joint + {n_dual} x dual)": round(eager, 2),
                    "+ XLA attention scores": round(scores, 2), "per_sample_eval_on_xla": round(eager + scores, 2)})
    return out


def sd3_activations(args) -> None:
    """Run the SD 3.5 Medium probes one process at a time (each its own peak), print and append the tables."""
    rows = []
    env = dict(clean_env(), MALLOC_MMAP_THRESHOLD_="65536")  # big blocks from mmap: freed memory leaves the RSS
    for precision in args.precisions:
        for layers, dual in SD3_PROBES:
            for batch in SD3_BATCHES[precision]:
                rows.append(run_probe(env, probe="sd3", layers=layers, dual=list(dual), batch=batch,
                                      precision=precision))
    est = sd3_estimate(rows, "peak_rss_delta_gib") + sd3_estimate(rows, "saved_gib")
    text = (heading() +
            f"SD 3.5 Medium's transformer at full width (1536, 24 heads of 64, RMS qk-norm), 512 px (1024 image "
            f"tokens + {SD3_TEXT_TOKENS} text tokens), LoRA rank 32 on the attention as model=sd35_medium, random "
            f"weights, 2 or 3 layers deep (dual_layers: which have dual attention), one forward + backward on eager "
            f"CPU (frozen weights bfloat16 under bf16 autocast, float32 otherwise; bf16 at batch 1 without a warm-up "
            f"call: its matmuls are ~20x slower here), one process per row. saved = bytes of the distinct storages "
            f"autograd keeps for the backward (saved_tensors_hooks; weights excluded); peak_rss_delta = the "
            f"process's peak resident memory over the step (VmHWM, reset before it) minus the resident memory "
            f"before it (MALLOC_MMAP_THRESHOLD_=65536, so freed tensors leave the RSS); score_matrices_saved = saved "
            f"tensors of S x S shape (0: eager CPU's fused attention keeps none):\n\n{table(rows)}\n\n"
            f"Per sample and transformer evaluation, GiB (batch 2 - batch 1 where run, else batch 1; a middle layer "
            f"= 3 layers - 2 layers), extrapolated to SD 3.5 Medium's 24 layers, plus the attention scores XLA keeps "
            f"(24 heads x S^2 x 4 bytes: 24 joint attentions at S = {1024 + SD3_TEXT_TOKENS}, the image-only "
            f"attentions of dual layers 1-12 at S = 1024; derived, not measured):\n\n{table(est)}\n")
    print(text)
    with open(args.out, "a") as f:
        f.write(text)


def run_probe(env: dict[str, str], **call) -> dict:
    """One probe (PROBES) in a process of its own, so its peak resident memory is its own."""
    proc = subprocess.run([sys.executable, __file__, "--probe", json.dumps(call)], env=env, cwd=REPO,
                          capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"probe {call} failed:\n{proc.stderr[-2000:]}")
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    print(json.dumps(row), flush=True)
    return row


def checkpointing(args) -> None:
    """train.activation_checkpointing: what the backward keeps with and without diffusers' gradient checkpointing.
    Eager CPU at full width (SD 1.4's UNet; SD 3.5 Medium's transformer 2-3 layers deep), per sample; and XLA CPU on
    SD 1.4's topology at 512 px tokens, where the attention scores XLA keeps show."""
    from ddpo_tpu.config.compose import compose_and_validate
    from ddpo_tpu.launch.env import child_environment

    eager_env = dict(clean_env(), MALLOC_MMAP_THRESHOLD_="65536")  # freed tensors leave the RSS
    sd1 = [run_probe(eager_env, probe="sd14", batch=b, checkpointed=c) for c in (False, True) for b in (1, 2)]
    sd3 = [run_probe(eager_env, probe="sd3", layers=layers, dual=list(dual), batch=b, precision="float32",
                     checkpointed=c)
           for c in (True,) for layers, dual in SD3_PROBES for b in SD3_BATCHES["float32"]]  # without: --sd3-activations
    with tempfile.TemporaryDirectory() as tmp:
        xla_env = dict(child_environment(compose_and_validate(XLA_PROBE_ARGS).cfg, Path(tmp)), PYTHONPATH=str(REPO))
        xla = [run_probe(xla_env, probe="xla", latent=64, checkpointed=c) for c in (False, True)]
    per_sample = []
    for c in (False, True):
        v = {r["batch"]: r for r in sd1 if r["checkpointed"] == c}
        per_sample.append({"model": "SD 1.4 UNet", "checkpointed": c, **{
            f: round(v[2][f] - v[1][f], 3) for f in ("saved_gib", "peak_rss_delta_gib")}})
    for c in (True,):
        for est in sd3_estimate([r for r in sd3 if r["checkpointed"] == c], "peak_rss_delta_gib"):
            per_sample.append({"model": "SD 3.5 Medium transformer (24 layers, extrapolated)", "checkpointed": c,
                               "peak_rss_delta_gib": next(v for k, v in est.items() if k.startswith("24_layers"))})
    text = (heading() +
            f"Activation checkpointing (train.activation_checkpointing; diffusers' gradient checkpointing of every "
            f"resnet and transformer block). Eager CPU, float32, LoRA, one forward + backward per process, full "
            f"width at 512 px (measure_backward: saved bytes, blind inside checkpointed blocks; peak RSS over the "
            f"step minus the RSS before it):\n\n{table(sd1 + sd3)}\n\nPer sample and evaluation (batch 2 - batch 1; "
            f"SD 3.5 Medium extrapolated to 24 layers as --sd3-activations does), GiB:\n\n{table(per_sample)}\n\n"
            f"XLA CPU (xla_probe: the compiled forward + backward of SD 1.4's UNet topology at narrow widths, 8 heads "
            f"at 4096 tokens, batch 1, two calls; the process's peak RSS holds XLA's buffers):\n\n{table(xla)}\n")
    print(text)
    with open(args.out, "a") as f:
        f.write(text)


def lazy_probe(model: str, checkpointed: bool, dump: str) -> dict:
    """One forward + backward on the lazy path (one XLA graph) through ddpo_tpu's runtime, its checkpoint function
    when `checkpointed`; XLA dumps the graph (xla.flags: --xla_dump_to=`dump`) before and after optimisation with its
    buffer assignment. model: "blocks" (4 residual self-attention blocks, 512 tokens, 16 wide) or "sd14_topology"
    (SD 1.4's UNet topology at narrow widths, 8 heads at 1024 tokens, trainable to_q)."""
    import re

    import torch

    from ddpo_tpu.config.compose import compose_and_validate
    from ddpo_tpu.runtime import make_runtime

    rt = make_runtime(compose_and_validate([*XLA_PROBE_ARGS, "xla.step_compiler=lazy"]).cfg)
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
        run = rt.checkpoint_function() if checkpointed else (lambda block, h: block(h))
        for block in blocks:
            x = run(block, x)
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
            "barriers_before_opt": count(before, "opt-barrier"), "exponentials_before_opt": count(before, "exponential"),
            "barriers_after_opt": count(after, "opt-barrier"), "exponentials_after_opt": count(after, "exponential"),
            "buffer_peak_mib": round(int(peak.group(1).replace(" ", "")) / 2**20, 1)}


def lazy_checkpointing(args) -> None:
    """Each lazy probe in a process of its own, XLA dumping its graphs into a fresh directory."""
    from ddpo_tpu.config.compose import compose_and_validate
    from ddpo_tpu.launch.env import child_environment

    rows = []
    for model in ("blocks", "sd14_topology"):
        for checkpointed in (False, True):
            with tempfile.TemporaryDirectory() as tmp:
                dump = Path(tmp) / "dump"
                flags = ",".join(f'"{f}"' for f in (*FAST_FLAGS, f"--xla_dump_to={dump}", "--xla_dump_hlo_as_text"))
                cfg = compose_and_validate([*XLA_PROBE_ARGS[:-1], f"xla.flags=[{flags}]"]).cfg
                env = dict(child_environment(cfg, Path(tmp)), PYTHONPATH=str(REPO))
                rows.append(run_probe(env, probe="lazy", model=model, checkpointed=checkpointed, dump=str(dump)))
    text = (heading() +
            "Activation checkpointing on the lazy path (xla.step_compiler=lazy: forward and backward in one XLA "
            "graph) with the runtime's checkpoint function (torch_xla's: an optimization barrier before each "
            "block's recomputation), XLA CPU with the tests' fast flags; counts in the largest graph (the gradients') "
            "before and after XLA's optimisation passes, and the peak of its buffer assignment (XLA's own liveness "
            "figure for the compiled program). Exponentials count softmaxes, but also SiLU/GELU's and the copies XLA makes "
            "when it fuses: a clean count for the blocks only:\n\n" + table(rows) + "\n")
    print(text)
    with open(args.out, "a") as f:
        f.write(text)


PROBES = {"sd14": sd14_probe, "xla": xla_probe, "lazy": lazy_probe,
          "sd3": lambda dual, **kw: sd3_probe(dual=tuple(dual), **kw)}


if __name__ == "__main__":
    main()
