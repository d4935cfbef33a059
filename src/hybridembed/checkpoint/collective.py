"""Distributed models: every rank saves and loads its own shards, rank 0 commits; reports exchanged so that every rank returns or every rank raises."""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..distributed import health
from ..distributed.sharded import ShardedTables
from ..errors import CheckpointError
from ..modules import EmbeddingCollection
from ..optim.wrapper import HybridOptimizer
from ..storage import serial
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
)
from .layout import (
    FORMAT_VERSION,
    MANIFEST,
    _clean,
    _dtype_name,
    _fsync_dir,
    _jsonable,
    _os_reason,
    _sha256,
    _WriteError,
)
from .links import Links, current_chain
from .local import (
    _cannot_write,
    _held,
    _load_tables,
    _loaded_from,
    _streamed,
)
from .lock import (
    _lock,
)
from .manifest import (
    _check_dense_file,
    _check_dense_names,
    _check_optimizer_kind,
    _check_shards,
    _raise,
    _sealed,
    _version_dir,
    read_manifest,
)
from .participant import CheckpointParticipant
from .pieces import Target, assemble, dynamic_parts
from .pieces import torch_load as _torch_load
from .snapshot import (
    _cloned,
    _header,
    _How,
    _incremental_entry,
    _link_plan,
    _next_version,
    _parent_candidate,
    _publish,
    _rows_per_file,
    _Snapshot,
    _sparse_meta,
    _stems,
    _storages,
    _table_files,
    _take_changes,
    _write_dense,
    _write_optimizer,
    _write_tiered,
    _write_tiered_dynamic,
)

log = get_logger("hybridembed.checkpoint")


# --- distributed models: every rank saves and loads its own shards --------------------------------
#
# A model holding ShardedCollections (he.distribute's result, a DistributedDataParallel wrapper
# or not) is saved by every rank of the job together: rank 0 makes the temporary version
# directory, every rank writes its shards' files into it (shared storage), rank 0 writes the
# dense state, the data-parallel tables, the optimizer file and the manifest from what every
# rank reports, and commits; every rank returns after the commit (or raises with the others).
# A shard's file holds its rows in the shard's own order with the manifest entry saying which
# global rows and columns they are: rows ``range(row_start, row_end, row_step)`` (a block has
# step 1, modulo placement over k shards step k) and columns ``col_start .. col_end - 1``.
def _tell_servers(colls: dict, action: str, path, options: dict, optimizer) -> None:
    """A parameter-server trainer asks its servers to join the collective save or load."""
    for sc in colls.values():
        if isinstance(sc, CheckpointParticipant):
            sc.before_checkpoint(action, str(path), {**options, "optimizer": optimizer is not None})


def _sharded_collections(model: nn.Module) -> dict[str, nn.Module]:
    """``{path: sharded module}`` of ``model`` (its ShardedCollections and PSCollections; empty for
    a model of one process)."""
    return {p: m for p, m in model.named_modules() if isinstance(m, ShardedTables)}


class _Piece:
    """One table, or one shard of one, that this rank holds: ``qualified`` is the whole table's
    checkpoint name, ``collection``/``name`` where its rows are here (``sc.local`` under
    ``t@i`` or ``t``, ``sc.replicated`` under ``t``), ``spec`` the manifest's shard entry
    without its file: which global rows and columns it holds."""

    def __init__(self, qualified: str, collection: EmbeddingCollection, name: str, spec: dict, whole):
        self.qualified, self.collection, self.name, self.spec = qualified, collection, name, spec
        self.whole = whole  # the whole table's TableConfig
        self.config = collection.tables[name]
        self.storage = collection.storage_of(name)
        self.kind = self.storage.kind  # the manifest's "dense" / "dynamic" (data)
        self.keyed = self.storage.keyed  # rows by id (dynamic), not by row number
        self.replicated = spec.get("replicated", False)


