"""Sparse input: the canonical ``Jagged`` form and its constructors."""

from .jagged import Jagged, as_jagged

__all__ = ["Jagged", "as_jagged"]
