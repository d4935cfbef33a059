"""Data for ``hybridembed train``: Criteo TSV files (streamed), a Criteo-format generator, UCI Adult.

    python -c "from hybridembed.train import data; print(data.count_rows(['../shared/data/criteo_1tb_day0_head1000.tsv']))"

Shape legend: ``B`` batch, ``Dn`` dense (numeric) features, ``F`` categorical features.

A :class:`Batch` is ``dense`` (B, Dn) float32, ``sparse`` (B, F) int64 ids, ``label`` (B,)
float32. Sources yield batches in an order fixed by ``(seed, epoch)``, so a run resumed
mid-epoch can skip the batches it already trained on.

Criteo format (the 1TB day files and Kaggle's ``train.txt``): one impression per line, tab
separated, no header: label, 13 integer features ``I1..I13``, 26 categorical features
``C1..C26`` as 8-hex-digit hashes; any feature may be empty. Files are read by
``pyarrow.csv`` in streaming blocks (``.gz``/``.bz2`` decompressed on the fly); hex cells become
int64 ids with numpy over the bytes (no Python loop per value); an empty categorical cell becomes
the reserved id :data:`MISSING_ID` of its feature; integers become ``log(1 + max(x, 0))``, an
empty one 0.
"""

from __future__ import annotations

import math
import os
import queue
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import HybridEmbedError
from ..init import stable_hash64
from ..synthetic import powerlaw_ids
from ..utils import get_logger

__all__ = [
    "Batch",
    "DataError",
    "MISSING_ID",
    "CRITEO_DENSE",
    "CRITEO_SPARSE",
    "CRITEO_COLUMNS",
    "ADULT_CATEGORICAL",
    "ADULT_NUMERIC",
    "hex_to_ids",
    "read_criteo",
    "count_rows",
    "CriteoSource",
    "TensorSource",
    "generate_criteo",
    "load_adult",
    "AdultData",
    "prefetch",
]

logger = get_logger(__name__)

CRITEO_DENSE = [f"I{i}" for i in range(1, 14)]
CRITEO_SPARSE = [f"C{i}" for i in range(1, 27)]
CRITEO_COLUMNS = ["label", *CRITEO_DENSE, *CRITEO_SPARSE]
MISSING_ID = 1 << 32  # an empty categorical cell: above every 8-hex-digit value, per feature (own table)
BLOCK_BYTES = 8 << 20  # pyarrow block: ~70k Criteo rows

ADULT_CATEGORICAL = [
    "workclass",
    "education",
    "marital-status",
    "occupation",
    "relationship",
    "race",
    "gender",
    "native-country",
]
ADULT_NUMERIC = ["age", "fnlwgt", "educational-num", "capital-gain", "capital-loss", "hours-per-week"]
ADULT_LABEL = "income"
# the 15 columns of UCI's own files (adult.data, adult.test: comma-separated, no header), in order
ADULT_UCI_COLUMNS = [
    "age", "workclass", "fnlwgt", "education", "educational-num", "marital-status", "occupation",
    "relationship", "race", "gender", "capital-gain", "capital-loss", "hours-per-week", "native-country", "income",
]  # fmt: skip
ADULT_SOURCE = (
    "UCI Adult (Census Income) is at https://archive.ics.uci.edu/dataset/2/adult: give its adult.data and "
    "adult.test (--data adult.data adult.test), or a parquet or CSV file with its 15 columns named age, workclass, "
    "..., native-country, income"
)


class DataError(HybridEmbedError):
    """A data file that is missing or malformed; the message names the file and the row."""


def _pyarrow():
    try:
        import pyarrow
        import pyarrow.compute
        import pyarrow.csv  # noqa: F401
    except ImportError:
        raise DataError("reading data needs pyarrow: pip install 'hybridembed[train]'") from None
    return pyarrow


@dataclass
class Batch:
    """One training batch: dense (B, Dn) float32, sparse (B, F) int64, label (B,) float32."""

    dense: torch.Tensor
    sparse: torch.Tensor
    label: torch.Tensor

    def __len__(self) -> int:
        return self.label.shape[0]


# --- Criteo: hex ids -------------------------------------------------------------------------
_HEX = np.full(256, 255, dtype=np.uint8)  # ASCII byte -> nibble; 255: not a hex digit
for _i, _c in enumerate(b"0123456789abcdef"):
    _HEX[_c] = _i
