"""Hybrid-parallel training over ``torch.distributed``: plans, sharded tables, the runtime."""

from .api import distribute, unwrap
from .plan import PLACEMENTS, SHARDING_TYPES, Plan, Shard, TablePlan, register_sharding, shard_table
from .planner import make_plan, plan_costs
from .runtime import ShardedCollection

__all__ = [
    "ShardedCollection",
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
