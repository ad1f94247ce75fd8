"""What a run needs from this machine, checked by the front end before a run dir exists (no torch import, well under
a second): the devices its processes will use (NVIDIA GPUs for CUDA topologies, libtpu or TorchTPU for TPU ones), a
free rendezvous port, a hub model that must come from the local Hugging Face cache, the tracker's names and
credentials. One line each, naming the key and what to change; a key the command line did not set is named with where
it came from (an experiment), so the fix says what to type instead.

Not checked at compose time: --cfg, the tests and the pod launcher (ddpo-pod) compose TPU and GPU configs on machines
without either."""

from __future__ import annotations

import glob
import importlib.util
import socket
from pathlib import Path

from ddpo_tpu import env as envmod

LOCAL_HOSTS = {"localhost", "127.0.0.1", "::1", "[::1]"}


def nvidia_gpus() -> int:
    """NVIDIA GPUs this process may use: the driver's list, narrowed by CUDA_VISIBLE_DEVICES."""
    found = len(glob.glob("/proc/driver/nvidia/gpus/*"))
    visible = envmod.cuda_visible_devices()
    return found if visible is None else min(found, len(visible))


def tpu_chips() -> int:
    """TPU chips attached to this VM (v4/v5p expose /dev/accel*, v5e/v6e /dev/vfio/<n>)."""
    return len(glob.glob("/dev/accel[0-9]*")) + len(glob.glob("/dev/vfio/[0-9]*"))


def _port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host.strip("[]"), port))
        except OSError:
            return True
    return False


def _devices_problems(topo, found: int, what: str, why: str, fix: str) -> list[str]:
    """None of the devices a topology's processes need, or fewer than its processes per node."""
    if found == 0:
        return [f"tpu_topology={topo.name}: no {what} is visible on this machine ({why}) ({fix})"]
    if topo.chips_per_host > found:
        return [f"tpu_topology.chips_per_host={topo.chips_per_host}: {topo.chips_per_host} processes per node but "
                f"this node has {found} {what}(s) (set tpu_topology.chips_per_host={found} with tpu_topology.chips "
                f"and tpu_topology.mesh to match, or choose the tpu_topology of this machine)"]
    return []


def problems(cfg, overrides: list[str] = ()) -> list[str]:
    """Everything this machine lacks for the run, one line each ([] when it has all). `overrides` are the command
    line's, to say where a key the user did not type came from."""
    return (device_problems(cfg) + rendezvous_problems(cfg) + hub_cache_problems(cfg, overrides)
            + reward_model_problems(cfg, overrides) + tracker_problems(cfg, overrides) + video_problems(cfg))


def video_problems(cfg) -> list[str]:
    """A video model's samples are written as mp4 through PyAV (rundir/video.py): its package, with FFmpeg's
    libraries in its wheel, must be here, else the run would stop at its first epoch's outputs."""
    from ddpo_tpu.catalog import family

    if family(cfg.model.family).output != "videos" or importlib.util.find_spec("av") is not None:
        return []
    return [f"model.family={cfg.model.family}: its sample videos are written as mp4 with PyAV, which is not installed "
            f"here (pip install av==18.1.0, the pin of requirements.txt)"]


def device_problems(cfg) -> list[str]:
    """The accelerator and its runtime: what says whether this machine is the run's target at all (`--check` on a
    laptop previews a GPU or TPU run and leaves the machine's checks to the target, ddpo_tpu/train.py)."""
    return cuda_problems(cfg) + distributed_device_problems(cfg) + tpu_runtime_problems(cfg)


