"""Issue 14's table: the embedding training step on a GPU, hybridembed's eager and Triton kernels
against one ``nn.EmbeddingBag(sparse=True)`` per table + ``torch.optim``, and the byte floor.

    python benchmarks/bench_gpu.py --device cuda --json gpu.json          # on an H100: the full table
    python benchmarks/bench_gpu.py --scale 0.001 --rounds 3                # CPU smoke (eager only)
    TRITON_INTERPRET=1 python benchmarks/bench_gpu.py --scale 0.0005 --rounds 2   # CPU, Triton interpreted

Workloads (``--scale s`` multiplies rows and batch, for a CPU smoke run): T = 26 tables of
R = 1,000,000 rows x D = 128 float32, batch B = 16,384, power-law ids (alpha 1.05):

- ``one-hot/sgd``, ``one-hot/adagrad``: one id per bag;
- ``multi-hot/sgd``, ``multi-hot/adagrad``: a uniform 0..40 ids per bag (mean 20);
- ``dynamic/one-hot/sgd``: the same as dynamic tables (``he.Dynamic(capacity=R)``, hash index).

Contenders, measured in one run with interleaved rounds (medians over ``--rounds`` after
``--warmup``; on CUDA every call is timed between two ``torch.cuda.synchronize``):

- ``eager``: ``he.EmbeddingCollection(kernels="eager")`` + ``he.wrap_optimizer``;
- ``triton``: the same collection with ``kernels="triton"`` (its storages switched between the
  two backends call by call, so the rows are held once), when Triton kernels can run: on
  CUDA, or on the CPU under ``TRITON_INTERPRET=1`` (set before the start: Triton reads it
  when a kernel is defined);
- ``baseline``: one ``nn.EmbeddingBag(mode="sum", sparse=True)`` per table + ``torch.optim.SGD``
  / ``Adagrad`` (sparse gradients). Ratios are baseline ms / contender ms (above 1: faster).

A step is forward + backward of a fixed upstream gradient (B, D) per table + the optimizer
update. The forward alone (``torch.no_grad``) is timed too.

Byte floor (``hybridembed.bench.floor``: bytes that must cross the memory bus at least once,
repeated ids counted once; the optimizer's state S = 0 elements a weight for SGD, 1 for Adagrad):
the step's bytes over a measured copy bandwidth: ``dst.copy_(src)`` of a large buffer
(``--copy-mib``), (bytes read + bytes written) / time, median of the rounds. The forward's
fraction is its bytes / its time over that bandwidth (1 = at the copy's speed).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import warnings
from collections.abc import Callable

import torch
from torch import nn

import hybridembed as he
from hybridembed.bench import powerlaw_ids, time_interleaved
from hybridembed.bench.floor import copy_bandwidth, step_bytes
from hybridembed.kernels.backend import interpreting, triton_available

TABLES, ROWS, DIM, BATCH = 26, 1_000_000, 128, 16_384
MULTI_MAX = 40  # multi-hot bags hold 0..40 ids, mean 20
LR = 0.01
WORKLOADS = (  # (name, hotness, optimizer, dynamic)
    ("one-hot/sgd", "one", "sgd", False),
    ("one-hot/adagrad", "one", "adagrad", False),
    ("multi-hot/sgd", "multi", "sgd", False),
    ("multi-hot/adagrad", "multi", "adagrad", False),
    ("dynamic/one-hot/sgd", "one", "sgd", True),
)
TORCH_OPT = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad}
STATE = {"sgd": 0, "adagrad": 1}  # optimizer state elements per weight


def triton_runs(device: torch.device) -> str | None:
    """None when Triton kernels can run on ``device``; else why not."""
    if not triton_available():
        return "Triton is not installed (pip install 'hybridembed[gpu]')"
    if device.type == "cuda" or (device.type == "cpu" and interpreting()):
        return None
    return "Triton kernels need CUDA (or TRITON_INTERPRET=1 on the CPU)"


def make_batch(
    names: list[str], rows: int, batch: int, hotness: str, gen: torch.Generator, device: torch.device
) -> dict[str, he.Jagged]:
    """Power-law ids per table: one per bag, or a uniform 0..40 per bag (mean 20). Made on the CPU."""
    out = {}
    for n in names:
        if hotness == "one":
            lengths = torch.ones(batch, dtype=torch.int64)  # (B,)
        else:
            lengths = torch.randint(0, MULTI_MAX + 1, (batch,), generator=gen)  # (B,) mean 20
        ids = powerlaw_ids(int(lengths.sum()), rows, generator=gen)  # (N_t,)
        out[n] = he.Jagged.from_lengths(ids, lengths).to(device)
    return out


def byte_model(batch: dict[str, he.Jagged], b: int, dim: int, optimizer: str, dynamic: bool) -> dict[str, int]:
    """The floor's bytes (see the module docstring) of one step on ``batch``."""
    return step_bytes(batch, b, dim, STATE[optimizer] * 4 * dim, dynamic)


