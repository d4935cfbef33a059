"""The planner: tables and a world size in, a :class:`~hybridembed.distributed.plan.Plan` out.

    hybridembed plan --model jumbo --world-size 128 --memory-per-rank 80GiB

Pure arithmetic on table sizes: no tensor is allocated, so the 1,022 tables of the 3 TB
"jumbo" model plan for 128 ranks in well under a second. Shape legend: ``W`` world size,
``B`` batch per rank, ``D`` a table's width, ``h`` ids per sample of a table (its hotness,
summed over the features that read it), ``f`` bags per sample (features reading it).

How a table is placed (in this order):

1. ``overrides`` win: a sharding type name, or ``dict(sharding=, ranks=, placement=, widths=)``.
2. A dynamic table is ``row_wise`` over every rank, placed by a hash of the id.
3. A table whose rows and optimizer state take less than ``data_parallel_below`` bytes is
   replicated (``data_parallel``).
4. A table of more than ``column_slice_threshold`` elements (rows x D) is cut into
   ``ceil(elements / threshold)`` column slices (at most ``min(D, W)``), each placed like a
   table on its own rank (as NVIDIA distributed-embeddings does).
5. The rest are placed ``table_wise``, largest first. ``memory_balanced``: onto the rank
   with the least memory; ``comm_balanced``: the heaviest traffic first, onto the rank with
   the least traffic where it fits in memory (at most 125% of the mean per rank). A table
   that fits on no rank (past the mean memory per rank by more than ``tolerance``, or past
   ``memory_per_rank``) is split ``row_wise`` in blocks over every rank instead; since that
   changes the room left for the others, the placement is repeated until the set of split
   tables is stable.

Memory and traffic per rank are those of :func:`plan_costs`.

    >>> import hybridembed as he
    >>> from hybridembed.distributed.planner import make_plan, plan_costs
    >>> tables = [he.TableConfig(f"t{i}", rows, 16) for i, rows in enumerate([100_000, 100_000, 300_000])]
    >>> plan = make_plan(tables, world_size=2)  # t2 is more than a rank's half: split by rows
    >>> [(tp.table, tp.sharding, tp.ranks) for tp in plan.tables]
    [('t0', 'table_wise', (0,)), ('t1', 'table_wise', (1,)), ('t2', 'row_wise', (0, 1))]
    >>> [c.memory_bytes for c in plan_costs(plan, tables)]  # rows + Adagrad state: 128 bytes a row
    [32000000, 32000000]
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..config import TableConfig
from ..errors import ConfigError
from ..utils import get_logger
from .plan import SHARDING_TYPES, Plan, Shard, TablePlan, shard_table

__all__ = [
    "STRATEGIES",
    "OPTIMIZER_STATE",
    "DATA_PARALLEL_BELOW",
    "RankCost",
    "make_plan",
    "plan_costs",
    "table_bytes",
    "tables_for_model",
    "format_bytes",
    "imbalance",
]

logger = get_logger(__name__)

STRATEGIES = ("memory_balanced", "comm_balanced")
# optimizer -> (float32 state per element, float32 state per row), as he.optim documents them
OPTIMIZER_STATE: dict[str, tuple[int, int]] = {
    "sgd": (0, 0),
    "adagrad": (1, 0),
    "rowwise_adagrad": (0, 1),
    "adam": (2, 0),
    "adamw": (2, 0),
    "adamax": (2, 0),
    "adadelta": (2, 0),
    "ftrl": (2, 0),
    "rmsprop": (1, 0),
}
DATA_PARALLEL_BELOW = 64 * 1024  # bytes of rows + optimizer state
DEFAULT_BATCH = 4096
COMM_MEMORY_SLACK = 0.25  # comm_balanced without memory_per_rank: at most 125% of the mean memory per rank
MAX_ROUNDS = 8  # placement rounds until the set of tables split row-wise is stable
ID_BYTES = 8  # int64 ids and lengths
ROW_BYTES = 4  # float32 pooled rows and their gradients
_OVERRIDE_KEYS = ("sharding", "ranks", "placement", "widths")


# --- per-table facts ------------------------------------------------------------------------
@dataclass(frozen=True)
class _Table:
    config: TableConfig
    index: int
    rows: int  # a dynamic table: Dynamic.capacity, else initial_rows
    row_bytes: int  # bytes per row of width D: rows + optimizer state
    elem_bytes: int  # bytes per element: storage + per-element state
    state_row_bytes: int  # per-row state, per shard
    hotness: float  # h: ids per sample
    bags: int  # f: bags (features) per sample

    @property
    def dim(self) -> int:
        return self.config.embedding_dim

    def _mem(self, rows: int, per_row: int) -> int:
        """Memory of ``rows`` rows of ``per_row`` bytes: a tiered table holds its cache's rows (at most),
        one int32 per row (where the row is) and ~40 bytes of bookkeeping a cached row (its row,
        last use, origin and flags, the free slots, its recency queue's entries:
        ``TieredStorage.memory_bytes``)."""
        tiered = self.config.tiered
        return rows * per_row if tiered is None else min(rows, tiered.cache_rows) * (per_row + 40) + 4 * rows

    @property
    def nbytes(self) -> int:
        return self._mem(self.rows, self.row_bytes)

    def shard_rows(self, tp: TablePlan, s: Shard) -> int:
        if s.row_stop is None:  # dynamic: hash shards hold an even share of the capacity
            return -(-self.rows // len(tp.shards)) if tp.partitioned == "rows" else self.rows
        return len(range(s.row_start, s.row_stop, s.row_step))

    def shard_bytes(self, tp: TablePlan, s: Shard) -> int:
        return self._mem(self.shard_rows(tp, s), s.width * self.elem_bytes + self.state_row_bytes)

    def slice_bytes(self, width: int) -> int:
        return self._mem(self.rows, width * self.elem_bytes + self.state_row_bytes)

    def out_rows(self, frac: float) -> float:
        """Rows returned per sample by a shard owning ``frac`` of the ids: one per bag, or one
        per id for a sequence table (combiner ``none``)."""
        return self.hotness * frac if self.config.combiner == "none" else float(self.bags)

    def exchange(self, frac: float, width: int, batch: int) -> tuple[float, float, float, float]:
        """One requester and one shard: (ids, requester bytes sent, requester bytes received,
        rows) per step. Sent: ids and one length per bag (int64) forward, the rows'
        gradients (float32) backward; received: the pooled rows (float32)."""
        ids = batch * self.hotness * frac
        rows = batch * self.out_rows(frac)
        rows_bytes = ROW_BYTES * rows * width
        return ids, ID_BYTES * (ids + batch * self.bags) + rows_bytes, rows_bytes, rows


def _state(t: TableConfig, optimizer: str) -> tuple[int, int]:
    if t.optimizer is not None:  # a per-table optimizer: its own state
        spec = t.optimizer.state_spec(t.optimizer.hparams)
        return sum(1 for per_elem, _ in spec.values() if per_elem), sum(
            1 for per_elem, _ in spec.values() if not per_elem
        )
    return OPTIMIZER_STATE[optimizer]


def _optimizer_key(optimizer: str) -> str:
    if not isinstance(optimizer, str):
        raise ConfigError(f"optimizer must be a name, got {optimizer!r}; allowed: {', '.join(OPTIMIZER_STATE)}")
    key = optimizer.lower().replace("-", "_")
    key = {"rowwiseadagrad": "rowwise_adagrad", "row_wise_adagrad": "rowwise_adagrad"}.get(key, key)
    if key not in OPTIMIZER_STATE:
        raise ConfigError(f"unknown optimizer {optimizer!r}; allowed: {', '.join(OPTIMIZER_STATE)}")
    return key


def _per_table(value: Any, names: Sequence[str], what: str, kind: type, low: float) -> dict[str, Any]:
    """A scalar or a {table: value} mapping -> a value per table (default for missing: 1)."""

    def ok(v: Any) -> bool:
        if isinstance(v, bool) or not isinstance(v, (int, float) if kind is float else int):
            return False
        return math.isfinite(v) and v >= low

    noun = "a number" if kind is float else "an int"
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - set(names))
        if unknown:
            raise ConfigError(f"{what} names unknown table {unknown[0]!r}; the tables: {', '.join(names[:20])}")
        bad = [(n, v) for n, v in value.items() if not ok(v)]
        if bad:
            raise ConfigError(f"{what} of table {bad[0][0]!r} must be {noun} >= {low}, got {bad[0][1]!r}")
        return {n: kind(value.get(n, 1)) for n in names}
    if not ok(value):
        raise ConfigError(f"{what} must be {noun} >= {low} or a {{table: value}} mapping, got {value!r}")
    return dict.fromkeys(names, kind(value))


def _tables(tables: Sequence[TableConfig], hotness: Any, bags: Any, optimizer: str) -> dict[str, _Table]:
    if isinstance(tables, (str, bytes)) or not isinstance(tables, Sequence):
        raise ConfigError(f"tables must be a sequence of TableConfig, got {type(tables).__name__}")
    for t in tables:
        if not isinstance(t, TableConfig):
            raise ConfigError(f"tables must be TableConfig objects, got {type(t).__name__}: {t!r}")
    names = [t.name for t in tables]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ConfigError(f"table name {dup[0]!r} is used twice; table names must be unique")
    opt = _optimizer_key(optimizer)
    h = _per_table(hotness, names, "hotness", float, 0.0)
    f = _per_table(bags, names, "bags", int, 1)
    out = {}
    for i, t in enumerate(tables):
        per_elem, per_row = _state(t, opt)
        rows = t.num_embeddings
        if t.dynamic is not None:
            rows = t.dynamic.capacity if t.dynamic.capacity is not None else t.dynamic.initial_rows
        elem = t.dtype.itemsize + 4 * per_elem
        out[t.name] = _Table(t, i, rows, t.embedding_dim * elem + 4 * per_row, elem, 4 * per_row, h[t.name], f[t.name])
    return out


def table_bytes(t: TableConfig, optimizer: str = "adagrad") -> int:
    """Bytes of a whole table: rows (its dtype) and float32 optimizer state (a dynamic table:
    ``Dynamic.capacity`` rows, else ``initial_rows``)."""
    return _tables([t], 1.0, 1, optimizer)[t.name].nbytes


# --- the cost model -------------------------------------------------------------------------
@dataclass(frozen=True)
class RankCost:
    """What one rank holds and moves in one training step (see :func:`plan_costs`)."""

    rank: int
    memory_bytes: int  # rows + optimizer state of every shard it holds
    ids_received: int  # ids other ranks send it to look up
    rows_sent: int  # pooled (or, for sequence tables, single) rows it returns to other ranks
    bytes_sent: int
    bytes_received: int

    @property
    def bytes_moved(self) -> int:
        return self.bytes_sent + self.bytes_received


class _Acc:
    """Per-rank sums; a cost every rank pays as requester is added once to ``all_*``."""

    def __init__(self, world_size: int):
        w = world_size
        self.w = w
        self.mem = [0] * w
        self.ids = [0.0] * w
        self.rows = [0.0] * w
        self.sent = [0.0] * w
        self.recv = [0.0] * w
        self.all_sent = 0.0
        self.all_recv = 0.0

    def add(self, tp: TablePlan, t: _Table, batch: int) -> None:
        w = self.w
        for s in tp.shards:
            self.mem[s.rank] += t.shard_bytes(tp, s)
        if tp.sharding == "data_parallel":  # a ring all-reduce of a dense (rows, D + 1) gradient
            v = 2 * (w - 1) / w * t.rows * (t.dim + 1) * ROW_BYTES
            self.all_sent += v
            self.all_recv += v
            return
        for s in tp.shards:
            frac = 1.0 if tp.partitioned != "rows" else (t.shard_rows(tp, s) / t.rows if t.rows else 0.0)
            ids, sent, recv, rows = t.exchange(frac, s.width, batch)
            # every other rank asks this shard; the owner asks itself for free
            self.all_sent += sent
            self.all_recv += recv
            o = s.rank
            self.sent[o] -= sent
            self.recv[o] -= recv
            self.ids[o] += (w - 1) * ids
            self.rows[o] += (w - 1) * rows
            self.recv[o] += (w - 1) * sent
            self.sent[o] += (w - 1) * recv

    def costs(self) -> list[RankCost]:
        return [
            RankCost(
                r,
                self.mem[r],
                round(self.ids[r]),
                round(self.rows[r]),
                round(self.sent[r] + self.all_sent),
                round(self.recv[r] + self.all_recv),
            )
            for r in range(self.w)
        ]


def plan_costs(
    plan: Plan,
    tables: Sequence[TableConfig],
    *,
    batch_size: int = DEFAULT_BATCH,
    hotness: float | Mapping[str, float] = 1.0,
    bags: int | Mapping[str, int] = 1,
    optimizer: str = "adagrad",
) -> list[RankCost]:
    """Memory and embedding traffic of each rank in one training step, from sizes alone.

    Memory: the rows of every shard a rank holds (the table's dtype) plus the optimizer's
    float32 state (``OPTIMIZER_STATE``: per element and per row; a table's own
    ``TableConfig.optimizer`` wins). A dynamic table counts ``Dynamic.capacity`` rows
    (else ``initial_rows``), split evenly over its hash shards.

    Traffic, with ``B = batch_size`` samples per rank, ``h`` ids and ``f`` bags per sample:
    every rank sends, for each shard on another rank, the ids of its batch that the shard
    owns (int64: ``B h`` for a table-wise or column shard, ``B h x`` for a row shard holding
    a fraction ``x`` of the rows: ids assumed spread evenly over rows) and one int64 length
    per bag (``B f``); the shard returns one float32 row of its width per bag (a row shard a
    partial sum, so a row-wise table returns ``B f`` rows from each of its ``k`` shards; a
    sequence table, combiner ``none``, one row per id), and in the backward pass the
    requester sends those rows' gradients back (same size). A data-parallel table sends
    nothing forward and all-reduces a dense ``(rows, D + 1)`` float32 gradient each step,
    counted as a ring: ``2 (W - 1) / W`` of it sent and received by every rank. Anything a
    rank asks of its own shards costs no bytes. ``ids_received`` and ``rows_sent`` count
    only ids and rows that cross to another rank.
    """
    infos = _tables(tables, hotness, bags, optimizer)
    _check_batch(batch_size)
    plan.check(tables)
    acc = _Acc(plan.world_size)
    for tp in plan.tables:
        acc.add(tp, infos[tp.table], batch_size)
    return acc.costs()


def imbalance(values: Sequence[float]) -> float:
    """max / mean (1.0 when perfectly balanced or all zero)."""
    mean = sum(values) / len(values) if values else 0.0
    return max(values) / mean if mean > 0 else 1.0


def format_bytes(n: float) -> str:
    """``1536`` -> ``'1.5 KiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


# --- the planner ----------------------------------------------------------------------------
@dataclass(frozen=True)
class _Unit:
    """A table (``part`` None) or one column slice of it, to place on one rank."""

    table: str
    index: int
    part: int | None
    width: int
    mem: int
    comm: float  # what its owner adds to its traffic
    forced: bool  # an override or a slice: never split row-wise


def _check_batch(batch_size: Any) -> None:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"batch_size must be a positive int (samples per rank per step), got {batch_size!r}")


