"""Helpers for the optimizer tests: a small model, deterministic batches, and references
that do not go through hybridembed (``nn.EmbeddingBag`` + ``torch.optim``, and a per-row
float64 loop written from the documented formulas)."""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

import hybridembed as he

# name, rows, dim, combiner. a and b share a dim (one group), c has its own.
TABLES = (("a", 12, 4, "sum"), ("b", 9, 4, "mean"), ("c", 7, 3, "sum"))
# f1 and f2 share table a.
FEATURES = {"f1": "a", "f2": "a", "f3": "b", "f4": "c"}
# how each feature is handed to the collection
FORMS = {"f1": "padded", "f2": "jagged", "f3": "padded", "f4": "onehot"}
BATCH = 4
HOT = 3
OUT = 2  # output width of the dense heads
TARGET_WIDTH = 8


# --- data ------------------------------------------------------------------------------------
def make_steps(k, seed, tables=TABLES, features=FEATURES, batch=BATCH):
    """``k`` batches ``(bags, targets)``: ``bags = {feature: list of lists of ids}``.

    Every batch has a duplicate id inside bag 0, the same id again in bag 1 (across bags),
    an empty last bag, and never touches a table's last row in the first batch (so that row
    is first updated at global step 2). In the third batch every bag of ``f3`` is empty.
    """
    gen = torch.Generator().manual_seed(seed)
    rows_of = {t[0]: t[1] for t in tables}
    steps = []
    for step in range(k):
        bags, targets = {}, {}
        for f, table in features.items():
            late = rows_of[table] - 1
            if FORMS.get(f, "jagged") == "onehot":
                ids = torch.randint(0, min(4, late), (batch,), generator=gen).tolist()
                if step >= 1:
                    ids[0] = late
                b = [[i] for i in ids]
            else:
                lengths = torch.randint(0, HOT + 1, (batch,), generator=gen).tolist()
                b = [torch.randint(0, late, (n,), generator=gen).tolist() for n in lengths]
                dup = int(torch.randint(0, late, (1,), generator=gen))
                b[0] = [dup, dup] + b[0][:1]
                b[1] = b[1] + [dup]
                if step >= 1:
                    b[1] = b[1] + [late]
                b[-1] = []
                if step == 2 and f == "f3":
                    b = [[] for _ in b]
            bags[f] = b
            targets[f] = torch.randn(batch, TARGET_WIDTH, generator=gen, dtype=torch.float64)
        steps.append((bags, targets))
    return steps


def concat_steps(steps):
    """One batch holding all bags and targets of ``steps`` (in order)."""
    bags = {f: [bag for b, _ in steps for bag in b[f]] for f in steps[0][0]}
    targets = {f: torch.cat([t[f] for _, t in steps]) for f in steps[0][1]}
    return bags, targets


def to_input(form, bags):
    if form == "onehot":
        return torch.tensor([b[0] for b in bags], dtype=torch.int64)
    if form == "jagged":
        return he.Jagged.from_lists(bags)
    width = max(1, max(len(b) for b in bags))
    return torch.tensor([b + [-1] * (width - len(b)) for b in bags], dtype=torch.int64)


def bag_args(bags):
    """(values, offsets of bag starts) for ``nn.EmbeddingBag`` / ``F.embedding_bag``."""
    values = torch.tensor([i for b in bags for i in b], dtype=torch.int64)
    starts, n = [], 0
    for b in bags:
        starts.append(n)
        n += len(b)
    return values, torch.tensor(starts, dtype=torch.int64)


def touched_rows(bags, features, table):
    return sorted({i for f, t in features.items() if t == table for b in bags[f] for i in b})


def loss_fn(outs, targets, heads=None):
    total = 0.0
    for f in sorted(outs):
        out = outs[f]
        pred = heads[str(out.shape[1])](out) if heads is not None else out
        tgt = targets[f][:, : pred.shape[1]].to(pred.dtype)
        total = total + ((pred - tgt) ** 2).sum()
    return total


# --- models ----------------------------------------------------------------------------------
def make_heads(dims, dtype, seed):
    gen = torch.Generator().manual_seed(1000 + seed)
    heads = nn.ModuleDict()
    for d in sorted(set(dims)):
        lin = nn.Linear(d, OUT, dtype=dtype)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(OUT, d, generator=gen, dtype=torch.float64) * 0.5)
            lin.bias.copy_(torch.randn(OUT, generator=gen, dtype=torch.float64) * 0.1)
        heads[str(d)] = lin
    return heads


class Net(nn.Module):
    """An EmbeddingCollection, optionally followed by dense linear heads (one per dim)."""

    def __init__(self, dtype=torch.float32, seed=0, heads=True, tables=TABLES, features=FEATURES, optimizers=None):
        super().__init__()
        optimizers = optimizers or {}
        configs = [
            he.TableConfig(n, r, d, combiner=c, dtype=dtype, optimizer=optimizers.get(n)) for n, r, d, c in tables
        ]
        self.ec = he.EmbeddingCollection(configs, features=dict(features), seed=seed)
        self.feature_map = dict(features)
        self.heads = make_heads([t[2] for t in tables], dtype, seed) if heads else None

    def forward(self, bags):
        return self.ec({f: to_input(FORMS.get(f, "jagged"), bags[f]) for f in self.feature_map})

    def loss(self, bags, targets):
        return loss_fn(self(bags), targets, self.heads)


