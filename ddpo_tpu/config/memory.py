"""The per-chip memory model: what the frozen models and trained state hold, what a fused training micro-step's
activations need, and the decisions the trainer takes from them (how many timesteps a micro-step fuses, whether
blocks are checkpointed). The figures are each family's (ddpo_tpu/catalog/families.py, where each cites the
benchmark that measured it); on TPU topologies and the distributed execution's GPUs. Estimates, not TPU figures."""

from __future__ import annotations

from typing import Any, Literal

from ddpo_tpu.catalog import ALGORITHMS, family
from ddpo_tpu.catalog.families import memory_of
from ddpo_tpu.config.batch import Totals, num_train_timesteps, product_fix, totals
from ddpo_tpu.config.schema import RunConfig
from ddpo_tpu.config.topology import single_host_of
from ddpo_tpu.problems import Fix, Problem

AUTO_MAX_FUSED = 10  # auto fuses at most this many timesteps (compile time and graph size grow with K)
# Fewer fused timesteps than this leave an SD-sized training micro-step bound by the host at parity batch sizes
# (measured host ms per micro-step on XLA CPU against the chip's FLOP time at 40% of a v6e: ratio 1.9 at K = 1, 1.29
# at K = 2, 0.75 at K = 5; benchmarks/RESULTS.md), so auto checkpoints when it would fuse fewer, for 1/3 more FLOPs.
AUTO_CHECKPOINT_BELOW = 2


def estimates_memory(topo) -> bool:
    """Whether the per-chip memory estimate applies: TPU chips (torch_xla or TorchTPU) and the accelerators of the
    distributed execution (GPUs), where the topology gives the device memory. The activation figures are XLA's
    (attention softmaxes materialised): on GPUs with fused attention they are an upper bound."""
    return bool(topo.hbm_gib_per_chip) and (topo.accelerator.startswith("tpu") or topo.spec.torchrun)


def _memory(cfg: RunConfig):
    """The model family's memory figures for this model config (catalog FamilyMemory; None: not estimated)."""
    return _memory_for(family(cfg.model.family), cfg.model)


def _memory_for(spec, model):
    """The family's figures at the size the model samples: an image family that reads model.resolution scales its
    512 px figures to that size (or, for a full-size checkpoint with resolution null, to the checkpoint's own), a
    video family's follow its frames and size already (wan_memory.py). None where nothing can be told: no figures,
    or figures that do not follow a size the run changes (then the HBM rules do not judge it)."""
    mem = memory_of(spec, model)
    if mem is None or spec.resolution_multiple is None or callable(spec.memory):
        return mem
    pixels = model.resolution or (mem.native_pixels if model.builder is None else None)
    if pixels is None or pixels == 512:
        return mem
    return mem.at_pixels(pixels) if mem.tokens_512 is not None else None


def _fsdp(cfg: RunConfig) -> int:
    topo = cfg.tpu_topology
    return topo.mesh.fsdp if topo.spec.multi_device else 1


def resident_gib(cfg: RunConfig, fsdp: int | None = None, dtype: str | None = None) -> float:
    """GiB of a chip held through training besides the micro-step's activations: frozen models, trained state,
    sampling buffers. `fsdp` and `dtype` ask "what if" (default: the config's). 0 for a family without figures."""
    mem = _memory(cfg)
    if mem is None:
        return 0.0
    return mem.resident_gib(cfg.model, fsdp or _fsdp(cfg), dtype or cfg.model.dtype)


def training_activation_gib(cfg: RunConfig, k: int, batch: int | None = None, precision: str | None = None,
                            checkpointed: bool | None = None) -> float:
    """Estimated activations of one fused training micro-step: k timesteps x train batch (x2 with CFG) evaluations.
    `batch`, `precision` and `checkpointed` ask "what if" (default: the config's)."""
    mem = _memory(cfg)
    if mem is None:
        return 0.0
    evals = k * (batch or cfg.train.batch_size) * (2 if cfg.train.cfg else 1)
    if checkpointed is None:
        checkpointed = activation_checkpointing(cfg)
    table = mem.checkpointed_gib_per_eval_512 if checkpointed else mem.activation_gib_per_eval_512
    return evals * table[precision or cfg.train.mixed_precision]


def activation_budget(cfg: RunConfig, resident: float | None = None) -> float | None:
    """GiB a chip has for training activations, for SD-sized models on estimated topologies; None where not
    estimated (small local builds, families without figures). Negative when the models alone do not fit."""
    spec = family(cfg.model.family)
    small = cfg.model.builder is not None and cfg.model.builder not in spec.full_size_builders
    if not estimates_memory(cfg.tpu_topology) or _memory(cfg) is None or small:
        return None
    return cfg.tpu_topology.hbm_gib_per_chip - (resident_gib(cfg) if resident is None else resident)


def train_batch_fits(cfg: RunConfig, batch: int) -> bool:
    """One timestep of `batch` samples per micro-step fits the chip by the estimate (or nothing is estimated)."""
    budget = activation_budget(cfg)
    return budget is None or training_activation_gib(cfg, 1, batch=batch) <= budget


