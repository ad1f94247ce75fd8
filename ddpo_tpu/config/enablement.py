"""Keys that only matter when another key enables them, as data: setting one where it cannot take effect (the EMA's
decay with the EMA off, evaluation prompts with evaluation off, XLA flags on an eager topology...) is refused in one
line naming what enables it, instead of starting a run that silently ignores it. A key is judged when the user set it
(on the command line or in a sweep); the defaults and groups that carry such keys for every run are left alone."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ddpo_tpu.catalog import ALGORITHMS, family
from ddpo_tpu.catalog.algorithms import GrpoKeys  # GRPO and what extends it (Flow-DPPO): GARDO's keys
from ddpo_tpu.catalog.families import models_making
from ddpo_tpu.config.distributed import compile_backend
from ddpo_tpu.config.schema import RunConfig
from ddpo_tpu.problems import Fix, Problem


@dataclass(frozen=True)
class Dependent:
    keys: tuple[str, ...]             # dotted keys, or prefixes ending in "." for a whole section
    active: Callable[[RunConfig], bool]
    because: str                      # why it is not read: "train.ema=false"
    fix: Fix | str                    # what enables it


_XLA = lambda c: c.tpu_topology.spec.torch_xla  # noqa: E731

DEPENDENTS: tuple[Dependent, ...] = (
    Dependent(("train.ema_decay", "train.ema_every"), lambda c: c.train.ema, "train.ema=false",
              Fix.of({"train.ema": True})),
    Dependent(("evaluation.seed", "evaluation.prompts", "evaluation.num_steps", "evaluation.deterministic",
               "evaluation.split", "evaluation.path", "evaluation.images_per_prompt", "evaluation.batch_size",
               "evaluation.guidance_scale", "evaluation.rewards"),
              lambda c: c.evaluation.every_n_epochs > 0, "evaluation.every_n_epochs=0",
              Fix.of({"evaluation.every_n_epochs": 1}, note="(or another period)")),
    Dependent(("logger.project", "logger.entity", "logger.group", "logger.tags", "logger.notes", "logger.mode",
               "logger.tensorboard"), lambda c: c.logger.name != "none", "logger=none",
              "add logger=wandb or logger=tensorboard"),
    # logger=tensorboard writes its files whatever logger.tensorboard says (that key adds them to wandb), and never
    # starts wandb, so wandb's keys would be silently dropped
    Dependent(("logger.tensorboard",), lambda c: c.logger.name != "tensorboard",
              "logger=tensorboard always writes TensorBoard files (the key adds them to logger=wandb)",
              "remove it; use logger=none for no tracker, or logger=wandb_tensorboard for both"),
    Dependent(("logger.project", "logger.entity", "logger.group", "logger.tags", "logger.notes", "logger.mode"),
              lambda c: c.logger.name == "wandb", "logger=tensorboard does not start wandb",
              Fix.of({"logger": "wandb_tensorboard"}, note="(both trackers)")),
    # torch_xla's PJRT device: eager and distributed topologies run plain torch (TorchTPU on TPUs), never PJRT
    Dependent(("tpu_topology.pjrt_device",),
              lambda c: not c.tpu_topology.spec.torchrun or c.tpu_topology.pjrt_device is None,
              "the distributed execution runs plain torch (torchrun), not PJRT",
              Fix.of({"tpu_topology.pjrt_device": None})),
    Dependent(("tpu_topology.mesh.",), lambda c: c.tpu_topology.spec.multi_device,
              "this topology drives one device", "use a multi-device topology, e.g. tpu_topology=cpu_spmd4"),
    Dependent(("xla.flags", "xla.libtpu_init_args", "xla.step_compiler", "xla.compilation_cache_dir",
               "xla.profile_steps", "xla.debug_level", "xla.gather", "xla.sync_before_reward_gather"), _XLA,
              "the topology does not run torch_xla", "use an XLA topology (tpu_topology=cpu, v6e-8, ...)"),
    # the reward's own process (rewards/managed.py): its settings mean nothing while the reward runs in the trainer
    Dependent(("reward.process.device", "reward.process.port", "reward.process.startup_timeout_s",
               "reward.process.request_timeout_s"), lambda c: c.reward.process.python is not None,
              "reward.process.python=null (the reward runs in the trainer)",
              "set reward.process.python=/path/to/env/bin/python"),
    Dependent(("sample.sde_window.placement", "sample.sde_window.start", "sample.sde_window.range",
               "sample.sde_window.shift_every", "sample.sde_window.stride"),
              lambda c: c.sample.sde_window.size is not None, "sample.sde_window.size=null (no window)",
              "set sample.sde_window.size=N"),
    Dependent(("sample.sde_window.shift_every", "sample.sde_window.stride"),
              lambda c: c.sample.sde_window.placement == "sliding", "the window does not slide",
              Fix.of({"sample.sde_window.placement": "sliding"})),
    Dependent(("sample.sde_window.start",), lambda c: c.sample.sde_window.placement != "random",
              "a random window draws its start", Fix.of({"sample.sde_window.placement": "fixed"},
                                                        {"sample.sde_window.placement": "sliding"})),
    Dependent(("train.timestep_fraction",), lambda c: c.sample.sde_window.size is None,
              "an SDE window trains its own steps (sample.sde_window.size)", Fix.of({"sample.sde_window.size": None})),
    # an image reward's frame reduction is read by video families only (a component's: components.py)
    Dependent(("reward.frame_reduction",), lambda c: family(c.model.family).output == "videos",
              "the model makes images (it reduces a video's frames' scores)",
              f"remove it, or use a video model ({models_making('videos')})"),
    Dependent(("storage_timeout_s",), lambda c: c.output_root.startswith("gs://"), "output_root is local",
              "use output_root=gs://BUCKET/PREFIX"),
    Dependent(("distributed.",), lambda c: c.tpu_topology.spec.torchrun,
              "tpu_topology.execution is not distributed", "use a distributed topology, e.g. tpu_topology=cpu_dist2"),
    # one process holds the whole epoch anyway; no compile, no compile cache; a fresh start never loads a checkpoint
    Dependent(("distributed.keep_samples_on_rank",), lambda c: c.tpu_topology.chips > 1,
              "one process: it holds every sample of the epoch either way",
              "remove it, or use a topology of several processes, e.g. tpu_topology=cpu_dist2"),
    Dependent(("distributed.compile_cache_dir",), lambda c: compile_backend(c) != "none",
              "distributed.compile=none compiles nothing", Fix.of({"distributed.compile": "auto"})),
    Dependent(("force_resume",), lambda c: c.resume != "never", "resume=never starts over, loading no checkpoint",
              Fix.of({"resume": "auto"}, note="(continue the run dir's checkpoint)")),
    # DiffusionNFT (catalog/algorithms.py NftKeys): the PPO keys, the SDE's keys under its ODE rollouts, and the old
    # policy's schedule when it never decays
    Dependent(("train.adv_clip_max",), lambda c: c.algorithm.name != "nft",
              "algorithm=nft clips with its own algorithm.adv_clip_max", "set algorithm.adv_clip_max instead"),
    Dependent(("train.clip_range",), lambda c: c.algorithm.name != "nft",
              "algorithm=nft has no PPO ratio to clip",
              "leave it unset: DiffusionNFT bounds its step with algorithm.beta"),
    # Flow-DPPO (algorithms/dppo.py, verl-omni's FlowDPPOLoss): a trust-region mask in place of the ratio clip, and the
    # advantages as they are
    Dependent(("train.clip_range",), lambda c: c.algorithm.name != "dppo",
              "algorithm=dppo has no ratio clip: its trust region masks steps by their KL to the sampling policy",
              "set algorithm.kl_mask_threshold instead"),
    Dependent(("train.adv_clip_max",), lambda c: c.algorithm.name != "dppo",
              "algorithm=dppo does not clip advantages (as verl-omni's FlowDPPOLoss)", "leave it unset"),
    # AWM clips its ratio with its own key (catalog/algorithms.py AwmKeys.clip_range; the reference's config.train
    # clip_range is that one), and trains all its times of a train batch in one forward (algorithms/awm.py: K x B rows)
    Dependent(("train.clip_range",), lambda c: c.algorithm.name != "awm",
              "algorithm=awm clips its ratio with its own algorithm.clip_range",
              "set algorithm.clip_range instead (the reference's 1.0 is its default)"),
    Dependent(("train.timesteps_per_micro_step",), lambda c: not ALGORITHMS.get(c.algorithm.name).one_forward,
              "this algorithm trains all its trained timesteps of a train batch in one forward (algorithm=awm: "
              "algorithm.train_timesteps)",
              "remove it; the algorithm's own key sets how many timesteps that forward holds"),
    Dependent(("sample.noise_level", "sample.sde_type"),
              lambda c: c.algorithm.name not in ("nft", "awm") or (c.algorithm.name == "nft"
                                                                   and not c.algorithm.ode_sampling),
              "algorithm=nft (with algorithm.ode_sampling=true) and algorithm=awm sample with the ODE",
              Fix.of({"algorithm.ode_sampling": False}, note="(the SDE; the official presets sample the ODE)")),
    Dependent(("algorithm.decay_max", "algorithm.decay_start"),
              lambda c: c.algorithm.name != "nft" or c.algorithm.decay_rate > 0,
              "algorithm.decay_rate=0: the old policy is the weights that sampled each epoch",
              Fix.of({"algorithm.decay_rate": 0.001}, note="(or another rate)")),
    # d = min(decay_rate x (steps - decay_start), decay_max) (algorithms/nft.py OldPolicy): 0 whatever the start
    Dependent(("algorithm.decay_start",), lambda c: c.algorithm.name != "nft" or c.algorithm.decay_max > 0,
              "algorithm.decay_max=0: the old policy is the weights that sampled each epoch",
              Fix.of({"algorithm.decay_max": 0.5}, note="(or another bound below 1)")),
    # the transformer's timestep of NFT's own ODE rollouts (algorithms/nft.py: with ode_sampling=false the loop's
    # SDE step samples, with the family's float timesteps)
    Dependent(("algorithm.integer_rollout_timesteps",),
              lambda c: c.algorithm.name != "nft" or c.algorithm.ode_sampling,
              "algorithm.ode_sampling=false: the SDE rollouts take the family's own timesteps",
              Fix.of({"algorithm.ode_sampling": True})),
    # Advantage Weighted Matching (AwmKeys): a weighting's parameter, and its KL terms' settings without the term
    Dependent(("algorithm.ghuber_power",), lambda c: c.algorithm.name != "awm" or c.algorithm.weighting == "ghuber",
              "algorithm.weighting is not ghuber", Fix.of({"algorithm.weighting": "ghuber"})),
    Dependent(("algorithm.ema_beta", "algorithm.kl_weight"),
              lambda c: c.algorithm.name != "awm" or c.algorithm.kl_beta > 0,
              "algorithm.kl_beta=0: AWM has no KL term (the slow copy's term is nested in it, as the reference's)",
              Fix.of({"algorithm.kl_beta": 0.001}, note="(or another weight)")),
    Dependent(("algorithm.kl_ema_decay",),
              lambda c: c.algorithm.name != "awm" or (c.algorithm.kl_beta > 0 and c.algorithm.ema_beta > 0),
              "algorithm.ema_beta=0 (or kl_beta=0): no KL term to the slow copy",
              Fix.of({"algorithm.ema_beta": 0.1, "algorithm.kl_beta": 0.001}, note="(or other weights)")),
    # GRPO's GARDO option: the reset period without the reset
    Dependent(("algorithm.reference_reset_every",),
              lambda c: not isinstance(c.algorithm, GrpoKeys) or c.algorithm.reference_reset_kl is not None,
              "algorithm.reference_reset_kl=null: the KL's reference is never reset",
              Fix.of({"algorithm.reference_reset_kl": 0.1}, note="(or another KL threshold)")),
    # GARDO's gated KL: the gate's starting share without a gate; its diversity-aware advantages have no std
    Dependent(("algorithm.kl_gate_share",),
              lambda c: not isinstance(c.algorithm, GrpoKeys) or bool(c.algorithm.kl_gate_rewards),
              "algorithm.kl_gate_rewards=[]: every sample carries the KL",
              "set algorithm.kl_gate_rewards=[{name: <reward>, ...}, ...] (the auxiliary rewards)"),
    Dependent(("algorithm.global_std",),
              lambda c: not isinstance(c.algorithm, GrpoKeys) or c.algorithm.diversity_features is None,
              "algorithm.diversity_features is set: GARDO's advantages are r - mean, not divided by a std",
              Fix.of({"algorithm.diversity_features": None})),
)


def _run_by(names: tuple[str, ...]) -> Callable[[RunConfig], bool]:
    """A Dependent's `active`: the run's algorithm is one of `names` (bound here, not in a loop's closure)."""
    return lambda c: c.algorithm.name in names


def _dependents(cfg: RunConfig) -> tuple[Dependent, ...]:
    """The table, plus the sections an algorithm reads besides its own keys (stat_tracking: DDPO's, not GRPO's)."""
    readers = {section: [a.name for a in ALGORITHMS if section in a.reads] for a in ALGORITHMS for section in a.reads}
    extra = tuple(Dependent((f"{section}.",), _run_by(tuple(names)),
                            f"algorithm={cfg.algorithm.name} does not read it",
                            f"add algorithm={names[0]}" if len(names) == 1 else f"use one of: {', '.join(names)}")
                  for section, names in readers.items())
    return DEPENDENTS + extra


def _matches(key: str, pattern: str) -> bool:
    return key.startswith(pattern) if pattern.endswith(".") else key == pattern or key.startswith(pattern + ".")


def ignored_problems(cfg: RunConfig, tree: dict[str, Any], overridden: frozenset[str]) -> list[Problem]:
    from ddpo_tpu.config.batch import lookup

    problems: list[Problem] = []
    said: set[str] = set()  # one line per key: the first reason it is not read
    for dep in _dependents(cfg):
        touched = sorted(k for k in overridden if any(_matches(k, p) for p in dep.keys) and k not in said)
        if touched and not dep.active(cfg):
            key = touched[0]
            said.update(touched)
            problems.append(Problem(key, lookup(tree, key), f"not read: {dep.because}", dep.fix))
    problems.extend(_ema_problems(cfg))
    every = cfg.evaluation.every_n_epochs
    if every > cfg.num_epochs:
        problems.append(Problem("evaluation.every_n_epochs", every,
                                f"the run has {cfg.num_epochs} epochs, so no evaluation would run",
                                Fix.of({"evaluation.every_n_epochs": cfg.num_epochs}, note="or fewer, or 0 for none")))
    problems.extend(_sliding_problems(cfg))
    problems.extend(_decay_problems(cfg, overridden))
    return problems


def _optimizer_steps_per_epoch(cfg: RunConfig) -> int:
    t, s = cfg.train, cfg.sample
    return (s.batch_size * s.num_batches_per_epoch * t.num_inner_epochs) // (t.batch_size
                                                                            * t.gradient_accumulation_steps)


