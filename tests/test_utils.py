"""hybridembed.utils: process-level helpers."""

import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import hybridembed as he
from tests import warm

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
    [("", "30", False), ("debug", "10", False), ("LOUD", "30", True)],  # (a process each: ~3 s)
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


# --- logging as a library's (the logging HOWTO): NullHandler, records propagate, the CLI prints ---------
_LOG_PROBE = """
import logging, sys, warnings
import hybridembed as he
how = sys.argv[1]
if how == "app":  # the application configures logging: it gets the library's records
    logging.basicConfig(filename=sys.argv[2], level=logging.INFO, format="%(name)s|%(levelname)s|%(message)s")
elif how == "cli":
    he.configure_logging()
log = he.get_logger("hybridembed.probe")
log.info("an info line")
log.warning("a warning line")
"""


def _log_probe(how, *args, env_extra=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYBRIDEMBED_") and k not in ("RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")])
    env.update(env_extra or {})
    # (a process forked warm: the library's logging is configured when the probe runs, not at its import)
    rc, _, err = warm.run_code(_LOG_PROBE, env, cwd=SRC, timeout=120, argv=[how, *map(str, args)])
    assert rc == 0, err
    return err


def test_an_applications_logging_config_receives_the_librarys_records(tmp_path):
    log = tmp_path / "app.log"
    err = _log_probe("app", log)
    assert "an info line" not in err and "a warning line" not in err  # (nothing printed by the library itself)
    lines = log.read_text().splitlines()
    assert "hybridembed.probe|INFO|an info line" in lines and "hybridembed.probe|WARNING|a warning line" in lines


def test_an_unconfigured_application_gets_nothing_printed():
    assert _log_probe("none") == ""  # (a NullHandler: the application decides)


def test_configure_logging_labels_ranks_only_in_a_job_and_info_comes_from_rank_0_alone():
    one = _log_probe("cli")
    assert one.splitlines() == ["INFO hybridembed.probe: an info line", "WARNING hybridembed.probe: a warning line"]
    r0 = _log_probe("cli", env_extra={"RANK": "0", "WORLD_SIZE": "2"})
    assert r0.splitlines() == [
        "[rank 0] INFO hybridembed.probe: an info line",
        "[rank 0] WARNING hybridembed.probe: a warning line",
    ]
    r1 = _log_probe("cli", env_extra={"RANK": "1", "WORLD_SIZE": "2"})
    assert r1.splitlines() == ["[rank 1] WARNING hybridembed.probe: a warning line"]
    # a level asked for is every rank's
    r1_debug = _log_probe("cli", env_extra={"RANK": "1", "WORLD_SIZE": "2", "HYBRIDEMBED_LOG_LEVEL": "info"})
    assert "[rank 1] INFO hybridembed.probe: an info line" in r1_debug.splitlines()


def test_configure_logging_refuses_a_bad_level():
    with pytest.raises(he.ConfigError, match="level must be one of"):
        he.configure_logging("LOUD")


_RELEASE = """
import ctypes, os, sys, time, torch
from hybridembed.utils import release_openmp_workers
try:
    ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD | os.RTLD_LAZY).omp_pause_resource_all
except (OSError, AttributeError):
    print("no libgomp"); sys.exit(0)
torch.set_num_threads(2)
def threads():
    return len(os.listdir("/proc/self/task"))
x = torch.ones(1 << 20)
x.add_(1)  # (a parallel op: torch's OpenMP worker is made, and idles)
before = threads()
released = release_openmp_workers()
deadline = time.monotonic() + 10
while released and threads() >= before and time.monotonic() < deadline:
    time.sleep(0.01)
after = threads()
x.add_(1)  # (the next parallel op makes its worker again)
print(released, before, after, threads(), float(x.sum()))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="libgomp's pause, Linux only")
@pytest.mark.parametrize("env", ["", "0"])
def test_release_openmp_workers_ends_torchs_idle_workers_until_its_next_parallel_op(env):
    out = subprocess.run(
        [sys.executable, "-c", _RELEASE],
        env={**os.environ, "HYBRIDEMBED_RELEASE_OPENMP": env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    if out.stdout.strip() == "no libgomp":
        pytest.skip("torch's OpenMP is not libgomp here")
    released, before, after, again, total = out.stdout.split()
    assert float(total) == 3 * (1 << 20)
    if env == "0":  # (opted out: nothing released)
        assert (released, after) == ("False", before)
    else:
        assert released == "True" and int(after) == int(before) - 1 and int(again) == int(before)


_RELEASE_BESIDE = """
import threading, time, torch
from hybridembed.utils import release_openmp_workers
torch.set_num_threads(2)
stop, wrong, ops = threading.Event(), [], [0]
def other():  # (its own OpenMP team: a release in the main thread must leave it alone)
    x = torch.ones(1 << 20)
    while not stop.is_set():
        if float((x * 2).sum()) != 2 * (1 << 20):
            wrong.append(1)
        ops[0] += 1
threads = [threading.Thread(target=other) for _ in range(2)]
for t in threads:
    t.start()
z, releases, end = torch.ones(1 << 20), 0, time.monotonic() + 2
while time.monotonic() < end:
    if float((z * 3).sum()) != 3 * (1 << 20):
        wrong.append(0)
    release_openmp_workers()
    releases += 1
stop.set()
for t in threads:
    t.join()
print(len(wrong), releases, ops[0])
"""


def test_releases_beside_threads_running_parallel_ops_of_their_own_change_no_result():
    out = subprocess.run([sys.executable, "-c", _RELEASE_BESIDE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    wrong, releases, ops = (int(v) for v in out.stdout.split())
    assert wrong == 0 and releases > 10 and ops > 10
