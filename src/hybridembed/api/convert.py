"""``he.convert``: swap a model's ``nn.Embedding`` / ``nn.EmbeddingBag`` for hybridembed tables.

Shape legend: ``B`` bags, ``L`` ids per bag (2-D input), ``N`` ids, ``D`` dim.

Two lines change in a training script::

    model = he.convert(model)                                   # after building the model
    opt = he.wrap_optimizer(torch.optim.Adagrad(model.parameters(), lr=0.05), model)

What ``convert`` does, in order:

1. Finds every ``nn.Embedding`` and ``nn.EmbeddingBag`` (nested, in ``ModuleList`` /
   ``ModuleDict``, in subclassed models). A layer object used in several places, or
   several layers sharing one ``weight`` Parameter, become ONE table.
2. Refuses, with a :class:`~hybridembed.ConfigError` naming the layer and the setting,
   what has no sparse equivalent: ``max_norm``, ``scale_grad_by_freq=True``,
   ``mode="max"``, a frozen weight (``requires_grad=False``), a weight tied to a
   non-embedding layer (e.g. an output projection), a subclass with its own ``forward``.
   Keep such a layer as it is with ``tables={path: None}``.
3. Builds one :class:`ConvertedCollection` (an :class:`~hybridembed.EmbeddingCollection`)
   holding all tables, registered on the model as ``model.hybridembed`` (on the first
   converted layer when the model is a ``Sequential`` / ``ModuleList`` / ``ModuleDict``,
   whose children a forward iterates over, or is itself an embedding layer). Its grouping
   rule is the collection's: tables of the same dim, dtype, storage kind (dense or
   dynamic), optimizer override and :class:`~hybridembed.Dynamic` settings share one
   storage, so the optimizer updates each group once per step (``model.hybridembed.groups``).
4. Copies every layer's current rows into its (dense) table, exactly, and replaces each
   layer by a :class:`HybridEmbedding` / :class:`HybridEmbeddingBag` that keeps its
   ``forward`` signature and reads its table from the collection.

The model is modified in place and returned (when the model itself is an embedding layer,
the returned module replaces it: use the return value).

``state_dict()`` keys stay those of the original: a converted dense layer writes
``<path>.weight`` (N, D), so plain checkpoints of the unconverted model still load. A
layer made dynamic writes ``<path>.ids`` / ``.weight`` / ``.last_seen`` / ``.freq`` /
``.stats`` / ``.clock`` (its rows by id); it also loads a plain ``<path>.weight`` (N, D)
as ids ``0..N-1``. The collection itself writes nothing, so nothing is duplicated. The
embedding rows are parameters of ``model.hybridembed`` (one per group); per-layer
optimizer settings go through ``tables={path: {"optimizer": he.optim.Adagrad(lr=...)}}``.

``tables=`` maps a layer's module path (any of its paths when shared) to one of:

- a dict of :class:`~hybridembed.TableConfig` field overrides: ``name``, ``dtype``,
  ``init``, ``optimizer``, ``dynamic``, e.g. ``{"user_emb": {"dynamic": he.Dynamic(capacity=10**6)}}``;
- a whole ``TableConfig`` (its ``embedding_dim`` must be the layer's; ``num_embeddings``
  the layer's or None when dynamic; ``combiner`` "sum": the layer's mode does the pooling);
- ``None``: leave this layer an ordinary torch layer.

A layer made dynamic starts empty: an id's row is made on first sight from the table's
row-keyed initializer (default ``he.init.normal()``, the ``nn.Embedding`` default), so its
trained rows are NOT carried over (a warning says so) unless ``copy_dynamic_rows=True``,
which loads them as ids ``0..N-1`` (they must fit the capacity).

Semantics kept: ``padding_idx`` (``nn.Embedding``: its position reads the row as it is
and sends it no gradient; a dynamic table reads zeros there. ``nn.EmbeddingBag``: entries
equal to it leave the bag, and the mean's count), ``mode`` sum/mean, ``per_sample_weights``
(mode sum, as torch), ``include_last_offset``, the output dtype. Gradients of converted
tables are always row-sparse, whatever ``sparse=`` said (the flag is kept on the module):
with SGD and Adagrad (no weight decay, no momentum) the result equals the dense
optimizer's; with Adam it equals ``torch.optim.SparseAdam`` (see :mod:`hybridembed.optim`).
Each converted layer is one lookup call; a step's calls on one group add up to one
sparse gradient and one optimizer update. The collection follows the model's
``train()`` / ``eval()`` (dynamic tables make rows only in training).

    >>> import torch, hybridembed as he
    >>> class Model(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.user = torch.nn.Embedding(100, 8, padding_idx=0)
    ...         self.items = torch.nn.EmbeddingBag(50, 8, mode="mean")
    ...         self.mlp = torch.nn.Linear(16, 1)
    ...     def forward(self, user, items):  # (B,), (B, L) -> (B, 1)
    ...         return self.mlp(torch.cat([self.user(user), self.items(items)], 1))
    >>> model = Model()
    >>> user, items = torch.tensor([0, 7]), torch.tensor([[1, 2], [3, 4]])
    >>> before = model(user, items)
    >>> model = he.convert(model)
    >>> type(model.items).__name__, model.hybridembed.groups
    ('HybridEmbeddingBag', [['user', 'items']])
    >>> torch.equal(model(user, items), before)
    True
    >>> sorted(model.state_dict())
    ['items.weight', 'mlp.bias', 'mlp.weight', 'user.weight']
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from .. import init as _init
from ..config import STORAGE_DTYPES, TableConfig
from ..errors import ConfigError, InvalidInputError
from ..input import Jagged, bag_index, offsets_from_lengths
from ..modules import EmbeddingCollection
from ..storage import serial
from ..utils import get_logger

__all__ = ["convert", "ConvertedCollection", "HybridEmbedding", "HybridEmbeddingBag", "COLLECTION_ATTR"]

log = get_logger(__name__)

COLLECTION_ATTR = "hybridembed"  # where convert registers the collection on the model
_OVERRIDABLE = ("name", "dtype", "init", "optimizer", "dynamic")


class ConvertedCollection(EmbeddingCollection):
    """The tables of a converted model (an :class:`~hybridembed.EmbeddingCollection`).

    The converted layers write its tables' ``state_dict`` entries under their own paths
    (``<layer path>.weight``), so the collection itself writes none and duplicates nothing.
    """

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        return

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        if strict:
            for key in state_dict:
                if key.startswith(prefix) and key[len(prefix) :].split(".", 1)[0] not in self._modules:
                    unexpected.append(key)


class _TableLayer(nn.Module):
    """What both converted layers share: the table they read and their ``state_dict``."""

    def __init__(self, collection: EmbeddingCollection, table: str, layer: nn.Module):
        super().__init__()
        self.__dict__["_collection"] = collection  # not a submodule: the model owns it once
        self.table = table
        cfg = collection.tables[table]
        self.dynamic = cfg.dynamic is not None
        self.num_embeddings = None if self.dynamic else layer.num_embeddings
        self.embedding_dim = layer.embedding_dim
        self.padding_idx = layer.padding_idx
        self.sparse = layer.sparse  # kept for reference; converted tables always get sparse gradients
        self.max_norm = None
        self.norm_type = layer.norm_type
        self.scale_grad_by_freq = False
        self.output_dtype = layer.weight.dtype

    @property
    def collection(self) -> EmbeddingCollection:
        """The collection holding this layer's table."""
        return self._collection

    def __getattr__(self, name: str) -> Any:
        if name == "weight":  # a view of the table, as nn.Embedding.weight (writes under no_grad go through)
            if self.__dict__.get("dynamic"):
                raise AttributeError(
                    f"table {self.table!r} is dynamic and has no fixed weight matrix; read its rows with "
                    f"model.{COLLECTION_ATTR}.dynamic_rows({self.table!r})"
                )
            return self._collection.weight(self.table)
        return super().__getattr__(name)

    def _lookup(self, ids: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        out = self._collection.lookup(self.table, Jagged(ids, offsets, weights))  # (B, D)
        return out if out.dtype == self.output_dtype else out.to(self.output_dtype)

    def _check(self, j: Jagged) -> None:
        j.check_structure(self.table)
        if not bool(j.ok(self.num_embeddings, allow_negative=self.dynamic)):
            j.raise_first_error(self.table, self.num_embeddings, allow_negative=self.dynamic)

    # --- state_dict: the table's entries under this layer's path (storage.serial) -------------
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        for k, v in serial.table_entry(self._collection.storage_of(self.table), self.table, keep_vars).items():
            destination[prefix + k] = v

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        storage = self._collection.storage_of(self.table)
        mine = {
            k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix) and "." not in k[len(prefix) :]
        }
        entry = mine
        if self.dynamic and set(mine) == {"weight"}:  # a plain (N, D) matrix from the unconverted model: ids 0..N-1
            w = mine["weight"]
            if not isinstance(w, torch.Tensor) or w.dim() != 2 or w.shape[1] != self.embedding_dim:
                errors.append(f"size mismatch for {prefix}weight: expected (N, {self.embedding_dim}) rows")
                return
            entry = serial.dense_as_dynamic(storage, w)
        lacking, problems = serial.check_entry(storage, self.table, entry, prefix)
        missing.extend(lacking)
        errors.extend(problems)
        if not lacking and not problems:
            serial.load_entry(storage, self.table, entry)
        if strict and not self.dynamic:  # a dynamic table's entry is whatever its storage saves
            unexpected.extend(prefix + k for k in mine if k != "weight")

    def extra_repr(self) -> str:
        size = "dynamic" if self.dynamic else str(self.num_embeddings)
        s = f"{size}, {self.embedding_dim}, table={self.table!r}"
        return s + ("" if self.padding_idx is None else f", padding_idx={self.padding_idx}")


