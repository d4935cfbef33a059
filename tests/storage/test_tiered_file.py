"""A tiered table's file (``storage.tiered._File``): scattered rows and runs read and written, runs
longer than one call cut, reads of runs far apart sliced over threads (in a forked child too), a
truncated file a clear error."""

from __future__ import annotations

import os
import subprocess
import sys
import types

import numpy as np
import pytest
import torch

import hybridembed as he

from .writes import HeldWriter


@pytest.mark.parametrize("numba", [True, False, "parallel"], ids=["numba", "python", "parallel"])
def test_a_file_reads_and_writes_scattered_rows_and_runs_and_a_truncated_file_is_a_clear_error(
    tmp_path, monkeypatch, numba
):
    """``_File``: one call a run of consecutive rows, in Numba's loop or (without Numba) Python's;
    a run longer than one call's bytes is cut; a short read raises, naming the file. ``parallel``:
    every read of 2+ runs cut into slices read by several threads (as runs far apart are)."""
    from hybridembed.storage import tiered_file as T

    if numba and T._io() is None:
        pytest.skip("Numba does not import here")
    if not numba:
        monkeypatch.setattr(T, "_io", lambda: None)
    if numba == "parallel":
        monkeypatch.setattr(T, "_PARALLEL_RUNS", 2)
        monkeypatch.setattr(T, "_SPARSE_GAP", 0)
        monkeypatch.setattr(T, "_READERS", 3)
        monkeypatch.setattr(T, "_readers", None)
        calls = []
        real = T._io().pread_runs
        monkeypatch.setattr(T._io(), "pread_runs", lambda *a: calls.append(a[2].size) or real(*a))
    monkeypatch.setattr(T, "_CALL_BYTES", 3 * 5 * 4)  # (three rows of 5 float32 per call)
    f = T._File(tmp_path / "f.rows", 64, 5, torch.float32)
    g = torch.Generator().manual_seed(0)
    want = torch.zeros(64, 5)
    for rows in (torch.tensor([9, 3, 4, 5, 6, 7, 8, 40, 63]), torch.randperm(64, generator=g)[:20], torch.arange(2)):
        data = torch.randn(rows.numel(), 5, generator=g)
        f.write(rows, data)
        want[rows] = data
        assert torch.equal(f.read(rows), data)
    assert torch.equal(f.read(torch.arange(64).flip(0)), want.flip(0))
    assert f.read(torch.zeros(0, dtype=torch.int64)).shape == (0, 5)
    if numba == "parallel":
        assert len(calls) > 3 and max(calls) < 20, calls  # (sliced: no call read every run)
    os.truncate(f.path, 40 * 5 * 4)
    for call in (lambda: f.read(torch.tensor([2])), lambda: f.write(torch.tensor([2]), torch.ones(1, 5))):
        with pytest.raises(he.HybridEmbedError, match=r"f\.rows: shorter than its rows \(the file was truncated\?\)"):
            call()  # (checked first: a write must not grow it again, nor a read give zeros)
    assert os.path.getsize(f.path) == 40 * 5 * 4
    f.size = 40 * 5 * 4  # (cut between the check and the read: the read itself comes short)
    with pytest.raises(he.HybridEmbedError, match=r"f\.rows: a short read \(the file was truncated\?\)"):
        f.read(torch.tensor([2, 39, 41]))
    with pytest.raises(he.HybridEmbedError, match="a short read"):  # (the failing run in a later slice)
        f.read(torch.tensor([2, 9, 12, 20, 25, 30, 33, 41, 50]))


