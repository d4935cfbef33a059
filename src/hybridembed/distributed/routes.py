"""Routes: how one table's ids find its shards, and its rows come back, one small class per kind.

A :class:`~hybridembed.distributed.plan.Plan` says where each shard of a table lives; the table's
:class:`Route` says how a lookup crosses them. Everything that reads a plan asks the route — the
collective exchange (:class:`~hybridembed.distributed.ShardedCollection`), the parameter servers'
client and server, :func:`assemble` (``gather_table``) and the checkpoints — so nothing else
branches on a sharding kind. A new sharding type is one plan function and one route, registered
together::

    @register_sharding("my_kind", route=MyRoute)     # hybridembed.distributed.plan
    def my_kind(t: TableConfig, ranks) -> TablePlan: ...

Shape legend: ``N`` ids of a request, ``B`` its bags, ``K`` the table's active shards, ``D`` a
shard's width.

    >>> import torch, hybridembed as he
    >>> from hybridembed.distributed.plan import shard_table
    >>> t = he.TableConfig("user", 10, 4)
    >>> route = route_for(shard_table(t, "row_wise", ranks=(0, 1), placement="mod"), t)
    >>> pos, local = route.locate(torch.tensor([0, 1, 2, 7]))
    >>> pos.tolist(), local.tolist()              # shard position, id in the shard's own rows
    ([0, 1, 0, 1], [0, 0, 1, 3])
    >>> route.span(1)
    Span(cols=range(0, 4), rows=range(1, 10, 2), residue=None, residues=None)
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch

from .. import init as _init
from ..config import ShardOf, TableConfig
from ..errors import ConfigError
from ..input import Jagged
from ..input.jagged import bag_index
from .plan import ROUTE_TYPES, Shard, TablePlan

__all__ = ["Route", "Replicated", "Whole", "Columns", "Rows", "Sends", "Span", "route_for", "assemble", "hash_residue"]

_HASH_MASK = (1 << 62) - 1


def hash_residue(ids: torch.Tensor, k: int) -> torch.Tensor:
    """(N,) int64 ids of a dynamic table -> the residue (N,) in ``0..k-1`` of their hash,
    which picks their shard under hash placement (splitmix64, so sequential ids spread)."""
    return (_init.mix64(ids) & _HASH_MASK).remainder_(k)


@dataclass(frozen=True)
class Span:
    """What one shard holds of its whole table: columns ``cols``; and rows ``rows`` (a dense table:
    local row i is global row ``rows[i]``), or the ids whose hash is ``residue`` modulo
    ``residues`` (a dynamic table placed by hash), or every id (a dynamic table otherwise)."""

    cols: range
    rows: range | None = None
    residue: int | None = None
    residues: int | None = None

    def spec(self) -> dict[str, int]:
        """The checkpoint manifest's fields of a shard entry holding this span."""
        out = {"col_start": self.cols.start, "col_end": self.cols.stop}
        if self.rows is not None:
            out.update(row_start=self.rows.start, row_end=self.rows.stop, row_step=self.rows.step)
        elif self.residue is not None:
            out.update(residue=self.residue, residues=self.residues)
        return out


@dataclass
class Sends:
    """What one request sends one shard's owner: bag lengths (B',) (``one``: one id per bag, and
    no lengths cross), ids (N',) in the shard's own id space, per-id weights (N',) or None."""

    lengths: torch.Tensor
    ids: torch.Tensor
    weights: torch.Tensor | None
    one: bool


