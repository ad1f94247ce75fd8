"""ddpo_tpu side by side with the reference it reproduces, on one device, in one command
(`python scripts/bench_accelerator.py --side-by-side --ddpo-pytorch CLONE --flow-grpo CLONE`): the same model shape
with the same random weights, built here (benchmarks/checkpoints.py; no model hub), run by

* sd14: ddpo_tpu's trainer (`+experiment=compressibility_parity model=sd14_random`) and kvablack/ddpo-pytorch's
  scripts/train.py (`--config=config/dgx.py:compressibility`, the same directory as `config.pretrained.model`);
* sd35: ddpo_tpu's trainer (`+experiment=flow_grpo_pickscore_sd35`, `model.pretrained=` the SD 3.5 Medium-shaped
  directory) and yifan123/flow_grpo's scripts/train_sd3.py (`config/grpo.py:pickscore_sd3` through
  benchmarks/reference_configs/flow_grpo_sd35.py, which swaps PickScore, a hub model, for JPEG compressibility).

The references run unmodified, from clones the user passes (never copied into this repo), each with the diffusers
it pins first on PYTHONPATH (--ref-site: folders scripts/device_check.sh fills from scripts/device_wheels.sh's
wheels), timed from outside by benchmarks/reference_harness.py. Epochs are shortened, never the model: the per-device
batch sizes stay the references' (8 sampled / 4 trained for SD 1.4; 9 / 9 for SD 3.5 Medium), fewer batches and
denoising steps make an epoch (both sides the same); epoch 0 compiles / warms up (reported apart), the measured
epoch is the median (by its seconds) of the epochs after it: the last one when there are two. On a CPU both sides run
with the same intra-op thread count, 1 unless --threads says otherwise (OMP_NUM_THREADS and MKL_NUM_THREADS): with
torch's default (one thread a core) a 2-core machine shared with other work made either side's epoch 3-40x slower
at random, depending on what else ran at that moment (docs/performance.md, "Where the tiny-SD3 epoch's time goes").
Single-GPU adjustments, both sides alike: flow_grpo's KL term (beta > 0) calls `transformer.module`, which exists
only under DDP (scripts/train_sd3.py@ac4c86e:877), so beta = 0 (kl_beta=0); groups of 9 (one GPU's batch) instead
of 24 across 32 GPUs. On a CPU (--size tiny, the tests) the references run with `--config.mixed_precision=no`:
accelerate refuses fp16 without a GPU.

Per side: sampling and training images/s (the epoch's samples over the phase's seconds), epoch seconds (sampling
through training), MFU of the epoch and of the training phase (the project's FLOP figures, those of
benchmarks/probes/accelerator.py, over seconds x the device's dense bf16 peak), peak device memory (the allocator's),
warm-up seconds (epoch 0 minus the measured epoch; ddpo_tpu also reports its compile seconds), seconds before the
first epoch (loading); then ddpo_tpu / reference for each rate. The heading names the device, torch and CUDA.

Memory-model constants: none set here; each side's peak_device_gib at the SD 1.4 and SD 3.5 Medium shapes is the
measured point ddpo_tpu/catalog/families.py's estimates (SD1_RESIDENT_GIB, SD3_STATE_GIB, activation_gib_per_eval_512)
wait for.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import runner
from benchmarks.probes.accelerator import MODEL_TFLOP

# dense bf16 (and fp16) peak TFLOP/s by device name (datasheets: H100/H200 SXM 989, A100 312); CPU: a nominal 1
PEAKS = (("H200", 989.0), ("H100", 989.0), ("A100", 312.0))
# the shortened epochs: per-device batch sizes are the references'; batches and steps are what fits a lease
SIZES = {
    "full": {"sd14": dict(checkpoint="sd14", ddpo_model="model=sd14_random", batch=8, batches=2, steps=20,
                          train_batch=4, accum=2, flops="sd14"),
             "sd35": dict(checkpoint="sd35_medium", ddpo_model="model=sd35_medium", batch=9, batches=2, steps=10,
                          train_batch=9, accum=1, eval_steps=10, resolution=512, flops="sd35_medium")},
    "tiny": {"sd14": dict(checkpoint="tiny", ddpo_model="model=tiny", batch=8, batches=1, steps=4, train_batch=4,
                          accum=2, flops="tiny"),
             "sd35": dict(checkpoint="tiny_sd3", ddpo_model="model=sd35_medium", batch=3, batches=2, steps=4,
                          train_batch=3, accum=1, eval_steps=2, resolution=32, flops="tiny")},
}
REFERENCES = {"sd14": ("ddpo-pytorch", "scripts/train.py"), "sd35": ("flow_grpo", "scripts/train_sd3.py")}
# what the references compute in on a GPU (config.mixed_precision fp16): ddpo-pytorch casts the frozen UNet to fp16
# (scripts/train.py@1958463:113-121); flow_grpo keeps the transformer float32 (scripts/train_sd3.py@ac4c86e:296);
# accelerate.prepare wraps the trained module's forward in fp16 autocast in both
PRECISION = {"sd14": "fp16 weights, fp16 autocast", "sd35": "float32 weights, fp16 autocast"}
TRAIN_FRACTION = {"sd14": 1.0, "sd35": 0.99}  # the configs' train.timestep_fraction (int(steps x fraction) trained)


def add_arguments(ap) -> None:
    ap.add_argument("--ddpo-pytorch", type=Path, help="a clone of kvablack/ddpo-pytorch (for the sd14 pair)")
    ap.add_argument("--flow-grpo", type=Path, help="a clone of yifan123/flow_grpo (for the sd35 pair)")
    ap.add_argument("--ref-site", nargs=2, action="append", default=[], metavar=("PAIR", "PATHS"),
                    help="a reference's own packages (os.pathsep-separated folders) put first on its PYTHONPATH")
    ap.add_argument("--pairs", nargs="+", choices=list(REFERENCES), default=list(REFERENCES))
    ap.add_argument("--size", choices=list(SIZES), default="full", help="full: SD 1.4 / SD 3.5 Medium; tiny: CPU")
    ap.add_argument("--topology", default="gpu-1", help="ddpo_tpu's tpu_topology (gpu-1; eager_cpu on a CPU)")
    ap.add_argument("--epochs", type=int, default=2, help="epochs per side; the median of those after the first "
                    "is measured (3 or more on a shared CPU)")
    ap.add_argument("--threads", type=int, help="intra-op threads of both sides (default: 1 on a CPU topology, "
                    "torch's own on a GPU)")
    ap.add_argument("--cache-dir", type=Path, default=Path("~/.cache/ddpo_tpu/models"))
    ap.add_argument("--peak-tflops", type=float, help="the device's peak (default: by its name)")
    ap.add_argument("--json-out", type=Path, help="also write the rows here")
    ap.add_argument("--timeout", type=float, default=600, help="seconds each side may run")
    ap.add_argument("--deadline-s", type=float, help="seconds the whole bench may run: a side gets what is left")


# ---------------------------------------------------------------------------------------------- FLOPs and rows


def epoch_tflop(pair: str, s: dict) -> tuple[float, float]:
    """(sampling, training) TFLOP of one epoch at shape s: CFG (2 evaluations) at every sampling step and every
    trained timestep, forward + backward = 3 forwards, one VAE decode per sample (the project's figures)."""
    per_eval, decode = MODEL_TFLOP[s["flops"]]
    samples = s["batch"] * s["batches"]
    trained = int(s["steps"] * TRAIN_FRACTION[pair])
    return samples * (s["steps"] * 2 * per_eval + decode), samples * trained * 2 * 3 * per_eval


def row(pair: str, side: str, s: dict, m: dict, peak: float) -> dict:
    """One side's table row from its measured phases m (sampling_s, training_s, epoch_s, warmup_s, ...)."""
    samples = s["batch"] * s["batches"]
    sampling_tf, training_tf = epoch_tflop(pair, s)
    rate = lambda sec: round(samples / sec, 3) if sec else None
    return {"pair": pair, "side": side, "precision": m.get("precision"), "samples/epoch": samples,
            "sampling img/s": rate(m["sampling_s"]), "training img/s": rate(m["training_s"]),
            "epoch img/s": rate(m["epoch_s"]), "epoch s": round(m["epoch_s"], 2),
            "MFU epoch %": round(100 * (sampling_tf + training_tf) / (m["epoch_s"] * peak), 2),
            "MFU training %": round(100 * training_tf / (m["training_s"] * peak), 2),
            "peak GiB": m.get("peak_gib"), "warm-up s": m.get("warmup_s"), "compile s": m.get("compile_s"),
            "load s": m.get("load_s"), "threads": m.get("threads"), "machine load": m.get("machine_load")}


def ratios(rows: list[dict]) -> list[dict]:
    """ddpo_tpu / reference for each rate, per pair (a pair with a side missing or failed has none)."""
    out = []
    for pair in dict.fromkeys(r["pair"] for r in rows):
        sides = {r["side"]: r for r in rows if r["pair"] == pair and "failed" not in r}
        ours = sides.pop("ddpo_tpu", None)
        for ref_name, ref in sides.items():
            if ours is None:
                continue
            div = lambda k: round(ours[k] / ref[k], 2) if ours.get(k) and ref.get(k) else None
            out.append({"pair": pair, "ddpo_tpu / reference": ref_name, "sampling img/s": div("sampling img/s"),
                        "training img/s": div("training img/s"), "epoch img/s": div("epoch img/s")})
    return out


# ---------------------------------------------------------------------------------------------- ddpo_tpu's side


def bounded(cmd: list[str], env: dict, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """cmd to completion, or its whole process group ended after `timeout` s (a trainer's workers hold the GPU)."""
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=20)
        raise RuntimeError(f"{' '.join(cmd[:4])} ... ran past {timeout:.0f} s and was stopped") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def side_env(threads: int | None, **extra: str) -> dict:
    """The environment of either side: the same intra-op thread count for both when one is given."""
    pinned = {name: str(threads) for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")} if threads else {}
    return runner.clean_env(**pinned, **extra)


def median_epoch(measured: list[dict]) -> dict:
    """The epoch whose seconds are the median of the epochs after the first (warm-up), itself when it is the only
    one: one slow epoch (another process on the cores, a page-cache miss) does not become the figure."""
    later = sorted(measured[1:] or measured, key=lambda e: e["epoch_s"])
    return later[(len(later) - 1) // 2]


def ddpo_tpu_phases(epochs: list[dict]) -> dict:
    """ddpo_tpu's epoch records (metrics.jsonl) -> the measured epoch's seconds and the warm-up, as the reference's."""
    work = lambda e: sum(e["phases"][k]["seconds"] for k in ("sampling", "reward", "advantages", "training"))
    per = [{"sampling_s": e["phases"]["sampling"]["seconds"], "training_s": e["phases"]["training"]["seconds"],
            "epoch_s": work(e)} for e in epochs]
    m = median_epoch(per)
    return {**m, "warmup_s": round(per[0]["epoch_s"] - m["epoch_s"], 1) if len(per) > 1 else None,
            "all_s": sum(p["epoch_s"] for p in per)}


def ddpo_tpu_overrides(pair: str, s: dict, model_dir: Path, topology: str, epochs: int, prompts: Path) -> list[str]:
    cuda = not topology.startswith(("eager_cpu", "cpu"))
    common = [f"tpu_topology={topology}", "parity=none", f"num_epochs={epochs}", f"save_freq={epochs + 1}",
              f"sample.batch_size={s['batch']}", f"sample.num_batches_per_epoch={s['batches']}",
              f"sample.num_steps={s['steps']}", f"train.batch_size={s['train_batch']}",
              f"train.gradient_accumulation_steps={s['accum']}"]
    # bf16 on a GPU; float32 on a CPU, as the references compute there (the SD 3.5 experiment sets bf16)
    common += ["train.mixed_precision=bf16", "model.dtype=bfloat16"] if cuda else ["train.mixed_precision=no",
                                                                                   "model.dtype=float32"]
    if pair == "sd14":
        return ["+experiment=compressibility_parity", s["ddpo_model"], f"model.cache_dir={model_dir.parent}", *common]
    return ["+experiment=flow_grpo_pickscore_sd35", s["ddpo_model"], f"model.pretrained={model_dir}",
            f"model.resolution={s['resolution']}", "reward=jpeg_compressibility", f"prompts.path={prompts}",
            f"algorithm.group_size={s['batch']}", "algorithm.kl_beta=0", "train.ema_every=1", *common]


def measure_ddpo_tpu(overrides: list[str], out_root: Path, timeout: float, threads: int | None = None) -> dict:
    t0 = time.perf_counter()
    proc = bounded([sys.executable, "-m", "ddpo_tpu.train", *overrides, f"output_root={out_root}",
                    "run_name=side_by_side"], side_env(threads), runner.REPO, timeout)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise RuntimeError(f"ddpo_tpu exited {proc.returncode}: {runner.failure(proc, 1500)}")
    run = out_root / "side_by_side"
    epochs = runner.read_records(run, "epoch")
    m = ddpo_tpu_phases(epochs)
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(run / "config.yaml")
    return {**m, "compile_s": round(sum(p["compile_seconds"] for p in epochs[0]["phases"].values()), 1),
            "peak_gib": max((e["device_peak_gib"] or 0) for e in epochs) or None,
            "load_s": round(wall - m.pop("all_s"), 1),
            "precision": f"{cfg.model.dtype} weights, {cfg.train.mixed_precision} autocast", "wall_s": round(wall, 1)}


# ---------------------------------------------------------------------------------------------- the reference


def reference_argv(pair: str, s: dict, model_dir: Path, epochs: int, cuda: bool, work: Path,
                   prompts: Path) -> list[str]:
    """The reference's own command line (after `python SCRIPT`): its named config, then the shortening flags."""
    precision = [] if cuda else ["--config.mixed_precision=no"]
    if pair == "sd14":
        return ["--config=config/dgx.py:compressibility", f"--config.pretrained.model={model_dir}",
                f"--config.num_epochs={epochs}", f"--config.save_freq={epochs + 1}", f"--config.logdir={work}",
                f"--config.sample.num_batches_per_epoch={s['batches']}", f"--config.sample.num_steps={s['steps']}",
                *precision]
    config = runner.REPO / "benchmarks" / "reference_configs" / "flow_grpo_sd35.py"
    return [f"--config={config}:pickscore_sd3", f"--config.pretrained.model={model_dir}",
            f"--config.dataset={prompts.parent}", f"--config.resolution={s['resolution']}",
            f"--config.sample.num_steps={s['steps']}", f"--config.sample.eval_num_steps={s['eval_steps']}",
            f"--config.sample.train_batch_size={s['batch']}", f"--config.sample.test_batch_size={s['batch']}",
            f"--config.sample.num_image_per_prompt={s['batch']}",
            f"--config.sample.num_batches_per_epoch={s['batches']}", f"--config.train.batch_size={s['train_batch']}",
            f"--config.train.gradient_accumulation_steps={s['accum']}", "--config.train.beta=0",
            f"--config.eval_freq={epochs + 1}", f"--config.save_freq={epochs + 1}",
            f"--config.save_dir={work / 'save'}", f"--config.logdir={work}", *precision]


def phases_to_measure(record: dict, epochs: int) -> dict:
    """The harness's phases -> the measured (median) epoch's seconds, the warm-up and the loading time."""
    ph = record["phases"]

    def epoch(n: int) -> dict:
        find = lambda desc: next((p for p in ph if p["desc"] == desc), None)
        sampling, training = find(f"Epoch {n}: sampling"), find(f"Epoch {n}.0: training")
        if sampling is None or training is None:
            raise RuntimeError(f"the reference's epoch {n} was not timed ({record['outcome']})")
        return {"sampling_s": sampling["end"] - sampling["start"], "training_s": training["end"] - training["start"],
                "epoch_s": training["end"] - sampling["start"], "start": sampling["start"]}

    per = [epoch(n) for n in range(epochs)]
    measured, first = median_epoch(per), per[0]
    evals = [p for p in ph if p["desc"].startswith("Eval")]
    load_end = evals[0]["start"] if evals else first["start"]
    return {**measured, "warmup_s": round(first["epoch_s"] - measured["epoch_s"], 1) if epochs > 1 else None,
            "peak_gib": record.get("peak_device_gib"), "load_s": round(load_end, 1),
            "eval_s": round(sum(p["end"] - p["start"] for p in evals), 1)}


def measure_reference(pair: str, clone: Path, site: str, argv: list[str], work: Path, epochs: int,
                      timeout: float, threads: int | None = None) -> dict:
    out = work / "harness.json"
    env = side_env(threads, WANDB_MODE="disabled")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (site, str(clone)) if p)  # the reference's packages, not ours
    harness = runner.REPO / "benchmarks" / "reference_harness.py"
    cmd = [sys.executable, str(harness), "--json", str(out), "--stop-after", str(epochs), "--",
           REFERENCES[pair][1], *argv]
    proc = bounded(cmd, env, clone, timeout)
    (work / "reference.log").write_text(proc.stdout + proc.stderr)
    if not out.exists():
        raise RuntimeError(f"the reference wrote no record (exit {proc.returncode}): {runner.failure(proc, 1500)}")
    record = json.loads(out.read_text())
    m = phases_to_measure(record, epochs)
    m["precision"] = "float32" if "--config.mixed_precision=no" in argv else PRECISION[pair]
    m["versions"], m["command"] = record["versions"], shlex.join(["python", REFERENCES[pair][1], *argv])
    return m


# ---------------------------------------------------------------------------------------------- the run


def device_facts() -> dict:
    """The device, torch and CUDA, from a child process (the front never imports torch)."""
    code = ("import json, torch; c = torch.cuda.is_available(); print(json.dumps({'device': "
            "torch.cuda.get_device_name(0) if c else 'cpu', 'torch': torch.__version__, 'cuda': torch.version.cuda "
            "if c else None}))")
    return json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                     env=runner.clean_env()).stdout.strip().splitlines()[-1])


