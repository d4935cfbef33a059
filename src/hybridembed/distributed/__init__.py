"""Hybrid-parallel training over ``torch.distributed``: plans, sharded tables, the runtime."""

from .plan import PLACEMENTS, SHARDING_TYPES, Plan, Shard, TablePlan, register_sharding, shard_table

__all__ = ["PLACEMENTS", "SHARDING_TYPES", "Plan", "Shard", "TablePlan", "register_sharding", "shard_table"]