def target_checks(cfg) -> list[str]:
    """What problems() checks on the machine that runs `cfg`, in words: the preview of --check on another machine."""
    from ddpo_tpu.catalog.rewards import TINY

    topo, m, d = cfg.tpu_topology, cfg.model, cfg.distributed
    if topo.accelerator == "cuda":
        out = [f"{topo.chips_per_host} NVIDIA GPU(s) visible to each of its {topo.hosts} node(s) (the driver, "
               f"CUDA_VISIBLE_DEVICES)"]
    elif topo.torchtpu:
        out = [f"TorchTPU and libtpu installed (bash scripts/setup.sh --torchtpu) and {topo.chips_per_host} "
               f"TPU chip(s) on each of its {topo.hosts} node(s)"]
    elif topo.accelerator.startswith("tpu"):
        out = [f"the TPU runtime, libtpu (pip install \"torch_xla[tpu]==2.9.0\"), on each of its {topo.hosts} host(s)"]
    else:
        out = []
    if topo.spec.torchrun and d.rdzv_endpoint is not None:
        out.append(f"the rendezvous port of distributed.rdzv_endpoint={d.rdzv_endpoint} free on the first node")
    if m.pretrained is not None and m.local_files_only and is_hub_id(m.pretrained):
        out.append(f"model.pretrained={m.pretrained} in its local Hugging Face cache ({download_command(m)})")
    for _, reward in model_entries(cfg):
        for name in REWARD_MODEL_KEYS:
            value = getattr(reward, name, None)
            if isinstance(value, str) and value != TINY:
                out.append(f"the {reward.name} reward's {name} {value} there (a directory, or in the Hugging Face "
                           f"cache: hf download {value})")
    if cfg.logger.name == "wandb" and cfg.logger.mode == "online":
        out.append("wandb credentials (WANDB_API_KEY or `wandb login`)")
    out.append("the accelerator free (no other run holding its lock), the run dir not held by another run")
    return out


def origin(key: str, overrides: list[str]) -> str:
    """Where a key the user did not type came from: ' (set by GROUP=OPTION)' for a group chosen on the command line,
    ' (set by +experiment=NAME)', or ' (the default)'."""
    from ddpo_tpu.config.compose import overridden_keys

    if key in overridden_keys(overrides):
        return ""
    # a group chosen on the command line (model=sd14 for model.pretrained) beats an experiment's choice of it
    group = next((o.lstrip("+") for o in reversed(overrides)
                  if "=" in o and key.startswith(o.lstrip("+~").split("=", 1)[0] + ".")), None)
    if group is not None:
        return f" (set by {group})"
    experiment = next((o.split("=", 1)[1] for o in overrides if o.lstrip("+").startswith("experiment=")), None)
    return f" (set by +experiment={experiment})" if experiment else " (the default)"


def cuda_problems(cfg) -> list[str]:
    """A CUDA topology on one device (tpu_topology=cuda, eager) needs a visible GPU; the distributed ones are
    checked with their processes per node (distributed_device_problems)."""
    topo = cfg.tpu_topology
    if topo.accelerator != "cuda" or topo.spec.torchrun:
        return []
    return _devices_problems(topo, nvidia_gpus(), "NVIDIA GPU", "no driver, or CUDA_VISIBLE_DEVICES hides them",
                             "run on a GPU machine, or tpu_topology=eager_cpu here")


def tpu_runtime_problems(cfg) -> list[str]:
    """A TPU topology on torch_xla needs libtpu (TorchTPU's own check is in distributed_device_problems)."""
    topo = cfg.tpu_topology
    if topo.torchtpu or not topo.accelerator.startswith("tpu") or importlib.util.find_spec("libtpu") is not None:
        return []
    return [f"tpu_topology={topo.name}: accelerator {topo.accelerator} needs the TPU runtime (libtpu), which is not "
            f"installed here (on a TPU VM: pip install \"torch_xla[tpu]==2.9.0\"; elsewhere choose tpu_topology=cpu "
            f"or tpu_topology=eager_cpu)"]


def distributed_device_problems(cfg) -> list[str]:
    topo = cfg.tpu_topology
    if not topo.spec.torchrun:
        return []
    out = []
    if topo.accelerator == "cuda":
        out += _devices_problems(topo, nvidia_gpus(), "NVIDIA GPU", "no driver, or CUDA_VISIBLE_DEVICES hides them",
                                 "run on a GPU machine, or tpu_topology=cpu_dist2 here")
    elif topo.torchtpu:
        if importlib.util.find_spec("torch_tpu") is None or importlib.util.find_spec("libtpu") is None:
            out.append(f"tpu_topology.execution=distributed: tpu_topology={topo.name} then runs on TorchTPU, which is "
                       f"not installed in this environment (bash scripts/setup.sh --torchtpu builds .venv-torchtpu; "
                       f"or set tpu_topology.execution=xla_spmd for torch_xla)")
        else:
            out += _devices_problems(topo, tpu_chips(), "TPU chip", "TorchTPU is installed",
                                     "run on a TPU VM; here use tpu_topology=cpu_dist2")
    return out


