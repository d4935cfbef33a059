"""Row-keyed initializers.

The initial value of element ``(r, c)`` of table ``t`` is a pure function of
``(seed, t, r, c)``: a counter-based hash (splitmix64) turned into a uniform number,
then into the requested distribution by its inverse CDF. Nothing depends on how many
rows the table has, which rows live in this process, or the order ids arrive in, so one
process and N processes (and a dense and a dynamic table) start from identical weights
(placement never changes the math).

    >>> import torch, hybridembed as he
    >>> spec = he.init.normal(std=0.1)
    >>> a = he.init.generate(spec, seed=0, table="items", rows=torch.arange(5), dim=4)
    >>> b = he.init.generate(spec, seed=0, table="items", rows=torch.tensor([3, 4]), dim=4)
    >>> torch.equal(a[3:], b)
    True
"""

from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass

import torch

from .errors import ConfigError

__all__ = [
    "Init",
    "normal",
    "truncated_normal",
    "uniform",
    "constant",
    "zeros",
    "ones",
    "generate",
    "stable_hash64",
]

_KINDS = ("normal", "truncated_normal", "uniform", "constant")


@dataclass(frozen=True)
class Init:
    """An initializer: a distribution and its parameters. Build it with the functions below.

    ``normal``: mean, std. ``truncated_normal``: mean, std, and absolute bounds low/high
    (as ``torch.nn.init.trunc_normal_``). ``uniform``: low, high. ``constant``: value.
    """

    kind: str
    mean: float = 0.0
    std: float = 1.0
    low: float = 0.0
    high: float = 0.0
    value: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ConfigError(f"unknown initializer {self.kind!r}; allowed: {', '.join(_KINDS)}")
        if self.kind in ("normal", "truncated_normal") and not self.std > 0:
            raise ConfigError(f"{self.kind} initializer needs std > 0, got {self.std}")
        if self.kind in ("uniform", "truncated_normal") and not self.low < self.high:
            raise ConfigError(f"{self.kind} initializer needs low < high, got [{self.low}, {self.high}]")
        for name in ("mean", "std", "low", "high", "value"):
            if not math.isfinite(getattr(self, name)):
                raise ConfigError(f"initializer {name} must be finite, got {getattr(self, name)}")


def normal(mean: float = 0.0, std: float = 1.0) -> Init:
    """Normal(mean, std), as ``torch.nn.init.normal_`` (the ``nn.Embedding`` default)."""
    return Init("normal", mean=float(mean), std=float(std))


def truncated_normal(mean: float = 0.0, std: float = 1.0, a: float = -2.0, b: float = 2.0) -> Init:
    """Normal(mean, std) truncated to ``[a, b]`` (absolute bounds, as ``trunc_normal_``)."""
    return Init("truncated_normal", mean=float(mean), std=float(std), low=float(a), high=float(b))


def uniform(a: float = -0.05, b: float = 0.05) -> Init:
    """Uniform on ``[a, b)``. The default ``[-0.05, 0.05)`` is Keras's embedding default."""
    return Init("uniform", low=float(a), high=float(b))


def constant(value: float) -> Init:
    """Every element equal to ``value``."""
    return Init("constant", value=float(value))


def zeros() -> Init:
    """Every row zero."""
    return constant(0.0)


def ones() -> Init:
    """Every element one."""
    return constant(1.0)


# --- the counter-based hash -------------------------------------------------------------

_M64 = 1 << 64


def _signed(x: int) -> int:
    x %= _M64
    return x - _M64 if x >= 1 << 63 else x


_C1 = _signed(0xBF58476D1CE4E5B9)
_C2 = _signed(0x94D049BB133111EB)
_GOLDEN = _signed(0x9E3779B97F4A7C15)


def stable_hash64(text: str) -> int:
    """A 64-bit hash of ``text`` (blake2b), as a signed int64: same in every process and run."""
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
    return _signed(int.from_bytes(digest, "little"))


