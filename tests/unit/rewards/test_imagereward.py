"""ImageReward v1.0 (Flow-GRPO's `imagereward` reward) on the tiny random build in the released checkpoint's layout.

The parity test scores the same images and prompts twice: with ``reward=imagereward`` (transformers' BLIP classes fed
by the key converter) and with the reference's computation written out below from its code, reading the tiny
ImageReward.pt by the reference's own key names:

* THUDM/ImageReward@c1392c6 ImageReward/ImageReward.py -- ``_transform`` (Resize(224, BICUBIC), CenterCrop(224),
  RGB, ToTensor, Normalize(BLIP mean/std)), ``MLP`` (Linear/Dropout at 0..7, no activations), ``inference_rank``
  (one prompt tokenised with padding="max_length", truncation, max_length=35; one image per forward; the [CLS] state
  through the MLP; (r - 0.16717362830052426) / 1.0333394966054072);
* models/BLIP/vit.py -- ``VisionTransformer.forward`` / ``Block`` / ``Attention`` / ``Mlp`` (conv patches, [CLS] +
  pos_embed, pre-norm blocks with LayerNorm eps 1e-6, fused qkv reshaped (B, N, 3, heads, C/heads), scale
  head_dim**-0.5, exact GELU, final norm);
* models/BLIP/med.py -- ``BertEmbeddings`` (word + absolute positions, LayerNorm; no token types), ``BertModel
  .get_extended_attention_mask`` ((1 - mask) * -10000), ``invert_attention_mask`` for the image tokens,
  ``BertSelfAttention`` (scores / sqrt(head size) + mask, softmax), ``BertSelfOutput`` / ``BertOutput`` (post-norm
  LayerNorm(dense(x) + input)), ``BertLayer`` with mode='multimodal' (self-attention, cross-attention on its output,
  then the feed-forward), ``BertIntermediate`` (gelu);
* models/BLIP/blip.py ``init_tokenizer`` (bert-base-uncased + [DEC] as bos_token + [ENC] as an additional special
  token) and blip_pretrain.py (``encoder_width = vision_width``).
The resize and centre crop are torchvision's on a PIL image (torchvision 0.21, the one flow_grpo's torch 2.6 pairs
with, transforms/functional.py ``resize`` -> ``_compute_resized_output_size`` + PIL ``Image.resize``; ``center_crop``
-> ``int(round((h - size) / 2.0))`` + PIL ``Image.crop``), written here without torchvision (not installed).
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from pydantic import TypeAdapter

from ddpo_tpu.config.schema import RewardConfig
from ddpo_tpu.rewards import REWARDS, RewardError, make_reward
from ddpo_tpu.rewards.from_config import reward_from_config, reward_kwargs
from ddpo_tpu.rewards.imagereward import ImageRewardReward
from ddpo_tpu.rewards.tiny_imagereward import ensure_tiny_imagereward, tiny_reference_state_dict

PROMPTS = ["a cat", "a red bicycle on the moon", "two dogs playing chess", 'a sign that says "hello"',
           # longer than 35 tokens once spelt in word pieces: truncated as the reference truncates
           "a photo of an astronaut glove floating in zero gravity with the words nasa twenty forty nine on it"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("imagereward")


@pytest.fixture(scope="module")
def tiny(cache):
    return ensure_tiny_imagereward(cache)


@pytest.fixture(scope="module")
def reward(tiny):
    checkpoint, _, tokenizer = tiny
    return make_reward("imagereward", checkpoint=str(checkpoint), tokenizer=str(tokenizer))  # med_config beside


def _images(n, h, w, seed=0):
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, (n, 1, 1, 3))   # a colour per image, with noise: images that score apart
    return np.clip(base + rng.integers(-60, 61, (n, h, w, 3)), 0, 255).astype(np.uint8)


# --- the reference, from its code -------------------------------------------------------------------------------

def _reference_tokenizer(tokenizer_dir):
    from transformers import BertTokenizer

    tok = BertTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    tok.add_special_tokens({"bos_token": "[DEC]"})
    tok.add_special_tokens({"additional_special_tokens": ["[ENC]"]})
    return tok


def _reference_pixels(image: np.ndarray, n_px: int) -> torch.Tensor:
    """ImageReward.py _transform(n_px) on Image.fromarray(image), as torchvision does it on a PIL image."""
    from PIL import Image

    pil = Image.fromarray(image)
    w, h = pil.size
    if w <= h:
        size = (n_px, int(n_px * h / w))            # (w, h)
    else:
        size = (int(n_px * w / h), n_px)
    pil = pil.resize(size, Image.BICUBIC)
    top, left = int(round((pil.size[1] - n_px) / 2.0)), int(round((pil.size[0] - n_px) / 2.0))
    pil = pil.crop((left, top, left + n_px, top + n_px)).convert("RGB")
    x = torch.from_numpy(np.array(pil)).permute(2, 0, 1).float().div(255)      # ToTensor
    mean = torch.tensor((0.48145466, 0.4578275, 0.40821073)).view(3, 1, 1)
    std = torch.tensor((0.26862954, 0.26130258, 0.27577711)).view(3, 1, 1)
    return ((x - mean) / std)[None]


def _linear(sd, name, x):
    return F.linear(x, sd[f"{name}.weight"], sd[f"{name}.bias"])


def _norm(sd, name, x, eps):
    return F.layer_norm(x, x.shape[-1:], sd[f"{name}.weight"], sd[f"{name}.bias"], eps)


def _reference_vit(sd, image, heads):
    """vit.py VisionTransformer.forward (eval: dropouts and drop-path are identities)."""
    p = "blip.visual_encoder."
    patch = sd[p + "patch_embed.proj.weight"].shape[-1]
    x = F.conv2d(image, sd[p + "patch_embed.proj.weight"], sd[p + "patch_embed.proj.bias"], stride=patch)
    x = x.flatten(2).transpose(1, 2)                                          # timm PatchEmbed
    B = x.shape[0]
    x = torch.cat((sd[p + "cls_token"].expand(B, -1, -1), x), dim=1)
    x = x + sd[p + "pos_embed"][:, :x.size(1), :]
    depth = len({k.split(".")[3] for k in sd if k.startswith(p + "blocks.")})
    for i in range(depth):
        b = f"{p}blocks.{i}."
        y = _norm(sd, b + "norm1", x, 1e-6)
        B, N, C = y.shape
        qkv = _linear(sd, b + "attn.qkv", y).reshape(B, N, 3, heads, C // heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        attn = ((q @ k.transpose(-2, -1)) * (C // heads) ** -0.5).softmax(dim=-1)
        x = x + _linear(sd, b + "attn.proj", (attn @ v).transpose(1, 2).reshape(B, N, C))
        y = _norm(sd, b + "norm2", x, 1e-6)
        x = x + _linear(sd, b + "mlp.fc2", F.gelu(_linear(sd, b + "mlp.fc1", y)))
    return _norm(sd, p + "norm", x, 1e-6)


def _reference_attention(sd, name, hidden, context, mask, heads):
    """med.py BertSelfAttention + BertSelfOutput (context: the image embeddings in cross-attention)."""
    def split(t):
        return t.view(*t.shape[:-1], heads, t.shape[-1] // heads).permute(0, 2, 1, 3)

    q = split(_linear(sd, f"{name}.self.query", hidden))
    k, v = split(_linear(sd, f"{name}.self.key", context)), split(_linear(sd, f"{name}.self.value", context))
    scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(q.shape[-1]) + mask
    ctx = torch.matmul(torch.softmax(scores, dim=-1), v).permute(0, 2, 1, 3).contiguous()
    ctx = ctx.view(*ctx.shape[:-2], -1)
    return _norm(sd, f"{name}.output.LayerNorm", _linear(sd, f"{name}.output.dense", ctx) + hidden, EPS_TEXT)


EPS_TEXT = 1e-12  # med_config.json layer_norm_eps


def _reference_text_cls(sd, med, input_ids, attention_mask, image_embeds):
    """med.py BertModel.forward(mode='multimodal', is_decoder=False) -> last_hidden_state[:, 0, :]."""
    t = "blip.text_encoder."
    L = input_ids.shape[1]
    x = F.embedding(input_ids, sd[t + "embeddings.word_embeddings.weight"])
    x = x + F.embedding(sd[t + "embeddings.position_ids"][:, :L], sd[t + "embeddings.position_embeddings.weight"])
    x = _norm(sd, t + "embeddings.LayerNorm", x, EPS_TEXT)
    self_mask = (1.0 - attention_mask[:, None, None, :].float()) * -10000.0
    image_atts = torch.ones(image_embeds.shape[:-1], dtype=torch.long)
    cross_mask = (1.0 - image_atts[:, None, None, :].float()) * torch.finfo(torch.float32).min
    heads = med["num_attention_heads"]
    for i in range(med["num_hidden_layers"]):
        b = f"{t}encoder.layer.{i}."
        x = _reference_attention(sd, b + "attention", x, x, self_mask, heads)
        x = _reference_attention(sd, b + "crossattention", x, image_embeds, cross_mask, heads)
        h = F.gelu(_linear(sd, b + "intermediate.dense", x))
        x = _norm(sd, b + "output.LayerNorm", _linear(sd, b + "output.dense", h) + x, EPS_TEXT)
    return x[:, 0, :]


def _reference_scores(tiny, images, prompts):
    """ImageRewardScorer.__call__: inference_rank(prompt, [image]) per pair, one image per forward, float32."""
    checkpoint, med_config, tokenizer_dir = tiny
    sd = torch.load(str(checkpoint), map_location="cpu")
    med = json.loads(med_config.read_text())
    tok = _reference_tokenizer(tokenizer_dir)
    n_px = int(math.isqrt(sd["blip.visual_encoder.pos_embed"].shape[1] - 1)
               * sd["blip.visual_encoder.patch_embed.proj.weight"].shape[-1])
    heads = sd["blip.visual_encoder.cls_token"].shape[-1] // 64   # blip.py create_vit: 64-wide heads
    out = []
    with torch.no_grad():
        for prompt, image in zip(prompts, images):
            text = tok(prompt, padding="max_length", truncation=True, max_length=35, return_tensors="pt")
            image_embeds = _reference_vit(sd, _reference_pixels(image, n_px), heads)
            h = _reference_text_cls(sd, med, text.input_ids, text.attention_mask, image_embeds).float()
            for index in (0, 2, 4, 6, 7):   # MLP.layers: the Dropouts at 1, 3, 5 are identities in eval
                h = _linear(sd, f"mlp.layers.{index}", h)
            out.append(((h - 0.16717362830052426) / 1.0333394966054072).squeeze().item())
    return np.asarray(out, dtype=np.float64)


# --- tests -------------------------------------------------------------------------------------------------------

def test_registered_and_the_tiny_build_has_the_released_layout(tiny, reward, cache):
    checkpoint, med_config, tokenizer_dir = tiny
    assert REWARDS["imagereward"] is ImageRewardReward
    sd = torch.load(str(checkpoint), map_location="cpu")
    tops = {k.split(".")[0] + "." + k.split(".")[1] for k in sd}
    assert tops == {"blip.visual_encoder", "blip.text_encoder", "blip.vision_proj", "blip.text_proj", "mlp.layers"}
    assert {k for k in sd if k.startswith("mlp.")} == {f"mlp.layers.{i}.{w}" for i in (0, 2, 4, 6, 7)
                                                      for w in ("weight", "bias")}
    assert sd["mlp.layers.0.weight"].shape[0] == 1024 and sd["mlp.layers.7.weight"].shape == (1, 16)
    assert "blip.text_encoder.encoder.layer.1.crossattention.self.key.weight" in sd
    assert "blip.visual_encoder.blocks.1.attn.qkv.bias" in sd                      # vit.py qkv_bias=True
    med = json.loads(med_config.read_text())
    assert med["add_cross_attention"] is True and med_config.parent == checkpoint.parent
    stamp = checkpoint.stat().st_mtime_ns
    assert ensure_tiny_imagereward(cache) == tiny and checkpoint.stat().st_mtime_ns == stamp  # built once
    assert not [p for p in cache.iterdir() if p.name.startswith(".")]                 # no temporary left behind
    # loaded through the real path: the med_config beside the checkpoint, the BERT tokenizer from its directory
    assert reward.med_config == str(med_config) and reward.image_size == 32
    assert reward.model.training is False and reward.device == torch.device("cpu")


def test_build_is_seeded():
    a, b, c = (tiny_reference_state_dict(50, seed=s) for s in (0, 0, 1))
    key = "blip.text_encoder.encoder.layer.0.crossattention.self.query.weight"
    assert torch.equal(a[key], b[key]) and not torch.equal(a[key], c[key])


def test_layers_are_transformers_blip_classes_with_the_references_structure(reward):
    from transformers import BlipTextModel, BlipVisionModel

    m = reward.model
    assert isinstance(m.vision_model, BlipVisionModel) and isinstance(m.text_encoder, BlipTextModel)
    assert m.text_encoder.pooler is None                                   # add_pooling_layer=False, as BLIP_Pretrain
    assert m.vision_model.config.layer_norm_eps == 1e-6 and m.vision_model.config.hidden_act == "gelu"
    assert m.vision_model.config.num_attention_heads == 2                  # 128 / 64
    layer = m.text_encoder.encoder.layer[0]
    assert layer.crossattention.self.key.in_features == 128                # the ViT's width (encoder_width)
    kinds = [(type(x).__name__, getattr(x, "p", None)) for x in m.head]
    assert kinds == [("Linear", None), ("Dropout", 0.2), ("Linear", None), ("Dropout", 0.2), ("Linear", None),
                     ("Dropout", 0.1), ("Linear", None), ("Linear", None)]


def test_converter_puts_every_released_tensor_where_transformers_reads_it(tiny, reward):
    checkpoint = tiny[0]
    sd = torch.load(str(checkpoint), map_location="cpu")
    ours = reward.model.state_dict()
    # the renames of transformers' BLIP conversion (convert_blip_original_pytorch_to_hf.py rename_key), spelt out
    expect = {
        "blip.visual_encoder.cls_token": "vision_model.embeddings.class_embedding",
        "blip.visual_encoder.pos_embed": "vision_model.embeddings.position_embedding",
        "blip.visual_encoder.patch_embed.proj.weight": "vision_model.embeddings.patch_embedding.weight",
        "blip.visual_encoder.norm.bias": "vision_model.post_layernorm.bias",
        "blip.visual_encoder.blocks.1.norm1.weight": "vision_model.encoder.layers.1.layer_norm1.weight",
        "blip.visual_encoder.blocks.0.attn.qkv.weight": "vision_model.encoder.layers.0.self_attn.qkv.weight",
        "blip.visual_encoder.blocks.1.attn.proj.bias": "vision_model.encoder.layers.1.self_attn.projection.bias",
        "blip.visual_encoder.blocks.0.norm2.bias": "vision_model.encoder.layers.0.layer_norm2.bias",
        "blip.visual_encoder.blocks.1.mlp.fc2.weight": "vision_model.encoder.layers.1.mlp.fc2.weight",
        "blip.text_encoder.embeddings.word_embeddings.weight": "text_encoder.embeddings.word_embeddings.weight",
        "blip.text_encoder.encoder.layer.1.crossattention.self.value.weight":
            "text_encoder.encoder.layer.1.crossattention.self.value.weight",
        "blip.text_encoder.encoder.layer.0.output.LayerNorm.bias": "text_encoder.encoder.layer.0.output.LayerNorm.bias",
        "mlp.layers.6.weight": "head.6.weight",
        "mlp.layers.7.bias": "head.7.bias",
    }
    for src, dst in expect.items():
        assert torch.equal(ours[dst], sd[src]), (src, dst)
    used = {k for k in sd if not k.startswith(("blip.vision_proj.", "blip.text_proj.")) and
            not k.endswith("embeddings.position_ids")}
    assert len(ours) == len(used)                  # every weight the score reads comes from the file, one for one
    assert sorted(t.numel() for t in ours.values()) == sorted(sd[k].numel() for k in used)


def test_a_checkpoint_that_does_not_fit_is_refused_naming_the_key(tiny, tmp_path):
    checkpoint, med_config, tokenizer = tiny
    sd = torch.load(str(checkpoint), map_location="cpu")
    (tmp_path / "med_config.json").write_text(med_config.read_text())
    missing = {k: v for k, v in sd.items() if k != "blip.text_encoder.encoder.layer.0.crossattention.self.key.bias"}
    torch.save(missing, str(tmp_path / "ImageReward.pt"))
    with pytest.raises(RewardError, match="crossattention.self.key.bias.*hf download THUDM/ImageReward"):
        make_reward("imagereward", checkpoint=str(tmp_path / "ImageReward.pt"), tokenizer=str(tokenizer))
    torch.save({**sd, "blip.itm_head.weight": torch.zeros(2, 32)}, str(tmp_path / "ImageReward.pt"))
    with pytest.raises(RewardError, match="blip.itm_head.weight: not a key of ImageReward"):
        make_reward("imagereward", checkpoint=str(tmp_path / "ImageReward.pt"), tokenizer=str(tokenizer))
    with pytest.raises(RewardError, match="reward.checkpoint is required"):
        make_reward("imagereward", tokenizer=str(tokenizer))


def test_tokens_are_berts_with_blips_added_tokens_padded_to_35(reward, tiny):
    tok = reward.tokenizer
    vocab = (tiny[2] / "vocab.txt").read_text().split()
    assert len(tok) == len(vocab) + 2
    assert tok.convert_tokens_to_ids(["[DEC]", "[ENC]"]) == [len(vocab), len(vocab) + 1]
    t = reward.tokens(PROMPTS)
    assert t["input_ids"].shape == (len(PROMPTS), 35)
    assert (t["input_ids"][:, 0] == tok.cls_token_id).all()                   # [CLS] first, not BLIP's [ENC]
    assert t["attention_mask"][-1].all() and t["input_ids"][-1, -1] == tok.sep_token_id   # truncated at 35
    assert t["attention_mask"][0].tolist() == [1] * 4 + [0] * 31              # "a cat": [CLS] a cat [SEP], padding
    assert tok.unk_token_id not in t["input_ids"][:4].tolist()


def test_preprocessing_matches_torchvisions_resize_and_centre_crop(reward):
    from ddpo_tpu.rewards.imagereward import preprocess

    for h, w in ((40, 48), (48, 40), (32, 33), (33, 32), (32, 35), (35, 35), (100, 51), (20, 31)):
        images = _images(2, h, w, seed=h * w)
        ours = torch.from_numpy(preprocess(images, 32))
        ref = torch.cat([_reference_pixels(im, 32) for im in images])
        assert ours.shape == (2, 3, 32, 32)
        torch.testing.assert_close(ours, ref, rtol=0, atol=1e-6, msg=f"{h}x{w}")


@pytest.mark.parametrize("h,w", [(40, 48), (33, 32)])
def test_scores_match_the_reference_computation_to_float32_rounding(reward, tiny, h, w):
    images = _images(len(PROMPTS), h, w, seed=h + w)
    ours = reward(images, PROMPTS)
    ref = _reference_scores(tiny, images, PROMPTS)
    assert ours.dtype == np.float32 and ours.shape == (len(PROMPTS),)
    np.testing.assert_allclose(ours, ref, rtol=0, atol=2e-6)
    assert np.ptp(ref) > 0.05                                  # the images and prompts score apart: a real check
    # each image is scored with its own prompt: a permutation of the prompts changes the scores
    shuffled = reward(images, PROMPTS[1:] + PROMPTS[:1])
    assert not np.allclose(shuffled, ours, atol=1e-3)


def test_fixed_batches_pad_the_last_chunk_and_give_the_same_scores(tiny, reward):
    checkpoint, _, tokenizer = tiny
    batched = make_reward("imagereward", checkpoint=str(checkpoint), tokenizer=str(tokenizer), batch_size=2)
    shapes = []
    hook = batched.model.vision_model.register_forward_hook(
        lambda m, args, kwargs, out: shapes.append(kwargs["pixel_values"].shape[0]), with_kwargs=True)
    images = _images(len(PROMPTS), 40, 48, seed=3)
    try:
        scores = batched(images, PROMPTS)
    finally:
        hook.remove()
    np.testing.assert_allclose(scores, reward(images, PROMPTS), rtol=0, atol=2e-6)
    assert len(scores) == 5 and shapes == [2, 2, 2]             # 2 + 2 + (1 padded to 2): one shape every forward
    assert reward(images[:0], []).shape == (0,)
    with pytest.raises(RewardError, match="needs the prompts"):
        reward(images, None)


def test_tiny_from_config_reward_local_and_cuda_passed_on(cache, tiny):
    from ddpo_tpu.config.compose import compose

    cfg = TypeAdapter(RewardConfig).validate_python(
        {"name": "imagereward", "host_workers": 1, "checkpoint": "tiny", "med_config": "tiny", "tokenizer": "tiny"})
    built = reward_from_config(cfg, model_cache_dir=str(cache), device=torch.device("cpu"))
    assert isinstance(built, ImageRewardReward)
    assert (built.checkpoint, built.med_config, built.tokenizer_name) == tuple(str(p) for p in tiny)

    class Cuda:
        type = "cuda"

        def __str__(self):
            return "cuda:0"

    assert reward_kwargs(cfg, cache, Cuda())["device"] == "cuda:0"
    assert "device" not in reward_kwargs(cfg, cache, torch.device("cpu"))
    for model in ("tiny", "tiny_sd3"):  # conf/reward_local/imagereward_<model>.yaml
        local = compose([f"model={model}", "reward=imagereward"]).reward
        assert (local.checkpoint, local.med_config, local.tokenizer) == ("tiny", "tiny", "tiny")
    real = compose(["model=sd35_medium", "reward=imagereward"]).reward
    assert (real.checkpoint, real.med_config, real.tokenizer) == (None, None, "bert-base-uncased")


def test_compose_time_checks_name_the_key_and_where_to_get_the_files(tmp_path):
    from ddpo_tpu.config.compose import compose_and_validate
    from ddpo_tpu.problems import ConfigError

    def refused(*overrides):
        with pytest.raises(ConfigError) as info:
            compose_and_validate(["+experiment=smoke", "model=sd14_random", "reward=imagereward", *overrides])
        return info.value.problems

    p, = refused()
    assert p.key == "reward.checkpoint" and p.value is None
    assert "hf download THUDM/ImageReward ImageReward.pt med_config.json" in str(p)
    p, = refused(f"reward.checkpoint={tmp_path / 'nope.pt'}")
    assert p.key == "reward.checkpoint" and "file not found" in str(p) and "THUDM/ImageReward" in str(p)
    (tmp_path / "ImageReward.pt").write_bytes(b"")
    p, = refused(f"reward.checkpoint={tmp_path / 'ImageReward.pt'}")
    assert p.key == "reward.med_config" and "beside the checkpoint" in p.reason and "med_config.json" in str(p)
    (tmp_path / "med_config.json").write_text("{}")
    compose_and_validate(["+experiment=smoke", "model=sd14_random", "reward=imagereward",
                          f"reward.checkpoint={tmp_path / 'ImageReward.pt'}"])
    p, = refused("reward.checkpoint=tiny")          # the stand-in comes whole
    assert p.key == "reward.tokenizer" and p.suggested() == ["reward.tokenizer=tiny"]
    # and as a weighted component, under its own prefix
    with pytest.raises(ConfigError) as info:
        compose_and_validate(["+experiment=smoke", "reward=weighted",
                              "reward.components=[{name:jpeg_compressibility},{name:imagereward}]"])
    assert [p.key for p in info.value.problems] == ["reward.components.1.checkpoint"]
