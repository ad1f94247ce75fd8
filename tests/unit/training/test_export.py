"""The exported weights load into the real diffusers pipelines and peft and give the trained model's outputs
(training/export.py, ddpo_tpu/export.py; issue 39 item 6).

Each family's tiny build (SD 1.x, SD 3, FLUX, Wan, Qwen-Image) gets a trained-looking LoRA (tests/helpers
`family_with_trained_adapter`), saved as the trainer saves it (RunDir.save_weights) and exported from that file as
`ddpo-export` does. The loaded copies then stand in for
our denoiser in our own sampler (diffusion/sampling.py `sample_trajectory`, the family's SDE step, the same seeded
noise): the final latents and the decoded images must equal those of the trained model. The base model's (adapter
off) differ, so a load that silently dropped the LoRA fails the test.

What the loaders expect, from diffusers 0.42.1: loaders/lora_pipeline.py (StableDiffusionLoraLoaderMixin
.load_lora_weights/.save_lora_weights :138-526, `unet.` prefix; SD3LoraLoaderMixin :964-1250 and
FluxLoraLoaderMixin :1441-1870, `transformer.` prefix), utils/peft_utils.py `_create_lora_config` :491-510 (the
metadata's LoraConfig, else alpha = rank); peft 0.21.2 PeftModel.from_pretrained (keys under `base_model.model.`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO, family_with_trained_adapter, run_train

# family -> the overrides of its smoke experiment, made short (few steps: the test compares, it does not train)
# (the smoke experiment trains the whole tiny UNet: its LoRA is turned on here)
CONFIGS = {
    "sd1": ["+experiment=smoke", "sample.num_steps=3", "model.lora.enabled=true"],
    "sd3": ["+experiment=flow_grpo_smoke", "sample.num_steps=3"],
    "flux": ["+experiment=flux_grpo_smoke", "sample.num_steps=3"],
    "wan": ["+experiment=wan_grpo_smoke", "sample.num_steps=3"],
    "qwen_image": ["+experiment=qwen_image_grpo_smoke", "sample.num_steps=3", "sample.sde_window.size=2"],
    "flux2": ["+experiment=flux2_grpo_smoke", "sample.num_steps=3", "sample.sde_window.size=2"],
    "z_image": ["+experiment=z_image_grpo_smoke", "sample.num_steps=3"],
    "qwen_image_edit": ["+experiment=qwen_image_edit_grpo_smoke", "sample.num_steps=3", "sample.sde_window.size=2"],
}
PROMPTS = ["a cat", "a red bicycle"]
EDIT_PROMPTS = ["make the square red", "make the square blue"]  # the edit family's prompts name their pictures


def prompts_of(fam) -> list[str]:
    return EDIT_PROMPTS if fam.name == "qwen_image_edit" else PROMPTS
# the loaded model computes what ours does (measured: 0, every family and format, torch 2.9 CPU): the bound leaves
# room for another BLAS ordering the same operations differently
REL_TOL = 1e-6


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def trained(request, model_cache, tmp_path_factory):
    """(family, weights dir holding final.safetensors and its exports)."""
    from ddpo_tpu.rundir.files import RunDir
    from ddpo_tpu.training.export import export_saved

    fam = family_with_trained_adapter([*CONFIGS[request.param], f"model.cache_dir={model_cache}"])
    run = RunDir(tmp_path_factory.mktemp(f"run_{request.param}"))
    path = run.save_weights("final", {k: v.cpu() for k, v in fam.trainable_state().items()})
    export_saved(path.parent, "final", fam.cfg.model)
    return fam, path.parent


def sample(fam, denoiser=None):
    """Our sampler's final latents and images with `denoiser` in place of the family's model (None: the model)."""
    from ddpo_tpu.diffusion.sampling import sample_trajectory

    fam.denoiser = denoiser
    try:
        gen = torch.Generator().manual_seed(7)
        prompts = prompts_of(fam)
        shape, steps = (len(prompts), *fam.latent_shape), fam.num_steps
        init, noise = torch.randn(shape, generator=gen), torch.randn((steps, *shape), generator=gen)
        with torch.no_grad():
            traj = sample_trajectory(fam.make_denoise_step(None), steps, fam.encode(prompts),
                                     fam.encode([""] * len(prompts)), init, noise, rt=fam.rt, sync_every=0)
            return traj.sample.float(), fam.decode(traj.sample)
    finally:
        fam.denoiser = None


def assert_same_as_trained(fam, denoiser, what: str):
    """`denoiser` samples what the trained model samples: latents within REL_TOL of their scale, images equal; and
    the base model does not (the comparison would see a dropped or mis-scaled LoRA)."""
    ours_x, ours_img = sample(fam)
    x, img = sample(fam, denoiser)
    scale = ours_x.abs().max()
    rel = float((x - ours_x).abs().max() / scale)
    print(f"{what}: max |latents - trained| / max |trained| = {rel:.1e}")  # shown with pytest -s
    assert rel <= REL_TOL, f"{what}: latents differ from the trained model's by {rel:.2e} of their scale"
    assert torch.equal(img, ours_img), f"{what}: images differ"
    with fam.reference():
        base_x, _ = sample(fam)
    assert float((base_x - ours_x).abs().max() / scale) > 1e-3, "the adapter does not change the samples"


def base_pipeline(fam):
    import diffusers

    from ddpo_tpu.training.export import checkpoint_source, family_export

    source, _, _ = checkpoint_source(fam.cfg.model)
    cls = getattr(diffusers, family_export(fam.name).pipeline)
    # the tiny SD 3 has no T5 (as SD 3 allows): its pipeline is told so
    extra = {"text_encoder_3": None, "tokenizer_3": None} if fam.name == "sd3" else {}
    if fam.name == "qwen_image_edit":  # its processor without the video part (models/qwen_image_edit.make_processor)
        extra = {"processor": fam.c.processor}
    return cls.from_pretrained(source, local_files_only=True, **extra)


def component(fam, pipe):
    from ddpo_tpu.training.export import family_export

    return getattr(pipe, family_export(fam.name).component)


# --- LoRA -----------------------------------------------------------------------------------------------------------

def test_the_diffusers_lora_loads_with_load_lora_weights_and_samples_the_trained_images(trained):
    fam, weights = trained
    folder = weights / "final_diffusers"
    assert sorted(p.name for p in folder.iterdir()) == ["pytorch_lora_weights.safetensors"]
    pipe = base_pipeline(fam)
    pipe.load_lora_weights(str(folder))
    assert_same_as_trained(fam, component(fam, pipe), f"{fam.name} load_lora_weights")


def test_the_peft_folder_loads_with_peftmodel_from_pretrained_and_samples_the_trained_images(trained):
    from peft import PeftModel

    fam, weights = trained
    folder = weights / "final_peft"
    assert sorted(p.name for p in folder.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((folder / "adapter_config.json").read_text())
    lc = fam.cfg.model.lora
    assert (config["r"], config["lora_alpha"], sorted(config["target_modules"])) == \
        (lc.rank, lc.alpha, sorted(lc.target_modules))
    denoiser = PeftModel.from_pretrained(component(fam, base_pipeline(fam)), str(folder))
    assert_same_as_trained(fam, denoiser, f"{fam.name} PeftModel.from_pretrained")


def test_the_exported_adapter_config_is_the_trained_one(trained):
    """lora_config (what the exports declare) against the adapter make_trainable added to the model."""
    from ddpo_tpu.training.export import lora_config

    fam, _ = trained
    ours, trained_cfg = lora_config(fam.cfg.model), fam.model.peft_config["default"]
    for key in ("r", "lora_alpha", "target_modules", "lora_dropout", "use_dora", "bias", "use_rslora"):
        assert getattr(ours, key) == getattr(trained_cfg, key), key


def _rewrite(src: Path, dst: Path, keys=lambda k: k, keep_metadata: bool = True) -> Path:
    from safetensors import safe_open
    from safetensors.torch import save_file

    dst.mkdir(parents=True)
    with safe_open(str(src), "pt") as f:
        state, meta = {keys(k): f.get_tensor(k) for k in f.keys()}, f.metadata()
    save_file(state, str(dst / src.name), metadata=meta if keep_metadata else {"format": "pt"})
    return dst


def test_a_wrong_key_prefix_loads_no_lora_and_the_comparison_sees_it(model_cache, tmp_path):
    """The exported keys carry the pipeline component's prefix; the same file under another component's prefix
    (what a hand-built exporter could get wrong) loads nothing into the UNet, and the sampling check fails."""
    from ddpo_tpu.rundir.files import RunDir
    from ddpo_tpu.training.export import export_saved
    from safetensors import safe_open

    fam = family_with_trained_adapter([*CONFIGS["sd1"], f"model.cache_dir={model_cache}"])
    path = RunDir(tmp_path).save_weights("final", {k: v.cpu() for k, v in fam.trainable_state().items()})
    export_saved(path.parent, "final", fam.cfg.model)
    good = path.parent / "final_diffusers" / "pytorch_lora_weights.safetensors"
    with safe_open(str(good), "pt") as f:
        keys = list(f.keys())
    assert keys and all(k.startswith("unet.") for k in keys), keys[:3]
    bad = _rewrite(good, tmp_path / "bad", keys=lambda k: "transformer." + k.removeprefix("unet."))
    pipe = base_pipeline(fam)
    pipe.load_lora_weights(str(bad))
    with pytest.raises(AssertionError, match="latents differ"):
        assert_same_as_trained(fam, pipe.unet, "wrong prefix")


def test_alpha_travels_in_the_metadata(model_cache, tmp_path):
    """SD 3's tiny config trains alpha 8 at rank 4 (scale 2): the file without its lora_adapter_metadata loads at
    diffusers' default alpha = rank and samples other images; with it, the trained ones."""
    from ddpo_tpu.rundir.files import RunDir
    from ddpo_tpu.training.export import export_saved

    fam = family_with_trained_adapter([*CONFIGS["sd3"], f"model.cache_dir={model_cache}"])
    assert fam.cfg.model.lora.alpha != fam.cfg.model.lora.rank
    path = RunDir(tmp_path).save_weights("final", {k: v.cpu() for k, v in fam.trainable_state().items()})
    export_saved(path.parent, "final", fam.cfg.model)
    bare = _rewrite(path.parent / "final_diffusers" / "pytorch_lora_weights.safetensors", tmp_path / "bare",
                    keep_metadata=False)
    pipe = base_pipeline(fam)
    pipe.load_lora_weights(str(bare))
    with pytest.raises(AssertionError, match="latents differ"):
        assert_same_as_trained(fam, pipe.transformer, "no metadata")


