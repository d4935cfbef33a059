"""Fuzz faults across ranks: one rank's bad input, malformed parameter-server requests, checkpoint
races; every trial classified as clear, silent, crash or hang against an independent reference.

    PYTHONPATH=src:. python benchmarks/fuzz_faults.py --seed 0 --trials 100 --json fuzz.json
    PYTHONPATH=src:. python benchmarks/fuzz_faults.py --seed 3 --trials 8 --families input   # seconds
    PYTHONPATH=src:. python benchmarks/fuzz_faults.py --seed 0 --families input --case ec2 --only 17  # one trial

Families (``--trials`` each, split over its cases). Every job is separate processes (each runs this
script as ``python`` would, forked from a warm process: ``tests/warm.py``) on
gloo (timeout 10 s), bounded: a job whose ranks all stay silent for 60 s (``FUZZ_STALL``; 180 s
while they start, until every rank is ready) is killed (hang), a rank that dies ends its job (crash), and the next job starts after the trial it
ended in, so the script always finishes (``--budget``: seconds per family; trials left are "not
run"). Trials are drawn from ``(seed, case, trial)`` alone: ``--only T`` runs trial T again.

1. ``input``: one rank's bad batch. Jobs of 2 ranks (an ``EmbeddingCollection`` model, ``ec2``;
   a plain ``nn.Embedding``/``nn.EmbeddingBag`` model converted by ``he.distribute``, ``plain2``)
   and of 3 ranks (``ec3``); every table sharded: row-wise (modulo placement; a dynamic table by
   hash), table-wise, column-wise. Each trial is 0-2 good steps, then ONE random rank's randomly
   malformed batch (wrong dtypes, missing/extra/renamed features, non-dict input, meta tensors,
   negative, out-of-range or huge ids, bad offsets, wrong or non-finite weights, tensors of the
   wrong rank, a device string ("cuda:0") or None for a feature, string ids for dense tables,
   ...), then a good step. Every rank's loop skips a step whose forward raises ``ValueError``.
   A draw that one process (the reference model, on the bad batch alone) accepts is not a bad
   batch: it is redrawn and counted as excluded. **clear**: in the bad step every rank raised a
   ``ValueError`` (the bad rank its own, the others one naming it), no rank raised in a good step,
   and after the trial every rank's gathered tables and MLP equal one process that trained on the
   ranks' concatenated good batches and skipped the bad step (within 1e-4); **silent**: otherwise
   (a job whose tables differ ends, the next trials run in a new one); **crash**: a rank's process
   died (e.g. its bad batch raised another error than a ``ValueError``); **hang**: the job stopped.
2. ``ps``: malformed requests to a parameter server (2 trainers + 1 server, 50 frames a job).
   Trainer 0 sends frames over gloo, each answered before the next: test_wire's named and random
   bad requests (unknown shards, ids out of range, pushes with non-finite gradients or of another
   step, payloads that do not parse...), random bytes, frames cut short or with k bytes more
   payload than declared, a refused request followed by k bytes, headers of 7 or 9 int64,
   closing nonces that differ, a nonce of 0, valid requests with one header field broken (never
   into another valid request), meta JSON near or over the size limit or nested past Python's
   recursion limit. **clear**: an error reply carrying the frame's request id, and the server's
   tables (read back whole, bit for bit) and counters (rows pulled and pushed, steps applied,
   the tables' own stats) unchanged; then both trainers train 6 steps and equal one process (if
   not, every frame of that job is silent); **silent**: an OK reply or a change; **crash**: the
   server died; **hang**: no reply within 10 s. Not fuzzed (NOT_FUZZED, with why): frames larger
   than the server's buffer, payloads that parse on STATS and BYE, a valid frame followed by more
   bytes (what the server does with one is measured and reported under "probes").
3. ``ckpt``: checkpoint races. ``threads``: two models of one process saving into one directory
   from two threads (each writer at random: blocking or background, incremental or not, keep
   1-3); ``procs``: two processes doing the same; ``dload``: a world-2 job loading again and
   again while another process commits; ``kill``: a committed version, then a writer (a forked
   process) SIGKILLed at a random point of its save (a file write, before, inside or right after
   its commit, while its cleanup deletes the older version, or a random delay), then another
   model's save and a load. Every save first changes its model's rows (a training step), copies
   them to ``snaps/<tag>.pt`` and tags the save (``extra``). **clear**: a second writer is refused with a CheckpointError (or succeeds
   after the first finished); every load returns a committed version whose rows are its save's
   copy, exactly, and the same version on every rank (or is refused on every rank: a version
   deleted by the writer's ``keep`` while it was read); LATEST is the last commit; no committed
   version is gone unless a later save's ``keep`` let it go; no version holds a refused save's
   rows; **silent**: otherwise; **crash**: a save or load raised another error, or a process
   died; **hang**: as above. Listed under "notable" (clear, and worth knowing): an older version
   a killed writer's cleanup was deleting, left damaged (a load of it is refused, naming the
   damage), versions never committed, temporary files the next save did not remove.

Output: a table per family and case (tried / clear / silent / crash / hang), and with ``--json``
every trial that was not clear (its case, trial and what happened: rerun it with ``--only``), the
exclusions, the kinds drawn and what the trials counted (saves refused, kills, ...).
``FUZZ_INJECT="case:trial:what"`` plants a failure (see :func:`_planted`): the smoke test's check
that each outcome is reported as what it is.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import random
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import hybridembed as he
from hybridembed.checkpoint import layout as ck
from hybridembed.distributed import make_plan, unwrap
from hybridembed.input import offsets_from_lengths
from hybridembed.ps import ServerLost, transport, wire
from hybridembed.ps.wire import Message

ROOT = Path(__file__).resolve().parents[1]
OUTCOMES = ("clear", "silent", "crash", "hang")
TOL = 1e-4  # the largest difference from one process taken as equal (float sums in another order)
JOB_TIMEOUT = 10.0  # seconds: the jobs' process-group timeout (a collective waits no longer)
STALL = float(os.environ.get("FUZZ_STALL", "60"))  # seconds without a word from any rank: the job is stopped (hang)
SETUP = 180.0  # seconds a job's ranks may take to start (import, rendezvous, model) before the stall clock runs


# --- jobs of separate processes, bounded ------------------------------------------------------------
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(extra: dict | None = None) -> dict:
    """The workers' environment: this hybridembed (the one this process would import) and the repo
    (for ``tests.ps.test_wire``'s generators) first on the path; one intra-op thread per process."""
    env = dict(os.environ)
    src = str(Path(he.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.update(OMP_NUM_THREADS="1", HYBRIDEMBED_LOG_LEVEL="ERROR", PYTHONUNBUFFERED="1")
    env.update(extra or {})
    return env


class Job:
    """``python fuzz_faults.py --worker ...`` on ``world`` ranks (``tests/warm.py``) of one gloo job (or ``world``
    independent processes with ``dist=False``). Each rank appends JSON lines to ``out/rank<r>.jsonl``;
    a job whose ranks all stay silent for ``stall`` seconds, or that outlives ``limit``, is killed."""

    def __init__(self, out: Path, world: int, argv: list[str], *, dist: bool = True, env: dict | None = None):
        self.out, self.world = out, world
        out.mkdir(parents=True, exist_ok=True)
        port = _free_port()
        base = _env(env)
        if dist:
            base.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world))
        from tests.warm import Script  # (each rank forked from a warm process: starts in ~0.1 s, not ~5)

        self.procs = [
            Script(
                Path(__file__).resolve(),
                ["--worker", *argv],
                {**base, "RANK": str(r), "LOCAL_RANK": str(r), "FUZZ_OUT": str(out)},
                out / f"rank{r}.log",  # (a file: a pipe nobody reads would block a chatty rank)
                cwd=ROOT,
                new_session=True,
            )
            for r in range(world)
        ]

    def _progress(self) -> int:
        total = 0
        for r in range(self.world):
            p = self.out / f"rank{r}.jsonl"
            total += p.stat().st_size if p.exists() else 0
        return total

    def _started(self) -> bool:
        """Has every rank reported ``ready`` (its setup done)?"""
        for r in range(self.world):
            p = self.out / f"rank{r}.jsonl"
            if not p.exists() or '"ready": true' not in p.read_text():
                return False
        return True

    def wait(self, stall: float = STALL, limit: float = 600.0, grace: float = JOB_TIMEOUT + 15) -> dict:
        """-> {"codes": [exit codes (-9: killed)], "how": "ok" | "crash" | "hang", "lines": [[dict] per rank]}.
        Until every rank is ready the allowance is ``SETUP`` (fresh processes on a loaded machine
        can take longer than ``stall`` to import and meet); a stall after that is a hang."""
        start = last = time.monotonic()
        seen, first_death, how, started = -1, None, "ok", False
        while True:
            codes = [p.poll() for p in self.procs]
            now = time.monotonic()
            if all(c is not None for c in codes):
                break
            size = self._progress()
            if size != seen:
                seen, last = size, now
                started = started or self._started()
            if first_death is None and any(c not in (None, 0) for c in codes):
                first_death = now
            if first_death is not None and now - first_death > grace:
                how = "crash"
                break
            if now - last > (stall if started else max(stall, SETUP)) or now - start > limit:
                how = "hang"
                break
            time.sleep(0.05)
        for p in self.procs:
            if p.poll() is None:
                self.kill(p)
        codes = [p.returncode for p in self.procs]
        if how == "ok" and any(c != 0 for c in codes):
            how = "crash"
        return {"codes": codes, "how": how, "lines": [self.lines(r) for r in range(self.world)]}

    @staticmethod
    def kill(p) -> None:
        try:
            os.killpg(p.pid, signal.SIGCONT)
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait(10)

    def lines(self, r: int) -> list[dict]:
        p = self.out / f"rank{r}.jsonl"
        if not p.exists():
            return []
        out = []
        for line in p.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:  # (a line cut short by a kill)
                pass
        return out

    def log_tail(self, r: int, n: int = 1500) -> str:
        p = self.out / f"rank{r}.log"
        return p.read_text(errors="replace")[-n:] if p.exists() else ""


def emit(**obj: Any) -> None:
    """A worker's report: one JSON line in ``$FUZZ_OUT/rank<RANK>.jsonl`` (flushed: a kill loses nothing)."""
    path = Path(os.environ["FUZZ_OUT"]) / f"rank{os.environ.get('RANK', '0')}.jsonl"
    with open(path, "a") as f:
        f.write(json.dumps(obj, default=str) + "\n")


def _seed(*parts: Any) -> int:
    """A 31-bit seed from any parts (the same in every process)."""
    return zlib.crc32("/".join(map(str, parts)).encode()) & 0x7FFFFFFF


def _short(e: BaseException, n: int = 400) -> str:
    text = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {text}"[:n]


# --- family 1: one rank's bad input --------------------------------------------------------------------
INPUT_CASES = {"ec2": ("ec", 2), "plain2": ("plain", 2), "ec3": ("ec", 3)}  # case -> (model, world)
B = 4  # samples per rank and step


class ECModel(nn.Module):
    """An EmbeddingCollection of four tables (one id per sample; weighted bags, mean; padded (B, 3),
    sqrtn; a dynamic table, bags) and an MLP on their pooled rows."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        tables = [
            he.TableConfig("a", 40, 4),
            he.TableConfig("b", 30, 4, combiner="mean"),
            he.TableConfig("c", 20, 4, combiner="sqrtn"),
            he.TableConfig("q", None, 4, dynamic=he.Dynamic()),
        ]
        self.ec = he.EmbeddingCollection(tables, seed=3)
        self.mlp = nn.Linear(16, 1)

    def forward(self, x):
        out = self.ec(x)
        return self.mlp(torch.cat([out[f] for f in "abcq"], 1)).squeeze(1)  # (B,)


class PlainModel(nn.Module):
    """Plain torch layers (he.distribute converts them): nn.Embedding of (B,) ids; nn.EmbeddingBag of
    (ids, offsets, per_sample_weights), sum; nn.EmbeddingBag of (B, 3) ids, mean; and an MLP."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Embedding(40, 4)
        self.b = nn.EmbeddingBag(30, 4, mode="sum")
        self.c = nn.EmbeddingBag(20, 4, mode="mean")
        self.mlp = nn.Linear(12, 1)

    def forward(self, x):
        a = self.a(x["a"])  # (B, D)
        b = self.b(x["b"], x["b_off"], per_sample_weights=x["b_w"])  # (B, D)
        c = self.c(x["c"])  # (B, D)
        return self.mlp(torch.cat([a, b, c], 1)).squeeze(1)  # (B,)


def plan_for(kind: str, world: int):
    """Every table sharded (none data-parallel): a row-wise (modulo placement), b table-wise on the
    last rank, c column-wise, q (dynamic) row-wise (hash placement)."""
    tables = list(
        ECModel().ec.tables.values() if kind == "ec" else he.convert(PlainModel()).hybridembed.tables.values()
    )
    over: dict[str, Any] = {"a": {"sharding": "row_wise", "placement": "mod"}, "c": "column_wise", "q": "row_wise"}
    over["b"] = {"sharding": "table_wise", "ranks": [world - 1]}
    over = {k: v for k, v in over.items() if any(t.name == k for t in tables)}
    return make_plan(tables, world, data_parallel_below=0, overrides=over)


def _good_batch(kind: str, seed: int, t: int, j: int, rank: int):
    """Rank ``rank``'s batch of step ``j`` of trial ``t``: (input, targets (B,))."""
    g = torch.Generator().manual_seed(_seed(seed, kind, t, j, rank))
    a = torch.randint(0, 40, (B,), generator=g)
    lengths = torch.randint(0, 4, (B,), generator=g)
    n = int(lengths.sum())
    bv, bw = torch.randint(0, 30, (n,), generator=g), torch.rand(n, generator=g) + 0.5
    c = torch.randint(0, 20, (B, 3), generator=g)
    y = torch.rand(B, generator=g)
    if kind == "plain":
        return {"a": a, "b": bv, "b_off": offsets_from_lengths(lengths)[:-1], "b_w": bw, "c": c}, y
    c[torch.rand(B, 3, generator=g) < 0.3] = -1  # (padding)
    ql = torch.randint(1, 3, (B,), generator=g)
    qv = torch.randint(-50, 50, (int(ql.sum()),), generator=g) * 1_000_003
    x = {"a": a, "b": he.Jagged(bv, offsets_from_lengths(lengths), bw), "c": c}
    x["q"] = he.Jagged(qv, offsets_from_lengths(ql))
    return x, y


def _concat(kind: str, xs: list) -> dict:
    """Every rank's batch as one (the one-process reference's)."""

    def jag(js):
        w = [j.weights for j in js]
        lengths = torch.cat([j.lengths() for j in js])
        ws = torch.cat(w) if all(x is not None for x in w) else None
        return he.Jagged(torch.cat([j.values for j in js]), offsets_from_lengths(lengths), ws)

    if kind == "plain":
        starts = [0]
        for x in xs[:-1]:
            starts.append(starts[-1] + x["b"].numel())
        out = {k: torch.cat([x[k] for x in xs]) for k in ("a", "b", "b_w", "c")}
        out["b_off"] = torch.cat([x["b_off"] + s for x, s in zip(xs, starts)])
        return out
    return {
        "a": torch.cat([x["a"] for x in xs]),
        "b": jag([x["b"] for x in xs]),
        "c": torch.cat([x["c"] for x in xs]),
        "q": jag([x["q"] for x in xs]),
    }


KINDS = {  # the malformations of each model's batch (see _malform)
    "ec": [
        "dtype",
        "offsets-dtype",
        "missing",
        "extra",
        "renamed",
        "non-dict",
        "key-type",
        "weights-length",
        "weights-nonfinite",
        "weights-dtype",
        "weights-2d",
        "weights-not-tensor",
        "meta",
        "meta-offsets",
        "negative",
        "range",
        "huge",
        "offsets",
        "offsets-empty",
        "offsets-2d",
        "ids-rank",
        "values-2d",
        "device-string",
        "string-ids",
        "lists-bad",
        "tuple-bad",
        "sparse-dup",
    ],
    "plain": [
        "dtype",
        "offsets-dtype",
        "weights-length",
        "weights-nonfinite",
        "weights-dtype",
        "weights-2d",
        "meta",
        "negative",
        "range",
        "huge",
        "offsets",
        "offsets-past",
        "ids-rank",
        "device-string",
        "string-ids",
        "list-ids",
        "none-ids",
    ],
}
ROWS = {"a": 40, "b": 30, "c": 20}  # the dense tables' rows (both models)
HUGE = [2**62, 2**63 - 1, 10**15, 1 << 40]


def _malform(kind: str, name: str, x: dict, r: random.Random):
    """A copy of the batch ``x`` of the model ``kind`` broken the ``name`` way (random details from ``r``)."""

    J, floats = he.Jagged, [torch.float32, torch.float64, torch.float16, torch.bool, torch.complex64]
    ids = r.choice("abcq" if kind == "ec" else "abc")  # the feature broken (of those the kind applies to)
    bags = r.choice("bq") if kind == "ec" else "b"
    dense = r.choice("abc")

    def one(t, v):  # t with one random entry set to v (an empty t: [v])
        if t.numel() == 0:
            return torch.tensor([v], dtype=t.dtype)
        t = t.clone()
        t.view(-1)[r.randrange(t.numel())] = v
        return t

    def ids_of(f, fn):  # feature f's ids through fn, its form kept
        v = x[f]
        return J(fn(v.values), v.offsets, v.weights) if isinstance(v, J) else fn(v)

    def jag(f, values=None, offsets=None, weights=None):  # feature f's Jagged with a part replaced
        v = x[f]
        return J(
            v.values if values is None else values,
            v.offsets if offsets is None else offsets,
            v.weights if weights is None else weights,
        )

    def bad_offsets(o, n, hows=("decrease", "first", "last", "last-huge", "past")):  # (B+1,) of n ids, broken
        o = o.clone()
        how = r.choice(hows if o.numel() > 2 else [h for h in hows if h in ("first", "last")])
        if how == "decrease":
            i = r.randrange(1, o.numel() - 1)
            o[i] = o[i + 1] + r.randrange(1, 5)
        elif how == "first":
            o[0] = r.choice([1, -1, 3, n + 1])
        elif how == "last":
            o[-1] = n + r.choice([-1, 1, 2, -2]) if n > 1 else n + 1
        elif how == "last-huge":
            o[-1] = r.choice(HUGE)
        else:
            o[r.randrange(1, o.numel() - 1)] = n + 1 + r.randrange(5)
        return o

    if kind == "plain":  # {"a": (B,), "b": (N,), "b_off": (B,) starts, "b_w": (N,), "c": (B, 3)}
        w = x["b_w"]
        if name == "offsets":
            n = x["b"].numel()
            starts = bad_offsets(torch.cat([x["b_off"], torch.tensor([n])]), n, ("decrease", "first", "past"))[:-1]
            return {**x, "b_off": starts}  # (the starts: torch's form; the end is the ids' count)
        change = {
            "dtype": lambda: (ids, x[ids].to(r.choice(floats))),
            "offsets-dtype": lambda: ("b_off", x["b_off"].to(r.choice(floats[:2]))),
            "offsets-past": lambda: ("b_off", one(x["b_off"], x["b"].numel() + 1 + r.randrange(9))),
            "weights-length": lambda: ("b_w", torch.ones(w.numel() + r.choice([-1, 1, 2, 5]) if w.numel() else 1)),
            "weights-nonfinite": lambda: ("b_w", one(w, r.choice([math.nan, math.inf, -math.inf]))),
            "weights-dtype": lambda: ("b_w", w.to(r.choice([torch.int64, torch.int32, torch.bool]))),
            "weights-2d": lambda: ("b_w", w.reshape(-1, 1)),
            "meta": lambda: ((f := r.choice(["a", "b", "c", "b_off", "b_w"])), torch.empty_like(x[f], device="meta")),
            "negative": lambda: (ids, one(x[ids], -r.randrange(1, 1000))),
            "range": lambda: (ids, one(x[ids], ROWS[ids] + r.randrange(1000))),
            "huge": lambda: (ids, one(x[ids], r.choice(HUGE))),
            "ids-rank": lambda: (r.choice("bc"), torch.zeros(r.choice([(0, 0, 0), (0, 1, 2), ()]), dtype=torch.int64)),
            "device-string": lambda: (ids, r.choice(["cuda", "cuda:0", "cuda:1"])),
            "string-ids": lambda: ("a", [f"u{i}" for i in range(B)]),
            "list-ids": lambda: ("a", x["a"].tolist()),
            "none-ids": lambda: (ids, None),
        }
        f, v = change[name]()
        return {**x, f: v}
    # kind "ec": {"a": (B,), "b": Jagged with weights, "c": (B, 3) padded with -1, "q": Jagged (dynamic)}
    if name == "missing":
        gone = r.choice(list(x))
        return {k: v for k, v in x.items() if k != gone}
    if name == "renamed":
        f = r.choice(list(x))
        new = r.choice([f.upper(), f + "_", " " + f, f + "@0", "q" if f != "q" else "a2"])
        return {(new if k == f else k): v for k, v in x.items() if k != new}
    if name == "non-dict":
        return r.choice([list(x.values()), tuple(x.values()), x["a"], None, "a", 3, set(x), [x]])
    if name == "key-type":
        return {**x, r.choice([1, None, ("a",), b"a"]): x["a"]}
    b = x["b"]
    change = {
        "dtype": lambda: (ids, ids_of(ids, lambda v: v.to(r.choice(floats)))),
        "offsets-dtype": lambda: (bags, jag(bags, offsets=x[bags].offsets.to(r.choice(floats)))),
        "extra": lambda: (r.choice(["d", "A", "a ", "q@1", "hybridembed"]), torch.tensor([1, 2, 3, 4])),
        "weights-length": lambda: ("b", jag("b", weights=torch.ones(b.values.numel() + r.choice([-1, 1, 3]) or 1))),
        "weights-nonfinite": lambda: ("b", jag("b", weights=one(b.weights, r.choice([math.nan, math.inf, -math.inf])))),
        "weights-dtype": lambda: (
            "b",
            jag("b", weights=b.weights.to(r.choice([torch.int64, torch.bool, torch.int32]))),
        ),
        "weights-2d": lambda: ("b", jag("b", weights=b.weights.reshape(-1, 1))),
        "weights-not-tensor": lambda: ("q", (x["q"].values, x["q"].offsets, r.choice(["w", [1.0], 1.0]))),
        "meta": lambda: (ids, ids_of(ids, lambda v: torch.empty_like(v, device="meta"))),
        "meta-offsets": lambda: (bags, jag(bags, offsets=torch.empty_like(x[bags].offsets, device="meta"))),
        "negative": lambda: (dense, ids_of(dense, lambda v: one(v, -r.randrange(2, 1000)))),  # (-1 is c's padding)
        "range": lambda: (dense, ids_of(dense, lambda v: one(v, ROWS[dense] + r.randrange(1000)))),
        "huge": lambda: (dense, ids_of(dense, lambda v: one(v, r.choice(HUGE)))),
        "offsets": lambda: (bags, jag(bags, offsets=bad_offsets(x[bags].offsets, x[bags].values.numel()))),
        "offsets-empty": lambda: (bags, jag(bags, offsets=torch.zeros(0, dtype=torch.int64))),
        "offsets-2d": lambda: (bags, jag(bags, offsets=x[bags].offsets.reshape(-1, 1))),
        "ids-rank": lambda: (
            r.choice("ac"),
            torch.zeros(r.choice([(0, 0, 0), (0, 1, 2), (2, 2, 2), ()]), dtype=torch.int64),
        ),
        "values-2d": lambda: (bags, J(x[bags].values.reshape(-1, 1), x[bags].offsets)),
        "device-string": lambda: (ids, r.choice(["cuda", "cuda:0", "cpu", "meta"])),
        "string-ids": lambda: (ids, [[f"s{i}" for i in range(r.randrange(1, 3))] for _ in range(B)]),
        "lists-bad": lambda: (ids, r.choice([[[1, None]], [[1.5, 2]], [[[1]]], [[1, "x"]], [1, 2], [[2**64]]])),
        "tuple-bad": lambda: (r.choice("abq"), r.choice([(x["a"],), (x["a"].tolist(), x["a"]), (x["a"],) * 4])),
        "sparse-dup": lambda: (
            dense,
            torch.sparse_coo_tensor(torch.tensor([[0, 0, 1], [0, 0, 0]]), torch.tensor([1, 2, 3]), (B, 2)),
        ),
    }
    f, v = change[name]()
    return {**x, f: v}


def _draw_bad(kind: str, x: dict, rng: random.Random, oracle) -> tuple[str, Any, str, list]:
    """A malformed copy of ``x`` that one process (``oracle``, on the bad batch alone) does not accept:
    (its kind, it, what one process raised, the draws excluded on the way: [(kind, why)]). A draw one
    process accepts is not a bad batch: it is excluded and another is drawn. One that one process
    refuses with another error than a ValueError is kept: the loop cannot skip it there either."""
    excluded = []
    for _ in range(40):
        name = rng.choice(KINDS[kind])
        bad = _malform(kind, name, x, rng)
        try:
            oracle(bad)
        except Exception as e:  # noqa: BLE001 - what one process says about it
            return name, bad, _short(e, 200), excluded
        excluded.append((name, "one process accepts it"))
    raise RuntimeError(f"no bad batch drawn in 40 tries: {excluded}")


def _tables(model, kind: str, sharded: bool) -> dict:
    """Every table (dynamic: ids ascending, rows) and the MLP, as tensors (gather: a collective)."""
    m = unwrap(model)
    ec = m.ec if kind == "ec" else m.hybridembed
    out = {}
    for name, t in ec.tables.items():
        if sharded:
            out[name] = ec.gather_table(name)
        elif t.dynamic is not None:
            ids, rows = ec.dynamic_rows(name)
            order = torch.argsort(ids)
            out[name] = (ids[order], rows[order].detach().clone())
        else:
            out[name] = ec.weight(name).detach().clone()
    out["mlp.weight"], out["mlp.bias"] = m.mlp.weight.detach().clone(), m.mlp.bias.detach().clone()
    return out


def _difference(got: dict, want: dict) -> float:
    """The largest absolute difference between two :func:`_tables` (inf: ids or shapes differ)."""
    worst = 0.0
    for k, w in want.items():
        g = got.get(k)
        if isinstance(w, tuple):
            if not isinstance(g, tuple) or not torch.equal(g[0], w[0]):
                return math.inf
            g, w = g[1], w[1]
        if g is None or g.shape != w.shape:
            return math.inf
        worst = max(worst, float((g.double() - w.double()).abs().max()) if w.numel() else 0.0)
    return worst


def input_worker(a: argparse.Namespace) -> None:
    """One rank of an ``input`` job: trials ``a.start`` .. ``a.stop - 1`` (see the module docstring)."""
    kind, world = INPUT_CASES[a.case]
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=JOB_TIMEOUT))
    build = ECModel if kind == "ec" else (lambda: he.convert(PlainModel()))
    path = "ec" if kind == "ec" else "hybridembed"
    model = he.distribute(ECModel() if kind == "ec" else PlainModel(), plan={path: plan_for(kind, world)})
    opt = he.wrap_optimizer(torch.optim.Adagrad(model.parameters(), lr=0.1), model)
    ref, oracle = build(), build()
    ref_opt = he.wrap_optimizer(torch.optim.Adagrad(ref.parameters(), lr=0.1), ref)
    emit(ready=True)
    for t in range(a.start, a.stop):
        rng = random.Random(_seed(a.seed, a.case, t))
        bad_rank, steps = rng.randrange(world), ["good"] * rng.randrange(3) + ["bad", "good"]
        emit(t=t, begin=True)
        record: dict[str, Any] = {"t": t, "bad_rank": bad_rank, "steps": []}
        planted = _planted(a.case, t)
        if planted == "hang":
            time.sleep(3600)
        for j, what in enumerate(steps):
            xs = [_good_batch(kind, a.seed, t, j, r) for r in range(world)]  # (every rank's: the reference's)
            x, y = xs[rank]
            if what == "bad" and planted == "crash" and rank == bad_rank:
                os._exit(3)
            if what == "bad" and rank == bad_rank:
                drawn = _draw_bad(kind, x, random.Random(_seed(a.seed, a.case, t, "bad")), oracle)
                record["kind"], x, record["one_process"], record["excluded"] = drawn
                record["input"] = repr(x)[:300]
                emit(t=t, note={k: record[k] for k in ("kind", "one_process", "input")})  # (for a crash)
            try:
                out = model(x)
            except ValueError as e:  # (a bad batch is skipped: on every rank, since every rank raises)
                record["steps"].append({"what": what, "raised": True, "error": _short(e)})
            else:
                record["steps"].append({"what": what, "raised": False})
                emit(t=t, step=j, forward="returned")  # (if what follows dies, the record says how far it got)
                loss = nn.functional.mse_loss(out, y)
                opt.zero_grad()
                loss.backward()
                opt.step()
            if what == "good" or planted == "silent":  # the reference: every good step, the bad one skipped
                xr = _concat(kind, [b[0] for b in xs])
                ref_loss = nn.functional.mse_loss(ref(xr), torch.cat([b[1] for b in xs]))
                ref_opt.zero_grad()
                ref_loss.backward()
                ref_opt.step()
        record["diff"] = _difference(_tables(model, kind, True), _tables(ref, kind, False))
        emit(end=True, **record)
        if not record["diff"] <= TOL:  # (the next trials would inherit the difference: a new job)
            emit(restart=True)
            break
    emit(done=True)
    dist.destroy_process_group()


