"""A plainly written per-layer model, converted: speed and AUC against plain PyTorch.

    python benchmarks/bench_convert.py                       # DeepFM, 26 fields -> 52 layers, batch 256
    python benchmarks/bench_convert.py --batch 4096 --rows 400000
    python benchmarks/bench_convert.py --rows 20000 --epochs 1 --quick   # smoke
    python benchmarks/bench_convert.py --per-call             # a lone layer's call against torch's

The model is DeepFM as DeepCTR-Torch writes it: per categorical field one
``nn.Embedding(vocab, D)`` for the FM/DNN part and one ``nn.Embedding(vocab, 1)`` for the
first-order part (26 fields: 52 layers called one by one), 13 dense features, a 3-layer
MLP. Data: Criteo-format rows from ``hybridembed.train.data.generate_criteo`` (power-law
ids), each field's ids folded into ``--vocab`` buckets; 10% held out for the AUC.

Contenders, all from the same initial weights, trained on the same batches in one process
with default settings (the allocator as ``import hybridembed`` leaves it, default threads):

- ``plain``: the model as written, ``nn.Embedding(sparse=True)`` + ``torch.optim.Adagrad``
  (which takes sparse gradients);
- ``converted``: ``he.convert(model)`` + ``he.wrap_optimizer(torch.optim.Adagrad(...))``
  (grouped lookups: one kernel call per group of tables per step);
- ``per-layer``: the same with ``grouped=False`` (one call per layer call);
- ``dynamic``: ``he.convert(model, dynamic=True)``: every table dynamic.

Samples/s are medians of per-step times, contenders interleaved step by step.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import tempfile
import time

import torch
from torch import nn

import hybridembed as he
from hybridembed.train import data as tdata
from hybridembed.train.metrics import auc


class DeepFM(nn.Module):
    """DeepFM as a client library writes it: one embedding layer per field and role."""

    def __init__(self, fields: int, vocab: int, dim: int, dense: int, hidden=(256, 128), init_std: float = 1e-4):
        super().__init__()
        self.embedding_dict = nn.ModuleDict({f"C{i}": nn.Embedding(vocab, dim, sparse=True) for i in range(fields)})
        self.linear_dict = nn.ModuleDict({f"C{i}": nn.Embedding(vocab, 1, sparse=True) for i in range(fields)})
        for e in [*self.embedding_dict.values(), *self.linear_dict.values()]:
            nn.init.normal_(e.weight, std=init_std)
        self.dense_linear = nn.Linear(dense, 1)
        layers, width = [], fields * dim + dense
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        self.dnn = nn.Sequential(*layers, nn.Linear(width, 1, bias=False))
        self.fields = fields

    def forward(self, sparse: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:  # (B, F) ids, (B, Dn) -> (B,)
        emb = [self.embedding_dict[f"C{i}"](sparse[:, i : i + 1]) for i in range(self.fields)]  # F x (B, 1, D)
        lin = [self.linear_dict[f"C{i}"](sparse[:, i : i + 1]) for i in range(self.fields)]  # F x (B, 1, 1)
        e = torch.cat(emb, 1)  # (B, F, D)
        first = torch.cat(lin, 1).sum((1, 2)) + self.dense_linear(dense).squeeze(1)  # (B,)
        fm = 0.5 * (e.sum(1).pow(2) - e.pow(2).sum(1)).sum(1)  # (B,)
        deep = self.dnn(torch.cat([e.flatten(1), dense], 1)).squeeze(1)  # (B,)
        return first + fm + deep


def load(rows: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sparse (R, 26) ids in [0, vocab), dense (R, 13), labels (R,)) of generated Criteo rows."""
    with tempfile.TemporaryDirectory() as tmp:
        path = tdata.generate_criteo(os.path.join(tmp, "criteo.tsv"), rows, seed=seed)
        parts = list(tdata.CriteoSource([path]).batches(1 << 16))
    sparse = torch.cat([b.sparse for b in parts]).remainder(vocab)
    return sparse, torch.cat([b.dense for b in parts]), torch.cat([b.label for b in parts])


def contenders(base: DeepFM, lr: float, which: list[str]):
    made = {}
    for name in which:
        m = copy.deepcopy(base)
        if name == "plain":
            made[name] = (m, torch.optim.Adagrad(m.parameters(), lr=lr))
            continue
        m = he.convert(m, grouped=name != "per-layer", dynamic=name == "dynamic")
        made[name] = (m, he.wrap_optimizer(torch.optim.Adagrad(m.parameters(), lr=lr), m))
    return made


