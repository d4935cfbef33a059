"""Parameter servers: embedding tables on server ranks of the same ``torch.distributed`` job.

    # every rank (torchrun --nproc-per-node 3 train.py): ranks 0, 1 train, rank 2 serves
    dist.init_process_group("gloo")
    model = he.distribute(model, servers=1)      # on rank 2: serves until the trainers leave, then exits
    opt = he.wrap_optimizer(torch.optim.Adagrad(model.parameters(), lr=0.05), model)
    for batch in my_shard_of_the_data:           # the training loop does not change
        loss = loss_fn(model(batch), y); opt.zero_grad(); loss.backward(); opt.step()

Servers hold the tables' shards (dense and dynamic) with their optimizer state in host
memory and apply the sparse optimizer; trainers hold the dense part (data-parallel among
trainers) and pull rows / push row gradients (:mod:`hybridembed.ps.remote`,
:mod:`hybridembed.ps.server`). Transport is c10d point-to-point over gloo
(:mod:`hybridembed.ps.transport`); ``torch.distributed.rpc`` is not used. Without an
initialised process group ``distribute(model, servers=...)`` returns the one-process model
(:func:`hybridembed.convert`): the servers' tables in the trainer's own process, so the
same script runs on a laptop. See docs/parameter_servers.md.
"""

from __future__ import annotations

import datetime
import queue
import threading
import time
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..distributed import health
from ..distributed.routes import route_for
from ..distributed.shard import rows_device, shard_collection, swap_collection
from ..errors import ConfigError, HybridEmbedError
from ..optim.wrapper import HybridOptimizer
from ..utils import get_logger
from . import wire
from .collection import MODES, PSCollection
from .remote import RemoteStorage
from .server import TableServer
from .transport import ServerLink, ServerLost

__all__ = ["PSCollection", "RemoteStorage", "TableServer", "ServerLost", "MODES", "serve", "ps_plan", "ServerOptimizer"]

log = get_logger(__name__)


class _NoDense:
    """A server's stand-in for the trainers' dense optimizer (rank 0, a trainer, saves that)."""

    param_groups: list = []
    state: dict = {}

    def state_dict(self) -> dict:
        return {"state": {}, "param_groups": []}

    def load_state_dict(self, sd: dict) -> None:
        pass

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass


class ServerOptimizer(HybridOptimizer):
    """The sparse half of the trainers' optimizer, as a server holds it: its shards' storages
    with their param groups (attached by the trainers), for checkpoints."""

    dense_elsewhere = True

    def __init__(self, server: TableServer):  # (no torch.optim.Optimizer.__init__: nothing is attached again)
        self._storages = [server.storages[i] for i in sorted(server.hparams)]
        self._sparse_groups = [server.hparams[i] for i in sorted(server.hparams)]
        self.dense = _NoDense()
        self._hooks = []
        self.param_groups = list(self._sparse_groups)
        self.state = {}
        self.defaults = {}


def ps_plan(plan, tables: list, world: int, servers: list[int]):
    """The plan of a parameter-server job: a plan for the ``len(servers)`` servers (or the
    planner's, by default) with its ranks moved onto the server ranks; or a plan for the whole
    job whose shards are all on server ranks. Tables must be table- or row-wise."""
    from ..distributed.plan import Plan
    from ..distributed.planner import make_plan

    s = len(servers)
    if plan is None:
        plan = make_plan(tables, s, data_parallel_below=0, column_slice_threshold=1 << 62)
    if not isinstance(plan, Plan):
        raise ConfigError(f"plan must be a hybridembed.distributed.Plan, got {type(plan).__name__}")
    if plan.world_size == s and s != world:
        from dataclasses import replace

        moved = tuple(
            replace(tp, shards=tuple(replace(sh, rank=servers[sh.rank]) for sh in tp.shards)) for tp in plan.tables
        )
        plan = Plan(world, moved, plan.strategy, dict(plan.notes))
    if plan.world_size != world:
        raise ConfigError(
            f"the plan is for {plan.world_size} ranks; a parameter-server job takes a plan for its {s} server(s) "
            f"or for all {world} ranks"
        )
    by_name = {t.name: t for t in tables}
    for tp in plan.tables:
        route = route_for(tp, by_name[tp.table]) if tp.table in by_name else None
        if route is not None and (route.replicated or route.slices_columns):  # (a server answers by row)
            raise ConfigError(
                f"table {tp.table!r}: {tp.sharding} sharding is not supported on parameter servers; use table_wise "
                "or row_wise"
            )
        bad = [sh.rank for sh in tp.shards if sh.rank not in servers]
        if bad:
            raise ConfigError(
                f"table {tp.table!r}: a shard on rank {bad[0]}, which is a trainer; servers are ranks {servers}"
            )
    return plan


