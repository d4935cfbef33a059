"""``EmbeddingCollection`` against an independent reference.

Run: python -m pytest -q tests/modules/test_collection.py

Reference: ``torch.nn.functional.embedding_bag`` / ``embedding`` per feature on a detached
copy of each table's rows, or, where PyTorch has no such mode (weighted mean, sqrtn),
the TensorFlow formulas written out by hand:
    weighted mean = sum(w * row) / sum(w)            (0 when sum(w) == 0 or the bag is empty)
    sqrtn         = sum(w * row) / sqrt(sum(w ** 2)) (unweighted: divide by sqrt(len))
Shape legend: B batch, D dim, T longest sequence.
"""

import random

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import hybridembed as he

DIMS = (2, 3, 4, 8)
POOLED = ("sum", "mean", "sqrtn")


# --- input forms ---------------------------------------------------------------------------

FORMS = ("jagged", "tuple", "tensor1d", "padded", "lists", "sparse")


def make_input(form, bags, wbags, rng, pad=-1):
    """The bags (list of lists of ids) and optional weights in the given input form."""
    values = torch.tensor([i for b in bags for i in b], dtype=torch.int64)
    lengths = torch.tensor([len(b) for b in bags], dtype=torch.int64)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    weights = None if wbags is None else torch.tensor([w for b in wbags for w in b], dtype=torch.float32)
    if form == "jagged":
        return he.Jagged(values, offsets, weights)
    if form == "tuple":
        return (values, offsets) if weights is None else (values, offsets, weights)
    if form == "lists":
        return [list(b) for b in bags] if wbags is None else he.Jagged.from_lists(bags, wbags)
    if form == "tensor1d":
        assert all(len(b) <= 1 for b in bags)
        ids = torch.tensor([b[0] if b else pad for b in bags], dtype=torch.int64)
        if wbags is None:
            return ids
        return he.Jagged.from_tensor(ids, pad=pad, weights=torch.tensor([w[0] if w else 0.0 for w in wbags]))
    # padded / sparse: ids at random sorted columns of a (B, H) layout
    width = max([len(b) for b in bags], default=0) + rng.randint(0, 2)
    ids = torch.full((len(bags), width), pad, dtype=torch.int64)
    w2d = torch.zeros(len(bags), width)
    entries = []
    for b, bag in enumerate(bags):
        for k, col in enumerate(sorted(rng.sample(range(width), len(bag)))):
            ids[b, col] = bag[k]
            w2d[b, col] = 0.0 if wbags is None else wbags[b][k]
            entries.append((b, col, bag[k], 0.0 if wbags is None else wbags[b][k]))
    if form == "padded":
        return ids if wbags is None else he.Jagged.from_dense(ids, pad=pad, weights=w2d)
    assert form == "sparse"
    rng.shuffle(entries)
    idx = torch.tensor([[e[0] for e in entries], [e[1] for e in entries]], dtype=torch.int64).reshape(2, -1)
    shape = (len(bags), width)
    coo = torch.sparse_coo_tensor(
        idx, torch.tensor([e[2] for e in entries], dtype=torch.int64), shape, check_invariants=True
    )
    if wbags is None:
        return coo
    wcoo = torch.sparse_coo_tensor(idx, torch.tensor([e[3] for e in entries]), shape, check_invariants=True)
    return he.Jagged.from_sparse(coo, wcoo)


# --- the reference ----------------------------------------------------------------------------


def ref_pooled(W, bags, w, combiner):
    """(B, D) pooled rows of W (R, D) for bags; w: (N,) weights in W's dtype or None."""
    values = torch.tensor([i for b in bags for i in b], dtype=torch.int64)
    lengths = [len(b) for b in bags]
    offsets = torch.tensor([0] + lengths[:-1], dtype=torch.int64).cumsum(0)
    if w is None and combiner in ("sum", "mean"):
        return F.embedding_bag(values, W, offsets, mode=combiner)
    if combiner == "sum":
        return F.embedding_bag(values, W, offsets, mode="sum", per_sample_weights=w)
    out, start = [], 0
    for n in lengths:
        rows = W[values[start : start + n]]  # (L, D)
        ww = torch.ones(n, dtype=W.dtype) if w is None else w[start : start + n]
        start += n
        s = (ww[:, None] * rows).sum(0)
        denom = ww.sum() if combiner == "mean" else (ww * ww).sum().sqrt()
        out.append(s / denom if float(denom.detach()) != 0 else s * 0)  # s * 0 keeps the graph
    return torch.stack(out) if out else W.new_zeros(0, W.shape[1])


def ref_sequence(W, bags, w):
    """(N, D) rows, each times its weight."""
    values = torch.tensor([i for b in bags for i in b], dtype=torch.int64)
    rows = F.embedding(values, W)
    return rows if w is None else rows * w[:, None]


def pad_sequence(rows, bags):
    """(N, D) -> zero-padded (B, T, D)."""
    t = max([len(b) for b in bags], default=0)
    out = rows.new_zeros(len(bags), t, rows.shape[1])
    start = 0
    for b, bag in enumerate(bags):
        out[b, : len(bag)] = rows[start : start + len(bag)]
        start += len(bag)
    return out


