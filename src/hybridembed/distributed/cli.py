"""``hybridembed plan``: place a model's tables on ranks and print memory and traffic per rank.

    hybridembed plan --model jumbo --world-size 128 --memory-per-rank 80GiB
    hybridembed plan --model tiny --world-size 8 --strategy comm_balanced --override t2=row_wise:mod
    hybridembed plan --tables tables.json --world-size 16 --json plan.json

Sizes only: no table is allocated, so the full-size synthetic models plan in about a second.
``--tables`` reads a JSON list (YAML too when PyYAML is installed) of
``{"name", "num_embeddings", "embedding_dim", "dynamic"?, "hotness"?, "bags"?, "combiner"?, "dtype"?}``.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..utils import OneLineParser
from .plan import PLACEMENTS, SHARDING_TYPES, Plan
from .planner import (
    DATA_PARALLEL_BELOW,
    DEFAULT_BATCH,
    OPTIMIZER_STATE,
    STRATEGIES,
    RankCost,
    format_bytes,
    imbalance,
    make_plan,
    plan_costs,
    tables_for_model,
)
from .routes import ROUTE_TYPES

__all__ = ["main", "build_parser", "parse_bytes", "parse_override", "load_tables", "format_plan"]

_SIZES = {"": 1, "b": 1}  # k, kib: 2**10; kb: 10**3; ...
for _i, _p in enumerate("kmgtp", 1):
    _SIZES.update({_p: 1 << (10 * _i), f"{_p}ib": 1 << (10 * _i), f"{_p}b": 10 ** (3 * _i)})
_TABLE_KEYS = ("name", "num_embeddings", "embedding_dim", "dynamic", "hotness", "bags", "combiner", "dtype")


def parse_bytes(text: str, minimum: int = 1) -> int:
    """``"80GiB"``, ``"80G"`` (binary), ``"80GB"`` (decimal), ``"512MiB"``, ``"1e9"`` -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*", text.lower())
    scale = _SIZES.get(m.group(2)) if m else None
    if scale is None:
        raise argparse.ArgumentTypeError(f"expected a size like 80GiB, 512MiB, 80GB or 1e9 (bytes), got {text!r}")
    v = float(m.group(1)) * scale
    if not math.isfinite(v) or v < minimum:
        raise argparse.ArgumentTypeError(f"expected a size >= {minimum} bytes, got {text!r}")
    return int(v)


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}")
    return v


