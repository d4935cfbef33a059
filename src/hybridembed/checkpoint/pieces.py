"""Reading a checkpoint's saved shards into any span: the rows one process holds now.

Shape legend: ``K`` rows of a span, ``C`` its columns, ``D`` the table's dim.

A table in a checkpoint is a list of shard entries (the manifest's ``shards``), each naming
a file and the global rows and columns it holds: dense rows ``range(row_start, row_end,
row_step)``, dynamic rows by id (all ids, or those whose hash residue is ``residue`` of
``residues``), columns ``col_start .. col_end - 1``. An incremental version's shard files
hold only the rows changed since the version before (dense: their global row numbers under
``rows``; dynamic: the ids changed and, under ``removed``, the ids dropped).

:func:`assemble` builds the entry of one :class:`Target` — a whole table (one process, a
replicated table), a row block, a residue class, a hash residue or a column slice (a shard of
a job of any size and plan) — from a chain of versions (a full base, then its deltas in
order). Files are memory-mapped and only the target's rows and columns are copied out of
them, so a process never reads the pages of rows it does not hold (except a dynamic table's
ids, which every reader scans to find its own).

    >>> Target((0, 10, 2), (0, 4)).num_rows     # rows 0, 2, .., 8 of columns 0..3
    5
    >>> _progression((0, 10, 2), (0, 10, 3))   # rows both hold: 0 and 6
    (0, 3, 0, 2, 2)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..distributed.routes import hash_residue
from ..errors import CheckpointError
from ..utils import get_logger

__all__ = ["Target", "assemble", "dynamic_parts", "files_for", "torch_load"]

log = get_logger("hybridembed.checkpoint")

Version = tuple[Path, dict]  # (version directory, the table's manifest entry in it)


@dataclass(frozen=True)
class Target:
    """What one process holds of a table: rows ``range(*rows)`` (dense) or the ids whose hash
    residue is ``hashed[0]`` of ``hashed[1]`` (dynamic; None: every id), columns ``cols``.
    ``first``: this span gets a dynamic table's counters (one span per table does, so their
    sum over the job stays the table's)."""

    rows: tuple[int, int, int] | None
    cols: tuple[int, int]
    hashed: tuple[int, int] | None = None
    first: bool = True

    @property
    def num_rows(self) -> int:
        return len(range(*self.rows)) if self.rows is not None else 0


