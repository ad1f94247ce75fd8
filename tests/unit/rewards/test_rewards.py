"""Tests for ddpo_tpu.rewards: JPEG rewards, registry, image conversion."""

import io
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from ddpo_tpu.rewards import REWARDS, Reward, RewardError, make_reward, register_reward, to_uint8_images


def _flat(b=1, h=64, w=64, colour=(120, 30, 200)):
    img = np.zeros((b, h, w, 3), dtype=np.uint8)
    img[...] = np.asarray(colour, dtype=np.uint8)
    return img


def _noise(b=1, h=64, w=64, seed=0):
    return np.random.default_rng(seed).integers(0, 256, size=(b, h, w, 3), dtype=np.uint8)


def _independent_size_kb(image: np.ndarray) -> float:
    buf = io.BytesIO()
    Image.fromarray(image, "RGB").save(buf, format="JPEG", quality=95)
    return len(buf.getvalue()) / 1000


# --------------------------------------------------------------------------- JPEG


def test_registry_has_jpeg_rewards():
    assert "jpeg_compressibility" in REWARDS
    assert "jpeg_incompressibility" in REWARDS
    for name in ("jpeg_compressibility", "jpeg_incompressibility"):
        r = make_reward(name)
        assert isinstance(r, Reward)
        assert r.name == name


def test_flat_is_more_compressible_than_noise():
    images = np.concatenate([_flat(), _noise()])
    comp = make_reward("jpeg_compressibility")(images, ["a", "b"])
    incomp = make_reward("jpeg_incompressibility")(images, ["a", "b"])
    assert comp[0] > comp[1]
    assert incomp[1] > 5 * incomp[0]  # noise is far bigger than a flat image
    assert np.all(incomp > 0)


def test_incompressibility_is_minus_compressibility():
    images = np.concatenate([_flat(2), _noise(3, seed=1)])
    prompts = ["p"] * 5
    comp = make_reward("jpeg_compressibility")(images, prompts)
    incomp = make_reward("jpeg_incompressibility")(images, prompts)
    np.testing.assert_array_equal(incomp, -comp)


def test_dtype_and_shape():
    images = _noise(4, 32, 48)
    out = make_reward("jpeg_incompressibility")(images, ["x"] * 4)
    assert isinstance(out, np.ndarray)
    assert out.dtype == np.float32
    assert out.shape == (4,)


def test_values_match_independent_pil_computation():
    rng = np.random.default_rng(3)
    gradient = np.broadcast_to(np.arange(96, dtype=np.uint8)[None, :, None], (80, 96, 3)).copy()
    images = np.stack([gradient, rng.integers(0, 256, (80, 96, 3), dtype=np.uint8)])
    expected = np.array([_independent_size_kb(im) for im in images], dtype=np.float32)
    incomp = make_reward("jpeg_incompressibility")(images, ["a", "b"])
    comp = make_reward("jpeg_compressibility")(images, ["a", "b"])
    np.testing.assert_array_equal(incomp, expected)
    np.testing.assert_array_equal(comp, -expected)


def test_non_contiguous_images_ok():
    base = _noise(2, 40, 40, seed=5)
    view = base[:, ::2, ::2]  # non-contiguous view
    out = make_reward("jpeg_incompressibility")(view, ["a", "b"])
    expected = np.array([_independent_size_kb(np.ascontiguousarray(im)) for im in view], np.float32)
    np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize(
    "bad",
    [
        np.zeros((2, 8, 8, 3), dtype=np.float32),  # wrong dtype
        np.zeros((8, 8, 3), dtype=np.uint8),  # not batched
        np.zeros((2, 3, 8, 8), dtype=np.uint8),  # channels-first
    ],
)
def test_bad_images_raise_reward_error(bad):
    reward = make_reward("jpeg_compressibility")
    with pytest.raises(RewardError, match="reward.name='jpeg_compressibility'"):
        reward(bad, ["p"] * len(bad))


def test_prompt_count_mismatch_raises():
    with pytest.raises(RewardError, match="jpeg_incompressibility"):
        make_reward("jpeg_incompressibility")(_noise(2), ["only one"])


