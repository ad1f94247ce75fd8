"""What a run needs from this machine, refused before a run dir exists (ddpo_tpu/launch/machine.py): one line naming
the key and what to change, exit 2, nothing written, fast. This machine has no GPU and no TPU; the Hugging Face cache
is a directory the test builds in the cache's own layout."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ddpo_tpu.config.compose import compose_and_validate
from ddpo_tpu.catalog import family
from ddpo_tpu.launch import machine
from tests.helpers import clean_env, front_end_in_process, heavy_imports, timed_run

pytestmark = pytest.mark.torch_free  # no torch in the test or what it starts (tests/conftest.py)

SD14 = "CompVis/stable-diffusion-v1-4"


def refused(cwd: Path, *args: str, **env: str) -> tuple[list[str], float]:
    """The front end's refusal in a real process, which imports none of the heavy packages (-X importtime lists every
    import: an exact count, where a CPU-seconds bound was not: 1.3 CPU s alone, 3.1 beside another worker in CI)."""
    proc, _, cpu = timed_run([sys.executable, "-X", "importtime", "-m", "ddpo_tpu.train", *args], cwd=cwd,
                             env=clean_env(**env), timeout=60)
    heavy = heavy_imports(proc)
    stderr = "\n".join(line for line in proc.stderr.splitlines() if not line.startswith("import time:"))
    assert proc.returncode == 2, proc.stdout + stderr
    assert "Traceback" not in stderr and proc.stdout == ""
    assert sorted(cwd.rglob("*")) == [], "something was written"
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert stderr.rstrip().endswith("nothing was started.")
    print(f"refused in {cpu:.2f} CPU s: {errors}")
    assert not heavy, heavy
    return errors, cpu


def refused_in_process(tmp: Path, monkeypatch, capsys, *args: str) -> list[str]:
    """refused()'s assertions on the front end's main() called in this process (tests.helpers.front_end_in_process):
    the same lines and exit code without a process start. test_hub_model_missing_from_the_local_cache keeps the real
    process (exit code, console, an environment variable read at import)."""
    proc, errors, cpu, heavy = front_end_in_process(tmp, list(args), monkeypatch, capsys)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert sorted((tmp / "cwd").rglob("*")) == [], "something was written"
    assert proc.stderr.rstrip().endswith("nothing was started.")
    assert not heavy, heavy  # imported by the call: none of torch, diffusers, transformers, peft...
    return errors


@pytest.mark.skipif(machine.nvidia_gpus() > 0, reason="this machine has a GPU")
@pytest.mark.parametrize("topology,here", [("cuda", "eager_cpu"), ("gpu-1", "cpu_dist2")])  # eager, distributed
def test_cuda_without_a_gpu(tmp_path, topology, here, monkeypatch, capsys):
    errors = refused_in_process(tmp_path, monkeypatch, capsys, "+experiment=smoke", f"tpu_topology={topology}")
    assert errors == [f"error: tpu_topology={topology}: no NVIDIA GPU is visible on this machine (no driver, or "
                      f"CUDA_VISIBLE_DEVICES hides them) (run on a GPU machine, or tpu_topology={here} here)"]


def hub_snapshot(cache: Path, repo: str, folders: tuple[str, ...]) -> Path:
    """A model in huggingface_hub's cache layout: refs/main names a snapshot holding model_index.json and folders."""
    root = cache / ("models--" + repo.replace("/", "--"))
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text("0" * 40)
    snap = root / "snapshots" / ("0" * 40)
    snap.mkdir(parents=True)
    (snap / "model_index.json").write_text("{}")
    for f in folders:
        (snap / f).mkdir()
    return snap


