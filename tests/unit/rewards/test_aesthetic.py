"""The LAION aesthetic reward, exercised end to end on the tiny random CLIP (loaded through from_pretrained)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn

from ddpo_tpu.rewards import REWARDS, RewardError, make_reward
from ddpo_tpu.rewards.aesthetic import (
    AESTHETIC_MLP_KEYS,
    AestheticReward,
    clip_image_processor_class,
    make_aesthetic_mlp,
)
from ddpo_tpu.rewards.tiny_clip import (
    TINY_CLIP_PROJECTION_DIM,
    build_tiny_aesthetic,
    ensure_tiny_aesthetic,
)


class ReferenceMLP(nn.Module):
    """The LAION improved-aesthetic-predictor head, written as in the reference (ddpo_pytorch/aesthetic_scorer.py)."""

    def __init__(self, input_size: int = 768):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(input_size, 1024),
            nn.Dropout(0.2),
            nn.Linear(1024, 128),
            nn.Dropout(0.2),
            nn.Linear(128, 64),
            nn.Dropout(0.1),
            nn.Linear(64, 16),
            nn.Linear(16, 1),
        )

    def forward(self, embed):
        return self.layers(embed)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return ensure_tiny_aesthetic(tmp_path_factory.mktemp("aesthetic"))


@pytest.fixture(scope="module")
def reward(tiny):
    clip_dir, mlp_path = tiny
    return AestheticReward(clip_model=str(clip_dir), mlp_path=str(mlp_path))


def _images(n, size, seed):
    return np.random.default_rng(seed).integers(0, 256, (n, size, size, 3), dtype=np.uint8)


def test_registered(tiny):
    assert REWARDS["aesthetic"] is AestheticReward
    clip_dir, mlp_path = tiny
    r = make_reward("aesthetic", clip_model=str(clip_dir), mlp_path=str(mlp_path))
    assert isinstance(r, AestheticReward) and r.name == "aesthetic"
    assert r.embed_dim == TINY_CLIP_PROJECTION_DIM


@pytest.mark.parametrize("size", [32, 64])
def test_scores_shape_dtype_finite(reward, size):
    images = _images(4, size, seed=size)
    scores = reward(images, ["a photo"] * 4)
    assert isinstance(scores, np.ndarray)
    assert scores.dtype == np.float32 and scores.shape == (4,)
    assert np.all(np.isfinite(scores))


def test_deterministic_and_image_dependent(reward, tiny):
    images = _images(4, 32, seed=1)
    a = reward(images, [""] * 4)
    b = reward(images, [""] * 4)
    np.testing.assert_array_equal(a, b)
    # A fresh instance loaded from disk agrees.
    clip_dir, mlp_path = tiny
    c = AestheticReward(str(clip_dir), str(mlp_path))(images, [""] * 4)
    np.testing.assert_array_equal(a, c)
    # Different images -> different scores.
    assert len(np.unique(a)) == 4
    other = reward(_images(4, 32, seed=2), [""] * 4)
    assert not np.allclose(a, other)


def test_chunked_equals_whole_batch(tiny, reward):
    clip_dir, mlp_path = tiny
    images = _images(5, 48, seed=3)
    chunked = AestheticReward(str(clip_dir), str(mlp_path), batch_size=2)(images, None)
    np.testing.assert_allclose(chunked, reward(images, None), rtol=1e-5, atol=1e-6)


def test_matches_manual_computation(tiny, reward):
    from safetensors.torch import load_file
    from transformers import CLIPModel

    clip_dir, mlp_path = tiny
    images = _images(3, 64, seed=4)

    processor = clip_image_processor_class().from_pretrained(str(clip_dir), local_files_only=True)
    clip = CLIPModel.from_pretrained(str(clip_dir), local_files_only=True).eval()
    mlp = ReferenceMLP(TINY_CLIP_PROJECTION_DIM).eval()
    mlp.load_state_dict(load_file(str(mlp_path)))
    with torch.no_grad():
        pixel_values = processor(images=list(images), return_tensors="pt")["pixel_values"]
        assert pixel_values.shape == (3, 3, 32, 32)
        feats = clip.get_image_features(pixel_values=pixel_values)
        if not isinstance(feats, torch.Tensor):  # transformers 5 returns the output object
            feats = feats.pooler_output
        feats = feats / torch.linalg.vector_norm(feats, dim=-1, keepdim=True)
        expected = mlp(feats).squeeze(1).numpy()

    np.testing.assert_allclose(reward(images, [""] * 3), expected, rtol=1e-5, atol=1e-6)


def test_mlp_keys_match_reference_naming(tiny, tmp_path, reward):
    ref_keys = set(ReferenceMLP(768).state_dict())
    assert set(make_aesthetic_mlp(768).state_dict()) == ref_keys == set(AESTHETIC_MLP_KEYS)
    for name, p in make_aesthetic_mlp(768).state_dict().items():
        assert p.shape == ReferenceMLP(768).state_dict()[name].shape

    # A reference-style torch.save(MLP().state_dict()) .pth (like sac+logos+ava1-l14-linearMSE.pth) loads.
    clip_dir, mlp_path = tiny
    from safetensors.torch import load_file

    ref = ReferenceMLP(TINY_CLIP_PROJECTION_DIM)
    ref.load_state_dict(load_file(str(mlp_path)))
    pth = tmp_path / "mlp.pth"
    torch.save(ref.state_dict(), pth)
    images = _images(2, 32, seed=5)
    from_pth = AestheticReward(str(clip_dir), str(pth))(images, ["", ""])
    np.testing.assert_array_equal(from_pth, reward(images, ["", ""]))


def test_mlp_path_none_names_the_key(tiny):
    clip_dir, _ = tiny
    with pytest.raises(RewardError) as ei:
        AestheticReward(clip_model=str(clip_dir), mlp_path=None)
    msg = str(ei.value)
    assert "reward.mlp_path" in msg and "sac+logos+ava1-l14-linearMSE.pth" in msg
    # Through the registry too.
    with pytest.raises(RewardError, match="reward.mlp_path"):
        make_reward("aesthetic", clip_model=str(clip_dir), mlp_path=None)


def test_missing_mlp_file_names_the_key(tiny, tmp_path):
    clip_dir, _ = tiny
    with pytest.raises(RewardError, match="reward.mlp_path"):
        AestheticReward(str(clip_dir), str(tmp_path / "nope.pth"))


def test_missing_clip_dir_names_the_key(tiny, tmp_path):
    _, mlp_path = tiny
    with pytest.raises(RewardError, match="reward.clip_model"):
        AestheticReward(clip_model=str(tmp_path / "no_such_clip"), mlp_path=str(mlp_path))
    empty = tmp_path / "empty_clip"
    empty.mkdir()
    with pytest.raises(RewardError, match="reward.clip_model"):
        AestheticReward(clip_model=str(empty), mlp_path=str(mlp_path))


def test_mlp_input_size_mismatch(tiny, tmp_path):
    from safetensors.torch import save_file

    clip_dir, _ = tiny
    big = tmp_path / "l14.safetensors"
    save_file({k: v.contiguous() for k, v in make_aesthetic_mlp(768).state_dict().items()}, str(big))
    with pytest.raises(RewardError, match="projection_dim"):
        AestheticReward(str(clip_dir), str(big))


def test_bad_images_rejected(reward):
    with pytest.raises(RewardError, match="uint8"):
        reward(np.zeros((2, 32, 32, 3), np.float32), ["", ""])
    with pytest.raises(RewardError, match="prompts"):
        reward(_images(2, 32, seed=0), ["only one"])


def test_build_is_deterministic_and_ensure_reuses(tiny, tmp_path):
    from safetensors.torch import load_file

    a_clip, a_mlp = build_tiny_aesthetic(tmp_path / "a", seed=0)
    b_clip, b_mlp = build_tiny_aesthetic(tmp_path / "b", seed=0)
    for x, y in ((a_clip / "model.safetensors", b_clip / "model.safetensors"), (a_mlp, b_mlp)):
        sx, sy = load_file(str(x)), load_file(str(y))
        assert sx.keys() == sy.keys()
        assert all(torch.equal(sx[k], sy[k]) for k in sx)
    c_clip, _ = build_tiny_aesthetic(tmp_path / "c", seed=1)
    assert not torch.equal(
        load_file(str(a_clip / "model.safetensors"))["visual_projection.weight"],
        load_file(str(c_clip / "model.safetensors"))["visual_projection.weight"],
    )

    clip_dir, mlp_path = tiny
    mtime = mlp_path.stat().st_mtime_ns
    again = ensure_tiny_aesthetic(clip_dir.parent.parent)
    assert again == (clip_dir, mlp_path)
    assert mlp_path.stat().st_mtime_ns == mtime
    assert not [p for p in clip_dir.parent.parent.iterdir() if p.name.startswith(".")]


def test_clip_score_on_the_tiny_clip(tmp_path):
    from ddpo_tpu.rewards import make_reward
    from ddpo_tpu.rewards.tiny_clip import ensure_tiny_aesthetic

    clip_dir, _ = ensure_tiny_aesthetic(tmp_path)
    reward = make_reward("clip_score", clip_model=str(clip_dir))
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (4, 32, 32, 3), dtype=np.uint8)
    a = reward(images, ["a cat", "a dog", "a cat", "a horse"])
    assert a.dtype == np.float32 and a.shape == (4,) and np.all(np.abs(a) <= 1.0 + 1e-6)
    b = reward(images, ["a horse", "a dog", "a cat", "a horse"])
    assert a[1] == b[1] and a[0] != b[0]  # the score depends on the prompt of its own image only
    with pytest.raises(RewardError, match="reward.clip_model"):
        make_reward("clip_score", clip_model=str(tmp_path / "nope"))
