"""The one module that reads or writes environment variables.

The launcher (parent process) composes the config, then builds the training process's environment from it here:
torch_xla reads PJRT_DEVICE, XLA_FLAGS, LIBTPU_INIT_ARGS, CPU_NUM_DEVICES, ... once, at import, so they must be final
before the child starts. Variables the config now owns are refused when found in the caller's environment, each with
the key to set instead, so a forgotten `export` can never silently change a run.

It also reads the one other setting a process inherits with its environment, the umask (`current_umask`), for the
writers that set a file's mode as a plain create would (rundir/files.py, proc/build_cache.py).
"""

from __future__ import annotations

import netrc
import os
import re
import urllib.parse
from pathlib import Path
from typing import Any, Mapping

# a validated ddpo_tpu.config.schema.RunConfig: not imported, so this module stands on the bottom floor (storage_url
# and storage_faults read the cache root and the emulator host from it)
RunConfig = Any

# legacy or owned variable -> the config key that replaces it
OWNED_VARIABLES: dict[str, str] = {
    "DDPO_TPU_SYNC_EVERY_STEP": "xla.sync_every_n_denoising_steps",
    "DDPO_TPU_SYNC_EVERY_BATCH": "xla.sync_every_n_sampling_batches",
    "DDPO_TPU_USE_ACCELERATE_GATHER": "xla.gather (device or host)",
    "DDPO_TPU_SHUFFLE_TIMESTEPS": "algorithm.shuffle_timesteps",
    "XLA_USE_BF16": "train.mixed_precision=bf16 (and model.dtype)",
    "XLA_DOWNCAST_BF16": "train.mixed_precision=bf16 (and model.dtype)",
    "PT_XLA_DEBUG": "xla.debug_level",
    "PT_XLA_DEBUG_LEVEL": "xla.debug_level",
    "XLA_IR_DEBUG": "xla.debug_level=2",
    "XLA_HLO_DEBUG": "xla.debug_level=2",
    "PJRT_DEVICE": "tpu_topology (e.g. tpu_topology=cpu, tpu_topology=v6e-8)",
    "CPU_NUM_DEVICES": "tpu_topology (e.g. tpu_topology=cpu_spmd4)",
    "XLA_USE_SPMD": "tpu_topology.execution=xla_spmd",
    "XLA_FLAGS": 'xla.flags (a list, quoted for the shell: \'xla.flags=["--xla_foo=1"]\')',
    "LIBTPU_INIT_ARGS": 'xla.libtpu_init_args (a list, quoted for the shell: \'xla.libtpu_init_args=["--flag=1"]\')',
    "XLA_PERSISTENT_CACHE_PATH": "xla.compilation_cache_dir",
    # TorchTPU reads these at `import torch`; the launcher sets what a run needs (tpu_topology, execution=distributed)
    "TORCH_TPU_TOPOLOGY": "tpu_topology (e.g. tpu_topology=v6e-8 tpu_topology.execution=distributed)",
    "TORCH_TPU_DEVICES_PER_HOST": "tpu_topology.chips_per_host",
    "TORCH_TPU_TIER2_COMPILATION_CACHE": "xla.compilation_cache_dir (TorchTPU's compile cache too)",
    "TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT": "xla.compilation_cache_dir (TorchTPU's compile cache too)",
    "TORCH_DEVICE_BACKEND_AUTOLOAD": "tpu_topology.execution (TorchTPU is loaded for TPU topologies with "
                                     "execution=distributed, and kept out of every other run)",
    # torchrun's own: the front end starts torchrun with the values of the config
    "PET_NPROC_PER_NODE": "tpu_topology.chips_per_host",
    "PET_NNODES": "tpu_topology.hosts",
    "PET_NODE_RANK": "distributed.node_rank",
    "PET_RDZV_ENDPOINT": "distributed.rdzv_endpoint",
    "TORCHINDUCTOR_CACHE_DIR": "distributed.compile_cache_dir",
}

# a run's own marker: the training process finds its run dir here (set by the launcher only)
RUN_DIR_VARIABLE = "DDPO_TPU_RUN_DIR"
# the descriptor of the run dir's lock, handed over by the front end that took it (proc/lock.py: adopt)
RUN_DIR_LOCK_FD_VARIABLE = "DDPO_TPU_RUN_DIR_LOCK_FD"
# the config file of this node in the run dir (config.yaml; config-node<N>.yaml for the other nodes of a multi-node
# distributed run, which share the run dir: see node_suffix)
CONFIG_FILE_VARIABLE = "DDPO_TPU_CONFIG_FILE"

_SECRET = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|CREDENTIAL", re.I)


def legacy_problems(environ: Mapping[str, str] | None = None) -> list[str]:
    """One line per owned variable set in the caller's environment."""
    environ = os.environ if environ is None else environ
    return [f"environment variable {name}={environ[name]!r} is not read by ddpo_tpu: set the config key {key} "
            f"instead (and unset {name})" for name, key in OWNED_VARIABLES.items() if name in environ]


