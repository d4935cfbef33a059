"""Files of a tiered table's directory mapped into memory (:func:`mapped`: arrays that grow with the
records of a dynamic tiered table, in the kernel's page cache rather than the process's memory),
and the lock that keeps two live tables off one directory's files."""

from __future__ import annotations

import fcntl
import functools
import math
import os
import tempfile
from pathlib import Path

import torch

from ..errors import ConfigError, HybridEmbedError

__all__ = ["mapped", "grown", "willneed", "group_stem", "lock_dir", "memory_limit", "map_limit"]

MAP_SHARE = 8  # Tiered(mapped=None): a tiered table's files mapped while they take at most 1 / this of the memory


def memory_limit() -> int:
    """Bytes of memory this process may use: the machine's, or less where its cgroup or one above
    it (v2's ``memory.max``, v1's ``memory.limit_in_bytes``) is limited."""
    limit = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return limit
    for line in lines:  # ("0::/path" for v2, "N:memory:/path" for v1)
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, rel = parts
        if controllers == "":
            root, name = Path("/sys/fs/cgroup"), "memory.max"
        elif "memory" in controllers.split(","):
            root, name = Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes"
        else:
            continue
        group = Path(rel.lstrip("/"))
        files = [root / g / name for g in (group, *group.parents)]  # (the process's cgroup, then those above)
        for f in files:
            try:
                text = f.read_text().strip()
            except OSError:
                continue
            if text.isdigit():
                limit = min(limit, int(text))
    return limit


def map_limit(choice: bool | None) -> int:
    """The most bytes of a tiered table's files mapped into memory under ``Tiered(mapped=choice)``:
    -1 (False: none), no bound (True), or :data:`MAP_SHARE`'s share of :func:`memory_limit` (None)."""
    return -1 if choice is False else 1 << 62 if choice else memory_limit() // MAP_SHARE


def group_stem(tables) -> str:
    """The stem of a tiered group's files in its directory: its one table's name, or the first's and
    how many more follow it after a '.' (which no table name holds: no group's stem is a table's)."""
    return tables[0].name if len(tables) == 1 else f"{tables[0].name}.{len(tables) - 1}"


def lock_dir(path: Path) -> int:
    """An exclusive ``flock`` on ``path`` (made if missing): its descriptor. Two live tables never
    share one set of files (the lock goes with the descriptor, or when the process ends)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
    except OSError as e:
        raise ConfigError(
            f"{path}: cannot make this table group's lock file ({e.strerror}); give Tiered(path=...) a writable "
            "directory whose files are the table's own"
        ) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise ConfigError(
            f"{path}: the files of this table group are in use by another live tiered table (in this process or "
            "another); give each model its own Tiered(path=...) directory"
        ) from None
    return fd


def mapped(
    where: Path | None, shape: tuple[int, ...], dtype: torch.dtype, fill: int = 0, random: bool = False
) -> torch.Tensor:
    """A tensor of ``shape`` full of ``fill``: in this process's memory where ``where`` is None, else
    in a file of that directory mapped into memory (``MAP_SHARED``): its pages are the kernel's page
    cache, written back and dropped under memory pressure, not this process's memory. The file is
    unlinked at once (it goes when the tensor does; a crash leaves nothing behind) and its blocks
    are reserved first: a full disk raises here, never a ``SIGBUS`` at a later write. ``random``:
    read at random (a hash index), so a fault reads its own page alone (``MADV_RANDOM``; arrays
    also scanned in order keep the kernel's read-ahead)."""
    numel = math.prod(shape)
    if where is None or numel == 0:
        return torch.full(shape, fill, dtype=dtype)
    size = numel * dtype.itemsize
    fd, name = -1, None
    try:
        fd, name = tempfile.mkstemp(dir=where, prefix=".mapped-")
        os.posix_fallocate(fd, 0, size)  # (blocks reserved, read as zeros)
        out = torch.from_file(name, shared=True, size=numel, dtype=dtype).view(shape)
        if random:
            _advise(out, _MADV_RANDOM)
    except (OSError, RuntimeError) as e:
        raise HybridEmbedError(
            f"tiered table index in {where}: cannot reserve {size / 2**20:,.1f} MiB ({getattr(e, 'strerror', e)}); "
            "nothing was changed: free room on that disk"
        ) from None
    finally:
        if fd >= 0:
            os.close(fd)
        if name is not None:
            os.unlink(name)
    if fill:
        out.fill_(fill)
    return out


_MADV_RANDOM = 1  # <sys/mman.h>: a page fault reads that page alone (no read-around of its neighbours)
_MADV_WILLNEED = 3  # <sys/mman.h>: read these pages now (the reads are started, not waited for)
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


@functools.cache
def _libc():
    """This process's C library (``ctypes``), loaded once."""
    import ctypes

    return ctypes.CDLL(None, use_errno=True)


def _advise(t: torch.Tensor, advice: int) -> None:
    """``madvise`` over the pages of ``t`` (a contiguous part of a mapping); a refusal is only a lost hint."""
    import ctypes

    if t.numel() == 0:
        return
    start = t.data_ptr() // _PAGE * _PAGE
    try:
        libc = _libc()
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(t.data_ptr() + t.numel() * t.itemsize - start), advice)
    except (OSError, AttributeError):
        pass


def willneed(t: torch.Tensor) -> None:
    """Start reading the pages of ``t`` (a contiguous part of a :func:`mapped` tensor) from the disk
    in one sweep, in order, while the caller goes on: a pass that is about to write most of them
    then finds them in memory instead of faulting each from the disk (``MADV_WILLNEED``)."""
    _advise(t, _MADV_WILLNEED)


def grown(t: torch.Tensor, rows: int, where: Path | None, fill: int = 0, keep: int | None = None) -> torch.Tensor:
    """``t`` with ``rows`` rows (:func:`mapped` in ``where``): its first ``keep`` rows (all: None)
    copied, the rest ``fill``."""
    out = mapped(where, (rows, *t.shape[1:]), t.dtype, fill)
    keep = t.shape[0] if keep is None else keep
    out[:keep] = t[:keep]
    return out