def torch_load(vdir: Path, rel: str, mmap: bool = False) -> Any:
    """``mmap`` for table shards only: their rows are copied into the tables, never kept (a
    torch optimizer would keep its loaded state tensors, which must not map a checkpoint file)."""
    try:
        return torch.load(vdir / rel, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:  # noqa: BLE001 - any failure to read is a damaged checkpoint
        raise CheckpointError(f"checkpoint {vdir}: file {rel!r} cannot be read ({type(e).__name__}: {e})") from None


def span(x: dict, dim: int) -> tuple[int, int, int, int, int]:
    """A dense shard entry's (row_start, row_end, row_step, col_start, col_end)."""
    return (
        int(x["row_start"]),
        int(x["row_end"]),
        int(x.get("row_step", 1)),
        int(x.get("col_start", 0)),
        int(x.get("col_end", dim)),
    )


def _cols(x: dict, dim: int) -> tuple[int, int]:
    return int(x.get("col_start", 0)), int(x.get("col_end", dim))


def _progression(a: tuple[int, int, int], b: tuple[int, int, int]) -> tuple[int, int, int, int, int] | None:
    """Rows held by both ``range(*a)`` and ``range(*b)``: (first position in a, step in a,
    first position in b, step in b, count), or None when they share none."""
    (a0, a1, sa), (b0, b1, sb) = a, b
    lo, hi = max(a0, b0), min(a1, b1)
    if lo >= hi:
        return None
    r = a0 + -(-(lo - a0) // sa) * sa  # the first row of a at or after lo
    for _ in range(sb):  # a solution of r = a0 (mod sa), r = b0 (mod sb) is within sb steps
        if r >= hi:
            return None
        if (r - b0) % sb == 0:
            break
        r += sa
    else:
        return None
    step = sa * sb // math.gcd(sa, sb)
    count = len(range(r, hi, step))
    return (r - a0) // sa, step // sa, (r - b0) // sb, step // sb, count


def _strided(t: torch.Tensor, first: int, step: int, count: int) -> torch.Tensor:
    return t[first : first + (count - 1) * step + 1 : step] if count else t[:0]


def overlaps(shard: dict, target: Target, dim: int, keyed: bool) -> bool:
    """Whether saved ``shard`` holds any of ``target``'s rows and columns (by its manifest entry)."""
    c0, c1 = _cols(shard, dim)
    if min(c1, target.cols[1]) <= max(c0, target.cols[0]):
        return False
    if keyed:
        res = shard.get("residue"), shard.get("residues")
        if target.hashed is None or res[0] is None:
            return True
        # a hash residue r of k holds the ids whose residue of k' may be anything unless k' = k
        return res[1] != target.hashed[1] or res[0] == target.hashed[0]
    if "changed" not in shard:
        a, b, s, *_ = span(shard, dim)
        return _progression(target.rows, (a, b, s)) is not None
    return shard["changed"] > 0


def files_for(versions: Sequence[Version], target: Target, dim: int, keyed: bool) -> list[tuple[Path, str]]:
    """The (version directory, file) pairs :func:`assemble` reads for ``target``."""
    out = []
    for vdir, spec in versions:
        for sh in spec["shards"]:
            if overlaps(sh, target, dim, keyed) or (keyed and _table_level(sh, spec, dim)):
                out.append((vdir, sh["file"]))
    return out


def _same_shard(sh: dict, target: Target, dim: int) -> bool:
    """Whether saved dynamic shard ``sh`` holds exactly ``target``'s ids and columns."""
    hashed = (sh["residue"], sh["residues"]) if sh.get("residue") is not None else None
    return _cols(sh, dim) == target.cols and hashed == target.hashed


def _table_level(sh: dict, spec: dict, dim: int) -> bool:
    """A dynamic table's counters are read from the shards of its first column slice."""
    first = min(_cols(x, dim)[0] for x in spec["shards"])
    return _cols(sh, dim)[0] == first


def assemble(
    q: str,
    versions: Sequence[Version],
    target: Target,
    dim: int,
    keyed: bool,
    state_names: Sequence[str],
    load: Callable[[Path, str], Any] | None = None,
) -> tuple[dict[str, Any], list[str]]:
    """The entry (as :func:`hybridembed.storage.serial.check_entry` reads it, plus ``state``:
    the optimizer state of those rows) of ``target`` of table ``q``, from ``versions`` (a full
    base first, then its deltas in order): (entry, problems). Nothing is changed."""
    load = load or (lambda vdir, rel: torch_load(vdir, rel, mmap=True))
    try:
        if keyed:
            return _dynamic(q, versions, target, dim, list(state_names), load)
        return _dense(q, versions, target, dim, list(state_names), load)
    except _Bad as e:
        return {}, [str(e)]


class _Bad(Exception):
    """A shard file that does not hold what its manifest entry says (a problem, not a crash)."""


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise _Bad(msg)


def _tensor(p: Any, key: str, shape: tuple, where: str, floating: bool | None = None) -> torch.Tensor:
    v = p.get(key) if isinstance(p, dict) else None
    ok = torch.is_tensor(v) and tuple(v.shape) == shape
    if ok and floating is not None:
        ok = v.is_floating_point() == floating and v.dtype != torch.bool
    _need(
        ok,
        f"{where} does not hold {key!r} of shape {shape}"
        + ("" if not torch.is_tensor(v) else f" (got {tuple(v.shape)})"),
    )
    return v


def _state_of(p: Any, k: str, rows: int, width: int, where: str) -> torch.Tensor:
    st = p.get("state") if isinstance(p, dict) else None
    v = st.get(k) if isinstance(st, dict) else None
    _need(torch.is_tensor(v), f"{where}: optimizer state {k!r} is missing")
    _need(
        v.is_floating_point() and tuple(v.shape) in ((rows,), (rows, width)),
        f"{where}: optimizer state {k!r} is {tuple(v.shape)} {v.dtype}, expected ({rows},) or ({rows}, {width}) floats",
    )
    return v


def _dense(q, versions, target, dim, state_names, load):
    n, (c0, c1) = target.num_rows, target.cols
    weight: torch.Tensor | None = None
    state: dict[str, torch.Tensor] = {}
    for vi, (vdir, spec) in enumerate(versions):
        for sh in spec["shards"]:
            if not overlaps(sh, target, dim, False):
                continue
            a, b, s, sc0, sc1 = span(sh, dim)
            lo, hi = max(c0, sc0), min(c1, sc1)
            where = f"table {q!r}: file {sh['file']!r}"
            p = load(vdir, sh["file"])
            _need(isinstance(p, dict), f"{where} is not a table shard")
            if "changed" in sh:  # a delta: the rows changed, by global row number
                k = int(sh["changed"])
                rows = _tensor(p, "rows", (k,), where, floating=False)
                w = _tensor(p, "weight", (k, sc1 - sc0), where, floating=True)
                rows = rows.to(torch.int64)
                keep = (rows >= target.rows[0]) & (rows < target.rows[1])
                keep &= (rows - target.rows[0]).remainder(target.rows[2]) == 0
                src = keep.nonzero().squeeze(1)
                dst = (rows.index_select(0, src) - target.rows[0]).div(target.rows[2], rounding_mode="floor")
                take = lambda t, src=src: t.index_select(0, src)  # noqa: E731
                put = lambda out, v, dst=dst: out.index_copy_(0, dst, v)  # noqa: E731
                _need(vi > 0, f"{where}: a delta's rows in a full version")
            else:
                k = len(range(a, b, s))
                w = _tensor(p, "weight", (k, sc1 - sc0), where, floating=True)
                hit = _progression(target.rows, (a, b, s))
                if hit is None:
                    continue
                d0, ds, s0, ss, cnt = hit
                take = lambda t, s0=s0, ss=ss, cnt=cnt: _strided(t, s0, ss, cnt)  # noqa: E731
                put = lambda out, v, d0=d0, ds=ds, cnt=cnt: _strided(out, d0, ds, cnt).copy_(v)  # noqa: E731
            if weight is None:
                weight = torch.empty(n, c1 - c0, dtype=w.dtype)
            _need(w.dtype == weight.dtype, f"{where}: rows of dtype {w.dtype}, other shards {weight.dtype}")
            put(weight[:, lo - c0 : hi - c0], take(w)[:, lo - sc0 : hi - sc0])
            for key in state_names:
                v = _state_of(p, key, w.shape[0], sc1 - sc0, where)
                if key not in state:
                    state[key] = torch.empty((n, c1 - c0) if v.dim() == 2 else (n,), dtype=v.dtype)
                _need(
                    state[key].dim() == v.dim(), f"{where}: optimizer state {key!r} of another shape than other shards"
                )
                if v.dim() == 2:
                    put(state[key][:, lo - c0 : hi - c0], take(v)[:, lo - sc0 : hi - sc0])
                else:  # a row-wise statistic: the whole row's, the same in every column slice
                    put(state[key], take(v))
    if weight is None:
        _need(n == 0, f"table {q!r}: no shard holds rows {target.rows} columns {target.cols}")
        weight = torch.empty(0, c1 - c0)
    return {"weight": weight, "state": state}, []


def _dynamic(q, versions, target, dim, state_names, load):
    c0, c1 = target.cols
    cur: dict[str, Any] | None = None
    last_parts: list[tuple[dict, dict]] = []
    for vdir, spec in versions:
        groups: dict[tuple[int, int], list[tuple[dict, dict]]] = {}
        parts = []
        for sh in spec["shards"]:
            top = _table_level(sh, spec, dim) or _same_shard(sh, target, dim)
            if not (overlaps(sh, target, dim, True) or top):
                continue
            where = f"table {q!r}: file {sh['file']!r}"
            p = load(vdir, sh["file"])
            _check_dynamic_file(p, sh, where, dim)
            if top and _first_part(sh):
                parts.append((sh, p))
            if overlaps(sh, target, dim, True):
                groups.setdefault(_cols(sh, dim), []).append((sh, p))
        last_parts = parts
        if not groups:
            continue
        slices = []  # per column group: (cols, ids ascending, rows data ordered alike)
        for (sc0, sc1), members in sorted(groups.items()):
            keys = ["weight", "last_seen", "freq", *(f"state.{k}" for k in state_names)]
            got = {k: [] for k in ["ids", *keys]}
            removed = []
            for sh, p in members:
                ids = p["ids"].to(torch.int64)
                keep = None
                if target.hashed is not None:
                    keep = (hash_residue(ids, target.hashed[1]) == target.hashed[0]).nonzero().squeeze(1)
                    ids = ids.index_select(0, keep)
                got["ids"].append(ids)
                for key in keys:
                    if key.startswith("state."):
                        v = _state_of(p, key[6:], p["ids"].numel(), sc1 - sc0, f"table {q!r}: file {sh['file']!r}")
                    else:
                        v = p[key]
                    got[key].append(v if keep is None else v.index_select(0, keep))
                if "changed" in sh:
                    removed.append(p["removed"].to(torch.int64))
            ids = torch.cat(got["ids"])
            order = torch.argsort(ids)
            data = {key: torch.cat(vs).index_select(0, order) for key, vs in got.items() if key != "ids"}
            slices.append(((sc0, sc1), ids.index_select(0, order), data, torch.cat(removed) if removed else None))
        ids = slices[0][1]
        for cols, other, _, _ in slices[1:]:
            _need(torch.equal(other, ids), f"table {q!r}: its column slices {slices[0][0]} and {cols} hold other ids")
        n = ids.numel()
        first_data = slices[0][2]
        weight = torch.empty(n, c1 - c0, dtype=first_data["weight"].dtype)
        state = {}
        for (sc0, sc1), _, data, _ in slices:
            lo, hi = max(c0, sc0), min(c1, sc1)
            weight[:, lo - c0 : hi - c0] = data["weight"][:, lo - sc0 : hi - sc0]
            for key in state_names:
                v = data[f"state.{key}"]
                if v.dim() == 1:
                    state.setdefault(key, v)
                else:
                    state.setdefault(key, torch.empty(n, c1 - c0, dtype=v.dtype))[:, lo - c0 : hi - c0] = v[
                        :, lo - sc0 : hi - sc0
                    ]
        part = {"ids": ids, "weight": weight, "last_seen": first_data["last_seen"], "freq": first_data["freq"]}
        part["state"] = state
        if cur is None or slices[0][3] is None:  # a full version (the base)
            _need(slices[0][3] is None or cur is not None, f"table {q!r}: a delta without its base")
            cur = part
            continue
        gone = torch.cat([slices[0][3], ids])
        keep = (~torch.isin(cur["ids"], gone)).nonzero().squeeze(1)
        merged = {}
        for key in ("ids", "weight", "last_seen", "freq"):
            merged[key] = torch.cat([cur[key].index_select(0, keep), part[key].to(cur[key].dtype)])
        merged["state"] = {
            key: torch.cat([cur["state"][key].index_select(0, keep), part["state"][key].to(cur["state"][key].dtype)])
            for key in state_names
        }
        order = torch.argsort(merged["ids"])
        cur = {key: v.index_select(0, order) for key, v in merged.items() if key != "state"}
        cur["state"] = {key: v.index_select(0, order) for key, v in merged["state"].items()}
    if cur is None:
        cur = {
            "ids": torch.zeros(0, dtype=torch.int64),
            "weight": torch.zeros(0, c1 - c0),
            "last_seen": torch.zeros(0, dtype=torch.int64),
            "freq": torch.zeros(0, dtype=torch.int64),
            "state": {},
        }
    return _counters(q, cur, last_parts, versions, target, dim), []


def _first_part(sh: dict) -> bool:
    """Whether saved shard ``sh`` is the first (or only) file of its rows: the one holding the
    table-wide counters (a tiered table's shard is saved in several parts)."""
    return int(sh.get("part", 0)) == 0


def _check_dynamic_file(p: Any, sh: dict, where: str, dim: int) -> int:
    """A dynamic shard file's ids, rows and per-row counters (and, in a first part, the table-wide
    counters; in a delta, the removed ids) against its manifest entry: its number of rows."""
    _need(isinstance(p, dict), f"{where} is not a table shard")
    ids = p.get("ids")
    _need(torch.is_tensor(ids) and ids.dim() == 1 and not ids.is_floating_point(), f"{where}: no (K,) ids")
    k = ids.numel()
    c0, c1 = _cols(sh, dim)
    _tensor(p, "weight", (k, c1 - c0), where, floating=True)
    for key in ("last_seen", "freq"):
        _tensor(p, key, (k,), where, floating=False)
    for key in ("stats", "clock") if _first_part(sh) else ():
        _need(torch.is_tensor(p.get(key)), f"{where}: no {key!r}")
    if "changed" in sh:
        rem = p.get("removed")
        _need(torch.is_tensor(rem) and rem.dim() == 1, f"{where}: a delta without its removed ids")
    return k


def _counters(q, cur: dict, last_parts: list, versions, target: Target, dim: int) -> dict:
    """``cur`` with the table's counters, clock, admission sketch and generator: of the newest
    version (``last_parts``: its table-level first parts); those of the saved shard that is the
    target itself (a resume in the same layout) when there is one."""
    same = [p for sh, p in last_parts if _same_shard(sh, target, dim)]
    if len(same) == 1:  # (several: a table split without saying how, as before hash residues were recorded)
        for key in ("stats", "clock", "sketch", "generator"):
            if torch.is_tensor(same[0].get(key)):
                cur[key] = same[0][key]
        return cur
    ps = [p for sh, p in last_parts if _table_level(sh, versions[-1][1], dim)]
    _need(bool(ps), f"table {q!r}: no shard of its first column slice")
    stats = torch.stack([p["stats"] for p in ps]).sum(0)
    cur["stats"] = stats if target.first else torch.zeros_like(stats)
    cur["clock"] = torch.stack([p["clock"].reshape(()) for p in ps]).max()
    if all(torch.is_tensor(p.get("sketch")) for p in ps):
        cur["sketch"] = torch.stack([p["sketch"] for p in ps]).sum(0)
    gens = [p.get("generator") for p in ps if torch.is_tensor(p.get("generator"))]
    if gens:
        cur["generator"] = gens[target.hashed[0] % len(gens) if target.hashed else 0]
    return cur


def dynamic_parts(
    q: str,
    versions: Sequence[Version],
    target: Target,
    dim: int,
    state_names: Sequence[str],
    load: Callable[[Path, str], Any] | None = None,
) -> tuple[dict[str, Any], Callable[[int], Any] | None, list[str]]:
    """A dynamic table (or shard: ``target``) read a file at a time, for a table larger than
    memory: (entry, parts, problems). ``entry`` is :func:`assemble`'s with its ids (ascending) and
    table-wide values and the rows' tensors on the meta device (for the checks of a whole entry);
    ``parts(rows)`` yields the rows, at most ``rows`` at a time, each id once, from the newest
    version that holds it (ids, weight, last_seen, freq, state). Only the ids are held in memory. Where the
    target spans several saved column slices (or none holds its rows), ``parts`` is None and
    ``entry`` assemble's whole one."""
    load = load or (lambda vdir, rel: torch_load(vdir, rel, mmap=True))
    over = [[sh for sh in spec["shards"] if overlaps(sh, target, dim, True)] for _, spec in versions]
    if not any(over) or any(len({_cols(sh, dim) for sh in shards}) > 1 for shards in over):
        if any(over):
            log.warning("table %r: its rows were saved in several column slices; they are read whole", q)
        entry, problems = assemble(q, versions, target, dim, True, state_names, load)
        return entry, None, problems
    try:
        return _dynamic_parts(q, versions, over, target, dim, list(state_names), load)
    except _Bad as e:
        return {}, None, [str(e)]


def _dynamic_parts(q, versions, over, target, dim, names, load):
    c0, c1 = target.cols
    full = [v for v, shards in enumerate(over) if shards and not any("changed" in sh for sh in shards)]
    _need(
        bool(full) and full[0] == next(v for v, shards in enumerate(over) if shards),
        f"table {q!r}: a delta without its base",
    )
    files = []  # [version, directory, shard entry, its rows, positions of the target's ids in it, those ids]
    removed: dict[int, list[torch.Tensor]] = {}
    kinds: dict[str, tuple[torch.dtype, int]] = {}
    for v in range(full[-1], len(versions)):
        vdir = versions[v][0]
        for sh in over[v]:
            where = f"table {q!r}: file {sh['file']!r}"
            p = load(vdir, sh["file"])
            k = _check_dynamic_file(p, sh, where, dim)
            sc0, sc1 = _cols(sh, dim)
            for key, t in [("weight", p["weight"])] + [(n, _state_of(p, n, k, sc1 - sc0, where)) for n in names]:
                was = kinds.setdefault(key, (t.dtype, t.dim()))
                _need(
                    was == (t.dtype, t.dim()),
                    f"{where}: {key} of dtype {t.dtype} and {t.dim()} dims, {was[0]} and {was[1]} in other files",
                )
            ids, pos = p["ids"].to(torch.int64), None  # (None: every row of the file)
            if target.hashed is not None:
                pos = (hash_residue(ids, target.hashed[1]) == target.hashed[0]).nonzero().squeeze(1)
                ids = ids.index_select(0, pos)
            files.append([v, vdir, sh, k, pos, ids])
            if "changed" in sh:
                removed.setdefault(v, []).append(p["removed"].to(torch.int64))
    later = torch.zeros(0, dtype=torch.int64)  # ids a newer version holds or removed
    for v in sorted({f[0] for f in files}, reverse=True):
        mine = [f for f in files if f[0] == v]
        for f in mine:
            if later.numel():
                keep = (~torch.isin(f[5], later)).nonzero().squeeze(1)
                f[4] = keep if f[4] is None else f[4].index_select(0, keep)
                f[5] = f[5].index_select(0, keep)
        later = torch.cat([later, *(f[5] for f in mine), *removed.get(v, [])]).unique()
    ids = torch.cat([f.pop() for f in files]).sort().values  # (each file's own ids dropped: held once)
    n = ids.numel()
    meta = lambda key, *shape: torch.empty(  # noqa: E731
        shape, dtype=kinds.get(key, (torch.float32,))[0], device="meta"
    )
    entry = {
        "ids": ids,
        "weight": meta("weight", n, c1 - c0),
        "last_seen": torch.empty(n, dtype=torch.int64, device="meta"),
        "freq": torch.empty(n, dtype=torch.int64, device="meta"),
        "state": {k: meta(k, n, c1 - c0) if kinds[k][1] == 2 else meta(k, n) for k in names if k in kinds},
    }
    last = len(versions) - 1
    tops = []
    for sh in versions[last][1]["shards"]:
        if _first_part(sh) and (_table_level(sh, versions[last][1], dim) or _same_shard(sh, target, dim)):
            p = load(versions[last][0], sh["file"])
            _check_dynamic_file(p, sh, f"table {q!r}: file {sh['file']!r}", dim)
            tops.append((sh, p))
    entry = _counters(q, entry, tops, versions, target, dim)

    def parts(rows: int):
        for _, vdir, sh, k, pos in files:
            p = load(vdir, sh["file"])
            if not (torch.is_tensor(p.get("ids")) and p["ids"].numel() == k):
                raise CheckpointError(
                    f"table {q!r}: file {sh['file']!r} changed while it was loaded (the table is partly loaded: "
                    "load again)"
                )
            sc0 = _cols(sh, dim)[0]
            r = max(1, rows)
            for at in pos.split(r) if pos is not None else [slice(lo, lo + r) for lo in range(0, k, r)]:
                take = lambda t, at=at: t[at] if isinstance(at, slice) else t.index_select(0, at)  # noqa: E731
                cols = lambda t, sc0=sc0: t[:, c0 - sc0 : c1 - sc0] if t.dim() == 2 else t  # noqa: E731
                yield {
                    "ids": take(p["ids"]).to(torch.int64),
                    "weight": cols(take(p["weight"])),
                    "last_seen": take(p["last_seen"]),
                    "freq": take(p["freq"]),
                    "state": {key: cols(take(p["state"][key])) for key in names},
                }

    return entry, parts, []
