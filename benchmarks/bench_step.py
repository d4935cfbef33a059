"""The embedding training step (forward + backward + optimizer update), in one run:

- hybridembed: EmbeddingCollection + he.wrap_optimizer (SGD, or sparse=RowWiseAdagrad);
- per-table PyTorch: one nn.EmbeddingBag(sparse=True) per table + torch.optim.SGD
  (torch.optim.Adagrad stands in for row-wise Adagrad, which torch lacks);
- FBGEMM's SplitTableBatchedEmbeddingBagsCodegen on CPU (EXACT_SGD, EXACT_ROWWISE_ADAGRAD),
  the kernel TorchRec uses, when fbgemm-gpu-cpu is installed.

    python benchmarks/bench_step.py                                  # 26 x 200k x 64, batch 8192, defaults
    HYBRIDEMBED_TUNE_ALLOCATOR=0 python benchmarks/bench_step.py     # glibc's allocator defaults
    python benchmarks/bench_step.py --tables 4 --rows 1000 --batch 256 --steps 3   # smoke
    python benchmarks/bench_step.py --kernels numba eager   # the fused CPU step against the eager ops, interleaved

(benchmarks/bench_defaults.py runs it in fresh processes, with and without the allocator tuning.)

Ids follow the power law (alpha 1.05); one-hot bags hold 1 id, multi-hot bags a uniform
0..20 ids (mean 10). Each contender backpropagates the same fixed upstream gradient, as a
model on top would send. Calls are interleaved; medians over --steps after warm-up.

Each line ends with the step's byte floor (``hybridembed.bench.floor``: the bytes a step must
move at least once, over this machine's copy bandwidth measured at the start on torch's
threads) and the fraction of it each step reaches (floor ms / step ms; 1 = at the copy's speed).
"""

from __future__ import annotations

import argparse
import functools
import json

import torch
from torch import nn

import hybridembed as he
from hybridembed.bench import add_allocator_option, apply_allocator_option, powerlaw_ids, time_interleaved
from hybridembed.bench.floor import copy_bandwidth, step_bytes

STATE_BYTES = {"sgd": 0, "rowwise_adagrad": 4}  # optimizer state a row (row-wise Adagrad: one float)


