"""hybridembed.utils: process-level helpers."""

import ctypes
import json
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


_MAPPED_BY_A_40_MB_MALLOC = """
import ctypes, json
import hybridembed as he
from hybridembed.utils import allocator_tuned
libc = ctypes.CDLL("libc.so.6")
fields = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")
class MallInfo2(ctypes.Structure):
    _fields_ = [(f, ctypes.c_size_t) for f in fields]
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
before = libc.mallinfo2().hblkhd  # bytes in blocks glibc mapped with mmap
p = libc.malloc(40 << 20)  # above glibc's largest default mmap threshold (32 MiB)
mapped = libc.mallinfo2().hblkhd - before
libc.free(p)
print(json.dumps({"tuned": allocator_tuned(), "mapped": mapped}))
"""


def _glibc_with_mallinfo2() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return hasattr(libc, "gnu_get_libc_version") and hasattr(libc, "mallinfo2")
    except OSError:
        return False


@pytest.mark.skipif(not _glibc_with_mallinfo2(), reason="needs glibc >= 2.33 (mallinfo2)")
@pytest.mark.parametrize("setting", [None, "0"])
def test_import_tunes_the_allocator_unless_opted_out(setting):
    # a user's own script sets nothing: importing hybridembed must make glibc serve a large
    # block from its heap (reused step after step) instead of mapping fresh pages for it
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYBRIDEMBED_")}
    if setting is not None:
        env["HYBRIDEMBED_TUNE_ALLOCATOR"] = setting
    res = subprocess.run(
        [sys.executable, "-c", _MAPPED_BY_A_40_MB_MALLOC], env=env, capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout)
    if setting == "0":  # the opt-out keeps glibc's thresholds: the block is mapped
        assert got == {"tuned": False, "mapped": got["mapped"]} and got["mapped"] >= 40 << 20, got
    else:
        assert got == {"tuned": True, "mapped": 0}, got
