"""One process's run of ``hybridembed train`` (alone, or one rank of a job): the data read, the
model built (and distributed), the epochs trained and evaluated, checkpoints written
(:class:`Checkpointer`) or resumed, and the model exported. :func:`run` is the entry point; the
flags were checked before (:func:`~.checks.resolve`)."""

from __future__ import annotations

import argparse
import inspect
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .. import _env
from ..utils import get_logger
from . import data as D
from . import models as M
from .loop import evaluate, pinned, to_device, train_epoch
from .options import ADULT_SPLIT_SEED, ARCH_DEFAULTS, MODEL_DIR, STATE_FORMAT, STATE_KEY, UsageError, one_line
from .parallel import ONE, Job
from .report import describe_model, epoch_line, progress, ps_collection


def _arch(args: argparse.Namespace) -> dict[str, Any]:
    return {k: getattr(args, k) for k in ARCH_DEFAULTS}


# --- data ---------------------------------------------------------------------------------------
def _criteo_eval(paths: list[str], split: str, holdout: float, max_rows: int | None, limit: int) -> D.TensorSource:
    """The first ``limit`` evaluation rows, read once and kept in memory."""
    src = D.CriteoSource(paths, split=split, holdout=holdout, max_rows=max_rows)
    dense, sparse, label, n = [], [], [], 0
    for b in src.batches(min(limit, 65536)):
        take = min(len(b), limit - n)
        dense.append(b.dense[:take])
        sparse.append(b.sparse[:take])
        label.append(b.label[:take])
        n += take
        if n >= limit:
            break
    if not label:
        return D.TensorSource(
            torch.zeros(0, 13), torch.zeros(0, 26, dtype=torch.int64), torch.zeros(0), D.CRITEO_SPARSE, False
        )
    return D.TensorSource(torch.cat(dense), torch.cat(sparse), torch.cat(label), D.CRITEO_SPARSE, shuffle=False)


def generate_if_needed(args: argparse.Namespace) -> str:
    """The generated Criteo-format file of ``--rows`` and ``--seed`` (written, and said so, if absent)."""
    path = D.default_generated_path(args.workdir, args.rows, args.seed)
    if not os.path.isfile(path):
        t0 = time.perf_counter()
        D.generate_criteo(path, args.rows, seed=args.seed)
        print(f"generated {args.rows:,} Criteo-format rows in {time.perf_counter() - t0:.1f} s: {path}")
    return path


def load_data(args: argparse.Namespace) -> tuple[Any, D.TensorSource, str]:
    """(training source, evaluation source, a line describing both)."""
    if args.dataset == "adult":
        adult = D.load_adult(
            args.data, ids="hash", test_fraction=args.holdout, seed=ADULT_SPLIT_SEED, shuffle_seed=args.seed
        )
        desc = (
            f"UCI Adult {' + '.join(args.data)}: {adult.rows:,} rows ({adult.positives:,} with income >50K); "
            f"train {len(adult.train):,}, test {len(adult.test):,} (fixed permutation, seed {ADULT_SPLIT_SEED}); "
            f"{len(D.ADULT_CATEGORICAL)} categorical (string ids hashed), {len(D.ADULT_NUMERIC)} numeric (standardised)"
        )
        return adult.train, adult.test, desc
    paths = list(args.data or [])
    D.check_files(paths + list(args.val_data or []))
    generated = not paths
    if generated:
        paths = [generate_if_needed(args)]
    if args.val_data:
        train = D.CriteoSource(paths, split="all", max_rows=args.max_rows)
        test = _criteo_eval(list(args.val_data), "all", 0.0, None, args.eval_rows)
        where = f"the first {len(test):,} rows of {', '.join(args.val_data)}"
    else:
        train = D.CriteoSource(paths, split="train", holdout=args.holdout, max_rows=args.max_rows)
        test = _criteo_eval(paths, "val", args.holdout, args.max_rows, args.eval_rows) if args.holdout > 0 else None
        where = (
            f"{len(test):,} held-out rows ({args.holdout:g} of the rows, by a hash of their position)"
            if test is not None
            else "nothing (--holdout 0)"
        )
    kind = "generated Criteo-format" if generated else "Criteo-format"
    rows = f"{args.max_rows:,} rows of " if args.max_rows else ""
    desc = f"{kind} data: {rows}{', '.join(paths)}; evaluating on {where}"
    return train, test, desc


