"""The trainer's side of the parameter servers: :class:`RemoteStorage` (the storage protocol
over pulls and pushes) and :class:`PSCollection` (the model's embedding module on a trainer).

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

import atexit
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from .. import init as _init
from ..checkpoint.participant import CheckpointParticipant
from ..config import TableConfig
from ..distributed import health
from ..distributed.routes import assemble
from ..distributed.runtime import ShardedCollection
from ..errors import ConfigError, HybridEmbedError
from ..input import Jagged
from ..modules import EmbeddingCollection
from ..storage import RowStorage
from ..storage.protocol import LookupPlan
from . import wire
from .server import ShardRef, shard_index, trainer_groups
from .transport import TrainerLink
from .wire import Message

__all__ = ["RemoteStorage", "PSCollection", "MODES"]

MODES = ("sync", "async")
_TRAIN = 1


def _no_rows(what: str) -> HybridEmbedError:
    return HybridEmbedError(
        f"{what}: this table's rows live on the parameter servers; read one with "
        "PSCollection.gather_table(name), or save a checkpoint (he.save; it loads in one process too)"
    )


class _Pull:
    """One group's pull: distinct (table index, id) pairs, the rows once they arrive."""

    def __init__(self, storage: RemoteStorage, ids, tabs, seen, train: bool, step: int):
        self.storage, self.ids, self.tabs, self.seen, self.train, self.step = storage, ids, tabs, seen, train, step
        self.rows: torch.Tensor | None = None
        self.sent = False
        self.raw: torch.Tensor | None = None  # prefetch: the lookup it answers (ids, inverse, tables and counts)
        self.inv: torch.Tensor | None = None
        self.ask: tuple[list, list] | None = None


