"""UCI Adult: the hybridembed-native run of ``hybridembed train``, and plain PyTorch vs ``he.convert``.

python -m pytest -q tests/train/test_adult.py
"""

from __future__ import annotations

import re

import pytest

pytest.importorskip("pyarrow", reason="the train tests need pyarrow (pip install 'hybridembed[train]')")

from hybridembed.train import cli  # noqa: E402
from hybridembed.train.compare import compare_adult  # noqa: E402


def test_native_adult_run(adult_path, tmp_path, capsys):
    argv = ["--dataset", "adult", "--data", str(adult_path), "--model", "wdl", "--epochs", "1", "--batch-size", "512"]
    assert cli.main([*argv, "--workdir", str(tmp_path), "--no-checkpoint", "--no-export", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "48,842 rows (11,687 with income >50K); train 39,074, test 9,768" in out
    assert "model wdl: 16 dynamic tables (8 features" in out  # + the 8 dim-1 wide tables
    auc = float(re.search(r"test loss [\d.]+  AUC ([\d.]+)", out).group(1))
    assert auc > 0.88, out


def test_converted_model_matches_plain_pytorch(adult_path):
    try:
        r = compare_adult(str(adult_path), "wdl", epochs=1, batch_size=512)
    except NotImplementedError as e:
        pytest.skip(f"he.convert is not implemented yet ({e}); this test runs once it lands")
    assert r.train_rows == 39_074 and r.test_rows == 9_768
    assert r.plain_auc > 0.88 and r.converted_auc > 0.88
    assert r.auc_diff <= 0.003, r.as_dict()
