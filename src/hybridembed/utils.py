"""Process-level helpers: CPU allocator tuning and rank-aware logging."""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import functools
import logging
import math
import os
import sys
import warnings
from collections.abc import Callable, Hashable
from typing import Any

import torch

from . import _env
from .errors import ConfigError

__all__ = [
    "tune_cpu_allocator",
    "allocator_tuned",
    "advise_huge_pages",
    "release_free_memory",
    "discard_pages",
    "get_logger",
    "OneLineParser",
    "check_device",
]

_MADV_DONTNEED = 4
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_tuned = False  # whether tune_cpu_allocator() has succeeded in this process (glibc has no getter)


def discard_pages(t: torch.Tensor) -> None:
    """Hands back to the system the whole pages inside CPU tensor ``t``'s memory
    (``madvise(MADV_DONTNEED)``): they read as zeros afterwards. Only for memory that will never
    be read again. A no-op off Linux and on other devices."""
    if not sys.platform.startswith("linux") or t.device.type != "cpu" or not t.is_contiguous():
        return
    page = 4096
    start = (t.data_ptr() + page - 1) // page * page
    end = (t.data_ptr() + t.numel() * t.element_size()) // page * page
    if end <= start:
        return
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.madvise(start, end - start, _MADV_DONTNEED)
    except (OSError, AttributeError):
        pass


def release_free_memory() -> None:
    """Hands the memory freed so far back to the system (glibc's ``malloc_trim``; a no-op where it
    is not there): with the tuned allocator, freed blocks below 2 GiB otherwise stay resident."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # (musl has no malloc_trim)
        pass


def tune_cpu_allocator(mmap_threshold: int = 1 << 30, trim_threshold: int = (1 << 31) - 1) -> bool:
    """Make glibc's malloc keep and reuse large blocks instead of mapping fresh pages per step.

    Grouped lookups make a few large tensors per step (26 features x 8,192 x 64 floats is
    54 MB). glibc serves blocks above its mmap threshold (at most 32 MB by default) with a
    fresh ``mmap``, so every step pays a page fault per 4 KiB on first touch: measured here,
    ``torch.zeros`` of 54 MB took 97 ms cold and a few ms reused. This raises the
    thresholds, the same effect PyTorch's CPU tuning guide gets from jemalloc or tcmalloc.

    Process-wide, and done by default: ``import hybridembed`` calls it (with these defaults)
    unless ``HYBRIDEMBED_TUNE_ALLOCATOR=0`` is set. Measured on the embedding step of 26 x
    200,000 x 64, batch 8,192, it is what makes the grouped step faster than per-table PyTorch
    without any setting (docs/benchmarks.md). The cost: freed memory below the trim threshold
    stays with the process for reuse instead of going back to the system. glibc offers no
    way back to its adaptive defaults once thresholds are set, so opting out must happen
    before the import. Returns False where glibc's ``mallopt`` is not there to call (other
    platforms, musl). (With jemalloc or tcmalloc preloaded it is harmless: they ignore it.)
    """
    global _tuned
    for arg, v in (("mmap_threshold", mmap_threshold), ("trim_threshold", trim_threshold)):
        if isinstance(v, bool) or not isinstance(v, int) or not 0 < v < 2**31:
            raise ConfigError(f"tune_cpu_allocator: {arg} must be an int in (0, 2**31), got {v!r}")
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]  # (a C int: 2**31 would wrap negative)
        ok = libc.mallopt(_M_MMAP_THRESHOLD, int(mmap_threshold)) == 1
        ok = libc.mallopt(_M_TRIM_THRESHOLD, int(trim_threshold)) == 1 and ok
    except (OSError, AttributeError):
        return False
    _tuned = _tuned or ok
    return ok


def is_number(v: Any) -> bool:
    """A finite int or float (not a bool): a hyper-parameter or setting's plain number."""
    return not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)


def allocator_tuned() -> bool:
    """Whether :func:`tune_cpu_allocator` has succeeded in this process (at import or later)."""
    return _tuned


@functools.cache
def _openmp_pause() -> Callable[[int], int] | None:
    """libgomp's ``omp_pause_resource_all`` where PyTorch loaded libgomp (its Linux wheels); else None."""
    if not sys.platform.startswith("linux") or not _env.flag("RELEASE_OPENMP", True):
        return None
    try:
        fn = ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD | os.RTLD_LAZY).omp_pause_resource_all
    except (OSError, AttributeError):  # (not loaded: another OpenMP, or none; or one before OpenMP 5.0)
        return None
    fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
    return fn


