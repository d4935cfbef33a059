"""``Jagged``: the one canonical form of sparse input.

Shape legend: ``B`` batch (bags), ``N`` ids in the batch, ``H`` padded hotness.

A batch of ``B`` bags is ``values`` (N,) int64 ids, ``offsets`` (B+1,) int64 with
``offsets[0] == 0``, ``offsets[-1] == N`` and bag ``b`` holding
``values[offsets[b]:offsets[b+1]]``, and optional float ``weights`` (N,) per id.
Every other form enters through a ``Jagged.from_*`` constructor.

    >>> import torch, hybridembed as he
    >>> j = he.Jagged.from_lists([[3, 1], [], [7]])
    >>> j.values.tolist(), j.offsets.tolist()
    ([3, 1, 7], [0, 2, 2, 3])
    >>> he.Jagged.from_dense(torch.tensor([[4, -1], [5, 6]])).offsets.tolist()
    [0, 1, 3]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..errors import InvalidInputError
from ..init import stable_hash64

__all__ = ["Jagged", "as_feature_inputs", "as_jagged", "bag_index", "offsets_from_lengths", "run_index"]

_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def _where(feature: str | None) -> str:
    return f"feature {feature!r}: " if feature is not None else ""


def _first_true(mask: torch.Tensor) -> int:
    return int(mask.nonzero()[0, 0])


def _as_tensor(x: Any, name: str, expected: str, dtype: torch.dtype | None = None, device: Any = None) -> torch.Tensor:
    """``torch.as_tensor(x)`` for a ``from_*`` argument: a tensor, an array or a (nested) list of numbers."""
    try:
        return torch.as_tensor(x, dtype=dtype, device=device)
    except (TypeError, ValueError, RuntimeError, OverflowError) as e:
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise InvalidInputError(f"{name} must be {expected}, got {type(x).__name__} ({why})") from None


def _weights(weights: Any, ids: torch.Tensor) -> torch.Tensor | None:
    """Weights as given when a tensor (or None); a list or array of numbers becomes float32 (as
    :meth:`Jagged.from_lists` makes them) on the ids' device."""
    if weights is None or isinstance(weights, torch.Tensor):
        return weights
    return _as_tensor(
        weights, "weights", "a float tensor or a (nested) list of floats, one per id", torch.float32, ids.device
    )


def _refuse_meta(t: torch.Tensor, name: str, feature: str | None = None) -> None:
    """Meta tensors have a shape and no values: nothing to look up (and any read of them fails)."""
    if t.device.type == "meta":
        raise InvalidInputError(
            f"{_where(feature)}{name} are on the meta device, and meta tensors hold no values (only a shape): "
            "there are no ids to look up; make them on the table's device (cpu or cuda)",
            feature,
        )


def offsets_from_lengths(lengths: torch.Tensor) -> torch.Tensor:
    """Run lengths (B,) -> int64 offsets (B+1,) starting at 0."""
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths, 0, out=offsets[1:])
    return offsets


def run_index(counts: torch.Tensor, n: int) -> torch.Tensor:
    """Run lengths (R,) summing to ``n`` -> (n,) int64 run of each position, as
    ``repeat_interleave(arange(R), counts)``. On a GPU it is a search per position: CUDA's
    repeat_interleave writes each run with one warp, so a few long runs (a group's features,
    hundreds of thousands of ids each) run nearly serially there (measured: 1.7 ms for 26 runs
    of 330k ids on an H200, against microseconds searched)."""
    if counts.device.type == "cpu":
        return torch.repeat_interleave(torch.arange(counts.numel()), counts, output_size=n)
    return _searched_run_index(counts, n)


def _searched_run_index(counts: torch.Tensor, n: int) -> torch.Tensor:
    """:func:`run_index` as one binary search per position (on any device: the tests run it on CPU)."""
    ends = torch.cumsum(counts, 0)
    return torch.searchsorted(ends, torch.arange(n, device=counts.device, dtype=ends.dtype), right=True)


def bag_index(offsets: torch.Tensor, n: int) -> torch.Tensor:
    """Well-formed offsets (B+1,) of ``n`` ids -> (N,) int64 bag of each id."""
    lengths = (offsets[1:] - offsets[:-1]).to(torch.int64)
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=offsets.device), lengths, output_size=n)


