"""RL algorithms: each one's keys under `algorithm.` (a pydantic model), its implementation (a class following the
`Algorithm` protocol of ddpo_tpu/algorithms/base.py, imported by the training process), the config sections it reads
besides its own keys, and its rules. Adding an algorithm: its keys and spec here, its class, conf/algorithm/<name>.yaml.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Callable, Literal, Optional, TypeAlias, Union

from pydantic import Field

from ddpo_tpu.catalog.registry import Registry
from ddpo_tpu.catalog.rewards import REWARDS, Keys
from ddpo_tpu.problems import Fix, Problem


@dataclass(frozen=True)
class AlgorithmSpec:
    name: str
    title: str
    keys: type[Keys]
    module: str                      # "package.module:Class"
    # sections read besides algorithm.*: a key under one the algorithm does not read is ignored (config/enablement.py)
    reads: tuple[str, ...] = ()
    # (cfg, totals) -> problems: what its keys need of the rest of the config (totals: config/batch.py Totals)
    problems: Callable[[Any, Any], list[Problem]] = lambda cfg, totals: []
    # trains its epochs itself (make_epoch_trainer) over the whole epoch's samples, laid out as one process holds
    # them: distributed.keep_samples_on_rank (each rank keeps its own) does not apply
    own_epoch_trainer: bool = False
    # how many timesteps it trains per sample (config/batch.py num_train_timesteps; the run plan's train_timesteps)
    # None: the sampled steps it re-scores or re-noises, an SDE window's size, else int(sample.num_steps x
    # train.timestep_fraction), as ddpo-pytorch, flow_grpo and DiffusionNFT count them; a dotted key of its own
    # ("algorithm.train_timesteps"): that key's value, whatever the fraction (which then only bounds where they fall)
    trained_timesteps: str | None = None
    # its epoch trainer puts all of a train batch's trained timesteps in one forward/backward (K x B rows), so the
    # fused K is the trained timesteps and train.timesteps_per_micro_step does not apply (config/memory.py
    # fused_timesteps; the memory estimate and activation checkpointing are sized on that forward)
    one_forward: bool = False

    def __post_init__(self) -> None:
        if self.one_forward and self.trained_timesteps is None:  # its K is set by that key (config/memory.py)
            raise ValueError(f"algorithm {self.name}: one_forward needs trained_timesteps, the key that sets its K")

    def own_timesteps(self, cfg: Any) -> int | None:
        """The trained timesteps per sample its own key sets (`trained_timesteps`); None: the sampler's count."""
        if self.trained_timesteps is None:
            return None
        node = cfg
        for part in self.trained_timesteps.split("."):
            node = getattr(node, part)
        return int(node)


ALGORITHMS: Registry[AlgorithmSpec] = Registry("algorithm")


class DdpoKeys(Keys):
    name: Literal["ddpo"]
    # each sample's trained timesteps in a random order (ddpo-pytorch), drawn on the device with fixed shapes;
    # was xla.shuffle_timesteps (config/compose.py maps the old key)
    shuffle_timesteps: bool = True


def _entries(features: bool) -> Any:
    """A reward-registry entry with its own keys, picked by `name`: the image scores (features=False) or the feature
    models (rewards/clip_features.py). Built from the registry, as the schema builds the `reward` group."""
    models = tuple(r.keys for r in REWARDS if not r.composite and r.features == features and r.takes == "images")
    return models[0] if len(models) == 1 else Annotated[Union[models], Field(discriminator="name")]  # noqa: UP007


if TYPE_CHECKING:  # built from the registry at import time: to the type checker, any entry
    _ScoreEntry: TypeAlias = Any
    _FeatureEntry: TypeAlias = Any
else:
    _ScoreEntry = _entries(False)
    _FeatureEntry = _entries(True)


