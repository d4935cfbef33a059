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
:mod:`.parallel`); rank 0 prints. ``--max-restarts K`` runs them under torch's elastic agent,
each start resuming from the last committed checkpoint (see :mod:`.elastic`). ``--servers S``
makes the last S of the N processes parameter servers that hold the tables; the other N - S
train (see docs/train.md). ``--device cuda`` trains in one process on one GPU (tables made there,
batches pinned by the reader thread and copied without blocking); ``--kernels`` picks the tables'
kernel backend (:mod:`hybridembed.kernels.backend`).
Bad flags, missing files and malformed rows end the run with one ``error:`` line and exit code 2.

The command is split by role: :mod:`.options` (the flags and constants), :mod:`.checks` (the flags
checked before anything starts), :mod:`.job` (one process's run), :mod:`.report` (what it prints),
:mod:`.multiproc` (the job of several processes); this module keeps :func:`main`.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from ..errors import HybridEmbedError, RankLost
from ..launch import SpawnError
from . import data as D
from . import elastic
from .checks import resolve, torchrun_world
from .job import Checkpointer, generate_if_needed, load_data, run
from .multiproc import LostRank, elastic_job, join_job, resume_last_commit, spawn_job
from .options import (
    ARCH_DEFAULTS,
    DATA_DEFAULTS,
    JOB_PG_TIMEOUT,
    MODEL_DIR,
    PROG,
    STATE_FORMAT,
    STATE_KEY,
    UsageError,
    build_parser,
    one_line,
)

__all__ = [
    "ARCH_DEFAULTS",
    "DATA_DEFAULTS",
    "JOB_PG_TIMEOUT",
    "MODEL_DIR",
    "PROG",
    "STATE_FORMAT",
    "STATE_KEY",
    "Checkpointer",
    "UsageError",
    "build_parser",
    "generate_if_needed",
    "load_data",
    "main",
    "resolve",
    "run",
]


def main(argv: Sequence[str] | None = None, prog: str = PROG) -> int:
    """``hybridembed train [flags]``; returns the exit code (2 for bad flags, files or rows)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(prog).parse_args(argv)
    where = ""  # which rank says it, in a torchrun job
    try:
        joined = torchrun_world()
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
            resume_last_commit(args, restart or 0)
        state = resolve(args)
        if joined is None and args.max_restarts is not None:
            return elastic_job(args, argv, prog)
        if joined is not None and joined[1] > 1:
            return join_job(args, state, *joined)
        if (args.nproc or 1) > 1:
            return spawn_job(args, state)
        return run(args, state)
    except SpawnError as e:
        sys.stdout.flush()
        if isinstance(e.error, KeyboardInterrupt):
            print(f"{prog}: interrupted", file=sys.stderr)
            return 130
        if isinstance(e.error, (UsageError, D.DataError, HybridEmbedError)):
            print(f"{prog}: error: {one_line(e.error)} (rank {e.rank} of {args.nproc})", file=sys.stderr)
            return 2
        if isinstance(e.error, RankLost):  # (a rank lost by another: named in the message, no traceback)
            print(f"{prog}: error: {one_line(e.error)} (rank {e.rank} of {args.nproc})", file=sys.stderr)
            return 1
        print(f"{prog}: error: {e}", file=sys.stderr)  # a bug: the rank's traceback
        return 1
    except (UsageError, D.DataError, HybridEmbedError) as e:
        sys.stdout.flush()
        print(f"{prog}: error: {one_line(e)}{where}", file=sys.stderr)
        return 2
    except LostRank as e:
        sys.stdout.flush()
        print(f"{prog}: error: {e}{where}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        sys.stdout.flush()
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    from ..utils import configure_logging

    configure_logging()
    sys.exit(main())