class Jagged:
    """A batch of variable-length bags of ids (see the module docstring).

    The constructor only stores; nothing is checked until :meth:`validate` (which
    :class:`~hybridembed.EmbeddingCollection` calls, naming the feature) so that building
    a ``Jagged`` on the hot path costs nothing.
    """

    __slots__ = ("values", "offsets", "weights")

    def __init__(self, values: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None = None):
        for name, t in (("values", values), ("offsets", offsets), ("weights", weights)):
            if t is not None and not isinstance(t, torch.Tensor):
                raise InvalidInputError(f"Jagged {name} must be a torch.Tensor, got {type(t).__name__}")
        self.values = values
        self.offsets = offsets
        self.weights = weights

    # --- constructors ------------------------------------------------------------------
    @classmethod
    def from_lengths(cls, values: torch.Tensor, lengths: torch.Tensor, weights: torch.Tensor | None = None) -> Jagged:
        """Ids (N,) and bag lengths (B,) summing to N; each a tensor or a list (weights: floats)."""
        values = _as_tensor(values, "values", "a 1-D integer tensor or a list of ints (the ids)")
        lengths = _as_tensor(lengths, "lengths", "a 1-D integer tensor or a list of ints (the bag lengths)")
        _refuse_meta(values, "ids")
        _refuse_meta(lengths, "lengths")
        if lengths.dim() != 1 or lengths.dtype not in _INT_DTYPES:
            raise InvalidInputError(f"lengths must be a 1-D integer tensor, got {tuple(lengths.shape)} {lengths.dtype}")
        if lengths.numel() and int(lengths.min()) < 0:
            raise InvalidInputError(f"lengths must be >= 0; lengths[{_first_true(lengths < 0)}] is negative")
        return cls(values, offsets_from_lengths(lengths), _weights(weights, values))

    @classmethod
    def from_dense(cls, ids: torch.Tensor, pad: int = -1, weights: torch.Tensor | None = None) -> Jagged:
        """Padded ids (B, H): every entry equal to ``pad`` is dropped. Weights, if any, are (B, H)
        (a tensor, or nested lists of floats)."""
        ids = _as_tensor(ids, "ids", "an integer tensor of shape (B, H) or a list of lists of ints")
        _refuse_meta(ids, "ids")
        if ids.dim() != 2:
            raise InvalidInputError(f"from_dense expects ids of shape (B, H), got {tuple(ids.shape)}")
        if ids.dtype not in _INT_DTYPES:
            raise InvalidInputError(f"ids must be integers, got dtype {ids.dtype}; convert with .long()")
        weights = _weights(weights, ids)
        if weights is not None and tuple(weights.shape) != tuple(ids.shape):
            raise InvalidInputError(f"weights shape {tuple(weights.shape)} differs from ids shape {tuple(ids.shape)}")
        keep = ids != pad  # (B, H)
        b, h = ids.shape
        if h > 0 and bool(keep.all()):  # nothing padded (one-hot, fixed hotness): no copy, regular offsets
            offsets = torch.arange(0, b * h + 1, h, dtype=torch.int64, device=ids.device)
            w = None if weights is None else weights.reshape(-1)
            return cls(ids.reshape(-1).to(torch.int64), offsets, w)
        values = ids[keep].to(torch.int64)
        return cls(values, offsets_from_lengths(keep.sum(1)), None if weights is None else weights[keep])

    @classmethod
    def from_tensor(cls, ids: torch.Tensor, pad: int = -1, weights: torch.Tensor | None = None) -> Jagged:
        """(B,) one id per sample, or (B, H) padded ids; ``pad`` entries are dropped. Weights, if
        any, have the ids' shape (a tensor, or a list of floats)."""
        ids = _as_tensor(ids, "ids", "an integer tensor of shape (B,) or (B, H), or a list of ints")
        weights = _weights(weights, ids)
        if ids.dim() == 1:
            ids = ids.unsqueeze(1)
            if weights is not None and weights.dim() == 1:
                weights = weights.unsqueeze(1)  # (B,) -> (B, 1)
        return cls.from_dense(ids, pad=pad, weights=weights)

    @classmethod
    def from_lists(cls, ids: Sequence[Sequence[int | str]], weights: Sequence[Sequence[float]] | None = None) -> Jagged:
        """Python lists of lists: ``[[3, 1], [], [7]]``, or of strings ``[["fr", "de"], []]``,
        hashed with :func:`hybridembed.init.stable_hash64` (blake2b, the same in every process)
        for dynamic tables."""
        try:
            lengths = [len(bag) for bag in ids]
            flat = [i for bag in ids for i in bag]
            if flat and all(isinstance(i, str) for i in flat):  # raw string ids: stable 64-bit hash
                flat = [stable_hash64(i) for i in flat]
            values = torch.tensor(flat) if flat else torch.zeros(0, dtype=torch.int64)
        except (TypeError, ValueError, RuntimeError, OverflowError) as e:
            raise InvalidInputError(f"from_lists expects a list of lists of ints: {e}") from None
        if values.dtype not in _INT_DTYPES or values.dim() != 1:
            raise InvalidInputError(f"from_lists expects a list of lists of ints, got {values.dtype} values")
        values = values.to(torch.int64)
        w = None
        if weights is not None:
            expected = "a list of lists of floats with the same bag lengths as ids"
            try:
                same = [len(bag) for bag in weights] == lengths
                flat_w = [x for bag in weights for x in bag] if same else []
            except TypeError:
                raise InvalidInputError(f"weights must be {expected}, got {type(weights).__name__}") from None
            if not same:
                raise InvalidInputError(f"weights must be {expected}; their bag lengths differ")
            w = _as_tensor(flat_w, "weights", expected, torch.float32)
        return cls.from_lengths(values, torch.tensor(lengths, dtype=torch.int64), w)

    @classmethod
    def from_sparse(cls, ids: torch.Tensor, weights: torch.Tensor | None = None) -> Jagged:
        """A 2-D ``torch.sparse_coo_tensor`` of shape (B, H) whose values are ids (the
        ``tf.SparseTensor`` layout); ``weights`` an optional one with the same indices."""
        if not isinstance(ids, torch.Tensor) or ids.layout != torch.sparse_coo or ids.sparse_dim() != 2:
            raise InvalidInputError("from_sparse expects a 2-D torch.sparse_coo_tensor of ids")
        _refuse_meta(ids, "ids")
        nnz = ids._nnz()
        ids = ids.coalesce()  # sorted by (row, column)
        if ids._nnz() != nnz:
            raise InvalidInputError(
                "sparse ids have duplicate (row, column) coordinates; coalescing would add ids together"
            )
        rows = ids.indices()[0]
        lengths = torch.bincount(rows, minlength=ids.shape[0])
        w = None
        if weights is not None:
            if not isinstance(weights, torch.Tensor) or weights.layout != torch.sparse_coo:
                raise InvalidInputError("sparse weights must be a sparse COO tensor with the same indices as the ids")
            weights = weights.coalesce()
            if not torch.equal(weights.indices(), ids.indices()):
                raise InvalidInputError("sparse weights must have the same indices as the sparse ids")
            w = weights.values()
        return cls.from_lengths(ids.values(), lengths, w)

    # --- properties ----------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        """B, the number of bags."""
        return self.offsets.numel() - 1

    def lengths(self) -> torch.Tensor:
        """(B,) number of ids in each bag."""
        return self.offsets[1:] - self.offsets[:-1]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Jagged:
        """The same bags with values, offsets and weights on ``device``."""
        w = None if self.weights is None else self.weights.to(device, non_blocking=non_blocking)
        return Jagged(
            self.values.to(device, non_blocking=non_blocking), self.offsets.to(device, non_blocking=non_blocking), w
        )

    def pin_memory(self) -> Jagged:
        """The same bags in pinned host memory (for asynchronous copies to a GPU)."""
        w = None if self.weights is None else self.weights.pin_memory()
        return Jagged(self.values.pin_memory(), self.offsets.pin_memory(), w)

    def to_padded(self, pad: float = 0, min_length: int = 0) -> torch.Tensor:
        """Values (N, *) -> (B, T, *) with bag b's values first in row b and ``pad`` after.

        ``T`` is the longest bag (at least ``min_length``). Works for ids (N,) and rows (N, D).

        >>> import hybridembed as he
        >>> he.Jagged.from_lists([[3, 1], [], [7]]).to_padded(-1).tolist()
        [[3, 1], [-1, -1], [7, -1]]
        """
        lengths = self.lengths()  # (B,)
        b, n, dev = lengths.numel(), self.values.shape[0], self.values.device
        t = max(min_length, int(lengths.max()) if b else 0)
        bag = bag_index(self.offsets, n)  # (N,)
        pos = torch.arange(n, device=dev) - self.offsets[:-1].to(torch.int64).index_select(0, bag)  # (N,)
        out = self.values.new_full((b, t, *self.values.shape[1:]), pad)
        return out.index_put((bag, pos), self.values)

    def to_lists(self) -> list[list[int]]:
        """The bags as a list of lists of ids (for tests and printing)."""
        v, o = self.values.tolist(), self.offsets.tolist()
        return [v[o[b] : o[b + 1]] for b in range(len(o) - 1)]

    def __repr__(self) -> str:
        w = "" if self.weights is None else ", weighted"
        n = self.values.shape[0] if self.values.dim() else 0
        return f"Jagged(B={self.batch_size}, N={n}{w}, device={self.values.device})"

    # --- validation ----------------------------------------------------------------------
    def check_structure(self, feature: str | None = None) -> None:
        """Checks dtypes, shapes and devices (no pass over the data)."""
        v, o, w = self.values, self.offsets, self.weights
        _refuse_meta(v, "ids", feature)
        if v.dtype not in _INT_DTYPES:
            raise InvalidInputError(f"{_where(feature)}ids must be integers, got dtype {v.dtype}", feature)
        if o.dtype not in _INT_DTYPES:
            raise InvalidInputError(f"{_where(feature)}offsets must be integers, got dtype {o.dtype}", feature)
        if v.dim() != 1:
            raise InvalidInputError(f"{_where(feature)}ids must be 1-D, got shape {tuple(v.shape)}", feature)
        if o.dim() != 1 or o.numel() < 1:
            raise InvalidInputError(
                f"{_where(feature)}offsets must be 1-D of length B+1 >= 1, got shape {tuple(o.shape)}", feature
            )
        if o.device != v.device:
            raise InvalidInputError(
                f"{_where(feature)}offsets are on {o.device} but ids are on {v.device}; "
                f"move them with .to({str(v.device)!r})",
                feature,
            )
        if w is not None:
            if not w.is_floating_point():
                raise InvalidInputError(f"{_where(feature)}weights must be floating point, got {w.dtype}", feature)
            if w.device != v.device:
                raise InvalidInputError(
                    f"{_where(feature)}weights are on {w.device} but ids are on {v.device}; "
                    f"move them with .to({str(v.device)!r})",
                    feature,
                )
            if w.shape != v.shape:
                raise InvalidInputError(
                    f"{_where(feature)}weights have shape {tuple(w.shape)} but ids have {tuple(v.shape)}; "
                    "give one weight per id",
                    feature,
                    min(w.numel(), v.numel()),
                )

    def ok(self, num_embeddings: int | None = None, allow_negative: bool = False) -> torch.Tensor:
        """0-d bool tensor: offsets well-formed, ids in ``[0, num_embeddings)`` (any int64
        with ``allow_negative`` and no ``num_embeddings``, as dynamic tables take) and
        weights, if any, finite.

        No host sync: a caller checking many features reduces these and syncs once.
        """
        o, v = self.offsets, self.values
        good = (o[0] == 0) & (o[-1] == v.numel())
        if o.numel() > 1:
            good = good & (o[1:] >= o[:-1]).all()
        if v.numel() and (num_embeddings is not None or not allow_negative):
            lo, hi = (m.to(torch.int64) for m in torch.aminmax(v))  # (uint8 would wrap the bound)
            if not allow_negative:
                good = good & (lo >= 0)
            if num_embeddings is not None:
                good = good & (hi < num_embeddings)
        if self.weights is not None and self.weights.numel():
            good = good & torch.isfinite(self.weights).all()
        return good

    def raise_first_error(
        self, feature: str | None = None, num_embeddings: int | None = None, allow_negative: bool = False
    ) -> None:
        """Raises :class:`InvalidInputError` for the first problem :meth:`ok` found."""
        o, v = self.offsets, self.values
        where = _where(feature)
        if int(o[0]) != 0:
            raise InvalidInputError(f"{where}offsets[0] must be 0, got {int(o[0])}", feature, 0)
        if o.numel() > 1:
            dec = o[1:] < o[:-1]
            if bool(dec.any()):
                i = _first_true(dec) + 1
                raise InvalidInputError(
                    f"{where}offsets must be non-decreasing; offsets[{i}]={int(o[i])} < offsets[{i - 1}]={int(o[i - 1])}",
                    feature,
                    i,
                )
        if int(o[-1]) != v.numel():
            raise InvalidInputError(
                f"{where}offsets[-1]={int(o[-1])} must equal the number of ids ({v.numel()})", feature, o.numel() - 1
            )
        if v.numel() and (num_embeddings is not None or not allow_negative):
            v = v.to(torch.int64)  # (a bound above 255 would wrap in uint8)
            bad = v < 0 if not allow_negative else torch.zeros_like(v, dtype=torch.bool)
            if num_embeddings is not None:
                bad |= v >= num_embeddings
            if bool(bad.any()):
                i = _first_true(bad)
                if int(v[i]) < 0:
                    raise InvalidInputError(
                        f"{where}ids must be >= 0 (padding is dropped before lookup); ids[{i}]={int(v[i])}", feature, i
                    )
                raise InvalidInputError(
                    f"{where}id out of range: ids[{i}]={int(v[i])}, the table has {num_embeddings} rows "
                    f"(allowed [0, {num_embeddings}))",
                    feature,
                    i,
                )
        w = self.weights
        if w is not None and w.numel():
            bad = ~torch.isfinite(w)
            if bool(bad.any()):
                i = _first_true(bad)
                raise InvalidInputError(
                    f"{where}weights must be finite; weights[{i}]={float(w[i])} would turn the rows it "
                    "pools (and, in training, their gradients) into NaN",
                    feature,
                    i,
                )

    def validate(self, feature: str | None = None, num_embeddings: int | None = None) -> Jagged:
        """Raises :class:`InvalidInputError` naming ``feature`` and the first bad position."""
        self.check_structure(feature)
        if not bool(self.ok(num_embeddings)):
            self.raise_first_error(feature, num_embeddings)
        return self