class _Client:
    """A trainer's links to the servers: requests, their replies, the step count."""

    def __init__(self, links: dict[int, TrainerLink], refs: list[ShardRef], routes: dict, wire_dtype):
        self.links, self.refs, self.routes, self.wire_dtype = links, refs, routes, wire_dtype
        self.ref_of = {(r.table, r.pos): r for r in refs}
        self.step = 0
        self._req = 0
        self._queued: list[_Pull] = []
        self._waiting: dict[tuple[int, int], list] = {}  # (server, req) -> [(pull, shard, positions)]
        self._stash: dict[tuple[int, int], Message] = {}
        self.closed = False
        self.bytes_out = self.bytes_in = 0

    def req(self) -> int:
        self._req += 1
        return self._req

    # --- plain calls --------------------------------------------------------------------------
    def call(self, server: int, op: int, ints=None, floats=None, meta=None) -> Message:
        m = Message(op, self.req(), self.step, torch.zeros(0, dtype=torch.int64) if ints is None else ints, floats)
        m.meta = meta or {}
        self.links[server].send(m)
        return self.wait(server, m.req)

    def wait(self, server: int, req: int) -> Message:
        """The reply to ``req`` from ``server`` (replies to other requests are kept; an error
        reply to a push raises here: the push's step was not applied)."""
        key = (server, req)
        while key not in self._stash:
            m = self.links[server].recv()
            if m.op == wire.ERROR and m.meta.get("op") == "push":  # (a push has no other reply)
                raise HybridEmbedError(m.meta.get("error", f"server rank {server} refused a push"))
            self._stash[(server, m.req)] = m
        m = self._stash.pop(key)
        if m.op == wire.ERROR:
            raise HybridEmbedError(m.meta.get("error", f"server rank {server} answered with an error"))
        return m

    # --- routing ------------------------------------------------------------------------------
    def route(self, ids: torch.Tensor, tabs: torch.Tensor, names: list[str]) -> dict[int, list]:
        """Distinct (table index ``tabs``, id) pairs -> ``{server: [(shard, positions, local ids)]}``."""
        out: dict[int, list] = {}
        if ids.numel() == 0:
            return out
        order = torch.argsort(tabs, stable=True)
        per = torch.bincount(tabs, minlength=len(names)).tolist()
        start = 0
        for t, n in enumerate(per):
            if n == 0:
                continue
            pos = order[start : start + n]
            start += n
            name = names[t]
            route = self.routes[name]
            x = ids.index_select(0, pos)
            if len(route) == 1:  # (one shard holds every id: nothing to split)
                ref = self.ref_of[(name, 0)]
                out.setdefault(ref.rank, []).append((ref, pos, x))
                continue
            where, local = route.locate(x)
            o = torch.argsort(where, stable=True)
            for p, piece in enumerate(o.split(torch.bincount(where, minlength=len(route.shards)).tolist())):
                if piece.numel():
                    ref = self.ref_of[(name, p)]
                    out.setdefault(ref.rank, []).append((ref, pos.index_select(0, piece), local.index_select(0, piece)))
        return out

    # --- pulls --------------------------------------------------------------------------------
    def queue(self, pull: _Pull) -> None:
        self._queued.append(pull)

    def drop(self, pull: _Pull) -> None:
        if pull in self._queued:
            self._queued.remove(pull)

    def send_queued(self) -> None:
        """Every queued pull, as one message per (server, train flag, step)."""
        batches: dict[tuple[int, bool, int], list] = {}
        for pull in self._queued:
            names = [t.name for t in pull.storage.tables]
            for server, items in self.route(pull.ids, pull.tabs, names).items():
                for ref, pos, local in items:
                    seen = pull.seen.index_select(0, pos) if pull.seen is not None else None
                    batches.setdefault((server, pull.train, pull.step), []).append((pull, ref, pos, local, seen))
            pull.rows = torch.empty(pull.ids.numel(), pull.storage.dim, dtype=pull.storage.dtype)
            pull.sent = True
        self._queued = []
        for (server, train, step), items in batches.items():
            head = [int(train) * _TRAIN, len(items)]
            for _, ref, _, local, _ in items:
                head += [ref.index, local.numel()]
            ints = torch.cat(
                [
                    torch.tensor(head, dtype=torch.int64),
                    *(x[3] for x in items),
                    *(x[4] for x in items if x[4] is not None),
                ]
            )
            m = Message(wire.PULL, self.req(), step, ints)
            self.links[server].send(m)
            self._waiting[(server, m.req)] = [(pull, ref, pos) for pull, ref, pos, _, _ in items]

    def complete(self, pull: _Pull) -> torch.Tensor:
        """The rows of ``pull`` (sends what is queued, then waits for every reply it needs)."""
        if not pull.sent:
            self.send_queued()
        for key in [k for k, v in self._waiting.items() if any(p is pull for p, _, _ in v)]:
            self.receive(key)
        return pull.rows

    def receive(self, key: tuple[int, int]) -> None:
        items = self._waiting.pop(key)
        m = self.wait(*key)
        flat = m.floats if m.floats is not None else torch.zeros(0, dtype=self.wire_dtype)
        sizes = [pos.numel() * ref.width for _, ref, pos in items]
        if flat.numel() != sum(sizes):
            raise HybridEmbedError(f"server rank {key[0]} sent {flat.numel()} values, {sum(sizes)} expected")
        for (pull, ref, pos), part in zip(items, flat.split(sizes)):
            pull.rows.index_copy_(0, pos, part.view(-1, ref.width).to(pull.rows.dtype))

    def drain(self) -> None:
        """Receive every outstanding pull reply (before a checkpoint, a push of an error, bye)."""
        for key in list(self._waiting):
            self.receive(key)

    # --- pushes -------------------------------------------------------------------------------
    def push(self, items_by_server: dict[int, list], had: list[int], hp: dict[int, dict]) -> None:
        """One push per server (every server, every step: synchronous mode counts them)."""
        for server, link in self.links.items():
            items = items_by_server.get(server, [])
            head = [0, len(items)]
            for ref, local, _ in items:
                head += [ref.index, local.numel()]
            ints = torch.cat([torch.tensor(head, dtype=torch.int64), *(x[1] for x in items)])
            floats = torch.cat([x[2].reshape(-1).to(self.wire_dtype) for x in items]) if items else None
            m = Message(
                wire.PUSH, self.req(), self.step, ints, floats, {"had": had, "hp": {str(k): v for k, v in hp.items()}}
            )
            link.send(m)
        self.step += 1

    def bye(self, failed: str | None = None) -> None:
        _CLIENTS.discard(self)
        if self.closed:
            return
        self.closed = True
        for link in self.links.values():
            try:
                m = Message(wire.BYE, self.req(), self.step, torch.zeros(0, dtype=torch.int64), None)
                m.meta = {"failed": failed} if failed else {}
                link.send(m)
            except Exception:  # noqa: BLE001 - leaving: a dead server needs no goodbye
                pass
        for link in self.links.values():
            link.close()


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
        self.client: _Client | None = None
        self.group = -1
        self.mode, self.staleness = "sync", 1
        self._staged_ids = torch.zeros(0, dtype=torch.int64)  # per weight row: its id and table
        self._staged_tabs = torch.zeros(0, dtype=torch.int64)
        self._prefetched: _Pull | None = None
        self._pending = False  # rows staged by a lookup with autograd since the last step
        self.cache: _Cache | None = None
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
        uniq, inv = torch.unique(keys, return_inverse=True)
        u = uniq.numel()
        first = torch.full((u,), n, dtype=torch.int64).scatter_reduce_(0, inv, torch.arange(n), "amin")
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
        pull = _Pull(self, uid, utab, seen, train, self.client.step)
        self.client.queue(pull)
        return LookupPlan(lambda: self._stage(pull, inv), lambda: self.client.drop(pull))

    def _stage(self, pull: _Pull, inv: torch.Tensor) -> tuple[torch.Tensor, None]:
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
        with torch.no_grad():
            self.weight.data = torch.cat([self.weight.data, rows.to(self.weight.device)]) if base else rows
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
        pull = _Pull(self, uid, utab, seen, train, self.client.step + 1)
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