# --- checkpoints --------------------------------------------------------------------------------
class Checkpointer:
    """``he.save(DIR/model, model, optimizer, extra=...)``: the run's state (model flags, epoch,
    steps done in it) is stored in the checkpoint's manifest, committed atomically with the rows."""

    def __init__(
        self,
        directory: str | None,
        arch: dict[str, Any],
        unavailable: str | None = None,
        incremental: bool = False,
        background: bool = False,
    ):
        self.dir, self.arch = directory, arch
        self.unavailable: str | None = unavailable  # why no checkpoint is written
        self.last: str | None = None
        self.incremental, self.background = incremental, background
        self.pending = None  # a background save still writing

    def wait(self) -> None:
        """Until the background save (if any) is committed; its error, if it failed, is raised."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.wait()

    def save(self, model: nn.Module, optimizer: torch.optim.Optimizer, position: dict[str, Any]) -> bool:
        if self.dir is None or self.unavailable:
            return False
        from ..api import save

        state = {"format": STATE_FORMAT, "arch": self.arch, **position}
        os.makedirs(self.dir, exist_ok=True)
        try:
            out = save(
                os.path.join(self.dir, MODEL_DIR),
                model,
                optimizer,
                extra={STATE_KEY: state},
                incremental=self.incremental,
                background=self.background,
            )
            self.pending = out if self.background else None
        except NotImplementedError as e:
            self.unavailable = f"he.save is not available in this build ({e})"
            return False
        e = position["epoch"] + 1
        self.last = (
            f"{self.dir} (after epoch {e})"
            if position["complete"]
            else f"{self.dir} (epoch {e}, step {position['batches_done']})"
        )
        return True


def _resume(args: argparse.Namespace, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    from ..api import load

    try:
        load(os.path.join(args.resume, MODEL_DIR), model, optimizer)
    except NotImplementedError as e:
        raise UsageError(f"cannot resume from {args.resume}: he.load is not available in this build ({e})") from None
    if args.lr_given:
        for g in optimizer.param_groups:
            g["lr"] = args.lr


def _export(
    args: argparse.Namespace, model: nn.Module, example: D.Batch | None, job: Job = ONE, unavailable: str | None = None
) -> str:
    """``he.export`` of ``model`` (on every rank of a job: a collective); the line to print."""
    from ..api import export

    if example is None:
        return "export: skipped (no example batch)"
    if unavailable:
        return f"export: skipped, {unavailable}"
    os.makedirs(os.path.dirname(os.path.abspath(args.export)), exist_ok=True)
    model.eval()
    failure = None
    try:
        export(model, args.export, (example.dense[:8], example.sparse[:8]), format=args.export_format)
    except NotImplementedError as e:
        failure = f"he.export is not available in this build ({e})"
    except Exception as e:
        if not job.parallel:
            raise
        failure = f"not yet supported at world {job.world} (he.export: {type(e).__name__}: {one_line(e)[:200]})"
    if job.parallel and job.sum(failure is not None)[0] and failure is None:
        failure = f"not yet supported at world {job.world} (he.export failed on another rank)"
    if failure:
        return f"export: skipped, {failure}"
    return f"export: {args.export} ({args.export_format}; inputs dense (B, {example.dense.shape[1]}) float32, sparse (B, {example.sparse.shape[1]}) int64 ids)"


def _replaced_outputs(args: argparse.Namespace, state: dict[str, Any] | None) -> list[str]:
    """One line per output of an earlier run that this run will replace (a new run in the same
    --workdir): said at the start, not discovered afterwards."""
    lines = []
    resuming_here = (
        state is not None and args.resume and os.path.abspath(args.resume) == os.path.abspath(args.checkpoint or "")
    )
    if args.checkpoint and not resuming_here and os.path.isdir(os.path.join(args.checkpoint, MODEL_DIR)):
        lines.append(
            f"note: {args.checkpoint} holds an earlier run's checkpoint; this run replaces it at its first save "
            f"(--resume {args.checkpoint} continues it instead; --checkpoint DIR writes elsewhere)"
        )
    if args.export and os.path.exists(args.export):
        lines.append(f"note: {args.export} exists; this run replaces it at the end (--export PATH writes elsewhere)")
    return lines


# --- the run --------------------------------------------------------------------------------------
def run(args: argparse.Namespace, state: dict[str, Any] | None, job: Job = ONE) -> int:
    """Trains, evaluates, checkpoints and exports as ``args`` say; prints the results (rank 0)."""
    log = get_logger("hybridembed")
    level = log.level
    if not _env.text("LOG_LEVEL"):  # the command prints what happens; library INFO lines would repeat it
        log.setLevel(logging.WARNING)
    try:
        return _run(args, state, job)
    finally:
        log.setLevel(level)


# DistributedDataParallel's argument for "no buffer broadcast before each forward" (renamed in torch 2.13)
_NO_BUFFER_SYNC = (
    {"forward_sync_buffers": False}
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
    else {"broadcast_buffers": False}
)


def _distribute(args: argparse.Namespace, model: nn.Module) -> nn.Module | None:
    """``he.distribute(model)`` over the job: the model to train (None on a parameter server, once
    it has served the trainers)."""
    from ..distributed import distribute

    # the models' only buffer (DLRM's pair indices) is a constant: DDP's default broadcast of the
    # buffers before every forward cost ~7 ms of a ~25 ms step on Adult at world 2
    if args.servers:  # on a server: serves until every trainer has left, then None
        ps = {"mode": args.ps_mode, "staleness": args.staleness, "cache_rows": args.cache_rows}
        return distribute(model, servers=args.servers, server_exit=False, ddp=_NO_BUFFER_SYNC, **ps)
    return distribute(model, ddp=_NO_BUFFER_SYNC)


def _prefetcher(model: nn.Module, collection=None) -> Callable[[D.Batch], None]:
    """``prefetch`` of a batch's ids (the next step's) by the model's tables in ``collection`` (None:
    every set of them): ``--prefetch`` sends the pulls to the servers at once; with ``--tiered`` in
    one process, the rows on disk are read in a background thread while this step's optimizer step
    runs."""
    kinds = (M.DynamicEmbeddings, M.TieredEmbeddings)
    sets = [m for m in model.modules() if isinstance(m, kinds) and (collection is None or m.collection is collection)]

    def prefetch(b: D.Batch) -> None:
        for tables in sets:
            rows = getattr(tables, "rows", None)  # (tiered tables: ids hashed into their rows, as their forward does)
            ids = b.sparse if rows is None else b.sparse.remainder(rows)
            tables.collection.prefetch({n: ids[:, j] for j, n in enumerate(tables.names)})  # {feature: (B,)}

    return prefetch


def _pipeliner(model: nn.Module) -> Callable[[D.Batch], None] | None:
    """A sharded job's pipeline: after each forward, the next batch's ids sent to their owners
    while this step's backward and optimizer step run (``ec.prefetch``; None: no sharded tables)."""
    from ..api.prefetch import prefetch as prefetch_layers
    from ..distributed import ShardedCollection

    collections = [
        m.collection
        for m in model.modules()
        if isinstance(m, M.DynamicEmbeddings) and isinstance(m.collection, ShardedCollection)
    ]
    names = [m.names for m in model.modules() if isinstance(m, M.DynamicEmbeddings) and m.collection in collections]
    layers = [
        (path, len(m.tables))
        for path, m in model.named_modules()
        if isinstance(m, M.TorchEmbeddings) and isinstance(getattr(m.tables[0], "collection", None), ShardedCollection)
    ]
    if not collections and not layers:
        return None

    def send(b: D.Batch) -> None:
        for ec, ns in zip(collections, names):
            ec.prefetch({n: b.sparse[:, j] for j, n in enumerate(ns)})
        if layers:  # (converted nn.Embedding layers: one call for all, as their collection may be shared)
            prefetch_layers(model, {f"{p}.tables.{j}".lstrip("."): b.sparse[:, j] for p, n in layers for j in range(n)})

    return send


