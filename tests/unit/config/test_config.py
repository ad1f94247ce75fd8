"""Compose-time validation through the compose API (in-process): every experiment on every topology it claims, the
field notes' overrides, one negative test per rule of rules.check, the schema, and the parity report."""

from __future__ import annotations

import json
import os
import tempfile
import subprocess
import sys
from pathlib import Path

import pytest

from ddpo_tpu.config.compose import compose_and_validate, conf_dir
from ddpo_tpu.problems import ConfigError, Fix, Problem, as_typed
from tests.helpers import compose_and_validate_shared

pytestmark = pytest.mark.torch_free  # no torch in the test or what it starts (tests/conftest.py)

REPO = Path(__file__).resolve().parents[3]

PARITY_EXPERIMENTS = {
    "compressibility_parity": ("ddpo_pytorch_compressibility", 256, 64, "jpeg_compressibility"),
    "incompressibility_parity": ("ddpo_pytorch_incompressibility", 256, 64, "jpeg_incompressibility"),
    "aesthetic_parity": ("ddpo_pytorch_aesthetic", 256, 128, "aesthetic"),
}
# the aesthetic reward needs the LAION MLP weights (no hub default): a placeholder file stands in for them
AESTHETIC_MLP = Path(tempfile.mkdtemp()) / "sac+logos+ava1-l14-linearMSE.pth"
AESTHETIC_MLP.write_bytes(b"placeholder")
EXTRA = {"aesthetic_parity": [f"reward.mlp_path={AESTHETIC_MLP}"]}
SMOKE_TOPOLOGIES = {"eager_cpu": ("eager", 1), "cpu": ("xla", 1), "cpu_spmd4": ("xla_spmd", 4)}


# --- helpers ------------------------------------------------------------------------------------------------------


def fails(overrides: list[str]) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        compose_and_validate(list(overrides))
    return info.value


def problem(err: ConfigError, key: str) -> Problem:
    found = [p for p in err.problems if p.key == key]
    assert found, f"no problem names {key!r}; got:\n{err}"
    return found[0]


def row(validated, constraint: str) -> dict:
    rows = [r for r in validated.report if r["constraint"] == constraint]
    assert len(rows) == 1, f"{constraint!r} not in the parity report: {[r['constraint'] for r in validated.report]}"
    return rows[0]


def apply(overrides: list[str], assignments: list[str]) -> list[str]:
    out = list(overrides)
    for a in assignments:
        key = a.split("=", 1)[0]
        out = [o for o in out if o.split("=", 1)[0].lstrip("+~") != key] + [a]
    return out


def follow_fixes(overrides: list[str]) -> list[str]:
    """Apply the first suggested alternative of every problem once (what a user would type next)."""
    err = fails(overrides)
    assignments = [a for p in err.problems for a in p.suggested()]
    assert assignments, f"no problem suggests an override:\n{err}"
    return apply(overrides, assignments)


def test_a_fix_is_data_rendered_to_text():
    fix = Fix.of({"sample.batch_size": 2}, {"sample.batch_size": 1, "train.gradient_accumulation_steps": 4},
                 verb="try", note="(or auto)")
    assert fix.overrides() == ["sample.batch_size=2"]
    assert fix.overrides(1) == ["sample.batch_size=1", "train.gradient_accumulation_steps=4"]
    assert str(fix) == "try sample.batch_size=2, or sample.batch_size=1 train.gradient_accumulation_steps=4 (or auto)"
    assert Fix.of({"tpu_topology.pjrt_device": None, "train.ema": True}).overrides() == [
        "tpu_topology.pjrt_device=null", "train.ema=true"]
    assert Problem("k", 1, "r", fix).suggested() == ["sample.batch_size=2"]
    assert Problem("k", 1, "r", "prose").suggested() == []


# --- every experiment composes on every topology it claims --------------------------------------------------------


def test_experiment_list_is_the_tested_one():
    shipped = sorted(p.stem for p in (conf_dir() / "experiment").glob("*.yaml"))
    # the flow-matching experiments are composed in tests/unit/algorithms/test_algorithms.py, digits in
    # tests/learning/test_digits_learns.py
    flow = ["flow_grpo_smoke", "flow_grpo_pickscore_sd35", "flow_grpo_geneval_sd35", "flow_grpo_ocr_sd35"]
    flow += ["flux_grpo_smoke", "flux_grpo_pickscore"]  # composed in tests/unit/config/test_flux_config.py
    flow += ["nft_smoke"]  # composed in tests/unit/algorithms/test_nft.py
    flow += [f"nft_sd3_{n}" for n in ("pickscore", "geneval", "ocr", "hpsv2", "multi_reward")]  # test_nft_presets.py
    flow += ["wan_grpo_smoke"]  # composed in tests/unit/models/test_wan_model.py
    flow += ["wan22_grpo_smoke"]  # composed in tests/unit/models/test_wan22_model.py
    flow += ["qwen_image_grpo_smoke", "qwen_image_grpo_pickscore"]  # composed in unit/models/test_qwen_image_model.py
    flow += ["qwen_image_edit_grpo_smoke"]  # composed in unit/models/test_qwen_image_edit_model.py
    flow += ["flux2_grpo_smoke"]  # composed in tests/unit/models/test_flux2_model.py
    flow += ["z_image_grpo_smoke"]  # composed in tests/unit/models/test_z_image_model.py
    flow += ["dppo_smoke"]  # composed in tests/unit/algorithms/test_dppo.py
    flow += ["awm_smoke"]  # composed in tests/unit/algorithms/test_awm.py
    flow += [f"gardo_{n}" for n in ("sd3_ocr", "sd3_geneval", "sd3_compressibility",
                                    "flux_hps")]  # test_gardo_presets.py
    flow += ["gardo_smoke"]  # composed and run in tests/e2e/test_gardo_smoke.py
    assert shipped == sorted([*PARITY_EXPERIMENTS, "smoke", "digits", *flow]), \
        "a new experiment needs a compose test here"


