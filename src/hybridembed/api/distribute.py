"""``he.distribute``: a model's embedding tables sharded over a job, its dense rest data-parallel.

    # every rank, after torch.distributed.init_process_group("gloo" | "nccl"):
    model = he.distribute(model)          # nn.Embedding(Bag) layers and EmbeddingCollections sharded
    opt = he.wrap_optimizer(torch.optim.Adagrad(model.parameters(), lr=0.05), model)
    for batch in my_shard_of_the_data:    # the training loop does not change
        loss = loss_fn(model(batch), y); opt.zero_grad(); loss.backward(); opt.step()

``distribute`` converts plain embedding layers as :func:`hybridembed.convert` does (their
lookups grouped per forward, so a forward that calls 26 layers makes one exchange), then
replaces every :class:`~hybridembed.EmbeddingCollection` (a converted model's included) by a
:class:`~hybridembed.distributed.ShardedCollection` holding this rank's shards, and wraps the
model in ``DistributedDataParallel`` with the embedding rows excluded from its all-reduce
(they train through the exchange; data-parallel tables all-reduce their own row gradients at
the optimizer step).
"""

from __future__ import annotations

import datetime
import gc
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..distributed import health
from ..distributed.plan import Plan
from ..distributed.runtime import REDUCTIONS
from ..distributed.shard import rows_device, shard_collection, swap_collection, unwrap
from ..distributed.sharded import ShardedTables, check_wire
from ..errors import ConfigError, HybridEmbedError
from ..modules import EmbeddingCollection
from ..ps.collection import check_ps_args
from ..utils import release_free_memory
from .convert import convert

__all__ = ["distribute", "unwrap"]

_CONVERT_ARGS = ("tables", "seed", "dynamic", "copy_dynamic_rows")