def reference_leaves(ec):
    """{table: leaf (R, D) copy of the rows in the table's compute dtype, requires grad}."""
    return {t: ec.weight(t).detach().clone().to(cfg.compute_dtype).requires_grad_() for t, cfg in ec.tables.items()}


def reference_forward(ec, leaves, batch, sequence_output="jagged"):
    """batch: {feature: (bags, weights tensor or None)} -> {feature: output}."""
    out = {}
    for f, (bags, w) in batch.items():
        cfg = ec.tables[ec.features[f]]
        W = leaves[cfg.name]
        ww = None if w is None else w.to(cfg.compute_dtype)
        if cfg.combiner == "none":
            rows = ref_sequence(W, bags, ww)
            out[f] = rows if sequence_output == "jagged" else pad_sequence(rows, bags)
        else:
            out[f] = ref_pooled(W, bags, ww, cfg.combiner)
    return out


def as_tensor(x):
    return x.values if isinstance(x, he.Jagged) else x


def table_grad(ec, table):
    """The collection's gradient of one table's rows, dense (num_embeddings, D)."""
    storage = ec.storage_of(table)
    g = storage.weight.grad
    n = ec.tables[table].num_embeddings
    if g is None:
        return torch.zeros(n, storage.dim, dtype=storage.dtype)
    g = g.coalesce().to_dense() if g.is_sparse else g
    start = storage.row_offset[table]
    return g[start : start + n]


def random_probes(outputs, gen):
    return {f: torch.randn(as_tensor(o).shape, generator=gen, dtype=torch.float64) for f, o in outputs.items()}


def linear_loss(outputs, probes):
    return sum((as_tensor(o).double() * probes[f]).sum() for f, o in outputs.items())


def tol(dtype):
    return {"rtol": 1e-12, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-6}


def check_against_reference(ec, inputs, batch, sequence_output="jagged", seed=0):
    """Forward values and row gradients of ``ec`` on ``inputs`` equal the reference on ``batch``."""
    leaves = reference_leaves(ec)
    out = ec(inputs)
    ref = reference_forward(ec, leaves, batch, sequence_output)
    assert list(out) == list(ec.features)
    for f in batch:
        cfg = ec.tables[ec.features[f]]
        got = out[f]
        if cfg.combiner == "none" and sequence_output == "jagged":
            assert isinstance(got, he.Jagged)
            lengths = torch.tensor([len(b) for b in batch[f][0]], dtype=torch.int64)
            assert torch.equal(got.offsets.long(), torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]))
            got = got.values
        assert got.dtype == cfg.compute_dtype, f
        assert got.shape == ref[f].shape, f
        torch.testing.assert_close(got, ref[f].detach(), **tol(cfg.compute_dtype), msg=lambda m, f=f: f"{f}: {m}")
    probes = random_probes(ref, torch.Generator().manual_seed(seed))
    linear_loss(out, probes).backward()
    linear_loss(ref, probes).backward()
    for t, leaf in leaves.items():
        expect = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
        got = table_grad(ec, t)
        assert got.dtype == ec.tables[t].dtype
        if got.dtype in (torch.float16, torch.bfloat16):
            # rounded to the storage dtype; allow a few ulps (exact summation of a frequent id is
            # checked by test_half_storage_gradient_of_a_frequent_id)
            rtol = 4e-3 if got.dtype == torch.float16 else 3e-2
            torch.testing.assert_close(got.float(), expect, rtol=rtol, atol=1e-3, msg=lambda m, t=t: f"table {t}: {m}")
        else:
            torch.testing.assert_close(got, expect, **tol(got.dtype), msg=lambda m, t=t: f"table {t}: {m}")
    return out


# --- random table sets and batches ------------------------------------------------------------


@st.composite
def collections(draw, combiners=POOLED, dtypes=(torch.float32, torch.float64)):
    n = draw(st.integers(1, 4))
    tables = [
        he.TableConfig(
            f"t{i}",
            draw(st.integers(1, 50)),
            draw(st.sampled_from(DIMS)),
            combiner=draw(st.sampled_from(combiners)),
            dtype=draw(st.sampled_from(dtypes)),
            init=he.init.normal(std=0.5),
        )
        for i in range(n)
    ]
    features = {f"f{i}": t.name for i, t in enumerate(tables)}
    for k in range(draw(st.integers(0, 2))):  # extra features sharing a table
        features[f"shared{k}"] = draw(st.sampled_from(tables)).name
    order = draw(st.permutations(list(features)))
    return tables, {f: features[f] for f in order}


@st.composite
def batches(draw, ec, weighted=None, min_batch=1):
    """{feature: (bags, weights or None)} and the inputs in random forms."""
    b = draw(st.integers(min_batch, 5))
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    batch, inputs = {}, {}
    for f, t in ec.features.items():
        n = ec.tables[t].num_embeddings
        bags = draw(st.lists(st.lists(st.integers(0, n - 1), max_size=4), min_size=b, max_size=b))
        w = draw(st.booleans()) if weighted is None else weighted
        wbags = None
        if w:
            wbag = st.one_of(st.just(0.0), st.floats(0.25, 2.0, width=32))
            wbags = [draw(st.lists(wbag, min_size=len(x), max_size=len(x))) for x in bags]
        forms = [fm for fm in FORMS if fm != "tensor1d" or all(len(x) <= 1 for x in bags)]
        form = draw(st.sampled_from(forms))
        inputs[f] = make_input(form, bags, wbags, rng)
        weights = None if wbags is None else torch.tensor([x for bag in wbags for x in bag], dtype=torch.float32)
        batch[f] = (bags, weights)
    return batch, inputs