# --- a full fine-tune -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_a_full_fine_tune_exports_a_save_pretrained_folder(name, model_cache, tmp_path):
    import diffusers

    from ddpo_tpu.families import load_family
    from ddpo_tpu.config.compose import compose_and_validate
    from ddpo_tpu.rundir.files import RunDir
    from ddpo_tpu.runtime import make_runtime
    from ddpo_tpu.training.export import export_saved

    overrides = [o for o in CONFIGS[name] if not o.startswith("model.lora.")]
    if name != "sd1":  # GRPO's KL reference is the adapter off: a full fine-tune has none
        overrides.append("algorithm.kl_beta=0")
    v = compose_and_validate([*overrides, f"model.cache_dir={model_cache}", "model.lora.enabled=false"])
    fam = load_family(v.cfg, make_runtime(v.cfg))
    before, _ = sample(fam)
    with torch.no_grad():  # "trained": every weight moved
        for i, p in enumerate(fam.model.parameters()):
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) * 0.02)
    path = RunDir(tmp_path).save_weights("final", {k: v.cpu() for k, v in fam.trainable_state().items()})
    export_saved(path.parent, "final", fam.cfg.model)
    folder = path.parent / "final_diffusers"
    assert not (path.parent / "final_peft").exists()
    assert {"config.json", "diffusion_pytorch_model.safetensors"} <= {p.name for p in folder.iterdir()}
    cls = getattr(diffusers, json.loads((folder / "config.json").read_text())["_class_name"])
    loaded = cls.from_pretrained(str(folder))
    ours, _ = sample(fam)
    x, _ = sample(fam, loaded)
    rel = float((x - ours).abs().max() / ours.abs().max())
    print(f"{name} full fine-tune from_pretrained: max |latents - trained| / max |trained| = {rel:.1e}")
    assert rel <= REL_TOL, rel
    assert float((before - ours).abs().max() / ours.abs().max()) > 1e-3


