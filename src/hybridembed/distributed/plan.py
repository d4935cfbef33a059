"""``Plan``: which rows and columns of which table live on which rank, as frozen data.

A plan never touches a tensor: it is made, checked, printed and saved on a laptop for a job
of 128 GPUs. Each table has one :class:`TablePlan`: a sharding type and its shards; a
:class:`Shard` is a rank and the part of the table it holds.

Sharding types (``SHARDING_TYPES``, plain functions ``(table, ranks, **options) -> shards``):

- ``data_parallel``: every rank holds the whole table; gradients are all-reduced (small tables).
- ``table_wise``: one rank holds the whole table.
- ``column_wise``: column slices on different ranks (each slice every row).
- ``row_wise``: rows split over ranks, in contiguous blocks (``placement="block"``) or by
  residue (``"mod"``: row ``r`` on shard ``r % k``, as SOK and OpenEmbedding); a dynamic
  table by a hash of the id (``"hash"``).
- ``table_row_wise``: ``row_wise`` inside a subgroup of ranks (a node).

    >>> import hybridembed as he
    >>> from hybridembed.distributed.plan import Plan, TablePlan, shard_table
    >>> t = he.TableConfig("user", 10, 8)
    >>> tp = shard_table(t, "row_wise", ranks=(0, 1), placement="mod")
    >>> [(s.rank, s.rows()) for s in tp.shards]
    [(0, range(0, 10, 2)), (1, range(1, 10, 2))]
    >>> Plan.from_json(Plan(2, (tp,)).to_json()) == Plan(2, (tp,))
    True
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from ..config import TableConfig
from ..errors import ConfigError

__all__ = [
    "Shard",
    "TablePlan",
    "Plan",
    "SHARDING_TYPES",
    "PLACEMENTS",
    "shard_table",
    "register_sharding",
    "ROUTE_TYPES",
]

PLACEMENTS = ("block", "mod", "hash")


@dataclass(frozen=True)
class Shard:
    """One piece of a table on one rank.

    Rows: a dense table's rows ``row_start, row_start + row_step, ... < row_stop`` (a block
    has step 1; modulo placement over k shards has ``row_start`` = the residue and step k);
    a hash-placed dynamic table's ids whose hash is ``row_start`` modulo ``row_step``.
    Columns: ``col_start .. col_stop - 1``.
    """

    rank: int
    row_start: int
    row_stop: int | None  # None: a dynamic table (no fixed rows)
    row_step: int
    col_start: int
    col_stop: int

    @property
    def width(self) -> int:
        """The columns this shard holds."""
        return self.col_stop - self.col_start

    def rows(self) -> range | None:
        """The whole table's rows this shard holds (None for a dynamic table)."""
        if self.row_stop is None:
            return None
        return range(self.row_start, self.row_stop, self.row_step)

    @property
    def num_rows(self) -> int | None:
        """The rows this shard holds (None for a dynamic table: any id)."""
        r = self.rows()
        return None if r is None else len(r)


@dataclass(frozen=True)
class TablePlan:
    """A table's sharding type, placement (row-wise: block, mod or hash) and shards."""

    table: str
    sharding: str
    shards: tuple[Shard, ...]
    placement: str | None = None

    @property
    def ranks(self) -> tuple[int, ...]:
        """The ranks holding a shard of the table, ascending."""
        return tuple(s.rank for s in self.shards)

    @property
    def partitioned(self) -> str:
        """How the shards split the table: ``"none"`` (each holds it whole), ``"rows"`` or ``"columns"``."""
        if self.sharding in ("data_parallel", "table_wise"):
            return "none"
        return "columns" if self.sharding == "column_wise" else "rows"


