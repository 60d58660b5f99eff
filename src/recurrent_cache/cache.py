"""`RecurrentCache`: the public face of the compiled core.

This module checks arguments and owns the numpy state tensors; the cell table
and every loop live in the Cython modules (``_cells``, ``_batch``,
``_memory``).  A rejected call raises before the core is touched, so the
cache is left exactly as it was.
"""

from __future__ import annotations

import numpy as np

from ._cells import CellTable
from ._config import Config, as_int, state_seq_id
from ._memory import MemoryState, core_error
from ._state_io import StateIO
from .batch import Batch
from .errors import BatchError, PositionError, SeqIdError
from .state_format import blob_view, read_rest, target_view

__all__ = ["RecurrentCache"]

POS_MAX = 2**31 - 1


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
    """

    def __init__(self, n_layer: int, n_embd_r: int, n_embd_s: int, n_seq_max: int = 1,
                 size: int | None = None, dtype_r: str = "f32", dtype_s: str = "f32") -> None:
        self._config = Config.check(n_layer, n_embd_r, n_embd_s, n_seq_max, size, dtype_r, dtype_s)
        r, s = self._config.allocate()
        self.r: tuple[np.ndarray, ...] = tuple(r)
        self.s: tuple[np.ndarray, ...] = tuple(s)
        self._cells = CellTable(self._config.size, r + s)
        self._state_io = StateIO(self._cells, [self._config.dtype_r.ggml_type] * self._config.n_layer
                                 + [self._config.dtype_s.ggml_type] * self._config.n_layer)

    # -- shape -------------------------------------------------------------------

    size = property(lambda self: self._config.size, doc="Number of cells.")
    n_seq_max = property(lambda self: self._config.n_seq_max, doc="Sequences the cache was sized for.")
    n_layer = property(lambda self: self._config.n_layer, doc="Layers (pairs of state tensors).")
    n_embd_r = property(lambda self: self._config.n_embd_r, doc="Width of an r row.")
    n_embd_s = property(lambda self: self._config.n_embd_s, doc="Width of an s row.")
    dtype_r = property(lambda self: self._config.dtype_r.name, doc="Element type of r.")
    dtype_s = property(lambda self: self._config.dtype_s.name, doc="Element type of s.")
    cell_table = property(lambda self: self._cells,
                          doc="The C-level handle (``recurrent_cache.core.CellTable``) for Cython code.")
    head = property(lambda self: self._cells.head, doc="Where the next free-cell search starts.")
    used = property(lambda self: self._cells.used, doc="Number of non-empty cells.")
    n = property(lambda self: self._cells.n, doc="Cells from head touched by the last placement.")

    # -- cells -------------------------------------------------------------------

    def cell(self, i: int) -> tuple[int, int, int, tuple[int, ...]]:
        """``(pos, src, tail, seq_ids)`` of cell ``i``; ``tail`` is the cell holding sequence ``i``."""
        i = as_int(i, "cell index")
        if not 0 <= i < self.size:
            raise SeqIdError(f"cell index {i} out of range [0, {self.size})")
        return self._cells.cell(i)

    def check(self) -> None:
        """Raise ``CoreError`` if an invariant of SPEC §1 is broken (O(size))."""
        self._cells.check()

    # -- sequence operations -------------------------------------------------------

    def clear(self) -> None:
        """Empty every cell and zero every state row."""
        self._cells.clear()

    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> bool:
        """Drop ``seq`` (every sequence when ``seq < 0``) from positions ``[p0, p1)``.

        A recurrent state cannot be cut: returns False, changing nothing, when
        the range would split a state (or for ``seq >= size``).
        """
        return self._cells.seq_rm(as_int(seq, "seq"), as_int(p0, "p0"), as_int(p1, "p1"))

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        """Make ``dst`` share ``src``'s cell (a fork); the range is ignored."""
        as_int(p0, "p0"), as_int(p1, "p1")
        self._cells.seq_cp(as_int(src, "src"), as_int(dst, "dst"))

    def seq_keep(self, seq: int) -> None:
        """Free every cell that does not hold ``seq``; its cell keeps only ``seq``.

        A ``seq`` outside ``[0, size)`` raises ``SeqIdError`` (llama.cpp would
        empty every cell).
        """
        seq = as_int(seq, "seq")
        self._check(self._cells.seq_keep(seq), f"seq_keep: seq_id {seq} (cache size {self.size})")

    def seq_add(self, seq: int, p0: int, p1: int, shift: int) -> None:
        """Shift the pos of ``seq``'s cell by ``shift`` if it lies in ``[p0, p1)``.

        The pos is the cell's, so sequences sharing the cell move with it.
        """
        seq, p0, p1, shift = as_int(seq, "seq"), as_int(p0, "p0"), as_int(p1, "p1"), as_int(shift, "shift")
        self._check(self._cells.seq_add(seq, p0, p1, shift),
                    f"seq_add: seq_id {seq} (cache size {self.size}) at pos {self.seq_pos_max(seq)} "
                    f"shifted by {shift}")

    def seq_div(self, seq: int, p0: int, p1: int, d: int) -> None:
        """Divide the pos of ``seq``'s cell by ``d`` (truncating) if it lies in ``[p0, p1)``."""
        seq, p0, p1, d = as_int(seq, "seq"), as_int(p0, "p0"), as_int(p1, "p1"), as_int(d, "d")
        self._check(self._cells.seq_div(seq, p0, p1, d),
                    f"seq_div: seq_id {seq} (cache size {self.size}), divisor d = {d} (must be positive)")

    @staticmethod
    def _check(code: int, detail: str) -> None:
        if code:
            raise core_error(code, detail)

    def seq_pos_min(self, seq: int) -> int:
        """Smallest pos of ``seq``'s cells; -1 when it has none."""
        return self._cells.seq_pos_min(as_int(seq, "seq"))

    def seq_pos_max(self, seq: int) -> int:
        """Largest pos of ``seq``'s cells; -1 when it has none."""
        return self._cells.seq_pos_max(as_int(seq, "seq"))

    def _place_sequence(self, seq: int, pos: int) -> int:
        """Give ``seq`` (holding no cell) a cell of its own at ``pos``; returns its row.

        Placed as ``state_read`` of a one-cell blob would place it; the caller
        fills the row (``r[il][row]``, ``s[il][row]``).  For ``PrefixCache``.
        """
        cell = self._cells.place(as_int(seq, "seq"), as_int(pos, "pos"))
        if cell < 0:
            raise core_error(cell, f"place seq {seq} at pos {pos}")
        return cell

    # -- batches -----------------------------------------------------------------

    def init_batch(self, batch: Batch, n_ubatch: int = 512, embd_pooled: bool = False,
                   logits_all: bool = False) -> MemoryState:
        """Validate and split ``batch`` into ubatches, and check that all of them fit.

        Raises (changing nothing) for a batch this cache cannot take; returns a
        ``MemoryState`` to ``apply()`` ubatch by ubatch, or to iterate over.
        """
        if not isinstance(batch, Batch):
            raise BatchError(f"init_batch takes a Batch, got {type(batch).__name__}")
        if isinstance(n_ubatch, bool) or not isinstance(n_ubatch, (int, np.integer)) or n_ubatch < 1:
            raise BatchError(f"n_ubatch must be an integer >= 1, got {n_ubatch!r}")
        pos = batch.pos
        if pos is None:
            start = self._cells.seq_pos_max(0) + 1
            if start + batch.n_tokens > POS_MAX:
                raise PositionError(f"default positions from {start} overflow int32")
            pos = np.arange(start, start + batch.n_tokens, dtype=np.int32)
        return MemoryState._from_batch(self._cells, self, batch, pos, min(int(n_ubatch), POS_MAX),
                                     bool(embd_pooled), bool(logits_all))

    def init_full(self) -> MemoryState:
        """A state covering the whole cache (``head = 0``, ``n_kv = size``)."""
        return MemoryState._from_full(self._cells, self)

    # -- state serialisation (SPEC §5) ---------------------------------------------

    def state_size(self, seq_id: int = -1) -> int:
        """Length in bytes of ``state_write(seq_id)``."""
        return self._state_io.size(state_seq_id(seq_id, self.size, "state_size"))

    def state_write(self, seq_id: int = -1) -> bytes:
        """The state of the whole cache (``seq_id = -1``) or of one sequence, as llama.cpp writes it.

        Raises ``SeqIdError`` for a ``seq_id`` outside ``[-1, size)`` (llama.cpp
        would write an empty blob).
        """
        return self._state_io.write_bytes(state_seq_id(seq_id, self.size, "state_write"))

    def state_write_into(self, target: object, seq_id: int = -1) -> int:
        """Write ``state_write(seq_id)`` into ``target``; returns the bytes written.

        ``target`` is a writable C-contiguous buffer (bytearray, memoryview,
        numpy array, mmap) of at least ``state_size(seq_id)`` bytes, filled from
        its start, or a binary file object, written at its position.  Rows go
        from the state tensors to the target with no intermediate copy.
        """
        seq_id = state_seq_id(seq_id, self.size, "state_write_into")
        view = target_view(target)
        if view is None:
            return self._state_io.write_file(target, seq_id)
        return self._state_io.write_into(view, seq_id)

    def state_read(self, data: object, seq_id: int = -1) -> int:
        """Restore a blob of ``state_write`` (any bytes-like object); returns its length.

        ``seq_id = -1`` replaces the whole cache; ``seq_id >= 0`` replaces that
        sequence with the blob's one cell (a 0-cell blob just removes it).  The
        whole blob is checked first: a ``StateError`` naming the defect and its
        byte offset leaves the cache, cells and rows, exactly as it was.
        """
        seq_id = state_seq_id(seq_id, self.size, "state_read")
        return self._state_io.read(blob_view(data), seq_id)

    def state_read_from(self, file: object, seq_id: int = -1) -> int:
        """``state_read`` of everything from a binary file's position to its end."""
        seq_id = state_seq_id(seq_id, self.size, "state_read_from")
        return self.state_read(read_rest(file), seq_id)

    def __repr__(self) -> str:
        return (f"RecurrentCache(size={self.size}, used={self.used}, head={self.head}, "
                f"n_layer={self.n_layer}, n_embd_r={self.n_embd_r}, n_embd_s={self.n_embd_s}, "
                f"dtype_r={self.dtype_r!r}, dtype_s={self.dtype_s!r})")