def _fraction(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = -1.0
    if not (math.isfinite(v) and v >= 0):
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return v


def _ranks(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        a, dash, b = part.partition("-")
        if not a.isdigit() or (dash and not b.isdigit()) or (dash and int(b) < int(a)):
            raise ValueError(f"ranks {text!r}: expected e.g. 3, 0-7 or 0,2,4-5")
        out += range(int(a), int(b or a) + 1)
    return out


def parse_override(text: str) -> tuple[str, dict[str, Any]]:
    """``NAME=TYPE[:PLACEMENT][@RANKS]`` (``t3=row_wise:mod``, ``t0=table_wise@5``,
    ``t1=row_wise@0-3``) -> ``(name, override dict)``."""
    name, eq, rest = text.partition("=")
    try:
        if not eq or not name:
            raise ValueError(f"expected TABLE=SHARDING[:PLACEMENT][@RANKS], got {text!r}")
        rest, at, ranks = rest.partition("@")
        sharding, _, placement = rest.partition(":")
        if sharding not in SHARDING_TYPES:
            raise ValueError(f"{text!r}: unknown sharding type {sharding!r}; known: {', '.join(SHARDING_TYPES)}")
        if placement and placement not in PLACEMENTS:
            raise ValueError(f"{text!r}: unknown placement {placement!r}; known: {', '.join(PLACEMENTS)}")
        spec: dict[str, Any] = {"sharding": sharding}
        if placement:
            spec["placement"] = placement
        if at:
            spec["ranks"] = _ranks(ranks)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return name, spec


def _by_name(workloads: Mapping[str, Sequence[Any]]) -> dict[str, Any]:
    """{name: model spec}: every spec by its own name, and a workload of one spec by the workload's."""
    out = {}
    for name, specs in workloads.items():
        for spec in specs:
            out[spec.name] = spec
        if len(specs) == 1:
            out[name] = specs[0]
    return out


def build_parser(prog: str = "hybridembed plan") -> argparse.ArgumentParser:
    p = OneLineParser(
        prog=prog,
        description="Place embedding tables on the ranks of a torch.distributed job and print each rank's memory "
        "(rows + optimizer state) and embedding traffic per step. Sizes only: nothing is allocated.",
        epilog="The cost model is in docs/distributed.md (Planning).",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--model",
        metavar="NAME",
        help="a synthetic model at full size: tiny, small, medium, large, "
        "jumbo, colossal, criteo-dlrm-like, embedding-step/one-hot, embedding-step/multi-hot",
    )
    src.add_argument(
        "--tables",
        metavar="FILE",
        type=Path,
        help="a JSON (or YAML) list of tables: name, "
        "num_embeddings, embedding_dim, and optionally dynamic {...}, hotness, bags, combiner, dtype "
        "(an example: examples/tables.json in the repository)",
    )
    p.add_argument("--world-size", type=_positive_int, required=True, metavar="N", help="ranks in the job")
    p.add_argument(
        "--memory-per-rank",
        type=parse_bytes,
        metavar="SIZE",
        help="bytes of rows + optimizer state a rank may hold, e.g. 80GiB (default: no limit)",
    )
    p.add_argument(
        "--strategy",
        choices=STRATEGIES,
        default="memory_balanced",
        help="balance memory per rank, or traffic per rank within memory (default memory_balanced)",
    )
    p.add_argument(
        "--batch-size",
        type=_positive_int,
        default=DEFAULT_BATCH,
        metavar="N",
        help=f"samples per rank per step, for the traffic (default {DEFAULT_BATCH})",
    )
    p.add_argument(
        "--optimizer",
        default="adagrad",
        choices=list(OPTIMIZER_STATE),
        help="whose state to count beside the rows (default adagrad: one float per element)",
    )
    p.add_argument(
        "--column-slice-threshold",
        type=_positive_int,
        metavar="ELEMENTS",
        help="cut tables of more elements (rows x dim) into column slices below it",
    )
    p.add_argument(
        "--data-parallel-below",
        type=lambda text: parse_bytes(text, minimum=0),
        default=DATA_PARALLEL_BELOW,
        metavar="SIZE",
        help=f"replicate tables smaller than this (default {format_bytes(DATA_PARALLEL_BELOW)})",
    )
    p.add_argument("--ranks-per-node", type=_positive_int, metavar="N", help="ranks of a node (table_row_wise)")
    p.add_argument(
        "--tolerance",
        type=_fraction,
        default=0.02,
        metavar="F",
        help="how far past the mean memory a table-wise placement may take a rank (default 0.02)",
    )
    p.add_argument(
        "--override",
        type=parse_override,
        action="append",
        default=[],
        metavar="TABLE=TYPE[:PLACEMENT][@RANKS]",
        help="force a table's sharding, e.g. t3=row_wise:mod, t0=table_wise@5, t1=row_wise@0-3 (repeatable)",
    )
    p.add_argument(
        "--summary", action="store_true", help="print the sharding counts and totals only, no table or rank lines"
    )
    p.add_argument(
        "--all",
        action="store_true",
        help=f"list every table and rank (default: the first {SHOWN_TABLES} tables and {SHOWN_RANKS} ranks)",
    )
    p.add_argument("--json", metavar="OUT", type=Path, help="write the plan as JSON (Plan.from_json reads it)")
    return p


def load_tables(path: Path) -> tuple[list[Any], dict[str, float], dict[str, int]]:
    """Tables, hotness and bags from a JSON (or YAML) list of table dicts."""
    from ..config import Dynamic, TableConfig

    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read --tables {str(path)!r}: {e.strerror}") from None
    if path.suffix.lower() in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise ConfigError(
                f"{path.name}: reading YAML needs PyYAML, which is not installed; write the tables as JSON instead"
            ) from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"{path.name} does not parse as YAML: {e}") from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path.name} does not parse as JSON: {e}") from None
    if isinstance(data, dict) and "tables" in data:
        data = data["tables"]
    if not isinstance(data, list) or not data:
        raise ConfigError(f"{path.name}: expected a non-empty list of tables, got {type(data).__name__}")
    tables, hotness, bags = [], {}, {}
    for i, d in enumerate(data):
        if not isinstance(d, dict):
            raise ConfigError(f"{path.name}: table {i} must be an object, got {d!r}")
        unknown = sorted(set(d) - set(_TABLE_KEYS))
        if unknown:
            raise ConfigError(
                f"{path.name}: table {i} has unknown key {unknown[0]!r}; allowed: {', '.join(_TABLE_KEYS)}"
            )
        try:
            dyn = d.get("dynamic")
            kw: dict[str, Any] = {}
            if dyn is not None:
                kw["dynamic"] = Dynamic(**dyn) if isinstance(dyn, dict) else Dynamic() if dyn is True else dyn
            if "combiner" in d:
                kw["combiner"] = d["combiner"]
            if "dtype" in d:
                import torch

                kw["dtype"] = getattr(torch, str(d["dtype"]).removeprefix("torch."), d["dtype"])
            t = TableConfig(d.get("name"), d.get("num_embeddings"), d.get("embedding_dim"), **kw)
        except TypeError as e:
            raise ConfigError(f"{path.name}: table {i}: {e}") from None
        tables.append(t)
        if "hotness" in d:
            hotness[t.name] = d["hotness"]
        if "bags" in d:
            bags[t.name] = d["bags"]
    return tables, hotness, bags


