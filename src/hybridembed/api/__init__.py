"""The adoption and shipping API: convert, save/load, export."""

from .checkpoint import load, save
from .convert import convert
from .export import export

__all__ = ["convert", "export", "load", "save"]
