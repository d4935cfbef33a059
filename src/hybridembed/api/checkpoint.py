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
them, only the rows and columns its shards hold now (see :mod:`hybridembed.api.shards`), checks
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
    >>> from hybridembed.api.checkpoint import checkpoint_tables
    >>> checkpoint_tables(path)
    {'ec.item': {'kind': 'dense', 'shape': [100, 8], 'dtype': 'float32', 'rows': 100}}
"""

from __future__ import annotations

import copy
import errno
import hashlib
import json
import math
import os
import re
import shutil
import socket
import threading
import time
import uuid
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

try:
    import fcntl
except ImportError:  # not POSIX: the lock file made with O_EXCL (see _lock)
    fcntl = None

from ..errors import CheckpointError
from ..modules import EmbeddingCollection
from ..modules.converted import _TableLayer
from ..optim.wrapper import HybridOptimizer
from ..storage import RowStorage, serial
from ..utils import get_logger
from .shards import Target, assemble, files_for
from .shards import span as _span
from .shards import torch_load as _torch_load

__all__ = ["save", "load", "compact", "read_manifest", "checkpoint_tables", "SaveHandle", "FORMAT_VERSION"]

log = get_logger(__name__)

FORMAT = "hybridembed-checkpoint"
FORMAT_VERSION = 3  # 3: incremental versions; 2: the manifest is checksummed (1, without, is still read)
_FULL_FORMAT = 2  # a full version is written as 2 (readable by the hybridembed before incremental ones)
POINTER = "LATEST"
LOCK = ".lock"  # the writer lock: flock'ed by the process writing the directory, removed when it is done
MANIFEST = "manifest.json"
CHECKSUM_KEY = "manifest_sha256"  # sha256 of the manifest's canonical JSON without this key
_VERSION_RE = re.compile(r"^v-(\d{6,})$")
_TMP_RE = re.compile(r"^\.tmp-v-\d+-(\d+)$")
_DROPPED = ".drop-"  # a version being deleted (renamed first; leftovers removed by the next writer)
_CHUNK = 1 << 22


# --- what a model holds ----------------------------------------------------------------------------
class _Table:
    """One table of the model: where it lives and what it is."""

    def __init__(self, qualified: str, collection: EmbeddingCollection, name: str):
        self.qualified = qualified
        self.collection = collection
        self.name = name
        self.config = collection.tables[name]
        self.storage = collection.storage_of(name)
        self.kind = self.storage.kind  # the manifest's "dense" / "dynamic" (data)
        self.keyed = self.storage.keyed  # rows by id (dynamic), not by row number

    @property
    def shape(self) -> list[int | None]:
        return [self.config.num_embeddings, self.config.embedding_dim]

    @property
    def dtype(self) -> str:
        return _dtype_name(self.config.dtype)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _model_tables(model: nn.Module) -> dict[str, _Table]:
    tables: dict[str, _Table] = {}
    for path, m in model.named_modules():
        if isinstance(m, EmbeddingCollection):
            for name in m.tables:
                q = f"{path}.{name}" if path else name
                tables[q] = _Table(q, m, name)
    return tables


def _dense_state(model: nn.Module) -> dict[str, Any]:
    """``model.state_dict()`` without the tables' entries (collections and converted layers)."""
    prefixes = [
        f"{path}." if path else ""
        for path, m in model.named_modules(remove_duplicate=False)
        if isinstance(m, (EmbeddingCollection, _TableLayer, RowStorage)) or getattr(type(m), "sharded", False) is True
    ]
    if "" in prefixes:
        return {}
    # each module's own entries, as state_dict() gathers them, without asking the tables for theirs
    # (a table's state_dict entry copies its rows: measured 40% of a background save's pause)
    out: dict[str, Any] = {}
    for path, m in model.named_modules(remove_duplicate=False):
        prefix = f"{path}." if path else ""
        if not any(prefix.startswith(p) for p in prefixes):
            m._save_to_state_dict(out, prefix, False)
    return out


def _table_of_storage(tables: Mapping[str, _Table]) -> dict[str, str]:
    """Bare table name (as the optimizer keys them) -> qualified name."""
    out: dict[str, str] = {}
    for q, t in tables.items():
        if t.name in out:
            raise CheckpointError(
                f"tables {out[t.name]!r} and {q!r} share the name {t.name!r}, and the optimizer keys its state by "
                "table name; give them different names"
            )
        out[t.name] = q
    return out


