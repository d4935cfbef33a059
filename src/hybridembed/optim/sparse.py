"""Row-wise ("lazy") optimizers with torch.optim's formulas, applied to the rows a batch touched.

Shape legend: ``U`` distinct rows touched this step, ``D`` dim.

Each optimizer is a small object holding hyper-parameters (same names and defaults as
``torch.optim``; Keras's for FTRL) and an ``update`` that maps the touched rows, their
summed gradient and their per-row state to new values. The storage gathers and scatters,
so the state lives beside the rows (and moves with them when rows are sharded, evicted or
checkpointed). Where lazy differs from dense:

- SGD, Adagrad, RowWiseAdagrad without weight decay or momentum: identical to the dense
  optimizer (an untouched row has gradient 0, which leaves it and its state unchanged).
- Adam: identical to ``torch.optim.SparseAdam`` (moments of untouched rows do not decay;
  ``eps`` is added before bias correction, as SparseAdam does).
- Weight decay, momentum and every moment-based optimizer (AdamW, Adamax, Adadelta,
  RMSprop, FTRL): the decay or moment update is applied to a row only on the steps that
  touch it; a dense optimizer would also move untouched rows. SGD's momentum buffer starts
  at 0 per row, so with ``dampening > 0`` a row's first update is damped (torch's first
  step is not).

Per-row state in float32 (bytes per row, ``D`` = dim): SGD 0 (4D with momentum); Adagrad
4D; RowWiseAdagrad 4; Adam, AdamW, Adamax, Adadelta, FTRL 8D; RMSprop 4D (+4D centered,
+4D momentum).

    >>> import hybridembed as he
    >>> he.optim.Adagrad(lr=0.1)
    Adagrad(lr=0.1, lr_decay=0.0, weight_decay=0.0, initial_accumulator_value=0.0, eps=1e-10, maximize=False)
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..errors import ConfigError
from ..utils import is_number as _is_number

__all__ = [
    "SparseOptimizer",
    "SGD",
    "Adagrad",
    "RowWiseAdagrad",
    "Adam",
    "AdamW",
    "Adamax",
    "Adadelta",
    "RMSprop",
    "Ftrl",
    "OPTIMIZERS",
]

Tensor = torch.Tensor


class SparseOptimizer:
    """Base: hyper-parameters in ``self.hparams`` (the param_group keys); subclasses define
    ``DEFAULTS``, ``state_spec`` and ``update``."""

    DEFAULTS: dict[str, Any] = {}

    def __init__(self, **hparams: Any):
        unknown = sorted(set(hparams) - set(self.DEFAULTS))
        if unknown:
            raise ConfigError(
                f"{type(self).__name__}: unknown hyper-parameter(s) {', '.join(unknown)}; "
                f"allowed: {', '.join(self.DEFAULTS)}"
            )
        self.hparams: dict[str, Any] = {**self.DEFAULTS, **hparams}
        self.validate(self.hparams)

    @property
    def name(self) -> str:
        """The optimizer's name (``"adagrad"``, ...), as checkpoints record it."""
        return type(self).__name__

    def validate(self, hp: dict[str, Any]) -> None:
        """Types from ``DEFAULTS`` (a flag is a bool, a number a finite int or float, ``betas``
        two numbers), then torch.optim's ranges: ``lr``, ``eps``, ``weight_decay`` >= 0,
        ``betas`` in [0, 1); subclasses add their own (:meth:`_at_least` and friends)."""
        for key, default in self.DEFAULTS.items():
            v = hp[key]
            if isinstance(default, bool):
                if not isinstance(v, bool):
                    raise ConfigError(f"{self.name}: {key} must be True or False, got {v!r}")
            elif isinstance(default, tuple):
                if not (isinstance(v, (tuple, list)) and len(v) == len(default) and all(map(_is_number, v))):
                    raise ConfigError(f"{self.name}: {key} must be a pair of numbers like {default!r}, got {v!r}")
            elif not _is_number(v):
                raise ConfigError(f"{self.name}: {key} must be a finite number, got {v!r}")
        for key in ("lr", "eps", "weight_decay"):
            if key in hp:
                self._at_least(hp, key, 0.0)
        betas = hp.get("betas")
        if betas is not None and not all(0.0 <= b < 1.0 for b in betas):
            raise ConfigError(f"{self.name}: betas must be two numbers in [0, 1), got {betas!r}")

    def _at_least(self, hp: dict[str, Any], key: str, low: float, strict: bool = False) -> None:
        v = hp[key]
        if v < low or (strict and v == low):
            raise ConfigError(f"{self.name}: {key} must be {'>' if strict else '>='} {low}, got {v!r}")

    def _within(self, hp: dict[str, Any], key: str, low: float, high: float) -> None:
        if not low <= hp[key] <= high:
            raise ConfigError(f"{self.name}: {key} must be in [{low}, {high}], got {hp[key]!r}")

    def state_spec(self, hp: dict[str, Any]) -> dict[str, tuple[bool, float]]:
        """``{state name: (per element (D) or per row (scalar), initial value)}``."""
        return {}

    def additive(self, hp: dict[str, Any]) -> bool:
        """True when the new row is ``row + delta(grad, state)``: the storage then updates
        with one ``index_add_`` and never gathers the rows."""
        return not hp.get("weight_decay")

    def delta(self, g: Tensor, state: dict[str, Tensor], step: int, hp: dict[str, Any]) -> tuple[Tensor, float]:
        """(U, D) summed gradient, gathered state (updated in place) -> ``(t, scale)``: the rows
        change by ``scale * t``. The scale folds into ``index_add_(alpha=...)``: no temporary."""
        raise NotImplementedError

    def update(self, w: Tensor, g: Tensor, state: dict[str, Tensor], step: int, hp: dict[str, Any]) -> Tensor:
        """(U, D) rows, (U, D) summed gradient, gathered state (updated in place) -> new rows.

        May modify its arguments in place (they are gathered copies)."""
        plain = {**hp, "weight_decay": 0.0, "maximize": False}  # both applied here, once
        t, scale = self.delta(_prep_grad(w, g, hp), state, step, plain)
        return w.add_(t, alpha=scale)

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.hparams == self.hparams

    def __hash__(self) -> int:
        return hash((type(self).__name__, tuple(sorted((k, str(v)) for k, v in self.hparams.items()))))

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.hparams.items())
        return f"{self.name}({args})"