def _planted(case: str, t: int) -> str | None:
    """``FUZZ_INJECT="case:trial:what,..."`` plants a failure in a trial: the check that the fuzzer
    reports each outcome it counts. Input family (what: ``crash``: the bad rank exits; ``hang``: every
    rank sleeps; ``silent``: the reference trains on the step every rank skips); ``ps`` (``oversize``:
    a frame larger than the server's buffer, which gloo answers by aborting the server)."""
    for item in os.environ.get("FUZZ_INJECT", "").split(","):
        parts = item.split(":")
        if len(parts) == 3 and parts[0] == case and int(parts[1]) == t:
            return parts[2]
    return None


def _names(text: str, rank: int) -> bool:
    """Whether an error message names ``rank`` as the rank at fault."""
    for m in re.finditer(r"rank\(s\) ([\d, ]+)|rank (\d+)", text):
        listed = m.group(1) or m.group(2)
        if str(rank) in [x.strip() for x in listed.split(",")]:
            return True
    return False


def classify_input(ends: list[dict], tol: float) -> tuple[str, str]:
    """One trial's records (one per rank) -> (outcome, why)."""
    bad = ends[0]["bad_rank"]
    problems = []
    for r, rec in enumerate(ends):
        for s in rec["steps"]:
            if s["what"] == "good" and s["raised"]:
                problems.append(f"rank {r} raised in a good step: {s['error']}")
            if s["what"] == "bad" and not s["raised"]:
                problems.append(f"rank {r} did not raise in the bad step")
            if s["what"] == "bad" and s["raised"] and r != bad and not _names(s["error"], bad):
                problems.append(f"rank {r}'s error does not name rank {bad}: {s['error']}")
            if s["what"] == "bad" and s["raised"] and r == bad and "input in this step (rank" in s["error"]:
                problems.append(f"the bad rank {r} raised another rank's error: {s['error']}")
        if not rec["diff"] <= tol:
            problems.append(f"rank {r}'s tables differ from one process by {rec['diff']:.3g}")
    return ("silent", "; ".join(problems)) if problems else ("clear", "")