def _positive_or_none(value: Any, what: str) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ConfigError(f"{what} must be a positive int or None, got {value!r}")


def _parse_override(name: str, value: Any, t: _Table, world_size: int, ranks_per_node: int | None) -> dict[str, Any]:
    spec = {"sharding": value} if isinstance(value, str) else value
    if not isinstance(spec, Mapping):
        raise ConfigError(
            f"override of table {name!r} must be a sharding type name or a dict with keys "
            f"{', '.join(_OVERRIDE_KEYS)}; got {value!r}"
        )
    unknown = sorted(set(spec) - set(_OVERRIDE_KEYS))
    if unknown:
        raise ConfigError(
            f"override of table {name!r}: unknown key {unknown[0]!r}; allowed: {', '.join(_OVERRIDE_KEYS)}"
        )
    sharding = spec.get("sharding")
    if sharding not in SHARDING_TYPES:
        raise ConfigError(
            f"override of table {name!r}: unknown sharding type {sharding!r}; known: {', '.join(SHARDING_TYPES)}"
        )
    if sharding == "data_parallel" and t.config.dynamic is not None:
        raise ConfigError(
            f"override of table {name!r}: a dynamic table cannot be data_parallel (replicas would make different "
            "rows); use row_wise"
        )
    ranks = spec.get("ranks")
    if ranks is not None:
        if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Sequence) or not ranks:
            raise ConfigError(f"override of table {name!r}: ranks must be a non-empty list of ints, got {ranks!r}")
        for r in ranks:
            if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < world_size:
                raise ConfigError(
                    f"override of table {name!r}: rank {r!r} is out of range for world size {world_size} "
                    f"(ranks are 0..{world_size - 1})"
                )
        if len(set(ranks)) != len(ranks):
            raise ConfigError(f"override of table {name!r}: ranks {list(ranks)} name a rank twice")
        if sharding == "data_parallel" and sorted(ranks) != list(range(world_size)):
            raise ConfigError(f"override of table {name!r}: data_parallel is on every rank; leave ranks out")
        ranks = tuple(ranks)
    placement = spec.get("placement")
    if placement is not None and sharding not in ("row_wise", "table_row_wise"):
        raise ConfigError(f"override of table {name!r}: placement is for row_wise and table_row_wise, not {sharding}")
    widths = spec.get("widths")
    if widths is not None:
        if sharding != "column_wise":
            raise ConfigError(f"override of table {name!r}: widths are for column_wise, not {sharding}")
        if isinstance(widths, (str, bytes)) or not isinstance(widths, Sequence) or not widths:
            raise ConfigError(f"override of table {name!r}: widths must be a list of ints, got {widths!r}")
        if ranks is not None and len(ranks) != len(widths):
            raise ConfigError(f"override of table {name!r}: {len(widths)} widths for {len(ranks)} ranks")
        if len(widths) > world_size:
            raise ConfigError(f"override of table {name!r}: {len(widths)} column slices for {world_size} ranks")
        widths = tuple(widths)
    if sharding == "table_row_wise" and ranks is None and ranks_per_node is None:
        raise ConfigError(
            f"override of table {name!r}: table_row_wise needs ranks_per_node (or explicit ranks) to know a node"
        )
    return {"sharding": sharding, "ranks": ranks, "placement": placement, "widths": widths}


