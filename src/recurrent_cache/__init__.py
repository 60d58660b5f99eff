"""recurrent_cache: llama.cpp's recurrent-state cache as a fast Python library.

    import recurrent_cache as rc
    cache = rc.RecurrentCache(n_layer=2, n_embd_r=192, n_embd_s=512, n_seq_max=4)
    for ub in cache.init_batch(rc.Batch(token=[1, 2, 3], seq_id=[0, 0, 1], pos=[0, 1, 0])):
        ...  # run the model on ub, reading and writing st.r(il) / st.s(il)

One facade over two engines: the compiled Cython core (the default) and the
pure-Python reference (``engine="reference"``, or ``RECURRENT_CACHE_IMPL=reference``).
"""

import os as _os
from importlib.metadata import PackageNotFoundError as _NotInstalled
from importlib.metadata import version as _version

from .batch import Batch
from .cache import CellInfo, RecurrentCache
from .errors import (ArgumentError, BatchError, BrokenCacheError, ConfigError, CoreError, GGUFError, ModelError,
                     NoFreeCellError, OutOfRangeError, OutputError, PositionError, RecurrentCacheError,
                     SafetensorsError, SeqIdError, StateError, UsageError)
from .hybrid import HybridCache, HybridState
from .hybrid_prefix import HybridPrefixCache
from .memory_state import MemoryState, MemoryStatus, SeqIdLists, Ubatch
from .prefix_cache import PrefixCache
from .seqfile import load_seq_file, load_session_file, save_seq_file, save_session_file
from . import stores   # rc.stores.DirectoryStore / RedisStore (the redis client is imported when used)

try:
    __version__ = _version("recurrent_cache")
except _NotInstalled:  # pragma: no cover - a source tree on sys.path, not installed
    __version__ = "0+unknown"


def get_include() -> str:
    """The directory to put on Cython's include path for ``cimport recurrent_cache.core``.

    Like ``numpy.get_include()``: a downstream extension builds with
    ``cythonize(..., include_path=[recurrent_cache.get_include()])``.
    """
    return _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))


__all__ = [
    "RecurrentCache", "HybridCache", "HybridState", "HybridPrefixCache", "CellInfo", "MemoryState", "MemoryStatus",
    "Batch", "Ubatch", "SeqIdLists",
    "RecurrentCacheError", "ConfigError", "BatchError", "SeqIdError", "PositionError",
    "ArgumentError", "StateError", "CoreError", "BrokenCacheError", "UsageError", "OutOfRangeError", "NoFreeCellError",
    "ModelError", "GGUFError", "SafetensorsError", "OutputError",
    "get_include", "save_seq_file", "load_seq_file", "save_session_file", "load_session_file", "PrefixCache", "stores",
]
