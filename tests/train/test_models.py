"""The four models end to end on a small generated file, through the CLI; model shapes and parts.

python -m pytest -q tests/train/test_models.py
"""

from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("pyarrow", reason="the train tests need pyarrow (pip install 'hybridembed[train]')")

import hybridembed as he  # noqa: E402
from hybridembed.train import cli  # noqa: E402
from hybridembed.train import models as M  # noqa: E402

SMALL = ["--embedding-dim", "4", "--mlp", "16", "--bottom-mlp", "8", "--capacity", "2000", "--batch-size", "128"]
QUIET = ["--no-checkpoint", "--no-export", "--no-progress", "--threads", "1"]
EPOCH = re.compile(
    r"epoch (\d)/2  train loss ([\d.]+)  test loss ([\d.]+)  AUC ([\d.]+)  ([\d,]+) samples in [\d.]+ s = ([\d,]+) samples/s"
)


@pytest.mark.parametrize("kind", list(M.MODELS))
def test_each_model_trains_end_to_end(kind, generated, tmp_path, capsys):
    argv = ["--data", str(generated), "--model", kind, "--epochs", "2", "--workdir", str(tmp_path), *SMALL, *QUIET]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    epochs = [EPOCH.search(line) for line in out.splitlines() if line.startswith("epoch ")]
    assert len(epochs) == 2 and all(epochs), out
    (_, loss1, _, auc1, rows, speed), (_, loss2, _, auc2, _, _) = (m.groups() for m in epochs)
    assert float(loss2) < float(loss1), out  # the training loss falls
    assert 0.0 <= float(auc1) <= 1.0 and 0.0 <= float(auc2) <= 1.0
    assert 2600 < int(rows.replace(",", "")) < 2800 and int(speed.replace(",", "")) > 0  # ~90% of 3,000 rows
    assert f"model {kind}: " in out and "done in" in out


@pytest.mark.parametrize("kind", list(M.MODELS))
def test_forward_shapes_and_tables(kind):
    feats = ["a", "b", "c"]
    m = M.build(kind, 5, feats, dim=4, capacity=50, mlp=(8,), bottom=(6,))
    ids = torch.tensor([[1, 2**40, -3], [1, 5, 7]])  # any int64 id: dynamic tables
    out = m(torch.randn(2, 5), ids)
    assert out.shape == (2,) and out.dtype == torch.float32
    hybrid = [x for x in m.modules() if isinstance(x, M.DynamicEmbeddings)]
    assert len(hybrid) == (2 if kind in ("wdl", "deepfm") else 1)  # + the dim-1 wide/first-order tables
    assert all(len(h.collection.groups) == 1 for h in hybrid)  # one fused group per width
    plain = M.build(kind, 5, feats, dim=4, vocab_sizes=[3, 4, 5], mlp=(8,), bottom=(6,))
    assert plain(torch.randn(2, 5), torch.tensor([[0, 1, 2], [2, 3, 4]])).shape == (2,)
    assert not any(isinstance(x, M.DynamicEmbeddings) for x in plain.modules())


def test_dlrm_interaction_is_pairwise_dots():
    torch.manual_seed(0)
    m = M.build("dlrm", 3, ["a", "b"], dim=4, capacity=10, mlp=(5,), bottom=(6,))
    dense, sparse = torch.randn(2, 3), torch.tensor([[1, 2], [3, 4]])
    x = m.bottom(dense)
    z = torch.cat([x[:, None], m.embeddings(sparse)], 1)  # (B, 3, D)
    pairs = torch.stack([(z[:, i] * z[:, j]).sum(1) for i in range(3) for j in range(i + 1, 3)], 1)
    torch.testing.assert_close(m(dense, sparse), m.top(torch.cat([x, pairs], 1)).squeeze(1))


def test_deepfm_second_order_term():
    v = torch.randn(2, 4, 3)  # (B, F, D)
    fast = 0.5 * (v.sum(1).square() - v.square().sum(1)).sum(1)
    slow = torch.stack([sum((v[b, i] * v[b, j]).sum() for i in range(4) for j in range(i + 1, 4)) for b in range(2)])
    torch.testing.assert_close(fast, slow)


def test_optimizer_wraps_tables_sparsely():
    m = M.build("wdl", 2, ["a"], dim=4, capacity=10, mlp=(4,))
    opt = he.wrap_optimizer(torch.optim.Adagrad(m.parameters(), lr=0.1), m)
    assert len(opt.sparse_optimizers()) == 2  # the dim-4 and the dim-1 (wide) table
    loss = m(torch.randn(3, 2), torch.tensor([[5], [6], [5]])).sum()
    loss.backward()
    opt.step()
    ids, _ = m.embeddings.collection.dynamic_rows("a")
    assert ids.tolist() == [5, 6]