@pytest.mark.parametrize("experiment", sorted(PARITY_EXPERIMENTS))
def test_parity_experiment_validates_on_v6e_8(experiment):
    parity, samples, train_batch, reward = PARITY_EXPERIMENTS[experiment]
    v = compose_and_validate([f"+experiment={experiment}", *EXTRA.get(experiment, [])])
    cfg = v.cfg
    assert cfg.tpu_topology.name == "v6e-8" and cfg.tpu_topology.replicas == 8
    assert cfg.tpu_topology.execution == "xla_spmd" and cfg.tpu_topology.pjrt_device == "TPU"
    assert cfg.parity.name == parity and cfg.reward.name == reward
    # the reference's values are the parity group's pins: each a report row, and every row is ok below
    pinned = {r["constraint"] for r in v.report if r["target"] is not None}
    assert {"sample.num_steps", "sample.eta", "sample.guidance_scale"} <= pinned, pinned
    assert row(v, "samples per epoch")["effective"] == samples
    assert row(v, "total train batch")["effective"] == train_batch
    bad = [r for r in v.report if not r["ok"]]
    assert not bad, bad
    assert v.tree["tpu_topology"]["name"] == "v6e-8" and "hydra" not in v.tree


@pytest.mark.parametrize("topology", sorted(SMOKE_TOPOLOGIES))
def test_smoke_validates_on_its_topologies(topology):
    execution, replicas = SMOKE_TOPOLOGIES[topology]
    overrides = ["+experiment=smoke"] + ([] if topology == "eager_cpu" else [f"tpu_topology={topology}"])
    v = compose_and_validate(overrides)
    assert v.cfg.tpu_topology.name == topology
    assert v.cfg.tpu_topology.execution == execution and v.cfg.tpu_topology.replicas == replicas
    assert v.cfg.model.builder == "tiny" and v.cfg.parity.name == "none" and v.cfg.run_name == "smoke"
    assert row(v, "samples per epoch")["effective"] == 8 * 2 * replicas
    assert row(v, "total train batch")["effective"] == 4 * 2 * replicas
    assert all(r["ok"] for r in v.report)


@pytest.mark.parametrize("topology", ["v6e-16", "v6e-4", "v4-64", "v4-8", "v5e-8"])
def test_compressibility_parity_on_other_topologies_with_the_suggested_values(topology):
    overrides = ["+experiment=compressibility_parity", f"tpu_topology={topology}"]
    chips = {"v6e-16": 16, "v6e-4": 4, "v4-64": 32, "v4-8": 4, "v5e-8": 8}[topology]
    if chips != 8:
        err = fails(overrides)
        for p in err.problems:  # only the per-replica arithmetic (or memory) is off, and each line says what to try
            assert p.key in ("sample.batch_size", "sample.num_batches_per_epoch",
                             "train.batch_size", "train.gradient_accumulation_steps"), str(err)
            assert isinstance(p.fix, Fix) and p.fix.verb == "try", str(err)
            assert f"x {chips} replicas" in p.reason or "GiB of activations per chip (estimate)" in p.reason, str(err)
        overrides = follow_fixes(overrides)
    v = compose_and_validate(overrides)  # one round of the printed suggestions is enough
    assert v.cfg.tpu_topology.replicas == chips
    # 2 samples x CFG a micro-step fuse 1 timestep on a 32 GiB chip and do not fit a v5e's 16 GiB without activation
    # checkpointing (estimate): auto checkpoints them; 1 sample fuses 2 timesteps without it
    assert row(v, "activation checkpointing")["effective"] == (v.cfg.train.batch_size >= 2)
    samples, train_batch = row(v, "samples per epoch"), row(v, "total train batch")
    assert (samples["target"], samples["effective"], samples["ok"]) == (256, 256, True)
    assert (train_batch["target"], train_batch["effective"], train_batch["ok"]) == (64, 64, True)
    assert row(v, "optimizer updates per epoch")["effective"] == 4
    s, t = v.cfg.sample, v.cfg.train
    assert s.batch_size * s.num_batches_per_epoch * chips == 256
    assert t.batch_size * t.gradient_accumulation_steps * chips == 64
    assert s.batch_size >= t.batch_size and s.batch_size % t.batch_size == 0


# --- the field notes' overrides -----------------------------------------------------------------------------------