def peak_of(device: str, given: float | None) -> float:
    return given or next((p for name, p in PEAKS if name in device), 1.0)


def checkpoint(spec: str, cache_dir: Path) -> dict:
    proc = subprocess.run([sys.executable, "-m", "benchmarks.checkpoints", spec, str(cache_dir)], cwd=runner.REPO,
                          env=runner.clean_env(), capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"building {spec} failed: {runner.failure(proc, 1500)}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def write_prompts(work: Path, n: int) -> Path:
    """flow_grpo's dataset layout (train.txt, test.txt): the same prompt file for both sides, a test split of one
    evaluation batch (its clone's dataset/ is not needed)."""
    work.mkdir(parents=True, exist_ok=True)
    animals = (runner.REPO / "ddpo_tpu" / "prompts" / "assets" / "simple_animals.txt").read_text().split()
    (work / "train.txt").write_text("\n".join(animals) + "\n")
    (work / "test.txt").write_text("\n".join(animals[:n]) + "\n")
    return work / "train.txt"


def run_pair(pair: str, args, facts: dict, work: Path, deadline: float) -> list[dict]:
    s, rows = SIZES[args.size][pair], []
    peak = peak_of(facts["device"], args.peak_tflops)
    t0 = time.perf_counter()
    try:
        dirs = checkpoint(s["checkpoint"], args.cache_dir)
    except RuntimeError as exc:
        return [runner.progress({"pair": pair, "side": "both", "failed": " ".join(str(exc).split())[:600]})]
    build_s = round(time.perf_counter() - t0, 1)
    prompts = write_prompts(work, s["batch"])
    sides = [("ddpo_tpu", None)]
    clone = getattr(args, REFERENCES[pair][0].replace("-", "_"))
    sides.append((REFERENCES[pair][0], clone))
    sites = dict(args.ref_site)
    threads = cpu_threads(args)
    for side, ref_clone in sides:
        side_work = work / side
        side_work.mkdir(parents=True, exist_ok=True)
        timeout = min(args.timeout, deadline - time.monotonic())
        try:
            if timeout < 30:
                raise RuntimeError(f"not run: {max(timeout, 0):.0f} s were left of --deadline-s")
            if side == "ddpo_tpu":
                # sd14: ddpo_tpu's own build in the same cache; sd35: the directory the reference loads
                model = Path(dirs["model" if pair == "sd14" else "reference_model"])
                overrides = ddpo_tpu_overrides(pair, s, model, args.topology, args.epochs, prompts)
                load0 = os.getloadavg()[0]
                m = measure_ddpo_tpu(overrides, side_work, timeout, threads)
                m["command"] = shlex.join(["python", "-m", "ddpo_tpu.train", *overrides])
            elif ref_clone is None:
                raise RuntimeError(f"no clone given (--{REFERENCES[pair][0].replace('_', '-')} PATH)")
            else:
                argv = reference_argv(pair, s, Path(dirs["reference_model"]), args.epochs,
                                      facts["device"] != "cpu", side_work, prompts)
                load0 = os.getloadavg()[0]
                m = measure_reference(pair, ref_clone.resolve(), sites.get(pair, ""), argv, side_work, args.epochs,
                                      timeout, threads)
            # the 1-minute load average when the side started and ended (2 cores: above ~1, others shared them)
            m["threads"], m["machine_load"] = threads, f"{load0:.1f}-{os.getloadavg()[0]:.1f}"
            if threads:
                m["command"] = f"OMP_NUM_THREADS={threads} MKL_NUM_THREADS={threads} {m['command']}"
            rows.append(runner.progress({**row(pair, side, s, m, peak), "command": m["command"],
                                         "versions": m.get("versions"), "checkpoint build s": build_s}))
        except (RuntimeError, subprocess.TimeoutExpired, KeyError, IndexError, ValueError) as exc:
            rows.append(runner.progress({"pair": pair, "side": side, "failed": " ".join(str(exc).split())[:600]}))
    return rows


def cpu_threads(args) -> int | None:
    """--threads, else 1 for both sides on a CPU topology (see the module's docstring), else torch's default."""
    if args.threads:
        return args.threads
    return 1 if args.topology.startswith(("eager_cpu", "cpu")) else None


def run(args, report: runner.Report) -> dict:
    deadline = time.monotonic() + (args.deadline_s or float("inf"))
    facts = device_facts()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for pair in args.pairs:
            rows += run_pair(pair, args, facts, Path(tmp) / pair, deadline)
    peak = peak_of(facts["device"], args.peak_tflops)
    shown = [{k: v for k, v in r.items() if k not in ("command", "versions")} for r in rows]
    commands = "\n".join(f"- {r['pair']} {r['side']}: `{r['command']}`" + (
        f" (diffusers {r['versions']['diffusers']}, transformers {r['versions']['transformers']}, accelerate "
        f"{r['versions']['accelerate']}, peft {r['versions']['peft']})" if r.get("versions") else "")
        for r in rows if r.get("command"))
    report.add(f"Side by side on {facts['device']} (torch {facts['torch']}, CUDA {facts['cuda']}; peak {peak} "
               f"TFLOP/s for MFU), size `{args.size}`, {args.epochs} epochs a side (the median of those after the "
               f"first measured), intra-op threads {cpu_threads(args) or 'torch default'} a side:\n\n"
               f"{runner.table(shown)}\n\n{runner.table(ratios(rows))}\n\nCommands:\n{commands}")
    result = {"device": facts, "rows": rows, "ratios": ratios(rows)}
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    runner.main(sys.modules[__name__])
