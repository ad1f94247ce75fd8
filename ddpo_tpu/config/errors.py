"""One problem per line: the dotted key, its value, the reason and a fix."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    key: str
    value: object
    reason: str
    fix: str = ""

    def __str__(self) -> str:
        value = "null" if self.value is None else self.value
        text = f"{self.key}={value}: {self.reason}"
        return f"{text} ({self.fix})" if self.fix else text


class ConfigError(Exception):
    """The composed config breaks the schema or a rule. Carries every problem found, not just the first."""

    def __init__(self, problems: list[Problem], context: str = ""):
        self.problems = list(problems)
        self.context = context
        super().__init__(self.render())

    def render(self) -> str:
        prefix = f"[{self.context}] " if self.context else ""
        return "\n".join(f"{prefix}{p}" for p in self.problems)
