"""One (de)serialisation of a table: the entry written by a module's ``state_dict``, by
checkpoints (``he.save``) and read back by ``load_state_dict`` and ``he.load``.

Shape legend: ``R`` rows of a dense table, ``K`` rows of a dynamic table, ``D`` dim.

A table's entry is a flat ``{key: tensor}``:

- dense: ``weight`` (R, D), the rows by row id;
- dynamic: ``ids`` (K,) ascending, ``weight`` (K, D), ``last_seen`` (K,), ``freq`` (K,),
  ``stats`` (the table's counters), ``clock`` (0-d), and, where the storage keeps them,
  ``generator`` (its admission RNG state) and ``sketch`` (its count-min sketch).

:func:`check_entry` finds every problem of an entry before :func:`load_entry` writes
anything, so a caller checks all its tables first and then loads them all or none.

    >>> import torch, hybridembed as he
    >>> from hybridembed.storage import serial
    >>> ec = he.EmbeddingCollection([he.TableConfig("a", 3, 2)])
    >>> st = ec.storage_of("a")
    >>> sorted(serial.table_entry(st, "a"))
    ['weight']
    >>> serial.check_entry(st, "a", {"weight": torch.zeros(4, 2)}, prefix="a.")[1]
    ['size mismatch for a.weight: copying a param with shape (4, 2) from checkpoint, the shape in current model is (3, 2).']
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import HybridEmbedError
from .base import RowStorage

__all__ = [
    "DYNAMIC_KEYS",
    "PER_ROW_KEYS",
    "table_entry",
    "check_entry",
    "load_entry",
    "load_entries",
    "dense_as_dynamic",
]

DYNAMIC_KEYS = ("ids", "weight", "last_seen", "freq", "stats", "clock")  # required in a dynamic entry
PER_ROW_KEYS = ("ids", "weight", "last_seen", "freq")  # one element (or row) per id
OPTIONAL_KEYS = ("generator", "sketch")
# the admission generator's state, by the kind of device it was saved on: a CPU generator (Mersenne
# Twister) or a CUDA one (Philox: seed and offset); one of the other kind loads as a fresh seed
GENERATOR_SIZES = {torch.Generator().get_state().numel(): "CPU", 16: "CUDA"}


def _rows(storage: RowStorage, name: str) -> int:
    return next(t.num_embeddings for t in storage.tables if t.name == name)


def table_entry(storage: RowStorage, name: str, keep_vars: bool = False) -> dict[str, torch.Tensor]:
    """Table ``name`` of ``storage`` as an entry. Dense: ``weight`` is a view of the rows (the
    parameter's own slice, with autograd, when ``keep_vars``); dynamic: copies."""
    if storage.keyed:
        if storage.weight.device.type == "meta":
            raise HybridEmbedError(
                f"dynamic table {name!r} was built on the meta device and holds no rows to save; he.distribute(model) "
                "makes each rank's shards, or build the collection on cpu or cuda"
            )
        return storage.save_table(name)
    if keep_vars and not getattr(storage, "tiered", False):
        start = storage.row_offset[name]
        return {"weight": storage.weight[start : start + _rows(storage, name)]}
    return {"weight": storage.table_rows(name)}


def _shape(x: Any) -> Any:
    return tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__


def _is_int(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and not x.is_floating_point() and not x.is_complex() and x.dtype != torch.bool


def check_entry(
    storage: RowStorage, name: str, entry: dict[str, Any], prefix: str = "", strict_dtype: bool = False
) -> tuple[list[str], list[str]]:
    """(missing keys, errors) of ``entry`` for table ``name`` of ``storage``; both empty: it loads.

    Keys are named ``prefix + key``. Checked: every required key is a tensor of the table's
    shape (dense ``(R, D)``; dynamic ``(K, D)`` rows, per-row tensors of ``K`` integers, distinct
    ids, ``K`` within the capacity, counters and clock), a sketch of the table's
    ``Dynamic(sketch_depth, sketch_width)`` and a generator state of the storage's kind.
    ``strict_dtype``: the rows must have the table's dtype (a checkpoint); otherwise any
    floating dtype is converted (as ``load_state_dict`` does).
    """
    errors: list[str] = []
    if not storage.keyed:
        if "weight" not in entry:
            return [prefix + "weight"], []
        src, want = entry["weight"], (_rows(storage, name), storage.dim)
        if not isinstance(src, torch.Tensor) or tuple(src.shape) != want:
            errors.append(
                f"size mismatch for {prefix}weight: copying a param with shape {_shape(src)} from checkpoint, "
                f"the shape in current model is {want}."
            )
        elif strict_dtype and src.dtype != storage.dtype:
            errors.append(f"{prefix}weight: dtype {src.dtype}, the table's is {storage.dtype}")
        return [], errors

    missing = [prefix + k for k in DYNAMIC_KEYS if k not in entry]
    if missing:
        return missing, []
    ids, w = entry["ids"], entry["weight"]
    if not _is_int(ids) or ids.dim() != 1:
        return [], [f"{prefix}ids: expected (K,) integer ids, got {_shape(ids)} {getattr(ids, 'dtype', '')}".rstrip()]
    k = ids.numel()
    if not isinstance(w, torch.Tensor) or tuple(w.shape) != (k, storage.dim):
        errors.append(f"size mismatch for {prefix}weight: {_shape(w)} for {k} ids of dim {storage.dim}")
    elif not w.is_floating_point() or (strict_dtype and w.dtype != storage.dtype):
        errors.append(f"{prefix}weight: dtype {w.dtype}, the table's is {storage.dtype}")
    for key in ("last_seen", "freq"):
        v = entry[key]
        if not _is_int(v) or tuple(v.shape) != (k,):
            errors.append(f"{prefix}{key}: expected ({k},) integers (one per id), got {_shape(v)}")
    i = storage.table_index[name]
    stats = entry["stats"]
    if not _is_int(stats) or stats.shape != storage.counters[i].shape:
        errors.append(
            f"{prefix}stats: expected {tuple(storage.counters[i].shape)} integer counters, got {_shape(stats)}"
        )
    clock = entry["clock"]
    if not _is_int(clock) or clock.numel() != 1:
        errors.append(f"{prefix}clock: expected one integer, got {_shape(clock)}")
    if storage.capacity is not None and k > storage.capacity:
        errors.append(
            f"{prefix}ids: {k} rows do not fit the table's capacity {storage.capacity}; raise Dynamic(capacity=...)"
        )
    if k and ids.unique().numel() != k:
        errors.append(f"{prefix}ids: an id appears more than once")
    sketch = entry.get("sketch")
    if sketch is not None and storage.sketch.numel():
        have = tuple(storage.sketch.shape[1:])
        if not _is_int(sketch) or tuple(sketch.shape) != have:
            cfg = storage.config
            got = f"{sketch.shape[0]} x {sketch.shape[1]}" if _is_int(sketch) and sketch.dim() == 2 else _shape(sketch)
            errors.append(
                f"{prefix}sketch: the admission sketch saved is {got} counters (sketch_depth x sketch_width), the "
                f"table has Dynamic(sketch_depth={cfg.sketch_depth}, sketch_width={cfg.sketch_width}); build the "
                "table with the saved sketch_depth and sketch_width to load it"
            )
    gen = entry.get("generator")
    if gen is not None and not (
        isinstance(gen, torch.Tensor) and gen.dtype == torch.uint8 and gen.dim() == 1 and gen.numel() in GENERATOR_SIZES
    ):
        sizes = " or ".join(f"{n} bytes ({kind})" for n, kind in GENERATOR_SIZES.items())
        errors.append(f"{prefix}generator: not a random generator state (a uint8 tensor of {sizes}), got {_shape(gen)}")
    return [], errors


def dense_as_dynamic(storage: RowStorage, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """A dense (N, D) matrix as an entry of a dynamic table of ``storage``: ids ``0..N-1``, fresh counters."""
    n = weight.shape[0]
    dev = storage.weight.device
    return {
        "ids": torch.arange(n, device=dev),
        "weight": weight,
        "last_seen": torch.zeros(n, dtype=torch.int64, device=dev),
        "freq": torch.zeros(n, dtype=torch.int64, device=dev),
        "stats": torch.zeros_like(storage.counters[0]),
        "clock": torch.tensor(0),
    }


def state_shapes(storage: RowStorage, name: str) -> dict[str, tuple[int, ...]]:
    """``{state: shape}`` of table ``name``'s optimizer state, as ``table_state`` would give it,
    without reading it (a tiered table's state is not in memory)."""
    n = storage.table_ids(name).numel() if storage.keyed else storage._span(name)[1]
    return {k: (n, *t.shape[1:]) for k, t in storage.state.items()}


def load_entry(storage: RowStorage, name: str, entry: dict[str, Any]) -> None:
    """Write ``entry`` (checked with :func:`check_entry`) into table ``name`` of ``storage``."""
    if storage.keyed:
        storage.load_table(name, {k: v for k, v in entry.items() if k in DYNAMIC_KEYS + OPTIONAL_KEYS})
        return
    if getattr(storage, "tiered", False):  # (its rows are not one matrix: written through the cache)
        storage.write_range(name, 0, {"weight": entry["weight"]})
        return
    with torch.no_grad():
        storage.table_rows(name).copy_(entry["weight"])
    storage._mark_span(*storage._rows_of(name))


def load_entries(storage: RowStorage, entries: dict[str, dict[str, Any]]) -> None:
    """:func:`load_entry` of several tables of ``storage`` (``{name: entry}``, each checked): a
    dynamic storage replaces them all at once."""
    if storage.keyed:
        keys = DYNAMIC_KEYS + OPTIONAL_KEYS
        storage.load_tables({n: {k: v for k, v in e.items() if k in keys} for n, e in entries.items()})
        return
    for name, entry in entries.items():
        load_entry(storage, name, entry)
