"""A trainer's connection to its parameter servers: :class:`Client` sends a call's pulls (one
message per server for every group of the call), matches the replies, pushes gradients and
says goodbye; :class:`Pull` is one group's pull (:mod:`hybridembed.ps.remote` makes them)."""

from __future__ import annotations

import os

import torch

from ..errors import HybridEmbedError
from ..storage import RowStorage
from . import wire
from .payload import PullItem, PullRequest, PushItem, PushRequest
from .server import ShardRef
from .transport import TrainerLink
from .wire import Message

__all__ = ["CLIENTS", "Client", "Pull"]


class Pull:
    """One group's pull: distinct (table index, id) pairs, the rows once they arrive."""

    def __init__(self, storage: RowStorage, ids, tabs, seen, train: bool, step: int):
        self.storage, self.ids, self.tabs, self.seen, self.train, self.step = storage, ids, tabs, seen, train, step
        self.rows: torch.Tensor | None = None
        self.sent = False
        self.raw: torch.Tensor | None = None  # prefetch: the lookup it answers (ids, inverse, tables and counts)
        self.inv: torch.Tensor | None = None
        self.ask: tuple[list, list] | None = None


class Client:
    """A trainer's links to the servers: requests, their replies, the step count."""

    def __init__(self, links: dict[int, TrainerLink], refs: list[ShardRef], routes: dict, wire_dtype):
        self.links, self.refs, self.routes, self.wire_dtype = links, refs, routes, wire_dtype
        self.ref_of = {(r.table, r.pos): r for r in refs}
        self.step = 0
        self._req = 0
        self._queued: list[Pull] = []
        self._waiting: dict[tuple[int, int], list] = {}  # (server, req) -> [(pull, shard, positions)]
        self._stash: dict[tuple[int, int], Message] = {}
        self.closed = False
        self.pid = os.getpid()  # (a child forked from this trainer never says its goodbye)
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
        # (a dense group's distinct ids come ascending, so their tables too: no sort then)
        grouped = tabs.numel() < 2 or bool((tabs[1:] >= tabs[:-1]).all())
        order = torch.arange(tabs.numel()) if grouped else torch.argsort(tabs, stable=True)
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
    def queue(self, pull: Pull) -> None:
        self._queued.append(pull)

    def drop(self, pull: Pull) -> None:
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
            ints, _ = PullRequest(train, [PullItem(ref.index, local, seen) for _, ref, _, local, seen in items]).pack()
            m = Message(wire.PULL, self.req(), step, ints)
            self.links[server].send(m)
            self._waiting[(server, m.req)] = [(pull, ref, pos) for pull, ref, pos, _, _ in items]

    def complete(self, pull: Pull) -> torch.Tensor:
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
        """One push per server (every server, every step: synchronous mode counts them).
        ``items_by_server``: ``{server: [(ShardRef, local ids (U,), gradient rows (U, D))]}``."""
        for server, link in self.links.items():
            items = items_by_server.get(server, [])
            ints, floats = PushRequest(
                [PushItem(r.index, ids, rows.to(self.wire_dtype)) for r, ids, rows in items]
            ).pack()
            meta = {"had": had, "hp": {str(k): v for k, v in hp.items()}}
            m = Message(wire.PUSH, self.req(), self.step, ints, floats, meta)
            link.send(m)
        self.step += 1

    def bye(self, failed: str | None = None) -> None:
        CLIENTS.discard(self)
        if self.closed or os.getpid() != self.pid:
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


CLIENTS: set[Client] = set()  # open links, until they say bye (also when their model is gone)
