"""Kernels: fused lookup-and-pool, sparse-gradient reduce, row-wise updates."""

from .lookup import bag_scale, pooled_lookup, reduce_rows, sorted_segments

__all__ = ["bag_scale", "pooled_lookup", "reduce_rows", "sorted_segments"]