def distribute(
    model: nn.Module,
    plan: Plan | Mapping[str, Plan] | None = None,
    process_group: dist.ProcessGroup | None = None,
    *,
    reduction: str = "mean",
    ddp: bool | Mapping[str, Any] = True,
    dedup: bool = False,
    wire: str | None = None,
    memory_per_rank: int | None = None,
    servers: int | None = None,
    mode: str = "sync",
    staleness: int = 1,
    cache_rows: int = 0,
    ps_timeout: float | None = None,
    max_request_bytes: int = 1 << 30,
    server_exit: bool = True,
    timeout: float | datetime.timedelta | None = None,
    **convert_args: Any,
) -> nn.Module | None:
    """Shard ``model``'s embedding tables over the job; returns the model to train, unchanged loop.

    Args:
        model: a plain model (``nn.Embedding`` / ``nn.EmbeddingBag`` layers), a converted one,
            or one holding :class:`~hybridembed.EmbeddingCollection` modules. Modified in place.
            A collection built with ``device="meta"`` allocates no rows: each rank makes only its
            shards (from the row-keyed init, so equal to the real table's rows) beside the model's
            dense parameters, and parameter-server trainers make none.
        plan: a :class:`Plan` placing every table (of every collection), or ``{collection path:
            Plan}``; default: the planner's ``memory_balanced`` plan per collection.
        process_group: the ranks to shard over and run data-parallel on (default: the job).
        reduction: ``"mean"`` (default, as DDP: world N equals world 1 on the concatenated
            batch) or ``"sum"`` of the ranks' embedding gradients.
        dedup: send distinct ids and pool on the requester where that sends fewer rows (see
            :class:`ShardedCollection`; off by default: measured slower on one machine).
        wire: ``"bf16"``: the exchange sends pooled rows and their gradients as bfloat16 (half
            the bytes; relative error <= 2**-8 per element, docs/distributed.md "Wire format");
            default None: exact. Not with ``servers``.
        memory_per_rank: refuse a plan that puts more rows and optimizer state on a rank (bytes),
            naming the rank and the shortfall, before any shard is allocated.
        ddp: wrap the result in ``DistributedDataParallel`` (a dict: its keyword arguments);
            False leaves the dense part to you.
        timeout: seconds (or a ``timedelta``) the library's own collectives wait for a peer (the
            embedding exchange, the parameter servers' groups, background checkpoints); default:
            the job's, as ``init_process_group(timeout=...)`` was given it. A peer that dies, stops or
            fails within it is named in a :class:`~hybridembed.distributed.health.RankLost`.
        **convert_args: ``tables``, ``seed``, ``dynamic``, ``copy_dynamic_rows`` as :func:`convert`.

    Parameter servers (``servers=S``, see docs/parameter_servers.md): the last S ranks of the
    job hold the tables (the plan places them on those ranks: a plan for S ranks, or the
    planner's) and apply the sparse optimizer; the other ranks train, pulling rows and pushing
    row gradients, with the dense part data-parallel among them. On a server rank this call
    serves until every trainer has left, then exits the process (``SystemExit(0)``;
    ``server_exit=False``: returns None instead). Without an initialised process group it
    returns :func:`convert`'s one-process model (the servers' tables in this process).

        mode: ``"sync"`` (a step's pushes summed on the servers and applied once: equal to the
            collective result) or ``"async"`` (applied as they arrive; a trainer runs at most
            ``staleness`` steps ahead of the slowest trainer's pushes).
        staleness: asynchronous mode's bound, in steps (>= 1).
        cache_rows: asynchronous mode's hot-row cache per group of tables on each trainer
            (rows; 0: none).
        ps_timeout: seconds a trainer waits for a server's answer (a dead server fails at once);
            default: ``timeout``.
        max_request_bytes: the largest request a server accepts.

    Every rank must call it with the same model, plan and arguments (they are compared across
    ranks before anything is allocated: the first difference is named on every rank, and an
    argument one rank refuses is refused on every rank, naming it).
    """
    job = dist.is_available() and dist.is_initialized()
    problem = None
    try:  # (every check before anything is allocated; in a job, one rank's refusal is every rank's)
        if job and process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise ConfigError(f"process_group must be a torch.distributed ProcessGroup, got {process_group!r}")
        _check_args(model, plan, reduction, ddp, dedup, memory_per_rank, convert_args)
        check_wire(wire)
        if wire is not None and servers is not None:
            raise ConfigError("wire='bf16' is the collective exchange's: parameter servers send rows at full precision")
        timeout = health.as_timeout(timeout)
        if servers is not None:
            check_ps_args(servers, mode, staleness, cache_rows, ps_timeout, max_request_bytes, server_exit)
        if job and any(isinstance(m, (nn.Embedding, nn.EmbeddingBag)) for m in model.modules()):
            model = convert(model, grouped=True, **convert_args)
        collections = _collections(model) if job else {}
        if job and not collections:
            raise ConfigError("distribute: the model has no embedding layers or hybridembed tables to shard")
        _check_untrained(collections)  # (no loop variable here: a server frees the unsharded tables)
    except HybridEmbedError as e:
        if not job:
            raise
        problem = e
    if not job:
        if servers is not None:  # the embedded default: the servers' tables in this process
            return convert(model, grouped=True, **convert_args)
        raise ConfigError(
            "he.distribute needs an initialised torch.distributed process group: call "
            "torch.distributed.init_process_group(...) first (launch with torchrun or `hybridembed launch`); "
            "for one process use he.convert"
        )
    group = process_group if isinstance(process_group, dist.ProcessGroup) else dist.group.WORLD
    settings = {
        "reduction": reduction,
        "dedup": dedup,
        "wire": wire if isinstance(wire, str) or wire is None else repr(wire),
        "ddp": sorted(ddp) if isinstance(ddp, Mapping) else ddp,
        "memory_per_rank": memory_per_rank,
        "timeout": None if timeout is None else timeout.total_seconds(),
        "servers": servers,
        "convert": {
            k: v if isinstance(v, (bool, int, str)) or v is None else type(v).__name__
            for k, v in sorted(convert_args.items())
        },
        "collections": sorted(collections) if problem is None else None,
    }
    if servers is not None:
        settings["ps"] = {
            "mode": mode,
            "staleness": staleness,
            "cache_rows": cache_rows,
            "ps_timeout": ps_timeout,
            "max_request_bytes": max_request_bytes,
        }
    health.agree(group, "he.distribute's arguments", problem, settings)
    if servers is not None:
        return _distribute_ps(
            model,
            collections,
            plan,
            process_group,
            reduction,
            ddp,
            memory_per_rank,
            servers,
            mode,
            staleness,
            cache_rows,
            ps_timeout,
            max_request_bytes,
            server_exit,
            timeout,
        )
    for path in list(collections):
        ec = collections.pop(path)
        where = rows_device(model, ec)
        sharded = shard_collection(
            ec, _plan_for(plan, path, ec), process_group, reduction, dedup, memory_per_rank, where, timeout, wire
        )
        swap_collection(model, ec, sharded)
        del ec, sharded  # the whole tables go now: a rank keeps its shards alone
        gc.collect()
        release_free_memory()
    return _wrap_ddp(model, ddp, process_group)


