"""Shared fixtures of the ``hybridembed train`` tests.

python -m pytest -q tests/train
"""

from __future__ import annotations

from pathlib import Path

import pytest

DATA_DIR = Path(__file__).resolve().parents[2].parent / "shared" / "data"
CRITEO_SAMPLE = DATA_DIR / "criteo_1tb_day0_head1000.tsv"
ADULT = DATA_DIR / "adult.parquet"


@pytest.fixture(scope="session")
def criteo_sample() -> Path:
    if not CRITEO_SAMPLE.is_file():
        pytest.skip(f"real Criteo sample not found at {CRITEO_SAMPLE} (the ../shared/data/ folder is absent)")
    return CRITEO_SAMPLE


@pytest.fixture(scope="session")
def adult_path() -> Path:
    if not ADULT.is_file():
        pytest.skip(f"UCI Adult not found at {ADULT} (the ../shared/data/ folder is absent)")
    return ADULT


@pytest.fixture(scope="session")
def generated(tmp_path_factory) -> Path:
    """3,000 generated Criteo-format rows, written once per session."""
    pytest.importorskip("pyarrow", reason="the train tests need pyarrow (pip install 'hybridembed[train]')")
    from hybridembed.train.data import generate_criteo

    return Path(generate_criteo(str(tmp_path_factory.mktemp("criteo") / "gen.tsv"), 3000, seed=1))
