"""Jobs on one machine listen on loopback only: the rendezvous stores and gloo's connections, of
``spawn`` (``hybridembed train --nproc N``) and of torchrun (``hybridembed launch --nproc N``,
``hybridembed train --max-restarts K``).

    python -m pytest -q tests/distributed/test_launch.py

c10d authenticates nothing (docs/distributed.md, Trust model): a job on one machine keeps every
listening socket on 127.0.0.1, where no other machine can reach it.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from hybridembed import launch
from hybridembed.launch import loopback_interface, spawn
from tests.procs import kill_tree

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/net/tcp (Linux)")


def _listening(pid: int | str = "self") -> list[tuple[str, int]]:
    """(address, port) of every TCP socket process ``pid`` listens on, from /proc/net/tcp{,6}."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    out = []
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(path) as f:
            for line in f.read().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # state LISTEN, one of ours
                    addr, port = fields[1].split(":")
                    if len(addr) == 8:  # little-endian IPv4
                        addr = socket.inet_ntop(socket.AF_INET, bytes.fromhex(addr)[::-1])
                    else:
                        addr = "[" + addr + "]"  # (IPv6 as the kernel writes it: any bound v6 address fails below)
                    out.append((addr, int(port, 16)))
    return out


def _other_address() -> str | None:
    """A non-loopback IPv4 address of this machine, or None (a UDP connect sends nothing)."""
    for target in ("198.51.100.1", "8.8.8.8"):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                s.connect((target, 9))
            except OSError:
                continue
            addr = s.getsockname()[0]
            if not addr.startswith("127.") and addr != "0.0.0.0":
                return addr
    return None


def _probe(rank: int, world: int, other: str | None) -> dict:
    port = int(os.environ["MASTER_PORT"])
    reachable = None
    if other is not None and rank == 1:  # rank 0's store is up (rank 1 joined through it)
        try:
            socket.create_connection((other, port), timeout=2).close()
            reachable = True
        except OSError:
            reachable = False
    dist.barrier()  # (rank 0 keeps the store until rank 1 has tried)
    return {
        "listening": _listening(),
        "port": port,
        "ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
        "reachable": reachable,
    }


def test_a_spawned_job_listens_on_loopback_only():
    other = _other_address()
    out = spawn(_probe, 2, other, timeout=60)
    port = out[0]["port"]
    assert (launch.LOOPBACK, port) in out[0]["listening"]  # the store: rank 0's, on 127.0.0.1 (was [::])
    for r in out:  # the store and gloo's listeners, on every rank
        assert r["listening"] and all(addr == "127.0.0.1" for addr, _ in r["listening"]), r["listening"]
        assert r["ifname"] == loopback_interface() is not None
    if other is None:
        pytest.skip("this machine has no non-loopback IPv4 address to try the store's port through")
    assert out[1]["reachable"] is False, f"the store's port {port} answered on {other}"


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_the_rendezvous_port_is_held_from_its_choice_until_rank_0s_store_takes_it(monkeypatch, method):
    """``spawn`` binds the store's listening socket itself before any rank starts and hands it to rank
    0: no port found free and bound later (another job's connection could take it in between:
    "Address already in use", seen once in a full run of the suite beside another job)."""
    monkeypatch.setattr(launch, "free_port", lambda: pytest.fail("spawn asked for a port found free"))
    out = spawn(_probe, 2, None, timeout=60, start_method=method)
    assert (launch.LOOPBACK, out[0]["port"]) in out[0]["listening"]  # (rank 0's store, on the socket given)


def _ifname(rank: int, world: int) -> str | None:
    return os.environ.get("GLOO_SOCKET_IFNAME")


def test_a_gloo_interface_the_caller_set_is_kept(monkeypatch):
    lo = loopback_interface()
    if lo is None:
        pytest.skip("no loopback interface found")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", lo)
    monkeypatch.setattr(launch, "loopback_interface", lambda: "no-such-if0")  # (the job would fail with it)
    assert spawn(_ifname, 2, timeout=60, start_method="spawn") == [lo, lo]


def _says(rank: int, world: int) -> str | None:
    print(f"out of rank {rank}", flush=True)
    print(f"err of rank {rank}", file=sys.stderr, flush=True)
    return os.environ.get("HYBRIDEMBED_TEST_SAID")