def _shard_pieces(path: str, sc) -> list[_Piece]:
    """This rank's pieces of the ShardedCollection ``sc`` at ``path``: its shards (every rank),
    and the data-parallel tables (written by rank 0, read by every rank)."""
    out = []
    for name, route in sc.routes().items():
        q = f"{path}.{name}" if path else name
        t = sc.tables[name]
        if route.replicated:
            spec = {"shard": 0, "rank": None, "replicated": True, **route.span(0).spec()}
            out.append(_Piece(q, sc.replicated, name, spec, t))
            continue
        for pos, (i, s) in enumerate(route.shards):
            if s.rank == sc.rank:
                spec = {"shard": i, "rank": s.rank, **route.span(pos).spec()}
                out.append(_Piece(q, sc.local, route.local_name(pos), spec, t))
    return out


def _global_tables(colls: Mapping[str, nn.Module]) -> dict[str, tuple[str, Any]]:
    """``{qualified: (collection path, whole TableConfig)}`` in the same order on every rank."""
    return {(f"{p}.{n}" if p else n): (p, t) for p, sc in colls.items() for n, t in sc.tables.items()}


def _group_of(colls: Mapping[str, nn.Module], model: nn.Module | None = None):
    """The process group the collections are sharded over (one for all of them)."""
    import torch.distributed as dist

    inside = {id(m) for sc in colls.values() for m in sc.modules()}
    plain = [p for p, m in (model.named_modules() if model is not None else []) if id(m) not in inside]
    plain = [p for p in plain if isinstance(model.get_submodule(p), EmbeddingCollection)]
    if plain:
        raise CheckpointError(
            f"the model holds sharded collections and unsharded EmbeddingCollection(s) at {plain}; a checkpoint "
            "of a distributed model needs every collection sharded (he.distribute shards them all)"
        )

    groups = {tuple(dist.get_process_group_ranks(sc.process_group)) for sc in colls.values()}
    if len(groups) > 1:
        raise CheckpointError(
            f"the model's sharded collections span different sets of ranks {sorted(groups)}; a checkpoint of a "
            "distributed model needs them sharded over the same process group"
        )
    return next(iter(colls.values())).process_group


def _all_report(group, mine: Any) -> list[Any]:
    """Every rank's ``mine`` on every rank (a collective: the status exchange of save and load)."""
    import torch.distributed as dist

    everyone: list[Any] = [None] * dist.get_world_size(group)
    try:
        dist.all_gather_object(everyone, mine, group=group)
    except RuntimeError as e:  # (a peer died or stopped: named, within the job's timeout)
        others = [r for r in range(len(everyone)) if r != dist.get_rank(group)]
        raise health.lost(f"rank {dist.get_rank()}: the checkpoint's exchange of reports", others, e, group) from None
    return everyone


def _failure(e: BaseException) -> str:
    if isinstance(e, _WriteError):
        return str(e)
    if isinstance(e, OSError):
        return f"{e.filename or ''}: {_os_reason(e)}".lstrip(": ")
    return str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"


def _failures(reports: list[Any]) -> list[str]:
    return [f"rank {r}: {rep[0]}" for r, rep in enumerate(reports) if rep[0] is not None]


