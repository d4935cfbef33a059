"""``TableConfig``: what a table is, as frozen, self-validating data."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from . import init as _init
from .errors import ConfigError
from .utils import is_number as _is_number

__all__ = [
    "TableConfig",
    "tables_from_torchrec",
    "Dynamic",
    "ShardOf",
    "Tiered",
    "COMBINERS",
    "STORAGE_DTYPES",
    "EVICTION_POLICIES",
    "MAX_ROWS",
    "MAX_SLOTS",
    "MAX_SKETCH_CELLS",
]

COMBINERS = ("sum", "mean", "sqrtn", "none")
STORAGE_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
EVICTION_POLICIES = ("lru", "lfu", "lrfu", "ttl")
# Most rows of a dense table: 2**48 (2.8e14, far beyond any table that can be allocated, even
# sharded) keeps row ids, a group's row offsets and rows x dim inside int64.
MAX_ROWS = 1 << 48
# Most row slots of a dynamic group (capacity x tables, and initial_rows): slots are int32.
MAX_SLOTS = (1 << 31) - 2
# Most counters of a dynamic table's admission sketch (sketch_depth x sketch_width): 2**31 int32
# counters are 8 GiB per table, made when the collection is built.
MAX_SKETCH_CELLS = 1 << 31
# min_count is compared with int32 sketch counters; ttl_steps with an int64 step clock.
MAX_MIN_COUNT = (1 << 31) - 1
MAX_TTL_STEPS = (1 << 63) - 1


_BOUNDS = {  # Dynamic's int fields beyond the slots' bound: the most each can be, and why
    "min_count": (MAX_MIN_COUNT, "sketch counters are int32"),
    "ttl_steps": (MAX_TTL_STEPS, "the step clock is int64"),
}


@dataclass(frozen=True)
class Dynamic:
    """A dynamic table: any int64 id (negative too) or hashed string, rows made on first sight.

    Args:
        capacity: most rows kept per table (None: grow without bound). When a batch needs
            more, rows are evicted in one batch, ``evict_fraction`` of the capacity at a time.
            A group's tables together hold at most ``MAX_SLOTS`` (2**31 - 2; slots are int32).
        eviction: ``lru`` (least recently seen), ``lfu`` (least often seen, then least
            recently), ``lrfu`` (least recently seen, each doubling of a row's count worth
            8 lookups of recency: often-seen rows stay, and age out once no longer seen) or
            ``ttl`` (every row unseen for ``ttl_steps`` training steps goes, full or not; LRU
            when still full). None (the default): ``lru`` for a table in memory; ``lrfu``
            for which rows of a tiered table (:class:`Tiered`) stay in its cache, which
            changes no result, only what is read back (measured on power-law ids: 29% fewer
            rows read back than LRU; with the hot ids drifting, 9% more).
        min_count: an id gets a row at its ``min_count``-th sighting (counted in a bounded
            count-min sketch of ``sketch_depth`` x ``sketch_width`` int32 counters per
            table, at most ``MAX_SKETCH_CELLS`` = 2**31 of them: 8 GiB); until then it reads
            the default vector and gets no update. At most 2**31 - 1 (the counters' range).
        admit_probability: a new id past ``min_count`` is admitted with this probability.
        default_value: every element of the default vector (read by ids without a row).
        initial_rows: rows allocated up front when ``capacity`` is None (doubles as needed).

    Rows are only made while the module is in training mode; in eval mode unknown ids read
    the default vector.

    >>> import hybridembed as he
    >>> he.TableConfig("user", None, 16, dynamic=he.Dynamic(capacity=1_000_000, min_count=2))
    TableConfig(name='user', num_embeddings=None, embedding_dim=16, combiner='sum', dtype=torch.float32, ...)
    """

    capacity: int | None = None
    eviction: str | None = None
    ttl_steps: int | None = None
    min_count: int = 1
    admit_probability: float = 1.0
    default_value: float = 0.0
    evict_fraction: float = 0.1
    sketch_depth: int = 4
    sketch_width: int = 1 << 16
    initial_rows: int = 1024

    def __post_init__(self) -> None:
        def positive_int(name: str, v, allow_none: bool = False) -> None:
            if v is None and allow_none:
                return
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ConfigError(f"Dynamic: {name} must be a positive int, got {v!r}")
            if name in ("capacity", "initial_rows") and v > MAX_SLOTS:
                raise ConfigError(f"Dynamic: {name} must be at most {MAX_SLOTS} (row slots are int32), got {v!r}")
            high, why = _BOUNDS.get(name, (None, ""))
            if high is not None and v > high:
                raise ConfigError(f"Dynamic: {name} must be at most {high} ({why}), got {v!r}")

        positive_int("capacity", self.capacity, allow_none=True)
        positive_int("min_count", self.min_count)
        positive_int("sketch_depth", self.sketch_depth)
        positive_int("sketch_width", self.sketch_width)
        positive_int("initial_rows", self.initial_rows)
        cells = self.sketch_depth * self.sketch_width
        if cells > MAX_SKETCH_CELLS:
            raise ConfigError(
                f"Dynamic: sketch_depth x sketch_width = {self.sketch_depth} x {self.sketch_width} = {cells} counters "
                f"per table; at most 2**31 = {MAX_SKETCH_CELLS} (8 GiB of int32), typically 4 x 65536: lower them"
            )
        if self.eviction is not None and self.eviction not in EVICTION_POLICIES:
            raise ConfigError(f"Dynamic: eviction must be one of {', '.join(EVICTION_POLICIES)}, got {self.eviction!r}")
        if self.eviction == "ttl":
            positive_int("ttl_steps", self.ttl_steps)
        elif self.ttl_steps is not None:
            raise ConfigError("Dynamic: ttl_steps is only used with eviction='ttl'")
        if not _is_number(self.default_value):
            raise ConfigError(f"Dynamic: default_value must be a finite number, got {self.default_value!r}")
        for name in ("admit_probability", "evict_fraction"):
            v = getattr(self, name)
            if not _is_number(v) or not 0.0 < v <= 1.0:
                raise ConfigError(f"Dynamic: {name} must be a number in (0, 1], got {v!r}")


@dataclass(frozen=True)
class Tiered:
    """A dense table whose rows and optimizer state live in files under ``path`` (local disk),
    with the ``cache_rows`` rows a batch needs held in memory (least recently used evicted,
    written back to the files): for tables larger than the machine's memory.

    Args:
        path: a directory (made if missing) for the table's files: scratch working memory, like
            swap, made afresh when the table is built (checkpoints are what keep a table).
        cache_rows: rows (and their optimizer state) held in memory for each group of tables
            sharing this ``Tiered`` (tables of one dim, dtype and optimizer form a group; each
            group has a cache of its own); a batch's distinct rows (and those looked up in training
            since the last optimizer step) must fit. Two live models must not share a ``path``
            (refused: the files are locked).
        mapped: a dense table's files also mapped into memory, rows copied from and into the
            mapping instead of a system call a row (several times faster while the files stay in
            the page cache; their pages then count in the process's resident memory, as file
            pages the kernel reclaims). None (the default): mapped when the group's row file is at
            most an eighth of the memory this process may use (the machine's, or its cgroup's
            limit), read and written by system calls beyond (a table larger than memory, whose
            rows the disk serves). A dynamic table's file of records, which grows, is mapped by
            the same rule (checked as it grows): while it is, a spilled row is written back into
            its record's place through the mapping; beyond, a spill's records are appended by one
            system call. A mapped file the page cache holds (None's rule) is in 2 MiB pages.

    >>> import hybridembed as he
    >>> t = he.TableConfig("item", 10_000_000, 64, tiered=he.Tiered("tiers/item", cache_rows=1_000_000))
    """

    path: str
    cache_rows: int
    mapped: bool | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.path, (str, os.PathLike)) or not str(self.path) or "\x00" in str(self.path):
            raise ConfigError(f"Tiered: path must be a directory path, got {self.path!r}")
        if isinstance(self.cache_rows, bool) or not isinstance(self.cache_rows, int) or self.cache_rows <= 0:
            raise ConfigError(f"Tiered: cache_rows must be a positive int, got {self.cache_rows!r}")
        if self.mapped is not None and not isinstance(self.mapped, bool):
            raise ConfigError(
                f"Tiered: mapped must be True, False or None (chosen by the table's size), got {self.mapped!r}"
            )
        object.__setattr__(self, "path", str(self.path))


@dataclass(frozen=True)
class ShardOf:
    """The part of a whole table a :class:`TableConfig` holds (set by the sharded runtime).

    A dense shard's local row ``i`` is the whole table's row ``row_start + i * row_step``
    (a block: step 1; a residue class of modulo placement: step = the number of shards);
    a dynamic shard holds the ids the plan sends it, by their own value. Its columns are
    the whole table's ``col_start .. col_start + embedding_dim - 1``. Initial values are
    keyed by the whole table's name, row and column, so a shard starts equal to the same
    slice of the whole table.
    """

    table: str
    row_start: int = 0
    row_step: int = 1
    col_start: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.table, str) or not self.table:
            raise ConfigError(f"ShardOf: table must be a table name, got {self.table!r}")
        for name, low in (("row_start", 0), ("row_step", 1), ("col_start", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ConfigError(f"ShardOf({self.table!r}): {name} must be an int >= {low}, got {v!r}")


@dataclass(frozen=True)
class TableConfig:
    """One embedding table.

    Args:
        name: unique name; the table's rows are ``<name>.weight`` in ``state_dict()``.
        num_embeddings: rows (ids ``0 .. num_embeddings-1``), at most ``MAX_ROWS`` (2**48),
            with ``num_embeddings * embedding_dim < 2**63``; None for a dynamic table.
        embedding_dim: ``D``, the width of a row.
        combiner: ``sum``, ``mean``, ``sqrtn`` (pooled, output ``(B, D)``) or ``none``
            (sequence: one row per id, output a ``Jagged`` of rows or padded ``(B, T, D)``).
        dtype: storage dtype: float32, float64, or float16/bfloat16 (pooled in float32).
        init: a row-keyed initializer from :mod:`hybridembed.init`; default ``uniform(-0.05, 0.05)``.
        optimizer: a per-table sparse optimizer overriding the one ``wrap_optimizer`` picks.
        dynamic: a :class:`Dynamic` makes the table keyed by any int64 id (``num_embeddings=None``).
        shard: a :class:`ShardOf` when this config is one shard of a sharded table (the
            sharded runtime makes these; users leave it None).
        tiered: a :class:`Tiered`: the rows live on local disk behind an in-memory cache
            (dense tables; dynamic ones with ``Dynamic(capacity=None)``, rows beyond the cache
            spilled to disk; see docs/tiered.md).

    >>> import hybridembed as he
    >>> he.TableConfig("user", num_embeddings=1000, embedding_dim=16, combiner="mean")
    TableConfig(name='user', num_embeddings=1000, embedding_dim=16, combiner='mean', dtype=torch.float32, ...)
    """

    name: str
    num_embeddings: int | None
    embedding_dim: int
    combiner: str = "sum"
    dtype: torch.dtype = torch.float32
    init: _init.Init = field(default_factory=_init.uniform)
    optimizer: Any = None
    dynamic: Dynamic | None = None
    shard: ShardOf | None = None
    tiered: Tiered | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or "." in self.name:
            raise ConfigError(f"table name must be a non-empty string without '.', got {self.name!r}")
        if self.dynamic is not None and not isinstance(self.dynamic, Dynamic):
            raise ConfigError(f"table {self.name!r}: dynamic must be a he.Dynamic(...), got {self.dynamic!r}")
        if self.tiered is not None:
            if not isinstance(self.tiered, Tiered):
                raise ConfigError(
                    f"table {self.name!r}: tiered must be a he.Tiered(path, cache_rows), got {self.tiered!r}"
                )
            if any(c in self.name for c in ("/", "\\", "\x00")):
                raise ConfigError(
                    f"table {self.name!r}: a tiered table's name names its files in Tiered(path=...): "
                    "no '/', '\\' or NUL in it"
                )
            if self.dynamic is not None and self.tiered.cache_rows > MAX_SLOTS:
                raise ConfigError(
                    f"table {self.name!r}: Tiered(cache_rows={self.tiered.cache_rows}) is more than a dynamic "
                    f"table's cache can hold: at most {MAX_SLOTS} (row slots are int32)"
                )
            if self.dynamic is not None and (self.dynamic.capacity is not None or self.dynamic.eviction == "ttl"):
                raise ConfigError(
                    f"table {self.name!r}: a tiered dynamic table keeps every row it admits (on disk beyond "
                    "Tiered(cache_rows=...)): give it Dynamic(capacity=None) and eviction 'lrfu', 'lru' or 'lfu' "
                    "(which rows stay in memory), not a capacity or 'ttl' (which drop rows)"
                )
        if self.dynamic is not None:
            if self.num_embeddings is not None:
                raise ConfigError(
                    f"table {self.name!r}: a dynamic table has no fixed size; pass num_embeddings=None "
                    "(bound its rows with Dynamic(capacity=...))"
                )
        for attr in ("num_embeddings", "embedding_dim"):
            v = getattr(self, attr)
            if attr == "num_embeddings" and self.dynamic is not None:
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ConfigError(f"table {self.name!r}: {attr} must be a positive int, got {v!r}")
        if self.dynamic is None and self.num_embeddings > MAX_ROWS:
            raise ConfigError(
                f"table {self.name!r}: num_embeddings={self.num_embeddings} is more rows than can ever be "
                f"allocated; at most 2**48 = {MAX_ROWS}. For an unbounded id space use dynamic=he.Dynamic(...)"
            )
        if self.dynamic is None and self.num_embeddings * self.embedding_dim >= 1 << 63:
            raise ConfigError(
                f"table {self.name!r}: num_embeddings x embedding_dim = {self.num_embeddings * self.embedding_dim} "
                "elements overflow int64 (must be < 2**63); use fewer rows or a smaller embedding_dim"
            )
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
        if self.shard is not None and not isinstance(self.shard, ShardOf):
            raise ConfigError(f"table {self.name!r}: shard must be a ShardOf, got {self.shard!r}")
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
    def init_name(self) -> str:
        """The name its initial values are keyed by: the whole table's, for a shard."""
        return self.shard.table if self.shard is not None else self.name

    @property
    def col_start(self) -> int:
        """Its first column in the whole table (0 unless a column shard)."""
        return self.shard.col_start if self.shard is not None else 0

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype rows are pooled and returned in (float32 for half-precision storage)."""
        return torch.float64 if self.dtype == torch.float64 else torch.float32


_TORCHREC_DTYPES = {"FP32": torch.float32, "FP16": torch.float16, "BF16": torch.bfloat16}
_TORCHREC_POOLING = {"SUM": "sum", "MEAN": "mean", "NONE": "none"}


def tables_from_torchrec(configs: Sequence[Any]) -> tuple[list[TableConfig], dict[str, str]]:
    """TorchRec ``EmbeddingBagConfig`` / ``EmbeddingConfig`` objects -> ``(tables, features)`` for
    :class:`~hybridembed.EmbeddingCollection` (duck-typed: TorchRec is not imported). Each config's
    ``feature_names`` read its table; ``pooling`` SUM/MEAN become the combiners ``sum``/``mean``
    (an ``EmbeddingConfig``, unpooled, ``none``); ``data_type`` FP32/FP16/BF16; the initializer is
    TorchRec's: ``weight_init_min``/``weight_init_max`` when given, else its default
    ``uniform(-sqrt(1 / rows), sqrt(1 / rows))`` (the same distribution; the values themselves are
    hybridembed's row-keyed ones).

    >>> from types import SimpleNamespace as C
    >>> tables, features = tables_from_torchrec([C(name="t", num_embeddings=100, embedding_dim=8, feature_names=["a", "b"])])
    >>> tables[0].combiner, features
    ('none', {'a': 't', 'b': 't'})
    """
    if isinstance(configs, (str, bytes)) or not isinstance(configs, Sequence):
        raise ConfigError(f"tables_from_torchrec takes a list of TorchRec table configs, got {type(configs).__name__}")
    tables: list[TableConfig] = []
    features: dict[str, str] = {}
    for c in configs:
        missing = [a for a in ("name", "num_embeddings", "embedding_dim", "feature_names") if not hasattr(c, a)]
        if missing:
            raise ConfigError(f"{type(c).__name__} is not a TorchRec table config: no {', '.join(missing)}")
        pooling = getattr(c, "pooling", None)
        key = str(getattr(pooling, "value", pooling)).upper() if pooling is not None else "NONE"
        if key not in _TORCHREC_POOLING:
            raise ConfigError(f"table {c.name!r}: pooling {pooling!r} has no hybridembed combiner (SUM, MEAN)")
        dt = getattr(c, "data_type", None)
        dname = str(getattr(dt, "value", dt)).upper() if dt is not None else "FP32"
        if dname not in _TORCHREC_DTYPES:
            raise ConfigError(f"table {c.name!r}: data_type {dt!r} is not one of FP32, FP16, BF16")
        lo, hi = getattr(c, "weight_init_min", None), getattr(c, "weight_init_max", None)
        if lo is None or hi is None:
            bound = math.sqrt(1.0 / max(int(c.num_embeddings), 1))
            lo, hi = -bound if lo is None else lo, bound if hi is None else hi
        tables.append(
            TableConfig(
                str(c.name),
                int(c.num_embeddings),
                int(c.embedding_dim),
                combiner=_TORCHREC_POOLING[key],
                dtype=_TORCHREC_DTYPES[dname],
                init=_init.uniform(float(lo), float(hi)),
            )
        )
        for f in c.feature_names:
            if f in features:
                raise ConfigError(f"feature {f!r} reads tables {features[f]!r} and {c.name!r}; a feature reads one")
            features[str(f)] = str(c.name)
    return tables, features
