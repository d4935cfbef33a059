"""``EmbeddingCollection``: many features, many tables, one fused lookup per group.

Shape legend: ``F`` features, ``B`` batch, ``D`` dim, ``N`` ids of a feature,
``T`` longest sequence.

    >>> import torch, hybridembed as he
    >>> ec = he.EmbeddingCollection(
    ...     [he.TableConfig("video", 100, 8), he.TableConfig("user", 50, 8, combiner="mean")],
    ...     features={"watched": "video", "browsed": "video", "user": "user"},
    ... )
    >>> out = ec({"watched": he.Jagged.from_lists([[1, 2], []]),
    ...           "browsed": torch.tensor([[3, -1], [4, 5]]),
    ...           "user": torch.tensor([7, 9])})
    >>> {k: tuple(v.shape) for k, v in out.items()}
    {'watched': (2, 8), 'browsed': (2, 8), 'user': (2, 8)}
    >>> len(ec.groups)  # both tables have dim 8 and float32: one storage, one kernel call
    1
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from ..config import MAX_SLOTS, TableConfig
from ..errors import ConfigError, HybridEmbedError, InvalidInputError
from ..input import Jagged, as_feature_inputs, as_jagged
from ..input.jagged import _INT_DTYPES
from ..kernels import bag_scale, cpu_fused, pooled_lookup
from ..kernels.backend import check_kernels, uses_triton
from ..storage import RowStorage, serial, storage_class
from ..storage.tiered import prefetch_rows
from ..utils import check_device, kept_tensor
from .assemble import GroupBatch, assemble, assemble_small
from .compiled import compiled_forward, compiling
from .joined import lookup_joined

__all__ = ["EmbeddingCollection"]

_SEQUENCE_OUTPUTS = ("jagged", "padded")


@dataclass(frozen=True)
class _Feature:
    name: str
    table: TableConfig
    group: int
    row_offset: int  # added to its ids before the storage resolves them (dense: the table's first row)
    table_index: int  # the table's index in its group's storage
    key: str | None = None  # its input's key in a batch; the name unless one feature is looked up twice
    jkey: str = field(init=False, repr=False, compare=False)  # key, or the name
    dynamic: bool = field(init=False, repr=False, compare=False)
    scaled: bool = field(init=False, repr=False, compare=False)  # its combiner scales rows (mean, sqrtn)

    def __post_init__(self) -> None:  # (plain fields: read on every lookup)
        object.__setattr__(self, "jkey", self.key if self.key is not None else self.name)
        object.__setattr__(self, "dynamic", self.table.dynamic is not None)
        object.__setattr__(self, "scaled", self.table.combiner in ("mean", "sqrtn"))


def _keeps(storage: RowStorage, psw, cdt) -> bool:
    """The fused CPU step may keep this lookup's gradient (no per-id weights that need their own, the
    table in its compute dtype). A parameter server's trainer keeps it too: its hook reduces the kept
    gradient of the rows it pulled (``grad_rows``) and pushes the sums."""
    return (psw is None or not psw.requires_grad) and cdt == storage.weight.dtype


def _pool(storage: RowStorage, ids, offsets, psw, cdt, sink, segments=None, one_per_bag=False) -> torch.Tensor:
    """The group's kernel call (:func:`~hybridembed.kernels.pooled_lookup`): Triton kernels when the
    storage's backend runs them on its device (not for a parameter server's rows), the fused CPU
    step's lookup on the CPU (neither for per-id weights that need a gradient of their own), else
    the eager ops."""
    keeps = (psw is None or not psw.requires_grad) and not storage.remote
    if keeps and uses_triton(storage.kernels, storage.weight):
        from ..kernels import triton_lookup  # (imports Triton)

        return triton_lookup.pooled_lookup(storage, ids, offsets, psw, cdt, one_per_bag)
    if _keeps(storage, psw, cdt) and cpu_fused.runs_on(storage.kernels, storage.weight):
        return cpu_fused.pooled_lookup(storage, ids, offsets, psw, one_per_bag)
    return pooled_lookup(storage.weight, ids, offsets, psw, cdt, sink, segments, one_per_bag)


# devices where forward takes id tensors whole, checking for padding in the validation's one sync
# (EmbeddingCollection._unpadded); on the CPU, dropping padding costs no wait
_WHOLE_DEVICES = ("cuda",)


def _group_key(t: TableConfig) -> tuple:
    return (t.embedding_dim, t.dtype, "dynamic" if t.dynamic else "dense", t.optimizer, t.dynamic, t.tiered)


def _check_group_size(ts: list[TableConfig]) -> None:
    """A group's rows must be addressable: dense row offsets and rows x dim inside int64,
    dynamic slots inside int32."""
    names = ", ".join(t.name for t in ts)
    if ts[0].dynamic is None:
        rows = sum(t.num_embeddings for t in ts)
        if rows * ts[0].embedding_dim >= 1 << 63:
            raise ConfigError(
                f"tables {names} share one storage of {rows} rows x {ts[0].embedding_dim}, which overflows int64 "
                "(must be < 2**63 elements); use fewer rows"
            )
    elif ts[0].dynamic.capacity is not None and ts[0].dynamic.capacity * len(ts) > MAX_SLOTS:
        raise ConfigError(
            f"dynamic tables {names} share one storage of capacity {ts[0].dynamic.capacity} x {len(ts)} tables "
            f"> {MAX_SLOTS} row slots (slots are int32); lower Dynamic(capacity=...)"
        )


def check_arguments(
    tables: list, features: Mapping[str, str] | None, seed: Any, pad: Any, sequence_output: Any
) -> dict:
    """The checks of a collection's arguments (tables, features, seed, pad, sequence output), made
    before anything is allocated; returns the features (one per table when None)."""
    if not tables or not all(isinstance(t, TableConfig) for t in tables):
        raise ConfigError("tables must be a non-empty sequence of hybridembed.TableConfig")
    names = [t.name for t in tables]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ConfigError(f"table names must be unique; repeated: {', '.join(dup)}")
    for arg, v in (("seed", seed), ("pad", pad)):
        if isinstance(v, bool) or not isinstance(v, int) or not -(1 << 63) <= v < 1 << 63:
            raise ConfigError(f"{arg} must be an int in [-2**63, 2**63) (int64), got {v!r}")
    if sequence_output not in _SEQUENCE_OUTPUTS:
        raise ConfigError(f"sequence_output must be one of {_SEQUENCE_OUTPUTS}, got {sequence_output!r}")
    if features is None:
        features = {n: n for n in names}
    if not isinstance(features, Mapping) or not features:
        raise ConfigError("features must be a non-empty mapping {feature name: table name}")
    for f, t in features.items():
        if not isinstance(f, str) or t not in names:
            raise ConfigError(f"feature {f!r} reads table {t!r}, which is not among the tables ({', '.join(names)})")
    return dict(features)


class EmbeddingCollection(nn.Module):
    """Embedding tables looked up by named features, grouped into fused storages.

    Args:
        tables: the tables (:class:`TableConfig`), names unique.
        features: ``{feature name: table name}``; several features may share a table.
            Default: one feature per table, named like it.
        seed: the seed of every table's row-keyed initializer (an int64).
        device: where the rows live: ``"cpu"``, ``"cuda"``, ``"cuda:N"`` or ``"meta"`` (no rows,
            no dynamic index, no tiered files: for ``he.distribute`` to make each rank's shards). A device
            this machine or torch build lacks is a :class:`ConfigError`.
        sequence_output: for ``combiner="none"`` tables, ``"jagged"`` (a :class:`Jagged`
            whose values are rows (N, D)) or ``"padded"`` (a zero-padded ``(B, T, D)`` tensor).
        pad: the id that marks padding in 2-D id tensors (an int64); dropped before lookup.
        kernels: the kernel backend (:mod:`hybridembed.kernels.backend`): ``"auto"``
            (``HYBRIDEMBED_KERNELS``, else Triton on CUDA when installed, the fused CPU step on the
            CPU when Numba is installed, eager elsewhere), ``"eager"`` (PyTorch ops), ``"triton"``
            (Triton kernels on CUDA tensors; eager elsewhere) or ``"numba"`` (the fused CPU step).

    ``forward(inputs)`` takes ``{feature: Jagged | (B,) or (B, H) ids | sparse COO | lists}``
    and returns ``{feature: (B, D) tensor}`` for pooled features. Tables with the same dim,
    dtype, storage kind and optimizer form a group: one storage, one kernel call per step.
    """

    def __init__(
        self,
        tables: Sequence[TableConfig],
        features: Mapping[str, str] | None = None,
        seed: int = 0,
        device: torch.device | str | None = None,
        sequence_output: str = "jagged",
        pad: int = -1,
        kernels: str = "auto",
    ):
        super().__init__()
        tables = list(tables)
        features = check_arguments(tables, features, seed, pad, sequence_output)
        kernels = check_kernels(kernels)
        device = check_device(device, "EmbeddingCollection")
        if any(t.name == "storages" for t in tables):
            raise ConfigError("'storages' is reserved; rename that table")
        by_name = {t.name: t for t in tables}
        self.tables: dict[str, TableConfig] = by_name
        self.features: dict[str, str] = dict(features)
        self.seed = int(seed)
        self.sequence_output = sequence_output
        self.pad = int(pad)

        keys: dict[tuple, list[TableConfig]] = {}
        for t in tables:
            keys.setdefault(_group_key(t), []).append(t)
        for ts in keys.values():
            _check_group_size(ts)
        self.storages = nn.ModuleList(self._make_storage(ts, device) for ts in keys.values())
        self.kernels = kernels
        for st in self.storages:  # (a plain attribute: read on every step)
            st.kernels = kernels
        self._table_group = {t.name: g for g, ts in enumerate(keys.values()) for t in ts}
        self.__dict__["_storage_list"] = list(self.storages)  # (plain list: indexed on every lookup)
        self._features = {}
        for f, t in self.features.items():
            st = self.storages[self._table_group[t]]
            self._features[f] = _Feature(f, by_name[t], self._table_group[t], st.row_offset[t], st.table_index[t])
        # per group: pooled features, then sequence features, in declaration order
        self._group_features: list[tuple[list[_Feature], list[_Feature]]] = [([], []) for _ in self.storages]
        for feat in self._features.values():
            pooled, seq = self._group_features[feat.group]
            (seq if feat.table.combiner == "none" else pooled).append(feat)

    def _make_storage(self, tables: list[TableConfig], device) -> RowStorage:
        """The storage of one group (a parameter-server trainer's collection makes remote ones)."""
        return storage_class(tables[0])(tables, seed=self.seed, device=device)

    # --- inspection ----------------------------------------------------------------------
    @property
    def groups(self) -> list[list[str]]:
        """Table names per group (one storage and one kernel call each)."""
        return [[t.name for t in s.tables] for s in self.storages]

    def weight(self, table: str) -> torch.Tensor:
        """(num_embeddings, D) rows of a dense table; a view sharing memory with the storage.
        Rows written through it are not counted as changed by ``he.save(incremental=True)``: save
        once without ``incremental`` after such an edit. A tiered table's rows are a copy (they are
        not one matrix): write them with ``storage_of(table).write_range``."""
        st = self.storage_of(table)
        if st.keyed:
            raise ConfigError(f"table {table!r} is dynamic; read its rows with ec.dynamic_rows({table!r})")
        return st.table_rows(table)

    def dynamic_rows(self, table: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids ascending (K,), rows (K, D)) of a dynamic table."""
        st = self.storage_of(table)
        if not st.keyed:
            raise ConfigError(f"table {table!r} is dense; read its rows with ec.weight({table!r})")
        return st.rows_by_id(table)

    def dynamic_stats(self) -> dict[str, dict[str, float]]:
        """Per dynamic table: size, capacity, inserted, evicted, rejected, hits, lookups, hit_rate."""
        return {n: self.storage_of(n).table_stats(n) for n, t in self.tables.items() if t.dynamic is not None}

    def storage_of(self, table: str) -> RowStorage:
        """The storage (rows and optimizer state) of the group that holds ``table``."""
        if table not in self.tables:
            raise ConfigError(f"unknown table {table!r}; tables: {', '.join(self.tables)}")
        return self.storages[self._table_group[table]]

    def prefetch(self, inputs: Mapping[str, Any]) -> None:
        """Start reading, in the background, the rows of tiered tables that ``inputs`` (a later
        forward's input: the next batch) will look up (:meth:`TieredStorage.prefetch`)."""
        prefetch_rows(self._features.values(), self.storages, self._prepare(as_feature_inputs(inputs)))

    # --- forward -------------------------------------------------------------------------
    def _prepare(self, inputs: Mapping[str, Any]) -> dict[str, Jagged]:
        if not isinstance(inputs, Mapping):
            raise InvalidInputError(
                f"inputs must be a mapping {{feature name: ids}} or a KeyedJaggedTensor, got {type(inputs).__name__}"
            )
        unknown = [k for k in inputs if k not in self._features]
        if unknown:
            raise InvalidInputError(
                f"unknown feature {unknown[0]!r}; this collection has: {', '.join(self._features)}", unknown[0]
            )
        missing = [f for f in self._features if f not in inputs]
        if missing:
            raise InvalidInputError(f"missing feature {missing[0]!r}: every feature needs an input", missing[0])
        devices = [st.weight.device for st in self.storages]  # (once, not a module lookup a feature)
        return {f: self._as_input(feat, inputs[f], devices[feat.group]) for f, feat in self._features.items()}

    def _as_input(self, feat: _Feature, x: Any, device: torch.device | None = None) -> Jagged:
        """One feature's input -> Jagged, with dtypes, shapes and device checked (no pass over data);
        ``device``: its table's (None: looked up)."""
        device = self.storages[feat.group].weight.device if device is None else device
        if device.type == "meta":
            msg = "was built on the meta device and has no rows to look up; he.distribute(model) makes each rank's"
            msg += " shards, or build the collection on cpu or cuda"
            raise InvalidInputError(f"feature {feat.name!r}: its table {feat.table.name!r} {msg}", feat.name)
        j = as_jagged(x, feat.name, self.pad)
        j.check_structure(feat.name)
        if j.values.device != device:  # (check_structure put offsets and weights beside the ids)
            raise InvalidInputError(
                f"feature {feat.name!r}: input is on {j.values.device} but its table is on {device}; "
                f"move it with .to({str(device)!r})",
                feat.name,
            )
        return j

    def _unpadded(self, inputs: Mapping[str, Any]) -> tuple[dict[str, Jagged], list[torch.Tensor]]:
        """:meth:`_prepare`, but id tensors ((B,) or (B, H)) on an accelerator taken whole, as bags of
        H ids, with a queued 0-d check that they hold no padding (dropping it makes a data-dependent
        size: a sync). When a check fails, :meth:`forward` starts over with :meth:`_prepare`."""
        jagged, assumed = {}, []
        for f, x in inputs.items() if isinstance(inputs, Mapping) else ():
            if (
                isinstance(x, torch.Tensor)
                and x.device.type in _WHOLE_DEVICES
                and x.layout == torch.strided
                and (x.dim() == 1 or (x.dim() == 2 and x.shape[1] > 0))
                and x.dtype in _INT_DTYPES
                and f in self._features
            ):
                b, h = x.shape[0], x.shape[1] if x.dim() == 2 else 1
                offsets = self._one_per_bag(b, x.device) if h == 1 else torch.arange(0, b * h + 1, h, device=x.device)
                jagged[f] = Jagged(x.reshape(-1).to(torch.int64), offsets)
                assumed.append((x != self.pad).all())
        if not jagged:
            return self._prepare(inputs), []
        rest = self._prepare({f: jagged.get(f, x) for f, x in inputs.items()})  # (checks the others, and the mapping)
        return rest, assumed

    def forward(self, inputs: Mapping[str, Any]) -> dict[str, torch.Tensor | Jagged]:
        """``{feature: output}`` for ``inputs``: ``{feature: ids}`` in any form :func:`as_jagged`
        takes, or a TorchRec ``KeyedJaggedTensor`` (one key per feature)."""
        inputs = as_feature_inputs(inputs)
        if compiling():  # (torch.compile / torch.export: no host sync, no data-dependent size)
            return compiled_forward(self, inputs)
        jagged, assumed = self._unpadded(inputs)
        batches = self._batches(jagged)
        if not self._validate(batches, jagged, assumed):  # some id tensor had padding: take it exactly
            jagged = self._prepare(inputs)
            batches = self._batches(jagged)
            self._validate(batches, jagged)
        out = self._run_groups(batches, jagged)
        return {f: out[f] for f in self._features}

    def _batches(self, jagged: dict[str, Jagged]) -> list[GroupBatch]:
        """Every group's batch of ``jagged`` (:meth:`_assemble`)."""
        return [
            self._assemble(storage, pooled, seq, jagged)
            for storage, (pooled, seq) in zip(self.storages, self._group_features)
            if pooled or seq
        ]

    def lookup(self, feature: str, ids: Any) -> torch.Tensor | Jagged:
        """One feature alone: the same result as ``self({...})[feature]`` without the others.

        ``ids`` takes any input form ``forward`` does. Validated the same way, before any
        row is read. Several single-feature lookups of one group in a step each add their
        part to the group's sparse gradient; the optimizer still updates the group once.

        >>> import torch, hybridembed as he
        >>> ec = he.EmbeddingCollection([he.TableConfig("a", 10, 4), he.TableConfig("b", 10, 4)])
        >>> tuple(ec.lookup("a", torch.tensor([[1, 2], [3, -1]])).shape)
        (2, 4)
        """
        feat = self._features.get(feature) if isinstance(feature, str) else None
        if feat is None:
            raise InvalidInputError(f"unknown feature {feature!r}; this collection has: {', '.join(self._features)}")
        j = self._as_input(feat, ids)
        if not feat.dynamic and feat.table.combiner != "none":
            return self._lookup_dense(feat, j)
        jagged = {feature: j}
        pooled, seq = ([], [feat]) if feat.table.combiner == "none" else ([feat], [])
        batch = self._assemble(self.storages[feat.group], pooled, seq, jagged)
        self._validate([batch], jagged)
        return self._run_groups([batch], jagged)[feature]

    def lookup_rows(self, feature: str, ids: torch.Tensor) -> torch.Tensor:
        """(N,) ids, one per bag, of a dense pooled feature -> (N, D) rows: :meth:`lookup` of
        ``Jagged(ids, arange(N + 1))`` with one range check and one sync (the converted
        ``nn.Embedding``'s per-call path)."""
        feat = self._features.get(feature) if isinstance(feature, str) else None
        if feat is None or feat.dynamic or feat.table.combiner == "none":
            raise InvalidInputError(f"lookup_rows takes a pooled feature of a dense table, got {feature!r}")
        if not isinstance(ids, torch.Tensor) or ids.dim() != 1:
            raise InvalidInputError(f"feature {feature!r}: ids must be a 1-D integer tensor", feature)
        j = Jagged(ids, self._one_per_bag(ids.shape[0], ids.device))
        dev = self._storage_list[feat.group].weight.device
        if ids.dtype not in _INT_DTYPES or ids.device != dev or dev.type == "meta":
            self._as_input(feat, j)  # (raises, naming the problem)
        return self._lookup_dense(feat, j)

    def _one_per_bag(self, n: int, device: torch.device) -> torch.Tensor:
        """Offsets (n+1,) of n bags of one id, ``arange(n + 1)``, kept for later calls of the same
        size (read-only: offsets are never written). Offsets that are one of these tensors are
        known to be well formed (:meth:`_trusted`), so their checks are skipped."""
        return kept_tensor(self, "_aranges", n, device, lambda: torch.arange(n + 1, device=device))

    def _trusted(self, j: Jagged) -> bool:
        """Whether ``j``'s offsets are this collection's own one-id-per-bag offsets."""
        return j.offsets is self.__dict__.get("_aranges", {}).get(j.values.shape[0] if j.values.dim() else -1)

    def step_failed(self, error: BaseException) -> None:
        """A forward of the model failed before the lookups it queued here ran (see
        :meth:`LookupQueue.exit`): in one process there is no one to tell. A sharded collection
        tells the other ranks."""

    def _request_input(self, feature: str, ids: Jagged) -> tuple[Jagged, torch.dtype, torch.device]:
        """For the lookup queue: ``ids`` of ``feature`` checked now (structure, dtypes, device; no
        sync), with the feature's output dtype and device."""
        feat = self._features[feature]
        device = self._storage_list[feat.group].weight.device
        v = ids.values
        if not (  # ids with the collection's own offsets: the ids alone
            self._trusted(ids)
            and ids.weights is None
            and v.dim() == 1
            and v.dtype in _INT_DTYPES
            and v.device == device
            and device.type != "meta"
        ):
            ids = self._as_input(feat, ids)
        return ids, feat.table.compute_dtype, device

    def _keyed(self, feature: str, i: int) -> _Feature:
        """Feature ``feature`` as the ``i``-th input of a batch (its key: ``str(i)``); cached."""
        cache = self.__dict__.setdefault("_keyed_features", {})
        feat = cache.get((feature, i))
        if feat is None:
            base = self._features.get(feature) if isinstance(feature, str) else None
            if base is None:
                raise InvalidInputError(
                    f"unknown feature {feature!r}; this collection has: {', '.join(self._features)}"
                )
            if len(cache) > 4096:
                cache.clear()
            feat = cache[(feature, i)] = replace(base, key=str(i))
        return feat

    def _lookup_dense(self, feat: _Feature, j: Jagged) -> torch.Tensor:
        """:meth:`lookup` of one pooled feature of a dense table, in a few ops: one bounds check,
        the offsets' checks and the weights' in one sync, then the group's kernel call."""
        storage = self.storages[feat.group]
        v, o, w = j.values, j.offsets, j.weights
        n = v.numel()
        trusted = self._trusted(j)  # the collection's own one-id-per-bag offsets: nothing to check
        if trusted and w is None:  # the ids alone: their bounds in one sync, compared here
            lo, hi = torch.stack(torch.aminmax(v)).tolist() if n else (0, 0)
            ok = lo >= 0 and hi < feat.table.num_embeddings
        else:
            checks = [] if trusted else [o[0] == 0, o[-1] == n]
            if o.numel() > 2 and not trusted:
                checks.append((o[1:] >= o[:-1]).all())
            if n:
                lo, hi = torch.aminmax(v)
                checks += [lo >= 0, hi < feat.table.num_embeddings]
            if w is not None and w.numel():
                checks.append(torch.isfinite(w).all())
            ok = not checks or bool(torch.stack(checks).all())
        if not ok:
            j.raise_first_error(feat.name, feat.table.num_embeddings)
            raise InvalidInputError(f"feature {feat.name!r}: input failed validation")  # (a bug if reached)
        ids = v + feat.row_offset if v.dtype == torch.int64 else v.to(torch.int64).add_(feat.row_offset)
        offsets = o if o.dtype == torch.int64 else o.to(torch.int64)
        cdt = storage.compute_dtype
        psw = bag_scale(feat.table.combiner, offsets, w, n, cdt)
        sink = storage.accumulate_grad
        return _pool(storage, ids, offsets, psw, cdt, sink, one_per_bag=trusted)  # (B, D)

    def lookup_many(
        self, requests: Sequence[tuple[str, Any]], train: bool | None = None
    ) -> list[torch.Tensor | Jagged]:
        """Several ``(feature, ids)`` lookups, a feature possibly repeated, in one kernel call per group.

        The same results as ``[self.lookup(f, ids) for f, ids in requests]``, validated the
        same way (every request before any row is read: one bad request changes nothing), but
        each group's requests are joined into one batch: this is how the separate embedding
        calls of a converted model's forward become one call per group. ``train`` overrides
        ``self.training`` (whether dynamic tables make rows).

        >>> import torch, hybridembed as he
        >>> ec = he.EmbeddingCollection([he.TableConfig("a", 10, 4), he.TableConfig("b", 10, 4)])
        >>> a1, b, a2 = ec.lookup_many([("a", torch.tensor([1, 2])), ("b", torch.tensor([3, 4])),
        ...                             ("a", torch.tensor([[5, 6], [7, -1]]))])
        >>> torch.equal(a2, ec.lookup("a", torch.tensor([[5, 6], [7, -1]])))
        True
        """
        if not isinstance(requests, Sequence) or not all(isinstance(r, tuple) and len(r) == 2 for r in requests):
            raise InvalidInputError("lookup_many takes a sequence of (feature name, ids) pairs")
        if train is not None and not isinstance(train, bool):
            raise InvalidInputError(f"train must be True, False or None (the module's mode), got {train!r}")
        return self._lookup_many(requests, train, checked=False)

    def _lookup_many(
        self, requests: Sequence[tuple[str, Any]], train: bool | None, checked: bool
    ) -> list[torch.Tensor | Jagged]:
        """:meth:`lookup_many`; ``checked``: every ``ids`` is a :class:`Jagged` that passed
        ``_as_input`` already (its structure, dtypes and device), as the lookup queue's are."""
        jagged: dict[str, Jagged] = {}
        per_group: dict[int, tuple[list[_Feature], list[_Feature]]] = {}
        for i, (feature, ids) in enumerate(requests):
            feat = self._keyed(feature, i)
            jagged[feat.jkey] = ids if checked else self._as_input(self._features[feature], ids)
            pooled, seq = per_group.setdefault(feat.group, ([], []))
            (seq if feat.table.combiner == "none" else pooled).append(feat)
        if not requests:
            return []
        batches = [self._assemble(self.storages[g], *per_group[g], jagged) for g in sorted(per_group)]
        self._validate(batches, jagged)
        out = self._run_groups(batches, jagged, train)
        return [out[str(i)] for i in range(len(requests))]

    def _lookup_joined(self, requests, outs, pieces, train: bool, others=()) -> tuple | None:
        """A ``torch.cat`` of queued lookups made by their kernel call, or None (:mod:`.joined`)."""
        return lookup_joined(self, requests, outs, pieces, train, others)

    def _assemble(self, storage: RowStorage, pooled: list[_Feature], seq: list[_Feature], jagged: dict) -> GroupBatch:
        """A group's features as one batch for one kernel call (:func:`.assemble.assemble`)."""
        return assemble(self, storage, pooled, seq, jagged)

    def _assemble_small(
        self, storage: RowStorage, feats: list[_Feature], js: list[Jagged], counts, sizes
    ) -> GroupBatch:
        """:func:`.assemble.assemble_small`: per-group ops, for pooled features of few ids each."""
        return assemble_small(self, storage, feats, js, counts, sizes)

    def _validate(
        self, batches: list[GroupBatch], jagged: dict[str, Jagged], assumed: Sequence[torch.Tensor] = ()
    ) -> bool:
        """One host sync for every group; on failure, the first bad feature's first bad
        position is found and raised. ``assumed``: 0-d checks of inputs taken on trust
        (:meth:`_unpadded`); when one fails, False is returned instead (nothing is raised)."""
        if bool(torch.stack([b.ok for b in batches] + list(assumed)).all()):
            return True
        if assumed and not bool(torch.stack(list(assumed)).all()):
            return False
        for f in (f for b in batches for f in b.feats):
            j = jagged[f.jkey]
            if not bool(j.ok(f.table.num_embeddings, allow_negative=f.dynamic)):
                j.raise_first_error(f.name, f.table.num_embeddings, allow_negative=f.dynamic)
        raise InvalidInputError("inputs failed validation, but no single feature is at fault")  # (a bug if reached)

    def _pooled_groups(
        self, requests: Sequence[tuple[str, Jagged]], train: bool
    ) -> list[tuple[list[int], torch.Tensor]]:
        """Pooled ``(feature, ids)`` requests (checked Jagged inputs, as the lookup queue's) ->
        per group, (the requests' indices in the order of its bags, its kernel call's output
        (S, D)): :meth:`_lookup_many` without splitting the output per request, so a caller
        that ships the rows on (the sharded runtime) sends the kernel's output as it is."""
        jagged: dict[str, Jagged] = {}
        per_group: dict[int, list[_Feature]] = {}
        for i, (feature, ids) in enumerate(requests):
            feat = self._keyed(feature, i)
            jagged[feat.jkey] = ids
            per_group.setdefault(feat.group, []).append(feat)
        batches = [self._assemble(self.storages[g], per_group[g], [], jagged) for g in sorted(per_group)]
        self._validate(batches, jagged)
        rows = self._run_groups(batches, jagged, train, whole=True)
        return [([int(f.jkey) for f in b.feats], rows[str(i)]) for i, b in enumerate(batches)]

    def _run_groups(
        self, batches: list[GroupBatch], jagged: dict[str, Jagged], train: bool | None = None, whole: bool = False
    ) -> dict[str, torch.Tensor | Jagged]:
        """Validated batches (one per group, each group at most once) -> ``{feature: output}``,
        all or nothing: every group's lookup is planned first (:meth:`Storage.resolve`), and when
        one group refuses the batch (a dynamic table over capacity) the others' plans are dropped,
        so a refused call changes no group. Only then are the lookups made, group by group. ``train``
        overrides ``self.training`` (whether dynamic tables make rows). ``whole``: the output is
        ``{str(batch index): its kernel call's (S, D) output}`` instead."""
        train = self.training if train is None else train
        storages = [b.storage for b in batches]
        if len({id(st) for st in storages}) != len(storages):
            raise HybridEmbedError("_run_groups takes one batch per group; join a group's features first")
        planned: list[GroupBatch] = []
        try:
            for batch in batches:
                self._plan_group(batch, train)
                planned.append(batch)
        except BaseException:
            for batch in planned:
                batch.plan.rollback()
                batch.plan = None
            raise
        out: dict[str, torch.Tensor | Jagged] = {}
        for i, batch in enumerate(batches):
            if whole:
                out[str(i)] = self._lookup_group(batch, jagged, train, whole=True)
            else:
                out.update(self._lookup_group(batch, jagged, train))
        return out

    def _plan_group(self, batch: GroupBatch, train: bool) -> None:
        """A group's lookup, planned (may raise; changes nothing): sets ``batch.plan``."""
        batch.plan = batch.storage.resolve(batch.ids, [f.table_index for f in batch.feats], batch.counts, train)

    def _lookup_group(
        self, batch: GroupBatch, jagged: dict[str, Jagged], train: bool | None = None, whole: bool = False
    ) -> dict[str, torch.Tensor | Jagged] | torch.Tensor:
        """The group's one kernel call, then the per-feature outputs (views of its result), by input
        key. The group's lookup is the plan :meth:`_run_groups` made, else planned here."""
        storage, feats, offsets = batch.storage, batch.feats, batch.offsets
        if batch.plan is None:
            self._plan_group(batch, self.training if train is None else train)
        plan, batch.plan = batch.plan, None
        ids, segments = plan.commit()  # row slots; dynamic: int32, new ids get rows while training
        if ids.dtype != offsets.dtype:  # (embedding_bag wants ids and offsets of one dtype)
            offsets = offsets.to(ids.dtype)
        sink = storage.grad_sink
        cdt = storage.tables[0].compute_dtype
        psw = None  # (N,) per-id multipliers: the combiners and the user's weights
        plain = not any(f.scaled or jagged[f.jkey].weights is not None for f in feats)
        scales = (
            []
            if plain
            else [
                bag_scale(f.table.combiner, jagged[f.jkey].offsets, jagged[f.jkey].weights, c, cdt)
                for f, c in zip(feats, batch.counts)
            ]
        )
        if any(sc is not None for sc in scales):
            psw = torch.cat(
                [
                    sc if sc is not None else torch.ones(c, dtype=cdt, device=ids.device)
                    for sc, c in zip(scales, batch.counts)
                ]
            )
        if not whole and _keeps(storage, psw, cdt) and cpu_fused.runs_on(storage.kernels, storage.weight):
            parts = cpu_fused.pooled_parts(storage, ids, offsets, psw, batch.one_per_bag, batch.sizes)
            return self._outputs(batch, jagged, parts)
        rows = _pool(storage, ids, offsets, psw, cdt, sink, segments, batch.one_per_bag)  # (S, D)
        if whole:
            return rows
        # unsafe_split: split's one backward (a cat), but outputs that may be changed in place, as an
        # nn.Embedding output may (split's multi-output views refuse that; narrow views would each
        # backpropagate a zero-filled (S, D) gradient). Safe here: the outputs are disjoint and
        # nothing else reads `rows`.
        return self._outputs(batch, jagged, torch.unsafe_split_with_sizes(rows, batch.sizes))

    def _outputs(self, batch: GroupBatch, jagged: dict[str, Jagged], parts) -> dict[str, torch.Tensor | Jagged]:
        """A group's per-feature rows -> its outputs by input key (sequence features as Jagged / padded)."""
        result: dict[str, torch.Tensor | Jagged] = dict(zip((f.jkey for f in batch.feats), parts))
        for f in batch.seq:
            result[f.jkey] = self._sequence(result[f.jkey], jagged[f.jkey].offsets.to(torch.int64))
        return result

    def _sequence(self, rows: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor | Jagged:
        """(N, D) rows of one sequence feature -> Jagged of rows, or zero-padded (B, T, D)."""
        j = Jagged(rows, offsets)
        return j if self.sequence_output == "jagged" else j.to_padded(0)

    # --- state_dict: one entry per table, whatever the grouping --------------------------
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        if self.__dict__.get("_entries_by_owner"):  # (a sharded collection's shards: it writes their entries)
            return
        for name in self.tables:  # dense: weight; dynamic: ids, rows and counters, by id (storage.serial)
            for k, v in serial.table_entry(self.storage_of(name), name, keep_vars).items():
                destination[prefix + name + "." + k] = v

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        if self.__dict__.get("_entries_by_owner"):
            return
        ours: set[str] = set()
        entries: dict[str, dict] = {}
        bad = False
        for name, t in self.tables.items():
            head = prefix + name + "."
            if t.dynamic is None:  # a dense table's entry is its weight; a dynamic one's whatever it saved
                keys = [head + "weight"] if head + "weight" in state_dict else []
            else:
                keys = [k for k in state_dict if k.startswith(head)]
            ours.update(keys)
            entry = {k[len(head) :]: state_dict[k] for k in keys}
            lacking, problems = serial.check_entry(self.storage_of(name), name, entry, head)
            missing.extend(lacking)
            errors.extend(problems)
            bad = bad or bool(problems)
            if not lacking and not problems:
                entries[name] = entry
        if not bad:  # all or nothing: no table is touched when any entry is wrong
            for name, entry in entries.items():
                serial.load_entry(self.storage_of(name), name, entry)
        if strict:
            for key in state_dict:
                if key.startswith(prefix) and key not in ours:
                    head = key[len(prefix) :].split(".", 1)[0]
                    if head not in self._modules:
                        unexpected.append(key)

    def extra_repr(self) -> str:
        return f"features={len(self._features)}, tables={len(self.tables)}, groups={self.groups}"