# --- small file helpers ----------------------------------------------------------------------------
def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # e.g. Windows: directories cannot be opened
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_file(path: Path, obj: Any) -> None:
    """One file of a checkpoint: ``torch.save`` (or raw bytes), flushed and fsynced."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            if isinstance(obj, bytes):
                f.write(obj)
            else:
                torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
    except (OSError, RuntimeError) as e:  # torch.save's writer reports a failed write as RuntimeError
        raise _WriteError(path, e) from e


class _WriteError(OSError):
    """A checkpoint file that could not be written (becomes a CheckpointError in :func:`save`)."""

    def __init__(self, path: Path, cause: BaseException):
        super().__init__(f"{path}: {_os_reason(cause)}")
        self.path = path


def _os_reason(e: BaseException) -> str:
    """The OS error's reason (``No space left on device``), or the first line of another error."""
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _commit(root: Path, version: str) -> None:
    """Point ``root/LATEST`` at ``version``: the one atomic step that makes a save visible."""
    tmp = root / f"{POINTER}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(version + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / POINTER)
    _fsync_dir(root)


def _jsonable(v: Any) -> Any:
    if isinstance(v, Mapping):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, torch.Tensor):
        return v.item() if v.numel() == 1 else v.tolist()
    if isinstance(v, torch.dtype):
        return _dtype_name(v)
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    return repr(v)


_FLOAT_KEY = "__float__"  # extra: a non-finite float is stored as {"__float__": "nan" | "inf" | "-inf"}
_NON_FINITE = ("nan", "inf", "-inf")


def _extra_json(extra: Mapping[str, Any] | None) -> dict:
    """``save(extra=...)`` as the manifest stores it: plain JSON, non-finite floats encoded."""
    try:
        plain = json.loads(json.dumps(dict(extra or {})))  # (nan, inf come back as floats)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"extra must be JSON-serialisable: {e}") from None
    return _encode_floats(plain, "extra")


def _encode_floats(v: Any, where: str) -> Any:
    """``v`` (JSON values) with every nan, inf and -inf as ``{"__float__": "nan"}``; strict JSON."""
    if isinstance(v, float) and not math.isfinite(v):
        return {_FLOAT_KEY: "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")}
    if isinstance(v, dict):
        if _FLOAT_KEY in v:
            raise CheckpointError(
                f"{where}: the key {_FLOAT_KEY!r} is reserved (the manifest stores a non-finite float such as nan "
                f"as {{{_FLOAT_KEY!r}: 'nan'}}); rename that key"
            )
        return {k: _encode_floats(x, f"{where}.{k}") for k, x in v.items()}
    if isinstance(v, list):
        return [_encode_floats(x, f"{where}[{i}]") for i, x in enumerate(v)]
    return v


