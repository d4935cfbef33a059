"""Full versions that hard-link what has not changed.

A tiered table's full save writes its rows in range files of at most 64 MiB, read through the
tiers (``snapshot._write_tiered``). A range none of whose rows was written since the full
version it was last saved in holds the same bytes as that version's file: the new version links
that file (``os.link``) instead of reading and writing the range again. Checkpoint files are
never changed once committed, so a link is safe: deleting the old version (``keep``) removes
one name of the file, not its bytes.

What "unchanged" means is counted exactly: the storage's rows changed since the current version
(``track_changes``, the mask an incremental save writes), and the rows each incremental version
of the current chain wrote (the ``rows`` of its delta files), against the full base's ranges.
A storage whose changes are not counted from the current version (never saved there, or loaded
from elsewhere) links nothing."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError
from ..utils import get_logger
from .chain import _chain
from .layout import _current
from .manifest import read_manifest
from .pieces import span as _span
from .pieces import torch_load

log = get_logger("hybridembed.checkpoint")

Span = tuple[int, int, int, int, int]  # a dense shard's (row_start, row_end, row_step, col_start, col_end)


def current_chain(root: Path) -> list[tuple[Path, dict]] | None:
    """``[(version directory, manifest)]`` of ``root``'s current version's chain (its full base
    first), or None: no version, or one that cannot be read (then nothing is linked)."""
    current = _current(root)
    if current is None:
        return None
    try:
        return _chain(read_manifest(root / current))
    except CheckpointError as e:
        log.warning("full save: version %s cannot be read (%s); every file is written", current, e)
        return None


class Links:
    """The range files a full save of one table (or one rank's shard of it) may link, from
    ``chain``; :meth:`sources` decides, :meth:`link` makes the link."""

    def __init__(self, chain: list[tuple[Path, dict]]) -> None:
        self.chain = chain
        self.id = chain[-1][1].get("id")
        self.files = 0  # linked so far (a save's count, logged)
        self.bytes = 0

    def counts_from(self, storage) -> bool:
        """Whether ``storage``'s changes are counted from the current version (its mask is exact)."""
        return self.id is not None and storage.checkpoint_base == self.id

    def sources(self, q: str, table: dict, spans: list[Span], changed: list[bool]) -> dict[int, tuple[Path, dict]]:
        """``{i: (file, its manifest entry)}`` for the spans ``spans`` (global rows and columns of
        the files the save would write of table ``q``) whose rows the chain's full base saved in
        one file of exactly that span and no version of the chain nor the model wrote since
        (``changed[i]``: rows of span i changed since the current version). ``table``: the new
        manifest's entry of ``q`` (kind, shape, dtype, optimizer state must be the chain's)."""
        versions = []
        for vdir, m in self.chain:
            t = m.get("tables", {}).get(q) or {}
            mine = ("dense", table["shape"], table["dtype"], sorted(table["optimizer_state"]))
            if (t.get("kind"), t.get("shape"), t.get("dtype"), sorted(t.get("optimizer_state", []))) != mine:
                return {}
            versions.append((vdir, m, t))
        base_dir, base, t0 = versions[0]
        dim = table["shape"][1]
        written = written_since_base(self.chain, q, dim)
        if written is None:
            return {}
        whole = {_span(x, dim): x["file"] for x in t0["shards"] if "changed" not in x}
        out = {}
        for i, sp in enumerate(spans):
            rel = whole.get(sp)
            if rel is not None and not changed[i] and not touched(sp, written):
                found = linkable(base_dir, base, rel)
                if found is not None:
                    out[i] = found
        return out

    def link(self, src: Path, dst: Path, spec: dict) -> bool:
        """``dst`` made a second name of ``src`` (:func:`hard_link`), counted."""
        if not hard_link(src, dst):
            return False
        self.files += 1
        self.bytes += int(spec["bytes"])
        return True


def hard_link(src: Path, dst: Path) -> bool:
    """``dst`` made a second name of ``src``; False where the file system cannot (write it then)."""
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        os.link(src, dst)
    except OSError as e:  # another file system, no hard links (some network ones), a vanished file
        log.debug("cannot link %s to %s (%s): writing it", src, dst, e)
        return False
    return True


def written_since_base(chain: list[tuple[Path, dict]], q: str, dim: int) -> list | None:
    """The rows of table ``q`` the incremental versions of ``chain`` wrote (after its full base):
    ``[(global rows sorted, col_start, col_end)]`` by column band; None where a version does not say which."""
    try:
        found = [w for vdir, m in chain[1:] for w in _delta_rows(vdir, m["tables"][q], dim)]
    except _Unknown:
        return None
    bands: dict[tuple[int, int], list[torch.Tensor]] = {}  # (sorted once per column band: a span's test is a search)
    for rows, c0, c1 in found:
        bands.setdefault((c0, c1), []).append(rows)
    return [(torch.unique(torch.cat(r)), c0, c1) for (c0, c1), r in bands.items()]


def touched(sp: Span, written: list) -> bool:
    """Whether any of ``written`` (:func:`written_since_base`) hits span ``sp``."""
    return any(_touches(sp, w) for w in written)


def linkable(vdir: Path, manifest: dict, rel: str) -> tuple[Path, dict] | None:
    """(file ``rel`` of version ``vdir``, its manifest entry) when it is listed and of its size."""
    spec = manifest.get("files", {}).get(rel)
    if spec is None:
        return None
    try:
        if (vdir / rel).stat().st_size != spec["bytes"]:
            return None
    except OSError:
        return None
    return vdir / rel, spec


class _Unknown(Exception):
    """A delta of the chain does not say which rows it wrote: nothing of the table is linked."""


def _delta_rows(vdir: Path, t: dict, dim: int) -> list[tuple[torch.Tensor, int, int]]:
    """``[(global rows written, col_start, col_end)]`` of an incremental version's table entry
    ``t`` (read from its files' ``rows``, mapped, never the rows' values)."""
    out = []
    for x in t["shards"]:
        if "changed" not in x:
            raise _Unknown
        if int(x["changed"]) == 0:
            continue
        try:
            rows = torch_load(vdir, x["file"], mmap=True).get("rows")
        except (CheckpointError, AttributeError):
            raise _Unknown from None
        if not torch.is_tensor(rows):
            raise _Unknown
        _, _, _, c0, c1 = _span(x, dim)
        out.append((rows.to(torch.int64), c0, c1))
    return out


def _touches(sp: Span, written: tuple[torch.Tensor, int, int]) -> bool:
    """Whether rows ``written`` (in their columns) hit span ``sp``'s rows and columns."""
    a, b, step, c0, c1 = sp
    rows, w0, w1 = written
    if w1 <= c0 or c1 <= w0 or rows.numel() == 0:
        return False
    lo, hi = (int(i) for i in torch.searchsorted(rows, torch.tensor([a, b], dtype=torch.int64)))  # (rows sorted)
    return hi > lo and (step == 1 or bool(((rows[lo:hi] - a) % step == 0).any()))


def spans_changed(storage, name: str, mask: torch.Tensor, ranges: list[tuple[int, int]]) -> list[bool]:
    """For each (lo, hi) of table ``name``'s own rows: whether ``mask`` (the storage's changes
    since the last checkpoint) marks any row in it."""
    rows = storage.changed_rows(name, mask)
    if rows.numel() == 0:
        return [False] * len(ranges)
    lo = torch.tensor([a for a, _ in ranges], dtype=torch.int64)
    hi = torch.tensor([b for _, b in ranges], dtype=torch.int64)
    left = torch.searchsorted(rows, lo)
    right = torch.searchsorted(rows, hi)
    return (right > left).tolist()


def describe(links: Any) -> str:
    """The log's words for what a save linked (empty when nothing)."""
    if links is None or not links.files:
        return ""
    return f", {links.files} files ({links.bytes / 2**20:.1f} MiB) linked from version {links.chain[0][0].name}"
