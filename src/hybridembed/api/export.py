"""``he.export``: a standalone model that serves without hybridembed.

Shape legend: ``B`` batch, ``H`` padded hotness (ids per sample), ``D`` dim, ``K`` rows of
a dynamic table.

For a ``model`` whose ``forward(batch, dense)`` reads ``batch = {"watched": ids (B, H),
"user": he.Jagged(values, offsets, weights)}`` with an EmbeddingCollection::

    he.export(model, "ranker.pt2", (batch, dense))                        # torch.export (the default)
    he.export(model, "ranker.pt", (batch, dense))                         # TorchScript (by the suffix)
    he.export(model, "ranker.onnx", (batch, dense))                       # ONNX (by the suffix)

    # serving, in a process without hybridembed (ids (B, H) int64, -1 = padding):
    m = torch.export.load("ranker.pt2").module()      # or torch.jit.load("ranker.pt")
    out = m({"watched": ids, "user": user_ids, "user:weights": user_w}, dense)
    s = onnxruntime.InferenceSession("ranker.onnx")
    out = s.run(None, {"batch.watched": ids.numpy(), "batch.user": user_ids.numpy(),
                       "batch.user:weights": user_w.numpy(), "dense": dense.numpy()})

What is written: a copy of ``model`` in eval mode in which every
:class:`~hybridembed.EmbeddingCollection` is replaced by a :class:`ServedEmbeddingCollection`
made of plain torch ops: a dense table becomes its ``(R, D)`` weight; a dynamic table becomes
its sorted ids ``(K,)`` and rows ``(K, D)``, looked up in-graph by ``torch.searchsorted`` (in
ONNX, which has none, a binary search of ``bit_length(K)`` unrolled steps), ids without a row reading
the table's default vector (``Dynamic.default_value``), as the trained model in eval mode.
A layer made by :func:`~hybridembed.convert` (``HybridEmbedding`` / ``HybridEmbeddingBag``)
becomes a module of plain ops with the layer's own ``forward`` signature (ids of any shape;
``(B, L)`` ids, or ``(N,)`` ids with offsets and ``per_sample_weights``, for a bag) reading
the same served table. The copy is exported with ``torch.export`` (``"pt2"``, the default; saved by
``torch.export.save``), traced (``torch.jit.trace``) or exported with the ONNX exporter
(``torch.onnx.export(dynamo=True)``, i.e. ``torch.export`` + onnxscript), with the batch and
hotness of every input tensor dynamic.

The served input contract. ``example_inputs`` is what ``model.forward`` takes: one tensor or
dict (the single argument) or a tuple of positional arguments, made of tensors, dicts (str
keys), lists and tuples. The served model takes the same structure, where each sparse
feature reaching an ``EmbeddingCollection`` is

- ``ids``: a ``(B, H)`` (or ``(B,)``) integer tensor padded with the collection's pad value
  (-1); a row's ids need not be left-aligned, every pad entry is dropped;
- for a weighted feature, also ``"<feature>:weights"``: a ``(B, H)`` float tensor beside the
  ids in the same dict (weights at pad positions are ignored).

A :class:`~hybridembed.Jagged` in ``example_inputs`` is converted to this form for the
export (ids padded to the longest bag; its weights, if any, added under
``"<feature>:weights"``). Other sparse forms (``(values, offsets)`` tuples, lists of lists,
sparse COO tensors) are refused with an error that says how to pad them. Outputs keep the
model's structure in TorchScript (a tensor, or tuples/lists/dicts of tensors); pooled
features are ``(B, D)``; a sequence feature (``combiner="none"``) is ``(B, H, D)`` with zero
rows at the pad positions, i.e. the trained model's ``sequence_output="padded"`` output when
the ids are right-padded (a ``Jagged`` sequence output is served padded). In ONNX the
inputs and outputs are flat and named by their path: inputs by the dict keys when the single
argument is a dict (``"watched"``, ``"watched:weights"``), otherwise by the parameter
names of ``forward`` (``"dense"``, ``"batch.watched"``); outputs ``"output"`` for a tensor,
``"output.<key>"`` / ``"output.<index>"`` for dicts / tuples. Integer inputs keep the
dtype of the example (give int64 ids).

The served model does not validate: a dense-table id outside ``[0, num_embeddings)`` fails
in the runtime's gather. Before anything is written, ``export`` runs the model (eval mode,
no gradient, every module's mode restored after; its validation refuses bad example ids
with :class:`~hybridembed.InvalidInputError`) and then the served copy on ``example_inputs`` and the artifact (TorchScript
module; ONNX in onnxruntime when installed) on the served inputs, and refuses to write a
file whose outputs differ (``check=False`` skips this). Every size of every input tensor is
dynamic; where the ONNX exporter still fixes one (a size 0 or 1 in some torch versions) a
warning names the input.

A distributed model (:func:`hybridembed.distribute`'s, ``DistributedDataParallel`` wrapper or
not) is exported by every rank calling ``export`` (each with its own ``example_inputs``): the
model runs on every rank, its sharded tables are gathered whole into every process
(``ShardedCollection.gather_table``, a collective: for models whose tables fit one process,
as the served file must), and rank 0 checks the served copy against its outputs and writes
the one plain file; the other ranks write nothing and return the path.

PyTorch 2.13 marks TorchScript (``torch.jit.trace/save/load``) deprecated (it warns), hence
``"pt2"`` as the default; TorchScript still works and needs no extra package. ONNX needs ``onnx`` and ``onnxscript``
to export, and ``onnxruntime`` to check and serve.
"""

