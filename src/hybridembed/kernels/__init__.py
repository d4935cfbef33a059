"""Kernels: fused lookup-and-pool, sparse-gradient reduce, row-wise updates."""

import functools
import importlib

from .lookup import bag_scale, pooled_lookup, reduce_rows, sorted_segments

__all__ = ["bag_scale", "pooled_lookup", "reduce_rows", "sorted_segments", "numba_loops"]


@functools.cache
def numba_loops(name: str):
    """The module of Numba loops ``hybridembed.kernels.<name>`` (e.g. ``"_numba_victims"``), or None
    where Numba does not import (the caller runs torch's ops instead)."""
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except Exception:  # (ImportError, or a Numba that does not match this NumPy)
        return None