def test_every_family_of_the_catalog_has_an_export():
    """The end of every run exports: a family added to the catalog without its pipeline here would end runs in an
    error after training."""
    from ddpo_tpu.catalog.families import FAMILIES
    from ddpo_tpu.training.export import EXPORTS

    assert set(EXPORTS) == {f.name for f in FAMILIES}
    assert set(CONFIGS) == set(EXPORTS)  # and each is tested above


# --- writes -----------------------------------------------------------------------------------------------------------

def test_an_export_is_written_whole_or_not_at_all(tmp_path):
    from ddpo_tpu.rundir.files import interrupted_writes
    from ddpo_tpu.training.export import interrupted_exports, write_folder_atomically

    target = tmp_path / "weights" / "final_peft"
    write_folder_atomically(target, lambda d: (d / "a.txt").write_text("one"))
    assert (target / "a.txt").read_text() == "one"

    def killed(d):
        (d / "a.txt").write_text("two")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_folder_atomically(target, killed)
    assert (target / "a.txt").read_text() == "one"  # the old export is untouched
    assert interrupted_exports(target.parent) == []
    write_folder_atomically(target, lambda d: (d / "b.txt").write_text("three"))
    assert sorted(p.name for p in target.iterdir()) == ["b.txt"]  # replaced, not merged
    assert sorted(p.name for p in target.parent.iterdir()) == ["final_peft"]
    # a kill's leftover folder is not one of the files resume unlinks (rundir/files.py interrupted_writes):
    # unlink of a directory would end the resume in an error
    leftover, others = target.parent / ".final_peft.abc.partial", target.parent / ".epoch_0001_peft.xyz.partial"
    leftover.mkdir()
    others.mkdir()
    assert interrupted_writes(target.parent) == []
    assert interrupted_exports(target.parent, "final") == [leftover]  # not another name's, maybe being written


