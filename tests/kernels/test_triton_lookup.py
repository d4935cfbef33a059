"""The Triton lookup and fused update against the eager ops (CPU: Triton's interpreter, small sizes)."""

import pytest
import torch

pytest.importorskip("triton")

import hybridembed as he  # noqa: E402
from hybridembed.kernels import pooled_lookup  # noqa: E402
from hybridembed.kernels import triton_lookup as tk  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _bags(lengths, rows, hot=None):
    """Ids (N,) of bags of these lengths, with a hot id repeated in many bags (duplicates over chunks)."""
    lengths = torch.tensor(lengths)
    n = int(lengths.sum())
    ids = torch.randint(0, rows, (n,))
    if hot is not None and n:
        ids[torch.rand(n) < hot] = 3
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    return ids.to(DEVICE), offsets.to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("weighted", [False, True])
def test_forward_matches_eager(dtype, weighted):
    cdt = torch.float64 if dtype == torch.float64 else torch.float32
    weight = torch.randn(50, 12, device=DEVICE).to(dtype)  # D = 12: not a power of two
    lengths = [0, 3, 1, 0, 17, 2, 40, 0]  # empty bags, and bags longer than a block
    ids, offsets = _bags(lengths, 50, hot=0.3)
    psw = torch.rand(ids.numel(), device=DEVICE, dtype=cdt) if weighted else None
    got = tk.pool(weight, ids, offsets, psw, cdt, one_per_bag=False)
    want = pooled_lookup(weight, ids, offsets, psw, cdt)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    # one id per bag (one-hot and sequence features): the gather kernel
    ids1 = ids[:37]
    off1 = torch.arange(38, device=DEVICE)
    psw1 = None if psw is None else psw[:37]
    got = tk.pool(weight, ids1, off1, psw1, cdt, one_per_bag=True)
    torch.testing.assert_close(got, pooled_lookup(weight, ids1, off1, psw1, cdt), rtol=tol, atol=tol)
    # short bags (at most two ids a bag on average, over several programs of bags): read together
    short = [1, 0, 2, 1, 5, 1, 1, 0] * 9  # 72 bags, 99 ids
    ids2, off2 = _bags(short, 50, hot=0.3)
    assert ids2.numel() <= tk._SHORT * len(short) and len(short) > 2 * tk._BAGS
    psw2 = torch.rand(ids2.numel(), device=DEVICE, dtype=cdt) if weighted else None
    got = tk.pool(weight, ids2, off2, psw2, cdt, one_per_bag=False)
    torch.testing.assert_close(got, pooled_lookup(weight, ids2, off2, psw2, cdt), rtol=tol, atol=tol)


def test_forward_empty():
    weight = torch.randn(5, 4, device=DEVICE)
    none = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    for bags in (0, 3):  # no bags; three empty bags
        offsets = torch.zeros(bags + 1, dtype=torch.int64, device=DEVICE)
        out = tk.pool(weight, none, offsets, None, torch.float32, False)
        assert torch.equal(out, torch.zeros(bags, 4, device=DEVICE))


OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.5),
    "sgd_wd_max": lambda p: torch.optim.SGD(p, lr=0.1, weight_decay=0.01, maximize=True),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.3, lr_decay=0.01),
    "rowwise": None,  # he.optim.RowWiseAdagrad
    "adam": lambda p: torch.optim.Adam(p, lr=0.05, weight_decay=0.001),
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),  # no fused update: eager reduce
}


def _model(kernels, dtype=torch.float32, dynamic=False):
    torch.manual_seed(1)
    dyn = he.Dynamic(capacity=dynamic) if dynamic else None
    rows = (lambda n: None) if dynamic else (lambda n: n)
    tables = [
        he.TableConfig("a", rows(40), 8, combiner="mean", dtype=dtype, dynamic=dyn),
        he.TableConfig("b", rows(30), 8, combiner="sum", dtype=dtype, dynamic=dyn),
        he.TableConfig("s", rows(20), 8, combiner="none", dtype=dtype, dynamic=dyn),
    ]
    ec = he.EmbeddingCollection(tables, device=DEVICE, kernels=kernels, sequence_output="padded")
    return torch.nn.ModuleDict({"ec": ec, "mlp": torch.nn.Linear(8, 1).to(DEVICE)})