_FORKED_READ = r"""
import os, signal, sys, torch
from pathlib import Path
from hybridembed.storage import tiered_file as T
T._PARALLEL_RUNS, T._SPARSE_GAP = 2, 0
f = T._File(Path(sys.argv[1]), 64, 5, torch.float32)
f.write(torch.arange(64), torch.arange(320.0).view(64, 5))
assert torch.equal(f.read(torch.arange(0, 64, 2)), torch.arange(320.0).view(64, 5)[::2])  # (the pool made)
pid = os.fork()
if pid == 0:
    signal.alarm(30)  # (a hung child ends itself)
    ok = torch.equal(f.read(torch.arange(1, 64, 2)), torch.arange(320.0).view(64, 5)[1::2])
    os._exit(0 if ok else 3)
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_reads_on_threads_of_its_own(tmp_path):
    """Sliced reads in a process forked after the readers' pool was made: the child makes its own
    (the parent's has no threads there, and a read sent to it would wait forever)."""
    from hybridembed.storage import tiered_file as T

    if T._io() is None:
        pytest.skip("Numba does not import here")
    r = subprocess.run(
        [sys.executable, "-c", _FORKED_READ, str(tmp_path / "f")], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr[-2000:]


def _resident_pages(path) -> int:
    """Pages of the file at ``path`` in the page cache now (``mincore`` over a mapping of it)."""
    import ctypes
    import mmap

    with open(path, "r+b") as fh:
        size = os.fstat(fh.fileno()).st_size
        m = mmap.mmap(fh.fileno(), size)
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            vec = (ctypes.c_ubyte * -(-size // mmap.PAGESIZE))()
            address = ctypes.addressof(ctypes.c_char.from_buffer(m))
            assert libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(size), vec) == 0, ctypes.get_errno()
            del address
            return sum(v & 1 for v in vec)
        finally:
            m.close()


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="needs posix_fadvise")
def test_reads_of_rows_far_apart_leave_no_page_in_the_page_cache_and_read_right(tmp_path, monkeypatch):
    """Rows far apart (a table larger than memory) are read with preadv2's RWF_DONTCACHE where the
    kernel takes it: the right rows, and none of their pages kept (they would evict the pages a
    capped process needs, its records index); where it is refused, the usual reads."""
    from hybridembed.storage import tiered_file as T

    if T._io() is None:
        pytest.skip("Numba does not import here")
    monkeypatch.setattr(T, "_READERS", 3)
    monkeypatch.setattr(T, "_readers", None)
    monkeypatch.setattr(T, "_PARALLEL_RUNS", 4)
    monkeypatch.setattr(T, "_SPARSE_GAP", 32 << 10)
    width = 1024  # float32: 4 KiB a row, a page each
    data = torch.randn(1024, width, generator=torch.Generator().manual_seed(0))
    rows = torch.arange(0, 1024, 16).flip(0)  # (64 runs 64 KiB apart: far apart, sliced)
    with monkeypatch.context() as m:
        m.setattr(T, "_DONTCACHE", 1 << 30)  # (a flag no kernel takes: refused, read as usual)
        g = T._File(tmp_path / "g.rows", 1024, width, torch.float32)
        g.write(torch.arange(1024), data)
        assert g.uncached == 0 and torch.equal(g.read(rows), data[rows])
    f = T._File(tmp_path / "f.rows", 1024, width, torch.float32)
    f.write(torch.arange(1024), data)
    os.fsync(f.fd)
    if not f.uncached:
        pytest.skip("this kernel or file system has no RWF_DONTCACHE (Linux 6.14+): every read is cached")
    for uncached in (f.uncached, 0):
        f.uncached = uncached
        os.posix_fadvise(f.fd, 0, 0, os.POSIX_FADV_DONTNEED)
        assert torch.equal(f.read(rows), data[rows])
        kept = _resident_pages(f.path)
        # (measured on Linux 6.18: 3 pages of the 64 kept uncached, one a reading thread; 67 as usual)
        assert (kept <= rows.numel() // 8) if uncached else (kept >= rows.numel()), (uncached, kept)
    assert torch.equal(f.read(torch.arange(40, 60)), data[40:60])  # (close together: one run, as usual)


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="needs posix_fadvise")
def test_many_rows_far_apart_have_their_pages_asked_for_at_once_before_they_are_read_or_written(tmp_path, monkeypatch):
    """A read of 16+ runs far apart asks the kernel for all their pages first (WILLNEED: one queue
    of reads, not one read at a time; then, where reads far apart leave no page cached, their
    pages dropped), and so does a write of runs a page or more apart, each shorter than a page (the
    kernel reads a page before writing part of it); not reads of rows closer together (the
    kernel's read-ahead streams the file), not few runs, not writes of whole pages, not more than
    ``_ASK_BYTES`` at once, not where the file's pages are in the page cache already (probed); a
    refused advice (a bad descriptor) reads as usual."""
    from hybridembed.storage import tiered_file as T

    io = T._io()
    if io is None:
        pytest.skip("Numba does not import here")
    asked = []

    def advise_runs(fd, starts, ends, offsets, advice, page):
        asked.append((advice, offsets.tolist(), (ends - starts).tolist()))
        return io.advise_runs(fd, starts, ends, offsets, advice, page)

    def cold(*files):  # (the files' pages out of the page cache)
        for x in files:
            os.fsync(x.fd)
            os.posix_fadvise(x.fd, 0, 0, os.POSIX_FADV_DONTNEED)
            if _resident_pages(x.path):
                pytest.skip("this file system keeps its files' pages (tmpfs?)")

    fake = types.SimpleNamespace(advise_runs=advise_runs, pread_runs=io.pread_runs, pwrite_runs=io.pwrite_runs)
    monkeypatch.setattr(T, "_io", lambda: fake)
    g = torch.Generator().manual_seed(0)
    f = T._File(tmp_path / "f.rows", 4096, 66, torch.float32)  # (264-byte rows, 15.5 a page)
    data = torch.randn(4096, 66, generator=g)
    f.write(torch.arange(4096), data)  # (one run: nothing asked)
    assert asked == []
    far = torch.randperm(256, generator=g)[:40] * 16  # (40 rows 4 KiB or more apart, out of order)
    if not T._cached(f.fd, np.sort(far.numpy()) * 264):
        pytest.skip("reads with RWF_NOWAIT do not find cached pages here: the probe sees none")
    new = torch.randn(40, 66, generator=g)
    f.write(far, new)  # (their pages cached: not asked for)
    assert asked == []
    cold(f)
    f.write(far, new)
    data[far] = new
    want = sorted(far.tolist())
    assert asked == [(os.POSIX_FADV_WILLNEED, [r * 264 for r in want], [264] * 40)]
    asked.clear()
    cold(f)
    assert torch.equal(f.read(far), data[far]) and asked == []  # (4 KiB apart: read ahead, not asked for)
    wide = T._File(tmp_path / "wide.rows", 256, 1024, torch.float32)  # (a row a page)
    cold(wide)
    wide.write(torch.arange(0, 256, 4), torch.ones(64, 1024))
    assert asked == []  # (whole pages written: none read first)
    monkeypatch.setattr(T, "_SPARSE_GAP", 4096)  # (now far apart for reads too)
    cold(f, wide)
    for rows in (far[:15], torch.arange(100, 140)):  # (15 runs; 40 rows in one run)
        assert torch.equal(f.read(rows), data[rows])
    assert asked == []
    assert torch.equal(wide.read(torch.arange(0, 256, 4)), torch.ones(64, 1024))
    assert [a for a, *_ in asked] == [os.POSIX_FADV_WILLNEED] + [os.POSIX_FADV_DONTNEED] * bool(wide.uncached)
    asked.clear()
    for uncached in (1, 0):
        f.uncached = uncached
        cold(f)
        assert torch.equal(f.read(far), data[far])
        assert [a for a, *_ in asked] == [os.POSIX_FADV_WILLNEED] + [os.POSIX_FADV_DONTNEED] * uncached
        asked.clear()
        kept = _resident_pages(f.path)  # (each 264-byte record's page or two: dropped whole, or all read)
        assert kept <= 4 if uncached else kept >= 40, (uncached, kept)
    assert torch.equal(f.read(far), data[far]) and asked == []  # (kept in the page cache: not asked again)
    bad = np.array([0, 264]), np.array([264, 528]), np.array([0, 8192])
    assert io.advise_runs(-1, *bad, os.POSIX_FADV_WILLNEED) == 2  # (a bad descriptor: both refused)
    assert io.advise_runs(f.fd, *bad, os.POSIX_FADV_WILLNEED) == 0
    monkeypatch.setattr(T, "_ASK_BYTES", 40 * 264 - 1)  # (more bytes than asked for at once: read as before)
    cold(f)
    assert torch.equal(f.read(far), data[far]) and asked == []
    monkeypatch.setattr(T, "_ASK_BYTES", 40 * 264)
    cold(f)
    assert torch.equal(f.read(far), data[far]) and asked
    asked.clear()
    monkeypatch.setattr(T, "_CAN_ASK", False)  # (no posix_fadvise: read as before)
    cold(f)
    assert torch.equal(f.read(far), data[far]) and asked == []


def _in_thread(fn):
    import threading

    out = {}
    t = threading.Thread(target=lambda: out.setdefault("value", fn()), daemon=True)
    t.start()
    return t, out


def test_a_write_behind_is_waited_for_by_reads_of_its_rows_and_by_a_write_and_no_one_else(tmp_path, monkeypatch):
    """``write_behind`` returns while its write is in flight: a read of other rows does not wait
    for it, a read of any of its rows does (and gets the rows written), and so does a plain write
    (which lands after it); ``_BEHIND = 0`` writes at once."""
    from hybridembed.storage import tiered_file as T

    if T._io() is None:
        pytest.skip("Numba does not import here")
    f = T._File(tmp_path / "f.rows", 64, 5, torch.float32)
    f.write(torch.arange(64), torch.zeros(64, 5))
    held = HeldWriter(monkeypatch, T)
    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(0))
    f.write_behind(torch.tensor([3, 4, 5]), x.clone())  # (returns: its write is held)
    assert len(f._behind) == 1
    assert torch.equal(f.read(torch.tensor([0, 2, 6, 63])), torch.zeros(4, 5))  # (none of its rows: no wait)
    assert not f._behind[0].done.done()  # (it did not wait: the write is still held)
    reader, got = _in_thread(lambda: f.read(torch.tensor([9, 5])))
    reader.join(0.3)
    assert reader.is_alive()  # (waits for the write in flight)
    held.release()
    reader.join(30)
    assert torch.equal(got["value"], torch.stack([torch.zeros(5), x[2]]))
    assert f._behind == []

    held = HeldWriter(monkeypatch, T)
    f.write_behind(torch.tensor([20, 21]), torch.ones(2, 5))
    writer, _ = _in_thread(lambda: f.write(torch.tensor([21]), torch.full((1, 5), 7.0)))
    writer.join(0.3)
    assert writer.is_alive()  # (a write waits for every write in flight: it lands after them)
    held.release()
    writer.join(30)
    assert torch.equal(f.read(torch.tensor([20, 21])), torch.tensor([[1.0] * 5, [7.0] * 5]))

    monkeypatch.setattr(T, "_BEHIND", 0)
    f.write_behind(torch.tensor([30]), torch.full((1, 5), 3.0))
    assert f._behind == [] and torch.equal(f.read(torch.tensor([30])), torch.full((1, 5), 3.0))


def test_a_failed_write_behind_keeps_its_rows_is_written_again_and_raises_while_it_fails(tmp_path, monkeypatch):
    """A write the writer thread could not make keeps its rows in memory: the next read of them (or
    the next ``make_room``, which a step calls before it changes anything) writes them again, and
    raises a clear error, naming the file, while that fails too; once it succeeds, nothing was lost."""
    import errno

    from hybridembed.storage import tiered_file as T

    if T._io() is None:
        pytest.skip("Numba does not import here")
    f = T._File(tmp_path / "f.rows", 64, 5, torch.float32)
    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(1))
    with monkeypatch.context() as m:
        HeldWriter(m, T, fail=True).release()
        f.write_behind(torch.tensor([7, 8, 9]), x.clone())
        real = os.pwritev

        def full(*a):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        m.setattr(os, "pwritev", full)
        for call in (lambda: f.read(torch.tensor([8])), f.make_room):
            with pytest.raises(
                he.HybridEmbedError, match=r"f\.rows: writing 3 rows failed \(No space left on device\); they are kept"
            ):
                call()
        assert len(f._behind) == 1
        m.setattr(os, "pwritev", real)
        assert torch.equal(f.read(torch.tensor([9, 7, 8])), x[[2, 0, 1]])  # (written again: nothing lost)
    assert f._behind == []
    with monkeypatch.context() as m:  # (a failed write that the next read writes again at once)
        HeldWriter(m, T, fail=True).release()
        f.write_behind(torch.tensor([40]), torch.full((1, 5), 2.0))
        assert torch.equal(f.read(torch.tensor([40])), torch.full((1, 5), 2.0))