# --- the command ------------------------------------------------------------------------------------------------------

def _run_dir(tmp_path: Path, model_cache: Path, overrides: list[str], epochs=(0, 1), trained: bool = True):
    """A run dir as the trainer leaves it: config.yaml and weights/epoch_NNNN.safetensors (the family's adapter, times
    epoch + 1; `trained` false: a placeholder tensor, for refusals that never read it). Returns (dir, state)."""
    from omegaconf import OmegaConf

    from ddpo_tpu.config.compose import compose_and_validate
    from ddpo_tpu.rundir.files import RunDir

    v = compose_and_validate([*overrides, f"model.cache_dir={model_cache}"])
    run = tmp_path / "run"
    run.mkdir()
    OmegaConf.save(OmegaConf.create(v.tree), run / "config.yaml")
    if trained:
        fam = family_with_trained_adapter([*overrides, f"model.cache_dir={model_cache}"])
        state = {k: v.cpu() for k, v in fam.trainable_state().items()}
    else:
        state = {"placeholder": torch.zeros(1)}
    for e in epochs:
        RunDir(run).save_weights(f"epoch_{e:04d}", {k: t * (e + 1) for k, t in state.items()})
    return run, state


def test_the_command_exports_the_newest_epoch_or_the_named_one(model_cache, tmp_path, capsys):
    from safetensors.torch import load_file

    from ddpo_tpu.export import main

    run, state = _run_dir(tmp_path, model_cache, CONFIGS["sd1"])
    killed = run / "weights" / ".epoch_0001_peft.abc.partial"  # a kill's leftover: the next export removes it
    killed.mkdir()
    assert main([str(run)]) == 0
    assert not killed.exists()
    assert sorted(p.name for p in (run / "weights").iterdir() if p.is_dir()) == \
        ["epoch_0001_diffusers", "epoch_0001_peft"]
    assert main([str(run), "epoch_0000"]) == 0
    peft0 = load_file(str(run / "weights" / "epoch_0000_peft" / "adapter_model.safetensors"))
    peft1 = load_file(str(run / "weights" / "epoch_0001_peft" / "adapter_model.safetensors"))
    key = next(iter(state))
    assert torch.equal(peft0["base_model.model." + key], state[key])
    assert torch.equal(peft1["base_model.model." + key], state[key] * 2)
    assert "epoch_0000 -> " in capsys.readouterr().out


