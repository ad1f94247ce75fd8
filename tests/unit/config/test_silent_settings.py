"""Issue 32's compose-time half: settings that would start training and take no effect, failures validation can
predict, the parity pins of windows and the zero-advantage filter, keys of another sampler or family, a command whose
run dir holds another run, and --check for another machine. Each is refused in one line naming the key, before any
run dir is written; the same config with the fix composes."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from ddpo_tpu.config.compose import compose, compose_and_validate
from ddpo_tpu.problems import ConfigError
from tests.helpers import front_end_in_process
from tests.unit.config.test_bad_input import assert_refused, front_end, heavy_imports

pytestmark = pytest.mark.torch_free  # no torch in the test or what it starts (tests/conftest.py)

REPO = Path(__file__).resolve().parents[3]
FLOW = "+experiment=flow_grpo_smoke"  # tiny SD 3, flow_sde sampler, GRPO with kl_beta 0.01, 6 steps, 20 epochs


def refused(overrides: list[str]):
    """The one problem of a config (the test fails if it composes or has several)."""
    with pytest.raises(ConfigError) as e:
        compose_and_validate(overrides)
    assert len(e.value.problems) == 1, str(e.value)
    return e.value.problems[0]


# --- settings that take no effect ------------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides,key,reason,fixed", [
    (["logger=tensorboard", "logger.tensorboard=false"], "logger.tensorboard", "always writes TensorBoard",
     ["logger=wandb_tensorboard", "logger.mode=offline"]),
    (["logger=tensorboard", "logger.mode=offline"], "logger.mode", "does not start wandb",
     ["logger=wandb_tensorboard", "logger.mode=offline"]),
    (["logger=tensorboard", "logger.project=p"], "logger.project", "does not start wandb",
     ["logger=wandb_tensorboard", "logger.mode=offline", "logger.project=p"]),
    (["tpu_topology=cpu_dist2", "tpu_topology.pjrt_device=CPU", "sample.batch_size=4", "train.batch_size=2"],
     "tpu_topology.pjrt_device", "not PJRT", ["tpu_topology=cpu", "tpu_topology.pjrt_device=CPU"]),
])
def test_a_setting_its_run_ignores_is_refused(overrides, key, reason, fixed):
    p = refused(["+experiment=smoke", *overrides])
    assert p.key == key and reason in p.reason and "not read" in p.reason, str(p)
    compose_and_validate(["+experiment=smoke", *fixed])


def test_a_sliding_window_that_never_moves_is_refused():
    window = [FLOW, "sample.sde_window.size=2", "sample.sde_window.placement=sliding"]
    p = refused([*window, "sample.sde_window.shift_every=20"])  # 20 epochs: epochs 0-19, its first move at 20
    assert p.key == "sample.sde_window.shift_every" and "never move" in p.reason and "20 epoch" in p.reason
    assert p.suggested() == ["sample.sde_window.shift_every=19"]
    compose_and_validate([*window, *p.suggested()])
    compose_and_validate([*window, "sample.sde_window.shift_every=20", "num_epochs=21"])
    compose_and_validate([*window, "num_epochs=1"])  # (the default shift_every=1 on a one-epoch run: nothing asked)


# --- failures validation can predict ---------------------------------------------------------------------------------

def test_a_cps_window_at_the_last_step_is_refused_with_a_fix_that_composes():
    cps = [FLOW, "sample.sde_type=cps", "sample.sde_window.size=2"]
    p = refused(cps)  # random placement: any start may be drawn, the last one included
    assert p.key == "sample.sde_window.range" and "0/0" in p.reason and "last of the 6 steps" in p.reason
    assert p.suggested() == ["sample.sde_window.range=[0,5]"]
    compose_and_validate([*cps, *p.suggested()])
    compose_and_validate([*cps, "algorithm.kl_beta=0"])  # no KL term: nothing divides by the last step's std
    fixed = refused([*cps, "sample.sde_window.placement=fixed", "sample.sde_window.start=4"])
    assert fixed.key == "sample.sde_window.start" and fixed.suggested() == ["sample.sde_window.start=3"]
    compose_and_validate([*cps, "sample.sde_window.placement=fixed", "sample.sde_window.start=3"])


@pytest.mark.needs_torch
def test_the_last_step_rule_agrees_with_where_the_windows_are_placed():
    """The front end restates the sliding arithmetic (window.py's package imports torch); every placement of a grid of
    windows, over every epoch of the run, is compared with diffusion/window.py's own."""
    from types import SimpleNamespace

    from ddpo_tpu.catalog.algorithms import _window_reaches_last_step
    from ddpo_tpu.config.schema import SdeWindowConfig
    from ddpo_tpu.diffusion.window import sde_window_at

    T = 6
    for size, start, shift, stride, epochs, rng in itertools.product((1, 2, 3), (0, 1, 2), (1, 2, 5), (1, 2),
                                                                       (1, 4, 9), (None, [1, 6], [0, 5])):
        lo, hi = rng or (0, T)
        if size > hi - lo or not lo <= start <= hi - size:
            continue
        for placement in ("fixed", "sliding"):
            w = SdeWindowConfig(size=size, placement=placement, start=start, range=rng, shift_every=shift,
                                stride=stride)
            cfg = SimpleNamespace(sample=SimpleNamespace(sde_window=w, num_steps=T), num_epochs=epochs)
            placed = any(sde_window_at(w, T, 0, e, 0)[1] == T for e in range(epochs))
            assert _window_reaches_last_step(cfg) == placed, (w, epochs)


def test_digits_scoring_the_prompted_digit_needs_prompts_that_name_one():
    compose_and_validate(["+experiment=digits", "reward.target=null"])  # digits.txt: "a handwritten digit N"
    p = refused(["+experiment=digits", "reward.target=null", "prompts=simple_animals", "prompts.file=null"])
    assert p.key == "reward.target" and "name none" in p.reason and "training prompts" in p.reason
    assert p.suggested() == ["reward.target=7"]
    p = refused(["+experiment=digits", "reward.target=null", "evaluation.prompts=[a cat]"])
    assert p.key == "reward.target" and "evaluation.prompts" in p.reason and "'a cat'" in p.reason
    compose_and_validate(["+experiment=digits", "reward.target=null", "evaluation.prompts=[a handwritten digit 3]"])
    p = refused(["+experiment=smoke", "reward=weighted", "reward.components=[{name:digit_classifier,target:null}]"])
    assert p.key == "reward.components.0.target"


def test_a_pickscore_component_this_machine_lacks_is_refused_before_a_run_dir(tmp_path):
    hf, processor = tmp_path / "hf", tmp_path / "processor"  # an empty cache; the processor a local copy
    hf.mkdir(), processor.mkdir()
    proc, errors, cpu = front_end(tmp_path, [
        "+experiment=smoke", f"output_root={tmp_path}/out", "reward=weighted",
        f"reward.components=[{{name:jpeg_compressibility}},{{name:pickscore,processor:'{processor}'}}]"],
        HF_HUB_CACHE=str(hf))
    assert_refused(tmp_path, proc, errors, "reward.components.1.clip_model", "hf download yuvalkirstain/PickScore_v1",
                   cpu)
    assert not heavy_imports(proc)  # no torch, diffusers, transformers, peft (-X importtime: exact)
    assert "local_files_only" in errors[0]


# --- parity pins -----------------------------------------------------------------------------------------------------

def _sd35(tmp_path: Path, *more: str) -> list[str]:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a photo of a cat\n")
    return ["+experiment=flow_grpo_pickscore_sd35", f"prompts.path={prompts}", *more]


@pytest.mark.parametrize("override,key,pinned", [("sample.sde_window.size=2", "sample.sde_window.size", "null"),
                                                 ("algorithm.drop_zero_advantage=false",
                                                  "algorithm.drop_zero_advantage", "true")])
def test_the_sd35_parity_pins_no_window_and_the_zero_advantage_filter(tmp_path, override, key, pinned):
    """yifan123/flow_grpo@54809b5 scripts/train_sd3.py trains every sampled step but the last (timestep_fraction, no
    window: windows are train_sd3_fast.py's) and drops the samples whose advantage is 0 at every step before
    training (its zero-advantage mask); conf/parity/flow_grpo_pickscore.yaml records both."""
    valid = compose_and_validate(_sd35(tmp_path))
    rows = {r["constraint"]: r for r in valid.report}
    assert rows[key]["ok"] and rows[key]["effective"] == rows[key]["target"]
    p = refused(_sd35(tmp_path, override))
    assert p.key == key and f"parity flow_grpo_pickscore pins {pinned}" in p.reason
    compose_and_validate(_sd35(tmp_path, override, "parity=none"))


def test_the_flux_parity_pins_no_window(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a photo of a cat\n")
    p = refused(["+experiment=flux_grpo_pickscore", f"prompts.path={prompts}", "sample.sde_window.size=2"])
    assert p.key == "sample.sde_window.size" and "flow_grpo_flux pins null" in p.reason


# --- keys of another sampler or family --------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides,key,words", [
    (["+experiment=smoke", "sample.sde_window.size=2"], "sample.sde_window.size",
     ["flow_sde", "sd3, flux", "model=tiny_sd3"]),
    (["+experiment=smoke", "sample.sde_type=cps"], "sample.sde_type", ["flow_sde sampler", "model=sd35_medium"]),
    (["+experiment=flux_grpo_smoke", "model.text_encoder_3=true"], "model.text_encoder_3",
     ["sd3 model family", "model=tiny_sd3"]),
])
def test_a_key_of_another_sampler_or_family_says_who_has_it(overrides, key, words):
    with pytest.raises(ConfigError) as e:
        compose(overrides)
    (p,) = e.value.problems
    assert p.key == key and "unknown key" not in p.reason and "spelling" not in str(p.fix), str(p)
    assert all(w in str(p) for w in words), str(p)
    with pytest.raises(ConfigError) as e:
        compose(["+experiment=smoke", "sample.sde_windw.size=2"])  # a misspelling is still one
    assert e.value.problems[0].reason == "unknown key"