def serve(model: nn.Module, server: TableServer, link: ServerLink, timeout: datetime.timedelta | None = None) -> None:
    """Answer the trainers until every one has said bye (a server rank's ``he.distribute``).

    Requests are received by a thread of their own, so this loop also watches the trainers'
    heartbeats: a trainer that failed, died, stopped or vanished without a goodbye (for
    :func:`~hybridembed.distributed.health.lost_after` of ``timeout``, the job's) ends the
    service; the other trainers' waiting and later requests are answered with an error naming
    it, and this raises :class:`~hybridembed.distributed.health.RankLost` once they have left
    (or after ``timeout``)."""
    from .. import checkpoint as ck

    rank = server.rank
    timeout = timeout if timeout is not None else health.job_timeout()
    log.info("parameter server rank %d: serving %d shard(s) to trainers %s", rank, len(server.held), server.trainers)
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    receiver = threading.Thread(target=_receive, args=(link, inbox, server.trainers), daemon=True)
    receiver.start()
    glob = {t: t for t in server.trainers}  # (the trainers' global ranks: their heartbeats' keys)
    watch = health.Watch(glob.values(), health.lost_after(timeout))
    checked = time.monotonic()
    lost_at = None
    while server.active:
        item = None
        try:
            item = inbox.get(timeout=health.PERIOD)
        except queue.Empty:
            pass
        now = time.monotonic()
        if item is None or now - checked > health.PERIOD:  # (busy or idle: the trainers are watched)
            checked = now
            gone = watch.check(glob[t] for t in server.active)
            if gone:
                by_trainer = {t: gone.get(glob[t], gone.get(-1)) for t in server.active}
                by_trainer = {t: why for t, why in by_trainer.items() if why is not None}
                _send(link, server, server.trainers_lost(by_trainer))
                log.error("parameter server rank %d: %s", rank, server.lost)
            if server.failed and lost_at is None:
                lost_at = now
            if lost_at is not None and now - lost_at > timeout.total_seconds():
                break
        if item is None:
            continue
        if item is _DEAF:  # (nothing more can be received: the trainers left are told by their timeouts)
            if not server.failed:
                _send(link, server, server.trainers_lost({-1: "broke the servers' connections"}))
            break
        if isinstance(item, BaseException):  # (the transport's: a trainer's connection broke)
            text = str(item).splitlines()[0] if str(item) else type(item).__name__
            found = health.diagnose(glob[t] for t in server.active)  # (which one: its heartbeat stopped)
            named = {t: found.get(glob[t], found.get(-1)) for t in server.active}
            named = {t: why for t, why in named.items() if why is not None}
            _send(link, server, server.trainers_lost(named or {-1: f"lost a trainer ({text[:200]})"}))
            log.error("parameter server rank %d: %s", rank, server.lost)
            lost_at = lost_at or time.monotonic()
            continue
        replies, checkpoint = server.handle(*item)
        _send(link, server, replies)
        if checkpoint is not None:
            _checkpoint(ck, model, server, checkpoint)
    try:
        link.sends.wait()
    except RuntimeError:  # (a trainer that left before reading a reply it no longer needed)
        pass
    # the receiving thread ends once it has read every goodbye, or (a trainer lost) once the trainers'
    # connections have closed; a thread that comes back from torch code while the interpreter shuts
    # down aborts the process ("terminate called without an active exception", seen about once in 25
    # runs of tests/ps/test_trainer_faults.py under load), so it is waited for, bounded
    if server.said_bye >= set(server.trainers) or server.failed:
        receiver.join(health.STORE_WAIT)
    if server.failed:  # (the trainers were told: the heartbeat stops now, before the store's host may go)
        health.stop()
        raise health.RankLost(server.lost, [t for t in server.trainers if t not in server.active])
    ck.wait_pending(model)
    health.stop()  # (the trainers are gone: the store may go with them)
    log.info("parameter server rank %d: every trainer left; stopping", rank)


_DEAF = object()  # what the receiving thread says when receives keep failing


def _receive(link: ServerLink, inbox: queue.SimpleQueue, trainers: list[int]) -> None:
    """The server's receiving thread: every request into ``inbox``, until every trainer has said bye
    (no receive is left waiting in gloo when the process ends). A failed receive (a trainer's
    connection broke) goes into ``inbox`` too, and receiving goes on for the other trainers, unless
    receives keep failing at once."""
    left: set[int] = set()
    failures: list[float] = []
    while left < set(trainers):
        try:
            src, header, payload = link.recv()
        except Exception as e:  # noqa: BLE001 - handed to the serving loop
            inbox.put(e)
            now = time.monotonic()
            failures = [t for t in failures if now - t < 1.0] + [now]
            if len(failures) >= 3:  # (the group is broken: nothing more can be received)
                inbox.put(_DEAF)
                return
            continue
        inbox.put((src, header, payload))
        if int(header[1]) == wire.BYE and not isinstance(payload, Exception) and src in trainers:
            try:  # (a goodbye the handler takes: one whose payload parses)
                wire.unpack(header, payload, link.limit)
            except wire.WireError:
                continue
            left.add(src)