def _decode_floats(v: Any) -> Any:
    """The inverse of :func:`_encode_floats`: ``{"__float__": "nan"}`` back to ``float("nan")``."""
    if isinstance(v, dict):
        if len(v) == 1 and v.get(_FLOAT_KEY) in _NON_FINITE:
            return float(v[_FLOAT_KEY])
        return {k: _decode_floats(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_decode_floats(x) for x in v]
    return v


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists but not ours, or no kill() here
        return True
    return True


def _versions(root: Path) -> list[str]:
    names = [p.name for p in root.iterdir() if p.is_dir() and _VERSION_RE.match(p.name)]
    return sorted(names, key=lambda n: int(n[2:]))


def _read_pointer(root: Path) -> str | None:
    """What ``root/LATEST`` names (stripped), None when absent; CheckpointError when it is not text."""
    try:
        data = (root / POINTER).read_bytes()
    except FileNotFoundError:
        return None
    try:
        return data.decode("ascii").strip()
    except UnicodeDecodeError as e:
        raise CheckpointError(
            f"{root / POINTER} is damaged: byte {e.start} is not text (it should hold a version name like "
            "'v-000001'); point it at a version directory of that folder or load that directory directly"
        ) from None


def _current(root: Path) -> str | None:
    try:
        name = _read_pointer(root)
    except CheckpointError:  # a damaged pointer names no version; the next commit replaces it
        return None
    return name if name is not None and _VERSION_RE.match(name) else None


_UNREADABLE = "?"  # _parent_of: the manifest could not be read (its chain is unknown)


def _parent_of(vdir: Path) -> str | None:
    """The version an incremental version was saved on top of (None: a full version)."""
    try:
        inc = json.loads((vdir / MANIFEST).read_bytes()).get("incremental")
        return inc["parent"]["version"] if isinstance(inc, dict) else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return _UNREADABLE


def _clean(root: Path, keep: int) -> None:
    """Remove leftovers of dead saves, versions never committed, and versions beyond ``keep``
    (never a version that a kept incremental version is saved on top of)."""
    for p in root.iterdir():
        m = _TMP_RE.match(p.name)
        if m and not _pid_alive(int(m.group(1))) or p.name.startswith(_DROPPED):  # (under the writer lock)
            shutil.rmtree(p, ignore_errors=True)
        elif p.name.startswith(f"{POINTER}.tmp-"):
            pid = p.name.rsplit("-", 1)[1]
            if not pid.isdigit() or not _pid_alive(int(pid)):
                p.unlink(missing_ok=True)
    current = _current(root)
    if current is None:
        return
    n = int(current[2:])
    versions = _versions(root)
    older = [v for v in versions if int(v[2:]) < n]
    kept = {current, *older[len(older) - (keep - 1) :]} if keep > 1 else {current}
    needed = set(kept)
    for v in kept:  # the chains of the kept versions
        while (v := _parent_of(root / v)) is not None and v not in needed:
            if v == _UNREADABLE:  # a chain not known: delete no older version
                needed.update(older)
                break
            needed.add(v)
    drop = [v for v in versions if int(v[2:]) > n or v not in needed]
    for v in drop:  # renamed first: a writer killed while deleting leaves no half version behind a version's name
        gone = root / f"{_DROPPED}{v}-{os.getpid()}"
        try:
            os.replace(root / v, gone)
        except OSError:
            continue
        shutil.rmtree(gone, ignore_errors=True)


# --- one writer per directory ------------------------------------------------------------------
class _WriterLock:
    """The writer lock of one checkpoint directory, held; :meth:`release` (once or more) removes
    ``path/.lock`` and unlocks."""

    def __init__(self, path: Path, fd: int | None) -> None:
        self.path, self.fd = path, fd  # fd: the flock'ed file (None: the O_EXCL file is the lock)
        _HELD.add(self)

    def release(self) -> None:
        if self.path is None:
            return
        # removed while held: a writer that opened it before sees a file no longer there and retries
        self.path.unlink(missing_ok=True)
        if self.fd is not None:
            os.close(self.fd)
        self.path = self.fd = None
        _HELD.discard(self)

    def _forget(self) -> None:
        """In a forked child: close the inherited file, which would hold the lock after the parent
        died (e.g. a data loader's worker), and never remove it."""
        if self.fd is not None:
            os.close(self.fd)
        self.path = self.fd = None


_HELD: weakref.WeakSet = weakref.WeakSet()  # the writer locks this process holds

if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=lambda: [lock._forget() for lock in list(_HELD)])


def _lock(root: Path) -> _WriterLock:
    """Take the writer lock of the checkpoint directory ``root``, or raise a CheckpointError naming
    its holder (never waits). An exclusive ``flock`` on ``root/.lock``: the OS drops it when its
    holder dies, however it dies. Where flock is missing (not POSIX, a filesystem without locks)
    the file, made with O_EXCL, is the lock; one left by a dead process of this host is taken over."""
    path = root / LOCK
    while True:
        try:
            fd, made = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644), True
        except FileExistsError:
            try:
                fd, made = os.open(path, os.O_RDWR), False
            except FileNotFoundError:  # released meanwhile
                continue
        try:
            got = _try_flock(fd)
            if got and _still_there(fd, path):
                os.ftruncate(fd, 0)
                _write_at_0(fd, _me())
                return _WriterLock(path, fd)
            if got is None and made:  # no flock here: the file made is the lock
                _write_at_0(fd, _me())
                os.close(fd)
                return _WriterLock(path, None)
            holder = _read_at_0(fd) if not got else b""
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
        if got:
            continue  # its holder released it (and removed the file) after we opened it
        pid, host = _holder(holder)
        if got is None and pid is not None and host == socket.gethostname() and not _pid_alive(pid):
            path.unlink(missing_ok=True)  # no flock, and the file's process died without removing it
            continue
        raise _held(root, holder, stale_hint=got is None)


_NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


