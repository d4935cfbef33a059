"""``hybridembed train``: train DLRM, Wide & Deep, DeepFM or DCNv2 on Criteo-format data or UCI Adult.

    hybridembed train                                            # 500k generated Criteo-format rows, < 1 minute
    hybridembed train --data day_0.gz --max-rows 10000000 --epochs 1 --checkpoint-every 1000
    hybridembed train --resume runs/train/checkpoint --epochs 3
    hybridembed train --dataset adult --data ../shared/data/adult.parquet --model wdl
    hybridembed train --nproc 2                                  # 2 processes (gloo), tables sharded
    hybridembed launch --nproc 2 -m hybridembed.cli train        # the same job under torchrun
    hybridembed train --nproc 2 --max-restarts 3 --checkpoint-every 500   # restarted from the last commit
    hybridembed train --nproc 3 --servers 1 --ps-mode async      # 2 trainers, the tables on 1 parameter server
    hybridembed train --device cuda --batch-size 65536           # one GPU: model, tables, batches and metrics on it

Every categorical feature gets its own dynamic table (``he.Dynamic(capacity=...)``): any id
gets a row on first sight, so there is no vocabulary pass. Without ``--data`` a Criteo-format
file with power-law ids is generated (once; reused while it exists). Each epoch prints the
training loss, the held-out loss and AUC, and the throughput; a checkpoint is written with
``he.save`` after every epoch (and every ``--checkpoint-every`` steps), ``--resume`` continues
from one with ``he.load``, and the model is exported with ``he.export`` at the end.
``--nproc N`` trains on N processes of one gloo job (spawned here, or joined under torchrun):
the tables sharded with ``he.distribute``, each rank on its slice of every global batch (see
:mod:`.parallel`); rank 0 prints. ``--max-restarts K`` runs them under torchrun's elastic agent,
each start resuming from the last committed checkpoint (see :mod:`.elastic`). ``--servers S``
makes the last S of the N processes parameter servers that hold the tables; the other N - S
train (see docs/train.md). ``--device cuda`` trains in one process on one GPU (tables made there,
batches pinned by the reader thread and copied without blocking); ``--kernels`` picks the tables'
kernel backend (:mod:`hybridembed.kernels.backend`).
Bad flags, missing files and malformed rows end the run with one ``error:`` line and exit code 2.
"""

from __future__ import annotations

import argparse
import inspect
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .. import __version__, _env
from ..distributed.launch import SpawnError
from ..errors import ConfigError, HybridEmbedError, RankLost
from ..kernels.backend import KERNELS, check_kernels
from ..utils import OneLineParser, get_logger
from . import data as D
from . import elastic
from . import models as M
from .loop import EpochStats, EvalStats, evaluate, pinned, to_device, train_epoch
from .parallel import ONE, Job

__all__ = ["main", "build_parser", "UsageError"]

PROG = "hybridembed train"
MODEL_DIR = "model"  # he.save's directory inside --checkpoint DIR
STATE_KEY = "hybridembed_train"  # the run's state, in he.save's extra= (committed with the rows)
STATE_FORMAT = 1

# flags that define the model (and its optimizer state): taken from the checkpoint on --resume
ARCH_DEFAULTS: dict[str, Any] = {
    "dataset": "criteo",
    "model": "dlrm",
    "embedding_dim": 16,
    "capacity": 100_000,
    "min_count": 1,
    "mlp": [128, 64],
    "bottom_mlp": [64],
    "cross_layers": 2,
    "optimizer": "adagrad",
}
# per-dataset defaults of the training flags
DATA_DEFAULTS: dict[str, dict[str, Any]] = {
    "criteo": {"batch_size": 2048, "epochs": 1, "holdout": 0.1},
    "adult": {"batch_size": 256, "epochs": 5, "holdout": 0.2},
}
LR_DEFAULTS = {"adagrad": 0.02, "adam": 1e-3}
PS_MODES = ("sync", "async")
PS_FLAGS = ("ps_mode", "staleness", "cache_rows", "prefetch")  # parameter-server flags: only with --servers
ONE_COLLECTION = ("dlrm", "dcnv2")  # the models whose tables form one collection (servers serve one per model)
ADULT_SPLIT_SEED = 0  # the Adult train/test split is fixed, whatever --seed says
JOB_PG_TIMEOUT = 1800  # seconds a collective of --nproc N waits for a rank that hangs: torch's default (--timeout)


class UsageError(Exception):
    """A problem with the command line or its files; printed as one line, exit code 2."""


def _number(kind: type, low: float, low_ok: bool, high: float | None = None) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        ok = (v >= low if low_ok else v > low) and (high is None or v < high) and math.isfinite(v)
        if not ok:
            rng = f"{'>=' if low_ok else '>'} {low}" + ("" if high is None else f" and < {high}")
            raise argparse.ArgumentTypeError(f"expected a {kind.__name__} {rng}, got {text!r}")
        return v

    return parse