def _send(link: ServerLink, server: TableServer, replies: list) -> None:
    for dst, m in replies:
        try:
            server.stats_["bytes_out"] += link.reply(dst, m)
        except RuntimeError:  # (a trainer that is gone: it reads nothing more)
            pass


def _checkpoint(ck, model: nn.Module, server: TableServer, meta: Mapping[str, Any]) -> None:
    """Join the trainers' collective save or load (its errors reach every rank through it)."""
    opt = ServerOptimizer(server) if meta.get("optimizer") else None
    try:
        if meta["action"] == "save":
            handle = ck.save(
                meta["path"],
                model,
                opt,
                keep=int(meta.get("keep", 1)),
                incremental=bool(meta.get("incremental", False)),
                max_chain=int(meta.get("max_chain", 8)),
                background=bool(meta.get("background", False)),
            )
            del handle  # (a background save is waited for by the next save, load or the end)
        else:
            ck.load(meta["path"], model, opt, verify=bool(meta.get("verify", True)))
            server.after_load()
    except Exception as e:  # noqa: BLE001 - the trainers got the same error from the collective
        log.warning("parameter server rank %d: checkpoint %s failed: %s", server.rank, meta["path"], e)


def setup(
    model: nn.Module,
    ec,
    plan,
    group,
    *,
    servers: int,
    mode: str,
    staleness: int,
    cache_rows: int,
    timeout: float | None,
    limit: int,
    reduction: str,
    budget: int | None,
    job_timeout: datetime.timedelta | None = None,
):
    """``he.distribute(model, servers=S)`` on every rank: the last S ranks of ``group`` serve
    (and return only when the trainers are done), the others get their :class:`PSCollection`.
    Returns (the trainers' process group, this rank's collection or None on a server)."""

    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    world = len(ranks)
    trainers, server_ranks = ranks[: world - servers], ranks[world - servers :]
    rank = dist.get_rank()
    tables = list(ec.tables.values())
    problem = None
    try:  # (a plan or budget one rank refuses is refused on every rank, before anything is allocated)
        if servers >= world:
            raise ConfigError(f"servers={servers} leaves no trainer in a job of {world} rank(s)")
        plan = ps_plan(plan, tables, world, list(range(world - servers, world)))
        if budget is not None:
            from ..distributed.planner import check_memory

            check_memory(plan, tables, budget)
    except HybridEmbedError as e:
        problem = e
    health.agree(group if group is not None else dist.group.WORLD, "the parameter-server plan", problem)
    # (collectives, in the same order on every rank; every wait bounded by the job's timeout)
    job = job_timeout if job_timeout is not None else health.job_timeout(group)
    timeout = timeout if timeout is not None else job.total_seconds()
    ps_group = health.new_group(ranks, job, backend="gloo")
    trainer_group = health.new_group(trainers, job)
    wire_dtype = torch.float64 if any(t.compute_dtype == torch.float64 for t in tables) else torch.float32
    device = rows_device(model, ec)  # (tables built on the meta device: no rank allocates a whole table)
    if rank in server_ranks:
        sc = shard_collection(ec, plan, group, reduction, False, None, device, job)
        swap_collection(model, ec, sc)
        server = TableServer(
            sc, trainers, mode=mode, staleness=staleness, reduction=reduction, limit=limit, wire_dtype=wire_dtype
        )
        link = ServerLink(ps_group, limit)

        def run() -> None:  # (called once the caller dropped the unsharded collection: its rows are freed)
            serve(model, server, link, job)

        return trainer_group, None, run
    pc = PSCollection(
        tables,
        ec.features,
        plan,
        servers=server_ranks,
        ps_group=ps_group,
        mode=mode,
        staleness=staleness,
        cache_rows=cache_rows,
        timeout=timeout,
        limit=limit,
        process_group=group,
        trainers_group=trainer_group,
        seed=ec.seed,
        device=device,
        sequence_output=ec.sequence_output,
        pad=ec.pad,
        reduction=reduction,
        job_timeout=job,
    )
    pc.train(ec.training)
    swap_collection(model, ec, pc)
    return trainer_group, pc, None