@given(data=st.data())
def test_pooled_matches_reference(data):
    tables, features = data.draw(collections())
    ec = he.EmbeddingCollection(tables, features=features, seed=data.draw(st.integers(0, 3)))
    batch, inputs = data.draw(batches(ec))
    check_against_reference(ec, inputs, batch, seed=data.draw(st.integers(0, 100)))


@given(data=st.data(), sequence_output=st.sampled_from(["jagged", "padded"]))
def test_mixed_pooled_and_sequence_match_reference(data, sequence_output):
    tables, features = data.draw(collections(combiners=(*POOLED, "none")))
    ec = he.EmbeddingCollection(tables, features=features, sequence_output=sequence_output)
    batch, inputs = data.draw(batches(ec))
    check_against_reference(ec, inputs, batch, sequence_output=sequence_output)


@settings(max_examples=10)
@given(data=st.data())
def test_empty_batch(data):
    tables, features = data.draw(collections(combiners=(*POOLED, "none")))
    ec = he.EmbeddingCollection(
        tables, features=features, sequence_output=data.draw(st.sampled_from(["jagged", "padded"]))
    )
    inputs = {f: he.Jagged.from_lists([]) for f in features}
    out = ec(inputs)
    for f, t in features.items():
        cfg = ec.tables[t]
        o = as_tensor(out[f])
        assert o.shape[0] == 0 and o.shape[-1] == cfg.embedding_dim


# --- combiner semantics on hand-made examples -------------------------------------------------


def one_table(combiner, rows=6, dim=3, dtype=torch.float32, **kw):
    return he.EmbeddingCollection(
        [he.TableConfig("t", rows, dim, combiner=combiner, dtype=dtype, init=he.init.normal())], **kw
    )


def test_combiners_by_hand():
    ec = one_table("sum", dtype=torch.float64)
    W = ec.weight("t")
    bags = [[1, 2, 2], [], [5], [0, 3]]
    w = [[0.5, 2.0, 1.0], [], [3.0], [0.0, 0.0]]
    expect = {
        "sum": [W[1] + 2 * W[2], 0 * W[0], W[5], W[0] + W[3]],
        "mean": [(W[1] + 2 * W[2]) / 3, 0 * W[0], W[5], (W[0] + W[3]) / 2],
        "sqrtn": [(W[1] + 2 * W[2]) / 3**0.5, 0 * W[0], W[5], (W[0] + W[3]) / 2**0.5],
    }
    expect_w = {
        "sum": [0.5 * W[1] + 3 * W[2], 0 * W[0], 3 * W[5], 0 * W[0]],
        "mean": [(0.5 * W[1] + 3 * W[2]) / 3.5, 0 * W[0], W[5], 0 * W[0]],
        "sqrtn": [(0.5 * W[1] + 3 * W[2]) / (0.25 + 4 + 1) ** 0.5, 0 * W[0], W[5], 0 * W[0]],
    }
    for combiner in POOLED:
        ec2 = one_table(combiner, dtype=torch.float64)
        assert torch.equal(ec2.weight("t"), W)
        got = ec2({"t": bags})["t"]
        torch.testing.assert_close(got, torch.stack(expect[combiner]))
        got = ec2({"t": he.Jagged.from_lists(bags, w)})["t"]
        torch.testing.assert_close(got, torch.stack(expect_w[combiner]))


def test_weighted_mean_with_negative_weight_sum_follows_tensorflow():
    # TF's embedding_lookup_sparse divides by sum(w) with div_no_nan: only a zero sum gives 0
    ec = one_table("mean", dtype=torch.float64)
    W = ec.weight("t")
    j = he.Jagged.from_lists([[1, 2], [3, 4]], [[-1.0, -3.0], [2.0, -1.0]])
    got = ec({"t": j})["t"]
    expect = torch.stack([(-W[1] - 3 * W[2]) / -4.0, (2 * W[3] - W[4]) / 1.0])
    torch.testing.assert_close(got, expect)


def test_weights_summing_to_zero_give_zero():
    for combiner in ("mean",):
        ec = one_table(combiner, dtype=torch.float64)
        got = ec({"t": he.Jagged.from_lists([[1, 2], [3]], [[1.0, -1.0], [0.0]])})["t"]
        assert torch.equal(got, torch.zeros(2, 3, dtype=torch.float64))
    ec = one_table("sqrtn", dtype=torch.float64)
    assert torch.equal(
        ec({"t": he.Jagged.from_lists([[1, 2]], [[0.0, 0.0]])})["t"], torch.zeros(1, 3, dtype=torch.float64)
    )


def test_duplicate_ids_in_a_bag_accumulate_gradient():
    ec = one_table("sum")
    out = ec({"t": [[2, 2, 2], [2, 4]]})["t"]
    out.sum().backward()
    g = table_grad(ec, "t")
    expect = torch.zeros(6, 3)
    expect[2] = 4.0
    expect[4] = 1.0
    assert torch.equal(g, expect)


