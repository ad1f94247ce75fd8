"""A registry of named specs: what the catalog's tables are made of. Registering is the only way a model family,
sampler, reward or algorithm becomes known to the front end (schema, rules, docs) and to the training process."""

from __future__ import annotations

import importlib
from typing import Any, Generic, Iterator, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, what: str):
        self.what = what  # "model family", "reward", ...: for messages
        self._specs: dict[str, T] = {}

    def register(self, spec: T, *, replace: bool = False) -> T:
        name = spec.name  # type: ignore[attr-defined]
        if name in self._specs and not replace:
            raise ValueError(f"a {self.what} named {name!r} is already registered")
        self._specs[name] = spec
        return spec

    def unregister(self, name: str) -> None:
        self._specs.pop(name, None)

    def get(self, name: str) -> T:
        try:
            return self._specs[name]
        except KeyError:
            raise KeyError(f"no {self.what} named {name!r} (known: {', '.join(self._specs)})") from None

    def __contains__(self, name: object) -> bool:
        return name in self._specs

    def __iter__(self) -> Iterator[T]:
        return iter(self._specs.values())

    def names(self) -> tuple[str, ...]:
        return tuple(self._specs)


def load_object(path: str) -> Any:
    """"package.module:Name" -> the object (the torch side of a spec, imported only when a run needs it)."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)