def rendezvous_problems(cfg) -> list[str]:
    """torchrun's rendezvous port on this host (the first node's), free before the run starts."""
    topo, d = cfg.tpu_topology, cfg.distributed
    out = []
    if topo.spec.torchrun and d.rdzv_endpoint is not None:
        host, _, port = d.rdzv_endpoint.rpartition(":")
        local = host in LOCAL_HOSTS or host == socket.gethostname()
        if local and envmod.node_rank(cfg) == 0 and _port_in_use(host, int(port)):
            out.append(f"distributed.rdzv_endpoint={d.rdzv_endpoint}: port {port} is in use on this host (another "
                       f"run or service) (choose a free port, or distributed.rdzv_endpoint=null on one node: torchrun "
                       f"then picks one)")
    return out


# --- the local Hugging Face cache ------------------------------------------------------------------------------------

def is_hub_id(pretrained: str) -> bool:
    """A hub repo id (org/name), not a local path: what from_pretrained looks up in the hub cache."""
    if Path(pretrained).expanduser().exists() or pretrained.startswith(("/", ".", "~")):
        return False
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(pretrained)
    except HFValidationError:
        return False
    return True


# the weights diffusers loads from a repo that also holds others: safetensors (not .bin), full precision (not the fp16
# or non-EMA variants), no single-file checkpoints at the root
DOWNLOAD_EXCLUDES = ("*.bin", "*fp16*", "*non_ema*", "*.ckpt")


def model_folders(model) -> tuple[str, ...]:
    """The subfolders of a diffusers checkpoint the model's loader reads (SD 3 with T5: its encoder too)."""
    from ddpo_tpu.catalog import family

    t5 = ("text_encoder_3", "tokenizer_3") if getattr(model, "text_encoder_3", False) else ()
    return tuple(family(model.family).subfolders) + t5


def download_command(model, local_dir: str | None = None) -> str:
    """The `hf download` that fetches what the model's loader reads (model_index.json and its subfolders), no more."""
    parts = ["hf download", model.pretrained, "--include model_index.json"]
    parts += [f"--include '{s}/*'" for s in model_folders(model)]
    parts += [f"--exclude '{x}'" for x in DOWNLOAD_EXCLUDES]
    if model.revision:
        parts.append(f"--revision {model.revision}")
    if local_dir:
        parts.append(f"--local-dir {local_dir}")
    return " ".join(parts)


def hub_cache_problems(cfg, overrides: list[str] = ()) -> list[str]:
    """model.local_files_only=true with a hub id: the local Hugging Face cache must hold it (model_index.json and the
    family's subfolders), or the training process fails after the run dir is written. Looked up in the cache's layout
    (huggingface_hub's try_to_load_from_cache), never on the network."""
    m = cfg.model
    if m.pretrained is None or not m.local_files_only or not is_hub_id(m.pretrained):
        return []
    from huggingface_hub import constants, try_to_load_from_cache

    found = try_to_load_from_cache(m.pretrained, "model_index.json", revision=m.revision)
    missing = ["model_index.json"]
    if isinstance(found, str):
        snapshot = Path(found).parent
        missing = [f"{s}/" for s in model_folders(m) if not (snapshot / s).is_dir()]
    if not missing:
        return []
    rev = f" (model.revision={m.revision})" if m.revision else ""
    where = origin("model.pretrained", overrides)
    return [f"model.pretrained={m.pretrained}{where}: model.local_files_only=true and the local Hugging Face cache "
            f"({constants.HF_HUB_CACHE}) lacks {', '.join(missing)}{rev} (download it once: "
            f"`{download_command(m)}`; or point model.pretrained=DIR at a local "
            f"copy; or set model.local_files_only=false to download at start)"]