def step(model, opt, x, d, y) -> tuple[float, float, float]:
    """One training step -> (forward, backward, optimizer) seconds."""
    t0 = time.perf_counter()
    loss = nn.functional.binary_cross_entropy_with_logits(model(x, d), y)
    t1 = time.perf_counter()
    opt.zero_grad()
    loss.backward()
    t2 = time.perf_counter()
    opt.step()
    return t1 - t0, t2 - t1, time.perf_counter() - t2


def evaluate(model, x, d, y, batch: int) -> float:
    model.eval()
    with torch.no_grad():
        scores = torch.cat([model(x[i : i + batch], d[i : i + batch]) for i in range(0, len(y), batch)])
    model.train()
    return auc(scores, y)


def per_call(calls: int = 2000) -> dict[str, float]:
    """Microseconds per call of a lone layer (no model forward: the per-layer path) against torch's."""
    x, xb = torch.randint(0, 100_000, (256,)), torch.randint(0, 100_000, (256, 3))
    layers = {
        "nn.Embedding": (nn.Embedding(100_000, 16, sparse=True), x),
        "nn.EmbeddingBag": (nn.EmbeddingBag(100_000, 16, mode="sum", sparse=True), xb),
    }
    out = {}
    for name, (layer, ids) in layers.items():
        for label, m in ((name, layer), (f"converted {name}", he.convert(copy.deepcopy(layer)))):
            for _ in range(50):
                m(ids)
            t0 = time.perf_counter()
            for _ in range(calls):
                m(ids)
            out[label] = (time.perf_counter() - t0) / calls * 1e6
            print(f"{label:>28}: {out[label]:7.1f} us a call")
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--vocab", type=int, default=100_000, help="buckets per field")
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--contenders", default="plain,converted,per-layer,dynamic")
    p.add_argument("--quick", action="store_true", help="time at most 200 steps per epoch")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--per-call", action="store_true", help="only time lone layer calls against torch's")
    args = p.parse_args(argv)
    if args.per_call:
        return per_call()

    torch.manual_seed(args.seed)
    sparse, dense, label = load(args.rows, args.vocab, args.seed)
    n_val = len(label) // 10
    va = slice(0, n_val)  # held out; training batches are drawn from the rest
    base = DeepFM(sparse.shape[1], args.vocab, args.dim, dense.shape[1])
    which = args.contenders.split(",")
    made = contenders(base, args.lr, which)
    times = {k: [] for k in made}
    n_train = len(label) - n_val
    steps = 0
    for epoch in range(args.epochs):
        order = torch.randperm(n_train, generator=torch.Generator().manual_seed(args.seed + epoch))
        for i in range(0, n_train - args.batch + 1, args.batch):
            idx = order[i : i + args.batch] + n_val
            x, d, y = sparse[idx], dense[idx], label[idx]
            for k, (m, opt) in made.items():  # interleaved: every contender trains on this batch now
                times[k].append(step(m, opt, x, d, y))
            steps += 1
            if args.quick and steps >= 200 * (epoch + 1):
                break
    result = {"args": vars(args), "threads": torch.get_num_threads(), "steps": steps, "contenders": {}}
    skip = min(20, steps // 5)  # warm-up
    for k, (m, _) in made.items():
        t = torch.tensor(times[k][skip:], dtype=torch.float64)  # (steps, 3)
        total = t.sum(1)
        result["contenders"][k] = {
            "samples_per_s": args.batch / float(total.median()),
            "forward_ms": 1e3 * float(t[:, 0].median()),
            "backward_ms": 1e3 * float(t[:, 1].median()),
            "optimizer_ms": 1e3 * float(t[:, 2].median()),
            "val_auc": evaluate(m, sparse[va], dense[va], label[va], 4096),
        }
    plain = result["contenders"].get("plain")
    print(
        f"DeepFM, {sparse.shape[1] * 2} embedding layers, batch {args.batch}, {steps} steps, "
        f"{result['threads']} threads"
    )
    for k, r in result["contenders"].items():
        ratio = f"  {r['samples_per_s'] / plain['samples_per_s']:.2f}x plain" if plain else ""
        dauc = f"  AUC {r['val_auc']:.4f}" + (f" ({r['val_auc'] - plain['val_auc']:+.4f})" if plain else "")
        print(
            f"{k:>10}: {r['samples_per_s']:9.0f} samples/s  fwd {r['forward_ms']:6.2f} bwd {r['backward_ms']:6.2f} "
            f"opt {r['optimizer_ms']:6.2f} ms{ratio}{dauc}"
        )
    conv, dyn = result["contenders"].get("converted"), result["contenders"].get("dynamic")
    if conv and dyn:
        print(f"dynamic step / converted step: {conv['samples_per_s'] / dyn['samples_per_s']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