def test_forked_ranks_print_where_the_caller_prints_now_with_its_environment(capfd, monkeypatch):
    """The forkserver (started by an earlier job, or here) has the stdout, stderr and environment
    of when it started; its ranks get the caller's current ones (``train --nproc`` prints through them)."""
    from multiprocessing import forkserver

    forkserver._forkserver._stop()  # a forkserver started afresh, its stdout and stderr /dev/null
    null, saved = os.open(os.devnull, os.O_WRONLY), (os.dup(1), os.dup(2))
    try:
        os.dup2(null, 1)
        os.dup2(null, 2)
        spawn(_ifname, 1, timeout=60)
    finally:
        for fd, target in zip(saved, (1, 2)):
            os.dup2(fd, target)
            os.close(fd)
        os.close(null)
    capfd.readouterr()
    monkeypatch.setenv("HYBRIDEMBED_TEST_SAID", "now")
    assert spawn(_says, 2, timeout=60) == ["now", "now"]
    out, err = capfd.readouterr()
    assert all(f"out of rank {r}" in out and f"err of rank {r}" in err for r in (0, 1)), (out, err)


def test_loopback_interface_is_flagged_loopback():
    name = loopback_interface()
    assert name is not None and name in [n for _, n in socket.if_nameindex()]
    with open(f"/sys/class/net/{name}/flags") as f:
        assert int(f.read(), 16) & 0x8


def test_the_store_of_a_train_rank_0_under_torchrun_listens_on_loopback(monkeypatch):
    from hybridembed.train.multiproc import _loopback_store

    port = launch.free_port()
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")  # (torchrun's with --max-restarts K: rank 0 hosts it)
    store = _loopback_store(0, 1, timedelta(seconds=10))
    store.set("k", "v")
    assert (launch.LOOPBACK, port) in _listening() and not any(p == port and a != "127.0.0.1" for a, p in _listening())
    del store
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")  # the agent's store: the ranks are its clients
    assert _loopback_store(0, 2, timedelta(seconds=10)) is None
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")  # another machine's: torch's env:// rendezvous
    assert _loopback_store(1, 2, timedelta(seconds=10)) is None


JOB = """
    import json, os, sys
    import torch.distributed as dist
    from tests.distributed.test_launch import _listening

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out = {"env": {k: os.environ.get(k) for k in ("GLOO_SOCKET_IFNAME", "MASTER_ADDR", "MASTER_PORT")},
           "ranks": _listening(), "agent": _listening(os.getppid()), "parent": os.getppid()}
    dist.barrier()  # (every rank listens before any reads: gloo's listeners, the stores)
    with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()
"""


def test_a_launched_job_on_one_machine_listens_on_loopback_only(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(JOB))
    env = {k: v for k, v in os.environ.items() if k != "GLOO_SOCKET_IFNAME"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *sys.path])  # (the job imports _listening from here)
    cmd = [sys.executable, "-m", "hybridembed.cli", "launch", "--nproc", "2", str(script), str(tmp_path)]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) as proc:
        try:
            _, stderr = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:  # (timed out: its ranks too)
                kill_tree(proc.pid)
    assert proc.returncode == 0, stderr
    out = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(2)]
    assert out[0]["parent"] == out[1]["parent"] == proc.pid  # (torchrun's agent is the command's own process)
    agent = out[0]["agent"]  # torchrun's agent: its rendezvous store and the store shared with the ranks
    assert len(agent) >= 2 and all(addr == "127.0.0.1" for addr, _ in agent), agent  # (were [::])
    assert ["127.0.0.1", int(out[0]["env"]["MASTER_PORT"])] in agent
    for r in out:
        assert r["env"]["GLOO_SOCKET_IFNAME"] == loopback_interface() and r["env"]["MASTER_ADDR"] == "127.0.0.1"
        assert r["ranks"] and all(addr == "127.0.0.1" for addr, _ in r["ranks"]), r["ranks"]


def _imported(rank: int, world: int) -> dict[str, bool]:
    return {m: m in sys.modules for m in ("torch._dynamo", "hybridembed.kernels._numba_kernels")}


def test_forked_ranks_start_with_what_every_rank_imports_already_imported():
    """The forkserver imports once what each rank would import again, job after job: torch._dynamo
    (DistributedDataParallel's, 2.3 s a rank here) and the fused CPU step's Numba kernels."""
    from hybridembed.kernels import cpu_fused

    want = {"torch._dynamo": True, "hybridembed.kernels._numba_kernels": cpu_fused.available()}
    assert spawn(_imported, 2, timeout=60) == [want, want]