def _snapshot_pieces(
    snap: _Snapshot,
    pieces: list[_Piece],
    stems: dict[str, str],
    optimizer,
    rank: int,
    delta: bool,
    stage=None,
    links=None,
):
    """This rank's pieces (rank 0 also the data-parallel ones), copied into ``snap.files`` (a
    tiered shard's written into ``stage`` now, a range at a time, see ``snapshot._write_tiered``;
    in a full save linked from the current chain where unchanged, ``links``); returns what the
    manifest needs of them: ``{tables: {q: [shard entries]}, meta: {q: ...}}``."""
    tables: dict[str, list[dict]] = {}
    meta: dict[str, dict] = {}
    opt_meta = _sparse_meta(optimizer) if isinstance(optimizer, HybridOptimizer) else {}
    for piece in pieces:
        if piece.replicated and rank != 0:
            continue
        q = piece.qualified
        rel = f"tables/{stems[q]}.{piece.spec['shard']:05d}.pt"
        managed = _managed(piece, optimizer)
        names = sorted(piece.storage.state) if managed else []
        changes = snap.taken[id(piece.storage)] if delta else None
        sp = piece.spec
        to_global = None
        if not piece.keyed:
            to_global = lambda r, sp=sp: r.mul(sp["row_step"]).add_(sp["row_start"])  # noqa: E731
        shard = {k: v for k, v in sp.items() if k != "replicated"}
        if managed:
            opt = opt_meta[piece.name]
            shard["step"] = opt["step"]
            meta[q] = {k: opt[k] for k in ("optimizer", "hparams", "step")}
        if piece.storage.streamed and piece.keyed and stage is not None:  # (its files written now, a part each)
            stem = f"{stems[q]}.{piece.spec['shard']:05d}"
            for sh in _write_tiered_dynamic(stage, snap, piece.storage, piece.name, stem, names, changes):
                tables.setdefault(q, []).append({**shard, **sh, "optimizer_state": names})
            continue
        if piece.storage.streamed and stage is not None:
            # a tiered shard: its files written now, a part of its rows each (global rows row_start + i * row_step)
            stem = f"{stems[q]}.{piece.spec['shard']:05d}"
            mask = changes[0] if changes is not None else None
            step, w = sp["row_step"], piece.whole
            link = None
            if not delta:
                table = {"shape": [w.num_embeddings, w.embedding_dim], "dtype": _dtype_name(w.dtype)}
                cols = (sp.get("col_start", 0), sp.get("col_end", w.embedding_dim))
                span_of = lambda lo, hi, a=sp["row_start"], st=step, c=cols: (a + lo * st, a + hi * st, st, *c)  # noqa: E731
                taken = snap.taken[id(piece.storage)][0]
                link = _link_plan(
                    links, piece.storage, piece.name, q, table | {"optimizer_state": names}, taken, span_of
                )
            parts = _write_tiered(stage, snap, piece.storage, piece.name, stem, names, mask, to_global, link=link)
            for lo, hi, rel, k in parts:
                span = {"row_start": sp["row_start"] + lo * step, "row_end": sp["row_start"] + hi * step}
                extra = {} if k is None else {"changed": k}
                tables.setdefault(q, []).append({**shard, "file": rel, **span, **extra, "optimizer_state": names})
            continue
        obj, extra = _table_files(piece.storage, piece.name, changes, names, to_global)
        snap.files[rel] = obj
        tables.setdefault(q, []).append({**shard, "file": rel, **extra, "optimizer_state": names})
    return {"tables": tables, "meta": meta}


def _checkpoint_group(group):
    """A second (gloo) process group over ``group``'s ranks for background saves: their
    collectives run beside the training's. Made once per group (collectively, the first time)."""
    import torch.distributed as dist

    ranks = tuple(dist.get_process_group_ranks(group))
    made = _CHECKPOINT_GROUPS.get(ranks)
    if made is None:
        # a group of the whole job is made by every rank, named by the count of groups made; a
        # subgroup by its members alone, named by a hash that counts the groups *this* process
        # belongs to: a rank outside another subgroup (a parameter server outside the trainers')
        # would name it differently from the others and wait for them forever
        local = len(ranks) != dist.get_world_size()
        made = dist.new_group(  # (its waits bounded by the job's timeout, as the training's)
            list(ranks), backend="gloo", use_local_synchronization=local, timeout=health.job_timeout(group)
        )
        _CHECKPOINT_GROUPS[ranks] = made
    return made


_CHECKPOINT_GROUPS: dict[tuple[int, ...], Any] = {}