for _i, _c in enumerate(b"ABCDEF"):
    _HEX[_c] = 10 + _i


def hex_to_ids(arr, missing: int = MISSING_ID) -> tuple[np.ndarray, int | None]:
    """A pyarrow binary/string array of hex numbers -> ((n,) int64 ids, index of the first bad cell or None).

    Nulls become ``missing``. Vectorised over the array's bytes. Criteo's case, every cell 8
    digits: the cells lie back to back in the data buffer, so it is one (R, 8) view, a
    256-entry table lookup and a byte pack read as big-endian uint32. Other widths: one pass
    per digit position (up to 15 digits, so ids stay non-negative int64).

    >>> import pyarrow as pa
    >>> ids, bad = hex_to_ids(pa.array(["0000000a", None, "ff", "62770d79"]))
    >>> ids.tolist(), bad
    ([10, 4294967296, 255, 1651969401], None)
    """
    pa = _pyarrow()
    n = len(arr)
    out = np.full(n, missing, dtype=np.int64)
    if n == 0 or arr.null_count == n:
        return out, None
    if not (pa.types.is_string(arr.type) or pa.types.is_binary(arr.type)):
        arr = arr.cast(pa.binary())
    _, offsets, data = arr.buffers()[:3]
    off = np.frombuffer(offsets, dtype=np.int32, count=n + 1, offset=arr.offset * 4)
    buf = np.frombuffer(data, dtype=np.uint8) if data is not None else np.zeros(0, np.uint8)
    length = np.diff(off)  # (n,) 0 for nulls (as pyarrow's CSV reader writes them)
    valid = length > 0 if arr.null_count == 0 else ~arr.is_null().to_numpy(zero_copy_only=False)
    rows = np.flatnonzero(valid)
    lens = length[rows]
    nulls_empty = arr.null_count == 0 or not length[~valid].any()
    if nulls_empty and rows.size and (lens == 8).all():  # Criteo: back-to-back 8-digit cells
        nib = _HEX[buf[off[0] : off[0] + 8 * rows.size]].reshape(-1, 8)  # (R, 8) uint8
        if (nib == 255).any():
            return out, int(rows[np.argmax((nib == 255).any(1))])
        packed = np.ascontiguousarray((nib[:, 0::2] << 4) | nib[:, 1::2])  # (R, 4) bytes
        out[rows] = packed.view(">u4").ravel()
        return out, None
    start = off[:-1][rows].astype(np.int64)
    bad = (lens == 0) | (lens > 15)
    val = np.zeros(rows.size, dtype=np.int64)
    for k in range(int(min(lens.max(initial=0), 15))):
        has = lens > k
        nib = _HEX[buf[start[has] + k]].astype(np.int64)
        bad[has] |= nib == 255
        val[has] = (val[has] << 4) | (nib & 15)
    out[rows] = val
    if bad.any():
        return out, int(rows[np.argmax(bad)])
    return out, None


# --- Criteo: reading -------------------------------------------------------------------------
@dataclass
class _Block:
    dense: np.ndarray  # (R, 13) float32, log(1 + max(x, 0)), missing 0
    sparse: np.ndarray  # (R, 26) int64
    label: np.ndarray  # (R,) float32
    first_row: int  # 0-based index of the block's first row among all rows read


def _one_line(text: str, limit: int = 160) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_files(paths: Sequence[str]) -> None:
    """Raises :class:`DataError` for the first path that is not a readable file."""
    for p in paths:
        if not os.path.exists(p):
            raise DataError(f"{p}: no such file")
        if not os.path.isfile(p):
            raise DataError(f"{p}: not a file")
        if not os.access(p, os.R_OK):
            raise DataError(f"{p}: not readable")


