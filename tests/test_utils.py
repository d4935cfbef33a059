"""hybridembed.utils: process-level helpers."""

import pytest

import hybridembed as he


@pytest.mark.parametrize("kwargs", [{"mmap_threshold": -1}, {"trim_threshold": 0}, {"mmap_threshold": 1.5}])
def test_tune_cpu_allocator_refuses_bad_thresholds(kwargs):
    with pytest.raises(he.ConfigError):
        he.tune_cpu_allocator(**kwargs)