def _save_sharded(root: Path, model: nn.Module, colls: dict, optimizer, extra: dict, how: _How):
    group = _group_of(colls, model)
    sc0 = next(iter(colls.values()))
    rank, world = sc0.rank, sc0.world_size
    storages = _storages(model)
    # 1. rank 0 takes the writer lock (until its cleanup after the commit), makes the temporary
    # version directory and says what an incremental save goes on
    version = tmp = error = parent = lock = refused = None
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            lock = _lock(root)
        except CheckpointError as e:  # another writer: every rank raises this message as it is
            refused = str(e)
        except Exception as e:  # noqa: BLE001 - every rank raises it below
            error = _failure(e)
        try:
            if lock is not None:
                _clean(root, how.keep)
                version = _next_version(root)
                tmp = root / f".tmp-{version}-{os.getpid()}"
                tmp.mkdir()
                parent = _parent_candidate(root, how)
        except Exception as e:  # noqa: BLE001 - every rank raises it below
            error = _failure(e)
            lock.release()
            lock = None
    try:  # (whatever fails before the thread or the commit ends: the lock is released)
        pieces = [p for path, sc in colls.items() for p in _shard_pieces(path, sc)]
        names = {p.qualified: sorted(p.storage.state) if _managed(p, optimizer) else [] for p in pieces}
        bases = sorted({str(st.checkpoint_base) for st in storages})
        new_id = uuid.uuid4().hex if rank == 0 else None
        reports = _all_report(group, (error, version, str(tmp) if tmp else None, parent, bases, names, new_id, refused))
        if reports[0][7] is not None:
            raise CheckpointError(reports[0][7])
        _raise_save(root, _failures(reports))
        version, tmp, parent = reports[0][1], Path(reports[0][2]), reports[0][3]
        if parent is not None:  # every rank's tables counted their changes from it, with the same state
            same_base = all(r[4] in ([parent["id"]], []) for r in reports)  # ([]: a rank holding no table)
            same_state = all(parent["state"].get(q) == n for r in reports for q, n in r[5].items())
            parent = parent if same_base and same_state else None
        final = root / version
        # 2. every rank copies its shards (rank 0 also the dense state and the optimizer's)
        version_id = reports[0][6]
        snap = _Snapshot(storages, {}, version_id)
        stems = _stems(list(_global_tables(colls)))
        hybrid = isinstance(optimizer, HybridOptimizer)
        dense_files: dict[str, Any] = {}
        dense_entry = dense_sd = torch_sd = snap_error = None
        part: dict[str, Any] = {"tables": {}, "meta": {}}
        try:  # (a failure here is reported with the writes below: every rank raises, none hangs)
            snap.taken = _take_changes(storages)
            chain = current_chain(root) if parent is None else None  # (a full save links what did not change)
            links = Links(chain) if chain else None
            part = _snapshot_pieces(snap, pieces, stems, optimizer, rank, parent is not None, tmp, links)
            if rank == 0:

                def copy_of(rel: str, obj: Any) -> str:
                    dense_files[rel] = _cloned(obj)
                    return rel

                dense_entry = _write_dense(copy_of, model)
                dense_sd = _cloned(optimizer.dense.state_dict()) if hybrid else None
                torch_sd = _cloned(optimizer.state_dict()) if optimizer is not None and not hybrid else None
        except Exception as e:  # noqa: BLE001
            snap_error = _failure(e)
        plans = {path: json.loads(sc.plan.to_json()) for path, sc in colls.items()}

        def run(grp) -> str:
            # 3. every rank writes its shards into the temporary directory
            files, error = dict(snap.written), snap_error
            try:
                for rel, obj in snap.files.items() if snap_error is None else ():
                    layout._write_file(tmp / rel, obj)
                    files[rel] = {"bytes": (tmp / rel).stat().st_size, "sha256": _sha256(tmp / rel)}
            except Exception as e:  # noqa: BLE001
                error = _failure(e)
            reports = _all_report(grp, (error, {**part, "files": files}))
            failed = _failures(reports)
            # 4. rank 0 writes the rest and commits; every rank learns how that went
            error = None
            if rank == 0:
                try:
                    if failed:
                        raise CheckpointError("")  # (the failures are reported by every rank below)
                    parts = [r[1] for r in reports]
                    manifest = _sharded_manifest(colls, extra, parts, world, version_id, parent, plans)
                    all_files: dict[str, Any] = {}
                    for p in parts:
                        all_files.update(p["files"])
                    meta = {}
                    for p in parts:
                        meta.update({q: m for q, m in p["meta"].items() if q not in meta})
                    sparse = None
                    if hybrid:
                        sparse = {}
                        for q, m in meta.items():  # a shard's step counts its own updates: each shard has its own
                            steps = [e["step"] for e in manifest["tables"][q]["shards"] if "step" in e]
                            sparse[q] = {**m, "step": max(steps), "shape": manifest["tables"][q]["shape"]}

                    def write(rel: str, obj: Any) -> str:
                        layout._write_file(tmp / rel, obj)
                        all_files[rel] = {"bytes": (tmp / rel).stat().st_size, "sha256": _sha256(tmp / rel)}
                        return rel

                    for rel, obj in dense_files.items():
                        write(rel, obj)
                    manifest["dense"] = dense_entry
                    manifest["optimizer"] = _write_optimizer(write, optimizer, dense_sd, sparse, torch_sd)
                    manifest["extra"] = extra
                    manifest["files"] = dict(sorted(all_files.items()))
                    layout._write_file(tmp / MANIFEST, (json.dumps(_sealed(manifest), indent=1) + "\n").encode())
                    for d in {tmp, *(p.parent for p in tmp.rglob("*") if p.is_file())}:
                        _fsync_dir(d)
                    _publish(root, tmp, version)
                except BaseException as e:
                    shutil.rmtree(tmp, ignore_errors=True)
                    error = _failure(e) if not failed else None
                    if not isinstance(e, Exception):
                        raise
            reports = _all_report(grp, (error,))  # every rank returns after the commit
            _raise_save(root, failed + _failures(reports))
            if rank == 0:
                _clean(root, how.keep)
                kind = f"incremental, {parent['length']} on top of a full one" if parent else "full"
                log.info("saved checkpoint %s (%d ranks, %s)", final, world, kind)
            return str(final)

        def locked_run(grp) -> str:
            try:
                return run(grp)
            finally:  # (rank 0: after its cleanup, the next writer may start)
                if lock is not None:
                    lock.release()

        if how.background:
            grp = _checkpoint_group(group)
            return SaveHandle(model, snap, lambda: locked_run(grp), lambda e: _cannot_write(root, e))
        try:
            out = locked_run(group)
        except BaseException:
            snap.finish(False)
            raise
        snap.finish(True)
        return out
    except BaseException:
        if lock is not None:
            lock.release()
        raise