# --- running a family's trials: jobs started again after a trial that crashed or hung ----------------
def run_trials(
    workdir: Path,
    case: str,
    world: int,
    argv: list[str],
    trials: range,
    classify,
    deadline: float,
    *,
    dist: bool = True,
    reporting: list[int] | None = None,
) -> list[dict]:
    """``trials`` of ``case`` in as few jobs as they take: a job runs from its first trial to the
    last; when it crashes or hangs, the trial it was in is classified so and the next job starts
    after it. ``classify(records by rank) -> (outcome, why, details)``; ``reporting``: the ranks
    whose ``end`` records a trial needs (default: every rank). Trials left when ``deadline`` passes
    are not run (and reported so)."""
    out: list[dict] = []
    reporting = reporting if reporting is not None else list(range(world))
    start, stop = trials.start, trials.stop
    while start < stop:
        left = deadline - time.monotonic()
        if left < 20:
            out += [
                {"case": case, "trial": t, "outcome": "not run", "why": "time budget spent"} for t in range(start, stop)
            ]
            break
        job = Job(workdir / f"{case}-{start}", world, [*argv, "--start", str(start), "--stop", str(stop)], dist=dist)
        res = job.wait(limit=left)
        ends = [{rec["t"]: rec for rec in res["lines"][r] if rec.get("end")} for r in reporting]
        t = start
        while t < stop and all(t in e for e in ends):
            outcome, why, details = classify([e[t] for e in ends])
            out.append({"case": case, "trial": t, "outcome": outcome, "why": why, **details})
            t += 1
        if t >= stop:
            break
        if res["how"] == "ok" and any(rec.get("restart") for lines in res["lines"] for rec in lines):
            start = t  # (the job ended itself after a trial whose state the next ones would inherit)
            continue
        ready = sum(any(rec.get("ready") for rec in lines) for lines in res["lines"])
        how = res["how"] if res["how"] != "ok" else "crash"
        logs = {r: job.log_tail(r, 800) for r in range(world) if res["codes"][r] != 0}
        where = "" if ready == world else f" (in setup: {ready} of {world} ranks ready)"
        notes = {
            k: v
            for lines in res["lines"]
            for rec in lines
            if rec.get("t") == t and "note" in rec
            for k, v in rec["note"].items()
        }
        why = f"exit codes {res['codes']}{where}"
        out.append({"case": case, "trial": t, "outcome": how, "why": why, **notes, "logs": logs})
        start = t + 1
    return out


