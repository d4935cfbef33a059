"""A trainer's embedding module over the parameter servers: :class:`PSCollection` (built by
:func:`hybridembed.distribute` with ``servers=``) and :func:`close_all` (every trainer says
goodbye to its servers at exit, or before its process group is destroyed). Its rows live in
:class:`~hybridembed.ps.remote.RemoteStorage`."""

from __future__ import annotations

import atexit
import os
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..checkpoint.participant import CheckpointParticipant
from ..config import TableConfig
from ..distributed import health
from ..distributed.routes import assemble
from ..distributed.sharded import ShardedTables
from ..errors import ConfigError
from ..input import Jagged
from ..optim.hooks import SparseStepHook
from . import wire
from .cache import RowCache
from .client import CLIENTS, Client
from .remote import RemoteCollection
from .server import shard_index, trainer_groups
from .transport import TrainerLink
from .wire import Message

__all__ = ["PSCollection", "MODES", "check_ps_args", "close_all"]

MODES = ("sync", "async")


def check_ps_args(servers, mode, staleness, cache_rows, timeout, limit, server_exit) -> None:
    """The parameter-server arguments of :func:`hybridembed.distribute` (and :class:`PSCollection`), or a
    :class:`ConfigError` naming the first that is wrong."""

    def count(v, low: int) -> bool:
        return not isinstance(v, bool) and isinstance(v, int) and v >= low

    if not count(servers, 0):
        raise ConfigError(f"servers must be an int >= 0 (the last ranks of the job), got {servers!r}")
    if mode not in MODES:
        raise ConfigError(f"mode must be one of {MODES}, got {mode!r}")
    if not count(staleness, 1):
        raise ConfigError(f"staleness must be an int >= 1 (steps), got {staleness!r}")
    if not count(cache_rows, 0):
        raise ConfigError(f"cache_rows must be an int >= 0, got {cache_rows!r}")
    if cache_rows and mode != "async":
        raise ConfigError(
            "cache_rows needs mode='async': in synchronous mode every row a step reads was updated by the step "
            "before, so a cache could only serve stale rows"
        )
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0):
        raise ConfigError(f"ps_timeout must be a number of seconds > 0 (or None: the job's timeout), got {timeout!r}")
    if not count(limit, 1024):
        raise ConfigError(f"max_request_bytes must be an int >= 1024, got {limit!r}")
    if not isinstance(server_exit, bool):
        raise ConfigError(f"server_exit must be True or False, got {server_exit!r}")


_OPEN: weakref.WeakSet = weakref.WeakSet()  # collections (their cached gradients are written back)


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
    for client in list(CLIENTS):
        client.bye(failed)


class PSCollection(ShardedTables, SparseStepHook, CheckpointParticipant):
    """A trainer's embedding tables served by parameter servers (see :func:`hybridembed.distribute`
    with ``servers=``); looked up and trained like an :class:`~hybridembed.EmbeddingCollection`.

    Built by every rank of the job at once (trainers build this, servers the
    :class:`~hybridembed.distributed.ShardedCollection` that holds their shards, by the same
    plan), so a checkpoint of it is the same as a collective job's: it loads at any world
    size, with or without servers. It is the tables and routes every sharded module shares
    (:class:`~hybridembed.distributed.sharded.ShardedTables`) with, for the lookups, an
    ordinary collection whose storages are remote (``self.remote``): none of the collective
    exchange.
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
        problem = None
        try:  # (a refusal here reaches every rank through the agreement)
            check_ps_args(len(servers), mode, staleness, cache_rows, timeout, limit, True)
        except ConfigError as e:
            problem = e
        super().__init__(
            tables,
            features,
            plan,
            process_group=process_group,
            seed=seed,
            sequence_output=sequence_output,
            pad=pad,
            reduction=reduction,
            timeout=job_timeout,
            problem=problem,
        )
        if self.shards_here() or any(r.replicated for r in self._routes.values()):
            raise ConfigError("a parameter-server plan places no table on a trainer")
        self.local = self.replicated = None  # (no shard here: the collective pieces of a checkpoint skip it)
        self.mode, self.staleness, self.servers = mode, int(staleness), list(servers)
        self.remote = RemoteCollection(
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
        self.__dict__["client"] = Client(links, shard_index(self), self.routes(), self._wire)
        for i, st in enumerate(self.remote.storages):
            st.client, st.group, st.staleness = self.client, groups[st.tables[0].name], self.staleness
            assert st.group == i
            if cache_rows:
                st.cache = RowCache(st, cache_rows)
            st.weight._hybridembed_in_job = True  # (its norm here is not the job's: see clip_grad_norm_)
        _OPEN.add(self)
        CLIENTS.add(self.client)
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

    def _lookup_joined(self, requests, outs, pieces, train: bool, others=()) -> tuple | None:
        """A converted model's ``torch.cat`` of its embedding outputs made by the lookup (the pulled
        rows pooled straight into it), or None: :mod:`hybridembed.modules.joined`."""
        return self.remote._lookup_joined(requests, outs, pieces, train, others)

    def _request_input(self, feature: str, ids: Jagged):
        return self.remote._request_input(feature, ids)

    def _one_per_bag(self, n: int, device: torch.device) -> torch.Tensor:
        return self.remote._one_per_bag(n, device)

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

    def remote_entry(self, name: str) -> dict[str, torch.Tensor]:
        """Table ``name``'s ``state_dict`` entry, pulled whole from its servers (:meth:`gather_table`;
        this trainer alone asks): dense ``{"weight": (rows, dim)}``, the plain model's key; dynamic
        ``{"ids": (K,), "rows": (K, dim)}``. Holds the whole table in this process: for tables that
        fit one (checkpoints, :func:`hybridembed.save`, need no such copy)."""
        got = self.gather_table(name)
        if self.tables[name].dynamic is None:
            return {"weight": got}
        ids, rows = got
        return {"ids": ids, "rows": rows}

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        """Every table pulled from the servers (:meth:`remote_entry`) under ``<table>.``, unless a
        converted model's layers write them under their own keys (the plain model's)."""
        if self.layers_hold_keys:
            return
        for name in self.tables:
            for k, v in self.remote_entry(name).items():
                destination[prefix + name + "." + k] = v

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        mine = sorted(k for k in state_dict if k.startswith(prefix) and k[len(prefix) :].split(".")[0] in self.tables)
        if mine:
            errors.append(
                f"{mine[0]}: the tables live on the parameter servers and are not loaded from a state_dict; "
                "load them with he.load (a checkpoint, at any world size)"
            )

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
        """Leave the job: write back cached gradients and say bye to every server (at exit too; not
        in a child forked from this trainer, whose exit leaves its parent's servers alone)."""
        if self.client.closed or os.getpid() != self.client.pid:
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
