"""Every environment variable hybridembed reads, in one place.

``HYBRIDEMBED_TUNE_ALLOCATOR=1``
    call :func:`hybridembed.tune_cpu_allocator` when hybridembed is imported.
``HYBRIDEMBED_HUGE_PAGES=0``
    do not ask for 2 MiB pages for embedding rows and optimizer state (on by default where
    the kernel allows it; see :func:`hybridembed.utils.advise_huge_pages`).
``HYBRIDEMBED_LOG_LEVEL``
    level of the ``hybridembed`` logger: ``DEBUG``, ``INFO`` (the default, also when empty),
    ``WARNING``, ``ERROR`` or ``CRITICAL``, any case; another value logs a warning and uses ``INFO``.
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
