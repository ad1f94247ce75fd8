"""Rewards on videos (rewards/video.py, rewards/frame_consistency.py, config/components.py): the temporal reward's
value from VBench's formula on hand-made features and frames, what a reward takes checked against what the model
makes at compose time, the frame reduction as a key, and reward=weighted mixing per-frame and video rewards.

The reference for frame_consistency is VBench's background consistency, Vchitect/VBench@45e79ec
vbench/background_consistency.py:42-56, written out here as its loop (`vbench_background_consistency`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ddpo_tpu.config.compose import compose_and_validate
from ddpo_tpu.problems import ConfigError
from ddpo_tpu.rewards.frame_consistency import consistency


def vbench_background_consistency(image_features: torch.Tensor) -> float:
    """VBench@45e79ec vbench/background_consistency.py:43-56 for one video's (F, D) CLIP image features."""
    F = torch.nn.functional
    image_features = F.normalize(image_features, dim=-1, p=2)
    video_sim, former_image_feature = 0.0, None  # the previous frame's (set at i == 0, read from i == 1)
    for i in range(len(image_features)):
        image_feature = image_features[i].unsqueeze(0)
        if i == 0:
            first_image_feature = image_feature
        else:
            sim_pre = max(0.0, F.cosine_similarity(former_image_feature, image_feature).item())
            sim_fir = max(0.0, F.cosine_similarity(first_image_feature, image_feature).item())
            video_sim += (sim_pre + sim_fir) / 2
        former_image_feature = image_feature
    return video_sim / (len(image_features) - 1)


def test_consistency_is_vbenchs_formula_on_hand_made_features():
    rng = np.random.default_rng(0)
    drift = np.cumsum(rng.normal(size=(3, 6, 8)), axis=1) + 4.0  # three slowly drifting feature tracks
    drift[2, 3] = -drift[2, 3]  # a frame pointing away from the others: its cosines clip at 0
    ours = consistency(drift)
    ref = [vbench_background_consistency(torch.tensor(v)) for v in drift]
    np.testing.assert_allclose(ours, ref, rtol=1e-12)
    # identical frames: every cosine is 1, the maximum; a frame-shuffled drift is less consistent than the drift
    same = np.repeat(rng.normal(size=(1, 1, 8)), 5, axis=1)
    np.testing.assert_allclose(consistency(same), [1.0], rtol=1e-12)
    ramp = np.stack([np.cos(np.linspace(0, 1.5, 6)), np.sin(np.linspace(0, 1.5, 6))], axis=-1)[None]  # a quarter turn
    shuffled = ramp[:, [0, 5, 1, 4, 2, 3]]
    assert consistency(shuffled)[0] < consistency(ramp)[0] < 1.0
    # by hand: unit vectors at angles 0, 0.3, ..., 1.5 rad: cos to the previous is cos(0.3), to the first cos(0.3 i)
    by_hand = np.mean([(np.cos(0.3) + np.cos(0.3 * i)) / 2 for i in range(1, 6)])
    np.testing.assert_allclose(consistency(ramp), [by_hand], rtol=1e-12)


@pytest.fixture(scope="module")
def tiny_clip(model_cache):
    from ddpo_tpu.rewards.tiny_clip import ensure_tiny_aesthetic

    return ensure_tiny_aesthetic(model_cache)[0]


def fade_in(frames: int = 6, size: int = 32, seed: int = 1) -> np.ndarray:
    """A black frame fading into a random texture in equal steps: (F, H, W, 3) uint8, each frame nearest the one
    before it."""
    texture = np.random.default_rng(seed).integers(0, 256, (size, size, 3)).astype(np.float64)
    t = np.linspace(0, 1, frames)[:, None, None, None]
    return (t * texture).round().astype(np.uint8)


def test_frame_consistency_on_the_tiny_clip(tiny_clip):
    from transformers import CLIPImageProcessor, CLIPModel

    from ddpo_tpu.rewards import make_reward

    reward = make_reward("frame_consistency", clip_model=str(tiny_clip), batch_size=4)  # 4: more than one pass
    fade = fade_in()
    still = np.repeat(fade[-1:], 6, axis=0)
    videos = np.stack([fade, still, fade[[0, 5, 1, 4, 2, 3]], fade[::-1]])
    got = reward(videos, ["p"] * 4)
    assert got.dtype == np.float32 and got.shape == (4,)
    # the reference: VBench's loop on CLIP's image features of each frame, computed here from the model itself
    model = CLIPModel.from_pretrained(str(tiny_clip)).eval()
    processor = CLIPImageProcessor.from_pretrained(str(tiny_clip))
    for video, value in zip(videos, got):
        with torch.no_grad():
            out = model.get_image_features(**processor(images=list(video), return_tensors="pt"))
        feats = out if torch.is_tensor(out) else out.pooler_output
        assert value == pytest.approx(vbench_background_consistency(feats), abs=1e-5)
    assert got[1] == pytest.approx(1.0, abs=1e-6)  # identical frames: the maximum
    assert got[2] < got[0] - 0.01 and got[0] < 1.0  # the same frames shuffled: less consistent
    assert got[3] != pytest.approx(got[0], abs=1e-3)  # reversed: the first frame is another one, the score differs
    with pytest.raises(Exception, match="at least 2 frames"):
        reward(videos[:, :1], ["p"] * 4)
    with pytest.raises(Exception, match=r"reward.clip_model"):
        make_reward("frame_consistency", clip_model="/nonexistent/clip")