def release_openmp_workers() -> bool:
    """Let PyTorch's idle OpenMP workers of the calling thread go now, before threads of ours run
    on the cores they hold; the next parallel torch op starts them again (measured: a 4M-element
    op 1.5 ms after a release against 0.5 ms; the whole sequence of a step, a torch op, a
    two-thread row update and small ops after it, is still faster with the release from 8,192
    rows updated: 3.33 against 4.49 ms; ``benchmarks/bench_openmp.py``).

    After each parallel op, libgomp (the OpenMP of PyTorch's Linux wheels) keeps its idle workers
    spinning for ~300,000 pauses (8-10 ms measured here) unless it counts more threads than CPUs.
    Threads of ours that run meanwhile share a core with a spinner: a two-thread Numba pass right
    after a torch op took 9.8 ms against 5.0 ms after a release (2 cores; docs/benchmarks.md
    "OpenMP's spinning workers"). This is OpenMP 5.0's ``omp_pause_resource_all(omp_pause_soft)``
    (0.05 ms): the calling thread's pool of workers ends; other threads' pools, and the ops that
    run later, are untouched. Call it outside any parallel region (from Python, between ops).
    Returns whether it released them: False where PyTorch's OpenMP is not libgomp, off Linux, or
    with ``HYBRIDEMBED_RELEASE_OPENMP=0``."""
    fn = _openmp_pause()
    return fn is not None and fn(1) == 0  # (1: omp_pause_soft)


_MADV_HUGEPAGE = 14
_HUGE = 2 << 20


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Ask Linux to back a large CPU tensor with 2 MiB pages (``madvise(MADV_HUGEPAGE)``).

    Embedding rows are read and written at random; with 4 KiB pages nearly every row access
    is a TLB miss. Call it on a freshly allocated tensor, before it is first written, so the
    pages are faulted in huge. A no-op (returns False) off Linux, on GPU tensors, for tensors
    under 4 MiB, or where transparent huge pages are disabled. Turn it off with
    ``HYBRIDEMBED_HUGE_PAGES=0``.
    """
    nbytes = t.numel() * t.element_size()
    if not sys.platform.startswith("linux") or t.device.type != "cpu" or nbytes < 2 * _HUGE:
        return False
    if not _env.flag("HUGE_PAGES", True):
        return False
    start = (t.data_ptr() + _HUGE - 1) // _HUGE * _HUGE
    end = (t.data_ptr() + nbytes) // _HUGE * _HUGE
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return libc.madvise(start, end - start, _MADV_HUGEPAGE) == 0
    except (OSError, AttributeError):
        return False


class _RankLabel(logging.Filter):
    """Adds ``record.rank_label``: ``"[rank N] "`` in a ``torch.distributed`` job of several
    processes, empty in one process; with ``quiet_others``, drops records below WARNING on
    every rank but 0 (one INFO line per job, not one per rank)."""

    def __init__(self, quiet_others: bool):
        super().__init__()
        self.quiet_others = quiet_others

    def filter(self, record: logging.LogRecord) -> bool:
        rank, world = _rank_and_world()
        record.rank_label = f"[rank {rank}] " if world > 1 else ""
        return not (self.quiet_others and rank != 0 and record.levelno < logging.WARNING)


def _rank_and_world() -> tuple[int, int]:
    """This process's rank and the job's size: torch.distributed's once initialised, else
    torchrun's environment (RANK, WORLD_SIZE), else (0, 1). Never raises."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    except Exception:  # pragma: no cover - logging must never fail
        return 0, 1


_ROOT_LOGGER = logging.getLogger("hybridembed")
_ROOT_LOGGER.addHandler(logging.NullHandler())  # a library's logger: the application decides where records go


def get_logger(name: str = "hybridembed") -> logging.Logger:
    """A logger under ``hybridembed``. As the ``logging`` HOWTO asks of a library, hybridembed adds
    only a ``NullHandler`` and its records propagate: an application's ``logging.basicConfig(...)``
    (or any handler on the root logger) receives them. ``HYBRIDEMBED_LOG_LEVEL`` sets the
    ``hybridembed`` logger's level; :func:`configure_logging` prints to stderr (the CLI's)."""
    return logging.getLogger(name)


def _level_from_env() -> str | None:
    """``HYBRIDEMBED_LOG_LEVEL`` as a level name, None when unset or empty; another value warns once
    and counts as unset."""
    value = _env.text("LOG_LEVEL").strip()
    if not value:
        return None
    if value.upper() in _LEVELS:
        return value.upper()
    warnings.warn(
        f"HYBRIDEMBED_LOG_LEVEL={value!r} is not a log level; ignored. Allowed: {', '.join(_LEVELS)}", stacklevel=2
    )
    return None


_HANDLER_NAME = "hybridembed.stderr"


def logging_configured() -> bool:
    """Whether :func:`configure_logging` was called in this process."""
    return any(h.name == _HANDLER_NAME for h in _ROOT_LOGGER.handlers)