def read_criteo(paths: Sequence[str], max_rows: int | None = None, block_bytes: int = BLOCK_BYTES) -> Iterator[_Block]:
    """Streams Criteo-format files as blocks of numpy arrays, at most ``max_rows`` rows in all.

    A row with the wrong number of columns, a label other than 0/1, an integer that does not
    parse or a categorical cell that is not hex raises :class:`DataError` naming the file and
    the row (1-based line number).
    """
    pa = _pyarrow()
    csv = pa.csv
    check_files(paths)
    types = {"label": pa.int64(), **{c: pa.int64() for c in CRITEO_DENSE}, **{c: pa.binary() for c in CRITEO_SPARSE}}
    convert = csv.ConvertOptions(column_types=types, null_values=[""], strings_can_be_null=True, check_utf8=False)
    parse = csv.ParseOptions(delimiter="\t", quote_char=False)
    # use_threads=False: pyarrow then knows the line number of a malformed row; parsing one
    # block while the model trains on the previous one (see prefetch) keeps both cores busy
    read = csv.ReadOptions(column_names=CRITEO_COLUMNS, block_size=block_bytes, use_threads=False)
    total = 0
    for path in paths:
        file_row = 0  # rows of this file already delivered
        try:
            reader = csv.open_csv(path, read_options=read, parse_options=parse, convert_options=convert)
            for rb in reader:
                if rb.num_rows == 0:
                    continue
                if max_rows is not None and total + rb.num_rows > max_rows:
                    rb = rb.slice(0, max_rows - total)
                yield _convert_block(rb, path, file_row, total)
                file_row += rb.num_rows
                total += rb.num_rows
                if max_rows is not None and total >= max_rows:
                    return
        except pa.ArrowInvalid as e:
            raise DataError(f"{path}: malformed data: {_one_line(_arrow_message(e))}") from None
        except (pa.ArrowException, OSError, UnicodeDecodeError) as e:
            raise DataError(f"{path}: cannot read: {_one_line(e)}") from None


def _arrow_message(e: Exception) -> str:
    msg = str(e).replace("CSV parse error: ", "")
    if msg.startswith("Row #"):  # "Row #701: Expected 40 columns, got 39: <text>"
        head, _, rest = msg.partition(": ")
        msg = f"line {head[5:]}: {rest}"
    return msg.replace("Expected 40 columns", "expected 40 columns (label, 13 integer, 26 categorical)")


def _convert_block(rb, path: str, file_row: int, first_row: int) -> _Block:
    pa = _pyarrow()
    n = rb.num_rows
    label_col = rb.column(0)
    label = label_col.to_numpy(zero_copy_only=False) if label_col.null_count == 0 else None
    if label is None or ((label != 0) & (label != 1)).any():
        vals = label_col.to_pylist()
        i = next(i for i, v in enumerate(vals) if v not in (0, 1))
        raise DataError(f"{path}: line {file_row + i + 1}: label must be 0 or 1, got {vals[i]!r}")
    dense = np.empty((n, len(CRITEO_DENSE)), dtype=np.float32)
    for j in range(len(CRITEO_DENSE)):
        col = pa.compute.fill_null(rb.column(1 + j), 0)
        dense[:, j] = np.log1p(np.maximum(col.to_numpy(zero_copy_only=False), 0).astype(np.float64))
    sparse = np.empty((n, len(CRITEO_SPARSE)), dtype=np.int64)
    for j, name in enumerate(CRITEO_SPARSE):
        ids, bad = hex_to_ids(rb.column(1 + len(CRITEO_DENSE) + j))
        if bad is not None:
            cell = rb.column(1 + len(CRITEO_DENSE) + j)[bad].as_py()
            raise DataError(
                f"{path}: line {file_row + bad + 1}: column {name} must be a hex id (up to 15 digits), got {cell!r}"
            )
        sparse[:, j] = ids
    return _Block(dense, sparse, label.astype(np.float32), first_row)


def count_rows(paths: Sequence[str]) -> int:
    """Rows in Criteo-format files (a full streaming read)."""
    return sum(b.label.shape[0] for b in read_criteo(paths))


def _splitmix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 (wrapping), the numpy twin of :func:`hybridembed.init.mix64`."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def _holdout(rows: np.ndarray, fraction: float) -> np.ndarray:
    """(R,) bool: rows (by global index) held out for evaluation; a fixed hash, streamable."""
    with np.errstate(over="ignore"):
        x = _splitmix(rows.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15))
    return (x >> np.uint64(11)).astype(np.float64) / float(1 << 53) < fraction


