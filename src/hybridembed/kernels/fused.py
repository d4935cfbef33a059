"""What the fused reduce-and-update kernels share, whatever runs them (Triton on CUDA,
:mod:`hybridembed.kernels.cpu_fused` on the CPU): which optimizers they implement and the
hyper-parameters of one step. Imports neither Triton nor Numba.

The kernels apply, to each distinct row of a step with its summed gradient ``g`` (in the
compute dtype), what the eager optimizers (:mod:`hybridembed.optim.sparse`) apply:

- ``g = -g`` with ``maximize``; ``g = g + weight_decay * w`` (L2) when it is set;
- SGD: ``w -= lr * g``;
- Adagrad: ``s += g * g``, ``w -= lr_t * g / (sqrt(s) + eps)``, ``lr_t = lr / (1 + (t - 1) lr_decay)``;
- row-wise Adagrad: ``s += mean(g * g)`` (one value per row), ``w -= lr * g / (sqrt(s) + eps)``;
- Adam (``torch.optim.SparseAdam``'s lazy form): ``m += (1 - b1)(g - m)``,
  ``v = b2 v + (1 - b2) g * g``, ``w -= lr sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + eps)``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

__all__ = ["FUSED", "StepHparams", "fusable", "step_hparams"]

# optimizer name -> kernel code
FUSED = {"SGD": 0, "Adagrad": 1, "RowWiseAdagrad": 2, "Adam": 3}


def fusable(optimizer, hp: dict) -> bool:
    """The fused update implements ``optimizer`` with these hyper-parameters."""
    name = getattr(optimizer, "name", None)
    if name not in FUSED:
        return False
    return not (name == "SGD" and hp.get("momentum"))


class StepHparams(NamedTuple):
    """One step's numbers: ``lr`` is this step's (decayed, or bias-corrected for Adam)."""

    opt: int
    lr: float
    eps: float
    b1: float
    b2: float
    weight_decay: float
    maximize: bool


def step_hparams(optimizer, hp: dict, step: int) -> StepHparams:
    """The hyper-parameters of step ``step`` (1 for the first) of ``optimizer`` with ``hp``."""
    name = optimizer.name
    lr, eps, b1, b2 = float(hp["lr"]), float(hp.get("eps", 0.0)), 0.0, 0.0
    if name == "Adagrad":
        lr = lr / (1 + (step - 1) * hp["lr_decay"])
    elif name == "Adam":
        b1, b2 = (float(b) for b in hp["betas"])
        lr = lr * math.sqrt(1 - b2**step) / (1 - b1**step)
    return StepHparams(
        FUSED[name], lr, eps, b1, b2, float(hp.get("weight_decay", 0.0)), bool(hp.get("maximize", False))
    )