@dataclass(frozen=True)
class Plan:
    """A whole job's placement: ``world_size`` and one :class:`TablePlan` per table.

    ``strategy`` and ``notes`` record how it was made (informational). ``to_json`` /
    ``from_json`` round-trip it exactly.
    """

    world_size: int
    tables: tuple[TablePlan, ...]
    strategy: str = "manual"
    notes: Mapping[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or self.world_size < 1:
            raise ConfigError(f"Plan: world_size must be a positive int, got {self.world_size!r}")
        names = [t.table for t in self.tables]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ConfigError(f"Plan: tables planned twice: {', '.join(dup)}")

    def table(self, name: str) -> TablePlan:
        """The table's :class:`TablePlan` (a ConfigError names the tables when it has none)."""
        for t in self.tables:
            if t.table == name:
                return t
        raise ConfigError(f"the plan has no table {name!r}; it plans: {', '.join(t.table for t in self.tables)}")

    def shards_on(self, rank: int) -> list[tuple[TablePlan, int]]:
        """(table plan, shard index) of every shard ``rank`` holds."""
        return [(t, i) for t in self.tables for i, s in enumerate(t.shards) if s.rank == rank]

    # --- JSON ------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The plan as plain data (JSON-able)."""
        return {
            "world_size": self.world_size,
            "strategy": self.strategy,
            "notes": dict(self.notes),
            "tables": [
                {
                    "table": t.table,
                    "sharding": t.sharding,
                    "placement": t.placement,
                    "shards": [asdict(s) for s in t.shards],
                }
                for t in self.tables
            ],
        }

    def to_json(self, indent: int | None = None) -> str:
        """The plan as JSON (:meth:`from_json` reads it back)."""
        return json.dumps(self.to_dict(), indent=indent, sort_keys=True)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Plan:
        """A plan from :meth:`to_dict`'s data, checked."""
        try:
            tables = tuple(
                TablePlan(
                    table=str(t["table"]),
                    sharding=str(t["sharding"]),
                    placement=t.get("placement"),
                    shards=tuple(Shard(**{k: s[k] for k in _SHARD_FIELDS}) for s in t["shards"]),
                )
                for t in d["tables"]
            )
            # world_size as stored: Plan checks it is an int (2.7 or "2" are not silently made 2)
            return cls(d["world_size"], tables, str(d.get("strategy", "manual")), dict(d.get("notes", {})))
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"not a hybridembed plan: {type(e).__name__}: {e}") from None

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """A plan from :meth:`to_json`'s text, checked."""
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"plan JSON does not parse: {e}") from None
        if not isinstance(d, dict):
            raise ConfigError("plan JSON must be an object")
        return cls.from_dict(d)

    # --- checks ------------------------------------------------------------------------------
    def check(self, tables: Sequence[TableConfig] | Mapping[str, TableConfig]) -> None:
        """Raise a :class:`ConfigError` naming the first problem of this plan for ``tables``:
        a table unplanned or unknown, a rank out of range, shards that overlap or miss rows
        or columns, a sharding type a table cannot take (data-parallel dynamic tables)."""
        by_name = dict(tables) if isinstance(tables, Mapping) else {t.name: t for t in tables}
        planned = {t.table for t in self.tables}
        unknown = sorted(planned - set(by_name))
        if unknown:
            raise ConfigError(f"the plan names unknown table {unknown[0]!r}; the model's tables: {', '.join(by_name)}")
        missing = [n for n in by_name if n not in planned]
        if missing:
            raise ConfigError(f"the plan does not place table {missing[0]!r}")
        for tp in self.tables:
            _check_table_plan(tp, by_name[tp.table], self.world_size)


_SHARD_FIELDS = ("rank", "row_start", "row_stop", "row_step", "col_start", "col_stop")