def _try_flock(fd: int) -> bool | None:
    """Exclusive flock of ``fd`` without waiting: True got, False held elsewhere, None no flock here."""
    if fcntl is None:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as e:
        if e.errno in _NO_FLOCK:
            return None
        raise
    return True


def _still_there(fd: int, path: Path) -> bool:
    """Whether ``path`` is still the file open as ``fd`` (a released lock file is removed)."""
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


def _read_at_0(fd: int) -> bytes:
    os.lseek(fd, 0, os.SEEK_SET)
    return os.read(fd, 256)


def _write_at_0(fd: int, data: bytes) -> None:
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, data)


def _me() -> bytes:
    return f"{os.getpid()} {socket.gethostname()}\n".encode()


def _holder(text: bytes) -> tuple[int | None, str | None]:
    """(pid, host) written in a lock file; None where it does not say."""
    parts = text.decode("utf-8", "replace").split()
    pid = int(parts[0]) if parts and parts[0].isdigit() else None
    return pid, parts[1] if len(parts) > 1 else None


def _held(root: Path, holder: bytes, stale_hint: bool = False) -> CheckpointError:
    pid, host = _holder(holder)
    me = pid == os.getpid() and host == socket.gethostname()
    who = f"{'this' if me else 'another'} process (pid {pid}, host {host})" if pid is not None else "another process"
    also = " (a save of another model, or a background save not yet committed)" if me else ""
    stale = f"; if no save is running there, remove {root / LOCK}" if stale_hint else ""
    return CheckpointError(
        f"{who} is writing the checkpoint {root}{also}; a checkpoint directory has one writer at a time: "
        f"wait for that save to finish, or save to another directory (loads need no lock){stale}"
    )


# --- save ---------------------------------------------------------------------------------------------
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
    inner = _unwrap(model)
    wait_pending(inner)
    how = _How(keep, incremental, max_chain, background)
    colls = _sharded_collections(inner)
    if colls:  # every rank of the job: its shards, then one commit by rank 0
        options = {"keep": keep, "incremental": incremental, "max_chain": max_chain, "background": background}
        _tell_servers(colls, "save", root, options, optimizer)
        return _save_sharded(root, inner, colls, optimizer, extra_json, how)
    try:
        return _save(root, model, optimizer, extra_json, how)
    except OSError as e:  # the disk, permissions, a file in the way: say which file and why
        raise _cannot_write(root, e) from e


def _cannot_write(root: Path, e: OSError) -> CheckpointError:
    what = str(e) if isinstance(e, _WriteError) else f"{e.filename or root}: {_os_reason(e)}"
    return CheckpointError(
        f"cannot write the checkpoint {root} ({what}); the previous version, if any, is intact; "
        "check that the directory is writable and has free space"
    )


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
    return list(
        {id(m): m for m in model.modules() if isinstance(m, RowStorage) and not getattr(m, "remote", False)}.values()
    )


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
    state_all = storage.table_state(name) if state_names and not storage.keyed else {}  # (dense: views)
    if changes is None:
        weight = serial.table_entry(storage, name)["weight"].clone()  # its own: a view would save the group
        return {"weight": weight, "state": {k: v.clone() for k, v in state_all.items()}}, {}
    changed, removed = changes
    if not storage.keyed:
        rows = storage.changed_rows(name, changed)
        obj = {
            "rows": rows if rows_to_global is None else rows_to_global(rows),
            "weight": storage.table_rows(name).index_select(0, rows),
            "state": {k: v.index_select(0, rows) for k, v in state_all.items()},
        }
        return obj, {"changed": int(rows.numel())}
    entry, slots = storage.save_changes(name, changed, removed)
    state = {k: storage.state[k].index_select(0, slots) for k in state_names}
    live = int(storage.stats(name)["rows"])
    return {**entry, "state": state}, {
        "rows": live,
        "changed": int(slots.numel()),
        "removed": int(entry["removed"].numel()),
    }


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


def _snapshot(model: nn.Module, optimizer, extra: dict, parent: dict | None) -> _Snapshot:
    """Everything a save of a one-process model writes, copied now (the foreground part of a save)."""
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
            obj, shard = _table_files(t.storage, t.name, changes, names[q])
            snap.files[rel] = obj
            if t.keyed:
                n = shard["rows"]
                shards = [{"file": rel, **shard}]
            else:
                n = t.config.num_embeddings
                shards = [{"file": rel, "row_start": 0, "row_end": n, **shard}]
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
        _write_file(tmp / rel, obj)
        files[rel] = {"bytes": (tmp / rel).stat().st_size, "sha256": _sha256(tmp / rel)}
    manifest = {**snap.manifest, "files": dict(sorted(files.items()))}
    _write_file(tmp / MANIFEST, (json.dumps(_sealed(manifest), indent=1) + "\n").encode())
    for d in {tmp, *(p.parent for p in tmp.rglob("*") if p.is_file())}:
        _fsync_dir(d)
    return manifest