def _device(text: str) -> str:
    """``--device``: cpu, cuda or cuda:N (whether it is there is checked later, by :func:`resolve`)."""
    try:
        dev = torch.device(text)
    except (RuntimeError, ValueError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda") or (dev.type == "cpu" and dev.index not in (None, 0)):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")
    return str(dev)


def _sizes(text: str) -> list[int]:
    """``--mlp``, ``--bottom-mlp``: comma-separated layer widths, each an int >= 1 (``128,64``)."""
    parts = [x.strip() for x in text.split(",")]
    bad = next((x for x in parts if not (x.isascii() and x.isdigit() and int(x) > 0)), None)
    if bad is not None:
        what = "an empty width" if not bad else f"width {bad!r}"
        raise argparse.ArgumentTypeError(
            f"expected comma-separated layer widths, each an int >= 1, like 128,64; got {text!r} ({what})"
        )
    return [int(x) for x in parts]


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    p = OneLineParser(
        prog=prog,
        description=(
            "Train a recommendation model (DLRM by default; Wide & Deep, DeepFM, DCNv2) with one dynamic "
            "hybridembed table per categorical feature, on Criteo-format TSV files or UCI Adult. Without "
            "--data, a Criteo-format file with power-law ids is generated. Prints loss, AUC and throughput "
            "per epoch, checkpoints every epoch, exports the model at the end."
        ),
        epilog="Examples and measured results: docs/train.md.",
    )
    d = p.add_argument_group("data")
    d.add_argument(
        "--dataset",
        choices=["criteo", "adult"],
        default=None,
        help="criteo: TSV with label, 13 integer and 26 hex categorical columns (the 1TB day files, Kaggle's "
        "train.txt; .gz read as is); adult: UCI Adult parquet, label income '>50K' (default: criteo)",
    )
    d.add_argument(
        "--data",
        nargs="+",
        metavar="FILE",
        help="the training file(s); for criteo without --data, a file of --rows rows is generated in --workdir",
    )
    d.add_argument(
        "--val-data",
        nargs="+",
        metavar="FILE",
        help="criteo: evaluate on these files instead of the rows --holdout keeps out of --data",
    )
    d.add_argument(
        "--holdout",
        type=_number(float, 0.0, True, 1.0),
        metavar="F",
        help="fraction of the rows held out for evaluation, chosen by a fixed hash of the row's position "
        "(criteo, default 0.1), or the test split by a fixed permutation (adult, default 0.2)",
    )
    d.add_argument(
        "--max-rows",
        type=_number(int, 0, False),
        metavar="N",
        help="criteo: read only the first N rows of --data (default: all)",
    )
    d.add_argument(
        "--eval-rows",
        type=_number(int, 0, False),
        default=100_000,
        metavar="N",
        help="criteo: evaluate on the first N held-out (or --val-data) rows (default 100000)",
    )
    d.add_argument(
        "--rows",
        type=_number(int, 0, False),
        default=500_000,
        metavar="N",
        help="rows to generate when --data is not given (default 500000)",
    )
    d.add_argument(
        "--workdir",
        default=os.path.join("runs", "train"),
        metavar="DIR",
        help="where generated data, the default checkpoint and the default export go (default runs/train)",
    )
    m = p.add_argument_group("model (taken from the checkpoint with --resume)")
    m.add_argument("--model", choices=list(M.MODELS), help="dlrm, wdl (Wide & Deep), deepfm or dcnv2 (default dlrm)")
    m.add_argument("--embedding-dim", type=_number(int, 0, False), metavar="D", help="embedding width (default 16)")
    m.add_argument(
        "--capacity",
        type=_number(int, 0, True),
        metavar="N",
        help="most rows kept per table; least recently used rows are evicted past it (default 100000; "
        "0: no limit, the table grows)",
    )
    m.add_argument(
        "--min-count",
        type=_number(int, 0, False),
        metavar="N",
        help="an id gets a row at its N-th sighting (counted in a bounded sketch); rarer ids read a zero "
        "vector (default 1)",
    )
    m.add_argument(
        "--mlp",
        type=_sizes,
        metavar="W,W",
        help="DLRM's top MLP, the deep tower of the others (default 128,64; a last layer to one logit is added)",
    )
    m.add_argument(
        "--bottom-mlp",
        type=_sizes,
        metavar="W,W",
        help="DLRM's bottom MLP over the dense features (default 64; a last layer of width D is added)",
    )
    m.add_argument("--cross-layers", type=_number(int, 0, False), metavar="N", help="DCNv2's cross layers (default 2)")
    m.add_argument(
        "--optimizer",
        choices=["adagrad", "adam"],
        help="torch.optim.Adagrad or Adam, wrapped with he.wrap_optimizer: tables get the sparse (row-wise, lazy) "
        "equivalent (default adagrad)",
    )
    t = p.add_argument_group("training")
    t.add_argument("--epochs", type=_number(int, 0, False), metavar="N", help="epochs in all (criteo 1, adult 5)")
    t.add_argument(
        "--batch-size", type=_number(int, 0, False), metavar="B", help="samples per step (criteo 2048, adult 256)"
    )
    t.add_argument(
        "--lr",
        type=_number(float, 0.0, False),
        help="learning rate (adagrad 0.02, adam 0.001; on --resume: the checkpoint's)",
    )
    t.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the initial weights, the generated data and the shuffling (default 0)",
    )
    t.add_argument(
        "--device",
        type=_device,
        default="cpu",
        metavar="DEV",
        help="where the model, its tables, the batches and the metrics live: cpu, cuda or cuda:N (one GPU, one "
        "process; default cpu). Checkpoints load on either",
    )
    t.add_argument(
        "--kernels",
        choices=list(KERNELS),
        default="auto",
        help="the tables' kernel backend: eager (PyTorch ops), triton (Triton kernels on CUDA; needs the gpu extra), "
        "auto (HYBRIDEMBED_KERNELS, else eager) (default auto)",
    )
    t.add_argument(
        "--nproc",
        type=_number(int, 0, False),
        metavar="N",
        help="train on N processes of one gloo job: tables sharded with he.distribute, dense layers "
        "data-parallel, each rank on B/N rows of every batch of --batch-size B (default 1; under torchrun: "
        "its WORLD_SIZE, joined; `hybridembed launch` runs torchrun)",
    )
    t.add_argument(
        "--timeout",
        type=_number(float, 0.0, False),
        metavar="SECONDS",
        help="with --nproc N: how long a collective of the job waits for a rank that hangs before failing, the "
        "process group's timeout (init_process_group(timeout=...); default: torch's, 1800)",
    )
    s = p.add_argument_group("parameter servers (with --nproc N)")
    s.add_argument(
        "--servers",
        type=_number(int, 0, True),
        default=0,
        metavar="S",
        help="the last S of the --nproc N processes are parameter servers: they hold the tables and apply their "
        "optimizer; the other N - S train, each on B/(N-S) rows of every batch, pulling rows and pushing row "
        "gradients (default 0: no servers, tables sharded over all N)",
    )
    s.add_argument(
        "--ps-mode",
        choices=list(PS_MODES),
        help="sync: a step's pushes of every trainer summed and applied before the next step reads (the math of "
        "--nproc N-S without servers); async: pushes applied on arrival, a trainer at most --staleness steps ahead "
        "of the slowest (default sync)",
    )
    s.add_argument(
        "--staleness",
        type=_number(int, 0, False),
        metavar="K",
        help="async: a pull of step s waits until every trainer pushed step s - K (default 1)",
    )
    s.add_argument(
        "--cache-rows",
        type=_number(int, 0, True),
        metavar="C",
        help="async: each trainer keeps up to C hot rows, served for --staleness steps, their gradients summed and "
        "written back (default 0: no cache)",
    )
    s.add_argument(
        "--prefetch",
        action="store_true",
        help="send the pulls of the next batch before this step's optimizer step, so rows travel while it pushes",
    )
    t.add_argument(
        "--max-restarts",
        type=_number(int, 0, True),
        metavar="K",
        help="run the processes under torchrun's elastic agent, which restarts them all up to K times when one "
        "fails or dies; every start resumes from the last committed checkpoint in --checkpoint DIR, if it holds "
        "one (needs checkpoints; --checkpoint-every STEPS bounds the steps redone)",
    )
    t.add_argument(
        "--threads",
        type=_number(int, 0, False),
        metavar="N",
        help="torch threads per process (default: (cores - 1) / processes, at least 1; the reader thread parses "
        "the next block meanwhile)",
    )
    t.add_argument(
        "--no-progress", action="store_true", help="no progress bar (none is shown when stderr is not a terminal)"
    )
    o = p.add_argument_group("checkpoint and export")
    o.add_argument(
        "--checkpoint",
        metavar="DIR",
        help="write a checkpoint here (he.save) after every epoch (default WORKDIR/checkpoint)",
    )
    o.add_argument("--no-checkpoint", action="store_true", help="write no checkpoint")
    o.add_argument(
        "--checkpoint-every",
        type=_number(int, 0, True),
        default=0,
        metavar="STEPS",
        help="also checkpoint every STEPS training steps, for long epochs (default 0: at epoch ends only)",
    )
    o.add_argument(
        "--checkpoint-incremental",
        action="store_true",
        help="checkpoints hold only the rows changed since the one before (a full one every 8; he.save "
        "incremental=True)",
    )
    o.add_argument(
        "--checkpoint-background",
        action="store_true",
        help="write checkpoints while training goes on (the step pauses only to copy; he.save background=True)",
    )
    o.add_argument(
        "--resume",
        metavar="DIR",
        help="continue from this checkpoint (he.load): its model flags, weights, optimizer state and position "
        "(epoch and step); --epochs counts all epochs, done ones included",
    )
    o.add_argument("--export", metavar="PATH", help="export the trained model here (default WORKDIR/model.pt or .onnx)")
    o.add_argument(
        "--export-format",
        choices=["torchscript", "onnx"],
        default="torchscript",
        help="format of the export, a model that serves without hybridembed (default torchscript)",
    )
    o.add_argument("--no-export", action="store_true", help="export nothing")
    p.add_argument("--version", action="version", version=f"hybridembed {__version__}")
    return p


