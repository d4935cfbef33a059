"""Storage: where rows and their optimizer state live."""

from .dense import DenseStorage

__all__ = ["DenseStorage"]