def as_jagged(x: Any, feature: str | None = None, pad: int = -1) -> Jagged:
    """Any accepted input form -> ``Jagged`` (no range checks; see :meth:`Jagged.validate`).

    Accepts ``Jagged``, a (B,) or (B, H) integer tensor (``pad`` entries dropped), a 2-D
    sparse COO tensor, a ``torch.nested`` tensor of ``layout=torch.jagged`` (B bags of ids), a
    TorchRec ``JaggedTensor`` (duck-typed: ``values()``, ``offsets()``, ``weights_or_none()``), a
    list of lists, or a ``(values, offsets)`` / ``(values, offsets, weights)`` tuple of tensors. Any other tuple is refused rather than guessed at:
    ``(ids_list, offsets)`` or ``(ids,)`` would otherwise read as a list of bags.
    """
    try:
        if isinstance(x, Jagged):
            return x
        if isinstance(x, torch.Tensor):
            if x.layout == torch.sparse_coo:
                return Jagged.from_sparse(x)
            if x.is_nested:
                return _from_nested(x)
            if x.dim() not in (1, 2):
                raise InvalidInputError(f"a dense id tensor must be (B,) or (B, H), got shape {tuple(x.shape)}")
            return Jagged.from_tensor(x, pad=pad)
        if isinstance(x, tuple):
            if len(x) in (2, 3) and all(isinstance(t, torch.Tensor) for t in x[:2]):
                return Jagged(*x)  # (which refuses weights that are not a tensor)
            got = ", ".join(type(t).__name__ for t in x)
            raise InvalidInputError(
                f"a tuple input must be (values, offsets) or (values, offsets, weights) tensors, got ({got}); "
                "give ids and offsets as he.Jagged(values, offsets), or bags as a list of lists ([[3, 1], [7]])"
            )
        if isinstance(x, list):
            return Jagged.from_lists(x)
        if _is_jagged_tensor(x):
            return Jagged(x.values(), x.offsets(), x.weights_or_none())
    except InvalidInputError as e:
        if feature is None or e.feature is not None:
            raise
        raise InvalidInputError(f"{_where(feature)}{e}", feature, e.position) from None
    raise InvalidInputError(
        f"{_where(feature)}unsupported input type {type(x).__name__}; give a Jagged, a tensor of ids, "
        "a sparse COO tensor, a torch.nested jagged tensor, a TorchRec JaggedTensor, a list of lists or a "
        "(values, offsets[, weights]) tuple of tensors",
        feature,
    )