# --- resolving the flags ------------------------------------------------------------------------
def _read_state(ckpt: str, flag: str = "--resume") -> dict[str, Any]:
    """The run's state (model flags, position) stored in the checkpoint's manifest by :class:`Checkpointer`."""
    from ..checkpoint import read_manifest

    if not os.path.isdir(ckpt):
        raise UsageError(f"{flag} {ckpt}: no such checkpoint directory")
    try:
        manifest = read_manifest(os.path.join(ckpt, MODEL_DIR))
    except HybridEmbedError as e:
        raise UsageError(f"{flag} {ckpt}: not a hybridembed train checkpoint ({_one_line(e)})") from None
    state = (manifest.get("extra") or {}).get(STATE_KEY)
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT or "arch" not in state:
        raise UsageError(f"{flag} {ckpt}: a hybridembed checkpoint, but not one written by hybridembed train")
    problems = _state_problems(state)
    if problems:
        raise UsageError(f"{flag} {ckpt}: the run's state in its manifest is malformed: {'; '.join(problems)}")
    return state


def _state_problems(state: dict[str, Any]) -> list[str]:
    """What is wrong with the run's state (types of the position and model flags); empty when fine."""
    problems = []
    for key in ("epoch", "batches_done", "step"):
        v = state.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            problems.append(f"{STATE_KEY}.{key} is {v!r}, expected an int >= 0")
    if not isinstance(state.get("complete"), bool):
        problems.append(f"{STATE_KEY}.complete is {state.get('complete')!r}, expected true or false")
    arch = state["arch"]
    if not isinstance(arch, dict):
        return problems + [f"{STATE_KEY}.arch is {arch!r}, expected an object of model flags"]
    for k, v in arch.items():
        default = ARCH_DEFAULTS.get(k)
        if k not in ARCH_DEFAULTS:
            problems.append(f"{STATE_KEY}.arch has the unknown flag {k!r}")
        elif (type(v) is not type(default) and not (isinstance(default, int) and v is None)) or (
            isinstance(v, list) and not all(type(x) is int for x in v)
        ):
            what = "a list of ints" if isinstance(default, list) else f"a {type(default).__name__}"
            problems.append(f"{STATE_KEY}.arch.{k} is {v!r}, expected {what}")
    return problems


