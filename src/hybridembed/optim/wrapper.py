"""``wrap_optimizer``: one optimizer object for dense parameters and sparse embedding rows.

>>> import torch, hybridembed as he
>>> ec = he.EmbeddingCollection([he.TableConfig("item", 100, 8)])
>>> mlp = torch.nn.Linear(8, 1)
>>> model = torch.nn.ModuleDict({"ec": ec, "mlp": mlp})
>>> opt = he.wrap_optimizer(torch.optim.Adagrad(model.parameters(), lr=0.05), model)
>>> opt.sparse_optimizers()
{'item': Adagrad(lr=0.05, lr_decay=0, weight_decay=0, initial_accumulator_value=0, eps=1e-10, maximize=False)}
>>> loss = mlp(ec({"item": torch.tensor([1, 2, 2])})["item"]).sum()
>>> loss.backward(); opt.step(); opt.zero_grad()
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError, HybridEmbedError
from ..kernels import reduce_rows
from ..storage import RowStorage, serial
from . import sparse as so
from .hooks import RowGrads, RowParts, SparseStepHook

__all__ = ["HybridOptimizer", "wrap_optimizer", "clip_grad_norm_", "sparse_equivalent"]

# torch.optim class -> (sparse class, hyper-parameters carried over)
_TORCH_TO_SPARSE: dict[type, tuple[type[so.SparseOptimizer], tuple[str, ...]]] = {
    torch.optim.SGD: (so.SGD, ("lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize")),
    torch.optim.Adagrad: (
        so.Adagrad,
        ("lr", "lr_decay", "weight_decay", "initial_accumulator_value", "eps", "maximize"),
    ),
    torch.optim.Adam: (so.Adam, ("lr", "betas", "eps", "weight_decay", "maximize")),
    torch.optim.SparseAdam: (so.Adam, ("lr", "betas", "eps", "maximize")),
    torch.optim.AdamW: (so.AdamW, ("lr", "betas", "eps", "weight_decay", "maximize")),
    torch.optim.Adamax: (so.Adamax, ("lr", "betas", "eps", "weight_decay", "maximize")),
    torch.optim.Adadelta: (so.Adadelta, ("lr", "rho", "eps", "weight_decay", "maximize")),
    torch.optim.RMSprop: (so.RMSprop, ("lr", "alpha", "eps", "weight_decay", "momentum", "centered", "maximize")),
}
_UNSUPPORTED_FLAGS = {"amsgrad": "amsgrad", "differentiable": "differentiable", "capturable": "capturable"}


def _as_float(v: Any) -> Any:
    """torch.optim's tensor hyper-parameters (``lr``, ``betas``) as floats."""
    if isinstance(v, tuple):
        return tuple(_as_float(x) for x in v)
    return float(v) if isinstance(v, torch.Tensor) else v


def sparse_equivalent(torch_optimizer: torch.optim.Optimizer, group: dict | None = None) -> so.SparseOptimizer:
    """The sparse optimizer with the same formula and hyper-parameters as ``torch_optimizer``."""
    cls = type(torch_optimizer)
    entry = next((v for k, v in _TORCH_TO_SPARSE.items() if cls is k), None)
    if entry is None:
        supported = ", ".join(sorted(k.__name__ for k in _TORCH_TO_SPARSE))
        raise ConfigError(
            f"{cls.__name__} has no sparse equivalent; supported: {supported}. "
            "Or pass sparse=he.optim.RowWiseAdagrad(...) (or any he.optim optimizer) to wrap_optimizer."
        )
    group = group if group is not None else torch_optimizer.param_groups[0]
    for flag in _UNSUPPORTED_FLAGS:
        if group.get(flag):
            raise ConfigError(
                f"{cls.__name__}({flag}=True) has no sparse equivalent; set {flag}=False, or pass "
                f"sparse=he.optim.X(...) with X one of: {', '.join(so.OPTIMIZERS)}"
            )
    sparse_cls, keys = entry
    if cls is torch.optim.Adam and group.get("decoupled_weight_decay"):  # torch's AdamW spelling
        sparse_cls, keys = _TORCH_TO_SPARSE[torch.optim.AdamW]
    return sparse_cls(**{k: _as_float(group[k]) for k in keys if k in group})


