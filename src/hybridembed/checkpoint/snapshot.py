"""A save's snapshot: the model's state (or its changed rows) copied in the call, written into a temporary version, published."""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import CheckpointError
from ..optim.wrapper import HybridOptimizer
from ..storage import RowStorage, serial
from ..utils import get_logger
from . import layout
from .layout import (
    _FULL_FORMAT,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    _current,
    _dense_state,
    _dtype_name,
    _fsync_dir,
    _jsonable,
    _model_tables,
    _sha256,
    _table_of_storage,
    _versions,
)
from .links import spans_changed
from .manifest import _sealed, _version, read_manifest

log = get_logger("hybridembed.checkpoint")


@dataclass(frozen=True)
class _How:
    keep: int
    incremental: bool
    max_chain: int
    background: bool


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)


def _next_version(root: Path) -> str:
    existing = _versions(root)
    return f"v-{(int(existing[-1][2:]) + 1 if existing else 1):06d}"


def _storages(model: nn.Module) -> list:
    """Every row storage of ``model`` that holds rows here, once each (a parameter-server
    trainer's remote storages hold none)."""
    return list({id(m): m for m in model.modules() if isinstance(m, RowStorage) and not m.remote}.values())


def _parent_candidate(root: Path, how: _How) -> dict | None:
    """The current version of ``root``, when an incremental save may go on top of it:
    ``{version, id, length, base, state}`` (``state``: each table's optimizer state names)."""
    if not how.incremental:
        return None
    current = _current(root)
    if current is None:
        return None
    try:
        m = read_manifest(root / current)
    except CheckpointError as e:
        log.warning("incremental save: the current version %s cannot be read (%s); writing a full one", current, e)
        return None
    inc = m.get("incremental") or {}
    length = inc.get("length", 0) + 1
    if m.get("id") is None or length > how.max_chain:
        return None
    me = {"version": current, "id": m["id"]}
    state = {q: sorted(t.get("optimizer_state", [])) for q, t in m["tables"].items()}
    return {"version": current, "id": m["id"], "length": length, "base": inc.get("base", me), "state": state}


def _incremental_entry(parent: dict) -> dict:
    """The manifest's ``incremental`` field (the caller also sets ``format_version`` 3: a reader of
    version 2 would take the delta's rows for the whole table)."""
    return {
        "parent": {"version": parent["version"], "id": parent["id"]},
        "base": parent["base"],
        "length": parent["length"],
    }


class _Snapshot:
    """One save's copy of the model: files (relative path -> object for ``torch.save``), the
    manifest without its file list, and the changes it took from each storage."""

    def __init__(self, storages: list, taken: dict, version_id: str) -> None:
        self.files: dict[str, Any] = {}
        self.manifest: dict[str, Any] = {}
        self.storages = storages
        self.taken = taken  # id(storage) -> changes since the last checkpoint (to put back on failure)
        self.id = version_id
        self.parent: dict | None = None  # the version it is incremental on (None: a full one)
        self.written: dict[str, dict] = {}  # files written already (tiered tables'): {"bytes", "sha256"}

    def finish(self, committed: bool) -> None:
        """After the commit (or its failure): count changes from this version, or put them back."""
        for st in self.storages:
            if committed:
                st.checkpoint_base = self.id
            else:
                st.restore_changes(*self.taken[id(st)])


def _take_changes(storages: list) -> dict:
    return {id(st): st.track_changes() for st in storages}


