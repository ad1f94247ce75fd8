"""Trained weights in the formats users load them with, written beside the run's own weights files.

The trainer saves `weights/NAME.safetensors` (rundir/files.py `save_weights`): the LoRA in peft's key names, or the
full denoiser as a bare state dict. That is what resume and our tools read, and it stays as it is. This module writes,
from such a file and the run's model config, folders another program loads without ddpo_tpu:

- LoRA, diffusers' layout: `weights/NAME_diffusers/pytorch_lora_weights.safetensors`, written by the family
  pipeline's own `save_lora_weights` (keys prefixed with the pipeline's component, `unet.` for SD 1.x,
  `transformer.` for SD 3 / FLUX / Wan / Qwen-Image), with the adapter's LoraConfig as its `lora_adapter_metadata`
  (the r/alpha a loader needs: without it diffusers assumes alpha = rank, and SD 3's tiny model trains alpha 8 at
  rank 4). Loaded by `pipe.load_lora_weights("weights/NAME_diffusers")`
  (diffusers 0.42.1 loaders/lora_pipeline.py: StableDiffusionLoraLoaderMixin.save_lora_weights :467-526 and its
  SD3 / Flux / Wan / QwenImage counterparts; lora_base.py `_save_lora_weights` :1083-1115 and
  `write_lora_layers` :1036-1080 write the file and the metadata key).
- LoRA, peft's adapter folder: `weights/NAME_peft/adapter_config.json` + `adapter_model.safetensors` (keys under
  `base_model.model.`, as PeftModel.save_pretrained writes them), loaded by `PeftModel.from_pretrained(denoiser,
  "weights/NAME_peft")` or `denoiser.load_adapter`-style peft loaders.
- A full fine-tune: `weights/NAME_diffusers/` as the denoiser's `save_pretrained` folder (config.json +
  diffusion_pytorch_model.safetensors), loaded by `UNet2DConditionModel.from_pretrained(...)` (or the family's
  transformer class), or as `unet=`/`transformer=` of the pipeline's from_pretrained.

A model with two experts (Wan 2.2 A14B: the trainer's state prefixes each expert's keys with `high.` / `low.`)
exports each trained expert for its pipeline component: `NAME_diffusers/pytorch_lora_weights.safetensors` for
`transformer` and `pytorch_lora_weights_transformer_2.safetensors` for `transformer_2`, loaded by
`pipe.load_lora_weights(dir)` and `pipe.load_lora_weights(dir,
weight_name="pytorch_lora_weights_transformer_2.safetensors", load_into_transformer_2=True)` (diffusers 0.42.1
WanLoraLoaderMixin.load_lora_weights); the peft folder and a full fine-tune's folder get one subfolder per component
(`NAME_peft/transformer_2/`, `NAME_diffusers/transformer/`).

When: at the end of a run, for `final` (and `final_ema` when EMA is kept), by the main process
(training/checkpointing.py `CheckpointManager.save`); and for any saved weights file by
`python -m ddpo_tpu.export RUN_DIR [NAME ...]` (ddpo_tpu/export.py, the `ddpo-export` script).
Each folder is written in a hidden temporary folder of weights/ and renamed into place whole, so a kill never leaves
a half-written export under the final name (a leftover `.NAME_*.partial` folder is removed by the next export of NAME).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

DIFFUSERS_SUFFIX = "_diffusers"  # weights/NAME_diffusers/: diffusers' LoRA layout, or the full model's folder
PEFT_SUFFIX = "_peft"            # weights/NAME_peft/: peft's adapter folder (LoRA only)
PEFT_PREFIX = "base_model.model."  # where PeftModel keeps the wrapped model: its saved keys start with it
_PARTIAL = ".partial"            # not ".tmp": rundir/files.py interrupted_writes unlinks `.*.*.tmp` as files


@dataclass(frozen=True)
class FamilyExport:
    """How a family's trained denoiser appears in diffusers: the pipeline class whose LoRA loader reads it and the
    pipeline component (subfolder) the denoiser is."""

    pipeline: str   # diffusers class name
    component: str  # "unet" or "transformer": the key prefix of its LoRA file and the checkpoint's subfolder
    # "module:function" building the family's tiny model into a cache dir once (cache_dir -> path), as its loader
    # does; with `builds` it is called (model.builder, cache_dir): a family with several tiny builds
    ensure_tiny: str = ""
    builds: bool = False
    # (state key prefix, pipeline component) of each expert of a model with several (Wan 2.2 A14B)
    experts: tuple[tuple[str, str], ...] = ()

    def split(self, state: dict) -> list[tuple[str, dict]]:
        """(component, its state with the expert prefix cut) for each expert the state holds; the whole state as
        `component`'s when it names no expert (one transformer)."""
        parts = [(comp, {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})
                 for prefix, comp in self.experts]
        parts = [(comp, part) for comp, part in parts if part]
        if not parts:
            return [(self.component, state)]
        left = len(state) - sum(len(part) for _, part in parts)
        if left:
            raise ValueError(f"{left} weights belong to no expert of {self.pipeline} "
                             f"(prefixes {[p for p, _ in self.experts]})")
        return parts

    def by_expert(self, state: dict) -> bool:
        """The state's keys name experts (each then gets its own subfolder in the peft and full exports)."""
        return any(k.startswith(prefix) for k in state for prefix, _ in self.experts)


