"""The synthetic recommendation models of NVIDIA distributed-embeddings, as data, and their builders.

    hybridembed bench --memory-only              # full-size accounting of every model, no tensors
    hybridembed bench --model tiny --quick       # scaled down and timed against the anchors

Shape legend: ``B`` batch, ``F`` inputs (features), ``D`` a table's width, ``W`` the
concatenated width of all inputs, ``N`` numerical features, ``U`` distinct rows touched.

A model is frozen data (:class:`ModelSpec`); :func:`expand` turns it into tables and the
inputs that read them, :func:`memory` accounts for its full size without allocating a
tensor, :func:`scale` caps each table's rows so it runs on one machine, and
:func:`build_model` makes a trainable :class:`SyntheticModel` whose embeddings are a
hybridembed ``EmbeddingCollection``, one ``nn.EmbeddingBag`` per table, or TorchRec's
``FusedEmbeddingBagCollection``:

    >>> from hybridembed.bench.models import MODELS, memory, scale, expand
    >>> m = memory(MODELS["tiny"])
    >>> m.tables, m.ids_per_sample, round(m.weight_bytes / 2**30, 1)
    (55, 85.0, 4.2)
    >>> tables, inputs = expand(scale(MODELS["tiny"], max_rows=1000))
    >>> max(t.rows for t in tables), len(inputs)
    (1000, 58)
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..config import TableConfig
from ..errors import ConfigError
from ..input import Jagged
from ..modules import EmbeddingCollection
from ..optim import wrap_optimizer
from ..synthetic import powerlaw_ids

__all__ = [
    "EmbeddingSpec",
    "ModelSpec",
    "TableSpec",
    "InputSpec",
    "MemoryReport",
    "Batch",
    "MODELS",
    "WORKLOADS",
    "E2E_MODEL",
    "BACKENDS",
    "workloads",
    "expand",
    "memory",
    "scale",
    "default_batch",
    "make_batch",
    "SamePool1d",
    "DenseTower",
    "SyntheticModel",
    "build_model",
    "torch_optimizer",
    "OPTIMIZERS",
    "torchrec_status",
    "state_bytes",
]

ALPHA = 1.05  # power-law exponent of the ids (NVIDIA's synthetic models page)


# --- specs --------------------------------------------------------------------------------
@dataclass(frozen=True)
class EmbeddingSpec:
    """``num_tables`` tables of ``rows`` x ``width``, each read by one input per entry of ``nnz``
    (its hotness: ids per sample). ``shared`` tables are read by ``len(nnz)`` inputs."""

    num_tables: int
    nnz: tuple[int, ...]
    rows: int
    width: int
    shared: bool

    def __post_init__(self) -> None:
        for attr in ("num_tables", "rows", "width"):
            v = getattr(self, attr)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ConfigError(f"EmbeddingSpec.{attr} must be a positive int, got {v!r}")
        if not self.nnz or not all(isinstance(h, int) and h > 0 for h in self.nnz):
            raise ConfigError(f"EmbeddingSpec.nnz must be a non-empty tuple of positive ints, got {self.nnz!r}")
        if len(self.nnz) > 1 and not self.shared:  # as distributed-embeddings: not implemented there
            raise ConfigError(
                f"EmbeddingSpec with nnz={list(self.nnz)} must be shared=True (one table, several inputs)"
            )


@dataclass(frozen=True)
class ModelSpec:
    """A synthetic model: embeddings, MLP widths (without the final ``Linear(., 1)``),
    numerical inputs and the stride of the average pooling that emulates an interaction.

    ``mlp=None`` makes an embedding-only workload: no MLP and no loss; the step
    backpropagates a fixed upstream gradient. With ``ragged=True`` a multi-hot bag of
    hotness ``h`` holds a uniform 0..2h ids (mean ``h``) instead of exactly ``h``. ``batch``:
    the batch the workload is defined at, if it fixes one.
    """

    name: str
    embeddings: tuple[EmbeddingSpec, ...]
    mlp: tuple[int, ...] | None
    numerical: int
    interact_stride: int | None
    ragged: bool = False
    batch: int | None = None

    def __post_init__(self) -> None:
        if not self.embeddings:
            raise ConfigError(f"model {self.name!r} has no embeddings")
        if self.interact_stride is not None and self.interact_stride <= 0:
            raise ConfigError(f"model {self.name!r}: interact_stride must be > 0 or None, got {self.interact_stride}")

    @property
    def num_tables(self) -> int:
        return sum(e.num_tables for e in self.embeddings)

    @property
    def ids_per_sample(self) -> float:
        """Mean ids per sample over all inputs (exact for fixed hotness)."""
        return float(sum(e.num_tables * sum(e.nnz) for e in self.embeddings))

    @property
    def embedding_width(self) -> int:
        """``W``: the width of all pooled inputs concatenated."""
        return sum(e.num_tables * len(e.nnz) * e.width for e in self.embeddings)


def _e(num_tables: int, nnz: list[int], rows: int, width: int, shared: bool) -> EmbeddingSpec:
    return EmbeddingSpec(num_tables, tuple(nnz), rows, width, shared)


# Transcribed from NVIDIA-Merlin/distributed-embeddings,
# examples/benchmarks/synthetic_models/config_v3.py (and the synthetic models page of its docs).
# Each entry is (num_tables, nnz, rows, width, shared).
MODELS: dict[str, ModelSpec] = {
    "tiny": ModelSpec(
        "tiny",
        (
            _e(1, [1, 10], 10_000, 8, True),
            _e(1, [1, 10], 1_000_000, 16, True),
            _e(1, [1, 10], 25_000_000, 16, True),
            _e(1, [1], 25_000_000, 16, False),
            _e(16, [1], 10, 8, False),
            _e(10, [1], 1_000, 8, False),
            _e(4, [1], 10_000, 8, False),
            _e(2, [1], 100_000, 16, False),
            _e(19, [1], 1_000_000, 16, False),
        ),
        mlp=(256, 128),
        numerical=10,
        interact_stride=None,
    ),
    "small": ModelSpec(
        "small",
        (
            _e(5, [1, 30], 10_000, 16, True),
            _e(3, [1, 30], 4_000_000, 32, True),
            _e(1, [1, 30], 50_000_000, 32, True),
            _e(1, [1], 50_000_000, 32, False),
            _e(30, [1], 10, 16, False),
            _e(30, [1], 1_000, 16, False),
            _e(5, [1], 10_000, 16, False),
            _e(5, [1], 100_000, 32, False),
            _e(27, [1], 4_000_000, 32, False),
        ),
        mlp=(512, 256, 128),
        numerical=10,
        interact_stride=None,
    ),
    "medium": ModelSpec(
        "medium",
        (
            _e(20, [1, 50], 100_000, 64, True),
            _e(5, [1, 50], 10_000_000, 64, True),
            _e(1, [1, 50], 100_000_000, 128, True),
            _e(1, [1], 100_000_000, 128, False),
            _e(80, [1], 10, 32, False),
            _e(60, [1], 1_000, 32, False),
            _e(80, [1], 100_000, 64, False),
            _e(24, [1], 200_000, 64, False),
            _e(40, [1], 10_000_000, 64, False),
        ),
        mlp=(1024, 512, 256, 128),
        numerical=25,
        interact_stride=7,
    ),
    "large": ModelSpec(
        "large",
        (
            _e(40, [1, 100], 100_000, 64, True),
            _e(16, [1, 100], 15_000_000, 64, True),
            _e(1, [1, 100], 200_000_000, 128, True),
            _e(1, [1], 200_000_000, 128, False),
            _e(100, [1], 10, 32, False),
            _e(100, [1], 10_000, 32, False),
            _e(160, [1], 100_000, 64, False),
            _e(50, [1], 500_000, 64, False),
            _e(144, [1], 15_000_000, 64, False),
        ),
        mlp=(2048, 1024, 512, 256),
        numerical=100,
        interact_stride=8,
    ),
    "jumbo": ModelSpec(
        "jumbo",
        (
            _e(50, [1, 200], 100_000, 128, True),
            _e(24, [1, 200], 20_000_000, 128, True),
            _e(1, [1, 200], 400_000_000, 256, True),
            _e(1, [1], 400_000_000, 256, False),
            _e(100, [1], 10, 32, False),
            _e(200, [1], 10_000, 64, False),
            _e(350, [1], 100_000, 128, False),
            _e(80, [1], 1_000_000, 128, False),
            _e(216, [1], 20_000_000, 128, False),
        ),
        mlp=(2048, 1024, 512, 256),
        numerical=200,
        interact_stride=20,
    ),
    "colossal": ModelSpec(
        "colossal",
        (
            _e(100, [1, 300], 100_000, 128, True),
            _e(50, [1, 300], 40_000_000, 256, True),
            _e(1, [1, 300], 2_000_000_000, 256, True),
            _e(1, [1], 1_000_000_000, 256, False),
            _e(100, [1], 10, 32, False),
            _e(400, [1], 10_000, 128, False),
            _e(100, [1], 100_000, 128, False),
            _e(800, [1], 1_000_000, 128, False),
            _e(450, [1], 40_000_000, 256, False),
        ),
        mlp=(4096, 2048, 1024, 512, 256),
        numerical=500,
        interact_stride=30,
    ),
    "criteo-dlrm-like": ModelSpec(
        "criteo-dlrm-like", (_e(26, [1], 100_000, 128, False),), mlp=(512, 256, 128), numerical=13, interact_stride=None
    ),
}

# The embedding-only step of benchmarks/bench_step.py: 26 x 200,000 x 64, one-hot and multi-hot (mean 10).
WORKLOADS: dict[str, tuple[ModelSpec, ...]] = {
    **{name: (spec,) for name, spec in MODELS.items()},
    "embedding-step": (
        ModelSpec("embedding-step/one-hot", (_e(26, [1], 200_000, 64, False),), None, 0, None, batch=8192),
        ModelSpec(
            "embedding-step/multi-hot", (_e(26, [10], 200_000, 64, False),), None, 0, None, ragged=True, batch=8192
        ),
    ),
}


# ``hybridembed train``'s DLRM end to end (bench/e2e.py, which imports the train package only
# when that workload runs); not a synthetic model, so not in WORKLOADS
E2E_MODEL = "train-e2e"


def workloads(name: str) -> tuple[ModelSpec, ...]:
    """The model(s) behind a ``--model`` name (``embedding-step`` is two: one-hot and multi-hot)."""
    if name not in WORKLOADS:
        raise ConfigError(f"unknown model {name!r}; allowed: {', '.join(WORKLOADS)}")
    return WORKLOADS[name]


# --- expansion, accounting, scaling --------------------------------------------------------
@dataclass(frozen=True)
class TableSpec:
    name: str
    rows: int
    width: int


@dataclass(frozen=True)
class InputSpec:
    """One sparse input (feature): ``hotness`` ids per sample from table ``table``."""

    name: str
    table: str
    hotness: int
    width: int


def expand(spec: ModelSpec) -> tuple[list[TableSpec], list[InputSpec]]:
    """Tables ``t0, t1, ...`` in config order; the inputs of a table follow each other
    (``t3`` for a single input, ``t0_0, t0_1`` for a shared table read twice)."""
    tables: list[TableSpec] = []
    inputs: list[InputSpec] = []
    for e in spec.embeddings:
        for _ in range(e.num_tables):
            t = TableSpec(f"t{len(tables)}", e.rows, e.width)
            tables.append(t)
            for k, h in enumerate(e.nnz):
                inputs.append(InputSpec(t.name if len(e.nnz) == 1 else f"{t.name}_{k}", t.name, h, e.width))
    return tables, inputs


# optimizer -> (state floats per element, state floats per row), as he.optim documents them
OPTIMIZER_STATE: dict[str, tuple[int, int]] = {
    "sgd": (0, 0),
    "adagrad": (1, 0),
    "rowwise_adagrad": (0, 1),
    "adam": (2, 0),
}


@dataclass(frozen=True)
class MemoryReport:
    """Full-size memory of a model's embeddings (float32 rows) and their optimizer state."""

    model: str
    tables: int
    inputs: int
    rows: int
    parameters: int  # embedding elements: sum of rows * width
    ids_per_sample: float
    optimizer: str
    weight_bytes: int
    optimizer_bytes: int
    dense_parameters: int  # MLP weights and biases, float32 (not in the totals)

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.optimizer_bytes

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "total_bytes": self.total_bytes}