def _publish(root: Path, tmp: Path, version: str) -> Path:
    """Rename the written ``tmp`` to its version and commit it (``LATEST``); on failure nothing stays."""
    final = root / version
    try:
        os.rename(tmp, final)
        _fsync_dir(root)
        _commit(root, version)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if _current(root) != version:
            shutil.rmtree(final, ignore_errors=True)
        raise
    return final


def _save(root: Path, model: nn.Module, optimizer, extra_json: dict, how: _How) -> str | SaveHandle:
    root.mkdir(parents=True, exist_ok=True)
    lock = _lock(root)  # held from choosing the version name to the cleanup after the commit
    try:
        _clean(root, how.keep)
        version = _next_version(root)
        parent = _parent_candidate(root, how)
        storages = _storages(model)
        if parent is not None and any(st.checkpoint_base != parent["id"] for st in storages):
            parent = None  # the model was not saved to or loaded from the current version: a full one
        snap = _snapshot(model, optimizer, extra_json, parent)
    except BaseException:
        lock.release()
        raise

    def run() -> str:
        try:
            tmp = root / f".tmp-{version}-{os.getpid()}"
            try:
                tmp.mkdir()
                manifest = _write_snapshot(tmp, snap)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            final = _publish(root, tmp, version)
            _clean(root, how.keep)
        finally:
            lock.release()
        inc = manifest.get("incremental")
        kind = f"incremental, {inc['length']} on top of a full one" if inc else "full"
        log.info("saved checkpoint %s (%d tables, %s)", final, len(manifest["tables"]), kind)
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


