"""Reading a version: its manifest (checksummed, every field's type checked) and the checks of a model, its optimizer and the files against it."""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import CheckpointError
from ..optim.wrapper import HybridOptimizer
from ..storage import serial
from ..utils import get_logger
from . import layout
from .layout import (
    _VERSION_RE,
    CHECKSUM_KEY,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    POINTER,
    _decode_floats,
    _dense_state,
    _dtype_name,
    _sha256,
    _Table,
    _table_of_storage,
)
from .pieces import span as _span

log = get_logger("hybridembed.checkpoint")


# --- load ---------------------------------------------------------------------------------------------
def _version_dir(path: str | os.PathLike) -> Path:
    root = Path(path)
    if (root / MANIFEST).is_file():  # a version directory itself
        return root
    if not root.is_dir():
        raise CheckpointError(f"no checkpoint at {root}: not a directory")
    pointer = root / POINTER
    if not pointer.is_file():
        raise CheckpointError(f"no checkpoint at {root}: {POINTER} is missing (no save ever completed there)")
    name = layout._read_pointer(root)
    if not _VERSION_RE.match(name):
        raise CheckpointError(f"{pointer} holds {name!r}, not a version name like 'v-000001'")
    if not (root / name).is_dir():
        raise CheckpointError(f"{pointer} names {name!r}, which is missing from {root}")
    return root / name


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """The manifest of the checkpoint at ``path`` (its directory, or a version directory in it), checked
    for format and version; ``["path"]`` is the version directory it was read from."""
    vdir = _version_dir(path)
    mpath = vdir / MANIFEST
    try:
        manifest = json.loads(mpath.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{mpath} is missing") from None
    except (ValueError, UnicodeDecodeError) as e:  # (JSONDecodeError is a ValueError)
        raise CheckpointError(f"{mpath} is not valid JSON ({e}); the checkpoint is damaged") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{mpath} is not a hybridembed checkpoint manifest (format != {FORMAT!r})")
    version = manifest.get("format_version")
    if isinstance(version, bool) or version not in (1, 2, FORMAT_VERSION):
        raise CheckpointError(
            f"{mpath}: checkpoint format version {version!r} is unknown; this hybridembed "
            f"({_version()}) reads versions 1 to {FORMAT_VERSION}"
            + ("; upgrade hybridembed" if isinstance(version, int) and version > FORMAT_VERSION else "")
        )
    if version >= 2:
        stored = manifest.pop(CHECKSUM_KEY, None)
        if stored != _manifest_sha256(manifest):
            what = "has no checksum" if stored is None else "does not match its checksum"
            raise CheckpointError(
                f"{mpath} {what} (field {CHECKSUM_KEY!r}): the manifest was changed or damaged after it was "
                "written; nothing was loaded. Load an older version directory of this checkpoint, or save again"
            )
    else:
        log.warning("%s: format version 1 has no manifest checksum; save again to get one", mpath)
    problems = _manifest_problems(manifest)
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise CheckpointError(f"{mpath} is malformed; nothing was loaded:\n{lines}")
    manifest["extra"] = _decode_floats(manifest["extra"])  # (checked above in its stored form)
    manifest["path"] = str(vdir)  # where it was read from (not stored in the file)
    return manifest


def _manifest_sha256(manifest: Mapping[str, Any]) -> str:
    """sha256 of the canonical JSON (sorted keys, no spaces, ASCII) of ``manifest`` without its checksum."""
    body = {k: v for k, v in manifest.items() if k != CHECKSUM_KEY}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return hashlib.sha256(text.encode("ascii")).hexdigest()


def _sealed(manifest: dict[str, Any]) -> dict[str, Any]:
    """``manifest`` with its checksum added under :data:`CHECKSUM_KEY` (last)."""
    return {**manifest, CHECKSUM_KEY: _manifest_sha256(manifest)}


# --- the manifest's schema: the type of every field -----------------------------------------------
def _is_int(v: Any, low: int | None = 0) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and (low is None or v >= low)


def _kind_name(v: Any) -> str:
    return "null" if v is None else type(v).__name__


class _Schema:
    """Collects ``field 'a.b': expected ..., got ...`` for every wrongly typed field of a manifest."""

    def __init__(self) -> None:
        self.problems: list[str] = []

    def bad(self, where: str, expected: str, got: Any) -> None:
        shown = repr(got) if not isinstance(got, (dict, list)) or len(repr(got)) < 60 else _kind_name(got)
        self.problems.append(f"field {where!r}: expected {expected}, got {shown}")

    def need(self, d: Mapping, key: str, where: str, test, expected: str) -> Any:
        if key not in d:
            self.problems.append(f"field {(where + '.' if where else '') + key!r} is missing")
            return None
        v = d[key]
        if not test(v):
            self.bad((where + "." if where else "") + key, expected, v)
            return None
        return v


def _dict(v: Any) -> bool:
    return isinstance(v, dict)


def _str(v: Any) -> bool:
    return isinstance(v, str)


def _manifest_problems(m: dict[str, Any]) -> list[str]:
    """Every field of the manifest whose type (or range) is wrong; empty when it is well formed."""
    s = _Schema()
    for key in ("hybridembed_version", "torch_version", "created"):
        s.need(m, key, "", _str, "a string")
    s.need(m, "world_size", "", lambda v: _is_int(v, 1), "an int >= 1")
    s.need(m, "extra", "", _dict, "an object")
    tables = s.need(m, "tables", "", _dict, "an object {table: entry}") or {}
    for q, t in tables.items():
        w = f"tables.{q}"
        if not _dict(t):
            s.bad(w, "an object", t)
            continue
        kind = s.need(t, "kind", w, lambda v: v in ("dense", "dynamic"), "'dense' or 'dynamic'")
        s.need(t, "collection", w, _str, "a string")
        s.need(t, "table", w, _str, "a string")
        s.need(t, "dtype", w, _str, "a string")
        s.need(t, "rows", w, _is_int, "an int >= 0")
        s.need(t, "optimizer_state", w, lambda v: isinstance(v, list) and all(map(_str, v)), "a list of strings")
        rows_ok = (lambda v: v is None) if kind == "dynamic" else _is_int
        s.need(
            t,
            "shape",
            w,
            lambda v, rows_ok=rows_ok: isinstance(v, list) and len(v) == 2 and rows_ok(v[0]) and _is_int(v[1], 1),
            "[null, dim]" if kind == "dynamic" else "[rows, dim] (ints)",
        )
        if kind == "dynamic":
            s.need(t, "dynamic", w, _dict, "an object (the Dynamic settings)")
        shards = s.need(t, "shards", w, lambda v: isinstance(v, list) and len(v) > 0, "a non-empty list") or []
        for i, sh in enumerate(shards):
            ws = f"{w}.shards[{i}]"
            if not _dict(sh):
                s.bad(ws, "an object", sh)
                continue
            s.need(sh, "file", ws, _str, "a string")
            if kind == "dense":
                s.need(sh, "row_start", ws, _is_int, "an int >= 0")
                s.need(sh, "row_end", ws, _is_int, "an int >= 0")
            elif "rows" in sh:
                s.need(sh, "rows", ws, _is_int, "an int >= 0")
            for key in ("row_step", "col_start", "col_end", "shard", "step", "changed", "removed", "residue", "part"):
                if key in sh:
                    s.need(sh, key, ws, lambda v, key=key: _is_int(v, 1 if key == "row_step" else 0), "an int")
            if "residue" in sh:  # a dynamic table's hash shard: ids whose hash residue of residues is residue
                s.need(
                    sh,
                    "residues",
                    ws,
                    lambda v, r=sh["residue"]: _is_int(v, 1) and (not _is_int(r) or r < v),
                    "an int > residue",
                )
            if sh.get("rank") is not None:
                s.need(sh, "rank", ws, _is_int, "an int >= 0 or null")
    if "id" in m:
        s.need(m, "id", "", _str, "a string")
    if "incremental" in m:
        inc = s.need(m, "incremental", "", _dict, "an object {parent, base, length}") or {}
        for key in ("parent", "base"):
            ref = s.need(inc, key, "incremental", _dict, "an object {version, id}") if inc else None
            if ref:
                s.need(ref, "version", f"incremental.{key}", _str, "a string")
                s.need(ref, "id", f"incremental.{key}", _str, "a string")
        if inc:
            s.need(inc, "length", "incremental", lambda v: _is_int(v, 1), "an int >= 1")
    if "plans" in m:
        plans = s.need(m, "plans", "", _dict, "an object {collection path: plan}") or {}
        for path, plan in plans.items():
            if not _dict(plan):
                s.bad(f"plans.{path}", "an object (a Plan's JSON)", plan)
    dense = s.need(m, "dense", "", _dict, "an object") or {}
    if dense:
        s.need(dense, "file", "dense", _str, "a string")
        tensors = s.need(dense, "tensors", "dense", _dict, "an object {name: {shape, dtype}}") or {}
        for k, spec in tensors.items():
            w = f"dense.tensors.{k}"
            if not _dict(spec):
                s.bad(w, "an object", spec)
                continue
            s.need(spec, "shape", w, lambda v: isinstance(v, list) and all(_is_int(x) for x in v), "a list of ints")
            s.need(spec, "dtype", w, _str, "a string")
        s.need(dense, "other", "dense", lambda v: isinstance(v, list) and all(map(_str, v)), "a list of strings")
    opt = m.get("optimizer", None) if "optimizer" in m else s.need(m, "optimizer", "", _dict, "")
    if opt is not None:
        if not _dict(opt):
            s.bad("optimizer", "an object or null", opt)
        else:
            s.need(opt, "file", "optimizer", _str, "a string")
            s.need(opt, "kind", "optimizer", lambda v: v in ("hybrid", "torch"), "'hybrid' or 'torch'")
            s.need(opt, "dense", "optimizer", _str, "a string (the optimizer's class)")
            groups = s.need(opt, "dense_param_groups", "optimizer", lambda v: isinstance(v, list), "a list") or []
            for i, g in enumerate(groups):
                w = f"optimizer.dense_param_groups[{i}]"
                if not _dict(g):
                    s.bad(w, "an object", g)
                    continue
                s.need(g, "num_params", w, _is_int, "an int >= 0")
            sparse = s.need(opt, "sparse", "optimizer", _dict, "an object {table: entry}") or {}
            for q, e in sparse.items():
                w = f"optimizer.sparse.{q}"
                if not _dict(e):
                    s.bad(w, "an object", e)
                    continue
                s.need(e, "optimizer", w, _str, "a string")
                s.need(e, "hparams", w, _dict, "an object")
                s.need(e, "step", w, _is_int, "an int >= 0")
    files = s.need(m, "files", "", _dict, "an object {file: {bytes, sha256}}") or {}
    for rel, spec in files.items():
        w = f"files.{rel}"
        if not _dict(spec):
            s.bad(w, "an object", spec)
            continue
        s.need(spec, "bytes", w, _is_int, "an int >= 0")
        s.need(spec, "sha256", w, lambda v: isinstance(v, str) and re.fullmatch(r"[0-9a-f]{64}", v), "64 hex digits")
    return s.problems


def checkpoint_tables(path: str | os.PathLike) -> dict[str, dict[str, Any]]:
    """``{table: {kind, shape, dtype, rows}}`` of the checkpoint at ``path``, read from its manifest."""
    m = read_manifest(path)
    return {q: {k: t[k] for k in ("kind", "shape", "dtype", "rows")} for q, t in m["tables"].items()}


def _version() -> str:
    import hybridembed

    return hybridembed.__version__


def _check_model(manifest: dict, model: nn.Module, optimizer, tables: dict[str, _Table]) -> list[str]:
    """Every difference between the checkpoint and the model / optimizer (empty: they match)."""
    problems: list[str] = []
    saved = manifest["tables"]
    for q in tables:
        if q not in saved:
            problems.append(f"table {q!r} is in the model but missing from the checkpoint")
    for q in saved:
        if q not in tables:
            problems.append(f"unexpected table {q!r} in the checkpoint: the model has no such table")
    for q, t in tables.items():
        s = saved.get(q)
        if s is None:
            continue
        if s.get("kind") != t.kind:
            problems.append(f"table {q!r} is {s.get('kind')} in the checkpoint but {t.kind} in the model")
            continue
        shape = s.get("shape") or [None, None]
        if shape[1] != t.config.embedding_dim:
            problems.append(
                f"table {q!r}: dim changed: {shape[1]} in the checkpoint, {t.config.embedding_dim} in the model"
            )
        if not t.keyed and shape[0] != t.config.num_embeddings:
            problems.append(
                f"table {q!r}: rows changed: {shape[0]} in the checkpoint, {t.config.num_embeddings} in the model"
            )
        if s.get("dtype") != t.dtype:
            problems.append(f"table {q!r}: dtype changed: {s.get('dtype')} in the checkpoint, {t.dtype} in the model")
        problems.extend(_check_shards(q, s))
    problems.extend(_check_capacity(saved, tables))
    problems.extend(_check_dense_names(manifest, model))
    if optimizer is not None:
        problems.extend(_check_optimizer(manifest, optimizer, tables))
    return problems


def _check_dense_names(manifest: dict, model: nn.Module) -> list[str]:
    """The model's parameters and buffers outside the tables against the manifest's (names, shapes, dtypes)."""
    problems: list[str] = []
    have = _dense_state(model)
    want = manifest["dense"].get("tensors", {})
    other = set(manifest["dense"].get("other", []))
    for k in have:
        if k not in want and k not in other:
            problems.append(f"parameter/buffer {k!r} is in the model but missing from the checkpoint")
    for k in list(want) + sorted(other):
        if k not in have:
            problems.append(f"unexpected parameter/buffer {k!r} in the checkpoint")
    for k, spec in want.items():
        v = have.get(k)
        if torch.is_tensor(v):
            if list(v.shape) != spec.get("shape"):
                problems.append(f"{k!r}: shape {spec.get('shape')} in the checkpoint, {list(v.shape)} in the model")
            elif _dtype_name(v.dtype) != spec.get("dtype"):
                problems.append(
                    f"{k!r}: dtype {spec.get('dtype')} in the checkpoint, {_dtype_name(v.dtype)} in the model"
                )
    return problems


def _check_shards(q: str, s: dict) -> list[str]:
    shards = s.get("shards")
    if not isinstance(shards, list) or not shards:
        return [f"table {q!r}: the manifest lists no shards"]
    if s["kind"] == "dynamic":
        if not all(isinstance(x, dict) and "file" in x for x in shards):
            return [f"table {q!r}: malformed shards"]
        return _check_dynamic_shards(q, shards, s["shape"][1])
    rows, dim = s["shape"]
    try:
        spans = [_span(x, dim) for x in shards]
    except (KeyError, TypeError, ValueError):
        return [f"table {q!r}: malformed shards (each needs file, row_start, row_end)"]
    if any(step < 1 or not 0 <= c0 < c1 <= dim for _, _, step, c0, c1 in spans):
        return [f"table {q!r}: malformed shards (row_step < 1 or columns outside 0..{dim})"]
    if all(step == 1 and (c0, c1) == (0, dim) for _, _, step, c0, c1 in spans):  # row blocks
        pos = 0
        for a, b, *_ in sorted(spans):
            if a != pos or b < a:
                return [f"table {q!r}: shards do not tile rows 0..{rows} (gap or overlap at row {pos})"]
            pos = b
        if pos != rows:
            return [f"table {q!r}: shards cover rows 0..{pos}, the table has {rows}"]
        return []
    # residues and column slices (a distributed save): every (row, column) exactly once
    cols = sorted({(c0, c1) for *_, c0, c1 in spans})
    if [c0 for c0, _ in cols] != [0, *(c1 for _, c1 in cols[:-1])] or cols[-1][1] != dim:
        return [f"table {q!r}: the shards' columns {cols} do not tile 0..{dim}"]
    for c in cols:
        count = torch.zeros(rows, dtype=torch.int32)
        for a, b, step, c0, c1 in spans:
            if (c0, c1) == c:
                count[a:b:step] += 1
        if rows and not bool((count == 1).all()):
            row = int((count != 1).nonzero()[0])
            return [f"table {q!r}: shards do not tile rows 0..{rows} of columns {c[0]}..{c[1]} (row {row})"]
    return []


def _check_dynamic_shards(q: str, shards: list[dict], dim: int) -> list[str]:
    """A dynamic table's shards: column slices tiling 0..dim, each split into hash residues
    0..k-1 (every id in exactly one) or whole; a shard saved in several files (a tiered table's:
    ``part`` 1, 2, .. after the first) counts once."""
    groups: dict[tuple[int, int], list] = {}
    where = lambda x: (int(x.get("col_start", 0)), int(x.get("col_end", dim)))  # noqa: E731
    firsts = [x for x in shards if not x.get("part")]
    for x in firsts:
        groups.setdefault(where(x), []).append(x.get("residue"))
    heads = {(where(x), x.get("residue"), x.get("shard")) for x in firsts}
    if any((where(x), x.get("residue"), x.get("shard")) not in heads for x in shards if x.get("part")):
        return [f"table {q!r}: a shard's later part without its first"]
    cols = sorted(groups)
    if [c0 for c0, _ in cols] != [0, *(c1 for _, c1 in cols[:-1])] or cols[-1][1] != dim:
        return [f"table {q!r}: the shards' columns {cols} do not tile 0..{dim}"]
    for c, residues in groups.items():
        if all(r is None for r in residues):  # whole, or split without saying how (ids are unique anyway)
            continue
        ks = {x.get("residues") for x in firsts if where(x) == c}
        if None in residues or len(ks) != 1 or sorted(residues) != list(range(next(iter(ks)))):
            return [f"table {q!r}: the hash shards of columns {c[0]}..{c[1]} hold residues {residues}, not 0..k-1 once"]
    return []


def _check_capacity(saved: dict, tables: dict[str, _Table]) -> list[str]:
    """Every dynamic table's saved rows must fit its own capacity (``Dynamic.capacity`` is per table)."""
    problems = []
    for q, t in tables.items():
        if not t.keyed or q not in saved or saved[q].get("kind") != t.kind:
            continue
        cap = t.storage.capacity
        rows = int(saved[q].get("rows", 0))
        if cap is not None and rows > cap:
            problems.append(
                f"dynamic table {q!r}: {rows} rows in the checkpoint do not fit its capacity {cap}; "
                "raise Dynamic(capacity=...)"
            )
    return problems


def _check_optimizer(manifest: dict, optimizer, tables: dict[str, _Table]) -> list[str]:
    problems = _check_optimizer_kind(manifest, optimizer)
    entry = manifest.get("optimizer")
    if not entry or entry.get("kind") != "hybrid" or not isinstance(optimizer, HybridOptimizer):
        return problems
    saved = entry.get("sparse", {})
    by_name = _table_of_storage(tables)
    mine = {by_name[n]: o for n, o in optimizer.sparse_optimizers().items() if n in by_name}
    for q in sorted(set(mine) - set(saved)):
        problems.append(f"table {q!r}: the checkpoint holds no optimizer state for it")
    for q in sorted(set(saved) - set(mine)):
        problems.append(f"unexpected optimizer state for table {q!r}")
    for q, opt in mine.items():
        if q not in saved:
            continue
        if saved[q].get("optimizer") != opt.name:
            problems.append(f"table {q!r}: optimizer {saved[q].get('optimizer')} in the checkpoint, {opt.name} here")
        names = sorted(tables[q].storage.state)
        if q in manifest["tables"] and sorted(manifest["tables"][q].get("optimizer_state", [])) != names:
            problems.append(
                f"table {q!r}: optimizer state {sorted(manifest['tables'][q].get('optimizer_state', []))} in the "
                f"checkpoint, {names} here"
            )
    return problems


def _check_optimizer_kind(manifest: dict, optimizer) -> list[str]:
    """The optimizer's kind (hybrid or torch), dense class and parameter groups against the manifest."""
    entry = manifest.get("optimizer")
    if not entry:
        return ["the checkpoint holds no optimizer state (saved without optimizer=); load with optimizer=None"]
    hybrid = isinstance(optimizer, HybridOptimizer)
    if entry.get("kind") != ("hybrid" if hybrid else "torch"):
        return [
            f"optimizer kind changed: {entry.get('kind')} in the checkpoint, "
            f"{'hybrid (he.wrap_optimizer)' if hybrid else 'plain torch'} here"
        ]
    problems: list[str] = []
    if getattr(optimizer, "dense_elsewhere", False):  # a parameter server: the trainers check the dense part
        return problems
    dense = optimizer.dense if hybrid else optimizer
    if entry.get("dense") != type(dense).__name__:
        problems.append(f"optimizer changed: {entry.get('dense')} in the checkpoint, {type(dense).__name__} here")
    groups = entry.get("dense_param_groups", [])
    sizes = [len(g["params"]) for g in dense.param_groups]
    if [g.get("num_params") for g in groups] != sizes:
        problems.append(
            f"optimizer parameter groups differ: {[g.get('num_params') for g in groups]} parameters per group "
            f"in the checkpoint, {sizes} here"
        )
    return problems


def _check_files(vdir: Path, manifest: dict, verify: bool) -> list[str]:
    """The files ``manifest["files"]`` lists, checked (and, for a whole manifest, every file it uses listed)."""
    problems = []
    listed = manifest["files"]
    needed = set()
    if "tables" in manifest:
        needed = {s["file"] for t in manifest["tables"].values() for s in t.get("shards", []) if isinstance(s, dict)}
        needed.add(manifest["dense"].get("file", "dense.pt"))
        if manifest.get("optimizer"):
            needed.add(manifest["optimizer"].get("file", "optimizer.pt"))
    for rel in sorted(needed - set(listed)):
        problems.append(f"file {rel!r} is used but not listed (with size and checksum) in the manifest")
    for rel, spec in sorted(listed.items()):
        p = vdir / rel
        if ".." in Path(rel).parts or Path(rel).is_absolute():
            problems.append(f"file {rel!r}: not a path inside the checkpoint")
            continue
        if not p.is_file():
            problems.append(f"file {rel!r} is missing")
            continue
        size = p.stat().st_size
        if size != spec.get("bytes"):
            what = "truncated" if size < spec.get("bytes", 0) else "larger than written"
            problems.append(f"file {rel!r} is {what}: {size} bytes, the manifest says {spec.get('bytes')}")
            continue
        if verify and _sha256(p) != spec.get("sha256"):
            problems.append(f"file {rel!r}: checksum mismatch (sha256 differs from the manifest): the file is corrupt")
    return problems


def _raise(vdir: Path, problems: list[str], what: str) -> None:
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise CheckpointError(f"checkpoint {vdir} {what}; nothing was loaded:\n{lines}")


def _check_dense_file(rel: str, dense: dict, model: nn.Module) -> list[str]:
    """The dense state file's tensors against the model's (shape and dtype), before loading."""
    problems = []
    for k, v in _dense_state(model).items():
        if not torch.is_tensor(v):
            continue
        got = dense.get(k)
        if not torch.is_tensor(got):
            problems.append(f"file {rel!r}: no tensor {k!r}")
        elif got.shape != v.shape or got.dtype != v.dtype:
            problems.append(
                f"file {rel!r}: {k!r} is {tuple(got.shape)} {_dtype_name(got.dtype)}, the model's "
                f"{tuple(v.shape)} {_dtype_name(v.dtype)}"
            )
    return problems


def _check_optimizer_file(opt_file: dict, optimizer, tables: dict[str, _Table], entries: dict) -> list[str]:
    """The optimizer file against ``optimizer`` (parameter groups; per table: optimizer, step,
    state of the rows' shapes), before anything is loaded."""
    hybrid = isinstance(optimizer, HybridOptimizer)
    sd = opt_file.get("dense") if hybrid else opt_file.get("state_dict")
    dense = optimizer.dense if hybrid else optimizer
    if (
        not isinstance(sd, dict)
        or not isinstance(sd.get("param_groups"), list)
        or not isinstance(sd.get("state"), dict)
    ):
        return ["the optimizer file holds no dense optimizer state_dict"]
    problems = []
    saved_sizes = [len(g.get("params", [])) if isinstance(g, dict) else None for g in sd["param_groups"]]
    sizes = [len(g["params"]) for g in dense.param_groups]
    if saved_sizes != sizes:
        problems.append(f"the optimizer file's parameter groups hold {saved_sizes} parameters, the optimizer's {sizes}")
    if not hybrid:
        return problems
    saved = opt_file.get("sparse")
    if not isinstance(saved, dict):
        return problems + ["the optimizer file holds no per-table optimizer state"]
    by_name = _table_of_storage(tables)
    for name in optimizer.sparse_optimizers():
        q = by_name.get(name)
        if q is None:
            continue
        meta, t = saved.get(q), tables[q]
        if not isinstance(meta, dict) or not all(k in meta for k in ("optimizer", "hparams", "step", "shape")):
            problems.append(f"table {q!r}: the optimizer file lacks its optimizer, hparams, step or shape")
            continue
        if list(meta["shape"]) != [t.config.num_embeddings, t.config.embedding_dim]:
            problems.append(f"table {q!r}: optimizer state saved for shape {meta['shape']}, the table is {t.shape}")
        if not isinstance(meta["step"], int) or not isinstance(meta["hparams"], dict):
            problems.append(f"table {q!r}: the optimizer file's step or hparams are malformed")
        have = serial.state_shapes(t.storage, t.name)
        state = entries[q]["state"]
        if set(state) != set(have):
            problems.append(f"table {q!r}: optimizer state {sorted(state)} in the checkpoint, {sorted(have)} here")
            continue
        rows = entries[q]["ids"].numel() if t.keyed else have[next(iter(have))][0] if have else 0
        for k, v in state.items():
            want = (rows, *have[k][1:])
            if tuple(v.shape) != want or not v.is_floating_point():
                problems.append(
                    f"table {q!r}: optimizer state {k!r} is {tuple(v.shape)} {_dtype_name(v.dtype)}, "
                    f"expected {want} floating point"
                )
    return problems