def _mix64_(x: torch.Tensor, tmp: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser, in place on an int64 tensor (wrapping multiply, logical shifts)."""
    for shift, mul in ((30, _C1), (27, _C2), (31, None)):
        torch.bitwise_right_shift(x, shift, out=tmp)
        tmp.bitwise_and_((1 << (64 - shift)) - 1)  # logical, not arithmetic, shift
        x.bitwise_xor_(tmp)
        if mul is not None:
            x.mul_(mul)
    return x


@functools.cache
def _numba_init():
    """:mod:`hybridembed.kernels._numba_init` where Numba imports, else None (the torch ops). (That
    module alone: the kernels' package imports the inputs, which import this module.)"""
    try:
        from .kernels import _numba_init as K
    except Exception:  # (ImportError, or a Numba that does not match this NumPy)
        return None
    return K


def _uniform01(rows: torch.Tensor, key: int | torch.Tensor, dim: int, col_start: int = 0) -> torch.Tensor:
    """(N,) int64 row ids -> (N, dim) float64 uniforms in (0, 1) of columns ``col_start ..
    col_start + dim - 1``, keyed by ``key`` (one, or (N,) per row). On the CPU with Numba: one
    pass (:mod:`hybridembed.kernels._numba_init`, the same bits)."""
    if rows.device.type == "cpu" and rows.numel() and _numba_init() is not None:
        out = torch.empty(rows.numel(), dim, dtype=torch.float64)
        per_row = isinstance(key, torch.Tensor)
        keys = key.to(torch.int64).contiguous() if per_row else torch.zeros(0, dtype=torch.int64)
        one = 0 if per_row else int(key)
        _numba_init().uniform01(rows.to(torch.int64).contiguous().numpy(), keys.numpy(), one, col_start, out.numpy())
        return out
    h = rows.to(torch.int64).bitwise_xor(key)  # (N,)
    _mix64_(h, torch.empty_like(h))
    cols = torch.arange(col_start, col_start + dim, device=rows.device, dtype=torch.int64)
    x = h[:, None] + cols * _GOLDEN  # (N, D)
    tmp = torch.empty_like(x)
    _mix64_(x, tmp)
    torch.bitwise_right_shift(x, 11, out=tmp)
    tmp.bitwise_and_((1 << 53) - 1)
    return tmp.to(torch.float64).add_(0.5).mul_(2.0**-53)


_CHUNK_ELEMENTS = 1 << 18  # keeps the int64 temporaries in cache


def generate(
    spec: Init,
    seed: int,
    table: str,
    rows: torch.Tensor,
    dim: int,
    dtype: torch.dtype = torch.float32,
    out: torch.Tensor | None = None,
    col_start: int = 0,
) -> torch.Tensor:
    """Initial values of ``rows`` (N,) of ``table``: a (N, dim) tensor on ``rows.device``.

    The value of each element depends only on ``(seed, table, row, column)``; ``col_start``
    makes columns ``col_start .. col_start + dim - 1`` (a column shard equals the same slice
    of the whole table).
    """
    return generate_keyed(spec, table_key(seed, table), rows, dim, dtype, out, col_start)


def table_key(seed: int, table: str) -> int:
    """The 64-bit key of ``table``'s initial values under ``seed``."""
    return stable_hash64(f"{int(seed)}\x00{table}")


def generate_keyed(
    spec: Init,
    key: int | torch.Tensor,
    rows: torch.Tensor,
    dim: int,
    dtype: torch.dtype = torch.float32,
    out: torch.Tensor | None = None,
    col_start: int = 0,
) -> torch.Tensor:
    """:func:`generate` with the table given by its :func:`table_key`: one int, or an (N,)
    int64 tensor of keys per row, so rows of several tables with one ``spec`` are made in one
    pass (bit-identical to one :func:`generate` per table)."""
    n = rows.numel()
    if out is None:
        out = torch.empty(n, dim, dtype=dtype, device=rows.device)
    if spec.kind == "constant":
        return out.fill_(spec.value)
    if spec.kind == "truncated_normal":
        lo = float(torch.special.ndtr(torch.tensor((spec.low - spec.mean) / spec.std, dtype=torch.float64)))
        hi = float(torch.special.ndtr(torch.tensor((spec.high - spec.mean) / spec.std, dtype=torch.float64)))
    step = max(1, _CHUNK_ELEMENTS // max(dim, 1))
    for start in range(0, n, step):
        k = key[start : start + step] if isinstance(key, torch.Tensor) else key
        u = _uniform01(rows[start : start + step], k, dim, col_start)  # (n_chunk, D) in (0, 1)
        if spec.kind == "uniform":
            v = u.mul_(spec.high - spec.low).add_(spec.low)
        elif spec.kind == "normal":
            # the normal quantile as sqrt(2) erfinv(2u - 1): 2x faster than ndtri here, equal to 1e-15
            v = torch.erfinv(u.mul_(2.0).sub_(1.0)).mul_(spec.std * math.sqrt(2.0)).add_(spec.mean)
        else:  # truncated_normal: inverse CDF restricted to [low, high]
            v = torch.special.ndtri(u.mul_(hi - lo).add_(lo)).mul_(spec.std).add_(spec.mean)
            v.clamp_(spec.low, spec.high)
        out[start : start + step] = v
    return out


def mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser of an int64 tensor (a new tensor): a bijective 64-bit hash."""
    x = x.to(torch.int64).clone()
    return _mix64_(x, torch.empty_like(x))
