"""A model's embedding collections made sharded: the steps :func:`hybridembed.distribute` takes
for each collection, below the verb (a parameter server's setup takes them too).

- :func:`shard_collection`: the :class:`ShardedCollection` of an ``EmbeddingCollection`` (this
  rank's shards, its rows copied from the collection's, or made by the row-keyed init when the
  collection was built on the meta device);
- :func:`swap_collection`: put it wherever the old one sits in the model, converted layers
  included;
- :func:`rows_device`: where a rank keeps its rows; :func:`unwrap`: the model inside DDP.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..errors import ConfigError
from ..modules import EmbeddingCollection
from ..modules.converted import ConvertedCollection, _TableLayer
from ..modules.grouped import LookupQueue
from .plan import Plan
from .runtime import ShardedCollection
from .sharded import ShardedTables

__all__ = ["shard_collection", "swap_collection", "rows_device", "unwrap"]


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside a ``DistributedDataParallel`` wrapper (the model itself otherwise)."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def rows_device(model: nn.Module, ec: EmbeddingCollection) -> torch.device:
    """Where a rank keeps the rows of ``ec``'s tables (its shards, or a trainer's pulled rows):
    beside the tables, or, for tables built on the meta device (no rows allocated: each rank
    makes only its shards), beside the model's dense parameters (the CPU if it has none)."""
    device = ec.storages[0].weight.device
    if device.type != "meta":
        return device
    return next((p.device for p in model.parameters() if p.device.type != "meta"), torch.device("cpu"))


def shard_collection(
    ec: EmbeddingCollection,
    plan: Plan | None,
    group,
    reduction: str,
    dedup: bool,
    budget,
    where: torch.device | None = None,
    timeout=None,
    wire: str | None = None,
) -> ShardedCollection:
    device = ec.storages[0].weight.device
    if device.type == "meta":  # built without rows: each shard starts from the row-keyed init alone
        weights = {}
        device = where if where is not None else torch.device("cpu")
    else:
        weights = {n: ec.weight(n) for n, t in ec.tables.items() if t.dynamic is None}
    sharded = ShardedCollection(
        list(ec.tables.values()),
        ec.features,
        plan,
        process_group=group,
        seed=ec.seed,
        device=device,
        sequence_output=ec.sequence_output,
        pad=ec.pad,
        reduction=reduction,
        weights=weights,
        dedup=dedup,
        memory_per_rank=budget,
        kernels=getattr(ec, "kernels", "auto"),
        timeout=timeout,
        wire=wire,
    )
    sharded.train(ec.training)
    return sharded


def swap_collection(model: nn.Module, old: EmbeddingCollection, new: ShardedTables) -> None:
    """Put ``new`` wherever ``old`` is registered, and point converted layers at it."""
    for _, parent in model.named_modules(remove_duplicate=False):
        for name, child in list(parent._modules.items()):
            if child is old:
                parent._modules[name] = new
        if isinstance(parent, _TableLayer) and parent.collection is old:
            parent.__dict__["_collection"] = new
            new.layers_hold_keys = True  # (a converted model: its layers write the tables' state_dict entries)
    if isinstance(old, ConvertedCollection) and old.lookup_queue is not None:
        new.lookup_queue = LookupQueue(new)
    if model is old:
        raise ConfigError("distribute a model holding the EmbeddingCollection, not the collection itself")
    torch.nn.Module.train(new, old.training)
