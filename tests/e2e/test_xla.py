"""Graph discipline on torch_xla's PJRT CPU device, measured with torch_xla's own counters (exact), through the real
launcher. Each run is its own training process: SPMD needs xr.use_spmd() before any XLA tensor exists."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from tests.helpers import FAST_XLA_CPU, FAST_XLA_FLAGS, REPO, clean_env, read_metrics, run_train
from ddpo_tpu.rundir import events as ev
from ddpo_tpu.runtime.base import KNOWN_CPU_FALLBACKS

pytestmark = [pytest.mark.slow, pytest.mark.xla]

SMOKE = ["+experiment=smoke", "reward.host_workers=0", FAST_XLA_CPU]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, model_cache):
    """name -> run dir. Global batch 8 (sampling) and 4 (training) everywhere."""
    specs = {
        "single_2ep": ["tpu_topology=cpu", "num_epochs=2", "save_freq=1"],
        # the same run as steps12_nb1, SPMD over 4 devices (same global batches)
        "spmd4": ["tpu_topology=cpu_spmd4", "num_epochs=2", "sample.batch_size=2", "train.batch_size=1",
                  "sample.num_steps=12", "sample.num_batches_per_epoch=1"],
        # the same again with parameters, gradients and Adam moments split over a 2-way fsdp axis (checkpoints on)
        "fsdp": ["tpu_topology=cpu_spmd4", "tpu_topology.mesh.dp=2", "tpu_topology.mesh.fsdp=2", "num_epochs=2",
                 "save_freq=1", "sample.batch_size=2", "train.batch_size=1", "sample.num_steps=12",
                 "sample.num_batches_per_epoch=1"],
        # 12 steps and one sampling batch and one optimizer step per epoch (single_2ep: 8 steps, two of each): the
        # graph count must depend on neither
        "steps12_nb1": ["tpu_topology=cpu", "num_epochs=2", "sample.num_steps=12", "sample.num_batches_per_epoch=1"],
    }
    out = {}
    for name, extra in specs.items():
        cwd = tmp_path_factory.mktemp(name)
        proc = run_train([*SMOKE, *extra, f"model.cache_dir={model_cache}"], cwd, timeout=900)
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
        out[name] = cwd / "outputs" / "smoke"
    return out


def test_no_new_compilations_after_the_first_epoch(runs):
    epochs = read_metrics(runs["single_2ep"], "epoch")
    assert [e["epoch"] for e in epochs] == [0, 1]
    assert epochs[0]["new_compilations"] > 0
    for e in epochs[1:]:
        assert e["new_compilations"] == 0, e["phases"]  # sampling, reward, advantages, training and checkpointing
        assert e["new_replicate_compilations"] == 0, e["phases"]


def test_epoch_0_says_what_it_compiles_and_later_epochs_compile_nothing_to_say(runs):
    """Each stage's compile is announced and ended in events.jsonl and in the run's console log, in epoch 0 only
    (ddpo-status reading an open compile is tests/unit/status/test_events.py's, extended)."""
    run = runs["single_2ep"]
    recs = [r for r in ev.read_events(run) if r["event"].startswith("compile_")]
    assert [(r["event"], r["epoch"], r["stage"], r["index"], r["of"]) for r in recs
            if r["event"] != "compile_progress"] == [
        ("compile_start", 0, "sampling", 1, 2), ("compile_end", 0, "sampling", 1, 2),
        ("compile_start", 0, "training", 2, 2), ("compile_end", 0, "training", 2, 2)]
    ends = [r for r in recs if r["event"] == "compile_end"]
    assert all(r["compilations"] > 0 and 0 < r["compile_seconds"] <= r["seconds"] for r in ends), ends
    log = (run / "train.log").read_text()
    assert ev.CompileStart(0, "sampling", 1, 2).text() in log and ev.parse(ends[-1]).text() in log


def test_graph_count_does_not_depend_on_steps_or_batches(runs):
    counts = {name: read_metrics(runs[name], "epoch")[0]["new_compilations"] for name in ("single_2ep", "steps12_nb1")}
    assert len(set(counts.values())) == 1, counts
    # with a single optimizer step per epoch the steady-state update first runs in epoch 1: still no new graph
    assert read_metrics(runs["steps12_nb1"], "epoch")[1]["new_compilations"] == 0


def test_cpu_fallbacks_only_where_allowed(runs):
    for e in read_metrics(runs["single_2ep"], "epoch"):
        phases = e["phases"]
        assert "cpu_fallbacks" not in phases["sampling"], phases["sampling"]
        for phase, data in phases.items():
            unexpected = set(data.get("cpu_fallbacks", {})) - set(KNOWN_CPU_FALLBACKS)
            assert not unexpected, (phase, unexpected)


def test_host_transfers_are_bounded_per_batch_and_per_step(runs):
    for e in read_metrics(runs["single_2ep"], "epoch"):
        p = e["phases"]
        assert p["sampling"]["host_transfers"] == 2  # one copy of uint8 images per sampling batch (2 batches)
        updates = 2
        fallbacks = sum(p["training"].get("cpu_fallbacks", {}).values())  # each CPU fallback copies to the host
        assert p["training"]["host_transfers"] == updates + fallbacks  # one metrics copy per optimizer step
        assert p["reward"]["host_transfers"] == 0 and p["advantages"]["host_transfers"] == 0


def _layout(run_dir):
    return next(r for r in ev.read_events(run_dir) if r["event"] == "state_layout")


@pytest.mark.parametrize("name", ["spmd4", "fsdp"])
def test_spmd_matches_one_device(runs, name):
    one = read_metrics(runs["steps12_nb1"], "epoch")[0], read_metrics(runs["steps12_nb1"], "step")[0]
    spmd = read_metrics(runs[name], "epoch")[0], read_metrics(runs[name], "step")[0]
    assert math.isclose(one[0]["reward_mean"], spmd[0]["reward_mean"], rel_tol=1e-4)
    # one update covers the whole epoch here, so the loss (a mean of zero-mean advantages) is ~1e-8: compare it
    # absolutely, and the gradient norm relatively
    assert math.isclose(one[1]["loss"], spmd[1]["loss"], abs_tol=1e-6), (one[1]["loss"], spmd[1]["loss"])
    assert math.isclose(one[1]["grad_norm"], spmd[1]["grad_norm"], rel_tol=1e-4), (one[1], spmd[1])
    assert spmd[1]["approx_kl"] < 1e-8 and spmd[1]["clipfrac"] == 0.0
    log = (runs[name] / "train.log").read_text()
    assert "xla_spmd" in log and "4 replica(s)" in log


@pytest.mark.parametrize("name", ["spmd4", "fsdp"])
def test_spmd_compiles_nothing_after_the_first_epoch(runs, name):
    """Weights, gradients and Adam moments are pinned to one layout, so the update graph is compiled once; split
    weights are copied to the host from their shards at checkpoints (their .cpu() would compile a program)."""
    later = read_metrics(runs[name], "epoch")[1]
    assert later["new_compilations"] == 0, later["phases"]
    for phase, data in later["phases"].items():
        # the one exception, CPU only: torch_xla replicates a sharded input of an allowed CPU fallback with a
        # compiled program (TPU lowers the op, so there is no fallback there)
        allowed = sum(data.get("cpu_fallbacks", {}).values())
        assert data.get("replicate_compilations", 0) <= allowed, (phase, data)
    assert later["phases"]["checkpoint"]["compilations"] == 0
    assert "replicate_compilations" not in later["phases"]["checkpoint"]


def test_fsdp_splits_the_training_state(runs):
    whole, split = _layout(runs["spmd4"]), _layout(runs["fsdp"])
    assert whole["sharded"] == 0 and whole["bytes_per_device"] == whole["bytes_total"]
    assert split["tensors"] == whole["tensors"] and split["bytes_total"] == whole["bytes_total"]
    # every conv and linear weight of the tiny UNet splits in two; biases and norms stay whole
    assert split["sharded"] > split["tensors"] / 3
    assert split["bytes_per_device"] < 0.55 * split["bytes_total"]
    assert (runs["fsdp"] / "weights" / "final.safetensors").exists()


CACHE_PROBE = """
import sys
from ddpo_tpu.config.compose import compose_and_validate
from ddpo_tpu.runtime import make_runtime
import torch, torch_xla, torch_xla.debug.metrics as met
cfg = compose_and_validate(["tpu_topology=cpu", f"xla.compilation_cache_dir={sys.argv[1]}"]).cfg
rt = make_runtime(cfg)
x = torch.arange(12.0).reshape(3, 4).to(rt.device)
y = (x @ x.T).sin().sum()
value = float(rt.to_host(y))
found = (met.counter_value("PersistentCacheHit") or 0) + (met.counter_value("PersistentCacheDeserializeFailure") or 0)
print(value, met.counter_value("PersistentCacheMiss") or 0, found, flush=True)
"""


def test_persistent_compilation_cache(tmp_path):
    env = clean_env(PJRT_DEVICE="CPU")
    cache = tmp_path / "xla_cache"
    first = subprocess.run([sys.executable, "-c", CACHE_PROBE, str(cache)], cwd=REPO, env=env, capture_output=True,
                           text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    assert any(cache.iterdir())
    second = subprocess.run([sys.executable, "-c", CACHE_PROBE, str(cache)], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=300)
    assert second.returncode == 0, second.stderr[-2000:]
    v1, miss1, found1 = first.stdout.split()[-3:]
    v2, miss2, found2 = second.stdout.split()[-3:]
    # the first run writes the executable, the second finds it. (PJRT CPU executables fail to deserialize in
    # torch_xla 2.9, counted as PersistentCacheDeserializeFailure; on TPU the same lookup is a PersistentCacheHit.)
    assert v1 == v2 and int(miss1) == 1 and int(found1) == 0
    assert int(found2) == 1 and int(miss2) == 0, (first.stdout[-300:], second.stdout[-300:])


LAUNCH_PROBE = """
from ddpo_tpu.config.compose import compose_and_validate
from ddpo_tpu.runtime.xla import LaunchMismatch, XlaRuntime
cfg = compose_and_validate(["+experiment=compressibility_parity", "tpu_topology=v6e-16",
                            "sample.num_batches_per_epoch=4", "train.gradient_accumulation_steps=2"]).cfg
rt = XlaRuntime.__new__(XlaRuntime)  # the check alone: this machine has no pod
rt.process_count, rt.spmd = 1, True
try:
    rt._check_launch(cfg)
except LaunchMismatch as e:
    print(e)
"""


def test_a_pod_launched_on_one_worker_aborts_with_the_fix():
    proc = subprocess.run([sys.executable, "-c", LAUNCH_PROBE], cwd=REPO, env=clean_env(PJRT_DEVICE="CPU"),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "expects 4 training processes" in proc.stdout and "has 1" in proc.stdout
    assert "launch the same command on all workers" in proc.stdout


GATHER_PROBE = """
import sys, torch
import torch_xla.debug.metrics as met
from ddpo_tpu.config.compose import compose_and_validate
from ddpo_tpu.runtime import make_runtime
cfg = compose_and_validate(["tpu_topology=cpu_spmd4", f"xla.gather={sys.argv[1]}"]).cfg
rt = make_runtime(cfg)
outs, compiles = [], []
for k in range(3):
    x = rt.shard_batch(torch.arange(8 * 5, dtype=torch.float32).reshape(8, 5).add(k).to(rt.device))
    outs.append(rt.to_host((x * 3).to(torch.uint8)).tolist())
    compiles.append(met.counter_value("UncachedCompile"))
print(outs == [((torch.arange(40).reshape(8, 5) + k) * 3).tolist() for k in range(3)], compiles[1] == compiles[2])
"""


@pytest.mark.parametrize("mode", ["device", "host"])
def test_spmd_gather_modes_bring_the_global_batch_to_the_host(mode):
    env = clean_env(PJRT_DEVICE="CPU", CPU_NUM_DEVICES="4")
    proc = subprocess.run([sys.executable, "-c", GATHER_PROBE, mode], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split()[-2:] == ["True", "True"], proc.stdout  # exact values, no recompilation per call


FSDP_PROBE = """
import torch
from ddpo_tpu.config.compose import compose_and_validate
from ddpo_tpu.runtime import make_runtime
cfg = compose_and_validate(["tpu_topology=cpu_spmd4", "tpu_topology.mesh.dp=2", "tpu_topology.mesh.fsdp=2"]).cfg
rt = make_runtime(cfg)
host = {"split": torch.randn(8, 3), "split3d": torch.randn(6, 2, 5), "odd_rows": torch.randn(3, 4),
        "bias": torch.randn(8)}
dev = {k: v.to(rt.device) for k, v in host.items()}
rt.place_state(dev.values())
rt.sync()
layout = rt.state_layout(dev.values())
print("layout", layout.tensors, layout.sharded, layout.bytes_total, layout.bytes_per_device)
print("split", [k for k, v in dev.items() if rt._is_split(v)])
before = rt.counters()
for step in range(3):
    with torch.no_grad():
        for v in dev.values():
            v.mul_(2.0).add_(1.0)  # an update in place keeps the pinned layout
    rt.sync()
    back = rt.state_to_host(dev)
    print("equal", step, all(torch.allclose(back[k], (host[k] * 2 + 1)) for k in host))
    host = {k: v * 2 + 1 for k, v in host.items()}
d = rt.counters().minus(before)
print("after_first", d.compilations, d.replicate_compilations)
before = rt.counters()
whole = dev["split"].cpu()  # what state_to_host avoids: torch_xla compiles a program to replicate it first
d = rt.counters().minus(before)
print("plain_cpu", d.compilations, d.replicate_compilations, torch.equal(whole, host["split"]))
print("split_after", [k for k, v in dev.items() if rt._is_split(v)])
"""


def test_fsdp_splits_weights_and_copies_them_to_the_host_without_compiling():
    env = clean_env(PJRT_DEVICE="CPU", CPU_NUM_DEVICES="4")
    proc = subprocess.run([sys.executable, "-c", FSDP_PROBE], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = {ln.split()[0] + (ln.split()[1] if ln.startswith("equal") else ""): ln.split()[1:]
             for ln in proc.stdout.splitlines() if ln.split()}
    # (8, 3) and (6, 2, 5) split in 2 along dim 0; (3, 4) cannot be, a bias is 1-D: both replicated
    total = 4 * (24 + 60 + 12 + 8)
    assert lines["layout"] == ["4", "2", str(total), str(4 * (12 + 30 + 12 + 8))]
    assert lines["split"] == ["['split',", "'split3d']"] and lines["split_after"] == lines["split"]
    assert all(lines[f"equal{i}"] == [str(i), "True"] for i in range(3))  # host copies put together exactly
    # one update graph compiled at the first step, then nothing: no graph and no replicating program per copy
    assert lines["after_first"] == ["1", "0"], proc.stdout
    assert lines["plain_cpu"] == ["0", "1", "True"], proc.stdout  # the counter sees what UncachedCompile misses


PROFILE_PROBE = """
import sys, torch
from ddpo_tpu.config.compose import compose_and_validate
from ddpo_tpu.runtime import make_runtime
rt = make_runtime(compose_and_validate(["tpu_topology=cpu"]).cfg)
x = torch.randn(16, 16).to(rt.device)
for step in (3, 4):
    with rt.profile(sys.argv[1], step):  # what xla.profile_steps=[3,4] wraps around those optimizer steps
        (x @ x).sin().sum()
        rt.sync()
"""


def test_profile_steps_write_a_trace_per_step_into_the_run_dir(tmp_path):
    import gzip
    import json

    proc = subprocess.run([sys.executable, "-c", PROFILE_PROBE, str(tmp_path)], cwd=REPO,
                          env=clean_env(PJRT_DEVICE="CPU"), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for step in (3, 4):
        traces = list((tmp_path / "profile" / f"step_{step}").rglob("*.trace.json.gz"))
        assert len(traces) == 1 and list(traces[0].parent.glob("*.xplane.pb")), step
        events = json.loads(gzip.decompress(traces[0].read_bytes()))["traceEvents"]
        assert len(events) > 10  # host and XLA activity of that step, viewable in TensorBoard / Perfetto


@pytest.mark.extended  # 2 SPMD processes, ~400 s here: CI keeps the module runs' FSDP split, graph set and checkpoints
def test_fsdp_with_lora_resumes_split_and_compiles_nothing_after_its_first_epoch(tmp_path, model_cache):
    """LoRA (frozen base weights split, rank-4 factors split where dim 0 divides) under dp 2 x fsdp 2: a run of one
    epoch, then the same command with num_epochs=3 resumes from its checkpoint, reloading the AdamW moments one
    parameter at a time into the split layout."""
    args = [*SMOKE, "tpu_topology=cpu_spmd4", "tpu_topology.mesh.dp=2", "tpu_topology.mesh.fsdp=2",
            "model.lora.enabled=true", "save_freq=1", "sample.batch_size=2", "train.batch_size=1",
            "sample.num_steps=6", "sample.num_batches_per_epoch=1", f"model.cache_dir={model_cache}"]
    first = run_train([*args, "num_epochs=1"], tmp_path, timeout=900)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-2000:]
    second = run_train([*args, "num_epochs=3"], tmp_path, timeout=900)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-2000:]
    run = tmp_path / "outputs" / "smoke"
    assert "resumed from" in (run / "train.log").read_text()
    layouts = [{k: v for k, v in r.items() if k not in ("time", "pid")} for r in ev.read_events(run)
               if r["event"] == "state_layout"]
    assert len(layouts) == 2 and layouts[0] == layouts[1]
    assert layouts[0]["sharded"] > 0 and layouts[0]["bytes_per_device"] < layouts[0]["bytes_total"]
    epochs = read_metrics(run, "epoch")
    assert [e["epoch"] for e in epochs] == [0, 1, 2]
    assert all(math.isfinite(e["loss"]) and e["approx_kl"] < 1e-3 for e in epochs)
    last = epochs[2]  # the second epoch of the resumed process
    assert last["new_compilations"] == 0, last["phases"]
    for phase, data in last["phases"].items():
        assert data.get("replicate_compilations", 0) <= sum(data.get("cpu_fallbacks", {}).values()), (phase, data)


SAMPLER_PROBE = """
import json, sys, torch
from ddpo_tpu.config.compose import compose_and_validate
from ddpo_tpu.runtime import make_runtime
from ddpo_tpu.models.from_config import load_from_config
from ddpo_tpu.diffusion.ddim import DDIMTables
from ddpo_tpu.diffusion.sampling import make_denoise_step, sample_trajectory
args = ["+experiment=smoke", "model.lora.enabled=true", f"model.cache_dir={sys.argv[1]}"]
runtimes = [make_runtime(compose_and_validate([*args, f"tpu_topology={t}"]).cfg) for t in ("eager_cpu", "cpu")]
from ddpo_tpu.models.lora import make_trainable
model_cfg = compose_and_validate(args).cfg.model
comps = load_from_config(model_cfg)
make_trainable(comps.unet, model_cfg)
g = torch.Generator().manual_seed(0)
B, T = 4, 6
cond, uncond = torch.randn(B, 77, 32, generator=g), torch.randn(B, 77, 32, generator=g)
inits = [torch.randn(B, 4, 8, 8, generator=g) for _ in range(2)]
noises = [torch.randn(T, B, 4, 8, 8, generator=g) for _ in range(2)]
out, compiles = {}, []
for rt in runtimes:
    unet = comps.unet.to(rt.device)
    tables = DDIMTables.from_scheduler(comps.scheduler, T, rt.device)
    step = rt.compile_step(make_denoise_step(unet, tables, eta=1.0, guidance_scale=5.0))
    for k in range(2):  # two batches: the second compiles nothing
        traj = sample_trajectory(step, T, cond.to(rt.device), uncond.to(rt.device), inits[k], noises[k], rt=rt,
                                 sync_every=0)
        out[(rt.name, k)] = (rt.to_host(traj.latents), rt.to_host(traj.log_probs))
        compiles.append(rt.counters().compilations)
rel = lambda a, b: float((a - b).abs().max() / b.abs().max())
print(json.dumps({"latents": max(rel(out[("xla", k)][0], out[("eager_cpu", k)][0]) for k in range(2)),
                  "log_probs": max(rel(out[("xla", k)][1], out[("eager_cpu", k)][1]) for k in range(2)),
                  "xla_compiles": compiles[2:]}))
"""


def test_compiled_sampler_equals_eager_and_compiles_once(model_cache):
    """The dynamo-compiled denoising step (xla.step_compiler=dynamo, the default) against plain eager PyTorch on the
    tiny model with LoRA: the same trajectories and log-probs within 1e-5 relative; a second batch with new noise
    replays the compiled step (no new compilation)."""
    import json

    proc = subprocess.run([sys.executable, "-c", SAMPLER_PROBE, str(model_cache)], cwd=REPO,
                          env=clean_env(PJRT_DEVICE="CPU"), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["latents"] < 1e-5 and res["log_probs"] < 1e-5, res
    first, second = res["xla_compiles"]
    assert first > 0 and second == first, res


@pytest.mark.extended  # SD 1.4's full block topology on XLA: CI runs the tiny UNet's graph discipline above
def test_sd14_topology_trains_on_xla_with_a_fixed_graph_set(tmp_path, model_cache):
    """SD 1.4's topology (narrow) through the real launcher on XLA CPU: compiled steps, 2 fused timesteps, LoRA;
    the second epoch compiles nothing and each phase reports the main thread's CPU time."""
    args = ["model=sd14_topology", "tpu_topology=cpu", "sample.num_steps=4", "sample.batch_size=2",
            "sample.num_batches_per_epoch=1", "train.batch_size=1", "train.gradient_accumulation_steps=2",
            "train.timesteps_per_micro_step=2", "num_epochs=2", "save_freq=2", "reward.host_workers=0",
            f"model.cache_dir={model_cache}", FAST_XLA_CPU]
    proc = run_train(args, tmp_path, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    run = tmp_path / "outputs" / "ddpo"
    epochs = read_metrics(run, "epoch")
    assert [e["epoch"] for e in epochs] == [0, 1]
    assert epochs[0]["new_compilations"] > 0 and epochs[1]["new_compilations"] == 0, epochs[1]["phases"]
    assert all(math.isfinite(e["loss"]) for e in epochs)
    for e in epochs:
        assert all(0 <= p["host_seconds"] <= p["seconds"] + 0.05 for p in e["phases"].values()), e["phases"]
    assert (run / "weights" / "final.safetensors").is_file()


CHECKPOINT_PROBE = """
import json, sys, torch, torch_xla
from ddpo_tpu.config.compose import compose_and_validate
from ddpo_tpu.runtime import make_runtime
from ddpo_tpu.models.from_config import load_from_config
from ddpo_tpu.models.lora import make_trainable
cfg = compose_and_validate(["+experiment=smoke", "model.lora.enabled=true", "tpu_topology=cpu",
                            "xla.step_compiler=lazy", f"model.cache_dir={sys.argv[1]}"]).cfg
rt = make_runtime(cfg)
unet = load_from_config(cfg.model).unet
make_trainable(unet, cfg.model)
unet.to(rt.device)
g = torch.Generator().manual_seed(0)
x, text = torch.randn(2, 4, 8, 8, generator=g).to(rt.device), torch.randn(2, 77, 32, generator=g).to(rt.device)
t = torch.tensor([500, 20], device=rt.device)
calls, lazy_checkpoint = [], rt.checkpoint_function()
def counted(module, *args):
    # a block with nothing to train and no input that needs a gradient has nothing to recompute in the backward
    trains = any(p.requires_grad for p in module.parameters())
    calls.append((type(module).__name__, trains or any(torch.is_tensor(a) and a.requires_grad for a in args)))
    return lazy_checkpoint(module, *args)
out = {}
for name in ("plain", "checkpointed"):
    if name == "checkpointed":
        unet.enable_gradient_checkpointing(counted)
    unet.zero_grad(set_to_none=True)
    unet(x, t, text).sample.square().mean().backward()
    grads = [p.grad for p in unet.parameters() if p.requires_grad]
    hlo = torch_xla._XLAC._get_xla_tensors_hlo([g for g in grads if g is not None])
    rt.sync()  # one graph for all gradients, then plain copies
    out[name] = dict(hlo=hlo, grads=[None if g is None else g.cpu() for g in grads])
flat = lambda gs: torch.cat([g.ravel() for g in gs])
a, b = (flat(out[n]["grads"]) for n in ("plain", "checkpointed"))
print(json.dumps({"calls": len(calls), "needed": sum(n for _, n in calls), "kinds": sorted({k for k, _ in calls}),
                  "barriers": {n: out[n]["hlo"].count("opt-barrier(") for n in out},
                  "missing_grads": sum(g is None for g in out["checkpointed"]["grads"]),
                  "rel": float((a - b).norm() / a.norm())}))
"""


def test_lazy_checkpointing_puts_a_barrier_before_each_recomputation(model_cache):
    """train.activation_checkpointing on the lazy path (xla.step_compiler=lazy): the forward and backward are one
    graph, so each block's recomputation must sit behind an optimization barrier, or XLA merges it with the forward
    and keeps every activation. One barrier per checkpointed block call in the gradients' graph, none without; every
    LoRA weight still gets its gradient (the first blocks' inputs are frozen), equal to the unchecked one. (A block
    with no trainable weight before it, the first resnet, has nothing to recompute: XLA drops its barrier as dead.)"""
    import json

    proc = subprocess.run([sys.executable, "-c", CHECKPOINT_PROBE, str(model_cache)], cwd=REPO,
                          env=clean_env(PJRT_DEVICE="CPU", XLA_FLAGS=" ".join(FAST_XLA_FLAGS)), capture_output=True,
                          text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["calls"] > 0 and {"ResnetBlock2D", "BasicTransformerBlock"} <= set(res["kinds"]), res
    assert res["barriers"] == {"plain": 0, "checkpointed": res["needed"]} and res["needed"] >= res["calls"] - 1, res
    assert res["missing_grads"] == 0 and res["rel"] < 1e-5, res