def contenders(
    names: list[str],
    rows: int,
    dim: int,
    optimizer: str,
    dynamic: bool,
    batch: dict[str, he.Jagged],
    grads: list[torch.Tensor],
    device: torch.device,
    with_triton: bool,
) -> tuple[dict[str, Callable[[], None]], dict[str, Callable[[], None]]]:
    """(step functions, forward-only functions) of eager, triton (if ``with_triton``) and baseline."""
    dyn = he.Dynamic(capacity=rows) if dynamic else None
    ec = he.EmbeddingCollection(
        [he.TableConfig(n, None if dynamic else rows, dim, dynamic=dyn) for n in names], device=device, kernels="eager"
    )
    opt = he.wrap_optimizer(TORCH_OPT[optimizer](ec.parameters(), lr=LR), ec)
    bags = nn.ModuleList(
        nn.EmbeddingBag(rows, dim, mode="sum", sparse=True, include_last_offset=True, device=device) for _ in names
    )
    if not dynamic:  # the same initial rows (dynamic rows are made on first sight)
        with torch.no_grad():
            for n, bag in zip(names, bags):
                bag.weight.copy_(ec.weight(n))
    topt = TORCH_OPT[optimizer](bags.parameters(), lr=LR)

    def backend(kernels: str) -> None:
        for st in ec.storages:
            st.kernels = kernels

    def hybrid(kernels: str) -> Callable[[], None]:
        def step() -> None:
            backend(kernels)
            out = ec(batch)  # {table: (B, D)}
            torch.autograd.backward([out[n] for n in names], grads)
            opt.step()
            opt.zero_grad()

        return step

    def hybrid_forward(kernels: str) -> Callable[[], None]:
        def forward() -> None:
            backend(kernels)
            with torch.no_grad():
                ec(batch)

        return forward

    def baseline() -> None:
        out = [bag(batch[n].values, batch[n].offsets) for n, bag in zip(names, bags)]  # T x (B, D)
        torch.autograd.backward(out, grads)
        topt.step()
        topt.zero_grad()

    def baseline_forward() -> None:
        with torch.no_grad():
            for n, bag in zip(names, bags):
                bag(batch[n].values, batch[n].offsets)

    kinds = ["eager", "triton"] if with_triton else ["eager"]
    steps = {k: hybrid(k) for k in kinds} | {"baseline": baseline}
    forwards = {k: hybrid_forward(k) for k in kinds} | {"baseline": baseline_forward}
    return steps, forwards