def test_one_hot_input_gradient_matches_reference():
    # every bag holds one id (the uncoalesced fast path in the kernel)
    ec = he.EmbeddingCollection(
        [
            he.TableConfig("a", 7, 4, init=he.init.normal()),
            he.TableConfig("b", 5, 4, combiner="mean", init=he.init.normal()),
        ],
        features={"x": "a", "y": "a", "z": "b"},
    )
    bags = {"x": [[3], [3], [0], [6]], "y": [[3], [1], [1], [6]], "z": [[4], [4], [0], [2]]}
    inputs = {f: torch.tensor([b[0] for b in bags[f]]) for f in bags}
    check_against_reference(ec, inputs, {f: (b, None) for f, b in bags.items()})
    ec.zero_grad()
    w = torch.tensor([0.5, 2.0, 3.0, 1.0])
    inputs = {f: he.Jagged.from_tensor(x, weights=w) for f, x in inputs.items()}
    check_against_reference(ec, inputs, {f: (b, w) for f, b in bags.items()})


# --- shared tables and grouping ---------------------------------------------------------------


def test_shared_table_gradients_add_up():
    ec = he.EmbeddingCollection(
        [he.TableConfig("video", 10, 4, init=he.init.normal())],
        features={"watched": "video", "browsed": "video"},
    )
    assert len(ec.state_dict()) == 1
    batch = {"watched": [[1, 2], [3]], "browsed": [[2], [2, 9]]}
    out = ec(batch)
    (out["watched"].sum() + 2 * out["browsed"].sum()).backward()
    expect = torch.zeros(10, 4)
    expect[1] += 1
    expect[2] += 1 + 2 + 2
    expect[3] += 1
    expect[9] += 2
    assert torch.equal(table_grad(ec, "video"), expect)
    W = ec.weight("video")
    torch.testing.assert_close(out["watched"], torch.stack([W[1] + W[2], W[3]]))
    torch.testing.assert_close(out["browsed"], torch.stack([W[2], W[2] + W[9]]))


def test_default_features_are_the_tables():
    ec = he.EmbeddingCollection([he.TableConfig("a", 3, 2), he.TableConfig("b", 4, 3)])
    assert ec.features == {"a": "a", "b": "b"}
    out = ec({"a": torch.tensor([0, 2]), "b": torch.tensor([3, 1])})
    assert torch.equal(out["a"], ec.weight("a")[[0, 2]])
    assert torch.equal(out["b"], ec.weight("b")[[3, 1]])


@given(data=st.data())
def test_one_group_per_dim_and_dtype(data):
    dtypes = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
    tables, features = data.draw(collections(dtypes=dtypes))
    ec = he.EmbeddingCollection(tables, features=features)
    keys = {}
    for t in tables:
        keys.setdefault((t.embedding_dim, t.dtype), []).append(t.name)
    assert sorted(map(sorted, ec.groups)) == sorted(map(sorted, keys.values()))
    assert len(ec.groups) == len(ec.storages)
    for g, names in enumerate(ec.groups):
        storage = ec.storages[g]
        assert [t for t in tables if t.name in names] == [ec.tables[n] for n in names]  # declaration order
        total = 0
        for name in names:
            cfg = ec.tables[name]
            assert ec.storage_of(name) is storage
            assert storage.weight.dtype == cfg.dtype and storage.weight.shape[1] == cfg.embedding_dim
            assert storage.row_offset[name] == total
            assert ec.weight(name).shape == (cfg.num_embeddings, cfg.embedding_dim)
            total += cfg.num_embeddings
        assert storage.weight.shape[0] == total
    # one nn.Parameter per group, and the table views share its memory
    assert len(list(ec.parameters())) == len(keys)
    name = tables[0].name
    before = ec.weight(name)[0, 0].item()
    with torch.no_grad():
        ec.storage_of(name).weight[ec.storage_of(name).row_offset[name], 0] += 1.0
    assert ec.weight(name)[0, 0].item() != before


def test_grouping_example():
    ec = he.EmbeddingCollection(
        [
            he.TableConfig("a", 5, 4),
            he.TableConfig("b", 6, 8),
            he.TableConfig("c", 7, 4, combiner="mean"),
            he.TableConfig("d", 8, 4, dtype=torch.float64),
            he.TableConfig("e", 9, 8, combiner="none"),
        ]
    )
    assert sorted(map(sorted, ec.groups)) == [["a", "c"], ["b", "e"], ["d"]]


# --- sequence output ---------------------------------------------------------------------------