def resolve(args: argparse.Namespace) -> dict[str, Any] | None:
    """Fills defaults in place (from the checkpoint with --resume); returns its state, if any."""
    state = None
    if args.resume:
        state = _read_state(args.resume, "--checkpoint" if getattr(args, "restart", None) is not None else "--resume")
        for k, saved in state["arch"].items():
            given = getattr(args, k, None)
            if given is not None and given != saved:
                flag = "--" + k.replace("_", "-")
                shown = ",".join(map(str, saved)) if isinstance(saved, list) else saved
                raise UsageError(
                    f"{flag} {given if not isinstance(given, list) else ','.join(map(str, given))} differs from the "
                    f"checkpoint's {shown}; drop {flag} to resume"
                )
            setattr(args, k, saved)
    for k, v in ARCH_DEFAULTS.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    for k, v in DATA_DEFAULTS[args.dataset].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.lr_given = args.lr is not None
    if args.lr is None:
        args.lr = LR_DEFAULTS[args.optimizer]
    if args.threads is None:
        args.threads = max(1, min(torch.get_num_threads(), (os.cpu_count() or 2) - 1) // _local_procs(args))
    world = args.nproc or 1
    _resolve_servers(args, world)
    _resolve_device(args, world)
    trainers = world - args.servers
    if args.batch_size < trainers:
        who = (
            f"the {trainers} trainers (--nproc {world} --servers {args.servers})"
            if args.servers
            else f"--nproc {world}"
        )
        raise UsageError(f"--batch-size {args.batch_size} is smaller than {who}; give at least one row per rank")
    if args.dataset == "adult":
        if not args.data:
            raise UsageError("--dataset adult needs --data PATH (the UCI Adult parquet file)")
        if len(args.data) != 1:
            raise UsageError(f"--dataset adult reads one parquet file, got {len(args.data)}")
        for flag in ("val_data", "max_rows"):
            if getattr(args, flag):
                raise UsageError(f"--{flag.replace('_', '-')} applies to --dataset criteo only")
    if args.no_checkpoint:
        args.checkpoint = None
    elif args.checkpoint is None:
        args.checkpoint = args.resume or os.path.join(args.workdir, "checkpoint")
    if args.max_restarts and not args.checkpoint:
        raise UsageError(
            f"--max-restarts {args.max_restarts} restarts from checkpoints, and --no-checkpoint writes none; drop "
            "--no-checkpoint (checkpoints go to --checkpoint DIR, default WORKDIR/checkpoint)"
        )
    if args.no_export:
        args.export = None
    elif args.export is None:
        args.export = os.path.join(args.workdir, "model.onnx" if args.export_format == "onnx" else "model.pt")
    _check_outputs(args)
    return state


def _resolve_device(args: argparse.Namespace, world: int) -> None:
    """Refuses a --device that is not there or cannot run this job, and a --kernels that cannot run."""
    dev = torch.device(args.device)
    if dev.type == "cuda":
        if world > 1:
            raise UsageError(
                f"--device {args.device} with --nproc {world}: a job of several processes runs over gloo on CPU "
                "tensors (one GPU per rank over NCCL is not supported yet); use --device cuda with --nproc 1, or "
                f"--device cpu with --nproc {world}"
            )
        if not torch.cuda.is_available():
            why = "torch is built without CUDA" if torch.version.cuda is None else "no CUDA device is visible"
            raise UsageError(
                f"--device {args.device}: CUDA is not available ({why}; torch {torch.__version__}); use --device cpu, "
                "or run on a machine with a GPU and a CUDA build of torch"
            )
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise UsageError(
                f"--device {args.device}: this machine has {count} CUDA device{'s' if count != 1 else ''} "
                f"(cuda:0{f'..cuda:{count - 1}' if count > 1 else ''}); give one of those"
            )
    try:
        args.kernels_resolved = check_kernels(args.kernels)
    except ConfigError as e:
        raise UsageError(f"--kernels {args.kernels}: {e}") from None


def _resolve_servers(args: argparse.Namespace, world: int) -> None:
    """Checks the parameter-server flags against --nproc and the model; fills their defaults."""
    flags = [f"--{k.replace('_', '-')}" for k in PS_FLAGS if getattr(args, k) not in (None, False)]
    if not args.servers:
        if flags:
            raise UsageError(
                f"{flags[0]} applies to parameter servers; add --servers S (the last S of the --nproc N processes "
                "serve the tables)"
            )
        return
    if args.servers >= world:
        raise UsageError(
            f"--servers {args.servers} leaves no trainer among --nproc {world} process{'es' if world > 1 else ''}; "
            f"give --nproc {args.servers + 1} or more (the last {args.servers} serve, the others train)"
        )
    if args.model not in ONE_COLLECTION:
        raise UsageError(
            f"--servers serves one collection of tables per model, and --model {args.model} has two (its first-order "
            f"tables apart); use --model {' or '.join(ONE_COLLECTION)} with --servers"
        )
    if args.ps_mode is None:
        args.ps_mode = "sync"
    if args.ps_mode == "sync":
        for flag in ("staleness", "cache_rows"):
            if getattr(args, flag) is not None:
                raise UsageError(
                    f"--{flag.replace('_', '-')} applies to --ps-mode async; in sync mode every step reads the rows "
                    "the step before it updated (add --ps-mode async)"
                )
    if args.staleness is None:
        args.staleness = 1
    if args.cache_rows is None:
        args.cache_rows = 0


def _check_outputs(args: argparse.Namespace) -> None:
    """Refuse, before any data is read or step trained, outputs that cannot be written."""
    if not args.data:  # the generated data goes there
        _check_output("--workdir", args.workdir, directory=True)
    if args.checkpoint:
        _check_output("--checkpoint", args.checkpoint, directory=True)
        _check_output("--checkpoint", os.path.join(args.checkpoint, MODEL_DIR), directory=True)
    if args.export:
        _check_output("--export", args.export, directory=False)


def _check_output(flag: str, path: str, directory: bool) -> None:
    """``path`` can be written: a directory (made if absent) or a file; nothing is created."""
    full = os.path.abspath(path)
    if directory and os.path.exists(full) and not os.path.isdir(full):
        raise UsageError(f"{flag} {path}: exists and is not a directory; give a directory")
    if not directory and os.path.isdir(full):
        raise UsageError(f"{flag} {path}: is a directory; give a file name, e.g. {os.path.join(path, 'model.pt')}")
    where = full if directory and os.path.isdir(full) else os.path.dirname(full)
    while not os.path.exists(where):  # the nearest existing folder is where it will be made
        where = os.path.dirname(where)
    if not os.path.isdir(where):
        raise UsageError(f"{flag} {path}: {where} is a file, not a directory")
    if not os.access(where, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {path}: {where} is not writable; give another path")


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
            args.data[0], ids="hash", test_fraction=args.holdout, seed=ADULT_SPLIT_SEED, shuffle_seed=args.seed
        )
        desc = (
            f"UCI Adult {args.data[0]}: {adult.rows:,} rows ({adult.positives:,} with income >50K); "
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


# --- output ---------------------------------------------------------------------------------------
def _progress(total: int | None, initial: int, desc: str, disable: bool):
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


def _table_stats(model: nn.Module, job: Job = ONE) -> tuple[int, int, int]:
    """(rows held, rows evicted, tables) over every dynamic table of ``model``: of all ranks'
    shards in a job (every rank calls it); with parameter servers, of the servers' shards (asked)."""
    rows = evicted = tables = 0
    remote = _collection(model)
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


def _epoch_line(
    epoch: int, epochs: int, tr: EpochStats | None, ev: EvalStats | None, model: nn.Module, job: Job = ONE
) -> str:
    parts = [f"epoch {epoch}/{epochs}"]
    if tr is not None:
        parts.append(f"train loss {tr.loss:.4f}")
    if ev is not None and ev.rows:
        parts.append(f"test loss {ev.loss:.4f}  AUC {ev.auc:.4f}")
    if tr is not None:
        parts.append(f"{tr.rows:,} samples in {tr.seconds:.1f} s = {tr.samples_per_s:,.0f} samples/s")
    rows, evicted, _ = _table_stats(model, job)
    parts.append(f"table rows {rows:,}" + (f" ({evicted:,} evicted)" if evicted else ""))
    return "  ".join(parts)


def _describe_model(args: argparse.Namespace, model: nn.Module, features: int, job: Job = ONE) -> str:
    dense = sum(p.numel() for n, p in model.named_parameters() if "storages" not in n)
    cap = "unbounded" if not args.capacity else f"<= {args.capacity:,} rows each"
    opt = {"adagrad": "Adagrad", "adam": "Adam"}[args.optimizer]
    _, _, tables = _table_stats(model, job)
    threads = f"{args.threads} thread{'s' if args.threads > 1 else ''}"
    if getattr(args, "servers", 0):
        s = args.servers
        how = args.ps_mode + (f", staleness {args.staleness}" if args.ps_mode == "async" else "")
        how += (f", {args.cache_rows:,} cached rows per trainer" if args.cache_rows else "") + (
            ", prefetch" if args.prefetch else ""
        )
        return (
            f"model {args.model}: {tables} dynamic tables ({features} features, dim {args.embedding_dim}, {cap}; "
            f"on {s} parameter server{'s' if s > 1 else ''}, {how}), {dense:,} dense parameters (data-parallel over "
            f"{job.world} trainer{'s' if job.world > 1 else ''}); {opt} lr {args.lr:g} via he.wrap_optimizer, batch "
            f"{args.batch_size:,} (~{args.batch_size // job.world:,} per trainer, gloo), {threads} per process"
        )
    if job.parallel:
        return (
            f"model {args.model}: {tables} dynamic tables ({features} features, dim {args.embedding_dim}, {cap}; "
            f"sharded over {job.world} processes), {dense:,} dense parameters (data-parallel); {opt} lr {args.lr:g} "
            f"via he.wrap_optimizer, batch {args.batch_size:,} (~{args.batch_size // job.world:,} per process, gloo), "
            f"{threads} per process"
        )
    kernels = getattr(args, "kernels_resolved", "eager")
    return (
        f"model {args.model}: {tables} dynamic tables ({features} features, dim {args.embedding_dim}, {cap}), "
        f"{dense:,} dense parameters; {opt} lr {args.lr:g} via he.wrap_optimizer, batch {args.batch_size:,}, "
        f"{threads}; on {getattr(args, 'device', 'cpu')}, {kernels} kernels"
    )


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
        failure = f"not yet supported at world {job.world} (he.export: {type(e).__name__}: {_one_line(e)[:200]})"
    if job.parallel and job.sum(failure is not None)[0] and failure is None:
        failure = f"not yet supported at world {job.world} (he.export failed on another rank)"
    if failure:
        return f"export: skipped, {failure}"
    return f"export: {args.export} ({args.export_format}; inputs dense (B, {example.dense.shape[1]}) float32, sparse (B, {example.sparse.shape[1]}) int64 ids)"


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


def _collection(model: nn.Module):
    """The model's PSCollection (its tables on parameter servers), or None."""
    from ..ps import PSCollection

    return next((m for m in model.modules() if isinstance(m, PSCollection)), None)


def _prefetcher(model: nn.Module, remote) -> Callable[[D.Batch], None]:
    """``--prefetch``: sends the pulls of a batch's ids (the next step's) to the servers at once."""
    (tables,) = [m for m in model.modules() if isinstance(m, M.DynamicEmbeddings) and m.collection is remote]

    def prefetch(b: D.Batch) -> None:
        remote.prefetch({n: b.sparse[:, j] for j, n in enumerate(tables.names)})  # {feature: (B,)}

    return prefetch


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
    )
    if job.parallel:
        model = _distribute(args, model)
        if model is None:  # a parameter server: it served the trainers until they left
            return 0
    inner = unwrap(model)  # the model itself (distributed: inside DistributedDataParallel)
    remote = _collection(inner)
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
    remote = _collection(inner)
    cls = {"adagrad": torch.optim.Adagrad, "adam": torch.optim.Adam}[args.optimizer]
    optimizer = he.wrap_optimizer(cls(model.parameters(), lr=args.lr), model)
    epoch0, skip, step = 0, 0, 0
    if state is not None:
        _resume(args, inner, optimizer)
        epoch0, skip, step = int(state["epoch"]), int(state["batches_done"]), int(state["step"])
        if state["complete"]:  # the saved epoch was finished: start the next one
            epoch0, skip = epoch0 + 1, 0
    say(f"hybridembed train: {desc}")
    say(_describe_model(args, inner, len(features), job))
    restart = getattr(args, "restart", None)
    if state is not None and restart is not None:  # under --max-restarts: the last committed checkpoint
        after = f" after restart {restart}" if restart else " (its last committed checkpoint)"
        say(f"resumed from {args.resume} (epoch {int(state['epoch']) + 1}, step {step}){after}")
    elif state is not None:
        where = f"epoch {epoch0 + 1}" + (f", step {skip} of it" if skip else "")
        say(f"resumed from {args.resume}: continuing at {where} (step {step} overall)")
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
    for epoch in range(epoch0, args.epochs):
        label = f"epoch {epoch + 1}/{args.epochs}"
        bar = _progress(estimate, skip * args.batch_size, label, args.no_progress or not job.main)
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
            tr = train_epoch(model, optimizer, to_device(D.prefetch(batches), device), on_step, job, prefetch=ahead)
        finally:
            if bar is not None:
                bar.close()
        if example is None:
            example = next(iter(train.batches(8)), None)
        skip = 0
        ev = evaluate(model, to_device(test.batches(8192), device), job) if test is not None else None
        say(_epoch_line(epoch + 1, args.epochs, tr if tr.rows else None, ev, inner, job), flush=True)
        ckpt.save(inner, optimizer, {"epoch": epoch, "batches_done": 0, "step": step, "complete": True,
                                     "test_auc": None if ev is None else ev.auc})  # fmt: skip
    if epoch0 >= args.epochs:
        ev = evaluate(model, to_device(test.batches(8192), device), job) if test is not None else None
        say(f"nothing to train: the checkpoint has done {epoch0} of --epochs {args.epochs}")
        say(_epoch_line(epoch0, args.epochs, None, ev, inner, job))
    ckpt.wait()
    if args.checkpoint:
        if ckpt.last:
            say(f"checkpoint: {ckpt.last}")
        elif state is not None and os.path.abspath(args.checkpoint) == os.path.abspath(args.resume):
            say(f"checkpoint: {args.checkpoint} (unchanged: nothing was left to train)")
        else:
            say(f"checkpoint: skipped, {ckpt.unavailable or 'nothing trained'}")
    if args.export:
        say(_export(args, inner, None if example is None else next(to_device([example], device)), job))
    say(f"done in {time.perf_counter() - t_start:.1f} s", flush=True)
    return 0


# --- processes ------------------------------------------------------------------------------------
def _torchrun_world() -> tuple[int, int] | None:
    """(rank, world size) when started by torchrun (RANK and WORLD_SIZE set), else None."""
    rank, world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    if rank is None or world is None:
        return None
    try:
        return int(rank), int(world)
    except ValueError:
        raise UsageError(f"RANK={rank!r} and WORLD_SIZE={world!r} must be ints (as torchrun sets them)") from None


def _local_procs(args: argparse.Namespace) -> int:
    """Processes of this job on this machine (they share its cores)."""
    if _torchrun_world() is not None:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ["WORLD_SIZE"]))
    return args.nproc or 1


