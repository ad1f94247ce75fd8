"""A tiny random-weight stand-in for ImageReward v1.0, written in the released files' own layout.

``ImageRewardReward`` loads the real model from THUDM/ImageReward's two files and bert-base-uncased's tokenizer; the
stand-in writes the same three things, so the same loading code (``torch.load`` + the key converter of
``imagereward_model.py`` + ``BertTokenizer.from_pretrained`` + BLIP's added tokens) runs on it::

    OUT_DIR/ImageReward.pt     a state dict with the released key names: blip.visual_encoder.* (timm ViT names),
                               blip.text_encoder.* (med.py BERT names, with its position_ids buffer),
                               blip.vision_proj.* / blip.text_proj.* (unused by the score, present in the release),
                               mlp.layers.{0,2,4,6,7}.*
    OUT_DIR/med_config.json    a BertConfig JSON as BLIP's (add_cross_attention true, vocab = the tokenizer's + 2)
    OUT_DIR/tokenizer/         a BERT WordPiece tokenizer (save_pretrained) over a small lowercase vocabulary

Architecture (``TINY_IMAGEREWARD_VERSION`` names it; bump it whenever anything here changes): ViT 128 wide, 2 blocks,
2 heads of 64 (BLIP's head width), patch 16 on 32 x 32 images (2 x 2 patches + [CLS]), MLP ratio 4; text BERT 32 wide,
2 layers, 4 heads, intermediate 64, 40 positions (>= the 35 tokens ImageReward pads to); the head keeps the
reference's hidden widths (1024, 128, 64, 16, 1) on the 32-wide [CLS] state. Weights: N(0, 0.1) for the encoders
(LayerNorm scales 1 + N(0, 0.1), biases N(0, 0.1)) and std 1/sqrt(fan_in) for the head, so scores differ by
tenths between images and between prompts; the reference's training init of the head (std 1/(768 + 1), biases 0)
would give every image nearly the same score.
"""

from __future__ import annotations

import json
import os
import string
from pathlib import Path

__all__ = ["TINY_IMAGEREWARD_VERSION", "TINY_ARCH", "build_tiny_imagereward", "ensure_tiny_imagereward",
           "tiny_reference_state_dict"]

TINY_IMAGEREWARD_VERSION = "v1"
ENCODER_STD = 0.1
CHECKPOINT, MED_CONFIG, TOKENIZER_SUBDIR = "ImageReward.pt", "med_config.json", "tokenizer"
_REQUIRED_FILES = (CHECKPOINT, MED_CONFIG, f"{TOKENIZER_SUBDIR}/vocab.txt", f"{TOKENIZER_SUBDIR}/tokenizer_config.json")

TINY_ARCH = dict(vit_width=128, vit_depth=2, vit_patch=16, vit_image=32, vit_mlp_ratio=4,
                 text_width=32, text_layers=2, text_heads=4, text_intermediate=64, text_positions=40,
                 head=(1024, 128, 64, 16, 1), embed_dim=16)

_WORDS = ("a an the of on in with and photo picture painting cat cats dog dogs red blue green yellow black white "
          "two three sign says hello bicycle moon chess playing astronaut glove floating").split()


def _vocab() -> list[str]:
    """BERT's special tokens, whole words, then single characters and their ## continuations: WordPiece can spell
    any lowercase ASCII prompt with them (no [UNK] but for other scripts)."""
    chars = list(string.ascii_lowercase + string.digits) + list(string.punctuation)
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *_WORDS, *chars,
              *[f"##{c}" for c in string.ascii_lowercase + string.digits]]
    return list(dict.fromkeys(tokens))  # once each ("a" is a word and a letter)


def _med_config(vocab_size: int) -> dict:
    a = TINY_ARCH
    return {"architectures": ["BertModel"], "attention_probs_dropout_prob": 0.1, "hidden_act": "gelu",
            "hidden_dropout_prob": 0.1, "hidden_size": a["text_width"], "initializer_range": 0.02,
            "intermediate_size": a["text_intermediate"], "layer_norm_eps": 1e-12,
            "max_position_embeddings": a["text_positions"], "model_type": "bert",
            "num_attention_heads": a["text_heads"], "num_hidden_layers": a["text_layers"], "pad_token_id": 0,
            "type_vocab_size": 2, "vocab_size": vocab_size, "encoder_width": a["text_width"],
            "add_cross_attention": True}