def _split(n: int, cases: list[str]) -> dict[str, int]:
    """``n`` trials over the cases, as evenly as they go (the first ones get the remainder)."""
    return {c: n // len(cases) + (i < n % len(cases)) for i, c in enumerate(cases)}


def _trials(n: int, only: int | None) -> range:
    return range(only, only + 1) if only is not None else range(n)


def run_input(seed: int, trials: int, workdir: Path, deadline: float, cases: list[str], only: int | None) -> list[dict]:
    out = []
    share = _split(trials, cases)
    for case in cases:
        kind, world = INPUT_CASES[case]

        def classify(ends):
            outcome, why = classify_input(ends, tol=TOL)
            bad = ends[ends[0]["bad_rank"]]
            details = {"bad_rank": bad["bad_rank"], "kind": bad.get("kind"), "excluded": bad.get("excluded", [])}
            if outcome != "clear":
                details.update(input=bad.get("input"), one_process=bad.get("one_process"))
            return outcome, why, details

        argv = ["input", "--case", case, "--seed", str(seed)]
        out += run_trials(workdir, case, world, argv, _trials(share[case], only), classify, deadline)
    return out


# --- family 2: malformed requests to a parameter server ---------------------------------------------
PS_CASES = ["ps"]
PS_LIMIT = 1 << 16  # the server's max_request_bytes: every frame sent fits its buffer
PS_CHUNK = 50  # frames per job (a failure of the training after them counts against each)
PS_STEPS = 6  # training steps after the frames, compared with one process


def _frame_bytes(h, p, nonce: int, tail: int | None = None):
    """nonce | header bytes | payload bytes | nonce (``tail``: another closing nonce), whatever the
    header's and payload's dtypes and shapes (their bytes as they are in memory)."""

    def raw(t):
        return (
            t.contiguous().reshape(-1).view(torch.uint8)
            if t is not None and t.numel()
            else torch.zeros(0, dtype=torch.uint8)
        )

    n0 = torch.tensor([nonce], dtype=torch.int64).view(torch.uint8)
    n1 = torch.tensor([nonce if tail is None else tail], dtype=torch.int64).view(torch.uint8)
    return torch.cat([n0, raw(h), raw(p), n1])


def _ps_frame(seed: int, t: int) -> tuple[str, Any]:
    """Trial ``t``'s malformed frame: (its kind, (B,) uint8). Deterministic in (seed, t)."""
    from tests.ps.test_wire import HP, _named_cases, _pull, _push, _random_cases

    rng = random.Random(_seed(seed, "ps", t))
    nonce = rng.randrange(1, 1 << 62)
    most = wire.frame_bytes(PS_LIMIT)  # (a frame larger than the server's buffer aborts it: not sent)
    if _planted("ps", t) == "oversize":  # (FUZZ_INJECT: the excluded frame, to see a crash reported)
        return "oversize", torch.zeros(most + 64, dtype=torch.uint8)

    def rbytes(k):
        return torch.tensor([rng.randrange(256) for _ in range(k)], dtype=torch.uint8)

    def valid():  # a request the server would accept (its parts are then broken)
        pick = rng.randrange(4)
        if pick == 0:
            return wire.pack(_pull(0, [(0, [rng.randrange(100)]), (2, [rng.randrange(-(1 << 40), 1 << 40)])], seen=[1]))
        if pick == 1:
            return wire.pack(_push(0, [(1, [rng.randrange(50)])], torch.randn(4)))
        if pick == 2:
            return wire.pack(
                Message(wire.READ, rng.randrange(1 << 20), 0, torch.zeros(0, dtype=torch.int64), None, {"table": "a"})
            )
        return wire.pack(
            Message(
                wire.ATTACH,
                1,
                0,
                torch.zeros(0, dtype=torch.int64),
                None,
                {"group": 0, "optimizer": "Adagrad", "hparams": HP},
            )
        )

    kind = rng.choice(
        [
            "named",
            "random",
            "bytes",
            "cut",
            "payload+k",
            "trailing",
            "header7",
            "header9",
            "nonce",
            "nonce0",
            "field",
            "garbage",
            "meta-big",
            "meta-deep",
        ]
    )
    if kind == "named":
        cases = [(h, p) for _, src, h, p, _ in _named_cases(None) if src == 5]
        h, p = cases[rng.randrange(len(cases))]
        return kind, _frame_bytes(h, p, nonce)
    if kind == "random":
        _, h, p = _random_cases(rng, 1, done=0)[0]
        return kind, _frame_bytes(h, p, nonce)
    if kind == "bytes":  # random bytes: short of a header, or up to the buffer's size
        n = rng.choice([rng.randrange(1, 8 + 8 * wire.HEAD), rng.randrange(8 + 8 * wire.HEAD, most + 1)])
        return kind, rbytes(n)
    h, p = valid()
    h0, f = h.clone(), _frame_bytes(h, p, nonce)
    if kind == "cut":  # the frame's last k bytes missing
        return kind, f[: f.numel() - rng.randrange(1, f.numel())]
    if kind == "payload+k":  # k bytes more payload than the header declares
        return kind, _frame_bytes(
            h,
            torch.cat([p if p is not None else torch.zeros(0, dtype=torch.uint8), rbytes(rng.randrange(1, 64))]),
            nonce,
        )
    if kind == "trailing":  # a frame of a request the server refuses, then k bytes
        _, bh, bp = _random_cases(rng, 1, done=0)[0]
        g = _frame_bytes(bh, bp, nonce)
        return kind, torch.cat([g, rbytes(min(rng.randrange(1, 4096), most - g.numel()))])
    if kind in ("header7", "header9"):
        hh = h[:7] if kind == "header7" else torch.cat([h, torch.tensor([rng.choice([0, wire.MAGIC, 7])])])
        return kind, _frame_bytes(hh, p, nonce)
    if kind == "nonce":  # the closing nonce differs (one bit, or another number)
        return kind, _frame_bytes(
            h, p, nonce, rng.choice([nonce ^ (1 << rng.randrange(62)), rng.randrange(1, 1 << 62)])
        )
    if kind == "nonce0":
        return kind, _frame_bytes(h, p, 0)
    if kind == "field":  # one header field broken (never the request id, never into a valid request)
        h = h.clone()
        i = rng.choice([0, 1, 3, 4, 5, 6, 7])
        if i == 0:
            h[0] = rng.choice([0, wire.MAGIC + 1, rng.randrange(-(1 << 63), 1 << 63)])
        elif i == 1:
            h[1] = rng.choice(
                [
                    0,
                    8,
                    -1,
                    1 << 40,
                    *[o for o in (wire.ATTACH, wire.PULL, wire.PUSH, wire.CHECKPOINT, wire.READ) if o != int(h[1])],
                ]
            )
        elif i == 3:
            h[3] = rng.choice([-1, -(1 << 62), rng.randrange(2, 1 << 62)])
        elif i == 7:
            h[7] = rng.choice([-2, 4, 99, -(1 << 40)])
        else:
            h[i] = (
                max(0, int(h[i]) + rng.choice([-2, -1, 1, 3, 1 << 20, 1 << 61]))
                if rng.random() < 0.8
                else -rng.randrange(1, 1 << 40)
            )
            if int(h[i]) == int(h0[i]):
                h[i] += 1
        return kind, _frame_bytes(h, p, nonce)
    if kind == "garbage":  # a valid header of any op, a payload of that size that does not parse
        op = rng.choice(list(wire.OPS))
        ni, nj = rng.randrange(4), rng.randrange(1, 64)
        h = torch.tensor([wire.MAGIC, op, rng.randrange(100), 0, ni, 0, nj, -1], dtype=torch.int64)
        pay = rbytes(8 * ni + nj)
        pay[8 * ni] = 0xFF  # (not UTF-8: the meta is never JSON)
        return kind, _frame_bytes(h, pay, nonce)
    if kind == "meta-big":  # meta JSON near the limit (or over it), of a request it does not fit
        size = rng.choice([PS_LIMIT - 200, PS_LIMIT // 2, PS_LIMIT + 1, 1 << 40])
        if size > PS_LIMIT:
            hdr = torch.tensor([wire.MAGIC, wire.ATTACH, 1, 0, 0, 0, size, -1], dtype=torch.int64)
            return kind, _frame_bytes(hdr, None, nonce)
        meta = {"group": 0, "optimizer": "Adagrad", "hparams": {"lr": 0.1, "x" * 8: "y" * (size - 80)}}
        h, p = wire.pack(
            Message(
                rng.choice([wire.ATTACH, wire.PUSH, wire.CHECKPOINT, wire.READ]),
                1,
                0,
                torch.zeros(0, dtype=torch.int64),
                None,
                meta,
            )
        )
        return kind, _frame_bytes(h, p, nonce)
    # meta-deep: JSON nested past Python's recursion limit (1,000), within the buffer
    opening, closing = ("[", "]") if rng.random() < 0.5 else ('{"a":', "}")
    depth = rng.randrange(1100, (PS_LIMIT - 1) // (len(opening) + 1))
    blob = opening * depth + ("1" if closing == "}" else "") + closing * depth
    hdr = torch.tensor(
        [wire.MAGIC, rng.choice([wire.ATTACH, wire.READ, wire.PULL]), 1, 0, 0, 0, len(blob), -1], dtype=torch.int64
    )
    return kind, _frame_bytes(hdr, torch.frombuffer(bytearray(blob.encode()), dtype=torch.uint8), nonce)


def _expected_req(f) -> int:
    """The request id a server's error reply to frame ``f`` carries: read from the first NONCE + 8 HEAD
    bytes of its buffer (zeroed before each receive) as the server reads them."""
    head = torch.zeros(wire.NONCE + 8 * wire.HEAD, dtype=torch.uint8)
    n = min(f.numel(), head.numel())
    head[:n] = f[:n]
    if int(head[: wire.NONCE].view(torch.int64)) == 0:
        return 0
    return max(int(head[wire.NONCE :].view(torch.int64)[2]), 0)


def _ps_state(link, req: int) -> dict:
    """What a request must not change on the server: every table's rows (read back whole, bit for
    bit) and the counters of rows pulled and pushed, steps applied and the tables' own stats."""
    empty = torch.zeros(0, dtype=torch.int64)
    out: dict[str, Any] = {}
    for name in ("a", "b", "q"):
        link.send(Message(wire.READ, req, 0, empty, None, {"table": name}))
        r = link.recv()
        assert r.op == wire.OK and r.req == req, (name, r.meta)
        out[name] = (r.ints.tolist(), r.floats.view(torch.uint8).tolist() if r.floats is not None else [])
    link.send(Message(wire.STATS, req, 0, empty))
    r = link.recv()
    skip = ("requests", "errors", "bytes_in", "bytes_out")
    out["stats"] = {k: v for k, v in r.meta.items() if k not in skip}
    return out


def ps_worker(a: argparse.Namespace) -> None:
    """One rank of a ``ps`` job (2 trainers, rank 2 serves): trainer 0 sends frames ``a.start`` ..
    ``a.stop - 1``, each answered and the server's state compared before the next; then both train."""
    from tests.ps.test_faults import M, _opt, _reference, _step
    from tests.ps.test_faults import _tables as trained_tables

    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))  # (trainer 1 waits out the frames)
    emit(ready=True)
    model = he.distribute(M(), servers=1, server_exit=False, ps_timeout=JOB_TIMEOUT, max_request_bytes=PS_LIMIT)
    if model is None:
        emit(served=True)
        return
    opt = _opt(model)
    ec = unwrap(model).ec
    if rank == 0:
        link = ec.client.links[2]
        before = _ps_state(link, 1 << 50)
        for t in range(a.start, a.stop):
            kind, f = _ps_frame(a.seed, t)
            if f.numel() > wire.frame_bytes(PS_LIMIT) and kind != "oversize":  # (gloo would abort the server)
                raise RuntimeError(f"frame {t} ({kind}) of {f.numel()} bytes is larger than the server's buffer")
            emit(t=t, note={"kind": kind, "bytes": f.numel(), "head": f[:80].tolist()})
            dist.send(f, 2, group=link.group, tag=transport.REQ)
            try:
                r = link.recv()
                after = _ps_state(link, (1 << 50) + t)
            except ServerLost as e:
                emit(t=t, lost=_short(e))
                raise
            changed = sorted(k for k in before if before[k] != after[k])
            want = _expected_req(f)
            emit(
                t=t,
                frame=True,
                kind=kind,
                ok=r.op == wire.OK,
                req=r.req,
                want_req=want,
                error=str(r.meta.get("error", ""))[:200],
                changed=changed,
            )
            before = after
        if a.start == 0:  # the probe of what is excluded: a valid read, then bytes after its closing nonce
            read = wire.frame(Message(wire.READ, 77, 0, torch.zeros(0, dtype=torch.int64), None, {"table": "b"}))
            dist.send(
                torch.cat([read, torch.full((100,), 7, dtype=torch.uint8)]), 2, group=link.group, tag=transport.REQ
            )
            r = link.recv()
            emit(
                probe="a valid read frame followed by 100 bytes",
                reply="OK" if r.op == wire.OK else f"error: {r.meta.get('error')}",
            )
    dist.barrier(model.process_group)
    for s in range(PS_STEPS):
        _step(model, opt, s, rank)
    got = trained_tables(model)
    if rank == 0:
        want = _reference(PS_STEPS)
        diff = _difference(
            {k: got[k] for k in ("a", "b", "q", "mlp")},
            {k: (v[0], v[1]) if isinstance(v, tuple) else v.detach() for k, v in want.items()},
        )
        emit(trained=True, diff=diff)
    emit(done=True)


def run_ps(seed: int, trials: int, workdir: Path, deadline: float, cases: list[str], only: int | None) -> list[dict]:
    """The ``ps`` trials, in jobs of PS_CHUNK frames; a job's frames are clear when each got an error
    reply (with its request id) and changed nothing, and the training after them equals one process."""
    out: list[dict] = []
    todo = list(_trials(trials, only))
    while todo:
        chunk, todo = todo[:PS_CHUNK], todo[PS_CHUNK:]
        start, stop = chunk[0], chunk[-1] + 1
        while start < stop:
            left = deadline - time.monotonic()
            if left < 20:
                out += [
                    {"case": "ps", "trial": t, "outcome": "not run", "why": "time budget spent"}
                    for t in range(start, stop)
                ]
                todo = []
                break
            job = Job(
                workdir / f"ps-{start}", 3, ["ps", "--seed", str(seed), "--start", str(start), "--stop", str(stop)]
            )
            res = job.wait(limit=left)
            lines = res["lines"][0]
            PROBES.update({rec["probe"]: rec["reply"] for rec in lines if "probe" in rec})
            frames = {rec["t"]: rec for rec in lines if rec.get("frame")}
            trained = next((rec for rec in lines if rec.get("trained")), None)
            t = start
            while t in frames:
                rec = frames[t]
                problems = []
                if rec["ok"]:
                    problems.append("an OK reply")
                if rec["changed"]:
                    problems.append(f"the server's {', '.join(rec['changed'])} changed")
                if rec["req"] != rec["want_req"]:
                    problems.append(f"the reply's request id is {rec['req']}, the frame's {rec['want_req']}")
                outcome = "silent" if problems else "clear"
                if not problems and trained is not None and not trained["diff"] <= TOL:
                    outcome = "silent"
                    problems.append(
                        f"the training after this job's frames differs from one process by {trained['diff']:.3g}"
                    )
                elif not problems and trained is None and len(frames) == stop - start:
                    outcome = res["how"] if res["how"] != "ok" else "crash"
                    problems.append(f"the training after this job's frames did not finish (exit codes {res['codes']})")
                out.append(
                    {
                        "case": "ps",
                        "trial": t,
                        "outcome": outcome,
                        "why": "; ".join(problems),
                        "kind": rec["kind"],
                        **({"error": rec["error"]} if problems else {}),
                    }
                )
                t += 1
            if t >= stop:
                break
            note = next((rec["note"] for rec in lines if rec.get("t") == t and "note" in rec), {})
            lost = next((rec["lost"] for rec in lines if rec.get("t") == t and "lost" in rec), "")
            server_died = res["codes"][2] not in (0, None)
            how = (
                "crash"
                if server_died or "is gone" in lost
                else "hang"
                if "did not answer" in lost or res["how"] == "hang"
                else "crash"
            )
            logs = {r: job.log_tail(r, 800) for r in range(3) if res["codes"][r] != 0}
            out.append(
                {
                    "case": "ps",
                    "trial": t,
                    "outcome": how,
                    "why": f"{lost or 'the job ended'}; exit codes {res['codes']}",
                    "kind": note.get("kind"),
                    "note": note,
                    "logs": logs,
                }
            )
            start = t + 1
    return out


PROBES: dict[str, str] = {}  # what a server answers to what is excluded from the ps trials (measured)
NOT_FUZZED = {  # what a family leaves out, and why
    "ps": [
        "frames larger than the server's buffer (frame_bytes(max_request_bytes)): gloo aborts the receiving "
        "process by design (docs/parameter_servers.md, trust model); a trainer of this library never sends one",
        "payloads that parse, on STATS and BYE: they take no arguments (a BYE ends the sender's session whatever "
        "it holds); payloads that do not parse are fuzzed on them",
        "a valid frame followed by more bytes: a c10d receive does not report a message's size, so the bytes after "
        "a frame's closing nonce are never read and the request inside is served (see probes; the 'trailing' "
        "kind sends a refused request followed by bytes)",
    ],
}


# --- family 3: checkpoint races ------------------------------------------------------------------------
CKPT_CASES = ["threads", "procs", "dload", "kill"]


def _ck_model(seed: int):
    """The ``input`` family's EmbeddingCollection model with its optimizer, trained one step on a
    batch of ``seed`` (so that every writer's rows differ)."""
    model = ECModel()
    opt = he.wrap_optimizer(torch.optim.Adagrad(model.parameters(), lr=0.1), model)
    _ck_train(model, opt, seed)
    return model, opt


def _ck_train(model, opt, seed: int) -> None:
    x, y = _good_batch("ec", seed, 0, 0, 0)
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()


class Writer:
    """Saves of one model into one directory; before each save its rows are changed (a training
    step) and copied to ``snaps/<tag>.pt`` (the tag goes into the save's ``extra``)."""

    def __init__(self, root: Path, prefix: str, model, opt, rng: random.Random):
        self.root, self.prefix, self.model, self.opt, self.rng = root, prefix, model, opt, rng
        self.results: list[dict] = []
        self.keep, self.incremental = rng.choice([1, 1, 2, 3]), rng.random() < 0.5
        self.background = rng.random() < 0.5

    def save(self, i: int) -> None:
        _ck_train(self.model, self.opt, _seed(self.prefix, i))
        tag = f"{self.prefix}-{i}"
        (self.root / "snaps").mkdir(parents=True, exist_ok=True)
        torch.save(_tables(self.model, "ec", False), self.root / "snaps" / f"{tag}.pt")
        how = {"keep": self.keep, "incremental": self.incremental, "background": self.background}
        try:
            out = he.save(self.root / "ckpt", self.model, self.opt, extra={"tag": tag}, **how)
            out = out.wait(60) if self.background else out
            self.results.append({"tag": tag, "ok": True, "version": Path(out).name, **how})
        except he.CheckpointError as e:
            self.results.append({"tag": tag, "ok": False, "error": _short(e, 200), **how})
        except Exception as e:  # noqa: BLE001 - a save that fails otherwise: the writer's loop would die
            self.results.append({"tag": tag, "ok": False, "unexpected": _short(e, 300), **how})

    def run(self, saves: int) -> None:
        for _ in range(saves):
            time.sleep(self.rng.random() * 0.03)
            self.save(len(self.results))


def _load_check(root: Path, target: Path, model=None) -> tuple[str | None, list[str]]:
    """Load ``target`` (a checkpoint or one of its versions) into a fresh one-process model: (the tag
    loaded, problems: its rows are not its save's copy). A CheckpointError is a refusal (tag None)."""
    model = model if model is not None else ECModel()
    try:
        manifest = he.load(target, model)
    except he.CheckpointError as e:
        return None, [f"refused: {_short(e, 200)}"]
    tag = manifest["extra"].get("tag")
    want = torch.load(root / "snaps" / f"{tag}.pt", weights_only=False)
    diff = _difference(_tables(model, "ec", False), want)
    return tag, (
        [] if diff == 0 else [f"{Path(manifest['path']).name} (tag {tag}) loads rows {diff:.3g} away from its save's"]
    )


def _check_dir(root: Path, results: list[dict], extra: list[dict] = ()) -> tuple[list[str], dict]:
    """The directory after its writers ended, against what their saves reported (``extra``: commits
    known otherwise, a killed writer's): (problems, notes). LATEST names the last commit and loads its
    rows; every committed version loads its save's rows unless a later commit's ``keep`` let it go (then
    it may be gone, or left damaged by a writer killed while deleting it: a load must refuse it); no
    version holds the rows of a save that was refused."""
    problems, notes = [], {}
    commits = sorted([r for r in results if r["ok"]] + list(extra), key=lambda r: int(r["version"][2:]))
    by_version = {r["version"]: r for r in commits}
    tags = {r["tag"]: r for r in commits}
    refused = {r["tag"] for r in results if not r["ok"]}
    ckpt = root / "ckpt"
    present = ck._versions(ckpt) if ckpt.exists() else []
    latest = ck._current(ckpt) if ckpt.exists() else None
    if len(by_version) != len(commits):
        problems.append(f"two successful saves reported one version: {[r['version'] for r in commits]}")

    def let_go(v: str) -> bool:  # a later commit keeps fewer versions than came after v
        later = [r for r in commits if int(r["version"][2:]) > int(v[2:])]
        return any(
            r["keep"] <= sum(int(v[2:]) < int(c["version"][2:]) <= int(r["version"][2:]) for c in commits)
            for r in later
        )

    if commits and latest != commits[-1]["version"]:
        problems.append(f"LATEST is {latest}, the last commit was {commits[-1]['version']}")
    for v in present:
        if latest is not None and int(v[2:]) > int(latest[2:]):
            notes.setdefault("uncommitted_versions_left", []).append(v)
            continue
        tag, probs = _load_check(root, ckpt / v)
        if tag is None and v in by_version and let_go(v):
            notes.setdefault("damaged_versions_left", []).append(v)  # (refused on load, naming the damage)
        else:
            problems += [f"version {v}: {p}" for p in probs]
        if tag is not None and (tag in refused or tag not in tags or tags[tag]["version"] != v):
            problems.append(f"version {v} holds the rows of save {tag}, which did not commit it")
    for r in commits:
        if r["version"] not in present and not let_go(r["version"]):
            problems.append(f"save {r['tag']}'s committed {r['version']} is gone; no later save's keep let it go")
    if latest is not None:
        problems += [f"LATEST: {p}" for p in _load_check(root, ckpt)[1]]
    return problems, notes


def _unexpected(results: list[dict]) -> list[str]:
    return [f"save {r['tag']} raised {r['unexpected']}" for r in results if "unexpected" in r]


def _ck_threads(root: Path, rng: random.Random) -> dict:
    """Two models of one process save into one directory from two threads at once."""
    writers = [Writer(root, f"t{k}", *_ck_model(_seed(root, k)), random.Random(rng.random())) for k in range(2)]
    threads = [threading.Thread(target=w.run, args=(rng.randrange(1, 4),)) for w in writers]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    if any(th.is_alive() for th in threads):
        raise RuntimeError("a saving thread did not end in 120 s")
    results = [r for w in writers for r in w.results]
    problems, notes = _check_dir(root, results)
    return {"results": results, "problems": problems, "unexpected": _unexpected(results), "note": notes}


def _file_barrier(root: Path, name: str, rank: int, ranks: int, timeout: float = 60.0) -> None:
    (root / f"{name}.{rank}").touch()
    end = time.monotonic() + timeout
    while not all((root / f"{name}.{r}").exists() for r in range(ranks)):
        if time.monotonic() > end:
            raise RuntimeError(f"barrier {name}: the other processes did not come in {timeout:.0f} s")
        time.sleep(0.005)


def _ck_kill(root: Path, rng: random.Random) -> dict:
    """A committed version, then a writer (a forked process) SIGKILLed at a random point of its save
    (at its k-th file write, or after a random delay), then another model's save, and a load."""
    first = Writer(root, "k0", *_ck_model(_seed(root, 0)), random.Random(rng.random()))
    first.save(0)
    victim = Writer(root, "k1", *_ck_model(_seed(root, 1)), random.Random(rng.random()))
    # where it dies: at its k-th file write (7 per save), before its commit (its version renamed into
    # place), inside it (LATEST.tmp written, not yet renamed), right after it (lock held, no cleanup),
    # while its cleanup deletes the older version (keep=1: one file of it gone), or after a random delay
    points = ["write", "write", "write", "before-commit", "in-commit", "after-commit", "in-cleanup", "delay", "delay"]
    point, at_write, delay = rng.choice(points), rng.randrange(1, 8), rng.random() * 0.1
    if point == "in-cleanup":
        victim.keep = 1
    pid = os.fork()
    if pid == 0:  # the victim
        try:
            die = lambda *_: os.kill(os.getpid(), signal.SIGKILL)  # noqa: E731
            real_write, real_commit, real_replace, n = ck._write_file, ck._commit, os.replace, [0]

            def write(path, obj):
                n[0] += 1
                if n[0] == at_write:
                    die()
                real_write(path, obj)

            def replace(src, dst, *args, **kwargs):
                if Path(dst).name == ck.POINTER:
                    die()
                real_replace(src, dst, *args, **kwargs)

            def rmtree(path, *args, **kwargs):
                if ck._VERSION_RE.match(Path(path).name):  # (a committed version, no longer kept)
                    next(f for f in sorted(Path(path).rglob("*")) if f.is_file()).unlink()
                    die()
                real_rmtree(path, *args, **kwargs)

            real_rmtree = shutil.rmtree

            if point == "write":
                ck._write_file = write
            elif point == "before-commit":
                ck._commit = die
            elif point == "in-commit":
                os.replace = replace
            elif point == "after-commit":
                ck._commit = lambda root, version: (real_commit(root, version), die())
            elif point == "in-cleanup":
                shutil.rmtree = rmtree
            victim.save(0)
        finally:
            os._exit(0)
    if point == "delay":
        time.sleep(delay)
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    killed = os.WIFSIGNALED(status)
    problems = []
    tag, probs = _load_check(root, root / "ckpt")  # (before the next save: a committed version, whole)
    problems += [f"after the kill: {p}" for p in probs]
    if tag not in ("k0-0", "k1-0"):
        problems.append(f"after the kill, LATEST holds {tag}")
    victim_commit = []
    if tag == "k1-0":  # (it committed before it died)
        how = {"keep": victim.keep, "incremental": victim.incremental, "background": victim.background}
        victim_commit = [{"tag": "k1-0", "ok": True, "version": ck._current(root / "ckpt"), **how}]
    after = Writer(root, "k2", *_ck_model(_seed(root, 2)), random.Random(rng.random()))
    after.background = after.incremental = False
    after.save(0)
    if not after.results[-1]["ok"]:
        problems.append(
            f"the save after the kill failed: {after.results[-1].get('error') or after.results[-1].get('unexpected')}"
        )
    results = first.results + after.results
    more, notes = _check_dir(root, results, victim_commit)
    problems += more
    leftovers = [p.name for p in (root / "ckpt").iterdir() if p.name.startswith((".tmp-", "LATEST.tmp-"))]
    notes.update(
        killed=killed, point=point if point != "write" else f"write {at_write}", victim_committed=tag == "k1-0"
    )
    if point == "delay":
        notes["delay"] = round(delay, 3)
    if leftovers:
        notes["leftovers_after_next_save"] = leftovers
    return {"results": results, "problems": problems, "unexpected": _unexpected(results), "note": notes}


def ckpt_worker(a: argparse.Namespace) -> None:
    """One process of a ``ckpt`` job: trials ``a.start`` .. ``a.stop - 1`` of case ``a.case``."""
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    base = Path(a.dir)
    if a.case == "dload":
        return _dload_worker(a, rank, base)
    emit(ready=True)
    for t in range(a.start, a.stop):
        root = base / f"{a.case}-{t}"
        rng = random.Random(_seed(a.seed, a.case, t))
        emit(t=t, begin=True)
        if a.case == "threads":
            out = _ck_threads(root, rng)
        elif a.case == "kill":
            out = _ck_kill(root, rng)
        else:  # procs: this process is one of the two writers
            w = Writer(root, f"p{rank}", *_ck_model(_seed(root, rank)), random.Random(_seed(a.seed, t, rank)))
            root.mkdir(parents=True, exist_ok=True)
            _file_barrier(root, "start", rank, 2)
            w.run(rng.randrange(1, 4))
            (root / f"results.{rank}.json").write_text(json.dumps(w.results))
            _file_barrier(root, "saved", rank, 2)
            out = {"results": w.results, "unexpected": _unexpected(w.results), "problems": []}
            if rank == 0:
                results = [r for k in range(2) for r in json.loads((root / f"results.{k}.json").read_text())]
                out["problems"], out["note"] = _check_dir(root, results)
                out["results"] = results
        emit(end=True, t=t, **out)
        if rank == 0 and not out["problems"] and not out["unexpected"]:  # (a trial that was not clear: kept)
            shutil.rmtree(root, ignore_errors=True)
    emit(done=True)


def _dload_worker(a: argparse.Namespace, rank: int, base: Path) -> None:
    """``dload``: ranks 0 and 1 are a world-2 job that loads the checkpoint again and again while
    process 2 (no process group) commits versions into it."""
    model = None
    if rank < 2:
        dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=JOB_TIMEOUT))
        model = he.distribute(ECModel(), plan={"ec": plan_for("ec", 2)})
    emit(ready=True)
    for t in range(a.start, a.stop):
        root = base / f"dload-{t}"
        rng = random.Random(_seed(a.seed, "dload", t))
        emit(t=t, begin=True)
        root.mkdir(parents=True, exist_ok=True)
        if rank == 2:
            w = Writer(root, "d", *_ck_model(_seed(root)), random.Random(rng.random()))
            w.save(0)  # (a version before the loads begin)
            _file_barrier(root, "start", rank, 3)
            w.run(rng.randrange(2, 6))
            (root / "results.json").write_text(json.dumps(w.results))
            _file_barrier(root, "done", rank, 3)
            problems, notes = _check_dir(root, w.results)
            emit(end=True, t=t, results=w.results, problems=problems, unexpected=_unexpected(w.results), note=notes)
            continue
        _file_barrier(root, "start", rank, 3)
        loads, problems = [], []
        for k in range(rng.randrange(2, 6)):
            time.sleep(rng.random() * 0.02)
            try:
                manifest = he.load(root / "ckpt", model)
            except he.CheckpointError as e:
                got = (None, _short(e, 200))
            else:
                got = (Path(manifest["path"]).name, manifest["extra"].get("tag"))
            everyone: list = [None, None]
            dist.all_gather_object(everyone, got)
            if everyone[0] != everyone[1]:
                problems.append(f"load {k}: rank 0 got {everyone[0]}, rank 1 got {everyone[1]}")
            if got[0] is not None:
                want = torch.load(root / "snaps" / f"{got[1]}.pt", weights_only=False)
                diff = _difference(_tables(model, "ec", True), want)
                if diff != 0:
                    problems.append(f"load {k}: {got[0]} (tag {got[1]}) loads rows {diff:.3g} away from its save's")
            loads.append(got)
        _file_barrier(root, "done", rank, 3)
        emit(end=True, t=t, loads=loads, problems=problems, unexpected=[])
    emit(done=True)
    if rank < 2:
        dist.destroy_process_group()


