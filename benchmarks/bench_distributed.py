"""Hybrid-parallel training steps over gloo on the CPU: he.distribute's plans against one
process and against TorchRec's DistributedModelParallel, plus the bytes each rank sends.

    PYTHONPATH=src python benchmarks/bench_distributed.py                     # everything, world 1 2 4
    PYTHONPATH=src /path/to/venv-with-torchrec/bin/python benchmarks/bench_distributed.py --world 2 --rounds 3
    python benchmarks/bench_distributed.py --world 2 --contenders default table_wise --profile
    python benchmarks/bench_distributed.py --quick --world 2                  # seconds: the smoke test

Each contender at each world size is its own job (``hybridembed.launch.spawn``:
fresh processes, gloo, one intra-op thread per rank). The model, as users write it: 26
separate ``nn.EmbeddingBag(rows, 64, mode="sum")`` layers called one by one, their pooled
rows concatenated (B, 26 * 64); by default no MLP: the backward of a fixed upstream gradient
of those rows, so that only the embeddings' work is timed (``--hidden N``: an MLP
``26*64 -> N -> 1``, BCE loss on random labels, SGD under DDP). One-hot power-law ids
(``hybridembed.synthetic.powerlaw_ids``, alpha 1.05), batch 4,096 per rank; tables trained by
row-wise Adagrad (``he.optim.RowWiseAdagrad``; TorchRec: ``EXACT_ROWWISE_ADAGRAD`` fused
into backward).

Contenders (``--contenders``):

- ``default``: ``he.distribute(model)``: the planner's default plan;
- ``table_wise`` / ``row_wise`` / ``row_wise_mod``: every table placed so by an explicit
  ``Plan`` (``shard_table``; table-wise: table i on rank i mod W; row-wise: blocks of rows
  over every rank, as TorchRec places them; ``row_wise_mod``: row r on rank r mod W);
- ``data_parallel``: small tables (``--small-rows``, 1,000) all ``data_parallel``;
- ``table_wise_bf16`` / ``row_wise_bf16``: ``table_wise`` / ``row_wise`` with ``wire="bf16"``
  (rows and their gradients cross as bfloat16);
- ``default_pipe`` / ``table_wise_pipe``: ``default`` / ``table_wise`` pipelined: after each
  forward, ``he.prefetch(model, next batch)`` sends the next step's ids while this step's
  backward and optimizer step run (``hybridembed.distributed.ahead``);
- ``default_gloo`` / ``table_wise_gloo``: ``default`` / ``table_wise`` with every exchange through
  gloo's all-to-all (``HYBRIDEMBED_SHM=0``: large rows' exchanges of ranks of one machine go
  through shared memory by default, ``hybridembed.distributed.shm``);
- ``table_wise_dedup`` / ``table_wise_dedup_pipe``: ``table_wise`` (pipelined) with
  ``dedup=True`` (a feature's distinct ids' rows cross, pooled by the requester);
- ``single`` / ``single_small``: ``he.convert`` of the same model in one process (world 1 only):
  the references of the large and the small tables; with ``--side-by-side`` also at every other
  world size W: W such processes at once, each its own model, nothing crossing between them (a
  barrier before each step): what sharing the machine's cores and memory costs a process, the
  floor of a job of W ranks on it;
- ``torchrec_tw`` / ``torchrec_rw``: TorchRec's ``DistributedModelParallel`` of an
  ``EmbeddingBagCollection`` of the same tables, planner constrained to table-wise / row-wise,
  fused kernel (skipped with a message when TorchRec does not import; ``torchrec_rw`` fails
  on the CPU: TorchRec 1.8's sharder offers no row-wise sharding for compute device ``cpu``,
  and the job's failure is reported as such);
- ``dlrm`` / ``dlrm_single``: the DLRM of ``hybridembed train`` (dynamic tables of
  ``hybridembed.train.models.build``, dim 16, capacity 100k, Adagrad) on synthetic
  Criteo-like batches (13 dense N(0,1) features, 26 power-law ids over ``--rows``),
  distributed with the default plan / in one process.

Timing: rank 0's wall time of a whole step (forward, zero_grad, backward, optimizer step)
after a barrier, and its CPU time (``time.process_time``: less sensitive to other processes
holding the cores); warm-up steps excluded; medians (and over ``--rounds`` the median of the
rounds' medians and their range). Bytes: ``all_to_all_single`` (and ``all_reduce``)
counted by wrapping ``torch.distributed`` in the benchmark's processes during one step,
against the minimum the plan implies for that batch. ``--profile``: after timing, rank 0's
phases (lookup exchanges, owner lookups, routing, backward, optimizer) and torch.profiler's
top operators.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import hybridembed as he
from hybridembed.bench.system import cpu_busy, machine
from hybridembed.distributed import Plan, ShardedCollection, shard_table, shm
from hybridembed.launch import SpawnError, spawn
from hybridembed.synthetic import powerlaw_ids

TABLES = 26
LR = 0.01
HYBRID = (
    "default",
    "table_wise",
    "row_wise",
    "row_wise_mod",
    "data_parallel",
    "table_wise_bf16",
    "row_wise_bf16",
    "default_pipe",
    "table_wise_pipe",
    "table_wise_dedup",
    "table_wise_dedup_pipe",
    "default_gloo",
    "table_wise_gloo",
)
SINGLE = ("single", "single_small", "dlrm_single")  # one process: world 1 only
TORCHREC = ("torchrec_tw", "torchrec_rw")
CONTENDERS = (*HYBRID, "single", "single_small", *TORCHREC, "dlrm", "dlrm_single")
DISTINCT_BATCHES = 4  # batches cycled through (ids generated before timing)


# --- the model ------------------------------------------------------------------------------
class Plain(nn.Module):
    """26 separate ``nn.EmbeddingBag`` layers called one by one, their rows concatenated,
    then (``hidden`` > 0) a small MLP to one logit."""

    def __init__(self, rows: int, dim: int, hidden: int = 0, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embs = nn.ModuleList(nn.EmbeddingBag(rows, dim, mode="sum") for _ in range(TABLES))
        self.mlp = nn.Sequential(nn.Linear(TABLES * dim, hidden), nn.ReLU(), nn.Linear(hidden, 1)) if hidden else None

    def forward(self, ids: list[torch.Tensor]) -> torch.Tensor:  # TABLES x (B, 1) -> (B,) or (B, TABLES * D)
        x = torch.cat([e(x) for e, x in zip(self.embs, ids)], 1)  # (B, TABLES * D)
        return x if self.mlp is None else self.mlp(x).squeeze(1)


def backward(out: torch.Tensor, y: torch.Tensor, upstream: torch.Tensor | None) -> None:
    """BCE on the MLP's logits, backward; or (no MLP) backward of the fixed gradient ``upstream``
    (B, TABLES * D) of the concatenated rows (no loss computed: nothing but the embeddings' work)."""
    if upstream is None:
        F.binary_cross_entropy_with_logits(out, y).backward()
    else:
        out.backward(upstream)


def table_configs(rows: int, dim: int) -> list[he.TableConfig]:
    """The tables ``he.convert`` makes of :class:`Plain` (named after the layers' paths)."""
    return [he.TableConfig(f"embs__{i}", rows, dim) for i in range(TABLES)]


def explicit_plan(kind: str, rows: int, dim: int, world: int) -> Plan:
    ranks = tuple(range(world))
    if kind == "table_wise":
        tps = [shard_table(t, "table_wise", (i % world,)) for i, t in enumerate(table_configs(rows, dim))]
    elif kind == "row_wise":
        tps = [shard_table(t, "row_wise", ranks) for t in table_configs(rows, dim)]
    elif kind == "row_wise_mod":
        tps = [shard_table(t, "row_wise", ranks, placement="mod") for t in table_configs(rows, dim)]
    else:
        tps = [shard_table(t, "data_parallel", ranks) for t in table_configs(rows, dim)]
    return Plan(world, tuple(tps))


def make_batches(rank: int, batch: int, rows: int, seed: int = 0) -> list[tuple[list[torch.Tensor], torch.Tensor]]:
    """``DISTINCT_BATCHES`` batches of this rank: TABLES x (B, 1) one-hot ids, (B,) labels."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    out = []
    for _ in range(DISTINCT_BATCHES):
        ids = [powerlaw_ids(batch, rows, generator=g).unsqueeze(1) for _ in range(TABLES)]
        out.append((ids, torch.randint(0, 2, (batch,), generator=g).float()))
    return out


# --- counting the exchanges -----------------------------------------------------------------
class Counter:
    """Wraps ``torch.distributed.all_to_all_single`` and ``all_reduce`` (as the runtime and
    TorchRec call them, through the module), and the shared-memory all-to-all (rows) and all-gather
    (replicated tables' touched rows) of ranks of one machine, to count bytes and, on request, time
    each call."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.calls: list[dict[str, Any]] = []
        self.phase = "forward"  # of the step: forward, backward, optimizer (advanced by mark)
        self._saved: dict[str, Callable] = {}

    _NEXT = {"forward": "backward", "zero_grad + backward": "optimizer", "optimizer step": "forward"}

    def mark(self, label: str) -> None:
        """A step's ``mark``: the phase that ``label`` ended is followed by the next."""
        self.phase = self._NEXT[label]

    def __enter__(self) -> Counter:
        a2a, ar = dist.all_to_all_single, dist.all_reduce
        self._saved = {"all_to_all_single": a2a, "all_reduce": ar}
        rank = self.rank

        def all_to_all_single(
            output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False
        ):
            size = input.element_size()
            world = dist.get_world_size(group)
            splits = input_split_sizes or [input.numel() // world] * world
            rec = {"op": "all_to_all_single", "phase": self.phase, "dtype": str(input.dtype)}
            rec["bytes"] = sum(splits) * size
            me = dist.get_rank(group) if group is not None else rank
            rec["off_rank_bytes"] = (sum(splits) - splits[me]) * size
            t0 = time.perf_counter()
            out = a2a(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)
            rec["ms"] = (time.perf_counter() - t0) * 1e3
            self.calls.append(rec)
            return out

        def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
            rec = {"op": "all_reduce", "phase": self.phase, "dtype": str(tensor.dtype)}
            rec["bytes"] = rec["off_rank_bytes"] = tensor.numel() * tensor.element_size()
            t0 = time.perf_counter()
            out = ar(tensor, op=op, group=group, async_op=async_op)
            rec["ms"] = (time.perf_counter() - t0) * 1e3
            self.calls.append(rec)
            return out

        through = self._through = shm.Transport.all_to_all

        def shared(tr, out, t, recv_splits, send_splits, status=1.0, meanwhile=None):  # (ranks of one machine)
            flat = t if isinstance(t, torch.Tensor) else out
            size = flat.element_size()
            rec = {"op": "all_to_all_single", "phase": self.phase, "dtype": str(flat.dtype), "shared": True}
            rec["bytes"] = sum(send_splits) * size
            rec["off_rank_bytes"] = (sum(send_splits) - send_splits[tr.rank]) * size
            t0 = time.perf_counter()
            res = through(tr, out, t, recv_splits, send_splits, status, meanwhile)
            rec["ms"] = (time.perf_counter() - t0) * 1e3
            self.calls.append(rec)
            return res

        gathered = self._gathered = shm.Transport.all_gather

        def shared_gather(tr, pieces):  # (replicated tables' touched rows, ranks of one machine: written once)
            rec = {"op": "all_gather", "phase": self.phase, "dtype": str([p.dtype for p in pieces]), "shared": True}
            rec["bytes"] = rec["off_rank_bytes"] = sum(p.numel() * p.element_size() for p in pieces)
            t0 = time.perf_counter()
            res = gathered(tr, pieces)
            rec["ms"] = (time.perf_counter() - t0) * 1e3
            self.calls.append(rec)
            return res

        dist.all_to_all_single = all_to_all_single
        dist.all_reduce = all_reduce
        shm.Transport.all_to_all = shared
        shm.Transport.all_gather = shared_gather
        return self

    def __exit__(self, *exc: Any) -> None:
        for k, v in self._saved.items():
            setattr(dist, k, v)
        shm.Transport.all_to_all = self._through
        shm.Transport.all_gather = self._gathered

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"calls": len(self.calls)}
        for key, sel in (
            ("a2a_forward", lambda c: c["op"] == "all_to_all_single" and c["phase"] == "forward"),
            ("a2a_backward", lambda c: c["op"] == "all_to_all_single" and c["phase"] != "forward"),
            ("all_reduce", lambda c: c["op"] == "all_reduce"),
            ("all_gather", lambda c: c["op"] == "all_gather"),
        ):
            picked = [c for c in self.calls if sel(c)]
            out[key] = {
                "calls": len(picked),
                "bytes": sum(c["bytes"] for c in picked),
                "off_rank_bytes": sum(c["off_rank_bytes"] for c in picked),
            }
        out["off_rank_bytes"] = sum(v["off_rank_bytes"] for k, v in out.items() if isinstance(v, dict))
        return out


def minimum_bytes(plan: Plan, ids: list[torch.Tensor], names: list[str], dim: int) -> dict[str, int]:
    """The fewest bytes this rank must send in one step under ``plan`` (a collective: every
    rank calls it): int64 ids to the owners of other ranks' shards (one-hot bags: no
    lengths needed), float32 pooled rows for the (bag, shard) pairs it serves to other
    ranks, float32 gradients of the rows it received from other ranks."""
    rank, world = dist.get_rank(), dist.get_world_size()
    pairs = torch.zeros(world, dtype=torch.int64)  # non-empty (bag, shard) pairs this rank asks of each owner
    for name, x in zip(names, ids):
        tp = plan.table(name)
        if tp.sharding == "data_parallel":
            continue
        v = x.reshape(-1)
        if tp.partitioned == "none":
            pairs[tp.shards[0].rank] += v.numel()
            continue
        for s in tp.shards:
            if s.num_rows == 0:
                continue
            r = s.rows()
            inside = (v >= r.start) & (v < r.stop) & ((v - r.start) % r.step == 0)
            pairs[s.rank] += int(inside.sum())  # one-hot: an id is a bag
    everyone = [torch.zeros_like(pairs) for _ in range(world)]
    dist.all_gather(everyone, pairs)
    asked = int(pairs.sum() - pairs[rank])  # pairs (= ids, one-hot) sent to others
    served = sum(int(everyone[r][rank]) for r in range(world) if r != rank)
    return {
        "ids": 8 * asked,
        "rows": 4 * dim * served,
        "grads": 4 * dim * asked,
        "total": 8 * asked + 4 * dim * (served + asked),
    }


# --- phases (rank 0, --profile) -------------------------------------------------------------
class Phases:
    """Times the runtime's pieces by wrapping them: the sharded lookup (``_run``), its owner
    lookups (``_own_lookups``), and every all-to-all / all-reduce (with :class:`Counter`)."""

    def __init__(self, rank: int) -> None:
        self.counter = Counter(rank)
        self.ms: dict[str, float] = {}
        self._saved: list[tuple[Any, str, Any]] = []

    def add(self, key: str, ms: float) -> None:
        self.ms[key] = self.ms.get(key, 0.0) + ms

    def _wrap(self, owner: Any, attr: str, key: str) -> None:
        fn = getattr(owner, attr)
        self._saved.append((owner, attr, fn))

        def timed(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.add(key, (time.perf_counter() - t0) * 1e3)

        setattr(owner, attr, timed)

    def __enter__(self) -> Phases:
        self._wrap(ShardedCollection, "_run", "sharded lookup (_run)")
        self._wrap(ShardedCollection, "_own_lookups", "owner lookups (_own_lookups)")
        self.counter.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.counter.__exit__()
        for owner, attr, fn in reversed(self._saved):
            setattr(owner, attr, fn)

    def per_step(self, steps: int, ours: bool = True) -> dict[str, float]:
        out = {k: v / steps for k, v in self.ms.items()}
        fwd = [c for c in self.counter.calls if c["op"] == "all_to_all_single" and c["phase"] == "forward"]
        bwd = [c for c in self.counter.calls if c["op"] == "all_to_all_single" and c["phase"] != "forward"]
        ar = [c for c in self.counter.calls if c["op"] == "all_reduce"]
        ag = [c for c in self.counter.calls if c["op"] == "all_gather"]
        per = len(fwd) // steps if steps else 0
        if not ours:  # another runtime's exchanges: by position in the step
            for i in range(per):
                out[f"a2a #{i + 1} (fwd)"] = sum(c["ms"] for c in fwd[i::per]) / steps
            per = 0
        labels = {  # (the owners' status rides in the rows' all-to-all when the rows are small)
            3: ["header", "ids", "rows + status"],
            4: ["header", "ids", "rows", "owners' status"],
            5: ["header", "ids", "weights", "rows", "owners' status"],
        }.get(per, [])
        if not ours:
            pass
        elif labels and len(fwd) == per * steps:
            for i, lab in enumerate(labels):
                out[f"a2a {lab} (fwd)"] = sum(c["ms"] for c in fwd[i::per]) / steps
        elif fwd:
            out["a2a (fwd)"] = sum(c["ms"] for c in fwd) / steps
        if bwd:
            out["a2a row gradients (bwd)"] = sum(c["ms"] for c in bwd) / steps
        if ar:
            out["all_reduce (data-parallel rows, in step)"] = sum(c["ms"] for c in ar) / steps
        if ag:
            out["shared all_gather (data-parallel rows, in step)"] = sum(c["ms"] for c in ag) / steps
        return out


# --- contenders ------------------------------------------------------------------------------
def _no_mark(label: str) -> None:
    pass


def _upstream(rank: int, cfg: dict) -> torch.Tensor | None:
    """The fixed gradient of the concatenated rows (B, TABLES * D) when there is no MLP."""
    if cfg["hidden"]:
        return None
    g = torch.Generator().manual_seed(7 + rank)
    return torch.randn(cfg["batch"], TABLES * cfg["dim"], generator=g) / cfg["batch"]


def _hybrid(name: str, rank: int, world: int, cfg: dict) -> tuple[Callable, Callable, dict]:
    """(step(batch), to_native(batch), info) of a hybridembed contender on this rank."""
    rows = cfg["small_rows"] if name in ("data_parallel", "single_small") else cfg["rows"]
    model: nn.Module = Plain(rows, cfg["dim"], cfg["hidden"])
    info: dict[str, Any] = {"rows": rows}
    if name in ("single", "single_small"):
        model = he.convert(model)
        plan = None
    else:
        kind = name.removesuffix("_pipe").removesuffix("_bf16").removesuffix("_dedup").removesuffix("_gloo")
        os.environ[shm.ENV] = "0" if name.endswith("_gloo") else os.environ.get(shm.ENV, "1")
        plan = None if kind == "default" else explicit_plan(kind, rows, cfg["dim"], world)
        wire = "bf16" if "_bf16" in name else None
        model = he.distribute(model, plan, wire=wire, dedup="_dedup" in name)
        sharded = [m for m in model.modules() if isinstance(m, ShardedCollection)][0]
        plan = sharded.plan
        kinds: dict[str, int] = {}
        for tp in plan.tables:
            kinds[tp.sharding] = kinds.get(tp.sharding, 0) + 1
        info["plan"] = kinds
        info["plan_ranks"] = {tp.table: list(tp.ranks) for tp in plan.tables}
    opt = he.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=LR), model, sparse=he.optim.RowWiseAdagrad(lr=LR))
    upstream = _upstream(rank, cfg)

    pipelined = name.endswith("_pipe")

    def step(
        b: tuple[list[torch.Tensor], torch.Tensor], mark: Callable[[str], None] = _no_mark, following=None
    ) -> None:
        ids, y = b
        out = model(ids)
        mark("forward")
        if pipelined and following is not None:  # the next batch's ids go out while this step computes
            he.prefetch(model, {f"embs.{i}": x for i, x in enumerate(following[0])})
        opt.zero_grad()
        backward(out, y, upstream)
        mark("zero_grad + backward")
        opt.step()
        mark("optimizer step")

    info["_plan"], info["_pipelined"] = plan, pipelined
    return step, (lambda b: b), info


def _torchrec(name: str, rank: int, world: int, cfg: dict) -> tuple[Callable, Callable, dict]:
    import torchrec
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.distributed.types import ShardingType
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    rows, dim = cfg["rows"], cfg["dim"]
    keys = [f"f{i}" for i in range(TABLES)]
    sharding = ShardingType.TABLE_WISE if name == "torchrec_tw" else ShardingType.ROW_WISE

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            configs = [
                torchrec.EmbeddingBagConfig(name=f"t{i}", num_embeddings=rows, embedding_dim=dim, feature_names=[k])
                for i, k in enumerate(keys)
            ]
            self.ebc = torchrec.EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
            hidden = cfg["hidden"]
            self.mlp = (
                nn.Sequential(nn.Linear(TABLES * dim, hidden), nn.ReLU(), nn.Linear(hidden, 1)) if hidden else None
            )

        def forward(self, kjt: Any) -> torch.Tensor:
            x = self.ebc(kjt).values()  # (B, TABLES * dim)
            return x if self.mlp is None else self.mlp(x).squeeze(1)

    fused = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": LR, "eps": 1e-8}
    sharder = EmbeddingBagCollectionSharder(fused_params=fused)
    constraints = {
        f"t{i}": ParameterConstraints(
            sharding_types=[sharding.value], compute_kernels=[EmbeddingComputeKernel.FUSED.value]
        )
        for i in range(TABLES)
    }
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world, compute_device="cpu"), constraints=constraints
    )
    module = Model()
    plan = planner.collective_plan(module, [sharder], dist.GroupMember.WORLD)
    model = DistributedModelParallel(
        module, device=torch.device("cpu"), plan=plan, sharders=[sharder], init_data_parallel=bool(cfg["hidden"])
    )
    dense = [p for n, p in model.named_parameters() if "mlp" in n]
    opt = torch.optim.SGD(dense or [nn.Parameter(torch.zeros(1))], lr=LR)
    upstream = _upstream(rank, cfg)
    info = {"rows": rows, "plan": str(plan).count(sharding.value)}

    def native(b: tuple[list[torch.Tensor], torch.Tensor]) -> tuple[Any, torch.Tensor]:
        ids, y = b
        values = torch.cat([x.reshape(-1) for x in ids])
        return KeyedJaggedTensor(keys=keys, values=values, lengths=torch.ones(values.numel(), dtype=torch.int32)), y

    def step(b: tuple[Any, torch.Tensor], mark: Callable[[str], None] = _no_mark) -> None:
        kjt, y = b
        out = model(kjt)
        mark("forward")
        opt.zero_grad()
        backward(out, y, upstream)  # the fused optimizer updates the rows here
        mark("zero_grad + backward")
        opt.step()
        mark("optimizer step")

    return step, native, info