def _raise_save(root: Path, failed: list[str]) -> None:
    if failed:
        lines = "\n".join(f"  - {f}" for f in failed)
        raise CheckpointError(
            f"cannot write the checkpoint {root}; the previous version, if any, is intact; check that the "
            f"directory is shared by every rank, writable and has free space:\n{lines}"
        )


def _sharded_manifest(colls: dict, extra: dict, parts: list[dict], world: int, version_id, parent, plans) -> dict:
    """The manifest of a distributed save (rank 0), from every rank's report of its shards
    (without dense, optimizer, extra and files: the caller adds them)."""
    shards: dict[str, list[dict]] = {}
    for part in parts:
        for q, entries in part["tables"].items():
            shards.setdefault(q, []).extend(entries)
    table_entries = {}
    for q, (path, t) in _global_tables(colls).items():
        entries = sorted(shards.get(q, []), key=lambda s: s["shard"])
        state = entries[0].pop("optimizer_state") if entries else []
        for e in entries[1:]:
            e.pop("optimizer_state")
        dynamic = t.dynamic is not None
        tp = colls[path].plan.table(t.name)
        table_entries[q] = {
            "kind": "dynamic" if dynamic else "dense",
            "collection": path,
            "table": t.name,
            "shape": [t.num_embeddings, t.embedding_dim],
            "dtype": _dtype_name(t.dtype),
            "rows": sum(e["rows"] for e in entries if e["col_start"] == 0) if dynamic else t.num_embeddings,
            "optimizer_state": state,
            "sharding": tp.sharding,
            "placement": tp.placement,
            "shards": entries,
        }
        if dynamic:
            table_entries[q]["dynamic"] = _jsonable(vars(t.dynamic))
    manifest = _header(world, version_id)
    if parent is not None:
        manifest["incremental"] = _incremental_entry(parent)
        manifest["format_version"] = FORMAT_VERSION
    manifest["plans"] = plans
    manifest["tables"] = table_entries
    return manifest