# --- a run dir that holds a run ---------------------------------------------------------------------------------------

def _saved_run(root: Path, epochs_done: int, *overrides: str) -> Path:
    """outputs/smoke as the front end left it: config.yaml and a complete checkpoint after `epochs_done` epochs."""
    run = root / "smoke"
    run.mkdir(parents=True)
    tree = compose_and_validate(["+experiment=smoke", f"output_root={root}", *overrides]).tree
    OmegaConf.save(OmegaConf.create(tree), run / "config.yaml")
    if epochs_done:
        ckpt = run / "checkpoints" / f"epoch_{epochs_done - 1:04d}"
        ckpt.mkdir(parents=True)
        (ckpt / "state.json").write_text("{}")
    return run


@pytest.mark.parametrize("change,key,words", [
    (["tpu_topology=cpu_dist2", "sample.batch_size=4", "train.batch_size=2"], "tpu_topology.", "is complete (20 of 20"),
    (["logger=tensorboard"], "logger.name", "is complete (20 of 20"),
])
def test_the_readme_next_commands_do_not_rewrite_a_finished_run(tmp_path, change, key, words, monkeypatch, capsys):
    """The refusal in a real process; the --check that follows it calls the front end's main() in-process."""
    root = tmp_path / "out"
    run = _saved_run(root, 20)
    before = (run / "config.yaml").read_bytes()
    proc, errors, cpu = front_end(tmp_path, ["+experiment=smoke", f"output_root={root}", *change])
    print(proc.stderr)
    assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert errors[0].startswith(f"error: {key}") and words in errors[0] and "run_name=smoke-2" in errors[0]
    assert (run / "config.yaml").read_bytes() == before and sorted(p.name for p in root.iterdir()) == ["smoke"]
    assert not heavy_imports(proc)  # no torch, diffusers, transformers, peft (-X importtime: exact)
    proc, errors, _, _ = front_end_in_process(tmp_path, ["+experiment=smoke", f"output_root={root}", *change,
                                                         "run_name=smoke-2", "--check"], monkeypatch, capsys)
    assert proc.returncode == 0 and errors == [], proc.stderr  # a new run is fine