EXPORTS = {
    "sd1": FamilyExport("StableDiffusionPipeline", "unet"),
    "sd3": FamilyExport("StableDiffusion3Pipeline", "transformer", "ddpo_tpu.models.sd3:ensure_tiny_sd3"),
    "flux": FamilyExport("FluxPipeline", "transformer", "ddpo_tpu.models.flux:ensure_tiny_flux"),
    "wan": FamilyExport("WanPipeline", "transformer", "ddpo_tpu.models.wan:ensure_tiny_wan_build", builds=True,
                        experts=(("high.", "transformer"), ("low.", "transformer_2"))),
    "qwen_image": FamilyExport("QwenImagePipeline", "transformer", "ddpo_tpu.models.qwen_image:ensure_tiny_qwen_image"),
    "qwen_image_edit": FamilyExport("QwenImageEditPlusPipeline", "transformer",
                                    "ddpo_tpu.models.qwen_image_edit:ensure_tiny_qwen_image_edit"),
    "flux2": FamilyExport("Flux2KleinPipeline", "transformer", "ddpo_tpu.models.flux2:ensure_tiny_flux2"),
    "z_image": FamilyExport("ZImagePipeline", "transformer", "ddpo_tpu.models.z_image:ensure_tiny_z_image"),
}


def family_export(family: str) -> FamilyExport:
    try:
        return EXPORTS[family]
    except KeyError:
        raise ValueError(f"model.family={family} has no export format here (known: {', '.join(EXPORTS)})") from None


def lora_config(model_cfg):
    """The run's adapter as a peft LoraConfig: what models/lora.py `make_trainable` added (rank, alpha, targets),
    with the base checkpoint named when it is a hub id or directory (null for a local build)."""
    from peft import LoraConfig

    lc = model_cfg.lora
    return LoraConfig(r=lc.rank, lora_alpha=lc.alpha, init_lora_weights="gaussian",
                      target_modules=list(lc.target_modules), base_model_name_or_path=model_cfg.pretrained,
                      revision=model_cfg.revision)


def checkpoint_source(model_cfg) -> tuple[str, str | None, bool]:
    """(path or hub id, revision, local_files_only) of the base checkpoint the run trained: its local build (built
    once in model.cache_dir, as the family's loader does) or model.pretrained."""
    from ddpo_tpu.families.base import checkpoint_source as source

    m = model_cfg
    if m.family == "sd1":
        from ddpo_tpu.models.tiny import ensure_tiny_model

        if m.builder == "digits":
            from ddpo_tpu.models.digits import ensure_digits_model

            return str(ensure_digits_model(Path(m.cache_dir).expanduser())), None, True
        return source(m, lambda cache: ensure_tiny_model(cache, spec=m.builder))
    from ddpo_tpu.catalog.registry import load_object

    fam = family_export(m.family)
    ensure = load_object(fam.ensure_tiny)
    path, revision, local = source(m, (lambda cache: ensure(m.builder, cache)) if fam.builds else ensure)
    return str(path), revision, local


# --- the writers ------------------------------------------------------------------------------------------------

def write_lora_diffusers(directory: Path, state: dict, model_cfg) -> Path:
    """`state` (peft key names, as models/lora.py `trainable_state_dict` gives) as diffusers'
    pytorch_lora_weights.safetensors in `directory`, through the family pipeline's `save_lora_weights`."""
    import diffusers

    fam = family_export(model_cfg.family)
    pipeline = getattr(diffusers, fam.pipeline)
    for component, part in fam.split(state):
        # the pipeline's loader reads each expert as `transformer`'s (load_into_transformer_2 says where it goes)
        name = {} if component == fam.component else {"weight_name": lora_file_of(component)}
        pipeline.save_lora_weights(str(directory), **{f"{fam.component}_lora_layers": _contiguous(part),
                                                      f"{fam.component}_lora_adapter_metadata":
                                                          lora_config(model_cfg).to_dict()}, **name)
    return directory


def lora_file_of(component: str) -> str:
    """The diffusers LoRA file of an expert other than the pipeline's first (the first keeps diffusers' default
    name, pytorch_lora_weights.safetensors)."""
    return f"pytorch_lora_weights_{component}.safetensors"


def write_lora_peft(directory: Path, state: dict, model_cfg) -> Path:
    """`state` as peft's adapter folder: adapter_config.json (LoraConfig.save_pretrained) and
    adapter_model.safetensors with PeftModel's key names (peft 0.21 PeftModel.save_pretrained: the wrapped model under
    `base_model.model.`, the adapter name left out)."""
    from safetensors.torch import save_file

    from peft.utils.constants import SAFETENSORS_WEIGHTS_NAME

    fam = family_export(model_cfg.family)
    parts = fam.split(state)
    for component, part in parts:
        folder = directory / component if fam.by_expert(state) else directory
        folder.mkdir(exist_ok=True)
        lora_config(model_cfg).save_pretrained(str(folder))
        save_file({PEFT_PREFIX + k: v for k, v in _contiguous(part).items()}, str(folder / SAFETENSORS_WEIGHTS_NAME),
                  metadata={"format": "pt"})
    return directory


