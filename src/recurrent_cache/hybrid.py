"""`HybridCache`: the memory of a hybrid model — an attention KV cache for its attention layers beside
the recurrent state of its other layers, behind one sequence API (llama.cpp's ``llama_memory_hybrid``;
docs/hybrid.md, "The hybrid memory").

The two halves are the package's own: the recurrent half is a ``RecurrentCache`` over the recurrent
layers (one cell per sequence), the KV half a KV cell table of the same engine
(``_engines.KVTable``) with a K and a V tensor per attention layer on the same storage.  This module
holds the rule that makes them one memory: **every call changes both halves or neither**.  Arguments
are checked here first, then the half that may still refuse goes first, and the other is asked only
when what it would refuse has been ruled out (each operation says how).  A ``HybridState`` applies a
ubatch to both halves, on slots both found at ``init_batch``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal, NamedTuple, NoReturn

import numpy as np

from . import _args, _engines
from ._args import as_flag, as_int, state_seq_id
from .batch import Batch
from .cache import RecurrentCache
from .errors import (CAPI_MOVE_RANGE, POS_MAX, SEQ_RANGE, ArgumentError, BrokenCacheError, ConfigError, CoreError,
                     NoFreeCellError, UsageError, engine_error)
from .formats.blob import framing_prefix
from .formats.dtypes import STATE_TYPES, StateType
from .hybrid_bytes import HybridBytes
from .hybrid_state import Guard, HybridState, KvPlan, KvTokens, TokenPlan, seq_lists
from .kv_reference import SWA_TYPES, N_KV_PAD, as_int32, check_config
from .kv_state import KvRows
from .memory_state import MemoryStatus, ThreadGuard
from .storage import Storage, Tensor, allocating, storage_for

__all__ = ["HybridCache", "HybridSeqState", "HybridState"]

# a range bound the KV table takes as int32: positions lie below POS_MAX, so larger bounds mean "to the end"
_POS_END = POS_MAX


class HybridSeqState(NamedTuple):
    """What one sequence holds (``HybridCache.seq_state``): its KV positions in order, the K and V
    rows of those cells ``[n_attn, n, n_embd_*]``, and its recurrent rows (one per recurrent layer)."""

    pos: np.ndarray
    k: Tensor
    v: Tensor
    r: list[Tensor]
    s: list[Tensor]


def _bound(value: int) -> int:
    """A range bound for both halves: < 0 means "open" to each; beyond every position, the end."""
    return -1 if value < 0 else min(value, _POS_END)


def _layers(value: Any, name: str, n_layer: int) -> tuple[int, ...]:
    layers = _args.layer_filter(value, n_layer, ConfigError, name)
    return tuple(range(n_layer)) if layers is None else layers


def _kv_type(value: Any, name: str) -> StateType:
    if not isinstance(value, str) or value not in STATE_TYPES:
        raise ConfigError(f"{name} must be one of {', '.join(STATE_TYPES)}, got {value!r}")
    return STATE_TYPES[value]


class _Call:
    """``with``: one call holding the thread guard; a broken memory is refused (``BrokenCacheError``,
    the guard left) before the call starts."""

    __slots__ = ("_guard", "_usable", "_op")

    def __init__(self, guard: Guard, usable: Callable[[str], None], op: str) -> None:
        self._guard, self._usable, self._op = guard, usable, op

    def __enter__(self) -> None:
        self._guard.enter()
        try:
            self._usable(self._op)
        except BaseException:
            self._guard.leave()
            raise

    def __exit__(self, *exc_info: object) -> None:
        self._guard.leave()


class _Breaks:
    """``with``: a failure of kind ``kind`` raised inside breaks the memory (``HybridCache._break``
    raises it again as ``BrokenCacheError``, the storage's exception its cause); others go on as raised."""

    __slots__ = ("_break", "_op", "_kind")

    def __init__(self, break_: Callable[[str, BaseException], NoReturn], op: str, kind: type[BaseException]) -> None:
        self._break, self._op, self._kind = break_, op, kind

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, failure: BaseException | None, traceback: object) -> None:
        if isinstance(failure, self._kind):
            self._break(self._op, failure)