def test_a_video_reward_on_an_image_model_is_refused_at_compose_time():
    with pytest.raises(ConfigError) as e:
        compose_and_validate(["+experiment=smoke", "reward=frame_consistency"])
    (p,) = e.value.problems
    assert (p.key, p.value) == ("reward.name", "frame_consistency") and "model.family=sd1 makes images" in p.reason
    assert p.suggested() == ["reward=jpeg_compressibility"] and "model=tiny_wan" in str(p)
    with pytest.raises(ConfigError) as e:  # as a component of a weighted sum: named by its index
        compose_and_validate(["+experiment=smoke", "reward=weighted", "reward.components=[{name:jpeg_compressibility},"
                              "{name:frame_consistency,clip_model:tiny}]"])
    (p,) = e.value.problems
    assert p.key == "reward.components.1.name" and "model=tiny_wan" in str(p)


def test_the_frame_reduction_is_a_key_read_by_video_models_only():
    v = compose_and_validate(["+experiment=wan_grpo_smoke", "reward.frame_reduction=min"])
    assert v.cfg.reward.frame_reduction == "min"
    assert compose_and_validate(["+experiment=wan_grpo_smoke"]).cfg.reward.frame_reduction == "mean"
    with pytest.raises(ConfigError) as e:  # an image model has no frames to reduce
        compose_and_validate(["+experiment=smoke", "reward.frame_reduction=min"])
    assert [(p.key, "not read" in p.reason) for p in e.value.problems] == [("reward.frame_reduction", True)]
    with pytest.raises(ConfigError) as e:
        compose_and_validate(["+experiment=smoke", "reward=weighted",
                              "reward.components=[{name:jpeg_compressibility,frame_reduction:min}]"])
    assert [p.suggested() for p in e.value.problems] == [["reward.components.0.frame_reduction=mean"]]
    with pytest.raises(ConfigError) as e:  # a video reward reads whole videos: no frame reduction
        compose_and_validate(["+experiment=wan_grpo_smoke", "reward=frame_consistency", "reward.frame_reduction=min"])
    assert [p.key for p in e.value.problems] == ["reward.frame_reduction"]
    with pytest.raises(ConfigError):
        compose_and_validate(["+experiment=wan_grpo_smoke", "reward.frame_reduction=max"])


def test_for_videos_wraps_image_rewards_by_their_reduction_and_passes_videos_to_video_rewards(model_cache):
    from ddpo_tpu.rewards.from_config import reward_from_config
    from ddpo_tpu.rewards.jpeg import JpegCompressibility
    from ddpo_tpu.rewards.video import PerFrame, for_videos

    v = compose_and_validate(["+experiment=wan_grpo_smoke", f"model.cache_dir={model_cache}", "reward=weighted",
                              "reward.components=[{name:jpeg_compressibility,frame_reduction:min},"
                              "{name:frame_consistency,clip_model:tiny,weight:0.5}]"])
    reward = for_videos(reward_from_config(v.cfg.reward, model_cache_dir=model_cache, device="cpu"), v.cfg.reward)
    jpeg, temporal = reward.components
    assert isinstance(jpeg, PerFrame) and jpeg.reduction == "min" and not isinstance(temporal, PerFrame)
    videos = np.stack([fade_in(), np.repeat(fade_in()[-1:], 6, axis=0)])
    total = reward(videos, ["a", "b"])
    per_frame = np.stack([JpegCompressibility()(v, ["p"] * 6) for v in videos])
    np.testing.assert_allclose(reward.last_components["jpeg_compressibility"], per_frame.min(axis=1), rtol=1e-6)
    assert reward.last_components["frame_consistency"].shape == (2,)  # one value a video, not a frame
    np.testing.assert_allclose(total, per_frame.min(axis=1) + 0.5 * reward.last_components["frame_consistency"],
                               rtol=1e-5)
    run = compose_and_validate(["+experiment=wan_grpo_smoke", f"model.cache_dir={model_cache}",
                                "reward=frame_consistency"])
    alone = reward_from_config(run.cfg.reward, model_cache_dir=model_cache, device="cpu")
    assert for_videos(alone, run.cfg.reward) is alone  # a video reward is not wrapped