class GrpoKeys(Keys):
    name: Literal["grpo"]
    group_size: int = Field(ge=2)                  # samples per prompt in an epoch
    kl_beta: float = Field(default=0.0, ge=0)      # weight of the KL penalty to the reference policy
    global_std: bool = False                       # divide by the std of the whole epoch, not the group's
    drop_zero_advantage: bool = True               # train only samples with advantage (flow_grpo's mask)
    # reward=weighted: sum (GRPO on the weighted sum, as flow_grpo and DiffusionNFT) or gdpo (each reward normalised
    # in its group, weighted, summed, batch-normalised: Flow-Factory's advantage_aggregation;
    # algorithms/multi_reward.py)
    advantage_aggregation: Literal["sum", "gdpo"] = "sum"
    # GARDO's adaptive reference (flow_grpo scripts/train_sd3_gardo.py): the KL's reference is a copy of the policy,
    # reset to the current weights after sampling when an update of the previous epoch had a KL above this (kl_thres)
    # or more than reference_reset_every epochs passed (reset_freq); null: the adapter-off base model (train_sd3.py)
    reference_reset_kl: float | None = Field(default=None, gt=0)
    reference_reset_every: int = Field(default=15, ge=1)
    # GRPO-Guard (flow_grpo scripts/train_sd3_GRPO_Guard.py, config.rationorm): the ratio normalised with the sampling
    # policy's step means, the loss divided by each step's dt (costs a forward of those weights per trained step)
    ratio_norm: bool = False
    # GARDO's uncertainty-gated KL (train_sd3_gardo.py:826-836, 953, 979-990): the KL only on the samples the trained
    # reward ranks furthest behind the mean rank these auxiliary rewards give them (its code: aesthetic, ImageReward);
    # []: every sample. kl_gate_share: its RiskCompensator's base, the gated share at the first epoch, then adapted
    kl_gate_rewards: list[_ScoreEntry] = []
    kl_gate_share: float = Field(default=0.1, ge=0.02, le=0.2)
    # GARDO's diversity-aware advantages (stat_tracking.py:11-50, type='gardo'): a feature model (its code: DINOv3);
    # null: GRPO's (r - mean) / std
    diversity_features: _FeatureEntry | None = None


class DppoKeys(GrpoKeys):
    """Flow-DPPO (arXiv 2606.11025) as verl-project/verl-omni@a1139baf FlowDPPOLoss has it: GRPO's keys, PPO's ratio
    clip replaced by a trust-region mask on the Gaussian KL to the sampling policy (ddpo_tpu/algorithms/dppo.py)."""
    name: Literal["dppo"]  # type: ignore[assignment]
    # eps of the mask: a row whose D (the mean Gaussian KL of its step to the sampling policy's) is >= this and whose
    # ratio moves further along its advantage's sign is masked (the reference's kl_mask_threshold, 1e-5, must be > 0)
    kl_mask_threshold: float = Field(default=1e-5, gt=0)
    # D normalised by the step's noise scale std_dev_t sqrt(-dt) (the exact KL); false: (mu - mu_old)^2 / 2
    add_kl_coefficient: bool = True


class NftKeys(Keys):
    """DiffusionNFT (Zheng et al. 2025, arXiv 2509.16117) as NVlabs/DiffusionNFT@24af5554 trains it:
    ddpo_tpu/algorithms/nft.py; docs/nft.md maps each key to the official code."""
    name: Literal["nft"]
    group_size: int = Field(ge=2)                       # samples per prompt in an epoch (as GRPO's)
    global_std: bool = True                             # divide by the std of the whole epoch, not the group's
    # reward=weighted: sum (GRPO on the weighted sum, as flow_grpo and DiffusionNFT) or gdpo (each reward normalised
    # in its group, weighted, summed, batch-normalised: Flow-Factory's advantage_aggregation;
    # algorithms/multi_reward.py)
    advantage_aggregation: Literal["sum", "gdpo"] = "sum"
    # NFT's own beta (official `config.beta`, 1; 0.1 in sd3_ocr and sd3_multi_reward): the implicit policies' step,
    # v+- = v_old +- beta (v - v_old). Not the KL weight below.
    beta: float = Field(default=1.0, gt=0)
    # the KL term's weight (official `config.train.beta`, 1e-4): kl_beta x mean((v - v_ref)^2), v_ref the model with
    # its LoRA adapter off; 0: no reference forward
    kl_beta: float = Field(default=1e-4, ge=0)
    adv_clip_max: float = Field(default=5.0, gt=0)      # advantages clipped to +-c, then r = clip(A/c)/2 + 1/2
    # the old (sampling) policy: after each epoch old <- d old + (1 - d) current, d = 0 for the first decay_start
    # optimizer steps, then min(decay_rate x (steps - decay_start), decay_max) (official return_decay; decay_type 1
    # = 0, 0.001, 0.5 the default; 2 = 75, 0.0075, 0.999; 0 = decay_rate 0: the weights that sampled the epoch)
    decay_max: float = Field(default=0.5, ge=0, lt=1)
    decay_rate: float = Field(default=0.001, ge=0)
    decay_start: int = Field(default=0, ge=0)
    ode_sampling: bool = True                           # sample with the ODE (sample.ode_solver; no log-probs)
    # the transformer's timestep while sampling: trunc(sigma x 1000) as the official sampling pipeline casts it
    # (training uses the float sigma x 1000 there and here); false: the float (SD3 family only when true);
    # null (the default): the official cast on SD3, the float on the families the official code does not train
    integer_rollout_timesteps: Optional[bool] = None


