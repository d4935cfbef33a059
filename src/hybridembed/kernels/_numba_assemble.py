"""Numba loop of a group's input assembly on the CPU (:mod:`.cpu_assemble`; imported only when
Numba is): every feature's ids shifted into the group's rows and its offsets into the group's bags,
with the checks the eager ops make (ids in their table's rows, offsets well formed), in one pass
over each feature's tensors. The features' tensors are passed by address (int64 arrays of
``data_ptr()``): a list of arrays would be converted element by element at each call.
"""

from __future__ import annotations

from numba import carray, njit, types
from numba.extending import intrinsic

__all__ = ["assemble_features"]


@intrinsic
def _int64s_at(typingctx, address):
    """The int64 array that starts at ``address`` (a tensor's ``data_ptr()``), as a pointer."""
    sig = types.CPointer(types.int64)(types.int64)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(signature.return_type))

    return sig, codegen


@njit(nogil=True, cache=True)
def assemble_features(
    values, offsets, counts, lengths, shifts, rows, seq, lo, hi, base, bag, force, ids_out, offs_out
):  # pragma: no cover
    """Features ``lo:hi`` into the group's ``ids_out`` (from ``base``) and ``offs_out`` (from ``bag``).

    Feature f: its ids at address ``values[f]`` (``counts[f]`` int64), its offsets at ``offsets[f]``
    (``lengths[f]`` int64, at least 1), its rows start at the group's row ``shifts[f]`` and are
    ``rows[f]`` many (-1: any id, a dynamic table's); ``seq[f]``: a sequence feature (each id its
    own bag) else pooled (a bag between each two offsets). Returns (every check held, every bag
    holds one id). The checks: each id in ``0 .. rows[f] - 1``; offsets from 0 to the feature's id
    count, never decreasing. Where every bag holds one id, the group's offsets are ``arange``: they
    are written only if ``force``."""
    ok = True
    one = True
    start = base
    for f in range(lo, hi):
        c, m, k, r = counts[f], lengths[f], shifts[f], rows[f]
        off = carray(_int64s_at(offsets[f]), m)
        if c:
            val = carray(_int64s_at(values[f]), c)
            low, high = val[0], val[0]
            for i in range(c):
                x = val[i]
                ids_out[base + i] = x + k
                low = min(low, x)
                high = max(high, x)
            if r >= 0 and (low < 0 or high >= r):
                ok = False
        if off[0] != 0 or off[m - 1] != c:
            ok = False
        for i in range(m - 1):
            step = off[i + 1] - off[i]
            if step < 0:
                ok = False
            if step != 1 and not seq[f]:
                one = False
        base += c
    if one and not force:
        return ok, one
    base = start
    for f in range(lo, hi):
        c, m = counts[f], lengths[f]
        if seq[f]:
            for i in range(c):
                offs_out[bag + i] = base + i
            bag += c
        else:
            off = carray(_int64s_at(offsets[f]), m)
            for i in range(m - 1):
                offs_out[bag + i] = off[i] + base
            bag += m - 1
        base += c
    return ok, one
