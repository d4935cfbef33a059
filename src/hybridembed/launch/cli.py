"""``hybridembed launch``: run a training script on N processes per machine, through torchrun.

    hybridembed launch --nproc 2 train.py --epochs 3            # one machine, 2 processes
    hybridembed launch --nproc 2 -m hybridembed.cli train       # hybridembed train as a torchrun job
    hybridembed launch --nproc 8 --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500 train.py

A thin wrapper: the flags become ``torch.distributed.run``'s (``--nproc-per-node N
--standalone --local-addr 127.0.0.1`` on one machine; ``--nnodes``, ``--node-rank``,
``--master-addr``, ``--master-port`` or ``--rdzv-endpoint`` across machines; ``--max-restarts``),
and torchrun's agent runs in this process (as ``python -m torch.distributed.run ...`` would in a
child, without importing torch a second time). On one machine the job
listens on loopback only (docs/distributed.md, Trust model): torchrun runs through
:mod:`~hybridembed.launch.local_run` (its stores on 127.0.0.1) and the processes get
``GLOO_SOCKET_IFNAME`` of the loopback interface (unless set). Every process gets
torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ...), so
the script calls ``torch.distributed.init_process_group("gloo" | "nccl")`` and
``he.distribute(model)``. The exit code is torchrun's: 0 when every process exited 0, non-zero
(after stopping the others) when one failed. Bad flags: one ``error:`` line, exit code 2.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import re
import signal
import sys
from collections.abc import Sequence

from ..utils import OneLineParser
from . import LOOPBACK, loopback_interface

__all__ = [
    "main", "build_parser", "split_torchrun_flags", "torchrun_argv", "torchrun_command", "restart_env", "run_torchrun",
]  # fmt: skip

PROG = "hybridembed launch"


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {text!r}")
    return v


def _count(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int >= 0, got {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected an int >= 0, got {text!r}")
    return v


def _port(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        v = -1
    if not 1 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"expected a TCP port 1..65535, got {text!r}")
    return v


_HOSTNAME = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_-]*[A-Za-z0-9_])?(\.[A-Za-z0-9_]([A-Za-z0-9_-]*[A-Za-z0-9_])?)*\.?")


def _endpoint(text: str) -> str:
    """``--rdzv-endpoint``: HOST or HOST:PORT, an IPv6 address in brackets (``[::1]:29400``); PORT 1..65535."""
    m = re.fullmatch(r"\[([^\[\]]*)\](?::([^:]*))?|([^:\[\]]*)(?::([^:]*))?", text.strip())
    host = None if m is None else m.group(1) if m.group(1) is not None else m.group(3)
    port = None if m is None else m.group(2) if m.group(1) is not None else m.group(4)
    ok = m is not None and bool(_HOSTNAME.fullmatch(host) if m.group(1) is None else _is_ipv6(host))
    if ok and port is not None:
        ok = re.fullmatch(r"[0-9]{1,5}", port) is not None and 1 <= int(port) <= 65535
    if not ok:
        raise argparse.ArgumentTypeError(
            f"expected HOST or HOST:PORT (a host name or IPv4 address, an IPv6 address in brackets as "
            f"[::1]:29400; PORT 1..65535), got {text!r}"
        )
    return text.strip()


def _is_ipv6(text: str) -> bool:
    try:
        ipaddress.IPv6Address(text)
    except ValueError:
        return False
    return True


TORCHRUN_NAMES = {  # our flag's dest -> torchrun's spellings of it
    "nproc": ("--nproc-per-node", "--nproc_per_node"),
    "node_rank": ("--node_rank",),
    "master_addr": ("--master_addr",),
    "master_port": ("--master_port",),
    "rdzv_endpoint": ("--rdzv_endpoint",),
    "rdzv_id": ("--rdzv_id",),
    "max_restarts": ("--max_restarts",),
}


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    p = OneLineParser(
        prog=prog,
        description=(
            "Run SCRIPT (or -m MODULE) on --nproc processes per machine as one torch.distributed job, through "
            "torchrun (python -m torch.distributed.run). Each process reads RANK, WORLD_SIZE and the rendezvous "
            "address from its environment: call torch.distributed.init_process_group() and he.distribute(model)."
        ),
        epilog="torchrun's own spellings (--nproc-per-node, --node_rank, ...) are accepted, and its other flags before SCRIPT (--log-dir, --redirects, --tee, --monitor-interval, "
        "--rdzv-backend, ...) are passed to it as they are. Several machines, examples: docs/train.md "
        "(Several processes).",
        allow_abbrev=False,
    )
    p.add_argument(
        "--nproc",
        dest="nproc",
        type=_positive,
        default=1,
        metavar="N",
        help="processes on this machine (default 1)",
    )
    p.add_argument(
        "--standalone", action="store_true", help="(torchrun's flag: one machine alone, the default without --nnodes)"
    )
    p.add_argument(
        "--nnodes",
        default=None,
        metavar="N|MIN:MAX",
        help="machines in the job (default 1: this one alone, torchrun --standalone); run the same command on each",
    )
    p.add_argument(
        "--node-rank",
        dest="node_rank",
        type=_count,
        metavar="R",
        help="this machine's index 0..nnodes-1 (with --master-addr)",
    )
    p.add_argument(
        "--master-addr",
        dest="master_addr",
        metavar="HOST",
        help="the address of the machine of --node-rank 0 (static rendezvous)",
    )
    p.add_argument(
        "--master-port",
        dest="master_port",
        type=_port,
        metavar="PORT",
        help="a free port on --master-addr (torchrun's default 29500)",
    )
    p.add_argument(
        "--rdzv-endpoint",
        dest="rdzv_endpoint",
        type=_endpoint,
        metavar="HOST[:PORT]",
        help="instead of --master-addr/--node-rank: torchrun's c10d rendezvous at HOST:PORT (ranks given by arrival)",
    )
    p.add_argument(
        "--rdzv-id",
        dest="rdzv_id",
        metavar="ID",
        help="the job's id for --rdzv-endpoint (the same on every machine)",
    )
    p.add_argument(
        "--max-restarts",
        dest="max_restarts",
        type=_count,
        default=0,
        metavar="K",
        help="restart all processes up to K times when one fails (default 0: fail at once)",
    )
    # torchrun's names for the same flags (hidden from --help; an error names the one given)
    for dest, names in TORCHRUN_NAMES.items():
        main = next(a for a in p._actions if a.dest == dest)
        for name in names:
            p.add_argument(
                name, dest=dest, type=main.type, metavar=main.metavar, default=argparse.SUPPRESS, help=argparse.SUPPRESS
            )
    p.add_argument("-m", "--module", action="store_true", help="SCRIPT is a module name, run as python -m MODULE")
    p.add_argument("script", metavar="SCRIPT", help="the Python file to run (or the module, with -m)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS", help="the script's own arguments")
    return p


def split_torchrun_flags(argv: Sequence[str], parser: argparse.ArgumentParser) -> tuple[list[str], list[str]]:
    """``argv`` -> (what ``parser`` reads, torchrun's own flags it does not know, to pass on as they
    are). Only the flags before SCRIPT are looked at; a flag neither knows stays for ``parser`` to
    refuse. Torchrun's flags and their arity come from its own parser."""
    from torch.distributed.run import get_args_parser

    ours = {o: a for a in parser._actions for o in a.option_strings}
    theirs = {o: a for a in get_args_parser()._actions for o in a.option_strings}
    kept: list[str] = []
    passed: list[str] = []
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok == "--" or not tok.startswith("-") or tok == "-":
            break  # SCRIPT (or the end of the flags): the rest is the script's
        name, eq, _ = tok.partition("=")
        action = ours.get(name) or theirs.get(name)
        takes = action is not None and action.nargs != 0 and not eq
        if name in ours or name not in theirs:
            kept.append(tok)
            if takes and i + 1 < len(argv):
                kept.append(argv[i + 1])
        else:
            passed.append(tok)
            if takes and i + 1 < len(argv):
                passed.append(argv[i + 1])
        i += 2 if takes else 1
    return kept + list(argv[i:]), passed