def _run(args: argparse.Namespace, state: dict[str, Any] | None, job: Job = ONE) -> int:
    """Reads the data and builds the model (distributed in a job), then :func:`_train` on it;
    a parameter server serves instead, until the trainers leave."""
    from ..distributed import unwrap

    t_start = time.perf_counter()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is not None:  # kernels launch on the current device
        torch.cuda.set_device(device)
    if job.parallel and args.dataset == "criteo" and not args.data:
        if job.main:  # one writer; the others wait for the file
            generate_if_needed(args)
        job.barrier()
    train, test, desc = load_data(args)
    most = max(args.batch_size, min(8192, len(test) if test is not None else 0))  # (a training or evaluation batch)
    if args.tiered and args.tiered_cache < most * len(train.features):
        raise UsageError(
            f"--tiered-cache {args.tiered_cache} rows cannot hold a batch's rows: up to {most * len(train.features):,} "
            f"({len(train.features)} features x {most:,} samples of a training or evaluation batch); give at least that"
        )
    model = M.build(
        args.model,
        train.num_dense,
        train.features,
        dim=args.embedding_dim,
        capacity=args.capacity or None,
        mlp=args.mlp,
        bottom=args.bottom_mlp,
        cross_layers=args.cross_layers,
        seed=args.seed,
        min_count=args.min_count,
        device=args.device,
        kernels=args.kernels,
        tiered=args.tiered,
        tiered_cache=args.tiered_cache or 0,
        tiered_mapped={"yes": True, "no": False}.get(args.tiered_mapped),
        sharded=job.parallel,
    )
    if job.parallel:
        model = _distribute(args, model)
        if model is None:  # a parameter server: it served the trainers until they left
            return 0
    inner = unwrap(model)  # the model itself (distributed: inside DistributedDataParallel)
    remote = ps_collection(inner)
    if remote is not None:  # from here on the job is the trainers: slices, gathers and prints among them
        import torch.distributed as dist

        group = model.process_group
        job = Job(dist.get_rank(group), dist.get_world_size(group), group)
    if remote is None:
        return _train(args, state, job, model, (train, test, desc), t_start)
    try:  # the servers serve until every trainer has left: this one leaves, also when it fails
        code = _train(args, state, job, model, (train, test, desc), t_start)
    except BaseException as e:
        remote.close(failed=f"trainer {job.rank} failed: {type(e).__name__}")
        raise
    remote.close()
    return code