def _from_nested(x: torch.Tensor) -> Jagged:
    """A ``torch.nested`` tensor of B bags of ids (``layout=torch.jagged``, shape (B, j)) -> Jagged."""
    if x.layout != torch.jagged:
        raise InvalidInputError(
            "a torch.nested tensor must have layout=torch.jagged (torch.nested.nested_tensor(bags, "
            f"layout=torch.jagged)), got {x.layout}"
        )
    if x.dim() != 2 or x._ragged_idx != 1:
        raise InvalidInputError(f"a nested jagged tensor of ids must be (B, j) bags of ids, got {x.dim()} dimensions")
    if x._lengths is not None:  # (a view with holes: its own offsets do not describe its values)
        raise InvalidInputError("a nested jagged tensor with holes (a narrow() view) is not accepted; .contiguous() it")
    return Jagged(x.values(), x.offsets())


def _is_jagged_tensor(x: Any) -> bool:
    """A TorchRec ``JaggedTensor`` (or anything shaped like one), without importing TorchRec."""
    return all(callable(getattr(x, m, None)) for m in ("values", "offsets", "weights_or_none")) and not isinstance(
        x, Mapping
    )


def _is_keyed(x: Any) -> bool:
    """A TorchRec ``KeyedJaggedTensor`` (duck-typed)."""
    return all(callable(getattr(x, m, None)) for m in ("keys", "values", "lengths", "length_per_key", "stride"))