def _batch(step):
    g = torch.Generator().manual_seed(step)
    la = torch.randint(0, 6, (16,), generator=g)
    a = torch.randint(0, 40, (int(la.sum()),), generator=g)
    a[torch.rand(a.numel(), generator=g) < 0.5] = 7  # a hot id: runs across several chunks
    b = torch.randint(0, 30, (16,), generator=g)
    b[:10] = 2
    s = torch.randint(0, 20, (16, 3), generator=g)
    s[0, 1] = -1
    w = torch.rand(a.numel(), generator=g)
    return {
        "a": he.Jagged(a, torch.cat([torch.zeros(1, dtype=torch.int64), la.cumsum(0)]), w).to(DEVICE),
        "b": b.to(DEVICE),
        "s": s.to(DEVICE),
    }


def _loss(model, batch):
    out = model["ec"](batch)
    x = out["a"] + out["b"] + out["s"].sum(1)
    return (model["mlp"](x) ** 2).mean()


def _opt(name, model):
    if name == "rowwise":
        return he.wrap_optimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), model, sparse=he.optim.RowWiseAdagrad(lr=0.2)
        )
    return he.wrap_optimizer(OPTIMIZERS[name](model.parameters()), model)


def _train(kernels, name, steps=3, dtype=torch.float32, dynamic=False, accumulate=1, clip=None):
    model = _model(kernels, dtype, dynamic)
    opt = _opt(name, model)
    for step in range(steps):
        for k in range(accumulate):
            _loss(model, _batch(10 * step + k)).backward()
        if clip is not None:
            he.clip_grad_norm_(model, clip)
        opt.step()
        opt.zero_grad()
    return model


def _assert_same(got, want, tol):
    for name in want["ec"].tables:  # rows and optimizer state by id (a dynamic table's free slots hold garbage)
        ids_g, rows_g, state_g = got["ec"].storage_of(name).read_ids(name)
        ids_w, rows_w, state_w = want["ec"].storage_of(name).read_ids(name)
        assert torch.equal(ids_g, ids_w)
        torch.testing.assert_close(rows_g.float(), rows_w.float(), rtol=tol, atol=tol)
        for k in state_w:
            torch.testing.assert_close(state_g[k], state_w[k], rtol=tol, atol=tol)
    assert [st.step for st in got["ec"].storages] == [st.step for st in want["ec"].storages]
    torch.testing.assert_close(got["mlp"].weight, want["mlp"].weight, rtol=tol, atol=tol)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_fused_update_matches_eager(name):
    _assert_same(_train("triton", name), _train("eager", name), 1e-5)


def test_fused_update_is_used():
    model = _model("triton")
    opt = _opt("adagrad", model)
    _loss(model, _batch(0)).backward()
    storages = list(model["ec"].storages)
    assert all(st.fused_ready() and st.weight.grad is None for st in storages)
    opt.step()
    assert not any(st._deferred for st in storages)


def test_dynamic_tables_fused():
    _assert_same(_train("triton", "adagrad", dynamic=64), _train("eager", "adagrad", dynamic=64), 1e-5)


def test_dynamic_tables_evicting_between_backwards():
    # capacity 36: the second forward of a step evicts rows while the first backward's gradient waits
    got = _train("triton", "adam", dynamic=36, accumulate=2)
    _assert_same(got, _train("eager", "adam", dynamic=36, accumulate=2), 1e-5)
    assert sum(got["ec"].storages[0].counters[:, 1].tolist()) > 0  # (rows were evicted)


def test_dynamic_ids_without_a_row_get_no_gradient():
    """Ids not admitted read the default row (slot 0): like the eager lookup, their gradient is
    dropped, so weight.grad and the norm clip_grad_norm_ takes are the eager ones."""
    got = {}
    for kernels in ("eager", "triton"):
        table = he.TableConfig("u", None, 4, dynamic=he.Dynamic(min_count=2))
        ec = he.EmbeddingCollection([table], device=DEVICE, kernels=kernels)
        ec({"u": torch.tensor([1, 2], device=DEVICE)})
        out = ec({"u": torch.tensor([1, 2, 3, 1, 5, 6], device=DEVICE)})  # 3, 5, 6: not admitted yet
        (out["u"] * torch.arange(1.0, 7.0, device=DEVICE).unsqueeze(1)).sum().backward()
        grad = ec.storages[0].weight.grad.to_dense()
        got[kernels] = (grad, he.clip_grad_norm_(ec, 1.0))
    torch.testing.assert_close(got["triton"][0], got["eager"][0])
    torch.testing.assert_close(got["triton"][1], got["eager"][1])


def test_fused_hyper_parameters_reach_the_kernels_in_float64():
    """A Python float reaches a compiled Triton kernel as float32 (the interpreter keeps it in
    float64, so only the signature shows it): the update's kernels take lr, eps, betas and weight
    decay as float64, so a float64 table's are exact on a GPU (rounded in the kernel otherwise)."""
    import inspect

    for kernel in (tk._reduce_update, tk._finish_runs):
        params = inspect.signature(kernel.fn).parameters  # (.fn: the function, compiled or interpreted)
        assert [str(params[k].annotation) for k in ("lr", "eps", "b1", "b2", "wd")] == ["tl.float64"] * 5


