"""A checkpoint directory on disk: its names (versions, ``LATEST``, the manifest), the model's tables as a checkpoint names them, the file helpers every write goes through, and the cleanup of old versions."""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import CheckpointError
from ..modules import EmbeddingCollection
from ..modules.converted import _TableLayer
from ..storage import RowStorage

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
    """One new file of a checkpoint: ``torch.save`` (or raw bytes), flushed and fsynced. Never
    written over (``"xb"``): a file of a staged version may be a second name of a committed
    version's file (:mod:`~hybridembed.checkpoint.links`), whose bytes must not change."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "xb") as f:
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
    kept = {current, *older[max(0, len(older) - (keep - 1)) :]} if keep > 1 else {current}
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
