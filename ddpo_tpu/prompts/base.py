"""The prompt source every set is (a finite set of prompts, sampled uniformly) and the error a source that cannot be
built raises. Standard library and numpy only; prompts/sources.py (the word lists) and prompts/datasets.py (JSONL and
text datasets) both build on it."""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np


def _distinct(items: Sequence[str]) -> list[str]:
    return list(dict.fromkeys(items))


class PromptError(ValueError):
    """A prompt source could not be built.

    The message names the configuration key at fault (``prompts.name``,
    ``prompts.file``, ...), says what is wrong and how to fix it.  ``key`` holds
    that configuration key.
    """

    def __init__(self, key: str, value: object, reason: str, fix: str):
        self.key, self.value, self.reason, self.fix = key, value, reason, fix
        super().__init__(f"{key}={value}: {reason} (fix: {fix})")


class PromptSource:
    """A finite set of prompts, sampled uniformly with replacement.

    A prompt is the words drawn independently and uniformly from each of
    ``parts`` (one list for a plain word list; nouns and activities for
    ``nouns_activities``) joined by single spaces.  Repeated lines in a list
    weigh more, as with ``random.choice`` in the reference.
    """

    # the rows name input pictures, handed to the reward as metadata["source_images"] (an edit dataset's)
    has_source_images = False

    def __init__(self, name: str, parts: Sequence[Sequence[str]]):
        if not parts or any(len(p) == 0 for p in parts):
            raise ValueError(f"prompt source {name!r}: every part needs at least one entry")
        self.name = name
        self._parts: tuple[tuple[str, ...], ...] = tuple(tuple(p) for p in parts)

    def sample(self, n: int, rng: np.random.Generator) -> list[str]:
        """``n`` prompts drawn uniformly with replacement; deterministic given ``rng``'s state."""
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
            raise ValueError(f"number of prompts must be an integer >= 0, got {n!r}")
        if not isinstance(rng, np.random.Generator):
            raise TypeError(f"rng must be a numpy.random.Generator, got {type(rng).__name__}")
        n = int(n)
        if n == 0:
            return []
        picks = [rng.integers(0, len(part), size=n) for part in self._parts]
        return [" ".join(part[idx[i]] for part, idx in zip(self._parts, picks)) for i in range(n)]

    @property
    def parts(self) -> tuple[tuple[str, ...], ...]:
        """The lists a prompt's words are drawn from, one word of each (read by the front end's checks)."""
        return self._parts

    @property
    def size(self) -> int:
        """Entries of the source: the product of its lists' lengths (repeated lines counted)."""
        return math.prod(len(p) for p in self._parts)

    def sample_distinct(self, n: int, rng: np.random.Generator) -> list[str]:
        """``n`` prompts at distinct entries of the source (uniformly without replacement), as flow_grpo's
        DistributedKRepeatSampler takes ``randperm(len(dataset))[:n]``: a repeated line may still come twice."""
        if n > self.size:
            raise ValueError(f"prompt source {self.name!r} has {self.size} prompts, fewer than the {n} distinct "
                             f"ones a sampling batch needs")
        flat = rng.choice(self.size, size=n, replace=False)
        out = []
        for i in np.asarray(flat, dtype=np.int64).tolist():
            words = []
            for part in reversed(self._parts):  # mixed radix: the last list varies fastest
                i, j = divmod(i, len(part))
                words.append(part[j])
            out.append(" ".join(reversed(words)))
        return out

    def metadata(self, prompts: Sequence[str]) -> list[dict]:
        """Each prompt's metadata for the reward: {} for a word list (a dataset's rows carry theirs)."""
        return [{} for _ in prompts]

    @property
    def vocabulary(self) -> list[str]:
        """Every distinct prompt this source can produce, in a stable order."""
        combos = [""]
        for part in self._parts:
            words = _distinct(part)
            combos = [f"{c} {w}" if c else w for c in combos for w in words]
        return _distinct(combos)

    @property
    def num_prompts(self) -> int:
        """Number of distinct prompts."""
        return len(self.vocabulary)

    def __repr__(self) -> str:
        sizes = "x".join(str(len(p)) for p in self._parts)
        return f"PromptSource(name={self.name!r}, lists={sizes})"
