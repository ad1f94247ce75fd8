"""Bad input through the real front end (`python -m ddpo_tpu.train ...` in an empty directory): each case is refused
with exit code 2 and one `error: key=value: reason (fix)` line naming the key, no traceback, and nothing written;
no case gets as far as starting a training process. Plus the torch-free helpers those checks rely on."""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tests.helpers import clean_env, front_end_in_process, HEAVY, heavy_imports, timed_run
from ddpo_tpu.catalog import family
from ddpo_tpu.config.compose import compose_and_validate
from ddpo_tpu import env as envmod

pytestmark = pytest.mark.torch_free  # no torch in the test or what it starts (tests/conftest.py)

REPO = Path(__file__).resolve().parents[3]
TIMEOUT = 60  # a refusal: ~1 s quiet, up to 8.4 s of wall time seen at load 9 (its CPU seconds are bounded)
WANDB_VARIABLES = ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL", "NETRC")


def _files(tmp: Path) -> None:
    """The bad paths the cases point at."""
    (tmp / "binary.txt").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe")
    (tmp / "empty.txt").write_text("\n  \n")
    (tmp / "a_file").write_text("not a directory")
    (tmp / "not_sd" / "unet").mkdir(parents=True)  # a dir, but not a diffusers checkpoint
    (tmp / "not_ckpt" / "checkpoints" / "epoch_0001").mkdir(parents=True)  # no state.json: never completed