def run_ckpt(seed: int, trials: int, workdir: Path, deadline: float, cases: list[str], only: int | None) -> list[dict]:
    out = []
    share = _split(trials, cases)
    worlds = {"threads": 1, "kill": 1, "procs": 2, "dload": 3}
    for case in cases:

        def classify(ends):
            problems = [p for e in ends for p in e["problems"]]
            unexpected = [p for e in ends for p in e["unexpected"]]
            results = [r for e in ends for r in e.get("results", [])]
            refused = sum(not r["ok"] for r in results)
            loads = ends[0].get("loads", [])  # (rank 0's: the loads are the job's, made by both ranks)
            details = {
                "saves": len(results),
                "refused": refused,
                "loads": len(loads),
                "loads_refused": sum(x[0] is None for x in loads),
            }
            details.update({k: v for e in ends for k, v in e.get("note", {}).items()})
            if unexpected:
                return "crash", "; ".join(unexpected)[:600], details
            return ("silent" if problems else "clear"), "; ".join(problems)[:600], details

        reporting = {"procs": [0], "dload": [0, 1, 2]}.get(case)
        argv = ["ckpt", "--case", case, "--seed", str(seed), "--dir", str(workdir / "dirs")]
        out += run_trials(
            workdir,
            case,
            worlds[case],
            argv,
            _trials(share[case], only),
            classify,
            deadline,
            dist=case == "dload",
            reporting=reporting,
        )
    return out


