"""``he.save`` / ``he.load``: atomic, checked checkpoints of models with hybridembed tables.

A checkpoint is a directory; each save writes a complete new version beside the old one
and then flips a one-line pointer file::

    path/
      LATEST                        the current version's name; replaced atomically (the commit)
      v-000007/
        manifest.json               format version, hybridembed/torch versions, tables (kind,
                                    shape, dtype, rows, shards), optimizer names and
                                    hyper-parameters, ``extra``, every file with its size and
                                    sha256, and ``manifest_sha256``: the sha256 of the manifest's
                                    canonical JSON (sorted keys, no spaces) without that key
        dense.pt                    every parameter and buffer outside the tables
        tables/<table>.00000.pt     one shard of one table: its rows BY ROW ID (dense: rows
                                    row_start..row_end-1; dynamic: ids and rows) and the
                                    optimizer state of those rows
        optimizer.pt                the dense optimizer's state_dict; per-table optimizer,
                                    hyper-parameters and step

Rows are stored by table and row id, never by rank or by group: a table's ``shards`` list
in the manifest (``[{file, row_start, row_end}]`` dense, ``[{file, rows}]`` dynamic) may
hold any number of pieces, and :func:`load` puts them together, so a checkpoint written
by N processes loads at any other world size. One process writes one shard per table.
Tables are named ``<collection path>.<table>`` (``hybridembed.user`` for a converted
model, ``ec.video`` for an ``EmbeddingCollection`` at ``model.ec``).

A distributed model (:func:`hybridembed.distribute`'s, or one holding
:class:`~hybridembed.distributed.ShardedCollection` s) is saved and loaded by EVERY rank of
the job calling :func:`save` / :func:`load` (collectives; the directory must be shared by
the ranks). Each rank writes its own shards (``tables/<table>.<shard index>.pt``); a shard
entry records which global rows and columns its file holds: rows ``range(row_start,
row_end, row_step)`` (``row_step`` k for modulo placement over k shards), columns
``col_start .. col_end - 1`` (a column slice), the rank and shard index, and the step of its
optimizer state. Rank 0 writes the data-parallel tables, the dense state, the optimizer file
and the manifest (with ``world_size`` and each collection's plan under ``plans``) and makes
the one commit below; every rank returns after it, or every rank raises (a rank that could
not write is named). :func:`load` works at any world size and plan: rank 0 reads which version
``LATEST`` names, once for the job; each rank reads, from that version's shards that overlap
them, only the rows and columns its shards hold now (see :mod:`hybridembed.checkpoint.pieces`), checks
them, the ranks exchange their verdicts, and every rank loads or none does. The model of one
process loads such a checkpoint too, and a distributed model loads the checkpoint of one process.

Incremental versions (``save(..., incremental=True)``): a version holding, per shard, only the
table rows changed (dense: with their row numbers; dynamic: the ids changed and the ids dropped)
since the version before it, which it names in ``incremental.parent`` (by name and ``id``, a
random id every manifest has); the dense state and the optimizer's dense state are whole.
:func:`load` reads the chain from its full base (``incremental.base``) and refuses one with a
version missing or replaced, naming it. Storages count changed rows from the version they were
last saved to or loaded from; a save that fails puts its rows back into the count. ``keep``
never deletes a version a kept version is saved on top of.

Background saves (``save(..., background=True)``): the model's state (or, incremental, its
changed rows) is copied in the call; a thread writes the files and commits (a distributed save
exchanges its reports over a second gloo process group) and :class:`SaveHandle` reports it.

Atomicity (:func:`save`): the new version is written under ``path/.tmp-v-000008-<pid>``,
every file and directory fsynced, renamed to ``path/v-000008``, then ``LATEST`` is
replaced with ``os.replace`` (written to ``LATEST.tmp-<pid>`` and fsynced first) and the
directory fsynced. A crash before that replace leaves ``LATEST`` naming the previous,
untouched version; after it, the new one. Older versions are deleted only after the
commit (``keep`` of them stay). Leftovers of a crashed save are removed by the next
save.

One writer per directory, enforced: a save (and :func:`compact`) holds an exclusive ``flock``
on ``path/.lock`` from choosing its version name to its cleanup after the commit (a background
save until its thread has committed; a distributed save on rank 0, the rank that commits). A
second writer (another job, or another model of this process) is refused at once with a
CheckpointError naming the holder's pid and host; every rank of a distributed save raises it.
The OS drops the lock when its holder dies, however it dies. Where flock is missing (not POSIX,
a filesystem without locks) the lock file itself, made with O_EXCL, is the lock. Loads take no
lock: they read committed versions only, while a writer saves.

Not saved: torch's global RNG state (dropout) and the data position; put what a resume
needs into ``save(..., extra={...})`` (stored in the manifest, committed atomically with
the rows; nan, inf and -inf too, as ``{"__float__": "nan"}``) and read it back from
``load(...)["extra"]`` (floats again).

Loading (:func:`load`) checks, before changing any parameter, buffer, row or optimizer
state: the manifest (readable JSON, known format version, its checksum, the type of every
field: any damage, e.g. a flipped digit of ``extra``, is a CheckpointError naming the file
and field), the model against it (tables
missing or unexpected, kind, dim, dtype, row count, dense parameters and buffers), every
file (present, size, sha256), the files' contents against the model (every table entry
with :func:`hybridembed.storage.serial.check_entry`, the dense tensors, the optimizer
state's shapes) and the optimizer. Every difference found is listed in one
:class:`~hybridembed.CheckpointError`.

    >>> import tempfile, torch, hybridembed as he
    >>> ec = he.EmbeddingCollection([he.TableConfig("item", 100, 8)])
    >>> model = torch.nn.ModuleDict({"ec": ec, "mlp": torch.nn.Linear(8, 1)})
    >>> opt = he.wrap_optimizer(torch.optim.Adagrad(model.parameters(), lr=0.05), model)
    >>> path = tempfile.mkdtemp() + "/ckpt"
    >>> _ = he.save(path, model, opt, extra={"step": 10})
    >>> he.load(path, model, opt)["extra"]
    {'step': 10}
    >>> from hybridembed.checkpoint import checkpoint_tables
    >>> checkpoint_tables(path)
    {'ec.item': {'kind': 'dense', 'shape': [100, 8], 'dtype': 'float32', 'rows': 100}}
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..distributed.shard import unwrap
from ..errors import CheckpointError
from .background import SaveHandle, wait_pending
from .collective import _load_sharded, _save_sharded, _sharded_collections, _tell_servers
from .layout import FORMAT_VERSION, _extra_json
from .local import _cannot_write, compact, load_local, save_local
from .manifest import checkpoint_tables, read_manifest
from .participant import CheckpointParticipant
from .snapshot import _How

__all__ = [
    "save",
    "load",
    "compact",
    "read_manifest",
    "checkpoint_tables",
    "SaveHandle",
    "FORMAT_VERSION",
    "CheckpointParticipant",
    "wait_pending",
]


def save(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    extra: Mapping[str, Any] | None = None,
    keep: int = 1,
    incremental: bool = False,
    max_chain: int = 8,
    background: bool = False,
) -> str | SaveHandle:
    """Write a checkpoint of ``model`` (and ``optimizer``) to the directory ``path``, atomically.

    Args:
        path: the checkpoint directory (made if absent); see the module docstring for its layout.
        model: any module; its hybridembed tables (dense and dynamic) are stored by row id,
            everything else of its ``state_dict`` in ``dense.pt``.
        optimizer: a :class:`~hybridembed.optim.HybridOptimizer` (dense state, per-table
            row state by id, hyper-parameters, steps) or a plain torch optimizer.
        extra: JSON-serialisable metadata stored in the manifest (e.g. the epoch); returned
            by :func:`load` under ``"extra"``. Non-finite floats (``nan``, ``inf``, ``-inf``,
            e.g. the AUC of held-out rows of one class) are stored too, as
            ``{"__float__": "nan"}`` (the manifest stays strict JSON; its checksum covers
            them), and come back as floats; a dict with the key ``"__float__"`` is refused.
        keep: how many committed versions to keep (>= 1); older ones are deleted after the
            commit, except those a kept incremental version is saved on top of.
        incremental: write only the table rows changed (or dropped) since the version this
            model last saved to or loaded from ``path``, when that version is still the current
            one there; otherwise (and every ``max_chain`` versions) a full version. The dense
            state and the optimizer's dense state are written in full every time.
        max_chain: the most incremental versions on top of one full version (>= 1).
        background: return once the model's state is copied (the training step is blocked only
            for that); the files are written and committed by a thread. Returns a
            :class:`SaveHandle`: ``handle.wait()`` returns the version's directory or raises.
            The next ``save`` or ``load`` of the model waits for it first.

    A distributed model is saved by every rank calling ``save`` with the same arguments (see
    the module docstring); ``model`` may be the ``DistributedDataParallel`` wrapper.

    One writer per directory: the save holds the directory's writer lock (``path/.lock``) until
    it has committed and cleaned up. While another process (or another save of this process)
    holds it, ``save`` does not wait: it raises a :class:`~hybridembed.CheckpointError` naming
    that writer's pid and host, and writes nothing (on every rank of a distributed save).

    Returns the directory of the version written (a :class:`SaveHandle` with ``background``).
    """
    if not isinstance(model, nn.Module):
        raise CheckpointError(f"save needs an nn.Module, got {type(model).__name__}")
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise CheckpointError(f"keep must be an int >= 1, got {keep!r}")
    if isinstance(max_chain, bool) or not isinstance(max_chain, int) or max_chain < 1:
        raise CheckpointError(f"max_chain must be an int >= 1, got {max_chain!r}")
    for name, flag in (("incremental", incremental), ("background", background)):
        if not isinstance(flag, bool):
            raise CheckpointError(f"{name} must be True or False, got {flag!r}")
    if extra is not None and not isinstance(extra, Mapping):
        raise CheckpointError(f"extra must be a dict of JSON values, got {type(extra).__name__}")
    extra_json = _extra_json(extra)
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise CheckpointError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    root = Path(path)
    if root.exists() and not root.is_dir():
        raise CheckpointError(f"{root} exists and is not a directory; a checkpoint is a directory")
    inner = unwrap(model)
    wait_pending(inner)
    how = _How(keep, incremental, max_chain, background)
    colls = _sharded_collections(inner)
    if colls:  # every rank of the job: its shards, then one commit by rank 0
        options = {"keep": keep, "incremental": incremental, "max_chain": max_chain, "background": background}
        _tell_servers(colls, "save", root, options, optimizer)
        return _save_sharded(root, inner, colls, optimizer, extra_json, how)
    _not_meta(inner, "holds no rows to save; save")
    try:
        return save_local(root, model, optimizer, extra_json, how)
    except OSError as e:  # the disk, permissions, a file in the way: say which file and why
        raise _cannot_write(root, e) from e


def load(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    verify: bool = True,
) -> dict[str, Any]:
    """Load the checkpoint at ``path`` into ``model`` (and ``optimizer``): all or nothing.

    Everything is checked first (see the module docstring); any difference raises one
    :class:`~hybridembed.CheckpointError` listing them all, and nothing is changed. With
    ``verify=False`` file sizes are still checked but not the sha256 checksums.
    Returns the manifest (``manifest["extra"]`` holds what ``save(extra=...)`` stored).
    Dynamic tables are replaced by the checkpoint's rows (their ``Dynamic`` settings
    may differ, as long as the rows fit the capacity and, where both keep an admission
    sketch (``min_count > 1``), its ``sketch_depth`` and ``sketch_width`` are the saved ones).
    A distributed model is loaded by every rank calling ``load``, at any world size and plan:
    rank 0 reads which version ``LATEST`` names and every rank loads that one (a save committed
    meanwhile does not split the job); a problem found by any rank raises on every rank and no
    rank changes anything.
    """
    if not isinstance(model, nn.Module):
        raise CheckpointError(f"load needs the model (an nn.Module) to load into, got {type(model).__name__}")
    if not isinstance(verify, bool):
        raise CheckpointError(f"verify must be True or False, got {verify!r}")
    inner = unwrap(model)
    wait_pending(inner)
    colls = _sharded_collections(inner)
    if colls:  # every rank of the job: its shards, all ranks or none
        _tell_servers(colls, "load", path, {"verify": verify}, optimizer)
        try:
            return _load_sharded(path, inner, colls, optimizer, verify)
        finally:
            for sc in colls.values():
                if isinstance(sc, CheckpointParticipant):
                    sc.after_load()
    _not_meta(inner, "has no rows to load into; load into")
    return load_local(path, model, optimizer, verify)


def _not_meta(model: nn.Module, what: str) -> None:
    """Refuses a model with parameters on the meta device (a description for he.distribute)."""
    meta = next((n for n, p in model.named_parameters() if p.device.type == "meta"), None)
    if meta is not None:
        raise CheckpointError(
            f"{meta} was built on the meta device and {what} the model he.distribute made (each rank's shards), "
            "or one built on cpu or cuda"
        )


def _unwrap(model: nn.Module) -> nn.Module:
    from ..distributed.shard import unwrap

    return unwrap(model)