def _asked_fused(cfg: RunConfig) -> int | Literal["auto"]:
    """The fused K the config asks for: train.timesteps_per_micro_step ("auto" or a K), or, for an algorithm that
    trains all of a sample's timesteps in one forward (catalog AlgorithmSpec.one_forward: AWM), its trained
    timesteps: that forward is the micro-step the memory decisions are made on."""
    if ALGORITHMS.get(cfg.algorithm.name).one_forward:
        return num_train_timesteps(cfg)
    return cfg.train.timesteps_per_micro_step


def activation_checkpointing(cfg: RunConfig) -> bool:
    """train.activation_checkpointing as the trainer uses it. auto: on where the HBM estimate applies (SD-sized
    models on estimated topologies) and, without it, the train batch (or an explicit timesteps_per_micro_step) does
    not fit, or auto would fuse fewer than AUTO_CHECKPOINT_BELOW timesteps where with it it fuses more; else off."""
    on = cfg.train.activation_checkpointing
    if on != "auto":
        return on
    budget, T = activation_budget(cfg), num_train_timesteps(cfg)
    if budget is None or T < 1:
        return False
    K = _asked_fused(cfg)
    if training_activation_gib(cfg, 1 if K == "auto" else K, checkpointed=False) > budget:
        return True
    if K != "auto":
        return False
    plain = fused_timesteps(cfg, checkpointed=False)
    return plain < AUTO_CHECKPOINT_BELOW and fused_timesteps(cfg, checkpointed=True) > plain


def fused_timesteps(cfg: RunConfig, checkpointed: bool | None = None) -> int:
    """train.timesteps_per_micro_step as the trainer uses it. auto: on TPU topologies the largest K (at most
    AUTO_MAX_FUSED) that divides the trained timesteps and whose activations fit the chip (by the estimate);
    elsewhere 1 (no memory figure to go by). An algorithm whose one forward holds all its trained timesteps (AWM)
    fuses them all. `checkpointed` asks "what if" (default: the config's)."""
    K, T = _asked_fused(cfg), num_train_timesteps(cfg)
    if K != "auto":
        return K
    if not cfg.tpu_topology.accelerator.startswith("tpu") or T < 1:
        return 1
    budget = activation_budget(cfg)
    if budget is not None and checkpointed is None:  # resolved once, not per candidate K
        checkpointed = activation_checkpointing(cfg)
    return max(d for d in range(1, min(T, AUTO_MAX_FUSED) + 1) if T % d == 0
               and (d == 1 or budget is None or training_activation_gib(cfg, d, checkpointed=checkpointed) <= budget))


