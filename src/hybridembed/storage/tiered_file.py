"""A tiered table's file (:class:`_File`): a (rows, width) matrix on local disk, read and written a
run of consecutive rows per system call (Numba's loop of ``pread`` / ``pwrite``, else Python's) or,
where it is small, through a mapping (in 2 MiB pages where the page cache holds it); a dynamic
table's spills appended by one writer thread behind the step where its file is not mapped
(:meth:`_File.write_behind`); for reads and writes of many rows far apart, the kernel asked for
all their pages at once (``posix_fadvise``) before the calls that need them. Used by
:mod:`hybridembed.storage.tiered` (dense tables: a file of rows and one per optimizer state) and
:mod:`hybridembed.storage.tiered_hash` (dynamic tables: one file of records).
"""

from __future__ import annotations

import functools
import mmap
import os
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from ..errors import ConfigError, HybridEmbedError
from ..utils import advise_huge_pages
from .mapped import map_limit

_CALL_BYTES = 1 << 30  # the most one preadv / pwritev call moves
# a read of many runs far apart (beyond the kernel's read-ahead: a table larger than memory) is
# cut into this many slices read at once, the disk's queue kept full. On this project's machine
# (a cold 1 GiB file, 264-byte records): 8,000 / 5,000 records 340-357 / 229-253 ms by one thread,
# 151-167 / 94-122 ms by 8. Records close together (31,000 there) are read by one thread: its
# read-ahead streams the file (370-430 ms), which 8 threads reading apart defeat (590-1,030 ms).
_READERS = 8
_PARALLEL_RUNS = 256  # runs from which a read may be cut into slices (where its pages are not asked for, below)
_SPARSE_GAP = 64 << 10  # mean bytes between runs from which it is
# such reads (records far apart: no neighbour is read again soon) leave no page in the page cache
# (``preadv2``'s RWF_DONTCACHE, Linux 6.14+: elsewhere refused and read as usual): in a process whose
# memory is capped, the pages they would fill evict the records index's instead
_DONTCACHE = 0x80
# a read of this many runs or more far apart (_SPARSE_GAP), or a write of runs a page or more apart
# each shorter than a page (the kernel reads a page before writing part of it), first asks the kernel
# for all their pages (``posix_fadvise(WILLNEED)``: it queues the reads at once and returns), then
# reads or writes them one call a run. Measured here on a cold 1 GiB file of 264-byte records
# (``bench_tiered.py --part reads``): 5,000-12,000 records far apart read 1.31-1.48x faster than by
# 8 threads' slices, 3.9-4.7x faster than by one thread; scattered writes 4.9-5.3x faster. Not reads
# of records closer together: there the kernel's read-ahead streams the file into the page cache,
# which a file the page cache holds gains from in the next steps (asked for, a cold dynamic step of
# 31,000 records 33 KiB apart took 281 ms against 120). A page already cached costs a call (~0.3 us).
_ASK_RUNS = 16
_ASK_BYTES = 256 << 20  # at most this many bytes a call (the pages asked for are read into the page cache at once)
_PAGE = mmap.PAGESIZE
_CAN_ASK = hasattr(os, "posix_fadvise")
_PROBES = 8  # runs probed for their pages in the page cache before any is asked for (_cached)
_NOWAIT = getattr(os, "RWF_NOWAIT", 0)
# writes a file has in flight at once (write_behind: a step's evictions, written while the step goes on;
# 0: none, each written at once)
_BEHIND = 1


