"""Incremental versions: the chain of versions from a full one, checked, and the files each table's rows are read from."""

from __future__ import annotations

from pathlib import Path

from ..errors import CheckpointError
from ..optim.wrapper import HybridOptimizer
from .layout import (
    _VERSION_RE,
    MANIFEST,
)
from .manifest import (
    _check_files,
    _check_shards,
    read_manifest,
)
from .pieces import Target, files_for


# --- versions of a chain: a full base, then the incremental versions saved on top of it ------
def _chain(manifest: dict) -> list[tuple[Path, dict]]:
    """``[(version directory, manifest)]`` from the full base to ``manifest`` (itself last):
    an incremental version names its parent, which must be in the same checkpoint directory."""
    vdir = Path(manifest["path"])
    out = [(vdir, manifest)]
    seen = {vdir.name}
    while (inc := out[0][1].get("incremental")) is not None:
        parent = inc["parent"]
        pdir = vdir.parent / parent["version"]
        child = out[0][0].name
        if parent["version"] in seen or not _VERSION_RE.match(parent["version"]):
            raise CheckpointError(f"checkpoint {vdir}: version {child} names a bad parent {parent['version']!r}")
        if not (pdir / MANIFEST).is_file():
            raise CheckpointError(
                f"checkpoint {vdir} is incremental: version {child} holds only the rows changed since version "
                f"{parent['version']}, which is missing from {vdir.parent}; nothing was loaded. Load a full "
                "version (or one whose chain is complete) instead"
            )
        m = read_manifest(pdir)
        if m.get("id") != parent["id"]:
            raise CheckpointError(
                f"checkpoint {vdir} is incremental: version {child} was saved on top of version "
                f"{parent['version']} with id {parent['id']}, but {pdir} holds id {m.get('id')} (another save "
                "replaced it); nothing was loaded"
            )
        seen.add(parent["version"])
        out.insert(0, (pdir, m))
    return out


def _check_chain(chain: list[tuple[Path, dict]]) -> list[str]:
    """Every version of the chain lists the final version's tables, each tiling its rows, with the
    same optimizer state names."""
    final = chain[-1][1]
    problems = []
    for vdir, m in chain[:-1]:
        for q, t in final["tables"].items():
            s = m["tables"].get(q)
            if s is None:
                problems.append(f"table {q!r} is missing from version {vdir.name} of the chain")
            elif (s.get("kind"), s.get("shape"), s.get("dtype")) != (t.get("kind"), t.get("shape"), t.get("dtype")):
                problems.append(f"table {q!r} changed kind, shape or dtype in version {vdir.name} of the chain")
            elif sorted(s.get("optimizer_state", [])) != sorted(t.get("optimizer_state", [])):
                problems.append(f"table {q!r}: version {vdir.name} of the chain has other optimizer state")
            else:
                problems.extend(f"version {vdir.name}: {p}" for p in _check_shards(q, s))
    return problems


def _versions_of(chain: list[tuple[Path, dict]], q: str) -> list[tuple[Path, dict]]:
    return [(vdir, m["tables"][q]) for vdir, m in chain]


def _whole(t, keyed: bool) -> Target:
    """A whole table (``t`` its TableConfig): one process's, or a replicated one."""
    if keyed:
        return Target(None, (0, t.embedding_dim))
    return Target((0, t.num_embeddings, 1), (0, t.embedding_dim))


def _state_names(manifest: dict, q: str, optimizer) -> list[str]:
    """The optimizer state to read for table ``q``: none without an optimizer to load it into."""
    if not isinstance(optimizer, HybridOptimizer):
        return []
    return sorted(manifest["tables"].get(q, {}).get("optimizer_state", []))


def _check_chain_files(chain, reads, with_optimizer: bool, verify: bool) -> tuple[list[str], dict[Path, set[str]]]:
    """The files this process reads of every version of the chain (``reads``: (table, Target,
    keyed) it assembles; the final version's dense state and, ``with_optimizer``, its optimizer
    file): listed, present, sizes, checksums. -> (problems, {version directory: files})."""
    needed: dict[Path, set[str]] = {vdir: set() for vdir, _ in chain}
    for q, target, keyed in reads:
        dim = chain[-1][1]["tables"][q]["shape"][1]
        for vdir, rel in files_for(_versions_of(chain, q), target, dim, keyed):
            needed[vdir].add(rel)
    final_dir, final = chain[-1]
    needed[final_dir].add(final["dense"]["file"])
    if with_optimizer and final.get("optimizer"):
        needed[final_dir].add(final["optimizer"]["file"])
    problems = []
    for vdir, m in chain:
        where = "" if vdir == final_dir else f"version {vdir.name}: "
        missing = sorted(needed[vdir] - set(m["files"]))
        problems += [
            f"{where}file {rel!r} is used but not listed (with size and checksum) in the manifest" for rel in missing
        ]
        mine = {rel: spec for rel, spec in m["files"].items() if rel in needed[vdir]}
        problems += [where + p for p in _check_files(vdir, {"files": mine}, verify)]
    return problems, needed
