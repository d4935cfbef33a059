"""A group's input assembly on the CPU: the one Numba pass (``kernels.cpu_assemble``) against the
eager ops (a few a feature, or a few a group for small batches), each inside the whole embedding
step (forward, backward, row-wise Adagrad step) of one collection, interleaved in one process. The
shape of ``bench_step.py``: 26 tables x 200k rows x 64, power-law ids, one-hot or 0..20 ids a bag.

    python benchmarks/bench_assemble.py                       # batch 8,192 and 128
    python benchmarks/bench_assemble.py --batch 128 --steps 200
"""

from __future__ import annotations

import argparse

import torch

import hybridembed as he
from hybridembed.bench import powerlaw_ids, time_interleaved
from hybridembed.kernels import cpu_assemble


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tables", type=int, default=26)
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, nargs="+", default=[8192, 128])
    p.add_argument("--hotness", nargs="+", choices=["one", "multi"], default=["one", "multi"])
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args(argv)
    names = [f"t{i}" for i in range(args.tables)]
    ec = he.EmbeddingCollection([he.TableConfig(n, args.rows, args.dim) for n in names])
    opt = he.wrap_optimizer(torch.optim.SGD(ec.parameters(), lr=0.01), ec, sparse=he.optim.RowWiseAdagrad(lr=0.01))
    numba = cpu_assemble.assemble
    out = []
    try:
        for b in args.batch:
            for hot in args.hotness:
                batch = {}
                for n in names:
                    lengths = torch.ones(b, dtype=torch.int64) if hot == "one" else torch.randint(0, 21, (b,))
                    batch[n] = he.Jagged.from_lengths(powerlaw_ids(int(lengths.sum()), args.rows), lengths)
                grads = list(torch.randn(b, args.tables * args.dim).split(args.dim, 1))

                def step(way, batch=batch, grads=grads):
                    cpu_assemble.assemble = way
                    outs = ec(batch)
                    torch.autograd.backward([outs[n] for n in names], grads)
                    opt.step()
                    opt.zero_grad()

                with torch.no_grad():  # (the same rows both ways)
                    cpu_assemble.assemble = numba
                    ours = ec(batch)
                    cpu_assemble.assemble = lambda *a: None
                    eager = ec(batch)
                    assert all(torch.equal(ours[n], eager[n]) for n in names)
                times = time_interleaved(
                    {"numba": lambda: step(numba), "eager": lambda: step(lambda *a: None)}, steps=args.steps
                )
                run = {"batch": b, "hotness": hot, **{f"{k}_ms": v.median for k, v in times.items()}}
                print(
                    f"batch {b:,} {hot}-hot: the step with the Numba assembly {run['numba_ms']:.2f} ms, "
                    f"with the eager ops {run['eager_ms']:.2f} ms ({run['eager_ms'] / run['numba_ms']:.3f}x)",
                    flush=True,
                )
                out.append(run)
    finally:
        cpu_assemble.assemble = numba
    return out


if __name__ == "__main__":
    main()
