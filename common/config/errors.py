"""The one error type of a user's configuration (exit code 2 at the CLI)."""

from __future__ import annotations


class ConfigError(Exception):
    """A user's configuration is wrong; the message says which setting and how to fix it.

    Deliberately not a ``ValueError``: pydantic would wrap a ``ValueError`` raised by the
    cross-field rules into its own error list and lose the explanation's paragraph shape.
    """
