"""``SparseStepHook``: a module's declared part in :meth:`HybridOptimizer.step`.

A sharded collection all-reduces its replicated tables' row gradients and completes column
slices' row statistics before the update; a parameter-server trainer pushes its rows' gradients
instead of applying them. Such a module subclasses :class:`SparseStepHook` (found by
``isinstance``) and *declares* which storages it needs materialised as :class:`RowGrads`
(:meth:`needs_rows`) and the scale of the others' gradients (:meth:`grad_scale`): every other
storage keeps the fused update (duplicates reduced and rows updated in one pass), so a sharded
table's shards train as fast as one process's tables.

Called on every rank of a job, in the same order, each step (collectives may run inside).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["RowGrads", "SparseStepHook"]


@dataclass
class RowGrads:
    """A storage's pending gradient, reduced: distinct row slots ``ids`` (U,), their summed
    gradients ``rows`` (U, D), and for a row-wise optimizer over a column slice each row's
    statistic of the whole row (``row_stat`` (U,); None: computed from ``rows``)."""

    ids: torch.Tensor
    rows: torch.Tensor
    row_stat: torch.Tensor | None = None


class SparseStepHook:
    """A module's part in the optimizer step (see the module docstring)."""

    def needs_rows(self, storage) -> bool:
        """Whether :meth:`before_sparse_step` must see ``storage``'s gradient as :class:`RowGrads`
        (False: it may be applied fused, scaled by :meth:`grad_scale`)."""
        return False

    def grad_scale(self, storage) -> float:
        """The factor of ``storage``'s gradient when it is applied without this hook's help."""
        return 1.0

    def before_sparse_step(self, storages: list, rows: list[RowGrads | None]) -> list[RowGrads | None]:
        """Every storage's :class:`RowGrads` (None: none pending, or applied fused) -> the same, as the
        update must see them."""
        return rows
