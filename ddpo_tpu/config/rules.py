"""Semantic rules checked at compose time, after the schema: parity arithmetic against the topology's replica count,
the reference's divisibility rules, topology consistency and cross-key ranges. Pure Python: no torch, no devices."""

from __future__ import annotations

import math
import os
import re
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddpo_tpu.config.errors import Problem
from ddpo_tpu.config.distributed import distributed_problems
from ddpo_tpu.config.schema import MULTI_DEVICE, TINY, RunConfig


def estimates_memory(topo) -> bool:
    """Whether the per-chip memory estimate applies: TPU chips (torch_xla or TorchTPU) and the accelerators of the
    distributed execution (GPUs), where the topology gives the device memory. The activation figures are XLA's
    (attention softmaxes materialised): on GPUs with fused attention they are an upper bound."""
    return bool(topo.hbm_gib_per_chip) and (topo.accelerator.startswith("tpu") or topo.execution == "distributed")


def num_train_timesteps(cfg: RunConfig) -> int:
    """Denoising steps trained per sample. int() as the reference does (not round())."""
    return int(cfg.sample.num_steps * cfg.train.timestep_fraction)


@dataclass(frozen=True)
class Totals:
    replicas: int
    samples_per_epoch: int
    total_train_batch: int
    updates_per_epoch: float
    train_timesteps: int


def totals(cfg: RunConfig) -> Totals:
    r = cfg.tpu_topology.replicas
    s = cfg.sample.batch_size * cfg.sample.num_batches_per_epoch * r
    t = cfg.train.batch_size * cfg.train.gradient_accumulation_steps * r
    return Totals(r, s, t, s * cfg.train.num_inner_epochs / t, num_train_timesteps(cfg))


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


_MISSING = object()


def lookup(tree: dict[str, Any], dotted: str) -> Any:
    node: Any = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b or a == b and type(a) is type(b)
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-12, abs_tol=0.0)
    return a == b


def _pick(keys: tuple[str, ...], overridden: frozenset[str]) -> str:
    """Name the key the user touched, if any of the involved ones; else the first."""
    for k in keys:
        if k in overridden:
            return k
    return keys[0]


