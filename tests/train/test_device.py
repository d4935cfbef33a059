"""``hybridembed train --device`` and ``--kernels``: refused clearly where they cannot run; the model,
its tables and the batches on the device asked for (the CUDA tests skip without a GPU).

    python -m pytest -q tests/train/test_device.py
"""

from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("pyarrow", reason="the train tests need pyarrow (pip install 'hybridembed[train]')")

import hybridembed as he  # noqa: E402
from hybridembed.kernels import backend  # noqa: E402
from hybridembed.train import cli  # noqa: E402
from hybridembed.train import models as M  # noqa: E402
from hybridembed.train.data import Batch  # noqa: E402

PROG = "hybridembed train"
SMALL = ["--embedding-dim", "4", "--mlp", "16", "--bottom-mlp", "8", "--capacity", "20000", "--batch-size", "256"]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"{PROG}: error: "), err
    return err[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where CUDA is absent")
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_cuda_without_cuda_is_refused_before_anything_is_written(device, tmp_path, capsys):
    assert cli.main(["--device", device, "--workdir", str(tmp_path), "--no-progress"]) == 2
    line = _error(capsys)
    assert f"--device {device}: CUDA is not available" in line and "use --device cpu" in line
    assert not any(tmp_path.iterdir())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where CUDA is absent")
def test_cuda_with_several_processes_without_cuda_is_refused(tmp_path, capsys):
    argv = ["--device", "cuda", "--nproc", "2", "--workdir", str(tmp_path), "--no-progress"]
    assert cli.main(argv) == 2
    assert "--device cuda: CUDA is not available" in _error(capsys)
    assert not any(tmp_path.iterdir())


def _gpus(monkeypatch, n: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)


@pytest.mark.parametrize(
    "argv, gpus, expected",
    [
        (["--nproc", "3"], 2, "3 trainers take one GPU each, and this machine has 2; give --nproc 2 or fewer"),
        (["--nproc", "3", "--servers", "1", "--model", "dlrm"], 1, "parameter servers need no GPU"),
        (["--nproc", "2", "--device", "cuda:1"], 2, "each trainer of a job takes its own GPU"),
    ],
)
def test_cuda_jobs_that_do_not_fit_the_gpus_are_refused_with_the_reason(
    argv, gpus, expected, tmp_path, capsys, monkeypatch
):
    _gpus(monkeypatch, gpus)
    argv = ["--device", "cuda", *argv, "--workdir", str(tmp_path), "--no-progress"]
    assert cli.main(argv) == 2
    assert expected in _error(capsys)
    assert not any(tmp_path.iterdir())


def test_a_cuda_job_takes_one_gpu_per_trainer_and_servers_stay_on_the_host(monkeypatch):
    from argparse import Namespace

    from hybridembed.train import checks, multiproc

    _gpus(monkeypatch, 2)
    job = Namespace(device="cuda", servers=1, nproc=3, kernels="auto")
    checks._resolve_device(job, 3)  # two trainers, two GPUs: accepted
    assert [multiproc.rank_device(job, r, 3, r) for r in range(3)] == ["cuda:0", "cuda:1", "cpu"]
    assert multiproc.backend(job) == "cpu:gloo,cuda:nccl"
    host = Namespace(device="cpu", servers=0)
    assert multiproc.rank_device(host, 1, 2, 1) == "cpu" and multiproc.backend(host) == "gloo"
    one = Namespace(device="cuda:1", servers=0)
    assert multiproc.rank_device(one, 0, 1, 0) == "cuda:1"  # one process: the GPU asked for
    monkeypatch.setenv("RANK", "2")  # a server of a torchrun job: no GPU checks (its node may have none)
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    checks._resolve_device(job, 3)


@pytest.mark.parametrize("value", ["gpu", "mps", "cuda:x", "cpu:1"])
def test_device_values_other_than_cpu_and_cuda_are_refused(value, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--device", value])
    assert e.value.code == 2
    assert f"argument --device: expected cpu, cuda or cuda:N, got {value!r}" in _error(capsys)


def test_triton_kernels_without_triton_are_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(backend, "triton_available", lambda: False)
    assert cli.main(["--kernels", "triton", "--workdir", str(tmp_path), "--no-progress"]) == 2
    line = _error(capsys)
    assert "--kernels triton" in line and "pip install" in line and 'kernels="eager"' in line
    assert not any(tmp_path.iterdir())


def test_build_makes_the_tables_with_the_kernels_and_on_the_device_asked_for():
    m = M.build("deepfm", 2, ["a", "b"], dim=4, capacity=100, mlp=(8,), device="cpu", kernels="eager")
    colls = [e.collection for e in (m.embeddings, m.first)]
    assert all(c.kernels == "eager" for c in colls)
    assert {p.device.type for p in m.parameters()} == {"cpu"}
    if backend.triton_available():
        m = M.build("dlrm", 2, ["a"], dim=4, capacity=10, mlp=(4,), bottom=(4,), kernels="triton")
        assert m.embeddings.collection.kernels == "triton"


def test_to_device_moves_every_tensor_of_a_batch():
    from hybridembed.train.loop import to_device

    b = Batch(torch.randn(3, 2), torch.tensor([[1], [2], [3]]), torch.tensor([0.0, 1.0, 1.0]))
    (same,) = to_device([b], "cpu")
    assert same is b  # already there: no copy
    (moved,) = to_device([b], "meta")
    assert all(t.device.type == "meta" for t in (moved.dense, moved.sparse, moved.label))
    assert (moved.dense.shape, moved.sparse.dtype) == (b.dense.shape, torch.int64)


def test_cpu_run_says_where_it_trains_and_with_which_kernels(generated, tmp_path, capsys):
    argv = ["--data", str(generated), "--workdir", str(tmp_path), "--no-progress", "--threads", "1", *SMALL]
    argv += ["--device", "cpu", "--kernels", "eager", "--no-checkpoint", "--no-export", "--max-rows", "1000"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "on cpu, eager kernels" in out and re.search(r"^epoch 1/1  train loss", out, re.M)


def test_a_dynamic_table_saved_on_cuda_loads_on_cpu():
    def collection():
        return he.EmbeddingCollection([he.TableConfig("a", None, 4, dynamic=he.Dynamic(capacity=100))])

    saved = collection()
    saved({"a": torch.tensor([1, 2, 3])})
    state = saved.state_dict()
    state["a.generator"] = torch.zeros(16, dtype=torch.uint8)  # what a CUDA (Philox) generator's get_state() is
    loaded = collection()
    loaded.load_state_dict(state)  # (the admission draws go on from a fresh seed)
    assert torch.equal(loaded({"a": torch.tensor([1, 2, 3])})["a"], saved({"a": torch.tensor([1, 2, 3])})["a"])
    state["a.generator"] = torch.zeros(17, dtype=torch.uint8)  # neither kind: refused, nothing loaded
    with pytest.raises(RuntimeError, match="generator: not a random generator state"):
        collection().load_state_dict(state)


@cuda
def test_cuda_run_trains_checkpoints_and_exports_on_the_gpu(generated, tmp_path, capsys):
    argv = ["--data", str(generated), "--workdir", str(tmp_path), "--no-progress", "--threads", "1", *SMALL]
    assert cli.main([*argv, "--device", "cuda", "--max-rows", "1000"]) == 0
    out = capsys.readouterr().out
    assert "on cuda" in out and re.search(r"^epoch 1/1  train loss [\d.]+  test loss [\d.]+  AUC", out, re.M)
    # the checkpoint, and the export at its default name
    assert (tmp_path / "checkpoint" / cli.MODEL_DIR).is_dir() and (tmp_path / "model.pt2").is_file()


@cuda
def test_cuda_checkpoint_resumes_on_cpu(generated, tmp_path, capsys):
    argv = ["--data", str(generated), "--workdir", str(tmp_path), "--no-progress", "--threads", "1", *SMALL]
    argv += ["--no-export", "--max-rows", "1000"]
    assert cli.main([*argv, "--device", "cuda", "--checkpoint", str(tmp_path / "c")]) == 0
    capsys.readouterr()
    assert cli.main([*argv, "--device", "cpu", "--resume", str(tmp_path / "c"), "--epochs", "2"]) == 0
    assert "continuing at epoch 2" in capsys.readouterr().out


@cuda
def test_a_dynamic_collection_moved_to_the_gpu_looks_up_there():
    ec = he.EmbeddingCollection([he.TableConfig("a", None, 4, dynamic=he.Dynamic(capacity=10))])
    want = ec({"a": torch.tensor([1, 2, 3])})["a"]
    ec.cuda()
    torch.testing.assert_close(ec({"a": torch.tensor([1, 2, 3], device="cuda")})["a"].cpu(), want)