def _one_machine(args: argparse.Namespace) -> bool:
    return not (args.nnodes not in (None, "1") or args.master_addr or args.rdzv_endpoint)


def torchrun_argv(args: argparse.Namespace) -> list[str]:
    """``torch.distributed.run``'s arguments for the parsed ``hybridembed launch`` flags."""
    argv = ["--nproc-per-node", str(args.nproc)]
    if _one_machine(args):  # (MASTER_ADDR 127.0.0.1, not this machine's name)
        argv += ["--standalone", "--local-addr", LOOPBACK]
    else:
        argv += ["--nnodes", str(args.nnodes or 1)]
        if args.rdzv_endpoint:
            argv += ["--rdzv-backend", "c10d", "--rdzv-endpoint", args.rdzv_endpoint]
            if args.rdzv_id:
                argv += ["--rdzv-id", args.rdzv_id]
        else:
            argv += ["--node-rank", str(args.node_rank or 0), "--master-addr", args.master_addr]
            if args.master_port is not None:
                argv += ["--master-port", str(args.master_port)]
    argv += ["--max-restarts", str(args.max_restarts)]
    argv += getattr(args, "torchrun_flags", [])  # (torchrun's own flags, as given)
    if args.module:
        argv.append("--module")
    # "--": the script's own flags are never read as torchrun's (argparse reads "--nproc 2" as an
    # ambiguous abbreviation of --nproc-per-node wherever it stands)
    return [*argv, "--", args.script, *args.script_args]