def _check_args(model, plan, reduction, ddp, dedup, memory_per_rank, convert_args) -> None:
    if not isinstance(model, nn.Module):
        raise ConfigError(f"distribute needs an nn.Module, got {type(model).__name__}")
    if isinstance(model, DistributedDataParallel):
        raise ConfigError("distribute takes the model itself, not a DistributedDataParallel wrapper (it wraps it)")
    if reduction not in REDUCTIONS:
        raise ConfigError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    unknown = sorted(set(convert_args) - set(_CONVERT_ARGS))
    if unknown:
        raise ConfigError(
            f"distribute: unknown argument {unknown[0]!r}; convert's arguments: {', '.join(_CONVERT_ARGS)}"
        )
    if plan is not None and not isinstance(plan, (Plan, Mapping)):
        raise ConfigError(f"plan must be a Plan or {{collection path: Plan}}, got {type(plan).__name__}")
    if not isinstance(ddp, (bool, Mapping)):
        raise ConfigError(f"ddp must be True, False or a dict of DistributedDataParallel arguments, got {ddp!r}")
    if not isinstance(dedup, bool):
        raise ConfigError(f"dedup must be True or False, got {dedup!r}")
    if memory_per_rank is not None and (
        isinstance(memory_per_rank, bool) or not isinstance(memory_per_rank, int) or memory_per_rank <= 0
    ):
        raise ConfigError(f"memory_per_rank must be a positive int (bytes) or None, got {memory_per_rank!r}")
    if any(isinstance(m, ShardedTables) for m in model.modules()):  # (all checked before the model changes)
        raise ConfigError("this model is distributed already")


def _check_untrained(collections: Mapping[str, EmbeddingCollection]) -> None:
    for ec in collections.values():
        for name, t in ec.tables.items():
            st = ec.storage_of(name)
            if t.dynamic is not None and st.weight.device.type != "meta" and st.table_stats(name)["size"] > 0:
                raise ConfigError(
                    f"dynamic table {name!r} already holds rows; distribute the model before training it "
                    "(or save it and load the checkpoint into the distributed model)"
                )


def _wrap_ddp(model: nn.Module, ddp: bool | Mapping[str, Any], group) -> nn.Module:
    """``model`` in DistributedDataParallel over ``group``, its sharded collections' rows and
    buffers left out (they train through the exchange or the servers)."""
    if ddp is False:
        return model
    ours = {id(t) for m in model.modules() if isinstance(m, ShardedTables) for t in (*m.parameters(), *m.buffers())}
    ignore = [n for n, p in model.named_parameters() if id(p) in ours]
    ignore += [n for n, b in model.named_buffers() if id(b) in ours]
    if not any(p.requires_grad and id(p) not in ours for p in model.parameters()):
        return model  # nothing dense to synchronise
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignore)
    kwargs = dict(ddp) if isinstance(ddp, Mapping) else {}
    return DistributedModel(model, process_group=group, **kwargs)


class DistributedModel(DistributedDataParallel):
    """``DistributedDataParallel`` whose attribute reads fall through to the user's module:
    ``model.loss_fn`` or ``model.predict(...)`` of a distributed model work as on the plain one
    (a DDP wrapper otherwise hides them behind ``model.module``). Everything else is DDP's."""

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            inner = self.__dict__.get("_modules", {}).get("module")
            if inner is None or name.startswith("__"):
                raise
            return getattr(inner, name)


def _distribute_ps(
    model,
    collections,
    plan,
    group,
    reduction,
    ddp,
    budget,
    servers,
    mode,
    staleness,
    cache_rows,
    timeout,
    limit,
    server_exit,
    job_timeout,
):
    from ..ps import setup

    if servers == 0:
        raise ConfigError(
            "servers=0 keeps the tables in this process, which takes one process: call distribute(model, servers=0) "
            "without a process group (or use he.convert), or give the job servers"
        )
    if len(collections) != 1:
        raise ConfigError(
            f"parameter servers serve one collection of tables per model; this model has {len(collections)} "
            f"({', '.join(collections)}): put the tables in one EmbeddingCollection"
        )
    ((path, ec),) = collections.items()
    trainer_group, pc, run = setup(
        model,
        ec,
        _plan_for(plan, path, ec),
        group,
        servers=servers,
        mode=mode,
        staleness=staleness,
        cache_rows=cache_rows,
        timeout=timeout,
        limit=limit,
        reduction=reduction,
        budget=budget,
        job_timeout=job_timeout,
    )
    if pc is None:  # a server: it serves with the unsharded collection's rows freed
        collections.clear()
        del ec
        gc.collect()
        run()
        if server_exit:
            raise SystemExit(0)
        return None
    return _wrap_ddp(model, ddp, trainer_group)  # (over the trainers: the servers run no model)


def _collections(model: nn.Module) -> dict[str, EmbeddingCollection]:
    found: dict[int, tuple[str, EmbeddingCollection]] = {}
    for path, m in model.named_modules():
        if isinstance(m, EmbeddingCollection) and id(m) not in found:
            found[id(m)] = (path, m)
    # a collection inside another is sharded with it (none today)
    return {path: m for path, m in found.values()}


def _plan_for(plan, path: str, ec: EmbeddingCollection) -> Plan | None:
    if plan is None:
        return None
    if isinstance(plan, Plan):
        names = set(ec.tables)
        if {t.table for t in plan.tables} == names:
            return plan
        picked = tuple(t for t in plan.tables if t.table in names)
        return Plan(plan.world_size, picked, plan.strategy, dict(plan.notes))
    if path not in plan:
        raise ConfigError(f"plan: no plan for the collection at {path!r}; plans given for: {', '.join(plan)}")
    return plan[path]