def memory_problems(cfg: RunConfig) -> list[Problem]:
    """A train batch, a fused micro-step or a full fine-tune the chip cannot hold (by the estimate)."""
    problems: list[Problem] = []
    topo, train, tot = cfg.tpu_topology, cfg.train, totals(cfg)
    K, budget = _asked_fused(cfg), activation_budget(cfg)
    # the key that sets K: train.timesteps_per_micro_step, or the count of an algorithm's one forward (AWM's
    # algorithm.train_timesteps), where a smaller K need not divide anything
    spec = ALGORITHMS.get(cfg.algorithm.name)
    k_key = spec.trained_timesteps if spec.one_forward and spec.trained_timesteps else "train.timesteps_per_micro_step"
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
                                Fix.of({"train.timesteps_per_micro_step": max(d for d in fits if d <= K)},
                                       verb="try", note="(or auto)")))
    elif K != "auto" and not batch_too_big and budget is not None and training_activation_gib(cfg, K) > budget:
        fits = [d for d in range(1, K) if (spec.one_forward or tot.train_timesteps % d == 0)
                and training_activation_gib(cfg, d) <= budget]
        if not activation_checkpointing(cfg) and training_activation_gib(cfg, K, checkpointed=True) <= budget:
            fix: Fix | str = Fix.of({"train.activation_checkpointing": True}, verb="try", note="(or auto)")
        elif fits:
            fix = Fix.of({k_key: max(fits)}, verb="try", note="" if spec.one_forward else "(or auto)")
        else:
            fix = "lower train.batch_size (raise train.gradient_accumulation_steps to keep parity)"
        problems.append(Problem(k_key, K,
                                f"{K} timesteps x {train.batch_size} samples{' x 2 (CFG)' if train.cfg else ''} "
                                f"in one forward/backward need about {training_activation_gib(cfg, K):.1f} GiB of "
                                f"activations per chip (estimate), the chip has {topo.hbm_gib_per_chip} GiB of which "
                                f"about {resident_gib(cfg):.1f} GiB hold the models", fix))
    fam = family(cfg.model.family)
    if not cfg.model.lora.enabled and estimates_memory(topo) and _memory(cfg) is not None:
        need = _memory(cfg).full_finetune_gib
        fsdp = _fsdp(cfg)
        if topo.hbm_gib_per_chip < need(fsdp):
            fits = [k for k in range(2, topo.chips_per_host + 1) if topo.chips % k == 0
                    and topo.chips_per_host % k == 0 and topo.hbm_gib_per_chip >= need(k)]
            alt = (f"; tpu_topology.mesh.fsdp={fits[0]} tpu_topology.mesh.dp={topo.chips // fits[0]} splits it to "
                   f"about {need(fits[0]):.1f} GiB" if fits and topo.spec.multi_device else "")
            problems.append(Problem("model.lora.enabled", False,
                                    f"a full {fam.denoiser} fine-tune with Adam needs about {need(fsdp):.1f} GiB per "
                                    f"chip with fsdp={fsdp}, the chip has {topo.hbm_gib_per_chip}{alt}",
                                    Fix.of({"model.lora.enabled": True})))
    return problems


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
        fix = product_fix(target, tot.replicas, ("train.batch_size", B),
                          ("train.gradient_accumulation_steps", train.gradient_accumulation_steps),
                          ok_first=lambda v: v <= most and sample.batch_size % v == 0, keep_first=False)
        return Problem("train.batch_size", B,
                       f"{B} samples{cfg_x} in one forward/backward need about {B * per:.1f} GiB of activations per "
                       f"chip (estimate), {what}: {most} sample{'s fit' if most > 1 else ' fits'}", fix)
    options: list[dict] = []
    if topo.spec.multi_device and _memory(cfg).fsdp_splits_frozen_weights:
        for k in range(topo.mesh.fsdp + 1, topo.chips_per_host + 1):
            if topo.chips % k == 0 and topo.chips_per_host % k == 0 and per <= hbm - resident_gib(cfg, fsdp=k):
                # splits the frozen weights too
                options.append({"tpu_topology.mesh.fsdp": k, "tpu_topology.mesh.dp": topo.chips // k,
                                "train.batch_size": 1})
                break
    if (not activation_checkpointing(cfg)
            and training_activation_gib(cfg, 1, batch=1, checkpointed=True) <= hbm - resident):
        options.append({"train.activation_checkpointing": True, "train.batch_size": 1})
    if cfg.model.dtype == "float32" and (training_activation_gib(cfg, 1, batch=1, precision="bf16")
                                        <= hbm - resident_gib(cfg, dtype="bfloat16")):
        options.append({"model.dtype": "bfloat16", "train.mixed_precision": "bf16", "train.batch_size": 1})
    if not options:
        options = _combined_options(cfg)
    if resident >= hbm:
        reason = (f"the models, trained state and sampling buffers alone need about {resident:.1f} GiB per chip "
                  f"(estimate), the {topo.name} chip has {hbm:g} GiB")
    else:
        reason = f"one sample{cfg_x} needs about {per:.1f} GiB of activations per chip (estimate), {what}"
    fix = (Fix.of(*options, verb="try") if options else
           "no setting of this topology fits one sample: use chips with more HBM (v6e, v4: 32 GiB)" if hbm < 32 else
           "no setting fits one sample on these chips")
    return Problem("tpu_topology.name", topo.name, reason, fix)


def _combined_options(cfg: RunConfig) -> list[dict]:
    """When no one setting makes room for one sample: the frozen weights over the host's widest fsdp (a single chip:
    over the same chips' 8-chip host, where conf/tpu_topology has one) with activation checkpointing and batch 1,
    and for a video family (catalog frame_step) the longest video that then fits."""
    topo, spec = cfg.tpu_topology, family(cfg.model.family)
    mem, k = _memory(cfg), _fsdp(cfg)
    base: dict[str, Any] = {}
    if mem.fsdp_splits_frozen_weights and topo.spec.multi_device:
        k = max(d for d in range(1, topo.chips_per_host + 1) if topo.chips % d == 0 and topo.chips_per_host % d == 0)
    elif mem.fsdp_splits_frozen_weights and topo.chips == 1 and (host := single_host_of(topo)) is not None:
        k, base = host[1], {"tpu_topology": host[0]}
    if k != _fsdp(cfg):
        base |= {"tpu_topology.mesh.fsdp": k, "tpu_topology.mesh.dp": (topo.chips if not base else k) // k}
    base |= {"train.activation_checkpointing": True, "train.batch_size": 1}
    room = topo.hbm_gib_per_chip - resident_gib(cfg, fsdp=k)
    evals = 2 if cfg.train.cfg else 1

    def fits(model) -> bool:
        return evals * _memory_for(spec, model).checkpointed_gib_per_eval_512[cfg.train.mixed_precision] <= room

    if room <= 0:
        return []
    if fits(cfg.model):
        return [base]
    step, n = spec.frame_step, cfg.model.num_frames
    if step is None or n is None:
        return []
    shorter = [f for f in range(n - step, 0, -step) if fits(cfg.model.model_copy(update={"num_frames": f}))]
    return [base | {"model.num_frames": shorter[0]}] if shorter else []