def _rank_main(rank: int, world: int, args: argparse.Namespace, state: dict[str, Any] | None) -> int:
    """One rank of ``--nproc N`` (spawned): the command's run with this rank's :class:`Job`."""
    return run(args, state, Job(rank, world))


def _spawn(args: argparse.Namespace, state: dict[str, Any] | None) -> int:
    from ..distributed.launch import spawn

    if args.dataset == "criteo" and not args.data:
        generate_if_needed(args)  # here, before the job's collectives start their clocks
    # no time limit on the job; a collective waits at most --timeout (JOB_PG_TIMEOUT) for a rank that
    # hangs (a rank that fails or dies stops the others within seconds)
    spawn(
        _rank_main,
        args.nproc,
        args,
        state,
        timeout=math.inf,
        pg_timeout=args.timeout or JOB_PG_TIMEOUT,
        threads=args.threads,
        start_method="spawn",  # (rank 0 prints where this command prints)
    )
    return 0


def _elastic(args: argparse.Namespace, argv: list[str], prog: str) -> int:
    """``--max-restarts K`` (not yet under torchrun): the same command as N processes under
    torchrun's elastic agent (see :mod:`.elastic`)."""
    if args.dataset == "criteo" and not args.data:
        generate_if_needed(args)  # once, here: not by every start of the job
    cmd = elastic.torchrun_command(args.nproc or 1, args.max_restarts, argv)
    return elastic.run_elastic(
        cmd,
        prog=prog,
        nproc=args.nproc or 1,
        max_restarts=args.max_restarts,
        checkpoint=args.checkpoint,
        threads=args.threads,
        model_dir=MODEL_DIR,
    )