def _row_grads(pending: tuple[torch.Tensor, torch.Tensor] | None) -> RowGrads | None:
    return None if pending is None else RowGrads(pending[0], pending[1])


def _storages(model: nn.Module) -> list[tuple[str, RowStorage]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, RowStorage)]


class HybridOptimizer(torch.optim.Optimizer):
    """A torch optimizer over dense parameters plus sparse row-wise updates of embedding rows.

    ``param_groups`` lists the dense optimizer's groups (the same dict objects) followed by
    one group per embedding storage with its hyper-parameters, so an LR scheduler attached
    to this object changes both. Build it with :func:`wrap_optimizer`.
    """

    def __init__(
        self,
        dense: torch.optim.Optimizer,
        storages: list[tuple[str, RowStorage, so.SparseOptimizer]],
        hooks: Sequence[SparseStepHook] = (),
    ):
        if not storages and not hooks:
            raise ConfigError("the model holds no hybridembed tables; use the torch optimizer directly")
        sparse_groups = []
        for name, storage, opt in storages:
            group = {"params": [storage.weight], **copy.deepcopy(opt.hparams)}
            group["sparse_optimizer"] = opt.name
            group["storage"] = name
            storage.attach_optimizer(opt, group)
            sparse_groups.append(group)
        # (a rank of a sharded job may hold no shard: then no sparse group, only its hooks)
        super().__init__(sparse_groups or [{"params": []}], defaults={})
        self.dense = dense
        self._storages = [s for _, s, _ in storages]
        # modules that see every storage's pending gradient before the update (a sharded collection:
        # it all-reduces its replicated tables' rows, and completes column slices' row statistics);
        # on every rank of a job, in the same order
        self._hooks = list(hooks)
        self.fused_steps: Counter[str] = Counter()  # per table: steps it took by the fused pass (where it runs)
        self._sparse_groups = list(self.param_groups) if sparse_groups else []
        self.param_groups = list(dense.param_groups) + self._sparse_groups
        self.state = dense.state  # dense per-parameter state; sparse state lives in the storages

    # --- torch.optim.Optimizer interface -----------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        self.dense.zero_grad(set_to_none=set_to_none)
        for s in self._storages:
            s.clear_grad()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # kept lookup gradients (the fused kernels') are reduced and applied in one pass, unless a hook
        # declares it needs a storage's rows
        fused = [
            storage.fused_ready() and not any(h.needs_rows(storage) for h in self._hooks) for storage in self._storages
        ]
        # (grad_rows raises on a dense gradient: before any update)
        rows = [None if f else _row_grads(storage.grad_rows()) for f, storage in zip(fused, self._storages)]
        for hook in self._hooks:
            rows = hook.before_sparse_step(self._storages, rows)
        if any(p.grad is not None for g in self.dense.param_groups for p in g["params"]):
            self.dense.step()
        for storage, group, r, f in zip(self._storages, self._sparse_groups, rows, fused):
            if f:
                scale = 1.0
                for h in self._hooks:
                    scale *= h.grad_scale(storage)
                storage.apply_fused(group, scale)
                self.fused_steps.update(t.name for t in storage.tables)
            elif isinstance(r, RowParts):  # (summed as the update reads them)
                storage.apply_parts(r, group)
            elif r is not None:
                storage.apply_gradient(r.ids, r.rows, group, *(() if r.row_stat is None else (r.row_stat,)))
            storage.after_step()
        return loss

    def sparse_optimizers(self) -> dict[str, so.SparseOptimizer]:
        """``{table name: its sparse optimizer}``."""
        return {t.name: s.optimizer for s in self._storages for t in s.tables}

    def state_dict(self) -> dict[str, Any]:
        """torch.optim's shape — ``state`` and ``param_groups``, the dense optimizer's (what LR
        monitors, Lightning and checkpoint tools read) — with the tables' sparse state beside them
        under ``sparse`` (per table: its optimizer, hyper-parameters, step and state by row id)."""
        tables = {}
        for storage, group in zip(self._storages, self._sparse_groups):
            if storage.remote:  # (rows and state on parameter servers)
                continue
            hp = {k: v for k, v in group.items() if k != "params"}
            for t in storage.tables:
                tables[t.name] = {
                    "shape": [t.num_embeddings, t.embedding_dim],
                    "ids": storage.table_ids(t.name),
                    "optimizer": storage.optimizer.name,
                    "hparams": copy.deepcopy(hp),
                    "step": storage.step,
                    "state": {k: v.clone() for k, v in storage.table_state(t.name).items()},
                }
        dense = self.dense.state_dict()
        return {"state": dense["state"], "param_groups": dense["param_groups"], "sparse": tables, "format": 2}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores both parts; checks everything before changing anything. Takes :meth:`state_dict`'s
        shape, and the earlier one (``dense``, ``sparse``) that checkpoints hold."""
        if not isinstance(state_dict, dict) or "sparse" not in state_dict:
            raise HybridEmbedError(
                "not a hybridembed optimizer state_dict (needs 'state', 'param_groups' and 'sparse' entries; a plain "
                "torch optimizer's has no 'sparse': load it into the optimizer you wrapped, opt.dense)"
            )
        if "dense" in state_dict:  # (format 1)
            dense_sd = state_dict["dense"]
        elif "state" in state_dict and "param_groups" in state_dict:
            dense_sd = {"state": state_dict["state"], "param_groups": state_dict["param_groups"]}
        else:
            raise HybridEmbedError(
                "a hybridembed optimizer state_dict needs 'state' and 'param_groups' beside 'sparse'"
            )
        sparse = state_dict["sparse"]
        mine = {
            t.name: (s, g)
            for s, g in zip(self._storages, self._sparse_groups)
            if not s.remote  # (rows and state on parameter servers)
            for t in s.tables
        }
        missing, extra = sorted(set(mine) - set(sparse)), sorted(set(sparse) - set(mine))
        if missing or extra:
            raise HybridEmbedError(f"optimizer state tables differ: missing {missing}, unexpected {extra}")
        for name, (storage, _) in mine.items():
            entry, have = sparse[name], serial.state_shapes(storage, name)
            table = next(t for t in storage.tables if t.name == name)
            if list(entry.get("shape", [])) != [table.num_embeddings, table.embedding_dim]:
                raise HybridEmbedError(
                    f"table {name!r}: optimizer state saved for shape {entry.get('shape')}, "
                    f"the table is [{table.num_embeddings}, {table.embedding_dim}]"
                )
            if entry["optimizer"] != storage.optimizer.name:
                raise HybridEmbedError(
                    f"table {name!r}: saved with {entry['optimizer']}, this optimizer uses {storage.optimizer.name}"
                )
            if entry.get("state_loaded") is True and storage.streamed:
                continue  # (he.load wrote a tiered table's state with its rows, a range at a time)
            if set(entry["state"]) != set(have):
                raise HybridEmbedError(f"table {name!r}: state {sorted(entry['state'])} != {sorted(have)}")
            for k, v in entry["state"].items():
                if storage.keyed:
                    ids = entry.get("ids")
                    if ids is None or tuple(v.shape) != (ids.numel(), *have[k][1:]):
                        raise HybridEmbedError(f"table {name!r}: state {k!r} does not match its ids")
                    continue
                if tuple(v.shape) != have[k]:
                    raise HybridEmbedError(
                        f"table {name!r}: state {k!r} has shape {tuple(v.shape)}, expected {have[k]}"
                    )
        self.dense.load_state_dict(dense_sd)  # replaces its group dicts and state:
        self.param_groups = list(self.dense.param_groups) + self._sparse_groups  # re-link them
        self.state = self.dense.state
        with torch.no_grad():
            for name, (storage, group) in mine.items():
                entry = sparse[name]
                if not (entry.get("state_loaded") is True and storage.streamed):
                    storage.load_table_state(name, entry.get("ids"), entry["state"])
                storage.step = int(entry["step"])
                group.update({k: v for k, v in entry["hparams"].items() if k not in ("params", "storage")})

    def __repr__(self) -> str:
        sparse = ", ".join(f"{g['storage']}: {g['sparse_optimizer']}(lr={g['lr']})" for g in self._sparse_groups)
        return f"HybridOptimizer(dense={type(self.dense).__name__}, sparse=[{sparse}])"


def wrap_optimizer(
    torch_optimizer: torch.optim.Optimizer,
    model: nn.Module,
    sparse: so.SparseOptimizer | None = None,
) -> HybridOptimizer:
    """Route ``model``'s embedding rows to sparse row-wise updates; leave the rest to ``torch_optimizer``.

    Each table gets, in order of precedence: its ``TableConfig(optimizer=...)``, then
    ``sparse``, then the sparse equivalent of ``torch_optimizer`` with the hyper-parameters
    of the param group holding that table (or of the first group). The embedding rows are
    removed from ``torch_optimizer``'s groups. Unsupported optimizers are refused with the
    list of supported ones.
    """
    if not isinstance(torch_optimizer, torch.optim.Optimizer):
        raise ConfigError(f"wrap_optimizer needs a torch.optim.Optimizer, got {type(torch_optimizer).__name__}")
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"wrap_optimizer needs the model (an nn.Module) holding the tables, got {type(model).__name__}"
        )
    if isinstance(torch_optimizer, HybridOptimizer):
        raise ConfigError("this optimizer is already wrapped")
    if sparse is not None and not isinstance(sparse, so.SparseOptimizer):
        raise ConfigError(f"sparse must be a he.optim optimizer (e.g. he.optim.RowWiseAdagrad()), got {sparse!r}")
    storages = _storages(model)
    weights = {id(s.weight) for _, s in storages}
    home: dict[int, dict] = {}
    for group in torch_optimizer.param_groups:
        for p in group["params"]:
            if id(p) in weights:
                home[id(p)] = group
    chosen = []
    for name, storage in storages:
        override = storage.tables[0].optimizer
        if override is not None:
            opt = override
        elif sparse is not None:
            opt = sparse
        else:
            opt = sparse_equivalent(torch_optimizer, home.get(id(storage.weight)))
        chosen.append((name, storage, opt))

    # the torch optimizer keeps the dense part only; it also lets go of the nn.Embedding weights
    # he.convert replaced (an optimizer built before convert holds them)
    def ours(p: torch.Tensor) -> bool:
        return id(p) in weights or getattr(p, "_hybridembed_replaced", False)

    for group in torch_optimizer.param_groups:
        for p in filter(ours, group["params"]):
            torch_optimizer.state.pop(p, None)
        group["params"] = [p for p in group["params"] if not ours(p)]
    hooks = [m for m in model.modules() if isinstance(m, SparseStepHook)]
    return HybridOptimizer(torch_optimizer, chosen, hooks)


_SHARDED_CLIP = (
    "clip_grad_norm_: this model's tables are sharded over a job (or held by parameter servers), and a norm taken "
    "here would be this rank's alone (not the job's); clip the dense part with torch.nn.utils.clip_grad_norm_ over "
    "the dense parameters, or train the tables without clipping"
)


def clip_grad_norm_(
    parameters: nn.Module | Iterable[torch.Tensor] | torch.Tensor,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over dense and sparse gradients together.

    Sparse gradients are reduced first (an uncoalesced one would count a duplicated row's
    parts separately), then every gradient is scaled by ``max_norm / (total + 1e-6)`` when
    the total norm exceeds ``max_norm``. Returns the total norm.
    """
    if not isinstance(max_norm, (int, float)) or isinstance(max_norm, bool) or not 0 <= max_norm < float("inf"):
        raise ConfigError(f"clip_grad_norm_: max_norm must be a finite number >= 0, got {max_norm!r}")
    if isinstance(parameters, nn.Module):
        if any(getattr(m, "sharded", False) for m in parameters.modules()):
            raise ConfigError(_SHARDED_CLIP)
        parameters = parameters.parameters()
    elif isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    parameters = list(parameters)
    for p in parameters:  # gradients the fused kernels kept for their update: made into sparse ones
        if getattr(p, "_hybridembed_in_job", False):  # (set by the sharded and parameter-server collections)
            raise ConfigError(_SHARDED_CLIP)
        storage = getattr(p, "_hybridembed_storage", None)
        if storage is not None:
            storage.materialize_grad()
    params = [p for p in parameters if p.grad is not None]
    if not params:
        return torch.tensor(0.0)
    norms = []
    for p in params:
        g = p.grad
        if g.is_sparse:
            if not g.is_coalesced():
                ids, rows = reduce_rows(g)
                g = torch.sparse_coo_tensor(ids.unsqueeze(0), rows, g.shape, is_coalesced=True, check_invariants=False)
                p.grad = g
            norms.append(torch.linalg.vector_norm(g._values(), norm_type))
        else:
            norms.append(torch.linalg.vector_norm(g, norm_type))
    dtype = max((n.dtype for n in norms), key=lambda d: torch.finfo(d).bits)
    dtype = torch.promote_types(torch.float32, dtype)  # float32 at least, float64 if any grad is
    total = torch.linalg.vector_norm(torch.stack([n.to(dtype) for n in norms]), norm_type)
    if error_if_nonfinite and not bool(torch.isfinite(total)):  # (before any gradient is scaled, as torch)
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it cannot be "
            "clipped (error_if_nonfinite=True)"
        )
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for p in params:
        (p.grad._values() if p.grad.is_sparse else p.grad).mul_(coef.to(p.grad.dtype))
    return total


