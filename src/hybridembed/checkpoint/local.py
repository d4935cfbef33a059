"""The model of one process: its save and load, and the compaction of a directory's chain into one full version."""

from __future__ import annotations

import copy
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..distributed.shard import unwrap as _unwrap
from ..errors import CheckpointError
from ..optim.wrapper import HybridOptimizer
from ..storage import RowStorage, serial
from ..utils import get_logger
from . import layout
from .background import (
    SaveHandle,
)
from .chain import (
    _chain,
    _check_chain,
    _check_chain_files,
    _state_names,
    _versions_of,
    _whole,
)
from .layout import (
    MANIFEST,
    POINTER,
    _clean,
    _current,
    _encode_floats,
    _fsync_dir,
    _model_tables,
    _os_reason,
    _sha256,
    _table_of_storage,
    _WriteError,
)
from .links import Links, current_chain, describe, hard_link, linkable, touched, written_since_base
from .lock import (
    _lock,
)
from .manifest import (
    _check_dense_file,
    _check_model,
    _check_optimizer_file,
    _raise,
    _sealed,
    read_manifest,
)
from .pieces import Target, assemble, dynamic_parts
from .pieces import span as _span
from .pieces import torch_load as _torch_load
from .snapshot import (
    _PIECE_BYTES,
    _header,
    _How,
    _next_version,
    _parent_candidate,
    _publish,
    _rows_per_file,
    _snapshot,
    _storages,
    _write_snapshot,
)

log = get_logger("hybridembed.checkpoint")


def _cannot_write(root: Path, e: OSError) -> CheckpointError:
    what = str(e) if isinstance(e, _WriteError) else f"{e.filename or root}: {_os_reason(e)}"
    return CheckpointError(
        f"cannot write the checkpoint {root} ({what}); the previous version, if any, is intact; "
        "check that the directory is writable and has free space"
    )


def save_local(root: Path, model: nn.Module, optimizer, extra_json: dict, how: _How) -> str | SaveHandle:
    root.mkdir(parents=True, exist_ok=True)
    lock = _lock(root)  # held from choosing the version name to the cleanup after the commit
    try:
        _clean(root, how.keep)
        version = _next_version(root)
        parent = _parent_candidate(root, how)
        storages = _storages(model)
        if parent is not None and any(st.checkpoint_base != parent["id"] for st in storages):
            parent = None  # the model was not saved to or loaded from the current version: a full one
        tmp = root / f".tmp-{version}-{os.getpid()}"
        tmp.mkdir()
        chain = current_chain(root) if parent is None else None  # (a full save links what did not change)
        links = Links(chain) if chain else None
        try:
            snap = _snapshot(model, optimizer, extra_json, parent, stage=tmp, links=links)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    except BaseException:
        lock.release()
        raise

    def run() -> str:
        try:
            try:
                manifest = _write_snapshot(tmp, snap, snap.written)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            final = _publish(root, tmp, version)
            _clean(root, how.keep)
        finally:
            lock.release()
        inc = manifest.get("incremental")
        kind = f"incremental, {inc['length']} on top of a full one" if inc else "full"
        log.info("saved checkpoint %s (%d tables, %s%s)", final, len(manifest["tables"]), kind, describe(links))
        return str(final)

    if how.background:
        try:
            return SaveHandle(_unwrap(model), snap, run, lambda e: _cannot_write(root, e))
        except BaseException:
            lock.release()
            raise
    try:
        out = run()
    except BaseException:
        snap.finish(False)
        raise
    snap.finish(True)
    return out


def _held(storages) -> list[str]:
    """Tiered storages whose cache holds rows for a gradient not yet applied (a backward without
    its optimizer step): loading would write through that cache, so it is refused first."""
    out = []
    for st in storages:
        if getattr(st, "tiered", False) and st.weight.device.type != "meta" and bool(st.pending.any()):
            names = ", ".join(t.name for t in st.tables)
            out.append(
                f"tiered table(s) {names}: {int(st.pending.sum())} rows looked up in training are held for the "
                "optimizer's next step; call it (opt.step()) before he.load"
            )
    return out


