"""Hybrid-parallel training over ``torch.distributed``: plans, sharded tables, the runtime."""

from .api import distribute, unwrap
from .plan import PLACEMENTS, SHARDING_TYPES, Plan, Shard, TablePlan, register_sharding, shard_table
from .runtime import ShardedCollection

__all__ = [
    "ShardedCollection",
    "distribute",
    "unwrap",
    "PLACEMENTS",
    "SHARDING_TYPES",
    "Plan",
    "Shard",
    "TablePlan",
    "register_sharding",
    "shard_table",
]
