"""The error of a config that can't be used (its own module: the checks and the roles section both raise it)."""

from __future__ import annotations

from collections.abc import Sequence


class ConfigError(ValueError):
    """A config that can't be used; the message names the key, the value and what to do. `problems` holds each
    problem found (one, or several when the reading or the checks went on past the first: `harness train --check`
    lists them all); the message is them joined, one a line."""

    def __init__(self, message: str | Sequence[str]):
        self.problems = [message] if isinstance(message, str) else list(message)
        super().__init__("\n".join(self.problems))


def raise_all(problems: Sequence[str]) -> None:
    """Raise one ConfigError holding every problem in `problems`, when there is any."""
    if problems:
        raise ConfigError(problems)