class CriteoSource:
    """Batches streamed from Criteo-format files.

    Args:
        paths: the files, read in order.
        split: ``"all"``, or ``"train"`` / ``"val"``: the rows kept out of (in) a fixed
            ``holdout`` fraction, chosen by a hash of the row's position.
        max_rows: read at most this many rows (before the split).
    """

    num_dense = len(CRITEO_DENSE)
    features = CRITEO_SPARSE

    def __init__(
        self,
        paths: Sequence[str],
        split: str = "all",
        holdout: float = 0.0,
        max_rows: int | None = None,
        block_bytes: int = BLOCK_BYTES,
    ):
        if split not in ("all", "train", "val"):
            raise ValueError(f"split must be all, train or val, got {split!r}")
        self.paths, self.split, self.holdout, self.max_rows = list(paths), split, holdout, max_rows
        self.block_bytes = block_bytes
        check_files(self.paths)

    def estimate_rows(self) -> int | None:
        """Rows this source yields: exact when ``max_rows`` bounds it, else guessed from file sizes."""
        if any(p.endswith((".gz", ".bz2", ".zst", ".lz4")) for p in self.paths) and self.max_rows is None:
            return None
        if self.max_rows is not None:
            rows = self.max_rows
        else:
            size = sum(os.path.getsize(p) for p in self.paths)
            with open(self.paths[0], "rb") as f:
                head = f.read(1 << 20)
            lines = head.count(b"\n")
            if lines == 0:
                return None
            rows = int(size * lines / len(head))
        keep = {"all": 1.0, "train": 1.0 - self.holdout, "val": self.holdout}[self.split]
        return int(rows * keep)

    def batches(self, batch_size: int, epoch: int = 0) -> Iterator[Batch]:
        """Fixed-size batches (the last one smaller) in file order; ``epoch`` does not change it."""
        del epoch  # streamed data is read in file order (Criteo is time-ordered)
        pending: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        have = 0
        for block in read_criteo(self.paths, self.max_rows, self.block_bytes):
            d, s, y = block.dense, block.sparse, block.label
            if self.split != "all" and self.holdout > 0:
                held = _holdout(np.arange(block.first_row, block.first_row + len(y)), self.holdout)
                keep = held if self.split == "val" else ~held
                d, s, y = d[keep], s[keep], y[keep]
            elif self.split == "val":
                return
            pending.append((d, s, y))
            have += len(y)
            if have < batch_size:
                continue
            d, s, y = (np.concatenate(parts) for parts in zip(*pending))
            full = (len(y) // batch_size) * batch_size
            for i in range(0, full, batch_size):
                yield _batch(d[i : i + batch_size], s[i : i + batch_size], y[i : i + batch_size])
            pending = [(d[full:], s[full:], y[full:])] if full < len(y) else []
            have = len(y) - full
        if have:
            d, s, y = (np.concatenate(parts) for parts in zip(*pending))
            yield _batch(d, s, y)


def _batch(d: np.ndarray, s: np.ndarray, y: np.ndarray) -> Batch:
    return Batch(
        torch.from_numpy(np.ascontiguousarray(d)), torch.from_numpy(np.ascontiguousarray(s)), torch.from_numpy(y)
    )


class TensorSource:
    """Batches of in-memory tensors, shuffled by ``(seed, epoch)`` when ``shuffle``."""

    def __init__(
        self,
        dense: torch.Tensor,
        sparse: torch.Tensor,
        label: torch.Tensor,
        features: Sequence[str],
        shuffle: bool = True,
        seed: int = 0,
    ):
        self.dense, self.sparse, self.label = dense, sparse, label  # (N, Dn), (N, F), (N,)
        self.num_dense = dense.shape[1]
        self.features = list(features)
        self.shuffle, self.seed = shuffle, seed

    def __len__(self) -> int:
        return self.label.shape[0]

    def estimate_rows(self) -> int:
        return len(self)

    def batches(self, batch_size: int, epoch: int = 0) -> Iterator[Batch]:
        n = len(self)
        order = None
        if self.shuffle:
            order = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed * 1_000_003 + epoch))
        for i in range(0, n, batch_size):
            idx = order[i : i + batch_size] if order is not None else slice(i, i + batch_size)
            yield Batch(self.dense[idx], self.sparse[idx], self.label[idx])


