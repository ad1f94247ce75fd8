"""What one training step costs the host, counted: ddpo_tpu's tiny-SD3 GRPO step against yifan123/flow_grpo's
(issue 41, item 2; docs/performance.md "Where the tiny-SD3 epoch's time goes").

A training step here is one micro-step (one timestep of one train batch: the guided forward, the loss, the
backward) plus its share of the optimizer steps, as the side-by-side bench's tiny sd35 pair runs it
(benchmarks/probes/side_by_side.py SIZES["tiny"]["sd35"]: 2 sampling batches of 3, groups of 3, 4 denoising steps,
train batch 3, no accumulation, guidance at train time, kl_beta 0, float32): 2 train batches x 3 trained timesteps
= 6 micro-steps and 2 optimizer steps an epoch. Both sides train the same PEFT-wrapped tiny SD3 transformer (built
by ddpo_tpu's Trainer, loaded through from_pretrained), so the transformer's own forward and backward are the same
ops on both sides and what differs is the code around them:

* ddpo_tpu: `Trainer.epoch_trainer.train_epoch` on an epoch the Trainer sampled (training/ppo_epoch.py, the Stepper,
  algorithms/grpo.py's loss, diffusion/flow.py's step);
* flow_grpo: its training loop (scripts/train_sd3.py@ac4c86e:843-953: compute_log_prob at :180-215, the clipped
  loss, accelerate's `accumulate`/`backward`/`clip_grad_norm_`, AdamW, `optimizer.zero_grad()`), with its own
  `sde_step_with_logprob` loaded from a clone (flow_grpo/diffusers_patch/sd3_sde_with_logprob.py) and diffusers'
  FlowMatchEulerDiscreteScheduler, on samples of the same shapes. Its EMA (every 8 steps) and wandb are left out.

Counted per micro-step (the epoch's training phase over its micro-steps; exact, independent of load):
* aten ops: every op a TorchDispatchMode sees (forward, backward and optimizer; the CPU autograd engine runs the
  backward on the calling thread);
* parallel ops: those that may use the intra-op thread pool (a matrix product, or an op touching a tensor of at
  least 32768 elements, at::parallel_for's grain): each one waits for every intra-op thread, the cost that grows when
  another process holds a core;
* host reads: data-dependent reads of a tensor's value by the host (`aten::_local_scalar_dense`: .item(),
  bool(t), float(t); `aten::nonzero`; Tensor.tolist and .numpy on the result of a computation). On a GPU or TPU each
  is a device sync; on a CPU each is a barrier for the intra-op thread pool;
* allocations: the profiler's memory events with a positive size (torch.profiler, profile_memory=True);
* ms per micro-step at 1 and 2 intra-op threads (torch.set_num_threads): the two sides alternate, the median of
  `--repeats` epochs each. Timings depend on what else runs on the machine; the counts do not.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/step_ops.py --flow-grpo CLONE [--append]

CLONE: a clone of yifan123/flow_grpo (any commit with flow_grpo/diffusers_patch/sd3_sde_with_logprob.py).
--append writes the table to benchmarks/RESULTS.md with the date, machine and commit.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import datetime
import importlib.util
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
OVERRIDES = ["+experiment=flow_grpo_smoke", "num_epochs=1", "save_freq=2", "reward.host_workers=0",
             "sample.batch_size=3", "sample.num_batches_per_epoch=2", "sample.num_steps=4", "algorithm.group_size=3",
             "train.batch_size=3", "train.gradient_accumulation_steps=1", "sample.guidance_scale=4.5",
             "train.cfg=true", "algorithm.kl_beta=0", "train.mixed_precision=no", "model.dtype=float32"]
READS = ("aten._local_scalar_dense", "aten.nonzero")
# ops that may run on the intra-op thread pool: at::parallel_for splits an op of at least GRAIN elements
# (at::internal::GRAIN_SIZE); matrix products go to the BLAS/oneDNN's own threading whatever their size. Each such op
# is a barrier for every intra-op thread: with a thread descheduled by another process, the op waits for it
GRAIN = 32768
MATMULS = ("aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "aten.matmul",
           "aten._scaled_dot_product_flash_attention_for_cpu",
           "aten._scaled_dot_product_flash_attention_for_cpu_backward", "aten.convolution", "aten.convolution_backward")


class Count(contextlib.ContextDecorator):
    """aten ops and host reads inside the context (this thread)."""

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counts = self.ops = collections.Counter()
        big = self.parallel = collections.Counter()

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = str(func.overloadpacket)
                counts[name] += 1
                out = func(*args, **(kwargs or {}))
                sizes = [t.numel() for t in torch.utils._pytree.tree_leaves((args, kwargs, out))
                         if isinstance(t, torch.Tensor)]
                if name in MATMULS or max(sizes, default=0) >= GRAIN:
                    big[name] += 1
                return out

        self._mode = Mode()
        self._mode.__enter__()
        self.tolist = 0
        real_tolist, real_numpy = torch.Tensor.tolist, torch.Tensor.numpy
        box = self

        def tolist(t, *a, **k):
            box.tolist += 1
            return real_tolist(t, *a, **k)

        def numpy(t, *a, **k):
            if t.grad_fn is not None or not t.is_leaf:
                box.tolist += 1
            return real_numpy(t, *a, **k)

        self._restore = (real_tolist, real_numpy)
        torch.Tensor.tolist, torch.Tensor.numpy = tolist, numpy
        return self

    def __exit__(self, *exc):
        torch.Tensor.tolist, torch.Tensor.numpy = self._restore
        self._mode.__exit__(*exc)
        return False

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    @property
    def reads(self) -> int:
        return sum(self.ops[k] for k in READS) + self.tolist


def allocations(fn) -> int:
    """Tensor allocations while fn runs (the profiler's memory events of positive size)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return sum(1 for e in prof.events() if e.name == "[memory]" and (e.cpu_memory_usage or 0) > 0)


def load_sde_step(clone: Path):
    path = clone / "flow_grpo" / "diffusers_patch" / "sd3_sde_with_logprob.py"
    spec = importlib.util.spec_from_file_location("flow_grpo_sd3_sde_with_logprob", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.sde_step_with_logprob


def build(tmp: Path):
    """The Trainer (tiny SD3, GRPO) and one sampled epoch's EpochSamples."""
    from ddpo_tpu.config.compose import compose_and_validate
    from ddpo_tpu.rundir.files import RunDir
    from ddpo_tpu.runtime import make_runtime
    from ddpo_tpu.training import loop

    v = compose_and_validate([*OVERRIDES, f"model.cache_dir={tmp / 'models'}"])
    (tmp / "run").mkdir()
    t = loop.Trainer(v.cfg, make_runtime(v.cfg), RunDir(tmp / "run"), tree=v.tree,
                     stop=SimpleNamespace(requested=False))
    t.report.step = lambda rec: None
    # distinct rewards (no zero-advantage group): every sample trains, as in flow_grpo's run of the same shape
    t.reward = lambda images, prompts: images.astype(np.float64).mean(axis=(1, 2, 3)) / 255.0
    sampled = t.sample_epoch(0)
    rewards = t.gather_rewards(0, sampled)
    return t, t.epoch_samples(0, sampled, rewards)


class Reference:
    """flow_grpo's training loop (scripts/train_sd3.py@ac4c86e:843-953) on samples shaped as ours."""

    def __init__(self, t, s, sde_step):
        from accelerate import Accelerator
        from diffusers import FlowMatchEulerDiscreteScheduler

        cfg = t.cfg
        self.model, self.sde_step, self.cfg = t.family.model, sde_step, cfg
        self.T = int(cfg.sample.num_steps * cfg.train.timestep_fraction)
        self.accelerator = Accelerator(gradient_accumulation_steps=cfg.train.gradient_accumulation_steps * self.T,
                                       mixed_precision="no", cpu=True)
        params = [p for p in self.model.parameters() if p.requires_grad]
        tr = cfg.train
        self.optimizer = self.accelerator.prepare(torch.optim.AdamW(
            params, lr=tr.learning_rate, betas=(tr.adam_beta1, tr.adam_beta2), weight_decay=tr.adam_weight_decay,
            eps=tr.adam_epsilon))
        sched = t.family.c.scheduler
        self.scheduler = FlowMatchEulerDiscreteScheduler.from_config(sched.config)
        self.scheduler.set_timesteps(cfg.sample.num_steps)
        N, B = s.latents.shape[0], cfg.train.batch_size
        embeds, pooled = s.cond
        ts = self.scheduler.timesteps[:cfg.sample.num_steps].expand(N, -1)
        adv = s.advantages.float()[:, None].expand(N, self.T)
        self.batches = [{"latents": s.latents[i:i + B, :-1], "next_latents": s.latents[i:i + B, 1:],
                         "timesteps": ts[i:i + B], "log_probs": s.log_probs[i:i + B], "advantages": adv[i:i + B],
                         "prompt_embeds": embeds[i:i + B], "pooled_prompt_embeds": pooled[i:i + B]}
                        for i in range(0, N, B)]
        neg = t.family.encode([""])
        self.neg = tuple(c.expand(B, *c.shape[1:]) for c in neg)

    def compute_log_prob(self, sample, j, embeds, pooled):
        g = self.cfg.sample.guidance_scale
        noise_pred = self.model(hidden_states=torch.cat([sample["latents"][:, j]] * 2),
                                timestep=torch.cat([sample["timesteps"][:, j]] * 2), encoder_hidden_states=embeds,
                                pooled_projections=pooled, return_dict=False)[0]
        uncond, text = noise_pred.chunk(2)
        uncond = uncond.detach()
        noise_pred = uncond + g * (text - uncond)
        return self.sde_step(self.scheduler, noise_pred.float(), sample["timesteps"][:, j],
                             sample["latents"][:, j].float(), prev_sample=sample["next_latents"][:, j].float(),
                             noise_level=self.cfg.sample.noise_level)

    def train_epoch(self) -> int:
        tr, acc, opt = self.cfg.train, self.accelerator, self.optimizer
        self.model.train()
        steps = 0
        for sample in self.batches:
            embeds = torch.cat([self.neg[0][:len(sample["prompt_embeds"])], sample["prompt_embeds"]])
            pooled = torch.cat([self.neg[1][:len(sample["pooled_prompt_embeds"])], sample["pooled_prompt_embeds"]])
            info = collections.defaultdict(list)
            for j in range(self.T):
                with acc.accumulate(self.model):
                    _, log_prob, _, _ = self.compute_log_prob(sample, j, embeds, pooled)
                    advantages = torch.clamp(sample["advantages"][:, j], -tr.adv_clip_max, tr.adv_clip_max)
                    ratio = torch.exp(log_prob - sample["log_probs"][:, j])
                    unclipped = -advantages * ratio
                    clipped = -advantages * torch.clamp(ratio, 1.0 - tr.clip_range, 1.0 + tr.clip_range)
                    loss = torch.mean(torch.maximum(unclipped, clipped))
                    info["approx_kl"].append(0.5 * torch.mean((log_prob - sample["log_probs"][:, j]) ** 2))
                    info["clipfrac"].append(torch.mean((torch.abs(ratio - 1.0) > tr.clip_range).float()))
                    info["clipfrac_gt_one"].append(torch.mean((ratio - 1.0 > tr.clip_range).float()))
                    info["clipfrac_lt_one"].append(torch.mean((1.0 - ratio > tr.clip_range).float()))
                    info["policy_loss"].append(loss)
                    info["loss"].append(loss)
                    acc.backward(loss)
                    if acc.sync_gradients:
                        acc.clip_grad_norm_(self.model.parameters(), tr.max_grad_norm)
                    opt.step()
                    opt.zero_grad()
                steps += 1
                if acc.sync_gradients:
                    info = {k: torch.mean(torch.stack(v)) for k, v in info.items()}
                    info = acc.reduce(info, reduction="mean")
                    info = collections.defaultdict(list)
        return steps


def measure(clone: Path, repeats: int, threads: list[int]) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        t, s = build(Path(tmp))
        micro = t.stepper  # counts micro-steps through the trainer's own Stepper
        state0 = copy.deepcopy({k: v.detach().clone() for k, v in t.family.model.state_dict().items()})
        ref = Reference(t, s, load_sde_step(clone))
        sides = {"ddpo_tpu": lambda: (t.epoch_trainer.train_epoch(1, s), micro.count)[1],
                 "flow_grpo": ref.train_epoch}
        rows = []
        for name, run in sides.items():
            run()  # warm-up (first-call allocations, lazy inits)
            with Count() as c:
                n = run()
            alloc = allocations(run)
            rows.append({"side": name, "micro_steps_per_epoch": n, "aten_ops_per_step": round(c.total / n, 1),
                         "parallel_ops_per_step": round(sum(c.parallel.values()) / n, 1),
                         "host_reads_per_step": round(c.reads / n, 2), "allocations_per_step": round(alloc / n, 1),
                         "_ops": c.ops, "_n": n})
        times = {(name, k): [] for name in sides for k in threads}
        for _ in range(repeats):  # alternating: both sides see the same load
            for k in threads:
                torch.set_num_threads(k)
                for name, run in sides.items():
                    t0 = time.perf_counter()
                    n = run()
                    times[(name, k)].append(1000 * (time.perf_counter() - t0) / n)
        t.family.model.load_state_dict(state0)
        for r in rows:
            for k in threads:
                r[f"ms_per_step_{k}_thread{'s' if k > 1 else ''}"] = round(statistics.median(times[(r['side'], k)]), 1)
        return rows


def table(rows: list[dict]) -> str:
    keys = [k for k in rows[0] if not k.startswith("_")]
    out = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    out += ["| " + " | ".join(str(r[k]) for k in keys) + " |" for r in rows]
    return "\n".join(out)


def op_diff(rows: list[dict], top: int = 25) -> str:
    """The ops whose per-step counts differ most between the sides."""
    a, b = rows[0], rows[1]
    keys = set(a["_ops"]) | set(b["_ops"])
    per = lambda r, k: r["_ops"].get(k, 0) / r["_n"]
    diff = sorted(keys, key=lambda k: -abs(per(a, k) - per(b, k)))[:top]
    lines = [f"| op | {a['side']} | {b['side']} |", "|---|---|---|"]
    lines += [f"| {k} | {per(a, k):.1f} | {per(b, k):.1f} |" for k in diff if per(a, k) != per(b, k)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--flow-grpo", type=Path, required=True, help="a clone of yifan123/flow_grpo")
    ap.add_argument("--repeats", type=int, default=5, help="timed epochs per side and thread count")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--append", action="store_true", help="append the tables to benchmarks/RESULTS.md")
    a = ap.parse_args(argv)
    rows = measure(a.flow_grpo, a.repeats, a.threads)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    ref_commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=a.flow_grpo, capture_output=True,
                                text=True).stdout.strip()
    load = " ".join(f"{x:.2f}" for x in __import__("os").getloadavg())
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    report = (f"## {when} — {platform.machine()}, {__import__('os').cpu_count()} CPU cores, Python "
              f"{platform.python_version()}, torch {torch.__version__}, ddpo_tpu {commit}, flow_grpo {ref_commit}\n\n"
              f"`PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/step_ops.py --flow-grpo CLONE "
              f"--repeats {a.repeats} --threads {' '.join(map(str, a.threads))}`\n\n"
              "One training step (a micro-step: guided forward, loss, backward, and its share of the optimizer "
              "steps) of the tiny-SD3 GRPO epoch of the side-by-side bench's tiny sd35 shape, both sides training the "
              "same PEFT-wrapped transformer: aten ops, host reads (.item/bool/nonzero/tolist), allocations per step "
              f"(exact); ms per step at each thread count (medians of alternating epochs; load average at the end "
              f"{load}):\n\n{table(rows)}\n\nThe ops whose counts per step differ most:\n\n{op_diff(rows)}\n")
    print(report)
    if a.append:
        with open(REPO / "benchmarks" / "RESULTS.md", "a") as f:
            f.write("\n" + report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
