import os
import socket

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile("default", max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

SHARED_DATA = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data")


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
