"""The one exception family of hybridembed.

Every error a user can trigger with bad input or configuration is a
:class:`HybridEmbedError`, itself a :class:`ValueError`, so ``except ValueError``
keeps working. Messages name the bad value, what was allowed, and what to do.

A peer of a distributed job that died, stopped or failed is not a bad value: it raises
:class:`RankLost`, a :class:`RuntimeError` (so a loop that skips bad batches with ``except
ValueError`` does not skip past a job that cannot go on).
"""

from __future__ import annotations

__all__ = ["HybridEmbedError", "InvalidInputError", "ConfigError", "CheckpointError", "RankLost"]


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


class RankLost(RuntimeError):
    """Another rank of the job died, stopped, failed or left: this rank cannot go on.

    ``ranks``: the ranks found at fault (empty when none could be told apart). A restart from
    the last committed checkpoint resumes the job."""

    def __init__(self, message: str, ranks=()):
        super().__init__(message)
        self.ranks = sorted(set(ranks))