# (id, overrides, key named by the error line, a fragment of the line); {tmp} is the test's tmp_path
XLA = "tpu_topology=cpu"  # xla.* keys are read by XLA topologies only (config/enablement.py)
CASES = [
    ("run_name_dotdot", ["run_name=.."], "run_name", "parent"),
    ("run_name_dot", ["run_name=."], "run_name", "output root"),
    ("inf_weight_decay", ["train.adam_weight_decay=inf"], "train.adam_weight_decay", "finite"),
    ("nan_guidance", ["sample.guidance_scale=nan"], "sample.guidance_scale", "finite"),
    ("inf_lora_alpha", ["model.lora.alpha=inf"], "model.lora.alpha", "finite"),
    ("output_root_empty", ["output_root="], "output_root", "empty path"),
    ("output_root_blank", ["output_root=' '"], "output_root", "empty path"),
    ("profile_beyond_run", [XLA, "xla.profile_steps=[2,40]"], "xla.profile_steps", "global steps 0-39"),
    ("evaluation_beyond_run", ["evaluation.every_n_epochs=21"], "evaluation.every_n_epochs", "20 epochs"),
    ("cache_dir_is_file", [XLA, "xla.compilation_cache_dir={tmp}/a_file"], "xla.compilation_cache_dir",
     "not a directory"),
    ("cache_dir_under_file", [XLA, "xla.compilation_cache_dir={tmp}/a_file/cache"], "xla.compilation_cache_dir",
     "not a directory"),
    ("prompts_binary", ["prompts=from_file", "prompts.file={tmp}/binary.txt"], "prompts.file", "not UTF-8"),
    ("prompts_empty", ["prompts=from_file", "prompts.file={tmp}/empty.txt"], "prompts.file", "empty"),
    ("nouns_empty", ["prompts=nouns_activities", "prompts.nouns_file={tmp}/empty.txt"], "prompts.nouns_file", "empty"),
    ("activities_binary", ["prompts=nouns_activities", "prompts.activities_file={tmp}/binary.txt"],
     "prompts.activities_file", "not UTF-8"),
    ("xla_flag_no_dashes", [XLA, "xla.flags=[xla_dump_to]"], "xla.flags[0]", "--name=value"),
    ("xla_flag_with_space", [XLA, 'xla.flags=["--xla_dump_to=/tmp/a b"]'], "xla.flags[0]", "no spaces"),
    ("libtpu_arg_malformed", [XLA, "xla.libtpu_init_args=[-x]"], "xla.libtpu_init_args[0]", "--name=value"),
    ("pretrained_not_sd", ["model=sd14", "model.pretrained={tmp}/not_sd"], "model.pretrained",
     "missing vae/, text_encoder/, tokenizer/, scheduler/"),
    ("pretrained_is_file", ["model=sd14", "model.pretrained={tmp}/a_file"], "model.pretrained", "a file"),
    ("reward_url_scheme", ["reward=remote", "reward.url=ftp://127.0.0.1/score"], "reward.url", "http://"),
    ("reward_url_no_host", ["reward=remote", "reward.url=http:///score"], "reward.url", "with a host"),
    ("reward_url_port", ["reward=remote", "reward.url=http://127.0.0.1:99999/score"], "reward.url", "Port"),
    ("weighted_unknown_name", ["reward=weighted", "reward.components=[{name:jpeg,weight:1}]"],
     "reward.components.0.name", "choose one of: jpeg_compressibility, jpeg_incompressibility, aesthetic"),
    ("weighted_inf_weight", ["reward=weighted", "reward.components=[{name:jpeg_compressibility,weight:inf}]"],
     "reward.components.0.weight", "finite"),
    ("weighted_unknown_key", ["reward=weighted", "reward.components=[{name:jpeg_compressibility,bogus:5}]"],
     "reward.components.0.bogus", "unknown key (remove it; valid keys here: frame_reduction, name, quality, weight)"),
    ("weighted_remote_url", ["reward=weighted", "reward.components=[{name:remote,weight:1,url:'localhost:8765'}]"],
     "reward.components.0.url", "http://"),
    ("weighted_remote_no_url", ["reward=weighted", "reward.components=[{name:jpeg_compressibility},{name:remote}]"],
     "reward.components.1.url", "set +reward.components.1.url="),
    ("weighted_nested", ["reward=weighted", "reward.components=[{name:weighted,components:[]}]"],
     "reward.components.0.name", "no reward of this name goes here"),
    ("weighted_empty", ["reward=weighted", "reward.components=[]"], "reward.components", "at least 1 item"),
    ("reward_key_of_another_reward", ["+reward.url=http://127.0.0.1:8765/score"], "reward.url",
     "unknown key (remove it; valid keys here: frame_reduction, host_workers, name, process, quality)"),
    ("reward_unknown_name", ["reward.name=jpeg"], "reward.name", "choose one of: jpeg_compressibility"),
    ("resume_not_checkpoint", ["resume={tmp}/not_ckpt"], "resume", "not a checkpoint"),
    ("interpolation_env", ["seed=${oc.env:DDPO_TPU_TEST_UNSET_VARIABLE}"], "seed", "DDPO_TPU_TEST_UNSET_VARIABLE"),
    ("interpolation_self", ["seed=${seed}"], "seed", "refers to itself"),
    ("interpolation_missing_key", ["seed=${no_such_key}"], "seed", "no_such_key"),
    ("grammar", ["train.batch_size=["], "train.batch_size", "not a valid override"),
    ("grammar_multirun", ["-m", "train.batch_size=["], "train.batch_size", "not a valid override"),
    ("logger_tag_empty", ["logger=wandb", "logger.mode=offline", "logger.tags=['']"], "logger.tags.0", "1 character"),
    ("lora_target_unknown", ["model.lora.enabled=true", "model.lora.target_modules=[nonexistent]"],
     "model.lora.target_modules", "nonexistent is not a layer of the sd1 family's denoiser (valid: conv, conv1"),
    ("lora_target_typo", ["model.lora.enabled=true", "model.lora.target_modules=[to_q,to_qq,attn1.to_kk]"],
     "model.lora.target_modules", "to_qq, attn1.to_kk are not layers"),
    ("lora_target_sd3_name_on_sd1", ["model.lora.enabled=true", "model.lora.target_modules=[attn.add_q_proj]"],
     "model.lora.target_modules", "to_out.0, to_q, to_v;"),
]