def test_changed_trained_settings_are_refused_naming_them(tmp_path):
    root = tmp_path / "out"
    run = _saved_run(root, 5)
    proc, errors, _ = front_end(tmp_path, ["+experiment=smoke", f"output_root={root}", "train.learning_rate=0.1"])
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr
    assert errors[0].startswith("error: train.learning_rate=0.1: ") and "0.003 -> 0.1" in errors[0]
    assert "force_resume=true" in errors[0] and not (run / "train.log").exists()
    from ddpo_tpu.launch import saved_run

    forced = compose_and_validate(["+experiment=smoke", f"output_root={root}", "train.learning_rate=0.1",
                                   "force_resume=true"])
    assert saved_run.problems(forced, run) == []
    longer = compose_and_validate(["+experiment=smoke", f"output_root={root}", "num_epochs=30", "logger=tensorboard"])
    assert saved_run.problems(longer, run) == []  # what a resume may change, on a run that is not complete


def test_a_resume_that_changes_how_the_run_continues_is_recorded(tmp_path):
    from ddpo_tpu.launch import saved_run

    root = tmp_path / "out"
    run = _saved_run(root, 5)
    same = compose_and_validate(["+experiment=smoke", f"output_root={root}"]).tree
    assert saved_run.record_changes(run, same) is None and not (run / saved_run.RESUMES_FILE).exists()
    tree = compose_and_validate(["+experiment=smoke", f"output_root={root}", "logger=tensorboard"]).tree
    line = saved_run.record_changes(run, tree)
    assert line.startswith("resume: from epoch 5 with changed settings (logger.name: none -> tensorboard")
    (record,) = [json.loads(x) for x in (run / saved_run.RESUMES_FILE).read_text().splitlines()]
    assert record["from_epoch"] == 5
    assert record["changed"]["logger.name"] == {"was": "none", "now": "tensorboard"}
    assert record["changed"]["logger.tensorboard"] == {"was": False, "now": True}


