"""Config errors reported all at once: one ConfigError (a ValueError, exit 2) with a line each."""
from __future__ import annotations


class ConfigError(ValueError):
    """Several config errors at once: the message holds one line per error."""

    def __init__(self, errors: list[str]):
        super().__init__("\n".join(errors))
        self.errors = errors


def raise_all(errors: list[Exception]) -> None:
    """Nothing when `errors` is empty; the error itself when there is one (its type kept);
    else one ConfigError listing them all."""
    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise ConfigError([str(e) for e in errors])