def torchrun_command(args: argparse.Namespace) -> list[str]:
    """The command that runs the job: ``python -m torch.distributed.run ARGV``, or on one machine
    ``python -m hybridembed.launch.local_run ARGV`` (torchrun, its stores on 127.0.0.1)."""
    module = "hybridembed.launch.local_run" if _one_machine(args) else "torch.distributed.run"
    return [sys.executable, "-m", module, *torchrun_argv(args)]


def restart_env(max_restarts: int = 1, one_machine: bool = False) -> dict[str, str]:
    """This process's environment for torchrun, with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` when it
    may restart (unless set): the rendezvous store shared with the processes (torchrun's default) keeps
    the keys of the previous start, whose process groups the restarted ones then try to reach
    (gloo: "connectFullMesh failed ... Connection refused"; pytorch/pytorch#135712). ``one_machine``:
    ``GLOO_SOCKET_IFNAME`` is the loopback interface (unless set), so gloo listens on loopback only."""
    env = dict(os.environ)
    if max_restarts > 0:
        env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    lo = loopback_interface() if one_machine and not env.get("GLOO_SOCKET_IFNAME") else None
    if lo:
        env["GLOO_SOCKET_IFNAME"] = lo
    return env


def _check(args: argparse.Namespace) -> str | None:
    """What is wrong with the flags (before any process starts), or None."""
    if args.standalone and args.nnodes not in (None, "1"):
        return f"--standalone is one machine alone; it does not go with --nnodes {args.nnodes}"
    if args.nnodes is not None and not re.fullmatch(r"[1-9]\d*(:[1-9]\d*)?", args.nnodes):
        return f"--nnodes: expected N or MIN:MAX (ints >= 1), got {args.nnodes!r}"
    if args.rdzv_endpoint and (args.master_addr or args.node_rank is not None or args.master_port is not None):
        return "--rdzv-endpoint replaces --master-addr, --master-port and --node-rank; give one or the other"
    if args.rdzv_id and not args.rdzv_endpoint:
        return "--rdzv-id goes with --rdzv-endpoint"
    if args.master_port is not None and not args.master_addr:
        return "--master-port goes with --master-addr (one machine alone picks a free port itself)"
    if args.node_rank is not None and not args.master_addr:
        return "--node-rank goes with --master-addr (the machine of --node-rank 0)"
    if args.nnodes not in (None, "1") and not (args.master_addr or args.rdzv_endpoint):
        return f"--nnodes {args.nnodes} needs --master-addr HOST with --node-rank R, or --rdzv-endpoint HOST:PORT"
    if not args.module and not os.path.isfile(args.script):
        return f"{args.script}: no such file (for a module, add -m)"
    return None


def main(argv: Sequence[str] | None = None, prog: str = PROG) -> int:
    """``hybridembed launch [flags] SCRIPT [ARGS...]``; returns torchrun's exit code (2 for bad flags)."""
    parser = build_parser(prog)
    mine, passed = split_torchrun_flags(list(sys.argv[1:] if argv is None else argv), parser)
    args = parser.parse_args(mine)
    args.torchrun_flags = passed
    problem = _check(args)
    if problem:
        print(f"{prog}: error: {problem}", file=sys.stderr)
        return 2
    one = _one_machine(args)
    return run_torchrun(torchrun_argv(args), restart_env(args.max_restarts, one), one, prog)


def run_torchrun(argv: Sequence[str], env: dict[str, str], one_machine: bool, prog: str = PROG) -> int:
    """torchrun ``argv`` with ``env`` as the environment, in this process (what
    :func:`torchrun_command` would run: this process has torch imported already, a child would
    import it again, ~3 s here). Returns torchrun's exit code: 0, 1 when a process failed (torchrun's
    failure table on stderr), 130 when interrupted, or the code torchrun exited with."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    if one_machine:
        from .local_run import main as torchrun
    else:
        from torch.distributed.run import main as torchrun
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)  # (what the agent reads, and the processes are given)
    try:
        torchrun(list(argv))
        return 0
    except ChildFailedError as e:
        print(e, file=sys.stderr, flush=True)  # (torchrun's table: which process failed, how, its error)
        return 1
    except SystemExit as e:  # (torchrun's own argument errors)
        return e.code if isinstance(e.code, int) else 0 if e.code is None else 1
    except (KeyboardInterrupt, SignalException) as e:  # (the agent stopped the processes)
        sig = getattr(e, "sigval", None)
        print(f"{prog}: {'interrupted' if sig in (None, signal.SIGINT) else f'stopped by {sig.name}'}",
              file=sys.stderr)  # fmt: skip
        return 130 if sig in (None, signal.SIGINT) else 128 + int(sig)
    finally:
        os.environ.clear()
        os.environ.update(saved)


if __name__ == "__main__":
    from ..utils import configure_logging

    configure_logging()
    sys.exit(main())
