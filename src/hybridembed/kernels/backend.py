"""Which kernels run a storage's lookup and update: a small registry chosen by name and device.

- ``"eager"``: PyTorch ops (:mod:`hybridembed.kernels.lookup`). Every device; the tested
  reference of every other backend.
- ``"triton"``: Triton kernels (:mod:`hybridembed.kernels.triton_lookup`,
  :mod:`hybridembed.kernels.triton_hash`) for tensors on CUDA, and on the CPU when Triton's
  interpreter is on (``TRITON_INTERPRET=1``, slow: for tests). Elsewhere the eager ops run,
  so a model built with ``kernels="triton"`` can still be moved to the CPU.
- ``"auto"`` (the default): the backend named by ``HYBRIDEMBED_KERNELS`` when it is set, else
  Triton's kernels for tensors on CUDA when Triton is installed (measured faster than the eager
  ops in every workload on an NVIDIA H200: docs/benchmarks.md) and the eager ops elsewhere (also
  on the CPU under Triton's interpreter: ``"triton"`` asks for that).

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

__all__ = ["KERNELS", "check_kernels", "describe", "triton_available", "uses_triton"]

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
    """Checks a ``kernels=`` argument; returns it, or the environment's choice for ``"auto"`` (which
    stays ``"auto"`` when the environment names none: Triton on CUDA when installed, else eager)."""
    if kernels not in KERNELS:
        raise ConfigError(f"kernels must be one of {', '.join(map(repr, KERNELS))}, got {kernels!r}")
    if kernels == "auto":
        env = _env.text("KERNELS").strip().lower()
        if env not in ("", *KERNELS):
            raise ConfigError(f"HYBRIDEMBED_KERNELS={env!r}: must be one of {', '.join(map(repr, KERNELS))} (or unset)")
        kernels = env if env not in ("", "auto") else "auto"
    if kernels == "triton" and not triton_available():
        raise ConfigError(
            'kernels="triton" needs Triton: pip install "hybridembed[gpu]" (or pip install triton), '
            'or use kernels="eager"'
        )
    return kernels


def uses_triton(kernels: str, t: torch.Tensor) -> bool:
    """Whether a storage whose backend is ``kernels`` runs Triton kernels on tensors like ``t``."""
    return _on(kernels, t.device.type)


def describe(kernels: str, device: torch.device | str) -> str:
    """The kernels that run on ``device`` for a storage whose backend is ``kernels`` (a run's report)."""
    return "triton" if _on(kernels, torch.device(device).type) else "eager"


def _on(kernels: str, device_type: str) -> bool:
    if kernels == "auto":
        return device_type == "cuda" and triton_available()
    return kernels == "triton" and (device_type == "cuda" or (device_type == "cpu" and interpreting()))