def test_the_readme_runs_its_commands_in_distinct_run_dirs():
    """The README's commands, run in the order written, each start their own run (issue 32: the ones after the smoke
    run kept run_name smoke and 'resumed' it)."""
    text = (REPO / "README.md").read_text()
    commands = re.sub(r"\\\n\s*", " ", text).splitlines()
    names: dict[str, list[str]] = {}
    for line in commands:
        line = line.split("#", 1)[0].strip()
        m = re.match(r"^(?:\.venv/bin/)?python -m ddpo_tpu\.train (.*)$", line)
        if not m or any(w in m.group(1).split() for w in ("--check", "--cfg", "--help", "-m")):
            continue
        words = m.group(1).split()
        experiment = next((w.split("=", 1)[1] for w in words if w.startswith("+experiment=")), None)
        name = next((w.split("=", 1)[1] for w in words if w.startswith("run_name=")), experiment)
        names.setdefault(name, []).append(m.group(1))
    assert names.get("smoke") and names.get("digits"), names
    for name, runs in names.items():
        assert len(set(runs)) == 1, f"run_name={name} is used by different commands: {runs}"


# --- --check for another machine -------------------------------------------------------------------------------------

def test_check_previews_a_run_for_a_machine_this_one_is_not(tmp_path, monkeypatch, capsys):
    """--check in a real process; --check-here's refusal and a config problem's call main() in-process."""
    from ddpo_tpu.launch import machine

    if machine.nvidia_gpus() > 0:
        pytest.skip("this machine has a GPU")
    args = ["+experiment=smoke", f"output_root={tmp_path}/out", "tpu_topology=gpu-1"]
    proc, errors, cpu = front_end(tmp_path, [*args, "--check"])
    assert proc.returncode == 0 and errors == [], proc.stderr
    assert "checked on the target machine" in proc.stdout and "1 NVIDIA GPU(s)" in proc.stdout
    assert "train timesteps per sample" in proc.stdout  # the parity table
    assert "for another machine" in proc.stdout and not (tmp_path / "out").exists()
    assert not heavy_imports(proc)  # no torch, diffusers, transformers, peft (-X importtime: exact)
    # a pod worker's check: this machine must be it
    proc, errors, _, _ = front_end_in_process(tmp_path, [*args, "--check-here"], monkeypatch, capsys)
    assert proc.returncode == 2 and len(errors) == 1 and "no NVIDIA GPU" in errors[0], proc.stderr
    # a config problem still is one
    proc, errors, _, _ = front_end_in_process(tmp_path, [*args, "--check", "train.batch_size=3"], monkeypatch, capsys)
    assert proc.returncode == 2 and errors, proc.stderr