from __future__ import annotations

import copy
import inspect
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ..errors import ConfigError, HybridEmbedError, InvalidInputError
from ..input import Jagged
from ..modules import EmbeddingCollection
from ..modules.converted import HybridEmbeddingBag, _TableLayer
from ..utils import get_logger

__all__ = ["export", "ServedEmbeddingCollection", "FORMATS", "SUFFIX_FORMATS", "WEIGHTS_SUFFIX"]

FORMATS = ("pt2", "torchscript", "onnx")
# format=None: the format a path's suffix names (what existing code writing "model.pt" meant); pt2 otherwise
SUFFIX_FORMATS = {".pt": "torchscript", ".jit": "torchscript", ".onnx": "onnx", ".pt2": "pt2"}
WEIGHTS_SUFFIX = ":weights"  # the served weights of feature f are input f + WEIGHTS_SUFFIX

_log = get_logger("hybridembed.export")


# --- the served module: plain torch ops only ----------------------------------------------------
def _count_below(keys: torch.Tensor, k: int, q: torch.Tensor) -> torch.Tensor:
    """(K,) ascending keys (``k`` = K, a python int), (...) queries -> (...) number of keys < q.

    Branch-free binary lifting with ``bit_length(K)`` unrolled steps of gather, compare and
    select: it traces and exports to ONNX, which has no ``searchsorted``.
    """
    pos = torch.zeros_like(q)
    step = 1 << (k.bit_length() - 1) if k else 0  # the largest power of two <= K
    while step:
        cand = pos + step  # (...) take the step if keys[cand - 1] < q
        probe = keys[torch.clamp(cand - 1, max=k - 1)]
        pos = torch.where((cand <= k) & (probe < q), cand, pos)
        step >>= 1
    return pos


