"""Numba loops over a tiered table's file: one ``pread`` / ``pwrite`` per run of consecutive rows
(imported only when Numba is; :class:`hybridembed.storage.tiered_file._File` falls back to a Python
loop of ``os.preadv`` / ``os.pwritev`` otherwise, and for the error of a failed call).

A dynamic tiered table reads back thousands of scattered rows a step, one call each: measured
here, 5,000 reads of 256 bytes from the page cache took 5.8 ms through ``os.preadv`` in a Python
loop and 2.9-3.2 ms in this loop (the system call alone, without Python's call, its
``memoryview`` and its tuple). The loops release the GIL, so a prefetch thread reads while the
step runs. libc's ``pread`` and ``pwrite`` are declared to LLVM by name, which keeps the kernels
in Numba's disk cache (a ``ctypes`` function pointer would not be).

``starts``, ``ends``: each run's bytes in ``buf`` (a flat uint8 array); ``offsets``: its byte
offset in the file. Each returns the first run that failed or was short (-1: none).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

__all__ = ["advise_runs", "pread_runs", "pwrite_runs"]


def _libc(name: str):
    @intrinsic
    def call(typingctx, fd, address, size, offset):
        sig = types.int64(types.int32, types.intp, types.int64, types.int64)

        def codegen(context, builder, signature, args):
            i64, ptr = ir.IntType(64), ir.IntType(8).as_pointer()
            fn = builder.module.globals.get(name)
            if fn is None:
                fn = ir.Function(builder.module, ir.FunctionType(i64, [ir.IntType(32), ptr, i64, i64]), name)
            return builder.call(fn, [args[0], builder.inttoptr(args[1], ptr), args[2], args[3]])

        return sig, codegen

    return call


_pread, _pwrite = _libc("pread"), _libc("pwrite")


@intrinsic
def _preadv2(typingctx, fd, iov, offset, flags):
    """libc's ``preadv2(fd, iov, 1, offset, flags)``: one iovec (``iov``: the address of its base and
    length, two int64s)."""
    sig = types.int64(types.int32, types.intp, types.int64, types.int32)

    def codegen(context, builder, signature, args):
        i32, i64, ptr = ir.IntType(32), ir.IntType(64), ir.IntType(8).as_pointer()
        fn = builder.module.globals.get("preadv2")
        if fn is None:
            fn = ir.Function(builder.module, ir.FunctionType(i64, [i32, ptr, i32, i64, i32]), "preadv2")
        one = ir.Constant(i32, 1)
        return builder.call(fn, [args[0], builder.inttoptr(args[1], ptr), one, args[2], args[3]])

    return sig, codegen


@intrinsic
def _fadvise(typingctx, fd, offset, size, advice):
    """libc's ``posix_fadvise(fd, offset, size, advice)``: 0, or the error's number."""
    sig = types.int32(types.int32, types.int64, types.int64, types.int32)

    def codegen(context, builder, signature, args):
        i32, i64 = ir.IntType(32), ir.IntType(64)
        fn = builder.module.globals.get("posix_fadvise")
        if fn is None:
            fn = ir.Function(builder.module, ir.FunctionType(i32, [i32, i64, i64, i32]), "posix_fadvise")
        return builder.call(fn, list(args))

    return sig, codegen


@njit(nogil=True, cache=True)
def advise_runs(
    fd: int, starts: np.ndarray, ends: np.ndarray, offsets: np.ndarray, advice: int, page: int = 4096
) -> int:
    """``posix_fadvise(advice)`` over each run's pages in the file, the run rounded out to whole
    pages of ``page`` bytes (``POSIX_FADV_WILLNEED``: the kernel starts reading them all at once,
    the disk's queue full, and returns; ``POSIX_FADV_DONTNEED``: those clean leave the page cache,
    and it drops only pages wholly inside the range it is given): the runs it refused."""
    f, a = np.int32(fd), np.int32(advice)
    refused = 0
    for i in range(starts.size):
        lo = offsets[i] - offsets[i] % page
        hi = offsets[i] + ends[i] - starts[i] + page - 1
        if _fadvise(f, lo, hi - hi % page - lo, a) != 0:
            refused += 1
    return refused


@njit(nogil=True, cache=True)
def pread_runs(
    fd: int, buf: np.ndarray, starts: np.ndarray, ends: np.ndarray, offsets: np.ndarray, flags: int = 0
) -> int:
    """``flags``: ``preadv2``'s (``RWF_DONTCACHE``: the pages read are not kept in the page cache);
    0: ``pread``."""
    base, f, fl = buf.ctypes.data, np.int32(fd), np.int32(flags)
    iov = np.empty(2, dtype=np.int64)
    for i in range(starts.size):
        want = ends[i] - starts[i]
        if fl == 0:
            got = _pread(f, base + starts[i], want, offsets[i])
        else:
            iov[0], iov[1] = base + starts[i], want
            got = _preadv2(f, iov.ctypes.data, offsets[i], fl)
        if got != want:
            return i
    return -1


@njit(nogil=True, cache=True)
def pwrite_runs(fd: int, buf: np.ndarray, starts: np.ndarray, ends: np.ndarray, offsets: np.ndarray) -> int:
    base, f = buf.ctypes.data, np.int32(fd)
    for i in range(starts.size):
        at, end, off = starts[i], ends[i], offsets[i]
        while at < end:  # (a write may move fewer bytes than asked)
            n = _pwrite(f, base + at, end - at, off)
            if n <= 0:
                return i
            at += n
            off += n
    return -1
