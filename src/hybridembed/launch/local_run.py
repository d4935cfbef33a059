"""``python -m hybridembed.launch.local_run ARGS``: torchrun (``python -m torch.distributed.run
ARGS``) for a job on this machine alone, whose rendezvous stores listen on 127.0.0.1 only.

What ``hybridembed launch --nproc N`` on one machine and ``hybridembed train --max-restarts K``
run (docs/distributed.md, Trust model). ``torchrun --standalone`` makes two ``TCPStore`` servers
in its agent process: the c10d rendezvous store (``--rdzv-endpoint localhost:0``) and the store it
shares with the processes (their ``MASTER_ADDR:MASTER_PORT``). A ``TCPStore`` server listens on
every interface (``[::]``) whatever host name it is given, and torchrun has no flag to change
that; so this wraps the two places where the agent makes them
(``c10d_rendezvous_backend.TCPStore``, ``DynamicRendezvousHandler._create_tcp_store_server``): a
server's socket is made here, bound to 127.0.0.1, and handed over as ``master_listen_fd``, as
:func:`~hybridembed.launch.loopback_store` does. Where this torch lacks either, torchrun
runs unchanged and a warning says that its stores listen on every interface.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from ..utils import get_logger
from . import LOOPBACK

__all__ = ["main", "patch_agent_stores"]

log = get_logger("hybridembed.distributed")


def _listening_fd(port: int) -> tuple[int, int]:
    """(fd, port) of a socket listening on 127.0.0.1:``port`` (0: a port the OS picks)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((LOOPBACK, port))
        sock.listen(128)
        port = sock.getsockname()[1]
    except BaseException:
        sock.close()
        raise
    return sock.detach(), port


def _loopback_tcp_store(real: Any) -> Any:
    """``real`` (``torch.distributed.TCPStore``) whose servers listen on 127.0.0.1 alone."""

    def make(
        host_name: str,
        port: int,
        world_size: int | None = None,
        is_master: bool = False,
        timeout: timedelta = timedelta(seconds=300),
        wait_for_workers: bool = True,
        multi_tenant: bool = False,
        master_listen_fd: int | None = None,
        use_libuv: bool = True,
    ) -> Any:
        if not is_master or master_listen_fd is not None or not use_libuv:  # (only libuv serves a given socket)
            return real(
                host_name,
                port,
                world_size,
                is_master,
                timeout,
                wait_for_workers,
                multi_tenant,
                master_listen_fd,
                use_libuv,
            )
        fd, port = _listening_fd(port)
        try:  # (its own client connects to 127.0.0.1: "localhost" may name ::1 first, where nothing listens)
            return real(LOOPBACK, port, world_size, True, timeout, wait_for_workers, multi_tenant, fd, True)
        except BaseException:
            os.close(fd)
            raise

    return make


def patch_agent_stores() -> bool:
    """Makes this process's torchrun agent make its TCPStore servers on 127.0.0.1 alone; False
    (nothing changed) where this torch lacks the places it wraps."""
    import torch.distributed as dist

    try:
        from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend as c10d_backend
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler
    except ImportError:
        return False
    if getattr(c10d_backend, "TCPStore", None) is not dist.TCPStore or not hasattr(
        DynamicRendezvousHandler, "_create_tcp_store_server"
    ):
        return False
    make = _loopback_tcp_store(dist.TCPStore)
    c10d_backend.TCPStore = make

    def _create_tcp_store_server(self: Any, master_addr: str, master_port: int) -> Any:
        return make(master_addr, master_port, is_master=True, multi_tenant=True)

    DynamicRendezvousHandler._create_tcp_store_server = _create_tcp_store_server
    return True


def main(argv: Sequence[str] | None = None) -> None:
    """torchrun's ``main`` with :func:`patch_agent_stores` applied."""
    if not patch_agent_stores():
        import torch

        log.warning(
            "torch %s: could not make torchrun's rendezvous stores listen on 127.0.0.1 alone; they listen on every "
            "interface (docs/distributed.md, Trust model)",
            torch.__version__,
        )
    from torch.distributed.run import main as torchrun

    torchrun(list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    from ..utils import configure_logging

    configure_logging()
    main()
