"""The two engines below the facade, their interface, and how one is chosen.

An engine builds two things: a ``MemoryCore`` — the only code that changes a cache's
cells, state rows, rollback history and change counter (docs/concepts.md §1, §2, §5, §7) — and the
batch split bound to it, which validates and splits a batch into a ``Placement`` whose
``apply(u)`` hands ubatch ``u`` to that core.  ``Core`` and ``Placement`` below are that
interface; the compiled engine (``_core``, ``_placement``) and the reference
(``recurrent_cache.reference``) both implement it, report failures as the codes of
``errors`` and never check the facade's arguments again.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import IO, Any, NamedTuple, Protocol

import numpy as np

from .formats.dtypes import StateType
from .storage import Storage, has_host_access

__all__ = ["Core", "Engine", "NAMES", "Placement", "Split", "load"]

NAMES = ("compiled", "reference")


class Core(Protocol):
    """A cache's memory core.  Every changing call first files the step states the model wrote
    for the last applied ubatch, and bumps ``generation`` when it changed something."""

    @property
    def size(self) -> int: ...
    @property
    def head(self) -> int: ...
    @property
    def used(self) -> int: ...
    @property
    def n(self) -> int: ...
    @property
    def n_rollback(self) -> int: ...
    @property
    def generation(self) -> int: ...
    def cell(self, i: int) -> tuple[int, int, int, tuple[int, ...]]: ...
    def seq_cell(self, seq: int) -> int: ...
    def seq_pos_min(self, seq: int) -> int: ...
    def seq_pos_max(self, seq: int) -> int: ...
    def check(self) -> str | None: ...
    def history(self) -> tuple[np.ndarray, list[np.ndarray]]: ...
    def steps(self, n_seq_tokens: int) -> int: ...
    def step_rows(self, k: int, n_seqs: int, m: int) -> Any: ...
    def clear(self) -> None: ...
    def seq_rm(self, seq: int, p0: int, p1: int) -> bool: ...
    def seq_cp(self, seq_src: int, seq_dst: int) -> None: ...
    def seq_keep(self, seq: int) -> int: ...
    def seq_add(self, seq: int, p0: int, p1: int, shift: int) -> int: ...
    def seq_div(self, seq: int, p0: int, p1: int, d: int) -> int: ...
    def rollback_min(self, seq: int) -> int: ...
    def restore(self, seq: int, pos: int, rows: list[Any]) -> int: ...
    def state_size(self, seq_id: int) -> int: ...
    def state_write_bytes(self, seq_id: int) -> bytes: ...
    def aliases(self, buffer: memoryview) -> bool: ...
    def state_write_into(self, view: memoryview, seq_id: int) -> int: ...
    def state_write_file(self, file: IO[bytes], seq_id: int) -> int: ...
    def state_read(self, data: memoryview, seq_id: int) -> int: ...


class Placement(Protocol):
    """The ubatches of one batch, and the copy plan of the last one applied."""

    @property
    def head(self) -> int: ...
    @property
    def n_kv(self) -> int: ...
    @property
    def n_ubatches(self) -> int: ...
    def prepare(self) -> int: ...
    def apply(self, u: int) -> int: ...
    def copy_src(self) -> np.ndarray: ...
    def zero(self) -> np.ndarray: ...
    def shape(self, u: int) -> tuple[int, int, int]: ...
    def batch_take(self, u: int) -> slice | np.ndarray: ...
    def batch_index(self, u: int) -> np.ndarray: ...
    def output(self, u: int) -> np.ndarray: ...
    def seq_id_arrays(self, u: int) -> tuple[np.ndarray, np.ndarray]: ...
    def out_ids(self) -> np.ndarray: ...


# split(seq_id_flat, seq_id_offset, pos, logits, logits_all, n_ubatch, embd_pooled): a batch validated
# against the core it was built with, split into ubatches
Split = Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None, bool, int, bool], Placement]


class Engine(NamedTuple):
    name: str
    # build(size, storage, kinds: the cells' r and s tensors [n_state, size, n_embd] of that storage,
    # their StateTypes, n_rollback, ggml type ids (r of each layer with state, then s), the model's
    # n_layer, the layers with state): a memory core over the tensors, and the batch split bound to
    # it (an engine's placements apply to its own core only)
    build: Callable[[int, Storage, tuple[Any, Any], tuple[StateType, StateType], int, list[int], int,
                     tuple[int, ...]], tuple[Core, Split]]


def _build_compiled(size: int, storage: Storage, kinds: tuple[Any, Any], dtypes: tuple[StateType, StateType],
                    n_rollback: int, type_ids: list[int], n_layer: int, layers: tuple[int, ...]) -> tuple[Core, Split]:
    from . import _core, _placement
    core = _core.MemoryCore(size, storage, kinds, dtypes, n_rollback, type_ids, n_layer, layers)
    return core, functools.partial(_placement.split_batch, core)


def _build_reference(size: int, storage: Storage, kinds: tuple[Any, Any], dtypes: tuple[StateType, StateType],
                     n_rollback: int, type_ids: list[int], n_layer: int, layers: tuple[int, ...]) -> tuple[Core, Split]:
    from . import reference
    if not has_host_access(storage):
        from .errors import ConfigError
        raise ConfigError(f"the reference engine moves rows in host memory; {storage!r} has none: "
                          "use the compiled engine")
    host = [storage.host_view(kind) for kind in kinds]
    tensors = [view[k] for view in host if view is not None for k in range(len(layers))]
    core = reference.MemoryCore(size, tensors, n_rollback, type_ids, n_layer, layers, storage)
    return core, functools.partial(reference.split_batch, core)


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
                from . import _core, _placement  # noqa: F401 - fail here, with advice, when unbuilt
            except ImportError as exc:  # pragma: no cover - only without a build
                raise ImportError(
                    f"recurrent_cache's compiled core is missing or was built for another Python ({exc}). "
                    "Build it from the source tree with `pip install .` (needs a C compiler), or use the "
                    "slow pure-Python engine: RECURRENT_CACHE_IMPL=reference") from exc
            _loaded[name] = Engine(name, _build_compiled)
        else:
            _loaded[name] = Engine(name, _build_reference)
    return _loaded[name]