class HybridEmbedding(_TableLayer):
    """A converted ``nn.Embedding``: ``forward(ids (*)) -> (*, D)``, any shape of int ids.

    Attributes as ``nn.Embedding`` (``num_embeddings`` is None when dynamic, ``weight`` a
    view of the table's rows) plus ``table`` and ``collection``.
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        shape = tuple(input.shape)
        ids = input.reshape(-1)  # (N,)
        n, dev = ids.numel(), ids.device
        keep = None if self.padding_idx is None else ids != self.padding_idx  # (N,)
        if keep is None or bool(keep.all()):
            rows = self._lookup(ids, torch.arange(n + 1, device=dev))  # (N, D): bags of one
            return rows.reshape(*shape, self.embedding_dim)
        self._check(Jagged(ids, torch.tensor([0, n], device=dev)))
        kept = ids[keep]  # (K,)
        rows = self._lookup(kept, torch.arange(kept.numel() + 1, device=dev))  # (K, D)
        if self.dynamic:
            pad = rows.new_zeros(self.embedding_dim)
        else:
            pad = self._collection.weight(self.table)[self.padding_idx].to(rows.dtype)  # (D,), no gradient
        out = pad.expand(n, self.embedding_dim).index_put((keep,), rows)  # (N, D)
        return out.reshape(*shape, self.embedding_dim)


class HybridEmbeddingBag(_TableLayer):
    """A converted ``nn.EmbeddingBag``: ``forward(input, offsets=None, per_sample_weights=None) -> (B, D)``.

    ``input`` is (B, L) ids with ``offsets=None``, or (N,) ids with (B,) offsets (B+1 with
    ``include_last_offset``); ``per_sample_weights`` has the shape of ``input`` (mode sum
    only, as torch). Entries equal to ``padding_idx`` leave their bag (and the mean's count).
    An empty bag pools to 0.
    """

    def __init__(self, collection: EmbeddingCollection, table: str, layer: nn.EmbeddingBag):
        super().__init__(collection, table, layer)
        self.mode = layer.mode
        self.include_last_offset = layer.include_last_offset

    def forward(
        self, input: torch.Tensor, offsets: torch.Tensor | None = None, per_sample_weights: torch.Tensor | None = None
    ) -> torch.Tensor:
        psw = per_sample_weights
        if psw is not None and self.mode != "sum":
            raise InvalidInputError(
                f"table {self.table!r}: per_sample_weights are only supported for mode='sum' (as in torch), "
                f"this layer has mode={self.mode!r}",
                self.table,
            )
        if psw is not None and (not isinstance(psw, torch.Tensor) or psw.shape != input.shape):
            got = tuple(psw.shape) if isinstance(psw, torch.Tensor) else type(psw).__name__
            raise InvalidInputError(
                f"table {self.table!r}: per_sample_weights must have the shape of input {tuple(input.shape)}, got {got}",
                self.table,
            )
        dev = input.device
        if input.dim() == 2:
            if offsets is not None:
                raise InvalidInputError(f"table {self.table!r}: offsets must be None when input is 2-D (B, L)")
            b, length = input.shape
            ids = input.reshape(-1)  # (B*L,)
            offsets = torch.arange(b + 1, device=dev) * length  # (B+1,)
            psw = None if psw is None else psw.reshape(-1)
        elif input.dim() == 1:
            if not isinstance(offsets, torch.Tensor) or offsets.dim() != 1:
                raise InvalidInputError(
                    f"table {self.table!r}: 1-D input needs 1-D offsets (B,) giving where each bag starts"
                )
            ids = input
            offsets = offsets.to(torch.int64)
            if not self.include_last_offset:
                offsets = torch.cat([offsets, torch.tensor([ids.numel()], dtype=torch.int64, device=offsets.device)])
        else:
            raise InvalidInputError(
                f"table {self.table!r}: input must be (B, L) or (N,) with offsets, got shape {tuple(input.shape)}"
            )
        if self.padding_idx is not None and not bool((ids != self.padding_idx).all()):
            ids, offsets, psw = self._drop_padding(ids, offsets, psw)
        pooled = self._lookup(ids, offsets, psw)  # (B, D), summed
        if self.mode == "mean":  # sum, then divide, as torch: an empty bag stays 0
            counts = (offsets[1:] - offsets[:-1]).clamp_min(1)  # (B,)
            pooled = pooled / counts.unsqueeze(1).to(pooled.dtype)
        return pooled

    def _drop_padding(self, ids: torch.Tensor, offsets: torch.Tensor, psw: torch.Tensor | None):
        """Entries equal to padding_idx leave their bag: (N,), (B+1,), (N,) -> (K,), (B+1,), (K,)."""
        self._check(Jagged(ids, offsets, psw))
        keep = ids != self.padding_idx  # (N,)
        b = offsets.numel() - 1
        kept = torch.bincount(bag_index(offsets, ids.numel())[keep], minlength=b)  # (B,)
        return ids[keep], offsets_from_lengths(kept), None if psw is None else psw[keep]

    def extra_repr(self) -> str:
        return super().extra_repr() + f", mode={self.mode!r}"


# --- finding and checking layers ---------------------------------------------------------------
_LAYERS = {nn.Embedding: HybridEmbedding, nn.EmbeddingBag: HybridEmbeddingBag}
_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


class _Found:
    """One embedding layer object: where it sits (every path) and in which parents."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.paths: list[str] = []
        self.parents: list[tuple[nn.Module, str]] = []


def _find_layers(model: nn.Module) -> tuple[dict[int, _Found], dict[int, list[str]]]:
    """Embedding layers by id (first-seen order) and, for every other module's parameters, its paths."""
    found: dict[int, _Found] = {}
    other_params: dict[int, list[str]] = {}

    def walk(m: nn.Module, path: str, stack: tuple[int, ...]) -> None:
        for name, p in m._parameters.items():
            if p is not None:
                other_params.setdefault(id(p), []).append(f"{path}.{name}" if path else name)
        for name, child in m._modules.items():
            if child is None or id(child) in stack:
                continue
            cpath = f"{path}.{name}" if path else name
            if isinstance(child, tuple(_LAYERS)):
                f = found.setdefault(id(child), _Found(child))
                f.paths.append(cpath)
                f.parents.append((m, name))
            else:
                walk(child, cpath, (*stack, id(child)))

    walk(model, "", (id(model),))
    return found, other_params


def _layer_kind(m: nn.Module) -> str:
    return "nn.EmbeddingBag" if isinstance(m, nn.EmbeddingBag) else "nn.Embedding"


def _check_layer(path: str, m: nn.Module, other_params: dict[int, list[str]]) -> None:
    kind = _layer_kind(m)
    keep = f"keep it a torch layer with he.convert(model, tables={{{path!r}: None}})"
    base = nn.EmbeddingBag if isinstance(m, nn.EmbeddingBag) else nn.Embedding
    if type(m).forward is not base.forward:
        raise ConfigError(
            f"layer {path!r} ({type(m).__name__}, a subclass of {kind}) has its own forward, which hybridembed "
            f"cannot reproduce; {keep}"
        )

    def refuse(setting: str, why: str) -> ConfigError:
        return ConfigError(f"layer {path!r} ({kind}): {setting} has no sparse equivalent ({why}); {keep}")

    if m.max_norm is not None:
        raise refuse(f"max_norm={m.max_norm}", "it renormalises rows in place during the forward; set max_norm=None")
    if m.scale_grad_by_freq:
        raise refuse("scale_grad_by_freq=True", "set it to False")
    if isinstance(m, nn.EmbeddingBag) and m.mode not in ("sum", "mean"):
        raise refuse(f"mode={m.mode!r}", "converted bags pool with 'sum' or 'mean'")
    if not m.weight.requires_grad:
        raise ConfigError(f"layer {path!r} ({kind}) is frozen (weight.requires_grad=False); {keep}")
    if m.weight.dtype not in STORAGE_DTYPES:
        raise ConfigError(f"layer {path!r} ({kind}): weight dtype {m.weight.dtype} is not supported; {keep}")
    tied = other_params.get(id(m.weight))
    if tied:
        raise ConfigError(
            f"layer {path!r} ({kind}): its weight is also the parameter {tied[0]!r} of a non-embedding layer "
            f"(tied weights); a table's rows cannot be shared with a dense layer; {keep}"
        )
    if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._state_dict_hooks:
        log.warning("layer %r (%s) has hooks; they stay on the replaced torch module and will not run", path, kind)


def _table_name(path: str, taken: set[str]) -> str:
    base = path.replace(".", "__") or "embedding"
    name, k = base, 2
    while name in taken:
        name, k = f"{base}_{k}", k + 1
    return name


def _table_config(
    path: str, weight: torch.Tensor, override: TableConfig | Mapping[str, Any] | None, taken: set[str]
) -> TableConfig:
    n, d = weight.shape
    if isinstance(override, TableConfig):
        if override.embedding_dim != d:
            raise ConfigError(f"tables[{path!r}]: embedding_dim {override.embedding_dim} differs from the layer's {d}")
        if override.dynamic is None and override.num_embeddings != n:
            raise ConfigError(
                f"tables[{path!r}]: num_embeddings {override.num_embeddings} differs from the layer's {n} "
                "(only a dynamic table may change it, to None)"
            )
        if override.combiner != "sum":
            raise ConfigError(
                f"tables[{path!r}]: combiner must be 'sum' (got {override.combiner!r}); the layer's mode does the pooling"
            )
        return override
    fields = dict(override or {})
    bad = sorted(set(fields) - set(_OVERRIDABLE))
    if bad:
        raise ConfigError(
            f"tables[{path!r}]: cannot override {', '.join(bad)} (set by the layer); allowed: {', '.join(_OVERRIDABLE)}"
        )
    dynamic = fields.get("dynamic")
    # a dense table is filled from the layer, so its initializer is never used: zeros is the cheapest
    default_init = _init.normal() if dynamic is not None else _init.zeros()
    return TableConfig(
        name=fields.get("name") or _table_name(path, taken),
        num_embeddings=None if dynamic is not None else n,
        embedding_dim=d,
        dtype=fields.get("dtype", weight.dtype),
        init=fields.get("init", default_init),
        optimizer=fields.get("optimizer"),
        dynamic=dynamic,
    )


def _collection_attr(model: nn.Module) -> str:
    name, k = COLLECTION_ATTR, 1
    while hasattr(model, name):
        name, k = f"{COLLECTION_ATTR}_{k}", k + 1
    return name


def convert(
    model: nn.Module,
    tables: Mapping[str, TableConfig | Mapping[str, Any] | None] | None = None,
    *,
    seed: int = 0,
    copy_dynamic_rows: bool = False,
) -> nn.Module:
    """Replace every ``nn.Embedding`` / ``nn.EmbeddingBag`` of ``model`` by a hybridembed layer.

    Args:
        model: any ``nn.Module``; modified in place.
        tables: per-layer overrides by module path (see the module docstring): a dict of
            ``TableConfig`` fields (``name``, ``dtype``, ``init``, ``optimizer``, ``dynamic``),
            a whole ``TableConfig``, or None to leave that layer unconverted.
        seed: seed of the row-keyed initializer of dynamic tables' new rows.
        copy_dynamic_rows: load a layer made dynamic with its current rows as ids ``0..N-1``.

    Returns the converted model (``model`` itself unless it is an embedding layer). The
    tables live in ``model.hybridembed`` (a :class:`ConvertedCollection`). Raises
    :class:`~hybridembed.ConfigError` naming the layer for settings with no sparse equivalent.
    """
    if not isinstance(model, nn.Module):
        raise ConfigError(f"convert needs an nn.Module, got {type(model).__name__}")
    if tables is not None and not isinstance(tables, Mapping):
        raise ConfigError(
            f"tables must be a mapping {{layer path: TableConfig | dict of fields | None}}, got {type(tables).__name__}"
        )
    overrides = dict(tables or {})
    if isinstance(model, tuple(_LAYERS)):  # the model is one layer: convert it inside a holder
        holder = nn.Module()
        holder.add_module("layer", model)
        converted = convert(
            holder,
            {f"layer.{k}" if k else "layer": v for k, v in overrides.items()},
            seed=seed,
            copy_dynamic_rows=copy_dynamic_rows,
        )
        layer = converted.layer
        if isinstance(layer, _TableLayer):
            layer.add_module(COLLECTION_ATTR, layer.collection)
        return layer

    found, other_params = _find_layers(model)
    by_path = {p: f for f in found.values() for p in f.paths}
    unknown = sorted(set(overrides) - set(by_path))
    if unknown:
        raise ConfigError(
            f"tables=: no nn.Embedding / nn.EmbeddingBag at {', '.join(map(repr, unknown))}; "
            f"the model's embedding layers: {', '.join(map(repr, by_path)) or 'none'}"
        )
    # one table per weight Parameter: a shared layer object, or layers sharing a weight
    by_weight: dict[int, list[_Found]] = {}
    for f in found.values():
        by_weight.setdefault(id(f.module.weight), []).append(f)

    plans = []  # (layers of one table, its config)
    taken: set[str] = set()
    for layers in by_weight.values():
        paths = [p for f in layers for p in f.paths]
        given = {p: overrides[p] for p in paths if p in overrides}
        values = list(given.values())
        if any(v is not values[0] and v != values[0] for v in values[1:]):
            raise ConfigError(
                f"tables=: {', '.join(map(repr, given))} are one shared table but got different overrides; give one"
            )
        if given and values[0] is None:
            log.info("layer %s left unconverted (tables=None)", ", ".join(map(repr, paths)))
            continue
        for f in layers:
            _check_layer(f.paths[0], f.module, other_params)
        weight = layers[0].module.weight
        cfg = _table_config(paths[0], weight, values[0] if given else None, taken)
        if cfg.name in taken:
            raise ConfigError(f"tables=: table name {cfg.name!r} is used twice; give each table its own name")
        taken.add(cfg.name)
        plans.append((layers, cfg))
    if not plans:
        log.info("convert: no nn.Embedding / nn.EmbeddingBag to convert")
        return model

    devices = {layers[0].module.weight.device for layers, _ in plans}
    if len(devices) > 1:
        raise ConfigError(
            f"convert: embedding layers sit on several devices ({', '.join(map(str, devices))}); "
            "move the model to one device first"
        )
    collection = ConvertedCollection([cfg for _, cfg in plans], seed=seed, device=devices.pop())
    with torch.no_grad():
        for layers, cfg in plans:
            weight = layers[0].module.weight.detach()
            paths = [p for f in layers for p in f.paths]
            if cfg.dynamic is None:
                collection.weight(cfg.name).copy_(weight)
            elif copy_dynamic_rows:
                storage = collection.storage_of(cfg.name)
                cap = cfg.dynamic.capacity
                if cap is not None and weight.shape[0] > cap:
                    raise ConfigError(
                        f"layer {paths[0]!r}: copy_dynamic_rows needs {weight.shape[0]} rows but "
                        f"Dynamic(capacity={cap}); raise the capacity or pass copy_dynamic_rows=False"
                    )
                storage.load_table(cfg.name, serial.dense_as_dynamic(storage, weight))
            else:
                log.warning(
                    "layer %r is now the dynamic table %r: its %d current rows are not carried over (new ids get "
                    "rows from the table's initializer); pass copy_dynamic_rows=True to keep them",
                    paths[0],
                    cfg.name,
                    weight.shape[0],
                )
    owner_path = ""
    if not isinstance(model, _CONTAINERS):
        attr = _collection_attr(model)
        model.add_module(attr, collection)
    for i, (layers, cfg) in enumerate(plans):
        for j, f in enumerate(layers):
            new = _LAYERS[_base(f.module)](collection, cfg.name, f.module)
            new.train(f.module.training)
            if i == j == 0 and isinstance(model, _CONTAINERS):  # a container's forward iterates its children
                attr, owner_path = _collection_attr(new), f.paths[0] + "."
                new.add_module(attr, collection)
            for parent, name in f.parents:
                setattr(parent, name, new)
    log.info(
        "converted %d embedding layer(s) into %d table(s) in %d group(s) at %s%s: %s",
        sum(len(layers) for layers, _ in plans),
        len(plans),
        len(collection.groups),
        owner_path,
        attr,
        collection.groups,
    )
    return model


def _base(m: nn.Module) -> type:
    return nn.EmbeddingBag if isinstance(m, nn.EmbeddingBag) else nn.Embedding