def _prep_grad(w: Tensor | None, g: Tensor, hp: dict[str, Any]) -> Tensor:
    """Applies ``maximize`` and L2 ``weight_decay`` (which needs the rows ``w``)."""
    if hp.get("maximize"):
        g = -g
    wd = hp.get("weight_decay", 0.0)
    if wd:
        g = g + wd * w
    return g


class SGD(SparseOptimizer):
    """``torch.optim.SGD`` on the touched rows (momentum buffer per row, starting at 0)."""

    DEFAULTS = {
        "lr": 1e-3,
        "momentum": 0.0,
        "dampening": 0.0,
        "weight_decay": 0.0,
        "nesterov": False,
        "maximize": False,
    }

    def validate(self, hp):
        super().validate(hp)
        self._at_least(hp, "momentum", 0.0)
        if hp["nesterov"] and (hp["momentum"] <= 0 or hp["dampening"] != 0):
            raise ConfigError("SGD: nesterov needs momentum > 0 and dampening = 0")

    def state_spec(self, hp):
        return {"momentum_buffer": (True, 0.0)} if hp["momentum"] else {}

    def delta(self, g, state, step, hp):
        g = _prep_grad(None, g, hp)
        if hp["momentum"]:
            buf = state["momentum_buffer"].mul_(hp["momentum"]).add_(g, alpha=1 - hp["dampening"])
            g = g.add(buf, alpha=hp["momentum"]) if hp["nesterov"] else buf
        return g, -hp["lr"]


class Adagrad(SparseOptimizer):
    """``torch.optim.Adagrad`` on the touched rows (one accumulator per element)."""

    DEFAULTS = {
        "lr": 1e-2,
        "lr_decay": 0.0,
        "weight_decay": 0.0,
        "initial_accumulator_value": 0.0,
        "eps": 1e-10,
        "maximize": False,
    }

    def validate(self, hp):
        super().validate(hp)
        self._at_least(hp, "lr_decay", 0.0)
        self._at_least(hp, "initial_accumulator_value", 0.0)

    def state_spec(self, hp):
        return {"sum": (True, float(hp["initial_accumulator_value"]))}

    def delta(self, g, state, step, hp):
        g = _prep_grad(None, g, hp)
        clr = hp["lr"] / (1 + (step - 1) * hp["lr_decay"])
        s = state["sum"].addcmul_(g, g)
        return g.div(s.sqrt().add_(hp["eps"])), -clr