def run_workload(
    spec: tuple[str, str, str, bool], args: argparse.Namespace, device: torch.device, bandwidth: float, triton_ok: bool
) -> dict:
    name, hotness, optimizer, dynamic = spec
    rows, b = max(1, round(ROWS * args.scale)), max(1, round(BATCH * args.scale))
    names = [f"t{i}" for i in range(TABLES)]
    gen = torch.Generator().manual_seed(args.seed)
    batch = make_batch(names, rows, b, hotness, gen, device)
    grads = [torch.randn(b, DIM, generator=gen).to(device) for _ in names]  # fixed upstream gradient (B, D)
    steps, forwards = contenders(names, rows, DIM, optimizer, dynamic, batch, grads, device, triton_ok)
    with warnings.catch_warnings():  # torch.optim on sparse gradients
        warnings.filterwarnings("ignore", message="Sparse invariant checks")
        t_step = time_interleaved(steps, steps=args.rounds, warmup=args.warmup, device=device)
        t_fwd = time_interleaved(forwards, steps=args.rounds, warmup=1, device=device)
    bytes_ = byte_model(batch, b, DIM, optimizer, dynamic)
    floor_ms = bytes_["step"] / bandwidth * 1e3
    base = t_step["baseline"].median
    out = {
        "workload": name,
        "tables": TABLES,
        "rows": rows,
        "dim": DIM,
        "batch": b,
        "optimizer": optimizer,
        "dynamic": dynamic,
        "bytes": bytes_,
        "floor_ms": floor_ms,
        "contenders": {},
    }
    for k in steps:
        step, fwd = t_step[k].median, t_fwd[k].median
        out["contenders"][k] = {
            **t_step[k].record(b),
            "forward_ms": fwd,
            "vs_baseline": base / step,
            "fraction_of_floor": floor_ms / step,
            "forward_fraction_of_copy_bandwidth": bytes_["forward"] / (fwd / 1e3) / bandwidth,
        }
    return out


def _print(run: dict) -> None:
    head = f"{run['workload']}: {run['tables']} x {run['rows']:,} x {run['dim']}, batch {run['batch']:,}, "
    head += f"{run['bytes']['ids']:,} ids ({run['bytes']['distinct_rows']:,} distinct); floor {run['floor_ms']:.2f} ms"
    print(head)
    for k, c in run["contenders"].items():
        print(
            f"  {k:<9} step {c['median_ms']:9.2f} ms ±{c['spread_ms']:.2f}  vs baseline {c['vs_baseline']:5.2f}x  "
            f"of floor {c['fraction_of_floor']:5.2f}  forward {c['forward_ms']:8.2f} ms "
            f"({c['forward_fraction_of_copy_bandwidth']:.2f} of copy bandwidth)",
            flush=True,
        )


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu, cuda or cuda:N")
    p.add_argument(
        "--scale", type=float, default=1.0, help="multiplies rows and batch (default 1: 1M rows, batch 16,384)"
    )
    p.add_argument("--rounds", type=int, default=20, help="timed interleaved rounds (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed rounds first (default 3)")
    p.add_argument("--workloads", nargs="+", choices=[w[0] for w in WORKLOADS], help="default: all")
    p.add_argument("--copy-mib", type=int, help="buffer of the copy-bandwidth probe (default 1024 on cuda, 256 on cpu)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    if not 0 < args.scale <= 1 or args.rounds < 1 or args.warmup < 0:
        p.error("--scale must be in (0, 1], --rounds >= 1 and --warmup >= 0")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        p.error(f"--device {args.device}: expected cpu, cuda or cuda:N")
    if device.type not in ("cpu", "cuda"):
        p.error(f"--device {args.device}: expected cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {args.device}: CUDA is not available; use --device cpu (with --scale 0.001)")
    if device.type == "cuda" and device.index is not None:  # kernels launch on the current device
        torch.cuda.set_device(device)
    why_not = triton_runs(device)
    bandwidth = copy_bandwidth(device, args.copy_mib or (1024 if device.type == "cuda" else 256), args.rounds)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    print(
        f"bench_gpu on {device}{f' ({gpu})' if gpu else ''}, torch {torch.__version__}, scale {args.scale:g}; "
        f"copy bandwidth {bandwidth / 1e9:.1f} GB/s (read + written); triton: {why_not or 'runs'}",
        flush=True,
    )
    results = {
        "command": "python benchmarks/bench_gpu.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "device": str(device),
        "gpu": gpu,
        "torch": torch.__version__,
        "triton_interpret": interpreting(),
        "triton_skipped": why_not,
        "settings": {k: v for k, v in vars(args).items() if k != "json"},
        "copy_bandwidth_bytes_per_s": bandwidth,
        "runs": [],
    }
    for spec in WORKLOADS:
        if args.workloads and spec[0] not in args.workloads:
            continue
        run = run_workload(spec, args, device, bandwidth, why_not is None)
        _print(run)
        results["runs"].append(run)
        gc.collect()  # the workload's tables go before the next one's are made
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
