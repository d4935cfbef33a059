"""What a job's forkserver imports once, so that every rank forked from it starts warm (see
:func:`hybridembed.launch.spawn`): torch, hybridembed, the modules ``DistributedDataParallel``
imports on its first use (``torch._dynamo``: 2.3 s a rank on a 2-core machine) and the fused CPU
step's Numba kernels with Numba's registries (0.8 s a rank). A module that cannot be imported is
left to the rank, which then imports it (or logs why not) as without a forkserver.
"""

import torch
import torch.distributed

import hybridembed

try:
    import torch._dynamo  # noqa: F401
except Exception:  # (a torch whose compiler stack does not import: the rank meets it where it is used)
    pass

try:
    from numba.core.registry import cpu_target

    from hybridembed.kernels import _numba_kernels  # noqa: F401

    cpu_target.target_context.refresh()
except Exception:  # (no Numba, or one that does not import: cpu_fused.available() says why in the rank)
    pass

__all__ = ["hybridembed", "torch"]
