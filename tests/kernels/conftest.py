import os

import torch

if not torch.cuda.is_available():  # Triton kernels run on CPU tensors through Triton's interpreter
    os.environ["TRITON_INTERPRET"] = "1"
