"""`MemoryState`: the ubatches of one ``init_batch``, placed one at a time — and `Ubatch`.

This is the one implementation of the protocol (``apply`` / ``next`` / iteration,
what is readable when, every misuse error) for both engines; an engine's
``Placement`` only runs the loops.  A state applies exactly what was validated,
against the cache it was validated on: any change to the cache between
``init_batch`` and an ``apply`` (another state applied, a sequence operation, a
``state_read``, through Python or the C API) moves the memory core's change
counter, makes the state stale, and using it raises ``UsageError``.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol, overload

import numpy as np

from ._args import index
from .errors import OutOfRangeError, UsageError, engine_error
from .storage import Tensor

if TYPE_CHECKING:
    from ._engines import Core, Placement
    from .batch import Batch

__all__ = ["MemoryState", "MemoryStatus", "RowViews", "Ubatch", "SeqIdLists", "ThreadGuard", "StateOwner", "Stepped",
           "each_ubatch"]


class StateOwner(Protocol):
    """What a ``MemoryState`` reads of the cache that made it (a ``RecurrentCache``): its cell count,
    layers and per-layer state tensors.  A protocol, so this module does not import the cache,
    which imports it."""

    r: tuple[Any, ...]
    s: tuple[Any, ...]

    @property
    def size(self) -> int: ...

    @property
    def n_layer(self) -> int: ...

    @property
    def layers(self) -> tuple[int, ...]: ...


class ThreadGuard:
    """One thread at a time inside a cache: ``enter()`` raises ``UsageError`` instead of waiting
    while another thread is inside (the cache and its states share one guard)."""

    __slots__ = ("_lock",)

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def enter(self) -> None:
        if not self._lock.acquire(blocking=False):
            raise UsageError("this RecurrentCache is in use by another thread: a cache belongs to one "
                             "thread at a time (use one cache per thread, or a lock around every call)")

    def leave(self) -> None:
        self._lock.release()


class MemoryStatus(enum.IntEnum):
    """Outcome of ``init_batch`` / ``init_full`` (llama.cpp's ``llama_memory_status``)."""

    SUCCESS = 0
    NO_UPDATE = 1
    FAILED_PREPARE = 2
    FAILED_COMPUTE = 3


class SeqIdLists:
    """The seq-id lists of a ubatch's groups (owner first), built only when read: a
    ``collections.abc.Sequence`` (registered, not derived: an ABC base costs every ubatch).

    ``lists[g]`` is a tuple of ints; it compares equal to a tuple or list of such tuples.
    Code that wants numbers reads ``Ubatch.seq_id_flat`` / ``seq_id_offset`` instead.
    """

    __slots__ = ("_placement", "_u", "_n_seqs", "_lists")

    def __init__(self, placement: Placement, u: int, n_seqs: int) -> None:
        # the engine's placement, not the Ubatch: no reference cycle to leave to the collector
        self._placement = placement
        self._u = u
        self._n_seqs = n_seqs
        self._lists: tuple[tuple[int, ...], ...] | None = None

    def _all(self) -> tuple[tuple[int, ...], ...]:
        if self._lists is None:
            flat, offset = (array.tolist() for array in self._placement.seq_id_arrays(self._u))
            self._lists = tuple(tuple(flat[offset[g]:offset[g + 1]]) for g in range(len(offset) - 1))
        return self._lists

    def __len__(self) -> int:
        return self._n_seqs

    @overload
    def __getitem__(self, index: int) -> tuple[int, ...]: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[tuple[int, ...], ...]: ...
    def __getitem__(self, index: int | slice) -> tuple[int, ...] | tuple[tuple[int, ...], ...]:
        return self._all()[index]

    def __iter__(self) -> Iterator[tuple[int, ...]]:
        return iter(self._all())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, SeqIdLists):
            other = other._all()
        if isinstance(other, (tuple, list)):
            return self._all() == tuple(tuple(ids) for ids in other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._all())

    def __repr__(self) -> str:
        return repr(self._all())

    def __contains__(self, value: object) -> bool:
        return value in self._all()

    def __reversed__(self) -> Iterator[tuple[int, ...]]:
        return reversed(self._all())

    def index(self, value: object, *args: Any) -> int:
        return self._all().index(value, *args)

    def count(self, value: object) -> int:
        return self._all().count(value)


Sequence.register(SeqIdLists)