# --- issue 43: the newest features' keys nothing reads, contradictions, and refusal texts ----------------------------

DIST = ["tpu_topology=cpu_dist2", "sample.batch_size=4", "train.batch_size=2"]  # smoke on two processes


@pytest.mark.parametrize("overrides,key,words,fixed", [
    # AWM trains all its times of a train batch in one forward of K x B rows (algorithms/awm.py; the reference's
    # train_sd3_awm.py trains its timesteps in one batch): the fused micro-step is NFT's and GRPO's knob
    (["+experiment=awm_smoke", "train.timesteps_per_micro_step=5"], "train.timesteps_per_micro_step",
     "trains all its trained timesteps of a train batch in one forward", ["+experiment=awm_smoke"]),
    # d = min(rate x (step - start), max) (NVlabs/DiffusionNFT@24af5554 train_nft_sd3.py return_decay): max 0 is 0
    (["+experiment=nft_smoke", "algorithm.decay_max=0", "algorithm.decay_start=75"], "algorithm.decay_start",
     "algorithm.decay_max=0", None),
    # the cast is of NFT's own ODE rollouts; ode_sampling=false samples with the loop's SDE step
    (["+experiment=nft_smoke", "algorithm.ode_sampling=false", "sample.ode_solver=euler",
      "algorithm.integer_rollout_timesteps=true"], "algorithm.integer_rollout_timesteps", "ode_sampling=false", None),
    (["+experiment=smoke", "tpu_topology=gpu-1", "distributed.keep_samples_on_rank=true"],
     "distributed.keep_samples_on_rank", "one process", ["+experiment=smoke", *DIST,
                                                         "distributed.keep_samples_on_rank=true"]),
    (["+experiment=smoke", *DIST, "distributed.compile=none", "distributed.compile_cache_dir=/tmp/cache"],
     "distributed.compile_cache_dir", "compiles nothing", None),
    (["+experiment=smoke", "resume=never", "force_resume=true"], "force_resume", "resume=never", None),
])
def test_issue43_a_key_its_combination_never_reads_is_refused(overrides, key, words, fixed):
    p = refused(overrides)
    assert p.key == key and words in p.reason and "not read" in p.reason, str(p)
    if p.suggested():  # the enabler composes
        compose_and_validate([*overrides, *p.suggested()])
    if fixed is not None:
        compose_and_validate(fixed)


def test_issue43_an_nft_decay_that_starts_after_the_last_sampling_is_refused():
    """nft_smoke: 128 samples / train batch 16 = 8 optimizer steps an epoch, 20 epochs = 160 steps. The old policy is
    updated after each epoch with the step count so far (NVlabs/DiffusionNFT@24af5554 train_nft_sd3.py: return_decay
    with the global step); the update after epoch e (step 8 (e + 1)) samples epoch e + 1, the last useful one is after
    epoch 18 at step 152, and d > 0 needs step > decay_start."""
    nft = ["+experiment=nft_smoke"]
    p = refused([*nft, "algorithm.decay_start=1000"])
    assert p.key == "algorithm.decay_start" and "160 optimizer steps" in p.reason and "never start" in p.reason
    assert p.suggested() == ["algorithm.decay_start=0"]
    assert refused([*nft, "algorithm.decay_start=152"]).key == "algorithm.decay_start"
    compose_and_validate([*nft, "algorithm.decay_start=151"])  # decays once, for the last epoch
    compose_and_validate([*nft, "algorithm.decay_start=1000", "num_epochs=200"])


@pytest.mark.parametrize("change,key,fix", [
    (["distributed.hang_timeout_s=1800"], "distributed.hang_timeout_s", "distributed.hang_timeout_s=450"),
    (["distributed.timeout_s=50"], "distributed.timeout_s", "distributed.timeout_s=120"),  # below the 60 s default
])
def test_issue43_the_rank_watch_bound_must_be_below_the_collective_timeout(change, key, fix):
    """A collective that times out first fails the rank that waited (gloo/nccl name the waiter), the outcome the rank
    watch (proc/rankwatch.py) exists to prevent: its bound must be the shorter one. The key the user set is named."""
    p = refused(["+experiment=smoke", *DIST, *change])
    assert p.key == key and "before a collective times out" in p.reason and p.suggested() == [fix], str(p)
    compose_and_validate(["+experiment=smoke", *DIST, *change, *p.suggested()])
    compose_and_validate(["+experiment=smoke", *DIST, "distributed.hang_timeout_s=1800", "distributed.timeout_s=3600"])