def test_jpeg_module_does_not_import_torch():
    code = (
        "import sys; import ddpo_tpu.rewards.jpeg, ddpo_tpu.rewards; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# --------------------------------------------------------------------------- registry


def test_unknown_reward_names_it_and_lists_registered():
    with pytest.raises(RewardError) as info:
        make_reward("no_such_reward")
    msg = str(info.value)
    assert "reward.name='no_such_reward'" in msg
    assert "jpeg_compressibility" in msg and "jpeg_incompressibility" in msg
    assert isinstance(info.value, RuntimeError)


def test_register_reward_class_and_factory():
    try:

        @register_reward("_test_constant")
        class Constant(Reward):
            def __init__(self, value: float = 1.0):
                self.value = value

            def __call__(self, images, prompts):
                return np.full(len(prompts), self.value, dtype=np.float32)

        assert REWARDS["_test_constant"] is Constant
        assert Constant.name == "_test_constant"  # filled in by the decorator
        r = make_reward("_test_constant", value=2.5)
        np.testing.assert_array_equal(r(None, ["a", "b"]), [2.5, 2.5])

        @register_reward("_test_factory")
        def build(value=3.0):
            return Constant(value)

        np.testing.assert_array_equal(make_reward("_test_factory")(None, ["a"]), [3.0])

        # bad kwargs -> RewardError naming the reward
        with pytest.raises(RewardError, match="reward.name='_test_constant'"):
            make_reward("_test_constant", nope=1)

        # a different factory under a taken name is refused
        with pytest.raises(RewardError, match="already registered"):
            register_reward("_test_constant")(build)
    finally:
        REWARDS.pop("_test_constant", None)
        REWARDS.pop("_test_factory", None)


def test_factory_must_return_reward():
    try:
        register_reward("_test_not_a_reward")(lambda: object())
        with pytest.raises(RewardError, match="not a Reward"):
            make_reward("_test_not_a_reward")
    finally:
        REWARDS.pop("_test_not_a_reward", None)


# --------------------------------------------------------------------------- to_uint8_images


def test_to_uint8_rounding_known_values():
    # x*255: 0 -> 0, 0.5 -> 127.5 -> 128 (half to even), 1 -> 255,
    # 0.2 -> 51, 1.3 -> clip 255, -0.1 -> clip 0, 0.5/255 -> 0.5 -> 0 (half to even),
    # 1.5/255 -> 1.5 -> 2 (half to even)
    vals = np.array([0.0, 0.5, 1.0, 0.2, 1.3, -0.1, 0.5 / 255, 1.5 / 255, 0.999], dtype=np.float64)
    expected = np.array([0, 128, 255, 51, 255, 0, 0, 2, 255], dtype=np.uint8)
    img = np.repeat(vals[None, None, :, None], 3, axis=3)  # (1, 1, 9, 3) NHWC
    out = to_uint8_images(img)
    assert out.dtype == np.uint8 and out.shape == (1, 1, 9, 3)
    np.testing.assert_array_equal(out[0, 0, :, 0], expected)


def test_to_uint8_layouts_agree():
    rng = np.random.default_rng(0)
    nhwc = rng.uniform(-0.05, 1.05, size=(2, 5, 7, 3)).astype(np.float32)
    nchw = np.ascontiguousarray(nhwc.transpose(0, 3, 1, 2))
    expected = np.clip(np.round(nhwc * np.float32(255)), 0, 255).astype(np.uint8)
    np.testing.assert_array_equal(to_uint8_images(nhwc), expected)
    np.testing.assert_array_equal(to_uint8_images(nchw), expected)


def test_to_uint8_torch_matches_reference_formula():
    import torch  # a hard dependency: no skip
    g = torch.Generator().manual_seed(0)
    x = torch.rand(3, 3, 6, 4, generator=g) * 1.1 - 0.05
    ref = (x * 255).round().clamp(0, 255).to(torch.uint8).cpu().numpy().transpose(0, 2, 3, 1)
    out = to_uint8_images(x)
    assert out.shape == (3, 6, 4, 3) and out.dtype == np.uint8
    np.testing.assert_array_equal(out, ref)
    # (B, 3, H, 3) tensor is channels-first for torch
    y = torch.rand(2, 3, 5, 3, generator=g)
    np.testing.assert_array_equal(to_uint8_images(y), to_uint8_images(y.numpy().transpose(0, 2, 3, 1)))
    # half precision inputs work (upcast before scaling)
    np.testing.assert_array_equal(
        to_uint8_images(x.to(torch.bfloat16)),
        to_uint8_images(x.to(torch.bfloat16).float()),
    )
    # requires_grad tensors work
    np.testing.assert_array_equal(to_uint8_images(x.clone().requires_grad_(True)), ref)


def test_to_uint8_uint8_passthrough_and_errors():
    u = _noise(2, 4, 4)
    np.testing.assert_array_equal(to_uint8_images(u), u)
    np.testing.assert_array_equal(to_uint8_images(u.transpose(0, 3, 1, 2)), u)
    with pytest.raises(ValueError):
        to_uint8_images(np.zeros((4, 4, 3), dtype=np.float32))
    with pytest.raises(ValueError):
        to_uint8_images(np.zeros((1, 4, 4, 4), dtype=np.float32))
    with pytest.raises(TypeError):
        to_uint8_images(np.zeros((1, 4, 4, 3), dtype=np.int64))
    assert to_uint8_images(np.full((1, 1, 1, 3), np.nan))[0, 0, 0, 0] == 0


def test_end_to_end_float_images_to_reward():
    flat = np.full((1, 3, 32, 32), 0.4, dtype=np.float32)
    noise = np.random.default_rng(1).uniform(0, 1, (1, 3, 32, 32)).astype(np.float32)
    imgs = to_uint8_images(np.concatenate([flat, noise]))
    comp = make_reward("jpeg_compressibility")(imgs, ["a", "b"])
    assert comp[0] > comp[1]
