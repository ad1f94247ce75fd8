"""Reward interface, reward registry and image conversion helpers.

Everything here imports only ``numpy`` (no torch, no PIL) so that reward
modules can be imported cheaply in any process.

A reward is a callable object::

    reward = make_reward("jpeg_compressibility")
    scores = reward(images_uint8_bhwc, prompts)                      # float32 (B,)
    scores = reward(images_uint8_bhwc, prompts, metadata=rows)       # rows: one dict per image (the prompt's metadata)
    result = reward.score(images_uint8_bhwc, prompts, metadata=rows) # RewardScores: values + per-image extras

``metadata`` is what a prompt dataset row holds besides its prompt (GenEval's tag, objects, counts, colours and
positions; an OCR target; anything a JSONL row carries), one mapping per image in the order of ``prompts``; an empty
mapping for a prompt without any, and ``None`` when the prompt source has no metadata at all. Rewards that do not use
it ignore it.

Source pictures (the edit task, model.family=qwen_image_edit): an edit dataset's rows name each prompt's input
pictures, and each image's metadata then holds them as ``metadata[i]["source_images"]``: a list of uint8 (H, W, 3)
arrays, as stored in the dataset (prompts/datasets.py; flow_grpo's order: the reference picture first, then the
control picture), not resized to the output. A reward that needs them says so in its catalog entry
(``RewardSpec(takes_sources=True)``, catalog/rewards.py): the front end refuses it on prompts that carry none, and
refuses an edit family scored by a reward that cannot see them (catalog/reward_checks.py). docs/rewards.md.

``extras`` are per-image values a reward reports beside the one that trains (a weighted reward's components,
GenEval's strict correctness per tag): float arrays of shape (B,), NaN where a value does not apply to an image. The
loop logs each one's mean over the images where it applies.

A run builds its reward from the typed `reward` config with
``ddpo_tpu.rewards.from_config.reward_from_config``.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ddpo_tpu.waits import advanced

__all__ = [
    "RewardError",
    "Reward",
    "RewardScores",
    "Metadata",
    "score_with",
    "REWARDS",
    "register_reward",
    "make_reward",
    "to_uint8_images",
]


class RewardError(RuntimeError):
    """A reward could not be built or computed.

    The message always names the reward (``reward.name=...``) and says what
    went wrong.
    """

    def __init__(self, name: str | None, message: str):
        self.reward_name = name
        super().__init__(f"reward.name={name!r}: {message}")


#: one mapping per image (its prompt's dataset fields besides the prompt), or None when the prompts carry none
Metadata = Sequence[Mapping[str, Any]] | None


@dataclass(frozen=True)
class RewardScores:
    """What one reward call scored: ``values`` train (float32 (B,)); ``extras`` are logged (name -> float (B,), NaN
    where the value does not apply to an image)."""

    values: np.ndarray
    extras: dict[str, np.ndarray] = field(default_factory=dict)


class Reward(abc.ABC):
    """Base class of all rewards.

    Subclasses set the class attribute ``name`` (``register_reward`` does) and
    implement ``__call__(images, prompts, metadata=None)`` which takes uint8
    images of shape (B, H, W, 3) on the host plus the B prompts (and, from a
    dataset, the B prompts' metadata), and returns float32 rewards of shape
    (B,). A reward with values to log beside the one that trains overrides
    ``score`` too.
    """

    name: str

    @abc.abstractmethod
    def __call__(self, images: np.ndarray, prompts: list[str], metadata: Metadata = None) -> np.ndarray:
        ...

    def score(self, images: np.ndarray, prompts: list[str], metadata: Metadata = None) -> RewardScores:
        """The values that train and the extras to log; by default the call's values and no extras."""
        return RewardScores(np.asarray(self(images, prompts, metadata=metadata), dtype=np.float32))

    # Helpers for subclasses -------------------------------------------------

    def _error(self, message: str) -> RewardError:
        return RewardError(getattr(self, "name", type(self).__name__), message)

    def _check_host_images(self, images: Any, prompts: Sequence[str] | None) -> np.ndarray:
        """Validate a host image batch: numpy uint8, shape (B, H, W, 3)."""
        if not isinstance(images, np.ndarray):
            raise self._error(
                f"expected a numpy uint8 array of shape (B, H, W, 3), got {type(images).__name__}; "
                "convert with ddpo_tpu.rewards.to_uint8_images"
            )
        if images.dtype != np.uint8:
            raise self._error(
                f"expected uint8 images, got dtype {images.dtype}; "
                "convert with ddpo_tpu.rewards.to_uint8_images"
            )
        if images.ndim != 4 or images.shape[-1] != 3:
            raise self._error(f"expected images of shape (B, H, W, 3), got {tuple(images.shape)}")
        if prompts is not None and len(prompts) != images.shape[0]:
            raise self._error(
                f"got {images.shape[0]} images but {len(prompts)} prompts"
            )
        return images

    def _score_in_chunks(self, images: Any, prompts: Sequence[str] | None, batch_size: int | None,
                         score_chunk: Callable[[np.ndarray, list[str]], np.ndarray], who: str,
                         fixed_shape: bool = False) -> np.ndarray:
        """A model reward's call: host images validated, scored `batch_size` at a time (null: all at once) by
        score_chunk(images, prompts) -> (n,); `fixed_shape` fills the last chunk with copies of its last pair and
        drops their scores (one input shape for every forward). A failure of the model is named as this reward's."""
        images = self._check_host_images(images, prompts)
        if prompts is None:
            raise self._error(f"{who} needs the prompts of the images")
        prompts = [str(p) for p in prompts]
        n = images.shape[0]
        if n == 0:
            return np.zeros((0,), dtype=np.float32)
        step = batch_size or n
        parts = []
        try:
            for i in range(0, n, step):
                ims, ps = images[i:i + step], prompts[i:i + step]
                real = len(ps)
                if fixed_shape and real < step:
                    ims = np.concatenate([ims, np.repeat(ims[-1:], step - real, axis=0)])
                    ps = ps + [ps[-1]] * (step - real)
                parts.append(np.asarray(score_chunk(ims, ps))[:real])
                advanced()  # a chunk scored: a rank waiting on this reward is moving (ddpo_tpu/waits.py)
        except Exception as exc:  # transformers / torch failures, named as this reward's
            raise self._error(f"scoring failed: {type(exc).__name__}: {exc}") from exc
        return np.concatenate(parts).astype(np.float32, copy=False)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={getattr(self, 'name', None)!r})"


