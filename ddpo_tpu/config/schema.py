"""The typed schema of every config group. Unknown keys and wrong types are rejected with their dotted key.

Only pydantic and the standard library are imported here: validation runs before torch is imported.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    # strict: "4" is not an int and 1.5 is not an int; ints are accepted where floats are expected.
    # no inf/nan: Hydra parses `inf` and `nan` as floats, and no key of a run means either
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)


class LoraConfig(_Strict):
    enabled: bool
    rank: int = Field(gt=0)
    alpha: float = Field(gt=0)
    target_modules: list[str] = Field(min_length=1)


class ModelConfig(_Strict):
    name: str
    family: Literal["sd1", "sd3"]    # ddpo_tpu/families: SD 1.x (UNet, DDIM) or SD 3 (MMDiT, flow matching)
    builder: Literal["tiny", "sd14_topology", "sd14_random", "tiny_sd3", "digits"] | None
    pretrained: str | None
    revision: str | None
    local_files_only: bool
    cache_dir: str
    dtype: Literal["float32", "bfloat16"]
    text_encoder_3: bool = False     # SD 3: load the T5 encoder too (false: zeros in its place, as SD 3 allows)
    resolution: int | None = Field(default=None, ge=8, le=4096)  # image size in pixels (null: the model's own)
    lora: LoraConfig


# --- rewards ----------------------------------------------------------------------------------------------------------
# One model per reward with that reward's own keys; `name` picks the model (a discriminated union), so a key of another
# reward, a wrong type or an unknown name is refused at compose time with its dotted key. Each reward's keys are also
# those of a component of reward=weighted, which adds `weight` (and has no `host_workers`: the run's reward has them).
# The keys are the reward constructor's keyword arguments (ddpo_tpu/rewards; a test keeps them equal).

TINY = "tiny"  # clip_model / mlp_path / processor: the tiny local stand-in (rewards/from_config.py builds it)


class _JpegKeys(_Strict):
    quality: int = Field(default=95, ge=1, le=100)  # JPEG quality the size is measured at (the reference's 95)


class JpegCompressibilityKeys(_JpegKeys):
    name: Literal["jpeg_compressibility"]


class JpegIncompressibilityKeys(_JpegKeys):
    name: Literal["jpeg_incompressibility"]


class AestheticKeys(_Strict):
    name: Literal["aesthetic"]
    clip_model: str = Field(default="openai/clip-vit-large-patch14", min_length=1)  # hub id, local dir or `tiny`
    mlp_path: str | None = None                        # LAION MLP weights (.pth/.safetensors) or `tiny`; required
    batch_size: int | None = Field(default=None, ge=1)  # images per forward pass (null: the whole batch)


class ClipScoreKeys(_Strict):
    name: Literal["clip_score"]
    clip_model: str = Field(default="openai/clip-vit-large-patch14", min_length=1)  # hub id, local dir or `tiny`


class PickScoreKeys(_Strict):
    name: Literal["pickscore"]
    clip_model: str = Field(default="yuvalkirstain/PickScore_v1", min_length=1)  # CLIPModel: hub id, dir or `tiny`
    processor: str = Field(default="laion/CLIP-ViT-H-14-laion2B-s32B-b79K", min_length=1)  # CLIPProcessor or `tiny`
    batch_size: int | None = Field(default=None, ge=1)


class RemoteKeys(_Strict):
    name: Literal["remote"]
    url: str                                           # http(s)://HOST:PORT/PATH (rules.py checks the form)
    timeout_s: float = Field(default=30.0, gt=0)
    retries: int = Field(default=3, ge=0, le=20)
    backoff_s: float = Field(default=0.5, ge=0)
    batch_size: int = Field(default=16, ge=1)
    image_format: Literal["png", "raw"] = "png"
    headers: dict[str, str] | None = None


class DigitClassifierKeys(_Strict):
    name: Literal["digit_classifier"]
    target: int | None = Field(default=7, ge=0, le=9)  # P(this digit); null: P(the digit the prompt names)
    cache_dir: str = Field(default="~/.cache/ddpo_tpu/models", min_length=1)  # where its classifier is built once


class _RunReward(_Strict):
    host_workers: int = Field(ge=0, le=64)  # threads scoring a batch while the next one samples (0: inline)


class _Component(_Strict):
    weight: float = 1.0


class JpegCompressibilityConfig(_RunReward, JpegCompressibilityKeys): ...
class JpegIncompressibilityConfig(_RunReward, JpegIncompressibilityKeys): ...
class AestheticConfig(_RunReward, AestheticKeys): ...
class ClipScoreConfig(_RunReward, ClipScoreKeys): ...
class PickScoreConfig(_RunReward, PickScoreKeys): ...
class RemoteConfig(_RunReward, RemoteKeys): ...
class DigitClassifierConfig(_RunReward, DigitClassifierKeys): ...


class JpegCompressibilityComponent(_Component, JpegCompressibilityKeys): ...
class JpegIncompressibilityComponent(_Component, JpegIncompressibilityKeys): ...
class AestheticComponent(_Component, AestheticKeys): ...
class ClipScoreComponent(_Component, ClipScoreKeys): ...
class PickScoreComponent(_Component, PickScoreKeys): ...
class RemoteComponent(_Component, RemoteKeys): ...
class DigitClassifierComponent(_Component, DigitClassifierKeys): ...


# a component of reward=weighted: any reward but `weighted` itself (a weighted sum of weighted sums is one weighted sum)
RewardComponent = Annotated[
    JpegCompressibilityComponent | JpegIncompressibilityComponent | AestheticComponent | ClipScoreComponent
    | PickScoreComponent | RemoteComponent | DigitClassifierComponent,
    Field(discriminator="name"),
]


class WeightedConfig(_RunReward):
    name: Literal["weighted"]
    components: list[RewardComponent] = Field(min_length=1)


RewardConfig = Annotated[
    JpegCompressibilityConfig | JpegIncompressibilityConfig | AestheticConfig | ClipScoreConfig | PickScoreConfig
    | RemoteConfig | WeightedConfig | DigitClassifierConfig,
    Field(discriminator="name"),
]


class SampleConfig(_Strict):
    name: Literal["ddim", "flow_sde"]  # the sampler: DDIM (SD 1.x) or Flow-GRPO's SDE (SD 3)
    num_steps: int = Field(ge=1, le=1000)
    eta: float | None = Field(default=None, gt=0, le=1)              # ddim
    noise_level: float | None = Field(default=None, gt=0, le=1)      # flow_sde
    sde_type: Literal["sde", "cps"] | None = None                    # flow_sde
    guidance_scale: float = Field(ge=1)
    batch_size: int = Field(ge=1)
    num_batches_per_epoch: int = Field(ge=1)


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


class AlgorithmConfig(_Strict):
    name: Literal["ddpo", "grpo"]
    group_size: int | None = Field(default=None, ge=2)   # grpo: samples per prompt in an epoch
    kl_beta: float = Field(default=0.0, ge=0)             # grpo: weight of the KL penalty to the reference policy
    global_std: bool = False                              # grpo: divide by the std of the whole epoch, not the group
    drop_zero_advantage: bool = True                      # grpo: train only samples with advantage (flow_grpo's mask)


class StatTrackingConfig(_Strict):
    per_prompt: bool
    buffer_size: int = Field(ge=1)
    min_count: int = Field(ge=1)


class EvaluationConfig(_Strict):
    every_n_epochs: int = Field(ge=0)
    seed: int = Field(ge=0, lt=2**31)
    prompts: list[str] = Field(min_length=1)
    num_steps: int | None = Field(default=None, ge=1, le=1000)  # denoising steps (null: sample.num_steps)
    deterministic: bool = False      # the sampler's noise-free step (DDIM eta 0, the flow ODE) instead of its own


class PromptsConfig(_Strict):
    name: Literal["imagenet_animals", "simple_animals", "nouns_activities", "from_file"]
    file: str | None
    nouns_file: str | None
    activities_file: str | None


class MeshConfig(_Strict):
    dp: int = Field(ge=1)
    fsdp: int = Field(ge=1)
    layout: Literal["auto", "host_local"]


# how a topology's devices are driven: eager (plain torch, one device), xla (torch_xla, one device), xla_spmd
# (torch_xla, one program per host sharded over a mesh), distributed (plain torch, one process per device under
# torchrun, DDP or FSDP2 over a DeviceMesh; TorchTPU on TPU accelerators)
EXECUTIONS = ("eager", "xla", "xla_spmd", "distributed")
MULTI_DEVICE = ("xla_spmd", "distributed")  # the executions that split the global batch over dp x fsdp devices


class TopologyConfig(_Strict):
    name: str
    accelerator: Literal["cpu", "cuda", "tpu_v4", "tpu_v5e", "tpu_v6e"]
    execution: Literal["eager", "xla", "xla_spmd", "distributed"]
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
    def replicas(self) -> int:
        """Data-parallel replicas: devices the global batch is split over (1 unless SPMD or distributed)."""
        return self.mesh.dp * self.mesh.fsdp if self.execution in MULTI_DEVICE else 1

    @property
    def expected_processes(self) -> int:
        """Training processes of the whole run: one per device under `distributed`, one per host otherwise."""
        return self.chips if self.execution == "distributed" else self.hosts

    @property
    def torchtpu(self) -> bool:
        """TPU chips driven by TorchTPU (plain PyTorch, `torch.device("tpu")`) instead of torch_xla."""
        return self.execution == "distributed" and self.accelerator.startswith("tpu")


class DistributedConfig(_Strict):
    """The `distributed` execution (tpu_topology.execution=distributed): torchrun, torch.distributed, torch.compile."""

    # torch.compile backend of the denoising step and the training micro-step: auto = inductor on CPU and CUDA,
    # tpu on TorchTPU; aot_eager (dynamo + AOTAutograd, no codegen); none (eager)
    compile: Literal["auto", "inductor", "tpu", "aot_eager", "none"] = "auto"
    # seconds a collective may wait for the other ranks before it fails the job (a dead or hung rank): bounded, so a
    # lost rank never hangs the others; the first epoch's compile happens between collectives, so keep it generous
    timeout_s: float = Field(default=900, ge=10, le=86400)
    # torchrun's c10d rendezvous: null = this host on a free port (one node); HOST:PORT = the rendezvous of several
    # nodes (the first node's address; every node runs the same command), or a fixed port on one node
    rdzv_endpoint: str | None = None
    # this node's rank among tpu_topology.hosts nodes: auto = the TPU VM worker id (TPU_WORKER_ID) or 0
    node_rank: Literal["auto"] | Annotated[int, Field(ge=0)] = "auto"


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
    shuffle_timesteps: bool
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
