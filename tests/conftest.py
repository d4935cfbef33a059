import os
import socket

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile("default", max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

# the files whose tests take longest (seconds on a 2-core machine, `pytest --durations=60`), run
# first: the two workers then end on short tests together instead of one finishing a long test
# alone (longest first, as a scheduler would; a file missing from the list only runs later)
_LONG_FIRST = (
    "train/test_faults.py", "modules/test_compile.py", "api/test_export.py", "train/test_train_nproc.py",
    "ps/test_faults.py", "train/test_tiered_train.py", "bench/test_fuzz_faults.py", "train/test_train_ps.py",
    "ps/test_trainer_faults.py", "distributed/test_launch.py", "bench/test_bench_tiered.py",
    "train/test_checkpoint.py", "storage/test_streaming.py", "bench/test_bench_ps.py",
    "bench/test_bench_distributed.py", "kernels/test_triton_compile.py", "bench/test_bench_checkpoint.py",
)  # fmt: skip


def pytest_collection_modifyitems(items) -> None:
    def rank(item) -> int:
        path = item.path.as_posix()
        return next((k for k, f in enumerate(_LONG_FIRST) if path.endswith("tests/" + f)), len(_LONG_FIRST))

    items.sort(key=rank)  # (stable: each file's tests keep their order)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# test folders of tiny tensors: there a second intra-op thread only adds contention on the
# shared 2-core machines (tiny ops with a parallel region slowed down ~25x when a neighbour
# held a core)
_ONE_THREAD_DIRS = ("api", "storage", "train")


@pytest.fixture(autouse=True)
def _one_thread(request):
    if request.path.parent.name not in _ONE_THREAD_DIRS:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def free_port() -> int:
    """A port the OS says is free now (multi-process tests never use a fixed port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
