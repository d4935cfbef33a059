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


def free_port() -> int:
    """A port the OS says is free now (multi-process tests never use a fixed port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
