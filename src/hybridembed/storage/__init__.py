"""Storage: where rows and their optimizer state live, behind one protocol (:class:`Storage`)."""

from .base import RowStorage
from .dense import DenseStorage
from .hashed import HashStorage
from .protocol import LookupPlan, Storage
from .tiered import TieredStorage

__all__ = ["DenseStorage", "HashStorage", "LookupPlan", "RowStorage", "Storage", "TieredStorage"]
