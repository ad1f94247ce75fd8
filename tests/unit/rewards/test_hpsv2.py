"""HPSv2 (Flow-GRPO's and DiffusionNFT's reward) on a tiny random-weight open_clip-layout checkpoint, loaded through
the real converter and ``CLIPModel.from_pretrained``.

The reference is written out here from the code the references call, not from ours:

* preprocessing: tgxs002/HPSv2@866735e hpsv2/src/open_clip/transform.py -- ``image_transform(is_train=False,
  resize_longest_max=True)`` (135-152): PIL -> RGB -> ``ToTensor`` -> ``ResizeMaxSize`` (26-48; torchvision 0.21's
  tensor resize: ``interpolate(bicubic, align_corners=False, antialias=True)``; ``F.pad([left, top, right,
  bottom], fill=0)``) -> ``Normalize(OPENAI mean, std)`` (constants.py), one image at a time as flow_grpo@94e23ee
  flow_grpo/hpsv2_scorer.py ``reward`` loops;
* the forward: model.py ``CLIP.encode_image`` / ``encode_text`` / ``forward`` (228-255) and transformer.py
  ``ResidualAttentionBlock`` (189-244: pre-norm, ``nn.MultiheadAttention`` with packed q|k|v, causal mask for text),
  ``VisionTransformer.forward`` (458-504: class token first, ln_pre, class-token pooling, ln_post, ``@ proj``), text
  pooled at ``argmax`` of the ids then ``@ text_projection``; nn.GELU (ViT-H-14 has no quick_gelu);
* tokens: tokenizer.py ``tokenize`` (159-188): [sot] + BPE + [eot], cut to 77 with eot last, padded with 0;
* the score: ``diagonal(image_features @ text_features.T)`` of the normalised features.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from pydantic import TypeAdapter

from ddpo_tpu.config.schema import RewardConfig
from ddpo_tpu.rewards import REWARDS, RewardError, make_reward
from ddpo_tpu.rewards.from_config import reward_from_config, reward_kwargs
from ddpo_tpu.rewards.hpsv2 import HPSv2Reward, hpsv2_pixels
from ddpo_tpu.rewards.open_clip_convert import (VIT_H_14, OpenClipConversionError, clip_config_from_open_clip,
                                                convert_state_dict)
from ddpo_tpu.rewards.tiny_hpsv2 import ensure_tiny_hpsv2, tiny_open_clip_state_dict

PROMPTS = ["a cat", "a red bicycle on the moon", "two dogs playing chess", 'a sign that says "hello"']
ENTITY = "salt &amp;amp; pepper &#128104"   # open_clip un-escapes twice: "salt & pepper" + one character
LONG = " ".join(["a very long prompt about many small things"] * 12)   # > 77 tokens: cut, eot kept last
MEAN = torch.tensor((0.48145466, 0.4578275, 0.40821073)).view(3, 1, 1)   # open_clip constants.py OPENAI_DATASET_*
STD = torch.tensor((0.26862954, 0.26130258, 0.27577711)).view(3, 1, 1)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("hpsv2")


@pytest.fixture(scope="module")
def tiny(cache):
    return ensure_tiny_hpsv2(cache)


@pytest.fixture(scope="module")
def reward(tiny):
    checkpoint, config, tokenizer = tiny
    return make_reward("hpsv2", checkpoint=str(checkpoint), architecture=str(config), tokenizer=str(tokenizer))


def _images(n, h=40, w=48, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (n, h, w, 3), dtype=np.uint8)


# -- the reference, written from HPSv2@866735e's open_clip ------------------------------------------------------


def _reference_preprocess(image: np.ndarray, size: int) -> torch.Tensor:
    """One uint8 HWC image -> (3, size, size): _convert_to_rgb_or_rgba, ToTensor, ResizeMaxSize, Normalize."""
    from PIL import Image

    pil = Image.fromarray(image).convert("RGB")
    img = torch.from_numpy(np.array(pil)).permute(2, 0, 1).contiguous().to(torch.float32).div(255)   # ToTensor
    height, width = img.shape[1:]
    scale = size / float(max(height, width))
    if scale != 1.0:
        new_size = tuple(round(dim * scale) for dim in (height, width))
        img = F.interpolate(img[None], size=list(new_size), mode="bicubic", align_corners=False, antialias=True)[0]
        pad_h, pad_w = size - new_size[0], size - new_size[1]
        left, top, right, bottom = pad_w // 2, pad_h // 2, pad_w - pad_w // 2, pad_h - pad_h // 2   # torchvision order
        img = F.pad(img, [left, right, top, bottom], mode="constant", value=0)
    return img.clone().sub_(MEAN).div_(STD)


def _reference_tokens(reward, prompts, context_length=77) -> torch.Tensor:
    """open_clip ``tokenize``: [sot] + BPE of basic_clean'd text (html.unescape twice, strip; ftfy.fix_text is
    the identity on these prompts) + [eot], truncated with eot last, zero padded."""
    import html

    tok = reward.tokenizer
    sot, eot = tok.bos_token_id, tok.eos_token_id
    result = torch.zeros(len(prompts), context_length, dtype=torch.long)
    for i, p in enumerate(prompts):
        text = html.unescape(html.unescape(p)).strip()
        tokens = [sot] + tok(text, add_special_tokens=False)["input_ids"] + [eot]
        if len(tokens) > context_length:
            tokens = tokens[:context_length]
            tokens[-1] = eot
        result[i, :len(tokens)] = torch.tensor(tokens)
    return result


def _mha(sd, p, width, heads):
    attn = torch.nn.MultiheadAttention(width, heads)
    attn.load_state_dict({"in_proj_weight": sd[p + "attn.in_proj_weight"], "in_proj_bias": sd[p + "attn.in_proj_bias"],
                          "out_proj.weight": sd[p + "attn.out_proj.weight"],
                          "out_proj.bias": sd[p + "attn.out_proj.bias"]})
    return attn.eval()


def _ln(x, sd, p):
    return F.layer_norm(x, x.shape[-1:], sd[p + ".weight"], sd[p + ".bias"], 1e-5)


def _transformer(x, sd, prefix, layers, width, heads, attn_mask=None):
    """Transformer.forward on LND input: ResidualAttentionBlock = x + attn(ln_1 x); x + c_proj(gelu(c_fc(ln_2 x)))."""
    for i in range(layers):
        p = f"{prefix}transformer.resblocks.{i}."
        h = _ln(x, sd, p + "ln_1")
        x = x + _mha(sd, p, width, heads)(h, h, h, need_weights=False, attn_mask=attn_mask)[0]
        h = F.linear(_ln(x, sd, p + "ln_2"), sd[p + "mlp.c_fc.weight"], sd[p + "mlp.c_fc.bias"])
        x = x + F.linear(F.gelu(h), sd[p + "mlp.c_proj.weight"], sd[p + "mlp.c_proj.bias"])
    return x


def _reference_scores(sd, oc, pixels, text):
    """CLIP.forward(image, text) with output_dict, then diagonal(image_features @ text_features.T)."""
    v, t = oc["vision_cfg"], oc["text_cfg"]
    vw, tw = v["width"], t["width"]
    with torch.no_grad():
        x = F.conv2d(pixels, sd["visual.conv1.weight"], stride=v["patch_size"])
        x = x.reshape(x.shape[0], x.shape[1], -1).permute(0, 2, 1)
        x = torch.cat([sd["visual.class_embedding"] + torch.zeros(x.shape[0], 1, x.shape[-1]), x], dim=1)
        x = _ln(x + sd["visual.positional_embedding"], sd, "visual.ln_pre")
        x = _transformer(x.permute(1, 0, 2), sd, "visual.", v["layers"], vw, vw // v["head_width"]).permute(1, 0, 2)
        image = _ln(x[:, 0], sd, "visual.ln_post") @ sd["visual.proj"]
        n = t["context_length"]
        mask = torch.empty(n, n).fill_(float("-inf")).triu_(1)   # build_attention_mask
        y = (sd["token_embedding.weight"][text] + sd["positional_embedding"]).permute(1, 0, 2)
        y = _transformer(y, sd, "", t["layers"], tw, t["heads"], attn_mask=mask).permute(1, 0, 2)
        y = _ln(y, sd, "ln_final")
        txt = y[torch.arange(y.shape[0]), text.argmax(dim=-1)] @ sd["text_projection"]
        image, txt = F.normalize(image, dim=-1), F.normalize(txt, dim=-1)
        return torch.diagonal(image @ txt.T).numpy()


def _loaded(tiny):
    checkpoint, config, _ = tiny
    sd = torch.load(str(checkpoint), map_location="cpu", weights_only=True)["state_dict"]
    return {k: v.float() for k, v in sd.items()}, json.loads(config.read_text())   # precision="amp": fp32 params


# -- tests ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("h,w", [(40, 48), (48, 40), (17, 29), (64, 64), (100, 33)])
def test_preprocessing_is_the_reference_transform_on_non_square_images(h, w):
    images = _images(3, h, w, seed=h * w)
    got = hpsv2_pixels(images, 32)
    want = torch.stack([_reference_preprocess(im, 32) for im in images])
    assert got.shape == (3, 3, 32, 32) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    # the geometry, by hand: the resized image is centred, the odd pad row / column goes to the bottom / right,
    # and the pad is black (0 before normalisation: -mean/std after)
    scale = 32 / max(h, w)
    nh, nw = round(h * scale), round(w * scale)
    top, left = (32 - nh) // 2, (32 - nw) // 2
    content = torch.zeros(32, 32, dtype=torch.bool)
    content[top:top + nh, left:left + nw] = True
    black = (-MEAN / STD).expand(3, 32, 32)
    assert torch.allclose(got[0][:, ~content], black[:, ~content], atol=1e-6)
    assert not torch.isclose(got[0][:, content], black[:, content], atol=1e-3).all()


def test_longest_side_already_the_size_is_padded_where_the_reference_is_not():
    # scale == 1: the reference neither resizes nor pads, and a non-square tensor then breaks its ViT; ours pads
    images = _images(2, 32, 20, seed=5)
    assert _reference_preprocess(images[0], 32).shape == (3, 32, 20)
    got = hpsv2_pixels(images, 32)
    assert got.shape == (2, 3, 32, 32)
    torch.testing.assert_close(got[0][:, :, 6:26], _reference_preprocess(images[0], 32), rtol=0, atol=1e-6)
    assert torch.allclose(got[:, :, :, :6], (-MEAN / STD).expand(2, 3, 32, 6), atol=1e-6)

def test_preprocessing_antialiases_and_does_not_clamp():
    # a 2x downscale of a checkerboard: with antialias the result is flat grey; without it, aliasing
    board = ((np.indices((64, 64)).sum(0) % 2) * 255).astype(np.uint8)
    img = np.repeat(board[None, :, :, None], 3, axis=3)
    got = hpsv2_pixels(img, 32)[0] * STD + MEAN
    assert got.std().item() < 0.05 and got.mean().item() == pytest.approx(0.5, abs=0.02)
    # bicubic overshoots at a hard edge and float images are not clamped (torchvision clamps only uint8)
    edge = np.zeros((1, 64, 64, 3), np.uint8)
    edge[:, :, 32:] = 255
    raw = hpsv2_pixels(edge, 24)[0] * STD + MEAN
    assert raw.min().item() < -1e-3 and raw.max().item() > 1 + 1e-3


def test_tiny_checkpoint_has_the_released_key_layout(tiny):
    sd, oc = _loaded(tiny)
    # open_clip CLIP's state dict names (model.py CLIP.__init__, transformer.py), resblock indices folded
    block = {"ln_1.weight", "ln_1.bias", "attn.in_proj_weight", "attn.in_proj_bias", "attn.out_proj.weight",
             "attn.out_proj.bias", "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight", "mlp.c_fc.bias",
             "mlp.c_proj.weight", "mlp.c_proj.bias"}
    expected = {"visual.class_embedding", "visual.positional_embedding", "visual.proj", "visual.conv1.weight",
                "visual.ln_pre.weight", "visual.ln_pre.bias", "visual.ln_post.weight", "visual.ln_post.bias",
                "positional_embedding", "text_projection", "logit_scale", "token_embedding.weight",
                "ln_final.weight", "ln_final.bias"}
    expected |= {f"visual.transformer.resblocks.*.{b}" for b in block} | {f"transformer.resblocks.*.{b}" for b in block}
    folded = {re.sub(r"resblocks\.\d+\.", "resblocks.*.", k) for k in sd}
    assert folded == expected
    raw = torch.load(str(tiny[0]), map_location="cpu", weights_only=True)
    assert set(raw) >= {"state_dict"} and raw["state_dict"]["visual.proj"].dtype == torch.float16


def test_converter_maps_vit_h_14_sizes_onto_clipmodel_exactly():
    """The released architecture's shapes (ViT-H-14: 32 x 1280 image blocks, 16 heads, 257 positions; 24 x 1024
    text blocks) on meta tensors: every key converted, and the result is exactly CLIPModel's state dict."""
    from transformers import CLIPModel
    try:
        from transformers.initialization import no_init_weights    # transformers 5
    except ImportError:
        from transformers.modeling_utils import no_init_weights     # 4.x

    oc = VIT_H_14
    sd = tiny_open_clip_state_dict(oc, meta=True)   # the tiny builder's layout at the released sizes, no 4 GB
    assert sd["visual.conv1.weight"].is_meta and sd["visual.proj"].shape == (1280, 1024)
    config = clip_config_from_open_clip(oc, bos_token_id=49406, eos_token_id=49407, pad_token_id=0)
    assert config.vision_config.num_attention_heads == 16 and config.text_config.num_attention_heads == 16
    assert config.vision_config.hidden_act == config.text_config.hidden_act == "gelu"
    converted = convert_state_dict(sd, config)
    with torch.device("meta"), no_init_weights():
        model = CLIPModel(config)
    want = {k: tuple(p.shape) for k, p in model.state_dict().items() if not k.endswith("position_ids")}
    assert {k: tuple(p.shape) for k, p in converted.items()} == want
    assert converted["vision_model.embeddings.position_embedding.weight"].shape == (257, 1280)