def test_hub_model_missing_from_the_local_cache(tmp_path, monkeypatch):
    work, cache = tmp_path / "work", tmp_path / "hf"
    work.mkdir(), cache.mkdir()
    # the user typed only the experiment: the error says where model.pretrained came from and what to type
    errors, _ = refused(work, "+experiment=compressibility_parity", "tpu_topology=eager_cpu", "parity=none",
                        "model.local_files_only=true", HF_HUB_CACHE=str(cache))
    (line,) = errors
    assert line.startswith(f"error: model.pretrained={SD14} (set by +experiment=compressibility_parity): "
                           f"model.local_files_only=true and the local Hugging Face cache ({cache}) lacks "
                           f"model_index.json")
    include = " ".join(f"--include '{s}/*'" for s in family("sd1").subfolders)
    assert f"`hf download {SD14} --include model_index.json {include} --exclude '*.bin'" in line
    assert "model.pretrained=DIR" in line and "model.local_files_only=false" in line

    # in the cache's layout: found, or named by the folders a partial download lacks (no network either way)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(cache))
    monkeypatch.setattr("huggingface_hub.file_download.HF_HUB_CACHE", str(cache), raising=False)
    cfg = compose_and_validate(["model=sd14", "model.local_files_only=true", "model.revision=null"]).cfg
    snap = hub_snapshot(cache, SD14, ("unet", "vae", "text_encoder", "tokenizer"))
    (problem,) = machine.hub_cache_problems(cfg, ["model=sd14", "model.local_files_only=true"])
    assert "lacks scheduler/" in problem and "(set by model=sd14)" in problem  # the group chosen on the command line
    (snap / "scheduler").mkdir()
    assert machine.hub_cache_problems(cfg, []) == []
    # a local dir, a build, or a run allowed to download: nothing to look up
    assert machine.hub_cache_problems(compose_and_validate(["model=sd14"]).cfg) == []
    assert machine.hub_cache_problems(compose_and_validate(["+experiment=smoke"]).cfg) == []
    assert not machine.is_hub_id(str(snap)) and not machine.is_hub_id("./sd14") and machine.is_hub_id(SD14)


@pytest.mark.parametrize("project,fix", [
    ("me/ddpo", "set logger.entity=me logger.project=ddpo"),   # wandb's entity/project spelling
    ("ddpo:v2?", "set logger.project=ddpo-v2-"),
])
def test_wandb_project_name_wandb_would_refuse(tmp_path, project, fix, monkeypatch, capsys):
    errors = refused_in_process(tmp_path, monkeypatch, capsys, "+experiment=smoke", "logger=wandb",
                                "logger.mode=offline", f"logger.project={project}")
    (line,) = errors
    assert line.startswith(f"error: logger.project={project}: contains ") and f"({fix}" in line


@pytest.mark.requires("wandb")
def test_wandb_names_match_wandbs_own_check():
    """The characters and length refused here are the ones wandb refuses (its settings validator)."""
    from wandb.sdk import wandb_settings
    for project in ["ok-name_1.2", "a/b", "a#b", "a?b", "a%b", "a:b", "a\\b", "x" * 128]:  # longer: the schema's
        cfg = compose_and_validate(["logger=wandb", "logger.mode=offline", f"logger.project='{project}'"]).cfg
        ours = machine.tracker_problems(cfg)
        try:
            wandb_settings.Settings(project=project)
            theirs = False
        except Exception:  # noqa: BLE001 -- wandb's UsageError or pydantic's wrapper of it
            theirs = True
        assert bool(ours) == theirs, project


def test_sd35_with_t5_needs_its_encoder_folders_too():
    cfg = compose_and_validate(["model=sd35_medium", "sampler=flow_sde10", "train.mixed_precision=bf16"]).cfg
    assert cfg.model.text_encoder_3
    folders = machine.model_folders(cfg.model)
    assert folders[-2:] == ("text_encoder_3", "tokenizer_3") and set(family("sd3").subfolders) <= set(folders)
    command = machine.download_command(cfg.model, local_dir="/data/sd35m")
    assert "--include 'text_encoder_3/*' --include 'tokenizer_3/*'" in command
    assert command.endswith("--local-dir /data/sd35m")


