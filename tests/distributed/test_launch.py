"""``spawn``'s jobs listen on loopback only: the rendezvous store and gloo's connections.

    python -m pytest -q tests/distributed/test_launch.py

c10d authenticates nothing (docs/distributed.md, Trust model): a job on one machine keeps every
listening socket on 127.0.0.1, where no other machine can reach it.
"""

from __future__ import annotations

import os
import socket
import sys

import pytest
import torch.distributed as dist

from hybridembed.distributed import launch
from hybridembed.distributed.launch import loopback_interface, spawn

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/net/tcp (Linux)")


def _listening() -> list[tuple[str, int]]:
    """(address, port) of every TCP socket this process listens on, from /proc/net/tcp{,6}."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
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


def _ifname(rank: int, world: int) -> str | None:
    return os.environ.get("GLOO_SOCKET_IFNAME")


def test_a_gloo_interface_the_caller_set_is_kept(monkeypatch):
    lo = loopback_interface()
    if lo is None:
        pytest.skip("no loopback interface found")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", lo)
    monkeypatch.setattr(launch, "loopback_interface", lambda: "no-such-if0")  # (the job would fail with it)
    assert spawn(_ifname, 2, timeout=60, start_method="spawn") == [lo, lo]


def test_loopback_interface_is_flagged_loopback():
    name = loopback_interface()
    assert name is not None and name in [n for _, n in socket.if_nameindex()]
    with open(f"/sys/class/net/{name}/flags") as f:
        assert int(f.read(), 16) & 0x8
