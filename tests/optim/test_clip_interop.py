"""``torch.nn.utils.clip_grad_norm_`` (a user's loop, Lightning's ``gradient_clip_val``) on a converted
model: the tables' gradients count and are clipped, as the plain model's dense ones are."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import hybridembed as he


class Tower(nn.Module):
    def __init__(self):
        super().__init__()
        self.user = nn.EmbeddingBag(50, 8, mode="sum")
        self.item = nn.Embedding(40, 8)
        self.top = nn.Linear(16, 1)

    def forward(self, users, items):
        return self.top(torch.cat([self.user(users), self.item(items)], 1)).squeeze(1)


def _batch(step):
    g = torch.Generator().manual_seed(step)
    users, items = torch.randint(0, 50, (32, 3), generator=g), torch.randint(0, 40, (32,), generator=g)
    return users, items, torch.rand(32, generator=g)


def _train(model, opt, steps, clip, kernels_note=""):
    norms = []
    for s in range(steps):
        users, items, y = _batch(s)
        opt.zero_grad()
        ((model(users, items) - y) ** 2).sum().backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
    return norms


@pytest.mark.parametrize("kernels", ["auto", "eager"])  # (auto: gradients kept for the fused step; eager: sparse)
def test_torch_clip_grad_norm_on_a_converted_model_equals_the_plain_model(kernels):
    torch.manual_seed(0)
    plain = Tower()
    conv = he.convert(copy.deepcopy(plain), kernels=kernels)
    plain_norms = _train(plain, torch.optim.SGD(plain.parameters(), lr=0.05), 4, clip=1.0)
    conv_opt = he.wrap_optimizer(torch.optim.SGD(conv.parameters(), lr=0.05), conv)
    conv_norms = _train(conv, conv_opt, 4, clip=1.0)
    assert min(plain_norms) > 1.0  # (every step clipped)
    torch.testing.assert_close(conv_norms, plain_norms, rtol=1e-5, atol=0)
    for (name, p), q in zip(plain.state_dict().items(), conv.state_dict().values()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=name)


def test_other_calls_stay_torch_s():
    w = nn.Parameter(torch.ones(3))
    w.grad = torch.full((3,), 4.0)
    assert torch.nn.utils.clip_grad_norm_.__module__ == "hybridembed.optim.wrapper"
    total = torch.nn.utils.clip_grad_norm_([w], 1.0, error_if_nonfinite=True)
    torch.testing.assert_close(total, torch.tensor(48.0).sqrt())
    w.grad = torch.tensor([float("inf"), 0.0, 0.0])
    with pytest.raises(RuntimeError, match="non-finite"):
        torch.nn.utils.clip_grad_norm_([w], 1.0, error_if_nonfinite=True)


def test_a_plain_sparse_embedding_clips_too():
    torch.manual_seed(0)
    dense, sparse = nn.Embedding(20, 4), nn.Embedding(20, 4, sparse=True)
    sparse.load_state_dict(dense.state_dict())
    ids = torch.tensor([1, 1, 3, 7])
    for m in (dense, sparse):
        m(ids).pow(2).sum().backward()
    want = torch.nn.utils.clip_grad_norm_(dense.parameters(), 0.5)
    got = torch.nn.utils.clip_grad_norm_(sparse.parameters(), 0.5)  # (torch's own refuses SparseCPU)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(sparse.weight.grad.to_dense(), dense.weight.grad)


def test_lightning_gradient_clip_val_trains_the_converted_model_as_the_plain_one():
    pl = pytest.importorskip("lightning.pytorch")

    class Module(pl.LightningModule):
        def __init__(self, net, convert):
            super().__init__()
            self.net = he.convert(net) if convert else net
            self.convert = convert

        def training_step(self, batch, _):
            users, items, y = batch
            return ((self.net(users, items) - y) ** 2).sum()

        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.05)
            return he.wrap_optimizer(opt, self) if self.convert else opt

    torch.manual_seed(0)
    net = Tower()
    data = [_batch(s) for s in range(4)]
    results = []
    for convert in (False, True):
        module = Module(copy.deepcopy(net), convert)
        trainer = pl.Trainer(
            max_epochs=1,
            gradient_clip_val=0.5,
            accelerator="cpu",
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=None))
        results.append(module.net.state_dict())
    for (name, p), q in zip(results[0].items(), results[1].values()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=name)


def test_a_nonfinite_norm_with_tables_raises_before_any_gradient_changes():
    torch.manual_seed(0)
    model = he.convert(Tower(), kernels="eager")
    users, items, y = _batch(0)
    ((model(users, items) - y) ** 2).sum().backward()
    model.top.weight.grad[0, 0] = float("inf")
    before = model.top.bias.grad.clone()
    with pytest.raises(RuntimeError, match="non-finite"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
    assert torch.equal(model.top.bias.grad, before)
