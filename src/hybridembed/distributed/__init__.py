"""Hybrid-parallel training over ``torch.distributed``: plans, sharded tables, the runtime."""

from .plan import PLACEMENTS, SHARDING_TYPES, Plan, Shard, TablePlan, register_sharding, shard_table
from .planner import make_plan, plan_costs
from .runtime import ShardedCollection
from .shard import unwrap
from .sharded import ShardedTables


def __getattr__(name: str):
    if name == "distribute":  # (the verb lives with the others, in hybridembed.api: imported when asked for)
        from ..api.distribute import distribute

        return distribute
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ShardedCollection",
    "ShardedTables",
    "distribute",
    "make_plan",
    "plan_costs",
    "unwrap",
    "PLACEMENTS",
    "SHARDING_TYPES",
    "Plan",
    "Shard",
    "TablePlan",
    "register_sharding",
    "shard_table",
]
