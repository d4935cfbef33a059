"""A tiny recommendation model trained end to end with hybridembed.

    python examples/quickstart.py

Builds an EmbeddingCollection (two tables of one dim, so one fused group; a shared table
read by two features; a mean-pooled multi-hot feature), puts an MLP on top, wraps a plain
torch.optim.Adagrad so the embedding rows get sparse row-wise updates, and trains on
synthetic clicks whose label depends on the ids. Prints the loss as it falls.
"""

from __future__ import annotations

import torch
from torch import nn

import hybridembed as he
from hybridembed.bench import powerlaw_ids


class TinyRecModel(nn.Module):
    def __init__(self, num_users: int, num_items: int, dim: int = 16):
        super().__init__()
        self.embeddings = he.EmbeddingCollection(
            [
                he.TableConfig("user", num_users, dim),
                he.TableConfig("item", num_items, dim, combiner="mean"),
            ],
            features={"user": "user", "clicked": "item", "candidate": "item"},
        )
        self.mlp = nn.Sequential(nn.Linear(3 * dim, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, sparse: dict) -> torch.Tensor:
        e = self.embeddings(sparse)  # {feature: (B, D)}
        return self.mlp(torch.cat([e["user"], e["clicked"], e["candidate"]], 1)).squeeze(1)  # (B,)


def synthetic_batch(batch: int, num_users: int, num_items: int, g: torch.Generator):
    user = powerlaw_ids(batch, num_users, generator=g)  # (B,)
    history = powerlaw_ids(batch * 5, num_items, generator=g).view(batch, 5)  # (B, 5)
    history[torch.rand(batch, 5, generator=g) < 0.3] = -1  # ragged: -1 pads are dropped
    candidate = powerlaw_ids(batch, num_items, generator=g)
    label = ((user + candidate) % 3 == 0).float()  # a pattern only the embeddings can learn
    return {"user": user, "clicked": history, "candidate": candidate}, label


def main(steps: int = 200, batch: int = 512) -> float:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    model = TinyRecModel(num_users=1000, num_items=5000)
    opt = he.wrap_optimizer(torch.optim.Adagrad(model.parameters(), lr=0.05), model)
    loss_fn = nn.BCEWithLogitsLoss()
    print(model.embeddings)
    print(opt)
    for step in range(1, steps + 1):
        sparse, label = synthetic_batch(batch, 1000, 5000, g)
        loss = loss_fn(model(sparse), label)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 25 == 0 or step == 1:
            print(f"step {step:4d}  loss {loss.item():.4f}")
    return loss.item()


if __name__ == "__main__":
    main()