def test_half_rows_fp32_state():
    got = _train("triton", "adam", dtype=torch.bfloat16)
    want = _train("eager", "adam", dtype=torch.bfloat16)
    _assert_same(got, want, 2e-2)
    assert got["ec"].storages[0].weight.dtype == torch.bfloat16
    assert got["ec"].storages[0].state["exp_avg"].dtype == torch.float32


def test_accumulation_and_clipping_take_the_eager_reduce():
    for kw in ({"accumulate": 2}, {"clip": 0.01}):
        _assert_same(_train("triton", "adagrad", steps=2, **kw), _train("eager", "adagrad", steps=2, **kw), 1e-5)


def test_without_optimizer_the_gradient_is_the_eager_one():
    got, want = _model("triton"), _model("eager")
    _loss(got, _batch(0)).backward()
    _loss(want, _batch(0)).backward()
    for a, b in zip(got["ec"].storages, want["ec"].storages):
        torch.testing.assert_close(a.weight.grad.to_dense(), b.weight.grad.to_dense())


def test_zero_grad_drops_kept_gradients():
    model = _model("triton")
    opt = _opt("sgd", model)
    before = [st.weight.detach().clone() for st in model["ec"].storages]
    _loss(model, _batch(0)).backward()
    opt.zero_grad()
    opt.step()
    assert all(torch.equal(b, st.weight) for b, st in zip(before, model["ec"].storages))


@pytest.fixture(params=["walk", "tile"])
def update_kernel(request, monkeypatch):
    """Each of the update's two first kernels: the walk id by id (_reduce_update, chosen for bags of
    more than _TILE ids on average) and the tile (_reduce_update_short, for shorter ones)."""
    monkeypatch.setattr(tk, "_TILE", 0 if request.param == "walk" else 10**9)
    return request.param


@pytest.mark.parametrize("name", ["sgd", "adagrad", "rowwise", "adam"])
def test_fused_update_hot_ids_many_chunks(name, update_kernel):
    """One id in hundreds of bags (runs over many chunks), many distinct ids, against the eager update."""
    from hybridembed.optim import sparse as so

    opt = {
        "sgd": so.SGD(lr=0.1),
        "adagrad": so.Adagrad(lr=0.1),
        "rowwise": so.RowWiseAdagrad(lr=0.1),
        "adam": so.Adam(lr=0.1),
    }[name]
    sts = []
    for _ in range(2):
        st = he.EmbeddingCollection([he.TableConfig("t", 300, 5)], device=DEVICE, kernels="triton").storages[0]
        st.attach_optimizer(opt, dict(opt.hparams))
        sts.append(st)
    n = 350
    ids = torch.randint(0, 300, (n,), device=DEVICE)
    ids[torch.rand(n, device=DEVICE) < 0.4] = 11
    ids[-70:] = 299  # a run ending at the last position, over more than two chunks
    offsets = torch.arange(0, n + 1, 7, device=DEVICE)
    grad = torch.randn(offsets.numel() - 1, 5, device=DEVICE)
    psw = torch.rand(n, device=DEVICE)
    for _ in range(2):
        sts[0].defer_grad(ids, grad, offsets, psw, False)
        assert sts[0].fused_ready()
        sts[0].apply_fused(sts[0].hparams)
        sts[1].defer_grad(ids, grad, offsets, psw, False)
        r = sts[1].grad_rows()
        sts[1].apply_gradient(r[0], r[1], sts[1].hparams)
        sts[1].clear_grad()
    torch.testing.assert_close(sts[0].weight, sts[1].weight, rtol=1e-5, atol=1e-6)
    for k in sts[1].state:
        torch.testing.assert_close(sts[0].state[k], sts[1].state[k], rtol=1e-5, atol=1e-6)


def _edge_layout(name, kernel):
    """Sorted ids whose runs of equal ids sit at the update's chunk edges (chunks of C ids)."""
    c, cat, full = (tk._CHUNK if kernel == "walk" else tk._TILE_CHUNK), torch.cat, torch.full
    return {
        "single_id": torch.tensor([5]),
        "one_chunk_one_id": full((c,), 3),
        "two_chunks_one_id": full((2 * c,), 3),
        "run_ends_at_a_chunk_end": cat(
            [torch.arange(10), full((c - 10,), 50), full((c,), 60), torch.arange(100, 100 + c)]
        ),
        "run_starts_at_a_chunk_start": cat([torch.arange(c), full((c + 8,), 200), torch.arange(210, 218)]),
        "run_over_three_chunks_to_the_end": cat([torch.arange(5), full((3 * c - 5,), 77)]),
        "run_ends_one_past_a_chunk": cat([full((c,), 1), full((c + 1,), 2)]),
    }[name]