def configure_logging(level: int | str | None = None) -> logging.Handler:
    """Prints hybridembed's records to stderr, as its command line does: ``[rank N] LEVEL name:
    message`` in a job of several processes (no label in one process), INFO and above on rank 0
    and WARNING and above on the other ranks, unless ``level`` (or ``HYBRIDEMBED_LOG_LEVEL``)
    says otherwise. For scripts that want the library's lines without configuring ``logging``
    themselves; calling it again changes the level and adds no second handler. Records still
    propagate to the application's handlers. Returns the handler.

    >>> h = configure_logging("WARNING"); h.name
    'hybridembed.stderr'
    """
    if level is not None and not isinstance(level, int) and str(level).upper() not in _LEVELS:
        raise ConfigError(f"configure_logging: level must be one of {', '.join(_LEVELS)} or an int, got {level!r}")
    env = _level_from_env()
    chosen = level if level is not None else env
    handler = next((h for h in _ROOT_LOGGER.handlers if h.name == _HANDLER_NAME), None)
    if handler is None:
        handler = logging.StreamHandler()
        handler.name = _HANDLER_NAME
        handler.setFormatter(logging.Formatter("%(rank_label)s%(levelname)s %(name)s: %(message)s"))
        _ROOT_LOGGER.addHandler(handler)
    for f in list(handler.filters):
        handler.removeFilter(f)
    handler.addFilter(_RankLabel(quiet_others=chosen is None))
    _ROOT_LOGGER.setLevel(chosen.upper() if isinstance(chosen, str) else chosen if chosen is not None else "INFO")
    return handler


_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")  # HYBRIDEMBED_LOG_LEVEL, any case
if (_LEVEL := _level_from_env()) is not None:  # (unset: the level follows the application's loggers)
    _ROOT_LOGGER.setLevel(_LEVEL)


DEVICE_FORMS = "'cpu', 'cuda', 'cuda:N' (N < the GPU count), 'meta' (no rows allocated) or a torch.device"


def check_device(device: torch.device | str | None, owner: str) -> torch.device | None:
    """``device`` as a ``torch.device`` (None stays None), or a :class:`ConfigError` saying why
    rows cannot live there: not a device name, CUDA not available in this torch build or on this
    machine, a GPU index past the last, an accelerator this machine lacks. ``owner`` begins the
    message (``"EmbeddingCollection"``).

    >>> check_device("cpu", "EmbeddingCollection")
    device(type='cpu')
    """
    if device is None:
        return None
    if not isinstance(device, (str, torch.device)):
        raise ConfigError(f"{owner}: device must be a str or torch.device ({DEVICE_FORMS}), got {device!r}")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError) as e:
        raise ConfigError(f"{owner}: device {device!r} is not a device name; use {DEVICE_FORMS}") from e
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = "torch is built without CUDA" if torch.version.cuda is None else "no CUDA device is visible"
            raise ConfigError(
                f"{owner}: device {str(device)!r}: CUDA is not available in this torch build/machine ({why}; "
                f"torch {torch.__version__}); use device='cpu', or a machine with a GPU and a CUDA build of torch"
            )
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise ConfigError(
                f"{owner}: device {str(device)!r}: this machine has {count} CUDA device{'s' if count != 1 else ''} "
                f"(cuda:0{f'..cuda:{count - 1}' if count > 1 else ''}); give one of those"
            )
        if dev.index is None:  # 'cuda' is the current GPU: named by index, as its tensors' .device is
            dev = torch.device("cuda", torch.cuda.current_device())
    elif dev.type not in ("cpu", "meta"):
        acc = getattr(torch, "accelerator", None)  # (torch >= 2.6)
        here = acc.current_accelerator() if acc is not None and acc.is_available() else None
        if here is None or here.type != dev.type:
            also = f" or {here.type!r} (this machine's accelerator)" if here is not None else ""
            raise ConfigError(f"{owner}: device {str(device)!r} is not available here; use {DEVICE_FORMS}{also}")
    return dev


def device_tensor(values: Any, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype, device=device)`` without waiting for the device: built
    on the host and copied asynchronously (a blocking host-to-device copy waits for every kernel
    queued before it; CUDA stages a pageable source at once, so the copy is safe)."""
    t = torch.tensor(values, dtype=dtype)
    return t if torch.device(device).type == "cpu" else t.to(device, non_blocking=True)


def kept_tensor(
    owner: Any, name: str, n: Hashable, device: torch.device, make: Callable[[], torch.Tensor], most: int = 16
) -> torch.Tensor:
    """``make()`` for size (or key) ``n`` on ``device``, kept in ``owner.__dict__[name]`` for later calls
    of the same one (at most ``most`` kept): read-only tensors a hot path would otherwise rebuild every call."""
    cache = owner.__dict__.setdefault(name, {})
    cached = cache.get(n)
    if cached is None or cached.device != device:
        if len(cache) >= most:
            cache.clear()
        cached = cache[n] = make()
    return cached


class OneLineParser(argparse.ArgumentParser):
    """The commands' argument parser: a bad argument is one line on stderr (exit 2), not the usage block."""

    def error(self, message: str) -> None:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")