def _check_sharded_model(manifest: dict, model: nn.Module, colls: dict, optimizer) -> list[str]:
    """The distributed model (tables, dense state, optimizer) against the manifest. Any world
    size and plan loads: each rank reads the rows and columns its shards hold now."""
    saved = manifest["tables"]
    mine = _global_tables(colls)
    problems = [f"table {q!r} is in the model but missing from the checkpoint" for q in mine if q not in saved]
    problems += [
        f"unexpected table {q!r} in the checkpoint: the model has no such table" for q in saved if q not in mine
    ]
    for q, (_, t) in mine.items():
        s = saved.get(q)
        if s is None:
            continue
        kind = "dynamic" if t.dynamic is not None else "dense"
        if (s.get("kind"), s.get("shape"), s.get("dtype")) != (
            kind,
            [t.num_embeddings, t.embedding_dim],
            _dtype_name(t.dtype),
        ):
            problems.append(
                f"table {q!r}: {s.get('kind')} {s.get('shape')} {s.get('dtype')} in the checkpoint, {kind} "
                f"{[t.num_embeddings, t.embedding_dim]} {_dtype_name(t.dtype)} in the model"
            )
        else:
            problems += _check_shards(q, s)
    problems += _check_dense_names(manifest, model)
    if optimizer is not None:
        problems += _check_optimizer_kind(manifest, optimizer)
    return problems


def _target(piece: _Piece) -> Target:
    """The rows and columns of the whole table that ``piece`` holds."""
    sp = piece.spec
    cols = (sp["col_start"], sp["col_end"])
    if not piece.keyed:
        return Target((sp["row_start"], sp["row_end"], sp["row_step"]), cols)
    if "residue" in sp:
        return Target(None, cols, (sp["residue"], sp["residues"]), first=sp["residue"] == 0)
    return Target(None, cols)


def _managed(piece: _Piece, optimizer) -> bool:
    return isinstance(optimizer, HybridOptimizer) and any(st is piece.storage for st in optimizer._storages)