def _resume_last_commit(args: argparse.Namespace, restart: int) -> None:
    """A start of the job under the elastic agent: continue from the last committed checkpoint
    in --checkpoint DIR when it holds one (then it wins over --resume), as --resume would."""
    if args.no_checkpoint:
        return
    found = elastic.checkpoint_to_resume(
        args.checkpoint or args.resume or os.path.join(args.workdir, "checkpoint"), MODEL_DIR
    )
    if found is not None:
        args.resume, args.restart = found, restart


class _LostRank(Exception):
    """A collective failed because another rank of the job is gone (it prints its own error)."""


# gloo's errors when the peer of a collective died: "[.../gloo/transport/tcp/pair.cc:537] Read error ...:
# Connection reset by peer", "Connection closed by peer", "Broken pipe"
_LOST_PEER = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")


def _loopback_store(rank: int, world: int, timeout: Any) -> Any:
    """The job's store when rank 0 of this torchrun job makes it (not the agent's, shared) at a loopback
    MASTER_ADDR: one that listens on 127.0.0.1 alone (:func:`~hybridembed.distributed.launch.loopback_store`;
    torch's env:// store listens on every interface). None otherwise: torch's env:// rendezvous."""
    import ipaddress

    from ..distributed.launch import loopback_store

    addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" or not port.isdigit():
        return None
    try:
        loopback = addr == "localhost" or ipaddress.ip_address(addr).is_loopback
    except ValueError:
        loopback = False
    return loopback_store(int(port), world, rank == 0, timeout) if loopback else None