def test_converter_refuses_what_it_does_not_map(tiny):
    sd, oc = _loaded(tiny)
    config = clip_config_from_open_clip(oc, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    with pytest.raises(OpenClipConversionError, match="does not map.*score_predictor"):
        convert_state_dict({**sd, "score_predictor.weight": torch.zeros(1)}, config)
    with pytest.raises(OpenClipConversionError, match="missing.*visual.proj"):
        convert_state_dict({k: v for k, v in sd.items() if k != "visual.proj"}, config)
    with pytest.raises(OpenClipConversionError, match="blocks"):
        convert_state_dict({k: v for k, v in sd.items() if ".resblocks.1." not in k}, config)
    wider = {**oc, "vision_cfg": {**oc["vision_cfg"], "width": 64, "head_width": 16}}
    bad = clip_config_from_open_clip(wider, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    with pytest.raises(OpenClipConversionError, match="shape"):
        convert_state_dict(sd, bad)
    with pytest.raises(OpenClipConversionError, match="attentional_pool"):
        clip_config_from_open_clip({**oc, "vision_cfg": {**oc["vision_cfg"], "attentional_pool": True}},
                                   bos_token_id=1, eos_token_id=2, pad_token_id=0)
    # an attn_mask entry (older open_clip kept the causal mask in the state dict) is a constant: ignored
    convert_state_dict({**sd, "attn_mask": torch.zeros(77, 77)}, config)


def test_scores_equal_open_clip_forward_to_float32_rounding(tiny, reward):
    sd, oc = _loaded(tiny)
    prompts = PROMPTS + [LONG, ENTITY]
    images = _images(6, 40, 56, seed=7)
    pixels = torch.stack([_reference_preprocess(im, 32) for im in images])
    want = _reference_scores(sd, oc, pixels, _reference_tokens(reward, prompts))
    got = reward(images, prompts)
    assert got.dtype == np.float32 and got.shape == (6,)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert np.all(np.abs(got) <= 1 + 1e-6) and np.ptp(got) > 0.05   # cosines, not all alike
    # reversing the prompts pairs each image with another prompt: the reference's diagonal follows
    rev = _reference_scores(sd, oc, pixels, _reference_tokens(reward, prompts[::-1]))
    np.testing.assert_allclose(reward(images, prompts[::-1]), rev, rtol=1e-5, atol=1e-6)
    # the tokens are open_clip's but for the padding id: same ids up to and including eot, 77 long
    ours, ref = reward.tokens(prompts), _reference_tokens(reward, prompts)
    assert ours.shape == ref.shape == (6, 77)
    for a, b in zip(ours, ref):
        end = int(b.argmax()) + 1
        assert torch.equal(a[:end], b[:end])
    assert int(ref[4, 76]) == reward.tokenizer.eos_token_id         # the long prompt: cut, eot last
    raw = reward.tokenizer(ENTITY)["input_ids"]                       # the entity is cleaned, not tokenised as is
    assert len(raw) > int(ref[5].argmax()) + 1


def test_loaded_through_from_pretrained_in_float32_and_built_once(tiny, reward, cache):
    from transformers import CLIPModel, CLIPTokenizer

    assert REWARDS["hpsv2"] is HPSv2Reward
    assert isinstance(reward.model, CLIPModel) and isinstance(reward.tokenizer, CLIPTokenizer)
    assert reward.model.dtype == torch.float32 and reward.device == torch.device("cpu") and reward.image_size == 32
    sd, _ = _loaded(tiny)   # the float16 file's values, upcast exactly
    assert torch.equal(reward.model.visual_projection.weight, sd["visual.proj"].t())
    stamp = tiny[0].stat().st_mtime_ns
    assert ensure_tiny_hpsv2(cache) == tiny and tiny[0].stat().st_mtime_ns == stamp   # no rebuild
    assert not [p for p in cache.iterdir() if p.name.startswith(".")]


def test_fixed_batch_shapes_and_chunking(tiny, reward):
    checkpoint, config, tokenizer = tiny
    chunked = make_reward("hpsv2", checkpoint=str(checkpoint), architecture=str(config), tokenizer=str(tokenizer),
                          batch_size=2)
    shapes = []
    chunked.model.vision_model.register_forward_pre_hook(
        lambda m, args, kwargs: shapes.append(tuple(kwargs["pixel_values"].shape)), with_kwargs=True)
    images, prompts = _images(5, seed=3), (PROMPTS * 2)[:5]
    got = chunked(images, prompts)
    np.testing.assert_allclose(got, reward(images, prompts), rtol=1e-5, atol=1e-6)
    assert got.shape == (5,) and shapes == [(2, 3, 32, 32)] * 3      # the last chunk filled to 2
    assert reward(np.zeros((0, 32, 32, 3), np.uint8), []).shape == (0,)
    with pytest.raises(RewardError, match="uint8"):
        reward(images.astype(np.float32) / 255, prompts)
    with pytest.raises(RewardError, match="5 images but 4 prompts"):
        reward(images, prompts[:4])
    with pytest.raises(RewardError, match="reward.batch_size"):
        make_reward("hpsv2", checkpoint=str(checkpoint), architecture=str(config), tokenizer=str(tokenizer),
                    batch_size=0)


def test_missing_checkpoint_names_the_key_and_the_download(tiny, tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    _, config, tokenizer = tiny
    with pytest.raises(RewardError, match=r"reward\.checkpoint=null: HPS_v2\.1_compressed\.pt is not in the Hugging "
                                          r"Face cache.*hf download xswu/HPSv2 HPS_v2\.1_compressed\.pt"):
        make_reward("hpsv2", architecture=str(config), tokenizer=str(tokenizer))
    with pytest.raises(RewardError, match=r"hf download xswu/HPSv2 HPS_v2_compressed\.pt"):
        make_reward("hpsv2", version="v2.0", architecture=str(config), tokenizer=str(tokenizer))
    with pytest.raises(RewardError, match=r"reward\.checkpoint=.*nope\.pt: file not found"):
        make_reward("hpsv2", checkpoint=str(tmp_path / "nope.pt"), architecture=str(config), tokenizer=str(tokenizer))


def test_null_checkpoint_is_found_in_the_hub_cache_as_hf_hub_download_leaves_it(tiny, tmp_path, monkeypatch):
    import shutil

    import huggingface_hub.constants

    hub = tmp_path / "hub"
    snap = hub / "models--xswu--HPSv2" / "snapshots" / ("0" * 40)
    snap.mkdir(parents=True)
    (hub / "models--xswu--HPSv2" / "refs").mkdir()
    (hub / "models--xswu--HPSv2" / "refs" / "main").write_text("0" * 40)
    shutil.copy(tiny[0], snap / "HPS_v2.1_compressed.pt")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub))
    r = make_reward("hpsv2", architecture=str(tiny[1]), tokenizer=str(tiny[2]))
    assert r.checkpoint == str(snap / "HPS_v2.1_compressed.pt")
    # and at compose time the same lookup finds it: no problem for checkpoint=null
    from ddpo_tpu.catalog.rewards import HPSv2Keys, _hpsv2_problems

    assert _hpsv2_problems(HPSv2Keys(name="hpsv2", architecture=str(tiny[1])), "reward") == []
    assert [p.key for p in _hpsv2_problems(HPSv2Keys(name="hpsv2", version="v2.0"), "reward")] == ["reward.checkpoint"]


def test_compose_time_problems(tmp_path, monkeypatch):
    import huggingface_hub.constants

    from ddpo_tpu.catalog.rewards import HPSv2Keys, _hpsv2_problems

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    lines = [str(p) for p in _hpsv2_problems(HPSv2Keys(name="hpsv2"), "reward")]
    assert lines == ["reward.checkpoint=null: HPS_v2.1_compressed.pt is not in the Hugging Face cache (download it "
                     "once: hf download xswu/HPSv2 HPS_v2.1_compressed.pt; or set reward.checkpoint=PATH)"]
    gone = _hpsv2_problems(HPSv2Keys(name="hpsv2", checkpoint=str(tmp_path / "x.pt")), "reward")
    assert [(p.key, p.reason) for p in gone] == [("reward.checkpoint", "file not found")]
    v20 = tmp_path / "HPS_v2_compressed.pt"
    v20.write_bytes(b"")
    (mismatch,) = _hpsv2_problems(HPSv2Keys(name="hpsv2", checkpoint=str(v20)), "reward")
    assert mismatch.key == "reward.version" and mismatch.suggested() == ["reward.version=v2.0"]
    assert _hpsv2_problems(HPSv2Keys(name="hpsv2", checkpoint=str(v20), version="v2.0"), "reward") == []
    (half,) = _hpsv2_problems(HPSv2Keys(name="hpsv2", checkpoint="tiny", tokenizer="tiny"), "reward")
    assert half.key == "reward.architecture" and "reward.architecture=tiny" in half.suggested()
    (cfg,) = _hpsv2_problems(HPSv2Keys(name="hpsv2", checkpoint=str(v20), version="v2.0", architecture="ViT-X"),
                             "reward")
    assert cfg.key == "reward.architecture"


def test_tiny_from_config_and_reward_local(cache, tiny, tmp_path, monkeypatch):
    import huggingface_hub.constants

    from ddpo_tpu.config.components import reward_problems
    from ddpo_tpu.config.compose import compose

    cfg = TypeAdapter(RewardConfig).validate_python(
        {"name": "hpsv2", "host_workers": 1, "checkpoint": "tiny", "architecture": "tiny", "tokenizer": "tiny"})
    built = reward_from_config(cfg, model_cache_dir=str(cache), device=torch.device("cpu"))
    assert isinstance(built, HPSv2Reward) and built.checkpoint == str(tiny[0])
    # on a GPU the reward gets the run's CUDA device; on XLA and the CPU it stays on the host CPU
    cuda, xla = (type("D", (), {"type": t, "__str__": lambda self: f"{self.type}:0"})() for t in ("cuda", "xla"))
    kwargs = reward_kwargs(cfg, cache, cuda)
    assert kwargs["device"] == "cuda:0" and kwargs["architecture"] == str(tiny[1])
    assert "device" not in reward_kwargs(cfg, cache, xla)
    # model=tiny_sd3 / tiny pick conf/reward_local/hpsv2_tiny*.yaml; a real model keeps the real keys, and without the
    # checkpoint in the cache the compose-time check names it
    for model in ("tiny_sd3", "tiny"):
        local = compose([f"model={model}", "reward=hpsv2"]).reward
        assert (local.checkpoint, local.architecture, local.tokenizer) == ("tiny", "tiny", "tiny")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    real = compose(["model=sd35_medium", "reward=hpsv2"]).reward
    assert (real.checkpoint, real.architecture, real.version) == (None, "ViT-H-14", "v2.1")
    typed = TypeAdapter(RewardConfig).validate_python(OmegaConf.to_container(real, resolve=True))
    assert [p.key for p in reward_problems(typed)] == ["reward.checkpoint"]