def _train(
    args: argparse.Namespace, state: dict[str, Any] | None, job: Job, model: nn.Module, data: tuple, t_start: float
) -> int:
    """The epochs, checkpoints and export of ``model`` (built, and distributed in a job)."""
    import hybridembed as he

    from ..distributed import unwrap

    def say(*parts: Any, **kwargs: Any) -> None:
        if job.main:
            print(*parts, **kwargs)

    train, test, desc = data
    features = train.features
    inner = unwrap(model)
    remote = ps_collection(inner)
    cls = {"adagrad": torch.optim.Adagrad, "adam": torch.optim.Adam}[args.optimizer]
    optimizer = he.wrap_optimizer(cls(model.parameters(), lr=args.lr), model)
    epoch0, skip, step = 0, 0, 0
    if state is not None:
        _resume(args, inner, optimizer)
        epoch0, skip, step = int(state["epoch"]), int(state["batches_done"]), int(state["step"])
        if state["complete"]:  # the saved epoch was finished: start the next one
            epoch0, skip = epoch0 + 1, 0
    say(f"hybridembed train: {desc}")
    say(describe_model(args, inner, len(features), job))
    restart = getattr(args, "restart", None)
    if state is not None and restart is not None:  # under --max-restarts: the last committed checkpoint
        after = f" after restart {restart}" if restart else " (its last committed checkpoint)"
        say(f"resumed from {args.resume} (epoch {int(state['epoch']) + 1}, step {step}){after}")
    elif state is not None:
        where = f"epoch {epoch0 + 1}" + (f", step {skip} of it" if skip else "")
        say(f"resumed from {args.resume}: continuing at {where} (step {step} overall)")
    for line in _replaced_outputs(args, state):
        say(line)
    ckpt = Checkpointer(
        args.checkpoint,
        _arch(args),
        incremental=args.checkpoint_incremental,
        background=args.checkpoint_background,
    )
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    example = next(iter(test.batches(8))) if test is not None and len(test) else None
    estimate = train.estimate_rows()
    ahead = _prefetcher(inner, remote) if args.servers and args.prefetch else None
    if args.tiered and args.prefetch and not job.parallel:  # (one process: the next batch's rows on disk read ahead)
        ahead = _prefetcher(inner)
    pipeline = _pipeliner(inner) if job.parallel and not args.servers and args.pipeline else None
    for epoch in range(epoch0, args.epochs):
        label = f"epoch {epoch + 1}/{args.epochs}"
        bar = progress(estimate, skip * args.batch_size, label, args.no_progress or not job.main)
        done = [skip]

        def on_step(rows: int, loss: float | torch.Tensor, epoch: int = epoch, bar=bar, done=done) -> None:
            nonlocal step
            step += 1
            done[0] += 1
            if bar is not None:
                bar.update(rows)
                if done[0] % 10 == 0:
                    bar.set_postfix(loss=f"{float(loss):.4f}", refresh=False)
            if args.checkpoint_every and step % args.checkpoint_every == 0:
                ckpt.save(inner, optimizer, {"epoch": epoch, "batches_done": done[0], "step": step, "complete": False})

        batches = D.batches_with_skip(train, args.batch_size, epoch, skip)
        if cuda:  # page-locked in the reader's thread, so the copy to the GPU does not block
            batches = pinned(batches)
        try:
            tr = train_epoch(
                model,
                optimizer,
                to_device(D.prefetch(batches), device),
                on_step,
                job,
                prefetch=ahead,
                pipeline=pipeline,
            )
        finally:
            if bar is not None:
                bar.close()
        if example is None:
            example = next(iter(train.batches(8)), None)
        skip = 0
        ev = evaluate(model, to_device(test.batches(8192), device), job) if test is not None else None
        say(epoch_line(epoch + 1, args.epochs, tr if tr.rows else None, ev, inner, job), flush=True)
        ckpt.save(inner, optimizer, {"epoch": epoch, "batches_done": 0, "step": step, "complete": True,
                                     "test_auc": None if ev is None else ev.auc})  # fmt: skip
    if epoch0 >= args.epochs:
        ev = evaluate(model, to_device(test.batches(8192), device), job) if test is not None else None
        say(f"nothing to train: the checkpoint has done {epoch0} of --epochs {args.epochs}")
        say(epoch_line(epoch0, args.epochs, None, ev, inner, job))
    ckpt.wait()
    if args.checkpoint:
        if ckpt.last:
            say(f"checkpoint: {ckpt.last}")
        elif state is not None and os.path.abspath(args.checkpoint) == os.path.abspath(args.resume):
            say(f"checkpoint: {args.checkpoint} (unchanged: nothing was left to train)")
        else:
            say(f"checkpoint: skipped, {ckpt.unavailable or 'nothing trained'}")
    if args.export:
        if args.export_format == "onnx":  # (the dynamo exporter takes about a minute on 2 cores)
            say(f"export: writing {args.export} (onnx: torch.export, then onnxscript; about a minute)...", flush=True)
        say(_export(args, inner, None if example is None else next(to_device([example], device)), job))
    say(f"done in {time.perf_counter() - t_start:.1f} s", flush=True)
    return 0