def make_plan(
    tables: Sequence[TableConfig],
    world_size: int,
    *,
    memory_per_rank: int | None = None,
    batch_size: int = DEFAULT_BATCH,
    hotness: float | Mapping[str, float] = 1.0,
    bags: int | Mapping[str, int] = 1,
    strategy: str = "memory_balanced",
    overrides: Mapping[str, str | Mapping[str, Any]] | None = None,
    optimizer: str = "adagrad",
    column_slice_threshold: int | None = None,
    data_parallel_below: int = DATA_PARALLEL_BELOW,
    ranks_per_node: int | None = None,
    tolerance: float = 0.02,
    notes: Mapping[str, Any] | None = None,
) -> Plan:
    """A checked :class:`Plan` for ``tables`` on ``world_size`` ranks (see the module doc).

    Args:
        memory_per_rank: bytes of rows + optimizer state a rank may hold; a plan that does
            not fit raises a :class:`ConfigError` naming the rank and the shortfall.
        batch_size, hotness, bags, optimizer: the step the cost model assumes
            (:func:`plan_costs`); ``hotness``/``bags`` are per table (a mapping; missing
            tables 1) or one number for all.
        strategy: ``memory_balanced`` or ``comm_balanced``.
        overrides: ``{table: "row_wise"}`` or ``{table: {"sharding": ..., "ranks": [...],
            "placement": ..., "widths": [...]}}``; ranks left out are chosen by the strategy
            (row_wise, column_wise: every rank / ``min(W, D)`` ranks; table_row_wise: the
            least loaded node of ``ranks_per_node`` ranks).
        column_slice_threshold: elements above which a table is cut into column slices.
        data_parallel_below: bytes under which a (dense) table is replicated.
        tolerance: how far past the mean memory per rank a table-wise placement may go.
        notes: recorded in ``plan.notes`` beside the assumptions (JSON-serialisable).
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size must be a positive int, got {world_size!r}")
    if strategy not in STRATEGIES:
        raise ConfigError(f"unknown strategy {strategy!r}; allowed: {', '.join(STRATEGIES)}")
    _check_batch(batch_size)
    _positive_or_none(memory_per_rank, "memory_per_rank (bytes)")
    _positive_or_none(column_slice_threshold, "column_slice_threshold (elements)")
    _positive_or_none(ranks_per_node, "ranks_per_node")
    if ranks_per_node is not None and world_size % ranks_per_node:
        raise ConfigError(f"ranks_per_node={ranks_per_node} does not divide world_size={world_size}")
    if isinstance(data_parallel_below, bool) or not isinstance(data_parallel_below, int) or data_parallel_below < 0:
        raise ConfigError(f"data_parallel_below must be an int >= 0 (bytes), got {data_parallel_below!r}")
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not 0 <= tolerance < math.inf:
        raise ConfigError(f"tolerance must be a number >= 0 (a fraction of the mean), got {tolerance!r}")
    info = _tables(tables, hotness, bags, optimizer)
    overrides = dict(overrides or {})
    unknown = sorted(set(overrides) - set(info))
    if unknown:
        raise ConfigError(
            f"overrides name unknown table {unknown[0]!r}; the tables: {', '.join(list(info)[:20])}"
            + (" ..." if len(info) > 20 else "")
        )
    parsed = {n: _parse_override(n, v, info[n], world_size, ranks_per_node) for n, v in overrides.items()}

    W, B = world_size, batch_size
    everyone = tuple(range(W))
    fixed: dict[str, TablePlan] = {}
    units: list[_Unit] = []
    node_tables: list[str] = []  # table_row_wise overrides without ranks: placed on a node after the rest is fixed

    def unit(t: _Table, part: int | None, width: int, forced: bool) -> _Unit:
        _, sent, recv, _ = t.exchange(1.0, width, B)
        return _Unit(t.config.name, t.index, part, width, t.slice_bytes(width), max(W - 2, 0) * (sent + recv), forced)

    def slices(t: _Table, n: int, widths: Sequence[int] | None = None) -> list[_Unit]:
        if widths is None:
            base, extra = divmod(t.dim, n)
            widths = [base + (i < extra) for i in range(n)]
        if sum(widths) != t.dim or min(widths) < 1:
            raise ConfigError(f"table {t.config.name!r}: column widths {list(widths)} do not split {t.dim} columns")
        return [unit(t, i, w, True) for i, w in enumerate(widths)]

    for name, t in info.items():
        c = t.config
        o = parsed.get(name)
        if o is not None:
            sh, ranks = o["sharding"], o["ranks"]
            opts = {k: o[k] for k in ("placement", "widths") if o[k] is not None}
            if sh == "table_wise" and ranks is None:
                units.append(unit(t, None, t.dim, True))
            elif sh == "column_wise" and ranks is None:
                units += slices(t, min(W, t.dim), o["widths"])
            elif sh == "table_row_wise" and ranks is None:
                node_tables.append(name)
            else:
                fixed[name] = shard_table(c, sh, ranks or everyone, **opts)
        elif c.dynamic is not None:
            fixed[name] = shard_table(c, "row_wise", everyone, placement="hash")
        elif t.nbytes < data_parallel_below and c.tiered is None:
            fixed[name] = shard_table(c, "data_parallel", everyone)
        elif column_slice_threshold is not None and c.num_embeddings * t.dim > column_slice_threshold and W > 1:
            n = min(-(-c.num_embeddings * t.dim // column_slice_threshold), t.dim, W)
            units += slices(t, n) if n > 1 else [unit(t, None, t.dim, False)]
        else:
            units.append(unit(t, None, t.dim, False))

    acc = _Acc(W)
    for name, tp in fixed.items():
        acc.add(tp, info[name], B)
    for name in node_tables:  # the node holding the least memory so far
        rpn = ranks_per_node or W
        nodes = [tuple(range(i, i + rpn)) for i in range(0, W, rpn)]
        node = min(nodes, key=lambda rs: (sum(acc.mem[r] for r in rs), rs[0]))
        o = parsed[name]
        opts = {"placement": o["placement"]} if o["placement"] else {}
        fixed[name] = shard_table(info[name].config, "table_row_wise", node, **opts)
        acc.add(fixed[name], info[name], B)

    total = sum(acc.mem) + sum(u.mem for u in units)
    mean = total / W
    if strategy == "memory_balanced":
        cap = mean * (1 + tolerance)
        order = sorted(units, key=lambda u: (-u.mem, -u.comm, u.index, u.part or 0))  # of equals, the cold split
    else:  # memory a constraint: at most 125% of the mean (and the budget, below)
        cap = mean * (1 + max(tolerance, COMM_MEMORY_SLACK))
        order = sorted(units, key=lambda u: (-u.comm, -u.mem, u.index, u.part or 0))
    if memory_per_rank is not None:
        cap = min(cap, memory_per_rank)
    comm0 = [acc.sent[r] + acc.recv[r] for r in range(W)]

    split: frozenset[str] = frozenset()
    for _ in range(MAX_ROUNDS):
        spread = sum(info[n].nbytes for n in split) / W  # what the row-wise tables add to every rank
        where, now_split = _place(order, W, acc.mem, comm0, cap - spread, strategy)
        if now_split == split:
            break
        split = now_split

    by_table: dict[str, list[_Unit]] = {}
    for u in units:
        by_table.setdefault(u.table, []).append(u)
    out = []
    for name, t in info.items():
        if name in fixed:
            out.append(fixed[name])
        elif name in split:
            out.append(shard_table(t.config, "row_wise", everyone, placement="block"))
        elif (name, None) in where:
            out.append(shard_table(t.config, "table_wise", (where[name, None],)))
        else:
            parts = sorted((u.part, where[name, u.part], u.width) for u in by_table[name])
            out.append(shard_table(t.config, "column_wise", [r for _, r, _ in parts], widths=[w for *_, w in parts]))

    plan_notes = {
        "batch_size": B,
        "hotness": _describe(hotness, "ids per sample"),
        "bags": _describe(bags, "bags per sample"),
        "optimizer": _optimizer_key(optimizer),
        "memory_per_rank": memory_per_rank,
        "tolerance": tolerance,
        "data_parallel_below": data_parallel_below,
        "column_slice_threshold": column_slice_threshold,
        "ranks_per_node": ranks_per_node,
        "overrides": len(overrides),
        "split_row_wise": len(split),
        **dict(notes or {}),
    }
    plan = Plan(W, tuple(out), strategy, plan_notes)
    plan.check(tables)
    if memory_per_rank is not None:
        _check_budget(plan, info, memory_per_rank, total)
    logger.debug("planned %d tables on %d ranks (%s); %d split row-wise", len(out), W, strategy, len(split))
    return plan


def _describe(value: Any, what: str) -> str:
    if isinstance(value, Mapping):
        return f"{what}: per table ({len(value)} given, 1 for the others)"
    return f"{what}: {value} for every table"


def _place(
    order: Sequence[_Unit], W: int, mem0: Sequence[int], comm0: Sequence[float], cap: float, strategy: str
) -> tuple[dict[tuple[str, int | None], int], frozenset[str]]:
    """One greedy round: each unit onto the best rank where it fits under ``cap`` (slices of a
    table on distinct ranks); a unit that fits nowhere (and is not forced) is split."""
    mem = list(mem0)
    comm = list(comm0)
    key = mem if strategy == "memory_balanced" else comm
    heap = [(key[r], r) for r in range(W)]
    heapq.heapify(heap)
    taken: dict[str, set[int]] = {}
    where: dict[tuple[str, int | None], int] = {}
    split: set[str] = set()
    for u in order:
        if u.table in split:
            continue
        used = taken.setdefault(u.table, set())
        popped, chosen = [], None
        while heap:
            item = heapq.heappop(heap)
            popped.append(item)
            r = item[1]
            if r in used:
                continue
            if mem[r] + u.mem <= cap:
                chosen = r
                break
            if strategy == "memory_balanced":  # the least-loaded rank is the best there is
                break
        if chosen is None and u.forced:
            free = [r for r in range(W) if r not in used]
            chosen = min(free, key=lambda r: (mem[r], r))
        for item in popped:
            if item[1] != chosen:
                heapq.heappush(heap, item)
        if chosen is None:
            split.add(u.table)
            continue
        mem[chosen] += u.mem
        comm[chosen] += u.comm
        used.add(chosen)
        where[u.table, u.part] = chosen
        heapq.heappush(heap, (key[chosen], chosen))
    return where, frozenset(split)


def _check_budget(plan: Plan, info: Mapping[str, _Table], budget: int, total: int) -> None:
    acc = _Acc(plan.world_size)
    for tp in plan.tables:
        acc.add(tp, info[tp.table], 1)
    over = [(m, r) for r, m in enumerate(acc.mem) if m > budget]
    if not over:
        return
    need, rank = max(over, key=lambda x: (x[0], -x[1]))
    short = need - budget
    at_least = -(-total // budget)
    hint = (
        f"the tables need {format_bytes(total)} in all, so at least {at_least} ranks of this size"
        if at_least > plan.world_size
        else "a column_slice_threshold, overrides that split the largest tables, or an optimizer with less state"
    )
    raise ConfigError(
        f"the plan does not fit memory_per_rank={budget:,} bytes ({format_bytes(budget)}): rank {rank} needs "
        f"{need:,} bytes ({format_bytes(need)}), {short:,} bytes ({format_bytes(short)}) too many; "
        f"{len(over)} of {plan.world_size} ranks are over. Fix: more ranks, more memory per rank, or {hint}"
    )


# --- synthetic models -----------------------------------------------------------------------
def tables_for_model(spec: Any) -> tuple[list[TableConfig], dict[str, float], dict[str, int]]:
    """A synthetic model's tables at full size (configs only, nothing allocated), with each
    table's hotness (ids per sample, summed over the inputs reading it) and bags per sample
    (inputs reading it).

    ``spec`` is a :class:`hybridembed.bench.models.ModelSpec` (read, not imported: the
    library does not import the benchmarks); tables are named as its ``expand`` names them.

    >>> from hybridembed.bench.models import MODELS
    >>> tables, hotness, bags = tables_for_model(MODELS["tiny"])
    >>> len(tables), tables[2].num_embeddings, hotness["t2"], bags["t2"]
    (55, 25000000, 11.0, 2)
    """
    tables: list[TableConfig] = []
    hotness: dict[str, float] = {}
    bags: dict[str, int] = {}
    for e in spec.embeddings:  # num_tables tables of rows x width, each read by one input per nnz entry
        for _ in range(e.num_tables):
            name = f"t{len(tables)}"
            tables.append(TableConfig(name, e.rows, e.width))
            hotness[name] = float(sum(e.nnz))
            bags[name] = len(e.nnz)
    return tables, hotness, bags


def check_memory(plan: Plan, tables: list[TableConfig], memory_per_rank: int) -> None:
    """Refuses a plan that puts more than ``memory_per_rank`` bytes of rows and optimizer state on a rank."""
    if isinstance(memory_per_rank, bool) or not isinstance(memory_per_rank, int) or memory_per_rank <= 0:
        raise ConfigError(f"memory_per_rank must be a positive int (bytes), got {memory_per_rank!r}")
    costs = plan_costs(plan, tables)
    worst = max(costs, key=lambda c: c.memory_bytes)
    if worst.memory_bytes > memory_per_rank:
        over = sum(c.memory_bytes > memory_per_rank for c in costs)
        raise ConfigError(
            f"the plan puts {format_bytes(worst.memory_bytes)} of rows and optimizer state on rank {worst.rank}, "
            f"{format_bytes(worst.memory_bytes - memory_per_rank)} over memory_per_rank="
            f"{format_bytes(memory_per_rank)} ({over} rank(s) over); nothing was allocated. Plan with "
            "make_plan(..., memory_per_rank=...) or shard the largest tables row_wise"
        )


def checked_plan(plan: Plan | None, tables: list[TableConfig], world: int, memory_per_rank: int | None) -> Plan:
    """``plan`` (the planner's when None) checked against the tables, the world size and the budget."""
    if plan is None:
        plan = make_plan(tables, world)
    if not isinstance(plan, Plan):
        raise ConfigError(f"plan must be a hybridembed.distributed.Plan, got {type(plan).__name__}")
    if plan.world_size != world:
        raise ConfigError(f"the plan is for world size {plan.world_size}, this process group has {world} ranks")
    plan.check(tables)
    if memory_per_rank is not None:
        check_memory(plan, tables, memory_per_rank)
    return plan