class RowWiseAdagrad(SparseOptimizer):
    """Adagrad with one accumulator per row: the mean of the squared gradient over the row
    (FBGEMM's ``EXACT_ROWWISE_ADAGRAD``, TorchRec's default). State: one float per row."""

    DEFAULTS = {"lr": 1e-2, "weight_decay": 0.0, "initial_accumulator_value": 0.0, "eps": 1e-8, "maximize": False}

    def validate(self, hp):
        super().validate(hp)
        self._at_least(hp, "initial_accumulator_value", 0.0)

    def state_spec(self, hp):
        return {"sum": (False, float(hp["initial_accumulator_value"]))}

    row_wise = True  # its state is a statistic of the whole row (see row_stat)

    def row_stat(self, g: Tensor) -> Tensor:
        """(U, D) gradient -> (U,) sum of squares per row (its slices' sums add up to the whole row's)."""
        return torch.linalg.vector_norm(g, dim=1).square_()

    def delta(self, g, state, step, hp, row_mean_square=None):
        g = _prep_grad(None, g, hp)
        # mean of squares per row as a norm: one pass, no (U, D) temporary (1.5 ms of a 30 ms step);
        # given for column slices of a wider row (the whole row's, from every slice)
        ms = self.row_stat(g).div_(g.shape[1]) if row_mean_square is None else row_mean_square
        s = state["sum"].add_(ms)  # (U,)
        return g * s.sqrt().add_(hp["eps"]).reciprocal_().unsqueeze(1), -hp["lr"]


class Adam(SparseOptimizer):
    """Lazy Adam, exactly ``torch.optim.SparseAdam`` (plus optional L2 ``weight_decay``)."""

    DEFAULTS = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "maximize": False}

    def state_spec(self, hp):
        return {"exp_avg": (True, 0.0), "exp_avg_sq": (True, 0.0)}

    def delta(self, g, state, step, hp):
        g = _prep_grad(None, g, hp)
        b1, b2 = hp["betas"]
        m = state["exp_avg"].lerp_(g, 1 - b1)
        v = state["exp_avg_sq"].mul_(b2).addcmul_(g, g, value=1 - b2)
        step_size = hp["lr"] * math.sqrt(1 - b2**step) / (1 - b1**step)
        return m.div(v.sqrt().add_(hp["eps"])), -step_size


class AdamW(SparseOptimizer):
    """``torch.optim.AdamW`` on the touched rows (decoupled decay applied when a row is touched)."""

    DEFAULTS = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2, "maximize": False}

    def additive(self, hp):
        return not hp["weight_decay"]

    def state_spec(self, hp):
        return {"exp_avg": (True, 0.0), "exp_avg_sq": (True, 0.0)}

    def delta(self, g, state, step, hp):
        if hp["maximize"]:
            g = -g
        b1, b2 = hp["betas"]
        m = state["exp_avg"].lerp_(g, 1 - b1)
        v = state["exp_avg_sq"].mul_(b2).addcmul_(g, g, value=1 - b2)
        denom = v.sqrt().div_(math.sqrt(1 - b2**step)).add_(hp["eps"])
        return m.div(denom), -hp["lr"] / (1 - b1**step)

    def update(self, w, g, state, step, hp):
        w.mul_(1 - hp["lr"] * hp["weight_decay"])  # decoupled decay, then Adam
        t, scale = self.delta(g, state, step, hp)
        return w.add_(t, alpha=scale)


class Adamax(SparseOptimizer):
    """``torch.optim.Adamax`` on the touched rows."""

    DEFAULTS = {"lr": 2e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "maximize": False}

    def state_spec(self, hp):
        return {"exp_avg": (True, 0.0), "exp_inf": (True, 0.0)}

    def delta(self, g, state, step, hp):
        g = _prep_grad(None, g, hp)
        b1, b2 = hp["betas"]
        m = state["exp_avg"].lerp_(g, 1 - b1)
        u = torch.maximum(state["exp_inf"].mul_(b2), g.abs().add_(hp["eps"]), out=state["exp_inf"])
        return m.div(u), -hp["lr"] / (1 - b1**step)


