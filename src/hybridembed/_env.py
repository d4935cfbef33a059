"""Every environment variable hybridembed reads, in one place.

``HYBRIDEMBED_TUNE_ALLOCATOR=0``
    do not tune glibc's allocator when hybridembed is imported. By default the import calls
    :func:`hybridembed.tune_cpu_allocator` (Linux with glibc; process-wide), so that large
    per-step tensors reuse memory instead of faulting in fresh pages; set this before the
    import to keep glibc's own thresholds.
``HYBRIDEMBED_HUGE_PAGES=0``
    do not ask for 2 MiB pages for embedding rows and optimizer state (on by default where
    the kernel allows it; see :func:`hybridembed.utils.advise_huge_pages`).
``HYBRIDEMBED_RELEASE_OPENMP=0``
    the fused CPU step does not end PyTorch's idle OpenMP workers before its own threads run
    (by default it does, where torch's OpenMP is libgomp; see
    :func:`hybridembed.utils.release_openmp_workers`).
``HYBRIDEMBED_LOG_LEVEL``
    level of the ``hybridembed`` logger: ``DEBUG``, ``INFO``, ``WARNING``, ``ERROR`` or
    ``CRITICAL``, any case; unset or empty, the logger follows the application's logging (and
    :func:`hybridembed.configure_logging` uses INFO); another value warns and is ignored.
``HYBRIDEMBED_CLIP_GRAD_NORM=0``
    do not make ``torch.nn.utils.clip_grad_norm_`` route calls that hold a table (or a sparse
    gradient) to :func:`hybridembed.clip_grad_norm_` (on by default, from the import).
``HYBRIDEMBED_SHM=0``
    the sharded runtime's rows exchange between ranks of one machine stays on gloo's all-to-all
    (by default, large ones go through shared memory in ``/dev/shm``; see
    :mod:`hybridembed.distributed.shm`). Read when a collection's first exchange runs.
``HYBRIDEMBED_SHM_FUTEX=0``
    the shared-memory exchange's meetings go through a gloo all-gather, and the headers, ids and
    small exchanges through gloo's all-to-all (by default, where every rank can, the ranks meet
    through their control files, asleep on a futex, and every all-to-all of the group goes through
    shared memory). Read with ``HYBRIDEMBED_SHM``.
``HYBRIDEMBED_KERNELS``
    the kernel backend of collections built with ``kernels="auto"`` (the default): ``eager``
    (PyTorch ops), ``triton`` (Triton kernels on CUDA, and on the CPU under
    ``TRITON_INTERPRET=1``) or ``auto`` (also when unset: Triton on CUDA when it is installed,
    eager elsewhere); see :mod:`hybridembed.kernels.backend`.
"""

from __future__ import annotations

import os

PREFIX = "HYBRIDEMBED_"


def flag(name: str, default: bool = False) -> bool:
    value = os.environ.get(PREFIX + name)
    if value is None or value == "":
        return default
    return value.strip().lower() in ("1", "true", "yes", "on")


def text(name: str, default: str = "") -> str:
    return os.environ.get(PREFIX + name, default)
