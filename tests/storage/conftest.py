import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    """One intra-op thread: on this shared 2-core machine, tiny ops with a parallel region
    (embedding_bag, repeat_interleave) slow down ~25x when a neighbour holds a core."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