def score_with(reward: Any, images: np.ndarray, prompts: list[str], metadata: Metadata = None) -> RewardScores:
    """`reward.score(images, prompts, metadata=)`; a plain callable (images, prompts) -> values in a reward's place
    (tests swap one in, and wrappers take any) scores without metadata and reports no extras."""
    if isinstance(reward, Reward) or hasattr(reward, "score"):
        return reward.score(images, prompts, metadata=metadata)
    return RewardScores(np.asarray(reward(images, prompts)))


# ---------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------

#: name -> factory (a Reward subclass or any callable returning a Reward).
REWARDS: dict[str, Callable[..., Reward]] = {}


def _same_factory(a: Any, b: Any) -> bool:
    # A module reload creates a new class object with the same identity by
    # module + qualname: treat that as the same factory, not a clash.
    if a is b:
        return True
    key = lambda f: (getattr(f, "__module__", None), getattr(f, "__qualname__", None))  # noqa: E731
    return key(a) == key(b) and key(a) != (None, None)


def register_reward(name: str) -> Callable[[Callable[..., Reward]], Callable[..., Reward]]:
    """Decorator registering a reward factory (class or function) under ``name``.

    A ``Reward`` subclass without its own ``name`` gets ``name`` set.
    Registering a different factory under an existing name raises RewardError.
    """
    if not isinstance(name, str) or not name:
        raise RewardError(name, "reward names must be non-empty strings")

    def decorator(factory: Callable[..., Reward]) -> Callable[..., Reward]:
        if not callable(factory):
            raise RewardError(name, f"cannot register non-callable {factory!r}")
        existing = REWARDS.get(name)
        if existing is not None and not _same_factory(existing, factory):
            raise RewardError(
                name, f"a different reward is already registered under this name ({existing!r})"
            )
        if isinstance(factory, type) and issubclass(factory, Reward) and "name" not in vars(factory):
            factory.name = name
        REWARDS[name] = factory
        return factory

    return decorator