class AwmKeys(Keys):
    """Advantage Weighted Matching (scxue/advantage_weighted_matching@be51372, scripts/train_sd3_awm.py):
    ddpo_tpu/algorithms/awm.py. Defaults: the reference's presets (config/dgx_awm.py, pickscore_sd3_no_cfg_1node)."""
    name: Literal["awm"]
    group_size: int = Field(ge=2)                       # samples per prompt in an epoch (as GRPO's)
    global_std: bool = True                             # divide by the std of the whole epoch (sample.global_std)
    # reward=weighted: sum (GRPO on the weighted sum, as flow_grpo and DiffusionNFT) or gdpo (each reward normalised
    # in its group, weighted, summed, batch-normalised: Flow-Factory's advantage_aggregation;
    # algorithms/multi_reward.py)
    advantage_aggregation: Literal["sum", "gdpo"] = "sum"
    train_timesteps: int = Field(default=6, ge=1)       # training times per sample, one per stratum
    time_type: Literal["discrete", "discrete_wo_init"] = "discrete"  # strata of steps [0 or 1, int(T x fraction)]
    weighting: Literal["uniform", "t", "t2", "huber", "ghuber"] = "ghuber"  # of the matching error (lp = -w(mse))
    ghuber_power: float = Field(default=0.25, gt=0)     # p of ghuber: -((mse + 1e-10)^p - 1e-10^p) t / p
    advantage_max: float | None = Field(default=1.0, gt=0)  # clipped advantages rescaled from +-adv_clip_max to +-this
    clip_range: float = Field(default=1.0, gt=0)        # PPO clip of the ratio exp(lp - lp_old) (the reference's 1)
    kl_beta: float = Field(default=0.0, ge=0)           # mean((v - v_ref)^2) to the adapter-off model (train.beta)
    kl_weight: Literal["uniform", "elbo"] = "uniform"   # the KL terms' weighting over times
    # a second KL term to a slow copy of the policy (only with kl_beta > 0, as the reference nests it):
    # copy <- d copy + (1 - d) policy after each epoch, d = min(0.001 x optimizer steps, kl_ema_decay)
    ema_beta: float = Field(default=0.0, ge=0)
    kl_ema_decay: float = Field(default=0.3, ge=0, lt=1)


def _divisor_near(n: int, want: int) -> int | None:
    sizes = [g for g in range(2, n + 1) if n % g == 0]
    return min(sizes, key=lambda g: (abs(g - want), g)) if sizes else None


def _group_problems(cfg: Any, tot: Any) -> list[Problem]:
    """Groups of group_size split the epoch and each sampling batch (GRPO's and NFT's prompts); GDPO needs rewards
    to normalise one by one."""
    a, n = cfg.algorithm, tot.samples_per_epoch
    problems: list[Problem] = []
    if a.advantage_aggregation == "gdpo" and cfg.reward.name != "weighted":
        problems.append(Problem("algorithm.advantage_aggregation", "gdpo", f"GDPO normalises each reward of a "
                                f"weighted sum on its own; reward={cfg.reward.name} is one reward",
                                Fix.of({"algorithm.advantage_aggregation": "sum"}, note="or reward=weighted with "
                                       "its components")))
    if a.advantage_aggregation == "gdpo" and getattr(a, "diversity_features", None) is not None:
        problems.append(Problem("algorithm.advantage_aggregation", "gdpo", "GARDO's diversity-aware advantages "
                                "(algorithm.diversity_features) replace GRPO's; they do not combine with GDPO",
                                Fix.of({"algorithm.advantage_aggregation": "sum"}, {"algorithm.diversity_features":
                                                                                    None})))
    batch = cfg.sample.batch_size * tot.replicas
    if n % a.group_size:
        near = _divisor_near(n, a.group_size)
        per = cfg.sample.batch_size * cfg.sample.num_batches_per_epoch
        problems.append(Problem("algorithm.group_size", a.group_size,
                                f"{per} samples x {tot.replicas} replicas = {n} samples per epoch do not split into "
                                f"groups of {a.group_size}",
                                Fix.of({"algorithm.group_size": near}, verb="try") if near else
                                "raise sample.batch_size or sample.num_batches_per_epoch"))
    elif batch % a.group_size:
        # flow_grpo's DistributedKRepeatSampler: each sampling batch holds whole groups (batch / group_size prompts)
        near = _divisor_near(batch, a.group_size)
        problems.append(Problem("algorithm.group_size", a.group_size,
                                f"a sampling batch of {cfg.sample.batch_size} x {tot.replicas} replicas = {batch} "
                                f"samples does not hold whole groups of {a.group_size} (flow_grpo draws each group "
                                f"inside one sampling batch)",
                                Fix.of({"algorithm.group_size": near}, verb="try") if near else
                                "raise sample.batch_size"))
    return problems


