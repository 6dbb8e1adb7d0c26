"""The one configuration error type (floor 0: every floor may raise it)."""

from __future__ import annotations


class ConfigError(ValueError):
    """A user configuration problem; ``str(err)`` is one line naming the key."""

    def __init__(self, message: str, key: str | None = None):
        super().__init__(message)
        self.key = key
