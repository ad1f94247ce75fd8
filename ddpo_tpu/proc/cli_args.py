"""What the command-line tools (ddpo-status, ddpo-pod) share about their arguments: a bad one is refused in one line
naming it and exit 2 (argparse's usage block stays in --help), and numbers are checked against their range."""

from __future__ import annotations

import argparse

EXIT_BAD_ARGUMENT = 2


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str):
        self.exit(EXIT_BAD_ARGUMENT, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def at_least(lo: float, kind: type = int):
    """An argparse type: a number of `kind` that is >= lo."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if not value >= lo:  # (nan too)
            raise argparse.ArgumentTypeError(f"{text} is below {lo:g}")
        return value

    return parse


def non_empty(text: str) -> str:
    """An argparse type: a name that is not empty or blank (`--tpu=`)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty name")
    return text