class _ServedTable(nn.Module):
    """One table's rows. Dense: ``weight`` (R, D). Dynamic: ``ids`` (K,) ascending and
    ``rows`` (K+1, D) whose last row is the default vector."""

    def __init__(
        self,
        name: str,
        compute_dtype: torch.dtype,
        weight: torch.Tensor | None = None,  # (R, D), a dense table
        ids: torch.Tensor | None = None,  # (K,) ascending, a dynamic table ...
        rows: torch.Tensor | None = None,  # (K, D) its rows
        default: torch.Tensor | None = None,  # (D,) what ids without a row read
    ):
        super().__init__()
        self.name = name
        self.compute_dtype = compute_dtype
        self.dynamic = weight is None
        self.branch_free = False  # dynamic ids found by _count_below, not searchsorted (set for ONNX)
        if self.dynamic:
            self.num_ids = int(ids.numel())  # K, a constant of the served graph
            self.register_buffer("ids", ids.detach().clone().to(torch.int64))  # (K,)
            self.register_buffer("rows", torch.cat([rows.detach(), default.detach().reshape(1, -1)]).clone())
        else:
            self.register_buffer("weight", weight.detach().clone())  # (R, D)

    def forward(self, ids: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """(B, H) int64 ids, (B, H) bool not-padding -> (B, H, D) rows (pad positions: any finite row)."""
        if not self.dynamic:
            return self.weight[torch.where(keep, ids, 0)].to(self.compute_dtype)
        k = self.num_ids
        if k == 0:
            return self.rows[torch.zeros_like(ids)].to(self.compute_dtype)
        # (one op where the format has it; ONNX has no searchsorted: the unrolled binary search)
        pos = _count_below(self.ids, k, ids) if self.branch_free else torch.searchsorted(self.ids, ids.contiguous())
        slot = torch.clamp(pos, max=k - 1)
        found = self.ids[slot] == ids
        return self.rows[torch.where(found, slot, k)].to(self.compute_dtype)  # row K: the default

    def extra_repr(self) -> str:
        if self.dynamic:
            return f"{self.name!r}, dynamic, rows={self.num_ids}, dim={self.rows.shape[1]}"
        return f"{self.name!r}, rows={self.weight.shape[0]}, dim={self.weight.shape[1]}"


class ServedEmbeddingCollection(nn.Module):
    """An :class:`~hybridembed.EmbeddingCollection` frozen into plain torch ops for serving.

    ``forward({feature: ids (B, H) or (B,), feature + ":weights": (B, H) float})`` returns
    ``{feature: (B, D)}`` for pooled features and ``(B, H, D)`` for sequence features
    (zero rows at pad positions). Combiners as the trained model (TensorFlow semantics:
    weighted ``mean`` divides by the bag's summed weights, ``sqrtn`` by the root of its summed
    squared weights, an empty bag pools to 0). Shared tables are stored once.
    ``lookup(feature, ids, weights=None)`` serves ``EmbeddingCollection.lookup``.

    >>> import torch, hybridembed as he
    >>> from hybridembed.api.export import ServedEmbeddingCollection
    >>> ec = he.EmbeddingCollection([he.TableConfig("video", 10, 4, combiner="mean")],
    ...                             features={"watched": "video", "browsed": "video"})
    >>> served = ServedEmbeddingCollection(ec.eval())
    >>> batch = {"watched": torch.tensor([[1, 2], [3, -1]]), "browsed": torch.tensor([4, 5])}
    >>> all(torch.allclose(served(batch)[f], ec(batch)[f]) for f in batch)
    True
    """

    def __init__(self, ec: EmbeddingCollection, rows: Mapping[str, Any] | None = None):
        """``rows``: ``{table: (R, D) weight, or (ids (K,) ascending, rows (K, D)) of a dynamic
        table}`` to serve instead of ``ec``'s own (a sharded collection's gathered tables)."""
        super().__init__()
        self.pad = ec.pad
        tables = sorted({t for t in ec.features.values()}, key=list(ec.tables).index)
        self.tables = nn.ModuleList()
        index = {}
        for name in tables:
            cfg = ec.tables[name]
            if cfg.dynamic is None:
                weight = ec.weight(name) if rows is None else rows[name]
                table = _ServedTable(name, cfg.compute_dtype, weight=weight)
            else:
                if rows is None:
                    ids, held = ec.dynamic_rows(name)
                    default = ec.storage_of(name).weight.detach()[0]  # slot 0: what ids without a row read
                else:
                    ids, held = rows[name]
                    default = torch.full((cfg.embedding_dim,), float(cfg.dynamic.default_value), dtype=cfg.dtype)
                table = _ServedTable(name, cfg.compute_dtype, ids=ids, rows=held, default=default)
            index[name] = len(self.tables)
            self.tables.append(table)
        self._index = index  # table name -> position in self.tables
        # (feature, index of its table, combiner), in the collection's feature order
        self.features = [(f, index[t], ec.tables[t].combiner) for f, t in ec.features.items()]

    def table(self, name: str) -> _ServedTable:
        """The served rows of table ``name`` (what a converted layer reading it serves from)."""
        return self.tables[self._index[name]]

    def forward(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        self._check_keys(inputs)
        return {f: self._lookup(f, t, c, inputs[f], inputs.get(f + WEIGHTS_SUFFIX)) for f, t, c in self.features}

    def lookup(self, feature: str, ids: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        """One feature alone (the served ``EmbeddingCollection.lookup``): ids (B, H) or (B,),
        weights like ids -> (B, D), or (B, H, D) for a sequence feature."""
        entry = next((e for e in self.features if e[0] == feature), None)
        if entry is None:
            names = ", ".join(f for f, _, _ in self.features)
            raise InvalidInputError(f"unknown feature {feature!r}; this collection has: {names}")
        return self._lookup(*entry, ids, weights)

    def _lookup(self, f: str, t: int, combiner: str, ids: Any, weights: Any) -> torch.Tensor:
        ids, weights = self._feature_input(f, ids, weights)  # (B, H), (B, H) | None
        table = self.tables[t]
        cdt = table.compute_dtype
        keep = ids != self.pad  # (B, H)
        rows = torch.where(keep.unsqueeze(-1), table(ids, keep), 0.0)  # (B, H, D), pads 0
        w = keep.to(cdt) if weights is None else torch.where(keep, weights.to(cdt), 0.0)  # (B, H)
        if combiner == "none":
            return rows if weights is None else rows * w.unsqueeze(-1)  # (B, H, D)
        if combiner != "sum":  # mean / sqrtn: per-bag divisor, 0 for an empty bag
            per_bag = (w if combiner == "mean" else w * w).sum(1, keepdim=True)  # (B, 1)
            nonzero = per_bag != 0
            safe = torch.where(nonzero, per_bag, torch.ones_like(per_bag))
            inv = safe.rsqrt() if combiner == "sqrtn" else safe.reciprocal()
            w = w * torch.where(nonzero, inv, torch.zeros_like(inv))  # (B, H)
        return (rows * w.unsqueeze(-1)).sum(1)  # (B, D)

    def _check_keys(self, inputs: Any) -> None:
        if not isinstance(inputs, Mapping):
            raise InvalidInputError(
                f"the served collection takes a dict {{feature: padded ids}}, got {type(inputs).__name__}"
            )
        names = [f for f, _, _ in self.features]
        allowed = set(names) | {f + WEIGHTS_SUFFIX for f in names}
        unknown = [k for k in inputs if k not in allowed]
        if unknown:
            raise InvalidInputError(f"unknown feature {unknown[0]!r}; this collection has: {', '.join(names)}")
        missing = [f for f in names if f not in inputs]
        if missing:
            raise InvalidInputError(f"missing feature {missing[0]!r}: every feature needs an input", missing[0])

    def _feature_input(self, f: str, ids: Any, weights: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not isinstance(ids, torch.Tensor) or ids.layout != torch.strided or ids.dim() not in (1, 2):
            got = type(ids).__name__ if not isinstance(ids, torch.Tensor) else f"tensor {tuple(ids.shape)} {ids.layout}"
            raise InvalidInputError(
                f"feature {f!r}: the served model takes padded ids, a (B, H) or (B,) integer tensor with "
                f"{self.pad} as padding (weights under {f + WEIGHTS_SUFFIX!r}), got {got}; "
                "give a he.Jagged in example_inputs to have it converted",
                f,
            )
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise InvalidInputError(f"feature {f!r}: ids must be integers, got dtype {ids.dtype}", f)
        checked = weights is None or torch.jit.is_tracing()  # traced shapes are symbolic; eager runs checked them
        if not checked and (not isinstance(weights, torch.Tensor) or weights.shape != ids.shape):
            got = tuple(weights.shape) if isinstance(weights, torch.Tensor) else type(weights).__name__
            raise InvalidInputError(f"feature {f!r}: weights must have the ids' shape {tuple(ids.shape)}, got {got}", f)
        if ids.dim() == 1:  # one id per sample
            ids = ids.unsqueeze(1)
            weights = None if weights is None else weights.unsqueeze(1)
        return ids.to(torch.int64), weights


class _ServedLayer(nn.Module):
    """A converted layer (:class:`~hybridembed.api.convert.HybridEmbedding` /
    ``HybridEmbeddingBag``) in plain torch ops: the same ``forward`` signature and results,
    reading its rows from the served collection's table (a shared submodule: stored once).

    Embedding: ``forward(ids (*)) -> (*, D)``. Bag: ``forward(ids (B, L)) -> (B, D)`` or
    ``forward(ids (N,), offsets (B,) or (B+1,), per_sample_weights (N,)) -> (B, D)``.
    """

    def __init__(self, layer: _TableLayer, table: _ServedTable):
        super().__init__()
        self.table = table
        self.bag = isinstance(layer, HybridEmbeddingBag)
        self.dynamic = layer.dynamic
        self.padding_idx = layer.padding_idx
        self.embedding_dim = layer.embedding_dim
        self.output_dtype = layer.output_dtype
        self.mode = getattr(layer, "mode", "sum")
        self.include_last_offset = getattr(layer, "include_last_offset", False)

    def forward(
        self, input: torch.Tensor, offsets: torch.Tensor | None = None, per_sample_weights: torch.Tensor | None = None
    ) -> torch.Tensor:
        ids = input.to(torch.int64)
        keep = torch.ones_like(ids, dtype=torch.bool) if self.padding_idx is None else ids != self.padding_idx
        if not self.bag:  # a dense table reads the padding row as it is, a dynamic one zeros
            rows = self.table(ids, torch.ones_like(keep) if not self.dynamic else keep)  # (*, D)
            if self.dynamic:
                rows = torch.where(keep.unsqueeze(-1), rows, 0.0)
            return rows.to(self.output_dtype)
        cdt = self.table.compute_dtype
        w = keep.to(cdt)  # padding entries leave their bag
        if per_sample_weights is not None:
            w = torch.where(keep, per_sample_weights.to(cdt), 0.0)
        rows = torch.where(keep.unsqueeze(-1), self.table(ids, keep), 0.0) * w.unsqueeze(-1)  # (..., D)
        if ids.dim() == 2:  # (B, L)
            pooled, counts = rows.sum(1), keep.sum(1)  # (B, D), (B,)
        else:  # (N,) ids in bags starting at offsets
            starts = offsets.to(torch.int64)
            if self.include_last_offset:
                starts = starts[:-1]
            n, b = ids.shape[0], starts.shape[0]
            marks = torch.zeros(n + 1, dtype=torch.int64, device=ids.device).index_add(
                0, starts, torch.ones_like(starts)
            )
            bag = marks.cumsum(0)[:n] - 1  # (N,) the bag of each id
            pooled = torch.zeros(b, self.embedding_dim, dtype=cdt, device=ids.device).index_add(0, bag, rows)
            counts = torch.zeros(b, dtype=torch.int64, device=ids.device).index_add(0, bag, keep.to(torch.int64))
        pooled = pooled.to(self.output_dtype)
        if self.mode == "mean":  # sum, then divide, as torch: an empty bag stays 0
            pooled = pooled / counts.clamp_min(1).unsqueeze(1).to(pooled.dtype)
        return pooled


# --- example inputs -> served inputs ---------------------------------------------------------------
def _padded(j: Jagged, pad: int, where: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A Jagged -> (ids (B, H) padded with ``pad``, weights (B, H) | None), H = longest bag (>= 1)."""
    j.check_structure(where)
    if j.values.numel() and bool((j.values == pad).any()):
        raise InvalidInputError(
            f"{where}: the Jagged holds the id {pad}, which the served model's padded input reads as padding"
        )
    ids = Jagged(j.values.long(), j.offsets).to_padded(pad, min_length=1)  # (B, H)
    if j.weights is None:
        return ids, None
    return ids, Jagged(j.weights, j.offsets).to_padded(0, min_length=1)


def _served_inputs(x: Any, path: str, pad: int) -> Any:
    """Validate example inputs (tensors in dicts / lists / tuples) and pad every Jagged."""
    if isinstance(x, torch.Tensor):
        if x.layout != torch.strided:
            raise InvalidInputError(
                f"example_inputs{path}: a {x.layout} tensor cannot be served; give padded ids (B, H) "
                f"with {pad} as padding (sparse.to_dense() with the pad value) or a he.Jagged"
            )
        return x
    if isinstance(x, Jagged):
        ids, weights = _padded(x, pad, f"example_inputs{path}")
        if weights is not None:
            raise InvalidInputError(
                f"example_inputs{path}: a weighted Jagged must be a value of a dict of features "
                f"(its weights are served as '<feature>{WEIGHTS_SUFFIX}')"
            )
        return ids
    if isinstance(x, Mapping):
        out = {}
        for k, v in x.items():
            if not isinstance(k, str):
                raise InvalidInputError(f"example_inputs{path}: dict keys must be str, got {k!r}")
            if isinstance(v, Jagged):
                ids, weights = _padded(v, pad, f"example_inputs{path}[{k!r}]")
                out[k] = ids
                if weights is not None:
                    if k + WEIGHTS_SUFFIX in x:
                        raise InvalidInputError(
                            f"example_inputs{path}: both a weighted Jagged {k!r} and {k + WEIGHTS_SUFFIX!r}"
                        )
                    out[k + WEIGHTS_SUFFIX] = weights
            else:
                out[k] = _served_inputs(v, f"{path}[{k!r}]", pad)
        return out
    if isinstance(x, (list, tuple)) and not (x and all(isinstance(v, (int, str)) for v in x)):
        return type(x)(_served_inputs(v, f"{path}[{i}]", pad) for i, v in enumerate(x))
    if isinstance(x, (list, tuple)):  # a bag of python ids
        raise InvalidInputError(
            f"example_inputs{path}: python lists of ids cannot be served; give padded ids, a (B, H) int64 tensor "
            f"with {pad} as padding (or a he.Jagged.from_lists(...), converted for you)"
        )
    raise InvalidInputError(
        f"example_inputs{path}: got {type(x).__name__}; example_inputs must be what model.forward takes, made of "
        "tensors, dicts, lists and tuples (a tuple is the positional arguments), with sparse features as "
        "padded id tensors or he.Jagged"
    )


# --- the served copy of the model -------------------------------------------------------------------
def _sharded(model: nn.Module) -> list[nn.Module]:
    """The ShardedCollections of ``model`` (a distributed model's), in module order."""
    if not any(getattr(type(m), "sharded", False) is True for m in model.modules()):
        return []
    from ..distributed.sharded import ShardedTables

    return [m for m in model.modules() if isinstance(m, ShardedTables)]


def _collections(model: nn.Module) -> list[EmbeddingCollection]:
    """The EmbeddingCollections of ``model``, and its ShardedCollections (not the shards inside them)."""
    sharded = _sharded(model)
    inside = {id(m) for sc in sharded for m in sc.modules() if m is not sc}
    return [m for m in model.modules() if isinstance(m, EmbeddingCollection) and id(m) not in inside] + sharded


def _served_model(model: nn.Module, gathered: Mapping[int, Mapping[str, Any]] | None = None) -> nn.Module:
    """A copy of ``model`` (eval mode) with every EmbeddingCollection, and every layer made by
    ``he.convert``, served by plain torch ops. ``model`` itself is not changed. ``gathered``:
    ``{id(sharded collection): {table: rows}}``, the whole tables of a distributed model."""
    gathered = gathered or {}
    memo: dict[int, Any] = {id(ec): ServedEmbeddingCollection(ec, gathered.get(id(ec))) for ec in _collections(model)}
    for layer in model.modules():
        if isinstance(layer, _TableLayer):  # its collection sits in __dict__, not among its submodules
            ec = layer.collection
            if id(ec) not in memo:
                memo[id(ec)] = ServedEmbeddingCollection(ec, gathered.get(id(ec)))
            memo[id(layer)] = _ServedLayer(layer, memo[id(ec)].table(layer.table))
    served = copy.deepcopy(model, memo)  # the memo swaps each collection and layer for its served twin
    return served.eval()


def _run_eval(model: nn.Module, args: tuple) -> Any:
    """``model(*args)`` in eval mode without gradient; every module's mode restored after."""
    modes = [(m, m.training) for m in model.modules()]
    try:
        with torch.no_grad():
            return model.eval()(*args)
    finally:
        for m, training in modes:
            m.training = training


# --- comparing outputs -----------------------------------------------------------------------------
def _flat(tree: Any) -> list[tuple[str, Any]]:
    leaves, _ = pytree.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, Jagged))
    return [(pytree.keystr(p), v) for p, v in leaves]


def _compare(expected: Any, got: Any, what: str, tol: float = 1e-5) -> None:
    """Raise HybridEmbedError where ``got`` differs from ``expected`` (trees of tensors)."""
    e, g = _flat(expected), _flat(got)
    if [p for p, _ in e] != [p for p, _ in g]:
        raise HybridEmbedError(f"export check: {what} has outputs {[p for p, _ in g]}, expected {[p for p, _ in e]}")
    for (p, ev), (_, gv) in zip(e, g):
        if isinstance(ev, Jagged):
            ev = ev.to_padded(0)
        if not isinstance(ev, torch.Tensor) or not isinstance(gv, torch.Tensor):
            if ev != gv:
                raise HybridEmbedError(f"export check: {what} output{p} is {gv!r}, expected {ev!r}")
            continue
        if ev.dim() == 3 and gv.dim() == 3 and gv.shape[0] == ev.shape[0] and gv.shape[1] > ev.shape[1]:
            tail = gv[:, ev.shape[1] :]  # a sequence served (B, H, D) against the trained (B, T, D)
            if bool(tail.any()):
                raise HybridEmbedError(
                    f"export check: {what} output{p} is {tuple(gv.shape)} with non-zero rows past the model's "
                    f"{tuple(ev.shape)}; serve sequence features right-padded"
                )
            gv = gv[:, : ev.shape[1]]
        if gv.shape != ev.shape:
            raise HybridEmbedError(
                f"export check: {what} output{p} has shape {tuple(gv.shape)}, the model's {tuple(ev.shape)}; "
                "the served model pads sequence features to the input's H (see he.export's docstring)"
            )
        ev, gv = ev.detach().cpu(), gv.detach().cpu().to(ev.dtype)
        if ev.is_floating_point():
            err = (gv - ev).abs().max().item() if ev.numel() else 0.0
            bad = not torch.allclose(gv, ev, rtol=tol, atol=tol, equal_nan=True)
        else:
            err, bad = None, not torch.equal(gv, ev)
        if bad:
            raise HybridEmbedError(
                f"export check: {what} output{p} differs from the model's (max abs error {err}); "
                "pass check=False to write it anyway"
            )


# --- names of the flat ONNX inputs and outputs --------------------------------------------------------
def _key_name(k: Any) -> str:
    if isinstance(k, pytree.MappingKey):
        return str(k.key)
    if isinstance(k, pytree.SequenceKey):
        return str(k.idx)
    return str(getattr(k, "name", k))


def _input_names(model: nn.Module, args: tuple) -> list[str]:
    try:
        params = [
            p.name
            for p in inspect.signature(model.forward).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
        ]
    except (TypeError, ValueError):
        params = []
    single_dict = len(args) == 1 and isinstance(args[0], Mapping)
    names = []
    for path, _ in pytree.tree_flatten_with_path(args)[0]:
        i = path[0].idx
        head = [] if single_dict else [params[i] if i < len(params) else f"input{i}"]
        names.append(".".join(head + [_key_name(k) for k in path[1:]]))
    return names


def _output_names(out: Any) -> list[str]:
    return [".".join(["output"] + [_key_name(k) for k in path]) for path, _ in pytree.tree_flatten_with_path(out)[0]]


# --- the two formats -----------------------------------------------------------------------------------
def _export_torchscript(served: nn.Module, args: tuple, expected: Any, path: Path, check: bool) -> None:
    with torch.no_grad():
        traced = torch.jit.trace(served, args, strict=False, check_trace=False)
        if check:
            _compare(expected, traced(*args), "the TorchScript module")
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        torch.jit.save(traced, str(tmp))
        os.replace(tmp, path)  # all or nothing
    finally:
        tmp.unlink(missing_ok=True)


def _export_pt2(served: nn.Module, args: tuple, expected: Any, path: Path, check: bool) -> None:
    """``torch.export`` of the served copy, every size of every input dynamic; saved with
    ``torch.export.save`` (served by ``torch.export.load(path).module()``)."""
    from torch.export import Dim

    dynamic = pytree.tree_map(lambda t: {i: Dim.AUTO for i in range(t.dim())}, args)
    with torch.no_grad():
        program = torch.export.export(served, args, dynamic_shapes=dynamic, strict=False)
        if check:
            _compare(expected, program.module()(*args), "the exported program (torch.export)")
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}.pt2")  # (torch.export.save wants a .pt2 name)
    try:
        torch.export.save(program, str(tmp))
        os.replace(tmp, path)  # all or nothing
    finally:
        tmp.unlink(missing_ok=True)


def _export_onnx(
    model: nn.Module, served: nn.Module, args: tuple, expected: Any, path: Path, check: bool, opset: int | None
) -> None:
    try:
        import onnxscript  # noqa: F401  (the dynamo ONNX exporter needs it)
    except ImportError as e:
        raise ConfigError(
            f"format='onnx' needs the onnx and onnxscript packages ({e}); pip install onnx onnxscript"
        ) from None
    from torch.export import Dim

    leaves = pytree.tree_leaves(args)
    dynamic = tuple({i: Dim.AUTO for i in range(t.dim())} for t in leaves)  # batch, hotness, ...
    in_names, out_names = _input_names(model, args), _output_names(expected)
    if len(set(in_names + out_names)) != len(in_names) + len(out_names):
        _log.warning("input and output names collide (%s, %s); the exporter names them", in_names, out_names)
        in_names, out_names = None, None
    flat = _Flat(served, args).eval()  # flat tensors in and out: a dict argument is not taken for kwargs
    with torch.no_grad():
        program = torch.onnx.export(
            flat,
            tuple(leaves),
            dynamo=True,
            dynamic_shapes=(dynamic,),  # for the one var-positional parameter
            input_names=in_names,
            output_names=out_names,
            opset_version=opset,
            verbose=False,
        )
    _warn_fixed_sizes(program.model_proto)
    large = _nbytes(served) > _ONNX_INLINE_LIMIT  # protobuf caps a file at 2 GB: weights go to <path>.data
    if check:
        _check_onnx(program, args, expected, large)
    # saved in a fresh folder beside path, then moved: all or nothing, and the external data
    # file keeps the name the model refers to
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        program.save(str(tmp / path.name), external_data=large)
        for f in sorted(tmp.iterdir(), key=lambda f: f.name == path.name):  # the model file last
            os.replace(f, path.parent / f.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class _Flat(nn.Module):
    """``module`` taking and returning flat tuples of tensors (the ONNX graph's inputs and outputs)."""

    def __init__(self, module: nn.Module, args: tuple):
        super().__init__()
        self.module = module
        self.spec = pytree.tree_structure(args)

    def forward(self, *leaves: torch.Tensor) -> tuple:
        out = self.module(*pytree.tree_unflatten(list(leaves), self.spec))
        return tuple(pytree.tree_leaves(out))


_ONNX_INLINE_LIMIT = 1 << 30  # bytes of weights above which ONNX weights are stored as external data


def _warn_fixed_sizes(proto: Any) -> None:
    """Warn about inputs whose size the exporter fixed to 0 or 1 (the example's)."""
    for inp in proto.graph.input:
        dims = inp.type.tensor_type.shape.dim
        fixed = [i for i, d in enumerate(dims) if not d.dim_param and d.dim_value < 2]
        if fixed:
            _log.warning(
                "ONNX input %r takes only size %s in dims %s (its size in example_inputs); give an example "
                "of size >= 2 where the size varies",
                inp.name,
                [dims[i].dim_value for i in fixed],
                fixed,
            )


def _nbytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in module.state_dict().values() if isinstance(t, torch.Tensor))


def _check_onnx(program: Any, args: tuple, expected: Any, large: bool) -> None:
    try:
        import onnxruntime as ort
    except ImportError:
        _log.info("onnxruntime is not installed: the ONNX file is written unchecked")
        return
    if large:
        _log.info("the ONNX model's weights are over %d bytes: written unchecked", _ONNX_INLINE_LIMIT)
        return
    session = ort.InferenceSession(program.model_proto.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    leaves = pytree.tree_leaves(args)
    if len(names) == len(leaves):  # every input kept, in the flattened order
        feeds = {n: t.detach().cpu().numpy() for n, t in zip(names, leaves)}
        got = [torch.from_numpy(o) for o in session.run(None, feeds)]
        _compare(expected, pytree.tree_unflatten(got, pytree.tree_structure(expected)), "the ONNX model (onnxruntime)")
    else:
        _log.info("the ONNX model dropped unused inputs: written unchecked")


# --- the entry point -------------------------------------------------------------------------------------
def export(
    model: nn.Module,
    path: str | os.PathLike,
    example_inputs: Any,
    format: str | None = None,
    *,
    check: bool = True,
    opset_version: int | None = None,
) -> Path:
    """Write ``model`` as a standalone file that serves without hybridembed installed.

    Args:
        model: any ``nn.Module`` holding :class:`~hybridembed.EmbeddingCollection` (s) or
            layers made by :func:`~hybridembed.convert` (or one itself). Not modified: a
            copy is exported, in eval mode; the model trains on after it as if never exported.
        path: the file to write (its directory must exist); replaced atomically.
        example_inputs: what ``model.forward`` takes: a tensor or dict (the one argument) or
            a tuple of positional arguments; sparse features as padded ``(B, H)`` id
            tensors (-1 padding) or :class:`~hybridembed.Jagged` (see the module docstring
            for the served input contract).
        format: ``"pt2"`` (``torch.export``, served by ``torch.export.load(path).module()``),
            ``"torchscript"`` (``torch.jit.load``; deprecated by PyTorch) or ``"onnx"`` (onnxruntime).
            Default: from ``path``'s suffix (:data:`SUFFIX_FORMATS`: ``.pt`` TorchScript, ``.onnx``
            ONNX), ``"pt2"`` for any other.
        check: compare the served copy and the written artifact with the model on
            ``example_inputs`` (tolerance 1e-5) and refuse to write on a mismatch.
        opset_version: the ONNX opset (default: the exporter's).

    Returns:
        The path written.

    Usage::

        he.export(model, "ranker.pt2", ({"watched": ids, "user": user}, dense))
        he.export(model, "ranker.pt", ({"watched": ids, "user": user}, dense))  # TorchScript
        he.export(model, "ranker.onnx", ({"watched": ids, "user": user}, dense), format="onnx")
    """
    if format is None:
        format = SUFFIX_FORMATS.get(Path(path).suffix.lower(), "pt2")
    if format not in FORMATS:
        raise ConfigError(f"unknown export format {format!r}; allowed: {', '.join(FORMATS)}")
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"export path {str(path)!r} is a directory; give a file name, e.g. {str(path / 'model')!r}")
    if not path.parent.is_dir():
        raise ConfigError(
            f"export path {str(path)!r}: directory {str(path.parent)!r} does not exist; create it first "
            "(os.makedirs(..., exist_ok=True))"
        )
    from ..distributed.shard import unwrap

    inner = unwrap(model)
    sharded = _sharded(inner)
    pads = {ec.pad for ec in _collections(inner)}
    if len(pads) > 1:
        raise ConfigError(f"the model's EmbeddingCollections use different pad values {sorted(pads)}; export needs one")
    pad = pads.pop() if pads else -1
    if isinstance(example_inputs, tuple):  # the positional arguments
        args = example_inputs
        served_args = tuple(_served_inputs(a, f"[{i}]", pad) for i, a in enumerate(args))
    else:  # the one argument
        args, served_args = (example_inputs,), (_served_inputs(example_inputs, "", pad),)

    if sharded:
        return _export_distributed(model, inner, sharded, path, args, served_args, format, check, opset_version)
    # the model first: its validation refuses bad example ids (the served copy does not
    # validate); eval mode, no gradient, modes restored: no dynamic row made, nothing changed
    expected = _run_eval(model, args)
    _write_served(model, _served_model(model), served_args, expected, path, format, check, opset_version)
    _log.info(
        "exported %s (%d embedding collections) to %s; inputs: %s",
        format,
        len(_collections(model)),
        path,
        ", ".join(_input_names(model, served_args)),
    )
    return path


def _write_served(model, served, served_args, expected, path, format, check, opset_version) -> None:
    """Run the served copy, compare it with ``expected`` (the model's outputs) and write it."""
    for m in served.modules():
        if isinstance(m, _ServedTable):
            m.branch_free = format == "onnx"
    with torch.no_grad():
        out = served(*served_args)
    if check:
        _compare(expected, out, "the served model")
    if format == "pt2":
        _export_pt2(served, served_args, out, path, check)
    elif format == "torchscript":
        _export_torchscript(served, served_args, out, path, check)
    else:
        _export_onnx(model, served, served_args, out, path, check, opset_version)


def _export_distributed(model, inner, sharded, path, args, served_args, format, check, opset_version) -> Path:
    """Every rank: the distributed model run on its ``args`` and its tables gathered (collectives);
    rank 0: the served copy checked against its outputs and written; every rank raises if it failed.

    The whole tables are gathered into every process (``ShardedCollection.gather_table``): this
    serves models whose tables fit one process, as the exported file must."""
    import torch.distributed as dist

    expected = _run_eval(model, args)  # (every rank: the lookups are an exchange)
    with torch.no_grad():
        gathered = {}
        for sc in sharded:
            gathered[id(sc)] = {name: sc.gather_table(name) for name in sc.tables}
    error = None
    if sharded[0].rank == 0:
        try:
            served = _served_model(inner, gathered)
            _write_served(inner, served, served_args, expected, path, format, check, opset_version)
        except Exception as e:  # noqa: BLE001 - raised below, after every rank heard of it
            error = e
    # (parameter servers: the trainers export, the servers take no part)
    group = getattr(sharded[0], "trainers_group", None) or sharded[0].process_group
    report: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(report, None if error is None else f"{type(error).__name__}: {error}", group=group)
    if error is not None:
        raise error
    if report[0] is not None:
        raise HybridEmbedError(f"export failed on rank 0, which writes the file: {report[0]}")
    if sharded[0].rank == 0:
        _log.info("exported %s (%d sharded collections, gathered) to %s", format, len(sharded), path)
    return path