# --- the report --------------------------------------------------------------------------------------
def counts(results: list[dict]) -> dict[str, dict[str, int]]:
    """{case: {tried, clear, silent, crash, hang}} and the family's total under "all"."""
    table: dict[str, dict[str, int]] = {}
    for r in results:
        if r["outcome"] == "not run":
            continue
        for key in (r["case"], "all"):
            row = table.setdefault(key, {"tried": 0, **dict.fromkeys(OUTCOMES, 0)})
            row["tried"] += 1
            row[r["outcome"]] += 1
    if "all" in table:
        table["all"] = table.pop("all")  # (last)
    return table


def print_table(family: str, table: dict[str, dict[str, int]]) -> None:
    print(f"\n{family}")
    print(f"  {'case':<10} {'tried':>6} " + " ".join(f"{o:>7}" for o in OUTCOMES))
    for case, row in table.items():
        print(f"  {case:<10} {row['tried']:>6} " + " ".join(f"{row[o]:>7}" for o in OUTCOMES))


def _exclusions(results: list[dict]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in results:
        for kind, why in r.get("excluded", []):
            key = f"{kind}: {why}"
            out[key] = out.get(key, 0) + 1
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


FAMILIES = ("input", "ps", "ckpt")
NOTABLE = (  # what a clear checkpoint trial may leave, listed by trial
    "damaged_versions_left",  # an older version a killed writer's cleanup was deleting: a load refuses it
    "uncommitted_versions_left",  # a version written, never committed (the next save removes it)
    "leftovers_after_next_save",  # temporary files of a dead save that the next save did not remove
)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trials", type=int, default=100, help="trials per family (split over its cases)")
    p.add_argument("--families", nargs="+", choices=FAMILIES, default=list(FAMILIES))
    p.add_argument("--case", nargs="+", help="only these cases (e.g. ec2 plain2 ec3 ps threads procs dload kill)")
    p.add_argument("--only", type=int, help="run this one trial of each case (a reproduction)")
    p.add_argument("--budget", type=float, default=600.0, help="seconds per family, at most (trials left: not run)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--keep", action="store_true", help="keep the jobs' directories (logs, reports)")
    a = p.parse_args(argv)
    if a.trials < 1:
        p.error("--trials must be >= 1")
    workdir = Path(tempfile.mkdtemp(prefix="fuzz-faults-"))
    started = time.time()
    report: dict[str, Any] = {
        "command": " ".join(["python", "benchmarks/fuzz_faults.py", *(argv if argv is not None else sys.argv[1:])]),
        "date": datetime.date.today().isoformat(),
        "seed": a.seed,
        "trials_per_family": a.trials,
        "families": {},
    }
    runners = {"input": (run_input, list(INPUT_CASES)), "ps": (run_ps, PS_CASES), "ckpt": (run_ckpt, CKPT_CASES)}
    try:
        for family in a.families:
            run, cases = runners[family]
            cases = [c for c in cases if a.case is None or c in a.case]
            if not cases:
                continue
            t0 = time.monotonic()
            results = run(a.seed, a.trials, workdir / family, t0 + a.budget, cases, a.only)
            table = counts(results)
            print_table(family, table)
            bad = [r for r in results if r["outcome"] not in ("clear",)]
            for r in bad:
                print(f"  {r['outcome']}: case {r['case']} trial {r['trial']}: {r['why'][:300]}")
            notable = [
                {"case": r["case"], "trial": r["trial"], **{k: r[k] for k in NOTABLE if k in r}}
                for r in results
                if any(k in r for k in NOTABLE)
            ]
            for r in notable:
                print(
                    f"  note: case {r['case']} trial {r['trial']}: "
                    + ", ".join(f"{k} {r[k]}" for k in NOTABLE if k in r)
                )
            report["families"][family] = {
                "counts": table,
                "seconds": round(time.monotonic() - t0, 1),
                "not_clear": bad,
                "notable": notable,
                "excluded_draws": _exclusions(results),
                "not_fuzzed": NOT_FUZZED.get(family, []),
                "kinds": _kinds(results),
                "tally": _tally(results),
            }
            if family == "ps":
                report["families"][family]["probes"] = dict(PROBES)
    finally:
        if not a.keep:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print(f"\njobs' directories kept in {workdir}")
    report["seconds"] = round(time.time() - started, 1)
    print(f"\n{report['seconds']:.0f} s; seed {a.seed}; {report['command']}")
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1, default=str) + "\n")
    return report