# the files of a reward's models its loader reads first (transformers' from_pretrained, local_files_only=True: rewards
# never download, rewards/pickscore.py, aesthetic.py, clip_score.py)
REWARD_MODEL_KEYS = {"clip_model": "config.json", "processor": "preprocessor_config.json"}


def model_entries(cfg) -> list[tuple[str, object]]:
    """Every reward-registry entry whose models the run loads, with its dotted key: the run's reward (each
    reward=weighted component), and GRPO's GARDO entries, its gate's auxiliary rewards (algorithm.kl_gate_rewards) and
    its diversity feature model (algorithm.diversity_features), built by the training process as the reward is."""
    r, a = cfg.reward, cfg.algorithm
    out = [(f"reward.components.{i}", c) for i, c in enumerate(r.components)] if r.name == "weighted" \
        else [("reward", r)]
    out += [(f"algorithm.kl_gate_rewards.{i}", e) for i, e in enumerate(getattr(a, "kl_gate_rewards", None) or ())]
    if getattr(a, "diversity_features", None) is not None:
        out.append(("algorithm.diversity_features", a.diversity_features))
    return out


def reward_model_problems(cfg, overrides: list[str] = ()) -> list[str]:
    """The CLIP models of the run's reward (and of each reward=weighted component, and GARDO's gate rewards and
    feature model: model_entries): a local directory, or a hub id in the local Hugging Face cache, since each loads
    them with local_files_only (else the run stops when it is built, after the run dir is written). `tiny` is built
    locally."""
    from ddpo_tpu.catalog.rewards import TINY

    out = []
    for prefix, reward in model_entries(cfg):
        for name, first_file in REWARD_MODEL_KEYS.items():
            value = getattr(reward, name, None)
            if not isinstance(value, str) or value == TINY:
                continue
            key = f"{prefix}.{name}"
            if not is_hub_id(value):
                if not Path(value).expanduser().is_dir():
                    out.append(f"{key}={value}{origin(key, overrides)}: no such directory (point it at a local copy "
                               f"of the model, or give its hub id)")
                continue
            from huggingface_hub import constants, try_to_load_from_cache

            if not isinstance(try_to_load_from_cache(value, first_file), str):
                out.append(f"{key}={value}{origin(key, overrides)}: the {reward.name} reward loads it with "
                           f"local_files_only and the local Hugging Face cache ({constants.HF_HUB_CACHE}) lacks its "
                           f"{first_file} (download it once: `hf download {value}`; or point {key}=DIR at a local "
                           f"copy)")
    return out


# --- trackers --------------------------------------------------------------------------------------------------------

# what wandb.init refuses in a project name (wandb/sdk/wandb_settings.py, validate_project, wandb 0.31; its limit of
# 128 characters is the schema's)
WANDB_PROJECT_FORBIDDEN = "/\\#?%:"


def tracker_problems(cfg, overrides: list[str] = ()) -> list[str]:
    """Names the tracker would refuse in the training process (a traceback after the run dir exists), and wandb's
    credentials for an online run. TensorBoard takes no names; logger.group and logger.tags' lengths are schema
    rules."""
    logger = cfg.logger
    if logger.name != "wandb" or logger.mode == "disabled":
        return []
    out = []
    bad = sorted({c for c in logger.project if c in WANDB_PROJECT_FORBIDDEN})
    if bad:
        why = f"contains {' '.join(bad)}, which wandb refuses in a project name"
        owner, _, name = logger.project.partition("/")
        if bad == ["/"] and owner and name and "/" not in name and logger.entity is None:  # wandb's entity/project
            fix = f"set logger.entity={owner} logger.project={name}"
        else:
            fix = (f"set logger.project={''.join('-' if c in WANDB_PROJECT_FORBIDDEN else c for c in logger.project)}"
                   f"; a team or user goes in logger.entity")
        out.append(f"logger.project={logger.project}{origin('logger.project', overrides)}: {why} ({fix})")
    if logger.mode == "online" and envmod.wandb_credentials() is None:
        out.append("logger.mode=online: wandb has no API key (WANDB_API_KEY is unset and ~/.netrc has no "
                   "api.wandb.ai entry) (run `wandb login` or export WANDB_API_KEY=...; or set "
                   "logger.mode=offline and `wandb sync` later)")
    return out
