"""Checking a run's flags before anything starts: the environment it runs in (a torchrun job or
not), the checkpoint it resumes from, the device, the parameter servers and the outputs. :func:`resolve`
fills the defaults in place and raises :class:`~.options.UsageError` for what cannot run."""

from __future__ import annotations

import argparse
import importlib.util
import os
from typing import Any

import torch

from ..errors import ConfigError, HybridEmbedError
from ..kernels.backend import check_kernels, describe
from . import data as D
from .options import (
    ARCH_DEFAULTS,
    DATA_DEFAULTS,
    LR_DEFAULTS,
    MODEL_DIR,
    ONE_COLLECTION,
    PS_FLAGS,
    STATE_FORMAT,
    STATE_KEY,
    UsageError,
    one_line,
)


def torchrun_world() -> tuple[int, int] | None:
    """(rank, world size) when started by torchrun (RANK and WORLD_SIZE set), else None."""
    rank, world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    if rank is None or world is None:
        return None
    try:
        return int(rank), int(world)
    except ValueError:
        raise UsageError(f"RANK={rank!r} and WORLD_SIZE={world!r} must be ints (as torchrun sets them)") from None


def local_procs(args: argparse.Namespace) -> int:
    """Processes of this job on this machine (they share its cores)."""
    if torchrun_world() is not None:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ["WORLD_SIZE"]))
    return args.nproc or 1