def prefetch(it: Iterator[Batch], depth: int = 4) -> Iterator[Batch]:
    """Runs ``it`` in a background thread, ``depth`` batches ahead; re-raises its errors here.

    pyarrow parses without holding the GIL, so reading the next block overlaps training.
    """
    q: queue.Queue = queue.Queue(maxsize=depth)
    done = object()
    stop = threading.Event()

    def work() -> None:
        try:
            for item in it:
                while not stop.is_set():
                    try:
                        q.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            q.put(done)
        except BaseException as e:  # handed to the consumer
            q.put(e)

    t = threading.Thread(target=work, daemon=True, name="hybridembed-prefetch")
    t.start()
    try:
        while True:
            item = q.get()
            if item is done:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()


# --- Criteo-format generator -----------------------------------------------------------------
# per feature: (distinct ids, fraction of empty cells, weight of the id's effect on the label)
_GEN_VOCAB = [
    1_400, 550, 200_000, 120_000, 300, 24, 12_000, 630, 3, 50_000, 5_000, 150_000, 3_000,
    27, 10_000, 140_000, 10, 4_000, 2_000, 4, 130_000, 18, 15, 40_000, 100, 30_000,
]  # fmt: skip
_GEN_EMPTY = [0.0, 0.0, 0.03, 0.03, 0.0, 0.12, 0.0, 0.0, 0.0, 0.0, 0.0, 0.03, 0.0,
              0.0, 0.0, 0.03, 0.0, 0.0, 0.45, 0.45, 0.03, 0.0, 0.76, 0.03, 0.45, 0.03]  # fmt: skip
_GEN_EFFECT = [0.9, 0.6, 0.5, 0.7, 0.4, 0.3, 0.6, 0.0, 0.3, 0.5, 0.0, 0.4, 0.3,
               0.2, 0.5, 0.6, 0.2, 0.0, 0.3, 0.2, 0.4, 0.0, 0.0, 0.5, 0.3, 0.2]  # fmt: skip
_GEN_DENSE_EMPTY = [0.45, 0.0, 0.2, 0.22, 0.03, 0.22, 0.04, 0.0, 0.04, 0.45, 0.04, 0.77, 0.22]
_GEN_DENSE_EFFECT = [0.3, -0.2, 0.0, 0.2, -0.3, 0.0, 0.2, 0.0, 0.1, 0.4, 0.2, 0.0, 0.0]
_GEN_CTR = 0.25


def _mix(x: np.ndarray, salt: int) -> np.ndarray:
    """splitmix64 finaliser of uint64 ``x ^ salt``: a bijection, so distinct ids stay distinct."""
    return _splitmix(x.astype(np.uint64) ^ np.uint64(salt * 0x9E3779B97F4A7C15 % (1 << 64)))


def _effect(ids: np.ndarray, salt: int) -> np.ndarray:
    """A fixed pseudo-random effect in (-sqrt 3, sqrt 3) (unit variance) per id."""
    u = (_mix(ids, salt) >> np.uint64(11)).astype(np.float64) / float(1 << 53)
    return (2.0 * u - 1.0) * math.sqrt(3.0)


def _hex8(x: np.ndarray) -> np.ndarray:
    """(n,) uint32 values -> (n,) ``S8`` lowercase hex strings."""
    digits = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)
    nib = (x[:, None].astype(np.uint64) >> np.arange(28, -1, -4, dtype=np.uint64)) & np.uint64(15)  # (n, 8)
    return np.ascontiguousarray(digits[nib.astype(np.int64)]).view("S8").ravel()


