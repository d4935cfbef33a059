"""``he.distribute`` on GPUs over NCCL (skipped without CUDA): a plain model built on the GPU,
distributed at world 1 over ``cpu:gloo,cuda:nccl`` (the backend ``hybridembed train --device
cuda --nproc N`` uses; one GPU is enough for world 1), trains as the plain model does on the
CPU, and its checkpoint loads into a one-process CPU model and back into the GPU job.

    python -m pytest -q tests/distributed/test_nccl.py
"""

from __future__ import annotations

import pytest
import torch

import hybridembed as he
from hybridembed.distributed import ShardedCollection, unwrap
from hybridembed.launch import spawn

from .test_distribute import STEPS, N, Plain, _batch, _plan, _reference, _train

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _on(x: dict, y: torch.Tensor, device: str) -> tuple[dict, torch.Tensor]:
    return {k: v.to(device) for k, v in x.items()}, y.to(device)


def _gpu_rank(rank: int, world: int, path: str) -> dict:
    torch.cuda.set_device(rank)
    model = he.distribute(Plain().cuda(), plan=_plan(world))
    opt = he.wrap_optimizer(torch.optim.Adagrad(model.parameters(), lr=0.1), model)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for s in range(STEPS):
        _train(model, [_on(*_batch(s, N), "cuda")], opt)
        sched.step()
    he.save(path, model, opt)
    inner = unwrap(model)
    ec = inner.hybridembed
    assert isinstance(ec, ShardedCollection) and ec.local.storages[0].weight.is_cuda
    tables = {n: ec.gather_table(n).cpu() for n in ec.tables}
    # and back: the checkpoint loads into a fresh GPU job, which then equals the trained one
    fresh = he.distribute(Plain().cuda(), plan=_plan(world))
    he.load(path, fresh, he.wrap_optimizer(torch.optim.Adagrad(fresh.parameters(), lr=0.1), fresh))
    again = {n: unwrap(fresh).hybridembed.gather_table(n).cpu() for n in ec.tables}
    return {"tables": tables, "again": again, "mlp": {k: v.cpu() for k, v in inner.mlp.state_dict().items()}}


def test_a_gpu_model_distributed_over_nccl_equals_the_cpu_model_and_its_checkpoint_loads_on_the_cpu(tmp_path):
    ref = _reference()
    path = str(tmp_path / "ckpt")
    (got,) = spawn(_gpu_rank, 1, path, backend="cpu:gloo,cuda:nccl", timeout=240, start_method="spawn")
    for name, w in ref["tables"].items():
        torch.testing.assert_close(got["tables"][name], w, atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
        assert torch.equal(got["again"][name], got["tables"][name]), name
    for k, v in ref["mlp"].items():
        torch.testing.assert_close(got["mlp"][k], v, atol=1e-5, rtol=1e-5)
    one = he.convert(Plain())  # one CPU process reads the GPU job's checkpoint
    he.load(path, one)
    for name, w in got["tables"].items():
        torch.testing.assert_close(one.hybridembed.weight(name), w, atol=0, rtol=0)