def _grpo_problems(cfg: Any, tot: Any) -> list[Problem]:
    a, problems = cfg.algorithm, _group_problems(cfg, tot)
    if getattr(cfg.sample, "ode_solver", None) == "dpm2":
        problems.append(Problem("sample.ode_solver", "dpm2", "GRPO samples with the SDE: the multistep ODE solver is "
                                "read by algorithm=nft's rollouts only", Fix.of({"sample.ode_solver": "euler"})))
    if a.reference_reset_kl is not None and a.kl_beta == 0:
        problems.append(Problem("algorithm.reference_reset_kl", a.reference_reset_kl, "GARDO resets the KL's "
                                "reference; with algorithm.kl_beta=0 there is no KL term",
                                Fix.of({"algorithm.kl_beta": 0.04}, {"algorithm.reference_reset_kl": None})))
    if a.kl_beta > 0 and not cfg.model.lora.enabled:
        problems.append(Problem("algorithm.kl_beta", a.kl_beta, "the reference policy is the model with its LoRA "
                                "adapter off; a full fine-tune has no adapter",
                                Fix.of({"model.lora.enabled": True}, {"algorithm.kl_beta": 0})))
    problems.extend(_gardo_problems(cfg))
    if a.ratio_norm and cfg.sample.name != "flow_sde":
        problems.append(Problem("algorithm.ratio_norm", True, "GRPO-Guard normalises the ratio by the flow_sde "
                                "sampler's step std x sqrt(dt) (train_sd3_GRPO_Guard.py); "
                                f"{_sampler_words(cfg.sample.name)}", Fix.of({"algorithm.ratio_norm": False})))
    cps_kl = a.kl_beta > 0 and cfg.sample.name == "flow_sde" and cfg.sample.sde_type == "cps"
    if cps_kl and cfg.sample.sde_window.size is None and tot.train_timesteps >= cfg.sample.num_steps:
        problems.append(Problem("train.timestep_fraction", cfg.train.timestep_fraction,
                                "the last CPS step is deterministic (std 0), so its KL term is 0/0",
                                Fix.of({"train.timestep_fraction": 0.99}, verb="train fewer steps, e.g.",
                                       note="(flow_grpo)")))
    elif cps_kl and cfg.sample.sde_window.size is not None and _window_reaches_last_step(cfg):
        problems.append(_last_step_window_problem(cfg))
    return problems


def _dppo_problems(cfg: Any, tot: Any) -> list[Problem]:
    """GRPO's rules, and what the mask needs: the flow_sde sampler's step means and its 'sde' noise scale; RatioNorm
    is another loss (GRPO-Guard's), not an option of this one."""
    a, problems = cfg.algorithm, _grpo_problems(cfg, tot)
    if cfg.sample.name != "flow_sde":
        problems.append(Problem("algorithm.name", "dppo", "Flow-DPPO compares the flow_sde sampler's step means with "
                                f"the sampling policy's (verl-omni FlowDPPOLoss); {_sampler_words(cfg.sample.name)}",
                                Fix.of({"algorithm": "grpo"}, note="or a model of a flow_sde family")))
    elif a.add_kl_coefficient and cfg.sample.sde_type != "sde":
        problems.append(Problem("sample.sde_type", cfg.sample.sde_type, "Flow-DPPO's D divides by std_dev_t "
                                "sqrt(-dt), the 'sde' step's noise scale (verl-omni docs/algo/flowdppo.md: "
                                "sde_type=sde); a CPS step's std is not of that form",
                                Fix.of({"sample.sde_type": "sde"}, {"algorithm.add_kl_coefficient": False})))
    if a.ratio_norm:
        problems.append(Problem("algorithm.ratio_norm", True, "GRPO-Guard's RatioNorm is another policy loss; "
                                "Flow-DPPO's mask replaces the ratio clip it normalises",
                                Fix.of({"algorithm.ratio_norm": False}, {"algorithm": "grpo"})))
    return problems


