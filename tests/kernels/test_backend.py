"""Choosing the kernel backend: kernels= and HYBRIDEMBED_KERNELS, checked; Triton only where it can run."""

import pytest
import torch

import hybridembed as he
from hybridembed.kernels import backend


def _ec(**kw):
    return he.EmbeddingCollection([he.TableConfig("a", 10, 4)], **kw)


@pytest.mark.parametrize("bad", ["cuda", "", None, 1, "Triton"])
def test_bad_kernels_argument_is_refused(bad):
    with pytest.raises(he.ConfigError, match="kernels must be one of 'auto', 'eager', 'triton'"):
        _ec(kernels=bad)
    with pytest.raises(he.ConfigError, match="kernels must be one of"):
        he.convert(torch.nn.Embedding(5, 2), kernels=bad)


def test_auto_follows_the_environment(monkeypatch):
    monkeypatch.delenv("HYBRIDEMBED_KERNELS", raising=False)
    assert _ec().storages[0].kernels == "auto"  # Triton on CUDA when installed, eager elsewhere
    monkeypatch.setenv("HYBRIDEMBED_KERNELS", "eager")
    assert _ec(kernels="auto").kernels == "eager"
    monkeypatch.setenv("HYBRIDEMBED_KERNELS", "fast")
    with pytest.raises(he.ConfigError, match="HYBRIDEMBED_KERNELS='fast'"):
        _ec()
    assert _ec(kernels="eager").kernels == "eager"  # (an explicit choice does not read it)


def test_triton_without_triton_is_refused(monkeypatch):
    monkeypatch.setattr(backend, "triton_available", lambda: False)
    with pytest.raises(he.ConfigError, match=r'pip install "hybridembed\[gpu\]"'):
        _ec(kernels="triton")
    monkeypatch.setenv("HYBRIDEMBED_KERNELS", "triton")
    with pytest.raises(he.ConfigError, match="needs Triton"):
        _ec()


def test_triton_runs_only_on_cuda_or_under_the_interpreter(monkeypatch):
    pytest.importorskip("triton")
    cpu = torch.zeros(1)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not backend.uses_triton("triton", cpu)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert backend.uses_triton("triton", cpu)
    assert not backend.uses_triton("eager", cpu)
    assert not backend.uses_triton("triton", torch.zeros(1, device="meta"))


def test_auto_runs_triton_on_cuda_only_and_never_interprets(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not backend.uses_triton("auto", torch.zeros(1))  # (the interpreter is for "triton" alone)
    from hybridembed.kernels import cpu_fused

    cpu = "numba" if cpu_fused.available() else "eager"  # (the fused CPU step where Numba is)
    assert backend.describe("auto", "cpu") == cpu and backend.describe("eager", "cuda:0") == "eager"
    monkeypatch.setattr(backend, "triton_available", lambda: True)
    assert backend.describe("auto", "cuda") == "triton" and backend.describe("triton", "cuda:1") == "triton"
    monkeypatch.setattr(backend, "triton_available", lambda: False)
    assert backend.describe("auto", "cuda") == "eager"


def test_triton_tables_on_the_cpu_without_interpreter_run_eager(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    ec = _ec(kernels="triton")
    opt = he.wrap_optimizer(torch.optim.SGD(ec.parameters(), lr=0.1), ec)
    ec({"a": torch.tensor([1, 2, 2])})["a"].sum().backward()
    st = ec.storages[0]
    assert not st._deferred and st.weight.grad is not None  # the eager backward's gradient
    opt.step()


def test_a_sharded_collection_checks_its_kernels_first():
    from hybridembed.distributed import ShardedCollection

    # (before anything else: a rank without shards builds no collection that would check it)
    with pytest.raises(he.ConfigError, match="kernels must be one of"):
        ShardedCollection([he.TableConfig("a", 10, 4)], kernels="fast")