def full_error_requested() -> bool:
    return os.environ.get("HYDRA_FULL_ERROR", "") == "1"


def wandb_credentials(environ: Mapping[str, str] | None = None) -> str | None:
    """Where wandb would find credentials, or None: WANDB_API_KEY, WANDB_IDENTITY_TOKEN_FILE, or a netrc entry for the
    wandb host (what `wandb login` writes), looked up the way wandb does, so an online run without one is refused
    before anything starts."""
    environ = os.environ if environ is None else environ
    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE"):
        if environ.get(name, "").strip():
            return name
    host = urllib.parse.urlsplit(environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").netloc
    home = Path(environ["HOME"]) if environ.get("HOME") else Path("~").expanduser()
    if environ.get("NETRC"):
        path = Path(environ["NETRC"]).expanduser()
    else:
        path = next((p for p in (home / ".netrc", home / "_netrc") if p.exists()), home / ".netrc")
    try:
        entry = netrc.netrc(path).authenticators(host)
    except (OSError, netrc.NetrcParseError):
        return None
    return str(path) if entry and entry[2] else None


def cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "ddpo_tpu"


# gcsfs (and google-cloud-storage) send requests to this GCS-compatible server instead of storage.googleapis.com
# (tests run fake-gcs-server on 127.0.0.1). The training process inherits it with the rest of the environment.
STORAGE_EMULATOR_VARIABLE = "STORAGE_EMULATOR_HOST"


def storage_emulator_host(environ: Mapping[str, str] | None = None) -> str | None:
    """The GCS emulator the bucket client talks to, or None for Google Cloud Storage itself (whose credentials then
    follow Google's usual chain: GOOGLE_APPLICATION_CREDENTIALS, gcloud's application-default login, the VM's
    service account)."""
    environ = os.environ if environ is None else environ
    value = environ.get(STORAGE_EMULATOR_VARIABLE, "").strip()
    return value if value and value != "default" else None


def compilation_cache_dir(cfg: RunConfig) -> str | None:
    """The persistent XLA compilation cache: auto = on for TPU topologies."""
    value = cfg.xla.compilation_cache_dir
    if value == "auto":
        return str(cache_root() / "xla_cache") if cfg.tpu_topology.accelerator.startswith("tpu") else None
    return None if value is None else str(Path(value).expanduser())


def torch_compile_cache_dir(cfg: RunConfig) -> str | None:
    """Where torch.compile keeps its caches across restarts (distributed.compile_cache_dir; auto = under the cache
    root), or None for torch's own default."""
    value = cfg.distributed.compile_cache_dir
    if value == "auto":
        return str(cache_root() / "torch_compile")
    return None if value is None else str(Path(value).expanduser())


def runtime_variables(cfg: RunConfig) -> dict[str, str]:
    """The variables the config sets for the training process (XLA and PJRT knobs)."""
    topo, xla = cfg.tpu_topology, cfg.xla
    out: dict[str, str] = {"PYTHONUNBUFFERED": "1", "TF_CPP_MIN_LOG_LEVEL": "2" if xla.debug_level == 0 else "0"}
    if not topo.spec.torch_xla:
        # diffusers imports torch_xla whenever it is installed; pin it to the host so it never claims an accelerator
        out["PJRT_DEVICE"] = "CPU"
        out.update(torchtpu_variables(cfg))
        cache = torch_compile_cache_dir(cfg) if topo.spec.torch_compiles else None
        if cache:  # inductor's FX graph and kernel caches and AOTAutograd's (triton's too, below it), kept
            out.update({"TORCHINDUCTOR_CACHE_DIR": cache, "TORCHINDUCTOR_FX_GRAPH_CACHE": "1",
                        "TORCHINDUCTOR_AUTOGRAD_CACHE": "1"})
        return out
    out["PJRT_DEVICE"] = topo.pjrt_device or "CPU"
    if topo.pjrt_device == "CPU":
        out["CPU_NUM_DEVICES"] = str(topo.chips_per_host)
    if xla.flags:
        out["XLA_FLAGS"] = " ".join(xla.flags)
    if xla.libtpu_init_args:
        out["LIBTPU_INIT_ARGS"] = " ".join(xla.libtpu_init_args)
    if xla.debug_level >= 1:
        out["PT_XLA_DEBUG_LEVEL"] = "1"
    if xla.debug_level >= 2:
        out["XLA_IR_DEBUG"] = "1"
        out["XLA_HLO_DEBUG"] = "1"
    return out


def torchtpu_variables(cfg: RunConfig) -> dict[str, str]:
    """TorchTPU's variables, read at `import torch` in the training process: loaded only for TPU topologies on the
    distributed execution, its compile cache where the config puts caches. (Multi-host launch variables are
    TorchTPU's own set_tpu_launch_env's, called by the torchrun wrapper: ddpo_tpu/torchrun.py.)"""
    if not cfg.tpu_topology.torchtpu:
        return {"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}  # an installed torch_tpu without a TPU aborts or claims nothing
    out = {"TORCH_DEVICE_BACKEND_AUTOLOAD": "1"}
    cache = compilation_cache_dir(cfg)
    if cache:
        out["TORCH_TPU_TIER2_COMPILATION_CACHE"] = str(Path(cache) / "torch_tpu")
    return out


def keep_torchtpu_unloaded() -> None:
    """This process's coming `import torch` leaves TorchTPU out (the test process of the TorchTPU environment: measured
    with torch 2.15 + torch-tpu 0.2.0 on a machine without a TPU, a plain CPU backward then hangs in the autograd
    engine). Training processes get the variable from torchtpu_variables instead."""
    os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")


def torchrun_ranks(environ: Mapping[str, str] | None = None) -> tuple[int, int, int] | None:
    """(global rank, world size, local rank) from torchrun's environment (this process's, or another's given its
    environment), or None outside torchrun."""
    environ = os.environ if environ is None else environ
    values = [environ.get(k, "") for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")]
    if not all(v.isdigit() for v in values) or "TORCHELASTIC_RUN_ID" not in environ:
        return None
    return int(values[0]), int(values[1]), int(values[2])


def node_rank(cfg: RunConfig) -> int:
    """This node's rank among tpu_topology.hosts: distributed.node_rank, or on auto the TPU VM worker id (0 if
    none)."""
    value = cfg.distributed.node_rank
    if value != "auto":
        return value
    return tpu_worker_id() or 0


def node_suffix(cfg: RunConfig) -> str:
    """"" for the run dir's own files (config.yaml, train.log, lock, env.json); "-node<N>" for node N > 0 of a
    multi-node distributed run. Its nodes share the run dir (every rank reads the checkpoint), so each other node's
    front end keeps its own lock, log, config and environment beside node 0's, and writes no events."""
    topo = cfg.tpu_topology
    if not topo.spec.torchrun or topo.hosts == 1:
        return ""
    node = node_rank(cfg)
    return f"-node{node}" if node else ""


def config_file_from_environment() -> str:
    return os.environ.get(CONFIG_FILE_VARIABLE) or "config.yaml"


def child_environment(cfg: RunConfig, run_dir: Path, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The exact environment of the training process: the caller's, minus owned variables, plus the config's."""
    environ = os.environ if environ is None else environ
    env = {k: v for k, v in environ.items() if k not in OWNED_VARIABLES}
    env.update(runtime_variables(cfg))
    if cfg.tpu_topology.spec.torchrun and cfg.tpu_topology.chips_per_host > 1:
        # torchrun's own default for several processes a node, given here so it does not print a page about it
        env.setdefault("OMP_NUM_THREADS", "1")
    env[RUN_DIR_VARIABLE] = str(run_dir)
    env[CONFIG_FILE_VARIABLE] = f"config{node_suffix(cfg)}.yaml"
    return env


def redacted(env: Mapping[str, str]) -> dict[str, str]:
    """The environment as saved in the run dir: values of secrets replaced."""
    return {k: ("<redacted>" if _SECRET.search(k) else v) for k, v in sorted(env.items())}


def run_dir_from_environment(environ: Mapping[str, str] | None = None) -> Path | None:
    """The run dir of this training process, or of another one given its environment (psutil's environ())."""
    value = (os.environ if environ is None else environ).get(RUN_DIR_VARIABLE)
    return Path(value) if value else None


def run_dir_lock_fd_from_environment() -> int | None:
    value = os.environ.get(RUN_DIR_LOCK_FD_VARIABLE, "")
    return int(value) if value.isdigit() else None


def cuda_visible_devices() -> list[str] | None:
    """CUDA_VISIBLE_DEVICES as a list, or None when unset (every GPU)."""
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    return [d for d in value.split(",") if d.strip() and not d.strip().startswith("-")]


def tpu_worker_id() -> int | None:
    """On a TPU VM pod, the worker index the VM image exports (used only for messages)."""
    value = os.environ.get("TPU_WORKER_ID") or os.environ.get("CLOUD_TPU_TASK_ID")
    return int(value) if value and value.isdigit() else None


def secret(name: str) -> str | None:
    """The value of the environment variable a config key names (e.g. reward.api_key_env: a chat endpoint's API key);
    the config holds the variable's name, never the secret."""
    return os.environ.get(name) or None


def process_rank() -> int:
    """This process's global rank under torchrun (its RANK), else 0: which of several ranks' files is its own."""
    value = os.environ.get("RANK", "")
    return int(value) if value.isdigit() else 0


def reward_process_environment(package_parent: str) -> dict[str, str]:
    """The environment of a reward process in another Python environment (rewards/managed.py): this process's, with
    ddpo_tpu's parent directory first on PYTHONPATH (that environment runs this checkout's code, nothing installed
    there) and unbuffered output (its log is read while it runs)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_parent, env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def current_umask() -> int:
    """The process umask, read without changing it (os.umask would, briefly, for every thread)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022
