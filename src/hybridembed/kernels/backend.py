"""Which kernels run a storage's lookup and update: a small registry chosen by name and device.

- ``"eager"``: PyTorch ops (:mod:`hybridembed.kernels.lookup`). Every device; the tested
  reference of every other backend.
- ``"triton"``: Triton kernels (:mod:`hybridembed.kernels.triton_lookup`,
  :mod:`hybridembed.kernels.triton_hash`) for tensors on CUDA, and on the CPU when Triton's
  interpreter is on (``TRITON_INTERPRET=1``, slow: for tests). Elsewhere the eager ops run,
  so a model built with ``kernels="triton"`` can still be moved to the CPU.
- ``"numba"``: the fused CPU step (:mod:`hybridembed.kernels.cpu_fused`: PyTorch's forward,
  the gradient's reduction and the optimizer's update in one Numba pass at the step) for
  float32 and float64 tables on the CPU; the eager ops elsewhere.
- ``"auto"`` (the default): the backend named by ``HYBRIDEMBED_KERNELS`` when it is set, else
  Triton's kernels for tensors on CUDA when Triton is installed (measured faster than the eager
  ops in every workload on an NVIDIA H200: docs/benchmarks.md), the fused CPU step on the CPU
  when Numba is installed, and the eager ops elsewhere (Triton's interpreter on the CPU runs
  only for ``"triton"``).

Triton is an optional extra (``pip install "hybridembed[gpu]"``), imported only when asked for;
Numba (a dependency, wheels only) is imported at the first CPU table that could use it.

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

KERNELS = ("auto", "eager", "triton", "numba")


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
    if kernels == "numba":
        from .cpu_fused import available

        if not available():
            raise ConfigError(
                'kernels="numba" (the fused CPU step) needs Numba: pip install numba, or use kernels="auto" '
                "(the eager ops where Numba is missing)"
            )
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
    kind = torch.device(device).type
    if _on(kernels, kind):
        return "triton"
    if kind == "cpu" and kernels in ("auto", "numba"):
        from .cpu_fused import available

        return "numba" if available() else "eager"
    return "eager"


def _on(kernels: str, device_type: str) -> bool:
    if kernels == "auto":
        return device_type == "cuda" and triton_available()
    return kernels == "triton" and (device_type == "cuda" or (device_type == "cpu" and interpreting()))
