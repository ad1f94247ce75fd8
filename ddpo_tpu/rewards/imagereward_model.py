"""ImageReward v1.0 on transformers' BLIP classes, and the converter from the released checkpoint's key names.

The reference model (THUDM/ImageReward@c1392c6 ImageReward/ImageReward.py, models/BLIP/blip_pretrain.py, vit.py,
med.py) is BLIP_Pretrain(vit='large', image_size=224) plus a 5-layer MLP head:

* image encoder ``blip.visual_encoder``: a timm-style ViT (vit.py VisionTransformer): patch-embedding conv, [CLS] +
  absolute position embeddings, pre-norm blocks (LayerNorm eps 1e-6, fused qkv with bias, exact GELU MLP of 4x width),
  a final LayerNorm. transformers' ``BlipVisionModel`` is that layer for layer (``layer_norm1`` / ``self_attn.qkv`` /
  ``self_attn.projection`` / ``layer_norm2`` / ``mlp.fc1,fc2``, then ``post_layernorm``, whose output is
  ``last_hidden_state``). blip.py create_vit: ViT-L/16 is 1024 wide, 24 blocks, 16 heads; ViT-B/16 768, 12, 12: both
  64 per head, which is how the head count is read off a checkpoint here (its shapes give everything else).
* text encoder ``blip.text_encoder``: med.py's BERT (post-norm, no token-type embeddings) with a cross-attention block
  in every layer (med_config.json ``add_cross_attention: true``; its keys/values read the ViT's width,
  blip_pretrain.py sets ``encoder_width = vision_width``). transformers' ``BlipTextModel`` with ``is_decoder=True``
  builds the same layers under the same names (``encoder.layer.N.attention`` / ``crossattention`` / ``intermediate``
  / ``output``); called with ``is_decoder=False`` its self-attention is bidirectional, as med.py's with
  ``is_decoder=False`` (ImageReward.py passes none: the default).
* head ``mlp.layers``: Linear(768, 1024), Dropout(0.2), Linear(1024, 128), Dropout(0.2), Linear(128, 64),
  Dropout(0.1), Linear(64, 16), Linear(16, 1) -- no activations (the ReLUs are commented out in the reference), so
  the checkpoint's keys are ``mlp.layers.{0,2,4,6,7}``. Built here as the same ``nn.Sequential`` (dropouts at the
  same indices, inactive in eval), its widths read from the checkpoint.

Score (ImageReward.py ``inference_rank``): ``(mlp(text_state[:, 0]) - 0.16717362830052426) / 1.0333394966054072``,
the [CLS] token's final state of the text encoder run over the prompt (padded to 35 tokens) with cross-attention to
all image tokens (encoder mask all ones).

Converter (``convert_state_dict``): the renames are the ones transformers' BLIP conversion uses
(huggingface/transformers@9c1ef16 src/transformers/models/blip/convert_blip_original_pytorch_to_hf.py
``rename_key``: visual_encoder -> vision_model, blocks -> layers, attn -> self_attn, attn.proj -> projection,
norm1/2 -> layer_norm1/2, the final norm -> post_layernorm, patch_embed.proj -> embeddings.patch_embedding,
pos_embed -> embeddings.position_embedding, cls_token -> embeddings.class_embedding); the BERT names are already
BlipTextModel's. Keys the score never reads (``blip.vision_proj``, ``blip.text_proj``, the persistent
``position_ids`` buffer of med.py) are dropped; a key missing from the checkpoint is an error, where the reference's
``load_state_dict(strict=False)`` would have scored with a randomly initialised weight.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

__all__ = ["IMAGEREWARD_MEAN", "IMAGEREWARD_STD", "VIT_HEAD_DIM", "VIT_LAYER_NORM_EPS", "HEAD_DROPOUTS",
           "ImageRewardArch", "ImageRewardModel", "arch_from_checkpoint", "convert_state_dict", "load_imagereward",
           "read_med_config"]

# ImageReward.py ImageReward.__init__: the reward's normalisation (the raw head's mean and std on its training set)
IMAGEREWARD_MEAN = 0.16717362830052426
IMAGEREWARD_STD = 1.0333394966054072
VIT_HEAD_DIM = 64           # blip.py create_vit: 768 / 12 heads (base), 1024 / 16 heads (large)
VIT_LAYER_NORM_EPS = 1e-6   # vit.py VisionTransformer: partial(nn.LayerNorm, eps=1e-6)
HEAD_LINEAR_INDICES = (0, 2, 4, 6, 7)        # ImageReward.py MLP.layers: Linear positions in the Sequential
HEAD_DROPOUTS = {1: 0.2, 3: 0.2, 5: 0.1}     # ... and its Dropout positions and rates

_VIS, _TXT, _MLP = "blip.visual_encoder.", "blip.text_encoder.", "mlp.layers."
# in the checkpoint, never read by the score: BLIP's contrastive projections, med.py's position_ids buffer
_UNUSED = re.compile(r"^blip\.(vision_proj|text_proj)\.|^blip\.text_encoder\.embeddings\.position_ids$")


@dataclass(frozen=True)
class ImageRewardArch:
    """What a checkpoint + med_config.json say the model is."""

    vision: dict[str, Any]      # BlipVisionConfig kwargs
    text: dict[str, Any]        # BlipTextConfig kwargs
    head: tuple[int, ...]       # the head's widths, input first: (768, 1024, 128, 64, 16, 1) for v1.0

    @property
    def image_size(self) -> int:
        return int(self.vision["image_size"])


def read_med_config(path: str | os.PathLike) -> dict[str, Any]:
    """med_config.json (a BertConfig JSON, BLIP's), checked for what the reference's text encoder needs."""
    cfg = json.loads(Path(path).read_text())
    if not cfg.get("add_cross_attention"):
        raise ValueError(f"{path}: add_cross_attention is not true; ImageReward's text encoder attends to the image "
                         "in every layer (THUDM/ImageReward's med_config.json sets it)")
    if cfg.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError(f"{path}: position_embedding_type={cfg['position_embedding_type']!r}; only absolute "
                         "positions are ImageReward's")
    return cfg


def arch_from_checkpoint(state_dict: Mapping[str, torch.Tensor], med_config: Mapping[str, Any]) -> ImageRewardArch:
    """The vision tower's shape from the checkpoint's tensors, the text encoder's from med_config.json, the head's
    widths from its Linear weights."""
    def get(key: str) -> torch.Tensor:
        if key not in state_dict:
            raise KeyError(f"the checkpoint has no {key!r}: not an ImageReward checkpoint (ImageReward.pt)")
        return state_dict[key]

    width = get(_VIS + "cls_token").shape[-1]
    patch = get(_VIS + "patch_embed.proj.weight").shape[-1]
    positions = get(_VIS + "pos_embed").shape[1]
    grid = math.isqrt(positions - 1)
    if grid * grid != positions - 1:
        raise ValueError(f"{_VIS}pos_embed has {positions} positions: not [CLS] + a square grid of patches")
    depth = len({k.split(".")[3] for k in state_dict if k.startswith(_VIS + "blocks.")})
    if width % VIT_HEAD_DIM:
        raise ValueError(f"ViT width {width} is not a multiple of BLIP's {VIT_HEAD_DIM}-wide heads")
    vision = dict(hidden_size=width, intermediate_size=get(_VIS + "blocks.0.mlp.fc1.weight").shape[0],
                  num_hidden_layers=depth, num_attention_heads=width // VIT_HEAD_DIM, image_size=grid * patch,
                  patch_size=patch, hidden_act="gelu", layer_norm_eps=VIT_LAYER_NORM_EPS, attention_dropout=0.0)
    m = med_config
    text = dict(vocab_size=m["vocab_size"], hidden_size=m["hidden_size"], encoder_hidden_size=width,
                intermediate_size=m["intermediate_size"], num_hidden_layers=m["num_hidden_layers"],
                num_attention_heads=m["num_attention_heads"], max_position_embeddings=m["max_position_embeddings"],
                hidden_act=m.get("hidden_act", "gelu"), layer_norm_eps=m.get("layer_norm_eps", 1e-12),
                pad_token_id=m.get("pad_token_id", 0), hidden_dropout_prob=m.get("hidden_dropout_prob", 0.1),
                attention_probs_dropout_prob=m.get("attention_probs_dropout_prob", 0.1),
                bos_token_id=None, eos_token_id=None, sep_token_id=None,  # generation ids: not read by a score
                is_decoder=True)  # builds the cross-attention blocks; the forward runs it as an encoder
    linears = [get(f"{_MLP}{i}.weight") for i in HEAD_LINEAR_INDICES]
    head = (linears[0].shape[1], *(w.shape[0] for w in linears))
    if head[0] != m["hidden_size"] or head[-1] != 1:
        raise ValueError(f"the head's widths {head} do not take the text encoder's {m['hidden_size']}-wide [CLS] "
                         "state to one score")
    return ImageRewardArch(vision=vision, text=text, head=head)


def _vision_key(rest: str) -> str:
    """A ``blip.visual_encoder.`` key (without the prefix) as BlipVisionModel names it."""
    fixed = {"cls_token": "embeddings.class_embedding", "pos_embed": "embeddings.position_embedding",
             "patch_embed.proj.weight": "embeddings.patch_embedding.weight",
             "patch_embed.proj.bias": "embeddings.patch_embedding.bias",
             "norm.weight": "post_layernorm.weight", "norm.bias": "post_layernorm.bias"}
    if rest in fixed:
        return fixed[rest]
    m = re.fullmatch(r"blocks\.(\d+)\.(norm1|norm2|attn\.qkv|attn\.proj|mlp\.fc1|mlp\.fc2)\.(weight|bias)", rest)
    if m is None:
        raise KeyError(f"{_VIS}{rest}: not a key of BLIP's ViT")
    block, part, kind = m.groups()
    part = {"norm1": "layer_norm1", "norm2": "layer_norm2", "attn.qkv": "self_attn.qkv",
            "attn.proj": "self_attn.projection"}.get(part, part)
    return f"encoder.layers.{block}.{part}.{kind}"


def convert_state_dict(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """ImageReward.pt's keys -> ImageRewardModel's (``vision_model.*``, ``text_encoder.*``, ``head.*``)."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        if _UNUSED.search(key):
            continue
        if key.startswith(_VIS):
            out["vision_model." + _vision_key(key[len(_VIS):])] = value
        elif key.startswith(_TXT):
            out["text_encoder." + key[len(_TXT):]] = value
        elif key.startswith(_MLP):
            out["head." + key[len(_MLP):]] = value
        else:
            raise KeyError(f"{key}: not a key of ImageReward (blip.visual_encoder.*, blip.text_encoder.*, "
                           "mlp.layers.*)")
    return out


class ImageRewardModel(nn.Module):
    """BlipVisionModel -> BlipTextModel (cross-attending to every image token) -> [CLS] -> MLP -> normalised."""

    def __init__(self, arch: ImageRewardArch):
        super().__init__()
        from transformers import BlipTextConfig, BlipTextModel, BlipVisionConfig, BlipVisionModel

        self.arch = arch
        self.vision_model = BlipVisionModel(BlipVisionConfig(**arch.vision))
        self.text_encoder = BlipTextModel(BlipTextConfig(**arch.text), add_pooling_layer=False)
        layers: list[nn.Module] = []
        widths = arch.head
        for i in range(len(widths) - 1):
            layers.append(nn.Linear(widths[i], widths[i + 1]))
            if len(layers) in HEAD_DROPOUTS:
                layers.append(nn.Dropout(HEAD_DROPOUTS[len(layers)]))
        self.head = nn.Sequential(*layers)

    def forward(self, pixel_values: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor
                ) -> torch.Tensor:
        """pixel_values (B, 3, S, S) normalised, input_ids / attention_mask (B, L) -> the scores, (B,)."""
        image_embeds = self.vision_model(pixel_values=pixel_values).last_hidden_state
        image_atts = torch.ones(image_embeds.shape[:-1], dtype=torch.long, device=image_embeds.device)
        text = self.text_encoder(input_ids=input_ids, attention_mask=attention_mask,
                                 encoder_hidden_states=image_embeds, encoder_attention_mask=image_atts)
        raw = self.head(text.last_hidden_state[:, 0, :].float())
        return ((raw - IMAGEREWARD_MEAN) / IMAGEREWARD_STD)[:, 0]


def load_imagereward(checkpoint: str | os.PathLike, med_config: str | os.PathLike) -> ImageRewardModel:
    """ImageReward.pt + med_config.json -> ImageRewardModel in float32, eval mode, every weight from the file."""
    state_dict = torch.load(str(checkpoint), map_location="cpu", weights_only=True)
    if not isinstance(state_dict, Mapping):
        raise ValueError(f"{checkpoint}: holds a {type(state_dict).__name__}, not a state dict")
    arch = arch_from_checkpoint(state_dict, read_med_config(med_config))
    with torch.device("meta"):
        model = ImageRewardModel(arch)
    converted = convert_state_dict(state_dict)
    expected = set(model.state_dict())
    missing, unexpected = sorted(expected - set(converted)), sorted(set(converted) - expected)
    if missing or unexpected:
        raise KeyError(f"{checkpoint}: does not fit ImageReward's layout (missing {missing[:5]}, unexpected "
                       f"{unexpected[:5]})")
    model.load_state_dict({k: v.float() for k, v in converted.items()}, strict=True, assign=True)
    # non-persistent buffers (the text position ids) are not in any state dict: made on the CPU
    for mod in model.modules():
        for name, buf in list(mod.named_buffers(recurse=False)):
            if buf.is_meta:
                if name != "position_ids":
                    raise RuntimeError(f"unexpected buffer {name} left unset")
                mod.register_buffer(name, torch.arange(buf.shape[-1]).expand(buf.shape), persistent=False)
    return model.eval().requires_grad_(False)