def generate_criteo(path: str, rows: int, seed: int = 0, alpha: float = 1.05) -> str:
    """Writes ``rows`` Criteo-format impressions to ``path`` (TSV) and returns ``path``.

    Categorical ids follow the power law of :func:`hybridembed.synthetic.powerlaw_ids` over a
    Criteo-like spread of vocabularies, written as 8-hex-digit hashes; cells are empty at
    Criteo-like rates. The click probability is a logistic function of per-id effects of
    most features, the dense counts and one pairwise interaction, shifted to a 25% click
    rate, so a model that learns the ids reaches a clearly better AUC than chance.
    Deterministic for a given ``(rows, seed)``. Written through a temporary name.
    """
    pa = _pyarrow()
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    logit = np.zeros(rows)
    cols: dict[str, object] = {}
    dense_cols = []
    for j in range(len(CRITEO_DENSE)):
        x = np.floor(np.exp(rng.normal(1.0 + 0.3 * j, 1.2, rows))).astype(np.int64) - 1  # counts, a few -1
        z = np.log1p(np.maximum(x, 0))
        logit += _GEN_DENSE_EFFECT[j] * (z - z.mean()) / (z.std() + 1e-9)
        empty = rng.random(rows) < _GEN_DENSE_EMPTY[j]
        dense_cols.append(pa.array(x, mask=empty))
    effects = []
    for j, name in enumerate(CRITEO_SPARSE):
        ids = powerlaw_ids(rows, _GEN_VOCAB[j], alpha=alpha, generator=g).numpy()
        e = _effect(ids, 1000 + j)
        effects.append(e)
        logit += _GEN_EFFECT[j] * e
        empty = rng.random(rows) < _GEN_EMPTY[j]
        hashed = (_mix(ids, j + 1) & np.uint64(0xFFFFFFFF)).astype(np.uint32)  # distinct per id: the low
        # 32 bits of a 64-bit bijection can collide, as Criteo's own 32-bit hashes do, rarely
        cols[name] = pa.array(_hex8(hashed), type=pa.binary(), mask=empty).cast(pa.string())
    logit += 0.6 * effects[0] * effects[2]  # one interaction a model has to find
    lo, hi = -20.0, 20.0
    for _ in range(60):  # the bias giving the target click rate
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if np.mean(1 / (1 + np.exp(-(logit + mid)))) < _GEN_CTR else (lo, mid)
    label = (rng.random(rows) < 1 / (1 + np.exp(-(logit + lo)))).astype(np.int64)
    table = pa.table(
        [pa.array(label), *dense_cols, *(cols[c] for c in CRITEO_SPARSE)],
        names=CRITEO_COLUMNS,
    )
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    opts = pa.csv.WriteOptions(include_header=False, delimiter="\t", quoting_style="none")
    pa.csv.write_csv(table, tmp, write_options=opts)
    os.replace(tmp, path)
    logger.debug("wrote %d generated Criteo-format rows to %s", rows, path)
    return path


# --- UCI Adult -------------------------------------------------------------------------------
@dataclass
class AdultData:
    """UCI Adult split into train/test tensors (see :func:`load_adult`)."""

    train: TensorSource
    test: TensorSource
    vocab_sizes: list[int] | None  # per categorical feature, with ids="vocab" (row 0 = unseen)
    positives: int
    rows: int


def _adult_table(path: str, pa: Any) -> Any:
    """One Adult file as a pyarrow table: parquet, a CSV with a header row (the OpenML/Kaggle
    ``adult.csv``), or UCI's headerless ``adult.data`` / ``adult.test`` (whose first line, a
    comment starting ``|``, is skipped)."""
    import pyarrow.compute as pc
    import pyarrow.csv as pcsv
    import pyarrow.parquet as pq

    with open(path, "rb") as f:
        head = f.read(4)
        f.seek(0)
        first = f.readline().decode("utf-8", "replace")
    try:
        if head == b"PAR1":
            return pq.read_table(path)
        names = [c.strip() for c in first.split(",")]
        has_header = ADULT_LABEL in names or "age" in names
        read = pcsv.ReadOptions(
            column_names=None if has_header else ADULT_UCI_COLUMNS, skip_rows=1 if first.startswith("|") else 0
        )
        parse = pcsv.ParseOptions(ignore_empty_lines=True)
        convert = pcsv.ConvertOptions(null_values=["?", " ?", ""], strings_can_be_null=True)
        table = pcsv.read_csv(path, read_options=read, parse_options=parse, convert_options=convert)
        table = table.rename_columns([c.strip() for c in table.column_names])
        for i, field in enumerate(table.schema):  # (UCI's cells are ", "-separated: " State-gov")
            if pa.types.is_string(field.type):
                table = table.set_column(i, field.name, pc.utf8_trim_whitespace(table.column(i)))
        return table
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: cannot read as parquet or CSV: {_one_line(e)} ({ADULT_SOURCE})") from None