class Route:
    """One table's route: its active shards (``shards``: (index in the plan, :class:`Shard`), in
    the route's order; an empty row block gets no ids), and the three questions every reader of a
    plan asks: :meth:`split` a request's ids over them, :meth:`combine` their rows back, and the
    :meth:`span` of a shard. ``replicated``: every rank holds the whole table (nothing crosses)."""

    replicated: ClassVar[bool] = False
    slices_columns: ClassVar[bool] = False  # each shard holds some columns of every row
    divides_rows: ClassVar[bool] = False  # each shard holds some rows (a dynamic table's capacity is split)

    def __init__(self, plan: TablePlan, table: TableConfig):
        self.plan, self.table = plan, table
        self.shards: list[tuple[int, Shard]] = list(enumerate(plan.shards))

    def __len__(self) -> int:
        return len(self.shards)

    def local_name(self, pos: int) -> str:
        """The name of shard ``pos``'s table in its owner's collection."""
        return f"{self.table.name}@{self.shards[pos][0]}"

    def local_config(self, pos: int) -> TableConfig:
        """Shard ``pos``'s own table: its rows and columns; pooled by sum (the requester applies the
        combiner's per-id weights: a row shard sees part of each bag)."""
        t, s = self.table, self.shards[pos][1]
        dynamic = t.dynamic
        if dynamic is not None and dynamic.capacity is not None and self.divides_rows and len(self) > 1:
            dynamic = replace(dynamic, capacity=-(-dynamic.capacity // len(self)))
        shard = (
            ShardOf(t.name, 0, 1, s.col_start)
            if dynamic is not None
            else ShardOf(t.name, s.row_start, s.row_step, s.col_start)
        )
        return replace(
            t,
            name=self.local_name(pos),
            num_embeddings=None if dynamic is not None else s.num_rows,
            embedding_dim=s.width,
            combiner="sum",
            dynamic=dynamic,
            shard=shard,
        )

    def span(self, pos: int) -> Span:
        """What shard ``pos`` holds of the whole table."""
        s = self.shards[pos][1]
        return Span(range(s.col_start, s.col_stop), s.rows())

    def locate(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(N,) global ids -> (the position of the shard holding each (N,), its id there (N,))."""
        return torch.zeros_like(ids), ids

    def split(
        self, j: Jagged, ids: torch.Tensor, lengths: torch.Tensor, weights: torch.Tensor | None, one: bool, ones
    ) -> tuple[list[Sends], Any]:
        """A request (its ``ids`` (N,) as int64, bag ``lengths`` (B,), per-id ``weights``, ``one``:
        one id per bag) -> what each active shard is sent, and what :meth:`combine` needs to put the
        rows back. ``ones(n)``: (n,) int64 ones, kept (the bag lengths of n bags of one id)."""
        return [Sends(lengths, ids, weights, one) for _ in self.shards], None

    def combine(self, parts: list[torch.Tensor], back: Any) -> torch.Tensor:
        """Each active shard's rows of the request -> the request's (B, D) rows."""
        return parts[0]


class Replicated(Route):
    """``data_parallel``: every rank holds the whole table, looked up where it is."""

    replicated = True

    def __init__(self, plan: TablePlan, table: TableConfig):
        super().__init__(plan, table)
        self.shards = self.shards[:1]


class Whole(Route):
    """``table_wise``: one rank holds the whole table, under its own name."""

    def local_name(self, pos: int) -> str:
        return self.table.name


class Columns(Route):
    """``column_wise``: column slices, each holding every row; a request's ids go to every slice,
    and the slices' rows are joined."""

    slices_columns = True

    def __init__(self, plan: TablePlan, table: TableConfig):
        super().__init__(plan, table)
        self.shards.sort(key=lambda x: x[1].col_start)

    def locate(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise ConfigError(f"table {self.table.name!r}: a column slice holds every row; no single shard holds an id")

    def combine(self, parts: list[torch.Tensor], back: Any) -> torch.Tensor:
        return torch.cat(parts, 1)


class Rows(Route):
    """``row_wise`` / ``table_row_wise``: rows split over shards, by contiguous blocks, by residue
    (``mod``) or by a hash of the id (``hash``, dynamic tables). Each shard is sent only the bags
    with ids on it, and returns one row per bag: the requester sums a bag's partial rows."""

    divides_rows = True

    def __init__(self, plan: TablePlan, table: TableConfig):
        super().__init__(plan, table)
        self.shards = [(i, s) for i, s in enumerate(plan.shards) if s.num_rows != 0]
        self.placement = plan.placement
        if self.placement in ("mod", "hash"):
            self.k = len(plan.shards)
            to = torch.full((self.k,), -1, dtype=torch.int64)
            for pos, (_, s) in enumerate(self.shards):
                to[s.row_start] = pos
            self.residue_to = to  # residue -> active shard position
        else:
            order = sorted(
                range(len(self.shards)), key=lambda p: (self.shards[p][1].row_start, self.shards[p][1].row_stop)
            )
            self.starts = torch.tensor([self.shards[p][1].row_start for p in order], dtype=torch.int64)
            self.order = torch.tensor(order, dtype=torch.int64)  # ascending start -> active shard position

    def span(self, pos: int) -> Span:
        s = self.shards[pos][1]
        if self.table.dynamic is not None:
            return Span(range(s.col_start, s.col_stop), None, s.row_start, s.row_step)
        return super().span(pos)

    def _on(self, name: str, device: torch.device) -> torch.Tensor:
        """The small lookup tensor ``name`` on ``device`` (copied there once, then kept)."""
        t = getattr(self, name)
        if t.device == device:
            return t
        kept = self.__dict__.setdefault("_kept", {})
        if (name, device) not in kept:
            kept[name, device] = t.to(device)
        return kept[name, device]

    def locate(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.placement in ("hash", "mod"):
            to = self._on("residue_to", ids.device)
            if self.placement == "hash":
                return to.index_select(0, hash_residue(ids, self.k)), ids
            return to.index_select(0, ids.remainder(self.k)), ids.div(self.k, rounding_mode="floor")
        starts = self._on("starts", ids.device)
        pos = torch.searchsorted(starts, ids, right=True).sub_(1)
        return self._on("order", ids.device).index_select(0, pos), ids - starts.index_select(0, pos)

    def split(self, j, ids, lengths, weights, one, ones):
        k, n = len(self.shards), ids.numel()
        where, local = self.locate(ids)
        order = torch.argsort(where, stable=True)
        per_shard = torch.bincount(where, minlength=k).tolist()
        ids_s = local.index_select(0, order).split(per_shard)
        w_s = weights.index_select(0, order).split(per_shard) if weights is not None else [None] * k
        if one:  # one id per bag: each id's row, from its shard, goes back to its position
            return [Sends(ones(c), x, w, True) for c, x, w in zip(per_shard, ids_s, w_s)], (order, None, n)
        b = j.batch_size
        cell = where * b + bag_index(j.offsets, n)
        counts = torch.bincount(cell, minlength=k * b).view(k, b)  # (K, B) ids per shard and bag
        bags_s = [m.nonzero().squeeze(1) for m in counts.ne(0).unbind(0)]  # the bags each shard sees
        sends = [Sends(c.index_select(0, bs), x, w, False) for c, bs, x, w in zip(counts.unbind(0), bags_s, ids_s, w_s)]
        return sends, (bags_s, "bags", b)

    def combine(self, parts: list[torch.Tensor], back: Any) -> torch.Tensor:
        where, how, size = back
        width = parts[0].shape[1]
        x = torch.zeros(size, width, dtype=parts[0].dtype, device=parts[0].device)
        if how is None:  # ids sorted by shard: the rows in that order, scattered back
            return x.index_copy(0, where, torch.cat(parts))
        for bags, p in zip(where, parts):  # bags seen by several shards get each one's partial sum
            x.index_add_(0, bags, p)
        return x


ROUTE_TYPES.update(data_parallel=Replicated, table_wise=Whole, column_wise=Columns, row_wise=Rows, table_row_wise=Rows)


def route_for(plan: TablePlan, table: TableConfig) -> Route:
    """The route of ``table`` placed by ``plan`` (its sharding type's registered route)."""
    kind = ROUTE_TYPES.get(plan.sharding)
    if kind is None:
        raise ConfigError(
            f"table {table.name!r}: sharding type {plan.sharding!r} has no route; register one with "
            "register_sharding(name, route=...)"
        )
    return kind(plan, table)


def assemble(route: Route, pieces: list[tuple[int, torch.Tensor | tuple[torch.Tensor, torch.Tensor]]]):
    """A whole table from its shards' rows, wherever they were read (every rank of a collective job,
    or the parameter servers): ``pieces`` = [(shard position, dense rows (R, D) | dynamic (ids, rows))].
    Returns dense (rows, dim), or dynamic (ids ascending, rows)."""
    t = route.table
    if t.dynamic is None:
        full = torch.zeros(t.num_embeddings, t.embedding_dim, dtype=t.dtype)
        for pos, rows in pieces:
            span = route.span(pos)
            full[span.rows.start : span.rows.stop : span.rows.step, span.cols.start : span.cols.stop] = rows.to(
                full.device
            )
        return full
    by_cols: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for pos, (ids, rows) in pieces:
        by_cols.setdefault(route.span(pos).cols.start, []).append((ids.cpu(), rows.cpu()))
    columns = []
    for c in sorted(by_cols):  # (column slices hold the same ids; row shards, disjoint ones)
        ids = torch.cat([i for i, _ in by_cols[c]])
        rows = torch.cat([r for _, r in by_cols[c]])
        o = torch.argsort(ids)
        columns.append((ids[o], rows[o]))
    if not columns:
        return torch.zeros(0, dtype=torch.int64), torch.zeros(0, t.embedding_dim, dtype=t.dtype)
    return columns[0][0], torch.cat([r for _, r in columns], 1)