def test_field_note_overrides_verbatim():
    line = ("sample.batch_size=4 sample.num_batches_per_epoch=8 train.batch_size=2 "
            "train.gradient_accumulation_steps=4 num_epochs=100 save_freq=1")
    v = compose_and_validate(["+experiment=compressibility_parity", *line.split()])
    c = v.cfg
    assert (c.sample.batch_size, c.sample.num_batches_per_epoch) == (4, 8)
    assert (c.train.batch_size, c.train.gradient_accumulation_steps) == (2, 4)
    assert (c.num_epochs, c.save_freq) == (100, 1)
    assert row(v, "samples per epoch")["effective"] == 256 and row(v, "total train batch")["effective"] == 64


@pytest.mark.parametrize("steps", [1, 20, 100])
@pytest.mark.parametrize("base", [[], ["+experiment=compressibility_parity"]], ids=["default", "compressibility"])
def test_sample_num_steps_with_parity_none(base, steps):
    v = compose_and_validate([*base, "parity=none", f"sample.num_steps={steps}"])
    assert v.cfg.sample.num_steps == steps and v.cfg.parity.name == "none"
    assert row(v, "train timesteps per sample")["effective"] == steps
    assert all(r["ok"] for r in v.report)


def test_sample_num_steps_without_parity_none_is_pinned():
    err = fails(["+experiment=compressibility_parity", "sample.num_steps=20"])
    assert "parity=none" in str(problem(err, "sample.num_steps").fix)


# --- one negative test per rule -----------------------------------------------------------------------------------

V5E_SMALL = ["tpu_topology=v5e-8", "tpu_topology.hbm_gib_per_chip=8", "model=sd14", "model.lora.enabled=false"]
CPU_2HOSTS = ["tpu_topology=cpu_spmd4", "tpu_topology.hosts=2", "tpu_topology.chips_per_host=2",
              "tpu_topology.processes=2"]
COMP = "+experiment=compressibility_parity"

