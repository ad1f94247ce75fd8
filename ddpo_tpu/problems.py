"""One problem per line: the dotted key, its value, the reason and a fix. A fix that is a change of settings is data
(`Fix`: alternative sets of override assignments) rendered to text, so tools and tests read the assignments, not
the prose. The bottom floor: no imports from the package."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping


def _value(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, tuple)):  # Hydra's list syntax, without spaces (one shell word)
        return "[" + ",".join(_value(x) for x in v) + "]"
    return str(v)


def as_typed(v: Any) -> str:
    """A value as it is typed in an override (null, true, [a,b])."""
    return _value(v)


@dataclass(frozen=True)
class Fix:
    """Alternatives, each a set of overrides applied together, e.g. ({"train.batch_size": 2},
    {"train.batch_size": 1, "train.gradient_accumulation_steps": 4}). `verb`: "set" when the first alternative is
    what the rule wants, "try" when it is a suggestion; `note` follows in words ("(or auto)", "to leave the
    reference")."""

    options: tuple[Mapping[str, Any], ...]
    verb: str = "set"
    note: str = ""

    @classmethod
    def of(cls, *options: Mapping[str, Any], verb: str = "set", note: str = "") -> "Fix":
        return cls(tuple(dict(o) for o in options), verb, note)

    def overrides(self, option: int = 0) -> list[str]:
        """The override strings of one alternative, as a user would type them."""
        return [f"{k}={_value(v)}" for k, v in self.options[option].items()] if self.options else []

    def __str__(self) -> str:
        text = ", or ".join(" ".join(self.overrides(i)) for i in range(len(self.options)))
        text = f"{self.verb} {text}" if text else ""
        return f"{text} {self.note}".strip() if self.note else text


@dataclass(frozen=True)
class Problem:
    key: str
    value: object
    reason: str
    fix: str | Fix = ""

    def __str__(self) -> str:
        value = _value(self.value) if self.value is None or isinstance(self.value, bool) else self.value  # as typed
        text = f"{self.key}={value}: {self.reason}"
        return f"{text} ({self.fix})" if str(self.fix) else text

    def suggested(self) -> list[str]:
        """The first alternative of a data fix as overrides ([] for a fix in words)."""
        return self.fix.overrides() if isinstance(self.fix, Fix) else []


class ConfigError(Exception):
    """The composed config breaks the schema or a rule. Carries every problem found, not just the first."""

    def __init__(self, problems: list[Problem], context: str = ""):
        self.problems = list(problems)
        self.context = context
        super().__init__(self.render())

    def render(self) -> str:
        prefix = f"[{self.context}] " if self.context else ""
        return "\n".join(f"{prefix}{p}" for p in self.problems)
