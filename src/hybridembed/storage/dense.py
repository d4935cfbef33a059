"""``DenseStorage``: the rows of a group of fixed-size tables in one matrix.

Table ``t`` of the group owns rows ``[row_offset[t], row_offset[t] + num_embeddings[t])``
of ``weight`` (R, D). Optimizer state tensors, when an optimizer adds them, are kept in
``state`` beside the rows with the same leading dimension R, so they move with the rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .. import init as _init
from ..config import TableConfig
from ..utils import advise_huge_pages
from .base import RowStorage

__all__ = ["DenseStorage"]


class DenseStorage(RowStorage):
    """Rows of several tables of one dim and dtype: ``weight`` (R, D), one ``nn.Parameter``."""

    kind = "dense"

    def __init__(self, tables: Sequence[TableConfig], seed: int = 0, device: torch.device | str | None = None):
        super().__init__()
        self.tables = list(tables)
        self.dim = self.tables[0].embedding_dim
        self.dtype = self.tables[0].dtype
        self.compute_dtype = self.tables[0].compute_dtype  # of updates and optimizer state
        offsets, total = {}, 0
        for t in self.tables:
            offsets[t.name] = total
            total += t.num_embeddings
        self.row_offset: dict[str, int] = offsets
        self.num_rows = total
        weight = torch.empty(total, self.dim, dtype=self.dtype, device=device)
        advise_huge_pages(weight)  # before the first write, so the pages fault in huge
        with torch.no_grad():
            for t in self.tables:
                rows = torch.arange(t.num_embeddings, device=weight.device)
                if t.shard is not None:  # the whole table's rows this shard holds
                    rows = rows.mul_(t.shard.row_step).add_(t.shard.row_start)
                _init.generate(
                    t.init,
                    seed,
                    t.init_name,
                    rows,
                    self.dim,
                    out=weight[offsets[t.name] : offsets[t.name] + t.num_embeddings],
                    col_start=t.col_start,
                )
        self.weight = nn.Parameter(weight)

    def table_state(self, name: str) -> dict[str, torch.Tensor]:
        """Views of table ``name``'s rows of each optimizer state tensor."""
        start = self.row_offset[name]
        n = next(t.num_embeddings for t in self.tables if t.name == name)
        return {k: v[start : start + n] for k, v in self.state.items()}

    def table_rows(self, name: str) -> torch.Tensor:
        """(num_embeddings, D) view of table ``name``'s rows (shares memory)."""
        start = self.row_offset[name]
        n = next(t.num_embeddings for t in self.tables if t.name == name)
        return self.weight.detach()[start : start + n]

    def extra_repr(self) -> str:
        names = ", ".join(t.name for t in self.tables)
        return f"rows={self.num_rows}, dim={self.dim}, dtype={self.dtype}, tables=[{names}]"