RULES = [
    # topology
    ("chips", ["tpu_topology=v6e-16", "tpu_topology.chips=12"], "tpu_topology.chips",
     ["4 hosts x 4 chips per host = 16", "set tpu_topology.chips=16"]),
    ("processes", ["tpu_topology=v6e-16", "tpu_topology.processes=1"], "tpu_topology.processes",
     ["4 hosts", "set tpu_topology.processes=4"]),
    ("pjrt_device_eager", ["tpu_topology.pjrt_device=CPU"], "tpu_topology.pjrt_device",
     ["eager", "set tpu_topology.pjrt_device=null"]),
    ("pjrt_device_cpu_xla", ["tpu_topology=cpu", "tpu_topology.pjrt_device=TPU"], "tpu_topology.pjrt_device",
     ["set tpu_topology.pjrt_device=CPU"]),
    ("pjrt_device_tpu", ["tpu_topology=v6e-8", "tpu_topology.pjrt_device=CPU"], "tpu_topology.pjrt_device",
     ["tpu_v6e", "set tpu_topology.pjrt_device=TPU"]),
    ("eager_on_tpu", ["tpu_topology=v6e-1", "tpu_topology.execution=eager", "tpu_topology.pjrt_device=null"],
     "tpu_topology.execution", ["TPUs run through XLA", "xla"]),
    ("eager_many_chips", ["tpu_topology=cpu_spmd4", "tpu_topology.execution=eager", "tpu_topology.pjrt_device=null"],
     "tpu_topology.execution", ["4 chips", "set tpu_topology.execution=xla_spmd"]),
    ("xla_many_chips", ["tpu_topology=v6e-8", "tpu_topology.execution=xla"], "tpu_topology.execution",
     ["8 chips", "set tpu_topology.execution=xla_spmd"]),
    ("mesh_product", ["tpu_topology=cpu_spmd4", "tpu_topology.mesh.dp=2"], "tpu_topology.mesh.dp",
     ["dp 2 x fsdp 1 = 2 devices", "4 chips", "set tpu_topology.mesh.dp=4"]),
    ("host_local", ["tpu_topology=v6e-16", "tpu_topology.mesh.layout=host_local"], "tpu_topology.mesh.layout",
     ["set tpu_topology.mesh.dp=4 tpu_topology.mesh.fsdp=4"]),
    ("fsdp_across_hosts", ["tpu_topology=v6e-16", "tpu_topology.mesh.dp=2", "tpu_topology.mesh.fsdp=8"],
     "tpu_topology.mesh.fsdp", ["inside one host (4 chips)", "set tpu_topology.mesh.fsdp=4 tpu_topology.mesh.dp=4"]),
    ("cpu_multi_host", CPU_2HOSTS, "tpu_topology.hosts", ["one host", "set tpu_topology.hosts=1"]),
    # the reference's batch rules
    ("train_batch_larger", ["train.batch_size=8"], "train.batch_size",
     ["sample batch 4", "train batch 8", "try train.batch_size=4"]),
    ("train_batch_not_divisor", ["sample.batch_size=6", "train.batch_size=4"], "train.batch_size",
     ["try train.batch_size=3"]),
    ("samples_not_multiple", ["sample.batch_size=4", "sample.num_batches_per_epoch=1", "train.batch_size=2",
                              "train.gradient_accumulation_steps=4"], "train.gradient_accumulation_steps",
     ["4 samples/epoch", "total train batch 8", "try train.gradient_accumulation_steps=2"]),
    ("timestep_fraction", ["train.timestep_fraction=0.1"], "train.timestep_fraction",
     ["int(8 steps x 0.1) = 0", "train.timestep_fraction=0.125 or more"]),
    # parity arithmetic
    ("parity_sample_batch", [COMP, "sample.batch_size=3"], "sample.batch_size",
     ["3 x 8 batches x 8 replicas = 192 samples/epoch", "needs 256", "try sample.batch_size=4"]),
    ("parity_sample_batches", [COMP, "sample.num_batches_per_epoch=4"], "sample.num_batches_per_epoch",
     ["= 128 samples/epoch", "needs 256", "sample.num_batches_per_epoch=8"]),
    ("parity_accumulation", [COMP, "train.gradient_accumulation_steps=2"], "train.gradient_accumulation_steps",
     ["= 32 per optimizer step", "needs 64", "train.gradient_accumulation_steps=4"]),
    ("parity_train_batch", [COMP, "train.batch_size=1"], "train.batch_size",
     ["= 32 per optimizer step", "needs 64", "try train.batch_size=2"]),
    # pinned keys, one per kind of value
    ("pinned_float", [COMP, "train.clip_range=0.2"], "train.clip_range",
     ["pins 0.0001", "set train.clip_range=0.0001", "parity=none"]),
    ("pinned_int", [COMP, "sample.num_steps=20"], "sample.num_steps", ["pins 50", "set sample.num_steps=50"]),
    ("pinned_top_level", [COMP, "num_epochs=10"], "num_epochs", ["pins 100", "set num_epochs=100"]),
    ("pinned_eta", [COMP, "sample.eta=0.5"], "sample.eta", ["pins 1.0"]),
    ("pinned_bool", [COMP, "train.cfg=false"], "train.cfg", ["train.cfg=false: ", "pins true"]),
    ("pinned_nested_bool", [COMP, "model.lora.enabled=false"], "model.lora.enabled", ["pins true"]),
    ("pinned_model", [COMP, "model=sd15"], "model.name", ["sd15", "pins sd14"]),
    ("pinned_prompts", [COMP, "prompts=simple_animals"], "prompts.name", ["pins imagenet_animals"]),
    ("gather_host_on_pod", [COMP, "tpu_topology=v6e-16", "sample.num_batches_per_epoch=4",
                            "train.gradient_accumulation_steps=2", "xla.gather=host"], "xla.gather",
     ["xla.gather=device"]),
    ("pinned_reward", [COMP, "reward=jpeg_incompressibility"], "reward.name", ["pins jpeg_compressibility"]),
    ("pinned_stat_tracking", [COMP, "stat_tracking.buffer_size=32"], "stat_tracking.buffer_size", ["pins 16"]),
    ("aesthetic_needs_mlp", ["+experiment=aesthetic_parity"], "reward.mlp_path", ["LAION", "reward.mlp_path="]),
    ("aesthetic_mlp_missing", ["+experiment=aesthetic_parity", "reward.mlp_path=/nope.pth"], "reward.mlp_path",
     ["not found"]),
    ("pinned_aesthetic_epochs", ["+experiment=aesthetic_parity", "num_epochs=100"], "num_epochs",
     ["ddpo_pytorch_aesthetic pins 200"]),
    ("pinned_key_missing", [COMP, "+parity.pinned.train.foo=1"], "parity.pinned.train.foo",
     ["pins a key the config does not have"]),
    # cross-key ranges
    ("min_count", ["stat_tracking.min_count=32"], "stat_tracking.min_count",
     ["buffer_size=16", "stat_tracking.min_count=16 or fewer"]),
    ("model_builder_and_pretrained", ["model.pretrained=CompVis/stable-diffusion-v1-4"], "model.pretrained",
     ["exactly one"]),
    ("model_neither", ["model=sd14", "model.pretrained=null"], "model.pretrained", ["exactly one"]),
    ("model_local_path_missing", ["model=sd14", "model.pretrained=/nonexistent/ddpo_tpu_test/sd14"],
     "model.pretrained", ["no such directory"]),
    ("model_relative_path_missing", ["model=sd14", "model.pretrained=./no_such_ddpo_tpu_dir"],
     "model.pretrained", ["no such directory"]),
    ("bf16_weights", ["model.dtype=bfloat16"], "model.dtype", ["train.mixed_precision=bf16"]),
    ("full_finetune_small_hbm", V5E_SMALL, "model.lora.enabled",
     ["15.8 GiB per chip with fsdp=1, the chip has 8.0", "tpu_topology.mesh.fsdp=4 tpu_topology.mesh.dp=2 splits it",
      "set model.lora.enabled=true"]),
    ("full_finetune_fsdp_too_small", [*V5E_SMALL, "tpu_topology.mesh.dp=4", "tpu_topology.mesh.fsdp=2"],
     "model.lora.enabled", ["9.4 GiB per chip with fsdp=2", "tpu_topology.mesh.fsdp=4"]),
    ("prompts_file_unset", ["prompts=from_file", "prompts.file=null"], "prompts.file", ["needs a file"]),
    ("prompts_file_missing", ["prompts=from_file", "prompts.file=/nonexistent/ddpo_tpu_prompts.txt"],
     "prompts.file", ["file not found"]),
    ("nouns_file_missing", ["prompts=nouns_activities", "prompts.nouns_file=/nonexistent/nouns.txt"],
     "prompts.nouns_file", ["file not found"]),
    ("activities_file_missing", ["prompts=nouns_activities", "prompts.activities_file=/nonexistent/act.txt"],
     "prompts.activities_file", ["file not found"]),
    ("resume_missing", ["resume=/nonexistent/ddpo_tpu_ckpt"], "resume", ["no such checkpoint", "resume=auto"]),
    ("compilation_cache_dir_empty", ["xla.compilation_cache_dir=''"], "xla.compilation_cache_dir",
     ["empty path"]),
    ("profile_steps_negative", ["xla.profile_steps=[3,-1]"], "xla.profile_steps", [">= 0"]),
    # inputs (more, through the real front end, in test_bad_input.py)
    ("run_name_dotdot", ["run_name=.."], "run_name", ["parent", "run_name=ddpo"]),
    ("output_root_empty", ["output_root="], "output_root", ["empty path", "output_root=outputs"]),
    ("profile_steps_beyond_run", ["xla.profile_steps=[1,8]"], "xla.profile_steps",
     ["[8] never run", "2 optimizer steps per epoch x 4 epochs", "below 8"]),
    ("evaluation_beyond_run", ["evaluation.every_n_epochs=5"], "evaluation.every_n_epochs",
     ["4 epochs", "evaluation.every_n_epochs=4 or fewer"]),
    ("xla_flag_malformed", ["xla.flags=[xla_dump_to]"], "xla.flags[0]", ["--name=value"]),
    ("reward_url_scheme", ["reward=remote", "reward.url=ftp://h/x"], "reward.url", ["http://", "reward.url="]),
    ("weighted_unknown_reward", ["reward=weighted", "reward.components=[{name:nope,weight:1}]"],
     "reward.components.0.name", ["no reward of this name goes here", "jpeg_compressibility, "]),
    ("reward_unknown_name", ["reward.name=nope"], "reward.name",
     ["no reward of this name goes here", "choose one of: jpeg_compressibility, ",
      ", remote, digit_classifier, ocr, geneval, vlm_judge, edit_consistency, weighted"]),
    ("reward_name_missing", ["~reward.name"], "reward.name", ["required key is missing", "jpeg_compressibility"]),
    ("reward_key_of_another_reward", ["reward=remote", "+reward.mlp_path=/x.pth"], "reward.mlp_path",
     ["unknown key", "valid keys here: backoff_s, batch_size, frame_reduction, headers, host_workers, image_format, "
                     "name, process, retries"]),
    ("reward_wrong_type", ["reward=remote", "reward.retries=many"], "reward.retries", ["valid integer"]),
    ("weighted_component_wrong_type", ["reward=weighted", "reward.components=[{name:remote,url:'http://h:1/s',"
                                       "timeout_s:-1}]"], "reward.components.0.timeout_s", ["greater than 0"]),
    ("weighted_component_mlp_missing", ["reward=weighted", "reward.components=[{name:aesthetic,mlp_path:/nope.pth}]"],
     "reward.components.0.mlp_path", ["not found"]),
    ("tiny_mlp_with_real_clip", ["reward=aesthetic", "reward.clip_model=openai/clip-vit-large-patch14"],
     "reward.mlp_path", ["pairs with a tiny clip_model", "set reward.clip_model=tiny"]),
    ("tiny_pickscore_with_real_processor", ["reward=pickscore", "reward.processor=laion/x"], "reward.clip_model",
     ["pairs with a tiny processor", "set reward.processor=tiny"]),
]


