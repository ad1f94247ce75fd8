"""The Wan family's memory figures (catalog/families.py, WAN): computed from the transformer's config and the video's
tokens, not tabled at 512 px, because a video's token count follows model.num_frames and the frame size:

    tokens S = latent frames x patches per frame = ((F - 1) / 4 + 1) x (H / 16) x (W / 16)
    (flow_grpo's 33 x 240 x 416: 9 x 15 x 26 = 3510), and L = 512 UMT5 tokens (cross-attention only).

Per denoiser evaluation and sample (estimates for the HBM rule, not TPU figures):

* what eager CPU saves for the backward (float32, LoRA on the attention projections), per block:
  ``S (14 dim + ffn + 2 heads + 33) + L (3 dim + 9) + 8 dim`` values, fitted to the bytes autograd saves
  (saved_tensors_hooks) over one block (3 blocks less 2) of WanTransformer3DModel at 12 toy shapes (dim 32-128, ffn
  64-256, 2-8 heads, S 32-256, L 16-512): the least-squares fit is these integers, exact on every shape
  (`python scripts/bench.py --wan-memory`, which also sets the tiny build's whole saved bytes and peak RSS beside it;
  tests/unit/config/test_wan_memory.py checks a block of the tiny build). bf16: float32's x 0.74, SD 3.5's measured
  ratio (not probed here);
* plus what XLA keeps and eager CPU does not: each attention's float32 softmax, heads x (S^2 + S L) x 4 bytes a
  block (self-attention over the video, cross-attention to the text), as the other families' figures;
* with activation checkpointing: every block's input (dim values a token, float32) and one block's recomputation,
  plus CKPT_HELD_BLOCKS blocks' softmaxes. The one measurement (SD 1.4's topology on XLA CPU, docs/performance.md)
  kept 0.51 of its softmaxes with checkpointing; nearly all of them are its 5 attentions at 4096 tokens, so about 2.6
  of its largest attentions at once. The other families scale 0.51 with their attention count; for Wan's 30-40 blocks
  that would hold 15-20 blocks' recomputations at once, which the measurement does not show: here 3 blocks (2.6 up).

Wan 2.2 (docs/families.md): TI2V-5B's video tokens are ((F - 1) / 4 + 1) x (H / 32) x (W / 32) (its VAE compresses
16x and the transformer patches 2x2), read from the checkpoint's ``in_channels`` 48; its VAE is the larger Wan 2.2 VAE.
T2V-A14B has two experts of Wan 2.1 14B's shape: both are resident (each denoising step calls one, but a run samples
and trains across the boundary), LoRA and its optimizer state are counted on each trained expert
(model.train_experts), and one evaluation's activations are one expert's (the experts never run in the same pass,
except a mixed training batch on XLA, which the figures do not count).

Resident (held through training): the transformer's weights (counted from its config, split by mesh.fsdp), UMT5-XXL's
encoder and the VAE (whole), LoRA's values x (weight, gradient, 2 AdamW moments, EMA) in float32, and 1 GiB for an
epoch's trajectories (flow_grpo's 16 videos a GPU x 21 latents of 0.86 MiB: 0.3 GiB) and the runtime.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ddpo_tpu.catalog.memory_figures import GIB, FamilyMemory

TEXT_TOKENS = 512                  # UMT5 tokens: flow_grpo's max_sequence_length for Wan, also its prompt keys
DEFAULT_FRAME = (240, 416)         # flow_grpo's general_ocr_wan2_1 (config/grpo.py): height 240, width 416
PIXELS_PER_TOKEN = 16              # the VAE's 8x and the transformer's 2x2 patches
FRAMES_PER_LATENT = 4              # the VAE's temporal compression after the first frame
# Wan-AI/Wan2.1-T2V-1.3B-Diffusers and -14B-Diffusers transformer/config.json (diffusers' WanTransformer3DModel; its
# defaults are the 14B's widths): the keys the figures read
_COMMON = dict(patch_size=(1, 2, 2), in_channels=16, out_channels=16, text_dim=4096, freq_dim=256)
WAN21_T2V = {
    "Wan-AI/Wan2.1-T2V-1.3B-Diffusers": dict(_COMMON, num_attention_heads=12, attention_head_dim=128, ffn_dim=8960,
                                             num_layers=30),
    "Wan-AI/Wan2.1-T2V-14B-Diffusers": dict(_COMMON, num_attention_heads=40, attention_head_dim=128, ffn_dim=13824,
                                            num_layers=40),
}
# Wan-AI/Wan2.2-TI2V-5B-Diffusers transformer/config.json (48 channels, 24 heads of 128, ffn 14336, 30 layers) and
# Wan-AI/Wan2.2-T2V-A14B-Diffusers transformer/ and transformer_2/ (each Wan 2.1 14B's shape)
WAN22 = {
    "Wan-AI/Wan2.2-TI2V-5B-Diffusers": dict(_COMMON, in_channels=48, out_channels=48, num_attention_heads=24,
                                            attention_head_dim=128, ffn_dim=14336, num_layers=30),
    "Wan-AI/Wan2.2-T2V-A14B-Diffusers": WAN21_T2V["Wan-AI/Wan2.1-T2V-14B-Diffusers"],
}
EXPERTS = {"Wan-AI/Wan2.2-T2V-A14B-Diffusers": 2}  # transformers a known checkpoint holds (else model_index.json's)
DEFAULT_CONFIG = WAN21_T2V["Wan-AI/Wan2.1-T2V-14B-Diffusers"]
# UMT5-XXL's encoder (the checkpoints' text_encoder/, d_model 4096, 24 layers, vocabulary 256384) and AutoencoderKLWan
# (Wan 2.1's, the class defaults), in billions of values, counted on the meta device
# (tests/unit/config/test_wan_memory.py)
UMT5_XXL_BILLIONS, VAE_BILLIONS = 5.681, 0.127
# the Wan 2.2 VAE (Wan-AI/Wan2.2-TI2V-5B-Diffusers vae/config.json: base_dim 160, decoder_base_dim 256, z_dim 48),
# counted on the meta device (tests/unit/models/test_wan22_model.py)
VAE22_BILLIONS = 0.705
STATE_GIB = 1.0
# the fit (module docstring): values saved per block per video token and per text token
SAVED_PER_TOKEN = dict(dim=14, ffn=1, heads=2, const=33)
SAVED_PER_TEXT_TOKEN = dict(dim=3, const=9)
SAVED_PER_BLOCK_DIM = 8            # token-independent values a block saves per unit of width
BF16_RATIO = 0.74                  # SD 3.5's measured bf16 / float32 ratio of saved activations
CKPT_HELD_BLOCKS = 3               # blocks whose softmaxes XLA holds at once with checkpointing (docstring)


def transformer_config(model) -> dict[str, Any]:
    """The config the figures use: a local checkpoint's transformer/config.json, a known hub id's, else the class
    defaults (the 14B's: the larger, so a refusal errs toward safety)."""
    pretrained = model.pretrained or ""
    path = Path(pretrained).expanduser() / "transformer" / "config.json"
    try:
        return dict(DEFAULT_CONFIG, **json.loads(path.read_text()))
    except (OSError, ValueError):
        return WAN21_T2V.get(pretrained) or WAN22.get(pretrained, DEFAULT_CONFIG)


def experts(model) -> int:
    """Transformers the checkpoint holds: 2 for Wan 2.2 A14B (model_index.json names a transformer_2), else 1."""
    pretrained = model.pretrained or ""
    if model.builder == "tiny_wan22":
        return 2
    path = Path(pretrained).expanduser() / "model_index.json"
    try:
        return 2 if (json.loads(path.read_text()).get("transformer_2") or [None])[0] else 1
    except (OSError, ValueError, AttributeError):
        return EXPERTS.get(pretrained, 1)


def trained_experts(model) -> int:
    """Experts that carry LoRA (or train whole): model.train_experts' count, null: all of them."""
    return len(model.train_experts) if model.train_experts is not None else experts(model)


def pixels_per_token(c: dict[str, Any]) -> int:
    """Pixels a video token spans: 16 for Wan 2.1 / A14B (VAE 8 x patch 2), 32 for TI2V-5B's 48-channel latents
    (its VAE 16 x patch 2)."""
    return 2 * PIXELS_PER_TOKEN if c["in_channels"] == 48 else PIXELS_PER_TOKEN


def transformer_parameters(c: dict[str, Any]) -> int:
    """WanTransformer3DModel's parameter count (text-to-video: no image embedder, no added K/V) from its config."""
    dim, ffn, patch = c["num_attention_heads"] * c["attention_head_dim"], c["ffn_dim"], c["patch_size"]
    p = patch[0] * patch[1] * patch[2]
    embed = (c["in_channels"] * p * dim + dim                           # patch_embedding (Conv3d)
             + c["freq_dim"] * dim + dim + dim * dim + dim              # time_embedder
             + dim * 6 * dim + 6 * dim                                  # time_proj (the blocks' modulation)
             + c["text_dim"] * dim + dim + dim * dim + dim)             # text_embedder
    # attn1 and attn2: q, k, v, out (with biases) and RMS q/k norms; norm2's affine; the feed-forward; the modulation
    block = 2 * (4 * (dim * dim + dim) + 2 * dim) + 2 * dim + 2 * dim * ffn + ffn + dim + 6 * dim
    head = dim * c["out_channels"] * p + c["out_channels"] * p + 2 * dim  # proj_out, scale_shift_table
    return embed + c["num_layers"] * block + head


def tokens(model) -> int:
    """Video tokens a sample has: latent frames x patches per frame."""
    height, width = (model.resolution, model.resolution) if model.resolution else DEFAULT_FRAME
    frames = (int(model.num_frames or 1) - 1) // FRAMES_PER_LATENT + 1
    px = pixels_per_token(transformer_config(model))
    return frames * (height // px) * (width // px)


def saved_values_per_block(c: dict[str, Any], S: int, L: int = TEXT_TOKENS) -> int:
    """Values eager CPU saves for the backward in one block (float32, the fit in the module docstring)."""
    dim, heads = c["num_attention_heads"] * c["attention_head_dim"], c["num_attention_heads"]
    t, x = SAVED_PER_TOKEN, SAVED_PER_TEXT_TOKEN
    return (S * (t["dim"] * dim + t["ffn"] * c["ffn_dim"] + t["heads"] * heads + t["const"])
            + L * (x["dim"] * dim + x["const"]) + SAVED_PER_BLOCK_DIM * dim)


def attention_scores_gib(c: dict[str, Any], S: int, L: int = TEXT_TOKENS, blocks: int | None = None) -> float:
    """The float32 softmaxes XLA keeps for the backward: heads x (S^2 + S L) a block, over every block (or `blocks`)."""
    return (blocks or c["num_layers"]) * c["num_attention_heads"] * (S * S + S * L) * 4 / GIB


def activation_gib(model, precision: str, checkpointed: bool) -> float:
    """GiB one evaluation of one sample keeps for the backward on XLA (module docstring)."""
    c, S = transformer_config(model), tokens(model)
    block = saved_values_per_block(c, S) * 4 / GIB
    dim = c["num_attention_heads"] * c["attention_head_dim"]
    eager = (c["num_layers"] * S * dim * 4 / GIB + block) if checkpointed else c["num_layers"] * block
    scale = BF16_RATIO if precision == "bf16" else 1.0
    held = min(CKPT_HELD_BLOCKS, c["num_layers"]) if checkpointed else None
    return eager * scale + attention_scores_gib(c, S, blocks=held)


def lora_values(model, c: dict[str, Any]) -> int:
    """LoRA's values on the blocks' attention projections and feed-forward layers its targets name (peft's match: the
    module path, or a suffix of it after a dot)."""
    if not model.lora.enabled:
        return 0
    dim, ffn, r = c["num_attention_heads"] * c["attention_head_dim"], c["ffn_dim"], model.lora.rank
    shapes = {f"attn{a}.{p}": (dim, dim) for a in (1, 2) for p in ("to_q", "to_k", "to_v", "to_out.0")}
    shapes |= {"ffn.net.0.proj": (dim, ffn), "ffn.net.2": (ffn, dim)}
    targets = model.lora.target_modules
    return c["num_layers"] * sum(r * (i + o) for path, (i, o) in shapes.items()
                                 if any(path == t or path.endswith("." + t) for t in targets))


def vae_billions(c: dict[str, Any]) -> float:
    return VAE22_BILLIONS if c["in_channels"] == 48 else VAE_BILLIONS


def resident_gib(model, fsdp: int, dtype: str) -> float:
    c = transformer_config(model)
    size = 2 if dtype == "bfloat16" else 4
    frozen = (experts(model) * transformer_parameters(c) / fsdp * size + UMT5_XXL_BILLIONS * 1e9 * size
              + vae_billions(c) * 1e9 * 4)
    return (frozen + trained_experts(model) * lora_values(model, c) * 20) / GIB + STATE_GIB


def figures(model):
    """This model config's FamilyMemory (the catalog's WAN spec calls it): the per-evaluation tables at its own video
    size, keyed by train.mixed_precision, and the resident and full fine-tune figures of its transformer."""
    return FamilyMemory(
        activation_gib_per_eval_512={p: activation_gib(model, p, False) for p in ("no", "bf16")},
        checkpointed_gib_per_eval_512={p: activation_gib(model, p, True) for p in ("no", "bf16")},
        resident_gib=resident_gib,
        full_finetune_gib=lambda fsdp: full_finetune_gib(model, fsdp),
        fsdp_splits_frozen_weights=True,
    )


def full_finetune_gib(model, fsdp: int) -> float:
    """The trained experts x (weight, gradient, 2 AdamW moments) x 4 bytes split by fsdp, a frozen expert in bf16;
    UMT5 (bf16) and the VAE whole."""
    c = transformer_config(model)
    whole = (UMT5_XXL_BILLIONS * 2 + vae_billions(c) * 4) * 1e9 / GIB + STATE_GIB
    trained = trained_experts(model)
    frozen = experts(model) - trained
    return transformer_parameters(c) * (16 * trained + 2 * frozen) / GIB / fsdp + whole
