"""The trainer's rows on the parameter servers: :class:`RemoteStorage` (the storage protocol
over pulls and pushes; its connection is :mod:`hybridembed.ps.client`, its hot-row cache
:mod:`hybridembed.ps.cache`) inside the model's embedding module on a trainer,
:class:`~hybridembed.ps.collection.PSCollection`.

Shape legend: ``N`` ids of a group's batch, ``U`` distinct (table, id) pairs, ``D`` dim,
``C`` cached rows.

A trainer's :class:`PSCollection` holds an ordinary :class:`~hybridembed.EmbeddingCollection`
of the whole tables whose storages are :class:`RemoteStorage`: validation, grouping (one
kernel call per group), combiners, per-id weights, shared tables and sequence outputs are
the single-process code. Only the rows differ: a group's lookup sends its distinct ids to
the servers that own them (one message per server for all the groups of a call) and pools
the rows that come back; the optimizer step sends each server the summed gradient of the
rows it owns, and the server applies the optimizer (:mod:`hybridembed.ps.server`).

The hot-row cache (asynchronous mode, ``cache_rows=C``) keeps up to C rows on the trainer,
least recently used out first. A cached row is served for ``staleness`` steps after it was
pulled, then pulled again; the gradients of cached rows are summed on the trainer and
written back when the row leaves the cache (after ``staleness`` steps at most, or when
evicted, or before a checkpoint), so neither a row read nor a gradient pushed is more than
``staleness`` steps late. Synchronous mode has no cache: every row a training step reads was
updated by the step before it on some trainer, so a cache there could only serve stale rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from .. import init as _init
from ..config import TableConfig
from ..errors import HybridEmbedError
from ..input import Jagged
from ..kernels import cpu_fused
from ..modules import EmbeddingCollection
from ..storage import RowStorage
from ..storage.protocol import LookupPlan
from . import wire
from .cache import RowCache
from .client import Client, Pull

__all__ = ["RemoteCollection", "RemoteStorage"]


def _no_rows(what: str) -> HybridEmbedError:
    return HybridEmbedError(
        f"{what}: this table's rows live on the parameter servers; read one with "
        "PSCollection.gather_table(name), or save a checkpoint (he.save; it loads in one process too)"
    )


class RemoteStorage(RowStorage):
    """The :class:`~hybridembed.storage.Storage` of a group whose rows live on parameter servers.

    ``weight`` holds only the rows this trainer pulled for the current step (and, with a
    cache, the cached rows first): a lookup's :meth:`resolve` plans a pull of its distinct
    ids, and the commit of the first group of a call sends every group's pulls (one message
    per server) and places the rows that come back. The gradient reaches ``weight.grad`` as
    usual; :class:`PSCollection.before_sparse_step` turns its rows back into (table, id)
    pairs and pushes them, so :meth:`apply_gradient` is never called here.
    """

    remote = True

    def __init__(self, tables: Sequence[TableConfig], seed: int = 0, device: torch.device | str | None = None):
        super().__init__()
        self.tables = list(tables)
        t0 = self.tables[0]
        self.keyed = t0.dynamic is not None
        self.kind = "dynamic" if self.keyed else "dense"
        self.dim, self.dtype, self.compute_dtype = t0.embedding_dim, t0.dtype, t0.compute_dtype
        offsets, total = {}, 0
        for t in self.tables:
            offsets[t.name] = 0 if self.keyed else total
            total += 0 if self.keyed else t.num_embeddings
        self.row_offset = offsets
        self.table_index = {t.name: i for i, t in enumerate(self.tables)}
        self.num_rows = total
        self.weight = nn.Parameter(torch.zeros(0, self.dim, dtype=self.dtype, device=device))
        self._starts = torch.tensor([offsets[t.name] for t in self.tables], dtype=torch.int64)
        salts = _init.mix64(torch.arange(1, len(self.tables) + 1, dtype=torch.int64) * 7919)
        self._salt = salts if self.keyed else None
        self.client: Client | None = None
        self.group = -1
        self.staleness = 1
        self._staged_ids = torch.zeros(0, dtype=torch.int64)  # per weight row: its id and table
        self._staged_tabs = torch.zeros(0, dtype=torch.int64)
        self._prefetched: Pull | None = None
        self._pending = False  # rows staged by a lookup with autograd since the last step
        self.cache: RowCache | None = None
        self.counters = {"lookups": 0, "pulled": 0, "cache_hits": 0, "prefetch_hits": 0, "prefetch_misses": 0}

    grad_sink = property(lambda self: self.accumulate_grad)

    # --- the lookup -----------------------------------------------------------------------------
    def _distinct(self, ids: torch.Tensor, tables: Sequence[int], counts: Sequence[int]):
        """(N,) ids -> (keys (U,) ascending, inverse (N,), ids (U,), table indices (U,), times seen (U,))."""
        n = ids.numel()
        if len(tables) == 1:
            tabs = torch.full((n,), tables[0], dtype=torch.int64)
        else:
            tabs = torch.repeat_interleave(torch.tensor(tables, dtype=torch.int64), torch.tensor(counts), output_size=n)
        keys = ids if not self.keyed else ids ^ self._salt.index_select(0, tabs)
        got = None if self.keyed else cpu_fused.distinct_rows(keys, self.num_rows)  # (no sort)
        if got is not None:
            uniq, inv, first = got
        else:
            uniq, inv = torch.unique(keys, return_inverse=True)
            first = torch.full((uniq.numel(),), n, dtype=torch.int64).scatter_reduce_(0, inv, torch.arange(n), "amin")
        u = uniq.numel()
        utab = tabs.index_select(0, first)
        if self.keyed:
            uid = ids.index_select(0, first)
            if n and not bool(torch.equal(tabs, utab.index_select(0, inv))):  # two tables' ids share a key
                return self._distinct_exact(ids, tabs)
        else:
            uid = uniq - self._starts.index_select(0, utab)
        seen = torch.bincount(inv, minlength=u) if self.keyed else None
        return uniq, inv, uid, utab, seen

    def _distinct_exact(self, ids: torch.Tensor, tabs: torch.Tensor):
        o = torch.argsort(ids, stable=True)
        o = o.index_select(0, torch.argsort(tabs.index_select(0, o), stable=True))
        si, st = ids.index_select(0, o), tabs.index_select(0, o)
        new = torch.ones(ids.numel(), dtype=torch.bool)
        new[1:] = (si[1:] != si[:-1]) | (st[1:] != st[:-1])
        group = torch.cumsum(new, 0) - 1
        inv = torch.empty_like(group).index_copy_(0, o, group)
        uid, utab = si[new], st[new]
        keys = uid ^ self._salt.index_select(0, utab)
        return keys, inv, uid, utab, torch.bincount(inv, minlength=uid.numel())

    def resolve(self, ids: torch.Tensor, tables: Sequence[int], counts: Sequence[int], train: bool) -> LookupPlan:
        if self.client is None:
            raise HybridEmbedError("this RemoteStorage is not connected to parameter servers")
        dev = self.weight.device
        if ids.device.type != "cpu":  # (ids and rows cross in host memory; slots go back to the device)
            plan = self.resolve(ids.cpu(), tables, counts, train)
            return LookupPlan(lambda: (plan.commit()[0].to(dev), None), plan.rollback)
        pre = self._prefetched
        self._prefetched = None
        if pre is not None:  # the same lookup as the prefetched one (ids, tables, counts): its rows
            same = pre.train == train and pre.step == self.client.step and pre.ask == (list(tables), list(counts))
            if same and torch.equal(pre.raw, ids):
                self.counters["prefetch_hits"] += 1
                self.counters["lookups"] += pre.ids.numel()
                return LookupPlan(lambda: self._stage(pre, pre.inv), lambda: None)
            self.counters["prefetch_misses"] += 1
            self.client.complete(pre)  # (its reply is read and dropped)
        keys, inv, uid, utab, seen = self._distinct(ids, tables, counts)
        self.counters["lookups"] += uid.numel()
        if self.cache is not None and train:
            return self.cache.resolve(keys, inv, uid, utab, seen)
        pull = Pull(self, uid, utab, seen, train, self.client.step)
        self.client.queue(pull)
        return LookupPlan(lambda: self._stage(pull, inv), lambda: self.client.drop(pull))

    def _stage(self, pull: Pull, inv: torch.Tensor) -> tuple[torch.Tensor, None]:
        rows = self.client.complete(pull)
        self.counters["pulled"] += pull.ids.numel()
        base = self.append(rows, pull.ids, pull.tabs)
        return (inv + base if base else inv), None

    def append(self, rows: torch.Tensor, ids: torch.Tensor, tabs: torch.Tensor) -> int:
        """Rows (K, D) of (``ids``, ``tabs``) after the cached and staged ones; returns their first
        slot. Lookups without autograd (eval) replace the previous ones unless a gradient may
        still come for those (a lookup with autograd since the last step)."""
        keep = self.cache.size if self.cache is not None else 0
        if not self._pending:
            self._truncate(keep)
        if torch.is_grad_enabled():
            self._pending = True
        base = self.weight.shape[0]
        rows = rows.to(self.weight.device)  # (pulled into host memory; kept beside the model)
        with torch.no_grad():
            self.weight.data = torch.cat([self.weight.data, rows]) if base else rows
        self._staged_ids = torch.cat([self._staged_ids, ids])
        self._staged_tabs = torch.cat([self._staged_tabs, tabs])
        return base

    def _truncate(self, keep: int) -> None:
        with torch.no_grad():
            self.weight.data = self.weight.data[:keep]
        self._staged_ids = self._staged_ids[:keep]
        self._staged_tabs = self._staged_tabs[:keep]

    def prefetch(self, ids: torch.Tensor, tables: Sequence[int], counts: Sequence[int], train: bool) -> None:
        """Send the pull of the next step's lookup now; :meth:`resolve` takes its rows if the
        lookup asks for the same ids (else they are dropped)."""
        if self.cache is not None or self.client is None:
            return
        _, inv, uid, utab, seen = self._distinct(ids, tables, counts)
        pull = Pull(self, uid, utab, seen, train, self.client.step + 1)
        pull.raw, pull.inv, pull.ask = ids, inv, (list(tables), list(counts))
        old, self._prefetched = self._prefetched, pull
        if old is not None:
            self.client.complete(old)
        self.client.queue(pull)
        self.client.send_queued()

    def take_gradient(self, rows: tuple[torch.Tensor, torch.Tensor] | None) -> tuple:
        """This step's reduced gradient ``(slots (U,), rows (U, D))`` -> ``(ids, table indices,
        rows)`` to push now (cached rows' are kept for write-back)."""
        empty = (torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64), None)
        if self.cache is not None:
            return self.cache.take(rows)
        if rows is None:
            return empty
        slots, grad = rows[0].cpu(), rows[1].cpu()
        return self._staged_ids.index_select(0, slots), self._staged_tabs.index_select(0, slots), grad

    def after_step(self) -> None:
        """The step's pulled rows are dropped (the cache's stay)."""
        self._truncate(self.cache.size if self.cache is not None else 0)
        self.weight.grad = None
        self._pending = False

    def reset(self) -> None:
        """Forget every pulled and cached row (after a checkpoint is loaded)."""
        if self.cache is not None:
            self.cache.clear()
        self._prefetched = None
        self._truncate(self.cache.size if self.cache is not None else 0)
        self.weight.grad = None
        self._pending = False

    # --- the optimizer -----------------------------------------------------------------------
    def attach_optimizer(self, optimizer, hparams: dict) -> None:
        """The servers allocate the optimizer's state beside their rows (one call per server)."""
        self.optimizer, self.hparams, self.step, self.state = optimizer, hparams, 0, {}
        if self.client is None:
            return
        hp = {k: v for k, v in optimizer.hparams.items()}
        for server in self.client.links:
            self.client.call(
                server, wire.ATTACH, meta={"group": self.group, "optimizer": optimizer.name, "hparams": hp}
            )

    def hparams_now(self) -> dict:
        return {k: v for k, v in self.hparams.items() if k in self.optimizer.hparams}

    def apply_gradient(self, ids, grad, hparams, row_stat=None) -> None:
        raise HybridEmbedError("a remote storage's rows are updated by its parameter servers (pushed gradients)")

    # --- what lives on the servers -------------------------------------------------------------
    def table_ids(self, name: str):
        raise _no_rows(f"table {name!r}")

    def table_state(self, name: str):
        raise _no_rows(f"table {name!r}")

    def load_table_state(self, name, ids, state):
        raise _no_rows(f"table {name!r}")

    def read_range(self, table, row_start, row_stop, col_start=0, col_stop=None):
        raise _no_rows(f"table {table!r}")

    def write_range(self, table, row_start, data, col_start=0):
        raise _no_rows(f"table {table!r}")

    def read_ids(self, table):
        raise _no_rows(f"table {table!r}")

    def write_ids(self, table, ids, rows, state=None):
        raise _no_rows(f"table {table!r}")

    def table_rows(self, name):
        raise _no_rows(f"table {name!r}")

    def table_slots(self, name):
        raise _no_rows(f"table {name!r}")

    def stats(self, table: str | None = None) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.counters)
        out["rows"] = int(self.weight.shape[0])
        out["memory_bytes"] = self.memory_bytes
        if self.cache is not None:
            out.update(self.cache.stats())
        return out

    def extra_repr(self) -> str:
        names = ", ".join(t.name for t in self.tables)
        cache = f", cache={self.cache.size}" if self.cache is not None else ""
        return f"tables=[{names}], dim={self.dim}, remote{cache}"


class RemoteCollection(EmbeddingCollection):
    """An EmbeddingCollection whose storages are :class:`RemoteStorage` (every lookup resolves
    through the storage: no direct read of ``weight``)."""

    def _make_storage(self, tables: list[TableConfig], device) -> RowStorage:
        return RemoteStorage(tables, seed=self.seed, device=device)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        return  # (its PSCollection writes the tables, pulled from the servers)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        return  # (refused by its PSCollection or the converted layers)

    def _lookup_dense(self, feat, j: Jagged) -> torch.Tensor:
        jagged = {feat.name: j}
        batch = self._assemble(self.storages[feat.group], [feat], [], jagged)
        self._validate([batch], jagged)
        return self._run_groups([batch], jagged)[feat.name]