def _product_fix(target: int, replicas: int, first: tuple[str, int], second: tuple[str, int],
                 ok_first=lambda v: True, keep_first: bool = True) -> str:
    """Per-replica settings a x b with a x b x replicas == target: one-key changes first, then pairs.
    keep_first=False: the first key's value itself is not ok, so no option keeps it."""
    (ka, a), (kb, b) = first, second
    if target % replicas:
        return f"{target} is not divisible by {replicas} replicas: use parity=none or another tpu_topology"
    per = target // replicas
    options = []
    if per % b == 0 and ok_first(per // b):
        options.append(f"{ka}={per // b}")
    if per % a == 0 and keep_first:
        options.append(f"{kb}={per // a}")
    if not options:
        for cand in sorted((d for d in range(1, per + 1) if per % d == 0), key=lambda d: abs(d - a)):
            if ok_first(cand):
                options.append(f"{ka}={cand} {kb}={per // cand}")
                break
    return "try " + ", or ".join(options) if options else f"no per-replica split of {per} fits"


def check(cfg: RunConfig, tree: dict[str, Any], overridden: frozenset[str] = frozenset()) -> list[Problem]:
    """All rule violations of a schema-valid config. `tree` is the same config as plain dicts (for parity lookups)."""
    problems: list[Problem] = []
    topo, sample, train = cfg.tpu_topology, cfg.sample, cfg.train
    tot = totals(cfg)
    R = tot.replicas

    # --- topology -------------------------------------------------------------------------------------------------
    if topo.hosts * topo.chips_per_host != topo.chips:
        problems.append(Problem("tpu_topology.chips", topo.chips,
                                f"{topo.hosts} hosts x {topo.chips_per_host} chips per host = "
                                f"{topo.hosts * topo.chips_per_host}",
                                f"set tpu_topology.chips={topo.hosts * topo.chips_per_host}"))
    if topo.processes != "auto" and topo.processes != topo.expected_processes:
        per = "device" if topo.execution == "distributed" else "host"
        problems.append(Problem("tpu_topology.processes", topo.processes,
                                f"one training process runs per {per} and there are {topo.expected_processes} "
                                f"{per}s", f"set tpu_topology.processes={topo.expected_processes} (or auto)"))
    if topo.execution == "distributed":
        problems.extend(distributed_problems(cfg, overridden))
    elif topo.execution == "eager":
        if topo.pjrt_device is not None and not topo.accelerator.startswith("tpu"):
            problems.append(Problem("tpu_topology.pjrt_device", topo.pjrt_device,
                                    "eager execution does not use PJRT", "set tpu_topology.pjrt_device=null"))
        if topo.accelerator.startswith("tpu"):
            problems.append(Problem("tpu_topology.execution", topo.execution,
                                    "TPUs run through XLA or TorchTPU",
                                    "set tpu_topology.execution=xla_spmd (or xla for one chip), or distributed for "
                                    "TorchTPU"))
    else:
        want = {"cpu": "CPU", "cuda": "CUDA"}.get(topo.accelerator, "TPU")
        if topo.pjrt_device != want:
            problems.append(Problem("tpu_topology.pjrt_device", topo.pjrt_device,
                                    f"accelerator {topo.accelerator} runs on PJRT device {want}",
                                    f"set tpu_topology.pjrt_device={want}"))
    if topo.execution in ("eager", "xla") and topo.chips != 1:
        problems.append(Problem("tpu_topology.execution", topo.execution,
                                f"{topo.execution} drives one device but the topology has {topo.chips} chips",
                                "set tpu_topology.execution=xla_spmd (or distributed) to use them all"))
    chips_ok = topo.hosts * topo.chips_per_host == topo.chips
    if topo.execution in MULTI_DEVICE and chips_ok:
        if topo.mesh.dp * topo.mesh.fsdp != topo.chips:
            if topo.chips % topo.mesh.fsdp == 0:
                fix = f"set tpu_topology.mesh.dp={topo.chips // topo.mesh.fsdp}"
            else:
                fix = f"set tpu_topology.mesh.dp={topo.chips} tpu_topology.mesh.fsdp=1"
            k = _pick(("tpu_topology.mesh.dp", "tpu_topology.mesh.fsdp"), overridden)
            problems.append(Problem(k, topo.mesh.dp if k.endswith(".dp") else topo.mesh.fsdp,
                                    f"mesh dp {topo.mesh.dp} x fsdp {topo.mesh.fsdp} = "
                                    f"{topo.mesh.dp * topo.mesh.fsdp} devices but the topology has {topo.chips} chips",
                                    fix))
        if topo.mesh.layout == "host_local" and (topo.mesh.dp, topo.mesh.fsdp) != (topo.hosts, topo.chips_per_host):
            problems.append(Problem("tpu_topology.mesh.layout", topo.mesh.layout,
                                    "host_local puts dp across hosts and fsdp within one",
                                    f"set tpu_topology.mesh.dp={topo.hosts} tpu_topology.mesh.fsdp={topo.chips_per_host}"))
        if topo.hosts > 1 and topo.mesh.fsdp > 1 and topo.chips_per_host % topo.mesh.fsdp:
            # a checkpoint is put together from one host's shards, so every fsdp group must sit inside a host
            problems.append(Problem("tpu_topology.mesh.fsdp", topo.mesh.fsdp,
                                    f"fsdp groups must fit inside one host ({topo.chips_per_host} chips) so each host "
                                    f"holds whole parameters",
                                    f"set tpu_topology.mesh.fsdp={topo.chips_per_host} "
                                    f"tpu_topology.mesh.dp={topo.chips // topo.chips_per_host}"))
        if cfg.xla.gather == "host" and topo.hosts > 1 and topo.execution == "xla_spmd":
            problems.append(Problem("xla.gather", "host", "a host-side gather sees only this host's shards on a pod",
                                    "set xla.gather=device"))
        if topo.accelerator == "cpu" and topo.hosts != 1 and topo.execution == "xla_spmd":
            problems.append(Problem("tpu_topology.hosts", topo.hosts, "PJRT CPU runs on one host",
                                    "set tpu_topology.hosts=1"))

    # --- parity -----------------------------------------------------------------------------------------------------
    par = cfg.parity
    if par.samples_per_epoch is not None and tot.samples_per_epoch != par.samples_per_epoch:
        k = _pick(("sample.batch_size", "sample.num_batches_per_epoch"), overridden)
        fix = _product_fix(par.samples_per_epoch, R, ("sample.batch_size", sample.batch_size),
                           ("sample.num_batches_per_epoch", sample.num_batches_per_epoch),
                           ok_first=lambda v: v >= train.batch_size and v % train.batch_size == 0)
        problems.append(Problem(k, lookup(tree, k),
                                f"{sample.batch_size} x {sample.num_batches_per_epoch} batches x {R} replicas = "
                                f"{tot.samples_per_epoch} samples/epoch, parity {par.name} needs "
                                f"{par.samples_per_epoch}", fix))
    if par.total_train_batch is not None and tot.total_train_batch != par.total_train_batch:
        k = _pick(("train.gradient_accumulation_steps", "train.batch_size"), overridden)
        fix = _product_fix(par.total_train_batch, R, ("train.batch_size", train.batch_size),
                           ("train.gradient_accumulation_steps", train.gradient_accumulation_steps),
                           ok_first=lambda v: v <= sample.batch_size and sample.batch_size % v == 0
                           and _train_batch_fits(cfg, v), keep_first=_train_batch_fits(cfg, train.batch_size))
        problems.append(Problem(k, lookup(tree, k),
                                f"{train.batch_size} x {train.gradient_accumulation_steps} accumulation x {R} replicas "
                                f"= {tot.total_train_batch} per optimizer step, parity {par.name} needs "
                                f"{par.total_train_batch}", fix))
    for key, target in flatten(par.pinned).items():
        got = lookup(tree, key)
        if got is _MISSING:
            problems.append(Problem(f"parity.pinned.{key}", target, "pins a key the config does not have",
                                    "fix the parity config"))
        elif not _same(got, target):
            problems.append(Problem(key, got, f"parity {par.name} pins {target}",
                                    f"set {key}={target}, or parity=none to leave the reference"))

    # --- the reference's batch rules (always; a parity problem on the same keys already carries a fix) ------------
    parity_batch_problem = any(p.key.startswith(("sample.", "train.")) and "parity" in p.reason for p in problems)
    if parity_batch_problem:
        pass
    elif sample.batch_size < train.batch_size or sample.batch_size % train.batch_size:
        k = _pick(("train.batch_size", "sample.batch_size"), overridden)
        divisors = [d for d in range(sample.batch_size, 0, -1) if sample.batch_size % d == 0]
        fix_tbs = next((d for d in divisors if d <= train.batch_size), 1)
        problems.append(Problem(k, train.batch_size if k == "train.batch_size" else sample.batch_size,
                                f"per-replica sample batch {sample.batch_size} must be >= and divisible by the "
                                f"train batch {train.batch_size}",
                                f"try train.batch_size={fix_tbs}"))
    elif tot.samples_per_epoch % tot.total_train_batch:
        k = _pick(("train.gradient_accumulation_steps", "train.batch_size"), overridden)
        batches = sample.batch_size * sample.num_batches_per_epoch // train.batch_size
        good = [d for d in range(1, batches + 1) if batches % d == 0]
        fix_acc = min(good, key=lambda d: abs(d - train.gradient_accumulation_steps))
        problems.append(Problem(k, lookup(tree, k),
                                f"{tot.samples_per_epoch} samples/epoch is not a multiple of the total train batch "
                                f"{tot.total_train_batch}: an optimizer step would straddle epochs",
                                f"try train.gradient_accumulation_steps={fix_acc}"))
    if tot.train_timesteps < 1:
        problems.append(Problem("train.timestep_fraction", train.timestep_fraction,
                                f"int({sample.num_steps} steps x {train.timestep_fraction}) = 0 timesteps to train",
                                f"use train.timestep_fraction>={_min_fraction(sample.num_steps)}"))

    K, budget = train.timesteps_per_micro_step, _activation_budget(cfg)
    # not even one timestep of the train batch fits: its samples (x 2 with CFG) in one forward/backward, or the frozen
    # models alone (with LoRA: the resident figures count LoRA's state; a full fine-tune has its own rule below)
    batch_too_big = (budget is not None and cfg.model.lora.enabled and tot.train_timesteps >= 1
                     and training_activation_gib(cfg, 1) > budget)
    if batch_too_big:
        problems.append(_hbm_problem(cfg, tot))
    if K != "auto" and tot.train_timesteps >= 1 and tot.train_timesteps % K:
        fits = [d for d in range(1, tot.train_timesteps + 1) if tot.train_timesteps % d == 0]
        problems.append(Problem("train.timesteps_per_micro_step", K,
                                f"{tot.train_timesteps} timesteps are trained per sample and a micro-step fuses {K}: "
                                f"it must divide them",
                                f"try train.timesteps_per_micro_step={max(d for d in fits if d <= K)} (or auto)"))
    elif K != "auto" and not batch_too_big and budget is not None and training_activation_gib(cfg, K) > budget:
        fits = [d for d in range(1, K) if tot.train_timesteps % d == 0 and training_activation_gib(cfg, d) <= budget]
        problems.append(Problem("train.timesteps_per_micro_step", K,
                                f"{K} timesteps x {train.batch_size} samples{' x 2 (CFG)' if train.cfg else ''} "
                                f"in one forward/backward need about {training_activation_gib(cfg, K):.1f} GiB of "
                                f"activations per chip (estimate), the chip has {topo.hbm_gib_per_chip} GiB of which "
                                f"about {resident_gib(cfg):.1f} GiB hold the models",
                                "try train.activation_checkpointing=true (or auto)"
                                if not activation_checkpointing(cfg) and
                                training_activation_gib(cfg, K, checkpointed=True) <= budget else
                                f"try train.timesteps_per_micro_step={max(fits)} (or auto)" if fits else
                                "lower train.batch_size (raise train.gradient_accumulation_steps to keep parity)"))

    # --- cross-key ranges -------------------------------------------------------------------------------------------
    st = cfg.stat_tracking
    if st.min_count > st.buffer_size:
        problems.append(Problem("stat_tracking.min_count", st.min_count,
                                f"can never be reached with stat_tracking.buffer_size={st.buffer_size}",
                                f"set stat_tracking.min_count<={st.buffer_size}"))
    m = cfg.model
    if (m.builder is None) == (m.pretrained is None):
        problems.append(Problem("model.pretrained", m.pretrained,
                                "set exactly one of model.pretrained (hub id or local dir) and model.builder",
                                "e.g. model=tiny for the local test model, model=sd14 for Stable Diffusion 1.4"))
    elif m.pretrained is not None:
        problems.extend(_pretrained_problems(m.pretrained, m.family))
    if m.dtype == "bfloat16" and train.mixed_precision != "bf16":
        problems.append(Problem("model.dtype", m.dtype, "bfloat16 weights need bfloat16 compute",
                                "set train.mixed_precision=bf16 or model.dtype=float32"))
    if not m.lora.enabled and estimates_memory(topo):
        # SD 1.x's UNet: 860M weights x (weight, gradient, 2 AdamW moments) x 4 bytes = 12.8 GiB, divided by fsdp,
        # plus ~3 GiB that stays whole (VAE, text encoder, 1-D tensors, activations of a small batch)
        def need(fsdp: int) -> float:
            return 12.8 / fsdp + 3.0

        fsdp = topo.mesh.fsdp if topo.execution in MULTI_DEVICE else 1
        if topo.hbm_gib_per_chip < need(fsdp):
            fits = [k for k in range(2, topo.chips_per_host + 1) if topo.chips % k == 0
                    and topo.chips_per_host % k == 0 and topo.hbm_gib_per_chip >= need(k)]
            alt = (f"; tpu_topology.mesh.fsdp={fits[0]} tpu_topology.mesh.dp={topo.chips // fits[0]} splits it to "
                   f"about {need(fits[0]):.1f} GiB" if fits and topo.execution in MULTI_DEVICE else "")
            problems.append(Problem("model.lora.enabled", False,
                                    f"a full UNet fine-tune with Adam needs about {need(fsdp):.1f} GiB per chip with "
                                    f"fsdp={fsdp}, the chip has {topo.hbm_gib_per_chip}{alt}",
                                    "set model.lora.enabled=true"))
    p = cfg.prompts
    if p.name == "from_file" and not p.file:
        problems.append(Problem("prompts.file", p.file, "prompts=from_file needs a file", "set prompts.file=PATH"))
    else:
        problems.extend(_prompt_problems(cfg))
    problems.extend(_reward_problems(cfg.reward))
    problems.extend(_family_problems(cfg))
    problems.extend(_algorithm_problems(cfg, tot, overridden))
    problems.extend(_guidance_problems(cfg))
    problems.extend(_input_problems(cfg, tot))
    return problems


# the sampler and the local builds each model family works with
FAMILY_SAMPLER = {"sd1": "ddim", "sd3": "flow_sde"}
FAMILY_BUILDERS = {"sd1": ("tiny", "sd14_topology", "sd14_random", "digits"), "sd3": ("tiny_sd3",)}
FAMILY_SAMPLER_KEYS = {"ddim": ("eta",), "flow_sde": ("noise_level", "sde_type")}


def _family_problems(cfg: RunConfig) -> list[Problem]:
    problems: list[Problem] = []
    m, s = cfg.model, cfg.sample
    want = FAMILY_SAMPLER[m.family]
    if s.name != want:
        problems.append(Problem("sample.name", s.name, f"model.family={m.family} samples with {want}",
                                f"use sampler={'flow_sde10' if want == 'flow_sde' else 'ddim50'} (or another {want} "
                                f"sampler)"))
    else:
        for key in FAMILY_SAMPLER_KEYS[want]:
            if getattr(s, key) is None:
                problems.append(Problem(f"sample.{key}", None, f"the {want} sampler needs it",
                                        f"set sample.{key}=... (see conf/sampler/)"))
    if m.builder is not None and m.builder not in FAMILY_BUILDERS[m.family]:
        other = next(f for f, b in FAMILY_BUILDERS.items() if m.builder in b)
        problems.append(Problem("model.builder", m.builder, f"a model.family={other} build, not {m.family}",
                                f"set model.family={other}, or use model={FAMILY_BUILDERS[m.family][0]}"))
    if m.text_encoder_3 and m.family != "sd3":
        problems.append(Problem("model.text_encoder_3", True, "only SD 3 has a third (T5) text encoder",
                                "set model.text_encoder_3=false"))
    return problems


def _algorithm_problems(cfg: RunConfig, tot: Totals, overridden: frozenset[str]) -> list[Problem]:
    problems: list[Problem] = []
    a, n = cfg.algorithm, tot.samples_per_epoch
    if a.name != "grpo":
        for key in ("group_size", "kl_beta", "global_std", "drop_zero_advantage"):
            if key in {k.removeprefix("algorithm.") for k in overridden}:
                problems.append(Problem(f"algorithm.{key}", getattr(a, key), "a GRPO setting; algorithm=ddpo",
                                        "add algorithm=grpo"))
        return problems
    if a.group_size is None:
        return [Problem("algorithm.group_size", None, "GRPO samples every prompt of an epoch group_size times",
                        "set algorithm.group_size=N (flow_grpo: 24)")]
    if n % a.group_size:
        sizes = [g for g in range(2, n + 1) if n % g == 0]
        near = min(sizes, key=lambda g: (abs(g - a.group_size), g)) if sizes else None
        per = cfg.sample.batch_size * cfg.sample.num_batches_per_epoch
        problems.append(Problem("algorithm.group_size", a.group_size,
                                f"{per} samples x {tot.replicas} replicas = {n} samples per epoch do not split into "
                                f"groups of {a.group_size}",
                                f"try algorithm.group_size={near}" if near else
                                "raise sample.batch_size or sample.num_batches_per_epoch"))
    elif n // a.group_size < 1:
        problems.append(Problem("algorithm.group_size", a.group_size, f"larger than the epoch's {n} samples",
                                f"set algorithm.group_size={n} or fewer"))
    elif (batch := cfg.sample.batch_size * tot.replicas) % a.group_size:
        # flow_grpo's DistributedKRepeatSampler: each sampling batch holds whole groups (batch / group_size prompts)
        sizes = [g for g in range(2, batch + 1) if batch % g == 0]
        near = min(sizes, key=lambda g: (abs(g - a.group_size), g)) if sizes else None
        problems.append(Problem("algorithm.group_size", a.group_size,
                                f"a sampling batch of {cfg.sample.batch_size} x {tot.replicas} replicas = {batch} "
                                f"samples does not hold whole groups of {a.group_size} (flow_grpo draws each group "
                                f"inside one sampling batch)",
                                f"try algorithm.group_size={near}" if near else "raise sample.batch_size"))
    if a.kl_beta > 0 and not cfg.model.lora.enabled:
        problems.append(Problem("algorithm.kl_beta", a.kl_beta, "the reference policy is the model with its LoRA "
                                "adapter off; a full fine-tune has no adapter", "set model.lora.enabled=true or "
                                "algorithm.kl_beta=0"))
    if (a.kl_beta > 0 and cfg.sample.name == "flow_sde" and cfg.sample.sde_type == "cps"
            and tot.train_timesteps >= cfg.sample.num_steps):
        problems.append(Problem("train.timestep_fraction", cfg.train.timestep_fraction,
                                "the last CPS step is deterministic (std 0), so its KL term is 0/0",
                                f"train fewer steps, e.g. train.timestep_fraction=0.99 (flow_grpo)"))
    return problems


def _guidance_problems(cfg: RunConfig) -> list[Problem]:
    """train.cfg_detach_uncond needs an unconditional half at train time to detach."""
    if cfg.train.cfg_detach_uncond and (not cfg.train.cfg or cfg.sample.guidance_scale == 1):
        why = "train.cfg=false" if not cfg.train.cfg else "sample.guidance_scale=1"
        return [Problem("train.cfg_detach_uncond", True, f"training has no guidance to detach ({why}: no "
                        f"unconditional half at train time)", "set train.cfg_detach_uncond=false, or train.cfg=true "
                        "with sample.guidance_scale > 1")]
    return []


# Activation memory of one SD 1.x UNet evaluation at 512 px (64x64 latents) kept for the backward pass, per sample, on
# XLA. Two parts: (1) 2.3 GiB measured on eager CPU with the full-width random SD 1.4 build (model=sd14_random, LoRA,
# float32: peak RSS of a forward + backward at batch 1 and 2), halved for bf16 autocast; eager CPU attention does not
# keep its score matrices; (2) XLA lowers attention to matmul + softmax and keeps each softmax for the backward:
# 8 heads x S^2 x 4 bytes (softmax runs in float32 under autocast) over SD 1.4's 16 self-attentions (5 each at 4096,
# 1024 and 256 tokens, 1 at 64) = 2.7 GiB. On XLA CPU one training evaluation at full width did not fit in 24 GiB in
# either precision (RESULTS.md). An estimate for the HBM rule, not a TPU figure.
ATTENTION_SCORES_GIB_512 = 2.7
SD1_EAGER_GIB = {"no": 2.3, "bf16": 1.2}
ACTIVATION_GIB_PER_UNET_EVAL_512 = {k: v + ATTENTION_SCORES_GIB_512 for k, v in SD1_EAGER_GIB.items()}
# The same for one SD 3.5 Medium transformer evaluation at 512 px (1024 image tokens + 77 CLIP + 128 T5 text tokens,
# flow_grpo's max_sequence_length), LoRA rank 32 as model=sd35_medium. (1) SD3_EAGER_GIB: 2.9 GiB in float32 measured
# on eager CPU with SD 3.5 Medium's transformer at full width (1536, 24 heads of 64, RMS qk-norm) and random weights,
# 2 and 3 layers deep, with and without dual attention, batch 1 and 2 (`python scripts/bench.py --sd3-activations`;
# peak RSS over a forward + backward, 2.87, and the bytes autograd saves, 2.80): per sample 0.24 for the first and
# last layers with the embeddings, 0.10 per middle joint layer, 0.14 per middle dual-attention layer, extrapolated to
# 24 layers (layer 0 is dual but its second attention keeps nothing: its input needs no gradient; then 10 joint and
# 12 dual middle layers and the last). bf16 (frozen weights bfloat16 under bf16 autocast, model.dtype=bfloat16):
# 2.1 = float32's x 0.74, the bf16 / float32 ratio of a 1-layer build at batch 1 and 2 (saved bytes; peak RSS 0.65);
# bf16 matmuls are too slow on this CPU to repeat the 3-layer probes. (2) XLA's softmaxes, derived as for SD 1.x:
# 24 heads x S^2 x 4 bytes over the 24 joint attentions (S = 1229) and the image-only attentions of dual layers 1-12
# (S = 1024) = 4.4 GiB. Per evaluation 7.2 GiB (float32) or 6.5 (bf16); an estimate, not a TPU figure.
SD3_ATTENTION_SCORES_GIB_512 = (24 * 24 * 1229 ** 2 + 12 * 24 * 1024 ** 2) * 4 / 2 ** 30  # 4.37
SD3_EAGER_GIB = {"no": 2.9, "bf16": 2.1}
ACTIVATION_GIB_PER_EVAL_512 = {
    "sd1": ACTIVATION_GIB_PER_UNET_EVAL_512,
    "sd3": {k: v + SD3_ATTENTION_SCORES_GIB_512 for k, v in SD3_EAGER_GIB.items()},
}
# The same with train.activation_checkpointing (diffusers' gradient checkpointing: every resnet and transformer
# block keeps only its input and the backward runs it again; `python scripts/bench.py --checkpointing`). (1) The
# eager part shrinks by what eager CPU measured at full width, per sample (batch 2 - batch 1 peak RSS): SD 1.4's UNet
# 1.53 -> 0.43 GiB (x 0.28), SD 3.5 Medium's transformer 2.9 -> 0.75 (x 0.26; 24 layers extrapolated from 2-3
# layers as above, counting each layer's recomputation as if kept: an upper bound). (2) The XLA scores: with checkpointing
# the forward graph hands no score matrix to the backward graph (AOTAutograd's partition on XLA tensors; without it
# 9 of 8 x S^2 at S = 1024 for SD 1.4's topology at 256 px); what the backward then holds at once is XLA's schedule: on
# XLA CPU the peak RSS of one compiled forward + backward of SD 1.4's topology at 4096 tokens fell from 11.0 to 5.6
# GiB above its baseline (x 0.51), so the checkpointed figure keeps 0.51 of the scores. An estimate, not a TPU figure.
SD1_CKPT_EAGER_RATIO, SD3_CKPT_EAGER_RATIO, CKPT_XLA_SCORES_RATIO = 0.28, 0.26, 0.51
CHECKPOINTED_GIB_PER_EVAL_512 = {
    "sd1": {k: round(v * SD1_CKPT_EAGER_RATIO + CKPT_XLA_SCORES_RATIO * ATTENTION_SCORES_GIB_512, 2)
            for k, v in SD1_EAGER_GIB.items()},
    "sd3": {k: round(v * SD3_CKPT_EAGER_RATIO + CKPT_XLA_SCORES_RATIO * SD3_ATTENTION_SCORES_GIB_512, 2)
            for k, v in SD3_EAGER_GIB.items()},
}
# local builds with 32-64 px images: their activations are negligible
SMALL_BUILDERS = ("tiny", "sd14_topology", "tiny_sd3", "digits")
RESIDENT_GIB = 6.0  # frozen UNet + VAE + text encoder, LoRA and Adam state, sampling buffers (SD 1.x, float32 weights)
# SD 3.5 Medium's parts in billions of values (the diffusers / transformers classes built with the checkpoint's configs
# on the meta device): the transformer's weights (split over mesh.fsdp with the training state, families/sd3.py +
# ddpo/state.py) and its positional table (a buffer, whole on every chip); CLIP-L and CLIP-G; T5-XXL's encoder, loaded
# by models/sd3.py when model.text_encoder_3 and kept on the device all run beside the rest (like the CLIPs, in
# model.dtype); the VAE, always float32.
SD35_MEDIUM_BILLIONS = {"transformer": 2.243, "pos_embed": 0.227, "clips": 0.124 + 0.695, "t5": 4.762, "vae": 0.084}
# plus LoRA's 18.8M values x (weight, gradient, 2 AdamW moments, EMA) in float32 (0.35 GiB), an epoch's trajectories
# and prompt embeddings (0.6 GiB at flow_grpo's 144 samples a chip) and ~1 GiB for the runtime and fragmentation
SD3_STATE_GIB = 2.0


def resident_gib(cfg: RunConfig, fsdp: int | None = None, dtype: str | None = None) -> float:
    """GiB of a chip held through training besides the micro-step's activations: frozen models, trained state,
    sampling buffers. `fsdp` and `dtype` ask "what if" (default: the config's)."""
    if cfg.model.family != "sd3":
        return RESIDENT_GIB
    topo, m = cfg.tpu_topology, cfg.model
    fsdp = fsdp or (topo.mesh.fsdp if topo.execution in MULTI_DEVICE else 1)
    size = 2 if (dtype or m.dtype) == "bfloat16" else 4
    b = SD35_MEDIUM_BILLIONS
    frozen = b["transformer"] / fsdp + b["pos_embed"] + b["clips"] + (b["t5"] if m.text_encoder_3 else 0.0)
    return (frozen * size + b["vae"] * 4) * 1e9 / 2 ** 30 + SD3_STATE_GIB


AUTO_MAX_FUSED = 10  # auto fuses at most this many timesteps (compile time and graph size grow with K)


def training_activation_gib(cfg: RunConfig, k: int, batch: int | None = None, precision: str | None = None,
                            checkpointed: bool | None = None) -> float:
    """Estimated activations of one fused training micro-step: k timesteps x train batch (x2 with CFG) evaluations.
    `batch`, `precision` and `checkpointed` ask "what if" (default: the config's)."""
    evals = k * (batch or cfg.train.batch_size) * (2 if cfg.train.cfg else 1)
    if checkpointed is None:
        checkpointed = activation_checkpointing(cfg)
    table = CHECKPOINTED_GIB_PER_EVAL_512 if checkpointed else ACTIVATION_GIB_PER_EVAL_512
    return evals * table[cfg.model.family][precision or cfg.train.mixed_precision]


def _activation_budget(cfg: RunConfig, resident: float | None = None) -> float | None:
    """GiB a chip has for training activations, for SD-sized models on TPU topologies; None where not estimated.
    Negative when the models alone do not fit."""
    topo = cfg.tpu_topology
    if not estimates_memory(topo) or cfg.model.builder in SMALL_BUILDERS:
        return None
    return topo.hbm_gib_per_chip - (resident_gib(cfg) if resident is None else resident)


def _train_batch_fits(cfg: RunConfig, batch: int) -> bool:
    """One timestep of `batch` samples per micro-step fits the chip by the estimate (or nothing is estimated)."""
    budget = _activation_budget(cfg)
    return budget is None or training_activation_gib(cfg, 1, batch=batch) <= budget


def _hbm_problem(cfg: RunConfig, tot: Totals) -> Problem:
    """A train batch whose one-timestep micro-step does not fit the chip: per-replica values that fit and keep the
    totals (parity's, else the config's); if not even one sample fits, the settings that would make room."""
    topo, train, sample = cfg.tpu_topology, cfg.train, cfg.sample
    hbm, resident, B = topo.hbm_gib_per_chip, resident_gib(cfg), train.batch_size
    per = training_activation_gib(cfg, 1, batch=1)
    what = (f"the {topo.name} chip has {hbm:g} GiB of which about {resident:.1f} hold the models, trained state and "
            f"sampling buffers")
    cfg_x = " x 2 (CFG)" if train.cfg else ""
    if per <= hbm - resident:
        most = int((hbm - resident) // per)
        target = cfg.parity.total_train_batch or tot.total_train_batch
        fix = _product_fix(target, tot.replicas, ("train.batch_size", B),
                           ("train.gradient_accumulation_steps", train.gradient_accumulation_steps),
                           ok_first=lambda v: v <= most and sample.batch_size % v == 0, keep_first=False)
        return Problem("train.batch_size", B,
                       f"{B} samples{cfg_x} in one forward/backward need about {B * per:.1f} GiB of activations per "
                       f"chip (estimate), {what}: {most} sample{'s fit' if most > 1 else ' fits'}", fix)
    options = []
    if topo.execution == "xla_spmd" and cfg.model.family == "sd3":
        for k in range(topo.mesh.fsdp + 1, topo.chips_per_host + 1):
            if topo.chips % k == 0 and topo.chips_per_host % k == 0 and per <= hbm - resident_gib(cfg, fsdp=k):
                options.append(f"tpu_topology.mesh.fsdp={k} tpu_topology.mesh.dp={topo.chips // k} (splits the "
                               f"transformer's weights) with train.batch_size=1")
                break
    if (not activation_checkpointing(cfg)
            and training_activation_gib(cfg, 1, batch=1, checkpointed=True) <= hbm - resident):
        options.append("train.activation_checkpointing=true with train.batch_size=1")
    if cfg.model.dtype == "float32" and (training_activation_gib(cfg, 1, batch=1, precision="bf16")
                                        <= hbm - resident_gib(cfg, dtype="bfloat16")):
        options.append("model.dtype=bfloat16 train.mixed_precision=bf16 with train.batch_size=1")
    if resident >= hbm:
        reason = (f"the models, trained state and sampling buffers alone need about {resident:.1f} GiB per chip "
                  f"(estimate), the {topo.name} chip has {hbm:g} GiB")
    else:
        reason = f"one sample{cfg_x} needs about {per:.1f} GiB of activations per chip (estimate), {what}"
    fix = ("try " + ", or ".join(options) if options else
           "no setting of this topology fits one sample: use chips with more HBM (v6e, v4: 32 GiB)" if hbm < 32 else
           "no setting fits one sample on these chips")
    return Problem("tpu_topology.name", topo.name, reason, fix)


def fused_timesteps(cfg: RunConfig, checkpointed: bool | None = None) -> int:
    """train.timesteps_per_micro_step as the trainer uses it. auto: on TPU topologies the largest K (at most
    AUTO_MAX_FUSED) that divides the trained timesteps and whose activations fit the chip (by the estimate above);
    elsewhere 1 (no memory figure to go by). `checkpointed` asks "what if" (default: the config's)."""
    K, T = cfg.train.timesteps_per_micro_step, num_train_timesteps(cfg)
    if K != "auto":
        return K
    if not cfg.tpu_topology.accelerator.startswith("tpu") or T < 1:
        return 1
    budget = _activation_budget(cfg)
    if budget is not None and checkpointed is None:  # resolved once, not per candidate K
        checkpointed = activation_checkpointing(cfg)
    return max(d for d in range(1, min(T, AUTO_MAX_FUSED) + 1) if T % d == 0
               and (d == 1 or budget is None or training_activation_gib(cfg, d, checkpointed=checkpointed) <= budget))


# Fewer fused timesteps than this leave an SD-sized training micro-step bound by the host at parity batch sizes
# (measured host ms per micro-step on XLA CPU against the chip's FLOP time at 40% of a v6e: ratio 1.9 at K = 1, 1.29
# at K = 2, 0.75 at K = 5; benchmarks/RESULTS.md), so auto checkpoints when it would fuse fewer, for 1/3 more FLOPs.
AUTO_CHECKPOINT_BELOW = 2


def activation_checkpointing(cfg: RunConfig) -> bool:
    """train.activation_checkpointing as the trainer uses it. auto: on where the HBM estimate applies (SD-sized
    models on TPU topologies) and, without it, the train batch (or an explicit timesteps_per_micro_step) does not
    fit, or auto would fuse fewer than AUTO_CHECKPOINT_BELOW timesteps where with it it fuses more; elsewhere off."""
    on = cfg.train.activation_checkpointing
    if on != "auto":
        return on
    budget, T = _activation_budget(cfg), num_train_timesteps(cfg)
    if budget is None or T < 1:
        return False
    K = cfg.train.timesteps_per_micro_step
    if training_activation_gib(cfg, 1 if K == "auto" else K, checkpointed=False) > budget:
        return True
    if K != "auto":
        return False
    plain = fused_timesteps(cfg, checkpointed=False)
    return plain < AUTO_CHECKPOINT_BELOW and fused_timesteps(cfg, checkpointed=True) > plain


def _min_fraction(num_steps: int) -> float:
    """The smallest 3-decimal fraction that trains at least one timestep (rounded up, checked)."""
    v = math.ceil(1000 / num_steps) / 1000
    while int(num_steps * v) < 1:
        v += 0.001
    return round(min(v, 1.0), 3)


def _looks_like_path(s: str) -> bool:
    return s.startswith(("/", "./", "../", "~")) or os.sep in s and s.count("/") > 1


def parity_report(cfg: RunConfig, tree: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows of (constraint, target, effective, ok) for the console and the run dir."""
    tot = totals(cfg)
    par = cfg.parity
    rows = [
        {"constraint": "replicas (tpu_topology)", "target": None, "effective": tot.replicas, "ok": True},
        {"constraint": "samples per epoch", "target": par.samples_per_epoch, "effective": tot.samples_per_epoch},
        {"constraint": "total train batch", "target": par.total_train_batch, "effective": tot.total_train_batch},
        {"constraint": "optimizer updates per epoch",
         "target": (par.samples_per_epoch * cfg.train.num_inner_epochs / par.total_train_batch
                    if par.samples_per_epoch and par.total_train_batch else None),
         "effective": tot.updates_per_epoch},
        {"constraint": "train timesteps per sample", "target": None, "effective": tot.train_timesteps},
        {"constraint": "timesteps per micro-step", "target": None,
         "effective": fused_timesteps(cfg) if tot.train_timesteps >= 1 else None},
        {"constraint": "activation checkpointing", "target": None, "effective": activation_checkpointing(cfg)},
    ]
    for key, target in flatten(par.pinned).items():
        rows.append({"constraint": key, "target": target, "effective": lookup(tree, key)})
    for row in rows:
        row.setdefault("ok", row["target"] is None or _same(row["effective"], row["target"]))
    return rows


# --- inputs: names, paths, URLs and flags, checked before a run dir exists -----------------------------------------

# the parts models/loading.py (SD 1.x) and models/sd3.py load from a local checkpoint (their SUBFOLDERS and
# SD3_SUBFOLDERS; copied: those modules import torch; a test keeps them equal)
PIPELINE_SUBFOLDERS = ("unet", "vae", "text_encoder", "tokenizer", "scheduler")
SD3_PIPELINE_SUBFOLDERS = ("transformer", "vae", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2",
                           "scheduler")
FAMILY_SUBFOLDERS = {"sd1": PIPELINE_SUBFOLDERS, "sd3": SD3_PIPELINE_SUBFOLDERS}

# What a checkpoint must agree on with the run that continues it: the keys that change what is trained (an allow-list:
# the sections below, less RUN_CONTROL_KEYS). Everything else (epochs, paths, logging, evaluation, how steps are
# compiled, fused or synced) may change between a checkpoint and its resume. Only keys both configs have are compared,
# so a key added by an upgrade (whose default keeps the old behaviour) never blocks a resume.
PARITY_KEYS = ("seed", "sample.", "train.", "algorithm.", "stat_tracking.", "model.", "reward.", "prompts.",
               "tpu_topology.", "parity.", "xla.shuffle_timesteps")
RUN_CONTROL_KEYS = ("train.timesteps_per_micro_step", "train.activation_checkpointing", "reward.host_workers",
                    "model.cache_dir", "model.local_files_only", "model.pretrained")

# what XLA_FLAGS and LIBTPU_INIT_ARGS accept: space-separated --name or --name=value (anything else aborts the runtime)
_FLAG = re.compile(r"--[A-Za-z0-9_]+(=\S*)?")
_CHECKPOINT_NAME = re.compile(r"^epoch_\d{4,}$")


# what is trained does not depend on how the global batch is split: these per-replica keys are compared as their
# global values (x the topology's replicas), and the topology itself not at all, so a run resumes on any runtime and
# any number of devices that give the same global batches (2 processes resume a 1-process checkpoint and the reverse)
PER_REPLICA_KEYS = {"sample.batch_size": "sample.global_batch_size", "train.batch_size": "train.global_batch_size"}
LAYOUT_KEYS = ("tpu_topology.",)


def _replicas_of(flat: dict[str, Any]) -> int:
    execution = flat.get("tpu_topology.execution", "eager")
    if execution not in MULTI_DEVICE:
        return 1
    return int(flat.get("tpu_topology.mesh.dp", 1)) * int(flat.get("tpu_topology.mesh.fsdp", 1))


def parity_relevant(tree: dict[str, Any]) -> dict[str, Any]:
    flat = flatten(tree)
    replicas = _replicas_of(flat)
    out = {k: v for k, v in flat.items()
           if k.startswith(PARITY_KEYS) and not k.startswith(RUN_CONTROL_KEYS) and not k.startswith(LAYOUT_KEYS)
           and k not in PER_REPLICA_KEYS}
    for key, name in PER_REPLICA_KEYS.items():
        if isinstance(flat.get(key), int):
            out[name] = flat[key] * replicas
    return dict(sorted(out.items()))


def changed_keys(then: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """Keys of two parity_relevant() configs whose values differ; a key only one of them has is not a change."""
    return sorted(k for k in set(then) & set(now) if then[k] != now[k])


def _input_problems(cfg: RunConfig, tot: Totals) -> list[Problem]:
    problems: list[Problem] = []
    if set(cfg.run_name) <= {"."}:  # "." is output_root itself and ".." its parent (the launch directory)
        problems.append(Problem("run_name", cfg.run_name, "names the output root or its parent, not a run dir",
                                "use a name with a letter or digit, e.g. run_name=ddpo"))
    if not cfg.output_root.strip():  # an empty root puts the run dir at the filesystem root
        problems.append(Problem("output_root", repr(cfg.output_root), "empty path",
                                "set output_root=outputs or another directory"))
    url = storage_url_problem(cfg.output_root)  # gs://BUCKET/PREFIX (the bucket itself is checked before a run starts)
    if url is not None:
        problems.append(Problem("output_root", cfg.output_root, *url))
    if cfg.resume not in ("auto", "never"):
        path = Path(cfg.resume).expanduser()
        if not path.exists():
            problems.append(Problem("resume", cfg.resume, "no such checkpoint",
                                    "use resume=auto, resume=never, or an existing checkpoint path"))
        elif not _holds_checkpoint(path):
            problems.append(Problem("resume", cfg.resume, "not a checkpoint: neither a checkpoints/epoch_NNNN dir "
                                    "with state.json nor a run dir or checkpoints dir holding one",
                                    "use resume=auto, resume=never, or the path of a checkpoint"))
    xla = cfg.xla
    examples = {"flags": "--xla_dump_to=/tmp/dump", "libtpu_init_args": "--xla_enable_async_all_gather=true"}
    for key, example in examples.items():
        for i, flag in enumerate(getattr(xla, key)):
            if not _FLAG.fullmatch(flag):
                problems.append(Problem(f"xla.{key}[{i}]", repr(flag), "not a flag of the form --name or "
                                        "--name=value (no spaces)", f"e.g. 'xla.{key}=[\"{example}\"]'"))
    cache = xla.compilation_cache_dir
    if cache not in (None, "auto"):
        if not cache.strip():
            problems.append(Problem("xla.compilation_cache_dir", repr(cache), "empty path",
                                    "use auto, null or a directory"))
        else:
            blocker = _nearest_existing(Path(cache).expanduser())
            if not blocker.is_dir():
                problems.append(Problem("xla.compilation_cache_dir", cache, f"{blocker} is a file, not a directory",
                                        "use a directory, created if missing; or auto or null"))
    if any(s < 0 for s in xla.profile_steps):
        problems.append(Problem("xla.profile_steps", xla.profile_steps, "steps are >= 0", "list step numbers"))
    elif xla.profile_steps and tot.samples_per_epoch % tot.total_train_batch == 0:  # else a batch rule fires
        steps = int(tot.updates_per_epoch) * cfg.num_epochs
        late = [s for s in xla.profile_steps if s >= steps]
        if late:
            problems.append(Problem("xla.profile_steps", xla.profile_steps,
                                    f"step(s) {late} never run: {int(tot.updates_per_epoch)} optimizer steps per "
                                    f"epoch x {cfg.num_epochs} epochs = global steps 0-{steps - 1}",
                                    f"list steps below {steps}"))
    every = cfg.evaluation.every_n_epochs
    if every > cfg.num_epochs:
        problems.append(Problem("evaluation.every_n_epochs", every,
                                f"the run has {cfg.num_epochs} epochs, so no evaluation would run",
                                f"set evaluation.every_n_epochs<={cfg.num_epochs}, or 0 for none"))
    return problems


def storage_url_problem(value: str) -> tuple[str, str] | None:
    from ddpo_tpu.storage import url_problem

    return url_problem(value)


def _nearest_existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


def _holds_checkpoint(path: Path) -> bool:
    """What checkpoint.find_resume accepts: a checkpoint dir, or a dir whose checkpoints/ (or itself) holds one."""
    if (path / "state.json").is_file():
        return True
    for root in (path, path / "checkpoints"):
        if root.is_dir() and any(_CHECKPOINT_NAME.match(c.name) and (c / "state.json").is_file()
                                 for c in root.iterdir()):
            return True
    return False


def _pretrained_problems(pretrained: str, family: str = "sd1") -> list[Problem]:
    """A local model dir must have what the family's loader loads; a hub id is checked when it is loaded."""
    path = Path(pretrained).expanduser()
    example = "stabilityai/stable-diffusion-3.5-medium" if family == "sd3" else "CompVis/stable-diffusion-v1-4"
    fix = (f"point model.pretrained at a diffusers Stable Diffusion dir, as `huggingface-cli download "
           f"{example} --local-dir DIR` writes, or use a hub id")
    if path.is_dir():
        missing = [f"{s}/" for s in FAMILY_SUBFOLDERS[family] if not (path / s).is_dir()]
        if missing:
            return [Problem("model.pretrained", pretrained,
                            f"not a diffusers Stable Diffusion checkpoint: missing {', '.join(missing)}", fix)]
    elif path.exists():
        return [Problem("model.pretrained", pretrained, "a file, not a checkpoint directory", fix)]
    elif _looks_like_path(pretrained):
        return [Problem("model.pretrained", pretrained, "no such directory", fix)]
    return []


def _prompt_problems(cfg: RunConfig) -> list[Problem]:
    """Build the prompt source as the training process will (same reader): missing, binary or empty files."""
    from ddpo_tpu.prompts import PromptError, make_prompt_source

    p = cfg.prompts
    try:
        make_prompt_source(p.name, file=p.file, nouns_file=p.nouns_file, activities_file=p.activities_file)
    except PromptError as e:
        # PromptError reads "prompts.KEY=VALUE: reason (fix: ...)": keep the reason and the fix
        key = e.key or "prompts.name"
        value = getattr(p, key.split(".", 1)[1], p.name)
        m = re.fullmatch(r"[\w.]+(?:=.*?)?: (.*) \(fix: (.*)\)", str(e), flags=re.S)
        reason, fix = (m.group(1), m.group(2)) if m else (str(e), "")
        return [Problem(key, value, reason, fix)]
    return []


def _url_problems(key: str, url: Any) -> list[Problem]:
    fix = f"set {key}=http://HOST:PORT/PATH, e.g. http://127.0.0.1:8765/score"
    if not isinstance(url, str) or not url.strip():
        return [Problem(key, url, "the reward server's URL is required", fix)]
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname or any(c.isspace() for c in url):
        return [Problem(key, url, "not an http:// or https:// URL with a host", fix)]
    try:
        parsed.port  # noqa: B018 -- raises ValueError for a port that is not a number in 0-65535
    except ValueError as e:
        return [Problem(key, url, str(e), fix)]
    return []


# a tiny stand-in comes in pairs: the tiny MLP takes the tiny CLIP's embeddings, the tiny processor the tiny model's
# vocabulary (rewards/from_config.py builds them)
_TINY_PAIRS = {"aesthetic": ("clip_model", "mlp_path"), "pickscore": ("clip_model", "processor")}


def _reward_problems(r: Any, key: str = "reward") -> list[Problem]:
    """What the schema cannot say about a reward's keys (types, names and unknown keys it has checked): the run's
    reward, or each component of reward=weighted under reward.components.N."""
    if r.name == "weighted":
        return [p for i, c in enumerate(r.components) for p in _reward_problems(c, f"{key}.components.{i}")]
    if r.name == "remote":
        return _url_problems(f"{key}.url", r.url)
    problems = []
    if r.name == "aesthetic":
        if not r.mlp_path:
            problems.append(Problem(f"{key}.mlp_path", r.mlp_path, "the aesthetic reward needs the LAION aesthetic "
                                    "MLP weights",
                                    f"download sac+logos+ava1-l14-linearMSE.pth and set {key}.mlp_path=PATH"))
        elif r.mlp_path != TINY and not os.path.isfile(os.path.expanduser(r.mlp_path)):
            problems.append(Problem(f"{key}.mlp_path", r.mlp_path, "file not found",
                                    "give the path of the MLP weights"))
    pair = _TINY_PAIRS.get(r.name)
    if pair and not problems and (getattr(r, pair[0]) == TINY) != (getattr(r, pair[1]) == TINY):
        a, b = pair if getattr(r, pair[1]) == TINY else pair[::-1]  # b is tiny, a is not
        problems.append(Problem(f"{key}.{b}", TINY, f"the tiny stand-in only pairs with a tiny {a} "
                                f"({key}.{a}={getattr(r, a)})", f"set {key}.{a}={TINY}, or {key}.{b} to a real one"))
    return problems