def _dense_parameters(spec: ModelSpec) -> int:
    if spec.mlp is None:
        return 0
    w = spec.embedding_width
    width = (-(-w // spec.interact_stride) if spec.interact_stride else w) + spec.numerical
    n = 0
    for size in (*spec.mlp, 1):
        n += width * size + size
        width = size
    return n


def memory(spec: ModelSpec, optimizer: str = "adagrad", bytes_per_element: int = 4) -> MemoryReport:
    """Full-size accounting from the spec alone (no tensor is allocated):
    rows * width * 4 bytes per table, plus the optimizer's state (Adagrad: the same again)."""
    if optimizer not in OPTIMIZER_STATE:
        raise ConfigError(f"unknown optimizer {optimizer!r}; allowed: {', '.join(OPTIMIZER_STATE)}")
    per_elem, per_row = OPTIMIZER_STATE[optimizer]
    rows = sum(e.num_tables * e.rows for e in spec.embeddings)
    params = sum(e.num_tables * e.rows * e.width for e in spec.embeddings)
    return MemoryReport(
        model=spec.name,
        tables=spec.num_tables,
        inputs=sum(e.num_tables * len(e.nnz) for e in spec.embeddings),
        rows=rows,
        parameters=params,
        ids_per_sample=spec.ids_per_sample,
        optimizer=optimizer,
        weight_bytes=params * bytes_per_element,
        optimizer_bytes=(params * per_elem + rows * per_row) * 4,
        dense_parameters=_dense_parameters(spec),
    )


def scale(spec: ModelSpec, max_rows: int | None) -> ModelSpec:
    """The same model with every table capped at ``max_rows`` rows; table count, widths,
    hotness and sharing are kept."""
    if max_rows is None:
        return spec
    if max_rows <= 0:
        raise ConfigError(f"max_rows must be > 0, got {max_rows}")
    capped = tuple(dataclasses.replace(e, rows=min(e.rows, max_rows)) for e in spec.embeddings)
    return dataclasses.replace(spec, embeddings=capped)


def default_batch(spec: ModelSpec, quick: bool = False) -> int:
    """The batch a scaled run uses: ``spec.batch`` where the workload fixes one (a quarter
    with ``quick``), else the largest power of two <= 8192 that keeps a step under 2**20 ids
    and 2**35 multiply-adds in the MLP (2**18 and 2**33 with ``quick``).

    The published runs use 65,536; scaled down, the batch shrinks with the ids per sample
    and the MLP so every model does comparable work per step (tiny 8192, large 128)."""
    if spec.batch is not None:
        return max(spec.batch // 4, 1) if quick else spec.batch
    ids_budget, mac_budget = (2**18, 2**33) if quick else (2**20, 2**35)
    macs = 3 * _dense_parameters(spec)  # per sample: forward + two backward matmuls
    b = 8192
    while b > 1 and (b * spec.ids_per_sample > ids_budget or b * macs > mac_budget):
        b //= 2
    return b


# --- data ------------------------------------------------------------------------------------
@dataclass
class Batch:
    """One synthetic batch: ``sparse`` ids per input, ``dense`` (B, N) uniform in [0, 100),
    ``labels`` (B, 1) in {0, 1} as floats."""

    sparse: dict[str, Jagged]
    dense: torch.Tensor
    labels: torch.Tensor

    @property
    def num_ids(self) -> int:
        return sum(int(j.values.numel()) for j in self.sparse.values())

    def to(self, device: torch.device | str) -> Batch:
        """The same batch on ``device`` (itself when already there)."""
        if self.dense.device == torch.device(device):
            return self
        return Batch({k: j.to(device) for k, j in self.sparse.items()}, self.dense.to(device), self.labels.to(device))


def make_batch(spec: ModelSpec, batch: int, generator: torch.Generator | None = None) -> Batch:
    """Power-law ids (alpha 1.05) for every input of ``spec``; fixed hotness unless ``spec.ragged``."""
    tables, inputs = expand(spec)
    rows = {t.name: t.rows for t in tables}
    sparse: dict[str, Jagged] = {}
    for inp in inputs:
        if spec.ragged and inp.hotness > 1:
            lengths = torch.randint(0, 2 * inp.hotness + 1, (batch,), generator=generator)  # (B,) mean h
        else:
            lengths = torch.full((batch,), inp.hotness, dtype=torch.int64)  # (B,)
        ids = powerlaw_ids(int(lengths.sum()), rows[inp.table], ALPHA, generator)  # (N_f,)
        sparse[inp.name] = Jagged.from_lengths(ids, lengths)
    dense = torch.rand(batch, spec.numerical, generator=generator) * 100.0  # (B, N)
    labels = torch.randint(0, 2, (batch, 1), generator=generator).float()  # (B, 1)
    return Batch(sparse, dense, labels)


# --- the dense part ------------------------------------------------------------------------
class SamePool1d(nn.Module):
    """Keras ``AveragePooling1D(stride, padding='same')`` along the width: (B, W) -> (B, ceil(W/s)).

    TensorFlow pads ``pad // 2`` zeros before and the rest after, and averages each window
    over its real elements only.

    >>> SamePool1d(5, 2)(torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0]]))
    tensor([[1.5000, 3.5000, 5.0000]])
    """

    def __init__(self, width: int, stride: int):
        super().__init__()
        self.stride = stride
        self.out = -(-width // stride)
        pad = self.out * stride - width
        self.pad = (pad // 2, pad - pad // 2)
        counts = F.pad(torch.ones(width), self.pad).view(self.out, stride).sum(1)  # (W',)
        self.register_buffer("inv_counts", counts.reciprocal(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, W)
        xp = F.pad(x, self.pad)  # (B, W' * s)
        return xp.view(x.shape[0], self.out, self.stride).sum(2) * self.inv_counts  # (B, W')


class DenseTower(nn.Module):
    """concat(embeddings) -> [pooling] -> concat numerical -> MLP (ReLU) -> Linear(., 1)."""

    def __init__(self, embedding_width: int, numerical: int, mlp: tuple[int, ...], interact_stride: int | None):
        super().__init__()
        self.interact = SamePool1d(embedding_width, interact_stride) if interact_stride else None
        width = (self.interact.out if self.interact is not None else embedding_width) + numerical
        layers: list[nn.Module] = []
        for size in mlp:
            layers += [nn.Linear(width, size), nn.ReLU()]
            width = size
        layers.append(nn.Linear(width, 1))
        self.mlp = nn.Sequential(*layers)

    def forward(self, parts: list[torch.Tensor], dense: torch.Tensor) -> torch.Tensor:
        x = torch.cat(parts, 1) if len(parts) > 1 else parts[0]  # (B, W)
        if self.interact is not None:
            x = self.interact(x)  # (B, ceil(W / s))
        return self.mlp(torch.cat([x, dense], 1))  # (B, 1) logits


# --- embedding backends -----------------------------------------------------------------------
class HybridEmbeddings(nn.Module):
    """hybridembed: one ``EmbeddingCollection``; tables of a width share a storage."""

    def __init__(
        self,
        tables: list[TableSpec],
        inputs: list[InputSpec],
        seed: int = 0,
        device: torch.device | str | None = None,
        kernels: str = "auto",
    ):
        super().__init__()
        self.collection = EmbeddingCollection(
            [TableConfig(t.name, t.rows, t.width) for t in tables],
            features={i.name: i.table for i in inputs},
            seed=seed,
            device=device,
            kernels=kernels,
        )
        self.names = [i.name for i in inputs]

    def native_input(self, sparse: dict[str, Jagged]) -> Any:
        return sparse

    def forward(self, sparse: Mapping[str, Jagged]) -> list[torch.Tensor]:
        out = self.collection(sparse)
        return [out[n] for n in self.names]  # F x (B, D)

    def weight(self, table: str) -> torch.Tensor:
        return self.collection.weight(table)

    def memory_tensors(self) -> list[torch.Tensor]:
        return [t for s in self.collection.storages for t in (s.weight, *getattr(s, "state", {}).values())]


class PerTableEmbeddings(nn.Module):
    """What a PyTorch user writes first: one ``nn.EmbeddingBag(mode="sum", sparse=True)`` per table."""

    def __init__(self, tables: list[TableSpec], inputs: list[InputSpec], device: torch.device | str | None = None):
        super().__init__()
        self.bags = nn.ModuleDict(
            {
                t.name: nn.EmbeddingBag(
                    t.rows, t.width, mode="sum", sparse=True, include_last_offset=True, device=device
                )
                for t in tables
            }
        )
        self.inputs = [(i.name, i.table) for i in inputs]

    def native_input(self, sparse: dict[str, Jagged]) -> Any:
        return {k: (j.values, j.offsets) for k, j in sparse.items()}

    def forward(self, sparse: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        return [self.bags[t](*sparse[n]) for n, t in self.inputs]  # F x (B, D)

    def weight(self, table: str) -> torch.Tensor:
        return self.bags[table].weight.detach()

    def memory_tensors(self) -> list[torch.Tensor]:
        return [b.weight for b in self.bags.values()]


def torchrec_status() -> str | None:
    """None when TorchRec's fused embedding modules import; otherwise why not (one line)."""
    try:
        import torchrec  # noqa: F401
        from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection  # noqa: F401
    except Exception as e:  # ImportError, or OSError when fbgemm's compiled ops mismatch torch
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None


class TorchRecEmbeddings(nn.Module):
    """TorchRec's ``FusedEmbeddingBagCollection``: FBGEMM's CPU kernel with the optimizer fused
    into backward (the rows are updated during ``backward()``; no optimizer step)."""

    def __init__(self, tables: list[TableSpec], inputs: list[InputSpec], optimizer: str, lr: float, eps: float):
        super().__init__()
        import torchrec
        from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection

        feats: dict[str, list[str]] = {}
        for i in inputs:
            feats.setdefault(i.table, []).append(i.name)
        configs = [
            torchrec.EmbeddingBagConfig(
                name=t.name, num_embeddings=t.rows, embedding_dim=t.width, feature_names=feats[t.name]
            )
            for t in tables
        ]
        opt_type, kwargs = _TORCH_OPTIMIZERS[optimizer]
        self.ebc = FusedEmbeddingBagCollection(
            configs, optimizer_type=opt_type, optimizer_kwargs=kwargs(lr, eps), device=torch.device("cpu")
        )
        # output order is table order, then each table's features: the order of ``inputs``
        self.keys = [i.name for i in inputs]
        self._weights = {
            c.name: w for m in self.ebc._emb_modules for c, w in zip(m._embedding_tables, m.split_embedding_weights())
        }

    def native_input(self, sparse: dict[str, Jagged]) -> Any:
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        lengths = [sparse[k].offsets[1:] - sparse[k].offsets[:-1] for k in self.keys]
        return KeyedJaggedTensor(
            keys=self.keys,
            values=torch.cat([sparse[k].values for k in self.keys]),
            lengths=torch.cat(lengths),
        )

    def forward(self, kjt: Any) -> list[torch.Tensor]:
        return [self.ebc(kjt).values()]  # [(B, W)]: FBGEMM writes the concatenation directly

    def weight(self, table: str) -> torch.Tensor:
        return self._weights[table]

    def memory_tensors(self) -> list[torch.Tensor]:
        tbe = [m._emb_module for m in self.ebc._emb_modules]
        return [t for m in tbe for t in (*m.parameters(), *m.buffers())]


class SyntheticModel(nn.Module):
    """Embeddings, then (unless embedding-only) the dense tower: ``forward -> (B, 1)`` logits,
    or the list of pooled embeddings ``F x (B, D)`` for an embedding-only model."""

    def __init__(self, spec: ModelSpec, embeddings: nn.Module, tower: DenseTower | None):
        super().__init__()
        self.spec = spec
        self.embeddings = embeddings
        self.tower = tower

    def forward(self, sparse: Any, dense: torch.Tensor | None = None) -> torch.Tensor | list[torch.Tensor]:
        parts = self.embeddings(sparse)
        if self.tower is None:
            return parts
        return self.tower(parts, dense)


BACKENDS = ("hybridembed", "per_table", "torchrec")

# optimizer name -> (torch.optim class, its kwargs from (lr, eps)); TorchRec fuses both classes
_TORCH_OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], Callable[[float, float], dict]]] = {
    "adagrad": (torch.optim.Adagrad, lambda lr, eps: {"lr": lr, "eps": eps}),
    "sgd": (torch.optim.SGD, lambda lr, eps: {"lr": lr}),
}
OPTIMIZERS = tuple(_TORCH_OPTIMIZERS)


def torch_optimizer(params: Any, name: str, lr: float, eps: float = 1e-8) -> torch.optim.Optimizer:
    """``torch.optim.Adagrad(params, lr=lr, eps=eps)`` or ``torch.optim.SGD(params, lr=lr)``."""
    if name not in _TORCH_OPTIMIZERS:
        raise ConfigError(f"unknown optimizer {name!r}; allowed: {', '.join(_TORCH_OPTIMIZERS)}")
    cls, kwargs = _TORCH_OPTIMIZERS[name]
    return cls(params, **kwargs(lr, eps))


def build_model(
    spec: ModelSpec,
    backend: str,
    optimizer: str = "adagrad",
    lr: float = 0.01,
    eps: float = 1e-8,
    seed: int = 0,
    like: SyntheticModel | None = None,
    device: torch.device | str | None = None,
    kernels: str = "auto",
) -> tuple[SyntheticModel, torch.optim.Optimizer | None]:
    """A model of ``spec`` with ``backend`` embeddings and its optimizer (None when nothing is
    left to step: TorchRec's embedding-only model updates its rows in backward).

    ``like``: copy its embedding rows and dense weights, so every contender starts equal.
    The dense part always trains with the torch optimizer; the embeddings with its sparse
    equivalent (``he.wrap_optimizer``), ``torch.optim`` on sparse gradients, or TorchRec's
    fused optimizer. ``device``: where the model lives (TorchRec's: the CPU only);
    ``kernels``: the hybridembed backend's (see :mod:`hybridembed.kernels.backend`).
    """
    if backend not in BACKENDS:
        raise ConfigError(f"unknown backend {backend!r}; allowed: {', '.join(BACKENDS)}")
    if optimizer not in _TORCH_OPTIMIZERS:
        raise ConfigError(f"unknown optimizer {optimizer!r}; allowed: {', '.join(_TORCH_OPTIMIZERS)}")
    tables, inputs = expand(spec)
    if backend == "torchrec" and device is not None and torch.device(device).type != "cpu":
        raise ConfigError(f"the torchrec backend runs FBGEMM's CPU kernel only, not on {device}; use device='cpu'")
    if backend == "hybridembed":
        emb: nn.Module = HybridEmbeddings(tables, inputs, seed, device=device, kernels=kernels)
    elif backend == "per_table":
        emb = PerTableEmbeddings(tables, inputs, device=device)
    else:
        emb = TorchRecEmbeddings(tables, inputs, optimizer, lr, eps)
    tower = None
    if spec.mlp is not None:
        if like is not None and like.tower is not None:
            tower = copy.deepcopy(like.tower)
        else:
            with torch.random.fork_rng():
                torch.manual_seed(seed)
                tower = DenseTower(spec.embedding_width, spec.numerical, spec.mlp, spec.interact_stride)
        if device is not None:
            tower = tower.to(device)
    if like is not None:
        with torch.no_grad():
            for t in tables:
                emb.weight(t.name).copy_(like.embeddings.weight(t.name))
    model = SyntheticModel(spec, emb, tower)
    if backend == "hybridembed":
        return model, wrap_optimizer(torch_optimizer(model.parameters(), optimizer, lr, eps), model)
    if backend == "per_table":
        return model, torch_optimizer(model.parameters(), optimizer, lr, eps)
    return model, (torch_optimizer(tower.parameters(), optimizer, lr, eps) if tower is not None else None)


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, Mapping):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def state_bytes(model: SyntheticModel, optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes held between steps: parameters, buffers and optimizer state (each storage once)."""
    tensors = [*model.parameters(), *model.buffers(), *model.embeddings.memory_tensors()]
    if optimizer is not None:
        tensors += _tensors(dict(optimizer.state))
    seen: dict[int, int] = {}
    for t in tensors:
        if t.device.type == "meta":
            continue
        s = t.untyped_storage()
        seen[s.data_ptr()] = max(seen.get(s.data_ptr(), 0), s.nbytes())
    return sum(seen.values())