def _gardo_problems(cfg: Any) -> list[Problem]:
    """GARDO's gate and feature model: a gate needs a KL term and rewards that can disagree with the trained one;
    each entry's own keys are checked as the run's reward's are."""
    from ddpo_tpu.catalog.families import FAMILIES

    a, problems = cfg.algorithm, []
    output = FAMILIES.get(cfg.model.family).output
    for key, on, off in (("algorithm.kl_gate_rewards", bool(a.kl_gate_rewards), []),
                         ("algorithm.diversity_features", a.diversity_features is not None, None)):
        if on and output != "images":
            problems.append(Problem(key, "set", f"GARDO's auxiliary rewards and feature model score images (its code "
                                    f"trains SD 3 and FLUX); model.family={cfg.model.family} decodes {output}",
                                    Fix.of({key: off})))
    if a.kl_gate_rewards and a.kl_beta == 0:
        problems.append(Problem("algorithm.kl_gate_rewards", [e.name for e in a.kl_gate_rewards], "GARDO's gate picks "
                                "the samples that carry the KL; with algorithm.kl_beta=0 there is no KL term",
                                Fix.of({"algorithm.kl_beta": 0.04}, {"algorithm.kl_gate_rewards": []})))
    trained = cfg.reward.model_dump(exclude={"host_workers", "frame_reduction", "process"})  # the run's own keys
    for i, e in enumerate(a.kl_gate_rewards):
        key = f"algorithm.kl_gate_rewards.{i}"
        if e.model_dump() == trained:
            problems.append(Problem(key, e.name, "the trained reward itself: it ranks every sample as the trained "
                                    "reward does, so no sample is ever uncertain", "give another reward (GARDO's "
                                    "code: aesthetic and ImageReward beside the trained one)"))
        problems.extend(REWARDS.get(e.name).problems(e, key))
    if a.diversity_features is not None:
        f = a.diversity_features
        problems.extend(REWARDS.get(f.name).problems(f, "algorithm.diversity_features"))
    return problems


