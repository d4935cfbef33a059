"""Triton kernels of a dynamic table's hash index (:class:`hybridembed.storage.HashStorage`).

Shape legend: ``U`` (table, id) pairs, ``H`` index positions (a power of two), ``B`` pairs per program.

The index is HashStorage's: ``hrow`` (H, 2) int64, one row per position holding the key and
``table << 32 | slot``; an empty position holds -1 in both words; ``mask`` = H - 1; linear
probing from a pair's home position: the storage's ``_hash`` of the pair masked to the index,
computed inside the kernels by :func:`_home` (the same splitmix64 bits; 19 torch launches a call
otherwise) unless the caller gives it; no tombstones (eviction rebuilds the index).

- :func:`find`: each pair probes from its home until it meets its key (the slot) or an empty
  position (absent: -1). One launch, no host sync: the eager reference reads a window of
  positions a round and asks the host after each round whether any pair is left.
- :func:`insert`: each (absent, distinct) pair claims the first empty position of its probe
  sequence with a compare-and-swap of the position's second word, and probes on when another
  pair took it first; the winner then writes the key word. Which pair wins a position depends
  on timing, so the layout may differ from the eager one's, but the set of pairs an index
  holds, and so every answer of ``find``, does not (linear probing without deletions). ``find``
  and ``insert`` are separate launches, so no reader sees a row whose key is not written yet.

Run on CPU tensors through Triton's interpreter: ``TRITON_INTERPRET=1`` must be set before this
module is imported (``triton.jit`` picks the interpreter when it decorates).

What still syncs and why (a training lookup on CUDA, Triton kernels on)
------------------------------------------------------------------------
Removed: ``_find``'s probing rounds and ``_insert``'s claiming rounds (a ``nonzero`` and a
``numel()`` test each, 2-3 rounds a lookup; now one launch each); the ``bincount`` of every
per-table count (on CUDA it reads the largest table index back to size its output; now
``index_add_`` into a (tables,) tensor); ``found[found >= 0]`` (a boolean mask) handed to the
eviction plan (the clamped slots protect the same rows: slot 0 is never a candidate); the TTL
check's ``bool(expired.any())`` before its ``nonzero`` (the one ``nonzero`` decides).

What still syncs, each because a shape or a Python branch needs the value:

- ``sort_pairs``: the ids' ``aminmax`` (``.tolist()``: picks the exact or the hashed key);
  ``unique_consecutive`` (exact key) or the ``nonzero`` of run starts and of hash clashes,
  ``clash.numel()`` and ``int(lens.sum())`` (hashed key): U, the number of distinct pairs,
  sizes every tensor after.
- ``plan_lookup``: ``(found < 0).nonzero()`` (the misses: how many rows to make);
  ``miss[ok]`` (a boolean mask, only with admission rules: how many are admitted).
- ``_admit``: none (the sketch reads and the draws stay on the device).
- ``_plan_evictions`` (capacity set and new rows only): ``(size + needed - capacity).tolist()``
  (which tables are over: a Python loop) and per such table the ``nonzero`` of its evictable
  rows and ``cand.numel()`` (enough rows? else an error; how many victims).
- ``_commit_lookup``: ``found[hit]`` (only when rows are evicted); ``_evict``'s filter of a
  pending gradient (a boolean mask) and its index rebuild's ``nonzero`` of the live rows;
  ``_init_rows``' ``nonzero`` of each initializer's pairs (only when the group's tables have
  different initializers); ``(found >= 0).nonzero()`` and ``(slot > 0).nonzero()`` (only when
  some pairs were not admitted: the rows seen and the gradient's kept segments); the TTL
  ``nonzero`` of expired rows (``eviction="ttl"`` only). ``_allocate`` and ``_grow`` read only
  shapes already on the host (the free stack's length).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["find", "insert"]

_BLOCK = 128  # pairs per program


@triton.jit
def _home(key, tab, mask):
    """HashStorage._hash(key, tab) & mask: splitmix64's finaliser of ``key ^ tab * golden``,
    in uint64 (wrapping multiplies, logical shifts), then kept below 2**62 and masked."""
    x = key.to(tl.uint64, bitcast=True) ^ (tab.to(tl.uint64, bitcast=True) * 0x9E3779B97F4A7C15)
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB
    x = x ^ (x >> 31)
    return (x & ((1 << 62) - 1)).to(tl.int64, bitcast=True) & mask


@triton.jit
def _find_kernel(hrow_ptr, mask, keys_ptr, tabs_ptr, home_ptr, out_ptr, n, BLOCK: tl.constexpr, HOME: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # (B,)
    live = offs < n
    key = tl.load(keys_ptr + offs, mask=live, other=0)
    tab = tl.load(tabs_ptr + offs, mask=live, other=0).to(tl.int64)
    if HOME:
        pos = tl.load(home_ptr + offs, mask=live, other=0)
    else:
        pos = _home(key, tab, mask)
    out = tl.full([BLOCK], -1, tl.int64)
    steps = 0  # at most H probes (the index is at most half full: a guard, never reached)
    while (tl.max(live.to(tl.int32), 0) > 0) & (steps <= mask):
        k = tl.load(hrow_ptr + 2 * pos, mask=live, other=-1)
        word = tl.load(hrow_ptr + 2 * pos + 1, mask=live, other=-1)
        hit = live & (k == key) & ((word >> 32) == tab)  # (an empty word's table, -1, is no table)
        out = tl.where(hit, word - ((word >> 32) << 32), out)  # the slot word
        live = live & ~hit & (word >= 0)  # an empty position: absent
        pos = (pos + 1) & mask
        steps += 1
    tl.store(out_ptr + offs, out, mask=offs < n)


@triton.jit
def _insert_kernel(hrow_ptr, mask, keys_ptr, tabs_ptr, slots_ptr, home_ptr, n, BLOCK: tl.constexpr, HOME: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # (B,)
    live = offs < n
    key = tl.load(keys_ptr + offs, mask=live, other=0)
    tab = tl.load(tabs_ptr + offs, mask=live, other=0).to(tl.int64)
    word = (tab << 32) | tl.load(slots_ptr + offs, mask=live, other=0).to(tl.int64)
    if HOME:
        pos = tl.load(home_ptr + offs, mask=live, other=0)
    else:
        pos = _home(key, tab, mask)
    steps = 0
    while (tl.max(live.to(tl.int32), 0) > 0) & (steps <= mask):
        # atomic_cas has no mask: a finished lane compares with -2, which no word holds
        cmp = tl.where(live, -1, -2).to(tl.int64)
        old = tl.atomic_cas(hrow_ptr + 2 * pos + 1, cmp, tl.where(live, word, -2).to(tl.int64))
        won = live & (old == -1)
        tl.store(hrow_ptr + 2 * pos, key, mask=won)
        live = live & ~won  # lost, or the position was taken: probe on
        pos = tl.where(live, (pos + 1) & mask, pos)
        steps += 1


def _grid(n: int):
    return (triton.cdiv(n, _BLOCK),)


def find(
    hrow: torch.Tensor, mask: int, keys: torch.Tensor, tabs: torch.Tensor, home: torch.Tensor | None = None
) -> torch.Tensor:
    """(U,) int64 slots of pairs ``keys`` (U,) int64, ``tabs`` (U,) int32 in index ``hrow`` (H, 2)
    of ``mask`` = H - 1; -1 where absent. ``home`` (U,) int64: the pairs' home positions (None:
    the storage's hash, computed in the kernel)."""
    out = torch.empty(keys.shape, dtype=torch.int64, device=keys.device)
    n = keys.numel()
    if n:
        keys = keys.contiguous()
        at = keys if home is None else home.contiguous()
        _find_kernel[_grid(n)](hrow, mask, keys, tabs.contiguous(), at, out, n, _BLOCK, home is not None)
    return out


def insert(
    hrow: torch.Tensor,
    mask: int,
    keys: torch.Tensor,
    tabs: torch.Tensor,
    slots: torch.Tensor,
    home: torch.Tensor | None = None,
) -> None:
    """Adds absent, distinct pairs ``keys`` (U,), ``tabs`` (U,) pointing at ``slots`` (U,) to index
    ``hrow`` (H, 2) in place, each at the first empty position from its home (``home`` (U,), or
    None: the storage's hash, computed in the kernel)."""
    n = keys.numel()
    if n:
        keys = keys.contiguous()
        at = keys if home is None else home.contiguous()
        _insert_kernel[_grid(n)](
            hrow, mask, keys, tabs.contiguous(), slots.contiguous(), at, n, _BLOCK, home is not None
        )