def _prepare_sharded(path, model: nn.Module, colls: dict, optimizer, verify: bool) -> dict:
    """Read and check everything this rank loads; raise a CheckpointError listing its problems."""
    manifest = read_manifest(path)
    vdir = Path(manifest["path"])
    chain = _chain(manifest)
    problems = _held(_storages(model)) + _check_sharded_model(manifest, model, colls, optimizer)
    _raise(vdir, problems + (_check_chain(chain) if not problems else []), "does not match the model")
    pieces = [p for path_, sc in colls.items() for p in _shard_pieces(path_, sc)]
    names = {id(p): _state_names(manifest, p.qualified, optimizer) if _managed(p, optimizer) else [] for p in pieces}
    reads = [(p.qualified, _target(p), p.keyed) for p in pieces]
    opt_entry = manifest["optimizer"] if optimizer is not None else None
    _raise(vdir, problems + _check_chain_files(chain, reads, optimizer is not None, verify)[0], "is damaged")

    hybrid = isinstance(optimizer, HybridOptimizer)
    sparse_meta = (opt_entry or {}).get("sparse", {})
    loaded = []
    parted = {}  # (id(storage), table): a tiered dynamic shard's rows, a file at a time
    for piece in pieces:
        q = piece.qualified
        where = f"table {q!r} shard {piece.spec['shard']}"
        target = _target(piece)
        versions = _versions_of(chain, q)
        dim, parts = piece.whole.embedding_dim, None
        if piece.storage.streamed and piece.keyed:  # (tiered dynamic: file by file)
            entry, parts, probs = dynamic_parts(q, versions, target, dim, names[id(piece)])
        else:
            read = _streamed if piece.storage.streamed else assemble  # (tiered: range by range)
            entry, probs = read(q, versions, target, dim, piece.keyed, names[id(piece)])
        if probs:
            problems += probs
            continue
        state = entry.pop("state")
        missing, errors = serial.check_entry(piece.storage, piece.name, entry, f"{where}: ", strict_dtype=True)
        problems += [f"{k}: missing" for k in missing] + errors
        if _managed(piece, optimizer) and not missing and not errors:
            have = serial.state_shapes(piece.storage, piece.name)
            rows = entry["ids"].numel() if piece.keyed else piece.config.num_embeddings
            if set(state) != set(have):
                problems.append(f"{where}: optimizer state {sorted(state)} in the checkpoint, {sorted(have)} here")
            for k, v in state.items():
                want = (rows, *have[k][1:]) if k in have else None
                if want is not None and (not torch.is_tensor(v) or tuple(v.shape) != want):
                    problems.append(f"{where}: optimizer state {k!r} is {_shape(v)}, expected {want}")
            meta = sparse_meta.get(q)
            if not isinstance(meta, dict) or meta.get("optimizer") != piece.storage.optimizer.name:
                got = meta.get("optimizer") if isinstance(meta, dict) else "none"
                problems.append(f"table {q!r}: optimizer {got} in the checkpoint, {piece.storage.optimizer.name} here")
        steps = [sh["step"] for sh in versions[-1][1]["shards"] if "step" in sh]
        loaded.append((piece, entry, state, max(steps) if steps else (sparse_meta.get(q) or {}).get("step", 0)))
        if parts is not None:
            rows = _rows_per_file(piece.storage, names[id(piece)])
            parted[(id(piece.storage), piece.name)] = lambda parts=parts, rows=rows: parts(rows)
    dense = _torch_load(vdir, manifest["dense"]["file"])
    if not isinstance(dense, dict):
        problems.append(f"file {manifest['dense']['file']!r} does not hold a state_dict")
    else:
        problems += _check_dense_file(manifest["dense"]["file"], dense, model)
    opt_file = None
    if optimizer is not None:
        opt_file = _torch_load(vdir, opt_entry["file"])
        sd = opt_file.get("dense" if hybrid else "state_dict") if isinstance(opt_file, dict) else None
        if not isinstance(sd, dict) or opt_file.get("kind") != opt_entry["kind"] or "param_groups" not in sd:
            problems.append(f"file {opt_entry['file']!r} does not hold the optimizer state")
        else:
            sizes = [len(g["params"]) for g in (optimizer.dense if hybrid else optimizer).param_groups]
            saved_sizes = [len(g.get("params", [])) for g in sd["param_groups"]]
            if saved_sizes != sizes and not getattr(optimizer, "dense_elsewhere", False):
                problems.append(f"the optimizer file's parameter groups hold {saved_sizes} parameters, here {sizes}")
    _raise(vdir, problems, "does not match the model")
    return {
        "manifest": manifest,
        "loaded": loaded,
        "dense": dense,
        "opt_file": opt_file,
        "chain": chain,
        "names": names,
        "parted": parted,
    }


def _shape(v: Any) -> str:
    return f"{tuple(v.shape)} {_dtype_name(v.dtype)}" if torch.is_tensor(v) else type(v).__name__


