"""Checkpoints of the DLRM of ``hybridembed train``: save and load time and bytes per rank at
world 1, 2 and 4 (gloo), the size of a delta (``incremental=True``) after training steps
against a full save, and the pause a save costs the training loop (blocking against
``background=True``).

    PYTHONPATH=src python benchmarks/bench_checkpoint.py                       # world 1 2 4, 26 x 100k x 16
    PYTHONPATH=src python benchmarks/bench_checkpoint.py --world 1 --repeats 5 --json ck.json
    python benchmarks/bench_checkpoint.py --quick --world 1 2                   # seconds: the smoke test

The model: ``hybridembed.train.models.build("dlrm", 13, C1..C26, dim=16)``, the DLRM that
``hybridembed train`` trains: 26 dynamic tables (one per categorical feature, rows made on
first sight; capacity 2x ``--rows`` so that nothing is evicted), its bottom and top MLPs,
``he.wrap_optimizer(torch.optim.Adagrad(lr=0.02))`` (tables: Adagrad, per-row accumulators
of dim 16 beside the rows). World 1 is that model in one process; world W > 1 is
``he.distribute(model)`` with the default plan (every table row-wise by hash over the W
ranks) under DDP. Each world is its own job (``hybridembed.launch.spawn``: fresh
processes, gloo, one intra-op thread per rank) that, on every rank:

1. fills every table with ``--rows`` ids (0 .. rows-1, each rank a share, forward passes in
   training mode), then trains ``--warmup`` steps (batch ``--batch`` per rank: 13 N(0,1)
   dense features, 26 power-law ids over ``--rows``, random labels);
2. full saves (``he.save(path, model, opt)``, ``--repeats`` times; each replaces the last)
   and loads (``he.load``, checksums verified) of that state: wall time of the call after a
   barrier, the slowest rank's; bytes each rank wrote (the manifest's files: a rank's shard
   files; rank 0 also the dense state, the optimizer file and the manifest);
3. the pause: ``he.save(..., background=True)`` returns after an in-memory copy; its
   return time against the blocking save's, the time until it is committed, and the
   training steps run while the thread writes (``--pause-steps`` of them, after as many just
   before; the median time of those that ended before the commit against the ones before);
4. the delta: after a load, for each of ``--delta-steps`` (10 100): that many training
   steps, each on a new batch, then ``he.save(path, model, opt, incremental=True)`` (on top
   of the previous version: a chain): its bytes, rows and time against the full save's, and
   the time to load the chain (full version + deltas). The batch is per rank: at world W a
   step sees W times the samples, and a delta holds more rows.

Files are written to a temporary directory (``--dir``: where; the page cache is warm when
a load reads what was just saved, as it is after a restart on the same host). World 4 runs
4 ranks on 2 cores here: its times show the trend, its bytes are exact.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import hybridembed as he
from hybridembed.bench.system import cpu_busy, machine
from hybridembed.checkpoint import read_manifest
from hybridembed.distributed import ShardedCollection
from hybridembed.launch import SpawnError, spawn
from hybridembed.synthetic import powerlaw_ids

TABLES = 26
DENSE = 13
FILL_CHUNK = 8192  # ids per table per fill forward
DISTINCT_BATCHES = 4  # batches cycled through by the timed steps (made before timing)


# --- the model and its data -----------------------------------------------------------------
def build_model(world: int, cfg: dict) -> tuple[nn.Module, torch.optim.Optimizer, dict[str, Any]]:
    """The DLRM of ``hybridembed train`` (dynamic tables), distributed when ``world`` > 1, and
    its Adagrad optimizer; ``info``: the plan (sharding/placement: tables)."""
    from hybridembed.train.models import build

    features = [f"C{i}" for i in range(1, TABLES + 1)]
    model: nn.Module = build("dlrm", DENSE, features, dim=cfg["dim"], capacity=2 * cfg["rows"])
    info: dict[str, Any] = {"plan": None}
    if world > 1:
        model = he.distribute(model)
        sharded = [m for m in model.modules() if isinstance(m, ShardedCollection)][0]
        kinds: dict[str, int] = {}
        for tp in sharded.plan.tables:
            key = f"{tp.sharding}/{tp.placement}"
            kinds[key] = kinds.get(key, 0) + 1
        info["plan"] = kinds
    opt = he.wrap_optimizer(torch.optim.Adagrad(model.parameters(), lr=0.02), model)
    return model, opt, info


def fill(model: nn.Module, rank: int, world: int, rows: int) -> None:
    """Makes ids 0 .. rows-1 of every table (rank r asks for ids r, r + W, ...): forward passes
    in training mode without gradients; every rank makes as many (the forward is a collective)."""
    mine = torch.arange(rank, rows, world)
    n = max(1, -(-((rows + world - 1) // world) // FILL_CHUNK))
    model.train()
    with torch.no_grad():
        for ids in torch.tensor_split(mine, n):
            model(torch.zeros(ids.numel(), DENSE), ids.unsqueeze(1).expand(-1, TABLES).contiguous())


def make_batch(rank: int, cfg: dict, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Batch ``index`` of this rank: (B, 13) dense N(0,1), (B, 26) power-law ids, (B,) labels."""
    g = torch.Generator().manual_seed(1_000_003 * cfg["seed"] + 1009 * index + rank)
    b = cfg["batch"]
    ids = torch.stack([powerlaw_ids(b, cfg["rows"], generator=g) for _ in range(TABLES)], 1)  # (B, 26)
    return torch.randn(b, DENSE, generator=g), ids, torch.randint(0, 2, (b,), generator=g).float()