@pytest.mark.parametrize("weighted", [False, True])
def test_sequence_jagged_and_padded(weighted):
    bags = [[1, 4, 4], [], [0], [5, 2]]
    wbags = [[0.5, 1.0, 2.0], [], [3.0], [-1.0, 1.5]] if weighted else None
    for sequence_output in ("jagged", "padded"):
        ec = he.EmbeddingCollection(
            [he.TableConfig("hist", 6, 3, combiner="none", init=he.init.normal())], sequence_output=sequence_output
        )
        W = ec.weight("hist")
        inp = he.Jagged.from_lists(bags, wbags)
        out = ec({"hist": inp})["hist"]
        rows = F.embedding(torch.tensor([i for b in bags for i in b]), W)  # (N, D)
        if weighted:
            rows = rows * inp.weights[:, None]
        if sequence_output == "jagged":
            assert isinstance(out, he.Jagged)
            assert torch.equal(out.offsets, inp.offsets)
            torch.testing.assert_close(out.values, rows)
        else:
            expect = torch.zeros(4, 3, 3)
            expect[0, :3] = rows[0:3]
            expect[2, 0] = rows[3]
            expect[3, :2] = rows[4:6]
            assert out.shape == (4, 3, 3)
            torch.testing.assert_close(out, expect)
    batch = {"hist": (bags, None if not weighted else torch.tensor([x for b in wbags for x in b]))}
    for sequence_output in ("jagged", "padded"):
        ec = he.EmbeddingCollection(
            [he.TableConfig("hist", 6, 3, combiner="none", init=he.init.normal())], sequence_output=sequence_output
        )
        check_against_reference(ec, {"hist": he.Jagged.from_lists(bags, wbags)}, batch, sequence_output=sequence_output)


def test_sequence_padded_all_empty():
    ec = he.EmbeddingCollection([he.TableConfig("hist", 6, 3, combiner="none")], sequence_output="padded")
    out = ec({"hist": [[], []]})["hist"]
    assert out.shape == (2, 0, 3)


# --- half precision storage ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn", "none"])
def test_half_storage_pools_in_float32(dtype, combiner):
    ec = he.EmbeddingCollection(
        [he.TableConfig("t", 20, 8, combiner=combiner, dtype=dtype, init=he.init.normal()), he.TableConfig("u", 5, 8)],
        features={"x": "t", "y": "t", "z": "u"},
    )
    assert ec.storage_of("t").weight.dtype == dtype
    assert ec.storage_of("t") is not ec.storage_of("u")
    bags = {"x": [[1, 2, 3], [], [19, 19]], "y": [[0], [4, 5], [6]], "z": [[1], [2], [3, 4]]}
    wx = torch.tensor([0.5, 1.0, 1.5, 2.0, -1.0])
    inputs = {"x": he.Jagged.from_lists(bags["x"], [[0.5, 1.0, 1.5], [], [2.0, -1.0]]), "y": bags["y"], "z": bags["z"]}
    out = check_against_reference(ec, inputs, {"x": (bags["x"], wx), "y": (bags["y"], None), "z": (bags["z"], None)})
    for f in ("x", "y"):
        assert as_tensor(out[f]).dtype == torch.float32
    with torch.no_grad():
        out2 = ec(inputs)
    for f in out:
        assert torch.equal(as_tensor(out2[f]), as_tensor(out[f]).detach())