def front_end(tmp: Path, args: list[str], **env_changes: str | None):
    """Run the front end in tmp/cwd with run dirs under tmp/out; returns (process, error lines, CPU seconds: what its
    wall time is on a quiet machine, and what other work on the machine does not stretch; tests.helpers.timed_run)."""
    cwd = tmp / "cwd"
    cwd.mkdir(exist_ok=True)
    env = clean_env()
    for k, v in env_changes.items():
        env.pop(k, None) if v is None else env.__setitem__(k, v)
    # -X importtime: stderr names every module imported, so a test can prove the front end imported no heavy one
    proc, wall, cpu = timed_run([sys.executable, "-X", "importtime", "-m", "ddpo_tpu.train", *args], cwd=cwd, env=env,
                                timeout=TIMEOUT)
    print(f"front end: {cpu:.2f} CPU s, {wall:.2f} s wall")
    return proc, [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")], cpu


def assert_refused(tmp: Path, proc, errors: list[str], key: str, fragment: str, cpu: float,
                   heavy: set[str] | None = None) -> None:
    """heavy: the heavy packages an in-process front end newly imported (None: read them from proc's -X importtime;
    under --torch-free=only torch is also unimportable in this process, so a heavy import fails either way)."""
    heavy = heavy_imports(proc) if heavy is None else heavy
    out = proc.stdout + proc.stderr
    print(f"refused in {cpu:.2f} CPU s: {errors}")
    assert proc.returncode == 2, out
    assert len(errors) == 1, out
    assert f"{key}=" in errors[0] and fragment in errors[0], errors[0]
    assert errors[0].endswith(")"), errors[0]  # ... (fix)
    assert "Traceback" not in out and "nothing was started" in proc.stderr
    assert list((tmp / "cwd").iterdir()) == [] and not (tmp / "out").exists()  # no run dir anywhere
    assert not heavy, f"refusing imported {heavy}"  # exact; CPU seconds stretch beside another worker


# one real process per path a refusal takes (a compose error, a validation error, a multirun's); the other cases call
# the front end's main() in-process (front_end_in_process)
SUBPROCESS = ("interpolation_missing_key", "inf_weight_decay", "grammar_multirun")


@pytest.mark.parametrize("overrides,key,fragment", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_refused_before_anything_is_written(tmp_path, overrides, key, fragment, request, monkeypatch,
                                                        capsys):
    """Each case: exit 2, one error line naming the key and the fix, no run dir, no heavy import. The cases in
    SUBPROCESS start `python -m ddpo_tpu.train` (the real process's exit code and console); the others call its
    main() in-process, where the same lines and exit code come out without ~0.8 CPU s of interpreter start each."""
    _files(tmp_path)
    overrides = [o.replace("{tmp}", str(tmp_path)) for o in overrides]
    multirun = [o for o in overrides if o == "-m"]
    overrides = [o for o in overrides if o != "-m"]
    root = [] if any(o.startswith("output_root=") for o in overrides) else [f"output_root={tmp_path}/out/runs"]
    args = [*multirun, "+experiment=smoke", *root, *overrides]
    if request.node.callspec.id in SUBPROCESS:
        proc, errors, cpu = front_end(tmp_path, args)
        assert_refused(tmp_path, proc, errors, key, fragment, cpu)
    else:
        proc, errors, cpu, heavy = front_end_in_process(tmp_path, args, monkeypatch, capsys, HEAVY)
        assert_refused(tmp_path, proc, errors, key, fragment, cpu, heavy)


@pytest.mark.requires("torch_xla")
def test_unknown_xla_flag_name_is_refused_before_xla_aborts_on_it(tmp_path):
    """XLA aborts its process on an unknown XLA_FLAGS name (SIGABRT, 15-20 s in, run dir written); the front end
    looks the names up in torch_xla's library instead and names the near ones. Known names pass."""
    proc, errors, cpu = front_end(tmp_path, ["+experiment=smoke", f"output_root={tmp_path}/out", "tpu_topology=cpu",
                                              'xla.flags=["--xla_dump_to=/tmp/x","--xla_dump_too=/tmp/x"]'])
    assert_refused(tmp_path, proc, errors, "xla.flags[1]", "XLA has no flag named xla_dump_too", cpu)
    assert "did you mean --xla_dump_to" in errors[0]
    from ddpo_tpu.launch import xla_flags

    assert xla_flags.unknown(["--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true",
                              "--xla_force_host_platform_device_count=4"]) == []
    assert xla_flags.problems(["--xla_nonexistent_flag=1"], "eager") == []  # XLA is not started: nothing to abort


@pytest.mark.needs_torch
def test_lora_target_table_matches_every_builders_model():
    """launch/lora_targets.py's table (what the front end checks target_modules against, without a model) is what
    the denoisers really have: every builder of each family, on the meta device."""
    import torch
    from diffusers import SD3Transformer2DModel
    from peft.tuners.lora import LoraModel  # noqa: F401 -- the layers peft adapts: Linear and Conv

    from ddpo_tpu.models import sd3, tiny

    from tests.helpers import block_layers

    layers = lambda model: block_layers(model, "sd1" if hasattr(model, "conv_in") else "sd3")

    with torch.device("meta"):
        sd1 = set().union(*(layers(tiny._build_unet(tiny.SPECS[k])) for k in ("tiny", "sd14_topology", "sd14_random")))
        sd35_medium = SD3Transformer2DModel(  # stabilityai/stable-diffusion-3.5-medium transformer/config.json
            sample_size=128, patch_size=2, in_channels=16, num_layers=24, attention_head_dim=64, num_attention_heads=24,
            joint_attention_dim=4096, caption_projection_dim=1536, pooled_projection_dim=2048, out_channels=16,
            pos_embed_max_size=384, dual_attention_layers=tuple(range(13)), qk_norm="rms_norm")
        sd3_layers = layers(sd3._build_transformer()) | layers(sd35_medium)
    assert sd1 == set(family("sd1").lora_layers)
    assert sd3_layers == set(family("sd3").lora_layers)


def test_lora_target_names_as_peft_matches_them():
    from ddpo_tpu.launch.lora_targets import is_known

    for name in ("to_q", "to_out.0", "attn1.to_q", "ff.net.0.proj", "proj", "net.2",
                 "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q", "mid_block.resnets.0.conv1"):
        assert is_known(name, "sd1"), name
    for name in ("0", "to_out", "attn.to_q", "ff.net.0", "down_blocks.0.attn9.to_q", "nonexistent", "TO_Q"):
        assert not is_known(name, "sd1"), name
    for name in ("attn.add_q_proj", "add_q_proj", "norm1.linear", "transformer_blocks.3.attn.to_q"):
        assert is_known(name, "sd3"), name
    assert not is_known("attn1.to_q", "sd3")


def test_wandb_online_without_credentials_is_refused(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    (home / ".netrc").write_text("machine example.com login user password secret\n")  # another host's entry
    proc, errors, cpu = front_end(tmp_path, ["+experiment=smoke", f"output_root={tmp_path}/out", "logger=wandb"],
                                   HOME=str(home), **dict.fromkeys(WANDB_VARIABLES))
    assert_refused(tmp_path, proc, errors, "logger.mode", "no API key", cpu)
    assert "wandb login" in errors[0] and "logger.mode=offline" in errors[0]


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is not None, reason="libtpu is installed here")
def test_tpu_topology_without_libtpu_is_refused(tmp_path):
    proc, errors, cpu = front_end(tmp_path, ["+experiment=smoke", f"output_root={tmp_path}/out",
                                              "tpu_topology=v6e-1"])
    assert_refused(tmp_path, proc, errors, "tpu_topology", "libtpu", cpu)
    assert 'pip install "torch_xla[tpu]==2.9.0"' in errors[0] and "tpu_topology=cpu" in errors[0]


def _saved_job(tmp_path: Path, num: int, *overrides: str) -> Path:
    """A job dir of an earlier sweep, with the config.yaml the front end saved for it."""
    job = tmp_path / "out" / "smoke-multirun" / str(num)
    job.mkdir(parents=True)
    tree = compose_and_validate(["+experiment=smoke", f"output_root={tmp_path}/out", *overrides]).tree
    OmegaConf.save(OmegaConf.create(tree), job / "config.yaml")
    return job


def test_changed_sweep_is_refused_naming_the_job_dir(tmp_path, monkeypatch, capsys):
    """In-process (the front end's main()): a multirun's refusal in a real process is the grammar_multirun case."""
    job = _saved_job(tmp_path, 1, "train.learning_rate=0.001")
    before = (job / "config.yaml").read_bytes()
    proc, errors, cpu, _ = front_end_in_process(tmp_path, ["-m", "+experiment=smoke", f"output_root={tmp_path}/out",
                                                           "train.learning_rate=0.003,0.0001"], monkeypatch, capsys)
    print(proc.stderr)
    assert proc.returncode == 2 and len(errors) == 2, proc.stderr  # the point, then the sweep summary
    assert errors[0].startswith("error: [job 1: ") and "train.learning_rate=0.0001: " in errors[0]
    assert str(job) in errors[0] and "train.learning_rate=0.001" in errors[0] and "run_name=smoke-2" in errors[0]
    assert "Traceback" not in proc.stderr
    assert (job / "config.yaml").read_bytes() == before  # untouched
    assert sorted(p.name for p in job.parent.iterdir()) == ["1"]  # job 0 was not started either


def test_same_sweep_again_passes_the_job_dir_check(tmp_path):
    from ddpo_tpu.launch.sweep import changed_sweep_point as _changed_sweep_point

    _saved_job(tmp_path, 0, "train.learning_rate=0.001")
    again = compose_and_validate(["+experiment=smoke", f"output_root={tmp_path}/out", "train.learning_rate=0.001",
                                  "num_epochs=30"])  # run-control keys may change (a longer run continues)
    assert _changed_sweep_point(again, 0) == []
    assert _changed_sweep_point(again, 1) == []  # no such job dir yet
    other = compose_and_validate(["+experiment=smoke", f"output_root={tmp_path}/out", "train.learning_rate=0.002"])
    assert len(_changed_sweep_point(other, 0)) == 1
    forced = compose_and_validate(["+experiment=smoke", f"output_root={tmp_path}/out", "train.learning_rate=0.002",
                                   "force_resume=true"])
    assert _changed_sweep_point(forced, 0) == []


# --- the torch-free helpers -----------------------------------------------------------------------------------------


def test_wandb_credentials_are_found_where_wandb_looks(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    base = {"HOME": str(home)}
    assert envmod.wandb_credentials(base) is None
    assert envmod.wandb_credentials({**base, "WANDB_API_KEY": "k" * 40}) == "WANDB_API_KEY"
    assert envmod.wandb_credentials({**base, "WANDB_API_KEY": " "}) is None
    (home / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    assert envmod.wandb_credentials(base) == str(home / ".netrc")
    assert envmod.wandb_credentials({**base, "WANDB_BASE_URL": "https://wandb.example.com"}) is None
    other = tmp_path / "netrc"
    other.write_text("machine wandb.example.com login user password " + "k" * 40 + "\n")
    assert envmod.wandb_credentials({**base, "NETRC": str(other), "WANDB_BASE_URL": "https://wandb.example.com"}) \
        == str(other)
    (home / ".netrc").write_text("this is not netrc syntax \"\n")
    assert envmod.wandb_credentials(base) is None


def _assigned_tuple_literal(path: Path, name: str) -> tuple | None:
    """The literal tuple a module assigns to `name`, or None (no assignment, or not a literal)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            try:
                return ast.literal_eval(node.value)
            except ValueError:
                return None
    return None


def test_the_torch_modules_read_the_catalog_instead_of_copies():
    # read from the source: importing models/loading.py would import torch. No literal copy of a family's folders:
    assert _assigned_tuple_literal(REPO / "ddpo_tpu" / "models" / "loading.py", "SUBFOLDERS") is None
    assert _assigned_tuple_literal(REPO / "ddpo_tpu" / "models" / "sd3.py", "SD3_SUBFOLDERS") is None
    # training/checkpoint_files.py compares configs with the front end's own rules (one copy)
    assert _assigned_tuple_literal(REPO / "ddpo_tpu" / "training" / "checkpoint_files.py", "RUN_CONTROL_KEYS") is None
    assert "from ddpo_tpu.config.resume import changed_keys, resume_relevant" in (
        REPO / "ddpo_tpu" / "training" / "checkpoint_files.py").read_text()


def test_profile_steps_at_the_last_step_are_accepted():
    # smoke: 16 samples / 8 per optimizer step = 2 steps per epoch x 20 epochs = global steps 0-39
    assert compose_and_validate(["+experiment=smoke", XLA, "xla.profile_steps=[0,39]"]).cfg.xla.profile_steps == [0, 39]
    assert compose_and_validate(["+experiment=smoke", "evaluation.every_n_epochs=20"])
