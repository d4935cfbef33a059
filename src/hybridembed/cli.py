"""The ``hybridembed`` command: a small dispatcher to subcommands.

    hybridembed bench --model tiny --quick     # see hybridembed bench --help
    hybridembed train                          # see hybridembed train --help
    hybridembed plan --model jumbo --world-size 128   # see hybridembed plan --help
    hybridembed launch --nproc 2 train.py      # see hybridembed launch --help
    hybridembed --version

Each subcommand lives beside the code it drives and is imported only when called, so
``hybridembed --help`` stays fast and needs neither TorchRec nor matplotlib.
"""

from __future__ import annotations

import difflib
import os
import sys
from collections.abc import Callable, Sequence

__all__ = ["main", "COMMANDS"]


def _bench(argv: list[str]) -> int:
    from .bench.cli import main

    return main(argv, prog="hybridembed bench")


def _launch(argv: list[str]) -> int:
    from .launch.cli import main

    return main(argv, prog="hybridembed launch")


def _plan(argv: list[str]) -> int:
    from .bench.models import WORKLOADS  # --model: the synthetic models, at full size
    from .distributed.cli import main

    return main(argv, prog="hybridembed plan", models=WORKLOADS)


def _train(argv: list[str]) -> int:
    from .train.cli import main

    return main(argv, prog="hybridembed train")


# name -> (one-line description, entry point taking the remaining arguments, returning the exit code)
COMMANDS: dict[str, tuple[str, Callable[[list[str]], int]]] = {
    "bench": ("time NVIDIA's synthetic models against PyTorch, TorchRec and a measured floor", _bench),
    "plan": ("place tables on the ranks of a distributed job; memory and traffic per rank", _plan),
    "train": ("train DLRM, Wide & Deep, DeepFM or DCNv2 on Criteo-format data or UCI Adult", _train),
    "launch": ("run a script on N processes per machine as one torch.distributed job (torchrun)", _launch),
}
PLANNED: tuple[str, ...] = ()  # named in the design, not built yet


def _usage() -> str:
    lines = ["usage: hybridembed <command> [flags]", "", "commands:"]
    lines += [f"  {name:<8} {desc}" for name, (desc, _) in COMMANDS.items()]
    lines += ["", "hybridembed <command> --help describes a command's flags."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``hybridembed`` console script; returns the exit code. Called with no
    ``argv`` (the console script) it also sends the library's log records to stderr
    (:func:`hybridembed.configure_logging`); an application calling it with ``argv`` keeps its own."""
    if argv is None:
        from .utils import configure_logging

        configure_logging()
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0 if args else 2
    if args[0] == "--version":
        from . import __version__

        print(f"hybridembed {__version__}")
        return 0
    name, rest = args[0], args[1:]
    if name in COMMANDS:
        try:
            return COMMANDS[name][1](rest)
        except BrokenPipeError:  # (`hybridembed plan ... | head`: the reader left; no traceback)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 141
    available = ", ".join(COMMANDS)
    if name in PLANNED:
        print(f"hybridembed: error: '{name}' is not yet available; available commands: {available}", file=sys.stderr)
    else:
        close = difflib.get_close_matches(name, COMMANDS, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        print(f"hybridembed: error: unknown command '{name}'{hint}; available commands: {available}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