def tiny_reference_state_dict(vocab_size: int, seed: int = 0) -> dict:
    """Random tensors under every key (and shape) of the released checkpoint's layout, at the tiny sizes."""
    import torch

    a = TINY_ARCH
    g = torch.Generator().manual_seed(seed)
    sd: dict[str, torch.Tensor] = {}

    def w(*shape: int, std: float = ENCODER_STD) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    def linear(name: str, n_in: int, n_out: int, std: float = ENCODER_STD) -> None:
        sd[f"{name}.weight"], sd[f"{name}.bias"] = w(n_out, n_in, std=std), w(n_out, std=std)

    def norm(name: str, n: int) -> None:
        sd[f"{name}.weight"], sd[f"{name}.bias"] = 1 + w(n, std=0.1), w(n)

    vw, grid = a["vit_width"], a["vit_image"] // a["vit_patch"]
    v = "blip.visual_encoder."
    sd[v + "cls_token"], sd[v + "pos_embed"] = w(1, 1, vw), w(1, grid * grid + 1, vw)
    sd[v + "patch_embed.proj.weight"] = w(vw, 3, a["vit_patch"], a["vit_patch"])
    sd[v + "patch_embed.proj.bias"] = w(vw)
    for i in range(a["vit_depth"]):
        b = f"{v}blocks.{i}."
        norm(b + "norm1", vw)
        linear(b + "attn.qkv", vw, 3 * vw)
        linear(b + "attn.proj", vw, vw)
        norm(b + "norm2", vw)
        linear(b + "mlp.fc1", vw, a["vit_mlp_ratio"] * vw)
        linear(b + "mlp.fc2", a["vit_mlp_ratio"] * vw, vw)
    norm(v + "norm", vw)

    tw, t = a["text_width"], "blip.text_encoder."
    sd[t + "embeddings.position_ids"] = torch.arange(a["text_positions"]).expand((1, -1)).clone()
    sd[t + "embeddings.word_embeddings.weight"] = w(vocab_size, tw)
    sd[t + "embeddings.position_embeddings.weight"] = w(a["text_positions"], tw)
    norm(t + "embeddings.LayerNorm", tw)
    for i in range(a["text_layers"]):
        b = f"{t}encoder.layer.{i}."
        for block, kv_width in (("attention", tw), ("crossattention", vw)):
            linear(f"{b}{block}.self.query", tw, tw)
            linear(f"{b}{block}.self.key", kv_width, tw)
            linear(f"{b}{block}.self.value", kv_width, tw)
            linear(f"{b}{block}.output.dense", tw, tw)
            norm(f"{b}{block}.output.LayerNorm", tw)
        linear(b + "intermediate.dense", tw, a["text_intermediate"])
        linear(b + "output.dense", a["text_intermediate"], tw)
        norm(b + "output.LayerNorm", tw)
    linear("blip.vision_proj", vw, a["embed_dim"])
    linear("blip.text_proj", tw, a["embed_dim"])

    widths = (tw, *a["head"])
    for index, n_in, n_out in zip((0, 2, 4, 6, 7), widths[:-1], widths[1:]):
        linear(f"mlp.layers.{index}", n_in, n_out, std=n_in ** -0.5)
    return sd


def build_tiny_imagereward(out_dir: str | os.PathLike, seed: int = 0) -> tuple[Path, Path, Path]:
    """Write ImageReward.pt, med_config.json and tokenizer/ into ``out_dir``; returns their paths in that order."""
    import torch

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vocab = _vocab()
    tok_dir = out / TOKENIZER_SUBDIR
    tok_dir.mkdir(exist_ok=True)
    (tok_dir / "vocab.txt").write_text("\n".join(vocab) + "\n")
    # what from_pretrained reads of bert-base-uncased's own files (vocab.txt, tokenizer_config.json), no more
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "BertTokenizer", "do_lower_case": True, "model_max_length": 512}, indent=2) + "\n")
    vocab_size = len(vocab) + 2  # + BLIP's [DEC] and [ENC] (blip.py init_tokenizer), as bert-base's 30522 -> 30524
    (out / MED_CONFIG).write_text(json.dumps(_med_config(vocab_size), indent=2) + "\n")
    torch.save(tiny_reference_state_dict(vocab_size, seed=seed), str(out / CHECKPOINT))
    return out / CHECKPOINT, out / MED_CONFIG, tok_dir


def ensure_tiny_imagereward(cache_dir: str | os.PathLike, seed: int = 0) -> tuple[Path, Path, Path]:
    """``(checkpoint, med_config, tokenizer_dir)`` under ``cache_dir``, built once atomically
    (``proc/build_cache.build_once``)."""
    from ddpo_tpu.proc.build_cache import build_once

    name = f"tiny-imagereward-{TINY_IMAGEREWARD_VERSION}-seed{seed}"
    final = build_once(cache_dir, name, _REQUIRED_FILES, lambda tmp: build_tiny_imagereward(tmp, seed=seed))
    return final / CHECKPOINT, final / MED_CONFIG, final / TOKENIZER_SUBDIR
