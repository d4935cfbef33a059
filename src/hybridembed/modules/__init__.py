"""Modules: the user-facing embedding layers."""

from .collection import EmbeddingCollection

__all__ = ["EmbeddingCollection"]
