"""Load the Stable Diffusion parts DDPO needs through the real diffusers/transformers ``from_pretrained``.

Failures (a path that is not a checkpoint, a hub id that cannot be reached offline, a missing or broken
subfolder) become one :class:`ModelLoadError` whose message names the config key to change and how.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ddpo_tpu.catalog import family
# the loaders' error, defined on the bottom floor because the build cache raises it too
from ddpo_tpu.proc.build_cache import ModelLoadError

if TYPE_CHECKING:
    from diffusers import AutoencoderKL, DDIMScheduler, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTokenizer

SUBFOLDERS = family("sd1").subfolders  # what a local SD 1.x checkpoint dir holds (the catalog's)
_EXPECTED = "expected " + ", ".join(f"{s}/" for s in SUBFOLDERS)
_TINY_HINT = "e.g. model=tiny for the local test model"

# A Hugging Face repo id: "name" or "namespace/name" (letters, digits, '-', '_', '.').
_HUB_ID = re.compile(r"^(?![./~])[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)?$")



@dataclass
class Components:
    unet: UNet2DConditionModel
    vae: AutoencoderKL
    text_encoder: CLIPTextModel
    tokenizer: CLIPTokenizer
    scheduler: DDIMScheduler


def _short_reason(exc: BaseException, limit: int = 300) -> str:
    """First non-empty line of an exception message, no traceback, bounded length."""
    text = str(exc).strip()
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    reason = f"{type(exc).__name__}: {line}" if line else type(exc).__name__
    return reason if len(reason) <= limit else reason[: limit - 3] + "..."


def _key(pretrained: str, revision: str | None) -> str:
    s = f"model.pretrained={pretrained}"
    if revision is not None:
        s += f" (model.revision={revision})"
    return s


def _not_a_checkpoint(pretrained: str, detail: str) -> ModelLoadError:
    return ModelLoadError(
        f"model.pretrained={pretrained}: no Stable Diffusion checkpoint there ({detail}). "
        f"Fix: point model.pretrained at a local diffusers checkpoint or a hub id, {_TINY_HINT}"
    )


def _hub_unreachable(pretrained: str, revision: str | None, local_files_only: bool, what: str, exc) -> ModelLoadError:
    rev_arg = f" --revision {revision}" if revision else ""
    why = "not in the local Hugging Face cache and local_files_only is set" if local_files_only else (
        "could not be fetched from the Hugging Face Hub (no network, not in the local cache, a gated repo "
        "without a token, or a wrong repo id/revision)"
    )
    rev_note = (
        f" If model.revision={revision} is wrong, fix it or set model.revision=null."
        if revision is not None
        else ""
    )
    return ModelLoadError(
        f"{_key(pretrained, revision)}: {what} {why} [{_short_reason(exc)}]. "
        f"It is not an existing local directory either. "
        f"Fix: on a machine with network run `huggingface-cli download {pretrained}{rev_arg} "
        f"--local-dir /path/to/sd` (or `hf download ...`), copy that directory here and set "
        f"model.pretrained=/path/to/sd; or use a valid local diffusers checkpoint, {_TINY_HINT}.{rev_note}"
    )


def _broken_local(pretrained: str, what: str, exc) -> ModelLoadError:
    return ModelLoadError(
        f"model.pretrained={pretrained}: {what} could not be loaded [{_short_reason(exc)}]. "
        f"Fix: re-download or rebuild that checkpoint (a diffusers Stable Diffusion layout: {_EXPECTED}), "
        f"or point model.pretrained at another one, {_TINY_HINT}"
    )


def load_components(
    pretrained: str,
    *,
    revision: str | None = None,
    local_files_only: bool = False,
    dtype: torch.dtype = torch.float32,
) -> Components:
    """Load unet, vae, text_encoder, tokenizer and a DDIM scheduler from a diffusers SD checkpoint.

    ``pretrained`` is a local directory (diffusers layout) or a hub id. The scheduler is always
    ``DDIMScheduler.from_pretrained(..., subfolder="scheduler")``: DDPO samples with DDIM whatever the
    checkpoint ships. unet/vae/text_encoder are cast to ``dtype``, put in eval mode, with requires_grad False.
    """
    from diffusers import AutoencoderKL, DDIMScheduler, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTokenizer

    pretrained = os.fspath(pretrained)
    if not pretrained or not pretrained.strip():
        raise _not_a_checkpoint(repr(pretrained), "empty value")
    local_path = os.path.expanduser(pretrained)
    is_local = os.path.isdir(local_path)

    if is_local:
        missing = [s for s in SUBFOLDERS if not os.path.isdir(os.path.join(local_path, s))]
        if missing:
            raise _not_a_checkpoint(
                pretrained, f"{_EXPECTED}; missing: " + ", ".join(f"{s}/" for s in missing)
            )
        source = local_path
    elif os.path.exists(local_path) or not _HUB_ID.match(pretrained):
        detail = "it is a file, not a directory" if os.path.exists(local_path) else "path does not exist"
        raise _not_a_checkpoint(pretrained, f"{detail}; {_EXPECTED}")
    else:
        source = pretrained

    common = dict(revision=revision, local_files_only=local_files_only)
    parts = (
        ("unet", UNet2DConditionModel),
        ("vae", AutoencoderKL),
        ("text_encoder", CLIPTextModel),
        ("tokenizer", CLIPTokenizer),
        ("scheduler", DDIMScheduler),
    )
    loaded = {}
    for sub, cls in parts:
        what = f"{sub}/ ({cls.__name__})"
        kwargs = dict(common)
        if sub in ("unet", "vae"):
            # diffusers casts at load time (casting later with .to(dtype) logs a warning per model).
            kwargs["torch_dtype"] = dtype
        try:
            loaded[sub] = cls.from_pretrained(source, subfolder=sub, **kwargs)
        except Exception as exc:  # any failure inside from_pretrained is a load failure of this part
            if is_local:
                err = _broken_local(pretrained, what, exc)
            else:
                err = _hub_unreachable(pretrained, revision, local_files_only, what, exc)
            err.original = exc
            raise err from None

    for sub in ("unet", "vae", "text_encoder"):
        loaded[sub] = frozen(loaded[sub], dtype)
    return Components(**loaded)


def frozen(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """A loaded part as the trainer holds it: in `dtype` (cast only if some weight or buffer is not), eval mode,
    no gradients (training adds its adapters or unfreezes the denoiser itself)."""
    if any(p.dtype != dtype for p in model.parameters()) or any(
        b.is_floating_point() and b.dtype != dtype for b in model.buffers()
    ):
        model = model.to(dtype=dtype)
    model.eval()
    model.requires_grad_(False)
    return model


def family_load_failure(name: str, what_checkpoint: str, tiny: str, pretrained: str, revision: str | None,
                        what: str, exc: BaseException | None = None, gated: bool = False) -> ModelLoadError:
    """A flow family's checkpoint that did not load, in one line: the key, what went wrong and the fix (its
    subfolders, the download command from its catalog entry, its tiny local build)."""
    spec = family(name)
    where = f"model.pretrained={pretrained}" + (f" (model.revision={revision})" if revision else "")
    reason = f" [{_short_reason(exc)}]" if exc is not None else ""
    licence = " (a gated repo: accept its licence first)" if gated else ""
    err = ModelLoadError(f"{where}: {what}{reason}. Fix: point model.pretrained at a diffusers {what_checkpoint} "
                         f"checkpoint (its {', '.join(s + '/' for s in spec.subfolders)}), e.g. `hf download "
                         f"{spec.example_hub_id} --local-dir DIR` on a machine with network{licence}, or use "
                         f"model={tiny}")
    err.original = exc
    return err


def load_parts(pretrained, revision: str | None, local_files_only: bool, classes: dict, dtypes: dict,
               failure, checkpoint: str) -> dict:
    """Each part of a diffusers checkpoint (a local directory or a hub id) with ``classes[sub].from_pretrained(path,
    subfolder=sub)``, the parts named in ``dtypes`` loaded in that torch dtype (the pipelines' loaders: FLUX, Wan).
    ``failure(revision, what, exc)`` makes the ModelLoadError naming the key and the fix; ``checkpoint`` names the
    kind ("FLUX.1") when a local directory lacks a part's folder."""
    source = os.path.expanduser(os.fspath(pretrained))
    local = os.path.isdir(source)
    if local:
        missing = [s for s in classes if not os.path.isdir(os.path.join(source, s))]
        if missing:
            raise failure(None, f"not a {checkpoint} checkpoint (missing " + ", ".join(f"{s}/" for s in missing) + ")",
                          None)
    elif os.path.exists(source):
        raise failure(None, "a file, not a checkpoint directory", None)
    parts = {}
    for sub, cls in classes.items():
        kwargs = dict(revision=revision, local_files_only=local_files_only)
        if sub in dtypes:
            kwargs["torch_dtype"] = dtypes[sub]
        try:
            parts[sub] = cls.from_pretrained(source if local else os.fspath(pretrained), subfolder=sub, **kwargs)
        except Exception as exc:  # any failure inside from_pretrained is a load failure of this part
            offline = " (not in the local Hugging Face cache and local_files_only is set)" if (
                local_files_only and not local) else ""
            raise failure(revision, f"{sub}/ ({cls.__name__}) could not be loaded{offline}", exc) from None
    return parts