def _check_table_plan(tp: TablePlan, t: TableConfig, world_size: int) -> None:
    name = tp.table
    if tp.sharding not in SHARDING_TYPES:
        raise ConfigError(f"table {name!r}: unknown sharding type {tp.sharding!r}; known: {', '.join(SHARDING_TYPES)}")
    if not tp.shards:
        raise ConfigError(f"table {name!r}: the plan gives it no shard")
    for s in tp.shards:
        for f in _SHARD_FIELDS:
            v = getattr(s, f)
            if not (v is None and f == "row_stop") and (isinstance(v, bool) or not isinstance(v, int)):
                raise ConfigError(f"table {name!r}: shard field {f} must be an int, got {v!r}")
        if not 0 <= s.rank < world_size:
            raise ConfigError(f"table {name!r}: rank {s.rank} is out of range for world size {world_size}")
    dynamic = t.dynamic is not None
    for s in tp.shards:  # None (no fixed rows) is a dynamic table's row_stop, and only a dynamic table's
        if (s.row_stop is None) != dynamic:
            what = "a dynamic table's shard has no row_stop (None)" if dynamic else "a shard's row_stop is an int"
            raise ConfigError(f"table {name!r}: {what}; got row_stop={s.row_stop!r}")
    if t.tiered is not None and tp.sharding == "data_parallel":
        raise ConfigError(
            f"table {name!r} is tiered: a replica on every rank's disk is not built; shard it table_wise, "
            "row_wise or column_wise"
        )
    if dynamic and tp.sharding == "data_parallel":
        raise ConfigError(
            f"table {name!r} is dynamic: replicas would make different rows; shard it row_wise (by a hash of the id)"
        )
    if dynamic and tp.partitioned == "rows" and tp.placement != "hash":
        raise ConfigError(f"table {name!r} is dynamic: its rows are placed by a hash of the id (placement='hash')")
    if not dynamic and tp.placement == "hash":
        raise ConfigError(f"table {name!r}: placement 'hash' is for dynamic tables; use 'block' or 'mod'")
    rows, dim = t.num_embeddings, t.embedding_dim
    ranks = [s.rank for s in tp.shards]
    if tp.partitioned == "none":
        if tp.sharding == "table_wise" and len(tp.shards) != 1:
            raise ConfigError(f"table {name!r}: table_wise puts it on one rank, the plan gives {len(tp.shards)}")
        if tp.sharding == "data_parallel" and sorted(ranks) != list(range(world_size)):
            raise ConfigError(f"table {name!r}: data_parallel puts it on every rank once, the plan gives {ranks}")
        for s in tp.shards:
            if (s.row_start, s.row_stop, s.row_step, s.col_start, s.col_stop) != (0, rows, 1, 0, dim):
                raise ConfigError(f"table {name!r}: a {tp.sharding} shard holds the whole table")
        return
    if len(set(ranks)) != len(ranks):
        raise ConfigError(f"table {name!r}: two of its shards are on one rank ({ranks}); merge them")
    if tp.partitioned == "columns":
        cols = sorted((s.col_start, s.col_stop) for s in tp.shards)
        pos = 0
        for a, b in cols:
            if a != pos or b <= a:
                what = "overlap" if a < pos else "gap"
                raise ConfigError(f"table {name!r}: column slices {cols} {what} at column {pos} (dim {dim})")
            pos = b
        if pos != dim:
            raise ConfigError(f"table {name!r}: column slices cover 0..{pos}, the table has {dim} columns")
        for s in tp.shards:
            if (s.row_start, s.row_stop, s.row_step) != (0, rows, 1):
                raise ConfigError(f"table {name!r}: a column slice holds every row")
        return
    for s in tp.shards:  # rows
        if (s.col_start, s.col_stop) != (0, dim):
            raise ConfigError(f"table {name!r}: a row shard holds every column")
    k = len(tp.shards)
    if tp.placement in ("mod", "hash"):
        residues = sorted(s.row_start for s in tp.shards)
        if residues != list(range(k)) or any(s.row_step != k for s in tp.shards):
            raise ConfigError(
                f"table {name!r}: {tp.placement} placement over {k} shards needs residues 0..{k - 1}, step {k}"
            )
        if tp.placement == "mod" and any(s.row_stop != rows for s in tp.shards):
            raise ConfigError(f"table {name!r}: a mod shard's row_stop is the table's rows ({rows})")
        return
    if tp.placement != "block":
        raise ConfigError(f"table {name!r}: unknown placement {tp.placement!r}; known: {', '.join(PLACEMENTS)}")
    spans = sorted((s.row_start, s.row_stop) for s in tp.shards)
    pos = 0
    for a, b in spans:
        if a != pos or b < a:
            what = "overlap" if a < pos else "gap" if a > pos else f"reversed range ({a}, {b})"
            raise ConfigError(f"table {name!r}: row ranges {spans} {what} at row {pos} ({rows} rows)")
        pos = b
    if pos != rows or any(s.row_step != 1 for s in tp.shards):
        raise ConfigError(f"table {name!r}: row ranges cover rows 0..{pos} with step 1, the table has {rows}")


# --- sharding types: plain functions in a registry ------------------------------------------------
ShardingFn = Callable[..., TablePlan]
SHARDING_TYPES: dict[str, ShardingFn] = {}
ROUTE_TYPES: dict[str, type] = {}  # sharding type -> its Route class (hybridembed.distributed.routes)


def register_sharding(name: str, route: type | None = None) -> Callable[[ShardingFn], ShardingFn]:
    """Register a sharding type's plan function under ``name`` and, for a new kind, the
    :class:`~hybridembed.distributed.routes.Route` that looks tables placed by it up (the built-in
    kinds' routes are registered by :mod:`hybridembed.distributed.routes`)."""

    def put(fn: ShardingFn) -> ShardingFn:
        SHARDING_TYPES[name] = fn
        if route is not None:
            ROUTE_TYPES[name] = route
        return fn

    return put