def make_reward(name: str, **kwargs: Any) -> Reward:
    """Build the reward registered under ``name`` with ``kwargs``."""
    factory = REWARDS.get(name)
    if factory is None:
        raise RewardError(
            name, f"unknown reward; registered rewards: {sorted(REWARDS)}"
        )
    try:
        reward = factory(**kwargs)
    except RewardError:
        raise
    except Exception as exc:  # bad kwargs, missing weights, ...
        raise RewardError(name, f"could not build the reward: {type(exc).__name__}: {exc}") from exc
    if not isinstance(reward, Reward):
        raise RewardError(name, f"factory returned {type(reward).__name__}, not a Reward")
    return reward


# ---------------------------------------------------------------------------
# Image conversion
# ---------------------------------------------------------------------------


def _to_numpy(images: Any) -> tuple[np.ndarray, bool]:
    """Return (array, came_from_torch). Duck-types torch tensors (no torch import)."""
    if hasattr(images, "detach") and hasattr(images, "cpu"):
        t = images.detach().cpu()
        is_float = getattr(t, "is_floating_point", lambda: False)()
        if is_float and str(t.dtype) not in ("torch.float32", "torch.float64"):
            t = t.float()  # float16 / bfloat16: numpy cannot hold bfloat16
        return t.numpy(), True
    return np.asarray(images), False


def to_uint8_images(images: Any) -> np.ndarray:
    """Convert a batch of images to uint8 (B, H, W, 3) on the host.

    Accepts float images in [0, 1] as a torch tensor (B, 3, H, W) or a numpy
    array (B, H, W, 3) or (B, 3, H, W); uint8 input is only re-laid-out.
    Float values become ``(x * 255).round().clip(0, 255)`` as in the reference
    (round half to even, like torch.round).  float16/bfloat16 are upcast to
    float32 before scaling; NaN maps to 0.

    Layout: torch tensors are read as channels-first when dim 1 is 3, numpy
    arrays as channels-last when the last dim is 3 (the other layout is the
    fallback).
    """
    arr, from_torch = _to_numpy(images)
    if arr.ndim != 4:
        raise ValueError(f"expected a 4-D image batch, got shape {tuple(arr.shape)}")

    channels_first_ok = arr.shape[1] == 3
    channels_last_ok = arr.shape[-1] == 3
    if from_torch:
        channels_first = channels_first_ok
    else:
        channels_first = channels_first_ok and not channels_last_ok
    if not (channels_first or channels_last_ok):
        raise ValueError(
            f"expected 3-channel images as (B, 3, H, W) or (B, H, W, 3), got shape {tuple(arr.shape)}"
        )
    if channels_first:
        arr = arr.transpose(0, 2, 3, 1)

    if arr.dtype == np.uint8:
        return np.ascontiguousarray(arr)
    if arr.dtype.kind in "biu":
        raise TypeError(
            f"expected float images in [0, 1] or uint8 images, got dtype {arr.dtype}"
        )
    if arr.dtype not in (np.float32, np.float64):
        arr = arr.astype(np.float32)  # float16, ml_dtypes bfloat16, ...
    scaled = np.round(arr * arr.dtype.type(255))
    scaled = np.nan_to_num(scaled, nan=0.0, posinf=255.0, neginf=0.0)
    return np.ascontiguousarray(np.clip(scaled, 0, 255).astype(np.uint8))