def write_full_model(directory: Path, state: dict, model_cfg) -> Path:
    """A full fine-tune's state dict as the denoiser's `save_pretrained` folder: the base checkpoint's config (its
    class named by `_class_name`) with the trained weights. The model is made without allocating weights (accelerate's
    init_empty_weights) and takes the state's tensors, so the export costs no second copy of a large denoiser."""
    import diffusers
    from accelerate import init_empty_weights

    fam = family_export(model_cfg.family)
    source, revision, local = checkpoint_source(model_cfg)
    for component, part in fam.split(state):
        config = _load_denoiser_config(source, component, revision, local)
        cls = getattr(diffusers, config["_class_name"])
        with init_empty_weights():
            model = cls.from_config(config)
        missing, unexpected = model.load_state_dict(part, strict=False, assign=True)
        if missing or unexpected:
            raise ValueError(f"weights do not fit {config['_class_name']} of {source}: missing "
                             f"{sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]}")
        meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
        if meta:
            raise ValueError(f"weights leave {config['_class_name']} without values for {meta[:3]}")
        model.save_pretrained(str(directory / component if fam.by_expert(state) else directory),
                              safe_serialization=True)
    return directory


def _load_denoiser_config(source: str, subfolder: str, revision: str | None, local: bool) -> dict:
    """The denoiser's config.json: in a local checkpoint dir, else from the hub (that one file)."""
    local_file = Path(source).expanduser() / subfolder / "config.json"
    if local_file.is_file():
        return json.loads(local_file.read_text())
    from huggingface_hub import hf_hub_download

    path = hf_hub_download(source, "config.json", subfolder=subfolder, revision=revision, local_files_only=local)
    return json.loads(Path(path).read_text())


def _contiguous(state: dict) -> dict:
    return {k: v.detach().to("cpu").contiguous() for k, v in state.items()}


# --- atomic folders ---------------------------------------------------------------------------------------------

def write_folder_atomically(target: Path, write) -> Path:
    """`write(tmp_dir)` fills a hidden temporary folder beside `target`; its files are synced and it is renamed to
    `target` (an older `target` is moved aside first and removed after), so `target` is either whole or absent."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.", suffix=_PARTIAL))
    try:
        write(tmp)
        for path in tmp.rglob("*"):
            if path.is_file():
                _fsync(path)
        _fsync(tmp)
        old = None
        if target.exists():
            old = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.", suffix=_PARTIAL))
            os.replace(target, old / target.name)
        os.replace(tmp, target)
        _fsync(target.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def interrupted_exports(weights_dir: Path, name: str = "") -> list[Path]:
    """Temporary export folders a kill left in weights/ (write_folder_atomically's cleanup never ran): those of the
    exports of weights NAME (another export may be writing its own right now), or all."""
    # exactly NAME's folders: ".final_*" would also match final_ema's, which another export may be writing
    patterns = ([f".{name}{suffix}.*{_PARTIAL}" for suffix in (DIFFUSERS_SUFFIX, PEFT_SUFFIX)] if name
                else [f".*{_PARTIAL}"])
    return sorted({p for pattern in patterns for p in Path(weights_dir).glob(pattern) if p.is_dir()})


# --- what the trainer and the CLI call -------------------------------------------------------------------------

def export_weights(weights_dir: Path, name: str, state: dict, model_cfg) -> list[Path]:
    """Write the exports of the weights `state` saved as weights_dir/NAME.safetensors: LoRA as NAME_diffusers/ and
    NAME_peft/, a full fine-tune as NAME_diffusers/. Returns the folders written."""
    weights_dir = Path(weights_dir)
    for leftover in interrupted_exports(weights_dir, name):
        shutil.rmtree(leftover, ignore_errors=True)
    family_export(model_cfg.family)  # an unknown family is refused before anything is written
    if model_cfg.lora.enabled:
        return [
            write_folder_atomically(weights_dir / f"{name}{DIFFUSERS_SUFFIX}",
                                    lambda d: write_lora_diffusers(d, state, model_cfg)),
            write_folder_atomically(weights_dir / f"{name}{PEFT_SUFFIX}",
                                    lambda d: write_lora_peft(d, state, model_cfg)),
        ]
    return [write_folder_atomically(weights_dir / f"{name}{DIFFUSERS_SUFFIX}",
                                    lambda d: write_full_model(d, state, model_cfg))]


def export_saved(weights_dir: Path, name: str, model_cfg) -> list[Path]:
    """The exports of a saved weights file weights_dir/NAME.safetensors (any epoch's, final, final_ema)."""
    from safetensors.torch import load_file

    path = Path(weights_dir) / f"{name}.safetensors"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such weights file")
    return export_weights(weights_dir, name, load_file(str(path)), model_cfg)
