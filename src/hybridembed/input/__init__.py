"""Sparse input: the canonical ``Jagged`` form and its constructors."""

from .jagged import Jagged, as_feature_inputs, as_jagged, bag_index, offsets_from_lengths, run_index

__all__ = ["Jagged", "as_feature_inputs", "as_jagged", "bag_index", "offsets_from_lengths", "run_index"]
