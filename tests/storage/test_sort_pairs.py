"""``sort_pairs`` (the dynamic lookup's one sort) and the distinct-rows gradient it enables.

Both key paths are checked against plain Python: the exact key (ids spanning fewer values
than the key's bits) and the hashed key (any int64), including ids built to share a hash.
"""

from __future__ import annotations

import pytest
import torch

import hybridembed as he
from hybridembed.storage.pairs import _MUL, sort_pairs

CASES = {  # lo, hi, tables: the exact key (ids span < the key's bits) or the hashed one
    "exact key": (0, 1000, 3),
    "exact key, negative ids": (-500, 500, 1),
    "hashed key": (-(2**40), 2**40, 5),
    "hashed key, full range": (-(2**63), 2**63 - 1, 4),
}


def _colliding_ids(count: int, bits: int) -> list[int]:
    """Distinct int64 ids whose multiplicative hash (the key's id part) is the same."""
    mod = 1 << 64
    inv = pow(_MUL % mod, -1, mod)
    ids = []
    for r in range(count):
        x = (12345 << (64 - bits)) | (r * 7919 + 1)  # same top ``bits``, different low bits
        v = (x * inv) % mod
        ids.append(v - mod if v >= 1 << 63 else v)
    return ids


def check_grouping(ids, tabs, num_tables, exact):
    keys, ktabs, perm, counts = sort_pairs(ids, tabs, num_tables)
    pairs = list(zip(tabs.tolist(), ids.tolist()))
    got = list(zip(ktabs.tolist(), keys.tolist()))
    assert sorted(got) == sorted(set(pairs))  # each distinct pair once
    assert ktabs.tolist() == sorted(ktabs.tolist())  # table-major
    if exact:
        assert got == sorted(got)  # ascending ids inside a table
    assert counts.tolist() == [pairs.count(p) for p in got]
    assert sorted(perm.tolist()) == list(range(len(pairs)))  # a permutation
    start = 0
    for p, c in zip(got, counts.tolist()):
        run = perm[start : start + c].tolist()
        assert all(pairs[j] == p for j in run)
        assert run == sorted(run)  # stable: positions ascending inside a run
        start += c


@pytest.mark.parametrize("case", CASES)
def test_sort_pairs_groups_equal_pairs_table_by_table(case):
    lo, hi, num_tables = CASES[case]
    gen = torch.Generator().manual_seed(7)
    pool = torch.cat([torch.randint(lo, hi, (40,), generator=gen), torch.tensor([lo, hi - 1, 0])])
    ids = pool[torch.randint(0, pool.numel(), (300,), generator=gen)]  # many repeats
    tabs = torch.randint(0, num_tables, (300,), generator=gen, dtype=torch.int32)
    check_grouping(ids, tabs, num_tables, exact=case.startswith("exact"))


def test_sort_pairs_separates_ids_that_share_a_hash():
    """Different ids with one hashed key land in one run of the sort and must be split."""
    num_tables = 2
    bits = 31 - (num_tables - 1).bit_length()
    same = _colliding_ids(4, bits)
    ids = torch.tensor(same * 3 + [2**62, -(2**62), same[0]])[
        torch.randperm(15, generator=torch.Generator().manual_seed(0))
    ]
    tabs = torch.tensor([0, 1, 0, 0, 1, 1, 0, 1, 0, 0, 1, 0, 1, 0, 0], dtype=torch.int32)
    keys = ((ids * _MUL) >> (64 - bits)) & ((1 << bits) - 1)
    assert keys[torch.isin(ids, torch.tensor(same))].unique().numel() == 1  # they do collide
    check_grouping(ids, tabs, num_tables, exact=False)


def test_sort_pairs_of_nothing():
    keys, ktabs, perm, counts = sort_pairs(torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int32), 3)
    assert keys.numel() == ktabs.numel() == perm.numel() == counts.numel() == 0


