"""recurrent_cache: llama.cpp's recurrent-state cache as a fast Python library.

    import recurrent_cache as rc
    cache = rc.RecurrentCache(n_layer=2, n_embd_r=192, n_embd_s=512, n_seq_max=4)
    for ub in cache.init_batch(rc.Batch(token=[1, 2, 3], seq_id=[0, 0, 1], pos=[0, 1, 0])):
        ...  # run the model on ub, reading and writing st.r(il) / st.s(il)

The compiled core is required; ``recurrent_cache.reference`` is the same API in
pure Python (set RECURRENT_CACHE_IMPL=reference to make the package export it).
"""

import os as _os

from .batch import Batch
from .errors import (ArgumentError, BatchError, ConfigError, CoreError, PositionError,
                     RecurrentCacheError, SeqIdError, StateError)
from .memory import MemoryStatus, Ubatch
from .prefix_cache import PrefixCache
from .seqfile import load_seq_file, save_seq_file

if _os.environ.get("RECURRENT_CACHE_IMPL", "core") == "reference":
    from .reference import MemoryState, RecurrentCache
else:
    try:
        from ._memory import MemoryState
        from .cache import RecurrentCache
    except ImportError as _exc:  # pragma: no cover - only without a build
        raise ImportError(
            "recurrent_cache's compiled core is missing or was built for another Python "
            f"({_exc}). Build it from the source tree with `pip install .` (needs a C compiler), "
            "or set RECURRENT_CACHE_IMPL=reference to use the slow pure-Python implementation."
        ) from _exc

__version__ = "0.1.0"


def get_include() -> str:
    """The directory to put on Cython's include path for ``cimport recurrent_cache.core``.

    Like ``numpy.get_include()``: a downstream extension builds with
    ``cythonize(..., include_path=[recurrent_cache.get_include()])``.
    """
    return _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))


__all__ = [
    "RecurrentCache", "MemoryState", "MemoryStatus", "Batch", "Ubatch",
    "RecurrentCacheError", "ConfigError", "BatchError", "SeqIdError", "PositionError",
    "ArgumentError", "StateError", "CoreError", "get_include", "save_seq_file", "load_seq_file",
    "PrefixCache",
]
