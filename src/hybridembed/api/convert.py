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
  ``init``, ``optimizer``, ``dynamic``, ``tiered``, e.g. ``{"user_emb": {"dynamic": he.Dynamic(capacity=10**6)}}``;
- a whole ``TableConfig`` (its ``embedding_dim`` must be the layer's; ``num_embeddings``
  the layer's or None when dynamic; ``combiner`` "sum": the layer's mode does the pooling);
- ``None``: leave this layer an ordinary torch layer.

``dynamic=True`` (or a :class:`~hybridembed.Dynamic`, or layer path patterns) makes layers
dynamic without listing them. A layer made dynamic starts empty: an id's row is made on
first sight from the table's row-keyed initializer, by default one fitted to the layer's
current weights (:func:`fitted_init`: the same normal or uniform distribution, so a model
initialised with std 1e-4 keeps std 1e-4), so its trained rows are NOT carried over (the
summary line says so) unless ``copy_dynamic_rows=True``, which loads them as ids ``0..N-1``
(they must fit the capacity).

``tiered=he.Tiered(path, cache_rows)`` puts every dense table (every layer not made dynamic)
on disk with a cache of ``cache_rows`` rows per group (:class:`~hybridembed.Tiered`); a
layer's own ``{"tiered": ...}`` entry wins. Their rows are written to the files a range at a
time and the layer's weight memory is handed back as they go. A layer made dynamic takes
``{"dynamic": he.Dynamic(), "tiered": ...}``: its rows beyond the cache spill to disk.

