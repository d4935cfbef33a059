"""What every sharded embedding module of a job shares: :class:`ShardedTables`, the tables, the
features and the plan (checked, and compared across ranks), a :class:`~hybridembed.distributed.routes.Route`
per table, and the job's exchange group. Two kinds build on it: the collective runtime's
:class:`~hybridembed.distributed.ShardedCollection` (every rank holds shards) and a parameter
server's trainer, :class:`~hybridembed.ps.PSCollection` (its rows on the servers). The
checkpoints, the export and ``distribute`` find both by this class.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..config import TableConfig
from ..errors import ConfigError, HybridEmbedError
from ..modules.collection import check_arguments
from . import health
from .plan import Plan, Shard
from .planner import checked_plan
from .routes import Route, route_for

__all__ = ["ShardedTables", "REDUCTIONS"]

REDUCTIONS = ("mean", "sum")
WIRES = {None: None, "bf16": torch.bfloat16}  # the rows' and row gradients' format in the exchange


MODEL_HINT = (
    "every rank builds the whole model, every table the same way (on device='meta' to allocate nothing), and "
    "he.distribute keeps this rank's shards"
)


class ShardedTables(nn.Module):
    """The tables of one sharded module of a job, placed by ``plan`` over ``process_group``.

    Every rank builds it with the same arguments, at once: they are checked first (a rank that
    refuses, here or in the subclass's own checks passed as ``problem``, makes every rank
    refuse), then compared across ranks (the first difference is named). It makes the group
    the job's exchange runs on (every rank of ``process_group`` takes part in making it).
    """

    sharded = True
    lookup_queue = None  # set by distribute on a converted model (one exchange per forward)
    layers_hold_keys = False  # set when converted layers read these tables (they write their state_dict entries)

    def __init__(
        self,
        tables: Sequence[TableConfig],
        features: Mapping[str, str] | None,
        plan: Plan | None,
        *,
        process_group: dist.ProcessGroup | None = None,
        seed: int = 0,
        sequence_output: str = "jagged",
        pad: int = -1,
        reduction: str = "mean",
        memory_per_rank: int | None = None,
        timeout: float | datetime.timedelta | None = None,
        problem: HybridEmbedError | None = None,
        wire: str | None = None,
    ):
        super().__init__()
        if not dist.is_available() or not dist.is_initialized():
            if problem is not None:  # (the arguments' own refusal first: no other rank to tell)
                raise problem
            raise ConfigError(
                "sharded tables need an initialised torch.distributed process group: call "
                "torch.distributed.init_process_group(...) first (torchrun sets the environment), "
                "or use he.convert for one process"
            )
        group = process_group if process_group is not None else dist.group.WORLD
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        try:  # (every check before the first collective: a rank that refuses tells the others in _agree)
            timeout = health.as_timeout(timeout)
            if reduction not in REDUCTIONS:
                raise ConfigError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
            check_wire(wire)
            tables = list(tables)
            _check_like_collection(tables, features, seed, pad, sequence_output)
            plan = checked_plan(plan, tables, self.world_size, memory_per_rank)
        except HybridEmbedError as e:
            problem = problem or e
        self._agree(group, problem, tables, features, seed, reduction, plan, wire)
        self.tables: dict[str, TableConfig] = {t.name: t for t in tables}
        self.features: dict[str, str] = dict(features) if features is not None else {n: n for n in self.tables}
        self.seed, self.pad, self.sequence_output, self.reduction = int(seed), int(pad), sequence_output, reduction
        self.plan = plan
        # the exchange runs on a group of its own, so DDP's all-reduce of dense gradients never
        # waits in line behind it (and the other way round); its timeout is the job's (or `timeout`)
        ranks = dist.get_process_group_ranks(group) if process_group is not None else list(range(self.world_size))
        self.__dict__["_group"] = health.new_group(ranks, timeout or health.job_timeout(group))
        health.heartbeat()
        self._routes: dict[str, Route] = {tp.table: route_for(tp, self.tables[tp.table]) for tp in plan.tables}
        dtypes = {t.compute_dtype for t in tables}
        self._wire = torch.float64 if torch.float64 in dtypes else torch.float32  # rows on the wire
        self.wire = wire  # ("bf16": rows and row gradients cross as bfloat16; see check_wire)

    def _agree(self, group, problem, tables, features, seed, reduction, plan, wire=None) -> None:
        """Every rank must shard the same tables by the same plan: compared once, here (and a rank
        that refused its arguments makes every rank refuse)."""
        mine = None
        if problem is None:
            mine = {
                "tables": {t.name: _describe(t) for t in tables},
                "features": dict(features) if features is not None else {t.name: t.name for t in tables},
                "seed": int(seed),
                "reduction": reduction,
                "wire": wire,
                "plan": plan.to_dict() | {"notes": {}},
            }
            mine = json.loads(json.dumps(mine, default=str))  # (in this order: the first difference is the first cause)
        health.agree(group, "the model", problem, mine, hint=MODEL_HINT)

    # --- inspection -------------------------------------------------------------------------
    @property
    def process_group(self) -> dist.ProcessGroup:
        """The process group of this collection's exchanges (its own; the same ranks as the
        group it was built over)."""
        return self._group

    def routes(self) -> dict[str, Route]:
        """``{table: its Route}``: how each table's lookups cross its shards (read-only)."""
        return dict(self._routes)

    def _positions_here(self, route: Route) -> list[int]:
        return [pos for pos, (_, s) in enumerate(route.shards) if s.rank == self.rank]

    def shards_here(self) -> list[tuple[str, int, Shard, str]]:
        """This rank's shards: (table, shard index in its plan, :class:`Shard`, the local table's
        name in ``self.local``); replicated tables are in ``self.replicated``."""
        return [
            (name, route.shards[pos][0], route.shards[pos][1], route.local_name(pos))
            for name, route in self._routes.items()
            if not route.replicated
            for pos in self._positions_here(route)
        ]

    @property
    def storages(self) -> list:
        """This rank's storages of these tables."""
        raise NotImplementedError


def _describe(t: TableConfig) -> dict[str, Any]:
    return {
        "rows": t.num_embeddings,
        "dim": t.embedding_dim,
        "combiner": t.combiner,
        "dtype": str(t.dtype),
        "init": repr(t.init),
        "optimizer": repr(t.optimizer),
        "dynamic": repr(t.dynamic),
    }


def _check_like_collection(tables, features, seed, pad, sequence_output) -> None:
    """The checks :class:`EmbeddingCollection` makes of its arguments, and '@' kept for shard names."""
    features = check_arguments(tables, features, seed, pad, sequence_output)
    for what, names in (("table name", [t.name for t in tables]), ("feature", list(features))):
        bad = [n for n in names if "@" in n]
        if bad:
            raise ConfigError(f"{what} {bad[0]!r}: '@' is reserved for shard names in a sharded collection")


def check_wire(wire: str | None) -> torch.dtype | None:
    """The exchange's format of rows and row gradients: ``None`` (default: the tables' own dtype,
    exact) or ``"bf16"`` (bfloat16: half the bytes of float32; each element that crosses is rounded
    to 8 significant bits, a relative error of at most 2**-8 = 0.39% of that element; a row's
    gradient, the sum of its bags' gradients each so rounded, is off by at most 2**-8 times the
    sum of their magnitudes). Returns the dtype to send in (None: unchanged)."""
    if not (wire is None or isinstance(wire, str)) or wire not in WIRES:
        raise ConfigError(f"wire must be None (the tables' own dtype) or 'bf16', got {wire!r}")
    return WIRES[wire]
