"""``hybridembed train``: recommendation models on Criteo-format data and UCI Adult (see docs/train.md).

    hybridembed train --help

``data`` (streamed Criteo reading, the generator, Adult), ``models`` (DLRM, Wide & Deep,
DeepFM, DCNv2 over dynamic hybridembed tables or ``nn.Embedding``), ``metrics`` (AUC, log
loss), ``loop`` (train and evaluate), ``cli`` (the command; its
flags in ``options``, checked in ``checks``, one process's run in ``job``, its output in ``report``,
the job of several processes in ``multiproc``), ``compare`` (plain PyTorch vs
``he.convert`` on Adult). Reading data needs pyarrow: ``pip install 'hybridembed[train]'``.
"""

from .metrics import auc, log_loss
from .models import MODELS, build

__all__ = ["MODELS", "auc", "build", "log_loss"]