class _Cache:
    """The hot-row cache of one remote storage (asynchronous mode; see the module docstring).

    Slots ``0..C-1`` of the storage's ``weight`` are the cache; rows a step needs beyond them
    are staged after (pulled, pushed and dropped with the step)."""

    def __init__(self, storage: RemoteStorage, size: int):
        self.st, self.size = storage, int(size)
        c, d = self.size, storage.dim
        self.key = torch.zeros(c, dtype=torch.int64)
        self.id = torch.zeros(c, dtype=torch.int64)
        self.tab = torch.zeros(c, dtype=torch.int64)
        self.fetched = torch.full((c,), -1, dtype=torch.int64)  # step pulled; -1: free
        self.used = torch.full((c,), -1, dtype=torch.int64)
        self.grad = torch.zeros(c, d, dtype=storage.compute_dtype)
        self.dirty = torch.zeros(c, dtype=torch.bool)
        self.sorted_keys = torch.zeros(0, dtype=torch.int64)
        self.sorted_slots = torch.zeros(0, dtype=torch.int64)
        self.flush: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (ids, tabs, grads) to write back
        self.lookups = 0
        with torch.no_grad():  # (the rows on the model's device; the index and gradients in host memory)
            storage.weight.data = torch.zeros(c, d, dtype=storage.dtype, device=storage.weight.device)
        storage._staged_ids = torch.zeros(c, dtype=torch.int64)
        storage._staged_tabs = torch.zeros(c, dtype=torch.int64)

    def clear(self) -> None:
        self.fetched.fill_(-1)
        self.dirty.fill_(False)
        self.grad.zero_()
        self.flush = []
        self._reindex()

    def _reindex(self, added: torch.Tensor | None = None) -> None:
        """The sorted index after entries left (their slots free or given other keys) and the
        slots ``added`` got new keys: a filter and a merge, no sort of the whole index."""
        ks, ss = self.sorted_keys, self.sorted_slots
        if ss.numel():
            ok = (self.fetched.index_select(0, ss) >= 0) & (self.key.index_select(0, ss) == ks)
            if not bool(ok.all()):
                ks, ss = ks[ok], ss[ok]
        if added is not None and added.numel():
            nk, order = torch.sort(self.key.index_select(0, added))
            ns = added.index_select(0, order)
            m, k = ks.numel(), nk.numel()
            at_new = torch.searchsorted(ks, nk) + torch.arange(k)  # (keys are distinct)
            at_old = torch.arange(m) + torch.searchsorted(nk, ks)
            keys, slots = torch.empty(m + k, dtype=torch.int64), torch.empty(m + k, dtype=torch.int64)
            keys.index_copy_(0, at_old, ks).index_copy_(0, at_new, nk)
            slots.index_copy_(0, at_old, ss).index_copy_(0, at_new, ns)
            ks, ss = keys, slots
        self.sorted_keys, self.sorted_slots = ks, ss

    def _take_out(self, slots: torch.Tensor) -> None:
        """Entries ``slots`` leave the cache; their summed gradients are queued for write-back."""
        d = slots.index_select(0, self.dirty.index_select(0, slots).nonzero().squeeze(1))
        if d.numel():
            self.flush.append((self.id.index_select(0, d), self.tab.index_select(0, d), self.grad.index_select(0, d)))
            self.grad.index_fill_(0, d, 0)
            self.dirty.index_fill_(0, d, False)
        self.fetched.index_fill_(0, slots, -1)

    def resolve(self, keys, inv, uid, utab, seen) -> LookupPlan:
        st, client = self.st, self.st.client
        step = client.step
        u = keys.numel()
        self.lookups += u
        m = self.sorted_keys.numel()
        slot = torch.full((u,), -1, dtype=torch.int64)
        if m:
            pos = torch.searchsorted(self.sorted_keys, keys).clamp_(max=m - 1)
            found = self.sorted_keys.index_select(0, pos) == keys
            slot = torch.where(found, self.sorted_slots.index_select(0, pos), slot)
        held = slot >= 0
        fresh = held.clone()
        fresh[held] = (step - self.fetched.index_select(0, slot[held])) < st.staleness
        st.counters["cache_hits"] += int(fresh.sum())
        expired = slot[held & ~fresh]
        if expired.numel():  # pulled again into the same slot; their gradients written back first
            self._take_out(expired)
        self.used.index_fill_(0, slot[held], step)  # (this lookup's rows are no eviction victims)
        new = (~held).nonzero().squeeze(1)
        added = None
        if new.numel():
            free = (self.fetched < 0) & (self.used < step)
            free[expired] = False  # (refreshed in place)
            free_slots = free.nonzero().squeeze(1)
            if free_slots.numel() < new.numel():  # least recently used out (not those of this step)
                cand = ((self.fetched >= 0) & (self.used < step)).nonzero().squeeze(1)
                need = min(new.numel() - free_slots.numel(), cand.numel())
                if need:  # (the `need` least recently used: a selection, not a sort of all)
                    oldest = torch.topk(self.used.index_select(0, cand), need, largest=False, sorted=False)[1]
                    victims = cand.index_select(0, oldest)
                    self._take_out(victims)
                    free_slots = torch.cat([free_slots, victims])
            got = min(free_slots.numel(), new.numel())
            slot[new[:got]] = free_slots[:got]
            added = free_slots[:got]
        miss = (~fresh).nonzero().squeeze(1)
        cached_miss = miss.index_select(0, (slot.index_select(0, miss) >= 0).nonzero().squeeze(1))
        if cached_miss.numel():
            s = slot.index_select(0, cached_miss)
            self.key.index_copy_(0, s, keys.index_select(0, cached_miss))
            self.id.index_copy_(0, s, uid.index_select(0, cached_miss))
            self.tab.index_copy_(0, s, utab.index_select(0, cached_miss))
            self.fetched.index_fill_(0, s, step)
        self.used.index_fill_(0, slot[slot >= 0], step)
        self._reindex(added)
        pull = _Pull(
            st,
            uid.index_select(0, miss),
            utab.index_select(0, miss),
            None if seen is None else seen.index_select(0, miss),
            True,
            step,
        )
        if miss.numel():
            client.queue(pull)

        def commit() -> tuple[torch.Tensor, None]:
            out = slot.clone()
            if miss.numel():
                rows = client.complete(pull).to(st.weight.dtype)
                st.counters["pulled"] += miss.numel()
                ms = slot.index_select(0, miss)
                in_cache = ms >= 0
                with torch.no_grad():
                    dev = st.weight.device
                    st.weight.data.index_copy_(0, ms[in_cache].to(dev), rows[in_cache].to(dev))
                extra = (~in_cache).nonzero().squeeze(1)
                if extra.numel():  # beyond the cache: staged for this step
                    x = (rows.index_select(0, extra), pull.ids.index_select(0, extra), pull.tabs.index_select(0, extra))
                    base = st.append(*x)
                    out[miss.index_select(0, extra)] = torch.arange(base, base + extra.numel())
            return out.index_select(0, inv), None

        def rollback() -> None:
            client.drop(pull)

        return LookupPlan(commit, rollback)

    def take(self, rows) -> tuple:
        """The step's gradient: cached rows' summed here; staged rows', expired entries' and
        evicted entries' returned for pushing."""
        st, step = self.st, self.st.client.step
        ids, tabs, grads = [], [], []
        if rows is not None:
            slots, g = rows[0].cpu(), rows[1].to("cpu", self.grad.dtype)
            c = slots < self.size
            cs = slots[c]
            self.grad.index_add_(0, cs, g[c])
            self.dirty.index_fill_(0, cs, True)
            tail = (~c).nonzero().squeeze(1)
            if tail.numel():
                ts = slots.index_select(0, tail)
                ids.append(st._staged_ids.index_select(0, ts))
                tabs.append(st._staged_tabs.index_select(0, ts))
                grads.append(g.index_select(0, tail))
        old = ((self.fetched >= 0) & (step + 1 - self.fetched >= st.staleness)).nonzero().squeeze(1)
        if old.numel():  # (written back now: at most `staleness` steps late)
            self._take_out(old)
            self._reindex()
        for i, t, g in self.flush:
            ids.append(i)
            tabs.append(t)
            grads.append(g)
        self.flush = []
        if not ids:
            return torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64), None
        return torch.cat(ids), torch.cat(tabs), torch.cat(grads)

    def write_back(self) -> tuple:
        """Every cached gradient, for pushing now (before a checkpoint or bye)."""
        self._take_out((self.fetched >= 0).nonzero().squeeze(1))
        self._reindex()
        out = self.flush
        self.flush = []
        if not out:
            return torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64), None
        return tuple(torch.cat([x[k] for x in out]) for k in range(3))

    def stats(self) -> dict[str, Any]:
        return {
            "cache_rows": self.size,
            "cache_held": int((self.fetched >= 0).sum()),
            "cache_lookups": self.lookups,
            "cache_hit_rate": self.st.counters["cache_hits"] / self.lookups if self.lookups else 0.0,
        }


