"""Host synchronisations of a training step with kernels="triton" (dense tables).

On CUDA, reading a tensor's value on the host (``bool``, ``.item()``, ``.tolist()``), an op whose
output size depends on the data (``nonzero``, ``unique``, boolean-mask indexing,
``repeat_interleave`` without ``output_size``) and a blocking host-to-device copy
(``torch.tensor(values, device=...)``) each wait for the GPU. This test counts those calls in
one step on the CPU (the same Python runs on CUDA), so a new one fails here. (Id tensors,
(B,) or (B, H) with padding, cost one more each: dropping the padding gives a data-dependent
size; pass a Jagged. So does
``sequence_output="padded"``: its length is the longest sequence's.)
"""

import contextlib
import traceback

import pytest
import torch

pytest.importorskip("triton")

import hybridembed as he  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@contextlib.contextmanager
def count_syncs():
    calls = []
    patched = []

    def wrap(owner, name, when=lambda *a, **k: True):
        real = getattr(owner, name)

        def counted(*args, **kwargs):
            caller = traceback.extract_stack(limit=2)[
                0
            ]  # (torch's own calls, e.g. torch.optim's CPU step counts, are not ours)
            if "hybridembed" in caller.filename and when(*args, **kwargs):
                calls.append(f"{name} at {caller.filename.rsplit('/', 1)[-1]}:{caller.lineno}")
            return real(*args, **kwargs)

        setattr(owner, name, counted)
        patched.append((owner, name, real))

    for name in ("__bool__", "item", "tolist", "__int__", "__float__", "__index__", "nonzero", "unique"):
        wrap(torch.Tensor, name)
    for name in ("nonzero", "unique", "unique_consecutive", "masked_select"):
        wrap(torch, name)
    wrap(torch, "repeat_interleave", lambda *a, **k: len(a) > 1 and "output_size" not in k)
    wrap(torch, "tensor", lambda *a, **k: k.get("device") is not None)
    try:
        yield calls
    finally:
        for owner, name, real in reversed(patched):
            setattr(owner, name, real)


def test_one_sync_per_training_step():
    tables = [he.TableConfig(f"t{i}", 100, 8, combiner=c) for i, c in enumerate(["sum", "mean", "sum", "none"])]
    ec = he.EmbeddingCollection(tables, device=DEVICE, kernels="triton", sequence_output="jagged")
    mlp = torch.nn.Linear(8, 1).to(DEVICE)
    model = torch.nn.ModuleDict({"ec": ec, "mlp": mlp})
    opt = he.wrap_optimizer(torch.optim.Adagrad(model.parameters(), lr=0.1), model)
    b = 16
    lengths = torch.randint(0, 5, (b,))
    jag = he.Jagged(
        torch.randint(0, 100, (int(lengths.sum()),)), torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    )
    fixed = [he.Jagged(torch.randint(0, 100, (b * h,)), torch.arange(0, b * h + 1, h)) for h in (1, 3, 4)]
    batch = {"t0": fixed[0], "t1": jag, "t2": fixed[1], "t3": fixed[2]}
    batch = {k: v.to(DEVICE) for k, v in batch.items()}

    def step():
        out = ec(batch)
        loss = mlp(out["t0"] + out["t1"] + out["t2"] + out["t3"].values.sum()).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()

    step()  # (first step: caches built)
    with count_syncs() as calls:
        step()
    assert len(calls) == 1 and calls[0].startswith("__bool__ at collection.py"), calls  # the input validation


def _tensor_inputs(pad: bool, bad: bool = False) -> dict:
    g = torch.Generator().manual_seed(5)
    one = torch.randint(0, 100, (12,), generator=g)
    two = torch.randint(0, 100, (12, 3), generator=g)
    if pad:
        one[3], two[2, 1], two[5] = -1, -1, -1
    if bad:
        two[4, 2] = 100
    return {"one": one, "two": two, "seq": two.clone(), "dyn": two.clone()}


def _tensor_collection():
    tables = [
        he.TableConfig("one", 100, 4),
        he.TableConfig("two", 100, 4, combiner="mean"),
        he.TableConfig("seq", 100, 4, combiner="none"),
        he.TableConfig("dyn", None, 4, dynamic=he.Dynamic()),
    ]
    return he.EmbeddingCollection(tables, seed=1)


@pytest.mark.parametrize("pad", [False, True])
def test_id_tensors_on_a_gpu_are_taken_whole_without_a_sync(monkeypatch, pad):
    """(B,) and (B, H) id tensors on CUDA: taken whole, their padding checked in the one validation
    sync; with padding, taken again exactly. Shown on the CPU by treating it as such a device."""
    want = _tensor_collection()(_tensor_inputs(pad))
    from hybridembed.modules import collection

    monkeypatch.setattr(collection, "_WHOLE_DEVICES", ("cpu", "cuda"))
    ec = _tensor_collection()
    with count_syncs() as calls:
        got = ec(_tensor_inputs(pad))
    bools = [c for c in calls if c.startswith("__bool__ at collection.py")]
    assert len(bools) == (3 if pad else 1), calls  # padding: the failed check, which one, the exact path's
    ours = [c for c in calls if "hashed.py" not in c and "pairs.py" not in c]  # (the dynamic table's own lookup aside)
    assert pad or len(ours) == 1, calls  # no padding: nothing but the validation
    for f in want:
        a, b = got[f], want[f]
        if isinstance(b, he.Jagged):
            assert torch.equal(a.offsets, b.offsets)
            a, b = a.values, b.values
        assert torch.equal(a, b), f
    with pytest.raises(he.InvalidInputError, match="feature 'two'.*100"):
        ec(_tensor_inputs(pad, bad=True))


@pytest.mark.parametrize("span", [1_000, 10**12])
def test_a_dynamic_group_step_syncs_where_sizes_depend_on_the_ids(span):
    """A training step of a group of dynamic tables with new ids every step: besides the input
    validation, one sync for the batch's id range (the sort key's form), one or two for the
    distinct (table, id) pairs (two when ids span more than the key holds: the hash clashes are
    looked for) and one for the misses. The tables' id counts reach the device without a wait."""
    tables = [he.TableConfig(f"t{i}", None, 8, dynamic=he.Dynamic()) for i in range(3)]
    ec = he.EmbeddingCollection(tables, device=DEVICE, kernels="triton")
    mlp = torch.nn.Linear(8, 1).to(DEVICE)
    model = torch.nn.ModuleDict({"ec": ec, "mlp": mlp})
    opt = he.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
    g = torch.Generator().manual_seed(0)

    def step():
        ids = {f"t{i}": he.Jagged(torch.randint(0, span, (32,), generator=g), torch.arange(33)) for i in range(3)}
        out = ec({k: v.to(DEVICE) for k, v in ids.items()})
        mlp(sum(out.values())).square().mean().backward()
        opt.step()
        opt.zero_grad()

    step()
    with count_syncs() as calls:
        step()
    sites = [c.split(":")[0] for c in calls]
    distinct = ["nonzero at pairs.py"] * 2 if span > 2**29 else ["unique_consecutive at pairs.py"]
    want = ["__bool__ at collection.py", "tolist at pairs.py", *distinct, "nonzero at hashed.py"]
    assert sites == want, calls