def _dlrm(name: str, rank: int, world: int, cfg: dict) -> tuple[Callable, Callable, dict]:
    from hybridembed.train.models import build

    features = [f"C{i}" for i in range(1, TABLES + 1)]
    model: nn.Module = build("dlrm", 13, features, dim=16, capacity=100_000)
    info: dict[str, Any] = {"rows": "dynamic"}
    if name == "dlrm":
        model = he.distribute(model)
        sharded = [m for m in model.modules() if isinstance(m, ShardedCollection)][0]
        kinds: dict[str, int] = {}
        for tp in sharded.plan.tables:
            kinds[f"{tp.sharding}/{tp.placement}"] = kinds.get(f"{tp.sharding}/{tp.placement}", 0) + 1
        info["plan"] = kinds
    opt = he.wrap_optimizer(torch.optim.Adagrad(model.parameters(), lr=0.02), model)

    def native(b: tuple[list[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ids, y = b
        g = torch.Generator().manual_seed(int(ids[0][0, 0]))
        return torch.randn(y.numel(), 13, generator=g), torch.cat(ids, 1), y  # (B, 13), (B, 26), (B,)

    def step(b: tuple[torch.Tensor, torch.Tensor, torch.Tensor], mark: Callable[[str], None] = _no_mark) -> None:
        dense, sparse, y = b
        out = model(dense, sparse)
        mark("forward")
        opt.zero_grad()
        backward(out, y, None)
        mark("zero_grad + backward")
        opt.step()
        mark("optimizer step")

    return step, native, info


def run_rank(rank: int, world: int, name: str, cfg: dict) -> dict[str, Any]:
    """One contender on one rank: build, warm up, time, count bytes (and profile)."""
    logging.getLogger("hybridembed").setLevel(logging.WARNING)
    logging.getLogger("torchrec").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="torchrec")
    t0 = time.perf_counter()
    if name in TORCHREC:
        step, native, info = _torchrec(name, rank, world, cfg)
    elif name.startswith("dlrm"):
        step, native, info = _dlrm(name, rank, world, cfg)
    else:
        step, native, info = _hybrid(name, rank, world, cfg)
    plan = info.pop("_plan", None)
    rows = info["rows"] if isinstance(info["rows"], int) else cfg["rows"]
    raw = make_batches(rank, cfg["batch"], rows, cfg["seed"])
    batches = [native(b) for b in raw]
    build_s = time.perf_counter() - t0
    pipelined, done = info.pop("_pipelined", False), [0]

    def go(
        mark: Callable[[str], None] = _no_mark,
    ) -> None:  # the next batch of the cycle (a pipeline: and the one after)
        k = done[0]
        done[0] += 1
        b = batches[k % len(batches)]
        step(b, mark, following=batches[(k + 1) % len(batches)]) if pipelined else step(b, mark)

    for _ in range(cfg["warmup"]):
        go()
    times, cpu = [], []
    for _ in range(cfg["steps"]):
        dist.barrier()
        t, c0 = time.perf_counter(), time.process_time()
        go()
        times.append((time.perf_counter() - t) * 1e3)
        cpu.append((time.process_time() - c0) * 1e3)
    out: dict[str, Any] = {"rank": rank, "times_ms": times, "cpu_ms": cpu, "build_s": build_s, **info}
    with Counter(rank) as c:
        go(c.mark)
    out["bytes"] = c.summary()
    if plan is not None:
        names = [f"embs__{i}" for i in range(TABLES)]
        out["min_bytes"] = minimum_bytes(plan, raw[0][0], names, cfg["dim"])
    if cfg["profile"]:
        out["profile"] = profile(go, cfg, rank, ours=name not in TORCHREC)
    return out


def profile(go: Callable, cfg: dict, rank: int, ours: bool = True) -> dict[str, Any]:
    """Rank 0's time per phase (the step's forward / backward / optimizer split by its marks,
    wrapped runtime methods and collectives) over ``profile_steps`` steps, then the top
    operators by self CPU time (torch.profiler) over as many more."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    n = max(2, cfg["profile_steps"])
    last = [0.0]

    def mark(label: str) -> None:
        ph.counter.mark(label)
        now = time.perf_counter()
        ph.add(label, (now - last[0]) * 1e3)
        last[0] = now

    with Phases(rank) as ph:
        for _ in range(n):
            dist.barrier()
            t = last[0] = time.perf_counter()
            go(mark)
            ph.add("step", (time.perf_counter() - t) * 1e3)
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(n):
            dist.barrier()
            go()
    avg = prof.key_averages()
    top = sorted(avg, key=lambda e: e.self_cpu_time_total, reverse=True)[:15]
    ops = [
        {"op": e.key, "self_ms_per_step": e.self_cpu_time_total / 1e3 / n, "calls_per_step": e.count / n} for e in top
    ]
    return {"phases_ms": ph.per_step(n, ours), "top_ops": ops}


# --- driver ----------------------------------------------------------------------------------
def torchrec_status() -> str | None:
    """None when TorchRec's distributed model parallel imports; otherwise why not (one line)."""
    try:
        import torchrec  # noqa: F401
        from torchrec.distributed.model_parallel import DistributedModelParallel  # noqa: F401
    except Exception as e:  # ImportError, or OSError when fbgemm's compiled ops mismatch torch
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None


def run_job(name: str, world: int, cfg: dict) -> dict[str, Any]:
    t0 = time.perf_counter()
    res = spawn(run_rank, world, name, cfg, timeout=cfg["timeout"], pg_timeout=cfg["timeout"], threads=1)
    first = res[0]
    times = first["times_ms"]
    rec = {
        "contender": name,
        "world": world,
        "median_ms": statistics.median(times),
        "min_ms": min(times),
        "max_ms": max(times),
        "times_ms": times,
        "cpu_median_ms": statistics.median(first["cpu_ms"]),
        "cpu_ms": first["cpu_ms"],
        "job_s": time.perf_counter() - t0,
        "build_s": first["build_s"],
        "plan": first.get("plan"),
        "bytes_per_rank": [r["bytes"]["off_rank_bytes"] for r in res],
        "bytes": first["bytes"],
    }
    if "min_bytes" in first:
        rec["min_bytes_per_rank"] = [r["min_bytes"]["total"] for r in res]
        rec["min_bytes"] = first["min_bytes"]
    if "profile" in first:
        rec["profile"] = first["profile"]
    return rec


def _targets(results: list[dict]) -> list[str]:
    """The issue's targets at world 2, from this run's medians."""
    ms = {(r["contender"], r["world"]): r["median_ms"] for r in results}
    cpu = {(r["contender"], r["world"]): r.get("cpu_ms") for r in results}
    lines = []

    def check(label: str, a: tuple, b: tuple, limit: float) -> None:
        if a not in ms or b not in ms:
            return
        ratio = ms[a] / ms[b]
        ok = "met" if ratio <= limit else "MISSED"
        line = f"{label}: {ms[a]:.1f} / {ms[b]:.1f} ms = {ratio:.2f}x (target <= {limit}x) {ok}"
        if cpu[a] and cpu[b]:
            line += f"; rank 0 CPU time {cpu[a]:.1f} / {cpu[b]:.1f} ms = {cpu[a] / cpu[b]:.2f}x"
        lines.append(line)

    check("default plan vs TorchRec table-wise (world 2)", ("default", 2), ("torchrec_tw", 2), 0.7)
    check("row-wise vs table-wise (world 2)", ("row_wise", 2), ("table_wise", 2), 1.5)
    check("data-parallel small tables (world 2) vs one process", ("data_parallel", 2), ("single_small", 1), 1.2)
    if ("single_small", 2) in ms and ("data_parallel", 2) in ms:  # (--side-by-side: not a target, a floor)
        lines.append(
            f"data-parallel small tables (world 2) vs two one-process jobs side by side: {ms['data_parallel', 2]:.1f} / "
            f"{ms['single_small', 2]:.1f} ms = {ms['data_parallel', 2] / ms['single_small', 2]:.2f}x "
            f"(one process alone -> side by side: {ms['single_small', 2] / ms['single_small', 1]:.2f}x)"
        )
    return lines


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--batch", type=int, default=4096, help="per rank")
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--small-rows", type=int, default=1_000, help="rows of the data_parallel / single_small tables")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument(
        "--hidden",
        type=int,
        default=0,
        help="0 (default): no MLP, a fixed upstream gradient of the rows (the embedding step alone); "
        "N: an MLP 26*dim -> N -> 1 with BCE loss, trained by SGD under DDP",
    )
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=1, help="repeat every job this many times (interleaved)")
    p.add_argument("--contenders", nargs="+", default=list(CONTENDERS), choices=CONTENDERS)
    p.add_argument("--profile", action="store_true", help="rank 0's phases and top operators after timing")
    p.add_argument(
        "--side-by-side",
        action="store_true",
        help="the one-process contenders also at each world size W > 1: W independent processes at once",
    )
    p.add_argument("--profile-steps", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="tiny sizes, seconds (a smoke test)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per job")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    if args.quick:
        args.batch, args.rows, args.small_rows, args.dim = 64, 1_000, 50, 8
        args.steps, args.warmup, args.profile_steps = 3, 1, 2
    cfg = {
        k: getattr(args, k)
        for k in ("batch", "rows", "small_rows", "dim", "hidden", "steps", "warmup", "seed", "timeout")
    }
    cfg["profile"], cfg["profile_steps"] = args.profile, args.profile_steps
    notes: dict[str, str] = {}
    contenders = list(args.contenders)
    if any(c in TORCHREC for c in contenders):
        why = torchrec_status()
        if why is not None:
            notes["torchrec"] = f"TorchRec not importable ({why}); torchrec_tw/torchrec_rw skipped"
            print(notes["torchrec"], flush=True)
            contenders = [c for c in contenders if c not in TORCHREC]
    jobs = [(c, 1) for c in contenders if c in SINGLE]
    if args.side_by_side:
        jobs += [(c, w) for w in args.world if w > 1 for c in contenders if c in SINGLE]
    jobs += [(c, w) for w in args.world for c in contenders if c not in SINGLE]
    busy = cpu_busy(0.5)
    print(f"machine: {machine()['cpu']}, {machine()['cores']} cores; other processes' CPU use: {busy}", flush=True)
    results: list[dict[str, Any]] = []
    failures: dict[str, str] = {}
    for r in range(args.rounds):
        for name, world in jobs:
            key = f"{name}@{world}"
            if key in failures:
                continue
            try:
                rec = run_job(name, world, cfg)
            except SpawnError as e:
                failures[key] = str(e).strip().splitlines()[-1][:300]
                print(f"{key}: FAILED: {failures[key]}", flush=True)
                continue
            rec["round"] = r
            results.append(rec)
            b = rec["bytes_per_rank"][0]
            mb = f" (plan's minimum {rec['min_bytes_per_rank'][0] / 1e6:.2f} MB)" if "min_bytes_per_rank" in rec else ""
            print(
                f"round {r + 1} {name:14s} world {world}: median {rec['median_ms']:7.1f} ms "
                f"[{rec['min_ms']:.1f}-{rec['max_ms']:.1f}] (CPU {rec['cpu_median_ms']:.1f} ms) sent {b / 1e6:.2f} MB/step by rank 0{mb}; "
                f"plan {rec['plan']}; job {rec['job_s']:.0f} s",
                flush=True,
            )
    summary = []
    for name, world in jobs:
        recs = [x for x in results if x["contender"] == name and x["world"] == world]
        if not recs:
            continue
        meds = [x["median_ms"] for x in recs]
        cpus = [x["cpu_median_ms"] for x in recs]
        summary.append(
            {
                "contender": name,
                "world": world,
                "median_ms": statistics.median(meds),
                "rounds_ms": meds,
                "cpu_ms": statistics.median(cpus),
                "rounds_cpu_ms": cpus,
            }
        )
    print("\ncontender      world  wall ms: median of rounds [range]   rank 0 CPU ms: median [range]")
    for s in summary:
        print(
            f"{s['contender']:14s} {s['world']:5d}  {s['median_ms']:8.1f} [{min(s['rounds_ms']):.1f}-{max(s['rounds_ms']):.1f}]"
            f"   {s['cpu_ms']:8.1f} [{min(s['rounds_cpu_ms']):.1f}-{max(s['rounds_cpu_ms']):.1f}]"
        )
    targets = _targets(summary)
    for line in targets:
        print(line)
    for rec in results:
        if "profile" in rec:
            _print_profile(rec)
    out = {
        "machine": machine(),
        "cpu_busy_before": busy,
        "config": cfg,
        "notes": notes,
        "failures": failures,
        "summary": summary,
        "targets": targets,
        "runs": results,
        "argv": sys.argv[1:] if argv is None else argv,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2, default=str))
    return out


def _print_profile(rec: dict) -> None:
    prof = rec["profile"]
    print(f"\nprofile of {rec['contender']} at world {rec['world']} (rank 0, ms per step):")
    for k, v in prof["phases_ms"].items():
        print(f"  {k:45s} {v:8.2f}")
    print("  top operators by self CPU time:")
    for o in prof["top_ops"]:
        print(f"    {o['op']:50s} {o['self_ms_per_step']:8.2f} ms  x{o['calls_per_step']:.0f}")


if __name__ == "__main__":
    main()