# --- measuring ------------------------------------------------------------------------------
def _barrier(world: int) -> None:
    if world > 1:
        dist.barrier()


def _slowest(world: int, seconds: float) -> float:
    """The largest of every rank's ``seconds`` (a collective)."""
    if world == 1:
        return seconds
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def bytes_per_rank(version_dir: str, world: int) -> dict[str, Any]:
    """Bytes each rank wrote for the version at ``version_dir`` (from its manifest: shard
    files by their ``rank``; every other file, and the manifest itself, by rank 0), and the
    table rows its files hold (a delta: the rows changed since its parent)."""
    m = read_manifest(version_dir)
    owner: dict[str, int] = {}
    rows = 0
    for t in m["tables"].values():
        for s in t["shards"]:
            owner[s["file"]] = int(s.get("rank", 0))
            if s.get("col_start", 0) == 0:  # a delta's shard: the rows it holds are the changed ones
                rows += int(s["changed"] if "changed" in s else s.get("rows", 0))
    per = [0] * world
    for rel, f in m["files"].items():
        per[owner.get(rel, 0)] += int(f["bytes"])
    per[0] += (Path(version_dir) / "manifest.json").stat().st_size
    return {"bytes_per_rank": per, "bytes": sum(per), "rows": rows, "incremental": "incremental" in m}