# --- compaction: a chain written again as one full version, without the model -----------------------
def compact(path: str | os.PathLike, *, keep: int = 1, verify: bool = True) -> str:
    """Write the current version of the checkpoint at ``path`` again as a full version (the
    chain of incremental versions it builds on put together, shard by shard, in the current
    version's layout) and commit it; no model is needed. Returns the new version's directory
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
    wanted = {}
    for q, t in manifest["tables"].items():
        keyed, dim = t["kind"] == "dynamic", t["shape"][1]
        for sh in t["shards"]:
            wanted[(q, sh["file"])] = (_shard_target(sh, keyed, dim), keyed, sorted(t.get("optimizer_state", [])))
    reads = [(q, target, keyed) for (q, _), (target, keyed, _) in wanted.items()]
    found, needed = _check_chain_files(chain, reads, True, verify)
    _raise(vdir, problems + found, "cannot be compacted")
    _clean(root, keep)
    version = _next_version(root)
    tmp = root / f".tmp-{version}-{os.getpid()}"
    tables = copy.deepcopy(manifest["tables"])
    try:
        tmp.mkdir()
        files = {}
        for q, t in tables.items():
            for sh in t["shards"]:
                target, keyed, names = wanted[(q, sh["file"])]
                entry, probs = assemble(q, _versions_of(chain, q), target, t["shape"][1], keyed, names)
                _raise(vdir, probs, "cannot be compacted")
                _write_file(tmp / sh["file"], entry)
                files[sh["file"]] = {"bytes": (tmp / sh["file"]).stat().st_size, "sha256": _sha256(tmp / sh["file"])}
                sh.pop("changed", None)
                sh.pop("removed", None)
                if keyed:
                    sh["rows"] = int(entry["ids"].numel())
        for rel in needed[vdir] - set(files):  # the dense state and the optimizer's, as they are
            shutil.copyfile(vdir / rel, tmp / rel)
            files[rel] = manifest["files"][rel]
        body = {k: v for k, v in manifest.items() if k not in ("path", "incremental", "files")}
        body["extra"] = _encode_floats(body["extra"], "extra")  # (read_manifest decoded it)
        body.update(_header(manifest["world_size"], uuid.uuid4().hex), created=body["created"], tables=tables)
        body["files"] = dict(sorted(files.items()))
        _write_file(tmp / MANIFEST, (json.dumps(_sealed(body), indent=1) + "\n").encode())
        for d in {tmp, *(p.parent for p in tmp.rglob("*") if p.is_file())}:
            _fsync_dir(d)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    final = _publish(root, tmp, version)
    _clean(root, keep)
    log.info("compacted checkpoint %s (%d versions) into %s", vdir, len(chain), final)
    return str(final)


def _shard_target(sh: dict, keyed: bool, dim: int) -> Target:
    """The rows and columns a saved shard entry holds, as a target to put together again."""
    cols = (int(sh.get("col_start", 0)), int(sh.get("col_end", dim)))
    if not keyed:
        a, b, step, *_ = _span(sh, dim)
        return Target((a, b, step), cols)
    if sh.get("residue") is not None:
        return Target(None, cols, (sh["residue"], sh["residues"]), first=sh["residue"] == 0)
    return Target(None, cols)


# --- background saves -------------------------------------------------------------------------------
_PENDING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its save in progress


class SaveHandle:
    """A save writing in the background (``he.save(..., background=True)``).

    ``wait()`` blocks until the version is committed and returns its directory, or raises the
    save's :class:`~hybridembed.CheckpointError` (then the previous version is still the
    current one, and the rows this save would have written are counted as changed again).
    ``done()`` says whether the writing finished. The next ``he.save`` or ``he.load`` of the
    same model waits for it first."""

    def __init__(self, model: nn.Module, snap: _Snapshot, run, wrap_error) -> None:
        self._snap, self._run, self._wrap = snap, run, wrap_error
        self._result: str | None = None
        self._error: BaseException | None = None
        self._finished = False
        self._model = weakref.ref(model)
        _PENDING[model] = self
        self._thread = threading.Thread(target=self._work, name="hybridembed-save", daemon=False)
        self._thread.start()

    def _work(self) -> None:
        try:
            self._result = self._run()
        except BaseException as e:  # noqa: BLE001 - raised by wait()
            self._error = e

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> str:
        """The committed version's directory (blocks up to ``timeout`` seconds; None: until done)."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the background save is still writing after {timeout} s")
        if not self._finished:
            self._finished = True
            model = self._model()
            if model is not None and _PENDING.get(model) is self:
                del _PENDING[model]
            self._snap.finish(self._error is None)
        if self._error is not None:
            e = self._error
            if isinstance(e, OSError):
                raise self._wrap(e) from e
            raise e
        return self._result

    result = wait

    def __repr__(self) -> str:
        state = "writing" if not self.done() else ("failed" if self._error else f"committed {self._result}")
        return f"SaveHandle({state})"


