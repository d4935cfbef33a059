"""A training step of a DLRM-style model, eager against ``torch.compile(fullgraph=True)``, in one run.

    python benchmarks/bench_compile.py                          # 26 x 100k x 16, batch 2048, defaults
    python benchmarks/bench_compile.py --tables 4 --rows 1000 --batch 256 --steps 3   # smoke

The model: 26 pooled features (one EmbeddingCollection, power-law ids, one id per sample), 13
dense features through a bottom MLP, the concatenation through a top MLP, BCE loss, Adagrad
through he.wrap_optimizer. Both models start equal; steps are interleaved; medians after
warm-up (the compiled model's first call compiles, excluded). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import copy
import json
import time

import torch
from torch import nn

import hybridembed as he
from hybridembed.bench import powerlaw_ids, time_interleaved


class DLRMish(nn.Module):
    def __init__(self, tables: int, rows: int, dim: int):
        super().__init__()
        names = [f"t{i}" for i in range(tables)]
        self.names = names
        self.ec = he.EmbeddingCollection([he.TableConfig(n, rows, dim) for n in names])
        self.bottom = nn.Sequential(nn.Linear(13, 64), nn.ReLU(), nn.Linear(64, dim), nn.ReLU())
        self.top = nn.Sequential(nn.Linear(dim * (tables + 1), 128), nn.ReLU(), nn.Linear(128, 1))

    def forward(self, dense: torch.Tensor, sparse: dict[str, torch.Tensor]) -> torch.Tensor:
        out = self.ec(sparse)
        x = torch.cat([self.bottom(dense), *(out[n] for n in self.names)], 1)
        return self.top(x).squeeze(1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tables", type=int, default=26)
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    torch.manual_seed(0)
    eager = DLRMish(args.tables, args.rows, args.dim)
    twin = copy.deepcopy(eager)
    compiled = torch.compile(twin, fullgraph=True)
    opts = {
        "eager": he.wrap_optimizer(torch.optim.Adagrad(eager.parameters(), lr=0.01), eager),
        "compiled": he.wrap_optimizer(torch.optim.Adagrad(twin.parameters(), lr=0.01), twin),
    }
    g = torch.Generator().manual_seed(1)
    batches = [
        (
            torch.randn(args.batch, 13, generator=g),
            {n: powerlaw_ids(args.batch, args.rows, generator=g) for n in eager.names},
            torch.randint(0, 2, (args.batch,), generator=g).float(),
        )
        for _ in range(4)
    ]
    loss_fn = nn.BCEWithLogitsLoss()
    counter = {"eager": 0, "compiled": 0}

    def step(name: str, model: nn.Module) -> None:
        dense, sparse, y = batches[counter[name] % len(batches)]
        counter[name] += 1
        opt = opts[name]
        opt.zero_grad()
        loss_fn(model(dense, sparse), y).backward()
        opt.step()

    t0 = time.perf_counter()
    step("compiled", compiled)  # (the first call compiles: excluded)
    compile_s = time.perf_counter() - t0
    timings = time_interleaved(
        {"eager": lambda: step("eager", eager), "compiled": lambda: step("compiled", compiled)},
        steps=args.steps,
        warmup=2,
    )
    e, c = timings["eager"].median, timings["compiled"].median
    print(
        json.dumps(
            {
                "tables": args.tables,
                "rows": args.rows,
                "dim": args.dim,
                "batch": args.batch,
                "threads": torch.get_num_threads(),
                "eager_ms": round(e, 2),
                "compiled_ms": round(c, 2),
                "compiled_over_eager": round(c / e, 3),
                "first_compile_s": round(compile_s, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