def _table_files(storage, name: str, changes, state_names, rows_to_global=None) -> tuple[dict, dict]:
    """(file object, shard entry) of table ``name`` of ``storage``: all its rows (``changes`` None)
    or those changed since the last checkpoint; optimizer state ``state_names`` of those rows."""
    if storage.keyed and changes is None:  # (copies)
        entry = {"state": {}, **storage.save_table(name, state_names)}
        return entry, {"rows": int(entry["ids"].numel())}
    if changes is None:
        state_all = storage.table_state(name) if state_names and not storage.keyed else {}  # (dense: views)
        weight = serial.table_entry(storage, name)["weight"].clone()  # its own: a view would save the group
        return {"weight": weight, "state": {k: v.clone() for k, v in state_all.items()}}, {}
    changed, removed = changes
    if not storage.keyed:
        rows = storage.changed_rows(name, changed)
        got = storage.read_table_rows(name, rows)  # (copies of those rows only, wherever they are)
        obj = {
            "rows": rows if rows_to_global is None else rows_to_global(rows),
            "weight": got.pop("weight"),
            "state": {k: got[k] for k in state_names},
        }
        return obj, {"changed": int(rows.numel())}
    entry, slots = storage.save_changes(name, changed, removed)
    held = entry.pop("state", None)  # (a tiered table's: its rows are not all in the cache)
    state = {k: held[k] if held is not None else storage.state[k].index_select(0, slots) for k in state_names}
    live = int(storage.stats(name)["rows"])
    return {**entry, "state": state}, {
        "rows": live,
        "changed": int(slots.numel()),
        "removed": int(entry["removed"].numel()),
    }


_PIECE_BYTES = 64 << 20  # rows and state of one file of a tiered table's checkpoint


def _write_tiered(
    stage: Path, snap: _Snapshot, storage, name: str, stem: str, state_names, changed=None, to_global=None, link=None
) -> list[tuple[int, int, str, int | None]]:
    """A tiered table written into ``stage`` now (in the save's foreground part, so a background
    save holds no copy of it), in files of at most :data:`_PIECE_BYTES` (``tables/<stem>.<i>.pt``)
    read through the tiers one file at a time: a table larger than memory is saved with the
    memory of one file. All its rows by range (``changed`` None), or an incremental version's
    rows changed since the last (``changed``: the storage's mask; each file also holds those
    rows, global with ``to_global``). Returns ``[(first row, end row, file, changed rows in it or
    None)]``: the files' spans tile the table (the table's own rows).

    ``link``: ``(links.Links, {i: (file, entry)})``: the full save's range files ``i`` linked
    from an earlier version instead of written (see :mod:`.links`; a link that fails is written)."""
    n = storage._span(name)[1]
    step = _rows_per_file(storage, state_names)
    if changed is None:
        parts = [(lo, hi, None) for lo, hi in _ranges(storage, name, state_names)]
    else:
        split = storage.changed_rows(name, changed).split(step)
        split = split or (torch.zeros(0, dtype=torch.int64),)
        starts = [0] + [int(p[0]) for p in split[1:]] + [n]
        parts = [(starts[i], starts[i + 1], rows) for i, rows in enumerate(split)]
    links, sources = link if link is not None else (None, {})
    out = []
    for i, (lo, hi, rows) in enumerate(parts):
        rel = f"tables/{stem}.{i:05d}.pt"
        if i in sources and links.link(sources[i][0], stage / rel, sources[i][1]):
            snap.written[rel] = {"bytes": sources[i][1]["bytes"], "sha256": sources[i][1]["sha256"]}
            out.append((lo, hi, rel, None))
            continue
        got = storage.read_range(name, lo, hi) if rows is None else storage.read_table_rows(name, rows)
        obj = {"weight": got.pop("weight"), "state": {k: got[k] for k in state_names}}
        if rows is not None:
            obj["rows"] = rows if to_global is None else to_global(rows)
        layout._write_file(stage / rel, obj)
        snap.written[rel] = {"bytes": (stage / rel).stat().st_size, "sha256": _sha256(stage / rel)}
        out.append((lo, hi, rel, None if rows is None else int(rows.numel())))
    return out


def _ranges(storage, name: str, state_names) -> list[tuple[int, int]]:
    """The (first, end) rows of a full save's files of tiered table ``name``."""
    n, step = storage._span(name)[1], _rows_per_file(storage, state_names)
    return [(lo, min(n, lo + step)) for lo in range(0, n, step)]


