"""Storage: where rows and their optimizer state live."""

from .base import RowStorage
from .dense import DenseStorage
from .hashed import HashStorage

__all__ = ["DenseStorage", "HashStorage", "RowStorage"]
