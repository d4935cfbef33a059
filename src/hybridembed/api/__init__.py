"""The verbs: convert, distribute, save/load (from :mod:`hybridembed.checkpoint`), export."""

from ..checkpoint import load, save
from .convert import convert
from .distribute import distribute
from .export import export
from .prefetch import prefetch

__all__ = ["convert", "distribute", "export", "load", "prefetch", "save"]