def _tally(results: list[dict]) -> dict[str, dict[str, int]]:
    """{case: {detail: total}}: the trials' numbers and flags summed, lists counted (the checkpoint
    family's saves, refusals, loads, kills, versions left damaged...)."""
    skip = set("case trial outcome why kind excluded logs note input one_process error bad_rank point".split())
    out: dict[str, dict[str, int]] = {}
    for r in results:
        row = out.setdefault(r["case"], {})
        for k, v in r.items():
            if k in skip:
                continue
            if isinstance(v, bool) or isinstance(v, int):
                row[k] = row.get(k, 0) + int(v)
            elif isinstance(v, list):
                row[k] = row.get(k, 0) + 1  # (trials where it happened)
        if r.get("point"):  # (kill: where the victim was to die)
            key = f"point {r['point'].split()[0]}"
            row[key] = row.get(key, 0) + 1
    return out


def _kinds(results: list[dict]) -> dict[str, dict[str, int]]:
    """{kind: {outcome: n}} over the trials that name a kind."""
    out: dict[str, dict[str, int]] = {}
    for r in results:
        if r.get("kind") and r["outcome"] != "not run":
            row = out.setdefault(r["kind"], {})
            row[r["outcome"]] = row.get(r["outcome"], 0) + 1
    return dict(sorted(out.items()))


def worker(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("family")
    p.add_argument("--case")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start", type=int, default=0)
    p.add_argument("--stop", type=int, default=1)
    p.add_argument("--dir")
    a = p.parse_args(argv)
    {"input": input_worker, "ps": ps_worker, "ckpt": ckpt_worker}[a.family](a)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2:])
    else:
        main()
