"""Parameter servers on one machine: step time and bytes of 2 trainers + 1 or 2 servers
against the collective row-wise runtime, asynchronous mode with and without the hot-row
cache, and prefetch.

    PYTHONPATH=src python benchmarks/bench_ps.py --rounds 3 --json ps.json   # every contender, 3 interleaved rounds
    PYTHONPATH=src python benchmarks/bench_ps.py --contenders sync_1 --profile  # where the 2+1 step's time goes
    PYTHONPATH=src python benchmarks/bench_ps.py --quick                        # seconds: the smoke test
    PYTHONPATH=src python benchmarks/bench_ps.py --reduce                       # the server's sum of the pushes

Every contender is its own job (``hybridembed.launch.spawn``: fresh processes,
gloo, one intra-op thread per process) on the same model: 26 ``nn.EmbeddingBag(rows, 16,
mode="sum")`` tables (100k rows by default), their pooled rows concatenated into an MLP
``26*16 -> 64 -> 1``, BCE loss on random labels; ``torch.optim.Adagrad`` (the tables: the
sparse Adagrad it maps to; the MLP: Adagrad under DDP among the trainers). One-hot power-law
ids (``hybridembed.synthetic.powerlaw_ids``, alpha 1.05), batch 4,096 per trainer; trainer r
gets the same batches in every contender.

Contenders (``--contenders``), 2 trainers each:

- ``sync_1`` / ``sync_2``: ``he.distribute(model, servers=1|2)`` (synchronous, the planner's
  plan for the servers);
- ``collective_rw``: ``he.distribute(model, plan)`` at world 2, every table row-wise over
  both ranks (no servers);
- ``async`` / ``async_cache``: one server, ``mode="async", staleness=2``, without / with
  ``cache_rows`` (``--cache-frac`` of all rows, 20% by default);
- ``sync_1_prefetch``: ``sync_1`` with ``PSCollection.prefetch(next step's inputs)`` called
  after backward, before ``opt.step()``.

Timing: a barrier among the trainers, then one whole step (forward, zero_grad, backward,
[prefetch], optimizer step); the step's time is the slowest trainer's; warm-up steps
excluded; medians over steps, and over ``--rounds`` (interleaved: every contender once per
round) the median of the rounds' medians. CPU time per step (``/proc/PID/stat``, user +
system) of every process, servers included: the machine may have fewer cores than
processes, so wall times include waiting for a core.

Bytes per step per trainer: parameter servers: ``PSCollection.stats()``'s
``bytes_sent`` / ``bytes_received`` (every message to and from the servers, headers
included) over the timed steps, and the servers' ``server_stats()``; collective: the
tensors this rank passes to ``torch.distributed.all_to_all_single`` that go to the other
rank, and what comes back, measured by wrapping the call during one step. Neither counts
the MLP's DDP all-reduce among the trainers (the same in both: 27k floats).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import logging
import os
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import hybridembed as he
from hybridembed.bench.system import cpu_busy, machine
from hybridembed.distributed import Plan, shard_table, shm
from hybridembed.launch import SpawnError, spawn
from hybridembed.ps import PSCollection
from hybridembed.synthetic import powerlaw_ids

TABLES = 26
TRAINERS = 2
LR = 0.05
DISTINCT_BATCHES = 4  # batches cycled through (ids generated before timing)
# name -> (servers, mode, cache, prefetch); servers 0: the collective row-wise runtime
CONTENDERS: dict[str, tuple[int, str, bool, bool]] = {
    "sync_1": (1, "sync", False, False),
    "sync_2": (2, "sync", False, False),
    "collective_rw": (0, "sync", False, False),
    "async": (1, "async", False, False),
    "async_cache": (1, "async", True, False),
    "sync_1_prefetch": (1, "sync", False, True),
}


class Plain(nn.Module):
    """26 separate ``nn.EmbeddingBag`` layers, their rows concatenated, a small MLP to one logit."""

    def __init__(self, rows: int, dim: int, hidden: int, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embs = nn.ModuleList(nn.EmbeddingBag(rows, dim, mode="sum") for _ in range(TABLES))
        self.mlp = nn.Sequential(nn.Linear(TABLES * dim, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, ids: list[torch.Tensor]) -> torch.Tensor:  # TABLES x (B, 1) -> (B,)
        x = torch.cat([e(x) for e, x in zip(self.embs, ids)], 1)  # (B, TABLES * D)
        return self.mlp(x).squeeze(1)


def make_batches(trainer: int, batch: int, rows: int, seed: int) -> list[tuple[list[torch.Tensor], torch.Tensor]]:
    """``DISTINCT_BATCHES`` batches of one trainer: TABLES x (B, 1) one-hot ids, (B,) labels."""
    g = torch.Generator().manual_seed(1000 * seed + trainer)
    out = []
    for _ in range(DISTINCT_BATCHES):
        ids = [powerlaw_ids(batch, rows, generator=g).unsqueeze(1) for _ in range(TABLES)]
        out.append((ids, torch.randint(0, 2, (batch,), generator=g).float()))
    return out


def row_wise_plan(rows: int, dim: int, world: int) -> Plan:
    tables = [he.TableConfig(f"embs__{i}", rows, dim) for i in range(TABLES)]
    return Plan(world, tuple(shard_table(t, "row_wise", tuple(range(world))) for t in tables))


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` (Linux ``/proc``; 0.0 elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class A2ACounter:
    """Counts the bytes this rank sends to / receives from other ranks through
    ``torch.distributed.all_to_all_single`` (as the collective runtime calls it) and through the
    rows' shared memory (:mod:`hybridembed.distributed.shm`, ranks of one machine)."""

    def __init__(self) -> None:
        self.sent = self.received = self.calls = 0

    def __enter__(self) -> A2ACounter:
        self._a2a = a2a = dist.all_to_all_single

        def wrapped(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
            world, me, size = dist.get_world_size(group), dist.get_rank(group), input.element_size()
            ins = input_split_sizes or [input.numel() // world] * world
            outs = output_split_sizes or [output.numel() // world] * world
            self.sent += (sum(ins) - ins[me]) * size
            self.received += (sum(outs) - outs[me]) * output.element_size()
            self.calls += 1
            return a2a(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)

        self._shm = through = shm.Transport.all_to_all

        def shared(tr, out, t, recv_splits, send_splits, status=1.0, meanwhile=None):
            size = (t if isinstance(t, torch.Tensor) else out).element_size()
            self.sent += (sum(send_splits) - send_splits[tr.rank]) * size
            self.received += (sum(recv_splits) - recv_splits[tr.rank]) * size
            self.calls += 1
            return through(tr, out, t, recv_splits, send_splits, status, meanwhile)

        dist.all_to_all_single = wrapped
        shm.Transport.all_to_all = shared
        return self

    def __exit__(self, *exc: Any) -> None:
        dist.all_to_all_single = self._a2a
        shm.Transport.all_to_all = self._shm


def _top(prof: cProfile.Profile, n: int, key: str, dump: str | None = None) -> list[str]:
    if dump:
        prof.dump_stats(dump)
    out = io.StringIO()
    pstats.Stats(prof, stream=out).strip_dirs().sort_stats(key).print_stats(n)
    lines = out.getvalue().splitlines()
    start = next((i for i, x in enumerate(lines) if x.lstrip().startswith("ncalls")), 0)
    return [x for x in lines[start:] if x.strip()]


def run_rank(rank: int, world: int, name: str, cfg: dict) -> dict[str, Any]:
    """One contender on one rank (trainer or server)."""
    logging.getLogger("hybridembed").setLevel(logging.WARNING)
    servers, mode, cache, prefetch = CONTENDERS[name]
    pids = [None] * world
    dist.all_gather_object(pids, os.getpid())
    model: nn.Module | None = Plain(cfg["rows"], cfg["dim"], cfg["hidden"])
    prof = cProfile.Profile() if cfg["profile"] else None
    if servers:
        cache_rows = int(cfg["cache_frac"] * TABLES * cfg["rows"]) if cache else 0
        opts = {"servers": servers, "mode": mode, "server_exit": False, "cache_rows": cache_rows}
        if mode == "async":
            opts["staleness"] = cfg["staleness"]
        if prof is not None and rank >= TRAINERS:
            prof.enable()
        model = he.distribute(model, **opts)
        if model is None:  # a server: served until the trainers left
            out: dict[str, Any] = {"server": True, "rank": rank}
            if prof is not None:
                prof.disable()
                out["profile_tottime"] = _top(prof, 25, "tottime", _dump(cfg, name, rank))
                out["profile_cumtime"] = _top(prof, 25, "cumulative")
            return out
        group = model.process_group
        ec = next(m for m in model.modules() if isinstance(m, PSCollection))
    else:
        model = he.distribute(model, row_wise_plan(cfg["rows"], cfg["dim"], world))
        group, ec = None, None
    opt = torch.optim.Adagrad(model.parameters(), lr=LR)
    opt = he.wrap_optimizer(opt, model)
    batches = make_batches(rank, cfg["batch"], cfg["rows"], cfg["seed"])
    names = [f"embs__{i}" for i in range(TABLES)]

    def step(i: int) -> None:
        ids, y = batches[i % len(batches)]
        loss = F.binary_cross_entropy_with_logits(model(ids), y)
        opt.zero_grad()
        loss.backward()
        if prefetch:
            ec.prefetch(dict(zip(names, batches[(i + 1) % len(batches)][0])))
        opt.step()

    def settle() -> None:
        """Every push sent so far is applied: a trainer's stats request is answered after its
        own pushes, so once every trainer has had its answer (the barrier), the servers have them all."""
        if ec is not None:
            ec.server_stats()
        dist.barrier(group)

    for i in range(cfg["warmup"]):
        step(i)
    settle()
    before = {"servers": ec.server_stats() if ec else None, "stats": ec.stats() if ec else None}
    cpu0 = {p: cpu_seconds(p) for p in pids}
    times, cpu = [], []
    if prof is not None:
        prof.enable()
    for i in range(cfg["warmup"], cfg["warmup"] + cfg["steps"]):
        dist.barrier(group)
        t, c = time.perf_counter(), time.process_time()
        step(i)
        times.append((time.perf_counter() - t) * 1e3)
        cpu.append((time.process_time() - c) * 1e3)
    if prof is not None:
        prof.disable()
    after = ec.stats() if ec else None
    settle()
    steps = cfg["steps"]
    cpu_all = {p: (cpu_seconds(p) - cpu0[p]) * 1e3 / steps for p in pids}  # ms per step
    out = {"rank": rank, "times_ms": times, "cpu_ms": cpu, "cpu_ms_per_step_by_rank": [cpu_all[p] for p in pids]}
    if ec is not None:
        srv = ec.server_stats()
        b = before["stats"]
        out["bytes_sent"] = (after["bytes_sent"] - b["bytes_sent"]) / steps
        out["bytes_received"] = (after["bytes_received"] - b["bytes_received"]) / steps
        out["lookups"] = (after["lookups"] - b["lookups"]) / steps
        out["pulled_rows"] = (after["pulled"] - b["pulled"]) / steps
        out["prefetch_hits"] = after["prefetch_hits"] - b["prefetch_hits"]
        if "cache_hit_rate" in after:
            looked = after["lookups"] - b["lookups"]
            out["cache_hit_rate"] = (after["cache_hits"] - b["cache_hits"]) / looked if looked else 0.0
            out["cache_hit_rate_all_steps"] = after["cache_hit_rate"]
        keys = ("requests", "pulled_rows", "pushed_rows", "bytes_in", "bytes_out")
        out["server_stats"] = [
            {**{k: (s[k] - s0[k]) / steps for k in keys}, "rank": s["rank"], "memory_bytes": s["memory_bytes"]}
            for s0, s in zip(before["servers"], srv)
        ]
        dist.barrier(group)  # (no trainer leaves while another still asks for stats)
        ec.close()
    else:
        with A2ACounter() as c:
            step(0)
        out["bytes_sent"], out["bytes_received"], out["a2a_calls"] = c.sent, c.received, c.calls
    if prof is not None:
        out["profile_tottime"] = _top(prof, 25, "tottime", _dump(cfg, name, rank))
        out["profile_cumtime"] = _top(prof, 25, "cumulative")
    return out


def _dump(cfg: dict, name: str, rank: int) -> str | None:
    """Where ``--profile-dir`` keeps this rank's raw cProfile stats (for ``pstats``)."""
    return str(Path(cfg["profile_dir"]) / f"{name}.rank{rank}.prof") if cfg.get("profile_dir") else None


def run_job(name: str, cfg: dict) -> dict[str, Any]:
    servers = CONTENDERS[name][0]
    world = TRAINERS + servers
    t0 = time.perf_counter()
    res = spawn(run_rank, world, name, cfg, timeout=cfg["timeout"], pg_timeout=cfg["timeout"], threads=1)
    trainers = res[:TRAINERS]
    step_ms = [max(ts) for ts in zip(*(r["times_ms"] for r in trainers))]  # the slowest trainer's
    cpu_by_rank = [statistics.mean(r["cpu_ms_per_step_by_rank"][k] for r in trainers) for k in range(world)]
    rec: dict[str, Any] = {
        "contender": name,
        "trainers": TRAINERS,
        "servers": servers,
        "mode": CONTENDERS[name][1],
        "median_ms": statistics.median(step_ms),
        "min_ms": min(step_ms),
        "max_ms": max(step_ms),
        "step_ms": step_ms,
        "trainer_cpu_ms": [statistics.median(r["cpu_ms"]) for r in trainers],
        "cpu_ms_per_step_by_rank": cpu_by_rank,  # every process, servers last
        "bytes_sent_per_trainer": [r["bytes_sent"] for r in trainers],
        "bytes_received_per_trainer": [r["bytes_received"] for r in trainers],
        "job_s": time.perf_counter() - t0,
    }
    for key in ("lookups", "pulled_rows", "prefetch_hits", "cache_hit_rate", "cache_hit_rate_all_steps", "a2a_calls"):
        if key in trainers[0]:
            rec[key] = [r[key] for r in trainers]
    if "server_stats" in trainers[0]:
        rec["server_stats"] = trainers[0]["server_stats"]
    if cfg["profile"]:
        rec["profile"] = {
            f"rank {r['rank']}{' (server)' if r.get('server') else ''}": {
                "tottime": r["profile_tottime"],
                "cumtime": r["profile_cumtime"],
            }
            for r in res
            if "profile_tottime" in r
        }
    return rec


def reduce_pushes(args) -> dict[str, float]:
    """The server's sum of a step's pushes, in one thread: two trainers' distinct rows of the 26
    tables (power-law batches) by the fused step's reduction (what the server runs) and by a
    sparse ``coalesce`` (what it ran before); medians of 30 each, alternated twice."""
    from hybridembed.kernels.cpu_fused import reduce_kept

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(args.seed)
    tables, total = 26, 26 * args.rows
    slots = torch.cat(
        [
            torch.unique(powerlaw_ids(args.batch, args.rows, generator=g)) + k * args.rows
            for _ in range(2)
            for k in range(tables)
        ]
    )
    grad = torch.randn(slots.numel(), args.dim, generator=g)

    def coalesced():
        coo = torch.sparse_coo_tensor(slots.unsqueeze(0), grad, (total, args.dim), check_invariants=False).coalesce()
        return coo.indices()[0], coo.values()

    runs = {"sorted_segments": lambda: reduce_kept(slots, grad, None, None, total), "coalesce": coalesced}
    a, b = (f() for f in runs.values())
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])  # (the same sums)
    out: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(2):
        for name, f in runs.items():
            ts = []
            for _ in range(30):
                t0 = time.perf_counter()
                f()
                ts.append(time.perf_counter() - t0)
            out[name].append(statistics.median(ts) * 1e3)
    print(
        f"{slots.numel():,} pushed rows of {args.dim}: "
        + ", ".join(f"{k} {' / '.join(f'{t:.2f}' for t in v)} ms" for k, v in out.items())
    )
    return {k: min(v) for k, v in out.items()}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=4096, help="per trainer")
    p.add_argument("--rows", type=int, default=100_000, help="rows of each of the 26 tables")
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--steps", type=int, default=20, help="timed steps per job")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=1, help="every contender this many times, interleaved")
    p.add_argument("--contenders", nargs="+", default=list(CONTENDERS), choices=list(CONTENDERS))
    p.add_argument("--staleness", type=int, default=2, help="asynchronous mode's bound")
    p.add_argument("--cache-frac", type=float, default=0.2, help="async_cache: cache_rows = this x all rows")
    p.add_argument("--profile", action="store_true", help="cProfile the trainers' timed steps and the servers")
    p.add_argument("--profile-dir", help="with --profile: also write each rank's raw stats here (pstats files)")
    p.add_argument("--quick", action="store_true", help="tiny sizes, seconds (a smoke test)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per job")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the results here")
    p.add_argument(
        "--reduce",
        action="store_true",
        help="only the server's sum of two trainers' pushes: sorted segments vs coalesce",
    )
    args = p.parse_args(argv)
    if args.reduce:
        return reduce_pushes(args)
    if args.quick:
        args.batch, args.rows, args.dim, args.hidden, args.steps, args.warmup = 64, 500, 4, 8, 3, 1
    cfg = {
        k: getattr(args, k)
        for k in ("batch", "rows", "dim", "hidden", "steps", "warmup", "staleness", "cache_frac", "seed", "timeout")
    }
    cfg["profile"], cfg["profile_dir"] = args.profile, args.profile_dir
    if args.profile_dir:
        Path(args.profile_dir).mkdir(parents=True, exist_ok=True)
    busy = cpu_busy(0.5)
    mach = machine()
    print(f"machine: {mach['cpu']}, {mach['cores']} cores; other processes' CPU use: {busy}", flush=True)
    results: list[dict[str, Any]] = []
    failures: dict[str, str] = {}
    for r in range(args.rounds):
        for name in args.contenders:
            if name in failures:
                continue
            try:
                rec = run_job(name, cfg)
            except SpawnError as e:
                failures[name] = str(e).strip().splitlines()[-1][:300]
                print(f"{name}: FAILED: {failures[name]}", flush=True)
                continue
            rec["round"] = r
            results.append(rec)
            hit = f" cache hit rate {rec['cache_hit_rate'][0]:.3f}" if "cache_hit_rate" in rec else ""
            cpu = " ".join(f"{x:.0f}" for x in rec["cpu_ms_per_step_by_rank"])
            print(
                f"round {r + 1} {name:16s} median {rec['median_ms']:7.1f} ms [{rec['min_ms']:.1f}-{rec['max_ms']:.1f}] "
                f"trainer 0 sent {rec['bytes_sent_per_trainer'][0] / 1e6:.2f} MB, received "
                f"{rec['bytes_received_per_trainer'][0] / 1e6:.2f} MB per step; CPU ms/step by rank [{cpu}]{hit}; "
                f"job {rec['job_s']:.0f} s",
                flush=True,
            )
    summary = []
    for name in args.contenders:
        recs = [x for x in results if x["contender"] == name]
        if not recs:
            continue
        s = {
            "contender": name,
            "servers": recs[0]["servers"],
            "mode": recs[0]["mode"],
            "median_ms": statistics.median(x["median_ms"] for x in recs),
            "rounds_ms": [x["median_ms"] for x in recs],
            "bytes_sent_per_trainer": statistics.median(statistics.mean(x["bytes_sent_per_trainer"]) for x in recs),
            "bytes_received_per_trainer": statistics.median(
                statistics.mean(x["bytes_received_per_trainer"]) for x in recs
            ),
            "cpu_ms_per_step_by_rank": [
                statistics.median(x["cpu_ms_per_step_by_rank"][k] for x in recs)
                for k in range(len(recs[0]["cpu_ms_per_step_by_rank"]))
            ],
        }
        if "cache_hit_rate" in recs[0]:
            s["cache_hit_rate"] = statistics.median(statistics.mean(x["cache_hit_rate"]) for x in recs)
        summary.append(s)
    print(
        "\ncontender         servers  step ms: median of rounds [range]  MB/step/trainer sent + received  CPU ms/step by rank"
    )
    for s in summary:
        cpu = " ".join(f"{x:.0f}" for x in s["cpu_ms_per_step_by_rank"])
        hit = f"  hit rate {s['cache_hit_rate']:.3f}" if "cache_hit_rate" in s else ""
        print(
            f"{s['contender']:17s} {s['servers']:7d}  {s['median_ms']:8.1f} [{min(s['rounds_ms']):.1f}-{max(s['rounds_ms']):.1f}]"
            f"   {s['bytes_sent_per_trainer'] / 1e6:6.2f} + {s['bytes_received_per_trainer'] / 1e6:6.2f}"
            f"   [{cpu}]{hit}"
        )
    for rec in results:
        for who, prof in rec.get("profile", {}).items():
            print(f"\nprofile of {rec['contender']}, {who} (top by own time):")
            print("\n".join(prof["tottime"]))
    out = {
        "machine": mach,
        "cpu_busy_before": busy,
        "config": cfg,
        "failures": failures,
        "summary": summary,
        "runs": results,
        "argv": sys.argv[1:] if argv is None else argv,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2, default=str))
    return out


if __name__ == "__main__":
    main()
