"""What a run prints: the progress bar of an epoch, the line describing the model, the line after
each epoch (losses, AUC, throughput, table rows) and the tables' statistics behind them
(with parameter servers, asked of them: :func:`ps_collection`)."""

from __future__ import annotations

import argparse

from torch import nn

from . import models as M
from .loop import EpochStats, EvalStats
from .parallel import ONE, Job


def ps_collection(model: nn.Module):
    """The model's PSCollection (its tables on parameter servers), or None."""
    from ..ps import PSCollection

    return next((m for m in model.modules() if isinstance(m, PSCollection)), None)


def progress(total: int | None, initial: int, desc: str, disable: bool):
    if disable:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(
        total=total, initial=initial, desc=desc, unit=" rows", unit_scale=True, leave=False, dynamic_ncols=True,
        disable=None, smoothing=0.1, mininterval=0.5,
    )  # fmt: skip


def table_stats(model: nn.Module, job: Job = ONE) -> tuple[int, int, int]:
    """(rows held, rows evicted, tables) over every dynamic table of ``model``: of all ranks'
    shards in a job (every rank calls it); with parameter servers, of the servers' shards (asked)."""
    rows = evicted = tables = 0
    remote = ps_collection(model)
    if remote is not None:
        for server in remote.server_stats():
            for s in server["tables"].values():
                rows += int(s.get("size") or 0)
                evicted += int(s.get("evicted") or 0)
        return rows, evicted, len(remote.tables)
    for m in model.modules():
        if isinstance(m, M.DynamicEmbeddings):
            c = m.collection
            tables += len(c.tables)
            local = c.local if getattr(c, "sharded", False) else c
            for s in local.dynamic_stats().values() if local is not None else ():
                rows += int(s["size"])
                evicted += int(s["evicted"])
    if job.parallel:
        rows, evicted = (int(v) for v in job.sum(rows, evicted))
    return rows, evicted, tables


def auc_text(ev: EvalStats) -> str:
    """``AUC 0.8012``, or why it is undefined: every held-out row of one class."""
    if ev.positives in (0, ev.rows):
        one = "positive" if ev.positives else "negative"
        return f"AUC undefined (all {ev.rows:,} held-out rows are {one}: more --rows or another --seed)"
    return f"AUC {ev.auc:.4f}"


def epoch_line(
    epoch: int, epochs: int, tr: EpochStats | None, ev: EvalStats | None, model: nn.Module, job: Job = ONE
) -> str:
    parts = [f"epoch {epoch}/{epochs}"]
    if tr is not None:
        parts.append(f"train loss {tr.loss:.4f}")
    if ev is not None and ev.rows:
        parts.append(f"test loss {ev.loss:.4f}  {auc_text(ev)}")
    if tr is not None:
        parts.append(f"{tr.rows:,} samples in {tr.seconds:.1f} s = {tr.samples_per_s:,.0f} samples/s")
    tiered = [m.collection for m in model.modules() if isinstance(m, M.TieredEmbeddings)]
    if tiered:  # (rows on disk: how often a step's rows were found in memory)
        keys = ("hits", "misses", "disk_reads", "prefetched")
        remote = ps_collection(model)
        if remote is not None:  # (the servers' caches, asked: every trainer hears the same)
            stats = [s for server in remote.server_stats() for s in server["storages"] if "hits" in s]
            hits, misses, reads, ahead = (sum(int(s.get(k, 0)) for s in stats) for k in keys)
        else:
            stats = [st.stats() for c in tiered for st in c.storages]
            hits, misses, reads, ahead = (int(v) for v in job.sum(*(sum(s[k] for s in stats) for k in keys)))
        seen = hits + misses
        parts.append(
            f"cache hit rate {hits / seen if seen else 0.0:.3f} so far ({reads:,} rows read from disk in the step, "
            f"{ahead:,} ahead of it)"
        )
        return "  ".join(parts)
    spills = [st.stats() for m in model.modules() if isinstance(m, M.DynamicEmbeddings) for st in m.collection.storages]
    if spills and "disk_rows" in spills[0]:  # (dynamic tables on disk)
        rows, disk, back, ahead = (
            int(v)
            for v in job.sum(
                *(sum(s.get(k, 0) for s in spills) for k in ("rows", "disk_rows", "read_back", "prefetched"))
            )
        )
        parts.append(
            f"table rows {rows:,} ({disk:,} on disk, {back:,} read back so far, {ahead:,} of them ahead of their step)"
        )
        return "  ".join(parts)
    rows, evicted, _ = table_stats(model, job)
    parts.append(f"table rows {rows:,}" + (f" ({evicted:,} evicted)" if evicted else ""))
    return "  ".join(parts)