def test_issue43_a_video_reward_on_one_frame_is_refused():
    """rewards/frame_consistency.py compares each frame with the one before and the first (VBench's background
    consistency, F >= 2): a one-frame video has nothing to compare, and the run would fail after it started."""
    wan = ["+experiment=wan_grpo_smoke", "reward=frame_consistency"]
    p = refused([*wan, "model.num_frames=1"])
    assert p.key == "model.num_frames" and "reward=frame_consistency is a video reward" in p.reason
    assert p.suggested() == ["model.num_frames=5"]
    compose_and_validate([*wan, *p.suggested()])
    compose_and_validate(["+experiment=wan_grpo_smoke", "model.num_frames=1"])  # an image reward scores one frame


def test_issue43_each_algorithm_explains_its_own_clip_range():
    awm = refused(["+experiment=awm_smoke", "train.clip_range=0.2"])
    assert awm.key == "train.clip_range" and "algorithm=awm clips its ratio with its own algorithm.clip_range" in \
        str(awm) and "nft" not in str(awm).lower(), str(awm)
    nft = refused(["+experiment=nft_smoke", "train.clip_range=0.2"])
    assert "algorithm=nft has no PPO ratio" in str(nft) and "awm" not in str(nft), str(nft)


@pytest.mark.parametrize("change,key", [(["algorithm=awm"], "algorithm.name"),
                                        (["algorithm.ratio_norm=true"], "algorithm.ratio_norm")])
def test_issue43_wan_s_sampler_is_named_for_the_flow_sampler_it_is(change, key):
    """catalog/samplers.py registers wan_sde with flow=True: the refusal says what it is not (flow_sde), and offers
    algorithms that run on it."""
    p = refused(["+experiment=wan_grpo_smoke", *change])
    assert p.key == key and "wan_sde, a flow sampler" in p.reason and "not a flow sampler" not in p.reason, str(p)
    assert "not a flow family" not in p.reason
    for option in range(len(p.fix.options)) if key == "algorithm.name" else ():
        compose_and_validate(["+experiment=wan_grpo_smoke", *p.fix.overrides(option)])


def test_issue43_a_preset_s_reward_keys_under_another_reward_are_one_line(tmp_path):
    """flow_grpo_geneval_sd35 sets its GenEval reward's detector and colors; reward=pickscore does not take them: one
    line naming them all, on `reward` (the key the user set), not an unknown key each. The preset's null
    detector_model (unset, and a null Hydra's `~key` cannot remove) is dropped, not refused."""
    geneval = Path(__file__).parents[2] / "data" / "flow_grpo" / "geneval"
    preset = ["+experiment=flow_grpo_geneval_sd35", f"prompts.path={geneval}", "reward=pickscore"]
    p = refused(preset)
    keys = ["reward.detector", "reward.colors"]
    assert "detector_model" not in str(p)
    assert p.key == "reward" and p.value == "pickscore" and all(k in p.reason for k in keys), str(p)
    assert "unknown key" not in str(p) and " ".join(f"~{k}" for k in keys) in str(p.fix)
    compose_and_validate([*preset, *(f"~{k}" for k in keys), "parity=none"])  # (the parity pins geneval)
    with pytest.raises(ConfigError) as e:  # a key the user typed keeps its own line
        compose_and_validate([*preset, "+reward.bogus=1"])
    assert any(q.key == "reward.bogus" and q.reason == "unknown key" for q in e.value.problems), str(e.value)