@pytest.mark.parametrize("case, args, message", [
    ("no dir", lambda run: [str(run / "nope")], "no such run dir"),
    ("no config", lambda run: [str(run / "weights")], "no config.yaml here"),
    ("no file", lambda run: [str(run), "epoch_0007"], "no weights file epoch_0007.safetensors (have: epoch_0000"),
])
def test_the_command_refuses_bad_input_in_one_line(case, args, message, model_cache, tmp_path, capsys):
    from ddpo_tpu.export import main

    run, _ = _run_dir(tmp_path, model_cache, CONFIGS["sd1"], epochs=(0,), trained=False)
    assert main(args(run)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err


# --- the README's snippet and a real run ----------------------------------------------------------------------------

def readme_snippet() -> str:
    """The python block of the README's "Use the trained weights" section."""
    text = (REPO / "README.md").read_text()
    section = text.split("## Use the trained weights", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.slow
def test_a_smoke_run_exports_its_final_lora_and_the_readme_snippet_generates_with_it(model_cache, tmp_path):
    """+experiment=smoke num_epochs=1 end to end: the run writes weights/final_diffusers and final_peft; the README's
    lines (with the tiny build's path, the run's folder and 2 sampler steps) generate with them, and the UNet they
    load computes what the run's final.safetensors gives our model."""
    from safetensors.torch import load_file

    from ddpo_tpu.config.compose import compose_and_validate
    from ddpo_tpu.families import load_family
    from ddpo_tpu.runtime import make_runtime
    from ddpo_tpu.training.export import checkpoint_source

    overrides = ["+experiment=smoke", "num_epochs=1", "sample.num_batches_per_epoch=1", "reward.host_workers=0",
                 "model.lora.enabled=true", f"model.cache_dir={model_cache}"]
    proc = run_train([*overrides, f"output_root={tmp_path}", "run_name=smoke"], tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    weights = tmp_path / "smoke" / "weights"
    assert {"final_diffusers", "final_peft"} <= {p.name for p in weights.iterdir()}

    cfg = compose_and_validate(overrides).cfg
    source, _, _ = checkpoint_source(cfg.model)
    code = readme_snippet()
    assert "load_lora_weights" in code and len(code.strip().splitlines()) <= 5
    for old, new in [('"CompVis/stable-diffusion-v1-4"', repr(str(source))),
                     ('"outputs/ddpo/weights/final_diffusers"', repr(str(weights / "final_diffusers"))),
                     ('"cat.png"', repr(str(tmp_path / "cat.png"))),
                     ('pipe("a photo of a cat")', 'pipe("a photo of a cat", num_inference_steps=2)')]:
        assert old in code, old
        code = code.replace(old, new)
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)  # noqa: S102 -- the README's own lines
    assert (tmp_path / "cat.png").is_file()

    fam = load_family(cfg, make_runtime(cfg))
    fam.load_trainable_state(load_file(str(weights / "final.safetensors")))
    gen = torch.Generator().manual_seed(0)
    x, c = torch.randn(2, *fam.latent_shape, generator=gen), torch.randn(2, 77, 32, generator=gen)
    t = torch.tensor([900, 10])
    with torch.no_grad():
        a, b, base = fam.model(x, t, c).sample, scope["pipe"].unet(x, t, c).sample, None
        with fam.reference():
            base = fam.model(x, t, c).sample
    scale = a.abs().max()
    assert float((a - b).abs().max() / scale) <= REL_TOL
    assert float((a - base).abs().max() / scale) > 1e-4  # one epoch moved the adapter: the check can see it


@pytest.mark.slow
def test_a_failed_export_warns_once_and_the_final_checkpoint_is_still_written(model_cache, tmp_path, monkeypatch,
                                                                              capsys):
    """The diffusers/peft copies are a convenience: a library failure while writing them (a hub config missing, an
    old diffusers) is one warning line naming the retry, and the epoch's checkpoint and weights are in place."""
    from types import SimpleNamespace

    from ddpo_tpu.config.compose import compose_and_validate
    from ddpo_tpu.rundir.files import RunDir
    from ddpo_tpu.runtime import make_runtime
    from ddpo_tpu.training import export, loop

    def broken(*args, **kwargs):
        raise ValueError("no config.json for this checkpoint\nsecond line")

    monkeypatch.setattr(export, "export_weights", broken)
    v = compose_and_validate(["+experiment=smoke", "num_epochs=1", "sample.num_batches_per_epoch=1",
                              "reward.host_workers=0", "model.lora.enabled=true", f"model.cache_dir={model_cache}"])
    tr = loop.Trainer(v.cfg, make_runtime(v.cfg), RunDir(tmp_path), tree=v.tree, stop=SimpleNamespace(requested=False))
    tr.fit()
    assert (tmp_path / "weights" / "final.safetensors").is_file()
    assert [p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith("epoch_")] == ["epoch_0000"]
    err = capsys.readouterr()
    lines = [x for x in (err.out + err.err).splitlines() if "exporting weights/final.safetensors" in x]
    assert len(lines) == 1 and "ValueError: no config.json for this checkpoint)" in lines[0], lines
    assert f"ddpo-export {tmp_path} final" in lines[0]


# --- two experts (Wan 2.2 A14B) -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def two_experts(model_cache, tmp_path_factory):
    """The tiny two-expert Wan 2.2 build with both experts' adapters moved off their start, each its own way (the
    helper's seeds depend on the name's length, the same for `high.x` and `low.x`), saved and exported."""
    from ddpo_tpu.rundir.files import RunDir
    from ddpo_tpu.training.export import export_saved

    fam = family_with_trained_adapter(["+experiment=wan22_grpo_smoke", f"model.cache_dir={model_cache}"])
    with torch.no_grad():
        for name, p in fam.model.named_parameters():
            if name.startswith("low.") and "lora_B" in name:
                p.mul_(-1.5)
    run = RunDir(tmp_path_factory.mktemp("run_wan22"))
    path = run.save_weights("final", {k: v.cpu() for k, v in fam.trainable_state().items()})
    export_saved(path.parent, "final", fam.cfg.model)
    return fam, path.parent


def test_two_experts_export_a_lora_each_that_wan_pipeline_loads_into_its_transformers(two_experts):
    """WanPipeline's loader reads each expert's file, the second with load_into_transformer_2 (diffusers 0.42.1
    WanLoraLoaderMixin.load_lora_weights); both experts loaded sample what the trained pair samples (the schedule
    calls `transformer` at 2 of its 6 steps and `transformer_2` at 4)."""
    from ddpo_tpu.models.wan import WanExperts
    from ddpo_tpu.training.export import lora_file_of

    fam, weights = two_experts
    folder = weights / "final_diffusers"
    second = lora_file_of("transformer_2")
    assert sorted(p.name for p in folder.iterdir()) == sorted(["pytorch_lora_weights.safetensors", second])
    pipe = base_pipeline(fam)
    pipe.load_lora_weights(str(folder))
    pipe.load_lora_weights(str(folder), weight_name=second, load_into_transformer_2=True)
    assert_same_as_trained(fam, WanExperts(pipe.transformer, pipe.transformer_2), "wan22 load_lora_weights x2")
    swapped = base_pipeline(fam)  # each file in the other expert: not the trained pair
    swapped.load_lora_weights(str(folder), load_into_transformer_2=True)
    swapped.load_lora_weights(str(folder), weight_name=second)
    x, _ = sample(fam, WanExperts(swapped.transformer, swapped.transformer_2))
    ours, _ = sample(fam)
    assert float((x - ours).abs().max() / ours.abs().max()) > 1e-3


def test_two_experts_export_a_peft_folder_each(two_experts):
    from peft import PeftModel

    from ddpo_tpu.models.wan import WanExperts

    fam, weights = two_experts
    folder = weights / "final_peft"
    assert sorted(p.name for p in folder.iterdir()) == ["transformer", "transformer_2"]
    pipe = base_pipeline(fam)
    high = PeftModel.from_pretrained(pipe.transformer, str(folder / "transformer"))
    low = PeftModel.from_pretrained(pipe.transformer_2, str(folder / "transformer_2"))
    assert_same_as_trained(fam, WanExperts(high, low), "wan22 PeftModel.from_pretrained x2")