Semantics kept: ``padding_idx`` (``nn.Embedding``: its position reads the row as it is
and sends it no gradient; a dynamic table reads zeros there. ``nn.EmbeddingBag``: entries
equal to it leave the bag, and the mean's count), ``mode`` sum/mean, ``per_sample_weights``
(mode sum, as torch), ``include_last_offset``, the output dtype. Gradients of converted
tables are always row-sparse, whatever ``sparse=`` said (the flag is kept on the module):
with SGD and Adagrad (no weight decay, no momentum) the result equals the dense
optimizer's; with Adam it equals ``torch.optim.SparseAdam`` (see :mod:`hybridembed.optim`).
Grouped lookups (``grouped=True``, the default): while the model's forward runs, each
converted layer's lookup is queued and returns a tensor that knows its shape but not yet its
values; the first use of any of them runs every queued lookup in one kernel call per group
of tables (:mod:`hybridembed.modules.grouped`). A model that calls 52 layers one by one
makes 2 kernel calls (one per group), with one validation sync, and the optimizer updates
each group once. Results and gradients are those of per-layer calls. Ids are checked for
dtype and device when the layer is called, for range when the queue runs (a bad id is
reported at the first use of an output, naming the layer's table, and changes nothing). A
layer called outside the model's forward, and tracing or compiling, look up at once;
``grouped=False`` makes every call a lookup of its own. The collection follows the model's
``train()`` / ``eval()`` (dynamic tables make rows only in training).

Traps reported: ``convert`` names the model attributes (a regularisation list) and torch
optimizers that still hold the replaced ``nn.Embedding`` weights (``he.wrap_optimizer``
drops them from an optimizer built before ``convert``); a table gradient that no optimizer
step consumed warns once, at the next forward, saying to call ``he.wrap_optimizer``; a
dense gradient on a table (an L2 term over ``layer.weight``) is refused at the optimizer
step, before any update, naming ``weight_decay`` (applied to the rows a step touches) as
the fix.

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

import fnmatch
import gc
import math
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from .. import init as _init
from ..config import STORAGE_DTYPES, Dynamic, TableConfig, Tiered
from ..errors import ConfigError
from ..modules.converted import (
    COLLECTION_ATTR,
    ConvertedCollection,
    HybridEmbedding,
    HybridEmbeddingBag,
    _QueueHook,
    _TableLayer,
)
from ..modules.grouped import LookupQueue
from ..storage import serial
from ..storage.dense import rows_from_caller
from ..utils import discard_pages, get_logger, release_free_memory

__all__ = ["convert", "fitted_init", "ConvertedCollection", "HybridEmbedding", "HybridEmbeddingBag", "COLLECTION_ATTR"]

log = get_logger(__name__)

_OVERRIDABLE = ("name", "dtype", "init", "optimizer", "dynamic", "tiered")


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
        warnings.warn(
            f"layer {path!r} ({kind}) has hooks; they stay on the replaced torch module and will not run", stacklevel=3
        )


def _table_name(path: str, taken: set[str]) -> str:
    base = path.replace(".", "__") or "embedding"
    name, k = base, 2
    while name in taken:
        name, k = f"{base}_{k}", k + 1
    return name


def fitted_init(weight: torch.Tensor, sample: int = 1 << 20) -> _init.Init:
    """The row-keyed initializer closest to how ``weight`` (N, D) was initialised: uniform on
    its range when its values look uniform (excess kurtosis below -0.9; a uniform's is -1.2, a
    normal's 0), else normal with its mean and std; constant when every value is equal. Reads
    at most ``sample`` values (evenly spaced rows). The parameters are rounded to two
    significant digits (a mean to 1% of the std), so layers initialised alike get one
    initializer and their dynamic rows are made in one pass."""
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point() or weight.numel() == 0:
        raise ConfigError(f"fitted_init needs a non-empty floating-point weight tensor, got {weight!r}")
    w = weight.detach().reshape(-1)
    if w.numel() > sample:
        w = w[:: -(-w.numel() // sample)]
    w = w.to(torch.float64)
    mean, std = float(w.mean()), float(w.std(unbiased=False)) if w.numel() > 1 else 0.0
    if not std > 0 or not all(map(math.isfinite, (mean, std))):
        return _init.constant(mean if math.isfinite(mean) else 0.0)
    kurtosis = float((((w - mean) / std) ** 4).mean()) - 3.0
    if kurtosis < -0.9:
        lo, hi = float(w.min()), float(w.max())
        step = _round2(hi - lo) / 100
        return _init.uniform(round(lo / step) * step, round(hi / step) * step)
    std = _round2(std)
    return _init.normal(round(mean / (std / 100)) * (std / 100), std)


def _round2(x: float) -> float:
    """``x`` > 0 to two significant digits."""
    return float(f"{x:.1e}")


def _table_config(
    path: str,
    weight: torch.Tensor,
    override: TableConfig | Mapping[str, Any] | None,
    taken: set[str],
    dynamic_default: Dynamic | None = None,
    tiered_default: Tiered | None = None,
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
    dynamic = fields.get("dynamic", dynamic_default)
    # a dense table is filled from the layer, so its initializer is never used: zeros is the cheapest;
    # a dynamic table's new rows follow the distribution of the layer's current weights
    default_init = fitted_init(weight) if dynamic is not None else _init.zeros()
    return TableConfig(
        name=fields.get("name") or _table_name(path, taken),
        num_embeddings=None if dynamic is not None else n,
        embedding_dim=d,
        dtype=fields.get("dtype", weight.dtype),
        init=fields.get("init", default_init),
        optimizer=fields.get("optimizer"),
        dynamic=dynamic,
        tiered=fields.get("tiered", tiered_default if dynamic is None else None),
    )


def _collection_attr(model: nn.Module) -> str:
    name, k = COLLECTION_ATTR, 1
    while hasattr(model, name):
        name, k = f"{COLLECTION_ATTR}_{k}", k + 1
    return name


def _dynamic_for(paths: list[str], dynamic: bool | Dynamic | str | Sequence[str]) -> Dynamic | None:
    """The ``Dynamic`` a layer at ``paths`` gets from ``convert(dynamic=...)``, or None."""
    if dynamic is False:
        return None
    if dynamic is True:
        return Dynamic()
    if isinstance(dynamic, Dynamic):
        return dynamic
    patterns = [dynamic] if isinstance(dynamic, str) else list(dynamic)
    return Dynamic() if any(fnmatch.fnmatchcase(p, pat) for p in paths for pat in patterns) else None


def _check_dynamic_arg(dynamic: Any) -> None:
    ok = isinstance(dynamic, (bool, Dynamic, str)) or (
        isinstance(dynamic, Sequence) and all(isinstance(p, str) for p in dynamic)
    )
    if not ok:
        raise ConfigError(
            f"convert: dynamic must be True/False, a he.Dynamic(...) for every table, or layer path patterns "
            f"(fnmatch, e.g. 'embedding_dict.*'), got {dynamic!r}"
        )


def _stale_references(model: nn.Module, replaced: dict[int, str]) -> list[str]:
    """Where ``model``'s own attributes (lists, tuples, dicts of them) and live torch optimizers
    still hold a replaced embedding weight: ``["model.reg_weights[0] ('emb')", ...]``."""
    found: list[str] = []

    def walk(x: Any, where: str, depth: int) -> None:
        if isinstance(x, torch.Tensor):
            if id(x) in replaced:
                found.append(f"{where} (layer {replaced[id(x)]!r})")
            return
        if depth > 4 or isinstance(x, (nn.Module, str, bytes)):
            return
        if isinstance(x, Mapping):
            for k, v in list(x.items())[:10_000]:
                walk(v, f"{where}[{k!r}]", depth + 1)
        elif isinstance(x, (list, tuple, set, frozenset)):
            for i, v in enumerate(list(x)[:10_000]):
                walk(v, f"{where}[{i}]", depth + 1)

    for path, m in model.named_modules():
        for attr, v in vars(m).items():
            if attr.startswith("_") or isinstance(v, nn.Module):
                continue
            walk(v, f"model.{path + '.' if path else ''}{attr}", 0)
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.optim.Optimizer):  # (type(): isinstance may run a proxy's __class__)
            held = [replaced[id(p)] for g in obj.param_groups for p in g["params"] if id(p) in replaced]
            if held:
                found.append(f"a {type(obj).__name__} optimizer ({len(held)} replaced weight(s), e.g. {held[0]!r})")
    return found


def convert(
    model: nn.Module,
    tables: Mapping[str, TableConfig | Mapping[str, Any] | None] | None = None,
    *,
    seed: int = 0,
    copy_dynamic_rows: bool = False,
    dynamic: bool | Dynamic | str | Sequence[str] = False,
    grouped: bool = True,
    kernels: str = "auto",
    tiered: Tiered | None = None,
) -> nn.Module:
    """Replace every ``nn.Embedding`` / ``nn.EmbeddingBag`` of ``model`` by a hybridembed layer.

    Args:
        model: any ``nn.Module``; modified in place.
        tables: per-layer overrides by module path (see the module docstring): a dict of
            ``TableConfig`` fields (``name``, ``dtype``, ``init``, ``optimizer``, ``dynamic``),
            a whole ``TableConfig``, or None to leave that layer unconverted.
        seed: seed of the row-keyed initializer of dynamic tables' new rows.
        copy_dynamic_rows: load a layer made dynamic with its current rows as ids ``0..N-1``.
        dynamic: make layers dynamic tables without listing them in ``tables``: True (every
            layer, ``Dynamic()``), a :class:`~hybridembed.Dynamic` (every layer, those settings)
            or layer path patterns (``fnmatch``, e.g. ``"embedding_dict.*"``). A layer's own
            ``tables`` entry wins. New rows follow the layer's current weights' distribution
            (:func:`fitted_init`) unless an ``init`` is given.
        grouped: defer each converted layer's lookup until an output of the forward is first
            used, then run all of them in one kernel call per group of tables
            (:mod:`hybridembed.modules.grouped`); False: one call per layer call.
        kernels: the kernel backend of the tables (see :class:`EmbeddingCollection`):
            ``"auto"``, ``"eager"``, ``"triton"`` or ``"numba"``. The tables stay on the layers' device.
        tiered: a :class:`~hybridembed.Tiered` for every dense table: rows and optimizer state
            in files under its ``path``, ``cache_rows`` of them in memory per group (None: in memory).

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
    _check_dynamic_arg(dynamic)
    if not isinstance(grouped, bool):
        raise ConfigError(f"convert: grouped must be True or False, got {grouped!r}")
    if not isinstance(copy_dynamic_rows, bool):
        raise ConfigError(f"convert: copy_dynamic_rows must be True or False, got {copy_dynamic_rows!r}")
    if tiered is not None and not isinstance(tiered, Tiered):
        raise ConfigError(f"convert: tiered must be a he.Tiered(path, cache_rows) or None, got {tiered!r}")
    if isinstance(model, tuple(_LAYERS)):  # the model is one layer: convert it inside a holder
        holder = nn.Module()
        holder.add_module("layer", model)
        converted = convert(
            holder,
            {f"layer.{k}" if k else "layer": v for k, v in overrides.items()},
            seed=seed,
            copy_dynamic_rows=copy_dynamic_rows,
            dynamic=dynamic if isinstance(dynamic, (bool, Dynamic)) else [f"layer.{p}" for p in dynamic],
            grouped=False,  # a lone layer's output is used right away: nothing to group
            kernels=kernels,
            tiered=tiered,
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
        override = values[0] if given else None
        cfg = _table_config(paths[0], weight, override, taken, _dynamic_for(paths, dynamic), tiered)
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
    with rows_from_caller():  # (the dense rows are the layers', copied in below: nothing to initialise)
        collection = ConvertedCollection([cfg for _, cfg in plans], seed=seed, device=devices.pop(), kernels=kernels)
    if grouped:
        collection.lookup_queue = LookupQueue(collection)
    emptied = []  # dynamic tables whose layer's rows are not carried over
    with torch.no_grad():
        for layers, cfg in plans:
            paths = [p for f in layers for p in f.paths]
            if cfg.tiered is not None and cfg.dynamic is None:
                _write_through(layers[0].module.weight, collection.storage_of(cfg.name), cfg.name)
                continue
            if cfg.dynamic is None:
                _take_over(layers[0].module.weight, collection.weight(cfg.name))
                continue
            weight = layers[0].module.weight.detach()
            if copy_dynamic_rows:
                storage = collection.storage_of(cfg.name)
                cap = cfg.dynamic.capacity
                if cap is not None and weight.shape[0] > cap:
                    raise ConfigError(
                        f"layer {paths[0]!r}: copy_dynamic_rows needs {weight.shape[0]} rows but "
                        f"Dynamic(capacity={cap}); raise the capacity or pass copy_dynamic_rows=False"
                    )
                storage.load_table(cfg.name, serial.dense_as_dynamic(storage, weight))
            else:
                emptied.append(cfg.name)
    replaced = {id(layers[0].module.weight): layers[0].paths[0] for layers, _ in plans}
    for layers, _ in plans:  # wrap_optimizer drops these from a torch optimizer built before convert
        layers[0].module.weight._hybridembed_replaced = True
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
    if grouped:
        model.register_forward_pre_hook(_QueueHook(owner_path + attr, begin=True))
        model.register_forward_hook(_QueueHook(owner_path + attr, begin=False), always_call=True)
    groups = collection.groups
    shown = "; ".join(", ".join(g[:3]) + (f" +{len(g) - 3}" if len(g) > 3 else "") for g in groups[:4])
    note = ""
    if emptied:
        note = (
            f"; {len(emptied)} dynamic table(s) start empty, new rows drawn like the layer's weights "
            "(copy_dynamic_rows=True keeps the rows)"
        )
    log.info(
        "converted %d embedding layer(s) into %d table(s) in %d group(s) at %s%s (%s)%s%s",
        sum(len(layers) for layers, _ in plans),
        len(plans),
        len(groups),
        owner_path,
        attr,
        shown + ("; ..." if len(groups) > 4 else ""),
        "; lookups grouped per forward" if grouped else "",
        note,
    )
    stale = _stale_references(model, replaced)
    if stale:
        more = f" and {len(stale) - 3} more" if len(stale) > 3 else ""
        warnings.warn(
            f"convert: {'; '.join(stale[:3])}{more} still hold the replaced nn.Embedding weights (kept in memory, "
            "no longer trained or read by the model). Build optimizers after convert or pass them through "
            "he.wrap_optimizer(opt, model) (which drops them); regularise tables with the optimizer's weight_decay "
            "(applied to the rows a step touches) or on the looked-up rows, not on the old weights",
            stacklevel=2,
        )
    return model


_CHUNK_BYTES = 64 << 20  # rows copied (and their old pages handed back) at a time


def _take_over(old: nn.Parameter, rows: torch.Tensor) -> None:
    """Copies a layer's weight into its table's ``rows`` (never uninitialised: the table was made
    with :func:`rows_from_caller`), then makes the old weight a view of those rows, so its own
    memory is freed (and handed back to the system). When nothing else holds that memory, the
    copy goes 64 MiB at a time and hands back each copied part's pages at once, so a table is
    never held twice, not even while it is copied (``he.convert``'s peak is about the model)."""
    alias = old.dtype == rows.dtype and old.device == rows.device and old.shape == rows.shape
    sole = alias and _only_holder(old) and old.device.type == "cpu" and old.is_contiguous()
    src = old.detach()
    if not sole:
        rows.copy_(src)
    else:
        step = max(1, _CHUNK_BYTES // max(1, src[0].numel() * src.element_size())) if len(src) else 1
        for a in range(0, src.shape[0], step):
            rows[a : a + step].copy_(src[a : a + step])
            discard_pages(src[a : a + step])  # (never read again: the parameter gets the table's rows next)
    del src
    if alias:  # (a table of another dtype: the old weight keeps its own rows, untouched)
        old.data = rows  # (a reference kept to the old layer reads the table's current rows)
        release_free_memory()


def _write_through(old: nn.Parameter, storage, name: str) -> None:
    """A layer's weight into its tiered table, 64 MiB at a time through the cache to the files;
    when nothing else holds the weight, each part's pages are handed back as it goes and the
    weight is left empty (a stale reference fails loudly instead of reading old rows)."""
    sole = _only_holder(old) and old.device.type == "cpu" and old.is_contiguous()  # (before the view below)
    src = old.detach()
    step = max(1, _CHUNK_BYTES // max(1, src[0].numel() * src.element_size())) if len(src) else 1
    for a in range(0, src.shape[0], step):
        storage.write_range(name, a, {"weight": src[a : a + step]})
        if sole:
            discard_pages(src[a : a + step])
    del src
    if sole:
        old.data = old.data.new_empty((0, old.shape[1]))
        release_free_memory()


def _only_holder(p: nn.Parameter) -> bool:
    """Nothing but ``p`` itself holds its memory (no view, no other tensor on the same storage)."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:
        return False
    storage = p.untyped_storage()
    return use_count(storage._cdata) == 2  # (p's tensor and this Python storage object)


def _base(m: nn.Module) -> type:
    return nn.EmbeddingBag if isinstance(m, nn.EmbeddingBag) else nn.Embedding