def describe_model(args: argparse.Namespace, model: nn.Module, features: int, job: Job = ONE) -> str:
    dense = sum(p.numel() for n, p in model.named_parameters() if "storages" not in n)
    cap = "unbounded" if not args.capacity else f"<= {args.capacity:,} rows each"
    opt = {"adagrad": "Adagrad", "adam": "Adam"}[args.optimizer]
    _, _, tables = table_stats(model, job)
    threads = f"{args.threads} thread{'s' if args.threads > 1 else ''}"
    wire = "on cuda, one GPU per trainer, NCCL" if str(getattr(args, "device", "cpu")).startswith("cuda") else "gloo"
    if getattr(args, "servers", 0):
        s = args.servers
        how = args.ps_mode + (f", staleness {args.staleness}" if args.ps_mode == "async" else "")
        how += (f", {args.cache_rows:,} cached rows per trainer" if args.cache_rows else "") + (
            ", prefetch" if args.prefetch else ""
        )
        kind = f"{tables} dynamic tables ({features} features, dim {args.embedding_dim}"
        if getattr(args, "tiered", None) and args.hashed_tables:
            kind = f"{features} tiered tables (dim {args.embedding_dim}"
            cap = f"{args.capacity:,} rows each, ids hashed into them; files under {args.tiered}, {args.tiered_cache:,} rows a server in memory"
        elif getattr(args, "tiered", None):
            cap += f"; rows beyond {args.tiered_cache:,} a server in memory spilled to files under {args.tiered}"
        return (
            f"model {args.model}: {kind}, {cap}; "
            f"on {s} parameter server{'s' if s > 1 else ''}, {how}), {dense:,} dense parameters (data-parallel over "
            f"{job.world} trainer{'s' if job.world > 1 else ''}); {opt} lr {args.lr:g} via he.wrap_optimizer, batch "
            f"{args.batch_size:,} (~{args.batch_size // job.world:,} per trainer, {wire}), {threads} per process"
        )
    if job.parallel:
        if getattr(args, "tiered", None):  # (each shard's rows beyond its cache on its process's disk)
            kind = f"{features} tiered tables" if args.hashed_tables else f"{tables} dynamic tables"
            cap = (
                f"{args.capacity:,} rows each, ids hashed into them" if args.hashed_tables else "unbounded"
            ) + f"; files under {args.tiered}, {args.tiered_cache:,} rows of each process's shards in memory"
        else:
            kind = f"{tables} dynamic tables"
        return (
            f"model {args.model}: {kind} ({features} features, dim {args.embedding_dim}, {cap}; "
            f"sharded over {job.world} processes), {dense:,} dense parameters (data-parallel); {opt} lr {args.lr:g} "
            f"via he.wrap_optimizer, batch {args.batch_size:,} (~{args.batch_size // job.world:,} per process, {wire}"
            f"{', ids sent a step ahead' if getattr(args, 'pipeline', False) else ''}), {threads} per process"
        )
    kernels = getattr(args, "kernels_resolved", "eager")
    if getattr(args, "tiered", None) and not args.hashed_tables:
        return (
            f"model {args.model}: {tables} dynamic tables ({features} features, dim {args.embedding_dim}, unbounded; "
            f"rows beyond {args.tiered_cache:,} in memory spilled to files under {args.tiered}), {dense:,} dense "
            f"parameters; {opt} lr {args.lr:g} via he.wrap_optimizer, batch {args.batch_size:,}, {threads}; on cpu, "
            f"{kernels} kernels"
        )
    if getattr(args, "tiered", None):
        return (
            f"model {args.model}: {features} tiered tables (dim {args.embedding_dim}, {args.capacity:,} rows each, ids "
            f"hashed into them; files under {args.tiered}, {args.tiered_cache:,} rows in memory), {dense:,} dense "
            f"parameters; {opt} lr {args.lr:g} via he.wrap_optimizer, batch {args.batch_size:,}, {threads}; on cpu, "
            f"{kernels} kernels"
        )
    return (
        f"model {args.model}: {tables} dynamic tables ({features} features, dim {args.embedding_dim}, {cap}), "
        f"{dense:,} dense parameters; {opt} lr {args.lr:g} via he.wrap_optimizer, batch {args.batch_size:,}, "
        f"{threads}; on {getattr(args, 'device', 'cpu')}, {kernels} kernels"
    )
