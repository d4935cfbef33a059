"""Grouped lookups of converted models, and the traps ``he.convert`` now reports.

The references: the same model converted with ``grouped=False`` (one lookup per layer call)
and the plain PyTorch model trained with ``torch.optim``.
"""

from __future__ import annotations

import copy
import io
import logging
import pickle
import re
import warnings

import pytest
import torch
from torch import nn

import hybridembed as he
from hybridembed.api.convert import fitted_init
from hybridembed.kernels import lookup as lookup_kernels
from hybridembed.modules.grouped import DeferredRows

from .test_convert import Model, make_opt, train


class Fields(nn.Module):
    """A plainly written per-field model: F embedding layers called one by one (DeepFM-like)."""

    def __init__(self, fields: int = 6, vocab: int = 50, dim: int = 4):
        super().__init__()
        self.emb = nn.ModuleList(nn.Embedding(vocab, dim, sparse=True) for _ in range(fields))
        self.first = nn.ModuleList(nn.Embedding(vocab, 1, sparse=True) for _ in range(fields))
        self.out = nn.Linear(fields * dim, 1)

    def forward(self, x):  # (B, F) -> (B,)
        e = torch.cat([layer(x[:, i]) for i, layer in enumerate(self.emb)], 1)  # (B, F*D)
        w = torch.cat([layer(x[:, i]) for i, layer in enumerate(self.first)], 1)  # (B, F)
        return self.out(e).squeeze(1) + w.sum(1)


def fields_batch(step: int, b: int = 8, fields: int = 6, vocab: int = 50):
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, vocab, (b, fields), generator=g), torch.randn(b, generator=g)


def count_kernel_calls(monkeypatch) -> list[int]:
    calls = []
    real = lookup_kernels.pooled_lookup

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr("hybridembed.modules.collection.pooled_lookup", counted)
    return calls


def test_one_kernel_call_per_group_per_forward(monkeypatch):
    conv = he.convert(Fields(), kernels="eager")  # (the eager path's kernel call is counted)
    assert len(conv.hybridembed.groups) == 2  # dim 4 and dim 1
    calls = count_kernel_calls(monkeypatch)
    x, _ = fields_batch(0)
    conv(x)
    # the six dim-4 lookups run together at the first torch.cat, the six dim-1 ones at the second
    assert len(calls) == 2 and conv.hybridembed.lookup_queue.flushes == 2
    per_layer = he.convert(Fields(), grouped=False, kernels="eager")
    calls.clear()
    per_layer(x)
    assert len(calls) == 12


@pytest.mark.parametrize("opt_name", ["sgd", "adagrad"])
def test_grouped_trains_like_per_layer_and_like_plain_torch(opt_name):
    plain = Model()
    grouped = he.convert(copy.deepcopy(plain))
    per_layer = he.convert(copy.deepcopy(plain), grouped=False)
    ref = train(plain, make_opt(opt_name, plain.parameters()))
    outs_g = train(grouped, he.wrap_optimizer(make_opt(opt_name, grouped.parameters()), grouped))
    outs_p = train(per_layer, he.wrap_optimizer(make_opt(opt_name, per_layer.parameters()), per_layer))
    for g, p, r in zip(outs_g, outs_p, ref):
        torch.testing.assert_close(g, p, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-6)
    sg, sp = grouped.state_dict(), per_layer.state_dict()
    for k in sg:
        torch.testing.assert_close(sg[k], sp[k], rtol=1e-6, atol=1e-7, msg=k)


def test_dynamic_grouped_equals_dynamic_per_layer():
    base = Fields()
    a = he.convert(copy.deepcopy(base), dynamic=True)
    b = he.convert(copy.deepcopy(base), dynamic=True, grouped=False)
    assert len(a.hybridembed.groups) == 2
    opt_a = he.wrap_optimizer(torch.optim.Adagrad(a.parameters(), lr=0.1), a)
    opt_b = he.wrap_optimizer(torch.optim.Adagrad(b.parameters(), lr=0.1), b)
    for s in range(4):
        x, y = fields_batch(s)
        for m, opt in ((a, opt_a), (b, opt_b)):
            opt.zero_grad()
            ((m(x) - y) ** 2).mean().backward()
            opt.step()
    x, _ = fields_batch(9)
    torch.testing.assert_close(a(x), b(x), rtol=1e-6, atol=1e-7)
    assert a.hybridembed.dynamic_stats() == b.hybridembed.dynamic_stats()


