"""The header's all-to-all carries the ids after it (``headers_and_ints``): every rank receives
exactly what every rank sent it, in one collective when each pair's int64s fit the capacity its
last exchange set and in two when some did not, through growing, shrinking, empty and oversized
steps and a failed rank's header."""

from __future__ import annotations

import torch

from hybridembed.distributed import exchange as wire
from hybridembed.distributed.exchange import Capacity, Header, headers_and_ints
from hybridembed.launch import spawn

# per step, the int64s rank s sends rank d: sizes[step][s][d]; None: rank s fails that step
SIZES = [
    [[5, 7, 0], [3, 3, 3], [1, 0, 9]],  # first step: nothing fits (capacities are 0)
    [[5, 7, 0], [3, 3, 3], [1, 0, 9]],  # the same again: one collective
    [[4, 7, 0], [3, 2, 3], [1, 0, 10]],  # fewer, or up to an eighth more: one collective
    [[40, 7, 0], [3, 2, 3], [1, 0, 10]],  # one pair grows: every rank takes part in the second
    [[0, 0, 0], [0, 0, 0], [0, 0, 0]],  # nothing at all
    [[2, 1, 1], [wire.MERGE_INTS + 5, 2, 2], [1, 1, 1]],  # more than a header ever carries
    [[2, 1, 1], [wire.MERGE_INTS + 5, 2, 2], [1, 1, 1]],  # ... still sent apart (capacity 0)
    [[6, 6, 6], None, [6, 6, 6]],  # rank 1 fails: the others send ids, nobody reads any
    [[6, 6, 6], [6, 6, 6], [6, 6, 6]],  # the capacities after a failed step agree on both ends
]


def _ints(step: int, src: int, dst: int, n: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.int64) + 1000 * (100 * step + 10 * src + dst)


def _steps(rank: int, world: int) -> list[tuple[int, bool]]:
    calls = []
    real = wire.exchange

    def counted(*a, **k):
        calls.append(1)
        return real(*a, **k)

    wire.exchange = counted
    cap = Capacity.of(world)
    group = torch.distributed.group.WORLD
    out = []
    for step, sizes in enumerate(SIZES):
        mine = sizes[rank]
        failed = int(mine is None)
        ints = None if failed else [_ints(step, rank, d, n) for d, n in enumerate(mine)]
        heads = [Header(failed, 0, 7, 0 if failed else n, 0) for n in (mine or [0] * world)]
        calls.clear()
        got, got_ints = headers_and_ints(heads, ints, cap, group, torch.device("cpu"))
        assert [h.failed for h in got] == [int(s is None) for s in sizes]
        if any(s is None for s in sizes):
            assert got_ints is None
        else:
            for src, x in enumerate(got_ints):
                assert torch.equal(x, _ints(step, src, rank, sizes[src][rank])), (step, src, x)
        out.append((len(calls), [h.more for h in got]))
    return out


def test_ids_ride_after_the_header_and_every_rank_gets_what_was_sent():
    res = spawn(_steps, 3, timeout=120)
    assert res[0] == res[1] == res[2]  # every rank made the same collectives
    collectives = [n for n, _ in res[0]]
    assert collectives == [2, 1, 1, 2, 1, 2, 2, 1, 2], collectives
