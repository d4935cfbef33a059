"""Reading Criteo-format files (the real 1TB sample), the generator, the row split, and UCI Adult.

python -m pytest -q tests/train/test_data.py
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

pa = pytest.importorskip("pyarrow", reason="the train tests need pyarrow (pip install 'hybridembed[train]')")

from hybridembed.init import stable_hash64  # noqa: E402
from hybridembed.train import data as D  # noqa: E402


def _reference(path) -> list[list[str]]:
    """The file split by hand: the obviously-correct reading the reader is checked against."""
    with open(path) as f:
        return [line.rstrip("\n").split("\t") for line in f]


def _read_all(paths, **kw) -> D.Batch:
    blocks = list(D.read_criteo([str(p) for p in paths], **kw))
    cat = lambda k: torch.from_numpy(np.concatenate([getattr(b, k) for b in blocks]))  # noqa: E731
    return D.Batch(cat("dense"), cat("sparse"), cat("label"))


def test_real_criteo_sample(criteo_sample):
    rows = _reference(criteo_sample)
    b = _read_all([criteo_sample])
    assert len(b) == len(rows) == 1000
    assert int(b.label.sum()) == 21
    assert b.dense.shape == (1000, 13) and b.sparse.shape == (1000, 26) and b.sparse.dtype == torch.int64
    # a few cells by hand, then every cell against the hand-split reference
    assert rows[0][14] == "62770d79" and int(b.sparse[0, 0]) == int("62770d79", 16)
    assert int(b.sparse[999, 25]) == (int(rows[999][39], 16) if rows[999][39] else D.MISSING_ID)
    want_sparse = [[int(x, 16) if x else D.MISSING_ID for x in r[14:]] for r in rows]
    want_dense = [[math.log1p(max(int(x), 0)) if x else 0.0 for x in r[1:14]] for r in rows]
    assert b.sparse.tolist() == want_sparse
    torch.testing.assert_close(b.dense, torch.tensor(want_dense, dtype=torch.float32))
    empty_cat = sum(x == "" for r in rows for x in r[14:])
    empty_int = sum(x == "" for r in rows for x in r[1:14])
    assert empty_cat > 0 and empty_int > 0  # the sample does exercise nulls
    assert int((b.sparse == D.MISSING_ID).sum()) == empty_cat
    assert bool((b.sparse[b.sparse != D.MISSING_ID] < 2**32).all())


def test_max_rows_and_small_blocks(criteo_sample):
    b = _read_all([criteo_sample], max_rows=300, block_bytes=10_000)  # many blocks
    full = _read_all([criteo_sample])
    assert len(b) == 300 and torch.equal(b.sparse, full.sparse[:300])
    two = _read_all([criteo_sample, criteo_sample], max_rows=1500)
    assert len(two) == 1500 and torch.equal(two.sparse[1000:], full.sparse[:500])


def test_hex_to_ids_forms():
    ids, bad = D.hex_to_ids(pa.array(["0000000a", None, "FFFFFFFF"], type=pa.binary()))
    assert ids.tolist() == [10, D.MISSING_ID, 2**32 - 1] and bad is None
    ids, bad = D.hex_to_ids(pa.array(["a", "10", None, "7fffffffffffffff"[:15]]))  # other widths
    assert ids.tolist() == [10, 16, D.MISSING_ID, int("7fffffffffffffff"[:15], 16)] and bad is None
    assert D.hex_to_ids(pa.array(["0000000a", "0000000x"]))[1] == 1
    assert D.hex_to_ids(pa.array(["12", "xyz"]))[1] == 1
    sliced = pa.array(["00000001", "00000002", None, "00000004"]).slice(1)
    assert D.hex_to_ids(sliced)[0].tolist() == [2, D.MISSING_ID, 4]


def _write(path, lines: list[str]) -> str:
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def test_malformed_rows_name_file_and_line(criteo_sample, tmp_path):
    lines = criteo_sample.read_text().splitlines()[:50]
    short = list(lines)
    short[20] = "\t".join(short[20].split("\t")[:-1])  # 39 columns
    p = _write(tmp_path / "short.tsv", short)
    with pytest.raises(D.DataError, match=r"short\.tsv: .*line 21: expected 40 columns.*got 39"):
        _read_all([p])
    bad_hex = list(lines)
    cells = bad_hex[7].split("\t")
    cells[20] = "zzzzzzzz"
    bad_hex[7] = "\t".join(cells)
    p = _write(tmp_path / "hex.tsv", bad_hex)
    with pytest.raises(D.DataError, match=r"hex\.tsv: line 8: column C7 must be a hex id.*'zzzzzzzz'"):
        _read_all([p])
    bad_label = list(lines)
    bad_label[3] = "2" + bad_label[3][1:]
    with pytest.raises(D.DataError, match=r"line 4: label must be 0 or 1, got 2"):
        _read_all([_write(tmp_path / "label.tsv", bad_label)])
    bad_int = list(lines)
    cells = bad_int[5].split("\t")
    cells[2] = "abc"
    bad_int[5] = "\t".join(cells)
    with pytest.raises(D.DataError, match=r"int\.tsv: malformed data: .*abc"):
        _read_all([_write(tmp_path / "int.tsv", bad_int)])
    with pytest.raises(D.DataError, match="no such file"):
        _read_all([tmp_path / "missing.tsv"])


def test_generator_is_deterministic_and_criteo_shaped(generated, tmp_path):
    again = D.generate_criteo(str(tmp_path / "again.tsv"), 3000, seed=1)
    assert generated.read_bytes() == open(again, "rb").read()
    rows = _reference(generated)
    assert len(rows) == 3000 and all(len(r) == 40 for r in rows)
    cells = [x for r in rows for x in r[14:] if x]
    assert all(len(x) == 8 for x in cells) and any(r[14 + 22] == "" for r in rows)  # C23 is often empty
    b = _read_all([generated])
    assert 0.18 < float(b.label.mean()) < 0.32  # ~25% clicks
    assert len(torch.unique(b.sparse[:, 2])) > 100  # a large vocabulary ...
    counts = torch.unique(b.sparse[:, 2], return_counts=True)[1]
    assert int(counts.max()) > 30  # ... with a power-law head


def test_holdout_split_partitions_the_rows(generated):
    def rows(split):
        return torch.cat([b.sparse for b in D.CriteoSource([str(generated)], split, holdout=0.1).batches(256)])

    train, val, every = rows("train"), rows("val"), rows("all")
    assert len(train) + len(val) == len(every) == 3000
    assert 200 < len(val) < 400
    mask = torch.from_numpy(D._holdout(np.arange(3000), 0.1))
    assert torch.equal(val, every[mask]) and torch.equal(train, every[~mask])
    sizes = [len(b) for b in D.CriteoSource([str(generated)], "all", block_bytes=50_000).batches(256)]
    assert sizes == [256] * 11 + [184]  # fixed-size batches across block boundaries


def test_prefetch_passes_items_and_errors():
    assert [x for x in D.prefetch(iter(range(10)), depth=2)] == list(range(10))

    def broken():
        yield 1
        raise D.DataError("boom")

    got = []
    with pytest.raises(D.DataError, match="boom"):
        for x in D.prefetch(broken()):
            got.append(x)
    assert got == [1]


def test_adult(adult_path):
    a = D.load_adult(str(adult_path))
    assert a.rows == 48_842 and a.positives == 11_687  # '>50K' (and '>50K.') are positive
    assert len(a.train) == 39_074 and len(a.test) == 9_768
    assert a.train.num_dense == 6 and a.train.features == D.ADULT_CATEGORICAL
    pos = float(a.train.label.mean())
    assert 0.22 < pos < 0.26 and abs(float(a.test.label.mean()) - pos) < 0.02
    torch.testing.assert_close(a.train.dense.mean(0), torch.zeros(6), atol=1e-4, rtol=0)  # standardised
    assert stable_hash64("Private") in set(a.train.sparse[:, 0].tolist())  # string ids, hashed as he does
    v = D.load_adult(str(adult_path), ids="vocab")
    assert torch.equal(v.test.label, a.test.label)  # the same split
    assert v.vocab_sizes[6] == 3  # gender: 2 values + the unseen slot
    for j, size in enumerate(v.vocab_sizes):
        assert int(v.train.sparse[:, j].min()) >= 1 and int(v.train.sparse[:, j].max()) < size
    batches = list(a.train.batches(10_000, epoch=0))
    assert [len(b) for b in batches] == [10_000] * 3 + [9_074]
    again = next(iter(a.train.batches(10_000, epoch=0)))
    other = next(iter(a.train.batches(10_000, epoch=1)))
    assert torch.equal(again.sparse, batches[0].sparse) and not torch.equal(other.sparse, batches[0].sparse)


def test_adult_labels_with_trailing_dot(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    cols = {c: ["x", "y", "x", "y"] for c in D.ADULT_CATEGORICAL}
    cols.update({c: [1, 2, 3, 4] for c in D.ADULT_NUMERIC})
    cols["income"] = ["<=50K", ">50K", ">50K.", "<=50K."]
    pq.write_table(pa.table(cols), tmp_path / "a.parquet")
    a = D.load_adult(str(tmp_path / "a.parquet"), test_fraction=0.5)
    assert a.positives == 2 and a.rows == 4
    pq.write_table(pa.table({"age": [1]}), tmp_path / "b.parquet")
    with pytest.raises(D.DataError, match="missing column"):
        D.load_adult(str(tmp_path / "b.parquet"))


def test_adult_reads_uci_s_own_files_and_a_csv_as_the_parquet(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    rng = random.Random(0)
    n = 60
    cols = {c: [rng.choice(["a b", "c-d", "e", None]) for _ in range(n)] for c in D.ADULT_CATEGORICAL}
    cols.update({c: [rng.randrange(1, 90) for _ in range(n)] for c in D.ADULT_NUMERIC})
    cols["income"] = [rng.choice(["<=50K", ">50K"]) for _ in range(n)]
    table = pa.table({c: cols[c] for c in D.ADULT_UCI_COLUMNS})
    pq.write_table(table, tmp_path / "adult.parquet")
    rows = [", ".join("?" if cols[c][i] is None else str(cols[c][i]) for c in D.ADULT_UCI_COLUMNS) for i in range(n)]
    (tmp_path / "adult.data").write_text("\n".join(rows[:40]) + "\n")  # UCI: no header, ", " between cells
    test_rows = [r.replace(">50K", ">50K.").replace("<=50K", "<=50K.") for r in rows[40:]]
    (tmp_path / "adult.test").write_text("|1x3 Cross validator\n" + "\n".join(test_rows) + "\n\n")
    header = ",".join(D.ADULT_UCI_COLUMNS)
    csv_rows = [",".join("" if cols[c][i] is None else str(cols[c][i]) for c in D.ADULT_UCI_COLUMNS) for i in range(n)]
    (tmp_path / "adult.csv").write_text(header + "\n" + "\n".join(csv_rows) + "\n")
    want = D.load_adult(str(tmp_path / "adult.parquet"))
    for got in (
        D.load_adult([str(tmp_path / "adult.data"), str(tmp_path / "adult.test")]),
        D.load_adult(str(tmp_path / "adult.csv")),
    ):
        assert (got.rows, got.positives) == (want.rows, want.positives)
        for split in ("train", "test"):
            a, b = getattr(got, split), getattr(want, split)
            assert torch.equal(a.sparse, b.sparse) and torch.equal(a.label, b.label)
            torch.testing.assert_close(a.dense, b.dense)
    (tmp_path / "junk.bin").write_bytes(b"\x00\x01 not a table")
    with pytest.raises(D.DataError, match="archive.ics.uci.edu"):
        D.load_adult(str(tmp_path / "junk.bin"))