class _RemoteCollection(EmbeddingCollection):
    """An EmbeddingCollection whose storages are :class:`RemoteStorage` (every lookup resolves
    through the storage: no direct read of ``weight``)."""

    def _make_storage(self, tables: list[TableConfig], device) -> RowStorage:
        return RemoteStorage(tables, seed=self.seed, device=device)

    def _lookup_dense(self, feat, j: Jagged) -> torch.Tensor:
        jagged = {feat.name: j}
        batch = self._assemble(self.storages[feat.group], [feat], [], jagged)
        self._validate([batch], jagged)
        return self._run_groups([batch], jagged)[feat.name]


_OPEN: weakref.WeakSet = weakref.WeakSet()  # collections (their cached gradients are written back)
_CLIENTS: set[_Client] = set()  # their links, open until they say bye (also when the model is gone)


@atexit.register
def close_all(failed: str | None = None) -> None:
    """Every open :class:`PSCollection` of this process leaves its servers: at exit, and before a
    process group is destroyed (``torch.distributed.destroy_process_group()``, the usual last line
    of a script: see :func:`~hybridembed.distributed.health.before_shutdown`); the servers serve until every trainer has
    left. A process that is ending with an unhandled exception says so (``failed``, by default the
    exception :mod:`~hybridembed.distributed.health` recorded): the servers then fail the job
    instead of letting the other trainers go on alone."""
    failed = failed if failed is not None else health.failure()
    for pc in list(_OPEN):
        try:
            pc.close(failed)
        except Exception:  # noqa: BLE001 - leaving
            pass
    for client in list(_CLIENTS):
        client.bye(failed)


