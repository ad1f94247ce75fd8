"""Local checkpoint directories with random weights for the side-by-side bench (benchmarks/probes/side_by_side.py),
built here (no model hub) and handed to both sides of a comparison through their own from_pretrained:

* sd14 / tiny: ddpo_tpu's own local builds (models/tiny.py SPECS: `sd14_random` is SD 1.4 at full width).
* sd35_medium: SD 3.5 Medium's configs (transformer, CLIP-L, CLIP-G, T5-XXL's encoder, the 16-channel VAE, the
  scheduler with shift 3) with random weights in bfloat16, built on the GPU when there is one (7.8B values: seconds
  there, about 16 GB on disk). The tokenizers are ddpo_tpu's byte-level CLIP tokenizer and printable-ASCII T5
  tokenizer, so the token-embedding tables are smaller than the real ones (514 and 98 rows against 49,408 and
  32,128); every other shape is SD 3.5 Medium's.
* tiny_sd3: ddpo_tpu's tiny SD3 build with its tiny T5 (flow_grpo moves text_encoder_3 to the device
  unconditionally, scripts/train_sd3.py@ac4c86e:294, so it needs one).

`reference_view(src)` is the same directory as a reference sees it: a folder of links to src's parts and a
model_index.json that names tokenizer_3 `T5TokenizerFast`, as stabilityai/stable-diffusion-3.5-medium's does
(transformers 5 saves the class as `T5Tokenizer`, which transformers 4.40 takes for the sentencepiece one).

`python -m benchmarks.checkpoints SPEC CACHE_DIR` builds (once) and prints the directory: the bench calls it in a
process of its own, so its front process never imports torch.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

SPECS = ("tiny", "sd14", "tiny_sd3", "sd35_medium")
SD35_DIR = "sd35-medium-random-v1"


def sd35_medium_parts(device: str, vocab: int, t5_vocab: int, ids: dict) -> dict:
    """SD 3.5 Medium's transformer, text encoders and VAE with random weights (on `device`, float32)."""
    import torch
    from diffusers import AutoencoderKL, SD3Transformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    from benchmarks.probes.sd3_activations import SD35_MEDIUM_TRANSFORMER
    from benchmarks.probes.sd3_parameters import CLIP_G, CLIP_L, T5_XXL, VAE

    clip = lambda c, act, pad: CLIPTextModelWithProjection(CLIPTextConfig(
        **dict(c, vocab_size=vocab), hidden_act=act, layer_norm_eps=1e-5, bos_token_id=ids["bos"],
        eos_token_id=ids["eos"], pad_token_id=pad))
    with torch.device(device):
        torch.manual_seed(0)
        return {
            "transformer": SD3Transformer2DModel(**SD35_MEDIUM_TRANSFORMER),
            "text_encoder": clip(CLIP_L, "quick_gelu", ids["eos"]),
            "text_encoder_2": clip(CLIP_G, "gelu", ids["pad_2"]),
            "text_encoder_3": T5EncoderModel(T5Config(**dict(T5_XXL, vocab_size=t5_vocab), dense_act_fn="gelu_new",
                                                      layer_norm_epsilon=1e-6, relative_attention_num_buckets=32,
                                                      pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)),
            "vae": AutoencoderKL(**VAE, scaling_factor=1.5305, shift_factor=0.0609, sample_size=1024),
        }


def build_sd35_medium(out: Path, device: str | None = None) -> Path:
    """SD 3.5 Medium's shape with random weights (bfloat16 on disk) saved as a diffusers checkpoint in `out`."""
    import torch
    from diffusers import StableDiffusion3Pipeline

    from ddpo_tpu.models.sd3 import _build_scheduler, _build_t5
    from ddpo_tpu.models.tiny import BOS_TOKEN, EOS_TOKEN, _build_tokenizer

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    tok, tok_2 = _build_tokenizer(out), _build_tokenizer(out)
    tok_2.pad_token = "!"  # SD3's CLIP-G tokenizer pads with "!"
    tok_2.init_kwargs["pad_token"] = "!"
    _, tok_3 = _build_t5()
    ids = {"bos": tok.convert_tokens_to_ids(BOS_TOKEN), "eos": tok.convert_tokens_to_ids(EOS_TOKEN),
           "pad_2": tok_2.convert_tokens_to_ids("!")}
    parts = sd35_medium_parts(device, len(tok), len(tok_3), ids)
    parts = {k: v.to("cpu", torch.bfloat16) for k, v in parts.items()}  # saved from host memory
    pipe = StableDiffusion3Pipeline(scheduler=_build_scheduler(), tokenizer=tok, tokenizer_2=tok_2, tokenizer_3=tok_3,
                                    **parts)
    pipe.save_pretrained(str(out), safe_serialization=True)
    return out


def reference_view(src: Path) -> Path:
    """src as the references load it (module docstring): `src` + "-reference", links and a rewritten index."""
    view = src.with_name(src.name + "-reference")
    view.mkdir(exist_ok=True)
    index = json.loads((src / "model_index.json").read_text())
    if index.get("tokenizer_3") and index["tokenizer_3"][0] == "transformers":
        index["tokenizer_3"] = ["transformers", "T5TokenizerFast"]
    for part in src.iterdir():
        if part.is_dir() and not (view / part.name).exists():
            (view / part.name).symlink_to(part.resolve(), target_is_directory=True)
    (view / "model_index.json").write_text(json.dumps(index, indent=2))
    return view


def ensure(spec: str, cache_dir: Path) -> Path:
    """The checkpoint directory of `spec` (SPECS), built on first use."""
    cache_dir = cache_dir.expanduser()
    if spec in ("tiny", "sd14"):
        from ddpo_tpu.models.tiny import ensure_tiny_model

        return ensure_tiny_model(cache_dir, spec="sd14_random" if spec == "sd14" else "tiny")
    if spec == "tiny_sd3":
        from ddpo_tpu.models.sd3 import ensure_tiny_sd3

        return ensure_tiny_sd3(cache_dir, t5=True)
    from ddpo_tpu.proc.build_cache import build_once

    required = ("model_index.json", "transformer/config.json", "text_encoder_3/config.json", "vae/config.json")
    return build_once(cache_dir, SD35_DIR, required, lambda tmp: build_sd35_medium(Path(tmp)))


if __name__ == "__main__":
    spec, cache = sys.argv[1], Path(sys.argv[2])
    if spec not in SPECS:
        raise SystemExit(f"spec {spec!r}: one of {', '.join(SPECS)}")
    path = ensure(spec, cache)
    print(json.dumps({"model": str(path), "reference_model": str(reference_view(path))}))
