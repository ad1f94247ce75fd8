"""open_clip CLIP checkpoints (the HPSv2 release) -> transformers' ``CLIPModel``, so HPSv2 runs on the CLIP code
PickScore already uses instead of a second CLIP implementation (no ``open_clip_torch`` / torchvision dependency).

What is converted is the plain ViT CLIP of open_clip as HPSv2 vendors it (tgxs002/HPSv2@866735e
hpsv2/src/open_clip: model.py ``CLIP`` 176-255, transformer.py ``ResidualAttentionBlock`` 189-244,
``VisionTransformer`` 323-504, ``TextTransformer`` 507-560). Its state dict names, and where each goes::

    visual.conv1.weight (no bias)              vision_model.embeddings.patch_embedding.weight
    visual.class_embedding                     vision_model.embeddings.class_embedding
    visual.positional_embedding                vision_model.embeddings.position_embedding.weight
    visual.ln_pre / visual.ln_post             vision_model.pre_layrnorm / vision_model.post_layernorm
    visual.proj (width, embed)                 visual_projection.weight (transposed: x @ proj == Linear)
    token_embedding.weight                     text_model.embeddings.token_embedding.weight
    positional_embedding                       text_model.embeddings.position_embedding.weight
    ln_final                                   text_model.final_layer_norm
    text_projection (width, embed)             text_projection.weight (transposed)
    logit_scale                                logit_scale
    [visual.]transformer.resblocks.N.ln_1 / ln_2              ...encoder.layers.N.layer_norm1 / layer_norm2
    [visual.]transformer.resblocks.N.attn.in_proj_weight/bias ...encoder.layers.N.self_attn.{q,k,v}_proj (rows q|k|v)
    [visual.]transformer.resblocks.N.attn.out_proj            ...encoder.layers.N.self_attn.out_proj
    [visual.]transformer.resblocks.N.mlp.c_fc / c_proj        ...encoder.layers.N.mlp.fc1 / fc2

Why the forward passes agree: both towers are pre-norm blocks (x + attn(ln_1 x), then x + mlp(ln_2 x)) with
nn.MultiheadAttention's packed q|k|v projection and 1/sqrt(head_dim) scaling; the image tower prepends the class
token, adds positions, applies ln_pre, and pools the class token through ln_post then ``proj`` (a LayerNorm is per
token, so normalising only the pooled token is the same); the text tower is causal and pools the end-of-text
token after ln_final (open_clip: ``argmax`` of the ids, the EOT id being the vocabulary's largest; transformers:
the first ``eos_token_id``, the same position), then ``text_projection``. Both use LayerNorm eps 1e-5 and exact
GELU (``nn.GELU``) unless the open_clip config says ``quick_gelu``.

The open_clip model config (its ``model_configs/<name>.json``) gives what shapes cannot: the head counts.
``VIT_H_14`` is HPSv2's (``create_model_and_transforms('ViT-H-14', ...)``). Layer scale, attentional pooling,
global average pooling, patch-norm, timm or HF text towers are refused: the HPSv2 checkpoints use none of them.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Mapping

__all__ = ["VIT_H_14", "OpenClipConversionError", "load_open_clip_config", "open_clip_state_dict",
           "clip_config_from_open_clip", "convert_state_dict", "clip_model_from_open_clip"]

# open_clip model_configs/ViT-H-14.json as vendored by tgxs002/HPSv2@866735e (hpsv2/src/open_clip/model_configs)
VIT_H_14: dict[str, Any] = {
    "embed_dim": 1024,
    "vision_cfg": {"image_size": 224, "layers": 32, "width": 1280, "head_width": 80, "patch_size": 14},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 1024, "heads": 16, "layers": 24},
}
NAMED_CONFIGS = {"ViT-H-14": VIT_H_14}

# open_clip options whose module layout this converter does not map (none is set by ViT-H-14)
_UNSUPPORTED_VISION = ("timm_model_name", "attentional_pool", "global_average_pool", "input_patchnorm",
                       "ls_init_value")
_UNSUPPORTED_TEXT = ("hf_model_name", "ls_init_value", "embed_cls")


class OpenClipConversionError(ValueError):
    """The checkpoint or config is not an open_clip ViT CLIP this converter maps; the message says what differs."""


def load_open_clip_config(name_or_path: str) -> dict[str, Any]:
    """A named config (``ViT-H-14``) or the path of an open_clip model-config JSON file."""
    if name_or_path in NAMED_CONFIGS:
        return json.loads(json.dumps(NAMED_CONFIGS[name_or_path]))  # a copy
    path = Path(name_or_path).expanduser()
    if not path.is_file():
        raise OpenClipConversionError(f"model config {name_or_path!r}: neither one of {sorted(NAMED_CONFIGS)} nor "
                                      "an open_clip model-config JSON file")
    return json.loads(path.read_text())


def open_clip_state_dict(path: str | Path) -> dict[str, Any]:
    """The tensors of an open_clip training checkpoint (``{"state_dict": ...}``, as HPSv2 releases them) or of a
    bare state dict. Loaded with ``weights_only=True``: tensors and plain containers only, no pickled code."""
    import torch

    ckpt = torch.load(str(path), map_location="cpu", weights_only=True)
    sd = ckpt.get("state_dict", ckpt) if isinstance(ckpt, Mapping) else None
    if not isinstance(sd, Mapping) or not sd:
        raise OpenClipConversionError(f"{path}: no state_dict in the checkpoint")
    return dict(sd)


def _layer_count(sd: Mapping[str, Any], prefix: str) -> int:
    pattern = re.compile(re.escape(prefix) + r"transformer\.resblocks\.(\d+)\.")
    found = {int(m.group(1)) for k in sd if (m := pattern.match(k))}
    return max(found) + 1 if found else 0


def clip_config_from_open_clip(oc_config: Mapping[str, Any], *, bos_token_id: int, eos_token_id: int,
                               pad_token_id: int):
    """transformers ``CLIPConfig`` of an open_clip ViT CLIP config; the token ids are the tokenizer's (the text
    tower pools the first ``eos_token_id``)."""
    from transformers import CLIPConfig

    vision, text = dict(oc_config["vision_cfg"]), dict(oc_config["text_cfg"])
    for key in _UNSUPPORTED_VISION:
        if vision.get(key):
            raise OpenClipConversionError(f"vision_cfg.{key}={vision[key]!r} is not converted (a plain ViT only)")
    for key in _UNSUPPORTED_TEXT:
        if text.get(key):
            raise OpenClipConversionError(f"text_cfg.{key}={text[key]!r} is not converted (a plain text tower only)")
    if not isinstance(vision.get("layers"), int):
        raise OpenClipConversionError(f"vision_cfg.layers={vision.get('layers')!r}: a ResNet tower, not a ViT")
    act = "quick_gelu" if oc_config.get("quick_gelu") else "gelu"   # open_clip: QuickGELU if quick_gelu else nn.GELU
    embed = int(oc_config["embed_dim"])
    v_width, t_width = int(vision.get("width", 768)), int(text.get("width", 512))
    mlp_ratio_v, mlp_ratio_t = float(vision.get("mlp_ratio", 4.0)), float(text.get("mlp_ratio", 4.0))
    image_size = vision.get("image_size", 224)
    if isinstance(image_size, (list, tuple)):
        if image_size[0] != image_size[1]:
            raise OpenClipConversionError(f"vision_cfg.image_size={image_size}: only square images are converted")
        image_size = image_size[0]
    vision_cfg = dict(
        image_size=int(image_size), patch_size=int(vision.get("patch_size", 16)), num_channels=3,
        hidden_size=v_width, intermediate_size=int(v_width * mlp_ratio_v), num_hidden_layers=int(vision["layers"]),
        num_attention_heads=v_width // int(vision.get("head_width", 64)),  # open_clip: width // head_width
        hidden_act=act, layer_norm_eps=1e-5, projection_dim=embed)
    text_cfg = dict(
        vocab_size=int(text.get("vocab_size", 49408)), hidden_size=t_width,
        intermediate_size=int(t_width * mlp_ratio_t), num_hidden_layers=int(text.get("layers", 12)),
        num_attention_heads=int(text.get("heads", 8)), max_position_embeddings=int(text.get("context_length", 77)),
        hidden_act=act, layer_norm_eps=1e-5, projection_dim=embed,
        bos_token_id=int(bos_token_id), eos_token_id=int(eos_token_id), pad_token_id=int(pad_token_id))
    return CLIPConfig(text_config=text_cfg, vision_config=vision_cfg, projection_dim=embed)


def _blocks(sd: Mapping[str, Any], src: str, dst: str, layers: int, out: dict[str, Any], used: set[str]) -> None:
    for i in range(layers):
        s, d = f"{src}transformer.resblocks.{i}.", f"{dst}encoder.layers.{i}."
        w, b = sd[s + "attn.in_proj_weight"], sd[s + "attn.in_proj_bias"]
        for j, name in enumerate(("q_proj", "k_proj", "v_proj")):   # nn.MultiheadAttention packs rows q | k | v
            out[f"{d}self_attn.{name}.weight"] = w.chunk(3, dim=0)[j]
            out[f"{d}self_attn.{name}.bias"] = b.chunk(3, dim=0)[j]
        pairs = {"attn.out_proj": "self_attn.out_proj", "ln_1": "layer_norm1", "ln_2": "layer_norm2",
                 "mlp.c_fc": "mlp.fc1", "mlp.c_proj": "mlp.fc2"}
        for a, bname in pairs.items():
            for p in ("weight", "bias"):
                out[f"{d}{bname}.{p}"] = sd[f"{s}{a}.{p}"]
                used.add(f"{s}{a}.{p}")
        used.update({s + "attn.in_proj_weight", s + "attn.in_proj_bias"})


def convert_state_dict(sd: Mapping[str, Any], config) -> dict[str, Any]:
    """open_clip state dict -> ``CLIPModel`` state dict for ``config`` (``clip_config_from_open_clip``'s).

    Every open_clip key must be used (the one exception: ``attn_mask``, a constant causal mask that newer open_clip
    keeps out of the state dict) and every shape must match the config; otherwise ``OpenClipConversionError`` names
    the first keys that differ."""
    v_layers, t_layers = config.vision_config.num_hidden_layers, config.text_config.num_hidden_layers
    found_v, found_t = _layer_count(sd, "visual."), _layer_count(sd, "")
    if (found_v, found_t) != (v_layers, t_layers):
        raise OpenClipConversionError(f"the checkpoint has {found_v} image / {found_t} text blocks, the model config "
                                      f"{v_layers} / {t_layers}")
    out: dict[str, Any] = {}
    used: set[str] = set()
    direct = {
        "visual.conv1.weight": "vision_model.embeddings.patch_embedding.weight",
        "visual.class_embedding": "vision_model.embeddings.class_embedding",
        "visual.positional_embedding": "vision_model.embeddings.position_embedding.weight",
        "visual.ln_pre.weight": "vision_model.pre_layrnorm.weight",
        "visual.ln_pre.bias": "vision_model.pre_layrnorm.bias",
        "visual.ln_post.weight": "vision_model.post_layernorm.weight",
        "visual.ln_post.bias": "vision_model.post_layernorm.bias",
        "token_embedding.weight": "text_model.embeddings.token_embedding.weight",
        "positional_embedding": "text_model.embeddings.position_embedding.weight",
        "ln_final.weight": "text_model.final_layer_norm.weight",
        "ln_final.bias": "text_model.final_layer_norm.bias",
        "logit_scale": "logit_scale",
    }
    missing = [k for k in (*direct, "visual.proj", "text_projection") if k not in sd]
    if missing:
        raise OpenClipConversionError(f"not an open_clip ViT CLIP state dict: missing {missing[:4]}")
    for a, b in direct.items():
        out[b] = sd[a]
    out["visual_projection.weight"] = sd["visual.proj"].t()        # pooled @ proj == Linear(weight=proj.T)
    out["text_projection.weight"] = sd["text_projection"].t()
    used.update(direct, {"visual.proj", "text_projection", "attn_mask"})
    try:
        _blocks(sd, "visual.", "vision_model.", v_layers, out, used)
        _blocks(sd, "", "text_model.", t_layers, out, used)
    except KeyError as exc:
        raise OpenClipConversionError(f"not an open_clip ViT CLIP state dict: missing {exc.args[0]!r}") from None
    extra = sorted(set(sd) - used)
    if extra:
        raise OpenClipConversionError(f"keys this converter does not map: {extra[:4]}"
                                      f"{' ...' if len(extra) > 4 else ''}")
    _check_shapes(out, config)
    return {k: v.contiguous() for k, v in out.items()}


def _check_shapes(out: Mapping[str, Any], config) -> None:
    v, t = config.vision_config, config.text_config
    grid = v.image_size // v.patch_size
    expect = {
        "vision_model.embeddings.patch_embedding.weight": (v.hidden_size, 3, v.patch_size, v.patch_size),
        "vision_model.embeddings.position_embedding.weight": (grid * grid + 1, v.hidden_size),
        "vision_model.encoder.layers.0.mlp.fc1.weight": (v.intermediate_size, v.hidden_size),
        "text_model.embeddings.token_embedding.weight": (t.vocab_size, t.hidden_size),
        "text_model.embeddings.position_embedding.weight": (t.max_position_embeddings, t.hidden_size),
        "text_model.encoder.layers.0.mlp.fc1.weight": (t.intermediate_size, t.hidden_size),
        "visual_projection.weight": (config.projection_dim, v.hidden_size),
        "text_projection.weight": (config.projection_dim, t.hidden_size),
    }
    for key, shape in expect.items():
        if tuple(out[key].shape) != shape:
            raise OpenClipConversionError(f"{key}: shape {tuple(out[key].shape)} but the model config makes {shape} "
                                          "(a checkpoint of another architecture?)")


def clip_model_from_open_clip(sd: Mapping[str, Any], oc_config: Mapping[str, Any], tokenizer, *,
                              dtype=None):
    """A ``CLIPModel`` holding an open_clip checkpoint, built by ``CLIPModel.from_pretrained`` from the converted
    state dict (no random initialisation of the full model; loading refuses missing or unexpected keys)."""
    import torch
    from transformers import CLIPModel

    config = clip_config_from_open_clip(oc_config, bos_token_id=tokenizer.bos_token_id,
                                        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    converted = convert_state_dict(sd, config)
    model, info = CLIPModel.from_pretrained(None, config=config, state_dict=converted, dtype=dtype or torch.float32,
                                            output_loading_info=True)
    bad = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
    if bad:
        raise OpenClipConversionError(f"CLIPModel did not take the converted weights as they are: {bad}")
    return model
