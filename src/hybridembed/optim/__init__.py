"""Sparse (row-wise) optimizers with torch.optim semantics, and ``wrap_optimizer``."""

from .sparse import (
    OPTIMIZERS,
    SGD,
    Adadelta,
    Adagrad,
    Adam,
    Adamax,
    AdamW,
    Ftrl,
    RMSprop,
    RowWiseAdagrad,
    SparseOptimizer,
)
from .wrapper import HybridOptimizer, clip_grad_norm_, sparse_equivalent, wrap_optimizer

__all__ = [
    "OPTIMIZERS",
    "SGD",
    "Adadelta",
    "Adagrad",
    "Adam",
    "AdamW",
    "Adamax",
    "Ftrl",
    "HybridOptimizer",
    "RMSprop",
    "RowWiseAdagrad",
    "SparseOptimizer",
    "clip_grad_norm_",
    "sparse_equivalent",
    "wrap_optimizer",
]