class RefNet(nn.Module):
    """``nn.EmbeddingBag`` tables (+ a copy of the heads) holding ``net``'s current weights."""

    def __init__(self, net, sparse, dtype=None):
        super().__init__()
        self.feature_map = dict(net.feature_map)
        self.bags = nn.ModuleDict()
        for name, cfg in net.ec.tables.items():
            w = net.ec.weight(name)
            bag = nn.EmbeddingBag(
                cfg.num_embeddings, cfg.embedding_dim, mode=cfg.combiner, sparse=sparse, dtype=dtype or w.dtype
            )
            with torch.no_grad():
                bag.weight.copy_(w)
            self.bags[name] = bag
        self.heads = None
        if net.heads is not None:
            self.heads = copy.deepcopy(net.heads) if dtype is None else copy.deepcopy(net.heads).to(dtype)

    def forward(self, bags):
        return {f: self.bags[t](*bag_args(bags[f])) for f, t in self.feature_map.items()}

    def loss(self, bags, targets):
        return loss_fn(self(bags), targets, self.heads)


def train(model, opt, steps, scheduler=None):
    for bags, targets in steps:
        opt.zero_grad()
        model.loss(bags, targets).backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()


def assert_same_weights(net, ref, atol, rtol=0.0):
    for name in net.ec.tables:
        got = net.ec.weight(name)
        want = ref.bags[name].weight.detach().to(got.dtype)
        torch.testing.assert_close(got, want, atol=atol, rtol=rtol, msg=lambda m, n=name: f"table {n}: {m}")
    if net.heads is not None:
        for (n, p), q in zip(net.heads.named_parameters(), ref.heads.parameters(), strict=True):
            torch.testing.assert_close(
                p.detach(), q.detach().to(p.dtype), atol=atol, rtol=rtol, msg=lambda m, n=n: f"head {n}: {m}"
            )


def table_grad(net, name):
    """The dense (rows, D) gradient of table ``name`` from its storage's sparse gradient."""
    storage = net.ec.storage_of(name)
    storage.materialize_grad()  # (a gradient the fused step keeps: made into the sparse one)
    start = storage.row_offset[name]
    rows = net.ec.tables[name].num_embeddings
    return storage.weight.grad.coalesce().to_dense()[start : start + rows]


# --- per-row reference optimizers (float64, from torch.optim's / Keras's formulas) -------------
# Hyper-parameter defaults as documented by torch.optim (Keras for Ftrl, FBGEMM for RowWiseAdagrad).
DEFAULTS = {
    "SGD": dict(lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False),
    "Adagrad": dict(lr=1e-2, lr_decay=0.0, weight_decay=0.0, initial_accumulator_value=0.0, eps=1e-10, maximize=False),
    "RowWiseAdagrad": dict(lr=1e-2, weight_decay=0.0, initial_accumulator_value=0.0, eps=1e-8, maximize=False),
    "Adam": dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, maximize=False),
    "AdamW": dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, maximize=False),
    "Adamax": dict(lr=2e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, maximize=False),
    "Adadelta": dict(lr=1.0, rho=0.9, eps=1e-6, weight_decay=0.0, maximize=False),
    "RMSprop": dict(lr=1e-2, alpha=0.99, eps=1e-8, weight_decay=0.0, momentum=0.0, centered=False, maximize=False),
    "Ftrl": dict(
        lr=1e-3,
        learning_rate_power=-0.5,
        initial_accumulator_value=0.1,
        l1_regularization_strength=0.0,
        l2_regularization_strength=0.0,
        l2_shrinkage_regularization_strength=0.0,
        beta=0.0,
    ),
}


def full_hparams(name, kwargs):
    return {**DEFAULTS[name], **kwargs}


def _row_state(name, hp, dim):
    z = torch.zeros(dim, dtype=torch.float64)
    if name == "Adagrad":
        return {"sum": z + hp["initial_accumulator_value"]}
    if name == "RowWiseAdagrad":
        return {"sum": torch.tensor(float(hp["initial_accumulator_value"]), dtype=torch.float64)}
    if name == "Ftrl":
        return {"acc": z + hp["initial_accumulator_value"], "linear": z.clone()}
    return {"m": z.clone(), "v": z.clone(), "buf": z.clone(), "u": z.clone(), "gavg": z.clone()}


