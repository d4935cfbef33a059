"""A sharded collection's joined lookups: a converted model's ``torch.cat`` of its embedding
outputs made by the lookup (:mod:`hybridembed.modules.joined`).

- Replicated (data-parallel) tables only: the rows are this rank's own, so the replicas'
  collection makes the joined tensor while the step's header crosses, as it makes their lookups
  (``runtime._run``).
- Whole tables (table-wise) only, their rows through shared memory: the exchange writes each
  owner's rows straight into their columns of the joined tensor (:class:`~.exchange.SharedRowsJoined`:
  the other ranks' rows read once out of their files, this rank's own copied once from its kernel's
  output), and the model's ``cat`` copies nothing more. Where they cross in one all-to-all with the
  owners' status folded in (a small step's rows, :data:`~.exchange.FOLD_ROWS`: through gloo, or the
  group's shared-memory transport), the same, out of the all-to-all's buffer
  (:class:`~.exchange.RowsJoined`); larger rows through gloo (no shared memory) take the usual cat
  after the exchange.

Anything else (row- or column-wise tables, replicated and sharded tables in one cat, per-id
weights, combiners other than sum, the bf16 wire, ``dedup``, a prefetched step) takes the usual path.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..input import Jagged
from ..modules import joined
from .exchange import RowsJoined, SharedRowsJoined
from .routes import Whole


class ShardedJoined:
    """The :class:`~hybridembed.distributed.ShardedCollection` side of a joined lookup."""

    def _lookup_joined(self, requests, outs, pieces: list[Any], train: bool, others=()) -> tuple | None:
        """``torch.cat`` of queued lookups and tensors made by the lookup, or None (nothing
        exchanged, nothing looked up)."""
        if self._ahead is not None or not all(self._trusted(j) and j.weights is None for _, j in requests):
            return None  # (a prefetched step's lookups come from its exchange)
        routes = [self._routes[self.features[f]] for f, _ in requests]
        if all(r.replicated for r in routes):
            return self._joined_replicas(requests, outs, pieces, train, others)
        if all(type(r) is Whole for r in routes) and not others and self.wire is None and not self.dedup:
            return self._joined_owners(requests, routes, outs, pieces, train)
        return None

    def _joined_replicas(self, requests, outs, pieces, train: bool, others) -> tuple | None:
        rep = self.replicated
        # (one id a bag: the same ids with the replicas' own offsets, which it takes on trust as these)
        mine = [(f, Jagged(j.values, rep._one_per_bag(j.values.shape[0], j.values.device))) for f, j in requests]
        ready = joined.prepare(rep, mine, outs, pieces, others)
        if ready is None:
            return None
        reqs = self._checked(requests)
        made: list = []
        self._send_ids(reqs, self._main, meanwhile=lambda tabs: made.append(ready.run(train)))
        if not made:  # pragma: no cover - the header raises on every rank when one failed
            raise RuntimeError("a joined lookup of replicated tables was not made")
        return made[0]

    def _joined_owners(self, requests, routes, outs, pieces, train: bool) -> tuple | None:
        """Whole tables: each request one pair (its table's owner), its rows into its columns."""
        b = requests[0][1].values.numel()
        nd = len(outs[0][0])
        spans, width, dense, dense_cols = {}, 0, [], []
        for p in pieces:
            if isinstance(p, int):
                shape, dtype = outs[p]
                d = routes[p].table.embedding_dim
                if tuple(shape) != ((b, d) if nd == 2 else (b, 1, d)) or dtype != routes[p].table.compute_dtype:
                    return None
                if routes[p].table.combiner != "sum" or requests[p][1].values.numel() != b:
                    return None
                spans[p] = (width, width + d)
            else:
                if p.shape[0] != b or p.device != self._device or p.dtype != self._wire:
                    return None
                d = math.prod(p.shape[1:])  # (not p[0]: a batch may be empty)
                dense_cols.append((width, width + d))
                dense.append(p)
            width += d
        if len({dtype for _, dtype in outs} | {self._wire}) != 1:
            return None
        shape = (b, width)
        if nd == 3:  # (B, slots, D): every piece's rows as wide
            dims = {routes[i].table.embedding_dim for i in spans} | {x.shape[-1] for x in dense}
            if len(dims) != 1:
                return None
            d = dims.pop()
            shape = (b, width // d, d)
        reqs = self._checked(requests)
        sent = self._send_ids(reqs, self._main)  # 1. to 4. (pair i is request i: one owner each)
        sizes, recv_ids, recv_w, fold = sent.received
        if self.world_size == 1 or not (fold or self._shared() is not None):  # (then the usual cat)
            rows_of = self._rows_for(sent, train)
            got = self._combine(reqs, sent.tabs, rows_of, sent.back, train)
            out = torch.cat([got[p].reshape(outs[p][0]) if isinstance(p, int) else p for p in pieces], 1)
        else:
            mine = sent.by_rank[self.rank]
            flat_send, failure = self._owner_rows(sent.step, mine, sent.pairs, sizes, recv_ids, recv_w, train)
            widths = [sent.pairs[i].width for i in mine]
            send_splits = [sum(n[k] * w for k, w in enumerate(widths)) for n in sizes[0]]
            recv_splits = [sum(b * sent.pairs[i].width for i in sent.by_rank[r]) for r in range(self.world_size)]
            if torch.is_grad_enabled() and not flat_send.requires_grad:  # (every rank joins the backward exchange)
                flat_send = flat_send + flat_send.new_zeros(()).requires_grad_()
            cols = [[spans[i] for i in sent.by_rank[r]] for r in range(self.world_size)]
            status = 0.0 if failure is not None else 1.0
            way, through = (RowsJoined, self._group) if fold else (SharedRowsJoined, self._shm)
            got, out = way.apply(flat_send, send_splits, recv_splits, through, status, shape, cols, dense_cols, *dense)
            self._raise_failed(sent.step, failure, got.tolist())
        n = len(requests)
        return out, joined.Made(out, [spans[i] for i in range(n)], [tuple(outs[i][0]) for i in range(n)], False)

    def _checked(self, requests) -> list:
        try:  # (a refusal here reaches every rank: see step_failed)
            return self._many_requests(requests, checked=True)
        except Exception as e:
            self.step_failed(e)
            raise


__all__ = ["ShardedJoined"]
