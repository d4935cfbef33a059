"""Sharded tables with kernels="triton" (2 gloo ranks) equal one eager process."""

import pytest

pytest.importorskip("triton")

from tests.distributed.test_runtime import BASE, _check_all  # noqa: E402


def test_sharded_triton_world2_equals_one_eager_process():
    # every sharding type (mixed plan: table-, row-, column-wise, replicated), dense and dynamic tables
    _check_all([{**BASE, "optimizer": "adagrad", "sizes": [6, 6], "kernels": "triton", "steps": 2}], 2)
