"""What every ``hybridembed bench`` workload reports about the machine it ran on, and its
progress lines: the machine, its memory, how busy other processes keep the CPU."""

from __future__ import annotations

import os
import platform
import resource
import sys
import time
from typing import Any

import torch

from .. import __version__

__all__ = ["machine", "meminfo", "peak_rss", "cpu_busy", "progress"]


def progress(msg: str) -> None:
    """One progress line on stderr (stdout is flushed first, so the two interleave in order)."""
    sys.stdout.flush()
    print(f"  .. {msg}", file=sys.stderr, flush=True)


def meminfo(key: str) -> int | None:
    """A ``/proc/meminfo`` field (``MemTotal``, ``MemAvailable``, ...) in bytes; None off Linux."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def peak_rss() -> int:
    """This process's peak resident set size, in bytes."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(module: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(module)
    except PackageNotFoundError:
        return None


def machine(device: str | torch.device | None = None) -> dict[str, Any]:
    """CPU, cores, torch threads, memory, and the versions of Python, torch, TorchRec, FBGEMM, hybridembed;
    with a CUDA ``device``, also its name, memory and the CUDA and Triton versions."""
    gpu: dict[str, Any] = {}
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        gpu = {
            "gpu": props.name,
            "gpu_memory_bytes": props.total_memory,
            "cuda": torch.version.cuda,
            "triton": _version("triton"),
        }
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_bytes": meminfo("MemTotal"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchrec": _version("torchrec"),
        "fbgemm_gpu": _version("fbgemm-gpu-cpu") or _version("fbgemm-gpu"),
        "hybridembed": __version__,
        "platform": platform.platform(),
        **gpu,
    }


def _cpu_ticks() -> tuple[int, int] | None:
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return sum(fields[3:5]), sum(fields)  # (idle + iowait, total)


def cpu_busy(interval: float = 0.5) -> float | None:
    """Fraction of the machine's CPU time used in the next ``interval`` seconds while this
    process sleeps: what other processes take. None off Linux."""
    a = _cpu_ticks()
    time.sleep(interval)
    b = _cpu_ticks()
    if a is None or b is None or b[1] == a[1]:
        return None
    return 1.0 - (b[0] - a[0]) / (b[1] - a[1])