def load_adult(
    path: str | Sequence[str],
    ids: str = "hash",
    test_fraction: float = 0.2,
    seed: int = 0,
    shuffle_seed: int = 0,
) -> AdultData:
    """UCI Adult: 8 categorical, 6 numeric features, label ``income`` starting ``>50K``. ``path``:
    one file or several, concatenated: parquet, a CSV with a header, or UCI's own ``adult.data``
    and ``adult.test``.

    Rows are split by ``torch.randperm(rows, Generator().manual_seed(seed))``: the first
    ``round(rows * (1 - test_fraction))`` train, the rest test. Numeric features are
    standardised with the training split's mean and standard deviation. ``ids="hash"``
    gives each category :func:`hybridembed.init.stable_hash64` of its string (what a dynamic
    table makes of string ids); ``ids="vocab"`` gives indices into a per-feature vocabulary
    built from the training split (sorted; 0 is reserved for values unseen in training), for
    ``nn.Embedding``. Both labels ``>50K`` and ``>50K.`` (the test file's spelling) count
    as positive.
    """
    pa = _pyarrow()
    import pyarrow.compute as pc

    if ids not in ("hash", "vocab"):
        raise ValueError(f"ids must be 'hash' or 'vocab', got {ids!r}")
    paths = [path] if isinstance(path, (str, os.PathLike)) else list(path)
    check_files(paths)
    table = pa.concat_tables([_adult_table(p, pa) for p in paths], promote_options="permissive")
    wanted = [*ADULT_CATEGORICAL, *ADULT_NUMERIC, ADULT_LABEL]
    lacking = [c for c in wanted if c not in table.column_names]
    if lacking:
        raise DataError(f"{paths[0]}: not the UCI Adult table: missing column(s) {', '.join(lacking)} ({ADULT_SOURCE})")
    n = table.num_rows
    income = pc.utf8_trim_whitespace(table[ADULT_LABEL].cast(pa.string()))
    label = torch.from_numpy(
        np.asarray(pc.starts_with(pc.fill_null(income, ""), ">50K").to_numpy(zero_copy_only=False), dtype=np.float32)
    )
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    n_train = round(n * (1 - test_fraction))
    train_idx, test_idx = perm[:n_train], perm[n_train:]

    numeric = torch.stack(
        [
            torch.from_numpy(pc.fill_null(table[c], 0).to_numpy(zero_copy_only=False).astype(np.float64))
            for c in ADULT_NUMERIC
        ],
        1,
    )  # (N, 6)
    mean, std = numeric[train_idx].mean(0), numeric[train_idx].std(0).clamp_min(1e-9)
    dense = ((numeric - mean) / std).float()

    sparse = torch.empty(n, len(ADULT_CATEGORICAL), dtype=torch.int64)
    vocab_sizes: list[int] | None = [] if ids == "vocab" else None
    train_mask = np.zeros(n, dtype=bool)
    train_mask[train_idx.numpy()] = True
    for j, c in enumerate(ADULT_CATEGORICAL):
        col = pc.utf8_trim_whitespace(pc.fill_null(table[c].cast(pa.string()), ""))
        enc = pc.dictionary_encode(col).combine_chunks()
        words = enc.dictionary.to_pylist()
        codes = enc.indices.to_numpy(zero_copy_only=False).astype(np.int64)  # (N,)
        if ids == "hash":  # hash each distinct string once
            table_ids = np.array([stable_hash64(w) for w in words], dtype=np.int64)
        else:
            seen = sorted({words[k] for k in np.unique(codes[train_mask])})
            index = {w: i + 1 for i, w in enumerate(seen)}
            table_ids = np.array([index.get(w, 0) for w in words], dtype=np.int64)
            vocab_sizes.append(len(seen) + 1)
        sparse[:, j] = torch.from_numpy(table_ids[codes])
    feats = list(ADULT_CATEGORICAL)
    train = TensorSource(dense[train_idx], sparse[train_idx], label[train_idx], feats, shuffle=True, seed=shuffle_seed)
    test = TensorSource(dense[test_idx], sparse[test_idx], label[test_idx], feats, shuffle=False)
    return AdultData(train, test, vocab_sizes, int(label.sum()), n)


def default_generated_path(workdir: str, rows: int, seed: int) -> str:
    return os.path.join(workdir, f"criteo_generated_{rows}_seed{seed}.tsv")


def batches_with_skip(source, batch_size: int, epoch: int, skip: int) -> Iterator[Batch]:
    """``source.batches(...)`` without its first ``skip`` batches (a resumed epoch)."""
    for i, b in enumerate(source.batches(batch_size, epoch)):
        if i >= skip:
            yield b
