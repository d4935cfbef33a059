"""Storage: where rows and their optimizer state live, behind one protocol (:class:`Storage`)."""

from .base import RowStorage
from .dense import DenseStorage
from .hashed import HashStorage
from .protocol import LookupPlan, Storage
from .tiered import TieredStorage
from .tiered_hash import TieredHashStorage

__all__ = [
    "DenseStorage",
    "HashStorage",
    "LookupPlan",
    "RowStorage",
    "Storage",
    "TieredHashStorage",
    "TieredStorage",
    "storage_class",
]


def storage_class(table) -> type[RowStorage]:
    """The storage of a group of tables like ``table`` (a :class:`~hybridembed.TableConfig`):
    dense or dynamic, in memory or tiered (rows on disk)."""
    if table.dynamic is not None:
        return TieredHashStorage if table.tiered is not None else HashStorage
    return TieredStorage if table.tiered is not None else DenseStorage
