"""``he.convert`` takes over the layers' weights: a table is never held twice, not even while it
is copied (peak RSS about the model's), and memory something else still holds is left intact.

    python -m pytest -q tests/api/test_convert_memory.py
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import hybridembed as he


class Two(nn.Module):
    def __init__(self, rows: int = 1000, dim: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.EmbeddingBag(rows, dim, mode="sum")
        self.b = nn.Embedding(rows // 2, dim)
        self.top = nn.Linear(2 * dim, 1)

    def forward(self, ids):
        return self.top(torch.cat([self.a(ids.unsqueeze(1)), self.b(ids % (self.b.num_embeddings))], 1))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status (Linux)")
def test_convert_peak_is_about_the_model_not_twice():
    code = textwrap.dedent(
        """
        import torch
        from torch import nn
        import hybridembed as he

        def status(key):  # VmRSS, VmHWM (this process's own high-water mark: getrusage's ru_maxrss
            # keeps the parent's resident size across fork and exec)
            line = next(x for x in open("/proc/self/status") if x.startswith(key))
            return int(line.split()[1]) * 1024

        def rss():
            return status("VmRSS:")

        T, R, D = 4, 500_000, 64
        model = nn.ModuleDict({f"t{i}": nn.EmbeddingBag(R, D, mode="sum") for i in range(T)})
        want = model["t2"].weight.detach().clone()
        size = T * R * D * 4
        before = rss()  # the model (and one table's clone) resident
        he.convert(model)
        peak = status("VmHWM:")
        assert torch.equal(model["t0"].hybridembed.weight("t2"), want)  # (a container: on its first layer)
        print((peak - before + size) / size, (rss() - before + size) / size)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    peak, after = map(float, out.stdout.split())
    assert peak <= 1.15, f"convert's peak RSS is {peak:.2f}x the model's tables"  # (it was 2.06x)
    assert after <= 1.10, after


def test_memory_held_elsewhere_is_left_intact_and_the_old_layer_reads_the_table():
    model = Two()
    view = model.a.weight.detach()  # a view of layer a's rows, held by the caller
    want_a, want_b = model.a.weight.detach().clone(), model.b.weight.detach().clone()
    old_b = model.b
    he.convert(model)
    assert torch.equal(view, want_a)  # (not handed back: something else held it)
    assert torch.equal(model.hybridembed.weight("a"), want_a) and torch.equal(model.hybridembed.weight("b"), want_b)
    opt = he.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.5), model)
    model(torch.tensor([1, 2, 3])).sum().backward()
    opt.step()
    trained = model.hybridembed.weight("b")
    assert not torch.equal(trained, want_b) and torch.equal(old_b.weight.detach(), trained)  # a view of the table


def test_a_converted_model_trains_as_the_plain_one():
    plain, conv = Two(), he.convert(Two())
    o1 = torch.optim.SGD(plain.parameters(), lr=0.3)
    o2 = he.wrap_optimizer(torch.optim.SGD(conv.parameters(), lr=0.3), conv)
    for s in range(3):
        ids = torch.randint(0, 1000, (16,), generator=torch.Generator().manual_seed(s))
        for m, o in ((plain, o1), (conv, o2)):
            o.zero_grad()
            m(ids).square().sum().backward()
            o.step()
    torch.testing.assert_close(conv.hybridembed.weight("a"), plain.a.weight.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(conv.hybridembed.weight("b"), plain.b.weight.detach(), rtol=1e-5, atol=1e-6)


def test_a_table_of_another_dtype_leaves_the_old_weight_its_own_rows():
    model = Two()
    old_a, want = model.a, model.a.weight.detach().clone()
    he.convert(model, tables={"a": {"dtype": torch.float16}})
    assert torch.equal(old_a.weight.detach(), want)  # (not handed back: it is not the table's view)
    torch.testing.assert_close(model.hybridembed.weight("a").float(), want, rtol=1e-3, atol=1e-3)
