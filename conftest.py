"""pytest, for tests/ and the doctests of src/: Triton's kernels run on CPU tensors through its
interpreter where there is no GPU. The interpreter is chosen when ``triton.jit`` decorates a
kernel, so it is set here, before anything imports one; without Triton, the modules that import
it are not collected (their tests skip)."""

import importlib.util
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

collect_ignore = (
    []
    if importlib.util.find_spec("triton")
    else ["src/hybridembed/kernels/triton_lookup.py", "src/hybridembed/kernels/triton_hash.py"]
)
