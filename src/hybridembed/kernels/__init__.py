"""Kernels: fused lookup-and-pool, sparse-gradient reduce, row-wise updates."""

import functools
import importlib
import importlib.util

from .lookup import bag_scale, pooled_lookup, reduce_rows, sorted_segments

__all__ = ["bag_scale", "pooled_lookup", "reduce_rows", "sorted_segments"]


@functools.cache
def numba_loops(name: str):
    """(Internal.) The module of Numba loops ``hybridembed.kernels.<name>`` (e.g. ``"_numba_victims"``),
    or None where Numba does not import (the caller runs torch's ops instead); a name that is no
    module here raises."""
    if importlib.util.find_spec(f"{__name__}.{name}") is None:
        raise ValueError(f"hybridembed.kernels has no module {name!r}")
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except Exception:  # (ImportError, or a Numba that does not match this NumPy)
        return None
