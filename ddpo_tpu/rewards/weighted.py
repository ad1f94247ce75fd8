"""Weighted sum of rewards.

::

    reward = make_reward("weighted", components=[
        {"name": "jpeg_compressibility", "weight": 0.5},
        {"name": "remote", "weight": 2.0, "url": "http://127.0.0.1:8000/score"},
    ])
    total = reward(images, prompts)        # float32 (B,) = 0.5 * jpeg + 2.0 * remote
    reward.last_components                 # {"jpeg_compressibility": (B,), "remote": (B,)} of that call

Each component is ``{"name": <registered reward>, "weight": <number, default 1.0>, **kwargs}``; the kwargs go to
that reward's constructor (``make_reward(name, **kwargs)``). A run's components were checked at compose time (the
typed ``RewardComponent`` of ddpo_tpu/config/schema.py); the constructor checks its plain mappings itself, since
``make_reward`` is called without the schema too (any registered reward may be a component there).  Components are
called one after the other on the same images and prompts; the sum is accumulated in float64 and returned as
float32.  Non-finite component values propagate into the sum (the trainer's ``on_nonfinite_reward`` handles them).

``last_components`` maps each component's key -- its name, or ``name#i`` (i = its index) when several
components share a name -- to its unweighted rewards from the most recent call.  When the reward is called from
several threads at once, use ``score_with_components`` to get the parts of one call race-free.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any, Mapping, Sequence

import numpy as np

from ddpo_tpu.rewards.base import Metadata, Reward, RewardError, RewardScores, make_reward, register_reward

__all__ = ["WeightedReward", "component_keys", "component_weights"]

_NAME = "weighted"


def component_keys(names: Sequence[str]) -> tuple[str, ...]:
    """Each component's name in extras and logs: the reward's name, `name#i` when two components share it."""
    counts = Counter(names)
    return tuple(n if counts[n] == 1 else f"{n}#{i}" for i, n in enumerate(names))


@register_reward(_NAME)
class WeightedReward(Reward):
    """sum_i weight_i * component_i(images, prompts)."""

    name = _NAME

    def __init__(self, components: Sequence[Mapping[str, Any]]):
        if isinstance(components, (str, bytes, Mapping)) or not isinstance(components, Sequence) or not components:
            raise self._error(
                f"reward.components={components!r}: must be a non-empty list of "
                '{"name": <reward>, "weight": <number>, ...its options}'
            )
        names: list[str] = []
        weights: list[float] = []
        rewards: list[Reward] = []
        for i, spec in enumerate(components):
            where = f"reward.components.{i}"
            if not isinstance(spec, Mapping):
                raise self._error(
                    f"{where}={spec!r}: must be a mapping "
                    '{"name": <reward>, "weight": <number>, ...its options}'
                )
            spec = dict(spec)
            name = spec.pop("name", None)
            if not isinstance(name, str) or not name:
                raise self._error(f"{where}.name={name!r}: must name a registered reward")
            weight = spec.pop("weight", 1.0)
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
                raise self._error(f"{where}.weight={weight!r}: must be a finite number")
            try:
                reward = make_reward(name, **spec)
            except RewardError as exc:
                raise self._error(f"{where} ({name}): {exc}") from exc
            names.append(name)
            weights.append(float(weight))
            rewards.append(reward)

        self.component_keys: tuple[str, ...] = component_keys(names)
        self.weights: tuple[float, ...] = tuple(weights)
        self.components: tuple[Reward, ...] = tuple(rewards)
        #: Unweighted per-component rewards (float32 (B,)) of the most recent call, by component key.
        self.last_components: dict[str, np.ndarray] = {}

    def score(self, images: np.ndarray, prompts: list[str], metadata: Metadata = None) -> RewardScores:
        """The weighted sum; extras: each component's unweighted values by component key, and each component's own
        extras as `<component key>/<extra>`."""
        batch = len(prompts) if prompts is not None else None
        if isinstance(images, np.ndarray) and images.ndim >= 1:
            batch = images.shape[0]
        extras: dict[str, np.ndarray] = {}
        total: np.ndarray | None = None
        for i, (key, weight, reward) in enumerate(zip(self.component_keys, self.weights, self.components)):
            where = f"reward.components.{i} ({reward.name})"
            try:
                scored = reward.score(images, prompts, metadata=metadata)
            except RewardError as exc:
                raise self._error(f"{where}: {exc}") from exc
            except Exception as exc:
                raise self._error(f"{where}: {type(exc).__name__}: {exc}") from exc
            values = np.asarray(scored.values)
            if values.ndim != 1 or (batch is not None and values.shape[0] != batch) or values.dtype.kind not in "fiu":
                raise self._error(
                    f"{where}: returned {values.dtype} of shape {tuple(values.shape)}, expected float ({batch},)"
                )
            extras[key] = values.astype(np.float32, copy=False)
            extras.update({f"{key}/{name}": v for name, v in scored.extras.items()})
            term = weight * values.astype(np.float64)
            total = term if total is None else total + term
        assert total is not None
        return RewardScores(total.astype(np.float32), extras)

    def score_with_components(self, images: np.ndarray, prompts: list[str], metadata: Metadata = None
                              ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """The weighted sum and the unweighted rewards of each component, for this call only."""
        scored = self.score(images, prompts, metadata=metadata)
        return scored.values, {k: scored.extras[k] for k in self.component_keys}

    def __call__(self, images: np.ndarray, prompts: list[str], metadata: Metadata = None) -> np.ndarray:
        total, parts = self.score_with_components(images, prompts, metadata=metadata)
        self.last_components = parts  # one assignment: readers never see a half-filled dict
        return total

    def __repr__(self) -> str:
        inner = ", ".join(f"{w:g}*{r!r}" for w, r in zip(self.weights, self.components))
        return f"WeightedReward({inner})"


def component_weights(reward_cfg) -> dict[str, float]:
    """reward=weighted's components as the reward reports them in its extras (rewards/weighted.py) -> their weights."""
    comps = reward_cfg.components
    return dict(zip(component_keys([c.name for c in comps]), (float(c.weight) for c in comps)))