def _whole(t: TableConfig, rank: int) -> Shard:
    return Shard(rank, 0, t.num_embeddings, 1, 0, t.embedding_dim)


@register_sharding("data_parallel")
def data_parallel(t: TableConfig, ranks: Sequence[int]) -> TablePlan:
    return TablePlan(t.name, "data_parallel", tuple(_whole(t, r) for r in ranks))


@register_sharding("table_wise")
def table_wise(t: TableConfig, ranks: Sequence[int]) -> TablePlan:
    if len(ranks) != 1:
        raise ConfigError(f"table {t.name!r}: table_wise takes one rank, got {list(ranks)}")
    return TablePlan(t.name, "table_wise", (_whole(t, ranks[0]),))


@register_sharding("column_wise")
def column_wise(t: TableConfig, ranks: Sequence[int], widths: Sequence[int] | None = None) -> TablePlan:
    """Column slices on ``ranks`` in order: even widths (the first ones one wider) unless given."""
    k = len(ranks)
    if widths is None:
        if k > t.embedding_dim:
            raise ConfigError(f"table {t.name!r}: {k} column slices of {t.embedding_dim} columns")
        base, extra = divmod(t.embedding_dim, k)
        widths = [base + (i < extra) for i in range(k)]
    if len(widths) != k or sum(widths) != t.embedding_dim or min(widths) < 1:
        raise ConfigError(f"table {t.name!r}: column widths {list(widths)} do not split {t.embedding_dim} columns")
    shards, c = [], 0
    for r, w in zip(ranks, widths):
        shards.append(Shard(r, 0, t.num_embeddings, 1, c, c + w))
        c += w
    return TablePlan(t.name, "column_wise", tuple(shards))


def _rows_split(t: TableConfig, ranks: Sequence[int], placement: str | None, sharding: str) -> TablePlan:
    k, dim = len(ranks), t.embedding_dim
    if t.dynamic is not None:
        if placement not in (None, "hash"):
            raise ConfigError(f"table {t.name!r} is dynamic: its rows are placed by a hash of the id")
        return TablePlan(t.name, sharding, tuple(Shard(r, i, None, k, 0, dim) for i, r in enumerate(ranks)), "hash")
    placement = placement or "block"
    n = t.num_embeddings
    if placement == "mod":
        return TablePlan(t.name, sharding, tuple(Shard(r, i, n, k, 0, dim) for i, r in enumerate(ranks)), "mod")
    if placement != "block":
        raise ConfigError(f"table {t.name!r}: unknown placement {placement!r}; known: block, mod")
    block = -(-n // k)  # ceil: the last blocks may be shorter (or empty)
    shards = tuple(Shard(r, min(i * block, n), min((i + 1) * block, n), 1, 0, dim) for i, r in enumerate(ranks))
    return TablePlan(t.name, sharding, shards, "block")


@register_sharding("row_wise")
def row_wise(t: TableConfig, ranks: Sequence[int], placement: str | None = None) -> TablePlan:
    return _rows_split(t, ranks, placement, "row_wise")


@register_sharding("table_row_wise")
def table_row_wise(t: TableConfig, ranks: Sequence[int], placement: str | None = None) -> TablePlan:
    """``row_wise`` over a subgroup of ranks (e.g. one node's)."""
    return _rows_split(t, ranks, placement, "table_row_wise")


def shard_table(t: TableConfig, sharding: str, ranks: Sequence[int], **options: Any) -> TablePlan:
    """``t`` sharded by the registered type ``sharding`` over ``ranks``."""
    fn = SHARDING_TYPES.get(sharding)
    if fn is None:
        raise ConfigError(f"table {t.name!r}: unknown sharding type {sharding!r}; known: {', '.join(SHARDING_TYPES)}")
    if not ranks:
        raise ConfigError(f"table {t.name!r}: {sharding} needs at least one rank")
    allowed = [p for p in inspect.signature(fn).parameters if p not in ("t", "ranks")]
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ConfigError(
            f"table {t.name!r}: {sharding} takes no option {unknown[0]!r}; its options: {', '.join(allowed) or 'none'}"
        )
    return fn(t, tuple(ranks), **options)
