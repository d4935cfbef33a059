"""Dynamic tables: lookup-and-insert throughput, and the training step against dense tables.

    python benchmarks/bench_dynamic.py                           # full size (several minutes)
    python benchmarks/bench_dynamic.py --skip throughput --hashed-ids
    python benchmarks/bench_dynamic.py --prefill 100000 --batch-ids 20000 --tables 3 --rows 2000 --batch 128 --steps 2

1. Throughput: a dynamic table is filled with --prefill (10,000,000) distinct ids, then
   batches of --batch-ids (1,000,000) power-law ids (alpha 1.05) over twice the prefilled
   range are mapped to rows in training mode (hits, admissions, inserts): ids per second.
2. Step: the optimizer benchmark's workload (26 tables x 200,000 rows x dim 64, batch 8192,
   one-hot and multi-hot) with dynamic tables in place of dense ones, interleaved with the
   dense version in the same run: forward, backward, optimizer step. Target: dynamic <= 1.25x.
   With --hashed-ids the dynamic tables get each id through splitmix64 (spread over all of
   int64, as hashed strings are), which takes the int64 sort instead of the int32 one.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import hybridembed as he
from hybridembed.bench import add_allocator_option, apply_allocator_option, powerlaw_ids, time_interleaved
from hybridembed.init import mix64


def throughput(args) -> dict:
    ec = he.EmbeddingCollection([he.TableConfig("t", None, args.dim, dynamic=he.Dynamic(initial_rows=args.prefill))])
    st = ec.storage_of("t")
    tabs = torch.zeros(args.batch_ids, dtype=torch.int32)
    t0 = time.perf_counter()
    for start in range(0, args.prefill, args.batch_ids):
        ids = torch.arange(start, min(start + args.batch_ids, args.prefill))
        st.slots(ids, tabs[: ids.numel()], train=True)
    fill_s = time.perf_counter() - t0
    times = []
    for _ in range(args.steps):
        ids = powerlaw_ids(args.batch_ids, 2 * args.prefill)
        t0 = time.perf_counter()
        st.slots(ids, tabs, train=True)
        times.append(time.perf_counter() - t0)
    times.sort()
    med = times[len(times) // 2]
    stats = st.table_stats("t")
    out = {
        "prefill_ids": args.prefill,
        "prefill_ids_per_s": args.prefill / fill_s,
        "batch_ids": args.batch_ids,
        "lookup_insert_ms": med * 1e3,
        "ids_per_s": args.batch_ids / med,
        "rows_after": stats["size"],
        "hit_rate": stats["hit_rate"],
    }
    print(
        f"throughput: prefill {out['prefill_ids_per_s'] / 1e6:.2f} M ids/s; lookup+insert of {args.batch_ids} "
        f"power-law ids {out['lookup_insert_ms']:.1f} ms = {out['ids_per_s'] / 1e6:.2f} M ids/s "
        f"({stats['size']} rows, hit rate {stats['hit_rate']:.3f})",
        flush=True,
    )
    return out


def step(args) -> list[dict]:
    names = [f"t{i}" for i in range(args.tables)]
    runs = []
    for optname in args.optimizers:
        sparse = he.optim.SGD(lr=0.01) if optname == "sgd" else he.optim.RowWiseAdagrad(lr=0.01)
        models = {}
        for kind in ("dense", "dynamic"):
            dyn = he.Dynamic() if kind == "dynamic" else None
            rows = None if dyn else args.rows
            ec = he.EmbeddingCollection([he.TableConfig(n, rows, args.dim, dynamic=dyn) for n in names])
            models[kind] = (ec, he.wrap_optimizer(torch.optim.SGD(ec.parameters(), lr=0.01), ec, sparse=sparse))
        for hot in args.hotness:
            batch, wide = {}, {}
            for n in names:
                lens = (
                    torch.ones(args.batch, dtype=torch.int64) if hot == "one" else torch.randint(0, 21, (args.batch,))
                )
                batch[n] = he.Jagged.from_lengths(powerlaw_ids(int(lens.sum()), args.rows), lens)
                # --hashed-ids: the same ids spread over all of int64, as hashed string ids are
                if args.hashed_ids:
                    wide[n] = he.Jagged(mix64(batch[n].values), batch[n].offsets)
            grads = [torch.randn(args.batch, args.dim) for _ in names]

            def make(ec, opt, grads=grads, plain=batch, wide=wide):
                batch_of = wide if args.hashed_ids and ec.storages[0].kind == "dynamic" else plain

                def fn(inputs=batch_of):
                    out = ec(inputs)
                    torch.autograd.backward([out[n] for n in names], grads)
                    opt.step()
                    opt.zero_grad()

                return fn

            t = time_interleaved({k: make(*v) for k, v in models.items()}, steps=args.steps)
            run = {
                "optimizer": optname,
                "hotness": hot,
                "hashed_ids": args.hashed_ids,
                "dense_ms": t["dense"].median,
                "dynamic_ms": t["dynamic"].median,
                "dynamic_over_dense": t["dynamic"].median / t["dense"].median,
            }
            print(
                f"step {optname:16s} {hot}-hot{' (hashed ids)' if args.hashed_ids else ''}: dense {run['dense_ms']:7.1f} ms | dynamic {run['dynamic_ms']:7.1f} ms "
                f"| dynamic/dense {run['dynamic_over_dense']:.2f}x",
                flush=True,
            )
            runs.append(run)
    return runs


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prefill", type=int, default=10_000_000)
    p.add_argument("--batch-ids", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--tables", type=int, default=26)
    p.add_argument("--rows", type=int, default=200_000, help="id range of the step workload")
    p.add_argument("--batch", type=int, default=8192)
    p.add_argument("--optimizers", nargs="+", default=["sgd", "rowwise_adagrad"])
    p.add_argument("--hotness", nargs="+", default=["one", "multi"], choices=["one", "multi"])
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--hashed-ids", action="store_true", help="step: dynamic tables get the ids through a 64-bit hash")
    p.add_argument("--skip", nargs="*", default=[], choices=["throughput", "step"])
    add_allocator_option(p)
    p.add_argument("--json")
    args = p.parse_args(argv)
    apply_allocator_option(args)
    torch.manual_seed(0)
    res = {"config": vars(args), "torch": torch.__version__, "threads": torch.get_num_threads()}
    if "throughput" not in args.skip:
        res["throughput"] = throughput(args)
    if "step" not in args.skip:
        res["step"] = step(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return res


if __name__ == "__main__":
    main()
