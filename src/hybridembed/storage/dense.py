"""``DenseStorage``: the rows of a group of fixed-size tables in one matrix.

Table ``t`` of the group owns rows ``[row_offset[t], row_offset[t] + num_embeddings[t])``
of ``weight`` (R, D). Optimizer state tensors, when an optimizer adds them, are kept in
``state`` beside the rows with the same leading dimension R, so they move with the rows.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from .. import init as _init
from ..config import TableConfig
from ..errors import HybridEmbedError
from ..utils import advise_huge_pages
from .base import RowStorage, _is_int
from .protocol import LookupPlan, ready_plan

__all__ = ["DenseStorage"]


_ROWS_FROM_CALLER: contextvars.ContextVar[bool] = contextvars.ContextVar("rows_from_caller", default=False)


@contextlib.contextmanager
def rows_from_caller():
    """Dense storages made inside leave their rows unwritten (``torch.empty``: no page touched):
    the caller writes every row next (``he.convert`` copies the layers' weights in, table by
    table, freeing each as it goes, so the rows are never held twice)."""
    token = _ROWS_FROM_CALLER.set(True)
    try:
        yield
    finally:
        _ROWS_FROM_CALLER.reset(token)


class DenseStorage(RowStorage):
    """Rows of several tables of one dim and dtype: ``weight`` (R, D), one ``nn.Parameter``."""

    kind = "dense"

    def __init__(self, tables: Sequence[TableConfig], seed: int = 0, device: torch.device | str | None = None):
        super().__init__()
        offsets, total = self._lay_out(tables)
        weight = torch.empty(total, self.dim, dtype=self.dtype, device=device)
        advise_huge_pages(weight)  # before the first write, so the pages fault in huge
        if weight.device.type != "meta" and not _ROWS_FROM_CALLER.get():  # (meta: no rows to fill)
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

    def _lay_out(self, tables: Sequence[TableConfig]) -> tuple[dict[str, int], int]:
        """The group's tables one after the other: sets ``tables``, ``dim``, ``dtype``,
        ``compute_dtype``, ``row_offset``, ``table_index``, ``num_rows``; returns (offsets, rows)."""
        self.tables = list(tables)
        self.dim = self.tables[0].embedding_dim
        self.dtype = self.tables[0].dtype
        self.compute_dtype = self.tables[0].compute_dtype  # of updates and optimizer state
        offsets, total = {}, 0
        for t in self.tables:
            offsets[t.name] = total
            total += t.num_embeddings
        self.row_offset: dict[str, int] = offsets
        self.table_index = {t.name: i for i, t in enumerate(self.tables)}
        self.num_rows = total
        return offsets, total

    def resolve(self, ids: torch.Tensor, tables: Sequence[int], counts: Sequence[int], train: bool) -> LookupPlan:
        """Ids shifted by their table's ``row_offset`` (and bounds-checked by the caller) are
        their own row slots: a plan that changes nothing (see :meth:`Storage.resolve`)."""
        return ready_plan(ids)

    # --- per-table views -------------------------------------------------------------------
    def _span(self, name: str) -> tuple[int, int]:
        """(first row in ``weight``, rows) of table ``name``."""
        t = self._table(name)
        return self.row_offset[t.name], t.num_embeddings

    def _rows_of(self, name: str) -> tuple[int, int]:
        """(first, last + 1) row of table ``name`` in ``weight``."""
        start, n = self._span(name)
        return start, start + n

    def table_ids(self, name: str) -> None:
        """None: a dense table's row r is id r."""
        self._table(name)
        return None

    def table_state(self, name: str) -> dict[str, torch.Tensor]:
        """Views of table ``name``'s rows of each optimizer state tensor."""
        start, n = self._span(name)
        return {k: v[start : start + n] for k, v in self.state.items()}

    @torch.no_grad()
    def load_table_state(self, name: str, ids: torch.Tensor | None, state: dict[str, torch.Tensor]) -> None:
        """Copies ``state`` (each of the table's shape, as :meth:`table_state`) into table ``name``'s
        optimizer state; ``ids`` is unused (a dense table's state covers all its rows)."""
        for k, v in self.table_state(name).items():
            v.copy_(state[k])
        self._mark_span(*self._rows_of(name))

    def changed_rows(self, name: str, changed: torch.Tensor) -> torch.Tensor:
        """Rows (K,) of table ``name`` (its own row numbers, ascending) marked in ``changed``
        (the storage's (R,) mask of rows changed since a checkpoint, see :meth:`track_changes`)."""
        start, n = self._span(name)
        return changed[start : start + n].nonzero().squeeze(1)

    def table_rows(self, name: str) -> torch.Tensor:
        """(num_embeddings, D) view of table ``name``'s rows (shares memory)."""
        start, n = self._span(name)
        return self.weight.detach()[start : start + n]

    def _check_range(self, name: str, rows: tuple[int, int], cols: tuple[int, int]) -> None:
        n = self._table(name).num_embeddings
        for what, (a, b), limit in (("rows", rows, n), ("columns", cols, self.dim)):
            if not (_is_int(a) and _is_int(b)):
                raise HybridEmbedError(f"table {name!r}: {what} [{a!r}, {b!r}): bounds must be ints")
            if not 0 <= a <= b <= limit:
                raise HybridEmbedError(
                    f"table {name!r}: {what} [{a}, {b}) are outside the table's {what} [0, {limit}); "
                    f"give a range with 0 <= start <= stop <= {limit}"
                )

    def read_range(
        self, table: str, row_start: int, row_stop: int, col_start: int = 0, col_stop: int | None = None
    ) -> dict[str, torch.Tensor]:
        """Copies of rows ``[row_start, row_stop)``, columns ``[col_start, col_stop)`` (default: to
        D) of ``table``: ``{"weight": (K, C), state: (K, C) per-element or (K,) row-wise}``."""
        col_stop = self.dim if col_stop is None else col_stop
        self._check_range(table, (row_start, row_stop), (col_start, col_stop))
        a, b = self.row_offset[table] + row_start, self.row_offset[table] + row_stop
        out = {"weight": self.weight.detach()[a:b, col_start:col_stop].clone()}
        for k, v in self.state.items():
            out[k] = (v[a:b, col_start:col_stop] if v.dim() > 1 else v[a:b]).clone()
        return out

    def read_table_rows(self, table: str, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """Copies of ``table``'s rows ``rows`` (K,) (its own row numbers, in range): ``{"weight":
        (K, D), state: (K, D) or (K,)}`` (an incremental checkpoint's changed rows)."""
        at = rows.to(torch.int64) + self.row_offset[table]
        return {
            "weight": self.weight.detach().index_select(0, at),
            **{k: v.index_select(0, at) for k, v in self.state.items()},
        }

    @torch.no_grad()
    def write_range(self, table: str, row_start: int, data: dict[str, torch.Tensor], col_start: int = 0) -> None:
        """Writes ``data`` (as :meth:`read_range` returns it, any subset of its keys) at rows
        ``[row_start, row_start + K)``, columns ``[col_start, col_start + C)`` of ``table``;
        checked before anything is written."""
        k, cols = self._checked_write(table, row_start, data, col_start)
        a = self.row_offset[table] + row_start
        for name, v in data.items():
            dst = self.weight.detach() if name == "weight" else self.state[name]
            dst = dst[a : a + k, col_start : col_start + cols] if dst.dim() > 1 else dst[a : a + k]
            dst.copy_(v)
        self._mark_span(a, a + k)

    def _checked_write(self, table: str, row_start: int, data: dict, col_start: int) -> tuple[int, int]:
        """:meth:`write_range`'s checks: (rows K, columns C) of ``data``."""
        self._table(table)
        k, cols = self._check_rows_data(table, data)
        if not (_is_int(row_start) and _is_int(col_start)):
            raise HybridEmbedError(f"table {table!r}: row_start and col_start must be ints")
        self._check_range(table, (row_start, row_start + k), (col_start, col_start + cols))
        return k, cols

    def read_ids(self, table: str) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """(ids ``0..R-1`` (R,), rows (R, D), ``{state: (R, D) or (R,)}``) of ``table``, copies."""
        _, n = self._span(table)
        data = self.read_range(table, 0, n)
        return torch.arange(n, device=self.weight.device), data.pop("weight"), data

    @torch.no_grad()
    def write_ids(
        self, table: str, ids: torch.Tensor, rows: torch.Tensor, state: dict[str, torch.Tensor] | None = None
    ) -> None:
        """Sets rows ``ids`` (K,) distinct, in ``[0, num_embeddings)``, of ``table`` to ``rows`` (K, D)
        (and their optimizer state to ``state``); checked before anything is written."""
        slots, data = self._checked_ids(table, ids, rows, state)
        for name, v in data.items():
            dst = self.weight.detach() if name == "weight" else self.state[name]
            dst.index_copy_(0, slots, v.to(dst))
        self._mark(slots)

    def _checked_ids(self, table: str, ids, rows, state) -> tuple[torch.Tensor, dict]:
        """:meth:`write_ids`'s checks: (the ids' rows in the group (K,), the data by name)."""
        start, n = self._span(table)
        ids, data = self._check_ids_data(table, ids, rows, state)
        if ids.numel():
            lo, hi = torch.stack(torch.aminmax(ids)).tolist()
            if lo < 0 or hi >= n:
                bad = lo if lo < 0 else hi
                raise HybridEmbedError(
                    f"table {table!r}: id {bad} is outside the table's rows [0, {n}); a dense table has no other ids"
                )
        return ids + start, data

    def stats(self, table: str | None = None) -> dict[str, Any]:
        """``{"rows", "memory_bytes"}`` of ``table`` or (None) of the whole storage."""
        if table is None:
            return {"rows": self.num_rows, "memory_bytes": self.memory_bytes}
        _, n = self._span(table)
        return {"rows": n, "memory_bytes": n * self._row_bytes()}

    def extra_repr(self) -> str:
        names = ", ".join(t.name for t in self.tables)
        return f"rows={self.num_rows}, dim={self.dim}, dtype={self.dtype}, tables=[{names}]"
