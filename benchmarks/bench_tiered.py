"""Tiered tables (``he.Tiered``: rows on local disk, a bounded cache in memory): the step against the
same tables in memory, and the memory of a table larger than the cache.

    python benchmarks/bench_tiered.py                       # both parts, defaults (~ a few minutes)
    python benchmarks/bench_tiered.py --part speed --steps 30
    python benchmarks/bench_tiered.py --part dynamic --steps 30   # dynamic tables (any int64 id) on disk
    python benchmarks/bench_tiered.py --part memory --memory-rows 160000000   # 40 GiB of rows (fp32, dim 64)
    python benchmarks/bench_tiered.py --part memory --memory-rows 20000000 --checkpoint   # he.save / he.load of 5 GiB
    python benchmarks/bench_tiered.py --part memory --memory-dynamic --memory-rows 10000000 --memory-cache 1000000 --checkpoint
    python benchmarks/bench_tiered.py --part memory --memory-dynamic --memory-rows 30000000 --dim 256 \
        --memory-cache 1000000 --memory-limit --memory-prefetch 20 --ahead 2   # 28.6 GiB dynamic, cgroup (root)
    python benchmarks/bench_tiered.py --part behind --cache-frac 0.01 --steps 40 --threads 1   # writes behind the step
    python benchmarks/bench_tiered.py --part dynamic-prefetch --steps 20 --warmup 5   # the prefetch, dynamic tables
    python benchmarks/bench_tiered.py --part index --index-records 8000000 --index-limit 800   # the records index (root)
    python benchmarks/bench_tiered.py --quick               # seconds: the smoke test

**speed**: ``--tables`` tables of ``--rows`` rows x ``--dim`` (one group), one-hot power-law ids
(``powerlaw_ids``, alpha 1.05; each table its own stream), batch ``--batch``, row-wise Adagrad,
the fused CPU step. The tiered collection's cache holds ``--cache-frac`` of the rows. Both
collections train in one process on the same batches, in blocks of 10 steps alternated; medians. The
steps until the cache has been full (evicting) for ``--warmup`` steps are not timed (the table in
memory gets the same): a cache still filling evicts and writes nothing, and steps then cost far
less than the steady state training spends its time in.

**dynamic**: as speed, with dynamic tables (``he.Dynamic()``: ids made on first sight; the ids
are the power-law ids spread over int64), in memory unbounded against tiered (rows beyond the
cache spilled to disk, :mod:`hybridembed.storage.tiered_hash`); the cache holds ``--cache-frac``
of ``--tables`` x ``--rows``; ``--with-prefetch``: the tiered collection calls ``ec.prefetch(next
batch)`` after each backward (in the same blocks: a block's last prefetch reads while the other
contender's block begins).

**behind**: as dynamic, the tiered tables alone: steps whose spills the writer thread writes
while the step goes on (the default) against steps that write them in the step
(``tiered_file._BEHIND = 0``), alternated in blocks of 5 steps in one process (``--threads``: torch's
intra-op threads, which the step's own passes use; the writer needs a core they leave free).

**prefetch** / **dynamic-prefetch**: ``--prefetch-rows`` rows of ``--tables`` tables (dense, or
dynamic with ids spread over int64) written to disk and dropped from the page cache, a cache of
``--prefetch-cache`` rows, uniform ids (nearly every row a miss), the files not mapped
(``Tiered(mapped=False)``: a mapping's pages are not dropped, and it is not read ahead): a step without and with
``ec.prefetch(next batch)`` after the backward, and the main thread's read time; the two modes
alternate in blocks of 5 steps (``--steps`` of each), each block from a cold page cache; medians.
``--ahead 2``: the batch two steps ahead is prefetched instead (two prefetches held at once).

**reads**: a tiered file's scattered reads alone, from a cold page cache: one thread against the
reads as shipped (many runs far apart cut into slices read by several threads).

**index**: the records index of dynamic tiered tables alone (``storage/records.py``, its arrays in
mapped files): a rebuild a window of positions at a time against one pass, each in a fresh process
held in a memory cgroup of ``--index-limit`` MiB (cgroup v1, root; 0: none).

**memory**: a fresh process builds one tiered table of ``--memory-rows`` rows x ``--dim`` with a
cache of ``--memory-cache`` rows and trains ``--memory-steps`` steps on power-law ids; its peak
resident memory (``VmHWM``, this process's own) against the cache's bytes (issue 26's target:
peak <= cache + 2 GiB); with ``--checkpoint``, then ``he.save`` of it and ``he.load`` into a
fresh tiered table, each one's peak (``VmHWM`` reset before it); ``--memory-dynamic``: a dynamic
table, its rows (ids ``0..rows-1``) written to disk first. ``--memory-behind N``: then ``N`` steps each with the evictions written behind the step and in it,
alternated in blocks of 10; ``--memory-asked N``: then ``N`` steps each with and without the pages of
reads far apart asked for first (``tiered_file._CAN_ASK``), alternated the same way. ``--memory-prefetch N``: then ``N`` steps each
without and with ``ec.prefetch`` (``--ahead``), alternated in blocks as the prefetch parts' (the page
cache is not dropped: in ``--memory-limit``'s cgroup the table is far larger than it). The table's files are made in ``--dir`` (default: a temporary directory)
and removed after.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import hybridembed as he
from hybridembed.synthetic import powerlaw_ids


def _collection(tables: int, rows: int, dim: int, tiered: he.Tiered | None, seed: int = 0, dynamic: bool = False):
    if dynamic:  # (unbounded in memory, rows made on first sight; tiered: beyond the cache on disk)
        dyn = he.Dynamic(initial_rows=1 << 16)
        ts = [he.TableConfig(f"t{i}", None, dim, dynamic=dyn, tiered=tiered) for i in range(tables)]
    else:
        ts = [he.TableConfig(f"t{i}", rows, dim, tiered=tiered) for i in range(tables)]
    ec = he.EmbeddingCollection(ts, seed=seed)
    opt = he.wrap_optimizer(torch.optim.SGD(ec.parameters(), lr=0.01), ec, sparse=he.optim.RowWiseAdagrad(lr=0.01))
    return ec, opt


_SPREAD = -7046029254386353131  # (odd: ids * it spread over int64, as a dynamic table's raw ids)
_COUNTED = ("lookups", "hits", "misses", "disk_reads", "disk_writes", "evictions", "read_back", "spilled")
_MAX_WARMUP = 2000  # speed: untimed steps at most, waiting for the cache to fill
SPEED_BLOCK = 10  # speed: steps a contender runs before the other's turn
BLOCK = 5  # prefetch: timed steps per block (the modes alternate block by block)


def _step(ec, opt, x: dict, ahead: dict | None) -> None:
    """One training step on ``x`` (the outputs' gradient ones); ``ahead``: prefetched after the
    backward, before the optimizer step."""
    y = ec(x)
    opt.zero_grad()
    torch.autograd.backward(list(y.values()), [torch.ones_like(v) for v in y.values()])
    if ahead is not None:
        ec.prefetch(ahead)
    opt.step()


def alternate(ec, opt, st, batch, steps: int, ahead: int, cold: bool) -> dict:
    """Steps without and with ``ec.prefetch`` of the batch ``ahead`` steps on, in blocks of
    :data:`BLOCK` timed steps, the modes alternating block by block (the disk's and the machine's pace
    drift over a run), each block after a lead-in step (untimed: it prefetches the block's first
    batch) and, ``cold``, from a dropped page cache. Returns each mode's median step and the main
    thread's read time a step (``_File.read``), and the share of that read time the prefetch hid."""
    import threading

    from hybridembed.storage import tiered_file as tiered_mod

    read_s = [0.0]
    real = tiered_mod._File.read

    def timed(self, r):
        t0 = time.perf_counter()
        try:
            return real(self, r)
        finally:
            if threading.current_thread() is threading.main_thread():
                read_s[0] += time.perf_counter() - t0

    tiered_mod._File.read = timed
    times: dict[str, list[float]] = {"plain": [], "prefetch": []}
    reads = {"plain": 0.0, "prefetch": 0.0}
    try:
        for b in range(2 * max(1, steps // BLOCK)):
            mode = ("plain", "prefetch")[b % 2]
            xs = [batch() for _ in range(BLOCK + 1 + ahead)]
            if cold:
                _cold(st)
            if mode == "prefetch":
                for j in range(1, ahead):
                    ec.prefetch(xs[j])
            _step(ec, opt, xs[0], xs[ahead] if mode == "prefetch" else None)
            read_s[0] = 0.0
            for i in range(1, BLOCK + 1):
                t0 = time.perf_counter()
                _step(ec, opt, xs[i], xs[i + ahead] if mode == "prefetch" else None)
                times[mode].append(time.perf_counter() - t0)
            st.drop_prefetch()
            reads[mode] += read_s[0]
    finally:
        tiered_mod._File.read = real
    out: dict = {
        m: {"step_ms": statistics.median(v) * 1e3, "read_ms": reads[m] / len(v) * 1e3, "steps": len(v)}
        for m, v in times.items()
    }
    plain, pre = out["plain"], out["prefetch"]
    out["hidden"] = (plain["step_ms"] - pre["step_ms"]) / plain["read_ms"] if plain["read_ms"] else 0.0
    return out


def speed(args: argparse.Namespace, where: str, dynamic: bool = False) -> dict:
    g = torch.Generator().manual_seed(0)
    spread = _SPREAD if dynamic else 1

    def batch() -> dict:
        return {f"t{i}": powerlaw_ids(args.batch, args.rows, generator=g) * spread for i in range(args.tables)}

    cache = int(args.cache_frac * args.rows * args.tables)
    contenders = {
        "memory": _collection(args.tables, args.rows, args.dim, None, dynamic=dynamic),
        "tiered": _collection(args.tables, args.rows, args.dim, he.Tiered(where, cache_rows=cache), dynamic=dynamic),
    }
    ahead = dynamic and args.with_prefetch  # (the tiered one calls ec.prefetch(next batch) after each backward)
    st = contenders["tiered"][0].storage_of("t0")
    evicted = (lambda: st.stats()["spilled"]) if dynamic else (lambda: st.stats()["evictions"])
    # untimed: until the cache has been full (evicting) for --warmup steps (a cache filling evicts
    # nothing: a step then costs far less than in the steady state that training spends its time in)
    batches, full, before = [], 0, 0
    while full < args.warmup and len(batches) < _MAX_WARMUP:
        batches.append(batch())
        for ec, opt in contenders.values():
            _step(ec, opt, batches[-1], None)
        full, before = full + (evicted() > before), evicted()
    if full < args.warmup:
        print(
            f"note: the cache of {cache:,} rows never filled in {_MAX_WARMUP} steps: the steps timed are a filling cache's"
        )
    warm = len(batches)
    batches += [batch() for _ in range(args.steps + 1)]
    times: dict[str, list[float]] = {k: [] for k in contenders}
    st0 = st.stats()
    # in blocks of SPEED_BLOCK steps, the contenders alternating block by block (first one, then the
    # other): stepped one after the other, the tiered table's writes behind its step (and the
    # kernel's write-back, or a prefetch thread's reads) ran into the table in memory's step and
    # slowed it (measured 5 -> 10-27 ms: a ratio flattered)
    order = []
    for lo in range(warm, len(batches) - 1, SPEED_BLOCK):
        block = range(lo, min(lo + SPEED_BLOCK, len(batches) - 1))  # (the last batch: the prefetch's)
        names = list(contenders) if (lo - warm) // SPEED_BLOCK % 2 == 0 else list(contenders)[::-1]
        order += [(s, name) for name in names for s in block]
    for s, name in order:
        b, (ec, opt) = batches[s], contenders[name]
        t0 = time.perf_counter()
        out = ec(b)
        opt.zero_grad()
        torch.autograd.backward(list(out.values()), [torch.ones_like(v) for v in out.values()])
        if ahead and name == "tiered":
            ec.prefetch(batches[s + 1])
        opt.step()
        times[name].append((time.perf_counter() - t0) * 1e3)
    st = {k: v - st0[k] if k in _COUNTED else v for k, v in st.stats().items()}  # (the timed steps')
    res = {k: statistics.median(v) for k, v in times.items()}
    rows_of = (lambda ec, n: ec.dynamic_rows(n)[1]) if dynamic else (lambda ec, n: ec.weight(n))
    same = all(
        torch.equal(rows_of(contenders["tiered"][0], n), rows_of(contenders["memory"][0], n))
        for n in ("t0", f"t{args.tables - 1}")
    )
    if dynamic:  # (the rows the tables hold: in memory all; tiered, the cache's and those spilled to disk)
        st["disk_reads"], st["disk_writes"] = st["read_back"], st["spilled"]
    else:
        st["lookups"] = st["hits"] + st["misses"]  # (distinct rows of each lookup)
    st["hit_rate"] = 1 - (st["read_back"] if dynamic else st["misses"]) / max(1, st["lookups"])
    return {
        "memory_ms": res["memory"],
        "tiered_ms": res["tiered"],
        "ratio": res["tiered"] / res["memory"],
        # (means too: a long run (--steps 5000) meets the kernel's writeback of the files' dirty pages,
        # a few slow steps every few seconds that a median does not show; docs/benchmarks.md)
        "mean_ratio": statistics.mean(times["tiered"]) / statistics.mean(times["memory"]),
        "cache_rows": cache,
        "rows": args.rows * args.tables,
        "hit_rate": st["hit_rate"],
        "disk_reads": st["disk_reads"],
        "disk_writes": st["disk_writes"],
        "warmup_steps": warm,
        "equal_to_memory": same,
        **({"table_rows": st["rows"], "disk_rows": st["disk_rows"]} if dynamic else {}),
        "prefetch": bool(ahead),
    }


def behind(args: argparse.Namespace, where: str) -> dict:
    """Dynamic tiered tables (as ``--part dynamic``): steps whose spills are written behind them by
    the writer thread (``_File.write_behind``, the default) and written in the step
    (``tiered_file._BEHIND = 0``), alternated in blocks of :data:`BLOCK` steps in one process; medians."""
    from hybridembed.storage import tiered_file as tiered_mod

    g = torch.Generator().manual_seed(0)
    cache = int(args.cache_frac * args.rows * args.tables)
    ec, opt = _collection(args.tables, args.rows, args.dim, he.Tiered(where, cache_rows=cache), dynamic=True)

    def batch() -> dict:
        return {f"t{i}": powerlaw_ids(args.batch, args.rows, generator=g) * _SPREAD for i in range(args.tables)}

    for _ in range(args.warmup):
        _step(ec, opt, batch(), None)
    times: dict[int, list[float]] = {1: [], 0: []}
    saved = tiered_mod._BEHIND
    try:
        for b in range(2 * max(1, args.steps // BLOCK)):
            tiered_mod._BEHIND = (1, 0)[b % 2]
            _step(ec, opt, batch(), None)  # (untimed: the other mode's write settles)
            for _ in range(BLOCK):
                t0 = time.perf_counter()
                _step(ec, opt, batch(), None)
                times[tiered_mod._BEHIND].append((time.perf_counter() - t0) * 1e3)
    finally:
        tiered_mod._BEHIND = saved
    st = ec.storage_of("t0").stats()
    return {
        "behind_ms": statistics.median(times[1]),
        "in_step_ms": statistics.median(times[0]),
        "cache_rows": cache,
        "spilled": st["spilled"],
        "threads": torch.get_num_threads(),
    }


_CHILD = """
import json, os, sys, time, torch
import hybridembed as he
from hybridembed.synthetic import powerlaw_ids
rows, dim, cache, steps, batch, where, checkpoint, dynamic, pre, ahead, here, behind, asked = json.loads(sys.argv[1])
def status(key):
    line = next(x for x in open("/proc/self/status") if x.startswith(key))
    return int(line.split()[1]) * 1024
def table(path):  # dynamic: any int64 id, rows made on first sight (here: written first, ids 0..rows-1)
    return he.TableConfig("big", None if dynamic else rows, dim, dynamic=he.Dynamic() if dynamic else None,
                          tiered=he.Tiered(path, cache_rows=cache))
base = status("VmRSS:")
t0 = time.perf_counter()
ec = he.EmbeddingCollection([table(where)])
opt = he.wrap_optimizer(torch.optim.SGD(ec.parameters(), lr=0.01), ec, sparse=he.optim.RowWiseAdagrad(lr=0.01))
if dynamic:  # its rows written to disk 262,144 at a time (the write's temporaries: about 1.5 KiB a row)
    for lo in range(0, rows, 1 << 18):
        ids = torch.arange(lo, min(rows, lo + (1 << 18)))
        ec.storage_of("big").write_ids("big", ids, torch.randn(ids.numel(), dim, generator=torch.Generator().manual_seed(lo)))
built = time.perf_counter() - t0
if dynamic:  # (the bulk write's freed temporaries handed back to the OS: glibc keeps them otherwise)
    import ctypes
    ctypes.CDLL("libc.so.6").malloc_trim(0)
g = torch.Generator().manual_seed(0)
t0 = time.perf_counter()
for _ in range(steps):
    out = ec({"big": powerlaw_ids(batch, rows, generator=g)})["big"]
    opt.zero_grad()
    out.sum().backward()
    opt.step()
train = time.perf_counter() - t0
if pre:  # steps without and with ec.prefetch alternated: the table is larger than the page cache left to it
    sys.path.insert(0, here)
    from bench_tiered import alternate
    prefetched = alternate(ec, opt, ec.storage_of("big"), lambda: {"big": powerlaw_ids(batch, rows, generator=g)}, pre, ahead, cold=False)
def alternated(name, n):  # n steps each with tiered_file.<name> on and off, blocks of 10 alternated: medians (ms)
    from hybridembed.storage import tiered_file as T
    saved, spent = getattr(T, name), {1: [], 0: []}
    for b in range(2 * max(1, n // 10)):
        on = (1, 0)[b % 2]
        setattr(T, name, type(saved)(on))
        for i in range(11):  # (the first untimed: the other mode's write settles)
            t0 = time.perf_counter()
            opt.zero_grad(); ec({"big": powerlaw_ids(batch, rows, generator=g)})["big"].sum().backward(); opt.step()
            if i:
                spent[on].append((time.perf_counter() - t0) * 1e3)
    setattr(T, name, saved)
    return {k: sorted(v)[len(v) // 2] for k, v in spent.items()}
if behind:  # steps whose evictions are written behind them and in them (tiered_file._BEHIND 1 / 0)
    ms = alternated("_BEHIND", behind)
    behind_ms = {"behind_ms": ms[1], "in_step_ms": ms[0]}
if asked:  # steps whose reads of records far apart ask for their pages first and do not (tiered_file._CAN_ASK)
    ms = alternated("_CAN_ASK", asked)
    asked_ms = {"asked_ms": ms[1], "not_asked_ms": ms[0]}
storage = ec.storage_of("big")
st = storage.stats()
mapped = (storage._file if dynamic else storage._rows_file).map is not None  # (Tiered(mapped=None): by size)
out = {"peak": status("VmHWM:"), "rss": status("VmRSS:"), "base": base, "built_s": built, "train_s": train, "stats": st, "mapped": mapped,
       "anon": status("RssAnon:"), "file": status("RssFile:") + status("RssShmem:")}
if pre:
    out["prefetch"] = prefetched
if behind:
    out["behind"] = behind_ms
if asked:
    out["asked"] = asked_ms
if checkpoint:  # he.save, then he.load into a fresh tiered table: each one's peak (VmHWM reset before it)
    def reset():
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    reset(); t0 = time.perf_counter(); out["save_rss"] = status("VmRSS:")
    he.save(where + "/ck", ec, opt)
    out["save_s"], out["save_peak"] = time.perf_counter() - t0, status("VmHWM:")
    back = he.EmbeddingCollection([table(where + "/back")])
    opt_back = he.wrap_optimizer(torch.optim.SGD(back.parameters(), lr=0.01), back, sparse=he.optim.RowWiseAdagrad(lr=0.01))
    reset(); t0 = time.perf_counter(); out["load_rss"] = status("VmRSS:")
    he.load(where + "/ck", back, opt_back)
    out["load_s"], out["load_peak"] = time.perf_counter() - t0, status("VmHWM:")
    pick = torch.randint(0, rows - 1000, (20,), generator=g)  # 20 spans of 1,000 rows: equal, rows and state
    a, b = ec.storage_of("big"), back.storage_of("big")
    if dynamic:  # (rows by eval lookups; the state by a step on both, then the rows again)
        spans = torch.cat([torch.arange(i, i + 1000) for i in pick.tolist()])
        for m in (ec, back):
            m.eval()
        same = torch.equal(ec({"big": spans})["big"], back({"big": spans})["big"])
        for m, o in ((ec, opt), (back, opt_back)):
            m.train(); o.zero_grad(); m({"big": spans})["big"].sum().backward(); o.step(); m.eval()
        out["loaded_equal"] = same and torch.equal(ec({"big": spans})["big"], back({"big": spans})["big"])
    else:
        out["loaded_equal"] = all(
            all(torch.equal(x, y) for x, y in zip(a.read_range("big", i, i + 1000).values(), b.read_range("big", i, i + 1000).values()))
            for i in pick.tolist()
        )
        for _ in range(steps):  # more steps, then a full save again: the files no row of changed since are linked
            opt.zero_grad(); ec({"big": powerlaw_ids(batch, rows, generator=g)})["big"].sum().backward(); opt.step()
        t0 = time.perf_counter()
        he.save(where + "/ck", ec, opt, keep=2)
        out["save2_s"] = time.perf_counter() - t0
        m = he.checkpoint.read_manifest(where + "/ck")
        files = [m["path"] + "/" + s["file"] for s in m["tables"]["big"]["shards"]]
        out["linked"], out["files"] = sum(os.stat(f).st_nlink > 1 for f in files), len(files)
        t0 = time.perf_counter()  # and once more with no step since: every file linked
        he.save(where + "/ck", ec, opt, keep=2)
        out["save3_s"] = time.perf_counter() - t0
print(json.dumps(out))
"""


def memory(args: argparse.Namespace, where: str) -> dict:
    spec = [args.memory_rows, args.dim, args.memory_cache, args.memory_steps, args.batch, where, args.checkpoint]
    spec += [args.memory_dynamic, args.memory_prefetch, args.ahead, str(Path(__file__).resolve().parent)]
    spec += [args.memory_behind, args.memory_asked]
    cache_bytes = args.memory_cache * (args.dim + 1) * 4  # (the cached rows and their row-wise Adagrad state)
    limit = cache_bytes + (2 << 30)
    group = _cgroup(limit) if args.memory_limit else None
    try:
        out = subprocess.run(
            [sys.executable, "-c", _CHILD, json.dumps(spec)],
            capture_output=True,
            text=True,
            check=False,
            preexec_fn=None if group is None else functools.partial(_join, group),
        )
        cg = None if group is None else _cgroup_peak(group)
    finally:
        if group is not None:
            group.rmdir()
    if out.returncode:
        raise SystemExit(f"the memory run failed (exit {out.returncode}; -9: killed):\n{out.stderr[-3000:]}")
    r = json.loads(out.stdout.strip().splitlines()[-1])
    r["table_bytes"] = args.memory_rows * args.dim * 4
    r["cache_bytes"] = cache_bytes
    r["limit"] = limit
    if cg is not None:
        r["cgroup"] = cg
    return r


_CGROUP_V1 = Path("/sys/fs/cgroup/memory")


def _cgroup(limit: int) -> Path:
    """A memory cgroup (v1) holding the memory part's process to ``limit`` bytes, its page cache
    counted (written back and dropped at the limit; the process is killed past it, no swap here)."""
    if not (_CGROUP_V1 / "memory.limit_in_bytes").exists():
        raise SystemExit("--memory-limit needs a writable cgroup v1 memory controller at /sys/fs/cgroup/memory")
    group = _CGROUP_V1 / f"bench-tiered-{os.getpid()}"
    group.mkdir()
    (group / "memory.limit_in_bytes").write_text(str(limit))
    return group


def _join(group: Path) -> None:
    (group / "cgroup.procs").write_text(str(os.getpid()))


def _cgroup_peak(group: Path) -> dict:
    def read(name: str) -> int:
        return int((group / name).read_text())

    return {
        "limit": read("memory.limit_in_bytes"),
        "peak": read("memory.max_usage_in_bytes"),
        "failcnt": read("memory.failcnt"),
    }


_INDEX_CHILD = """
import json, shutil, sys, tempfile, time, torch
from pathlib import Path
from hybridembed.storage.records import Homes
n, window, where, batch = json.loads(sys.argv[1])
Homes._WINDOW_BYTES = window
h = Homes()
h.where = Path(tempfile.mkdtemp(dir=where))
keys = torch.randperm(n, generator=torch.Generator().manual_seed(0)) * 7919
t0 = time.perf_counter()
for c in keys.split(batch):
    h.add(c, torch.zeros(c.numel(), dtype=torch.int32))
add = time.perf_counter() - t0
print(json.dumps({"add_s": add, "positions": h._mask + 1}), flush=True)  # (what a run stopped in its rebuild did)
t0 = time.perf_counter()
h._reindex(2 * (h._mask + 1))
rebuild = time.perf_counter() - t0
found = torch.equal(h.lookup(keys[:100000], torch.zeros(100000, dtype=torch.int32)), torch.arange(100000))
shutil.rmtree(h.where)
print(json.dumps({"add_s": add, "rebuild_s": rebuild, "positions": h._mask + 1, "found": found}))
"""


def index(args: argparse.Namespace, where: str) -> dict:
    """The records index alone (``storage/records.py``): ``--index-records`` records added a million
    at a time, then one rebuild to twice the positions, a window of ``--index-window`` MiB at a time against one pass,
    each in a fresh process (in a memory cgroup of ``--index-limit`` MiB when given); None: it
    outlived ``--index-timeout`` seconds and was stopped."""
    out = {}
    for name, window in (("windows", args.index_window << 20), ("one pass", 1 << 62)):
        group = _cgroup(args.index_limit << 20) if args.index_limit else None
        try:
            run = subprocess.run(
                [sys.executable, "-c", _INDEX_CHILD, json.dumps([args.index_records, window, where, args.index_batch])],
                capture_output=True,
                text=True,
                timeout=args.index_timeout,
                preexec_fn=None if group is None else functools.partial(_join, group),
            )
            out[name] = json.loads(run.stdout.strip().splitlines()[-1]) if run.returncode == 0 else run.returncode
        except subprocess.TimeoutExpired as e:  # (its adds' time, when they ended before the limit)
            done = (e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or "").strip().splitlines()
            out[name] = {**json.loads(done[-1]), "rebuild_s": None} if done else None
        finally:
            if group is not None:
                group.rmdir()
    return out


def _cold(storage) -> None:
    """The table's files out of the kernel's page cache (written, then dropped): reads go to the disk."""
    files = [storage._file] if hasattr(storage, "_file") else [storage._rows_file, *storage._state_files.values()]
    for f in files:
        os.fsync(f.fd)
        os.posix_fadvise(f.fd, 0, 0, os.POSIX_FADV_DONTNEED)


def prefetch(args: argparse.Namespace, where: str, dynamic: bool = False) -> dict:
    """Cold-cache steps without and with ``ec.prefetch(next batch)``: the time a step spends in the
    files' reads (main thread) without it, and how much of that the prefetch takes off the step.
    ``dynamic``: dynamic tables (ids spread over int64), their rows written to disk first."""
    rows, tables = args.prefetch_rows, args.tables
    n = rows // tables
    tier = he.Tiered(where, cache_rows=args.prefetch_cache, mapped=False)  # (the disk serves it: no mapping)
    spread = _SPREAD if dynamic else 1
    ts = [
        he.TableConfig(f"t{i}", None, args.dim, dynamic=he.Dynamic(), tiered=tier)
        if dynamic
        else he.TableConfig(f"t{i}", n, args.dim, tiered=tier)
        for i in range(tables)
    ]
    ec = he.EmbeddingCollection(ts)
    opt = he.wrap_optimizer(torch.optim.SGD(ec.parameters(), lr=0.01), ec, sparse=he.optim.RowWiseAdagrad(lr=0.01))
    st = ec.storage_of("t0")
    g = torch.Generator().manual_seed(0)
    step = max(1, args.prefetch_cache // 2)
    for t in ts:  # every row written once (to disk, with state): a cold cache reads them back
        for lo in range(0, n, step):
            k = min(step, n - lo)
            data = {"weight": torch.randn(k, args.dim, generator=g), "sum": torch.rand(k, generator=g)}
            if dynamic:
                st.write_ids(t.name, torch.arange(lo, lo + k) * spread, data.pop("weight"), data)
            else:
                st.write_range(t.name, lo, data)
    with torch.no_grad():  # (the last rows written out of the cache)
        ec({t.name: torch.arange(0, min(step // tables, n)) * spread for t in ts})

    def batch() -> dict:
        return {t.name: torch.randint(0, n, (args.batch,), generator=g) * spread for t in ts}

    for _ in range(args.warmup):  # (the first steps warm the code, not the cache: uniform ids mostly miss)
        _step(ec, opt, batch(), None)
    out = alternate(ec, opt, st, batch, args.steps, args.ahead, cold=True)
    out["stats"] = st.stats()
    return out


def reads(args: argparse.Namespace, where: str) -> list[dict]:
    """A tiered file's scattered reads and writes alone (``_File.read`` / ``_File.write``) of
    ``--reads-counts`` records of a ``--reads-rows`` x 264-byte file (a 64-float row and its row-wise
    state), each way alternated ``--rounds`` times; medians. From a cold page cache, reads: one
    thread's ``pread``s, :data:`~hybridembed.storage.tiered_file._READERS` threads each reading a
    slice, and as shipped (the records' pages asked for at once, ``posix_fadvise(WILLNEED)``, then
    read); writes: one thread's ``pwrite``s (each page written in part read first, one at a time)
    and as shipped. With the records' pages cached (read and written just before): as shipped (a
    probe finds them cached: nothing asked for) and without the probe (asked for, and far apart,
    dropped after)."""
    from hybridembed.storage import tiered_file as tiered_mod

    os.makedirs(where, exist_ok=True)
    rows, width = args.reads_rows, 264
    f = tiered_mod._File(Path(where) / "records", rows, width, torch.uint8)
    g = torch.Generator().manual_seed(0)
    for lo in range(0, rows, 1 << 19):
        k = min(1 << 19, rows - lo)
        f.write(torch.arange(lo, lo + k), torch.randint(0, 255, (k, width), dtype=torch.uint8, generator=g))
    os.fsync(f.fd)
    names = ("_PARALLEL_RUNS", "_CAN_ASK", "_NOWAIT")
    saved = {k: getattr(tiered_mod, k) for k in names}
    ways = {  # each way's settings of tiered_file (the rest as shipped)
        "one thread": {"_PARALLEL_RUNS": 10**12, "_CAN_ASK": False},
        "slices": {"_CAN_ASK": False},
        "asked": {},
        "write, one thread": {"_CAN_ASK": False},
        "write, asked": {},
        "warm": {},
        "warm, not probed": {"_NOWAIT": 0},
        "warm write": {},
        "warm write, not probed": {"_NOWAIT": 0},
    }
    out = []
    try:
        for n in args.reads_counts:
            ms: dict[str, list[float]] = {way: [] for way in ways}
            for i in range(args.rounds):
                for way in list(ms)[:: 1 if i % 2 == 0 else -1]:  # (which goes first alternates)
                    for k in names:
                        setattr(tiered_mod, k, ways[way].get(k, saved[k]))
                    r = torch.randperm(rows, generator=g)[:n]
                    data = torch.randint(0, 255, (n, width), dtype=torch.uint8, generator=g)
                    os.fsync(f.fd)  # (the last writes on disk: the page cache dropped whole)
                    os.posix_fadvise(f.fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    if way.startswith("warm"):  # (their pages read and written: in the page cache)
                        f.read(r)
                        f.write(r, data)
                    t0 = time.perf_counter()
                    f.write(r, data) if "write" in way else f.read(r)
                    ms[way].append((time.perf_counter() - t0) * 1e3)
            row = {"records": n, "gap_kib": rows * width / n / 1024, **{k: statistics.median(v) for k, v in ms.items()}}
            out.append(row)
            print(
                f"reads: {n:,} records of {rows * width / 2**30:.1f} GiB (one per {row['gap_kib']:.0f} KiB), cold: "
                f"one thread {row['one thread']:.1f} ms, {tiered_mod._READERS} slices {row['slices']:.1f} ms, as shipped "
                f"{row['asked']:.1f} ms ({row['one thread'] / row['asked']:.2f}x / {row['slices'] / row['asked']:.2f}x); "
                f"writes: one thread {row['write, one thread']:.1f} ms, as shipped {row['write, asked']:.1f} ms "
                f"({row['write, one thread'] / row['write, asked']:.2f}x); warm: reads {row['warm']:.1f} ms "
                f"({row['warm, not probed']:.1f} not probed), writes {row['warm write']:.1f} ms "
                f"({row['warm write, not probed']:.1f} not probed)",
                flush=True,
            )
    finally:
        for k in names:
            setattr(tiered_mod, k, saved[k])
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--part",
        choices=["speed", "dynamic", "behind", "memory", "prefetch", "dynamic-prefetch", "index", "reads", "both"],
        default="both",
    )
    p.add_argument("--index-records", type=int, default=8_000_000, help="index part: records")
    p.add_argument("--index-window", type=int, default=64, help="index part: MiB of positions a window")
    p.add_argument("--index-batch", type=int, default=1 << 20, help="index part: records added a call")
    p.add_argument("--index-limit", type=int, default=800, help="index part: a memory cgroup of MiB (0: none)")
    p.add_argument("--index-timeout", type=float, default=300.0, help="index part: seconds a run may take")
    p.add_argument("--prefetch-rows", type=int, default=4_000_000, help="prefetch part: rows of all tables")
    p.add_argument("--prefetch-cache", type=int, default=200_000)
    p.add_argument(
        "--ahead", type=int, choices=(1, 2), default=1, help="prefetch parts: prefetch the batch 1 or 2 steps ahead"
    )
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--rows", type=int, default=500_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--cache-frac", type=float, default=0.1)
    p.add_argument(
        "--with-prefetch", action="store_true", help="dynamic part: the tiered tables prefetch the next batch"
    )
    p.add_argument("--threads", type=int, help="torch's intra-op threads (default: torch's own)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--memory-rows", type=int, default=40_000_000, help="rows of the memory part's table (10 GiB)")
    p.add_argument("--memory-cache", type=int, default=2_000_000)
    p.add_argument("--memory-steps", type=int, default=50)
    p.add_argument("--checkpoint", action="store_true", help="memory part: he.save and he.load the table too")
    p.add_argument(
        "--memory-limit",
        action="store_true",
        help="memory part: run it in a memory cgroup (v1, root) limited to the target, cache + 2 GiB, page cache counted",
    )
    p.add_argument(
        "--memory-dynamic", action="store_true", help="memory part: a dynamic table (ids 0..rows-1 written first)"
    )
    p.add_argument(
        "--memory-prefetch",
        type=int,
        default=0,
        help="memory part: then this many steps each without and with ec.prefetch (--ahead), alternated",
    )
    p.add_argument(
        "--memory-behind",
        type=int,
        default=0,
        help="memory part: then this many steps each with evictions written behind the step and in it, alternated",
    )
    p.add_argument(
        "--memory-asked",
        type=int,
        default=0,
        help="memory part: then this many steps each with and without the pages of reads far apart asked for first",
    )
    p.add_argument("--reads-rows", type=int, default=4_000_000, help="reads part: records in the file")
    p.add_argument("--reads-counts", type=int, nargs="+", default=[31_000, 12_000, 8_000, 5_000])
    p.add_argument("--rounds", type=int, default=3, help="reads part: alternations")
    p.add_argument("--dir", help="where the tables' files go (default: a temporary directory)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json")
    args = p.parse_args(argv)
    if args.quick:
        args.tables, args.rows, args.dim, args.batch, args.steps, args.warmup = 2, 5_000, 8, 256, 3, 2
        args.memory_rows, args.memory_cache, args.memory_steps, args.memory_prefetch = 100_000, 400, 3, BLOCK
        args.memory_behind = args.memory_asked = 20
        args.prefetch_rows, args.prefetch_cache = 40_000, 2_000
        args.index_records, args.index_window, args.index_limit = 300_000, 1, 0
        args.reads_rows, args.reads_counts, args.rounds = 20_000, [300], 1
    if args.threads:
        torch.set_num_threads(args.threads)
    root = tempfile.mkdtemp(prefix="hybridembed-tiered-", dir=args.dir)
    result: dict = {}
    try:
        if args.part in ("speed", "both"):
            r = result["speed"] = speed(args, f"{root}/speed")
            print(
                f"speed: {args.tables} x {args.rows:,} x {args.dim}, cache {r['cache_rows']:,} rows "
                f"({args.cache_frac:.0%}), batch {args.batch}, timed after {r['warmup_steps']} steps (the cache full): "
                f"in memory {r['memory_ms']:.1f} ms, tiered {r['tiered_ms']:.1f} ms ({r['ratio']:.2f}x; target <= 2x; "
                f"means {r['mean_ratio']:.2f}x); hit rate {r['hit_rate']:.3f}, rows read {r['disk_reads'] / args.steps:,.0f} and written "
                f"{r['disk_writes'] / args.steps:,.0f} a step; equal to the table in memory: {r['equal_to_memory']}",
                flush=True,
            )
        if args.part == "dynamic" or args.quick:
            r = result["dynamic"] = speed(args, f"{root}/dynamic", dynamic=True)
            print(
                f"dynamic: {args.tables} dynamic tables, power-law ids over {args.rows:,} ids each spread over int64, "
                f"{r['table_rows']:,} rows made; cache {r['cache_rows']:,} rows ({r['disk_rows']:,} on disk), batch "
                f"{args.batch}: in memory {r['memory_ms']:.1f} ms, tiered {r['tiered_ms']:.1f} ms ({r['ratio']:.2f}x; "
                f"target <= 2x; means {r['mean_ratio']:.2f}x){'; with ec.prefetch(next batch)' if r['prefetch'] else ''}; timed after "
                f"{r['warmup_steps']} steps, rows read back {r['disk_reads'] / args.steps:,.0f} and spilled "
                f"{r['disk_writes'] / args.steps:,.0f} a step; equal to the tables in memory: "
                f"{r['equal_to_memory']}",
                flush=True,
            )
        if args.part == "behind" or args.quick:
            r = result["behind"] = behind(args, f"{root}/behind")
            print(
                f"behind: {args.tables} dynamic tables, cache {r['cache_rows']:,} rows, batch {args.batch}, "
                f"{r['threads']} threads: spills written behind the step {r['behind_ms']:.1f} ms a step, written in "
                f"the step {r['in_step_ms']:.1f} ms ({r['in_step_ms'] / r['behind_ms']:.2f}x); rows spilled "
                f"{r['spilled']:,}",
                flush=True,
            )
        if args.part == "index" or args.quick:
            r = result["index"] = index(args, root)
            for name, v in r.items():
                what = (
                    f"add {v['add_s']:.2f} s ({v['positions']:,} positions), the rebuild stopped after --index-timeout"
                    if isinstance(v, dict) and v["rebuild_s"] is None
                    else f"add {v['add_s']:.2f} s, rebuild to {v['positions']:,} positions {v['rebuild_s']:.2f} s, "
                    f"found: {v['found']}"
                    if isinstance(v, dict)
                    else ("stopped after --index-timeout" if v is None else f"failed (exit {v}; -9: killed)")
                )
                limit = f"a cgroup of {args.index_limit} MiB" if args.index_limit else "no cgroup"
                print(f"index: {args.index_records:,} records, {limit}, {name}: {what}", flush=True)
        if args.part in ("memory", "both"):
            r = result["memory"] = memory(args, f"{root}/memory")
            print(
                f"memory: a table of {r['table_bytes'] / 2**30:.1f} GiB, cache {r['cache_bytes'] / 2**30:.2f} GiB: peak "
                f"RSS {r['peak'] / 2**30:.2f} GiB (target <= cache + 2 GiB: {r['limit'] / 2**30:.2f}); built in "
                f"{r['built_s']:.1f} s, {args.memory_steps} steps in {r['train_s']:.1f} s; hit rate "
                f"{r['stats']['hit_rate']:.3f}; at the end anonymous {r['anon'] / 2**30:.2f} GiB, file pages "
                f"{r['file'] / 2**30:.2f} GiB",
                flush=True,
            )
            if "cgroup" in r:
                cg = r["cgroup"]
                print(
                    f"in a memory cgroup of {cg['limit'] / 2**30:.2f} GiB (page cache counted): trained; its peak "
                    f"{cg['peak'] / 2**30:.2f} GiB, the limit reached {cg['failcnt']:,} times (pages reclaimed)",
                    flush=True,
                )
            if "prefetch" in r:
                pf = r["prefetch"]
                print(
                    f"memory, prefetch {args.ahead} ahead: a step {pf['plain']['step_ms']:.1f} ms of which "
                    f"{pf['plain']['read_ms']:.1f} ms reading; with ec.prefetch {pf['prefetch']['step_ms']:.1f} ms "
                    f"({pf['prefetch']['read_ms']:.1f} ms reading): {pf['hidden']:.0%} of the read time hidden "
                    f"(target >= 70%)",
                    flush=True,
                )
            if "behind" in r:
                bh = r["behind"]
                print(
                    f"memory, evictions written behind the step {bh['behind_ms']:.1f} ms a step, in the step "
                    f"{bh['in_step_ms']:.1f} ms ({bh['in_step_ms'] / bh['behind_ms']:.2f}x)",
                    flush=True,
                )
            if "asked" in r:
                ak = r["asked"]
                print(
                    f"memory, the pages of reads far apart asked for first: {ak['asked_ms']:.1f} ms a step, not asked "
                    f"for {ak['not_asked_ms']:.1f} ms ({ak['not_asked_ms'] / ak['asked_ms']:.2f}x)",
                    flush=True,
                )
            if args.checkpoint:
                print(
                    f"checkpoint: he.save {r['save_s']:.1f} s, peak RSS {r['save_peak'] / 2**30:.2f} GiB (RSS at the "
                    f"call {r['save_rss'] / 2**30:.2f}); he.load into a fresh tiered table {r['load_s']:.1f} s, peak RSS "
                    f"{r['load_peak'] / 2**30:.2f} GiB (at the call {r['load_rss'] / 2**30:.2f}); loaded rows and state "
                    f"equal: {r['loaded_equal']}",
                    flush=True,
                )
                if "save2_s" in r:
                    print(
                        f"checkpoint after {args.memory_steps} more steps: a full he.save {r['save2_s']:.1f} s "
                        f"({r['save2_s'] / r['save_s']:.2f}x the first), {r['linked']} of its {r['files']} files "
                        f"linked from the first (no row of them changed since); with no step since: "
                        f"{r['save3_s']:.2f} s",
                        flush=True,
                    )
        for part in ("prefetch", "dynamic-prefetch"):
            if args.part != part and not args.quick:
                continue
            r = result[part] = prefetch(args, f"{root}/{part}", dynamic=part == "dynamic-prefetch")
            print(
                f"{part}: {args.prefetch_rows:,} rows on disk, cold cache of {args.prefetch_cache:,}, uniform ids: "
                f"a step {r['plain']['step_ms']:.1f} ms of which {r['plain']['read_ms']:.1f} ms reading; with "
                f"ec.prefetch(next batch) {r['prefetch']['step_ms']:.1f} ms ({r['prefetch']['read_ms']:.1f} ms "
                f"reading): {r['hidden']:.0%} of the read time hidden (target >= 70%)",
                flush=True,
            )
        if args.part == "reads" or args.quick:
            result["reads"] = reads(args, f"{root}/reads")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
