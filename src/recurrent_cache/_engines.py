"""The two engines below the facade, and how one is chosen.

An engine is three things with one small interface: ``CellTable(size, tensors)``
(cells, sequence operations, placement of one sequence, invariant check),
``split_batch(table, seq_id_flat, seq_id_offset, pos, logits, logits_all, n_ubatch,
embd_pooled) -> Placement`` (validation, splitting, ``prepare``, ``apply(u)`` and the
arrays of each ubatch) and ``StateIO(table, type_ids)`` (the serialisation loops).
Both report failures as the codes of ``errors`` and never check the facade's
arguments again.
"""

from __future__ import annotations

import importlib
import os
from typing import Any, NamedTuple

__all__ = ["Engine", "load", "NAMES"]

NAMES = ("compiled", "reference")


class Engine(NamedTuple):
    name: str
    CellTable: Any
    split_batch: Any
    StateIO: Any


_loaded: dict[str, Engine] = {}


def load(name: str | None = None) -> Engine:
    """The engine ``name``; None: ``RECURRENT_CACHE_IMPL`` (``compiled`` when unset)."""
    if name is None:
        name = os.environ.get("RECURRENT_CACHE_IMPL") or "compiled"
    if name not in NAMES:
        from .errors import ConfigError
        raise ConfigError(f"unknown engine {name!r} (expected one of {', '.join(NAMES)})")
    if name not in _loaded:
        if name == "compiled":
            try:
                cells = importlib.import_module("recurrent_cache._cells")
                placement = importlib.import_module("recurrent_cache._placement")
                state_io = importlib.import_module("recurrent_cache._state_io")
            except ImportError as exc:  # pragma: no cover - only without a build
                raise ImportError(
                    f"recurrent_cache's compiled core is missing or was built for another Python ({exc}). "
                    "Build it from the source tree with `pip install .` (needs a C compiler), or use the "
                    "slow pure-Python engine: RECURRENT_CACHE_IMPL=reference") from exc
            _loaded[name] = Engine(name, cells.CellTable, placement.split_batch, state_io.StateIO)
        else:
            reference = importlib.import_module("recurrent_cache.reference")
            _loaded[name] = Engine(name, reference.CellTable, reference.split_batch, reference.StateIO)
    return _loaded[name]
