"""Which kernels run a storage's lookup and update: a small registry chosen by name and device.

- ``"eager"``: PyTorch ops (:mod:`hybridembed.kernels.lookup`). Every device; the tested
  reference of every other backend.
- ``"triton"``: Triton kernels (:mod:`hybridembed.kernels.triton_lookup`,
  :mod:`hybridembed.kernels.triton_hash`) for tensors on CUDA, and on the CPU when Triton's
  interpreter is on (``TRITON_INTERPRET=1``, slow: for tests). Elsewhere the eager ops run,
  so a model built with ``kernels="triton"`` can still be moved to the CPU.
- ``"auto"`` (the default): the backend named by ``HYBRIDEMBED_KERNELS`` when it is set, else
  ``"eager"``. The Triton kernels become the CUDA default once they are measured faster on a
  GPU (docs/benchmarks.md).

Triton is an optional extra (``pip install "hybridembed[gpu]"``), imported only when asked for.

    >>> from hybridembed.kernels.backend import check_kernels
    >>> check_kernels("eager")
    'eager'
"""

from __future__ import annotations

import functools
import os

import torch

from .. import _env
from ..errors import ConfigError

__all__ = ["KERNELS", "check_kernels", "triton_available", "uses_triton"]

KERNELS = ("auto", "eager", "triton")


@functools.cache
def triton_available() -> bool:
    """Triton can be imported (the ``gpu`` extra is installed)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # (ImportError, or a broken install that fails on import)
        return False
    return True


def interpreting() -> bool:
    """Triton's interpreter is on: its kernels run on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "") == "1"


def check_kernels(kernels: str) -> str:
    """Checks a ``kernels=`` argument; returns it, or the environment's choice for ``"auto"``."""
    if kernels not in KERNELS:
        raise ConfigError(f"kernels must be one of {', '.join(map(repr, KERNELS))}, got {kernels!r}")
    if kernels == "auto":
        env = _env.text("KERNELS").strip().lower()
        if env not in ("", *KERNELS):
            raise ConfigError(f"HYBRIDEMBED_KERNELS={env!r}: must be one of {', '.join(map(repr, KERNELS))} (or unset)")
        kernels = env if env not in ("", "auto") else "eager"
    if kernels == "triton" and not triton_available():
        raise ConfigError(
            'kernels="triton" needs Triton: pip install "hybridembed[gpu]" (or pip install triton), '
            'or use kernels="eager"'
        )
    return kernels


def uses_triton(kernels: str, t: torch.Tensor) -> bool:
    """Whether a storage whose backend is ``kernels`` runs Triton kernels on tensors like ``t``."""
    return kernels == "triton" and (t.device.type == "cuda" or (t.device.type == "cpu" and interpreting()))