def test_half_storage_grad_is_in_storage_dtype_and_close_to_fp32():
    ec = he.EmbeddingCollection([he.TableConfig("t", 10, 4, dtype=torch.bfloat16, init=he.init.normal())])
    ref = ec.weight("t").float().clone().requires_grad_()
    bags = [[1, 1, 2], [3, 9], [1]]
    out = ec({"t": bags})["t"]
    probe = torch.randn(3, 4)
    (out * probe).sum().backward()
    (ref_pooled(ref, bags, None, "sum") * probe).sum().backward()
    g = table_grad(ec, "t")
    assert g.dtype == torch.bfloat16
    torch.testing.assert_close(g, ref.grad.to(torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "combiner, layout",
    [("sum", "one_hot"), ("mean", "one_hot"), ("none", "one_hot"), ("none", "one_bag"), ("sum", "one_bag")],
)
def test_half_storage_gradient_of_a_frequent_id(dtype, combiner, layout):
    # 5,000 lookups of one row: its gradient is 5,000 per element (rounded once to the
    # storage dtype), whether the ids come one per sample, as a sequence, or in one bag.
    # Summing per-occurrence half-precision gradients in half precision stalls at 256 (bf16)
    # or 2048 (fp16).
    n = 5000
    ec = he.EmbeddingCollection([he.TableConfig("t", 4, 2, dtype=dtype, combiner=combiner)])
    ids = torch.zeros(n, dtype=torch.int64) if layout == "one_hot" else [[0] * n]
    as_tensor(ec({"t": ids})["t"]).sum().backward()
    expect = torch.full((2,), float(n)).to(dtype)
    assert torch.equal(table_grad(ec, "t")[0], expect)


# --- autograd details ---------------------------------------------------------------------------


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gradient_wrt_per_id_weights(combiner, dtype):
    ec = he.EmbeddingCollection(
        [
            he.TableConfig("t", 12, 4, combiner=combiner, dtype=dtype, init=he.init.normal()),
            he.TableConfig("u", 5, 4, dtype=dtype),
        ],
        features={"x": "t", "y": "u", "x2": "t"},
    )
    bags = {"x": [[1, 2, 2], [], [11], [0, 5, 7, 3]], "y": [[0], [1, 2], [], [4]], "x2": [[3], [3], [3], []]}
    g = torch.Generator().manual_seed(1)
    weights = {f: (torch.rand(sum(map(len, b)), generator=g) + 0.25).requires_grad_() for f, b in bags.items()}
    ref_weights = {f: w.detach().clone().requires_grad_() for f, w in weights.items()}
    inputs = {
        f: he.Jagged.from_lengths(
            torch.tensor([i for x in b for i in x]), torch.tensor([len(x) for x in b]), weights[f]
        )
        for f, b in bags.items()
    }
    leaves = reference_leaves(ec)
    out = ec(inputs)
    ref = reference_forward(ec, leaves, {f: (b, ref_weights[f]) for f, b in bags.items()})
    probes = random_probes(ref, torch.Generator().manual_seed(2))
    linear_loss(out, probes).backward()
    linear_loss(ref, probes).backward()
    for f in bags:
        assert weights[f].grad is not None, f
        torch.testing.assert_close(
            weights[f].grad, ref_weights[f].grad, rtol=1e-5, atol=1e-6, msg=lambda m, f=f: f"{f}: {m}"
        )
    for t, leaf in leaves.items():
        torch.testing.assert_close(table_grad(ec, t).to(leaf.dtype), leaf.grad, **tol(dtype))


@pytest.mark.parametrize("combiner", ["sum", "mean"])
def test_fixed_hotness_gradient_matches_reference(combiner):
    """Every bag of the group holds 3 ids (unpadded 2-D input): the backward finds an id's
    bag as position // 3 instead of building a bag index; rows and per-id weights must get
    the reference gradients, duplicates within and across bags included."""
    ec = he.EmbeddingCollection(
        [he.TableConfig("t", 9, 4, combiner=combiner, init=he.init.normal())], features={"x": "t", "y": "t"}
    )
    bags = {"x": [[1, 2, 2], [8, 0, 1], [4, 4, 4]], "y": [[2, 3, 1], [5, 6, 7], [0, 0, 8]]}
    g = torch.Generator().manual_seed(3)
    weights = {f: (torch.rand(3, 3, generator=g) + 0.25).requires_grad_() for f in bags}
    ref_weights = {f: w.detach().reshape(-1).clone().requires_grad_() for f, w in weights.items()}
    inputs = {f: he.Jagged.from_dense(torch.tensor(b), weights=weights[f]) for f, b in bags.items()}
    leaves = reference_leaves(ec)
    out = ec(inputs)
    ref = reference_forward(ec, leaves, {f: (b, ref_weights[f]) for f, b in bags.items()})
    probes = random_probes(ref, torch.Generator().manual_seed(4))
    linear_loss(out, probes).backward()
    linear_loss(ref, probes).backward()
    for f in bags:
        torch.testing.assert_close(weights[f].grad.reshape(-1), ref_weights[f].grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(table_grad(ec, "t"), leaves["t"].grad, rtol=1e-5, atol=1e-6)


def test_no_grad_and_inference_mode_give_the_same_values():
    ec = he.EmbeddingCollection(
        [
            he.TableConfig("a", 20, 4, combiner="mean", init=he.init.normal()),
            he.TableConfig("b", 20, 4, combiner="sqrtn", init=he.init.normal()),
            he.TableConfig("c", 9, 3, combiner="none", init=he.init.normal()),
        ]
    )
    inputs = {
        "a": he.Jagged.from_lists([[1, 2], [], [3, 3, 3]], [[0.5, 2.0], [], [1.0, 1.0, 0.0]]),
        "b": [[0, 19], [5], []],
        "c": torch.tensor([[1, -1], [2, 3], [-1, -1]]),
    }
    out = ec(inputs)
    with torch.no_grad():
        out_ng = ec(inputs)
    with torch.inference_mode():
        out_im = ec(inputs)
    for f in out:
        a = as_tensor(out[f]).detach()
        torch.testing.assert_close(as_tensor(out_ng[f]), a, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(as_tensor(out_im[f]), a, rtol=1e-6, atol=1e-7)
        assert not as_tensor(out_ng[f]).requires_grad
    leaves = reference_leaves(ec)
    batch = {
        "a": ([[1, 2], [], [3, 3, 3]], torch.tensor([0.5, 2.0, 1.0, 1.0, 0.0])),
        "b": ([[0, 19], [5], []], None),
        "c": ([[1], [2, 3], []], None),
    }
    ref = reference_forward(ec, leaves, batch)
    for f in out:
        torch.testing.assert_close(as_tensor(out_ng[f]), ref[f].detach())


def test_backward_twice_accumulates():
    ec = one_table("sum")
    ec({"t": [[1, 2]]})["t"].sum().backward()
    ec({"t": [[2, 3]]})["t"].sum().backward()
    expect = torch.zeros(6, 3)
    expect[1] = 1
    expect[2] = 2
    expect[3] = 1
    assert torch.equal(table_grad(ec, "t"), expect)


def test_pad_argument():
    ec = he.EmbeddingCollection([he.TableConfig("t", 6, 2, init=he.init.normal())], pad=0)
    out = ec({"t": torch.tensor([[0, 3, 0], [5, 1, 0]])})["t"]
    W = ec.weight("t")
    torch.testing.assert_close(out, torch.stack([W[3], W[5] + W[1]]))


def test_int32_inputs():
    ec = he.EmbeddingCollection(
        [
            he.TableConfig("a", 6, 2, combiner="mean", init=he.init.normal()),
            he.TableConfig("s", 6, 2, combiner="none", init=he.init.normal()),
        ],
        sequence_output="padded",
    )
    v = torch.tensor([1, 2, 5], dtype=torch.int32)
    o = torch.tensor([0, 2, 2, 3], dtype=torch.int32)
    w = torch.tensor([1.0, 3.0, 2.0])
    out = ec({"a": he.Jagged(v, o, w), "s": he.Jagged(v, o)})
    Wa, Ws = ec.weight("a"), ec.weight("s")
    torch.testing.assert_close(out["a"], torch.stack([(Wa[1] + 3 * Wa[2]) / 4, torch.zeros(2), Wa[5]]))
    expect = torch.zeros(3, 2, 2)
    expect[0, 0], expect[0, 1], expect[2, 0] = Ws[1], Ws[2], Ws[5]
    torch.testing.assert_close(out["s"], expect)


# --- state_dict ---------------------------------------------------------------------------------


def mixed_collection(seed=0, extra=False, reverse=False):
    tables = [
        he.TableConfig("user", 13, 4, init=he.init.normal()),
        he.TableConfig("item", 21, 4, combiner="mean", init=he.init.normal()),
        he.TableConfig("cat", 5, 8, dtype=torch.float64, init=he.init.normal()),
        he.TableConfig("hist", 9, 4, combiner="none", dtype=torch.bfloat16, init=he.init.normal()),
    ]
    if reverse:
        tables = tables[::-1]
    if extra:
        tables.insert(0, he.TableConfig("zzz", 7, 4, init=he.init.normal()))
        tables.insert(2, he.TableConfig("other", 11, 2, init=he.init.normal()))
    return he.EmbeddingCollection(tables, seed=seed)


def test_state_dict_keys_and_values():
    ec = mixed_collection()
    sd = ec.state_dict()
    assert sorted(sd) == ["cat.weight", "hist.weight", "item.weight", "user.weight"]
    for name, cfg in ec.tables.items():
        v = sd[f"{name}.weight"]
        assert v.shape == (cfg.num_embeddings, cfg.embedding_dim)
        assert v.dtype == cfg.dtype
        assert not v.requires_grad
        assert torch.equal(
            v, he.init.generate(cfg.init, 0, name, torch.arange(cfg.num_embeddings), cfg.embedding_dim, cfg.dtype)
        )
    parent = torch.nn.Module()
    parent.emb = ec
    assert sorted(parent.state_dict()) == ["emb.cat.weight", "emb.hist.weight", "emb.item.weight", "emb.user.weight"]


def test_load_state_dict_into_other_grouping_and_seed():
    src = mixed_collection(seed=0)
    sd = {k: v.clone() for k, v in src.state_dict().items()}
    dst = mixed_collection(seed=1, reverse=True)
    assert not torch.equal(dst.weight("user"), src.weight("user"))
    result = dst.load_state_dict(sd)
    assert result.missing_keys == [] and result.unexpected_keys == []
    for name in src.tables:
        assert torch.equal(dst.weight(name), sd[f"{name}.weight"]), name
    # into a collection with extra tables (one of another dim): row offsets differ
    dst2 = mixed_collection(seed=2, extra=True)
    assert dst2.storage_of("user").row_offset["user"] != src.storage_of("user").row_offset["user"]
    zzz, other = dst2.weight("zzz").clone(), dst2.weight("other").clone()
    result = dst2.load_state_dict(sd, strict=False)
    assert sorted(result.missing_keys) == ["other.weight", "zzz.weight"]
    assert result.unexpected_keys == []
    for name in src.tables:
        assert torch.equal(dst2.weight(name), sd[f"{name}.weight"]), name
    assert torch.equal(dst2.weight("zzz"), zzz) and torch.equal(dst2.weight("other"), other)
    # the loaded rows are what forward reads
    inputs = {"user": [[1, 12]], "item": [[0, 20]], "cat": [[4]], "hist": [[8, 0]], "zzz": [[0]], "other": [[0]]}
    out = dst2(inputs)
    torch.testing.assert_close(out["user"], (sd["user.weight"][1] + sd["user.weight"][12])[None])
    torch.testing.assert_close(out["cat"], sd["cat.weight"][4][None])
    # and back the other way
    back = mixed_collection(seed=3)
    back.load_state_dict(dst2.state_dict(), strict=False)
    for name in src.tables:
        assert torch.equal(back.weight(name), sd[f"{name}.weight"])


def snapshot(ec):
    return {k: v.detach().clone() for k, v in ec.state_dict().items()}


def assert_unchanged(ec, snap):
    now = ec.state_dict()
    assert sorted(now) == sorted(snap)
    for k, v in snap.items():
        assert torch.equal(now[k], v), k


@pytest.mark.parametrize("bad_key", ["user.weight", "cat.weight", "hist.weight"])
@pytest.mark.parametrize("shape", [(1, 4), (13, 8), (100, 4), (4,)])
def test_wrong_shape_leaves_every_table_unchanged(bad_key, shape):
    ec = mixed_collection(seed=0)
    snap = snapshot(ec)
    new = {k: torch.randn(v.shape).to(v.dtype) for k, v in mixed_collection(seed=9).state_dict().items()}
    new[bad_key] = torch.randn(shape)
    with pytest.raises((RuntimeError, he.HybridEmbedError)) as info:
        ec.load_state_dict(new)
    assert bad_key in str(info.value)
    assert_unchanged(ec, snap)
    with pytest.raises((RuntimeError, he.HybridEmbedError)):
        ec.load_state_dict(new, strict=False)
    assert_unchanged(ec, snap)


def test_non_tensor_entry_leaves_every_table_unchanged():
    ec = mixed_collection()
    snap = snapshot(ec)
    new = {k: torch.zeros_like(v) for k, v in snap.items()}
    new["item.weight"] = [[0.0] * 4] * 21
    with pytest.raises((RuntimeError, he.HybridEmbedError)):
        ec.load_state_dict(new)
    assert_unchanged(ec, snap)


def test_strict_load_reports_missing_and_unexpected_keys():
    ec = mixed_collection()
    sd = snapshot(ec)
    del sd["item.weight"]
    with pytest.raises(RuntimeError) as info:
        ec.load_state_dict(sd)
    assert "item.weight" in str(info.value) and "Missing" in str(info.value)
    sd = snapshot(ec)
    sd["bogus.weight"] = torch.zeros(3, 4)
    sd["storages.0.weight"] = torch.zeros(3, 4)
    sd["user.bias"] = torch.zeros(3)
    with pytest.raises(RuntimeError) as info:
        ec.load_state_dict(sd)
    msg = str(info.value)
    assert "Unexpected" in msg
    for k in ("bogus.weight", "storages.0.weight", "user.bias"):
        assert k in msg, k
    result = ec.load_state_dict(sd, strict=False)
    assert sorted(result.unexpected_keys) == ["bogus.weight", "storages.0.weight", "user.bias"]
    assert result.missing_keys == []


def test_load_converts_dtype_and_state_dict_round_trips_through_torch_save(tmp_path):
    src = mixed_collection(seed=4)
    path = tmp_path / "ec.pt"
    torch.save(src.state_dict(), path)
    dst = mixed_collection(seed=5)
    dst.load_state_dict(torch.load(path))
    for name in src.tables:
        assert torch.equal(dst.weight(name), src.weight(name))
    f64 = {k: v.double() for k, v in src.state_dict().items()}
    dst = mixed_collection(seed=6)
    dst.load_state_dict(f64)
    for name, cfg in src.tables.items():
        assert dst.weight(name).dtype == cfg.dtype
        assert torch.equal(dst.weight(name), src.weight(name))


@pytest.mark.parametrize(
    "ids_dtype, off_dtype, top",
    [(torch.uint8, torch.uint8, 250), (torch.int16, torch.int16, 30000), (torch.int32, torch.uint8, 30000)],
)
def test_small_integer_ids_and_offsets_give_the_int64_result(ids_dtype, off_dtype, top):
    """uint8 / int16 ids and offsets are widened before a table's row offset or a feature's
    id offset is added (adding in the input's dtype wrapped around: wrong rows, silently)."""
    ec = he.EmbeddingCollection(
        [he.TableConfig("a", 300, 4, init=he.init.normal()), he.TableConfig("b", 40000, 4, combiner="mean")]
    )
    a_ids, a_off = torch.arange(300) % 250, torch.tensor([0, 100, 300])  # "b"'s ids follow 300 of "a"
    b_ids, b_off = torch.tensor([top, 7, 200]), torch.tensor([0, 1, 3])  # "b"'s rows start at 300
    ref = ec({"a": he.Jagged(a_ids, a_off), "b": he.Jagged(b_ids, b_off)})
    out = ec({"a": he.Jagged(a_ids.to(ids_dtype), a_off), "b": he.Jagged(b_ids.to(ids_dtype), b_off.to(off_dtype))})
    for f in ("a", "b"):
        torch.testing.assert_close(out[f], ref[f], rtol=0, atol=0)


def test_lookup_backward_frees_its_grouping():
    """The dynamic lookup's (N,) grouping lives on the autograd node until backward only (eager ops)."""
    ec = he.EmbeddingCollection([he.TableConfig("t", None, 4, dynamic=he.Dynamic())], kernels="eager")
    out = ec({"t": he.Jagged.from_lists([[1, 2, 2], [3]])})["t"]
    nodes, todo = [], [out.grad_fn]
    while todo:
        n = todo.pop()
        if n is not None:
            nodes.append(n)
            todo.extend(f for f, _ in n.next_functions)
    lookup = [n for n in nodes if type(n).__name__ == "_PooledLookupBackward"]
    assert len(lookup) == 1 and lookup[0].segments is not None
    out.sum().backward()
    assert lookup[0].segments is None


def test_module_apply_visits_the_storages():
    """``nn.Module.apply`` works on a collection (a storage method once shadowed it)."""
    ec = he.EmbeddingCollection(
        [he.TableConfig("a", 5, 4), he.TableConfig("b", None, 4, dynamic=he.Dynamic()), he.TableConfig("c", 3, 2)]
    )
    seen = []
    assert ec.apply(seen.append) is ec
    assert seen[-1] is ec and all(any(m is s for m in seen) for s in ec.storages)
