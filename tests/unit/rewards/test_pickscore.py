"""PickScore (Flow-GRPO's reward), exercised on the tiny random CLIP + processor loaded through from_pretrained.

The reference formula (flow_grpo/pickscore_scorer.py): exp(logit_scale) * cos(text_i, image_i) / 26. Here it is
checked against CLIPModel's own forward (logits_per_text, which normalises and scales by itself), so the reward's
separate image/text path, its pairing of each image with its own prompt and the /26 are each pinned.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from pydantic import TypeAdapter

from ddpo_tpu.config.schema import RewardConfig
from ddpo_tpu.rewards import REWARDS, RewardError, make_reward
from ddpo_tpu.rewards.from_config import reward_from_config
from ddpo_tpu.rewards.pickscore import PickScoreReward
from ddpo_tpu.rewards.tiny_pickscore import build_tiny_pickscore, ensure_tiny_pickscore

PROMPTS = ["a cat", "a red bicycle on the moon", "two dogs playing chess", 'a sign that says "hello"']


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("pickscore")


@pytest.fixture(scope="module")
def tiny(cache):
    return ensure_tiny_pickscore(cache)


@pytest.fixture(scope="module")
def reward(tiny):
    processor_dir, model_dir = tiny
    return make_reward("pickscore", clip_model=str(model_dir), processor=str(processor_dir))


def _images(n, h=40, w=48, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (n, h, w, 3), dtype=np.uint8)


def _reference_matrix(tiny, images, prompts):
    """exp(logit_scale) * cos(text_i, image_j) / 26 for every pair, from CLIPModel.forward loaded afresh."""
    from transformers import AutoProcessor, CLIPModel

    processor_dir, model_dir = tiny
    # flow_grpo@ac4c86e flow_grpo/pickscore_scorer.py:12 loads AutoProcessor under transformers==4.40.0 (setup.py:12),
    # whose CLIP image processor is the PIL one; transformers 5 picks a torchvision-backed one when torchvision is
    # installed (the GPU image has it), 5e-4 off: the PIL backend named, as the reference had it
    processor = AutoProcessor.from_pretrained(str(processor_dir), local_files_only=True, backend="pil")
    model = CLIPModel.from_pretrained(str(model_dir), local_files_only=True).eval()
    inputs = processor(text=prompts, images=list(images), padding=True, truncation=True, max_length=77,
                       return_tensors="pt")
    with torch.no_grad():
        out = model(**inputs)
    return out.logits_per_text.double().numpy() / 26.0   # [text i, image j]


def test_registered_built_once_and_loaded_through_from_pretrained(tiny, reward, cache):
    from transformers import CLIPModel, CLIPProcessor

    assert REWARDS["pickscore"] is PickScoreReward
    processor_dir, model_dir = tiny
    assert json.loads((processor_dir / "processor_config.json").read_text())["processor_class"] == "CLIPProcessor"
    assert json.loads((model_dir / "config.json").read_text())["architectures"] == ["CLIPModel"]
    assert isinstance(reward.processor, CLIPProcessor) and isinstance(reward.model, CLIPModel)
    assert type(reward.processor.image_processor).__name__ in ("CLIPImageProcessorPil", "CLIPImageProcessor")
    assert reward.model.logit_scale.exp().item() == pytest.approx(100.0, rel=1e-5)   # PickScore_v1's range
    assert reward.device == torch.device("cpu") and reward.model.dtype == torch.float32
    stamp = (model_dir / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_pickscore(cache) == tiny                           # second call: no rebuild
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == stamp
    assert not [p for p in cache.iterdir() if p.name.startswith(".")]    # no temporary build left behind


def test_score_equals_clip_forward_diagonal_over_26(tiny, reward):
    images = _images(4)
    matrix = _reference_matrix(tiny, images, PROMPTS)
    got = reward(images, PROMPTS)
    assert got.dtype == np.float32 and got.shape == (4,)
    np.testing.assert_allclose(got, np.diag(matrix), rtol=1e-5, atol=1e-6)
    # each image is scored against its own prompt: reversing the prompts reads the anti-diagonal
    np.testing.assert_allclose(reward(images, PROMPTS[::-1]), matrix[::-1].diagonal(), rtol=1e-5, atol=1e-6)
    # and the pieces give the same number: exp(logit_scale) * <t, v> / 26 of unit-norm embeddings
    t, v = reward.text_embeddings(PROMPTS[:1]), reward.image_embeddings(images[:1])
    assert torch.linalg.vector_norm(t, dim=-1).item() == pytest.approx(1.0, abs=1e-6)
    manual = math.exp(reward.model.logit_scale.item()) * float((t * v).sum()) / 26.0
    assert got[0] == pytest.approx(manual, rel=1e-5)


def test_prompt_changes_only_its_own_score(reward):
    images = _images(4, seed=1)
    a = reward(images, PROMPTS)
    changed = list(PROMPTS)
    changed[2] = "an empty white room"
    b = reward(images, changed)
    assert b[2] != pytest.approx(a[2], abs=1e-4)
    np.testing.assert_array_equal(np.delete(a, 2), np.delete(b, 2))
    same_image = np.repeat(images[:1], 4, axis=0)                  # one image, four prompts: four scores
    assert len(np.unique(np.round(reward(same_image, PROMPTS), 5))) == 4


@pytest.mark.parametrize("n,h,w", [(1, 32, 32), (3, 64, 40), (5, 17, 29)])
def test_shapes_dtypes_range(reward, n, h, w):
    out = reward(_images(n, h, w, seed=n), (PROMPTS * 2)[:n])
    assert out.shape == (n,) and out.dtype == np.float32 and np.all(np.isfinite(out))
    assert np.all(np.abs(out) <= 100.0 / 26.0 + 1e-5)


def test_empty_chunked_and_bad_input(tiny, reward):
    empty = reward(np.zeros((0, 32, 32, 3), np.uint8), [])
    assert empty.shape == (0,) and empty.dtype == np.float32
    processor_dir, model_dir = tiny
    chunked = make_reward("pickscore", clip_model=str(model_dir), processor=str(processor_dir), batch_size=2)
    images = _images(5, seed=3)
    prompts = (PROMPTS * 2)[:5]
    np.testing.assert_allclose(chunked(images, prompts), reward(images, prompts), rtol=1e-5, atol=1e-6)
    with pytest.raises(RewardError, match="uint8"):
        reward(images.astype(np.float32) / 255, prompts)
    with pytest.raises(RewardError, match="5 images but 4 prompts"):
        reward(images, prompts[:4])
    with pytest.raises(RewardError, match="reward.batch_size"):
        make_reward("pickscore", clip_model=str(model_dir), processor=str(processor_dir), batch_size=0)


def test_missing_assets_name_the_key(tiny, tmp_path):
    processor_dir, model_dir = tiny
    with pytest.raises(RewardError, match=r"reward\.clip_model=.*hf download yuvalkirstain/PickScore_v1"):
        make_reward("pickscore", clip_model=str(tmp_path / "nope"), processor=str(processor_dir))
    with pytest.raises(RewardError, match=r"reward\.processor=.*CLIPProcessor"):
        make_reward("pickscore", clip_model=str(model_dir), processor=str(tmp_path / "nope"))


def test_build_is_seeded(tmp_path):
    from safetensors.torch import load_file

    a = load_file(str(build_tiny_pickscore(tmp_path / "a", seed=0)[1] / "model.safetensors"))
    b = load_file(str(build_tiny_pickscore(tmp_path / "b", seed=0)[1] / "model.safetensors"))
    c = load_file(str(build_tiny_pickscore(tmp_path / "c", seed=1)[1] / "model.safetensors"))
    key = "text_projection.weight"
    assert torch.equal(a[key], b[key]) and not torch.equal(a[key], c[key])


def test_tiny_from_config_and_reward_local(cache, tiny):
    from ddpo_tpu.config.compose import compose

    cfg = TypeAdapter(RewardConfig).validate_python(
        {"name": "pickscore", "host_workers": 1, "clip_model": "tiny", "processor": "tiny"})
    built = reward_from_config(cfg, model_cache_dir=str(cache), device=torch.device("cpu"))
    assert isinstance(built, PickScoreReward)
    assert (built.clip_model, built.processor_name) == (str(tiny[1]), str(tiny[0]))
    # model=tiny_sd3 picks conf/reward_local/pickscore_tiny_sd3.yaml; a real model keeps the real ids
    local = compose(["model=tiny_sd3", "reward=pickscore"]).reward
    assert (local.clip_model, local.processor) == ("tiny", "tiny")
    real = compose(["model=sd35_medium", "reward=pickscore"]).reward
    assert (real.clip_model, real.processor) == ("yuvalkirstain/PickScore_v1", "laion/CLIP-ViT-H-14-laion2B-s32B-b79K")