class Ubatch:
    """One micro-batch: ``n_seqs`` groups of exactly ``n_seq_tokens`` tokens.

    Token ``k`` of group ``s`` is entry ``s * n_seq_tokens + k`` of every
    per-token array.  ``seq_id[s]`` is group ``s``'s seq-id list, owner first;
    the same lists as numbers: ``seq_id_flat[seq_id_offset[s]:seq_id_offset[s + 1]]``,
    and ``seq_owner[s]`` the owner.  Everything is built on first read, in C; the
    per-token arrays are read-only, and views of the batch's arrays when the
    ubatch's tokens are a contiguous run of the batch (a decode step).
    """

    __slots__ = ("n_tokens", "n_seq_tokens", "n_seqs", "_placement", "_u", "_batch", "_pos",
                 "_take", "_output", "_seq_arrays", "_seq_id")

    def __init__(self, placement: Placement, u: int, batch: Batch, pos: np.ndarray) -> None:
        self.n_tokens, self.n_seq_tokens, self.n_seqs = placement.shape(u)
        self._placement = placement
        self._u = u
        self._batch = batch
        self._pos = pos
        self._take: slice | np.ndarray | None = None
        self._output: np.ndarray | None = None
        self._seq_arrays: tuple[np.ndarray, np.ndarray] | None = None
        self._seq_id: SeqIdLists | None = None

    def _taken(self, array: np.ndarray) -> np.ndarray:
        if self._take is None:
            self._take = self._placement.batch_take(self._u)
        taken: np.ndarray = array[self._take]
        return taken

    @property
    def batch_index(self) -> np.ndarray:
        """[n_tokens] int64: where each token sits in the batch."""
        return self._placement.batch_index(self._u)

    @property
    def token(self) -> np.ndarray | None:
        """[n_tokens] int32 token ids, or None for an embedding batch."""
        return None if self._batch.token is None else self._taken(self._batch.token)

    @property
    def embd(self) -> np.ndarray | None:
        """[n_tokens, n_embd] float32, or None for a token batch."""
        return None if self._batch.embd is None else self._taken(self._batch.embd)

    @property
    def pos(self) -> np.ndarray:
        """[n_tokens] int32 positions."""
        return self._taken(self._pos)

    @property
    def output(self) -> np.ndarray:
        """[n_tokens] bool: the tokens whose outputs (logits, embeddings) are wanted."""
        if self._output is None:
            self._output = self._placement.output(self._u)
        return self._output

    def _arrays(self) -> tuple[np.ndarray, np.ndarray]:
        if self._seq_arrays is None:
            self._seq_arrays = self._placement.seq_id_arrays(self._u)
        return self._seq_arrays

    @property
    def seq_id_flat(self) -> np.ndarray:
        """[entries] int32: every group's seq ids back to back."""
        return self._arrays()[0]

    @property
    def seq_id_offset(self) -> np.ndarray:
        """[n_seqs + 1] int32: group s lists ``seq_id_flat[seq_id_offset[s]:seq_id_offset[s + 1]]``."""
        return self._arrays()[1]

    @property
    def seq_owner(self) -> np.ndarray:
        """[n_seqs] int32: each group's owner (its first seq id), whose cell the group's row is."""
        flat, offset = self._arrays()
        owners: np.ndarray = flat[offset[:-1]]
        return owners

    @property
    def seq_id(self) -> SeqIdLists:
        """[n_seqs] seq-id lists, owner first (tuples of ints)."""
        if self._seq_id is None:
            self._seq_id = SeqIdLists(self._placement, self._u, self.n_seqs)
        return self._seq_id

    def __repr__(self) -> str:
        return (f"Ubatch(n_tokens={self.n_tokens}, n_seqs={self.n_seqs}, "
                f"n_seq_tokens={self.n_seq_tokens}, owners={self.seq_owner.tolist()})")


class RowViews:
    """The views ``st.r(il)`` / ``st.s(il)`` hand out, kept per layer and rows: slicing a torch
    tensor costs microseconds, and a decode loop asks for the same rows every step.  The
    tensors never move, so a view stays valid for the cache's lifetime."""

    MAX_KEPT = 4096   # distinct (kind, layer, rows): beyond this the memo starts over

    def __init__(self) -> None:
        self._kept: dict[tuple[int, int, int, int], Tensor] = {}

    def rows(self, tensor: Tensor, kind: int, il: int, rows: slice) -> Tensor:
        """``tensor[rows]`` (of layer ``il``'s r, kind 0, or s, kind 1)."""
        key = (kind, il, rows.start, rows.stop)
        view = self._kept.get(key)
        if view is None:
            if len(self._kept) >= self.MAX_KEPT:
                self._kept.clear()
            view = self._kept[key] = tensor[rows]
        return view


class Stepped(Protocol):
    """A state whose ubatches are applied one at a time (``MemoryState``, ``hybrid.HybridState``)."""

    @property
    def n_ubatches(self) -> int: ...
    @property
    def applied(self) -> bool: ...
    @property
    def ubatch(self) -> Ubatch: ...
    def apply(self) -> bool: ...
    def next(self) -> bool: ...