@pytest.mark.parametrize("overrides,key,fragments", [r[1:] for r in RULES], ids=[r[0] for r in RULES])
def test_rule_names_key_and_fix(overrides, key, fragments):
    err = fails(overrides)
    p = problem(err, key)
    text = str(err)
    assert f"{key}=" in text
    assert p.reason and p.fix, p  # a reason and a fix, rendered as "key=value: reason (fix)"
    assert str(p) == f"{p.key}={as_typed(p.value) if p.value is None or isinstance(p.value, bool) else p.value}: " \
                     f"{p.reason} ({p.fix})"  # (a value as typed: null, true)
    assert str(p) in text.splitlines()
    for fragment in fragments:
        assert fragment in text, f"{fragment!r} not in:\n{text}"
    assert "Traceback" not in text


def test_problem_value_is_the_offending_value():
    err = fails([COMP, "sample.batch_size=3"])
    assert problem(err, "sample.batch_size").value == 3
    assert str(err).splitlines()[0].startswith("sample.batch_size=3: 3 x 8 batches x 8 replicas = 192 samples/epoch")
    assert str(err).splitlines()[0].endswith("(try sample.batch_size=4)")


def test_every_problem_is_reported_at_once():
    err = fails(["stat_tracking.min_count=32", "model.dtype=bfloat16", "resume=/nonexistent/ddpo_tpu_ckpt"])
    assert {p.key for p in err.problems} >= {"stat_tracking.min_count", "model.dtype", "resume"}
    assert len(str(err).splitlines()) == len(err.problems)