def test_the_machine_checks_import_no_torch(tmp_path):
    code = ("import sys\n"
            "from ddpo_tpu.config.compose import compose_and_validate\n"
            "from ddpo_tpu.launch import machine\n"
            "cfg = compose_and_validate(['model=sd14', 'model.local_files_only=true', 'logger=wandb',\n"
            "                            'logger.mode=offline', 'logger.project=a/b']).cfg\n"
            "assert len(machine.problems(cfg, [])) == 2\n"
            "print([m for m in ('torch', 'diffusers', 'transformers', 'wandb') if sys.modules.get(m) is not None])\n")
    proc = subprocess.run([sys.executable, "-c", code], env=clean_env(HF_HUB_CACHE=str(tmp_path)),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_a_video_model_needs_pyav_for_its_mp4_samples(monkeypatch):
    import importlib.util

    wan = compose_and_validate(["+experiment=wan_grpo_smoke"]).cfg
    image = compose_and_validate(["+experiment=smoke"]).cfg
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "av" else real(name, *a))
    (line,) = machine.video_problems(wan)
    assert line.startswith("model.family=wan:") and "pip install av==" in line
    assert machine.video_problems(image) == []  # an image model writes no video
    pin = next(x for x in (Path(__file__).parents[3] / "requirements.txt").read_text().splitlines()
               if x.startswith("av=="))
    assert f"pip install {pin}," in line  # the fix installs the lockfile's pin
    monkeypatch.setattr(importlib.util, "find_spec", real)
    assert machine.video_problems(wan) == []  # av is installed (a pinned requirement)


def test_gardo_s_gate_and_feature_models_are_looked_for_as_the_reward_s(tmp_path, monkeypatch, capsys):
    """Issue 43: GARDO's auxiliary rewards (algorithm.kl_gate_rewards) and feature model (algorithm.diversity_features)
    load CLIP models with local_files_only as the run's reward does (rewards/aesthetic.py, rewards/clip_features.py);
    the machine check never looked for them, so the run stopped (exit 1) after its run dir was written.
    In-process (the cache's path as huggingface_hub reads it at import, set where it keeps it): the refusal whose
    real process is test_hub_model_missing_from_the_local_cache's."""
    work, cache = tmp_path / "work", tmp_path / "hf"
    work.mkdir(), cache.mkdir()
    clip = "openai/clip-vit-large-patch14"
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(cache))
    monkeypatch.setattr("huggingface_hub.file_download.HF_HUB_CACHE", str(cache), raising=False)
    errors = refused_in_process(work, monkeypatch, capsys, "+experiment=gardo_smoke",
                                f"algorithm.diversity_features.clip_model={clip}")
    assert errors == [f"error: algorithm.diversity_features.clip_model={clip}: the clip_features reward loads it with "
                      f"local_files_only and the local Hugging Face cache ({cache}) lacks its config.json (download it "
                      f"once: `hf download {clip}`; or point algorithm.diversity_features.clip_model=DIR at a local "
                      f"copy)"]
    mlp = tmp_path / "sac+logos+ava1-l14-linearMSE.pth"
    mlp.write_bytes(b"\0")
    gate = ["+experiment=gardo_smoke", f"algorithm.kl_gate_rewards.0.clip_model={tmp_path}/no_such_clip",
            f"algorithm.kl_gate_rewards.0.mlp_path={mlp}"]
    cfg = compose_and_validate(gate).cfg
    (line,) = machine.reward_model_problems(cfg, gate)
    assert line.startswith(f"algorithm.kl_gate_rewards.0.clip_model={tmp_path}/no_such_clip: no such directory")
    assert any("the aesthetic reward's clip_model" in c for c in machine.target_checks(cfg))
    (tmp_path / "no_such_clip").mkdir()
    assert machine.reward_model_problems(cfg, gate) == []
    assert machine.reward_model_problems(compose_and_validate(["+experiment=gardo_smoke"]).cfg) == []  # tiny: built
