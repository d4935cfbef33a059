"""The one exception family of hybridembed.

Every error a user can trigger with bad input or configuration is a
:class:`HybridEmbedError`, itself a :class:`ValueError`, so ``except ValueError``
keeps working. Messages name the bad value, what was allowed, and what to do.
"""

from __future__ import annotations

__all__ = ["HybridEmbedError", "InvalidInputError", "ConfigError", "CheckpointError"]


class HybridEmbedError(ValueError):
    """Base class of every error hybridembed raises on purpose."""


class InvalidInputError(HybridEmbedError):
    """Sparse input that cannot be looked up: bad ids, offsets, weights or dtypes.

    Raised before any row is read or written, so a table is never left half-updated.
    ``feature`` and ``position`` say where the first problem is (``None`` when unknown).
    """

    def __init__(self, message: str, feature: str | None = None, position: int | None = None):
        super().__init__(message)
        self.feature = feature
        self.position = position


class ConfigError(HybridEmbedError):
    """A table, feature or optimizer configuration that cannot be built."""


class CheckpointError(HybridEmbedError):
    """A checkpoint that is missing, truncated, corrupt or does not match the model."""
