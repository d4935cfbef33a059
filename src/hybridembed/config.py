"""``TableConfig``: what a table is, as frozen, self-validating data."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from . import init as _init
from .errors import ConfigError

__all__ = ["TableConfig", "COMBINERS", "STORAGE_DTYPES"]

COMBINERS = ("sum", "mean", "sqrtn", "none")
STORAGE_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class TableConfig:
    """One embedding table.

    Args:
        name: unique name; the table's rows are ``<name>.weight`` in ``state_dict()``.
        num_embeddings: rows (ids ``0 .. num_embeddings-1``).
        embedding_dim: ``D``, the width of a row.
        combiner: ``sum``, ``mean``, ``sqrtn`` (pooled, output ``(B, D)``) or ``none``
            (sequence: one row per id, output a ``Jagged`` of rows or padded ``(B, T, D)``).
        dtype: storage dtype: float32, float64, or float16/bfloat16 (pooled in float32).
        init: a row-keyed initializer from :mod:`hybridembed.init`; default ``uniform(-0.05, 0.05)``.
        optimizer: a per-table sparse optimizer overriding the one ``wrap_optimizer`` picks.

    >>> import hybridembed as he
    >>> he.TableConfig("user", num_embeddings=1000, embedding_dim=16, combiner="mean")
    TableConfig(name='user', num_embeddings=1000, embedding_dim=16, combiner='mean', dtype=torch.float32, ...)
    """

    name: str
    num_embeddings: int
    embedding_dim: int
    combiner: str = "sum"
    dtype: torch.dtype = torch.float32
    init: _init.Init = field(default_factory=_init.uniform)
    optimizer: Any = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or "." in self.name:
            raise ConfigError(f"table name must be a non-empty string without '.', got {self.name!r}")
        for attr in ("num_embeddings", "embedding_dim"):
            v = getattr(self, attr)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ConfigError(f"table {self.name!r}: {attr} must be a positive int, got {v!r}")
        if self.combiner not in COMBINERS:
            raise ConfigError(
                f"table {self.name!r}: unknown combiner {self.combiner!r}; allowed: {', '.join(COMBINERS)}"
            )
        if self.dtype not in STORAGE_DTYPES:
            allowed = ", ".join(str(d) for d in STORAGE_DTYPES)
            raise ConfigError(f"table {self.name!r}: dtype {self.dtype} not supported; allowed: {allowed}")
        if self.optimizer is not None:
            from .optim.sparse import SparseOptimizer

            if not isinstance(self.optimizer, SparseOptimizer):
                raise ConfigError(
                    f"table {self.name!r}: optimizer must be a he.optim optimizer (e.g. he.optim.Adagrad(lr=0.1)), "
                    f"got {self.optimizer!r}"
                )
        if not isinstance(self.init, _init.Init):
            raise ConfigError(
                f"table {self.name!r}: init must be a hybridembed.init.Init (e.g. he.init.normal(std=0.01)), "
                f"got {type(self.init).__name__}"
            )

    def __repr__(self) -> str:
        return (
            f"TableConfig(name={self.name!r}, num_embeddings={self.num_embeddings}, "
            f"embedding_dim={self.embedding_dim}, combiner={self.combiner!r}, dtype={self.dtype}, ...)"
        )

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype rows are pooled and returned in (float32 for half-precision storage)."""
        return torch.float64 if self.dtype == torch.float64 else torch.float32