_FORKED_BEHIND = r"""
import os, signal, sys, threading, types, torch
from pathlib import Path
from hybridembed.storage import tiered_file as T
io, gate = T._io(), threading.Event()
T._io = lambda: types.SimpleNamespace(advise_runs=io.advise_runs, pread_runs=io.pread_runs, pwrite_runs=lambda *a: gate.wait(30) and io.pwrite_runs(*a))
f = T._File(Path(sys.argv[1]), 64, 5, torch.float32)
f.write_behind(torch.tensor([1, 2]), torch.ones(2, 5))  # (held in the parent's writer thread)
pid = os.fork()
if pid == 0:
    signal.alarm(30)  # (a hung child ends itself)
    os._exit(0 if torch.equal(f.read(torch.tensor([2])), torch.ones(1, 5)) else 3)
_, status = os.waitpid(pid, 0)
gate.set()
assert torch.equal(f.read(torch.tensor([1, 2])), torch.ones(2, 5))
sys.exit(os.waitstatus_to_exitcode(status))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_writes_a_write_behind_it_inherited_itself(tmp_path):
    """A process forked while a write is in flight has no writer thread to wait for: its read of
    those rows writes them itself (it would wait forever otherwise)."""
    from hybridembed.storage import tiered_file as T

    if T._io() is None:
        pytest.skip("Numba does not import here")
    r = subprocess.run(
        [sys.executable, "-c", _FORKED_BEHIND, str(tmp_path / "f")], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr[-2000:]