@pytest.mark.parametrize("opt", [he.optim.SGD(lr=0.1), he.optim.Adagrad(lr=0.1)], ids=["additive", "gathered"])
def test_apply_takes_distinct_rows_in_any_order(opt):
    """The dynamic backward hands over distinct but unsorted rows; the update must not care."""
    ec_sorted, ec_shuffled = (he.EmbeddingCollection([he.TableConfig("t", 50, 4)]) for _ in range(2))
    for ec in (ec_sorted, ec_shuffled):
        he.wrap_optimizer(torch.optim.SGD(ec.parameters(), lr=0.1), ec, sparse=opt)
    ids = torch.tensor([3, 7, 8, 20, 41, 49])
    grad = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
    order = torch.tensor([4, 0, 5, 2, 1, 3])
    st_a, st_b = ec_sorted.storages[0], ec_shuffled.storages[0]
    st_a.apply_gradient(ids, grad, st_a.hparams)
    st_b.apply_gradient(ids[order], grad[order], st_b.hparams)
    torch.testing.assert_close(ec_sorted.weight("t"), ec_shuffled.weight("t"), rtol=0, atol=0)
    for k in st_a.state:
        torch.testing.assert_close(st_a.state[k], st_b.state[k], rtol=0, atol=0)


def test_dynamic_gradient_rows_are_distinct_and_skip_ids_without_a_row():
    """min_count=2: an id seen once reads the default row and gets no gradient row; the others'
    gradient is the sum over every bag that read them."""
    ec = he.EmbeddingCollection([he.TableConfig("t", None, 3, dynamic=he.Dynamic(min_count=2))], kernels="eager")
    ids = he.Jagged.from_lists([[5, 9], [5], [9, 9, 11], [5]])  # 5 three times, 9 three times, 11 once
    out = ec({"t": ids})["t"]
    up = torch.randn(4, 3, generator=torch.Generator().manual_seed(1))
    (out * up).sum().backward()
    st = ec.storages[0]
    rows, grad = st.grad_rows()
    assert rows.unique().numel() == rows.numel() and bool((rows > 0).all())
    got = {int(st.slot_key[r]): g for r, g in zip(rows, grad)}
    assert sorted(got) == [5, 9]
    torch.testing.assert_close(got[5], up[0] + up[1] + up[3])
    torch.testing.assert_close(got[9], up[0] + 2 * up[2])


def test_a_reduced_gradient_reaches_the_optimizer_unsorted_and_the_module_still_pickles():
    """Rows made for ids 9 then 5 sit in slots in that order; a batch [5, 9] reduces to rows in
    id order, i.e. descending slots. The mark lets the step take them as they are (no sort),
    and it does not stop the module from being saved whole."""
    import io

    ec = he.EmbeddingCollection([he.TableConfig("t", None, 3, dynamic=he.Dynamic())], kernels="eager")
    opt = he.wrap_optimizer(torch.optim.SGD(ec.parameters(), lr=0.1), ec)
    ec({"t": torch.tensor([9])})["t"].sum().backward()
    opt.step()
    opt.zero_grad()
    ec({"t": torch.tensor([5])})["t"].sum().backward()
    opt.step()
    opt.zero_grad()
    ec({"t": he.Jagged.from_lists([[5, 9], [9]])})["t"].sum().backward()
    st = ec.storages[0]
    rows, grad = st.grad_rows()
    slot_of = {int(st.slot_key[s]): int(s) for s in rows}
    assert slot_of[9] < slot_of[5] and rows.tolist() == [slot_of[5], slot_of[9]]  # unsorted, as reduced
    torch.testing.assert_close(grad, torch.tensor([[1.0] * 3, [2.0] * 3]))
    opt.step()
    torch.save(ec, io.BytesIO())
    st.weight.grad.mul_(1.0)  # (in place, same rows: still marked)
    assert st.grad_rows()[0].tolist() == rows.tolist()
