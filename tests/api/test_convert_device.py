"""``he.convert`` keeps the model's device: the tables are made where the layers' weights are
(the CUDA test skips without a GPU).

    python -m pytest -q tests/api/test_convert_device.py
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hybridembed as he


def _collection(model: nn.Module) -> he.EmbeddingCollection:
    (ec,) = {id(m): m for m in model.modules() if isinstance(m, he.EmbeddingCollection)}.values()
    return ec


def test_tables_are_made_on_the_layers_device():
    model = nn.Sequential(nn.EmbeddingBag(100, 8, mode="sum", device="meta"), nn.Linear(8, 1, device="meta"))
    ec = _collection(he.convert(model, kernels="eager"))
    assert ec.kernels == "eager" and [s.weight.device.type for s in ec.storages] == ["meta"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dynamic", [False, True])
def test_a_model_on_cuda_converts_and_trains_there(dynamic):
    torch.manual_seed(0)
    model = nn.Sequential(nn.EmbeddingBag(100, 8, mode="sum"), nn.Linear(8, 1)).cuda()
    ids = torch.randint(0, 100, (16, 3), device="cuda")
    expected = model(ids)
    model = he.convert(model, dynamic=dynamic, copy_dynamic_rows=dynamic)
    ec = _collection(model)
    assert all(s.weight.is_cuda for s in ec.storages)
    out = model(ids)
    assert out.is_cuda and torch.allclose(out, expected, atol=1e-6)
    opt = he.wrap_optimizer(torch.optim.Adagrad(model.parameters(), lr=0.1), model)
    out.sum().backward()
    opt.step()