class PSCollection(ShardedCollection, CheckpointParticipant):
    """A trainer's embedding tables served by parameter servers (see :func:`hybridembed.distribute`
    with ``servers=``); looked up and trained like an :class:`~hybridembed.EmbeddingCollection`.

    Built by every rank of the job at once (trainers build this, servers the
    :class:`~hybridembed.distributed.ShardedCollection` that holds their shards, by the same
    plan), so a checkpoint of it is the same as a collective job's: it loads at any world
    size, with or without servers.
    """

    def __init__(
        self,
        tables: Sequence[TableConfig],
        features: Mapping[str, str] | None,
        plan,
        *,
        servers: Sequence[int],
        ps_group,
        mode: str = "sync",
        staleness: int = 1,
        cache_rows: int = 0,
        timeout: float = 300.0,
        limit: int = 1 << 30,
        process_group=None,
        trainers_group=None,
        seed: int = 0,
        device=None,
        sequence_output: str = "jagged",
        pad: int = -1,
        reduction: str = "mean",
        job_timeout=None,
    ):
        super().__init__(
            tables,
            features,
            plan,
            process_group=process_group,
            seed=seed,
            device=device,
            sequence_output=sequence_output,
            pad=pad,
            reduction=reduction,
            timeout=job_timeout,
        )
        if self.local is not None or self.replicated is not None:
            raise ConfigError("a parameter-server plan places no table on a trainer")
        self.mode, self.staleness, self.servers = mode, int(staleness), list(servers)
        self.remote = _RemoteCollection(
            list(self.tables.values()),
            self.features,
            seed=self.seed,
            device=device,
            sequence_output=sequence_output,
            pad=pad,
        )
        groups = trainer_groups(self.tables.values())
        links = {s: TrainerLink(ps_group, s, timeout, limit) for s in self.servers}
        self.__dict__["trainers_group"] = trainers_group  # the trainers' collectives (an export's report)
        self.__dict__["client"] = _Client(links, shard_index(self), self.routes(), self._wire)
        for i, st in enumerate(self.remote.storages):
            st.client, st.group, st.mode, st.staleness = self.client, groups[st.tables[0].name], mode, self.staleness
            assert st.group == i
            if cache_rows:
                st.cache = _Cache(st, cache_rows)
        _OPEN.add(self)
        _CLIENTS.add(self.client)
        health.before_shutdown(close_all)  # (destroy_process_group() would leave the servers waiting)
        weakref.finalize(self, self.client.bye)  # (a model dropped: its trainer is done)

    # --- lookups: the remote collection's ---------------------------------------------------------
    def forward(self, inputs: Mapping[str, Any]) -> dict[str, torch.Tensor | Jagged]:
        return self.remote(inputs)

    def lookup(self, feature: str, ids: Any):
        return self.remote.lookup(feature, ids)

    def lookup_rows(self, feature: str, ids: torch.Tensor) -> torch.Tensor:
        return self.remote.lookup(feature, Jagged(ids, self.remote._one_per_bag(ids.shape[0], ids.device)))

    def lookup_many(self, requests, train: bool | None = None) -> list:
        return self.remote.lookup_many(requests, train)

    def _lookup_many(self, requests, train, checked: bool) -> list:
        return self.remote._lookup_many(requests, train, checked)

    def _request_input(self, feature: str, ids: Jagged):
        return self.remote._request_input(feature, ids)

    def step_failed(self, error: BaseException) -> None:
        """A trainer's lookups reach the servers only: no other trainer waits for them."""

    @property
    def storages(self) -> list:
        return list(self.remote.storages) if "remote" in self._modules else []

    def prefetch(self, inputs: Mapping[str, Any], train: bool | None = None) -> None:
        """Send the pulls of ``inputs`` (the next step's ``forward`` input) now, so their rows
        travel while this step computes; the next ``forward`` with the same ids uses them.
        Call it before ``optimizer.step()`` of the current step."""
        rc = self.remote
        jagged = rc._prepare(inputs)
        per_group: dict[int, tuple[list, list]] = {}
        for f in jagged:
            feat = rc._features[f]
            pooled, seq = per_group.setdefault(feat.group, ([], []))
            (seq if feat.table.combiner == "none" else pooled).append(feat)
        batches = [rc._assemble(rc.storages[g], *per_group[g], jagged) for g in sorted(per_group)]
        rc._validate(batches, jagged)
        train = self.training if train is None else train
        for b in batches:
            b.storage.prefetch(b.ids, [f.table_index for f in b.feats], b.counts, train)

    # --- the optimizer step ---------------------------------------------------------------------
    def needs_rows(self, storage) -> bool:
        """Every remote storage's gradient is pushed, as rows, to the servers that apply it."""
        return any(storage is st for st in self.storages)

    def grad_scale(self, storage) -> float:
        return 1.0  # (the servers divide a synchronous step's sum by the number of trainers)

    def before_sparse_step(self, storages: list, rows: list) -> list:
        """Pushes this step's row gradients to the servers (every server gets one push per step)
        and leaves nothing for the local update."""
        rows = list(rows)
        mine = {id(st) for st in self.storages}
        items: dict[int, list] = {}
        had: list[int] = []
        hp: dict[int, dict] = {}
        for k, st in enumerate(storages):
            if id(st) not in mine:
                continue
            r, rows[k] = rows[k], None
            if st.optimizer is not None:
                hp[st.group] = st.hparams_now()
            if r is not None:
                had.append(st.group)
            ids, tabs, grad = st.take_gradient(None if r is None else (r.ids, r.rows))
            self._route_push(st, ids, tabs, grad, items)
        self.client.push(items, had, hp)
        return rows

    def _route_push(self, st, ids, tabs, grad, items: dict) -> None:
        if grad is None or ids.numel() == 0:
            return
        names = [t.name for t in st.tables]
        for server, parts in self.client.route(ids, tabs, names).items():
            for ref, pos, local in parts:
                items.setdefault(server, []).append((ref, local, grad.index_select(0, pos)))

    def write_back(self) -> None:
        """Push every cached gradient now (a checkpoint or the end of training)."""
        items: dict[int, list] = {}
        had = []
        for st in self.storages:
            if st.cache is not None:
                ids, tabs, grad = st.cache.write_back()
                if grad is not None:
                    had.append(st.group)
                self._route_push(st, ids, tabs, grad, items)
        if items:
            self.client.push(items, had, {st.group: st.hparams_now() for st in self.storages if st.optimizer})

    # --- checkpoints, reads, stats, close --------------------------------------------------------
    def before_checkpoint(self, action: str, path: str, options: dict) -> None:
        """Every trainer tells every server to join the collective ``he.save`` / ``he.load``."""
        self.client.drain()
        if action == "save":
            self.write_back()
        for st in self.storages:
            st._prefetched = None
        for server in self.client.links:
            m = Message(wire.CHECKPOINT, self.client.req(), self.client.step, torch.zeros(0, dtype=torch.int64))
            m.meta = {"action": action, "path": str(path), **options}
            self.client.links[server].send(m)

    def after_load(self) -> None:
        self.client.step = 0
        for st in self.storages:
            st.reset()

    def gather_table(self, name: str):
        """The whole table ``name`` from its servers (not a collective: this trainer alone asks):
        dense (rows, dim); dynamic (ids ascending, rows)."""
        t = self.tables.get(name)
        if t is None:
            raise ConfigError(f"unknown table {name!r}; tables: {', '.join(self.tables)}")
        route = self.routes()[name]
        self.client.drain()
        pieces = []
        for server in sorted({s.rank for _, s in route.shards}):
            m = self.client.call(server, wire.READ, meta={"table": name})
            n = int(m.ints[0])
            head = m.ints[1 : 1 + 3 * n].view(n, 3).tolist()
            pos, fpos = 1 + 3 * n, 0
            for shard, nids, nrows in head:
                ref = self.client.refs[shard]
                rows = m.floats[fpos : fpos + nrows * ref.width].view(nrows, ref.width).to(t.dtype)
                fpos += nrows * ref.width
                ids = m.ints[pos : pos + nids]
                pos += nids
                pieces.append((ref.pos, rows if t.dynamic is None else (ids, rows)))
        return assemble(route, pieces)

    def server_stats(self) -> list[dict[str, Any]]:
        """Each server's counters (requests, rows pulled and pushed, bytes, errors, memory, tables)."""
        self.client.drain()
        return [self.client.call(s, wire.STATS).meta for s in self.servers]

    def stats(self) -> dict[str, Any]:
        """This trainer's side: lookups, rows pulled, the cache's hits, bytes sent and received."""
        out: dict[str, Any] = {}
        for st in self.storages:
            for k, v in st.counters.items():
                out[k] = out.get(k, 0) + v
        cached = [st.cache for st in self.storages if st.cache is not None]
        if cached:
            lookups = sum(c.lookups for c in cached)
            out["cache_hit_rate"] = sum(c.st.counters["cache_hits"] for c in cached) / lookups if lookups else 0.0
        out["bytes_sent"] = sum(link.bytes_out for link in self.client.links.values())
        out["bytes_received"] = sum(link.bytes_in for link in self.client.links.values())
        out["step"] = self.client.step
        return out

    def close(self, failed: str | None = None) -> None:
        """Leave the job: write back cached gradients and say bye to every server (at exit too)."""
        if self.client.closed:
            return
        try:
            if failed is None:
                self.client.drain()
                self.write_back()
        finally:
            self.client.bye(failed)
            _OPEN.discard(self)

    def extra_repr(self) -> str:
        return (
            f"rank={self.rank}/{self.world_size}, tables={len(self.tables)}, servers={self.servers}, "
            f"mode={self.mode}, reduction={self.reduction}"
        )