def each_ubatch(state: Stepped) -> Iterator[Ubatch]:
    """``for ub in state``: each ubatch, applied before it is yielded; none for a state without
    ubatches (a failed prepare, ``init_full``)."""
    if not state.n_ubatches:
        return
    while True:
        if not state.applied:
            state.apply()
        yield state.ubatch
        if not state.next():
            return


class MemoryState:
    """The ubatches of one ``init_batch`` (or the whole cache, for ``init_full``).

    ``apply()`` places the current ubatch (find_slot, copy plan, row moves); read
    ``ubatch`` / ``r(il)`` / ``s(il)``; ``next()`` moves on.  Or iterate:
    ``for ub in cache.init_batch(batch): ...`` applies each ubatch before yielding it.
    """

    __slots__ = ("_cache", "_core", "_guard", "_views", "_placement", "_batch", "_pos", "status", "_u", "_applied",
                 "_generation", "_ubatch", "_out_ids", "_rows_slice", "_m")

    def __init__(self, cache: StateOwner, core: Core, guard: ThreadGuard, views: RowViews,
                 placement: Placement | None, batch: Batch | None, pos: np.ndarray | None,
                 status: MemoryStatus) -> None:
        self._cache = cache
        self._views = views
        self._core = core                # the cache's memory core: its counter says when this state is stale
        self._guard = guard
        self._placement = placement      # None: the whole cache (init_full)
        self._batch = batch
        self._pos = pos
        self.status = status
        self._u = 0
        self._applied = placement is None
        self._generation = core.generation
        self._ubatch: Ubatch | None = None
        self._out_ids: np.ndarray | None = None
        self._rows_slice = slice(0, cache.size)   # the rows of the applied ubatch
        self._m = 0                               # step states the model writes per group
    # -- stepping ----------------------------------------------------------------------

    def apply(self) -> bool:
        """Place the current ubatch: find_slot, copy plan, row moves. Returns True."""
        if self._placement is None:
            return True
        if self.status != MemoryStatus.SUCCESS:
            raise UsageError(f"apply() on a state whose status is {self.status.name}")
        if self._applied:
            raise UsageError(f"ubatch {self._u} is already applied; call next() first")
        core = self._core
        self._guard.enter()
        try:
            if core.generation != self._generation:
                raise UsageError("the cache changed after this state was prepared (a sequence operation, "
                                 "a state_read or another state's apply): call init_batch again")
            code = self._placement.apply(self._u)
            if code:
                raise engine_error(code, what=f"apply of ubatch {self._u}", seq=-1, size=core.size)
            self._generation = core.generation
            head = self._placement.head
            _, n_seq_tokens, n_seqs = self._placement.shape(self._u)
            self._m = core.steps(n_seq_tokens) if n_seq_tokens > 1 else 0   # (a decode step keeps none)
        finally:
            self._guard.leave()
        self._rows_slice = slice(head, head + n_seqs)
        self._applied = True
        return True

    @property
    def stale(self) -> bool:
        """Whether the cache changed after this state's ``init_batch`` (or its last ``apply``) other than
        through it, by whichever API (Python or C): its next ``apply`` would be refused."""
        return self._placement is not None and self._core.generation != self._generation

    def next(self) -> bool:
        """Move to the next ubatch; False after the last one."""
        placement = self._placement
        if placement is None or self.status is not MemoryStatus.SUCCESS or self._u + 1 >= placement.n_ubatches:
            return False
        self._u += 1
        self._applied = False
        self._ubatch = None
        return True

    def __iter__(self) -> Iterator[Ubatch]:
        return each_ubatch(self)

    @property
    def applied(self) -> bool:
        """Whether the current ubatch is applied (``init_full``'s state always is)."""
        return self._applied

    # -- what the model reads ------------------------------------------------------------

    @property
    def n_ubatches(self) -> int:
        """Number of ubatches (0 for ``init_full`` and for a failed prepare)."""
        if self._placement is None or self.status != MemoryStatus.SUCCESS:
            return 0
        return int(self._placement.n_ubatches)

    @property
    def placement(self) -> Placement | None:
        """The engine's split of this batch (None for ``init_full``), to read its ubatches' tokens
        from: a hybrid memory places them in its KV table too (``_hybrid_step``, at the C level).
        Applying goes through ``apply()``, which checks the state is not stale."""
        return self._placement

    @property
    def head(self) -> int:
        """First cell (row) of the applied ubatch; -1 before the first apply()."""
        return 0 if self._placement is None else int(self._placement.head)

    @property
    def n_kv(self) -> int:
        """Cells from head that the applied ubatch touches (the copy plan's length)."""
        return self._cache.size if self._placement is None else int(self._placement.n_kv)

    @property
    def copy_src(self) -> np.ndarray:
        """[n_kv] int32: row head+i was filled from row copy_src[i]."""
        if self._placement is None:
            return np.arange(self._cache.size, dtype=np.int32)
        return self._placement.copy_src()

    @property
    def zero(self) -> np.ndarray:
        """[n_kv] bool: rows that were zeroed (no state yet)."""
        if self._placement is None:
            return np.zeros(self._cache.size, dtype=bool)
        return self._placement.zero()

    @property
    def ubatch(self) -> Ubatch:
        """The current ubatch (see ``Ubatch``)."""
        if self._ubatch is None:
            self._ubatch = self.planned(self._u)
        return self._ubatch

    def planned(self, u: int) -> Ubatch:
        """Ubatch ``u`` as the split made it — its tokens, positions and seq ids, readable before it
        is applied (a hybrid memory places every ubatch's attention tokens up front); its rows are
        ``r(il)`` / ``s(il)`` once it is the applied one."""
        if self._placement is None or self.status != MemoryStatus.SUCCESS:
            raise UsageError("this state has no ubatches")
        u = index(u, "ubatch index", int(self._placement.n_ubatches), OutOfRangeError)
        assert self._batch is not None and self._pos is not None
        return Ubatch(self._placement, u, self._batch, self._pos)

    def _rows(self, tensors: tuple[Tensor | None, ...], il: int, kind: int) -> Tensor:
        if type(il) is not int or not 0 <= il < len(tensors):   # the common case skips the general check
            il = index(il, "layer index", len(tensors), OutOfRangeError)
        rows = tensors[il]
        if rows is None:
            raise OutOfRangeError(f"layer {il} holds no recurrent state (layers={self._cache.layers})")
        if not self._applied:
            raise UsageError(f"ubatch {self._u} is not applied yet: call apply() first")
        if self._placement is not None and self._core.generation != self._generation:
            raise UsageError("the cache changed after this ubatch was applied: its rows may hold "
                             "other sequences now")
        return self._views.rows(rows, kind, il, self._rows_slice)

    def r(self, il: int) -> Tensor:
        """Rows head .. head+n_seqs-1 of layer il's r tensor: group s is row s (a view, of the
        cache's storage: a numpy array, or a torch tensor on the cache's device)."""
        return self._rows(self._cache.r, il, 0)

    def s(self, il: int) -> Tensor:
        """Rows head .. head+n_seqs-1 of layer il's s tensor: group s is row s."""
        return self._rows(self._cache.s, il, 1)

    def _steps(self, first: int, il: int) -> Tensor:
        il = index(il, "layer index", self._cache.n_layer, OutOfRangeError)
        self._rows(self._cache.r, il, 0)   # a layer with state, applied, and the cache unchanged since
        n_seqs = 0 if self._placement is None else self.ubatch.n_seqs
        layers = self._cache.layers
        k = il if len(layers) == self._cache.n_layer else layers.index(il)   # the core's tensor of il
        return self._core.step_rows(first * len(layers) + k, n_seqs, self._m)

    def r_steps(self, il: int) -> Tensor:
        """[n_seqs, m, n_embd_r] where the model writes, with ``n_rollback > 0``, layer il's r state
        after each token but the last of every group: entry ``[g, j]`` is the state after token
        ``n_seq_tokens - 1 - m + j`` of group g, ``m = min(n_rollback, n_seq_tokens - 1)`` (docs/rollback.md).
        A scratch of the memory core: the next call that changes the cache (through this API or
        the C API) files it into the history, so write it before that call."""
        return self._steps(0, il)

    def s_steps(self, il: int) -> Tensor:
        """[n_seqs, m, n_embd_s]: as ``r_steps`` for layer il's s state."""
        return self._steps(1, il)

    @property
    def out_ids(self) -> np.ndarray:
        """[n_outputs] int64: the batch index of each output row, in ubatch order."""
        if self._placement is None or self.status != MemoryStatus.SUCCESS:
            return np.zeros(0, dtype=np.int64)
        if self._out_ids is None:
            self._out_ids = self._placement.out_ids()
        return self._out_ids

    def __repr__(self) -> str:
        if self._placement is None:
            return f"MemoryState(full, n_kv={self.n_kv})"
        return (f"MemoryState({self.status.name}, ubatch {self._u + 1}/{self.n_ubatches}, "
                f"{'applied' if self._applied else 'pending'}, head={self.head}, n_kv={self.n_kv})")