def _rank_list(ranks: Sequence[int]) -> str:
    rs = sorted(ranks)
    runs, i = [], 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        runs.append(str(rs[i]) if i == j else f"{rs[i]}-{rs[j]}")
        i = j + 1
    return ",".join(runs)


SHOWN_TABLES, SHOWN_RANKS = 30, 16  # listed by default (the totals cover every one)


def format_plan(
    plan: Plan,
    tables: Sequence[Any],
    costs: Sequence[RankCost],
    hotness: dict[str, float],
    title: str,
    summary: bool = False,
    shown: tuple[int, int] | None = None,
) -> str:
    """The readable report ``hybridembed plan`` prints. ``shown``: at most this many (tables, ranks)
    listed, with a line saying how many more (None: every one)."""
    from .planner import _tables

    info = _tables(tables, hotness, 1, plan.notes.get("optimizer", "adagrad"))
    W = plan.world_size
    n = plan.notes
    lines = [
        f"{title}: {len(plan.tables)} tables on {W} ranks, strategy {plan.strategy}",
        f"assumed: batch {n.get('batch_size')} samples per rank; {n.get('hotness_source', n.get('hotness'))}; "
        f"optimizer {n.get('optimizer')}; memory per rank "
        + (format_bytes(n["memory_per_rank"]) if n.get("memory_per_rank") else "unlimited"),
        "",
        f"{'sharding':<16}{'tables':>8}{'memory':>12}",
    ]
    mem_by: Counter[str] = Counter()
    for tp in plan.tables:
        t = info[tp.table]
        mem_by[tp.sharding] += t.nbytes * (W if ROUTE_TYPES[tp.sharding].replicated else 1)  # (a copy per rank)
    count = Counter(tp.sharding for tp in plan.tables)
    for sh in SHARDING_TYPES:
        if count[sh]:
            lines.append(f"{sh:<16}{count[sh]:>8}{format_bytes(mem_by[sh]):>12}")
    if not summary:
        lines += ["", f"{'table':<14}{'rows':>15}{'dim':>6}{'hotness':>9}  {'sharding':<15}{'ranks':<14}{'memory':>11}"]
        max_tables, max_ranks = shown or (len(plan.tables), len(costs))
        for tp in plan.tables[:max_tables]:
            t = info[tp.table]
            rows = f"{t.rows:,}" + ("*" if t.config.dynamic is not None else "")
            ranks = _rank_list(tp.ranks) + (f" ({tp.placement})" if tp.placement else "")
            lines.append(
                f"{tp.table:<14}{rows:>15}{t.dim:>6}{t.hotness:>9.4g}  {tp.sharding:<15}{ranks:<14}"
                f"{format_bytes(t.nbytes):>11}"
            )
        if len(plan.tables) > max_tables:
            lines.append(
                f"... and {len(plan.tables) - max_tables:,} more tables (--all lists every one; --json OUT writes the plan)"
            )
        lines += [
            "",
            f"{'rank':>5}{'memory':>12}{'shards':>8}{'ids in':>14}{'rows out':>14}{'sent':>12}{'received':>12}"
            "   (per step)",
        ]
        shards = Counter(s.rank for tp in plan.tables for s in tp.shards)
        for c in costs[:max_ranks]:
            lines.append(
                f"{c.rank:>5}{format_bytes(c.memory_bytes):>12}{shards[c.rank]:>8}{c.ids_received:>14,}"
                f"{c.rows_sent:>14,}{format_bytes(c.bytes_sent):>12}{format_bytes(c.bytes_received):>12}"
            )
        if len(costs) > max_ranks:
            lines.append(f"... and {len(costs) - max_ranks:,} more ranks (--all lists every one)")
    mem = [c.memory_bytes for c in costs]
    moved = [c.bytes_moved for c in costs]
    hi_m = max(range(W), key=lambda r: (mem[r], -r))
    hi_c = max(range(W), key=lambda r: (moved[r], -r))
    lines += [
        "",
        f"memory: {format_bytes(sum(mem))} in all, mean {format_bytes(sum(mem) / W)} per rank, max "
        f"{format_bytes(mem[hi_m])} (rank {hi_m}), min {format_bytes(min(mem))}; max/mean {imbalance(mem):.3f}",
        f"traffic per step (sent + received): {format_bytes(sum(moved))} in all, mean {format_bytes(sum(moved) / W)} "
        f"per rank, max {format_bytes(moved[hi_c])} (rank {hi_c}); max/mean {imbalance(moved):.3f}",
    ]
    return "\n".join(lines)