# --- torch.nn.utils.clip_grad_norm_ on a converted model ---------------------------------------------------
_TORCH_CLIP = torch.nn.utils.clip_grad_norm_


def _table_aware_clip(
    parameters: Iterable[torch.Tensor] | torch.Tensor,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` as installed by :func:`install_clip_grad_norm`: parameters
    that include a hybridembed table's weight go to :func:`clip_grad_norm_` (torch's would fail on a
    sparse gradient, or leave out a gradient a fused kernel keeps until the step); any other call is
    torch's own, unchanged."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    # a table's gradient is sparse (eager) or kept by its storage for the fused step (weight.grad None)
    if not any(_table_or_sparse(p) for p in params):
        return _TORCH_CLIP(params, max_norm, norm_type, error_if_nonfinite, foreach)
    return clip_grad_norm_(params, float(max_norm), float(norm_type), error_if_nonfinite)


def _table_or_sparse(p: torch.Tensor) -> bool:
    """A table's weight whose gradient torch's clip would miss or refuse, a sharded table's, or a sparse gradient."""
    if getattr(p, "_hybridembed_storage", None) is not None or getattr(p, "_hybridembed_in_job", False):
        return True
    return p.grad is not None and p.grad.is_sparse


def install_clip_grad_norm() -> None:
    """Makes ``torch.nn.utils.clip_grad_norm_`` (what user loops and Lightning's ``gradient_clip_val``
    call) handle hybridembed tables: calls whose parameters hold a table's weight are
    :func:`clip_grad_norm_`, as are calls with sparse gradients (which torch's refuses); others stay
    torch's. Called when hybridembed is imported; code that imported torch's function by name before
    then keeps torch's."""
    import torch.nn.utils.clip_grad as clip_module

    for owner in (torch.nn.utils, clip_module):
        if getattr(owner, "clip_grad_norm_", None) is _TORCH_CLIP:
            owner.clip_grad_norm_ = _table_aware_clip
