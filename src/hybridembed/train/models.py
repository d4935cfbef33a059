"""The recommendation models of ``hybridembed train``: DLRM, Wide & Deep, DeepFM, DCNv2.

    python -c "from hybridembed.train.models import build; print(build('dlrm', 13, [f'C{i}' for i in range(1, 27)]))"

Shape legend: ``B`` batch, ``Dn`` dense features, ``F`` categorical features, ``D``
embedding dim, ``K = Dn + F * D`` the flat input of the MLP/cross towers.

Every model is plain PyTorch around an *embedding provider*: a module mapping sparse ids
(B, F) int64 to rows (B, F, D). :class:`DynamicEmbeddings` holds one dynamic
:class:`hybridembed.EmbeddingCollection` table per feature (any int64 id, rows made on first
sight, at most ``capacity`` rows per table); :class:`TorchEmbeddings` holds one
``nn.Embedding`` per feature over a known vocabulary (what :func:`hybridembed.convert`
swaps out). ``forward(dense (B, Dn) float, sparse (B, F) int64) -> logits (B,)``: two plain
tensors in, one out, so the model exports to TorchScript or ONNX as is.

    >>> import torch
    >>> m = build("deepfm", 2, ["a", "b"], dim=4, capacity=100, mlp=(8,))
    >>> m(torch.randn(3, 2), torch.tensor([[1, 7], [2, 7], [1, 9]])).shape
    torch.Size([3])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from .. import init as he_init
from ..config import Dynamic, TableConfig, Tiered
from ..modules import EmbeddingCollection

__all__ = [
    "MODELS",
    "DynamicEmbeddings",
    "TieredEmbeddings",
    "TorchEmbeddings",
    "DLRM",
    "WideDeep",
    "DeepFM",
    "DCNv2",
    "build",
    "mlp",
    "tower",
]

EmbeddingFactory = Callable[[int, str], nn.Module]  # (dim, name prefix) -> (B, F) ids -> (B, F, D)


class DynamicEmbeddings(nn.Module):
    """One dynamic hybridembed table per feature: (B, F) int64 ids -> (B, F, D) rows.

    All tables share dim, dtype and :class:`hybridembed.Dynamic` config, so they form one
    group: one hash storage and one fused lookup per step. ``device`` and ``kernels`` are the
    collection's (:class:`hybridembed.EmbeddingCollection`): the rows are made where they live.
    ``tiered`` (unbounded tables only): rows beyond its cache spilled to its files, every row kept.
    """

    def __init__(
        self,
        features: Sequence[str],
        dim: int,
        capacity: int | None = 100_000,
        prefix: str = "",
        seed: int = 0,
        init: he_init.Init | None = None,
        min_count: int = 1,
        device: torch.device | str | None = None,
        kernels: str = "auto",
        tiered: Tiered | None = None,
    ):
        super().__init__()
        self.features = list(features)
        self.names = [f"{prefix}{f}".replace(".", "_") for f in self.features]
        dynamic = Dynamic(capacity=capacity, min_count=min_count)
        init = init or he_init.uniform(-0.05, 0.05)
        tables = [TableConfig(n, None, dim, init=init, dynamic=dynamic, tiered=tiered) for n in self.names]
        self.collection = EmbeddingCollection(tables, seed=seed, device=device, kernels=kernels)

    def forward(self, sparse: torch.Tensor) -> torch.Tensor:
        out = self.collection({n: sparse[:, j] for j, n in enumerate(self.names)})  # {feature: (B, D)}
        return torch.stack([out[n] for n in self.names], 1)  # (B, F, D)


class TieredEmbeddings(nn.Module):
    """One dense tiered table of ``rows`` rows per feature, ids hashed into it (``id mod rows``:
    ids that collide share a row): (B, F) int64 ids -> (B, F, D). The rows and optimizer state
    live in files under ``where``, ``cache_rows`` of them in memory (:class:`hybridembed.Tiered`;
    the tables form one group, so one cache)."""

    def __init__(
        self,
        features: Sequence[str],
        dim: int,
        rows: int,
        where: str,
        cache_rows: int,
        prefix: str = "",
        seed: int = 0,
        init: he_init.Init | None = None,
        device: torch.device | str | None = None,
        mapped: bool | None = None,
    ):
        super().__init__()
        self.features, self.rows = list(features), int(rows)
        self.names = [f"{prefix}{f}".replace(".", "_") for f in self.features]
        tiered = Tiered(where, cache_rows=cache_rows, mapped=mapped)
        init = init or he_init.uniform(-0.05, 0.05)
        tables = [TableConfig(n, self.rows, dim, init=init, tiered=tiered) for n in self.names]
        self.collection = EmbeddingCollection(tables, seed=seed, device=device)

    def forward(self, sparse: torch.Tensor) -> torch.Tensor:
        ids = sparse.remainder(self.rows)  # (any int64, negative too, into [0, rows))
        out = self.collection({n: ids[:, j] for j, n in enumerate(self.names)})  # {feature: (B, D)}
        return torch.stack([out[n] for n in self.names], 1)  # (B, F, D)


class TorchEmbeddings(nn.Module):
    """One ``nn.Embedding`` per feature over a known vocabulary: (B, F) int64 -> (B, F, D)."""

    def __init__(self, vocab_sizes: Sequence[int], dim: int, std: float | None = None):
        super().__init__()
        self.tables = nn.ModuleList(nn.Embedding(v, dim) for v in vocab_sizes)
        for t in self.tables:
            if std is None:
                nn.init.uniform_(t.weight, -0.05, 0.05)  # hybridembed's default initializer
            else:
                nn.init.normal_(t.weight, std=std)

    def forward(self, sparse: torch.Tensor) -> torch.Tensor:
        return torch.stack([t(sparse[:, j]) for j, t in enumerate(self.tables)], 1)  # (B, F, D)


def mlp(sizes: Sequence[int], last_relu: bool = True) -> nn.Sequential:
    """Linear layers ``sizes[0] -> sizes[1] -> ...`` with ReLU between (and after the last if asked)."""
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(a, b))
        if last_relu or i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def tower(width: int, sizes: Sequence[int]) -> nn.Sequential:
    """An MLP ``width -> sizes...`` with ReLUs, then a linear layer to one logit."""
    return nn.Sequential(mlp([width, *sizes]), nn.Linear(sizes[-1] if sizes else width, 1))


class DLRM(nn.Module):
    """DLRM (Naumov et al. 2019): bottom MLP on dense features, pairwise dot interactions, top MLP.

    The bottom MLP maps (B, Dn) to one more (B, D) vector; the dot products of every pair
    among the F + 1 vectors, with the bottom output, feed the top MLP.
    """

    def __init__(
        self,
        num_dense: int,
        num_sparse: int,
        dim: int,
        embeddings: EmbeddingFactory,
        bottom: Sequence[int] = (64,),
        top: Sequence[int] = (128, 64),
    ):
        super().__init__()
        self.embeddings = embeddings(dim, "")
        self.bottom = mlp([num_dense, *bottom, dim])
        n = num_sparse + 1
        tri = torch.triu_indices(n, n, offset=1)  # (2, n(n-1)/2): the pairs i < j
        # flat positions in the (n, n) matrix: index_select (backward: index_add) is ~2x faster
        # than advanced indexing (backward: index_put with accumulate) on the CPU here
        self.register_buffer("pairs", tri[0] * n + tri[1], persistent=False)
        self.top = tower(dim + n * (n - 1) // 2, top)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        x = self.bottom(dense)  # (B, D)
        z = torch.cat([x.unsqueeze(1), self.embeddings(sparse)], 1)  # (B, F+1, D)
        dots = torch.bmm(z, z.transpose(1, 2))  # (B, F+1, F+1)
        inter = dots.flatten(1).index_select(1, self.pairs)  # (B, (F+1)F/2)
        return self.top(torch.cat([x, inter], 1)).squeeze(1)  # (B,)


class WideDeep(nn.Module):
    """Wide & Deep (Cheng et al. 2016): a linear model over the ids (dim-1 embeddings) and the
    dense features, plus an MLP over the concatenated embeddings and dense features."""

    def __init__(
        self,
        num_dense: int,
        num_sparse: int,
        dim: int,
        embeddings: EmbeddingFactory,
        deep: Sequence[int] = (128, 64),
    ):
        super().__init__()
        self.embeddings = embeddings(dim, "")
        self.wide = embeddings(1, "wide_")
        self.wide_dense = nn.Linear(num_dense, 1)
        self.deep = tower(num_dense + num_sparse * dim, deep)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        wide = self.wide(sparse).sum((1, 2)) + self.wide_dense(dense).squeeze(1)  # (B,)
        e = self.embeddings(sparse).flatten(1)  # (B, F*D)
        return wide + self.deep(torch.cat([dense, e], 1)).squeeze(1)  # (B,)


class DeepFM(nn.Module):
    """DeepFM (Guo et al. 2017): first-order terms, the factorisation machine's pairwise term
    over the embeddings (the dense features projected to one more field), and an MLP."""

    def __init__(
        self,
        num_dense: int,
        num_sparse: int,
        dim: int,
        embeddings: EmbeddingFactory,
        deep: Sequence[int] = (128, 64),
    ):
        super().__init__()
        self.embeddings = embeddings(dim, "")
        self.first = embeddings(1, "first_")
        self.first_dense = nn.Linear(num_dense, 1)
        self.dense_field = nn.Linear(num_dense, dim)
        self.deep = tower(num_dense + num_sparse * dim, deep)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        e = self.embeddings(sparse)  # (B, F, D)
        v = torch.cat([self.dense_field(dense).unsqueeze(1), e], 1)  # (B, F+1, D)
        fm = 0.5 * (v.sum(1).square() - v.square().sum(1)).sum(1)  # (B,) sum over pairs of <v_i, v_j>
        first = self.first(sparse).sum((1, 2)) + self.first_dense(dense).squeeze(1)  # (B,)
        deep = self.deep(torch.cat([dense, e.flatten(1)], 1)).squeeze(1)  # (B,)
        return first + fm + deep


class DCNv2(nn.Module):
    """DCN-V2 (Wang et al. 2021), stacked: full-rank cross layers
    ``x_{l+1} = x0 * (W x_l + b) + x_l`` over ``x0 = [dense, embeddings]``, then an MLP."""

    def __init__(
        self,
        num_dense: int,
        num_sparse: int,
        dim: int,
        embeddings: EmbeddingFactory,
        deep: Sequence[int] = (128, 64),
        cross_layers: int = 2,
    ):
        super().__init__()
        self.embeddings = embeddings(dim, "")
        k = num_dense + num_sparse * dim
        self.cross = nn.ModuleList(nn.Linear(k, k) for _ in range(cross_layers))
        for layer in self.cross:
            nn.init.zeros_(layer.bias)
            nn.init.normal_(layer.weight, std=1.0 / k)  # starts near the identity map x_{l+1} ~ x_l
        self.deep = tower(k, deep)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        x0 = torch.cat([dense, self.embeddings(sparse).flatten(1)], 1)  # (B, K)
        x = x0
        for layer in self.cross:
            x = x0 * layer(x) + x  # (B, K)
        return self.deep(x).squeeze(1)  # (B,)


MODELS: dict[str, type[nn.Module]] = {"dlrm": DLRM, "wdl": WideDeep, "deepfm": DeepFM, "dcnv2": DCNv2}


def build(
    kind: str,
    num_dense: int,
    features: Sequence[str],
    dim: int = 16,
    capacity: int | None = 100_000,
    vocab_sizes: Sequence[int] | None = None,
    mlp: Sequence[int] = (128, 64),
    bottom: Sequence[int] = (64,),
    cross_layers: int = 2,
    seed: int = 0,
    min_count: int = 1,
    device: torch.device | str | None = None,
    kernels: str = "auto",
    tiered: str | None = None,
    tiered_cache: int = 0,
    sharded: bool = False,
    tiered_mapped: bool | None = None,
) -> nn.Module:
    """A model by name (``dlrm``, ``wdl``, ``deepfm``, ``dcnv2``).

    With ``vocab_sizes`` the tables are ``nn.Embedding`` (:class:`TorchEmbeddings`);
    otherwise dynamic hybridembed tables of at most ``capacity`` rows each (None: unbounded).
    ``mlp`` is the top MLP of DLRM and the deep tower of the others; ``bottom`` DLRM's
    bottom MLP (its last layer, of width ``dim``, is added); ``cross_layers`` DCNv2's.
    The dense layers' initial weights come from ``torch.manual_seed(seed)`` (made on the CPU,
    then moved: the same on every device). ``device``: where the model lives (the dynamic
    tables are made there, not moved); ``kernels``: their backend (``"auto"``, ``"eager"``,
    ``"triton"``; see :mod:`hybridembed.kernels.backend`). ``tiered``: a directory: the tables
    are :class:`TieredEmbeddings` there (``capacity`` rows each, ``tiered_cache`` rows in memory),
    or without a ``capacity`` dynamic tables whose rows beyond ``tiered_cache`` go to files there
    (``tiered_mapped``: :class:`~hybridembed.Tiered`'s ``mapped``).
    ``sharded``: the model is for :func:`hybridembed.distribute`, which makes each rank's shards:
    tiered tables are described on ``meta`` (no files: each rank's shards open their own).
    """
    if kind not in MODELS:
        raise ValueError(f"unknown model {kind!r}; allowed: {', '.join(MODELS)}")
    torch.manual_seed(seed)
    on = "meta" if sharded and tiered is not None else None  # (where tiered tables are made: here, or by shard)

    def embeddings(d: int, prefix: str) -> nn.Module:
        if vocab_sizes is not None:
            return TorchEmbeddings(vocab_sizes, d)
        if tiered is not None and capacity is not None:
            return TieredEmbeddings(
                features, d, capacity, tiered, tiered_cache, prefix=prefix, seed=seed, device=on, mapped=tiered_mapped
            )
        return DynamicEmbeddings(
            features,
            d,
            capacity=capacity,
            prefix=prefix,
            seed=seed,
            min_count=min_count,
            device=on if tiered is not None else device,
            kernels=kernels,
            tiered=Tiered(tiered, cache_rows=tiered_cache, mapped=tiered_mapped) if tiered is not None else None,
        )

    f = len(features)
    if kind == "dlrm":
        model = DLRM(num_dense, f, dim, embeddings, bottom=bottom, top=mlp)
    elif kind == "dcnv2":
        model = DCNv2(num_dense, f, dim, embeddings, deep=mlp, cross_layers=cross_layers)
    else:
        model = MODELS[kind](num_dense, f, dim, embeddings, deep=mlp)
    return model if device is None or on is not None else model.to(device)  # (tiered: on the CPU only)