def _window_reaches_last_step(cfg: Any) -> bool:
    """Whether an SDE window (trained steps) covers the last denoising step in some epoch of the run: diffusion/
    window.py places it (that module's package imports torch, so its sliding arithmetic is restated here)."""
    w, T = cfg.sample.sde_window, cfg.sample.num_steps
    lo, hi = w.range if w.range is not None else (0, T)
    if hi != T:
        return False
    if w.placement == "random":  # any start in [lo, hi - size] may be drawn
        return True
    last_start = w.start
    if w.placement == "sliding":  # it moves `stride` steps every `shift_every` epochs, cycling within the range
        moves = min((hi - w.size - w.start) // w.stride, (cfg.num_epochs - 1) // w.shift_every)
        last_start = w.start + moves * w.stride
    return last_start + w.size == T


def _last_step_window_problem(cfg: Any) -> Problem:
    w, T = cfg.sample.sde_window, cfg.sample.num_steps
    lo = w.range[0] if w.range is not None else 0
    reason = (f"the window reaches the last of the {T} steps, a deterministic CPS step (std 0), so its KL term is 0/0 "
              f"(a non-finite loss at the first step)")
    if w.placement == "fixed" and w.start > lo:
        return Problem("sample.sde_window.start", w.start, reason,
                       Fix.of({"sample.sde_window.start": T - 1 - w.size}, {"algorithm.kl_beta": 0}))
    if T - 1 - lo >= w.size:
        return Problem("sample.sde_window.range", w.range, reason,
                       Fix.of({"sample.sde_window.range": [lo, T - 1]}, {"algorithm.kl_beta": 0}))
    return Problem("sample.sde_window.size", w.size, reason, Fix.of({"algorithm.kl_beta": 0}))


def _nft_problems(cfg: Any, tot: Any) -> list[Problem]:
    from ddpo_tpu.catalog.families import FAMILIES

    from ddpo_tpu.catalog.samplers import SAMPLERS

    problems = _group_problems(cfg, tot)
    fam = FAMILIES.get(cfg.model.family)
    if not SAMPLERS.get(fam.sampler).flow:
        flows = ", ".join(f.name for f in FAMILIES if SAMPLERS.get(f.sampler).flow)
        problems.append(Problem("algorithm.name", "nft", f"DiffusionNFT trains on the flow-matching forward process; "
                                f"model.family={fam.name} is not a flow family ({fam.sampler} sampler)",
                                Fix.of({"algorithm": "ddpo"}, note=f"or a flow family's model ({flows})")))
    if cfg.train.cfg:
        problems.append(Problem("train.cfg", True, "DiffusionNFT is CFG-free: it trains the conditional velocity "
                                "alone", Fix.of({"train.cfg": False, "sample.guidance_scale": 1})))
    # a family whose guidance is an embedding (FLUX: spec.guidance "embedded") samples guided in one pass
    elif cfg.sample.guidance_scale != 1 and getattr(fam, "guidance", "cfg") == "cfg":
        problems.append(Problem("sample.guidance_scale", cfg.sample.guidance_scale,
                                "DiffusionNFT is CFG-free: it samples and trains the conditional velocity alone",
                                Fix.of({"sample.guidance_scale": 1})))
    if cfg.sample.sde_window.size is not None:
        problems.append(Problem("sample.sde_window.size", cfg.sample.sde_window.size, "DiffusionNFT trains on the "
                                "clean samples, not on recorded steps: it has no window to train",
                                Fix.of({"sample.sde_window.size": None})))
    return problems + _nft_key_problems(cfg, fam)


def _nft_key_problems(cfg: Any, fam: Any) -> list[Problem]:
    """NFT keys that would start a run and take no effect, or need what the config lacks."""
    a, problems = cfg.algorithm, []
    if a.kl_beta > 0 and not cfg.model.lora.enabled:
        problems.append(Problem("algorithm.kl_beta", a.kl_beta, "the KL term's reference is the model with its LoRA "
                                "adapter off; a full fine-tune has none (the official code asserts use_lora)",
                                Fix.of({"model.lora.enabled": True}, {"algorithm.kl_beta": 0})))
    if not a.ode_sampling and getattr(cfg.sample, "ode_solver", None) == "dpm2":
        problems.append(Problem("sample.ode_solver", "dpm2", "algorithm.ode_sampling=false samples with the SDE: "
                                "the ODE solver is not read", Fix.of({"algorithm.ode_sampling": True},
                                                                     {"sample.ode_solver": "euler"})))
    if a.ode_sampling and a.integer_rollout_timesteps is True and fam.name != "sd3":
        problems.append(Problem("algorithm.integer_rollout_timesteps", True, f"trunc(sigma x 1000) is the SD3 "
                                f"transformer's timestep (the official code trains SD3 only); model.family={fam.name} "
                                f"takes its own", Fix.of({"algorithm.integer_rollout_timesteps": False})))
    return problems


def _awm_problems(cfg: Any, tot: Any) -> list[Problem]:
    from ddpo_tpu.catalog.families import FAMILIES

    a, problems = cfg.algorithm, _group_problems(cfg, tot)
    fam = FAMILIES.get(cfg.model.family)
    if fam.sampler != "flow_sde":
        from ddpo_tpu.catalog.samplers import SAMPLERS

        runs = ", ".join(f.name for f in FAMILIES if f.sampler == "flow_sde")
        if SAMPLERS.get(fam.sampler).flow:  # a flow family with its own step (Wan): AWM drives flow_sde's only
            reason, fix = (f"AWM samples and trains through the flow_sde sampler's step (the reference's SD 3); "
                           f"model.family={fam.name} {_sampler_words(fam.sampler, family=True)}",
                           Fix.of({"algorithm": "grpo"}, {"algorithm": "nft"}, note=f"(or a model of {runs})"))
        else:
            reason, fix = (f"AWM trains on the flow-matching forward process; model.family={fam.name} is not a flow "
                           f"family ({fam.sampler} sampler)", Fix.of({"algorithm": "ddpo"},
                                                                     note=f"or a flow family's model ({runs})"))
        problems.append(Problem("algorithm.name", "awm", reason, fix))
    if cfg.train.cfg:
        problems.append(Problem("train.cfg", True, "AWM trains the conditional velocity alone (the reference's "
                                "presets: train.cfg false)", Fix.of({"train.cfg": False})))
    if cfg.sample.sde_window.size is not None:
        problems.append(Problem("sample.sde_window.size", cfg.sample.sde_window.size, "AWM trains on the clean "
                                "samples, not on recorded steps: it has no window to train",
                                Fix.of({"sample.sde_window.size": None})))
    if getattr(cfg.sample, "ode_solver", None) == "dpm2":
        problems.append(Problem("sample.ode_solver", "dpm2", "AWM samples with the family's Euler ODE step: the "
                                "multistep solver is read by algorithm=nft's rollouts only",
                                Fix.of({"sample.ode_solver": "euler"})))
    if cfg.train.num_inner_epochs != 1:
        problems.append(Problem("train.num_inner_epochs", cfg.train.num_inner_epochs, "AWM scores lp_old once an "
                                "epoch with the weights that sampled it (the reference has no inner epochs)",
                                Fix.of({"train.num_inner_epochs": 1})))
    if a.kl_beta > 0 and not cfg.model.lora.enabled:
        problems.append(Problem("algorithm.kl_beta", a.kl_beta, "the reference policy is the model with its LoRA "
                                "adapter off; a full fine-tune has no adapter",
                                Fix.of({"model.lora.enabled": True}, {"algorithm.kl_beta": 0})))
    return problems


def _sampler_words(name: str, family: bool = False) -> str:
    """A sampler named for what it is (catalog/samplers.py): a flow sampler with its own step, or not a flow one."""
    from ddpo_tpu.catalog.samplers import SAMPLERS

    spec = SAMPLERS.get(name)
    what = f"samples with {name}" if family else f"sample.name={name}"
    if spec.flow:
        return f"{what}, a flow sampler with its own step ({spec.title}), not flow_sde"
    return f"{what}, not a flow sampler ({spec.title})"


def _ddpo_problems(cfg: Any, tot: Any) -> list[Problem]:
    st = cfg.stat_tracking
    if st.min_count > st.buffer_size:
        return [Problem("stat_tracking.min_count", st.min_count,
                        f"can never be reached with stat_tracking.buffer_size={st.buffer_size}",
                        Fix.of({"stat_tracking.min_count": st.buffer_size}, note="or fewer"))]
    return []


def integer_rollout_timesteps(cfg) -> bool:
    """NFT's rollout timestep cast, resolved: the key when set, else the official code's (it trains SD3 only)."""
    value = cfg.algorithm.integer_rollout_timesteps
    return cfg.model.family == "sd3" if value is None else bool(value)


ALGORITHMS.register(AlgorithmSpec(
    "ddpo", "DDPO", DdpoKeys, "ddpo_tpu.algorithms.ddpo:DDPO", reads=("stat_tracking",), problems=_ddpo_problems))
ALGORITHMS.register(AlgorithmSpec(
    "grpo", "GRPO", GrpoKeys, "ddpo_tpu.algorithms.grpo:GRPO", problems=_grpo_problems))
ALGORITHMS.register(AlgorithmSpec(
    "dppo", "Flow-DPPO", DppoKeys, "ddpo_tpu.algorithms.dppo:DPPO", problems=_dppo_problems))
ALGORITHMS.register(AlgorithmSpec(
    "nft", "DiffusionNFT", NftKeys, "ddpo_tpu.algorithms.nft:NFT", problems=_nft_problems,
    own_epoch_trainer=True))
ALGORITHMS.register(AlgorithmSpec(
    "awm", "Advantage Weighted Matching", AwmKeys, "ddpo_tpu.algorithms.awm:AWM", problems=_awm_problems,
    # train_sd3_awm.py@be51372 trains config.train.train_timesteps times per sample, a stratum each of the first
    # int(num_steps x timestep_fraction) steps, concatenated into one forward of K x B rows (:1172-1180, 1212-1220,
    # 1265-1270)
    own_epoch_trainer=True, trained_timesteps="algorithm.train_timesteps", one_forward=True))


def owner_of(key: str) -> AlgorithmSpec | None:
    """The algorithm whose keys include `key` (a dotted algorithm.* key), for a key set under another algorithm."""
    field = key.removeprefix("algorithm.")
    return next((a for a in ALGORITHMS if field in a.keys.model_fields and field != "name"), None)
