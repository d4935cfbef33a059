"""OpenMP's spinning workers against threads of ours: a two-thread Numba pass (the shape of the
fused CPU step's row update) timed right after a parallel torch op, with and without
:func:`hybridembed.utils.release_openmp_workers` between them, and after a gap of 50 ms (the
workers asleep by then), alternated. Also the cost of the release and of the next torch op.

Then the whole sequence a training step makes, at several sizes: a parallel torch op, the fused
step's row update of U rows (row-wise Adagrad, 64 floats a row, rows spread over 5.2M) on the
step's threads, then small parallel ops (five 256 x 256 matmuls: a dense layer, which must start
the released workers again) and one more op; with the release as shipped and without (the release
made a no-op), alternated.

    python benchmarks/bench_openmp.py [--rounds 15] [--work 2000000] [--rows 8192 16384 32768 65536]
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from numba import njit

from hybridembed.utils import release_openmp_workers


# (not cached: a script loaded under another name, as tests.bench.load_script loads it, cannot read its cache back)
@njit(nogil=True)
def _work(n):  # pragma: no cover (compiled)
    s = 0.0
    for i in range(n):
        s += np.sqrt(i * 1.0)
    return s


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--work", type=int, default=2_000_000, help="loop iterations a thread (~5 ms here)")
    p.add_argument("--rows", type=int, nargs="*", default=[8192, 16384, 32768, 65536], help="U of the sequences")
    p.add_argument("--table-rows", type=int, default=5_200_000)
    args = p.parse_args(argv)
    pool = ThreadPoolExecutor(1)
    x = torch.randn(1 << 22)

    def two() -> None:
        f = pool.submit(_work, args.work)
        _work(args.work)
        f.result()

    two()
    modes = ("spinning", "released", "asleep")
    times = {m: {"op": [], "release": [], "two_threads": []} for m in modes}
    for _ in range(args.rounds):
        for m in modes:
            t = time.perf_counter()
            x.mul_(1.0001)  # a parallel torch op: its workers idle after it
            times[m]["op"].append(time.perf_counter() - t)
            t = time.perf_counter()
            if m == "released":
                release_openmp_workers()
            elif m == "asleep":
                time.sleep(0.05)
            times[m]["release"].append(time.perf_counter() - t)
            t = time.perf_counter()
            two()
            times[m]["two_threads"].append(time.perf_counter() - t)
    one = []
    for _ in range(args.rounds):
        t = time.perf_counter()
        _work(args.work)
        one.append(time.perf_counter() - t)
    out = {m: {k: 1e3 * statistics.median(v) for k, v in d.items()} for m, d in times.items()}
    out["one_thread_alone_ms"] = 1e3 * statistics.median(one)
    print(f"{torch.get_num_threads()} torch threads; one thread's pass alone {out['one_thread_alone_ms']:.2f} ms")
    for m in modes:
        o = out[m]
        print(f"{m:9s}: two threads' pass {o['two_threads']:6.2f} ms | the torch op before it {o['op']:.3f} ms", end="")
        print(f" | release {o['release']:.3f} ms" if m == "released" else "")
    out["sequences"] = sequences(args)
    return out


def sequences(args: argparse.Namespace) -> list[dict]:
    """The step's sequence (module docstring) with and without the release, medians in ms."""
    import hybridembed as he
    from hybridembed.kernels import cpu_fused

    c = he.EmbeddingCollection([he.TableConfig("t", args.table_rows, 64)])
    opt = he.wrap_optimizer(torch.optim.SGD(c.parameters(), lr=0.01), c, sparse=he.optim.RowWiseAdagrad(lr=0.01))
    storage, hp = c.storages[0], opt.param_groups[-1]  # (the sparse group: its hyper-parameters)
    x, y = torch.randn(1 << 21), torch.randn(256, 256)
    shipped, runs = cpu_fused.release_openmp_workers, []
    try:
        for u in args.rows:
            ids = torch.randperm(args.table_rows)[:u].sort().values
            g = torch.randn(u, 64)
            times: dict[str, list[float]] = {"released": [], "spinning": []}
            for _ in range(args.rounds):
                for mode in times:
                    cpu_fused.release_openmp_workers = shipped if mode == "released" else (lambda: False)
                    t = time.perf_counter()
                    x.mul_(1.0001)  # (a parallel op: its workers idle after it)
                    cpu_fused.apply_rows(storage, ids, g, hp, None)
                    for _ in range(5):
                        y @ y
                    x.add_(1e-6)
                    times[mode].append(time.perf_counter() - t)
            run = {"rows": u, **{f"{k}_ms": 1e3 * statistics.median(v) for k, v in times.items()}}
            print(f"U {u:>7,}: the sequence {run['released_ms']:.2f} ms released, {run['spinning_ms']:.2f} ms not")
            runs.append(run)
    finally:
        cpu_fused.release_openmp_workers = shipped
    return runs


if __name__ == "__main__":
    main()