def _decay_problems(cfg: RunConfig, overridden: frozenset[str]) -> list[Problem]:
    """DiffusionNFT's old policy is updated after each epoch with d(step) = 0 before decay_start optimizer steps
    (algorithms/nft.py OldPolicy, NVlabs/DiffusionNFT@24af5554 train_nft_sd3.py return_decay); the update after the
    last epoch samples nothing, so a start at or beyond the last epoch's first step never decays a sampling policy."""
    a = cfg.algorithm
    if a.name != "nft" or "algorithm.decay_start" not in overridden or a.decay_rate <= 0 or a.decay_max <= 0:
        return []
    per_epoch = _optimizer_steps_per_epoch(cfg)
    last = per_epoch * (cfg.num_epochs - 1)  # the step count at the last update a later epoch samples with
    if per_epoch < 1 or a.decay_start < last:
        return []
    total = per_epoch * cfg.num_epochs
    fix = Fix.of({"algorithm.decay_start": 0}, note=f"(or below {last}, or raise num_epochs)") if last else \
        "raise num_epochs: a one-epoch run samples with its first weights only"
    return [Problem("algorithm.decay_start", a.decay_start, f"the run has {total} optimizer steps ({per_epoch} an "
                    f"epoch x {cfg.num_epochs}); the last epoch samples after step {last}, so the old policy's decay "
                    "would never start", fix)]


def _sliding_problems(cfg: RunConfig) -> list[Problem]:
    """A sliding window first moves at epoch shift_every (diffusion/window.py): a run that ends before that trains a
    fixed window while asking for a sliding one."""
    w, n = cfg.sample.sde_window, cfg.num_epochs
    if w.size is None or w.placement != "sliding" or w.shift_every < n or w.shift_every == 1:
        return []
    fixes = [{"sample.sde_window.shift_every": n - 1}] if n > 1 else []
    return [Problem("sample.sde_window.shift_every", w.shift_every, f"the run has {n} epoch(s), so the sliding "
                    f"window would never move (its first move is at epoch {w.shift_every})",
                    Fix.of(*fixes, {"sample.sde_window.placement": "fixed"}, note="(or raise num_epochs)"))]


def _ema_problems(cfg: RunConfig) -> list[Problem]:
    t = cfg.train
    if not t.ema:
        return []
    steps = _optimizer_steps_per_epoch(cfg) * cfg.num_epochs
    if 0 < steps < t.ema_every:
        return [Problem("train.ema_every", t.ema_every, f"the run has {steps} optimizer steps, so the EMA would never "
                        "be updated", Fix.of({"train.ema_every": max(1, steps)}, verb="try", note="or fewer"))]
    return []