def run_rank(rank: int, world: int, cfg: dict) -> dict[str, Any]:
    """One world's job on one rank (see the module docstring); rank 0's result carries the figures."""
    logging.getLogger("hybridembed").setLevel(logging.WARNING)
    path = str(Path(cfg["dir"]) / f"world{world}")
    t0 = time.perf_counter()
    model, opt, info = build_model(world, cfg)
    fill(model, rank, world, cfg["rows"])
    fill_s = time.perf_counter() - t0
    batches = [make_batch(rank, cfg, i) for i in range(DISTINCT_BATCHES)]

    def step(i: int, batch: tuple | None = None) -> None:
        dense, ids, y = batch or batches[i % len(batches)]
        loss = F.binary_cross_entropy_with_logits(model(dense, ids), y)
        opt.zero_grad()
        loss.backward()
        opt.step()

    for i in range(cfg["warmup"]):
        step(i)
    out: dict[str, Any] = {"rank": rank, "fill_s": fill_s, **info}

    # full saves and loads of the same state
    saves, loads, vdir = [], [], ""
    for _ in range(cfg["repeats"]):
        _barrier(world)
        t = time.perf_counter()
        vdir = str(he.save(path, model, opt))
        saves.append(_slowest(world, time.perf_counter() - t))
        _barrier(world)
        t = time.perf_counter()
        he.load(path, model, opt)
        loads.append(_slowest(world, time.perf_counter() - t))
    out["save_s"], out["load_s"] = saves, loads
    if rank == 0:
        out["full"] = bytes_per_rank(vdir, world)

    # the pause: a blocking save against a background one, and the steps while it writes
    blocking, returns, written, before, during, overlapped = [], [], [], [], [], []
    n = cfg["pause_steps"]
    for _ in range(cfg["repeats"]):
        _barrier(world)
        t = time.perf_counter()
        he.save(path, model, opt)
        blocking.append(_slowest(world, time.perf_counter() - t))
        times = []
        for i in range(n):  # steps without a save, just before
            _barrier(world)
            t = time.perf_counter()
            step(i)
            times.append(time.perf_counter() - t)
        before.append(statistics.median(times))
        _barrier(world)
        t = time.perf_counter()
        handle = he.save(path, model, opt, background=True)
        returns.append(_slowest(world, time.perf_counter() - t))
        times, overlap, done_at = [], 0, None
        for i in range(n):  # the same steps while the thread writes (every rank runs n)
            _barrier(world)
            s = time.perf_counter()
            step(i)
            times.append(time.perf_counter() - s)
            if not handle.done():
                overlap += 1  # this step ended before the save did
            elif done_at is None:
                done_at = time.perf_counter()  # committed during this step
        handle.wait()
        written.append(_slowest(world, (done_at or time.perf_counter()) - t))
        during.append(statistics.median(times[: max(1, overlap)]))
        overlapped.append(overlap)
    out["pause"] = {
        "blocking_s": blocking,
        "background_return_s": returns,
        "background_total_s": written,
        "step_before_s": before,
        "step_during_s": during,
        "steps": n,
        "steps_overlapped": overlapped,
    }

    # the delta: training steps after a load, then an incremental save on top of it
    _barrier(world)
    he.load(path, model, opt)  # the version the delta goes on top of
    deltas, fresh = [], DISTINCT_BATCHES
    for steps in cfg["delta_steps"]:
        for _ in range(steps):  # every step a new batch (its rows are what the delta holds)
            step(0, make_batch(rank, cfg, fresh))
            fresh += 1
        _barrier(world)
        t = time.perf_counter()
        vdelta = str(he.save(path, model, opt, incremental=True, keep=1))
        save_s = _slowest(world, time.perf_counter() - t)
        _barrier(world)
        t = time.perf_counter()
        he.load(path, model, opt)
        load_s = _slowest(world, time.perf_counter() - t)
        rec = {"steps": steps, "save_s": save_s, "load_chain_s": load_s}
        if rank == 0:
            rec.update(bytes_per_rank(vdelta, world))
        deltas.append(rec)
    out["deltas"] = deltas
    return out


# --- driver ---------------------------------------------------------------------------------
def _med(xs: list[float]) -> float:
    return statistics.median(xs)


def run_world(world: int, cfg: dict) -> dict[str, Any]:
    t0 = time.perf_counter()
    res = spawn(run_rank, world, cfg, timeout=cfg["timeout"], pg_timeout=cfg["timeout"], threads=1)
    r = res[0]
    full, p = r["full"], r["pause"]
    return {
        "world": world,
        "plan": r["plan"],
        "job_s": time.perf_counter() - t0,
        "fill_s": max(x["fill_s"] for x in res),
        "save_s": _med(r["save_s"]),
        "load_s": _med(r["load_s"]),
        "save_runs_s": r["save_s"],
        "load_runs_s": r["load_s"],
        "full_bytes_per_rank": full["bytes_per_rank"],
        "full_bytes": full["bytes"],
        "full_rows": full["rows"],
        "pause": {
            **p,
            "blocking_median_s": _med(p["blocking_s"]),
            "background_return_median_s": _med(p["background_return_s"]),
            "background_total_median_s": _med(p["background_total_s"]),
            "step_before_median_s": _med(p["step_before_s"]),
            "step_during_median_s": _med(p["step_during_s"]),
        },
        "deltas": r["deltas"],
        "loadavg_after": os.getloadavg()[0],  # other jobs on the machine: 1-minute load average
    }


def _mb(b: float) -> str:
    return f"{b / 1e6:.1f}"