class Adadelta(SparseOptimizer):
    """``torch.optim.Adadelta`` on the touched rows."""

    DEFAULTS = {"lr": 1.0, "rho": 0.9, "eps": 1e-6, "weight_decay": 0.0, "maximize": False}

    def validate(self, hp):
        super().validate(hp)
        self._within(hp, "rho", 0.0, 1.0)

    def state_spec(self, hp):
        return {"square_avg": (True, 0.0), "acc_delta": (True, 0.0)}

    def delta(self, g, state, step, hp):
        g = _prep_grad(None, g, hp)
        rho, eps = hp["rho"], hp["eps"]
        sq = state["square_avg"].mul_(rho).addcmul_(g, g, value=1 - rho)
        delta = state["acc_delta"].add(eps).sqrt_().div_(sq.add(eps).sqrt_()).mul_(g)
        state["acc_delta"].mul_(rho).addcmul_(delta, delta, value=1 - rho)
        return delta, -hp["lr"]


class RMSprop(SparseOptimizer):
    """``torch.optim.RMSprop`` on the touched rows."""

    DEFAULTS = {
        "lr": 1e-2,
        "alpha": 0.99,
        "eps": 1e-8,
        "weight_decay": 0.0,
        "momentum": 0.0,
        "centered": False,
        "maximize": False,
    }

    def validate(self, hp):
        super().validate(hp)
        self._at_least(hp, "alpha", 0.0)
        self._at_least(hp, "momentum", 0.0)

    def state_spec(self, hp):
        spec = {"square_avg": (True, 0.0)}
        if hp["centered"]:
            spec["grad_avg"] = (True, 0.0)
        if hp["momentum"]:
            spec["momentum_buffer"] = (True, 0.0)
        return spec

    def delta(self, g, state, step, hp):
        g = _prep_grad(None, g, hp)
        a = hp["alpha"]
        sq = state["square_avg"].mul_(a).addcmul_(g, g, value=1 - a)
        if hp["centered"]:
            ga = state["grad_avg"].lerp_(g, 1 - a)
            avg = sq.addcmul(ga, ga, value=-1).sqrt_().add_(hp["eps"])
        else:
            avg = sq.sqrt().add_(hp["eps"])
        if hp["momentum"]:
            buf = state["momentum_buffer"].mul_(hp["momentum"]).addcdiv_(g, avg)
            return buf, -hp["lr"]
        return g.div(avg), -hp["lr"]


class Ftrl(SparseOptimizer):
    """FTRL-Proximal with Keras's formula and defaults (``keras.optimizers.Ftrl``).

    ``learning_rate_power`` -0.5, ``initial_accumulator_value`` 0.1, L1, L2 and L2-shrinkage
    regularisation, ``beta``. The hyper-parameter ``lr`` is Keras's ``learning_rate``.
    """

    DEFAULTS = {
        "lr": 1e-3,
        "learning_rate_power": -0.5,
        "initial_accumulator_value": 0.1,
        "l1_regularization_strength": 0.0,
        "l2_regularization_strength": 0.0,
        "l2_shrinkage_regularization_strength": 0.0,
        "beta": 0.0,
    }

    def validate(self, hp):
        super().validate(hp)
        self._at_least(hp, "lr", 0.0, strict=True)  # (the update divides by it)
        if hp["learning_rate_power"] > 0:
            raise ConfigError(f"Ftrl: learning_rate_power must be <= 0, got {hp['learning_rate_power']}")
        for k in (
            "initial_accumulator_value",
            "l1_regularization_strength",
            "l2_regularization_strength",
            "l2_shrinkage_regularization_strength",
            "beta",
        ):
            self._at_least(hp, k, 0.0)

    def state_spec(self, hp):
        return {"accumulator": (True, float(hp["initial_accumulator_value"])), "linear": (True, 0.0)}

    def additive(self, hp):
        return False  # the new row is a function of the accumulated linear term, not row + delta

    def update(self, w, g, state, step, hp):
        lr, p = hp["lr"], -hp["learning_rate_power"]
        l1 = hp["l1_regularization_strength"]
        l2 = hp["l2_regularization_strength"] + hp["beta"] / (2.0 * lr)
        g_shrunk = g + 2 * hp["l2_shrinkage_regularization_strength"] * w
        acc = state["accumulator"]
        new_acc = acc + g * g
        sigma = (new_acc.pow(p) - acc.pow(p)) / lr
        linear = state["linear"].add_(g_shrunk - sigma * w)
        quadratic = new_acc.pow(p) / lr + 2 * l2
        state["accumulator"].copy_(new_acc)
        return (linear.clamp(-l1, l1) - linear) / quadratic


OPTIMIZERS: dict[str, type[SparseOptimizer]] = {
    c.__name__: c for c in (SGD, Adagrad, RowWiseAdagrad, Adam, AdamW, Adamax, Adadelta, RMSprop, Ftrl)
}
