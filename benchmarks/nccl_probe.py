"""World 1 over NCCL on one GPU: the sharded runtime (mixed plan, every sharding kind) trains as
the single-process collection does on the CPU. A probe for issue 27 (run by gpu_session.sh):

    PYTHONPATH=src:. python benchmarks/nccl_probe.py [--kernels triton]
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import traceback

import torch
import torch.distributed as dist

from hybridembed.distributed import ShardedCollection
from tests.distributed import test_runtime as T


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--kernels", default="auto")
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))
    for optimizer in ("sgd", "adagrad", "rowwise"):
        case = dict(T.BASE, optimizer=optimizer, sizes=[7])
        try:
            tables = T._tables(True)
            features = {f: t for f, t in T.FEATURES.items() if any(t == x.name for x in tables)}
            ec = ShardedCollection(tables, features, T._plan(1, tables), seed=3, device="cuda:0", kernels=args.kernels)
            batches = [
                {f: j.to("cuda:0") for f, j in T._batch(s, 7, features, True).items()} for s in range(case["steps"])
            ]
            proj = {f: v.cuda() for f, v in T._projections(features).items()}
            model = torch.nn.ModuleDict({"ec": ec, "dense": torch.nn.Linear(1, 1).cuda()})
            opt = T._opt(optimizer, model)
            for b in batches:
                opt.zero_grad()
                T._loss(ec(b), proj, 1 / 7).backward()
                opt.step()
            ref, _ = T._reference(case)
            worst = 0.0
            for name, t in ref.tables.items():
                got = ec.gather_table(name)
                if t.dynamic is None:
                    worst = max(worst, float((got.cpu() - ref.weight(name)).abs().max()))
                else:
                    ids, rows = ref.dynamic_rows(name)
                    assert torch.equal(got[0].cpu(), ids), name
                    worst = max(worst, float((got[1].cpu() - rows).abs().max()))
            print(
                f"nccl world 1, {optimizer}: max |sharded - one process| = {worst:.2e}", "fused", dict(opt.fused_steps)
            )
        except Exception:
            print(f"nccl world 1, {optimizer}: FAILED")
            traceback.print_exc()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