def markdown(results: list[dict[str, Any]], cfg: dict) -> str:
    """The figures as markdown tables."""
    lines = [
        f"Save and load, full version ({TABLES} tables x {cfg['rows']:,} rows x dim {cfg['dim']}, "
        f"Adagrad; median of {cfg['repeats']}, slowest rank):",
        "",
        "| world | plan | save s | load s | MB written per rank | MB total | rows |",
        "| ---: | --- | ---: | ---: | --- | ---: | ---: |",
    ]
    for r in results:
        plan = ", ".join(f"{k} {v}" for k, v in r["plan"].items()) if r["plan"] else "one process"
        per = " / ".join(_mb(b) for b in r["full_bytes_per_rank"])
        lines.append(
            f"| {r['world']} | {plan} | {r['save_s']:.2f} | {r['load_s']:.2f} | {per} | {_mb(r['full_bytes'])} "
            f"| {r['full_rows']:,} |"
        )
    lines += [
        "",
        "Delta (`incremental=True`) after training steps, against the full version:",
        "",
        "| world | steps | rows in delta / full | MB delta / full | ratio | delta save s / full | load chain s |",
        "| ---: | ---: | --- | --- | ---: | --- | ---: |",
    ]
    for r in results:
        for d in r["deltas"]:
            lines.append(
                f"| {r['world']} | {d['steps']} | {d['rows']:,} / {r['full_rows']:,} | {_mb(d['bytes'])} / "
                f"{_mb(r['full_bytes'])} | {d['bytes'] / r['full_bytes']:.2f} | {d['save_s']:.2f} / "
                f"{r['save_s']:.2f} | {d['load_chain_s']:.2f} |"
            )
    lines += [
        "",
        f"The pause of a full save (median of {cfg['repeats']}, slowest rank; steps: batch {cfg['batch']} per rank):",
        "",
        "| world | blocking save s | background: returns after s | written + committed s | ratio | "
        "step ms before / while writing |",
        "| ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in results:
        p = r["pause"]
        ratio = p["blocking_median_s"] / p["background_return_median_s"]
        lines.append(
            f"| {r['world']} | {p['blocking_median_s']:.2f} | {p['background_return_median_s']:.3f} | "
            f"{p['background_total_median_s']:.2f} | {ratio:.0f}x | {1e3 * p['step_before_median_s']:.0f} / "
            f"{1e3 * p['step_during_median_s']:.0f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--rows", type=int, default=100_000, help="ids per table")
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--batch", type=int, default=4096, help="per rank")
    p.add_argument("--warmup", type=int, default=3, help="training steps before the first save")
    p.add_argument("--repeats", type=int, default=3, help="full saves, loads and pause measurements")
    p.add_argument("--pause-steps", type=int, default=10, help="steps timed before and during a background save")
    p.add_argument(
        "--delta-steps", type=int, nargs="+", default=[10, 100], help="steps before each incremental save (a chain)"
    )
    p.add_argument("--quick", action="store_true", help="tiny sizes, seconds (a smoke test)")
    p.add_argument("--dir", help="where to write the checkpoints (a temporary directory in it; removed after)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per job")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    if args.quick:
        args.rows, args.dim, args.batch, args.warmup = 1_000, 4, 32, 1
        args.repeats, args.pause_steps, args.delta_steps = 1, 2, [5]
    cfg = {
        k: getattr(args, k)
        for k in ("rows", "dim", "batch", "warmup", "repeats", "pause_steps", "delta_steps", "timeout", "seed")
    }
    busy = cpu_busy(0.5)
    print(f"machine: {machine()['cpu']}, {machine()['cores']} cores; other processes' CPU use: {busy}", flush=True)
    tmp = tempfile.mkdtemp(prefix="bench-ckpt-", dir=args.dir)
    cfg["dir"] = tmp
    results: list[dict[str, Any]] = []
    failures: dict[str, str] = {}
    try:
        for world in args.world:
            try:
                rec = run_world(world, cfg)
            except SpawnError as e:
                failures[f"world {world}"] = str(e).strip().splitlines()[-1][:300]
                print(f"world {world}: FAILED: {failures[f'world {world}']}", flush=True)
                continue
            finally:
                shutil.rmtree(Path(tmp) / f"world{world}", ignore_errors=True)
            results.append(rec)
            p_ = rec["pause"]
            print(
                f"world {world}: save {rec['save_s']:.2f} s, load {rec['load_s']:.2f} s, "
                f"{_mb(rec['full_bytes'])} MB ({' / '.join(_mb(b) for b in rec['full_bytes_per_rank'])} per rank); "
                f"delta {_mb(rec['deltas'][0]['bytes'])} MB; pause {p_['blocking_median_s']:.2f} s blocking, "
                f"{p_['background_return_median_s']:.3f} s background; job {rec['job_s']:.0f} s; "
                f"load average {rec['loadavg_after']:.1f}",
                flush=True,
            )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    table = markdown(results, cfg) if results else ""
    print("\n" + table)
    out = {
        "machine": machine(),
        "cpu_busy_before": busy,
        "cpu_busy_after": cpu_busy(0.5),
        "config": {k: v for k, v in cfg.items() if k != "dir"},
        "failures": failures,
        "results": results,
        "markdown": table,
        "argv": sys.argv[1:] if argv is None else argv,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2, default=str))
    return out


if __name__ == "__main__":
    main()