def row_update(name, w, g, st, t, hp):
    """One update of one row ``w`` (D,) with summed gradient ``g`` (D,) at global step ``t``."""
    if name == "Ftrl":
        lr, p = hp["lr"], hp["learning_rate_power"]
        l1 = hp["l1_regularization_strength"]
        l2 = hp["l2_regularization_strength"] + hp["beta"] / (2.0 * lr)
        grad_to_use = g + 2.0 * hp["l2_shrinkage_regularization_strength"] * w
        acc = st["acc"]
        new_acc = acc + g * g
        st["linear"] = st["linear"] + grad_to_use - (new_acc ** (-p) - acc ** (-p)) / lr * w
        quadratic = new_acc ** (-p) / lr + 2.0 * l2
        lin = st["linear"]
        st["acc"] = new_acc
        return (lin.clamp(-l1, l1) - lin) / quadratic
    if hp.get("maximize"):
        g = -g
    lr, wd = hp["lr"], hp.get("weight_decay", 0.0)
    if name == "AdamW":
        w = w * (1.0 - lr * wd)
    elif wd:
        g = g + wd * w
    if name == "SGD":
        mu = hp["momentum"]
        if mu:
            # the buffer of a row starts at 0 (documented in hybridembed.optim.sparse)
            st["buf"] = mu * st["buf"] + (1.0 - hp["dampening"]) * g
            g = g + mu * st["buf"] if hp["nesterov"] else st["buf"]
        return w - lr * g
    if name == "Adagrad":
        clr = lr / (1.0 + (t - 1) * hp["lr_decay"])
        st["sum"] = st["sum"] + g * g
        return w - clr * g / (st["sum"].sqrt() + hp["eps"])
    if name == "RowWiseAdagrad":
        st["sum"] = st["sum"] + (g * g).mean()
        return w - lr * g / (st["sum"].sqrt() + hp["eps"])
    if name == "Adam":  # torch.optim.SparseAdam's formula (eps before the bias correction)
        b1, b2 = hp["betas"]
        st["m"] = b1 * st["m"] + (1.0 - b1) * g
        st["v"] = b2 * st["v"] + (1.0 - b2) * g * g
        step_size = lr * math.sqrt(1.0 - b2**t) / (1.0 - b1**t)
        return w - step_size * st["m"] / (st["v"].sqrt() + hp["eps"])
    if name == "AdamW":
        b1, b2 = hp["betas"]
        st["m"] = b1 * st["m"] + (1.0 - b1) * g
        st["v"] = b2 * st["v"] + (1.0 - b2) * g * g
        m_hat = st["m"] / (1.0 - b1**t)
        v_hat = st["v"] / (1.0 - b2**t)
        return w - lr * m_hat / (v_hat.sqrt() + hp["eps"])
    if name == "Adamax":
        b1, b2 = hp["betas"]
        st["m"] = b1 * st["m"] + (1.0 - b1) * g
        st["u"] = torch.maximum(b2 * st["u"], g.abs() + hp["eps"])
        return w - lr / (1.0 - b1**t) * st["m"] / st["u"]
    if name == "Adadelta":
        rho, eps = hp["rho"], hp["eps"]
        st["v"] = rho * st["v"] + (1.0 - rho) * g * g
        delta = (st["u"] + eps).sqrt() / (st["v"] + eps).sqrt() * g
        st["u"] = rho * st["u"] + (1.0 - rho) * delta * delta
        return w - lr * delta
    if name == "RMSprop":
        a = hp["alpha"]
        st["v"] = a * st["v"] + (1.0 - a) * g * g
        v = st["v"]
        if hp["centered"]:
            st["gavg"] = a * st["gavg"] + (1.0 - a) * g
            v = v - st["gavg"] * st["gavg"]
        denom = v.sqrt() + hp["eps"]
        if hp["momentum"]:
            st["buf"] = hp["momentum"] * st["buf"] + g / denom
            return w - lr * st["buf"]
        return w - lr * g / denom
    raise AssertionError(f"no reference for {name}")


def run_row_reference(net, steps, table_opts, dense_opt=None, lr_at=None):
    """Train a float64 copy of ``net`` on ``steps``: each table's touched rows with the per-row
    loop (``table_opts = {table: (name, full hparams)}``), the heads with ``dense_opt(params)``.

    ``lr_at(t)``, if given, overrides every table's ``lr`` at global step ``t``.
    """
    ref = RefNet(net, sparse=False, dtype=torch.float64)
    dense = dense_opt(ref.heads.parameters()) if dense_opt is not None else None
    state = {t: {} for t in ref.bags}
    for t, (bags, targets) in enumerate(steps, 1):
        ref.zero_grad(set_to_none=True)
        ref.loss(bags, targets).backward()
        if dense is not None:
            dense.step()
        with torch.no_grad():
            for table, bag in ref.bags.items():
                name, hp = table_opts[table]
                if lr_at is not None:
                    hp = {**hp, "lr": lr_at(t)}
                w, g = bag.weight, bag.weight.grad
                for r in touched_rows(bags, ref.feature_map, table):
                    st = state[table].setdefault(r, _row_state(name, hp, w.shape[1]))
                    w[r] = row_update(name, w[r].clone(), g[r].clone(), st, t, hp)
    return ref