def _refuse_load(path, failed: list[str | None]) -> None:
    """Every rank raises one CheckpointError when any rank's report (``failed[rank]``) is an error."""
    if all(f is None for f in failed):
        return
    ranks: dict[str, list[int]] = {}
    for r, f in enumerate(failed):
        if f is not None:
            ranks.setdefault(f, []).append(r)
    lines = "\n".join(f"rank {', '.join(map(str, rs))}: {f}" for f, rs in ranks.items())
    raise CheckpointError(f"checkpoint {path} cannot be loaded; no rank changed anything:\n{lines}")


def _agreed_version(path, group, rank: int) -> Path:
    """The version directory every rank loads: the one ``path``'s LATEST names when rank 0 reads
    it, read once for the job (ranks reading it each would load different versions if a save
    committed in between)."""
    name, error = None, None
    if rank == 0:
        try:
            vdir = _version_dir(path)
            name = vdir.name if vdir != Path(path) else None  # (None: ``path`` is a version directory)
        except Exception as e:  # noqa: BLE001 - every rank hears of it below
            error = _failure(e)
    reports = _all_report(group, (error, name))
    _refuse_load(path, [rep[0] for rep in reports])
    name = reports[0][1]
    return Path(path) / name if name is not None else Path(path)


def _load_sharded(path, model: nn.Module, colls: dict, optimizer, verify: bool) -> dict[str, Any]:
    """Rank 0 says which version, every rank checks what it loads of it, the ranks exchange their
    verdicts, and all load or none does."""
    group = _group_of(colls, model)
    vdir = _agreed_version(path, group, next(iter(colls.values())).rank)
    prepared, error = None, None
    try:
        prepared = _prepare_sharded(vdir, model, colls, optimizer, verify)
    except Exception as e:  # noqa: BLE001 - every rank hears of it below
        error = _failure(e)
    _refuse_load(path, [rep[0] for rep in _all_report(group, (error,))])
    manifest, loaded, dense = prepared["manifest"], prepared["loaded"], prepared["dense"]
    # --- every rank checked its part; from here on, apply ---------------------------------------
    if dense:
        model.load_state_dict(dense, strict=False)
    tiered = {id(p) for p, *_ in loaded if p.storage.streamed and not p.keyed}
    parted = prepared["parted"]
    rest = [(piece.storage, piece.name, entry) for piece, entry, _, _ in loaded if id(piece) not in tiered]
    _load_tables(rest, parted)
    for piece, *_ in loaded:  # (tiered shards: checked range by range, now written range by range)
        if id(piece) in tiered:
            versions, names = _versions_of(prepared["chain"], piece.qualified), prepared["names"][id(piece)]
            _, late = _streamed(
                piece.qualified, versions, _target(piece), piece.whole.embedding_dim, False, names, piece
            )
            _raise(Path(manifest["path"]), late, "changed while it was loaded (a shard is partly loaded: load again)")
    opt_file = prepared["opt_file"]
    if optimizer is not None and opt_file["kind"] == "torch":
        optimizer.load_state_dict(opt_file["state_dict"])
    elif optimizer is not None:
        sparse = {}
        for piece, entry, state, step in loaded:
            if not any(st is piece.storage for st in optimizer._storages):
                continue
            meta = opt_file["sparse"].get(piece.qualified, {})
            came = id(piece) in tiered or (id(piece.storage), piece.name) in parted  # (with the rows)
            sparse[piece.name] = {
                "shape": [piece.config.num_embeddings, piece.config.embedding_dim],
                "ids": entry["ids"] if piece.keyed else None,
                "optimizer": piece.storage.optimizer.name,
                "hparams": meta.get("hparams", {}),
                "step": int(step),
                "state": {} if came else state,
                "state_loaded": came,
            }
        optimizer.load_state_dict({"dense": opt_file["dense"], "sparse": sparse, "format": 1})
    _loaded_from(manifest, {id(st): st for sc in colls.values() for st in sc.storages}.values(), optimizer)
    log.info("loaded checkpoint %s (rank %d)", manifest["path"], next(iter(colls.values())).rank)
    return manifest
