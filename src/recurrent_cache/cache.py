"""`RecurrentCache`: the one facade over the two engines.

This module owns every argument check, their order, every message and the
default positions; an *engine* (``_engines``) owns the memory core — the one
owner of the cells, the state rows, the rollback history and the change counter —
and the loops: the compiled core (``_core`` over ``_cells``, ``_split``,
``_placement``, ``_state_io``) or the pure-Python reference
(``recurrent_cache.reference``).  A rejected call raises before the engine is
touched, so the cache is left exactly as it was.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import IO, Any, Literal, NamedTuple, cast

import numpy as np

from . import _engines
from . import _args
from ._args import as_flag, as_int, state_seq_id
from .batch import Batch
from .errors import (POS_MAX, SEQ_RANGE, ArgumentError, ConfigError, CoreError, OutOfRangeError, PositionError,
                     StateError, engine_error)
from .memory_state import MemoryState, MemoryStatus, RowViews, ThreadGuard
from .storage import Storage, Tensor, allocating, has_host_access, storage_for
from .formats.blob import blob_view, framing_prefix
from .formats.files import read_file
from .formats.framings import Framing, in_section, unframe
from .formats.geometry import Geometry
from .formats.messages import target_aliases_cache, target_too_small
from .formats.streams import target_view, write_all

__all__ = ["CellInfo", "RecurrentCache"]


class CellInfo(NamedTuple):
    """One entry of the cell table (``cache.cell(i)``), llama.cpp's ``kv_cell`` plus its tail."""

    pos: int                   # the last position the cell's state has seen; -1: an empty cell
    src: int                   # the row holding the cell's state: itself, the row it was forked
                               # from until a ubatch runs on it, -1 for none yet (zeros)
    holder_of_seq: int         # the cell holding *sequence* i (llama.cpp's tail[i], kept in the
                               # table by index): -1 when sequence i holds none.  Not a field of cell i
    seq_ids: tuple[int, ...]   # the sequences sharing this cell's state, sorted