def fbgemm_module(tables: int, rows: int, dim: int, optimizer: str, lr: float, weights: list[torch.Tensor]):
    try:
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice,
            SplitTableBatchedEmbeddingBagsCodegen,
        )
    except Exception:  # not installed (optional `bench` extra)
        return None
    opt = {"sgd": EmbOptimType.EXACT_SGD, "rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD}[optimizer]
    emb = SplitTableBatchedEmbeddingBagsCodegen(
        embedding_specs=[(rows, dim, EmbeddingLocation.HOST, ComputeDevice.CPU) for _ in range(tables)],
        optimizer=opt,
        learning_rate=lr,
        eps=1e-8,
        pooling_mode=PoolingMode.SUM,
    )
    with torch.no_grad():
        for t, w in zip(emb.split_embedding_weights(), weights):
            t.copy_(w)
    return emb


def make_batch(names, rows, batch, hotness):
    ids, lengths = {}, {}
    for n in names:
        lens = torch.ones(batch, dtype=torch.int64) if hotness == 1 else torch.randint(0, 21, (batch,))
        lengths[n] = lens
        ids[n] = he.Jagged.from_lengths(powerlaw_ids(int(lens.sum()), rows), lens)
    return ids


def run_optimizer(args: argparse.Namespace, names: list[str], optname: str) -> list[dict]:
    """All hotness levels for one optimizer: the three contenders, interleaved."""
    sparse = he.optim.SGD(lr=args.lr) if optname == "sgd" else he.optim.RowWiseAdagrad(lr=args.lr)
    ours = {}  # contender name -> (collection, optimizer): one per --kernels value, the same rows
    for k in args.kernels:
        name = "hybridembed" if k == args.kernels[0] else f"hybridembed_{k}"
        c = he.EmbeddingCollection([he.TableConfig(n, args.rows, args.dim) for n in names], kernels=k)
        ours[name] = (c, he.wrap_optimizer(torch.optim.SGD(c.parameters(), lr=args.lr), c, sparse=sparse))
    ec, opt = ours["hybridembed"]
    bags = nn.ModuleList(nn.EmbeddingBag(args.rows, args.dim, mode="sum", sparse=True) for _ in names)
    with torch.no_grad():
        for n, bag in zip(names, bags):
            bag.weight.copy_(ec.weight(n))
    topt = (torch.optim.SGD if optname == "sgd" else torch.optim.Adagrad)(bags.parameters(), lr=args.lr)
    fb = fbgemm_module(args.tables, args.rows, args.dim, optname, args.lr, [ec.weight(n) for n in names])
    runs = []
    for hot in args.hotness:
        batch = make_batch(names, args.rows, args.batch, 1 if hot == "one" else 10)
        fb_ids = torch.cat([batch[n].values for n in names])
        starts = torch.tensor([0] + [batch[n].values.numel() for n in names]).cumsum(0)
        fb_off = torch.cat([batch[n].offsets[:-1] + starts[i] for i, n in enumerate(names)] + [starts[-1:]])
        # the upstream gradient a model would send back: fixed, dense, the same for all; a model
        # concatenates the tables' outputs (FBGEMM's output layout), so each table's gradient is a
        # view of one (B, T*D) buffer
        grad_cat = torch.randn(args.batch, args.tables * args.dim)
        grads = list(grad_cat.split(args.dim, dim=1))
        if args.upstream == "apart":
            grads = [g.clone() for g in grads]

        def hybrid(batch=batch, grads=grads, ec=ec, opt=opt):
            out = ec(batch)
            torch.autograd.backward([out[n] for n in names], grads)
            opt.step()
            opt.zero_grad()

        def per_table(batch=batch, grads=grads):
            out = [bag(batch[n].values, batch[n].offsets[:-1]) for n, bag in zip(names, bags)]
            torch.autograd.backward(out, grads)
            topt.step()
            topt.zero_grad()

        fns = {name: functools.partial(hybrid, ec=c, opt=o) for name, (c, o) in ours.items()}
        fns["per_table"] = per_table
        if fb is not None:
            fns["fbgemm"] = lambda ids=fb_ids, off=fb_off, g=grad_cat: fb(ids, off).backward(g)
        t = time_interleaved(fns, steps=args.steps)
        run = {"optimizer": optname, "hotness": hot, "ids": int(fb_ids.numel())}
        for k, v in t.items():
            run[f"{k}_ms"], run[f"{k}_spread_ms"] = v.median, v.spread
        by = step_bytes(batch, args.batch, args.dim, STATE_BYTES[optname])
        run["floor_bytes"], run["floor_ms"] = by["step"], by["step"] / args.bandwidth * 1e3
        for k, v in t.items():
            run[f"{k}_fraction_of_floor"] = run["floor_ms"] / v.median
        line = f"{optname:16s} {hot}-hot: hybridembed {t['hybridembed'].median:7.1f} ms"
        for k in fns:
            if k != "hybridembed":
                run[f"speedup_vs_{k}"] = t[k].median / t["hybridembed"].median
                line += f" | {k} {t[k].median:7.1f} ms ({run[f'speedup_vs_{k}']:.2f}x)"
        line += f" | floor {run['floor_ms']:.2f} ms: hybridembed at {run['hybridembed_fraction_of_floor']:.2f}"
        if "fbgemm" in t:
            line += f", fbgemm {run['fbgemm_fraction_of_floor']:.2f}"
        print(line, flush=True)
        runs.append(run)
    return runs


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tables", type=int, default=26)
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=8192)
    p.add_argument("--optimizers", nargs="+", default=["sgd", "rowwise_adagrad"])
    p.add_argument("--hotness", nargs="+", default=["one", "multi"], choices=["one", "multi"])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument(
        "--upstream",
        choices=["cat", "apart"],
        default="cat",
        help="cat (default): the tables' gradients are views of one (B, T*D) buffer, as a model that "
        "concatenates the outputs sends them; apart: one tensor per table",
    )
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's own)")
    p.add_argument(
        "--kernels",
        nargs="+",
        default=["auto"],
        choices=he.kernels.backend.KERNELS,
        help="hybridembed's kernel backends, each a contender in the same interleaved run (the first is "
        "'hybridembed', the others 'hybridembed_<kernels>'; default: auto)",
    )
    add_allocator_option(p)
    p.add_argument("--json", help="write results here")
    args = p.parse_args(argv)
    tuned = apply_allocator_option(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    names = [f"t{i}" for i in range(args.tables)]
    results = {
        "config": vars(args),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "allocator_tuned": tuned,
        "runs": [],
    }
    args.bandwidth = copy_bandwidth("cpu", 256, 5)
    results["copy_bandwidth_bytes_per_s"] = args.bandwidth
    print(
        f"{torch.get_num_threads()} threads, allocator {'tuned' if tuned else 'glibc defaults'}, "
        f"copy bandwidth {args.bandwidth / 1e9:.1f} GB/s (read + written)",
        flush=True,
    )
    for optname in args.optimizers:
        results["runs"] += run_optimizer(args, names, optname)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