def test_metadata_does_not_run_the_queue_and_first_use_runs_all():
    conv = he.convert(Fields())
    seen = {}

    def probe(module, args, output):
        seen["type"], seen["shape"] = type(output), tuple(output.shape)
        seen["pending"] = len(conv.hybridembed.lookup_queue)

    conv.emb[2].register_forward_hook(probe)
    conv(fields_batch(0)[0])
    assert seen["type"] is DeferredRows and seen["shape"] == (8, 4)
    assert seen["pending"] == 3  # layers 0..2 queued, nothing run: shape read without a flush


def test_layer_called_outside_the_forward_looks_up_at_once():
    conv = he.convert(Fields())
    out = conv.emb[0](torch.tensor([1, 2]))
    assert type(out) is torch.Tensor and len(conv.hybridembed.lookup_queue) == 0
    with pytest.raises(he.InvalidInputError, match="out of range"):
        conv.emb[0](torch.tensor([1, 99]))


def test_bad_ids_in_a_grouped_forward_name_the_table_and_change_nothing():
    conv = he.convert(Fields(), dynamic="first.*")
    conv(fields_batch(0)[0])  # some dynamic rows exist
    before = {k: v.clone() for k, v in conv.state_dict().items()}
    stats = conv.hybridembed.dynamic_stats()
    x, _ = fields_batch(1)
    x[3, 4] = 50  # out of range for the dense table of field 4
    with pytest.raises(he.InvalidInputError, match="emb__4.*out of range"):
        conv(x)
    assert conv.hybridembed.dynamic_stats() == stats
    after = conv.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert len(conv.hybridembed.lookup_queue) == 0 and conv.hybridembed.lookup_queue.depth == 0
    conv(fields_batch(2)[0])  # and the model still works


def test_grad_mode_change_runs_the_queue_and_gradients_flow():
    class Mixed(Fields):
        def forward(self, x):
            a = self.emb[0](x[:, 0])
            with torch.no_grad():
                b = self.emb[1](x[:, 1])  # another mode: what is queued runs first
            return (a * b).sum()

    conv = he.convert(Mixed())
    conv(fields_batch(0)[0]).backward()
    g = conv.hybridembed.storage_of("emb__0").weight.grad
    assert g is not None and g._nnz() > 0
    assert conv.hybridembed.lookup_queue.flushes == 2


def test_tracing_and_copies_see_per_layer_calls():
    conv = he.convert(Fields()).eval()
    x = fields_batch(0)[0]
    expected = conv(x)
    traced = torch.jit.trace(conv, (x,), check_trace=False)
    torch.testing.assert_close(traced(x), expected)
    again = pickle.loads(pickle.dumps(conv))
    torch.testing.assert_close(again(x), expected)
    twin = copy.deepcopy(conv)
    torch.testing.assert_close(twin(x), expected)
    assert twin.hybridembed.lookup_queue is not conv.hybridembed.lookup_queue


