"""``hybridembed bench``: the synthetic models, timed against PyTorch, TorchRec and a measured floor.

    hybridembed bench --model tiny --quick                 # well under 2 minutes on 2 cores
    hybridembed bench --model criteo-dlrm-like --quick
    hybridembed bench --model embedding-step               # 26 x 200k x 64, batch 8192, one- and multi-hot
    hybridembed bench --memory-only                        # full-size memory of every model, no tensors
    hybridembed bench --model tiny --full-size --device cuda --kernels triton   # NVIDIA's tiny, 4.2 GiB, batch 65,536

Contenders, built from the same initial weights and fed the same batch in one process:
``hybridembed`` (EmbeddingCollection + ``he.wrap_optimizer``), ``per_table`` (one
``nn.EmbeddingBag(sparse=True)`` per table + ``torch.optim``), ``torchrec``
(``FusedEmbeddingBagCollection``: FBGEMM's CPU kernel, optimizer fused into backward), when it
imports. The ``floor`` is measured, not modelled: one ``index_select`` + ``index_add_`` over the
sorted distinct rows the batch touches, plus (for models with an MLP) the dense part alone on
fixed embeddings. A step is forward + backward + optimizer update (dense and embedding
Adagrad by default; a BCE-with-logits loss, or a fixed upstream gradient for embedding-only
workloads). Calls are interleaved round-robin, warm-up steps excluded, medians reported.
A ratio is anchor ms / contender ms: above 1 is faster than the anchor; against the floor
it is the fraction of the machine's limit reached.

``--device cuda`` builds every contender, the batch and the floor on the GPU (TorchRec's
CPU kernel is skipped there) and times each call between two ``torch.cuda.synchronize``;
peak step memory is then the CUDA allocator's. ``--kernels`` is hybridembed's kernel backend.
``--full-size`` runs a model at its published size: no row cap, batch 65,536.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import logging
import math
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ..errors import ConfigError
from ..kernels.backend import KERNELS, check_kernels, describe
from ..utils import OneLineParser, get_logger
from . import models as M
from .system import cpu_busy, machine, meminfo, peak_rss, progress
from .timing import Timing, add_allocator_option, apply_allocator_option, time_interleaved

__all__ = ["main", "run", "build_parser"]

logger = get_logger(__name__)

ANCHORS = ("per_table", "torchrec", "floor")
SYNTHETIC_MAX_ROWS = 100_000  # NVIDIA's synthetic models page: "cap each table at 100,000 rows"
QUICK_MAX_ROWS = 20_000  # still larger than L2 for every table of width >= 16
QUICK_STEPS, QUICK_WARMUP = 10, 2
FULL_SIZE_BATCH = 65_536  # the batch of NVIDIA's published runs (its synthetic models page)
MEMORY_FRACTION = 0.7  # refuse a run whose tables would need more of MemAvailable than this


class UsageError(Exception):
    """A flag combination that cannot run; reported as one line, exit code 2."""


def _positive(kind: type) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}, got {text!r}") from None
        if not v > 0 or (kind is float and not math.isfinite(v)):
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}, got {text!r}")
        return v

    return parse


def _non_negative_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        v = -1
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected an int >= 0, got {text!r}")
    return v


def _anchor_list(text: str) -> list[str]:
    names = [a.strip().replace("-", "_") for a in text.replace(" ", ",").split(",") if a.strip()]
    bad = [a for a in names if a not in ANCHORS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown anchor {bad[0]!r}; allowed: {', '.join(ANCHORS)} (comma-separated)")
    return list(dict.fromkeys(names))


def build_parser(prog: str = "hybridembed bench") -> argparse.ArgumentParser:
    p = OneLineParser(
        prog=prog,
        description="Time a training step of NVIDIA's synthetic recommendation models (scaled down) with "
        "hybridembed against one nn.EmbeddingBag per table, TorchRec and a measured floor.",
        epilog="Ratios are anchor ms / contender ms (above 1: faster than the anchor; vs floor: the fraction "
        "of the machine's limit reached). See docs/benchmarks.md.",
    )
    p.add_argument(
        "--model",
        choices=[*M.WORKLOADS, M.E2E_MODEL],
        help="workload: a synthetic model (tables, widths, hotness and sharing of config_v3.py), "
        "criteo-dlrm-like, or embedding-step (26 x 200k x 64, batch 8192, one-hot then multi-hot mean 10, "
        "embedding-only), or train-e2e (hybridembed train's DLRM vs the same DLRM in plain PyTorch, end to "
        "end on a generated Criteo-format file). Default tiny; with --memory-only, every model",
    )
    p.add_argument(
        "--rows",
        type=_positive(int),
        metavar="N",
        help="train-e2e only: rows of the generated Criteo-format file (default 100,000; --quick 20,000)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"a short run: --max-rows {QUICK_MAX_ROWS:,}, a 4x smaller batch budget, {QUICK_STEPS} steps, "
        f"{QUICK_WARMUP} warm-up steps (flags given explicitly win)",
    )
    p.add_argument(
        "--batch",
        type=_positive(int),
        metavar="N",
        help="samples per step; default: the largest power of two <= 8192 under 2**20 ids and 2**35 MLP "
        "multiply-adds per step (tiny 8192, small 2048, medium 512, large 128), the fixed 8192 of "
        "embedding-step; --quick: budgets 4x smaller (tiny 2048)",
    )
    p.add_argument(
        "--max-rows",
        type=_positive(int),
        metavar="N",
        help=f"cap every table at N rows (default {SYNTHETIC_MAX_ROWS:,} for tiny..colossal; "
        "criteo-dlrm-like and embedding-step run at full size). Full sizes are only ever accounted, "
        "never allocated",
    )
    p.add_argument(
        "--full-size",
        action="store_true",
        help=f"run the model at its published size: no --max-rows cap and --batch {FULL_SIZE_BATCH:,} (unless "
        "given; embedding-step keeps its 8192). tiny: 55 tables, 4.2 GiB of rows (8.4 with Adagrad) per contender: "
        "meant for a GPU (--device cuda)",
    )
    p.add_argument(
        "--device",
        default="cpu",
        metavar="DEV",
        help="where the contenders, the batch and the floor live: cpu, cuda or cuda:N (default cpu; TorchRec's CPU "
        "kernel is skipped on cuda)",
    )
    p.add_argument(
        "--kernels",
        choices=list(KERNELS),
        default="auto",
        help="hybridembed's kernel backend: eager (PyTorch ops), triton (Triton kernels on CUDA; needs the gpu "
        "extra), auto (HYBRIDEMBED_KERNELS, else triton on CUDA when installed, eager elsewhere) (default auto)",
    )
    p.add_argument(
        "--steps",
        type=_positive(int),
        metavar="N",
        help=f"timed steps per contender (default 20; --quick {QUICK_STEPS})",
    )
    p.add_argument(
        "--warmup",
        type=_non_negative_int,
        metavar="N",
        help=f"untimed steps per contender first (default 3; --quick {QUICK_WARMUP})",
    )
    p.add_argument("--json", metavar="PATH", help="results file (default bench_out/bench-MODEL.json)")
    p.add_argument("--png", metavar="PATH", help="ratio chart (default bench_out/bench-MODEL.png; needs matplotlib)")
    p.add_argument(
        "--anchors",
        type=_anchor_list,
        default=list(ANCHORS),
        metavar="LIST",
        help=f"comma-separated anchors to run and compare with, from {','.join(ANCHORS)} (default all; "
        "torchrec is skipped with a note when it does not import)",
    )
    add_allocator_option(p)
    p.add_argument(
        "--memory-only",
        action="store_true",
        help="print the full-size memory accounting (rows x width x 4 bytes plus optimizer state) of "
        "--model or of every model, allocating no tensors, and exit",
    )
    p.add_argument(
        "--optimizer",
        choices=list(M.OPTIMIZERS),
        default="adagrad",
        help="optimizer of the dense part and the embeddings (default adagrad, as the published runs)",
    )
    p.add_argument("--lr", type=_positive(float), default=0.01, help="learning rate (default 0.01)")
    p.add_argument(
        "--threads",
        type=_positive(int),
        metavar="N",
        help=f"torch intra-op threads for the run (default torch's: {torch.get_num_threads()} here)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the synthetic data (default 0)")
    return p


# --- memory ------------------------------------------------------------------------------------
def _gib(n: float) -> str:
    g = n / 2**30
    return f"{g:,.1f}" if g >= 0.95 else f"{g:.2f}"


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Silences C-level stderr (the profiler's start/stop lines) for the block."""
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def step_peak_bytes(fn: Callable[[], object], device: torch.device | str | None = None) -> int | None:
    """Peak bytes allocated above the starting point during one call, from the profiler's
    memory events (allocator-independent: counts what is allocated, not what glibc keeps);
    on CUDA, from the CUDA caching allocator's peak of allocated bytes."""
    dev = torch.device(device if device is not None else "cpu")
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        start = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        fn()
        torch.cuda.synchronize(dev)
        return max(torch.cuda.max_memory_allocated(dev) - start, 0)
    try:
        from torch.profiler import ProfilerActivity, profile

        with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fn()
        events = sorted(
            (e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
        )
    except Exception as e:  # the profiler's internals moved: report no figure rather than fail
        logger.warning("peak step memory not measured: %s", e)
        return None
    cur = peak = 0
    for _, n in events:
        cur += n
        peak = max(peak, cur)
    return peak


# --- one run --------------------------------------------------------------------------------
def _floor_step(ref: M.SyntheticModel, spec: M.ModelSpec, batch: M.Batch) -> tuple[Callable[[], None], int]:
    """Gather and scatter each distinct touched row once, per width: the least row traffic a step
    can do. Its own copy of the rows (so no contender's tables change); returns (step, distinct rows)."""
    tables, inputs = M.expand(spec)
    groups: list[tuple[torch.Tensor, torch.Tensor]] = []
    distinct = 0
    for width in sorted({t.width for t in tables}):
        ts = [t for t in tables if t.width == width]
        start, base = {}, 0
        for t in ts:
            start[t.name], base = base, base + t.rows
        w = torch.empty(base, width, device=batch.dense.device)  # (R, D)
        for t in ts:
            w[start[t.name] : start[t.name] + t.rows].copy_(ref.embeddings.weight(t.name))
        ids = torch.cat([batch.sparse[i.name].values + start[i.table] for i in inputs if i.width == width])
        uniq = torch.unique(ids)  # (U,) sorted distinct
        groups.append((w, uniq))
        distinct += uniq.numel()

    @torch.no_grad()
    def step() -> None:
        for w, u in groups:
            w.index_add_(0, u, w.index_select(0, u), alpha=-1e-3)  # gather (U, D), scatter (U, D)

    return step, distinct


def _dense_step(ref: M.SyntheticModel, x: Any, batch: M.Batch, opt_name: str, lr: float) -> Callable[[], None]:
    """The dense part alone (concat, pooling, MLP, loss, optimizer) on fixed embeddings,
    including the gradient it sends back to them (which every contender computes)."""
    tower = copy.deepcopy(ref.tower)
    opt = M.torch_optimizer(tower.parameters(), opt_name, lr)
    with torch.no_grad():
        parts = [p.detach().clone().requires_grad_() for p in ref.embeddings(x)]  # F x (B, D)

    def step() -> None:
        loss = F.binary_cross_entropy_with_logits(tower(parts, batch.dense), batch.labels)
        loss.backward()
        opt.step()
        opt.zero_grad()
        for p in parts:
            p.grad = None

    return step


def _train_step(
    model: M.SyntheticModel, opt: torch.optim.Optimizer | None, x: Any, batch: M.Batch, grads: list[torch.Tensor]
) -> Callable[[], None]:
    """Forward + backward + update. Embedding-only models backpropagate ``grads`` (fixed, the
    same for all): one (B, D) per input, or their (B, W) concatenation for a concatenated output."""
    grad_cat = torch.cat(grads, 1) if len(grads) > 1 else grads[0]  # (B, W)

    def step() -> None:
        if model.tower is not None:
            loss = F.binary_cross_entropy_with_logits(model(x, batch.dense), batch.labels)
            loss.backward()
        else:
            parts = model(x)  # F x (B, D), or [(B, W)] when the backend concatenates
            torch.autograd.backward(parts, grads if len(parts) == len(grads) else [grad_cat])
        if opt is not None:
            opt.step()
            opt.zero_grad()

    return step


def _output(model: M.SyntheticModel, x: Any, batch: M.Batch) -> torch.Tensor:
    with torch.no_grad():
        out = model(x, batch.dense)
    return out if isinstance(out, torch.Tensor) else torch.cat(out, 1)


def _ratios(times: dict[str, float], contenders: Sequence[str], anchors: Sequence[str]) -> dict[str, dict[str, float]]:
    return {c: {a: times[a] / times[c] for a in anchors if a != c and a in times} for c in contenders if c in times}


def _bench_model(name: str, args: argparse.Namespace, anchors: list[str], notes: dict[str, str]) -> list[dict]:
    specs = [M.scale(s, args.max_rows) for s in M.workloads(name)]
    first = specs[0]
    device = args.device
    backends = ["hybridembed"] + [b for b in ("per_table", "torchrec") if b in anchors and b not in notes]
    tables, _ = M.expand(first)
    params = sum(t.rows * t.width for t in tables)
    models: dict[str, tuple[M.SyntheticModel, torch.optim.Optimizer | None]] = {}
    build_s: dict[str, float] = {}
    for b in backends:
        progress(f"{name}: building {b} ({len(tables)} tables, {params / 1e6:.1f}M parameters)")
        t0 = time.perf_counter()
        ref = models["hybridembed"][0] if b != "hybridembed" else None
        models[b] = M.build_model(
            first, b, args.optimizer, args.lr, seed=args.seed, like=ref, device=device, kernels=args.kernels
        )
        build_s[b] = time.perf_counter() - t0
    runs = []
    for k, spec in enumerate(specs):
        gen = torch.Generator().manual_seed(args.seed + 1 + k)
        batch = M.make_batch(spec, _batch_size(spec, args), gen).to(device)  # (made on the CPU: the same ids anywhere)
        b = batch.dense.shape[0]
        xs = {n: m.embeddings.native_input(batch.sparse) for n, (m, _) in models.items()}
        _, inputs = M.expand(spec)
        grads = [torch.randn(b, i.width, generator=gen).to(device) for i in inputs]  # fixed upstream gradient
        ref_out = _output(models["hybridembed"][0], xs["hybridembed"], batch)
        max_diff = {n: float((_output(m, xs[n], batch) - ref_out).abs().max()) for n, (m, _) in models.items()}
        fns = {n: _train_step(m, o, xs[n], batch, grads) for n, (m, o) in models.items()}
        distinct = None
        if "floor" in anchors:
            fns["floor_rows"], distinct = _floor_step(models["hybridembed"][0], spec, batch)
            if spec.mlp is not None:
                fns["floor_dense"] = _dense_step(
                    models["hybridembed"][0], xs["hybridembed"], batch, args.optimizer, args.lr
                )
        progress(f"{spec.name}: timing {', '.join(fns)}: {args.warmup} warm-up + {args.steps} steps, interleaved")
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Sparse invariant checks")
            timing = time_interleaved(fns, steps=args.steps, warmup=args.warmup, device=device)
            progress(f"{spec.name}: measuring peak step memory")
            peaks = {n: step_peak_bytes(fns[n], device) for n in models}
        # every contender has now taken the same steps on the same batch: same weights, same outputs
        ref_out = _output(models["hybridembed"][0], xs["hybridembed"], batch)
        diff_after = {n: float((_output(m, xs[n], batch) - ref_out).abs().max()) for n, (m, _) in models.items()}
        runs.append(
            _record(spec, batch, models, timing, peaks, build_s, (max_diff, diff_after), distinct, anchors, args)
        )
    return runs


def _batch_size(spec: M.ModelSpec, args: argparse.Namespace) -> int:
    """--batch; else the workload's own; else 65,536 with --full-size; else the scaled default."""
    if args.batch:
        return args.batch
    if args.full_size and spec.batch is None:
        return FULL_SIZE_BATCH
    return M.default_batch(spec, args.quick)


def _record(
    spec: M.ModelSpec,
    batch: M.Batch,
    models: dict[str, tuple[M.SyntheticModel, torch.optim.Optimizer | None]],
    timing: dict[str, Timing],
    peaks: dict[str, int | None],
    build_s: dict[str, float],
    diffs: tuple[dict[str, float], dict[str, float]],
    distinct: int | None,
    anchors: list[str],
    args: argparse.Namespace,
) -> dict[str, Any]:
    b = batch.dense.shape[0]
    contenders: dict[str, dict[str, Any]] = {}
    for n, (m, o) in models.items():
        t = timing[n]
        state = M.state_bytes(m, o)
        contenders[n] = {
            **t.record(b),
            "state_bytes": state,
            "step_peak_bytes": peaks[n],
            "peak_bytes": state + (peaks[n] or 0),
            "build_s": build_s[n],
            "max_abs_diff_vs_hybridembed": {"before": diffs[0][n], "after": diffs[1][n]},
        }
    floor = None
    times = {n: c["median_ms"] for n, c in contenders.items()}
    if "floor_rows" in timing:
        rows, dense = timing["floor_rows"], timing.get("floor_dense")
        floor = {
            "median_ms": rows.median + (dense.median if dense else 0.0),
            "spread_ms": rows.spread + (dense.spread if dense else 0.0),
            "rows_ms": rows.median,
            "dense_ms": dense.median if dense else None,
            "distinct_rows": distinct,
        }
        times["floor"] = floor["median_ms"]
    tables, inputs = M.expand(spec)
    full = M.memory(next(s for s in M.workloads(args.model) if s.name == spec.name), args.optimizer)
    scaled = M.memory(spec, args.optimizer)
    return {
        "workload": spec.name,
        "batch": b,
        "max_rows": args.max_rows,
        "device": str(args.device),
        "tables": len(tables),
        "inputs": len(inputs),
        "ids_per_sample": spec.ids_per_sample,
        "ids_per_step": batch.num_ids,
        "distinct_rows_per_step": distinct,
        "steps_taken": args.warmup + args.steps + 1,  # warm-up, timed, and the memory probe
        "full_size": full.as_dict(),
        "scaled": scaled.as_dict(),
        "contenders": contenders,
        "floor": floor,
        "ratios": _ratios(times, list(contenders), [a for a in anchors if a in times]),
    }


def _free_bytes(device: str) -> tuple[int | None, str]:
    """(bytes free for the tables, where): the GPU's free memory on CUDA, else MemAvailable."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.mem_get_info(dev)[0], f"free on {device}"
    return meminfo("MemAvailable"), "available"


def _check_fits(
    full: M.ModelSpec, max_rows: int | None, contenders: int, floor: bool, optimizer: str, device: str = "cpu"
) -> None:
    """Refuses, before allocating, a run whose tables would not fit in memory (the GPU's on CUDA)."""
    available, where = _free_bytes(device)
    if available is None:
        return

    def need(cap: int | None) -> int:
        m = M.memory(M.scale(full, cap), optimizer)
        return contenders * m.total_bytes + (m.weight_bytes if floor else 0)

    if need(max_rows) <= MEMORY_FRACTION * available:
        return
    cap = max_rows or max(e.rows for e in full.embeddings)
    while cap > 1000 and need(cap) > MEMORY_FRACTION * available:
        cap //= 2
    size = "at full size" if max_rows is None else f"at --max-rows {max_rows}"
    raise UsageError(
        f"{full.name} {size} needs ~{_gib(need(max_rows))} GiB of tables for {contenders} "
        f"contender(s), above {MEMORY_FRACTION:.0%} of the {_gib(available)} GiB {where}; "
        f"use --max-rows {cap}{' (without --full-size)' if max_rows is None else ''} or fewer --anchors"
    )


# --- output -----------------------------------------------------------------------------------
def _print_run(run: dict[str, Any], anchors: list[str]) -> None:
    full, scaled = run["full_size"], run["scaled"]
    cap = f"rows <= {run['max_rows']:,}" if run["max_rows"] else "full-size rows"
    print(
        f"\n{run['workload']}: {run['tables']} tables, {run['inputs']} inputs, {cap}, batch {run['batch']:,}; "
        f"{run['ids_per_sample']:g} ids/sample, {run['ids_per_step']:,} ids"
        + (f" and {run['distinct_rows_per_step']:,} distinct rows" if run["distinct_rows_per_step"] else "")
        + " per step"
    )
    opt = full["optimizer"].capitalize()
    print(
        f"  full size: rows {_gib(full['weight_bytes'])} GiB + {opt} {_gib(full['optimizer_bytes'])} GiB "
        f"= {_gib(full['total_bytes'])} GiB; this run: {_gib(scaled['total_bytes'])} GiB per contender"
    )
    shown = [a for a in anchors if any(a in r for r in run["ratios"].values())]
    head = f"  {'contender':<12} {'median ms':>10} {'spread':>8} {'samples/s':>11}"
    head += "".join(f" {'vs ' + a:>13}" for a in shown) + f" {'peak MiB':>9}"
    print(head)
    for n, c in run["contenders"].items():
        line = (
            f"  {n:<12} {c['median_ms']:>10.1f} {'±' + format(c['spread_ms'], '.1f'):>8} {c['samples_per_s']:>11,.0f}"
        )
        for a in shown:
            r = run["ratios"][n].get(a)
            line += f" {'-' if r is None else (format(r, '.2f') + ('' if a == 'floor' else 'x')):>13}"
        print(line + f" {c['peak_bytes'] / 2**20:>9,.0f}")
    fl = run["floor"]
    if fl:
        parts = f"rows {fl['rows_ms']:.1f} ms" + (f" + dense part {fl['dense_ms']:.1f} ms" if fl["dense_ms"] else "")
        print(f"  {'floor':<12} {fl['median_ms']:>10.1f} {'±' + format(fl['spread_ms'], '.1f'):>8}   ({parts})")
    diffs = {n: c["max_abs_diff_vs_hybridembed"] for n, c in run["contenders"].items() if n != "hybridembed"}
    if diffs:
        worst = max(max(d.values()) for d in diffs.values())
        print(
            f"  outputs vs hybridembed's, same weights and batch: max |diff| {worst:.1e} "
            f"(before, and after the {run['steps_taken']} steps each contender took on this batch)"
        )


def _print_memory(reports: list[M.MemoryReport]) -> None:
    opt = reports[0].optimizer.capitalize()
    print(
        f"{'model':<26} {'tables':>6} {'inputs':>6} {'ids/sample':>10} {'rows':>15} "
        f"{'rows GiB':>10} {opt + ' GiB':>12} {'total GiB':>10} {'MLP params':>11}"
    )
    for m in reports:
        print(
            f"{m.model:<26} {m.tables:>6,} {m.inputs:>6,} {m.ids_per_sample:>10,.0f} {m.rows:>15,} "
            f"{m.weight_bytes / 2**30:>10,.1f} {m.optimizer_bytes / 2**30:>12,.1f} {m.total_bytes / 2**30:>10,.1f} "
            f"{m.dense_parameters:>11,}"
        )
    print("rows x width x 4 bytes per table (float32), plus the optimizer's state; nothing is allocated.")


_COLORS = {"hybridembed": "C0", "per_table": "C1", "torchrec": "C2"}


def write_chart(results: dict[str, Any], path: str) -> bool:
    """Bar chart of every ratio, one panel per anchor. False (with a note) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("chart skipped: matplotlib is not installed (pip install matplotlib, or the 'bench' extra)")
        return False
    runs = results["runs"]
    anchors = [a for a in ANCHORS if any(a in r for run in runs for r in run["ratios"].values())]
    if not anchors:
        print("chart skipped: no anchor ran")
        return False
    fig, axes = plt.subplots(1, len(anchors), figsize=(4.5 * len(anchors), 3.8), squeeze=False)
    for ax, a in zip(axes[0], anchors):
        names = [
            c for c in ("hybridembed", "per_table", "torchrec") if any(a in run["ratios"].get(c, {}) for run in runs)
        ]
        width = 0.8 / max(len(names), 1)
        for k, c in enumerate(names):
            vals = [run["ratios"].get(c, {}).get(a, float("nan")) for run in runs]
            bars = ax.bar([i + k * width for i in range(len(runs))], vals, width, label=c, color=_COLORS[c])
            ax.bar_label(bars, fmt="%.2f", fontsize=7)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks([i + width * (len(names) - 1) / 2 for i in range(len(runs))])
        ax.set_xticklabels([run["workload"] for run in runs], fontsize=8)
        ax.set_title("fraction of the floor" if a == "floor" else f"speed-up over {a}", fontsize=10)
        ax.legend(fontsize=8)
    fig.suptitle(f"hybridembed bench (anchor ms / contender ms), {results['machine']['cores']} cores", fontsize=10)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# --- entry points ------------------------------------------------------------------------------
def _check_device(args: argparse.Namespace) -> None:
    """Refuses a --device that is not there and a --kernels that cannot run (UsageError)."""
    try:
        dev = torch.device(args.device)
    except (RuntimeError, ValueError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise UsageError(f"--device {args.device}: expected cpu, cuda or cuda:N")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = "torch is built without CUDA" if torch.version.cuda is None else "no CUDA device is visible"
            raise UsageError(f"--device {args.device}: CUDA is not available ({why}); use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise UsageError(
                f"--device {args.device}: this machine has {torch.cuda.device_count()} CUDA device(s); give one of "
                "those"
            )
    args.device = str(dev)
    if dev.type == "cuda" and dev.index is not None:  # kernels launch on the current device
        torch.cuda.set_device(dev)
    try:
        check_kernels(args.kernels)
    except ConfigError as e:
        raise UsageError(f"--kernels {args.kernels}: {e}") from None


def _resolve(args: argparse.Namespace) -> None:
    """Fills the defaults that depend on --model, --quick and --full-size; checks --device and --kernels."""
    args.model = args.model or "tiny"
    _check_device(args)
    if args.full_size:
        if args.model == M.E2E_MODEL:
            raise UsageError(f"--full-size applies to the synthetic models, not --model {M.E2E_MODEL} (use --rows)")
        for flag, given in (("--quick", args.quick), ("--max-rows", args.max_rows is not None)):
            if given:
                raise UsageError(f"--full-size runs without a row cap; drop {flag}")
    elif args.max_rows is None:
        if args.quick:
            args.max_rows = QUICK_MAX_ROWS
        elif args.model in M.MODELS and args.model != "criteo-dlrm-like":
            args.max_rows = SYNTHETIC_MAX_ROWS
    if args.steps is None:
        args.steps = QUICK_STEPS if args.quick else 20
    if args.warmup is None:
        args.warmup = QUICK_WARMUP if args.quick else 3
    stem = f"bench_out/bench-{args.model}"
    args.json = args.json or stem + ".json"
    args.png = args.png or stem + ".png"


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Runs the benchmark described by parsed ``args``; prints the table, returns the results.

    ``--threads`` applies for the run only; the previous thread count is restored."""
    before = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        if args.model == M.E2E_MODEL:
            from .e2e import run_e2e

            return run_e2e(args)
        return _run(args)
    finally:
        torch.set_num_threads(before)


def _run(args: argparse.Namespace) -> dict[str, Any]:
    busy = cpu_busy()  # before this process adds to it
    anchors = list(args.anchors)
    notes: dict[str, str] = {}
    if "torchrec" in anchors and torch.device(args.device).type != "cpu":
        notes["torchrec"] = f"FBGEMM's CPU kernel only (as built here), not run on {args.device}; skipped"
    contenders = 1 + sum(b in anchors and b not in notes for b in ("per_table", "torchrec"))
    _check_fits(M.workloads(args.model)[0], args.max_rows, contenders, "floor" in anchors, args.optimizer, args.device)
    if "torchrec" in anchors and "torchrec" not in notes:
        progress("importing torchrec")
        why = M.torchrec_status()
        if why is not None:
            notes["torchrec"] = f"not importable ({why}); skipped"
        else:  # TorchRec calls torch.fx.is_fx_tracing(), which warns once about its own API
            logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
    allocator = apply_allocator_option(args)
    torch.manual_seed(args.seed)
    results: dict[str, Any] = {
        "command": "hybridembed bench " + " ".join(args.argv),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine(args.device),
        "settings": {
            "model": args.model,
            "quick": args.quick,
            "full_size": args.full_size,
            "device": args.device,
            "kernels": args.kernels,
            "kernels_resolved": describe(check_kernels(args.kernels), args.device),
            "batch": args.batch,
            "max_rows": args.max_rows,
            "steps": args.steps,
            "warmup": args.warmup,
            "optimizer": args.optimizer,
            "lr": args.lr,
            "seed": args.seed,
            "anchors": anchors,
            "threads": torch.get_num_threads(),
            "tune_allocator": args.tune_allocator,
            "allocator_tuned": allocator,
        },
        "skipped": notes,
        "cpu_busy_by_others": {"start": busy},
        "runs": [],
    }
    cores = results["machine"]["cores"] or 1
    gpu = results["machine"].get("gpu")
    print(
        f"hybridembed bench --model {args.model}: {cores} cores, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}"
        + ("" if busy is None else f"; other processes use {busy:.0%} of the CPU")
        + f"; on {args.device}"
        + (f" ({gpu})" if gpu else "")
        + f", {describe(check_kernels(args.kernels), args.device)} kernels"
    )
    for name, why in notes.items():
        print(f"  {name}: {why}")
    results["runs"] = _bench_model(args.model, args, anchors, notes)
    results["process_peak_rss_bytes"] = peak_rss()
    results["cpu_busy_by_others"]["end"] = end = cpu_busy()
    for r in results["runs"]:
        _print_run(r, anchors)
    print(
        "\nratio = anchor ms / contender ms: above 1 is faster than that anchor; vs floor is the fraction "
        "of the machine's limit reached (1 = at the floor).\npeak MiB = tables + optimizer state + the step's "
        f"peak allocations; process peak RSS {results['process_peak_rss_bytes'] / 2**20:,.0f} MiB."
    )
    worst = max((b for b in (busy, end) if b is not None), default=0.0)
    if worst > 0.25:
        print(
            f"note: other processes used up to {worst:.0%} of the CPU around this run; interleaving spreads their "
            "noise over every contender, but a thread waiting on a busy core can slow any step many-fold "
            "(--threads 1 is steadier)"
        )
    return results


def main(argv: Sequence[str] | None = None, prog: str = "hybridembed bench") -> int:
    """``hybridembed bench [flags]``; returns the exit code (2 for bad flags)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    args.argv = argv
    if args.memory_only and args.model == M.E2E_MODEL:
        parser.error(f"--memory-only does not apply to --model {M.E2E_MODEL}")
    if args.memory_only:
        specs = [s for n in ([args.model] if args.model else M.WORKLOADS) for s in M.workloads(n)]
        reports = [M.memory(s, args.optimizer) for s in specs]
        _print_memory(reports)
        if args.json:
            _write_json({"machine": machine(), "memory": [r.as_dict() for r in reports]}, args.json)
        return 0
    try:
        _resolve(args)
        results = run(args)
    except UsageError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    _write_json(results, args.json)
    print(f"results: {args.json}")
    if args.model != M.E2E_MODEL and write_chart(results, args.png):
        print(f"chart: {args.png}")
    return 0


def _write_json(obj: Any, path: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)


if __name__ == "__main__":
    from ..utils import configure_logging

    configure_logging()
    sys.exit(main())
