"""The command line of ``hybridembed train``: its flags (:func:`build_parser`), their defaults and the
names of a checkpoint's parts (the constants), and how a problem with them is reported (:class:`UsageError`,
printed as one line by :func:`one_line`)."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from typing import Any

import torch

from .. import __version__
from ..kernels.backend import KERNELS
from ..utils import OneLineParser
from . import models as M

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
    "hashed_tables": False,  # --tiered: dense tables of --capacity rows, ids hashed into them
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


def one_line(e: BaseException) -> str:
    """A (possibly multi-line, listed) message as one line: ``a:\n  - b\n  - c`` -> ``a: b; c``."""
    lines = [ln.strip().removeprefix("- ") for ln in str(e).splitlines() if ln.strip()]
    if not lines:
        return type(e).__name__
    head, rest = lines[0], lines[1:]
    return head + (" " + "; ".join(rest) if rest else "")


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
        "train.txt; .gz read as is); adult: UCI Adult (parquet, a CSV, or UCI's adult.data adult.test), label income '>50K' (default: criteo)",
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
        "--tiered",
        metavar="DIR",
        help="tables on local disk: one table of --capacity rows per feature, ids hashed into it (colliding ids "
        "share a row), its rows and optimizer state in files under DIR, --tiered-cache rows in memory; with "
        "--capacity 0, the dynamic tables (no collisions), rows beyond --tiered-cache spilled to DIR and read back "
        "(they train exactly as in memory). For tables larger than memory (CPU; with --nproc N each process's "
        "shards in their own files under DIR, a cache each, or with --servers S the servers'; give DIR again "
        "with --resume; no export unless --export PATH: an export holds the tables in memory). wdl and deepfm "
        "have two sets of tables, each with its own cache",
    )
    m.add_argument(
        "--tiered-cache",
        type=_number(int, 0, False),
        metavar="ROWS",
        help="--tiered: rows (and their optimizer state) kept in memory, for all the tables together (each "
        "process's shards with --nproc N; default 262144; a step's distinct rows must fit)",
    )
    m.add_argument(
        "--tiered-mapped",
        choices=["auto", "yes", "no"],
        help="--tiered: the files also mapped into memory, rows copied from and into the mapping instead of a "
        "system call a row (he.Tiered's mapped; auto, the default: where the tables take at most an eighth of "
        "the memory; --prefetch reads ahead only files that are not mapped)",
    )
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
        "auto (HYBRIDEMBED_KERNELS, else triton on CUDA when installed, eager elsewhere) (default auto)",
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
        "--pipeline",
        action="store_true",
        help="with --nproc N: send each batch's ids to the tables' owners during the step before (after its forward, "
        "while its backward and optimizer step run; the same figures); off by default: measured no faster on a "
        "2-core machine (docs/benchmarks.md)",
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
        help="send the pulls of the next batch before this step's optimizer step, so rows travel while it pushes; "
        "with --tiered DIR in one process, read the next batch's rows on disk in a background thread meanwhile",
    )
    t.add_argument(
        "--max-restarts",
        type=_number(int, 0, True),
        metavar="K",
        help="run the processes under torch's elastic agent (torchrun's), which restarts them all up to K times when one "
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
    o.add_argument(
        "--export", metavar="PATH", help="export the trained model here (default WORKDIR/model.pt2, .pt or .onnx)"
    )
    o.add_argument(
        "--export-format",
        choices=["pt2", "torchscript", "onnx"],
        default=None,
        help="format of the export, a model that serves without hybridembed: pt2 (torch.export; "
        "torch.export.load(PATH).module()), torchscript (torch.jit.load) or onnx (default: by --export's "
        "suffix, .pt torchscript and .onnx onnx; else pt2)",
    )
    o.add_argument("--no-export", action="store_true", help="export nothing")
    p.add_argument("--version", action="version", version=f"hybridembed {__version__}")
    return p
