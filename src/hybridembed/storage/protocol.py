"""``Storage``: what the collection, the optimizer, checkpoints and resharding ask of a storage.

Shape legend: ``N`` ids of a group's batch, ``U`` distinct rows, ``K`` rows read or written,
``C`` columns read or written, ``D`` dim.

A storage holds the rows of a group of tables (same dim, dtype and optimizer) and their
optimizer state. Two kinds implement it: :class:`~hybridembed.storage.DenseStorage`
(``keyed=False``: table ``t`` owns a fixed range of row numbers) and
:class:`~hybridembed.storage.HashStorage` (``keyed=True``: ids are keys, any int64, given
rows on first sight). Callers use the members below and the ``keyed`` flag, never the
``kind`` string: ``kind`` ("dense", "dynamic") is data, written into checkpoint manifests.

A lookup goes through three steps: the collection writes each table's ids shifted by
``row_offset[table]`` into one (N,) tensor, :meth:`Storage.resolve` turns them into row
slots (a :class:`LookupPlan`, committed once every group of a call accepted its batch),
and the kernel reads ``weight`` at those slots. The gradient comes back as a sparse
(R, D) tensor: to ``weight.grad`` through autograd, or to ``grad_sink`` when it is set.

    >>> import torch, hybridembed as he
    >>> from hybridembed.storage import Storage
    >>> ec = he.EmbeddingCollection([he.TableConfig("a", 4, 2), he.TableConfig("b", 3, 2)])
    >>> st = ec.storage_of("b")
    >>> isinstance(st, Storage), st.keyed, st.row_offset
    (True, False, {'a': 0, 'b': 4})
    >>> st.read_range("b", 1, 3, col_start=1)["weight"].shape
    torch.Size([2, 1])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = ["Storage", "LookupPlan", "ready_plan"]


@dataclass(frozen=True)
class LookupPlan:
    """A lookup checked but not yet made (see :meth:`Storage.resolve`): ``commit()`` makes it
    and returns ``(slots (N,), grouping)``; ``rollback()`` drops it."""

    commit: Callable[[], tuple[torch.Tensor, tuple | None]]
    rollback: Callable[[], None]


def _nothing() -> None:
    pass


def ready_plan(slots: torch.Tensor) -> LookupPlan:
    """The plan of a lookup that changes nothing: ``commit()`` returns ``(slots, None)``."""
    return LookupPlan(lambda: (slots, None), _nothing)


@runtime_checkable
class Storage(Protocol):
    """The rows of a group of tables and their optimizer state, behind one interface.

    Attributes:
        kind: "dense" or "dynamic": the name written into checkpoint manifests (data; do
            not branch on it, use ``keyed``).
        keyed: ids are keys (any int64; rows made on first sight, read back by id with
            :meth:`read_ids`); else ids are row numbers in ``[0, num_embeddings)`` and a
            table's rows are read by range with :meth:`read_range`.
        tables: the :class:`~hybridembed.TableConfig` of each table, in group order.
        dim, dtype, compute_dtype: the rows' dim and dtype, and the dtype of updates and
            optimizer state.
        weight: the (R, D) ``nn.Parameter`` the lookup kernel reads at resolved slots.
        state: the optimizer's per-row tensors, ``{name: (R,) or (R, D)}``.
        optimizer, step: the attached sparse optimizer and its step count.
        row_offset: ``{table: int}`` added to a table's ids before :meth:`resolve` (a dense
            table's first row in ``weight``; 0 for keyed tables).
        table_index: ``{table: int}``, the table's position in ``tables``.
        grad_sink: where the lookup kernel hands the gradient (see
            :func:`hybridembed.kernels.pooled_lookup`): None for autograd's accumulation
            into ``weight.grad``, or :meth:`accumulate_grad` for a matrix that may grow
            between forward and backward.
        remote: the rows live elsewhere (a parameter-server trainer's storage holds only the
            rows of its current step): no state of its own to save, no update applied here.
    """

    kind: str
    keyed: bool
    remote: bool
    tables: list
    dim: int
    dtype: torch.dtype
    compute_dtype: torch.dtype
    weight: torch.Tensor
    state: dict[str, torch.Tensor]
    optimizer: Any
    step: int
    row_offset: dict[str, int]
    table_index: dict[str, int]
    grad_sink: Callable[..., None] | None

    # --- the lookup ----------------------------------------------------------------------
    def resolve(self, ids: torch.Tensor, tables: Sequence[int], counts: Sequence[int], train: bool) -> LookupPlan:
        """Plans the lookup of ``ids`` (N,) int64: the first ``counts[0]`` ids are of table
        ``tables[0]`` (a ``table_index``), the next ``counts[1]`` of ``tables[1]``, and so on,
        each shifted by its table's ``row_offset``. Raises :class:`HybridEmbedError` before any
        change if the batch cannot be taken (a keyed table over capacity). ``plan.commit()``
        returns ``(slots (N,), grouping or None)``: the rows of ``weight`` to read (int64 or
        int32), and a grouping the kernel's backward may use instead of sorting (see
        :meth:`HashStorage.lookup`). Dense ids are bounds-checked by the caller and are their
        own slots. ``train``: keyed storages make rows for new ids and count the sightings."""
        ...

    def read_rows(self, slots: torch.Tensor) -> torch.Tensor:
        """(K,) slots (from :meth:`resolve`) -> (K, D) copies of their rows, without autograd."""
        ...

    # --- gradients and the optimizer ----------------------------------------------------
    def accumulate_grad(self, grad: torch.Tensor, distinct: bool = False) -> None:
        """Adds a lookup's sparse gradient (R, D) to ``weight.grad``; ``distinct``: its row
        ids are distinct (summed per row already)."""
        ...

    def grad_rows(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The pending gradient as (distinct row slots (U,), summed rows (U, D)); None if none."""
        ...

    def attach_optimizer(self, optimizer: Any, hparams: dict) -> None:
        """Allocates ``optimizer``'s per-row state beside the rows; resets the step."""
        ...

    def apply_gradient(
        self, ids: torch.Tensor, grad: torch.Tensor, hparams: dict, row_stat: torch.Tensor | None = None
    ) -> None:
        """One optimizer step on row slots ``ids`` (U,) distinct, with summed gradient ``grad`` (U, D);
        ``row_stat`` (U,): a row-wise optimizer's statistic of the whole row when these are column slices."""
        ...

    def apply_parts(self, parts: Any, hparams: dict) -> None:
        """One optimizer step from several parts' reduced gradients not yet summed
        (:class:`~hybridembed.optim.hooks.RowParts`: each row's parts summed in order, divided by its
        ``divisor``), as :meth:`apply_gradient` would apply their sums."""
        ...

    def after_step(self) -> None:
        """Called by the optimizer after every step, whether or not this storage had a gradient."""
        ...

    # --- one table's rows and optimizer state -------------------------------------------
    def table_ids(self, name: str) -> torch.Tensor | None:
        """Ids ascending (K,) of the rows keyed table ``name`` holds; None for a dense table (row r is id r)."""
        ...

    def table_state(self, name: str) -> dict[str, torch.Tensor]:
        """Table ``name``'s rows of each optimizer state tensor (dense: views; keyed: copies, in
        :meth:`table_ids` order)."""
        ...

    def load_table_state(self, name: str, ids: torch.Tensor | None, state: dict[str, torch.Tensor]) -> None:
        """Writes optimizer state as :meth:`table_state` returns it: of rows ``ids`` (keyed;
        they must be held) or of all the table's rows (dense, ``ids`` None)."""
        ...

    def read_range(
        self, table: str, row_start: int, row_stop: int, col_start: int = 0, col_stop: int | None = None
    ) -> dict[str, torch.Tensor]:
        """Copies of rows ``[row_start, row_stop)`` and columns ``[col_start, col_stop)`` of a
        dense table: ``{"weight": (K, C), state name: (K, C) per-element or (K,) row-wise}``.
        Keyed tables refuse (read them by id with :meth:`read_ids`)."""
        ...

    def write_range(self, table: str, row_start: int, data: dict[str, torch.Tensor], col_start: int = 0) -> None:
        """Writes ``data`` (as :meth:`read_range` returns it, any subset of its keys) at rows
        ``[row_start, row_start + K)`` and columns ``[col_start, col_start + C)`` of a dense
        table; everything is checked before anything is written."""
        ...

    def read_ids(self, table: str) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """The table's rows by id: (ids ascending (K,), rows (K, D), ``{state name: (K, D) or (K,)}``),
        copies. A dense table's ids are ``0..num_embeddings-1``."""
        ...

    def write_ids(
        self, table: str, ids: torch.Tensor, rows: torch.Tensor, state: dict[str, torch.Tensor] | None = None
    ) -> None:
        """Sets rows ``rows`` (K, D) (and optimizer state, as :meth:`read_ids` returns it) of
        distinct ``ids`` (K,); a keyed table makes rows for ids it does not hold (never
        evicting: they must fit its capacity), other rows are left as they are. Checked
        before anything is written."""
        ...

    # --- inspection ----------------------------------------------------------------------
    def stats(self, table: str | None = None) -> dict[str, Any]:
        """``{"rows": rows held, "memory_bytes": bytes of rows and optimizer state, ...}`` of one
        table or (None) the whole storage; keyed storages add their counters (inserted,
        evicted, rejected, hits, lookups, hit_rate) and capacity."""
        ...

    @property
    def memory_bytes(self) -> int:
        """Bytes of rows and optimizer state."""
        ...