def _join(args: argparse.Namespace, state: dict[str, Any] | None, rank: int, world: int) -> int:
    """One rank of a torchrun job (``hybridembed launch`` or torchrun itself)."""
    from datetime import timedelta

    import torch.distributed as dist

    ours = not dist.is_initialized()
    if ours:
        timeout = timedelta(seconds=args.timeout or JOB_PG_TIMEOUT)
        store = _loopback_store(rank, world, timeout)
        where = {} if store is None else {"store": store, "rank": rank, "world_size": world}
        dist.init_process_group("gloo", timeout=timeout, **where)
    try:
        return run(args, state, Job(rank, world))
    except RankLost as e:  # (the library named the rank that died, stopped or failed)
        raise _LostRank(str(e)) from None
    except RuntimeError as e:
        text = str(e)
        if "gloo" in text and any(k in text for k in _LOST_PEER):
            reason = _one_line(e).split("] ", 1)[-1].split(". ", 1)[0]  # "Read error [addr]: Connection reset by peer"
            raise _LostRank(f"lost another rank of the job ({reason})") from None
        raise
    finally:
        if ours:
            from ..ps.collection import close_all

            close_all()  # (a trainer of parameter servers leaves them first: they serve until it does)
            try:
                dist.destroy_process_group()
            except RuntimeError:  # a broken group: the process ends anyway
                pass