class RecurrentCache:
    """Recurrent-state cache for Mamba / RWKV-style models (llama.cpp's
    ``llama_kv_cache_recurrent``).

    ``size`` cells (default ``max(1, n_seq_max)``) each hold the state of one
    sequence, or of several sequences that share it after a fork.  Per layer
    ``il`` the states live in ``r[il]`` (size, n_embd_r) — the rolling state,
    Mamba's conv window — and ``s[il]`` (size, n_embd_s) — the SSM / WKV state;
    ``n_embd_s = 0`` for a model with a conv state only (LFM2's short convolution:
    rows of no values, written in state bytes as llama.cpp writes them, a row size of 0).
    Row ``c`` belongs to cell ``c``.  The arrays are allocated once and never
    reallocated, so views of them stay valid for the cache's lifetime.

    dtype_r / dtype_s: ``"f32"``, ``"f16"`` or ``"bf16"`` (a
    ``ml_dtypes.bfloat16`` array when ml_dtypes is installed, else raw
    ``uint16`` bits: the upper half of each float32).

    n_rollback: how many past states each cell keeps for rollback (speculative
    decoding, docs/rollback.md): ``seq_rm(seq, p0, -1)`` then returns the sequence to its
    state after ``p0 - 1`` when that state is held.  ``n_rollback > 0`` is the
    model's promise to write the states after each token but the last of every
    ubatch into ``st.r_steps(il)`` / ``st.s_steps(il)`` (the cache cannot tell
    whether it did); it costs ``n_rollback`` rows of every tensor per cell.
    ``0`` (the default) is llama.cpp's cache exactly, with no extra memory or work.

    layers: the layers that hold recurrent state (a hybrid model's Mamba / RWKV
    layers; llama.cpp's layer filter): distinct indices in ``[0, n_layer)``, any
    order, kept sorted in ``cache.layers``; default None: every layer.  For any
    other layer ``r[il]`` and ``s[il]`` are None and nothing is allocated (rows,
    rollback history, step scratch); ``()`` keeps no state at all (only positions
    move).  State bytes keep ``n_layer`` = the model's layer count and hold the
    r, then the s, sections of these layers only (SPEC §5), as llama.cpp writes them.

    engine: ``"compiled"`` (the Cython core) or ``"reference"`` (pure Python,
    the readable oracle; thousands of times slower); default: the environment
    variable ``RECURRENT_CACHE_IMPL``, else ``"compiled"``.

    One thread at a time: a call while another thread is inside the same cache
    raises ``UsageError`` instead of corrupting it.
    """

    def __init__(self, n_layer: int, n_embd_r: int, n_embd_s: int, n_seq_max: int = 1,
                 size: int | None = None, dtype_r: str = "f32", dtype_s: str = "f32",
                 n_rollback: int = 0, *, engine: Literal["compiled", "reference"] | None = None,
                 layers: Iterable[int] | None = None, storage: str | Storage = "numpy",
                 device: Any = None) -> None:
        self._n_seq_max = _args.count(n_seq_max, "n_seq_max", 0, ConfigError)
        self._geometry = Geometry.checked(ConfigError, n_layer, n_embd_r, n_embd_s, dtype_r, dtype_s,
                                          max(1, self._n_seq_max) if size is None else size, layers)
        self._n_rollback = _args.count(n_rollback, "n_rollback")
        self._engine = _engines.load(engine)
        self._storage = storage_for(storage, device)
        # the states, the engine's cell table and rollback history: a cache too big to allocate is a
        # ConfigError
        with allocating(f"the cache (size={self._geometry.size}: {self._geometry.cache_bytes(self._n_rollback)} bytes "
                        f"of states with n_rollback={self._n_rollback}) on {self._storage!r}"):
            kinds = self._tensors = self._geometry.allocate(self._storage)
            self._core, self._split = self._engine.build(self._geometry.size, self._storage, kinds,
                                                         (self._geometry.type_r, self._geometry.type_s),
                                                         self._n_rollback, list(self._geometry.type_ids),
                                                         self._geometry.n_layer, self._geometry.state_layers)
        # whether the engine moves the rows in host memory (then rows it is given are made numpy first)
        self._host_rows = has_host_access(self._storage)
        placed_r: list[Any] = [None] * self._geometry.n_layer
        placed_s: list[Any] = [None] * self._geometry.n_layer
        for k, il in enumerate(self._geometry.state_layers):
            placed_r[il], placed_s[il] = kinds[0][k], kinds[1][k]
        # r[il] / s[il] of a layer without state is None (tuples of n_layer entries either way)
        self.r: tuple[Any, ...] = tuple(placed_r)
        self.s: tuple[Any, ...] = tuple(placed_s)
        self._guard = ThreadGuard()
        self._views = RowViews()

    @property
    def tensors(self) -> tuple[Tensor, Tensor]:
        """The state tensors of the cache's storage: r ``[n_state, size, n_embd_r]`` and s
        ``[n_state, size, n_embd_s]``, ``n_state = len(layers)``; ``r[il]`` is ``tensors[0][k]`` for the
        k-th layer with state.  A kernel that takes state indices reads and writes these by row."""
        return self._tensors

    @property
    def storage(self) -> Storage:
        """Where the state tensors live (``recurrent_cache.storage``): numpy, or torch on a device."""
        return self._storage

    # -- one thread at a time ----------------------------------------------------------

    def _enter(self) -> None:
        self._guard.enter()

    def _leave(self) -> None:
        self._guard.leave()

    # -- rollback history (docs/rollback.md) -----------------------------------------------------

    @property
    def n_rollback(self) -> int:
        """Past states each cell keeps for rollback (docs/rollback.md); 0: none."""
        return self._n_rollback

    def seq_rollback_min(self, seq: int) -> int:
        """The smallest position ``q`` that ``seq_rm(seq, q + 1, -1)`` can roll ``seq`` back to, or -1."""
        seq = as_int(seq, "seq")
        self._enter()
        try:
            return self._core.rollback_min(seq)
        finally:
            self._leave()

    # -- shape -------------------------------------------------------------------------

    @property
    def size(self) -> int:
        """Number of cells."""
        return self._geometry.size

    @property
    def n_seq_max(self) -> int:
        """Sequences the cache was sized for."""
        return self._n_seq_max

    @property
    def n_layer(self) -> int:
        """Layers (pairs of state tensors)."""
        return self._geometry.n_layer

    @property
    def layers(self) -> tuple[int, ...]:
        """The layers that hold recurrent state, sorted (every layer unless filtered)."""
        return self._geometry.state_layers

    @property
    def n_embd_r(self) -> int:
        """Width of an r row."""
        return self._geometry.n_embd_r

    @property
    def n_embd_s(self) -> int:
        """Width of an s row."""
        return self._geometry.n_embd_s

    @property
    def dtype_r(self) -> str:
        """Element type of r: ``"f32"``, ``"f16"`` or ``"bf16"``."""
        return self._geometry.dtype_r

    @property
    def dtype_s(self) -> str:
        """Element type of s."""
        return self._geometry.dtype_s

    @property
    def engine(self) -> str:
        """``"compiled"`` or ``"reference"``."""
        return self._engine.name

    @property
    def memory_core(self) -> _engines.Core:
        """The engine's memory core: the one owner of this cache's cells, rows, rollback history and
        change counter.  The C API (``rc_ctx_new``) drives the compiled one; not for Python callers,
        which use this facade (a change made through the core directly skips every argument check)."""
        return self._core

    @property
    def cell_table(self) -> object:
        """Deprecated (``recurrent_cache.core``): the compiled engine's memory core, for Cython code."""
        if self._engine.name != "compiled":
            raise ArgumentError("cell_table is the compiled engine's C-level handle; this cache runs "
                                "on the reference engine")
        if not self._host_rows:
            raise ArgumentError(f"cell_table hands out pointers to host rows; this cache's storage is "
                                f"{self._storage!r}")
        return self._core

    @property
    def head(self) -> int:
        """Where the next free-cell search starts / first cell of the last placement."""
        return int(self._core.head)

    @property
    def used(self) -> int:
        """Number of non-empty cells."""
        return int(self._core.used)

    @property
    def n(self) -> int:
        """Cells from head touched by the last placement."""
        return int(self._core.n)

    # -- cells -------------------------------------------------------------------------

    def cell(self, i: int) -> CellInfo:
        """Cell ``i`` of the cell table, as a ``CellInfo`` (a named tuple: ``pos, src, holder_of_seq,
        seq_ids``); ``holder_of_seq`` is per *sequence* ``i``, not per cell (see ``CellInfo``)."""
        i = _args.index(i, "cell index", self.size, OutOfRangeError)
        self._enter()
        try:
            return CellInfo(*self._core.cell(i))
        finally:
            self._leave()

    def check(self) -> None:
        """Raise ``CoreError`` if an invariant of docs/concepts.md §1 is broken (O(size))."""
        self._enter()
        try:
            broken = self._core.check()
        finally:
            self._leave()
        if broken is not None:
            raise CoreError(f"invariant broken: {broken}")

    # -- sequence operations -------------------------------------------------------------

    def clear(self) -> None:
        """Empty every cell and zero every state row."""
        self._enter()
        try:
            self._core.clear()
        finally:
            self._leave()

    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> bool:
        """Drop ``seq`` (every sequence when ``seq < 0``) from positions ``[p0, p1)``.

        A recurrent state cannot be cut: returns False, changing nothing, when
        the range would split a state (or for ``seq >= size``) — except with
        ``n_rollback > 0``: ``seq_rm(seq, p0, -1)`` with ``0 < p0 <= pos`` rolls
        ``seq`` back to its state after ``p0 - 1`` when its cell holds that state
        (a sequence sharing its cell first gets a cell of its own) and returns True.
        """
        seq, p0, p1 = as_int(seq, "seq"), as_int(p0, "p0"), as_int(p1, "p1")
        self._enter()
        try:
            return self._core.seq_rm(seq, p0, p1)
        finally:
            self._leave()

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        """Make ``dst`` share ``src``'s cell (a fork); the range is ignored.

        A no-op when ``src == dst`` or either is outside ``[0, size)``, as in llama.cpp.
        """
        src, dst = as_int(src, "src"), as_int(dst, "dst")
        as_int(p0, "p0"), as_int(p1, "p1")
        self._enter()
        try:
            self._core.seq_cp(src, dst)
        finally:
            self._leave()

    def _seq_op(self, op: str, code: int, seq: int, what: str) -> None:
        if code:
            raise engine_error(code, what=f"{op}: {what}", seq=seq, size=self.size)

    def seq_keep(self, seq: int) -> None:
        """Free every cell that does not hold ``seq``; its cell keeps only ``seq``.

        A ``seq`` outside ``[0, size)`` raises ``SeqIdError`` (llama.cpp would
        empty every cell).
        """
        seq = as_int(seq, "seq")
        self._enter()
        try:
            self._seq_op("seq_keep", self._core.seq_keep(seq), seq, f"seq_id {seq}")
        finally:
            self._leave()

    def seq_add(self, seq: int, p0: int, p1: int, shift: int) -> None:
        """Shift the pos of ``seq``'s cell by ``shift`` if it lies in ``[p0, p1)``.

        The pos is the cell's, so sequences sharing the cell move with it.
        """
        seq, p0, p1, shift = as_int(seq, "seq"), as_int(p0, "p0"), as_int(p1, "p1"), as_int(shift, "shift")
        self._enter()
        try:
            self._seq_op("seq_add", self._core.seq_add(seq, p0, p1, shift), seq,
                         f"seq_id {seq} at pos {self._core.seq_pos_max(seq)} shifted by {shift}")
        finally:
            self._leave()

    def seq_div(self, seq: int, p0: int, p1: int, d: int) -> None:
        """Divide the pos of ``seq``'s cell by ``d`` (truncating) if it lies in ``[p0, p1)``; ``d >= 1``."""
        seq, p0, p1, d = as_int(seq, "seq"), as_int(p0, "p0"), as_int(p1, "p1"), as_int(d, "d")
        self._enter()
        try:
            self._seq_op("seq_div", self._core.seq_div(seq, p0, p1, d), seq,
                         f"seq_id {seq} divided by d = {d} (d must be positive)")
        finally:
            self._leave()

    def seq_pos_min(self, seq: int) -> int:
        """Smallest pos of ``seq``'s cells; -1 when it has none."""
        seq = as_int(seq, "seq")
        self._enter()
        try:
            return int(self._core.seq_pos_min(seq))
        finally:
            self._leave()

    def seq_pos_max(self, seq: int) -> int:
        """Largest pos of ``seq``'s cells; -1 when it has none."""
        seq = as_int(seq, "seq")
        self._enter()
        try:
            return int(self._core.seq_pos_max(seq))
        finally:
            self._leave()

    def seq_cell(self, seq: int) -> int:
        """The cell holding ``seq`` (its row in ``r[il]`` / ``s[il]``, once a ubatch or a restore
        has filled it), or -1 when it holds none.  O(1)."""
        seq = as_int(seq, "seq")
        if not 0 <= seq < self.size:
            raise engine_error(SEQ_RANGE, what=f"seq_cell: seq_id {seq}", seq=seq, size=self.size)
        self._enter()
        try:
            return self._core.seq_cell(seq)
        finally:
            self._leave()

    def seq_row(self, seq: int) -> int:
        """The row of ``r[il]`` / ``s[il]`` holding ``seq``'s state: its cell's ``src`` — the cell
        itself once a ubatch ran on it, the row it was forked from before that — or -1 when it
        holds no cell or its cell has no state yet.  O(1)."""
        cell = self.seq_cell(seq)
        if cell < 0:
            return -1
        self._enter()
        try:
            return self._core.cell(cell)[1]
        finally:
            self._leave()

    def seq_state(self, seq: int) -> tuple[list[Tensor], list[Tensor]]:
        """Copies of ``seq``'s state: its r rows and s rows, one per layer with state (``layers``,
        in layer order; every layer unless filtered) — zeros while its cell has no state yet (it
        was placed by a fork and no ubatch has run since).  The lists skip the layers without
        state rather than hold None for them: they are what ``seq_restore`` takes, what a
        snapshot stores and what a blob holds, section for section.

        Raises ``ArgumentError`` when ``seq`` holds no cell (there is no state).
        """
        seq = as_int(seq, "seq")
        if not 0 <= seq < self.size:
            raise engine_error(SEQ_RANGE, what=f"seq_state: seq_id {seq}", seq=seq, size=self.size)
        self._enter()
        try:
            cell = self._core.seq_cell(seq)
            if cell < 0:
                raise ArgumentError(f"seq_state: sequence {seq} holds no cell, so it has no state")
            src = self._core.cell(cell)[1]   # the row its data lives in; -1: none yet
            kinds = [self._storage.take(tensor, np.array([src])) if src >= 0
                     else self._storage.allocate((tensor.shape[0], 1, tensor.shape[2]), dtype)
                     for tensor, dtype in zip(self.tensors, (self._geometry.type_r, self._geometry.type_s))]
            return ([kinds[0][k, 0] for k in range(len(self.layers))],
                    [kinds[1][k, 0] for k in range(len(self.layers))])
        finally:
            self._leave()

    def seq_restore(self, seq: int, pos: int, r_rows: Sequence[Tensor], s_rows: Sequence[Tensor]) -> int:
        """Give ``seq``, which must hold no cell, a cell of its own at position ``pos`` holding
        exactly these rows (byte for byte): ``r_rows[k]`` / ``s_rows[k]``, one per layer with state
        (the k-th of ``layers``, as ``seq_state`` returns them), each a 1-D row of ``n_embd_r`` /
        ``n_embd_s`` values of the tensor's dtype: a numpy array, or a tensor of the cache's
        storage (a torch cache takes torch rows from any device, copies them to its own and
        detaches them; a sparse or ``meta`` row is refused).  The cell keeps no
        rollback history (another sequence's past is not this one's).  Returns the cell.

        Placed as ``state_read`` of a one-cell blob would place it (a sequence without a cell
        always finds a free one: seq ids are < size).  Every row, ``seq`` and ``pos`` are
        checked before anything changes: a call that raises (``ArgumentError``,
        ``SeqIdError``, ``PositionError``) has changed nothing.
        """
        seq, pos = as_int(seq, "seq"), as_int(pos, "pos")
        rows = self._rows_of("r", r_rows, "r") + self._rows_of("s", s_rows, "s")
        self._enter()
        try:
            cell = self._core.restore(seq, pos, rows)
        finally:
            self._leave()
        if cell < 0:
            raise engine_error(cell, what=f"seq_restore of seq_id {seq} at pos {pos}", seq=seq, size=self.size)
        return cell

    def _rows_of(self, which: str, given: Sequence[Tensor], kind: str) -> list[Tensor]:
        """``given`` checked as one row per layer with state of the ``kind`` tensors' dtype and width:
        numpy arrays (made C-contiguous) or tensors of the storage's type.  Tensor rows are stacked
        by the storage first, which refuses one it cannot read and detaches and moves the others, so
        that both paths check the same and a bad row changes nothing; a host storage's core then
        copies host bytes."""
        tensors = [t for t in (self.r if kind == "r" else self.s) if t is not None]
        dtype = self._geometry.type_r if kind == "r" else self._geometry.type_s
        width = self.n_embd_r if kind == "r" else self.n_embd_s
        if isinstance(given, (str, bytes)) or not isinstance(given, Sequence) or len(given) != len(tensors):
            raise ArgumentError(f"seq_restore: {which}_rows must be a sequence of {len(tensors)} rows "
                                f"(one per layer with state), got {type(given).__name__}"
                                + (f" of {len(given)}" if isinstance(given, Sequence) else ""))
        rows = list(given)
        for il, (row, tensor) in enumerate(zip(rows, tensors)):
            if isinstance(row, np.ndarray):
                fits = row.dtype == dtype.numpy and row.shape == (width,)
            else:
                fits = isinstance(row, type(tensor)) and row.dtype == tensor.dtype and tuple(row.shape) == (width,)
            if not fits:
                got = (f"{row.dtype} array of shape {tuple(row.shape)}" if hasattr(row, "dtype")
                       and hasattr(row, "shape") else type(row).__name__)
                raise ArgumentError(f"seq_restore: {which}_rows[{il}] must be a {tensor.dtype} array of shape "
                                    f"{(width,)}, got a {got}")
        if all(isinstance(row, np.ndarray) for row in rows):
            return [np.ascontiguousarray(row) for row in rows]
        try:
            stacked = self._storage.stack(rows, dtype)
        except ArgumentError as exc:   # the storage names the row as rows[k]
            raise ArgumentError(f"seq_restore: {which}_{exc}") from None
        if self._host_rows:
            stacked = self._storage.to_host(stacked)
        return [stacked[k] for k in range(len(rows))]

    # -- batches -------------------------------------------------------------------------

    def init_batch(self, batch: Batch, n_ubatch: int = 512, embd_pooled: bool = False,
                   logits_all: bool = False) -> MemoryState:
        """Validate and split ``batch`` into ubatches, and check that all of them fit.

        Raises (changing nothing) for a batch this cache cannot take; returns a
        ``MemoryState`` to ``apply()`` ubatch by ubatch, or to iterate over.
        ``embd_pooled`` splits one sequence per ubatch (``split_seq``);
        ``logits_all`` makes every token an output.
        """
        if not isinstance(batch, Batch):
            raise ArgumentError(f"init_batch takes a Batch, got {type(batch).__name__}")
        if type(n_ubatch) is not int:   # the common case skips the general checks
            n_ubatch = as_int(n_ubatch, "n_ubatch")
        if not 1 <= n_ubatch < 2**31:
            raise ArgumentError(f"n_ubatch must be in [1, 2**31), got {n_ubatch}")
        pooled = embd_pooled if embd_pooled is False else as_flag(embd_pooled, "embd_pooled")
        every = logits_all if logits_all is False else as_flag(logits_all, "logits_all")
        self._enter()
        try:
            pos = batch.pos if batch.pos is not None else self._default_positions(batch)
            placement = self._split(batch.seq_id_flat, batch.seq_id_offset, pos, batch.logits, every, n_ubatch,
                                    pooled)
            status = MemoryStatus.SUCCESS if placement.prepare() == 0 else MemoryStatus.FAILED_PREPARE
        finally:
            self._leave()
        return MemoryState(self, self._core, self._guard, self._views, placement, batch, pos, status)

    def _default_positions(self, batch: Batch) -> np.ndarray:
        """llama_decode's defaults: each token continues its first sequence (seq_pos_max + 1, ...)."""
        owners = batch.seq_id_flat[batch.seq_id_offset[:-1]]
        order = np.argsort(owners, kind="stable")
        ranked = owners[order]
        starts = np.flatnonzero(np.r_[True, ranked[1:] != ranked[:-1]])
        counts = np.diff(np.r_[starts, ranked.size])
        pos = np.empty(batch.n_tokens, dtype=np.int64)
        for first, count in zip(starts.tolist(), counts.tolist()):
            seq = int(ranked[first])
            # an owner out of range keeps position 0: the split reports its seq id
            base = self._core.seq_pos_max(seq) + 1 if 0 <= seq < self.size else 0
            pos[order[first:first + count]] = base + np.arange(count)
        if pos.size and pos.max() >= POS_MAX:
            raise PositionError(f"default positions of sequence {int(owners[int(pos.argmax())])} reach "
                                f"{int(pos.max())}: positions must be < 2**31 - 1")
        return pos.astype(np.int32)

    def init_full(self) -> MemoryState:
        """A state covering the whole cache (``head = 0``, ``n_kv = size``)."""
        return MemoryState(self, self._core, self._guard, self._views, None, None, None, MemoryStatus.SUCCESS)

    # -- state serialisation (docs/concepts.md §5) ---------------------------------------------------

    def state_size(self, seq_id: int = -1, framing: str = "bare", arch: str | None = None) -> int:
        """Length in bytes of ``state_write(seq_id, framing, arch)``."""
        seq_id = state_seq_id(seq_id, self.size, "state_size")
        prefix = framing_prefix(framing, seq_id, arch)
        self._enter()
        try:
            return len(prefix) + self._core.state_size(seq_id)
        finally:
            self._leave()

    def state_write(self, seq_id: int = -1, framing: str = "bare", arch: str | None = None) -> bytes:
        """The state of the whole cache (``seq_id = -1``) or of one sequence, as llama.cpp writes it.

        ``framing="bare"`` (the default) is the memory section alone, what
        llama.cpp's recurrent memory writes; ``framing="llama"`` is what
        current llama.cpp's context writes: ``llama_state_seq_get_data``'s
        header (magic, ``seq_id``) before a sequence's section,
        ``llama_state_get_data``'s architecture string ``arch`` (the model's,
        e.g. ``"mamba"``) before the whole cache's.  Raises ``SeqIdError`` for a
        ``seq_id`` outside ``[-1, size)`` (llama.cpp would write an empty blob).
        """
        seq_id = state_seq_id(seq_id, self.size, "state_write")
        prefix = framing_prefix(framing, seq_id, arch)
        self._enter()
        try:
            section = self._core.state_write_bytes(seq_id)
        finally:
            self._leave()
        return prefix + section if prefix else section

    def state_write_into(self, target: object, seq_id: int = -1, framing: str = "bare",
                         arch: str | None = None) -> int:
        """Write ``state_write(seq_id, framing, arch)`` into ``target``; returns the bytes written.

        ``target`` is a writable C-contiguous buffer (bytearray, memoryview,
        numpy array, mmap) of at least ``state_size(seq_id, framing, arch)``
        bytes, filled from its start, or a binary file object, written at its
        position.  Rows go from the state tensors to the target with no
        intermediate copy.
        """
        seq_id = state_seq_id(seq_id, self.size, "state_write_into")
        prefix = framing_prefix(framing, seq_id, arch)
        view = target_view(target)
        self._enter()
        try:
            if view is None:
                write_all(target, prefix)
                return len(prefix) + self._core.state_write_file(cast("IO[bytes]", target), seq_id)
            if not prefix:
                return self._core.state_write_into(view, seq_id)
            needed = len(prefix) + self._core.state_size(seq_id)
            if len(view) < needed:
                raise target_too_small(len(view), needed)
            if self._core.aliases(view):   # the prefix's bytes too, not only the section's the core checks
                raise target_aliases_cache()
            written = self._core.state_write_into(view[len(prefix):], seq_id)
        finally:
            self._leave()
        view[:len(prefix)] = prefix
        return len(prefix) + written

    def state_read(self, data: object, seq_id: int = -1, arch: str | None = None, *,
                   kv_section: bool = False, framing: str | None = None, kv_cell_ext: bool | None = None) -> int:
        """Restore a state in any framing llama.cpp or this package writes; returns its length.

        ``data`` (any bytes-like object) is a bare memory section, a
        ``llama_state_seq_get_data`` blob, a ``llama_state_get_data`` blob
        (its architecture name must be ``arch`` when given), June-2025
        llama.cpp's ``llama_state_get_data`` blob (an output block after the name), or
        a 'ggsq' / 'ggsn' file's bytes (the tokens are not kept: see
        ``load_seq_file``); the framing is found from the bytes, and a blob
        that two framings read whole is refused (docs/llamacpp_formats.md).
        ``kv_section=True``: the state is a hybrid model's, whose memory begins
        with the attention KV section, which is checked and skipped (the bytes
        cannot say so themselves); ``kv_cell_ext`` says whether its cells carry
        the 12-byte extended position (None: found from the bytes).
        ``framing`` skips the detection: "bare" (``data`` is a memory section),
        "llama" (current llama.cpp's framing) or "llama-june-2025".

        ``seq_id = -1`` replaces the whole cache; ``seq_id >= 0`` replaces that
        sequence with the blob's one cell (a 0-cell blob just removes it).  The
        whole blob is checked first: a ``StateError`` naming the defect and its
        byte offset leaves the cache, cells and rows, exactly as it was.
        """
        seq_id = state_seq_id(seq_id, self.size, "state_read")
        kv_section = as_flag(kv_section, "state_read: kv_section")
        unframed = unframe(data, seq_id, arch, kv_section, framing=framing, cache=self._geometry,
                           kv_cell_ext=kv_cell_ext)
        self._read_section(unframed.section, seq_id, unframed.framing)
        return unframed.framing.section_offset + len(unframed.section)

    def _read_section(self, section: memoryview, seq_id: int, framing: Framing) -> None:
        """Restore a bare memory section (the core's bytes) found in ``framing``."""
        self._enter()
        try:
            self._core.state_read(section, seq_id)   # the blob carries no history: the core forgets it
        except StateError as exc:
            raise in_section(exc, framing) from None
        finally:
            self._leave()

    def state_read_from(self, file: object, seq_id: int = -1, arch: str | None = None, *,
                        kv_section: bool = False, framing: str | None = None, kv_cell_ext: bool | None = None) -> int:
        """``state_read`` of everything from a binary file's position to its end (the same framings,
        ``framing`` and ``kv_cell_ext``)."""
        seq_id = state_seq_id(seq_id, self.size, "state_read_from")
        kv_section = as_flag(kv_section, "state_read_from: kv_section")
        # bounded by this cache's state size, and checked as state_read checks the bytes
        contents = read_file(file, "state_read_from", self._geometry, seq_id, sequence_file=None, arch=arch,
                             kv_section=kv_section, framing=framing, kv_cell_ext=kv_cell_ext)
        self._read_section(blob_view(contents.data), seq_id, contents.framing)
        return contents.blob_offset + len(contents.data)

    def __repr__(self) -> str:
        return (f"RecurrentCache(size={self.size}, used={self.used}, head={self.head}, "
                f"n_layer={self.n_layer}, n_embd_r={self.n_embd_r}, n_embd_s={self.n_embd_s}, "
                f"dtype_r={self.dtype_r!r}, dtype_s={self.dtype_s!r}, engine={self.engine!r}"
                + (f", layers={self.layers!r})" if len(self.layers) != self.n_layer else ")"))