def as_feature_inputs(inputs: Any) -> Any:
    """A model's sparse inputs as ``{feature: ids}``: a mapping as it is; a TorchRec
    ``KeyedJaggedTensor`` (duck-typed, no TorchRec import) split into one :class:`Jagged` per key,
    its per-id weights kept; anything else returned unchanged (the caller refuses it)."""
    if isinstance(inputs, Mapping) or not _is_keyed(inputs):
        return inputs
    if callable(getattr(inputs, "variable_stride_per_key", None)) and inputs.variable_stride_per_key():
        raise InvalidInputError(
            "a KeyedJaggedTensor with a batch size per key (variable stride) is not accepted: every feature of a "
            "step needs the same number of bags"
        )
    keys, stride = list(inputs.keys()), int(inputs.stride())
    if len(set(keys)) != len(keys):
        dup = next(k for k in keys if keys.count(k) > 1)
        raise InvalidInputError(f"a KeyedJaggedTensor names feature {dup!r} twice; each feature once", dup)
    lengths, values = inputs.lengths(), inputs.values()
    weights = inputs.weights_or_none() if callable(getattr(inputs, "weights_or_none", None)) else None
    if lengths.numel() != len(keys) * stride:
        raise InvalidInputError(
            f"a KeyedJaggedTensor of {len(keys)} keys and stride {stride} needs {len(keys) * stride} lengths, "
            f"got {lengths.numel()}"
        )
    per_key = [int(n) for n in inputs.length_per_key()]
    if sum(per_key) != values.numel():
        raise InvalidInputError(f"a KeyedJaggedTensor with {values.numel()} values whose lengths sum to {sum(per_key)}")
    out: dict[str, Jagged] = {}
    vals = values.split(per_key)
    ws = weights.split(per_key) if weights is not None else [None] * len(keys)
    for key, v, w, n in zip(keys, vals, ws, lengths.split(stride)):
        out[key] = Jagged.from_lengths(v, n, w)
    return out
