"""``hybridembed train --nproc N``: the job of several processes. Spawned here (:func:`spawn_job`),
joined as one rank of a torchrun job (:func:`join_job`), or run under torchrun's elastic agent
(``--max-restarts K``: :func:`elastic_job`, each start resuming from the last committed checkpoint,
:func:`resume_last_commit`). Each rank runs :func:`~.job.run`."""

from __future__ import annotations

import argparse
import math
import os
from typing import Any

import torch

from ..errors import RankLost
from ..utils import configure_logging, logging_configured
from . import elastic
from .job import generate_if_needed, run
from .options import JOB_PG_TIMEOUT, MODEL_DIR, one_line
from .parallel import Job


def backend(args: argparse.Namespace) -> str:
    """The job's torch.distributed backend: gloo on the CPU; on CUDA, NCCL for the GPUs' tensors
    (the exchange, DDP) and gloo beside it for the host's (counters, agreements, checkpoints,
    parameter servers)."""
    return "cpu:gloo,cuda:nccl" if torch.device(args.device).type == "cuda" else "gloo"


def rank_device(args: argparse.Namespace, rank: int, world: int, local_rank: int) -> str:
    """Where rank ``rank`` of ``world`` computes: with --device cuda, a trainer takes the GPU
    ``cuda:LOCAL_RANK`` and a parameter server (the last --servers ranks) the host; on the CPU, the CPU."""
    if torch.device(args.device).type != "cuda" or world == 1:
        return args.device
    if args.servers and rank >= world - args.servers:
        return "cpu"
    return f"cuda:{local_rank}"


def _on_rank(args: argparse.Namespace, rank: int, world: int, local_rank: int) -> argparse.Namespace:
    """``args`` with this rank's device (a copy: the caller's stays as given)."""
    device = rank_device(args, rank, world, local_rank)
    if device == args.device:
        return args
    mine = argparse.Namespace(**vars(args))
    mine.device = device
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))  # (NCCL's communicators and the kernels use the current GPU)
    return mine


def _rank_main(rank: int, world: int, args: argparse.Namespace, state: dict[str, Any] | None) -> int:
    """One rank of ``--nproc N`` (spawned): the command's run with this rank's :class:`Job`."""
    if getattr(args, "log_to_stderr", False):  # (as the command's own process: see spawn_job)
        configure_logging()
    return run(_on_rank(args, rank, world, rank), state, Job(rank, world))


def spawn_job(args: argparse.Namespace, state: dict[str, Any] | None) -> int:
    from ..launch import spawn

    if args.dataset == "criteo" and not args.data:
        generate_if_needed(args)  # here, before the job's collectives start their clocks
    args.log_to_stderr = logging_configured()  # the ranks print the library's records where this command does
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
        backend=backend(args),
        start_method="forkserver",  # (the ranks print where this command prints: see spawn)
    )
    return 0


def elastic_job(args: argparse.Namespace, argv: list[str], prog: str) -> int:
    """``--max-restarts K`` (not yet under the agent): the same command as N processes under
    torch's elastic agent (see :mod:`.elastic`)."""
    if args.dataset == "criteo" and not args.data:
        generate_if_needed(args)  # once, here: not by every start of the job
    return elastic.run_elastic(
        argv,
        prog=prog,
        nproc=args.nproc or 1,
        max_restarts=args.max_restarts,
        checkpoint=args.checkpoint,
        threads=args.threads,
        model_dir=MODEL_DIR,
    )


def resume_last_commit(args: argparse.Namespace, restart: int) -> None:
    """A start of the job under the elastic agent: continue from the last committed checkpoint
    in --checkpoint DIR when it holds one (then it wins over --resume), as --resume would."""
    if args.no_checkpoint:
        return
    found = elastic.checkpoint_to_resume(
        args.checkpoint or args.resume or os.path.join(args.workdir, "checkpoint"), MODEL_DIR
    )
    if found is not None:
        args.resume, args.restart = found, restart


class LostRank(Exception):
    """A collective failed because another rank of the job is gone (it prints its own error)."""


# gloo's errors when the peer of a collective died: "[.../gloo/transport/tcp/pair.cc:537] Read error ...:
# Connection reset by peer", "Connection closed by peer", "Broken pipe"
_LOST_PEER = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")


def _loopback_store(rank: int, world: int, timeout: Any) -> Any:
    """The job's store when rank 0 of this torchrun job makes it (not the agent's, shared) at a loopback
    MASTER_ADDR: one that listens on 127.0.0.1 alone (:func:`~hybridembed.launch.loopback_store`;
    torch's env:// store listens on every interface). None otherwise: torch's env:// rendezvous."""
    import ipaddress

    from ..launch import loopback_store

    addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" or not port.isdigit():
        return None
    try:
        loopback = addr == "localhost" or ipaddress.ip_address(addr).is_loopback
    except ValueError:
        loopback = False
    return loopback_store(int(port), world, rank == 0, timeout) if loopback else None


def join_job(args: argparse.Namespace, state: dict[str, Any] | None, rank: int, world: int) -> int:
    """One rank of a torchrun job (``hybridembed launch`` or torchrun itself)."""
    from datetime import timedelta

    import torch.distributed as dist

    ours = not dist.is_initialized()
    if ours:
        timeout = timedelta(seconds=args.timeout or JOB_PG_TIMEOUT)
        store = _loopback_store(rank, world, timeout)
        where = {} if store is None else {"store": store, "rank": rank, "world_size": world}
        dist.init_process_group(backend(args), timeout=timeout, **where)  # (every rank's: servers' too)
    args = _on_rank(args, rank, world, int(os.environ.get("LOCAL_RANK", "0")))
    try:
        return run(args, state, Job(rank, world))
    except RankLost as e:  # (the library named the rank that died, stopped or failed)
        raise LostRank(str(e)) from None
    except RuntimeError as e:
        text = str(e)
        if "gloo" in text and any(k in text for k in _LOST_PEER):
            reason = one_line(e).split("] ", 1)[-1].split(". ", 1)[0]  # "Read error [addr]: Connection reset by peer"
            raise LostRank(f"lost another rank of the job ({reason})") from None
        raise
    finally:
        if ours:
            from ..ps.collection import close_all

            close_all()  # (a trainer of parameter servers leaves them first: they serve until it does)
            try:
                dist.destroy_process_group()
            except RuntimeError:  # a broken group: the process ends anyway
                pass
