"""hybridembed: embedding tables too large, too many or too dynamic for ``nn.Embedding``.

>>> import hybridembed as he
"""

from . import _env, init, optim
from .api import convert, distribute, export, load, prefetch, save
from .config import Dynamic, TableConfig, Tiered, tables_from_torchrec
from .errors import CheckpointError, ConfigError, HybridEmbedError, InvalidInputError, RankLost
from .input import Jagged
from .modules import EmbeddingCollection
from .optim import clip_grad_norm_, wrap_optimizer
from .utils import configure_logging, get_logger, tune_cpu_allocator

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "ConfigError",
    "Dynamic",
    "EmbeddingCollection",
    "HybridEmbedError",
    "InvalidInputError",
    "Jagged",
    "RankLost",
    "TableConfig",
    "Tiered",
    "clip_grad_norm_",
    "configure_logging",
    "convert",
    "distribute",
    "export",
    "get_logger",
    "init",
    "load",
    "optim",
    "prefetch",
    "save",
    "tables_from_torchrec",
    "tune_cpu_allocator",
    "wrap_optimizer",
]

if _env.flag("TUNE_ALLOCATOR", True):  # on by default; HYBRIDEMBED_TUNE_ALLOCATOR=0 opts out
    tune_cpu_allocator()

if _env.flag("CLIP_GRAD_NORM", True):  # HYBRIDEMBED_CLIP_GRAD_NORM=0 leaves torch's function alone
    optim.wrapper.install_clip_grad_norm()  # torch.nn.utils.clip_grad_norm_ handles tables (see its docstring)