def test_issue43_a_bucket_as_the_compile_cache_is_refused_before_a_run_dir(tmp_path):
    """torch.compile's cache is TORCHINDUCTOR_CACHE_DIR, a local path: gs://b/c became a `gs:` folder in the working
    directory and a traceback after the run dir was written. Refused as xla.compilation_cache_dir=gs://... is."""
    proc, errors, cpu = front_end(tmp_path, ["+experiment=smoke", f"output_root={tmp_path}/out", *DIST,
                                             "distributed.compile_cache_dir=gs://bucket/cache"])
    assert_refused(tmp_path, proc, errors, "distributed.compile_cache_dir", "not a bucket", cpu)


def test_issue43_memory_figures_follow_the_resolution_of_every_image_family(tmp_path):
    """Qwen-Image at model.resolution=1024 passed --check on gpu-8 with its 512 px figures. The figures now follow the
    size: the softmax part is the family's own formula at the new sequence (catalog/families.py: 60 attentions x 24
    heads x S^2 x 4 bytes, S = image + 128 text tokens, 4096 image tokens at 1024 px), the rest grows with S."""
    from ddpo_tpu.catalog import FAMILIES
    from ddpo_tpu.catalog.families import QWEN_IMAGE_EAGER_GIB, memory_of
    from ddpo_tpu.catalog.memory_figures import GIB
    from ddpo_tpu.config import memory

    prompts = tmp_path / "p.txt"
    prompts.write_text("a photo of a cat\n")
    qwen = ["+experiment=qwen_image_grpo_pickscore", f"prompts.path={prompts}"]
    at_512 = compose_and_validate(qwen).cfg
    p = refused([*qwen, "model.resolution=1024"])
    assert p.key == "tpu_topology.name" and "activations per chip" in p.reason, str(p)
    figures = memory_of(FAMILIES.get("qwen_image"), at_512.model)  # as tabled, at 512 px
    at_1024 = memory._memory_for(FAMILIES.get("qwen_image"), at_512.model.model_copy(update={"resolution": 1024}))
    s = (4096 + 128) / (1024 + 128)
    scores = 60 * 24 * (4096 + 128) ** 2 * 4 / GIB
    assert at_1024.activation_gib_per_eval_512["no"] == pytest.approx(QWEN_IMAGE_EAGER_GIB["no"] * s + scores)
    assert memory._memory(at_512) is figures and figures.at_pixels(512).activation_gib_per_eval_512 == \
        pytest.approx(figures.activation_gib_per_eval_512)
    # a full-size checkpoint at resolution null samples at its own size (QwenImagePipeline: 1024 px), not 512
    native = memory._memory_for(FAMILIES.get("qwen_image"), at_512.model.model_copy(update={"resolution": None}))
    assert native.activation_gib_per_eval_512 == pytest.approx(at_1024.activation_gib_per_eval_512)
    # every family that reads model.resolution has figures that follow it (a 512 px table, or a function of the
    # model config as Wan's), and a video family's follow its frame count
    from ddpo_tpu.config.schema import ModelConfig

    walked = []
    for spec in FAMILIES:
        if spec.memory is None or not _full_models(spec.name):
            continue
        model = ModelConfig.model_validate(OmegaConf.to_container(OmegaConf.load(
            REPO / "conf" / "model" / f"{_full_models(spec.name)[0]}.yaml")))
        walked.append(spec.name)
        if spec.resolution_multiple is not None:
            small, big = (memory._memory_for(spec, model.model_copy(update={"resolution": r})) for r in (256, 768))
            assert big.activation_gib_per_eval_512["no"] > small.activation_gib_per_eval_512["no"] * 2, spec.name
        if spec.frame_step is not None:
            short, long = (memory._memory_for(spec, model.model_copy(update={"num_frames": n})) for n in (5, 33))
            assert long.activation_gib_per_eval_512["no"] > short.activation_gib_per_eval_512["no"] * 2, spec.name
    assert set(walked) == {"sd1", "sd3", "flux", "qwen_image", "wan", "flux2", "z_image", "qwen_image_edit"}, walked


def _full_models(family_name: str) -> list[str]:
    """conf/model options of a family that load a full-size checkpoint (builder null)."""
    out = []
    for path in sorted((REPO / "conf" / "model").glob("*.yaml")):
        text = path.read_text()
        if re.search(rf"^family:\s*{family_name}\b", text, flags=re.M) and re.search(r"^builder:\s*null", text,
                                                                                       flags=re.M):
            out.append(path.stem)
    return out