def main(
    argv: Sequence[str] | None = None,
    prog: str = "hybridembed plan",
    models: Mapping[str, Sequence[Any]] | None = None,
) -> int:
    """Entry point of ``hybridembed plan``; returns the exit code (2: bad arguments or no fitting plan).

    ``models``: ``--model`` names -> model specs (``hybridembed.bench.models.WORKLOADS``, passed
    in by the ``hybridembed`` command: the library does not import the benchmarks)."""
    args = build_parser(prog).parse_args(argv)

    def fail(message: str) -> int:
        print(f"{prog}: error: {message}", file=sys.stderr)
        return 2

    overrides: dict[str, Any] = {}
    for name, spec in args.override:
        if name in overrides:
            return fail(f"--override names table {name!r} twice")
        overrides[name] = spec
    try:
        if args.model is not None:
            specs = _by_name(models or {})
            if args.model not in specs:
                return fail(f"unknown model {args.model!r}; allowed: {', '.join(specs) or 'none (use --tables)'}")
            tables, hotness, bags = tables_for_model(specs[args.model])
            title, source = f"{args.model}", "hotness from the model's inputs"
        else:
            tables, hotness, bags = load_tables(args.tables)
            title = args.tables.name
            source = f"hotness from {args.tables.name} ({len(hotness)} tables; 1 for the others)"
        plan = make_plan(
            tables,
            args.world_size,
            memory_per_rank=args.memory_per_rank,
            batch_size=args.batch_size,
            hotness=hotness,
            bags=bags,
            strategy=args.strategy,
            overrides=overrides,
            optimizer=args.optimizer,
            column_slice_threshold=args.column_slice_threshold,
            data_parallel_below=args.data_parallel_below,
            ranks_per_node=args.ranks_per_node,
            tolerance=args.tolerance,
            notes={"source": title, "hotness_source": source},
        )
        costs = plan_costs(
            plan, tables, batch_size=args.batch_size, hotness=hotness, bags=bags, optimizer=args.optimizer
        )
    except ConfigError as e:
        return fail(str(e))
    shown = None if args.all else (SHOWN_TABLES, SHOWN_RANKS)
    print(format_plan(plan, tables, costs, hotness, f"{prog}: {title}", args.summary, shown))
    if args.json is not None:
        try:
            args.json.write_text(plan.to_json(indent=1) + "\n")
        except OSError as e:
            return fail(f"cannot write --json {str(args.json)!r}: {e.strerror}")
        print(f"\nplan written to {args.json}")
    return 0
