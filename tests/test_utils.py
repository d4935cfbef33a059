"""hybridembed.utils: process-level helpers."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import hybridembed as he

SRC = Path(he.__file__).resolve().parents[1]  # the child imports the hybridembed under test


@pytest.mark.parametrize("kwargs", [{"mmap_threshold": -1}, {"trim_threshold": 0}, {"mmap_threshold": 1.5}])
def test_tune_cpu_allocator_refuses_bad_thresholds(kwargs):
    with pytest.raises(he.ConfigError):
        he.tune_cpu_allocator(**kwargs)


def _import_with_log_level(value):
    """Imports hybridembed in a fresh interpreter with HYBRIDEMBED_LOG_LEVEL=value; (rc, stderr, level)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYBRIDEMBED_")}
    env["HYBRIDEMBED_LOG_LEVEL"] = value
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")])
    code = "import logging, hybridembed; print(logging.getLogger('hybridembed').getEffectiveLevel())"
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    return p.returncode, p.stderr, p.stdout.strip()


@pytest.mark.parametrize(
    "value, level, warns",
    [("", "20", False), ("debug", "10", False), ("LOUD", "20", True)],  # (a process each: ~3 s)
)
def test_log_level_variable_never_breaks_the_import(value, level, warns):
    rc, err, got = _import_with_log_level(value)
    assert rc == 0, err
    assert got == level
    assert ("LOUD" in err and "DEBUG, INFO, WARNING, ERROR, CRITICAL" in err) == warns, err
