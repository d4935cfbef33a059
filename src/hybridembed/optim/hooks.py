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

__all__ = ["RowGrads", "RowParts", "SparseStepHook"]


@dataclass
class RowGrads:
    """A storage's pending gradient, reduced: distinct row slots ``ids`` (U,), their summed
    gradients ``rows`` (U, D), and for a row-wise optimizer over a column slice each row's
    statistic of the whole row (``row_stat`` (U,); None: computed from ``rows``)."""

    ids: torch.Tensor
    rows: torch.Tensor
    row_stat: torch.Tensor | None = None


@dataclass
class RowParts:
    """A storage's pending gradient as several parts' reduced gradients not yet summed (a replicated
    table's, one part per rank, in rank order): per part distinct row slots ``ids[k]`` (U_k,) and
    their summed gradients ``rows[k]`` (U_k, D). The gradient is each row's parts summed in order,
    then divided by ``divisor``; the update may read them where they lie (a peer's shared memory:
    valid until this rank's next call on its transport) instead of writing the sums first
    (:meth:`RowStorage.apply_parts`)."""

    ids: list[torch.Tensor]
    rows: list[torch.Tensor]
    divisor: float = 1.0

    def own(self) -> None:
        """Every part copied: views of memory that is about to be reused become this rank's own."""
        self.ids = [x.clone() for x in self.ids]
        self.rows = [x.clone() for x in self.rows]

    def summed(self, dtype: torch.dtype, compute_dtype: torch.dtype, nrows: int | None = None) -> RowGrads | None:
        """The sums as :class:`RowGrads` (ids ascending; rows summed in ``compute_dtype``, returned in
        ``dtype``), the same bits on every rank given the same parts; None where no part has a row.
        ``nrows``: the rows the ids are in (for the fused step's reduction where the parts' ids are
        not ascending)."""
        from ..kernels import cpu_fused

        sizes = [x.numel() for x in self.ids]
        if not any(sizes):
            return None
        cpu = self.ids[0].device.type == "cpu"
        merged = cpu_fused.merge_rows(self.ids, self.rows, self.divisor) if cpu else None
        if merged is not None:  # (each part's ids ascending, as the fused step's reduction leaves them: one merge)
            return RowGrads(merged[0], merged[1].to(dtype))
        if cpu and nrows is not None and cpu_fused.available():  # (each row's rows in the parts' order)
            ids = torch.cat([x.to(torch.int64) for x in self.ids])
            touched, grad = cpu_fused.reduce_kept(
                ids, torch.cat([r.to(compute_dtype) for r in self.rows]), None, None, nrows
            )
        else:
            touched, where = torch.unique(torch.cat(self.ids), return_inverse=True)
            grad = torch.zeros(touched.numel(), self.rows[0].shape[1], dtype=compute_dtype, device=touched.device)
            for at, g in zip(where.split(sizes), self.rows):  # (in order)
                if g.shape[0]:
                    grad.index_add_(0, at, g.to(compute_dtype))
        if self.divisor != 1:
            grad.div_(self.divisor)
        return RowGrads(touched, grad.to(dtype))


class SparseStepHook:
    """A module's part in the optimizer step (see the module docstring)."""

    def needs_rows(self, storage) -> bool:
        """Whether :meth:`before_sparse_step` must see ``storage``'s gradient as :class:`RowGrads`
        (False: it may be applied fused, scaled by :meth:`grad_scale`)."""
        return False

    def grad_scale(self, storage) -> float:
        """The factor of ``storage``'s gradient when it is applied without this hook's help."""
        return 1.0

    def before_sparse_step(self, storages: list, rows: list[RowGrads | None]) -> list[RowGrads | RowParts | None]:
        """Every storage's :class:`RowGrads` (None: none pending, or applied fused) -> the same, as the
        update must see them (or as :class:`RowParts`: summed as the update reads them)."""
        return rows