# --- traps ------------------------------------------------------------------------------------
def test_converting_after_the_optimizer_is_reported_and_unconsumed_gradients_warn():
    # (warnings.warn, not log records: a user who configured no logging still sees these traps)
    model = Fields()
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1)
    with pytest.warns(UserWarning, match=re.escape("Adagrad optimizer (12 replaced weight(s)")):
        conv = he.convert(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for s in range(3):  # the user's loop with the old optimizer: tables never train
            x, y = fields_batch(s)
            opt.zero_grad()
            ((conv(x) - y) ** 2).mean().backward()
            opt.step()
    warned = [str(w.message) for w in caught if "no optimizer step consumed" in str(w.message)]
    assert len(warned) == 1 and "he.wrap_optimizer" in warned[0]
    # wrapping the optimizer built before convert lets go of the replaced weights and trains the tables
    wrapped = he.wrap_optimizer(opt, conv)
    assert all(not getattr(p, "_hybridembed_replaced", False) for g in opt.param_groups for p in g["params"])
    before = conv.emb[0].weight.detach().clone()
    x, y = fields_batch(5)
    wrapped.zero_grad()
    ((conv(x) - y) ** 2).mean().backward()
    wrapped.step()
    assert not torch.equal(before, conv.emb[0].weight.detach())


def test_unconsumed_gradients_warn_on_the_per_layer_path_too():
    conv = he.convert(Fields(), grouped=False)  # nn.Embedding layers then take lookup_rows
    x, y = fields_batch(0)
    ((conv(x) - y) ** 2).mean().backward()
    with pytest.warns(UserWarning, match="no optimizer step consumed"):
        conv(x)


def test_lookup_many_and_fitted_init_refuse_bad_arguments():
    conv = he.convert(Fields())
    ec = conv.hybridembed
    for bad in ([torch.tensor([1])], [("emb__0",)], "emb__0"):
        with pytest.raises(he.InvalidInputError, match="pairs"):
            ec.lookup_many(bad)
    with pytest.raises(he.InvalidInputError, match="train"):
        ec.lookup_many([("emb__0", torch.tensor([1]))], train="yes")
    with pytest.raises(he.InvalidInputError, match="input must be a tensor"):
        conv.emb[0]([1, 2])
    for bad in (None, torch.zeros(0, 4), torch.zeros(3, 4, dtype=torch.int64)):
        with pytest.raises(he.ConfigError, match="fitted_init"):
            fitted_init(bad)


def test_model_attributes_holding_replaced_weights_are_reported():
    model = Fields()
    model.reg_weights = [(list(model.emb.parameters()), 0.0, 1e-5)]  # DeepCTR keeps this for its L2 term
    with pytest.warns(UserWarning) as caught:
        he.convert(model)
    text = " ".join(str(w.message) for w in caught)
    assert "model.reg_weights[0][0][0] (layer 'emb.0')" in text
    assert "weight_decay" in text


def test_a_dense_gradient_on_a_table_is_refused_with_the_fix_and_changes_nothing():
    conv = he.convert(Fields())
    opt = he.wrap_optimizer(torch.optim.SGD(conv.parameters(), lr=0.1), conv)
    x, y = fields_batch(0)
    loss = ((conv(x) - y) ** 2).mean() + 1e-3 * sum(layer.weight.pow(2).sum() for layer in conv.emb)
    loss.backward()
    before = {k: v.clone() for k, v in conv.state_dict().items()}
    with pytest.raises(he.HybridEmbedError, match="dense gradient.*weight_decay"):
        opt.step()
    assert all(torch.equal(v, conv.state_dict()[k]) for k, v in before.items())  # dense layers too


# --- dynamic conversion ---------------------------------------------------------------------------
def test_dynamic_true_makes_every_table_dynamic_with_the_models_initialisation(caplog):
    model = Fields(vocab=1000, dim=32)
    for layer in model.emb:
        nn.init.normal_(layer.weight, std=1e-4)
    for layer in model.first:
        nn.init.uniform_(layer.weight, -0.3, 0.3)
    with caplog.at_level(logging.INFO, logger="hybridembed"):
        conv = he.convert(model, dynamic=True)
    assert all(t.dynamic is not None for t in conv.hybridembed.tables.values())
    assert len([r for r in caplog.records if r.name == "hybridembed.api.convert"]) == 1  # one summary line
    init = conv.hybridembed.tables["emb__0"].init
    assert init.kind == "normal" and abs(init.std - 1e-4) < 1e-5
    first = conv.hybridembed.tables["first__0"].init
    assert first.kind == "uniform" and -0.31 < first.low < -0.29 and 0.29 < first.high < 0.31
    conv(torch.randint(0, 10**9, (4096, 6)))  # rows made on first sight follow the fitted init
    _, rows = conv.hybridembed.dynamic_rows("emb__0")
    assert rows.shape[0] > 4000 and 0.9e-4 < float(rows.std()) < 1.1e-4


def test_dynamic_patterns_settings_and_explicit_init():
    settings = he.Dynamic(capacity=100)
    conv = he.convert(Fields(), dynamic="first.*", tables={"first.1": {"init": he.init.zeros(), "dynamic": settings}})
    tables = conv.hybridembed.tables
    assert [n for n, t in tables.items() if t.dynamic is not None] == [f"first__{i}" for i in range(6)]
    assert tables["first__1"].dynamic == settings and tables["first__1"].init == he.init.zeros()
    everything = he.convert(Fields(), dynamic=settings)
    assert all(t.dynamic == settings for t in everything.hybridembed.tables.values())
    for bad in (3, [1], {"a": 1}):
        with pytest.raises(he.ConfigError, match="dynamic must be"):
            he.convert(Fields(), dynamic=bad)
    with pytest.raises(he.ConfigError, match="grouped"):
        he.convert(Fields(), grouped="yes")


def test_deferred_outputs_behave_as_tensors():
    class Probe(Fields):
        def forward(self, x):
            a, b = self.emb[0](x[:, 0]), self.emb[1](x[:, 1])
            seen = {"repr": repr(a), "len": len(b), "numpy": b.detach().numpy().shape, "grad_fn": a.grad_fn is not None}
            a.mul_(1.0)  # in place on a deferred output changes the real rows
            return a.sum() + b.sum(), seen

    conv = he.convert(Probe())
    out, seen = conv(fields_batch(0)[0])
    assert seen == {"repr": seen["repr"], "len": 8, "numpy": (8, 4), "grad_fn": True}
    assert "tensor(" in seen["repr"]
    out.backward()
    assert conv.hybridembed.storage_of("emb__0").weight.grad is not None
    buf = io.BytesIO()
    torch.save(conv.emb[0](torch.tensor([1])), buf)  # (outside the forward: a plain tensor)