XLA = "tpu_topology=cpu"


def test_rules_do_not_over_fire(tmp_path):
    """Each case's composition shares its group choices' (tests.helpers.compose_and_validate_shared: the same config,
    test_shared_composition_is_hydras holds them equal); ~30 compositions of 0.5 s were most of this test."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat\na dog\n")
    for sub in ("unet", "vae", "text_encoder", "tokenizer", "scheduler"):  # what models/loading.py loads
        (tmp_path / "sd" / sub).mkdir(parents=True)
    (tmp_path / "checkpoints" / "epoch_0001").mkdir(parents=True)
    (tmp_path / "checkpoints" / "epoch_0001" / "state.json").write_text("{}")
    for overrides in (
        ["model.dtype=bfloat16", "train.mixed_precision=bf16"],
        ["prompts=from_file", f"prompts.file={prompts}"],
        ["prompts=nouns_activities", f"prompts.nouns_file={prompts}", f"prompts.activities_file={prompts}"],
        [f"resume={tmp_path}"], [f"resume={tmp_path / 'checkpoints' / 'epoch_0001'}"], ["resume=never"],
        ["model=sd14", f"model.pretrained={tmp_path / 'sd'}"],
        # xla.* keys on an XLA topology (an eager one does not read them: config/enablement.py)
        [XLA, "xla.profile_steps=[0,5]"], [XLA, "xla.compilation_cache_dir=null"],
        [XLA, f"xla.compilation_cache_dir={tmp_path}"], [XLA, f"xla.compilation_cache_dir={tmp_path}/new/cache"],
        [XLA, "num_epochs=1", "xla.profile_steps=[0]"], [XLA, 'xla.flags=["--xla_dump_to=/tmp/dump","--xla_foo"]'],
        [XLA, 'xla.libtpu_init_args=["--xla_tpu_x=true"]'],
        ["evaluation.every_n_epochs=4", "num_epochs=4"], ["run_name=a.b"], ["output_root=./runs"],
        ["prompts=nouns_activities", "prompts.nouns_file=simple_animals.txt"],  # a shipped list by name
        ["reward=remote", "reward.url=https://example.com:8443/score"], ["reward=weighted"],
        ["logger=wandb", "logger.entity=me", "logger.group=g", "logger.tags=[a,b]", "logger.notes=n"],
        ["tpu_topology=v6e-16", "tpu_topology.mesh.layout=host_local", "tpu_topology.mesh.dp=4",
         "tpu_topology.mesh.fsdp=4"],
        ["tpu_topology=cpu_spmd4", "tpu_topology.mesh.dp=2", "tpu_topology.mesh.fsdp=2"],
        ["tpu_topology=v6e-16", "tpu_topology.mesh.dp=8", "tpu_topology.mesh.fsdp=2"],  # fsdp inside a host
        [*V5E_SMALL, "tpu_topology.mesh.dp=2", "tpu_topology.mesh.fsdp=4"],  # full fine-tune split 4 ways
        ["train.timestep_fraction=0.125"],
        ["stat_tracking.min_count=16", "stat_tracking.buffer_size=16"],
        ["tpu_topology=v5e-8", "model=sd14", "model.lora.enabled=false"],  # 16 GiB is enough
        [COMP, "train.learning_rate=0.0003", "sample.eta=1"],  # equal values in another spelling keep parity
    ):
        compose_and_validate_shared(overrides)


@pytest.mark.hydra_compose  # compose_and_validate below composes with Hydra whole
@pytest.mark.parametrize("overrides", [
    [XLA, 'xla.flags=["--xla_dump_to=/tmp/dump","--xla_foo"]', "xla.profile_steps=[0]", "num_epochs=1"],
    ["+experiment=flow_grpo_smoke", "seed=3", "sample.num_steps=4", "run_name=a.b"],
    [COMP, "sample.batch_size=3", "stat_tracking.min_count=32"],  # refused by validation
    ["+experiment=smoke", "prompts.path=x", "+prompts.extra=1"],  # refused by composition
    ["prompts=dataset", "prompts.path=[a"],  # the override's grammar
])
def test_shared_composition_is_hydras(overrides):
    """tests.helpers.compose_and_validate_shared gives what compose_and_validate gives: the same config (nested and
    top-level values, lists, an added key) or the same problems."""
    def outcome(fn):
        try:
            v = fn(overrides)
        except ConfigError as e:
            return [str(p) for p in e.problems] or e.context
        return v.tree, v.cfg

    assert outcome(compose_and_validate_shared) == outcome(compose_and_validate)


# following the printed fix of a single mistake gives a valid config
FOLLOW = [
    pytest.param(["tpu_topology=v6e-16", "tpu_topology.processes=1"], id="processes"),
    pytest.param(["tpu_topology.pjrt_device=CPU"], id="pjrt_device_eager"),
    pytest.param(["tpu_topology=v6e-8", "tpu_topology.pjrt_device=CPU"], id="pjrt_device_tpu"),
    pytest.param(["tpu_topology=v6e-8", "tpu_topology.execution=xla"], id="xla_many_chips"),
    pytest.param(["tpu_topology=cpu_spmd4", "tpu_topology.mesh.dp=2"], id="mesh_dp"),
    pytest.param(["tpu_topology=v6e-16", "tpu_topology.mesh.layout=host_local"], id="host_local"),
    pytest.param(["tpu_topology=v6e-16", "tpu_topology.mesh.dp=2", "tpu_topology.mesh.fsdp=8"],
                 id="fsdp_across_hosts"),
    pytest.param(["train.batch_size=8"], id="train_batch_larger"),
    pytest.param(["sample.batch_size=6", "train.batch_size=4"], id="train_batch_not_divisor"),
    pytest.param(["sample.batch_size=4", "sample.num_batches_per_epoch=1", "train.gradient_accumulation_steps=4"],
                 id="samples_not_multiple"),
    pytest.param(["train.timestep_fraction=0.1"], id="timestep_fraction_8_steps"),
    pytest.param(["sample.num_steps=50", "train.timestep_fraction=0.01"], id="timestep_fraction_50_steps"),
    pytest.param(["sample.num_steps=3", "train.timestep_fraction=0.1"], id="timestep_fraction_3_steps"),
    pytest.param(["tpu_topology=v6e-8", "tpu_topology.mesh.fsdp=3"], id="mesh_fsdp_not_divisor"),
    pytest.param([COMP, "sample.batch_size=3"], id="parity_sample_batch"),
    pytest.param([COMP, "sample.num_batches_per_epoch=3"], id="parity_sample_batches"),
    pytest.param(["tpu_topology=v6e-16", "tpu_topology.chips=12"], id="chips_typo"),
    pytest.param(["tpu_topology=v6e-8", "tpu_topology.execution=eager"], id="eager_on_tpu"),
    pytest.param([COMP, "train.clip_range=0.2"], id="pinned"),
    pytest.param([COMP, "model=sd15"], id="pinned_model"),
    pytest.param([COMP, "train.batch_size=4"], id="parity_train_batch"),
    pytest.param(["model.dtype=bfloat16"], id="bf16_weights"),
    # 12 GiB: too small for the full fine-tune, enough for LoRA's 1 sample without CFG (the activation estimate)
    pytest.param([*V5E_SMALL, "tpu_topology.hbm_gib_per_chip=12", "train.cfg=false", "train.batch_size=1"],
                 id="full_finetune_small_hbm"),
    pytest.param(["resume=/nonexistent/ddpo_tpu_ckpt"], id="resume"),
]


@pytest.mark.parametrize("overrides", FOLLOW)
def test_following_the_fix_gives_a_valid_config(overrides):
    compose_and_validate(follow_fixes(overrides))


# --- the schema ---------------------------------------------------------------------------------------------------


def test_unknown_key_appended():
    err = fails(["+train.foo=1"])
    p = problem(err, "train.foo")
    assert "unknown key" in p.reason and p.value == 1
    assert "batch_size" in str(p.fix) and "clip_range" in str(p.fix)  # the valid keys of that section


def test_unknown_key_without_plus():
    err = fails(["train.foo=1"])  # Hydra refuses it during composition
    p = problem(err, "train.foo")
    assert "unknown key" in p.reason and p.fix
    assert "Traceback" not in str(err)


def test_unknown_top_level_key():
    assert "unknown key" in problem(fails(["+foo=1"]), "foo").reason


@pytest.mark.parametrize("overrides,key,reason,fix", [
    # a near miss of a real key: the key it resembles (a new word gets no guess)
    (["+experiment=smoke", "sample.batch_sise=3"], "sample.batch_sise", "unknown key",
     "did you mean sample.batch_size?"),
    (["train.lerning_rate=1e-4"], "train.lerning_rate", "unknown key", "did you mean train.learning_rate?"),
    # a group outside the defaults list selected without its +
    (["experiment=smoke"], "experiment", "added to the defaults, not overridden", "use +experiment=smoke"),
    # Hydra's sweep syntax without -m
    (["+experiment=smoke", "seed=1,2"], "seed", "a comma list is a sweep", "add -m"),
])
def test_the_usual_hydra_slips_get_their_fix(overrides, key, reason, fix):
    p = problem(fails(overrides), key)
    assert reason in p.reason and fix in str(p.fix), p


def test_a_new_word_is_not_guessed():
    p = problem(fails(["sample.totally_new=3"]), "sample.totally_new")
    assert "did you mean" not in str(p.fix) and "--cfg job" in str(p.fix)


@pytest.mark.parametrize("override,key,expected", [
    ("train.batch_size=x", "train.batch_size", "integer"),
    ("train.batch_size=1.5", "train.batch_size", "integer"),
    ("train.batch_size='4'", "train.batch_size", "integer"),  # strict: a string is not an int
    ("sample.eta=true", "sample.eta", "number"),
    ("train.cfg=1", "train.cfg", "boolean"),
    ("train.mixed_precision=fp16", "train.mixed_precision", "'bf16'"),
    ("tpu_topology.execution=jit", "tpu_topology.execution", "xla_spmd"),
])
def test_wrong_type(override, key, expected):
    p = problem(fails([override]), key)
    assert expected in p.reason and p.fix


@pytest.mark.parametrize("override,key,expected", [
    ("sample.eta=0", "sample.eta", "greater than 0"),
    ("sample.eta=1.5", "sample.eta", "less than or equal to 1"),
    ("train.clip_range=-1", "train.clip_range", "greater than 0"),
    ("train.clip_range=1", "train.clip_range", "less than 1"),
    ("train.batch_size=0", "train.batch_size", "greater than or equal to 1"),
    ("sample.num_steps=0", "sample.num_steps", "greater than or equal to 1"),
    ("xla.debug_level=3", "xla.debug_level", "less than or equal to 2"),
    ("seed=-1", "seed", "greater than or equal to 0"),
    ("run_name=a/b", "run_name", "pattern"),
])
def test_out_of_range(override, key, expected):
    p = problem(fails([override]), key)
    assert expected in p.reason, p
    assert str(p).startswith(f"{key}={override.split('=', 1)[1]}: ")


@pytest.mark.parametrize("override,group", [("model=nope", "model"), ("tpu_topology=v7", "tpu_topology"),
                                            ("+experiment=nope", "experiment")])
def test_unknown_group_option_names_the_group(override, group):
    err = fails([override])
    assert err.problems[0].key == group and "no such option" in err.problems[0].reason
    assert "Traceback" not in str(err)


def test_unknown_group_option_lists_the_valid_options():
    p = fails(["model=nope"]).problems[0]
    for option in ("sd14", "sd15", "tiny"):
        assert option in str(p.fix), p


def test_missing_mandatory_value():
    err = fails(["prompts=from_file"])
    p = problem(err, "prompts.file")
    assert p.value == "???" and "required" in p.reason and "prompts.file=" in str(p.fix)


# --- no torch at validation time; the parity report ---------------------------------------------------------------


def test_validation_leaves_torch_unimported(tmp_path):
    code = (
        "import sys\n"
        "from ddpo_tpu.config.compose import compose_and_validate\n"
        "v = compose_and_validate(['+experiment=compressibility_parity'])\n"
        "assert v.cfg.tpu_topology.name == 'v6e-8'\n"
        "import ddpo_tpu.train, ddpo_tpu.env\n"
        "ddpo_tpu.train.preflight(['+experiment=smoke', 'tpu_topology=cpu_spmd4'])\n"
        "heavy = [m for m in ('torch', 'torch_xla', 'diffusers', 'transformers', 'peft') "
        "if sys.modules.get(m) is not None]\n"
        "print('HEAVY', heavy)\n"
        "assert not heavy, heavy\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in _owned()}
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    # in tmp_path: preflight takes the run dir's lock, outputs/smoke/lock under the working directory
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "HEAVY []" in p.stdout and (tmp_path / "outputs" / "smoke" / "lock").exists()


def _owned():
    from ddpo_tpu.env import OWNED_VARIABLES

    return OWNED_VARIABLES


def test_parity_report_of_compressibility_parity():
    v = compose_and_validate([COMP])
    assert all(r["ok"] for r in v.report), [r for r in v.report if not r["ok"]]
    expected = {"samples per epoch": (256, 256), "total train batch": (64, 64),
                "optimizer updates per epoch": (4, 4), "replicas (tpu_topology)": (None, 8),
                "train timesteps per sample": (None, 50)}
    for constraint, (target, effective) in expected.items():
        r = row(v, constraint)
        assert (r["target"], r["effective"]) == (target, effective), r
    pinned = {r["constraint"]: r for r in v.report}
    for key, value in [("train.clip_range", 1e-4), ("sample.num_steps", 50), ("train.learning_rate", 3e-4),
                       ("model.name", "sd14"), ("prompts.name", "imagenet_animals"),
                       ("stat_tracking.min_count", 16)]:
        assert pinned[key]["target"] == value and pinned[key]["effective"] == value and pinned[key]["ok"]
    json.dumps(v.report)  # saved as parity.json in the run dir


def test_parity_report_marks_drift_when_validating_a_tree_directly():
    # the report itself flags a violated row (what the rules turn into an error)
    from ddpo_tpu.config import rules
    from ddpo_tpu.config.schema import RunConfig

    tree = compose_and_validate([COMP]).tree
    tree = json.loads(json.dumps(tree))
    tree["train"]["clip_range"] = 0.2
    tree["sample"]["batch_size"] = 2
    cfg = RunConfig.model_validate(tree)
    rows = {r["constraint"]: r for r in rules.parity_report(cfg, tree)}
    assert rows["train.clip_range"]["ok"] is False and rows["train.clip_range"]["effective"] == 0.2
    assert rows["samples per epoch"]["ok"] is False and rows["samples per epoch"]["effective"] == 128
    assert rows["total train batch"]["ok"] is True