def _link_plan(links, storage, name: str, q: str, table: dict, mask, span_of) -> tuple | None:
    """``link`` of :func:`_write_tiered` for a full save of tiered table ``name`` (``q`` in the
    manifest, ``table`` its entry's kind, shape, dtype and optimizer state; ``mask`` the storage's
    changes taken by this save; ``span_of(lo, hi)`` a file's global span): None when ``links``
    is None or the storage's changes are not counted from the current version."""
    if links is None or mask is None or not links.counts_from(storage):
        return None
    ranges = _ranges(storage, name, table["optimizer_state"])
    changed = spans_changed(storage, name, mask, ranges)
    return links, links.sources(q, table, [span_of(lo, hi) for lo, hi in ranges], changed)


def _rows_per_file(storage, state_names) -> int:
    """Rows of a tiered table in one file of at most :data:`_PIECE_BYTES` (with their state)."""
    row_bytes = storage.weight.element_size() * storage.dim + (24 if storage.keyed else 0)  # (ids, counters)
    row_bytes += sum(t.element_size() * t[0].numel() for k, t in storage.state.items() if k in state_names)
    return max(1, _PIECE_BYTES // row_bytes)


def _write_tiered_dynamic(stage: Path, snap: _Snapshot, storage, name: str, stem: str, state_names, changes=None):
    """A tiered dynamic table written into ``stage`` now, as ``_write_tiered`` a dense one: in
    files of at most :data:`_PIECE_BYTES` read through the tiers one at a time
    (:meth:`~hybridembed.storage.tiered_hash.TieredHashStorage.save_parts`), all its rows or
    (``changes``: the storage's (mask, removed)) those changed since the last checkpoint. Returns
    the files' shard entries ``{file, rows, part, changed}``: ``part`` numbers the files after
    the first, which holds the table-wide counters (and a delta's removed ids) and says the
    table's ``rows``; the others say 0."""
    rows = int(storage.stats(name)["rows"])
    out = []
    for i, part in enumerate(storage.save_parts(name, state_names, _rows_per_file(storage, state_names), changes)):
        rel = f"tables/{stem}.{i:05d}.pt"
        layout._write_file(stage / rel, part)
        snap.written[rel] = {"bytes": (stage / rel).stat().st_size, "sha256": _sha256(stage / rel)}
        entry = {"file": rel, "rows": rows if i == 0 else 0, **({"part": i} if i else {})}
        if changes is not None:
            entry |= {"changed": int(part["ids"].numel()), "removed": int(part["removed"].numel())}
        out.append(entry)
    return out


def _sparse_meta(optimizer) -> dict[str, dict]:
    """``{table: {optimizer, hparams, step, shape}}`` of a hybrid optimizer's tables (exact types)."""
    out = {}
    for storage, group in zip(optimizer._storages, optimizer._sparse_groups):
        hp = {k: v for k, v in group.items() if k not in ("params", "storage")}
        for t in storage.tables:
            out[t.name] = {
                "optimizer": storage.optimizer.name,
                "hparams": copy.deepcopy(hp),
                "step": int(storage.step),
                "shape": [t.num_embeddings, t.embedding_dim],
            }
    return out


def _cloned(obj: Any) -> Any:
    """``obj`` with every tensor copied (a state_dict the training goes on changing)."""
    if torch.is_tensor(obj):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _cloned(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cloned(v) for v in obj)
    return copy.deepcopy(obj)


def _snapshot_dense(snap: _Snapshot, model: nn.Module, optimizer, sparse: dict | None) -> None:
    """Adds ``dense.pt`` and ``optimizer.pt`` (copies) to ``snap``, their entries to its manifest."""

    def write(rel: str, obj: Any) -> str:
        snap.files[rel] = _cloned(obj)
        return rel

    snap.manifest["dense"] = _write_dense(write, model)
    dense_sd = optimizer.dense.state_dict() if sparse is not None else None
    snap.manifest["optimizer"] = _write_optimizer(write, optimizer, dense_sd, sparse)


def _header(world: int, version_id: str) -> dict:
    return {
        "format": FORMAT,
        "format_version": _FULL_FORMAT,
        "id": version_id,
        "hybridembed_version": _version(),
        "torch_version": torch.__version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "world_size": world,
    }


def _snapshot(
    model: nn.Module, optimizer, extra: dict, parent: dict | None, stage: Path | None = None, links=None
) -> _Snapshot:
    """Everything a save of a one-process model writes, copied now (the foreground part of a
    save); a tiered table's files are written into ``stage`` (the version's temporary directory) now,
    or in a full save linked from the current version's chain where unchanged (``links``: a
    :class:`.links.Links`)."""
    tables = _model_tables(model)
    hybrid = isinstance(optimizer, HybridOptimizer)
    meta: dict[str, dict] = {}
    if hybrid:
        by_name, every = _table_of_storage(tables), _sparse_meta(optimizer)
        meta = {by_name[n]: m for n, m in every.items() if n in by_name}
        unknown = sorted(set(every) - set(by_name))
        if unknown:
            raise CheckpointError(f"the optimizer updates tables {unknown} that this model does not hold")
    names = {q: sorted(t.storage.state) if q in meta else [] for q, t in tables.items()}
    if parent is not None and any(parent["state"].get(q) != names[q] for q in tables):
        parent = None  # the optimizer state changed since: a full version
    storages = _storages(model)
    snap = _Snapshot(storages, _take_changes(storages), uuid.uuid4().hex)
    try:  # (changes taken: a failure below puts them back)
        table_entries: dict[str, Any] = {}
        for q, stem in _stems(list(tables)).items():
            t = tables[q]
            rel = f"tables/{stem}.00000.pt"
            changes = snap.taken[id(t.storage)] if parent is not None else None
            if t.storage.streamed and t.keyed and stage is not None:  # (written now, a part at a time)
                shards = _write_tiered_dynamic(stage, snap, t.storage, t.name, stem, names[q], changes)
                n = shards[0]["rows"]
            elif t.storage.streamed and stage is not None:
                n = t.config.num_embeddings
                mask = changes[0] if changes is not None else None
                link = None
                if changes is None:
                    entry = {"shape": t.shape, "dtype": t.dtype, "optimizer_state": names[q]}
                    taken = snap.taken[id(t.storage)][0]
                    whole = lambda lo, hi, d=t.shape[1]: (lo, hi, 1, 0, d)  # noqa: E731
                    link = _link_plan(links, t.storage, t.name, q, entry, taken, whole)
                parts = _write_tiered(stage, snap, t.storage, t.name, stem, names[q], mask, link=link)
                shards = [
                    {"file": rel, "row_start": lo, "row_end": hi, **({} if k is None else {"changed": k})}
                    for lo, hi, rel, k in parts
                ]
            else:
                obj, shard = _table_files(t.storage, t.name, changes, names[q])
                snap.files[rel] = obj
                n = shard["rows"] if t.keyed else t.config.num_embeddings
                shards = [{"file": rel, **shard} if t.keyed else {"file": rel, "row_start": 0, "row_end": n, **shard}]
            table_entries[q] = {
                "kind": t.kind,
                "collection": q[: -len(t.name) - 1] if q != t.name else "",
                "table": t.name,
                "shape": t.shape,
                "dtype": t.dtype,
                "rows": n,
                "optimizer_state": names[q],
                "shards": shards,
            }
            if t.keyed:
                table_entries[q]["dynamic"] = _jsonable(vars(t.config.dynamic))
        snap.manifest.update(_header(1, snap.id))
        if parent is not None:
            snap.manifest["incremental"] = _incremental_entry(parent)
            snap.manifest["format_version"] = FORMAT_VERSION
        snap.manifest["tables"] = table_entries
        _snapshot_dense(snap, model, optimizer, meta if hybrid else None)
        snap.manifest["extra"] = extra
    except BaseException:
        snap.finish(False)
        raise
    snap.parent = parent
    return snap


def _write_snapshot(tmp: Path, snap: _Snapshot, files: dict | None = None) -> dict:
    """Writes ``snap``'s files and its manifest into ``tmp``, every file and directory fsynced."""
    files = dict(files or {})
    for rel, obj in snap.files.items():
        layout._write_file(tmp / rel, obj)
        files[rel] = {"bytes": (tmp / rel).stat().st_size, "sha256": _sha256(tmp / rel)}
    manifest = {**snap.manifest, "files": dict(sorted(files.items()))}
    layout._write_file(tmp / MANIFEST, (json.dumps(_sealed(manifest), indent=1) + "\n").encode())
    for d in {tmp, *(p.parent for p in tmp.rglob("*") if p.is_file())}:
        _fsync_dir(d)
    return manifest


def _publish(root: Path, tmp: Path, version: str) -> Path:
    """Rename the written ``tmp`` to its version and commit it (``LATEST``); on failure nothing stays."""
    final = root / version
    try:
        os.rename(tmp, final)
        _fsync_dir(root)
        layout._commit(root, version)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if _current(root) != version:
            shutil.rmtree(final, ignore_errors=True)
        raise
    return final


def _stems(names: list[str]) -> dict[str, str]:
    used: set[str] = set()
    out = {}
    for q in names:
        stem = _safe(q)
        while stem in used:
            stem += "_"
        used.add(stem)
        out[q] = stem
    return out


def _write_dense(write, model: nn.Module) -> dict[str, Any]:
    """Writes ``dense.pt`` (every parameter and buffer outside the tables); its manifest entry."""
    dense = _dense_state(model)
    write("dense.pt", dense)
    return {
        "file": "dense.pt",
        "tensors": {
            k: {"shape": list(v.shape), "dtype": _dtype_name(v.dtype)} for k, v in dense.items() if torch.is_tensor(v)
        },
        "other": sorted(k for k, v in dense.items() if not torch.is_tensor(v)),
    }


def _write_optimizer(
    write, optimizer, dense_sd: dict | None, sparse: dict | None, torch_sd: dict | None = None
) -> dict[str, Any] | None:
    """Writes ``optimizer.pt``: a hybrid optimizer's dense state and per-table ``sparse`` entries
    (exact Python types; a JSON copy goes in the manifest), or a plain torch optimizer's state."""
    if sparse is not None:
        write("optimizer.pt", {"kind": "hybrid", "dense": dense_sd, "sparse": sparse})
        return {
            "file": "optimizer.pt",
            "kind": "hybrid",
            "dense": type(optimizer.dense).__name__,
            "dense_param_groups": _param_groups_json(dense_sd),
            "sparse": {
                q: {"optimizer": e["optimizer"], "hparams": _jsonable(e["hparams"]), "step": e["step"]}
                for q, e in sparse.items()
            },
        }
    if optimizer is None:
        return None
    sd = torch_sd if torch_sd is not None else optimizer.state_dict()
    write("optimizer.pt", {"kind": "torch", "state_dict": sd})
    return {
        "file": "optimizer.pt",
        "kind": "torch",
        "dense": type(optimizer).__name__,
        "dense_param_groups": _param_groups_json(sd),
        "sparse": {},
    }


def _param_groups_json(sd: Mapping[str, Any]) -> list[dict]:
    out = []
    for g in sd.get("param_groups", []):
        g = {k: v for k, v in g.items() if k != "params"}
        out.append({**_jsonable(g), "num_params": len(sd["param_groups"][len(out)]["params"])})
    return out