class _File:
    """One (rows, width) matrix of ``dtype`` in a file, read and written a run of consecutive rows
    per system call (``os.preadv`` / ``os.pwritev``; measured against a ``numpy.memmap``: 5,000
    scattered rows of 256 bytes written into a 40 GiB file in 29 ms, against 151 ms through the
    mapping's page faults, and no file page ever counts against the process's memory).

    ``mapped``: the file also mapped into memory (``MAP_SHARED``; a file of fixed size), its rows
    read and written by copies from and into the mapping, no system call a row: where the file
    stays in the page cache (a table smaller than the machine's memory), 6,000 scattered rows of
    256 bytes of a 1 GiB file read in 0.4 ms against 5.2 ms by ``pread`` and written in 4.2
    against 9.0 ms by ``pwrite`` (measured here); the mapped pages count in the process's resident
    memory (file pages, which the kernel reclaims as it needs)."""

    def __init__(self, path: Path, rows: int, width: int, dtype: torch.dtype, mapped: bool = False):
        self.item = torch.empty((), dtype=dtype).element_size()
        self.width, self.dtype, self.path = width, dtype, path
        self.row_bytes = width * self.item
        size = rows * self.row_bytes
        try:  # (not through a symbolic link: the table writes its own files only)
            self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o644)
        except OSError as e:
            raise ConfigError(
                f"tiered table file {path}: cannot make it ({e.strerror}); give Tiered(path=...) a writable "
                "directory whose files are the table's own"
            ) from None
        try:
            os.posix_fallocate(self.fd, 0, max(size, 1))  # (reserved now: a full disk fails here)
        except OSError as e:
            os.close(self.fd)
            raise ConfigError(
                f"tiered table file {path}: cannot reserve {size / 2**20:,.1f} MiB ({e.strerror}); give "
                "Tiered(path=...) a writable directory on a disk with room for the table and its optimizer state"
            ) from None
        self._closer = weakref.finalize(self, os.close, self.fd)
        self.uncached = _DONTCACHE if _reads_uncached(self.fd) else 0  # (preadv2's flag for reads far apart)
        self._behind: list[_Behind] = []  # writes handed to the writer thread, oldest first (write_behind)
        self._behind_lock = threading.Lock()
        self._retry_lock = threading.Lock()
        self.map, self.size = None, size  # (rows, width) over the file's pages (mapped)
        self.fits = False  # (mapped and at most map_limit(None) bytes: in huge pages, the page cache's)
        self.map_writes, self._map_limit = mapped, -1  # (map_reads: a file that grows, read through a mapping)
        if mapped and size:
            self._map(rows)

    def _map(self, rows: int) -> None:
        self.map = torch.from_file(str(self.path), shared=True, size=rows * self.width, dtype=self.dtype)
        self.fits = rows * self.row_bytes <= map_limit(None)  # (the page cache holds it: Tiered(mapped=None)'s rule)
        if self.fits:
            # in 2 MiB pages where the page cache holds the whole file (before a page is touched): rows
            # copied at random miss the TLB far less, and once the kernel has written the file back,
            # the next writes fault once a huge page, not once a 4 KiB page. Measured on the dense
            # tiered step (bench_tiered.py --part speed, 1 GiB of rows): after ~30 s, 600-1,600 faults
            # a step, steps 12-17 ms; in huge pages 15-30 faults, 9-11 ms (docs/benchmarks.md). Not in
            # a larger file: a fault would read 2 MiB from disk for one row
            advise_huge_pages(self.map)
        self.map, self.size = self.map.view(rows, self.width), rows * self.row_bytes

    def map_reads(self, limit: int) -> None:
        """Read rows through a mapping of the file while it takes at most ``limit`` bytes (checked
        again as :meth:`reserve` grows it: a file of records that grows); -1: never. Its writes
        are system calls, or :meth:`write_mapped` (the caller's choice)."""
        self._map_limit = limit
        rows = os.fstat(self.fd).st_size // max(self.row_bytes, 1)
        if 0 < rows * self.row_bytes <= limit:
            self._map(rows)
        else:
            self.map, self.fits = None, False

    def reserve(self, rows: int) -> None:
        """Room on disk for ``rows`` rows (the file grows; a full disk raises here, before a write)."""
        if self.map_writes:
            raise HybridEmbedError(f"tiered table file {self.path}: a mapped file does not grow")
        try:
            os.posix_fallocate(self.fd, 0, max(rows * self.row_bytes, 1))
        except OSError as e:
            raise HybridEmbedError(
                f"tiered table file {self.path}: cannot grow to {rows * self.row_bytes / 2**20:,.1f} MiB "
                f"({e.strerror}); nothing was changed: free room on that disk"
            ) from None
        self.size = max(self.size, rows * self.row_bytes)
        if self._map_limit >= 0:
            self.map_reads(self._map_limit)

    def __reduce__(self):  # (and deepcopy: two tables must not share one file and its descriptor)
        raise HybridEmbedError(
            f"a tiered table's file ({self.path}) cannot be copied or pickled: save a checkpoint (he.save) "
            "and load it into a new model"
        )

    def _runs(self, rows: torch.Tensor) -> tuple[torch.Tensor | None, np.ndarray, np.ndarray, np.ndarray]:
        """``rows`` (K,) -> (their order ascending (None: ascending already), then per run of
        consecutive rows in that order: its first byte and end byte in the sorted rows' buffer, its
        byte offset in the file), each run at most :data:`_CALL_BYTES` (Linux moves at most 2 GiB
        per call)."""
        ascending = rows.numel() < 2 or bool((rows[1:] > rows[:-1]).all())
        order = None if ascending else torch.argsort(rows)  # (None: in order already, as a spill's places)
        r = (rows if order is None else rows.index_select(0, order)).numpy()
        if r.size == 0:
            return order, *(np.zeros(0, dtype=np.int64),) * 3
        cut = np.flatnonzero(np.diff(r) != 1) + 1
        starts, ends = np.r_[0, cut], np.r_[cut, r.size]
        most = max(1, _CALL_BYTES // max(self.row_bytes, 1))
        if int((ends - starts).max()) > most:  # (rare: a run cut into calls of at most `most` rows)
            lo = np.concatenate([np.arange(a, b, most) for a, b in zip(starts.tolist(), ends.tolist())])
            starts, ends = lo, np.minimum(np.r_[lo[1:], r.size], lo + most)
        rb = self.row_bytes
        return order, starts * rb, ends * rb, r[starts] * rb

    def read(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows ``rows`` (K,) -> (K, width) (after the writes in flight to any of them)."""
        if self._behind:
            self.settle_writes(rows)
        if self.map is not None:
            m = self.mapping()
            if self.dtype != torch.uint8:
                return m.index_select(0, rows)
            return _words(m.view(-1), self.row_bytes).index_select(0, rows).view(torch.uint8).view(-1, self.width)
        self._check_size()
        order, starts, ends, offsets = self._runs(rows)
        io = _io()
        buf = torch.empty(rows.numel() * self.row_bytes, dtype=torch.uint8)
        first = _pread_runs(io, self.fd, buf.numpy(), starts, ends, offsets, self.uncached) if io else 0
        if first >= 0:  # (no Numba, or a run failed: Python's calls from there, which raise the error)
            view = memoryview(buf.numpy())
            for a, b, at in zip(starts[first:].tolist(), ends[first:].tolist(), offsets[first:].tolist()):
                if os.preadv(self.fd, [view[a:b]], at) != b - a:
                    raise HybridEmbedError(f"tiered table file {self.path}: a short read (the file was truncated?)")
        if order is not None:  # (back into the order asked for, a row as its widest words)
            out = torch.empty_like(buf)
            dst, src = _words(out, self.row_bytes, buf)
            dst.index_copy_(0, order, src)
            buf = out
        return buf.view(self.dtype).view(-1, self.width)

    def write(self, rows: torch.Tensor, data: torch.Tensor) -> None:
        """``data`` (K, width) into rows ``rows`` (K,) distinct (after every write in flight)."""
        if self.map_writes and self.write_mapped(rows, data):
            return
        if self._behind:
            self.settle_writes()
        try:
            self._write_now(rows, data)
        except OSError as e:
            raise HybridEmbedError(
                f"tiered table file {self.path}: writing {rows.numel():,} rows failed ({e.strerror}): check that disk"
            ) from None

    def write_mapped(self, rows: torch.Tensor, data: torch.Tensor) -> bool:
        """``data`` (K, width) into rows ``rows`` (K,) distinct through the file's mapping, after
        the writes in flight to any of them: True, or False where the file is not mapped (or not
        all of these rows are: the caller writes them by system calls)."""
        if self.map is None or (rows.numel() and int(rows.max()) >= self.map.shape[0]):
            return False
        if self._behind:
            self.settle_writes(rows)
        dst, src = self.mapping(), data.reshape(-1, self.width).contiguous()
        if self.dtype == torch.uint8:  # (records of bytes: copied as words)
            dst, src = _words(dst.view(-1), self.row_bytes, src.view(-1))
        dst.index_copy_(0, rows, src)
        return True

    def mapping(self) -> torch.Tensor:
        """The mapping, after a check that the file still holds it (a page beyond a file truncated
        under the table would kill the process with SIGBUS, not raise)."""
        self._check_size()
        return self.map

    def _check_size(self) -> None:
        """Raise where the file is shorter than the rows it holds: cut under the table. (Read by
        system calls, its missing rows would read as zeros, and a write would grow it again.)"""
        if os.fstat(self.fd).st_size < self.size:
            raise HybridEmbedError(f"tiered table file {self.path}: shorter than its rows (the file was truncated?)")

    def write_behind(self, rows: torch.Tensor, data: torch.Tensor) -> None:
        """:meth:`write` by the writer thread while the caller goes on (the copy into the kernel's
        page cache: ~1 ms a MiB here, 2-4 ms of a dynamic tiered step's spill; the thread runs the
        Numba loops, which hold no GIL, and for rows far apart the eight calls of :func:`_cached`:
        without Numba this writes now). ``data`` is kept, not
        copied, until written: the caller hands it over. A read of any of these rows waits for the
        write, a :meth:`write` for every write in flight, and a write beyond :data:`_BEHIND` in
        flight for the oldest. A failed write keeps its rows here and is tried again by the next
        :meth:`settle_writes` that needs it, which raises if it fails again: nothing is lost."""
        io = _io()
        if io is None or _BEHIND <= 0 or self.map_writes:
            self.write(rows, data)
            return
        self.make_room()
        self._check_size()
        w = _Behind(rows, self._prepared(rows, data))
        with self._behind_lock:
            self._behind.append(w)
        # (through self: this file, and its descriptor, outlive the write)
        w.done = _writer().submit(lambda: _pwrite_runs(io, self.fd, *w.runs))

    def settle_writes(self, rows: torch.Tensor | None = None, keep: int = 0) -> None:
        """Wait for the writes in flight to any of ``rows`` (None: all but the newest ``keep``); a
        failed one is written again here from where it failed, and raises if it fails again (its
        rows kept for the next try)."""
        with self._behind_lock:
            waiting = list(self._behind)
        if rows is None:
            waiting = waiting[: max(0, len(waiting) - keep)]
        else:
            waiting = [w for w in waiting if w.overlaps(rows)]
        for w in waiting:
            with self._retry_lock:  # (the prefetch thread may need it too: one try at a time)
                if w.first is None:  # (a forked child never sees its parent's writer finish: it writes it all)
                    w.first = w.done.result() if w.pid == os.getpid() else 0
                if w.first >= 0:
                    self._check_size()  # (its rows stay kept: a cut file is not grown again by the retry)
                    try:
                        self._write_runs(*w.runs, w.first)
                    except OSError as e:
                        raise HybridEmbedError(
                            f"tiered table file {self.path}: writing {w.rows.numel():,} rows failed ({e.strerror}); "
                            "they are kept in memory and written again at the next step: check that disk"
                        ) from None
                    w.first = -1
            with self._behind_lock:
                if w in self._behind:
                    self._behind.remove(w)

    def make_room(self) -> None:
        """Wait until one more write may go in flight (:data:`_BEHIND`); an earlier failed write is
        written again here, and raises if it fails again. A step calls it before it changes anything."""
        self.settle_writes(keep=max(0, _BEHIND - 1))

    def _prepared(self, rows: torch.Tensor, data: torch.Tensor) -> tuple[np.ndarray, ...]:
        """(``data``'s bytes in the order of ``rows`` ascending, then :meth:`_runs`' bytes and offsets)."""
        order, starts, ends, offsets = self._runs(rows)
        flat = data.contiguous().view(torch.uint8).view(-1)
        if order is not None:  # (in the order of the rows, a row as its widest words)
            flat = _words(flat, self.row_bytes).index_select(0, order).view(torch.uint8).view(-1)
        return flat.numpy(), starts, ends, offsets

    def _write_now(self, rows: torch.Tensor, data: torch.Tensor) -> None:
        self._check_size()
        runs = self._prepared(rows, data)
        io = _io()
        first = _pwrite_runs(io, self.fd, *runs) if io else 0
        if first >= 0:
            self._write_runs(*runs, first)

    def _write_runs(self, flat, starts, ends, offsets, first: int) -> None:
        """Runs ``first`` on by Python's calls (no Numba, or a run failed: they raise the error)."""
        buf = memoryview(flat)
        for a, b, at in zip(starts[first:].tolist(), ends[first:].tolist(), offsets[first:].tolist()):
            view = buf[a:b]
            while len(view):  # (a write may move fewer bytes than asked)
                n = os.pwritev(self.fd, [view], at)
                view, at = view[n:], at + n


def _words(flat: torch.Tensor, row_bytes: int, *more: torch.Tensor):
    """A flat uint8 buffer of rows of ``row_bytes`` as (rows, words) of the widest integer that divides
    a row and the buffer's address: a reorder of rows moves words, not bytes (3,800 records of 260
    bytes: 0.80 ms as uint8, 0.11 ms as int32 words; 8,000 of 264 bytes copied into a 792 MB
    array, ``index_copy_``: 1.19 ms as uint8, 0.37 ms as int64; measured). With ``more`` buffers:
    each, in one word for all (a tuple)."""
    bufs = (flat, *more)
    views = None
    for dt in (torch.int64, torch.int32, torch.int16):
        if row_bytes % dt.itemsize == 0 and all(b.data_ptr() % dt.itemsize == 0 for b in bufs):
            views = tuple(b.view(dt).view(-1, row_bytes // dt.itemsize) for b in bufs)
            break
    views = views or tuple(b.view(-1, row_bytes) for b in bufs)
    return views if more else views[0]


class _Behind:
    """A write in flight (:meth:`_File.write_behind`): its rows (K,), their bytes and runs (as
    :meth:`_File._prepared` gives them), the writer's future and, once waited for, the first run
    that failed (-1: none; None: not waited for yet)."""

    def __init__(self, rows: torch.Tensor, runs: tuple):
        self.rows, self.runs, self.first, self.done, self.pid = rows, runs, None, None, os.getpid()
        self.lo, self.hi = (int(rows.min()), int(rows.max())) if rows.numel() else (0, -1)

    def overlaps(self, rows: torch.Tensor) -> bool:
        """Whether any of ``rows`` is one of these (a spill's rows are one run: a range test alone)."""
        inside = rows[(rows >= self.lo) & (rows <= self.hi)]
        if inside.numel() == 0:
            return False
        return self.hi - self.lo + 1 == self.rows.numel() or bool(torch.isin(inside, self.rows).any())


_readers: ThreadPoolExecutor | None = None
_readers_lock = threading.Lock()
_writers: ThreadPoolExecutor | None = None


def _forget_readers() -> None:  # (a forked child has none of its parent's threads)
    global _readers, _writers
    _readers = _writers = None


def _writer() -> ThreadPoolExecutor:
    """The thread that writes every tiered file's rows behind the steps (one: the disk is one queue)."""
    global _writers
    with _readers_lock:
        if _writers is None:
            _writers = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hybridembed-write")
        return _writers


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_readers)


def _reads_uncached(fd: int) -> bool:
    """Whether ``fd``'s reads can leave the page cache as it was (``preadv2``'s RWF_DONTCACHE)."""
    try:
        os.preadv(fd, [bytearray(1)], 0, _DONTCACHE)
        return True
    except (OSError, AttributeError, TypeError):  # (an older kernel, another file system or OS)
        return False


def _pread_runs(
    io, fd: int, buf: np.ndarray, starts: np.ndarray, ends: np.ndarray, offsets: np.ndarray, uncached: int = 0
) -> int:
    """``io.pread_runs`` over all runs (ascending offsets): the first run that failed, or -1. Runs
    far apart (:data:`_SPARSE_GAP`) have their pages asked for first (:func:`_ask_pages`), then read
    by one loop as they arrive and, with ``uncached``, dropped from the page cache after
    (``POSIX_FADV_DONTNEED``); where they are not asked for (mostly cached already, or no
    ``posix_fadvise``), many are read in :data:`_READERS`
    slices at once (the loop releases the GIL; ``uncached``: preadv2's flag, leaving no page in the
    page cache). Runs closer together are read by one loop, the kernel's read-ahead streaming the file."""
    n = starts.size
    sparse = n > 0 and int(offsets[-1] - offsets[0]) >= _SPARSE_GAP * n
    if sparse and _ask_pages(io, fd, starts, ends, offsets, writes=False):
        first = io.pread_runs(fd, buf, starts, ends, offsets)
        if uncached:
            io.advise_runs(fd, starts, ends, offsets, os.POSIX_FADV_DONTNEED, _PAGE)
        return first
    if n < _PARALLEL_RUNS or not sparse:
        return io.pread_runs(fd, buf, starts, ends, offsets)
    global _readers
    with _readers_lock:
        if _readers is None:
            _readers = ThreadPoolExecutor(max_workers=_READERS - 1, thread_name_prefix="hybridembed-read")
        pool = _readers
    cuts = np.linspace(0, n, _READERS + 1).astype(np.int64)
    part = [(int(a), int(b)) for a, b in zip(cuts[:-1], cuts[1:])]
    futures = [pool.submit(io.pread_runs, fd, buf, starts[a:b], ends[a:b], offsets[a:b], uncached) for a, b in part[1:]]
    a, b = part[0]
    failed = [a + r if (r := io.pread_runs(fd, buf, starts[a:b], ends[a:b], offsets[a:b], uncached)) >= 0 else n]
    failed += [a + r if (r := f.result()) >= 0 else n for (a, _), f in zip(part[1:], futures)]
    first = min(failed)
    return -1 if first == n else first


def _pwrite_runs(io, fd: int, buf: np.ndarray, starts: np.ndarray, ends: np.ndarray, offsets: np.ndarray) -> int:
    """``io.pwrite_runs``, the pages of runs far apart asked for first (:func:`_ask_pages`)."""
    _ask_pages(io, fd, starts, ends, offsets, writes=True)
    return io.pwrite_runs(fd, buf, starts, ends, offsets)


def _ask_pages(io, fd: int, starts: np.ndarray, ends: np.ndarray, offsets: np.ndarray, writes: bool) -> bool:
    """Ask the kernel for the pages of :data:`_ASK_RUNS` or more runs a page or more apart (on
    average), :data:`_ASK_BYTES` at most, at once (``POSIX_FADV_WILLNEED``), before the calls that
    read them (``writes``: that write them, where a run is shorter than a page on average: a page
    written only in part is read first; whole pages are not). Whether it asked."""
    n = starts.size
    if not _CAN_ASK or n < _ASK_RUNS or int(offsets[-1] - offsets[0]) < _PAGE * n:
        return False
    size = int(ends[-1] - starts[0])
    if size > _ASK_BYTES or (writes and size >= _PAGE * n) or _cached(fd, offsets):
        return False
    return io.advise_runs(fd, starts, ends, offsets, os.POSIX_FADV_WILLNEED, _PAGE) < n


def _cached(fd: int, offsets: np.ndarray) -> bool:
    """Whether most of :data:`_PROBES` runs spread over ``offsets`` have their first page in the page
    cache (a read with ``RWF_NOWAIT`` of a byte each: refused where it would wait for the disk, whose
    read of that page it starts). A file the page cache holds is not asked for (a call a run: 4.5 ms
    for 8,000 runs, measured here) nor dropped after. (Python's calls: on the writer thread, a write
    far apart holds the GIL for these eight.)"""
    if _NOWAIT == 0:
        return False
    one, hits = bytearray(1), 0
    for at in offsets[np.linspace(0, offsets.size - 1, _PROBES).astype(np.int64)].tolist():
        try:
            hits += os.preadv(fd, [one], at, _NOWAIT) == 1
        except OSError:  # (BlockingIOError: not cached; another: a file system without it)
            pass
    return 2 * hits > _PROBES


@functools.cache
def _io():
    """The Numba loops of :mod:`hybridembed.kernels._numba_io`, or None (no Numba: Python's loop)."""
    from ..kernels import cpu_fused

    if not cpu_fused.available():
        return None
    from ..kernels import _numba_io

    return _numba_io