def _streamed(q: str, versions, target, dim: int, keyed: bool, names, into=None) -> tuple[dict, list[str]]:
    """A tiered table (or shard: ``target``'s row ``i`` is the table's ``a + i * s``) read a range
    of rows at a time (never the whole table in memory): checked (``into`` None: the entry's
    tensors on the meta device, for the checks of a whole entry, and the problems), or written
    into ``into``'s storage (``.storage``, ``.name``; after every check passed)."""
    (a, _, s), width = target.rows, target.cols[1] - target.cols[0]
    n, step = target.num_rows, max(1, _PIECE_BYTES // (4 * width * (1 + len(names))))
    dtypes: dict[str, torch.dtype] = {}
    shapes: dict[str, tuple] = {"weight": (n, width)}
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        span = Target((a + lo * s, a + hi * s, s), target.cols)
        part, problems = assemble(q, versions, span, dim, keyed, names)
        if problems:
            return {}, problems
        data = {"weight": part["weight"], **part["state"]}
        if into is not None:  # (checked before: a file that changed since is refused, mid-load)
            into.storage.write_range(into.name, lo, data)
            continue
        for k, v in data.items():
            if dtypes.setdefault(k, v.dtype) != v.dtype:
                return {}, [f"table {q!r}: {k} of dtype {v.dtype} in rows {lo}..{hi - 1}, {dtypes[k]} before"]
            shapes[k] = (n, *v.shape[1:])
    meta = {k: torch.empty(shapes[k], dtype=dtypes.get(k, torch.float32), device="meta") for k in shapes}
    return {"weight": meta.pop("weight"), "state": meta}, []


@torch.no_grad()
def _load_tables(items: list, parted: dict | None = None) -> None:
    """Writes checked entries ``[(storage, table, entry)]``: a storage's tables at once; a dynamic
    storage's clock is then the saved one (the latest of its tables'), not max(saved, current).
    ``parted``: ``{(id(storage), table): parts}`` of tiered dynamic tables whose rows are written
    a file at a time (``parts()``, see :func:`~hybridembed.checkpoint.pieces.dynamic_parts`)."""
    parted = parted or {}
    by_storage: dict[int, tuple[RowStorage, dict]] = {}
    for storage, name, entry in items:
        by_storage.setdefault(id(storage), (storage, {}))[1][name] = entry
    for storage, entries in by_storage.values():
        whole = {n: e for n, e in entries.items() if (id(storage), n) not in parted}
        if whole:
            serial.load_entries(storage, whole)
        for n, e in entries.items():
            if (id(storage), n) in parted:
                storage.load_parts(n, e, parted[(id(storage), n)]())
        if storage.keyed:
            storage.clock = max(int(e["clock"]) for e in entries.values())


def _loaded_from(manifest: dict, storages, optimizer) -> None:
    """The model now holds version ``manifest``: its tables' changes are counted from it (not
    for a storage whose optimizer state was not loaded: it differs from the version's)."""
    for st in storages:
        st.track_changes()
        loaded_state = not st.state or (
            isinstance(optimizer, HybridOptimizer) and any(x is st for x in optimizer._storages)
        )
        st.checkpoint_base = manifest.get("id") if loaded_state else None


def load_local(path, model: nn.Module, optimizer, verify: bool) -> dict[str, Any]:
    """:func:`hybridembed.checkpoint.load` of a model of one process."""
    manifest = read_manifest(path)
    vdir = Path(manifest["path"])
    chain = _chain(manifest)
    tables = _model_tables(model)
    held = _held({id(t.storage): t.storage for t in tables.values()}.values())
    _raise(
        vdir, held + _check_model(manifest, model, optimizer, tables) + _check_chain(chain), "does not match the model"
    )
    wanted = {q: (_whole(t.config, t.keyed), t.keyed, _state_names(manifest, q, optimizer)) for q, t in tables.items()}
    reads = [(q, target, keyed) for q, (target, keyed, _) in wanted.items()]
    _raise(vdir, _check_chain_files(chain, reads, optimizer is not None, verify)[0], "is damaged")

    problems: list[str] = []
    entries = {}
    streamed = {q for q, t in tables.items() if t.storage.streamed and not t.keyed}  # (dense tiered: by range)
    parted = {}  # (id(storage), table): the rows of a tiered dynamic table, a file at a time
    for q, (target, keyed, names) in wanted.items():
        t, versions = tables[q], _versions_of(chain, q)
        if keyed and t.storage.streamed:
            entries[q], parts, p = dynamic_parts(q, versions, target, t.config.embedding_dim, names)
            if parts is not None:
                rows = _rows_per_file(t.storage, names)
                parted[(id(t.storage), t.name)] = lambda parts=parts, rows=rows: parts(rows)
        else:
            read = _streamed if q in streamed else assemble
            entries[q], p = read(q, versions, target, t.config.embedding_dim, keyed, names)
        problems.extend(p)
    dense = _torch_load(vdir, manifest["dense"]["file"])
    if not isinstance(dense, dict):
        problems.append(f"file {manifest['dense']['file']!r} does not hold a state_dict")
    opt_file = None
    if optimizer is not None:
        opt_file = _torch_load(vdir, manifest["optimizer"]["file"])
        if not isinstance(opt_file, dict) or opt_file.get("kind") != manifest["optimizer"]["kind"]:
            problems.append(f"file {manifest['optimizer']['file']!r} does not hold the optimizer state")
    _raise(vdir, problems, "is damaged")
    # every table entry, the dense state and the optimizer state against the model, before
    # anything is written: a refused load leaves model and optimizer as they were
    for q, t in tables.items():
        missing, errors = serial.check_entry(
            t.storage, t.name, {k: v for k, v in entries[q].items() if k != "state"}, f"{q}.", strict_dtype=True
        )
        problems.extend([f"{k}: missing from the table's files" for k in missing] + errors)
    problems.extend(_check_dense_file(manifest["dense"]["file"], dense, model))
    if optimizer is not None:
        problems.extend(_check_optimizer_file(opt_file, optimizer, tables, entries))
    _raise(vdir, problems, "does not match the model")

    # --- nothing was changed so far; from here on, apply ---------------------------------------
    if dense:
        model.load_state_dict(dense, strict=False)
    _load_tables([(t.storage, t.name, entries[q]) for q, t in tables.items() if q not in streamed], parted)
    for q in streamed:
        target, keyed, names = wanted[q]
        _, late = _streamed(q, _versions_of(chain, q), target, tables[q].config.embedding_dim, keyed, names, tables[q])
        _raise(vdir, late, "changed while it was loaded (this table is partly loaded: load again)")
    if optimizer is not None:
        if opt_file["kind"] == "torch":
            optimizer.load_state_dict(opt_file["state_dict"])
        else:
            by_name = _table_of_storage(tables)
            sparse = {}
            for name, q in by_name.items():
                meta = opt_file["sparse"].get(q)
                if meta is None:
                    continue
                e, t = entries[q], tables[q]
                came = q in streamed or (id(t.storage), t.name) in parted  # (a tiered table's came with its rows)
                sparse[name] = {
                    **meta,
                    "ids": e["ids"] if t.keyed else None,
                    "state": {} if came else e["state"],
                    "state_loaded": came,
                }
            optimizer.load_state_dict({"dense": opt_file["dense"], "sparse": sparse, "format": 1})
    _loaded_from(manifest, {id(t.storage): t.storage for t in tables.values()}.values(), optimizer)
    log.info("loaded checkpoint %s (%d tables)", vdir, len(tables))
    return manifest


# --- compaction: a chain written again as one full version, without the model -----------------------
def compact(path: str | os.PathLike, *, keep: int = 1, verify: bool = True) -> str:
    """Write the current version of the checkpoint at ``path`` again as a full version (the
    chain of incremental versions it builds on put together, shard by shard: a dense table in
    its full base's shards, linking those no version since wrote a row of, a dynamic one in the
    current version's) and commit it; no model is needed. Returns the new version's directory
    (the current one, unchanged, when it is already full). Loading it equals loading the chain,
    bit for bit. It is a writer like :func:`save`: it holds the directory's writer lock, and is
    refused (a CheckpointError naming the writer) while a job saves there."""
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise CheckpointError(f"keep must be an int >= 1, got {keep!r}")
    if not isinstance(verify, bool):
        raise CheckpointError(f"verify must be True or False, got {verify!r}")
    root = Path(path)
    read_manifest(root)  # (a CheckpointError saying what is missing there)
    if not (root / POINTER).is_file():
        raise CheckpointError(f"compact takes a checkpoint directory (with {POINTER}), got {path}")
    lock = _lock(root)
    try:
        return _compact(root, keep, verify)
    finally:
        lock.release()


def _compact(root: Path, keep: int, verify: bool) -> str:
    manifest = read_manifest(root)
    vdir = Path(manifest["path"])
    if vdir.parent != root or _current(root) != vdir.name:
        raise CheckpointError(f"compact takes a checkpoint directory (with {POINTER}), got {root}")
    if "incremental" not in manifest:
        return str(vdir)
    chain = _chain(manifest)
    problems = _check_chain(chain)
    if problems:
        _raise(vdir, problems, "cannot be compacted")
    # a dense table in its full base's shards (a tiered table's: range files of at most 64 MiB,
    # where a delta's spans follow its changed rows and may cover the whole table), each linked
    # from the base when no version of the chain wrote a row of it; a dynamic one in the current's
    shards_of = {
        q: chain[0][1]["tables"][q]["shards"] if t["kind"] == "dense" else t["shards"]
        for q, t in manifest["tables"].items()
    }
    wanted = {}
    for q, t in manifest["tables"].items():
        keyed, dim = t["kind"] == "dynamic", t["shape"][1]
        for sh in shards_of[q]:
            wanted[(q, sh["file"])] = (_shard_target(sh, keyed, dim), keyed, sorted(t.get("optimizer_state", [])))
    reads = [(q, target, keyed) for (q, _), (target, keyed, _) in wanted.items()]
    found, _ = _check_chain_files(chain, reads, True, verify)
    _raise(vdir, problems + found, "cannot be compacted")
    _clean(root, keep)
    version = _next_version(root)
    tmp = root / f".tmp-{version}-{os.getpid()}"
    tables = copy.deepcopy(manifest["tables"])
    try:
        tmp.mkdir()
        files = {}
        linked = 0
        for q, t in tables.items():
            saved, t["shards"] = shards_of[q], []
            # (a tiered dynamic table's, saved in parts in any version: put together file by file)
            parted = any(x.get("part") for _, spec in _versions_of(chain, q) for x in spec["shards"])
            written = written_since_base(chain, q, t["shape"][1]) if t["kind"] == "dense" else None
            for sh in saved:
                src = None
                if written is not None and not touched(_span(sh, t["shape"][1]), written):
                    src = linkable(chain[0][0], chain[0][1], sh["file"])
                if src is not None and hard_link(src[0], tmp / sh["file"]):
                    files[sh["file"]] = src[1]
                    t["shards"].append({k: v for k, v in sh.items() if k != "changed"})
                    linked += 1
                elif not sh.get("part"):
                    t["shards"] += _compact_shard(tmp, files, q, sh, wanted[(q, sh["file"])], chain, t, parted)
            if t["kind"] == "dense":  # (the base's shards: the optimizer's step a job saves with each is the current's)
                steps = [x["step"] for x in manifest["tables"][q]["shards"] if "step" in x]
                for x in t["shards"]:
                    x.pop("step", None)
                    x.update({"step": max(steps)} if steps else {})
        # the dense state and the optimizer's, as they are (the tables' files: all written or linked above)
        for rel in {manifest["dense"]["file"], *([manifest["optimizer"]["file"]] if manifest.get("optimizer") else [])}:
            shutil.copyfile(vdir / rel, tmp / rel)
            files[rel] = manifest["files"][rel]
        body = {k: v for k, v in manifest.items() if k not in ("path", "incremental", "files")}
        body["extra"] = _encode_floats(body["extra"], "extra")  # (read_manifest decoded it)
        body.update(_header(manifest["world_size"], uuid.uuid4().hex), created=body["created"], tables=tables)
        body["files"] = dict(sorted(files.items()))
        layout._write_file(tmp / MANIFEST, (json.dumps(_sealed(body), indent=1) + "\n").encode())
        for d in {tmp, *(p.parent for p in tmp.rglob("*") if p.is_file())}:
            _fsync_dir(d)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    final = _publish(root, tmp, version)
    _clean(root, keep)
    log.info("compacted checkpoint %s (%d versions) into %s (%d files linked)", vdir, len(chain), final, linked)
    return str(final)


def _compact_shard(tmp: Path, files: dict, q: str, sh: dict, wanted, chain, t: dict, parted: bool) -> list[dict]:
    """Saved shard ``sh`` of table ``q`` put together from the chain into ``tmp`` (its files added
    to ``files``): its new shard entries. A tiered dynamic table's (``parted``) file by file, as
    its save wrote it, so that a table larger than memory compacts in the memory of one file."""
    target, keyed, names = wanted
    versions, dim = _versions_of(chain, q), t["shape"][1]
    parts = None
    if keyed and parted:
        entry, parts, probs = dynamic_parts(q, versions, target, dim, names)
    else:
        entry, probs = assemble(q, versions, target, dim, keyed, names)
    _raise(Path(chain[-1][0]), probs, "cannot be compacted")
    base = {k: v for k, v in sh.items() if k not in ("changed", "removed", "part", "rows", "file")}
    if parts is None or not entry["ids"].numel():
        if parts is not None:  # (no rows: the whole empty entry)
            entry = assemble(q, versions, target, dim, keyed, names)[0]
        chunks = [entry]
    else:
        per_row = [entry["weight"], *entry["state"].values()]  # (meta tensors: their shapes and dtypes)
        per_file = max(1, _PIECE_BYTES // (24 + sum(x.element_size() * x[0].numel() for x in per_row)))
        wide = {k: entry[k] for k in ("stats", "clock", "generator", "sketch") if k in entry}
        chunks = (c | wide if i == 0 else c for i, c in enumerate(_repacked(parts(per_file), per_file)))
    out = []
    for i, chunk in enumerate(chunks):
        rel = sh["file"] if i == 0 else f"{sh['file'][:-3]}-{i:05d}.pt"
        layout._write_file(tmp / rel, chunk)
        files[rel] = {"bytes": (tmp / rel).stat().st_size, "sha256": _sha256(tmp / rel)}
        count = {"rows": int(entry["ids"].numel()) if i == 0 else 0} if keyed else {}
        out.append({**base, "file": rel, **count, **({"part": i} if i else {})})
    return out


def _repacked(parts, rows: int):
    """Dynamic rows (entries of ids, weight, counters and state) regrouped ``rows`` at a time,
    each group its own tensors (a part may view a memory-mapped file: saved, it would write it all)."""
    held: list[dict] = []
    count = 0
    for part in parts:
        held.append(part)
        count += part["ids"].numel()
        while count >= rows:
            joined = _joined(held)
            yield _sliced(joined, 0, rows)
            held, count = [_sliced(joined, rows, None)], count - rows
    if count:
        yield _sliced(_joined(held), 0, None)


def _sliced(entry: dict, a: int, b: int | None) -> dict:
    """Rows ``a:b`` of ``entry``, copies (a view would save the whole tensor it views)."""
    return {k: v[a:b].clone() if k != "state" else {s: x[a:b].clone() for s, x in v.items()} for k, v in entry.items()}


def _joined(parts: list[dict]) -> dict:
    if len(parts) == 1:
        return parts[0]
    out = {k: torch.cat([p[k] for p in parts]) for k in parts[0] if k != "state"}
    return out | {"state": {s: torch.cat([p["state"][s] for p in parts]) for s in parts[0]["state"]}}


def _shard_target(sh: dict, keyed: bool, dim: int) -> Target:
    """The rows and columns a saved shard entry holds, as a target to put together again."""
    cols = (int(sh.get("col_start", 0)), int(sh.get("col_end", dim)))
    if not keyed:
        a, b, step, *_ = _span(sh, dim)
        return Target((a, b, step), cols)
    if sh.get("residue") is not None:
        return Target(None, cols, (sh["residue"], sh["residues"]), first=sh["residue"] == 0)
    return Target(None, cols)