def _read_state(ckpt: str, flag: str = "--resume") -> dict[str, Any]:
    """The run's state (model flags, position) stored in the checkpoint's manifest by :class:`~.job.Checkpointer`."""
    from ..checkpoint import read_manifest

    if not os.path.isdir(ckpt):
        raise UsageError(f"{flag} {ckpt}: no such checkpoint directory")
    try:
        manifest = read_manifest(os.path.join(ckpt, MODEL_DIR))
    except HybridEmbedError as e:
        raise UsageError(f"{flag} {ckpt}: not a hybridembed train checkpoint ({one_line(e)})") from None
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
    tiered = getattr(args, "tiered", None)  # (--capacity 0: dynamic tables on disk; else dense tables, ids hashed)
    args.hashed_tables = True if tiered and args.capacity != 0 else None
    if args.resume:
        state = _read_state(args.resume, "--checkpoint" if getattr(args, "restart", None) is not None else "--resume")
        if tiered and args.capacity is None and not state["arch"].get("hashed_tables"):
            args.hashed_tables = None  # (a checkpoint of dynamic tables: on disk if unbounded, see _resolve_tiered)
        for k, saved in state["arch"].items():
            given = getattr(args, k, None)
            if k == "hashed_tables" and given and not saved:
                raise UsageError(
                    "--tiered: the checkpoint's tables are dynamic tables, not hashed ones: drop --capacity (a "
                    "checkpoint of unbounded tables resumes on disk) or --tiered"
                )
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
    _resolve_tiered(args)
    args.lr_given = args.lr is not None
    if args.lr is None:
        args.lr = LR_DEFAULTS[args.optimizer]
    if args.threads is None:
        args.threads = max(1, min(torch.get_num_threads(), (os.cpu_count() or 2) - 1) // local_procs(args))
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
            raise UsageError(f"--dataset adult needs --data FILE... ({D.ADULT_SOURCE})")
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
    if args.export_format is None:
        from ..api.export import SUFFIX_FORMATS

        args.export_format = SUFFIX_FORMATS.get(os.path.splitext(args.export or "")[1].lower(), "pt2")
    if args.no_export:
        args.export = None
    elif args.export is None:
        suffix = {"pt2": "pt2", "torchscript": "pt", "onnx": "onnx"}[args.export_format]
        args.export = os.path.join(args.workdir, f"model.{suffix}")
    if args.export and args.export_format == "onnx":  # (before training, not after it)
        missing = [m for m in ("onnx", "onnxscript") if importlib.util.find_spec(m) is None]
        if missing:
            raise UsageError(
                f"--export-format onnx needs the {' and '.join(missing)} package{'s' if len(missing) > 1 else ''}: "
                'pip install -e ".[export]" (or pip install onnx onnxscript onnxruntime); or --export-format '
                "pt2, or --no-export"
            )
    _check_outputs(args)
    return state


def _resolve_tiered(args: argparse.Namespace) -> None:
    """--tiered DIR: dense tables on disk, ids hashed into them (a checkpoint of such tables resumes
    with --tiered again: its files are where the rows work, not what keeps them), or with --capacity
    0 the job's dynamic tables with rows beyond the cache on disk (their checkpoints are dynamic
    tables', in memory or not); on the CPU, in one process, each process's shards on its disk, or
    the parameter servers' on theirs."""
    if args.tiered is not None and not args.tiered.strip():
        raise UsageError("--tiered needs a directory (DIR), got an empty one")
    if args.hashed_tables and not args.tiered:
        raise UsageError("the checkpoint's tables are tiered (hashed into files on disk): give --tiered DIR to resume")
    if not args.tiered:
        for flag in ("tiered_cache", "tiered_mapped"):
            if getattr(args, flag) is not None:
                raise UsageError(f"--{flag.replace('_', '-')} applies to --tiered DIR only")
        return
    args.tiered_cache = args.tiered_cache or 262_144
    for bad, why in (
        (torch.device(args.device).type != "cpu", "keeps its cache on the CPU (no --device cuda)"),
        (
            not args.hashed_tables and args.capacity,
            f"with dynamic tables keeps every row (the checkpoint's --capacity {args.capacity} evicts rows past it)",
        ),
        (
            args.hashed_tables and args.min_count != 1,
            "with --capacity N admits every id (its tables have a row for every hash): drop --min-count",
        ),
    ):
        if bad:
            raise UsageError(f"--tiered {args.tiered} {why}")
    if args.export is None:  # (an export holds every table in memory: only when asked for, --export PATH)
        args.no_export = True


def _resolve_device(args: argparse.Namespace, world: int) -> None:
    """Refuses a --device that is not there or cannot run this job, and a --kernels that cannot run.
    A job of several processes on CUDA takes one GPU per trainer (``cuda:LOCAL_RANK``; parameter
    servers stay on the host): there --device names the kind, not one GPU."""
    dev = torch.device(args.device)
    joined = torchrun_world()
    server = joined is not None and bool(args.servers) and joined[0] >= world - args.servers
    if dev.type == "cuda" and not server:  # (a parameter server of a torchrun job needs no GPU)
        if not torch.cuda.is_available():
            why = "torch is built without CUDA" if torch.version.cuda is None else "no CUDA device is visible"
            raise UsageError(
                f"--device {args.device}: CUDA is not available ({why}; torch {torch.__version__}); use --device cpu, "
                "or run on a machine with a GPU and a CUDA build of torch"
            )
        count = torch.cuda.device_count()
        if world > 1 and dev.index is not None:
            raise UsageError(
                f"--device {args.device} with --nproc {world}: each trainer of a job takes its own GPU "
                "(cuda:LOCAL_RANK, over NCCL); give --device cuda"
            )
        trainers = world - (args.servers or 0)
        if world > 1 and joined is None and trainers > count:
            raise UsageError(
                f"--device cuda with --nproc {world}: {trainers} trainer{'s' if trainers > 1 else ''} take one GPU "
                f"each, and this machine has {count}; give --nproc {count + (args.servers or 0)} or fewer"
                + (" (parameter servers need no GPU)" if args.servers else "")
            )
        if dev.index is not None and dev.index >= count:
            raise UsageError(
                f"--device {args.device}: this machine has {count} CUDA device{'s' if count != 1 else ''} "
                f"(cuda:0{f'..cuda:{count - 1}' if count > 1 else ''}); give one of those"
            )
    try:
        args.kernels_resolved = describe(check_kernels(args.kernels), args.device)
    except ConfigError as e:
        raise UsageError(f"--kernels {args.kernels}: {e}") from None


def _resolve_servers(args: argparse.Namespace, world: int) -> None:
    """Checks the parameter-server flags against --nproc and the model; fills their defaults."""
    flags = [f"--{k.replace('_', '-')}" for k in PS_FLAGS if getattr(args, k) not in (None, False)]
    if not args.servers:
        if args.tiered and world == 1:  # (one process: --prefetch reads the next batch's rows on disk ahead)
            flags = [f for f in flags if f != "--prefetch"]
        if flags:
            also = "; or, without servers, give it with --tiered DIR in one process" if flags[0] == "--prefetch" else ""
            raise UsageError(
                f"{flags[0]} applies to parameter servers; add --servers S (the last S of the --nproc N processes "
                f"serve the tables){also}"
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
        raise UsageError(f"{flag} {path}: is a directory; give a file name, e.g. {os.path.join(path, 'model.pt2')}")
    where = full if directory and os.path.isdir(full) else os.path.dirname(full)
    while not os.path.exists(where):  # the nearest existing folder is where it will be made
        where = os.path.dirname(where)
    if not os.path.isdir(where):
        raise UsageError(f"{flag} {path}: {where} is a file, not a directory")
    if not os.access(where, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {path}: {where} is not writable; give another path")
