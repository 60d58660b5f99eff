"""`RecurrentCache`: the one facade over the two engines.

This module owns every argument check, their order, every message and the
default positions; an *engine* (``_engines``) owns the cell table, the loops and
the state tensors' pointers: the compiled core (``_cells``, ``_split``,
``_placement``, ``_state_io``) or the pure-Python reference
(``recurrent_cache.reference``).  A rejected call raises before the engine is
touched, so the cache is left exactly as it was.
"""

from __future__ import annotations

import threading
from typing import Literal

import numpy as np

from . import _engines
from . import _args
from ._args import as_flag, as_int, state_seq_id
from ._config import Config
from .batch import Batch
from .errors import (POS_MAX, ArgumentError, CoreError, OutOfRangeError, PositionError, UsageError,
                     engine_error)
from .memory_state import MemoryState, MemoryStatus
from .state_format import Geometry, blob_view, read_rest, target_view

__all__ = ["RecurrentCache"]


class RecurrentCache:
    """Recurrent-state cache for Mamba / RWKV-style models (llama.cpp's
    ``llama_kv_cache_recurrent``).

    ``size`` cells (default ``max(1, n_seq_max)``) each hold the state of one
    sequence, or of several sequences that share it after a fork.  Per layer
    ``il`` the states live in ``r[il]`` (size, n_embd_r) — the rolling state,
    Mamba's conv window — and ``s[il]`` (size, n_embd_s) — the SSM / WKV state.
    Row ``c`` belongs to cell ``c``.  The arrays are allocated once and never
    reallocated, so views of them stay valid for the cache's lifetime.

    dtype_r / dtype_s: ``"f32"``, ``"f16"`` or ``"bf16"`` (a
    ``ml_dtypes.bfloat16`` array when ml_dtypes is installed, else raw
    ``uint16`` bits: the upper half of each float32).

    n_rollback: how many past states each cell keeps for rollback (speculative
    decoding, SPEC §7): ``seq_rm(seq, p0, -1)`` then returns the sequence to its
    state after ``p0 - 1`` when that state is held.  ``n_rollback > 0`` is the
    model's promise to write the states after each token but the last of every
    ubatch into ``st.r_steps(il)`` / ``st.s_steps(il)`` (the cache cannot tell
    whether it did); it costs ``n_rollback`` rows of every tensor per cell.
    ``0`` (the default) is llama.cpp's cache exactly, with no extra memory or work.

    engine: ``"compiled"`` (the Cython core) or ``"reference"`` (pure Python,
    the readable oracle; thousands of times slower); default: the environment
    variable ``RECURRENT_CACHE_IMPL``, else ``"compiled"``.

    One thread at a time: a call while another thread is inside the same cache
    raises ``UsageError`` instead of corrupting it.
    """

    def __init__(self, n_layer: int, n_embd_r: int, n_embd_s: int, n_seq_max: int = 1,
                 size: int | None = None, dtype_r: str = "f32", dtype_s: str = "f32",
                 n_rollback: int = 0, *, engine: Literal["compiled", "reference"] | None = None) -> None:
        self._config = Config.check(n_layer, n_embd_r, n_embd_s, n_seq_max, size, dtype_r, dtype_s)
        self._n_rollback = _args.count(n_rollback, "n_rollback")
        self._engine = _engines.load(engine)
        r, s = self._config.allocate()
        self.r: tuple[np.ndarray, ...] = tuple(r)
        self.s: tuple[np.ndarray, ...] = tuple(s)
        size_ = self._config.size
        if self._n_rollback:
            # history[k][c, q % n_rollback]: the state after position q of cell c's tensor k
            self._history = [np.zeros((size_, self._n_rollback, t.shape[1]), dtype=t.dtype) for t in r + s]
            self._tags = np.zeros((size_, self._n_rollback), dtype=np.int32)
            self._table = self._engine.CellTable(size_, r + s, self._history, self._tags)
        else:
            self._history, self._tags = [], np.zeros((size_, 0), dtype=np.int32)
            self._table = self._engine.CellTable(size_, r + s)
        # where the model writes a ubatch's step states, and what the cache still has to file
        self._steps: list[np.ndarray] = [np.zeros((0, t.shape[1]), dtype=t.dtype) for t in r + s]
        self._pending_steps: tuple[int, int, int, np.ndarray] | None = None
        self._state_io = self._engine.StateIO(self._table, self._config.type_ids())
        self._lock = threading.Lock()
        # bumped by every change of the cells: a MemoryState applies only on the generation
        # it was prepared on (or its own previous apply left)
        self._generation = 0

    # -- one thread at a time ----------------------------------------------------------

    def _enter(self) -> None:
        if not self._lock.acquire(blocking=False):
            raise UsageError("this RecurrentCache is in use by another thread: a cache belongs to one "
                             "thread at a time (use one cache per thread, or a lock around every call)")

    def _enter_to_change(self) -> None:
        """``_enter`` for a call that moves rows or reads the history: first file the step
        states the model wrote for the last ubatch (reads during the model's forward do not)."""
        self._enter()
        if self._pending_steps is not None:
            self._file_steps()

    # -- rollback history (SPEC §7) -----------------------------------------------------

    def _expect_steps(self, head: int, n_seqs: int, n_seq_tokens: int, last_pos: np.ndarray) -> int:
        """After a ubatch is applied: room for the model's step states; returns m (0: none)."""
        m = min(self._n_rollback, n_seq_tokens - 1)
        if m > 0:
            if self._steps and self._steps[0].shape[0] < n_seqs * m:
                self._steps = [np.zeros((max(n_seqs * m, 2 * self._steps[0].shape[0]), t.shape[1]), dtype=t.dtype)
                               for t in self.r + self.s]
            self._pending_steps = (head, n_seqs, m, last_pos)
        return m

    def _step_rows(self, k: int, n_seqs: int, m: int) -> np.ndarray:
        return self._steps[k][:n_seqs * m].reshape(n_seqs, m, self._steps[k].shape[1])

    def _file_steps(self) -> None:
        """File the states the model wrote for the last ubatch into its cells' histories."""
        assert self._pending_steps is not None
        head, n_seqs, m, last_pos = self._pending_steps
        self._pending_steps = None
        cells = np.arange(head, head + n_seqs)[:, None]
        positions = last_pos[:, None] - m + np.arange(m)[None, :]   # states after these positions
        slots = positions % self._n_rollback
        for k, history in enumerate(self._history):
            history[cells, slots] = self._step_rows(k, n_seqs, m)
        self._tags[cells, slots] = positions + 1

    @property
    def n_rollback(self) -> int:
        """Past states each cell keeps for rollback (SPEC §7); 0: none."""
        return self._n_rollback

    def seq_rollback_min(self, seq: int) -> int:
        """The smallest position ``q`` that ``seq_rm(seq, q + 1, -1)`` can roll ``seq`` back to, or -1."""
        seq = as_int(seq, "seq")
        self._enter_to_change()
        try:
            return int(self._table.rollback_min(seq))
        finally:
            self._leave()

    def _leave(self) -> None:
        self._lock.release()

    # -- shape -------------------------------------------------------------------------

    @property
    def size(self) -> int:
        """Number of cells."""
        return self._config.size

    @property
    def n_seq_max(self) -> int:
        """Sequences the cache was sized for."""
        return self._config.n_seq_max

    @property
    def n_layer(self) -> int:
        """Layers (pairs of state tensors)."""
        return self._config.n_layer

    @property
    def n_embd_r(self) -> int:
        """Width of an r row."""
        return self._config.n_embd_r

    @property
    def n_embd_s(self) -> int:
        """Width of an s row."""
        return self._config.n_embd_s

    @property
    def dtype_r(self) -> str:
        """Element type of r: ``"f32"``, ``"f16"`` or ``"bf16"``."""
        return self._config.dtype_r.name

    @property
    def dtype_s(self) -> str:
        """Element type of s."""
        return self._config.dtype_s.name

    @property
    def engine(self) -> str:
        """``"compiled"`` or ``"reference"``."""
        return self._engine.name

    @property
    def cell_table(self) -> object:
        """The C-level handle (``recurrent_cache.core.CellTable``) for Cython code; compiled engine only."""
        if self._engine.name != "compiled":
            raise ArgumentError("cell_table is the compiled engine's C-level handle; this cache runs "
                                "on the reference engine")
        return self._table

    @property
    def head(self) -> int:
        """Where the next free-cell search starts / first cell of the last placement."""
        return int(self._table.head)

    @property
    def used(self) -> int:
        """Number of non-empty cells."""
        return int(self._table.used)

    @property
    def n(self) -> int:
        """Cells from head touched by the last placement."""
        return int(self._table.n)

    # -- cells -------------------------------------------------------------------------

    def cell(self, i: int) -> tuple[int, int, int, tuple[int, ...]]:
        """``(pos, src, tail, seq_ids)`` of cell ``i``; ``tail`` is the cell holding sequence ``i``."""
        i = _args.index(i, "cell index", self.size, OutOfRangeError)
        self._enter()
        try:
            return self._table.cell(i)  # type: ignore[no-any-return]
        finally:
            self._leave()

    def check(self) -> None:
        """Raise ``CoreError`` if an invariant of SPEC §1 is broken (O(size))."""
        self._enter()
        try:
            broken = self._table.check()
        finally:
            self._leave()
        if broken is not None:
            raise CoreError(f"invariant broken: {broken}")

    # -- sequence operations -------------------------------------------------------------

    def clear(self) -> None:
        """Empty every cell and zero every state row."""
        self._enter_to_change()
        try:
            self._table.clear()
            self._generation += 1
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
        self._enter_to_change()
        try:
            pos = self._table.seq_pos_max(seq) if self._n_rollback and 0 <= seq < self.size else -1
            if 0 < p0 <= pos and (p1 < 0 or p1 > pos):
                removed = bool(self._table.rollback(seq, p0 - 1))   # SPEC §7: back to the state after p0 - 1
            else:
                removed = bool(self._table.seq_rm(seq, p0, p1))
            if removed:
                self._generation += 1
        finally:
            self._leave()
        return removed

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        """Make ``dst`` share ``src``'s cell (a fork); the range is ignored.

        A no-op when ``src == dst`` or either is outside ``[0, size)``, as in llama.cpp.
        """
        src, dst = as_int(src, "src"), as_int(dst, "dst")
        as_int(p0, "p0"), as_int(p1, "p1")
        self._enter_to_change()
        try:
            self._table.seq_cp(src, dst)
            self._generation += 1
        finally:
            self._leave()

    def _seq_op(self, op: str, code: int, seq: int, what: str) -> None:
        if code:
            raise engine_error(code, what=f"{op}: {what}", seq=seq, size=self.size)
        self._generation += 1

    def seq_keep(self, seq: int) -> None:
        """Free every cell that does not hold ``seq``; its cell keeps only ``seq``.

        A ``seq`` outside ``[0, size)`` raises ``SeqIdError`` (llama.cpp would
        empty every cell).
        """
        seq = as_int(seq, "seq")
        self._enter_to_change()
        try:
            self._seq_op("seq_keep", self._table.seq_keep(seq), seq, f"seq_id {seq}")
        finally:
            self._leave()

    def seq_add(self, seq: int, p0: int, p1: int, shift: int) -> None:
        """Shift the pos of ``seq``'s cell by ``shift`` if it lies in ``[p0, p1)``.

        The pos is the cell's, so sequences sharing the cell move with it.
        """
        seq, p0, p1, shift = as_int(seq, "seq"), as_int(p0, "p0"), as_int(p1, "p1"), as_int(shift, "shift")
        self._enter_to_change()
        try:
            self._seq_op("seq_add", self._table.seq_add(seq, p0, p1, shift), seq,
                         f"seq_id {seq} at pos {self._table.seq_pos_max(seq)} shifted by {shift}")
        finally:
            self._leave()

    def seq_div(self, seq: int, p0: int, p1: int, d: int) -> None:
        """Divide the pos of ``seq``'s cell by ``d`` (truncating) if it lies in ``[p0, p1)``; ``d >= 1``."""
        seq, p0, p1, d = as_int(seq, "seq"), as_int(p0, "p0"), as_int(p1, "p1"), as_int(d, "d")
        self._enter_to_change()
        try:
            self._seq_op("seq_div", self._table.seq_div(seq, p0, p1, d), seq,
                         f"seq_id {seq} divided by d = {d} (d must be positive)")
        finally:
            self._leave()

    def seq_pos_min(self, seq: int) -> int:
        """Smallest pos of ``seq``'s cells; -1 when it has none."""
        seq = as_int(seq, "seq")
        self._enter()
        try:
            return int(self._table.seq_pos_min(seq))
        finally:
            self._leave()

    def seq_pos_max(self, seq: int) -> int:
        """Largest pos of ``seq``'s cells; -1 when it has none."""
        seq = as_int(seq, "seq")
        self._enter()
        try:
            return int(self._table.seq_pos_max(seq))
        finally:
            self._leave()

    def _place_sequence(self, seq: int, pos: int) -> int:
        """Give ``seq`` (holding no cell) a cell of its own at ``pos``; returns its row.

        Placed as ``state_read`` of a one-cell blob would place it; the caller
        fills the row (``r[il][row]``, ``s[il][row]``).  For ``PrefixCache``.
        """
        seq, pos = as_int(seq, "seq"), as_int(pos, "pos")
        self._enter_to_change()
        try:
            cell = int(self._table.place(seq, pos))
            self._generation += 1
        finally:
            self._leave()
        if cell < 0:
            raise engine_error(cell, what=f"place seq_id {seq} at pos {pos}", seq=seq, size=self.size)
        return cell

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
            placement = self._engine.split_batch(self._table, batch.seq_id_flat, batch.seq_id_offset, pos,
                                                 batch.logits, every, n_ubatch, pooled)
            status = MemoryStatus.SUCCESS if placement.prepare() == 0 else MemoryStatus.FAILED_PREPARE
        finally:
            self._leave()
        return MemoryState(self, placement, batch, pos, status, self._generation)

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
            base = self._table.seq_pos_max(seq) + 1 if 0 <= seq < self.size else 0
            pos[order[first:first + count]] = base + np.arange(count)
        if pos.size and pos.max() >= POS_MAX:
            raise PositionError(f"default positions of sequence {int(owners[int(pos.argmax())])} reach "
                                f"{int(pos.max())}: positions must be < 2**31 - 1")
        return pos.astype(np.int32)

    def init_full(self) -> MemoryState:
        """A state covering the whole cache (``head = 0``, ``n_kv = size``)."""
        return MemoryState(self, None, None, None, MemoryStatus.SUCCESS, self._generation)

    # -- state serialisation (SPEC §5) ---------------------------------------------------

    def state_size(self, seq_id: int = -1) -> int:
        """Length in bytes of ``state_write(seq_id)``."""
        seq_id = state_seq_id(seq_id, self.size, "state_size")
        self._enter()
        try:
            return int(self._state_io.size(seq_id))
        finally:
            self._leave()

    def state_write(self, seq_id: int = -1) -> bytes:
        """The state of the whole cache (``seq_id = -1``) or of one sequence, as llama.cpp writes it.

        Raises ``SeqIdError`` for a ``seq_id`` outside ``[-1, size)`` (llama.cpp
        would write an empty blob).
        """
        seq_id = state_seq_id(seq_id, self.size, "state_write")
        self._enter()
        try:
            return self._state_io.write_bytes(seq_id)  # type: ignore[no-any-return]
        finally:
            self._leave()

    def state_write_into(self, target: object, seq_id: int = -1) -> int:
        """Write ``state_write(seq_id)`` into ``target``; returns the bytes written.

        ``target`` is a writable C-contiguous buffer (bytearray, memoryview,
        numpy array, mmap) of at least ``state_size(seq_id)`` bytes, filled from
        its start, or a binary file object, written at its position.  Rows go
        from the state tensors to the target with no intermediate copy.
        """
        seq_id = state_seq_id(seq_id, self.size, "state_write_into")
        view = target_view(target)
        self._enter()
        try:
            if view is None:
                return int(self._state_io.write_file(target, seq_id))
            return int(self._state_io.write_into(view, seq_id))
        finally:
            self._leave()

    def state_read(self, data: object, seq_id: int = -1) -> int:
        """Restore a blob of ``state_write`` (any bytes-like object); returns its length.

        ``seq_id = -1`` replaces the whole cache; ``seq_id >= 0`` replaces that
        sequence with the blob's one cell (a 0-cell blob just removes it).  The
        whole blob is checked first: a ``StateError`` naming the defect and its
        byte offset leaves the cache, cells and rows, exactly as it was.
        """
        seq_id = state_seq_id(seq_id, self.size, "state_read")
        view = blob_view(data)
        self._enter_to_change()
        try:
            n = int(self._state_io.read(view, seq_id))
            self._table.forget_history(seq_id)   # the blob carries no history (llama.cpp's bytes)
            self._generation += 1
        finally:
            self._leave()
        return n

    def state_read_from(self, file: object, seq_id: int = -1) -> int:
        """``state_read`` of everything from a binary file's position to its end."""
        seq_id = state_seq_id(seq_id, self.size, "state_read_from")
        # bounded by this cache's state size, and checked as state_read checks the bytes
        return self.state_read(read_rest(file, Geometry.of(self), seq_id), seq_id)

    def __repr__(self) -> str:
        return (f"RecurrentCache(size={self.size}, used={self.used}, head={self.head}, "
                f"n_layer={self.n_layer}, n_embd_r={self.n_embd_r}, n_embd_s={self.n_embd_s}, "
                f"dtype_r={self.dtype_r!r}, dtype_s={self.dtype_s!r}, engine={self.engine!r})")