def wait_pending(model: nn.Module) -> None:
    """Wait for ``model``'s background save, if any (its error, if it failed, is raised here)."""
    pending = _PENDING.get(model)
    if pending is not None:
        pending.wait()


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
    name = _read_pointer(root)
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
            for key in ("row_step", "col_start", "col_end", "shard", "step", "changed", "removed", "residue"):
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
    0..k-1 (every id in exactly one) or whole."""
    groups: dict[tuple[int, int], list] = {}
    for x in shards:
        groups.setdefault((int(x.get("col_start", 0)), int(x.get("col_end", dim))), []).append(x.get("residue"))
    cols = sorted(groups)
    if [c0 for c0, _ in cols] != [0, *(c1 for _, c1 in cols[:-1])] or cols[-1][1] != dim:
        return [f"table {q!r}: the shards' columns {cols} do not tile 0..{dim}"]
    for c, residues in groups.items():
        if all(r is None for r in residues):  # whole, or split without saying how (ids are unique anyway)
            continue
        ks = {x.get("residues") for x in shards if (int(x.get("col_start", 0)), int(x.get("col_end", dim))) == c}
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
        have = t.storage.table_state(t.name)
        state = entries[q]["state"]
        if set(state) != set(have):
            problems.append(f"table {q!r}: optimizer state {sorted(state)} in the checkpoint, {sorted(have)} here")
            continue
        rows = entries[q]["ids"].numel() if t.keyed else have[next(iter(have))].shape[0] if have else 0
        for k, v in state.items():
            want = (rows, *have[k].shape[1:])
            if tuple(v.shape) != want or not v.is_floating_point():
                problems.append(
                    f"table {q!r}: optimizer state {k!r} is {tuple(v.shape)} {_dtype_name(v.dtype)}, "
                    f"expected {want} floating point"
                )
    return problems


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


@torch.no_grad()
def _load_tables(items: list) -> None:
    """Writes checked entries ``[(storage, table, entry)]``: a storage's tables at once; a dynamic
    storage's clock is then the saved one (the latest of its tables'), not max(saved, current)."""
    by_storage: dict[int, tuple[RowStorage, dict]] = {}
    for storage, name, entry in items:
        by_storage.setdefault(id(storage), (storage, {}))[1][name] = entry
    for storage, entries in by_storage.values():
        serial.load_entries(storage, entries)
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
    inner = _unwrap(model)
    wait_pending(inner)
    colls = _sharded_collections(inner)
    if colls:  # every rank of the job: its shards, all ranks or none
        _tell_servers(colls, "load", path, {"verify": verify}, optimizer)
        try:
            return _load_sharded(path, inner, colls, optimizer, verify)
        finally:
            for sc in colls.values():
                if hasattr(sc, "after_load"):
                    sc.after_load()
    manifest = read_manifest(path)
    vdir = Path(manifest["path"])
    chain = _chain(manifest)
    tables = _model_tables(model)
    _raise(vdir, _check_model(manifest, model, optimizer, tables) + _check_chain(chain), "does not match the model")
    wanted = {q: (_whole(t.config, t.keyed), t.keyed, _state_names(manifest, q, optimizer)) for q, t in tables.items()}
    reads = [(q, target, keyed) for q, (target, keyed, _) in wanted.items()]
    _raise(vdir, _check_chain_files(chain, reads, optimizer is not None, verify)[0], "is damaged")

    problems: list[str] = []
    entries = {}
    for q, (target, keyed, names) in wanted.items():
        entries[q], p = assemble(q, _versions_of(chain, q), target, tables[q].config.embedding_dim, keyed, names)
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
    _load_tables([(t.storage, t.name, entries[q]) for q, t in tables.items()])
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
                e = entries[q]
                sparse[name] = {
                    **meta,
                    "ids": e["ids"] if tables[q].keyed else None,
                    "state": e["state"],
                }
            optimizer.load_state_dict({"dense": opt_file["dense"], "sparse": sparse, "format": 1})
    _loaded_from(manifest, {id(t.storage): t.storage for t in tables.values()}.values(), optimizer)
    log.info("loaded checkpoint %s (%d tables)", vdir, len(tables))
    return manifest


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
        if hasattr(sc, "before_checkpoint"):
            sc.before_checkpoint(action, str(path), {**options, "optimizer": optimizer is not None})


def _sharded_collections(model: nn.Module) -> dict[str, nn.Module]:
    """``{path: ShardedCollection}`` of ``model`` (empty for a model of one process)."""
    if not any(getattr(type(m), "sharded", False) is True for m in model.modules()):
        return {}
    from ..distributed.runtime import ShardedCollection

    return {p: m for p, m in model.named_modules() if isinstance(m, ShardedCollection)}


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

    from ..distributed import health

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


def _snapshot_pieces(snap: _Snapshot, pieces: list[_Piece], stems: dict[str, str], optimizer, rank: int, delta: bool):
    """This rank's pieces (rank 0 also the data-parallel ones), copied into ``snap.files``;
    returns what the manifest needs of them: ``{tables: {q: [shard entries]}, meta: {q: ...}}``."""
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
        obj, extra = _table_files(piece.storage, piece.name, changes, names, to_global)
        snap.files[rel] = obj
        shard = {"file": rel, **{k: v for k, v in sp.items() if k != "replicated"}, **extra}
        if managed:
            opt = opt_meta[piece.name]
            shard["step"] = opt["step"]
            meta[q] = {k: opt[k] for k in ("optimizer", "hparams", "step")}
        tables.setdefault(q, []).append({**shard, "optimizer_state": names})
    return {"tables": tables, "meta": meta}


def _checkpoint_group(group):
    """A second (gloo) process group over ``group``'s ranks for background saves: their
    collectives run beside the training's. Made once per group (collectively, the first time)."""
    import torch.distributed as dist

    from ..distributed import health

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
            part = _snapshot_pieces(snap, pieces, stems, optimizer, rank, parent is not None)
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
            files, error = {}, snap_error
            try:
                for rel, obj in snap.files.items() if snap_error is None else ():
                    _write_file(tmp / rel, obj)
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
                        _write_file(tmp / rel, obj)
                        all_files[rel] = {"bytes": (tmp / rel).stat().st_size, "sha256": _sha256(tmp / rel)}
                        return rel

                    for rel, obj in dense_files.items():
                        write(rel, obj)
                    manifest["dense"] = dense_entry
                    manifest["optimizer"] = _write_optimizer(write, optimizer, dense_sd, sparse, torch_sd)
                    manifest["extra"] = extra
                    manifest["files"] = dict(sorted(all_files.items()))
                    _write_file(tmp / MANIFEST, (json.dumps(_sealed(manifest), indent=1) + "\n").encode())
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
    problems = _check_sharded_model(manifest, model, colls, optimizer)
    _raise(vdir, problems + (_check_chain(chain) if not problems else []), "does not match the model")
    pieces = [p for path_, sc in colls.items() for p in _shard_pieces(path_, sc)]
    names = {id(p): _state_names(manifest, p.qualified, optimizer) if _managed(p, optimizer) else [] for p in pieces}
    reads = [(p.qualified, _target(p), p.keyed) for p in pieces]
    opt_entry = manifest["optimizer"] if optimizer is not None else None
    _raise(vdir, problems + _check_chain_files(chain, reads, optimizer is not None, verify)[0], "is damaged")

    hybrid = isinstance(optimizer, HybridOptimizer)
    sparse_meta = (opt_entry or {}).get("sparse", {})
    loaded = []
    for piece in pieces:
        q = piece.qualified
        where = f"table {q!r} shard {piece.spec['shard']}"
        target = _target(piece)
        versions = _versions_of(chain, q)
        entry, probs = assemble(q, versions, target, piece.whole.embedding_dim, piece.keyed, names[id(piece)])
        if probs:
            problems += probs
            continue
        state = entry.pop("state")
        missing, errors = serial.check_entry(piece.storage, piece.name, entry, f"{where}: ", strict_dtype=True)
        problems += [f"{k}: missing" for k in missing] + errors
        if _managed(piece, optimizer) and not missing and not errors:
            have = piece.storage.table_state(piece.name)
            rows = entry["ids"].numel() if piece.keyed else piece.config.num_embeddings
            if set(state) != set(have):
                problems.append(f"{where}: optimizer state {sorted(state)} in the checkpoint, {sorted(have)} here")
            for k, v in state.items():
                want = (rows, *have[k].shape[1:]) if k in have else None
                if want is not None and (not torch.is_tensor(v) or tuple(v.shape) != want):
                    problems.append(f"{where}: optimizer state {k!r} is {_shape(v)}, expected {want}")
            meta = sparse_meta.get(q)
            if not isinstance(meta, dict) or meta.get("optimizer") != piece.storage.optimizer.name:
                got = meta.get("optimizer") if isinstance(meta, dict) else "none"
                problems.append(f"table {q!r}: optimizer {got} in the checkpoint, {piece.storage.optimizer.name} here")
        steps = [sh["step"] for sh in versions[-1][1]["shards"] if "step" in sh]
        loaded.append((piece, entry, state, max(steps) if steps else (sparse_meta.get(q) or {}).get("step", 0)))
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
    return {"manifest": manifest, "loaded": loaded, "dense": dense, "opt_file": opt_file}


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
    _load_tables([(piece.storage, piece.name, entry) for piece, entry, _, _ in loaded])
    opt_file = prepared["opt_file"]
    if optimizer is not None and opt_file["kind"] == "torch":
        optimizer.load_state_dict(opt_file["state_dict"])
    elif optimizer is not None:
        sparse = {}
        for piece, entry, state, step in loaded:
            if not any(st is piece.storage for st in optimizer._storages):
                continue
            meta = opt_file["sparse"].get(piece.qualified, {})
            sparse[piece.name] = {
                "shape": [piece.config.num_embeddings, piece.config.embedding_dim],
                "ids": entry["ids"] if piece.keyed else None,
                "optimizer": piece.storage.optimizer.name,
                "hparams": meta.get("hparams", {}),
                "step": int(step),
                "state": state,
            }
        optimizer.load_state_dict({"dense": opt_file["dense"], "sparse": sparse, "format": 1})
    _loaded_from(manifest, {id(st): st for sc in colls.values() for st in sc.storages}.values(), optimizer)
    log.info("loaded checkpoint %s (rank %d)", manifest["path"], next(iter(colls.values())).rank)
    return manifest


def _unwrap(model: nn.Module) -> nn.Module:
    from ..distributed.shard import unwrap

    return unwrap(model)