def _one_line(e: BaseException) -> str:
    """A (possibly multi-line, listed) message as one line: ``a:\n  - b\n  - c`` -> ``a: b; c``."""
    lines = [ln.strip().removeprefix("- ") for ln in str(e).splitlines() if ln.strip()]
    if not lines:
        return type(e).__name__
    head, rest = lines[0], lines[1:]
    return head + (" " + "; ".join(rest) if rest else "")


def main(argv: Sequence[str] | None = None, prog: str = PROG) -> int:
    """``hybridembed train [flags]``; returns the exit code (2 for bad flags, files or rows)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(prog).parse_args(argv)
    where = ""  # which rank says it, in a torchrun job
    try:
        joined = _torchrun_world()
        if joined is not None:
            rank, world = joined
            where = f" (rank {rank} of {world})" if world > 1 else ""
            if args.nproc is not None and args.nproc != world:
                raise UsageError(
                    f"--nproc {args.nproc} differs from this torchrun job's WORLD_SIZE {world}; drop --nproc "
                    "(the launcher sets the job's size)"
                )
            args.nproc = world
        restart = elastic.restart_count() if joined is not None else None
        if args.max_restarts is not None or restart:  # a start of an elastic job (checked before it): the last commit
            _resume_last_commit(args, restart or 0)
        state = resolve(args)
        if joined is None and args.max_restarts is not None:
            return _elastic(args, argv, prog)
        if joined is not None and joined[1] > 1:
            return _join(args, state, *joined)
        if (args.nproc or 1) > 1:
            return _spawn(args, state)
        return run(args, state)
    except SpawnError as e:
        sys.stdout.flush()
        if isinstance(e.error, KeyboardInterrupt):
            print(f"{prog}: interrupted", file=sys.stderr)
            return 130
        if isinstance(e.error, (UsageError, D.DataError, HybridEmbedError)):
            print(f"{prog}: error: {_one_line(e.error)} (rank {e.rank} of {args.nproc})", file=sys.stderr)
            return 2
        if isinstance(e.error, RankLost):  # (a rank lost by another: named in the message, no traceback)
            print(f"{prog}: error: {_one_line(e.error)} (rank {e.rank} of {args.nproc})", file=sys.stderr)
            return 1
        print(f"{prog}: error: {e}", file=sys.stderr)  # a bug: the rank's traceback
        return 1
    except (UsageError, D.DataError, HybridEmbedError) as e:
        sys.stdout.flush()
        print(f"{prog}: error: {_one_line(e)}{where}", file=sys.stderr)
        return 2
    except _LostRank as e:
        sys.stdout.flush()
        print(f"{prog}: error: {e}{where}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        sys.stdout.flush()
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
