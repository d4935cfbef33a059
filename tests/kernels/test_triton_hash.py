"""The Triton hash-index kernels (find, insert) against the eager index of HashStorage.

On the CPU they run through Triton's interpreter (the root conftest.py sets TRITON_INTERPRET=1),
slow: sizes here are hundreds of ids. A storage with kernels="triton" must end with the same
slots, ids, counters and sketch as an eager one, bit for bit; only the index's layout may differ
(which pair wins a contested position), never what it holds. Rows and optimizer state match up
to the float rounding of the Triton lookup and fused update.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import hybridembed as he  # noqa: E402
from hybridembed.kernels import triton_hash  # noqa: E402

DIM = 4
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # (the interpreter on the CPU)
_INT64 = torch.iinfo(torch.int64)


@pytest.fixture
def calls(monkeypatch):
    """Counts the Triton kernel launches (so an equivalence cannot pass on the eager path alone)."""
    n = {"find": 0, "insert": 0}

    def counted(name):
        real = getattr(triton_hash, name)

        def run(*args):
            n[name] += 1
            return real(*args)

        return run

    for name in n:
        monkeypatch.setattr(triton_hash, name, counted(name))
    return n


def index_rows(hrow: torch.Tensor) -> torch.Tensor:
    """The (key, table << 32 | slot) rows an index holds, wherever they sit, ordered by slot."""
    held = hrow[hrow[:, 1] >= 0]
    return held[torch.argsort(held[:, 1])]


def empty_index(st, h: int) -> None:
    st._hrow = torch.full((h, 2), -1, dtype=torch.int64)
    st._claim = torch.full((h,), -1, dtype=torch.int32)
    st._mask = h - 1


def test_find_and_insert_match_the_eager_index_when_nearly_full():
    h = 128
    ec = he.EmbeddingCollection(
        [he.TableConfig(n, None, DIM, dynamic=he.Dynamic()) for n in ("a", "b")], kernels="eager"
    )
    st = ec.storage_of("a")
    g = torch.Generator().manual_seed(1)
    special = torch.tensor([_INT64.min, _INT64.max, -1, 0, 1, -(2**62), 2**62])
    pool = torch.cat([special, torch.randint(_INT64.min, _INT64.max, (3000,), generator=g), torch.arange(-40, 40)])
    pool = torch.unique(pool)
    keys = torch.cat([pool, pool])  # every key in both tables (same id, another pair)
    tabs = torch.cat([torch.zeros_like(pool), torch.ones_like(pool)]).to(torch.int32)
    home = st._hash(keys, tabs) & (h - 1)
    order = torch.randperm(keys.numel(), generator=g)
    near_end = order[home[order] >= h - 8][:30]  # crowd the last positions: chains wrap to 0
    others = order[home[order] < h - 8][:80]
    specials = (torch.isin(keys, special) & (tabs == 0)).nonzero().squeeze(1)
    chosen = torch.unique(torch.cat([near_end, others, specials]))
    assert 110 <= chosen.numel() <= 117  # of 128 positions: nearly full
    k, t = keys[chosen], tabs[chosen]
    slots = torch.randperm(chosen.numel(), generator=g) + 1

    empty_index(st, h)
    st._insert(k, t, slots)
    eager = st._hrow
    on = lambda *xs: [x.to(DEVICE) for x in xs]  # noqa: E731
    tri = torch.full((h, 2), -1, dtype=torch.int64, device=DEVICE)
    triton_hash.insert(tri, h - 1, *on(k, t, slots, home[chosen]))
    tri = tri.cpu()
    assert torch.equal(index_rows(tri), index_rows(eager))  # the same pairs, maybe elsewhere
    at = (tri[:, 1] >= 0).nonzero().squeeze(1)
    at_home = st._hash(tri[at, 0], (tri[at, 1] >> 32).to(torch.int32)) & (h - 1)
    assert bool((at < at_home).any())  # some probe sequence wrapped from H-1 to 0

    held = dict(zip(zip(k.tolist(), t.tolist()), slots.tolist()))
    absent = order[~torch.isin(order, chosen)][:40]
    qk = torch.cat([k, keys[absent], k])  # held pairs, absent pairs, held ids in the other table
    qt = torch.cat([t, tabs[absent], 1 - t])
    want = torch.tensor([held.get(p, -1) for p in zip(qk.tolist(), qt.tolist())])
    assert 0 < int((want < 0).sum()) < qk.numel()
    qhome = st._hash(qk, qt) & (h - 1)
    for index in (eager, tri):
        st._hrow = index
        got = triton_hash.find(*on(index), h - 1, *on(qk, qt, qhome))  # (3 programs)
        assert torch.equal(got.cpu(), want)
        assert torch.equal(st._find(qk, qt), want)  # the eager reference on the same index


def test_the_kernels_hash_is_the_storages():
    """find/insert without ``home`` hash in the kernel: the same positions as the storage's torch
    ``_hash`` (any int64 id, several tables), so either side finds what the other inserted. The
    index is sparse (300 pairs in 2**16 positions): a pair probed from another home meets an empty
    position and is reported absent."""
    st = he.EmbeddingCollection([he.TableConfig("a", None, DIM, dynamic=he.Dynamic())], kernels="eager").storage_of("a")
    g = torch.Generator().manual_seed(5)
    keys = torch.cat(
        [torch.tensor([_INT64.min, _INT64.max, -1, 0, 1]), torch.randint(_INT64.min, _INT64.max, (295,), generator=g)]
    )
    tabs = torch.randint(0, 7, (300,), generator=g, dtype=torch.int32)
    keys, tabs = keys.to(DEVICE), tabs.to(DEVICE)
    h = 1 << 16
    home = (st._hash(keys.cpu(), tabs.cpu()) & (h - 1)).to(DEVICE)
    slots = torch.arange(1, 301, device=DEVICE)
    for given_at_insert in (True, False):
        hrow = torch.full((h, 2), -1, dtype=torch.int64, device=DEVICE)
        triton_hash.insert(hrow, h - 1, keys, tabs, slots, home if given_at_insert else None)
        assert torch.equal(triton_hash.find(hrow, h - 1, keys, tabs, None if given_at_insert else home), slots)
        if not given_at_insert:  # (no two pairs share a home here: each sits at its own)
            assert home.unique().numel() == keys.numel()
            assert torch.equal(hrow[home, 0], keys)


def test_find_of_no_keys_and_insert_of_none():
    hrow = torch.full((16, 2), -1, dtype=torch.int64, device=DEVICE)
    e = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    assert triton_hash.find(hrow, 15, e, e.to(torch.int32), e).shape == (0,)
    assert triton_hash.find(hrow, 15, e, e.to(torch.int32)).shape == (0,)
    triton_hash.insert(hrow, 15, e, e.to(torch.int32), e, e)
    triton_hash.insert(hrow, 15, e, e.to(torch.int32), e)
    assert bool((hrow == -1).all())


# --- a Triton-backed storage against an eager one ------------------------------------------------
CONFIGS = {
    "growth": he.Dynamic(initial_rows=4),
    "admission": he.Dynamic(min_count=2, admit_probability=0.6, sketch_width=64, initial_rows=8),
    "lru": he.Dynamic(capacity=10, eviction="lru", evict_fraction=0.2),
    "lfu": he.Dynamic(capacity=10, eviction="lfu"),
    "ttl": he.Dynamic(capacity=12, eviction="ttl", ttl_steps=2),
}
_BUFFERS = (
    "slot_key",
    "slot_table",
    "last_seen",
    "freq",
    "free",
    "counters",
    "size",
    "sketch",
)  # (not the torch ops' claims: scratch)


def batches(steps: int, bags: int, per_bag: int, span: int, seed: int = 0):
    """Random training batches of features "a" and "b": small ids (negative too) shared by both
    tables, and a few huge ones."""
    g = torch.Generator().manual_seed(seed)
    huge = torch.tensor([_INT64.min, _INT64.max, 2**62 + 5, -(2**61)])
    out = []
    for _ in range(steps):
        step = {}
        for f in ("a", "b"):
            lengths = torch.randint(0, per_bag + 1, (bags,), generator=g)
            ids = torch.randint(-span, span, (int(lengths.sum()),), generator=g)
            swap = torch.rand(ids.shape, generator=g) < 0.1
            ids[swap] = huge[torch.randint(0, 4, (int(swap.sum()),), generator=g)]
            step[f] = he.Jagged.from_lengths(ids, lengths)
        out.append(step)
    return out


def train(dynamic: he.Dynamic, kernels: str, data, device="cpu"):
    tables = [he.TableConfig(n, None, DIM, dynamic=dynamic) for n in ("a", "b")]
    ec = he.EmbeddingCollection(tables, seed=3, device=device, kernels=kernels)
    opt = he.wrap_optimizer(torch.optim.Adagrad(ec.parameters(), lr=0.1), ec)
    g = torch.Generator().manual_seed(5)
    outs = []
    for step in data:
        opt.zero_grad()
        out = ec({f: j.to(device) for f, j in step.items()})
        loss = sum((o * torch.randn(o.shape, generator=g).to(device)).sum() for o in out.values())
        loss.backward()
        opt.step()
        outs.append(out)
    ec.eval()
    with torch.no_grad():
        outs.append(ec({f: j.to(device) for f, j in data[0].items()}))  # eval: find only
    return ec, outs


def assert_same_storage(a, b, exact: bool = True):
    same = torch.equal if exact else lambda x, y: torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6) is None
    assert a.clock == b.clock
    live = (a.slot_table >= 0).nonzero().squeeze(1)  # (free slots hold whatever torch.empty left)
    assert same(a.weight[0], b.weight[0]) and same(a.weight[live], b.weight[live])
    for name in _BUFFERS:
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert a.state.keys() == b.state.keys()
    for k in a.state:
        assert same(a.state[k], b.state[k]), k
    assert torch.equal(a._gen.get_state(), b._gen.get_state())
    assert torch.equal(index_rows(a._hrow).cpu(), index_rows(b._hrow).cpu())


@pytest.mark.skipif(DEVICE == "cuda", reason="the interpreter's form; on a GPU: the _on_the_gpu test below")
@pytest.mark.parametrize("name", list(CONFIGS))
def test_triton_storage_trains_like_eager(name, calls):
    """The index, slots, counters and sketch bit-identical; rows and optimizer state equal up to the
    float rounding of the Triton lookup and fused update (summation order)."""
    data = batches(steps=4, bags=4, per_bag=2, span=12, seed=len(name))
    eager, want = train(CONFIGS[name], "eager", data)
    assert calls == {"find": 0, "insert": 0}
    tri, got = train(CONFIGS[name], "triton", data)
    assert calls["find"] >= len(data) + 1 and calls["insert"] >= 1
    for w, o in zip(want, got):
        assert w.keys() == o.keys()
        for f in w:
            torch.testing.assert_close(o[f], w[f], rtol=1e-5, atol=1e-6)
    a, b = eager.storage_of("a"), tri.storage_of("a")
    assert a is eager.storage_of("b")  # one storage for both tables: pairs salted by table
    assert_same_storage(a, b, exact=False)
    stats = a.stats()
    if name == "growth":
        assert a.weight.shape[0] - 1 > CONFIGS[name].initial_rows
    if name == "admission":
        assert stats["rejected"] > 0
    if name in ("lru", "lfu", "ttl"):
        assert stats["evicted"] > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["growth", "admission", "lru"])
def test_triton_storage_trains_like_eager_on_the_gpu(name):
    dynamic = {
        "growth": he.Dynamic(initial_rows=1024),
        "admission": he.Dynamic(min_count=2, admit_probability=0.7),
        "lru": he.Dynamic(capacity=20_000, eviction="lru"),
    }[name]
    data = batches(steps=6, bags=2048, per_bag=8, span=30_000, seed=1)
    eager, want = train(dynamic, "eager", data, device="cuda")
    tri, got = train(dynamic, "triton", data, device="cuda")
    # slots, ids and counters exactly; floats up to the order of CUDA's atomic adds
    for w, o in zip(want, got):
        for f in w:
            torch.testing.assert_close(o[f], w[f], rtol=1e-5, atol=1e-6)
    assert_same_storage(eager.storage_of("a"), tri.storage_of("a"), exact=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_triton_lookup_of_known_ids_syncs_less_than_eager_on_the_gpu():
    import warnings

    def syncs(kernels: str) -> int:
        tables = [he.TableConfig(n, None, DIM, dynamic=he.Dynamic(initial_rows=4096)) for n in ("a", "b")]
        ec = he.EmbeddingCollection(tables, device="cuda", kernels=kernels)
        step = {f: j.to("cuda") for f, j in batches(steps=1, bags=512, per_bag=4, span=2000)[0].items()}
        ec(step)  # makes the rows: the lookup below finds every id (several probing rounds in eager)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                ec(step)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return len(caught)

    assert syncs("triton") < syncs("eager")