@pytest.mark.parametrize(
    "layout",
    [
        "single_id",
        "one_chunk_one_id",
        "two_chunks_one_id",
        "run_ends_at_a_chunk_end",
        "run_starts_at_a_chunk_start",
        "run_over_three_chunks_to_the_end",
        "run_ends_one_past_a_chunk",
    ],
)
def test_fused_update_runs_at_chunk_edges(layout, update_kernel):
    """Every way a run of equal ids can meet a chunk edge (N a multiple of C or not), one id per
    bag in shuffled order, against the eager update: each row updated once, with its whole sum.
    (Bags given as bags for the walk: one id per bag without offsets always takes the tile.)"""
    from hybridembed.optim import sparse as so

    ids = _edge_layout(layout, update_kernel)
    ids = ids[torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(0))].to(DEVICE)
    grad = torch.randn(ids.numel(), 5, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    offsets = torch.arange(ids.numel() + 1, device=DEVICE)
    for opt in (so.Adam(lr=0.1, weight_decay=0.01, maximize=True), so.RowWiseAdagrad(lr=0.1)):
        sts = []
        for _ in range(2):
            st = he.EmbeddingCollection([he.TableConfig("t", 300, 5)], device=DEVICE, kernels="triton").storages[0]
            st.attach_optimizer(opt, dict(opt.hparams))
            sts.append(st)
        sts[0].defer_grad(ids, grad, offsets, None, update_kernel == "tile")
        sts[0].apply_fused(sts[0].hparams)
        sts[1].defer_grad(ids, grad, offsets, None, True)
        r = sts[1].grad_rows()
        sts[1].apply_gradient(r[0], r[1], sts[1].hparams)
        torch.testing.assert_close(sts[0].weight, sts[1].weight, rtol=1e-5, atol=1e-6)
        for k in sts[1].state:
            torch.testing.assert_close(sts[0].state[k], sts[1].state[k], rtol=1e-5, atol=1e-6)


def _converted(kernels):
    torch.manual_seed(3)
    model = torch.nn.ModuleDict(
        {
            "bag": torch.nn.EmbeddingBag(30, 6, mode="mean"),
            "emb": torch.nn.Embedding(20, 6),
            "out": torch.nn.Linear(6, 1),
        }
    ).to(DEVICE)
    model = he.convert(model, kernels=kernels)
    opt = he.wrap_optimizer(torch.optim.Adagrad(model.parameters(), lr=0.2), model)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(0, 30, (8, 5), generator=g).to(DEVICE)
        one = torch.randint(0, 20, (8,), generator=g).to(DEVICE)
        y = model["out"](model["bag"](ids) + model["emb"](one))
        (y**2).mean().backward()
        if step == 2:  # a parameter list: its kept gradients are found from the parameters
            he.clip_grad_norm_(list(model.parameters()), 0.05)
        opt.step()
        opt.zero_grad()
    return model


def test_converted_model_matches_eager():
    got, want = _converted("triton"), _converted("eager")
    for (k, a), (_, b) in zip(got.state_dict().items(), want.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=k)


def test_copy_and_pickle_between_backward_and_step():
    import copy
    import io

    model = _model("triton")
    opt = _opt("adagrad", model)
    _loss(model, _batch(0)).backward()
    twin = copy.deepcopy(model)
    for a, b in zip(twin["ec"].storages, model["ec"].storages):
        assert getattr(a.weight, "_hybridembed_storage", a) is a  # (never the original's)
        assert b.weight._hybridembed_storage is b
    torch.save(model, io.BytesIO())
    opt.step()
    assert not any(hasattr(st.weight, "_hybridembed_storage") for st in model["ec"].storages)


@pytest.mark.parametrize("chunks", [1, 2, 7, 300])
def test_last_start_is_the_cumulative_max_of_the_run_beginnings(chunks):
    """The update's carry of partial sums names, per chunk, the chunk its run began in: the
    count-and-scatter form equals the cumulative max it stands in for."""
    gen = torch.Generator().manual_seed(chunks)
    inside = torch.rand(chunks, generator=gen) < 0.6
    inside[0] = False  # (chunk 0 always begins a run)
    begins = torch.where(inside, -1, torch.arange(chunks))
    assert torch.equal(tk.last_start(inside), torch.cummax(begins, 0).values)
