"""The ``state_dict`` side of a sharded collection (:class:`ShardedEntries`, a base of
:class:`~hybridembed.distributed.ShardedCollection`): the whole model's keys with sharded values
(``torch.distributed.checkpoint`` reshards them), and loading either those or a one-process
model's whole tables.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from ..storage import serial

__all__ = ["ShardedEntries"]


def _is_sharded(x: Any) -> bool:
    return type(x).__name__ == "ShardedTensor"


class ShardedEntries:
    """Reads the collection's ``tables``, routes, ``local``, ``replicated``, group and device."""

    # --- state_dict: the whole model's keys, sharded values (torch.distributed.checkpoint) ----------
    def table_entry(self, name: str) -> dict[str, Any]:
        """Table ``name``'s ``state_dict`` entry on this rank, under the unsharded table's keys
        where a sharded value can say what it holds: ``{"weight": ShardedTensor}`` of the whole
        (rows, dim) table with this rank's shards as its local shards (views of the rows: a
        ``torch.distributed.checkpoint.load`` writes into them), for table-wise, column-wise and
        block row-wise tables; ``{"weight": (rows, dim)}`` for a replicated one (every rank the
        same: DCP writes it once). Tables a rectangle cannot describe (``mod`` row placement,
        dynamic tables) keep their shards' own entries, ``{"shard<i>.<key>": ...}``: saved and
        loaded at this plan, not resharded by DCP (``he.save`` / ``he.load`` reshard them).
        Builds no collective: any rank may call it alone."""
        t, route = self.tables[name], self._routes[name]
        if route.replicated:
            return serial.table_entry(self.replicated.storage_of(name), name)
        spans = [route.span(pos) for pos in range(len(route))]
        if t.dynamic is not None or any(sp.rows is None or sp.rows.step != 1 for sp in spans if len(sp.rows or ()) > 1):
            return {
                f"shard{route.shards[pos][0]}.{k}": v
                for pos in self._positions_here(route)
                for k, v in serial.table_entry(
                    self.local.storage_of(route.local_name(pos)), route.local_name(pos)
                ).items()
            }
        from torch.distributed._shard.metadata import ShardMetadata
        from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
        from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

        def meta(pos: int) -> ShardMetadata:  # (ShardedTensor places shards by the job's global ranks)
            sp, owner = spans[pos], dist.get_global_rank(self._group, route.shards[pos][1].rank)
            return ShardMetadata(
                [sp.rows.start, sp.cols.start], [len(sp.rows), len(sp.cols)], f"rank:{owner}/{self._device}"
            )

        local = [Shard(self.local.weight(route.local_name(pos)), meta(pos)) for pos in self._positions_here(route)]
        dtype = t.dtype
        props = TensorProperties(dtype=dtype, layout=torch.strided, requires_grad=False, memory_format=torch.contiguous_format, pin_memory=False)  # fmt: skip
        glob = ShardedTensorMetadata([meta(pos) for pos in range(len(route))], torch.Size([t.num_embeddings, t.embedding_dim]), props)  # fmt: skip
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # (ShardedTensor: what DCP reshards uneven shards with)
            st = ShardedTensor._init_from_local_shards_and_global_metadata(local, glob, process_group=self._group)
        return {"weight": st}

    def load_table_entry(self, name: str, entry: Mapping[str, Any], where: str, errors: list[str]) -> None:
        """Loads table ``name`` from ``entry`` (keys as :meth:`table_entry` writes them; or a whole
        (rows, dim) ``weight``, e.g. a one-process model's, of which this rank copies its shards'
        slices), appending what does not fit to ``errors`` (named by ``where``)."""
        t, route = self.tables[name], self._routes[name]
        if route.replicated:
            storage = self.replicated.storage_of(name)
            lacking, problems = serial.check_entry(storage, name, dict(entry), where)
            errors.extend([f"missing {k}" for k in lacking] + problems)
            if not lacking and not problems:
                serial.load_entry(storage, name, dict(entry))
            return
        w = entry.get("weight")
        with torch.no_grad():
            if isinstance(w, torch.Tensor) and not _is_sharded(w) and t.dynamic is None:
                if tuple(w.shape) != (t.num_embeddings, t.embedding_dim):
                    errors.append(
                        f"{where}weight: shape {tuple(w.shape)}, the table is {(t.num_embeddings, t.embedding_dim)}"
                    )
                    return
                for pos in self._positions_here(route):
                    sp, local = route.span(pos), route.local_name(pos)
                    rows = w[sp.rows.start : sp.rows.stop : sp.rows.step, sp.cols.start : sp.cols.stop]
                    serial.load_entry(self.local.storage_of(local), local, {"weight": rows})  # (rows marked changed)
                return
            if _is_sharded(w):
                mine = {(s.metadata.shard_offsets[0], s.metadata.shard_offsets[1]): s.tensor for s in w.local_shards()}
                for pos in self._positions_here(route):
                    sp = route.span(pos)
                    got = mine.get((sp.rows.start, sp.cols.start))
                    ours = self.local.weight(route.local_name(pos))
                    if got is None or tuple(got.shape) != tuple(ours.shape):
                        errors.append(
                            f"{where}weight: a ShardedTensor of another plan; load it with torch.distributed.checkpoint.load into this model's own state_dict()"
                        )
                        return
                    local = route.local_name(pos)
                    if got.data_ptr() != ours.data_ptr():
                        serial.load_entry(self.local.storage_of(local), local, {"weight": got})
                    else:  # (DCP wrote into the rows themselves: count them changed for incremental saves)
                        storage = self.local.storage_of(local)
                        storage._mark_span(*storage._rows_of(local))
                return
            for pos in self._positions_here(route):  # (the shards' own entries)
                local = route.local_name(pos)
                part = {
                    k.split(".", 1)[1]: v for k, v in entry.items() if k.startswith(f"shard{route.shards[pos][0]}.")
                }
                storage = self.local.storage_of(local)
                lacking, problems = serial.check_entry(storage, local, part, f"{where}shard{route.shards[pos][0]}.")
                errors.extend([f"missing {where}shard{route.shards[pos][0]}.{k}" for k in lacking] + problems)
                if not lacking and not problems:
                    serial.load_entry(storage, local, part)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        if self.layers_hold_keys:  # (a converted model: each layer writes its table under its own key)
            return
        for name in self.tables:
            for k, v in self.table_entry(name).items():
                destination[f"{prefix}{name}.{k}"] = v

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        if self.layers_hold_keys:
            return
        for name in self.tables:
            head = f"{prefix}{name}."
            entry = {k[len(head) :]: v for k, v in state_dict.items() if k.startswith(head)}
            if not entry:
                missing.append(f"{head}weight")
                continue
            self.load_table_entry(name, entry, head, errors)