class HybridCache:
    """Memory for a hybrid model (Jamba, Granite-4.0-H, Nemotron-H, Falcon-H1, Qwen3-Next, LFM2, ...).

    ``attn_layers`` hold attention (a K and a V row per KV cell), ``recr_layers`` recurrent state
    (r and s rows per sequence, as ``RecurrentCache``); a layer may be in both (Falcon-H1) or in
    neither (Nemotron-H's MLP layers).  ``kv_size`` KV cells hold one token each; the recurrent half
    has ``n_seq_max`` cells.  Per attention layer ``il``: ``k[il]`` is ``[kv_size, n_embd_k]`` (row =
    cell) and ``v[il]`` ``[kv_size, n_embd_v]``, or ``[n_embd_v, kv_size]`` with ``v_trans`` (llama.cpp's
    layout without flash attention, its default); ``None`` for other layers.  ``r[il]`` / ``s[il]`` as
    in ``RecurrentCache``.

    dtype_k / dtype_v: ``"f16"`` (llama.cpp's default), ``"f32"`` or ``"bf16"``; dtype_r / dtype_s,
    n_rollback, engine, storage, device: as ``RecurrentCache``.  n_swa / swa_type: the sliding window
    of the layers that have one (``kv_mask(sliding=True)``); kv_pad: the attended cells ``n_kv`` are
    the used ones rounded up to a multiple of it (llama.cpp's 256), at most ``kv_size``.

    The sequence API is the recurrent cache's: each call acts on both halves, or raises (or returns
    False) having changed neither.  One thread at a time, as ``RecurrentCache``.
    """

    def __init__(self, n_layer: int, *, attn_layers: Iterable[int], recr_layers: Iterable[int],
                 n_embd_k: int, n_embd_v: int, n_embd_r: int, n_embd_s: int, kv_size: int, n_seq_max: int = 1,
                 dtype_k: str = "f16", dtype_v: str = "f16", dtype_r: str = "f32", dtype_s: str = "f32",
                 v_trans: bool = True, n_swa: int = 0, swa_type: str = "none", kv_pad: int = N_KV_PAD,
                 n_rollback: int = 0, engine: Literal["compiled", "reference"] | None = None,
                 storage: str | Storage = "numpy", device: Any = None) -> None:
        n_layer = _args.count(n_layer, "n_layer", 1, ConfigError)
        self._n_seq_max = _args.count(n_seq_max, "n_seq_max", 1, ConfigError)
        self._attn_layers = _layers(attn_layers, "attn_layers", n_layer)
        kv_size = _args.in_range(kv_size, "kv_size", 1, _args.INT32_END, ConfigError)
        self._n_embd_k = _args.count(n_embd_k, "n_embd_k", 1, ConfigError)
        self._n_embd_v = _args.count(n_embd_v, "n_embd_v", 1, ConfigError)
        self._type_k, self._type_v = _kv_type(dtype_k, "dtype_k"), _kv_type(dtype_v, "dtype_v")
        self._v_trans = as_flag(v_trans, "v_trans", ConfigError)
        self._kv_pad = _args.count(kv_pad, "kv_pad", 1, ConfigError)
        if swa_type not in SWA_TYPES:
            raise ConfigError(f"swa_type must be one of {', '.join(SWA_TYPES)}, got {swa_type!r}")
        check_config(kv_size, self._n_seq_max, _args.as_int(n_swa, "n_swa", ConfigError), swa_type)
        self._storage = storage_for(storage, device)
        engine_of = _engines.load(engine)
        self._recurrent = RecurrentCache(n_layer, n_embd_r, n_embd_s, self._n_seq_max, dtype_r=dtype_r,
                                         dtype_s=dtype_s, n_rollback=n_rollback, engine=engine,
                                         layers=_layers(recr_layers, "recr_layers", n_layer), storage=self._storage)
        n_attn = len(self._attn_layers)
        v_shape = (n_attn, self._n_embd_v, kv_size) if self._v_trans else (n_attn, kv_size, self._n_embd_v)
        with allocating(f"the KV cache ({n_attn} layers x {kv_size} cells, K width {self._n_embd_k} "
                        f"{self._type_k.name}, V width {self._n_embd_v} {self._type_v.name}) on {self._storage!r}"):
            self._kv = engine_of.kv_table(kv_size, self._n_seq_max, n_swa, swa_type)
            self._kv_tensors = (self._storage.allocate((n_attn, kv_size, self._n_embd_k), self._type_k),
                                self._storage.allocate(v_shape, self._type_v))
        placed_k: list[Any] = [None] * n_layer
        placed_v: list[Any] = [None] * n_layer
        for j, il in enumerate(self._attn_layers):
            placed_k[il], placed_v[il] = self._kv_tensors[0][j], self._kv_tensors[1][j]
        self.k: tuple[Any, ...] = tuple(placed_k)
        self.v: tuple[Any, ...] = tuple(placed_v)
        k_tensor, v_tensor = self._kv_tensors
        self._kv_rows = KvRows(self._storage, k_tensor, v_tensor.swapaxes(1, 2) if self._v_trans else v_tensor,
                               self._type_k, self._type_v, self._n_embd_k, self._n_embd_v, self._v_trans, n_swa,
                               swa_type)
        self._bytes = HybridBytes(self._kv, self._kv_rows, self._kv_tensors, self._recurrent, n_attn)
        # the compiled engine places a batch's KV tokens straight from its split's C arrays, takes its guard
        # with one atomic exchange (_hybrid_step), and its sequence operations are _hybrid_rule's, the C
        # API's too (one copy of the rule); the reference engine's are this module's own, below
        self._compiled_plan: Callable[[_engines.KVTable, _engines.Placement], KvPlan | None] | None = None
        self._guard: Guard = ThreadGuard()
        self._rule: Any = None
        if engine_of.name == "compiled":
            from . import _hybrid_step
            from ._hybrid_rule import HybridRule
            self._guard = _hybrid_step.StepGuard()
            self._rule = HybridRule(self._recurrent.memory_core, self._kv, bool(self._attn_layers))
            if self._attn_layers:
                self._compiled_plan = _hybrid_step.prepare
        self._generation = 0
        # the storage's failure that left the halves (or one half's cells and rows) disagreeing: while
        # set, every call raises BrokenCacheError until clear() succeeds
        self._broken: BaseException | None = None

    # -- what it is ------------------------------------------------------------------------

    @property
    def n_layer(self) -> int:
        return self._recurrent.n_layer

    @property
    def attn_layers(self) -> tuple[int, ...]:
        """The layers with attention (K and V rows), sorted."""
        return self._attn_layers

    @property
    def recr_layers(self) -> tuple[int, ...]:
        """The layers with recurrent state (r and s rows), sorted."""
        return self._recurrent.layers

    @property
    def n_seq_max(self) -> int:
        return self._n_seq_max

    @property
    def kv_size(self) -> int:
        return self._kv.size

    @property
    def n_embd_r(self) -> int:
        """The width of a recurrent layer's r row (``RecurrentCache.n_embd_r``)."""
        return self._recurrent.n_embd_r

    @property
    def n_embd_s(self) -> int:
        """The width of a recurrent layer's s row."""
        return self._recurrent.n_embd_s

    @property
    def dtype_r(self) -> str:
        """The storage type of the r rows ("f32", "f16", "bf16")."""
        return self._recurrent.dtype_r

    @property
    def dtype_s(self) -> str:
        """The storage type of the s rows."""
        return self._recurrent.dtype_s

    @property
    def n_embd_k(self) -> int:
        return self._n_embd_k

    @property
    def n_embd_v(self) -> int:
        return self._n_embd_v

    @property
    def dtype_k(self) -> str:
        return self._type_k.name

    @property
    def dtype_v(self) -> str:
        return self._type_v.name

    @property
    def v_trans(self) -> bool:
        """Whether ``v[il]`` is ``[n_embd_v, kv_size]`` (one run of cells per dimension)."""
        return self._v_trans

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of one token's K and V rows, every attention layer."""
        return self._bytes.kv_bytes_per_token

    @property
    def recurrent_bytes_per_seq(self) -> int:
        """Bytes of one sequence's recurrent state (r and s rows, every recurrent layer)."""
        return self._bytes.recurrent_bytes_per_seq

    @property
    def kv_pad(self) -> int:
        return self._kv_pad

    @property
    def n_rollback(self) -> int:
        return self._recurrent.n_rollback

    @property
    def engine(self) -> str:
        return self._recurrent.engine

    @property
    def storage(self) -> Storage:
        return self._storage

    @property
    def r(self) -> tuple[Any, ...]:
        """Layer il's recurrent r rows ``[n_seq_max, n_embd_r]`` (None for a layer without state)."""
        return self._recurrent.r

    @property
    def s(self) -> tuple[Any, ...]:
        return self._recurrent.s

    @property
    def kv_tensors(self) -> tuple[Tensor, Tensor]:
        """K ``[n_attn, kv_size, n_embd_k]`` and V (``[n_attn, n_embd_v, kv_size]`` with ``v_trans``, else
        ``[n_attn, kv_size, n_embd_v]``): ``k[il]`` is ``kv_tensors[0][j]`` for the j-th attention layer."""
        return self._kv_tensors

    @property
    def memory_core(self) -> _engines.Core:
        """The recurrent half's memory core (``RecurrentCache.memory_core``): with ``kv_table``, what the
        C API (``rc_ctx_new``) drives; not for Python callers, which use this facade."""
        return self._recurrent.memory_core

    @property
    def kv_table(self) -> _engines.KVTable:
        """The KV half's cell table, for the C API (``rc_ctx_new``) beside ``memory_core``."""
        return self._kv

    @property
    def generation(self) -> int:
        """Moves with every change to either half (a state prepared before a change is stale)."""
        return self._generation

    # -- the cells of each half ---------------------------------------------------------------

    @property
    def kv_used(self) -> int:
        return self._kv.used

    @property
    def kv_head(self) -> int:
        return self._kv.head

    def kv_cell(self, i: int) -> tuple[int, tuple[int, ...]] | None:
        """KV cell ``i``: ``(pos, seq ids)``, or None when empty."""
        i = _args.index(i, "KV cell index", self._kv.size)
        self._usable("kv_cell")
        return self._kv.cell(i)

    def kv_cells(self) -> list[tuple[int, tuple[int, ...]] | None]:
        """Every KV cell, as ``kv_cell``."""
        self._usable("kv_cells")
        return self._kv.cells()

    def seq_kv_cells(self, seq: int) -> np.ndarray:
        """The KV cells holding ``seq``, ordered by position (int32)."""
        seq = self._seq(seq, "seq_kv_cells")
        self._usable("seq_kv_cells")
        return self._kv.seq_cells(seq)

    def recurrent_cell(self, i: int) -> Any:
        """Recurrent cell ``i`` (``RecurrentCache.cell``)."""
        return self._recurrent.cell(i)

    def seq_row(self, seq: int) -> int:
        """The row of ``r[il]`` / ``s[il]`` holding ``seq``'s recurrent state, or -1."""
        return self._recurrent.seq_row(self._seq(seq, "seq_row"))

    @property
    def kv_has_shift(self) -> bool:
        """Whether ``seq_add`` / ``seq_div`` moved a cell's position since ``kv_reset_shift``: the model
        must rotate those keys (``kv_shifts``) before attending to them again."""
        return self._kv.has_shift

    def kv_shifts(self) -> np.ndarray:
        """[kv_size] int32: how far each cell's position moved since its key was last rotated."""
        self._usable("kv_shifts")
        return self._kv.shifts()

    def kv_reset_shift(self) -> None:
        """The model rotated the keys by ``kv_shifts()``: none is pending any more."""
        with self._call("kv_reset_shift"):
            self._kv.reset_shift()
            self._generation += 1

    def check(self) -> None:
        """Raise ``CoreError`` if an invariant of either half is broken, or if they disagree on which
        sequences hold a position (a sequence's recurrent position must be its largest KV position
        where it holds KV cells and the model has attention layers).  ``BrokenCacheError`` when a
        storage failure broke it."""
        self._usable("check")
        self._kv.check()
        self._recurrent.check()
        if not self._attn_layers:
            return
        for seq in range(self._n_seq_max):
            kv_max, recr_max = self._kv.seq_pos_max(seq), self._recurrent.seq_pos_max(seq)
            if kv_max != recr_max:
                raise CoreError(f"sequence {seq}: its KV cells end at position {kv_max} but its recurrent "
                                f"state is at {recr_max}")

    # -- one thread at a time ------------------------------------------------------------------

    def _call(self, op: str) -> _Call:
        """``with``: the thread guard held for ``op``, a broken memory refused first."""
        return _Call(self._guard, self._usable, op)

    def _breaks_on(self, op: str, kind: type[BaseException]) -> _Breaks:
        """``with``: a failure of ``kind`` inside breaks the memory — ``BrokenCacheError``, raised by a
        half that failed having changed nothing of the other (a storage's failure in its own moves),
        or any failure once a half changed."""
        return _Breaks(self._break, op, kind)

    def _usable(self, op: str) -> None:
        """Raise ``BrokenCacheError`` if a storage failure broke the memory.  The recurrent half broken
        by one (in a decode's moves) is found by asking it, and breaks the whole memory."""
        if self._broken is None:
            with self._breaks_on(op, BrokenCacheError):
                self._recurrent.seq_pos_max(0)
            return
        raise self._broken_error(op)

    def _broken_error(self, op: str) -> BrokenCacheError:
        error = BrokenCacheError(f"{op}: the cache is broken: {self._storage!r} failed while moving its rows "
                                 f"({type(self._broken).__name__}: {self._broken}); clear() it to use it again")
        error.__cause__ = self._broken
        return error

    def _break(self, op: str, failure: BaseException) -> NoReturn:
        """A failure after a half changed (a storage's, or the recurrent half broken by one): the memory
        is marked broken and every state prepared before made stale; raises ``BrokenCacheError`` with
        the storage's exception as its cause (an interrupt goes on as it came)."""
        cause = failure.__cause__ if isinstance(failure, BrokenCacheError) and failure.__cause__ else failure
        self._broken = cause
        self._generation += 1
        if not isinstance(failure, Exception):
            raise failure
        raise self._broken_error(op) from cause

    def _seq(self, value: Any, op: str) -> int:
        seq = as_int(value, "seq")
        if not 0 <= seq < self._n_seq_max:
            raise engine_error(SEQ_RANGE, what=f"{op}: seq_id {seq}", seq=seq, size=self._n_seq_max)
        return seq

    # -- the sequence API -------------------------------------------------------------------------

    def clear(self) -> None:
        """Empty every cell of both halves and zero every row; a broken memory (``BrokenCacheError``)
        is usable again once this succeeds."""
        self._guard.enter()   # (a broken memory too)
        try:
            with self._breaks_on("clear", BaseException):
                self._kv.clear()
                for tensor in self._kv_tensors:
                    self._storage.zero(tensor, np.arange(tensor.shape[1], dtype=np.int64))
                self._recurrent.clear()
            self._broken = None
            self._generation += 1
        finally:
            self._guard.leave()

    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> bool:
        """Drop ``seq`` (every sequence when ``seq < 0``) from positions ``[p0, p1)`` in both halves.

        The recurrent half decides: it cannot cut a state — except back to one its rollback history
        holds (``n_rollback > 0``: ``seq_rm(seq, p0, -1)`` returns to the state after ``p0 - 1``) — and
        then False is returned with neither half changed.  The KV half never refuses.
        """
        seq, p0, p1 = as_int(seq, "seq"), _bound(as_int(p0, "p0")), _bound(as_int(p1, "p1"))
        if seq >= self._n_seq_max:
            return False   # as llama.cpp: no such sequence in the recurrent half, nothing removed
        seq = max(seq, -1)
        with self._call("seq_rm"):
            # the recurrent half refuses (False) or fails (a storage's error) before changing
            with self._breaks_on("seq_rm", BrokenCacheError):
                if self._rule is not None:
                    if not self._rule.seq_rm(seq, p0, p1):   # both halves, or neither
                        return False
                elif not self._recurrent.seq_rm(seq, p0, p1):
                    return False
            if self._rule is None:
                with self._breaks_on("seq_rm", BaseException):
                    self._kv.seq_rm(seq, p0, p1)
            self._generation += 1
            return True

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        """Fork: ``dst``, which must hold nothing, joins ``src``'s KV cells (shared, not copied) and
        shares its recurrent state.  The range must cover every position ``src`` holds: a recurrent
        state is whole, so a part of the KV cells beside it would give ``dst`` a state past its
        context (llama.cpp lets it happen; here it raises ``ArgumentError``, as does a ``dst`` that
        holds positions, whose old KV cells would stay beside the new state)."""
        src, dst = self._seq(src, "seq_cp"), self._seq(dst, "seq_cp")
        p0, p1 = _bound(as_int(p0, "p0")), _bound(as_int(p1, "p1"))
        if src == dst:
            return
        with self._call("seq_cp"):
            if self._rule is not None:
                with self._breaks_on("seq_cp", BrokenCacheError):
                    self._rule.seq_cp(src, dst, p0, p1)
                self._generation += 1
                return
            if self._kv.seq_pos_max(dst) >= 0 or self._recurrent.seq_pos_max(dst) >= 0:
                raise ArgumentError(f"seq_cp: sequence {dst} holds positions: remove it first (seq_rm({dst}))")
            first = self._kv.seq_pos_min(src)
            last = max(self._kv.seq_pos_max(src), self._recurrent.seq_pos_max(src))
            if last >= 0 and (max(p0, 0) > max(first, 0) or 0 <= p1 <= last):
                raise ArgumentError(f"seq_cp: [{p0}, {p1}) does not cover sequence {src}'s positions {first} .. "
                                    f"{last}: a hybrid sequence is copied whole")
            self._kv.seq_cp(src, dst, p0, p1)      # refuses (out of memory) before changing anything
            with self._breaks_on("seq_cp", BaseException):
                self._recurrent.seq_cp(src, dst, p0, p1)
            self._generation += 1

    def seq_keep(self, seq: int) -> None:
        """Every other sequence leaves both halves."""
        seq = self._seq(seq, "seq_keep")
        with self._call("seq_keep"):
            if self._rule is not None:
                with self._breaks_on("seq_keep", BrokenCacheError):
                    self._rule.seq_keep(seq)
            else:
                self._kv.seq_keep(seq)
                with self._breaks_on("seq_keep", BaseException):
                    self._recurrent.seq_keep(seq)
            self._generation += 1

    def seq_add(self, seq: int, p0: int, p1: int, shift: int) -> None:
        """Move ``seq``'s positions in ``[p0, p1)`` by ``shift`` in both halves (KV cells pushed below 0
        are freed; their keys' rotation is then pending: ``kv_has_shift``).

        Refused, changing neither half, when the recurrent state's position would leave
        ``[0, 2**31 - 1)``, when a sequence's last KV position would no longer be its recurrent state's
        (``ArgumentError``: the KV cells move, the state only when it lies in the range), or when a KV
        position would reach ``2**31 - 1``."""
        seq = self._seq(seq, "seq_add")
        p0, p1 = _bound(as_int(p0, "p0")), _bound(as_int(p1, "p1"))
        shift = _args.in_range(shift, "shift", _args.INT32_MIN, _args.INT32_END)
        with self._call("seq_add"):
            if self._rule is not None:
                with self._breaks_on("seq_add", BrokenCacheError):
                    self._rule.seq_add(seq, p0, p1, shift)
                self._generation += 1
                return
            pos = self._recurrent.seq_pos_max(seq)
            low, high = max(p0, 0), (_POS_END if p1 < 0 else p1)
            if shift and low <= pos < high and not 0 <= pos + shift < POS_MAX:
                self._recurrent.seq_add(seq, p0, p1, shift)   # the recurrent half refuses, in its words
            if shift:
                self._moves_alike("seq_add", seq, p0, p1, lambda pos: pos + shift)
            self._kv.seq_add(seq, p0, p1, shift)         # refuses before changing anything
            with self._breaks_on("seq_add", BaseException):
                self._recurrent.seq_add(seq, p0, p1, shift)  # cannot refuse: ruled out above
            self._generation += 1

    def seq_div(self, seq: int, p0: int, p1: int, d: int) -> None:
        """Divide ``seq``'s positions in ``[p0, p1)`` by ``d >= 1`` (truncating) in both halves; refused,
        changing neither, as ``seq_add`` when a sequence's halves would no longer end at one position."""
        seq = self._seq(seq, "seq_div")
        p0, p1, d = _bound(as_int(p0, "p0")), _bound(as_int(p1, "p1")), as_int(d, "d")
        with self._call("seq_div"):
            if self._rule is not None:
                with self._breaks_on("seq_div", BrokenCacheError):
                    self._rule.seq_div(seq, p0, p1, as_int32(min(d, 2**31 - 1), "d"))
            else:
                if d > 1:
                    self._moves_alike("seq_div", seq, p0, p1, lambda pos: pos // d)
                self._kv.seq_div(seq, p0, p1, min(d, 2**31 - 1))   # refuses d < 1 before changing anything
                with self._breaks_on("seq_div", BaseException):
                    self._recurrent.seq_div(seq, p0, p1, d)
            self._generation += 1

    def _moves_alike(self, op: str, seq: int, p0: int, p1: int, move: Callable[[int], int]) -> None:
        """``ArgumentError`` unless moving ``seq``'s positions in ``[p0, p1)`` to ``move(pos)`` leaves every
        sequence whose halves agree (its last KV position its recurrent state's) agreeing.  The KV half
        moves the range's cells, the recurrent half the state only when it lies in the range; a fork
        shares both the cells and the state, and moves with them (``_hybrid_rule``'s rule, by brute force)."""
        low, high = max(p0, 0), (_POS_END if p1 < 0 else p1)
        recurrent = self._recurrent
        moved_cell = recurrent.seq_cell(seq) if low <= recurrent.seq_pos_max(seq) < high else -1
        last = [-1] * self._n_seq_max   # each sequence's last KV position once moved (below 0: freed)
        for cell in self._kv.cells():
            if cell is not None:
                pos, seqs = cell
                pos = move(pos) if seq in seqs and low <= pos < high else pos
                for s in seqs:
                    last[s] = max(last[s], pos)
        for s in range(self._n_seq_max):
            state = recurrent.seq_pos_max(s)
            if state < 0 or self._kv.seq_pos_max(s) != state:   # (a model without attention layers)
                continue
            if moved_cell >= 0 and recurrent.seq_cell(s) == moved_cell:
                state = move(state)
            if last[s] != state:
                raise engine_error(CAPI_MOVE_RANGE, what=op, seq=seq, pos=p0, prev=p1, need=s, index=last[s], n=state)

    def seq_pos_min(self, seq: int) -> int:
        """The first position ``seq`` holds in both halves (the larger of the two minima; -1: none)."""
        seq = self._seq(seq, "seq_pos_min")
        self._usable("seq_pos_min")
        if self._rule is not None:
            return int(self._rule.seq_pos(seq, False))
        if not self._attn_layers:
            return self._recurrent.seq_pos_min(seq)
        return max(self._kv.seq_pos_min(seq), self._recurrent.seq_pos_min(seq))

    def seq_pos_max(self, seq: int) -> int:
        """The last position ``seq`` holds in both halves (the smaller of the two maxima; -1: none)."""
        seq = self._seq(seq, "seq_pos_max")
        self._usable("seq_pos_max")
        if self._rule is not None:
            return int(self._rule.seq_pos(seq, True))
        if not self._attn_layers:
            return self._recurrent.seq_pos_max(seq)
        return min(self._kv.seq_pos_max(seq), self._recurrent.seq_pos_max(seq))

    def seq_rollback_min(self, seq: int) -> int:
        """The smallest ``p0`` for which ``seq_rm(seq, p0, -1)`` rolls ``seq`` back (both halves);
        as ``RecurrentCache.seq_rollback_min``."""
        return self._recurrent.seq_rollback_min(self._seq(seq, "seq_rollback_min"))

    # -- a sequence's rows ---------------------------------------------------------------------

    def seq_state(self, seq: int) -> HybridSeqState:
        """Copies of everything ``seq`` holds: its KV positions in order and the K and V rows of those
        cells (``[n_attn, n, n_embd_k]`` / ``[n_attn, n, n_embd_v]``, tensors of the cache's storage), and
        its recurrent r and s rows (``RecurrentCache.seq_state``)."""
        seq = self._seq(seq, "seq_state")
        with self._call("seq_state"):
            index = self._kv.seq_cells(seq).astype(np.int64)
            pos = np.array([cell[0] for cell in map(self._kv.cell, index.tolist()) if cell is not None],
                           dtype=np.int32)
            storage, rows = self._storage, self._kv_rows
            k, v = storage.take(rows.k_by_cell, index), storage.take(rows.v_by_cell, index)
            r_rows, s_rows = self._recurrent.seq_state(seq) if self._recurrent.seq_row(seq) >= 0 else ([], [])
        return HybridSeqState(pos, k, v, r_rows, s_rows)

    def seq_restore(self, seq: int, pos: Any, k: Tensor, v: Tensor, r_rows: Sequence[Tensor],
                    s_rows: Sequence[Tensor]) -> None:
        """Give ``seq``, which must hold nothing, these rows: KV cells at positions ``pos`` (1-D) with
        K and V rows ``[n_attn, len(pos), n_embd_*]`` (numpy arrays or tensors of the cache's storage,
        of its dtypes), placed where a ubatch of them would go, and its recurrent state at the last
        position (``RecurrentCache.seq_restore``'s rows).  Everything is checked before anything
        changes: a call that raises (``ArgumentError``, ``SeqIdError``, ``NoFreeCellError``, ...) has
        changed neither half."""
        seq = self._seq(seq, "seq_restore")
        self._usable("seq_restore")   # (before the storage is asked to take the rows)
        positions = _args.int_array(pos, "seq_restore: pos")
        n = positions.size
        if n == 0:
            raise ArgumentError("seq_restore: pos holds no position")
        if n > 1 and bool((positions[1:] < positions[:-1]).any()):   # the state is at the last: the largest
            at = int(np.flatnonzero(positions[1:] < positions[:-1])[0]) + 1
            raise ArgumentError(f"seq_restore: pos must be in increasing order (as seq_state gives them), but "
                                f"pos[{at}] = {int(positions[at])} follows {int(positions[at - 1])}")
        k = self._kv_rows_of("k", k, 0, n)
        v = self._kv_rows_of("v", v, 1, n)
        seqs = np.full(n, seq, dtype=np.int32)
        with self._call("seq_restore"):
            if self.seq_pos_max(seq) >= 0 or self._kv.seq_pos_max(seq) >= 0:
                raise ArgumentError(f"seq_restore: sequence {seq} holds positions: remove it first (seq_rm)")
            tokens = (positions, seqs, np.arange(n + 1, dtype=np.int32))
            slots = self._kv.prepare([tokens]) if self._attn_layers else [np.empty(0, dtype=np.int32)]
            if slots is None:
                raise NoFreeCellError(f"seq_restore: {n} KV cells for sequence {seq} fit nowhere "
                                      f"({self._kv.used} of {self._kv.size} cells used)")
            # checks its rows first: refuses before changing, or breaks (a storage failure)
            with self._breaks_on("seq_restore", BrokenCacheError):
                self._recurrent.seq_restore(seq, int(positions[-1]), r_rows, s_rows)
            if self._attn_layers:
                cells = slots[0].astype(np.int64)
                with self._breaks_on("seq_restore", BaseException):
                    self._kv.apply(slots[0], positions, seqs)
                    self._storage.put(self._kv_rows.k_by_cell, cells, k)
                    self._storage.put(self._kv_rows.v_by_cell, cells, v)
            self._generation += 1

    def _kv_rows_of(self, which: str, rows: Any, kind: int, n: int) -> Tensor:
        """``rows`` checked as ``[n_attn, n, n_embd]`` of the K (kind 0) or V (1) dtype — a numpy array,
        or a tensor of the storage's type — as a new tensor of the storage.  A tensor goes through the
        storage's ``stack`` (as ``RecurrentCache.seq_restore``'s rows do), which refuses one it cannot
        read (sparse, ``meta``) and detaches and moves the others: checked on both paths alike, before
        either half changes."""
        state_type = (self._type_k, self._type_v)[kind]
        shape = (len(self._attn_layers), n, (self._n_embd_k, self._n_embd_v)[kind])
        own = self._kv_tensors[kind]
        dtype = state_type.numpy if isinstance(rows, np.ndarray) else own.dtype
        fits = (isinstance(rows, (np.ndarray, type(own))) and rows.dtype == dtype
                and tuple(rows.shape) == shape)
        if not fits:
            got = (f"{rows.dtype} of shape {tuple(rows.shape)}" if hasattr(rows, "dtype") and hasattr(rows, "shape")
                   else type(rows).__name__)
            raise ArgumentError(f"seq_restore: {which} must be {dtype} of shape {shape}, got {got}")
        if isinstance(rows, np.ndarray):
            return self._storage.from_host(rows, state_type)
        try:
            return self._storage.stack([rows], state_type)[0]
        except ArgumentError as exc:   # the storage names the tensor rows[0]
            raise ArgumentError(f"seq_restore: {which}{str(exc).removeprefix('rows[0]')}") from None

    # -- batches --------------------------------------------------------------------------

    def init_batch(self, batch: Batch, n_ubatch: int = 512, embd_pooled: bool = False,
                   logits_all: bool = False) -> HybridState:
        """Split ``batch`` as the recurrent half must (equal-length ubatches, as ``RecurrentCache``)
        and find every ubatch's cells in both halves.  Raises, changing nothing, for a batch either
        half cannot take; a batch that does not fit gives a state whose status is
        ``FAILED_PREPARE``."""
        guard = self._guard   # (the decode step's hot path: the guard without _call's object)
        guard.enter()
        try:
            if self._broken is not None:   # (a broken recurrent half refuses in its own init_batch)
                raise self._broken_error("init_batch")
            recurrent = self._recurrent.init_batch(batch, n_ubatch, embd_pooled, logits_all)
            plan: KvPlan | None = None
            if recurrent.status is MemoryStatus.SUCCESS:
                # the KV half: each ubatch's cells, found with the ones before placed (the table left as
                # it was), or None when they fit nowhere
                placement = recurrent.placement
                if self._compiled_plan is not None and placement is not None:
                    plan = self._compiled_plan(self._kv, placement)
                else:
                    plan = TokenPlan.prepare(self._kv, recurrent, bool(self._attn_layers))
            status = recurrent.status if plan is not None else MemoryStatus.FAILED_PREPARE
            return HybridState(self, recurrent, plan, status, self._generation, self._apply_both, self._kv_mask)
        finally:
            guard.leave()

    def _apply_both(self, state_generation: int, plan: KvPlan, u: int,
                    apply_recurrent: Callable[[], object]) -> tuple[int, int]:
        """Ubatch ``u`` of a state into the KV half, on the cells ``init_batch`` found, then into the
        recurrent half (``apply_recurrent``): the new generation and the cells to attend to (``n_kv``).
        Raises ``UsageError``, changing nothing, for a stale state; a recurrent half that fails once the
        KV half holds the ubatch (its step scratch not allocated, a storage's error) breaks the memory."""
        guard = self._guard
        guard.enter()
        try:
            if state_generation != self._generation:
                raise UsageError("the cache changed after this state was prepared (a sequence operation, a "
                                 "state_read or another state's apply): call init_batch again")
            n_kv = plan.apply(u, self._kv_pad)
            self._generation += 1
            try:   # (the decode step's: a bare try costs ~0.2 us less than the _Breaks bracket)
                apply_recurrent()
            except BaseException as failure:
                self._break("apply", failure)
            return self._generation, n_kv
        finally:
            guard.leave()

    def _kv_mask(self, tokens: KvTokens, n_kv: int, sliding: bool) -> np.ndarray:
        pos, flat, offsets = tokens
        out = np.empty((pos.size, n_kv), dtype=np.float32)
        self._kv.mask(pos, seq_lists(flat, offsets), out, sliding)
        return out

    # -- state bytes (docs/hybrid.md, "State bytes") ----------------------------------------------

    def state_write(self, seq_id: int = -1, framing: str = "bare", arch: str | None = None, *,
                    partial_only: bool = False) -> bytes:
        """The state of the whole memory (``seq_id = -1``) or of one sequence, as llama.cpp's hybrid
        memory writes it: the attention KV section, then the recurrent section.  ``framing`` and
        ``arch`` as ``RecurrentCache.state_write``.  ``partial_only``: the recurrent section alone
        (llama.cpp's ``LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY``, what its context checkpoints keep)."""
        seq_id = state_seq_id(seq_id, self._n_seq_max, "state_write")
        partial = as_flag(partial_only, "state_write: partial_only")
        prefix = framing_prefix(framing, seq_id, arch)
        with self._call("state_write"):
            return prefix + self._bytes.write(seq_id, partial)

    def state_size(self, seq_id: int = -1, framing: str = "bare", arch: str | None = None, *,
                   partial_only: bool = False) -> int:
        """Length in bytes of ``state_write`` with the same arguments."""
        return len(self.state_write(seq_id, framing, arch, partial_only=partial_only))

    def state_write_into(self, target: object, seq_id: int = -1, framing: str = "bare", arch: str | None = None, *,
                         partial_only: bool = False) -> int:
        """Write ``state_write(...)`` with the same arguments into ``target``: a writable C-contiguous
        buffer of at least that many bytes (filled from its start; refused, ``ArgumentError``, when it
        shares a byte with any tensor of this cache — K, V, the recurrent rows, their history and
        scratch — on either path), or a binary file object (written at its position).  Returns the
        bytes written."""
        return self._bytes.write_into(target, self.state_write(seq_id, framing, arch, partial_only=partial_only))

    def seq_state_bound(self) -> int:
        """The most bytes one sequence's state (``state_write(seq)``) can take: every KV cell held, with
        its cell header, and the recurrent section; what ``load_seq_file`` reads no further than."""
        return self._bytes.seq_bound()

    def state_bound(self) -> int:
        """The most bytes the whole memory's state (``state_write()``) can take: every KV cell held by
        every sequence, every recurrent cell; what ``load_session_file`` reads no further than."""
        return self._bytes.bound()

    def state_read(self, data: object, seq_id: int = -1, arch: str | None = None, *, framing: str | None = None,
                   partial_only: bool = False, kv_cell_ext: bool | None = None, n_tokens: int | None = None) -> int:
        """Restore a hybrid state in any framing llama.cpp or this package writes (found from the
        bytes, as ``RecurrentCache.state_read``); returns its length.  The KV section is found
        without being told: a hybrid memory's state has one (``partial_only``: none, the recurrent
        section alone, which leaves the KV half as it is).  Either V layout is read.

        ``seq_id = -1`` replaces the whole memory; ``seq_id >= 0`` replaces that sequence in both
        halves (its KV cells go where a ubatch of them would).  Everything is checked before either
        half changes: a ``StateError`` (or ``NoFreeCellError`` when the sequence's cells fit nowhere)
        leaves both exactly as they were.  ``n_tokens`` (one sequence): the state must be that of a
        prefix of ``n_tokens`` tokens — KV cells at exactly positions ``0 .. n_tokens - 1`` and the
        recurrent state at the last — else ``StateError`` (a prefix store's entry that is not one)."""
        seq_id = state_seq_id(seq_id, self._n_seq_max, "state_read")
        self._usable("state_read")   # a broken memory refuses before reading a byte
        partial = as_flag(partial_only, "state_read: partial_only")
        if n_tokens is not None:
            if seq_id < 0:
                raise ArgumentError("state_read: n_tokens is for the state of one sequence (seq_id >= 0)")
            n_tokens = _args.in_range(n_tokens, "state_read: n_tokens", 1, POS_MAX + 1)
        state = self._bytes.checked(data, seq_id, arch, framing, partial, kv_cell_ext, n_tokens)
        with self._call("state_read"):
            # NoFreeCellError: nothing changed; then a half changes
            cells = self._bytes.place_kv(state.load, seq_id) if state.load is not None else None
            with self._breaks_on("state_read", BaseException):
                self._bytes.fill(state, cells, seq_id)
            self._generation += 1
        return state.length

    def __repr__(self) -> str:
        return (f"HybridCache(n_layer={self.n_layer}, attn_layers={self._attn_layers}, "
                f"recr_layers={self.recr_layers}, kv_size={self.kv_size}, n_seq_max={self._n_seq_max}, "
                f"kv_used={self._kv.used}, engine={self.engine!r})")
