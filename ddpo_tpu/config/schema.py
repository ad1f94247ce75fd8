"""The typed schema of every config group. Unknown keys and wrong types are rejected with their dotted key.

Only pydantic, the standard library and the catalog are imported here: validation runs before torch is imported.
What is registered in the catalog (model families, samplers, rewards, algorithms) is read from it, not listed here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeAlias, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, create_model
from pydantic_core import PydanticCustomError

from ddpo_tpu.rundir.storage_faults import DEFAULT_TIMEOUT_S
from ddpo_tpu.catalog import ALGORITHMS, EXECUTIONS, FAMILIES, REWARDS, SAMPLERS, ExecutionSpec, Registry, execution
from ddpo_tpu.catalog.families import all_builders
from ddpo_tpu.catalog.rewards import FrameReductionKeys


class _Strict(BaseModel):
    # strict: "4" is not an int and 1.5 is not an int; ints are accepted where floats are expected.
    # no inf/nan: Hydra parses `inf` and `nan` as floats, and no key of a run means either
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)


def _registered(registry: Registry) -> Any:
    """A name that must be registered in `registry` when the config is validated (so a spec registered at run time,
    e.g. by a test, is accepted)."""

    def check(name: str) -> str:
        if name not in registry:
            raise PydanticCustomError("not_registered", "no {what} of this name",
                                      {"what": registry.what, "choices": ", ".join(registry.names())})
        return name

    return AfterValidator(check)


def _builder(name: str | None) -> str | None:
    if name is not None and name not in all_builders():
        raise PydanticCustomError("not_registered", "no local model build of this name",
                                  {"what": "local build", "choices": ", ".join(all_builders())})
    return name


class LoraConfig(_Strict):
    enabled: bool
    rank: int = Field(gt=0)
    alpha: float = Field(gt=0)
    target_modules: list[str] = Field(min_length=1)


class ModelConfig(_Strict):
    name: str
    family: Annotated[str, _registered(FAMILIES)]  # ddpo_tpu/catalog/families.py: sd1, sd3, ...
    builder: Annotated[str | None, AfterValidator(_builder)]  # a local build of the family (catalog), or null
    pretrained: str | None
    revision: str | None
    local_files_only: bool
    cache_dir: str
    dtype: Literal["float32", "bfloat16"]
    text_encoder_3: bool = False     # SD 3: load the T5 encoder too (false: zeros in its place, as SD 3 allows)
    resolution: int | None = Field(default=None, ge=8, le=4096)  # image size in pixels (null: the model's own)
    num_frames: int | None = Field(default=None, ge=1, le=1025)  # video families: frames a sample has
    # Wan 2.2 A14B: the experts that train (high: WanPipeline's transformer, low: transformer_2); null: all of them
    train_experts: list[Literal["high", "low"]] | None = Field(default=None, min_length=1)
    lora: LoraConfig


# --- rewards ----------------------------------------------------------------------------------------------------------
# One model per reward with that reward's own keys (ddpo_tpu/catalog/rewards.py); `name` picks the model (a
# discriminated union), so a key of another reward, a wrong type or an unknown name is refused at compose time with its
# dotted key. Each reward's keys are also those of a component of reward=weighted, which adds `weight` (and has no
# `host_workers`: the run's reward has them).


class RewardProcessConfig(_Strict):
    """The run's reward in a Python environment of its own (ddpo_tpu/rewards/managed.py, docs/rewards.md "Rewards in
    their own environment"): the trainer starts `python -m ddpo_tpu.rewards.serve` with this interpreter and scores
    over loopback. A run-level block: the components of reward=weighted run where the weighted reward runs."""

    python: str | None = None        # that environment's interpreter, e.g. /opt/env/bin/python (null: in-process)
    device: str | None = None        # where it runs the reward: cpu, cuda, cuda:1 (null: the run's CUDA device or cpu)
    port: int | None = Field(default=None, ge=1, le=65535)  # on 127.0.0.1 (null: a free port)
    startup_timeout_s: float = Field(default=600, gt=0, le=86400)  # to build the reward and listen (model loading)
    request_timeout_s: float = Field(default=600, gt=0, le=86400)  # one request's wait for its scores


class _RunReward(_Strict):
    host_workers: int = Field(ge=0, le=64)  # threads scoring a batch while the next one samples (0: inline)
    process: RewardProcessConfig = RewardProcessConfig()


class _Component(_Strict):
    weight: float = 1.0


def _tagged_union(models: list[type[BaseModel]]) -> Any:
    return Annotated[Union[tuple(models)], Field(discriminator="name")]  # noqa: UP007 -- built from a list


_LEAF_REWARDS = [r for r in REWARDS if not r.composite and not r.features]  # feature models score nothing


def _frames(spec) -> tuple[type[BaseModel], ...]:
    """An image reward's frame_reduction key (how a video family reduces its frames' scores); a video reward has
    none."""
    return (FrameReductionKeys,) if spec.takes == "images" else ()


# the run config's unions are built at import time from the catalog: to the type checker they are Any (docs/testing.md)
if TYPE_CHECKING:
    RewardComponent: TypeAlias = Any
    RewardConfig: TypeAlias = Any
    AlgorithmConfig: TypeAlias = Any
else:
    # a component of reward=weighted: any reward but `weighted` itself (a weighted sum of weighted sums is one)
    RewardComponent = _tagged_union([create_model(f"{r.keys.__name__.removesuffix('Keys')}Component",
                                                  __base__=(_Component, r.keys, *_frames(r))) for r in _LEAF_REWARDS])


class WeightedConfig(_RunReward):
    name: Literal["weighted"]
    components: list[RewardComponent] = Field(min_length=1)


if not TYPE_CHECKING:
    RewardConfig = _tagged_union([create_model(f"{r.keys.__name__.removesuffix('Keys')}Config",
                                               __base__=(_RunReward, r.keys, *_frames(r))) for r in _LEAF_REWARDS]
                                 + [WeightedConfig])


class SdeWindowConfig(_Strict):
    """SDE steps only inside a window of the denoising steps, the ODE elsewhere; only the window's steps are stored and
    trained (MixGRPO, Flow-GRPO-Fast). Samplers with windows: catalog/samplers.py."""

    size: int | None = Field(default=None, ge=1)  # steps in the window (null: no window, every step is the SDE's)
    # how it moves: fixed (at `start`), sliding (MixGRPO: from `start`, `stride` steps every `shift_every` epochs,
    # back to `start` past the range's end), random (Flow-GRPO-Fast: a new start for every sampling batch)
    placement: Literal["fixed", "sliding", "random"] = "random"
    start: int = Field(default=0, ge=0)
    range: list[Annotated[int, Field(ge=0)]] | None = Field(default=None, min_length=2, max_length=2)  # [lo, hi)
    shift_every: int = Field(default=1, ge=1)
    stride: int = Field(default=1, ge=1)


class SampleConfig(_Strict):
    name: Annotated[str, _registered(SAMPLERS)]  # the sampler (ddpo_tpu/catalog/samplers.py): ddim, flow_sde
    num_steps: int = Field(ge=1, le=1000)
    eta: float | None = Field(default=None, gt=0, le=1)              # ddim
    # flow_sde; above 1: flow_grpo's Qwen-Image runs (config/grpo.py pickscore_qwenimage 1.2, its edit runs 1.5)
    noise_level: float | None = Field(default=None, gt=0, le=2)
    sde_type: Literal["sde", "cps"] | None = None                    # flow_sde
    ode_solver: Literal["euler", "dpm2"] | None = None               # flow_sde: its ODE rollouts' solver (nft)
    guidance_scale: float = Field(ge=1)
    batch_size: int = Field(ge=1)
    num_batches_per_epoch: int = Field(ge=1)
    sde_window: SdeWindowConfig = SdeWindowConfig()


class TrainConfig(_Strict):
    batch_size: int = Field(ge=1)
    gradient_accumulation_steps: int = Field(ge=1)
    learning_rate: float = Field(gt=0, le=1)
    adam_beta1: float = Field(ge=0, lt=1)
    adam_beta2: float = Field(ge=0, lt=1)
    adam_weight_decay: float = Field(ge=0)
    adam_epsilon: float = Field(gt=0)
    max_grad_norm: float = Field(gt=0)
    num_inner_epochs: int = Field(ge=1)
    cfg: bool
    # the unconditional half of the guided prediction without gradient at train time (flow_grpo at ac4c86e)
    cfg_detach_uncond: bool = False
    adv_clip_max: float = Field(gt=0)
    clip_range: float = Field(gt=0, lt=1)
    timestep_fraction: float = Field(gt=0, le=1)
    timesteps_per_micro_step: Literal["auto"] | Annotated[int, Field(ge=1, le=1000)]
    # keep only each block's input through the forward and run the block again in the backward (diffusers' gradient
    # checkpointing): a fraction of the activations for one more forward; auto: where it lets more timesteps fuse
    activation_checkpointing: Literal["auto"] | bool = "auto"
    mixed_precision: Literal["no", "bf16"]
    ema: bool = False                                # keep an EMA of the trained weights (evaluation, final_ema)
    ema_decay: float = Field(default=0.9, gt=0, lt=1)  # its decay, reached after the warm-up min((1+s)/(10+s), d)
    ema_every: int = Field(default=8, ge=1)          # optimizer steps between EMA updates (flow_grpo: 8)


# the algorithm's own keys (ddpo_tpu/catalog/algorithms.py), picked by `name`
if not TYPE_CHECKING:
    AlgorithmConfig = _tagged_union([a.keys for a in ALGORITHMS])


class StatTrackingConfig(_Strict):
    per_prompt: bool
    buffer_size: int = Field(ge=1)
    min_count: int = Field(ge=1)


class EvaluationConfig(_Strict):
    """The held-out evaluation (training/evaluation.py, config/eval_plan.py; docs/operations.md "Evaluation")."""
    every_n_epochs: int = Field(ge=0)
    seed: int = Field(ge=0, lt=2**31)
    prompts: list[str] = Field(min_length=1)
    num_steps: int | None = Field(default=None, ge=1, le=1000)  # denoising steps (null: sample.num_steps)
    deterministic: bool = False      # the sampler's noise-free step (DDIM eta 0, the flow ODE) instead of its own
    # a dataset split instead of `prompts`: every row of evaluation.path's (null: prompts.path's) split file
    split: Literal["train", "test"] | None = None
    path: str | None = None
    images_per_prompt: int = Field(default=1, ge=1, le=1024)  # images of each row (GenEval: 4 of each prompt)
    batch_size: int | None = Field(default=None, ge=1)       # per replica (null: sample.batch_size)
    guidance_scale: float | None = Field(default=None, ge=0)  # null: sample.guidance_scale
    # the reward panel: catalog reward configs (a reward=weighted component's keys; `weight` is not read), each
    # scored on every evaluation image; null: the training reward alone
    rewards: list[RewardComponent] | None = None


class PromptsConfig(_Strict):
    name: Literal["imagenet_animals", "simple_animals", "nouns_activities", "from_file", "dataset"]
    file: str | None
    nouns_file: str | None
    activities_file: str | None
    # name=dataset: a flow_grpo / DiffusionNFT dataset folder or a .txt / .jsonl file (ddpo_tpu/prompts/datasets.py),
    # and which of the folder's splits to read
    path: str | None = None
    split: Literal["train", "test"] = "train"


class MeshConfig(_Strict):
    dp: int = Field(ge=1)
    fsdp: int = Field(ge=1)
    layout: Literal["auto", "host_local"]


# how a topology's devices are driven: the catalog's execution kinds (catalog/executions.py), one spec each with the
# capabilities the rules, the launcher and the loop read (TopologyConfig.spec)
_EXECUTION_NAMES = EXECUTIONS.names()


class TopologyConfig(_Strict):
    name: str
    accelerator: Literal["cpu", "cuda", "tpu_v4", "tpu_v5e", "tpu_v6e"]
    execution: Literal[_EXECUTION_NAMES]  # type: ignore[valid-type]
    pjrt_device: Literal["CPU", "TPU", "CUDA"] | None
    hosts: int = Field(ge=1)
    chips_per_host: int = Field(ge=1)
    chips: int = Field(ge=1)
    hbm_gib_per_chip: float = Field(ge=0)
    # training processes the launch must find: auto = one per host (xla, xla_spmd, eager) or one per device
    # (distributed); an explicit number is checked against that
    processes: Literal["auto"] | Annotated[int, Field(ge=1)] = "auto"
    mesh: MeshConfig

    @property
    def spec(self) -> ExecutionSpec:
        """What the execution can do (catalog/executions.py): read its capabilities, never compare its name."""
        return execution(self.execution)

    @property
    def replicas(self) -> int:
        """Data-parallel replicas: devices the global batch is split over (1 unless the execution is multi-device)."""
        return self.mesh.dp * self.mesh.fsdp if self.spec.multi_device else 1

    @property
    def expected_processes(self) -> int:
        """Training processes of the whole run: one per device under torchrun, one per host otherwise."""
        return self.chips if self.spec.process_per == "device" else self.hosts

    @property
    def torchtpu(self) -> bool:
        """TPU chips driven by TorchTPU (plain PyTorch under torchrun, `torch.device("tpu")`) instead of torch_xla."""
        return self.spec.torchrun and self.accelerator.startswith("tpu")


class DistributedConfig(_Strict):
    """The `distributed` execution (tpu_topology.execution=distributed): torchrun, torch.distributed, torch.compile."""

    # torch.compile backend of the denoising step and the training micro-step: auto = inductor on CPU and CUDA,
    # tpu on TorchTPU; aot_eager (dynamo + AOTAutograd, no codegen); none (eager)
    compile: Literal["auto", "inductor", "tpu", "aot_eager", "none"] = "auto"
    # seconds a collective may wait for the other ranks before it fails the job (a dead or hung rank): bounded, so a
    # lost rank never hangs the others; the first epoch's compile happens between collectives, so keep it generous
    timeout_s: float = Field(default=900, ge=10, le=86400)
    # seconds a rank may be stopped (SIGSTOP), silent (its heartbeat thread not beating: a frozen process) or stuck
    # in a wait with no progress (a reward call, a checkpoint write: ddpo_tpu/waits.py; a reward's own timeouts may
    # allow it longer) before its node's launcher ends the job naming it and the wait (proc/rankwatch.py)
    hang_timeout_s: float = Field(default=60, ge=3, le=86400)
    # torch.compile's caches (inductor's FX graphs and kernels, AOTAutograd's graphs), kept across restarts as the
    # XLA runtime keeps its compilation cache: auto = ~/.cache/ddpo_tpu/torch_compile, a path, or null (torch's own
    # default, /tmp/torchinductor_$USER, which a reboot or a tmp cleaner empties)
    compile_cache_dir: str | None = "auto"
    # torchrun's c10d rendezvous: null = this host on a free port (one node); HOST:PORT = the rendezvous of several
    # nodes (the first node's address; every node runs the same command), or a fixed port on one node
    rdzv_endpoint: str | None = None
    # this node's rank among tpu_topology.hosts nodes: auto = the TPU VM worker id (TPU_WORKER_ID) or 0
    node_rank: Literal["auto"] | Annotated[int, Field(ge=0)] = "auto"
    # where an epoch's trajectories live between sampling and training. false: every rank gathers the whole epoch
    # (all steps' latents and the conditioning) and trains its rows of the one shuffle one process would draw: the
    # run trains what one process trains, exactly. true: each rank keeps the samples it drew and trains them in its
    # own shuffle, as ddpo-pytorch and flow_grpo do; only the rewards are gathered, so the advantages are the whole
    # epoch's as before. Each rank then holds 1/ranks of the epoch (docs/distributed.md "Where an epoch's samples
    # live"); an algorithm that trains the whole epoch itself (nft, awm) needs false
    keep_samples_on_rank: bool = False


class ParityConfig(_Strict):
    name: str
    samples_per_epoch: int | None = Field(default=None, ge=1)
    total_train_batch: int | None = Field(default=None, ge=1)
    pinned: dict[str, Any]


class XlaConfig(_Strict):
    step_compiler: Literal["dynamo", "lazy"]
    sync_every_n_denoising_steps: int = Field(ge=0, le=1000)
    sync_every_n_sampling_batches: int = Field(ge=1)
    sync_before_reward_gather: bool
    gather: Literal["device", "host"]
    debug_level: int = Field(ge=0, le=2)
    flags: list[str]
    libtpu_init_args: list[str]
    compilation_cache_dir: str | None
    profile_steps: list[int]


class LoggerConfig(_Strict):
    name: Literal["none", "wandb", "tensorboard"]
    mode: Literal["online", "offline", "disabled"]
    project: str = Field(min_length=1, max_length=128)
    entity: str | None = Field(min_length=1)
    group: str | None = Field(min_length=1, max_length=128)
    tags: list[Annotated[str, Field(min_length=1, max_length=64)]]  # wandb's own limit is 64 characters a tag
    notes: str | None
    tensorboard: bool = False  # also write TensorBoard event files (logger=tensorboard does; with wandb: both)


class RunConfig(_Strict):
    """The whole composed config (hydra's own section removed)."""

    run_name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.\-]+$")
    output_root: str
    # gs:// output roots: how long a request waits out an unreachable bucket before the run stops
    # (ddpo_tpu/rundir/storage.py)
    storage_timeout_s: float = Field(default=DEFAULT_TIMEOUT_S, gt=0)
    seed: int = Field(ge=0, lt=2**31)
    num_epochs: int = Field(ge=1)
    save_freq: int = Field(ge=1)
    checkpoint_limit: int = Field(ge=1)
    resume: str
    force_resume: bool
    on_nonfinite_reward: Literal["stop", "skip"]
    lock_accelerator: Literal["auto"] | bool
    sample: SampleConfig
    train: TrainConfig
    algorithm: AlgorithmConfig
    stat_tracking: StatTrackingConfig
    evaluation: EvaluationConfig
    model: ModelConfig
    reward: RewardConfig
    prompts: PromptsConfig
    tpu_topology: TopologyConfig
    parity: ParityConfig
    xla: XlaConfig
    logger: LoggerConfig
    distributed: DistributedConfig = DistributedConfig()
