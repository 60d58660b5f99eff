"""The attention KV cell table in plain Python: docs/hybrid.md ("KV cells"), written to be read.

A KV cache holds one token per cell: a position and the set of sequences that
see it.  This module states what every operation does with Python lists and
sets, scanning every cell as llama.cpp's ``llama_kv_cache`` does (one stream,
the unified cache).  It is the oracle the compiled table
(``_kv_cells.KVCells``) is tested against, operation by operation and cell by
cell; both classes have the same interface, take the same arguments and raise
the same exceptions, worded here once (``kv_error``).

A call that is refused — a bad argument, or ``find_slot`` / ``place`` finding
no slot (they return ``None``) — changes nothing.
"""

from __future__ import annotations

import itertools
import operator
from typing import Any

import numpy as np

from . import errors as E

__all__ = ["CODES", "KVCells", "POS_MAX", "SWA_TYPES", "as_int32", "cell_array", "check_config", "check_mask_out",
           "checked_ubatches", "is_masked_swa", "kv_error", "position_array", "token_array_shapes", "token_arrays"]

POS_MAX = E.POS_MAX            # positions lie in [0, POS_MAX); a range bound < 0 means "to the end"
SWA_TYPES = ("none", "standard", "chunked", "symmetric")   # llama.cpp's llama_swa_type, in its order
N_KV_PAD = 256                 # llama.cpp pads the attended cells to a multiple of 256 (get_n_kv)

# Failure codes both tables report; kv_error turns (code, a, b) into the exception.
CODES = {
    "OK": 0,
    "SEQ_RANGE": 1,         # a = seq id, b = n_seq_max
    "POSITION": 2,          # a = token, b = position
    "DUPLICATE_SEQ": 3,     # a = token, b = seq id
    "CELL_INDEX": 4,        # a = cell, b = size
    "CELL_TAKEN": 5,        # a = cell: listed twice, or holding several sequences
    "DIVISOR": 6,           # a = d
    "SHIFT_POSITION": 7,    # a = cell, b = its position
    "CELL_COUNT": 8,        # a = cells given, b = tokens
    "NO_MEMORY": 9,
    "SHIFT_RANGE": 11,      # a = cell, b = its pending shift
    "TOO_MANY_CELLS": 12,   # a = cells given, b = size
}


_MESSAGES: dict[int, tuple[type[Exception], str]] = {
    CODES["SEQ_RANGE"]: (E.SeqIdError, "seq_id {a} is out of range [0, {b}) (n_seq_max = {b})"),
    CODES["POSITION"]: (E.PositionError, "token {a} has position {b}: positions lie in [0, 2**31 - 1)"),
    CODES["DUPLICATE_SEQ"]: (E.BatchError, "token {a} lists seq_id {b} twice"),
    CODES["CELL_INDEX"]: (E.OutOfRangeError, "cell index {a} is out of range [0, {b})"),
    CODES["CELL_TAKEN"]: (E.ArgumentError, "cell {a} cannot take a token: it is listed twice or holds several "
                                           "sequences"),
    CODES["DIVISOR"]: (E.ArgumentError, "seq_div: d must be >= 1, got {a}"),
    CODES["SHIFT_POSITION"]: (E.PositionError, "seq_add: cell {a} at position {b} would move to 2**31 - 1 or beyond"),
    CODES["CELL_COUNT"]: (E.BatchError, "apply: {a} cells for {b} tokens"),
    CODES["NO_MEMORY"]: (MemoryError, "out of memory in the KV cell table"),
    CODES["SHIFT_RANGE"]: (E.PositionError, "cell {a} would pile its pending shift {b} beyond int32: rotate the "
                                            "keys (reset_shift) first"),
    CODES["TOO_MANY_CELLS"]: (E.StateError, "load: {a} cells do not fit a table of {b}"),
}


def kv_error(code: int, a: int = 0, b: int = 0) -> Exception:
    """The exception for a failure code of either table (the one wording of each)."""
    kind, message = _MESSAGES.get(code, (E.CoreError, "KV cell table: unknown failure code {code}"))
    return kind(message.format(a=a, b=b, code=code))


def as_int32(value: Any, what: str) -> int:
    """An integer argument that must fit llama.cpp's int32 (``ArgumentError`` naming it when not)."""
    try:
        number = operator.index(value)
    except TypeError:
        raise E.ArgumentError(f"{what} must be an integer, got {value!r}") from None
    if not -(2**31) <= number < 2**31:
        raise E.ArgumentError(f"{what} = {number} does not fit in int32")
    return number


def _integers(values: Any) -> np.ndarray:
    """Seq ids as int64 (``BatchError`` for anything but integers)."""
    try:
        array = np.asarray(values)
    except OverflowError as exc:
        raise E.BatchError(f"seq ids must fit in int64: {exc}") from None
    if array.dtype.kind not in "iu" or array.ndim != 1:
        raise E.BatchError(f"seq ids must be integers, got {array.dtype} of shape {array.shape}")
    return array.astype(np.int64)


def token_arrays(pos: Any, seq_ids: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A ubatch's tokens as int32 arrays: positions ``[n]``, every token's seq ids one after the
    other, and their offsets ``[n + 1]``.  ``seq_ids`` is one id per token (a 1-D integer array or
    list of ints) or a list of id lists.  Checks the shape only (range checks are the tables')."""
    pos_values = np.asarray(pos)
    if pos_values.ndim != 1 or pos_values.size == 0:
        raise E.BatchError(f"a ubatch needs a 1-D array of at least one position, got shape {pos_values.shape}")
    if pos_values.dtype.kind not in "iu":
        raise E.BatchError(f"positions must be integers, got dtype {pos_values.dtype}")
    n = pos_values.size
    if len(seq_ids) != n:
        raise E.BatchError(f"{n} positions but {len(seq_ids)} seq id entries")
    lengths: Any
    one_each = isinstance(seq_ids, np.ndarray) and seq_ids.ndim == 1
    if one_each or all(isinstance(ids, (int, np.integer)) for ids in seq_ids):
        flat = _integers(seq_ids)                 # one seq id per token
        lengths = np.ones(n, dtype=np.int32)
    else:
        lists = [list(ids) if np.ndim(ids) == 1 else [ids] for ids in seq_ids]
        for token, ids in enumerate(lists):
            if not ids:
                raise E.BatchError(f"token {token} has no seq id")
        flat = _integers([seq for ids in lists for seq in ids])
        lengths = [len(ids) for ids in lists]
    outside_ids = np.flatnonzero((flat < -(2**31)) | (flat >= 2**31))
    if outside_ids.size:
        raise kv_error(CODES["SEQ_RANGE"], int(flat[outside_ids[0]]), 2**31)
    wide = pos_values.astype(np.int64)
    outside = np.flatnonzero((wide < 0) | (wide >= POS_MAX))
    if outside.size:
        raise kv_error(CODES["POSITION"], int(outside[0]), int(wide[outside[0]]))
    offsets = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    return wide.astype(np.int32), flat.astype(np.int32), offsets


def token_array_shapes(pos: Any, flat: Any, offsets: Any, what: str,
                       min_tokens: int = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Tokens in ``place_arrays``'s encoding — positions ``[n]``, every token's seq ids one after the
    other, their offsets ``[n + 1]`` — after the shape checks (range checks are the tables'): 1-D
    int32 numpy arrays, at least ``min_tokens`` tokens, offsets from 0 to ``len(flat)``, every token
    listing a seq id.  ``BatchError`` naming ``what`` otherwise."""
    arrays = []
    for name, values in (("pos", pos), ("flat", flat), ("offsets", offsets)):
        if not isinstance(values, np.ndarray) or values.dtype != np.int32 or values.ndim != 1:
            got = f"{values.dtype} of shape {values.shape}" if isinstance(values, np.ndarray) else type(values).__name__
            raise E.BatchError(f"{what}: {name} must be a 1-D int32 numpy array, got {got}")
        arrays.append(np.ascontiguousarray(values))
    positions, ids, starts = arrays
    n = positions.shape[0]
    if n < min_tokens or starts.shape[0] != n + 1 or starts[0] != 0 or starts[n] != ids.shape[0]:
        raise E.BatchError(f"{what}: offsets must be [n + 1], from 0 to len(flat), for n >= {min_tokens} tokens "
                           f"(got {n} positions, {starts.shape[0]} offsets, {ids.shape[0]} seq ids)")
    if (starts[1:] <= starts[:-1]).any():
        empty = np.flatnonzero(starts[1:] <= starts[:-1])[0]
        raise E.BatchError(f"{what}: token {empty} has no seq id (offsets must grow strictly)")
    return positions, ids, starts


def checked_ubatches(ubatches: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``prepare``'s argument — a non-empty sequence of ``(pos, flat, offsets)`` ubatches, each
    through ``token_array_shapes`` (``ArgumentError`` / ``BatchError`` naming the ubatch) — as one
    run of tokens: ``bounds [n_ubatch + 1]`` (ubatch u is tokens ``bounds[u]:bounds[u + 1]``), and
    the positions, seq ids and offsets of all the tokens."""
    if not isinstance(ubatches, (list, tuple)) or not ubatches:
        raise E.ArgumentError(f"prepare needs a non-empty list of (pos, flat, offsets) ubatches, got {ubatches!r:.80}")
    checked = []
    for u, ubatch in enumerate(ubatches):
        if not isinstance(ubatch, tuple) or len(ubatch) != 3:
            raise E.ArgumentError(f"prepare: ubatch {u} must be a (pos, flat, offsets) tuple, got {ubatch!r:.80}")
        checked.append(token_array_shapes(*ubatch, f"prepare: ubatch {u}"))
    bounds = np.asarray([0, *itertools.accumulate(pos.shape[0] for pos, _, _ in checked)], dtype=np.int32)
    if len(checked) == 1:
        return (bounds, *checked[0])
    offsets = np.empty(bounds[-1] + 1, dtype=np.int32)
    flat_base = 0
    for u, (_, flat, starts) in enumerate(checked):
        offsets[bounds[u]:bounds[u + 1]] = starts[:-1] + flat_base
        flat_base += flat.shape[0]
    offsets[-1] = flat_base
    return (bounds, np.concatenate([pos for pos, _, _ in checked]), np.concatenate([flat for _, flat, _ in checked]),
            offsets)


def position_array(pos: Any, what: str) -> np.ndarray:
    """Positions as int32 ``[n]`` (n >= 0): a 1-D integer array or list, each in ``[0, 2**31 - 1)``."""
    values = np.asarray(pos)
    if values.ndim != 1 or (values.size and values.dtype.kind not in "iu"):
        raise E.BatchError(f"{what}: positions must be a 1-D integer array, got {values.dtype} of shape {values.shape}")
    wide = values.astype(np.int64)
    outside = np.flatnonzero((wide < 0) | (wide >= POS_MAX))
    if outside.size:
        raise kv_error(CODES["POSITION"], int(outside[0]), int(wide[outside[0]]))
    return wide.astype(np.int32)


def cell_array(cells: Any, n_tokens: int, size: int) -> np.ndarray:
    """The cells given to ``apply`` as int32 ``[n_tokens]`` (their range is checked cell by cell later)."""
    slot = np.asarray(cells).reshape(-1)
    if slot.dtype.kind not in "iu":
        raise E.ArgumentError(f"cells must be integers, got dtype {slot.dtype}")
    if slot.shape[0] != n_tokens:
        raise kv_error(CODES["CELL_COUNT"], slot.shape[0], n_tokens)
    outside = np.flatnonzero((slot < 0) | (slot >= size))
    if outside.size and not -(2**31) <= int(slot[outside[0]]) < 2**31:
        raise kv_error(CODES["CELL_INDEX"], int(slot[outside[0]]), size)
    return np.ascontiguousarray(slot, dtype=np.int32)


def is_masked_swa(n_swa: int, swa_type: str, p0: int, p1: int) -> bool:
    """Whether a token at ``p1`` cannot see one at ``p0`` through a sliding window (llama.cpp's rule)."""
    if swa_type == "standard":
        return p1 - p0 >= n_swa
    if swa_type == "chunked":
        return p0 < (p1 // n_swa) * n_swa
    if swa_type == "symmetric":
        return abs(p1 - p0) > n_swa // 2
    return False


def check_config(size: int, n_seq_max: int, n_swa: int, swa_type: str) -> None:
    """Refuse a table llama.cpp could not hold (both tables call this first)."""
    if not 1 <= size < 2**31:
        raise E.ConfigError(f"size must be in [1, 2**31), got {size}")
    if not 1 <= n_seq_max <= 256:
        raise E.ConfigError(f"n_seq_max must be in [1, 256] (llama.cpp's LLAMA_MAX_SEQ), got {n_seq_max}")
    if swa_type not in SWA_TYPES:
        raise E.ConfigError(f"swa_type must be one of {SWA_TYPES}, got {swa_type!r}")
    if swa_type != "none" and not 1 <= n_swa < 2**31:
        raise E.ConfigError(f"a sliding window (swa_type {swa_type!r}) needs n_swa >= 1, got {n_swa}")


def _bounds(p0: int, p1: int) -> tuple[int, int]:
    p0, p1 = as_int32(p0, "p0"), as_int32(p1, "p1")
    return (0 if p0 < 0 else p0), (POS_MAX if p1 < 0 else p1)


class KVCells:
    """``size`` KV cells of one stream: per cell a position (-1 = empty), the set of sequences
    holding it and the shift accumulated since the keys were last rotated; ``head``, where the
    next slot search starts."""

    def __init__(self, size: int, n_seq_max: int = 1, n_swa: int = 0, swa_type: str = "none") -> None:
        check_config(size, n_seq_max, n_swa, swa_type)
        self.size, self.n_seq_max, self.n_swa, self.swa_type = size, n_seq_max, n_swa, swa_type
        self.pos = [-1] * size
        self.seqs: list[set[int]] = [set() for _ in range(size)]
        self.shift = [0] * size
        self.head = 0
        self.has_shift = False

    # -- reading ------------------------------------------------------------------------------------

    @property
    def used(self) -> int:
        """The cells holding a token."""
        return sum(p >= 0 for p in self.pos)

    @property
    def used_max_p1(self) -> int:
        """One past the last cell holding a token (0 when none does)."""
        return max((i + 1 for i, p in enumerate(self.pos) if p >= 0), default=0)

    def cell(self, i: int) -> tuple[int, tuple[int, ...]] | None:
        """Cell ``i``: ``None`` when empty, else its position and its sequences in increasing order."""
        if not 0 <= i < self.size:
            raise kv_error(CODES["CELL_INDEX"], i, self.size)
        return None if self.pos[i] < 0 else (self.pos[i], tuple(sorted(self.seqs[i])))

    def cells(self) -> list[tuple[int, tuple[int, ...]] | None]:
        """Every cell, as ``cell`` gives it."""
        return [self.cell(i) for i in range(self.size)]

    def shifts(self) -> np.ndarray:
        """Per cell, the position change the keys have not been rotated by yet ``[size]``."""
        return np.asarray(self.shift, dtype=np.int32)

    def _check_seq(self, seq: int) -> int:
        seq = as_int32(seq, "seq_id")
        if not 0 <= seq < self.n_seq_max:
            raise kv_error(CODES["SEQ_RANGE"], seq, self.n_seq_max)
        return seq

    def seq_pos_min(self, seq: int) -> int:
        """The smallest position ``seq`` holds, -1 when it holds none."""
        seq = self._check_seq(seq)
        return min((p for p, s in zip(self.pos, self.seqs) if seq in s), default=-1)

    def seq_pos_max(self, seq: int) -> int:
        """The largest position ``seq`` holds, -1 when it holds none."""
        seq = self._check_seq(seq)
        return max((p for p, s in zip(self.pos, self.seqs) if seq in s), default=-1)

    def seq_cells(self, seq: int) -> np.ndarray:
        """The cells holding ``seq``, by position (then by cell), as int32."""
        seq = self._check_seq(seq)
        held = sorted((p, i) for i, (p, s) in enumerate(zip(self.pos, self.seqs)) if seq in s)
        return np.array([i for _, i in held], dtype=np.int32)

    def n_kv(self, pad: int = N_KV_PAD) -> int:
        """The cells a ubatch attends to: the used ones rounded up to ``pad``, at least ``pad``,
        at most ``size`` (llama.cpp's get_n_kv)."""
        if pad < 1:
            raise E.ArgumentError(f"pad must be >= 1, got {pad}")
        return min(self.size, max(pad, -(-self.used_max_p1 // pad) * pad))

    def check(self) -> None:
        """Raise ``CoreError`` naming the first broken invariant of the table."""
        for i, (p, seqs, shift) in enumerate(zip(self.pos, self.seqs, self.shift)):
            if (p < 0) != (not seqs) or p < -1 or p >= POS_MAX:
                raise E.CoreError(f"KV cell {i}: position {p} with sequences {sorted(seqs)}")
            if not all(0 <= s < self.n_seq_max for s in seqs):
                raise E.CoreError(f"KV cell {i}: a seq id outside [0, {self.n_seq_max}): {sorted(seqs)}")
            if p < 0 and shift != 0:
                raise E.CoreError(f"KV cell {i}: empty with shift {shift}")
        if not 0 <= self.head <= self.size:
            raise E.CoreError(f"KV head {self.head} outside [0, {self.size}]")

    # -- placing a ubatch ---------------------------------------------------------------------------

    def _tokens(self, pos: Any, seq_ids: Any) -> tuple[list[int], list[list[int]]]:
        positions, flat, offsets = token_arrays(pos, seq_ids)
        lists = [flat[offsets[t]:offsets[t + 1]].tolist() for t in range(positions.size)]
        for token, ids in enumerate(lists):
            for k, seq in enumerate(ids):
                if not 0 <= seq < self.n_seq_max:
                    raise kv_error(CODES["SEQ_RANGE"], seq, self.n_seq_max)
                if seq in ids[:k]:
                    raise kv_error(CODES["DUPLICATE_SEQ"], token, seq)
        return positions.tolist(), lists

    def _usable(self, i: int) -> bool:
        """An empty cell, or one whose only sequence no longer sees it through the sliding window."""
        if self.pos[i] < 0:
            return True
        if len(self.seqs[i]) != 1:
            return False
        (owner,) = self.seqs[i]
        return is_masked_swa(self.n_swa, self.swa_type, self.pos[i], self.seq_pos_max(owner) + 1)

    def find_slot(self, pos: Any, seq_ids: Any, cont: bool = False) -> np.ndarray | None:
        """The cells the ubatch's tokens would take, in token order, or ``None`` when it fits nowhere.

        The search starts at ``head`` — at cell 0 instead when more than twice the ubatch's free
        cells lie before ``head`` — and wraps around once.  ``cont`` asks for consecutive cells."""
        positions, _ = self._tokens(pos, seq_ids)
        n_tokens = len(positions)
        head = self.head
        if head > self.used + 2 * n_tokens:
            head = 0
        if n_tokens > self.size:
            return None
        n_test = n_tokens if cont else 1
        found: list[int] = []
        tested = 0
        while True:
            if head + n_test > self.size:
                tested += self.size - head
                head = 0
                continue
            for _ in range(n_test):
                cell = head
                head += 1
                tested += 1
                if self._usable(cell):
                    found.append(cell)
                elif cont:
                    break
            if len(found) == n_tokens:
                return np.asarray(found, dtype=np.int32)
            if cont:
                found = []
            if tested >= self.size:
                return None

    def apply(self, cells: Any, pos: Any, seq_ids: Any) -> None:
        """Token t takes cell ``cells[t]`` (a slot ``find_slot`` gave).  A cell reused under the
        sliding window first loses its token, and its sequence every position up to that one, so
        that each sequence keeps holding one unbroken run of positions.  ``head`` moves past the
        last cell."""
        positions, lists = self._tokens(pos, seq_ids)
        slot = cell_array(cells, len(positions), self.size).tolist()
        for k, cell in enumerate(slot):
            if not 0 <= cell < self.size:
                raise kv_error(CODES["CELL_INDEX"], cell, self.size)
            if cell in slot[:k] or len(self.seqs[cell]) > 1:
                raise kv_error(CODES["CELL_TAKEN"], cell)
        overwritten: dict[int, int] = {}
        for cell, p, ids in zip(slot, positions, lists):
            if self.pos[cell] >= 0:
                (owner,) = self.seqs[cell]
                overwritten[owner] = max(overwritten.get(owner, -1), self.pos[cell])
                self._free(cell)
            self.pos[cell] = p
            self.seqs[cell] = set(ids)
        for owner in sorted(overwritten):
            lowest = self.seq_pos_min(owner)
            if lowest <= overwritten[owner]:
                self.seq_rm(owner, lowest, overwritten[owner] + 1)
        self.head = slot[-1] + 1

    def place(self, pos: Any, seq_ids: Any, cont: bool = False) -> np.ndarray | None:
        """``find_slot`` then ``apply``: the cells taken, or ``None`` (nothing changed)."""
        slot = self.find_slot(pos, seq_ids, cont)
        if slot is not None:
            self.apply(slot, pos, seq_ids)
        return slot

    # -- preparing and loading ----------------------------------------------------------------------

    def _checked_tokens(self, pos: np.ndarray, flat: np.ndarray, offsets: np.ndarray) -> list[list[int]]:
        """Each token's seq ids, after the range checks token by token (the compiled table's order)."""
        lists = []
        for token in range(pos.shape[0]):
            if not 0 <= pos[token] < POS_MAX:
                raise kv_error(CODES["POSITION"], token, int(pos[token]))
            ids = flat[offsets[token]:offsets[token + 1]].tolist()
            for k, seq in enumerate(ids):
                if not 0 <= seq < self.n_seq_max:
                    raise kv_error(CODES["SEQ_RANGE"], seq, self.n_seq_max)
                if seq in ids[:k]:
                    raise kv_error(CODES["DUPLICATE_SEQ"], token, seq)
            lists.append(ids)
        return lists

    def _saved(self) -> tuple[list[int], list[set[int]], list[int], int, bool]:
        return list(self.pos), [set(seqs) for seqs in self.seqs], list(self.shift), self.head, self.has_shift

    def _restore(self, saved: tuple[list[int], list[set[int]], list[int], int, bool]) -> None:
        self.pos, self.seqs, self.shift, self.head, self.has_shift = saved

    def apply_arrays(self, cells: np.ndarray, pos: np.ndarray, flat: np.ndarray, offsets: np.ndarray) -> None:
        """``apply`` for tokens in ``place_arrays``'s encoding (int32 arrays) and int32 cells."""
        positions, ids, starts = token_array_shapes(pos, flat, offsets, "apply_arrays")
        if len(cells) != len(positions):
            raise kv_error(CODES["CELL_COUNT"], len(cells), len(positions))
        self.apply(cells, positions, [ids[starts[t]:starts[t + 1]].tolist() for t in range(len(positions))])

    def prepare(self, ubatches: Any) -> list[np.ndarray] | None:
        """The slot of each ubatch (``(pos, flat, offsets)``, ``place_arrays``'s encoding), or ``None``
        when one fits nowhere — llama.cpp's ``prepare``: each ubatch in turn gets a slot
        (``find_slot``, not continuous) and is applied, so the next sees it; then the table is put
        back exactly as it was, including the cells a sliding window's purge freed (llama.cpp leaves
        those freed)."""
        bounds, pos, flat, offsets = checked_ubatches(ubatches)
        tokens = [self._checked_tokens(pos[start:end], flat, offsets[start:end + 1])
                  for start, end in zip(bounds[:-1].tolist(), bounds[1:].tolist())]
        saved = self._saved()
        slots = []
        try:
            for start, end, ids in zip(bounds[:-1].tolist(), bounds[1:].tolist(), tokens):
                slot = self.find_slot(pos[start:end], ids)
                if slot is None:
                    return None
                self.apply(slot, pos[start:end], ids)
                slots.append(slot)
            return slots
        finally:
            self._restore(saved)

    def load(self, pos: Any, flat: Any, offsets: Any) -> None:
        """A whole context's cells, as a state blob carries them (llama.cpp's ``state_read_meta`` with
        no destination sequence): cell i takes token i (its position and every seq id it lists),
        every other cell is empty, ``head`` is 0 and no shift is pending."""
        positions, ids, starts = token_array_shapes(pos, flat, offsets, "load", 0)
        if positions.shape[0] > self.size:
            raise kv_error(CODES["TOO_MANY_CELLS"], positions.shape[0], self.size)
        lists = self._checked_tokens(positions, ids, starts)
        self.clear()
        for cell, (p, seqs) in enumerate(zip(positions.tolist(), lists)):
            self.pos[cell], self.seqs[cell] = p, set(seqs)

    def load_seq(self, seq: int, pos: Any) -> np.ndarray | None:
        """One sequence's cells, as its state blob carries them (llama.cpp's ``state_read_meta`` into
        ``seq``): ``seq`` leaves its cells, then its tokens are placed as one ubatch (``find_slot``,
        not continuous, from ``head``) and the cells taken returned — the caller writes the rows
        there.  ``None`` when they fit nowhere, and then nothing changed: ``seq`` keeps its old cells
        (llama.cpp leaves them removed).  No positions: nothing changes (llama.cpp skips an empty
        stream)."""
        seq = self._check_seq(seq)
        positions = position_array(pos, "load_seq")
        n = positions.shape[0]
        if n == 0:
            return np.empty(0, dtype=np.int32)
        if n > self.size:
            return None
        saved = self._saved()
        self.seq_rm(seq)
        slot = self.find_slot(positions, [seq] * n)
        if slot is None:
            self._restore(saved)
            return None
        self.apply(slot, positions, [seq] * n)
        return slot

    # -- sequence operations ------------------------------------------------------------------------

    def _free(self, cell: int) -> None:
        self.pos[cell], self.seqs[cell], self.shift[cell] = -1, set(), 0

    def _lower_head(self, freed: list[int]) -> None:
        if freed and freed[0] < self.head:
            self.head = freed[0]

    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> bool:
        """``seq`` (every sequence when -1) leaves its cells with positions in ``[p0, p1)``; cells
        left with no sequence are freed and ``head`` drops to the first of them."""
        seq = as_int32(seq, "seq_id")
        if seq != -1:
            self._check_seq(seq)
        lo, hi = _bounds(p0, p1)
        freed = []
        for i in range(self.size):
            if not lo <= self.pos[i] < hi or (seq != -1 and seq not in self.seqs[i]):
                continue
            if seq == -1:
                self.seqs[i].clear()
            else:
                self.seqs[i].discard(seq)
            if not self.seqs[i]:
                self._free(i)
                freed.append(i)
        self._lower_head(freed)
        return True

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        """``dst`` joins every cell of ``src`` with a position in ``[p0, p1)`` (the cells are shared)."""
        src, dst = self._check_seq(src), self._check_seq(dst)
        lo, hi = _bounds(p0, p1)
        if src == dst:
            return
        for i in range(self.size):
            if lo <= self.pos[i] < hi and src in self.seqs[i]:
                self.seqs[i].add(dst)

    def seq_keep(self, seq: int) -> None:
        """Every other sequence leaves every cell."""
        seq = self._check_seq(seq)
        freed = []
        for i in range(self.size):
            if seq in self.seqs[i]:
                self.seqs[i] = {seq}
            elif self.pos[i] >= 0:
                self._free(i)
                freed.append(i)
        self._lower_head(freed)

    def _moved(self, seq: int, p0: int, p1: int) -> list[int]:
        return [i for i in range(self.size) if p0 <= self.pos[i] < p1 and seq in self.seqs[i]]

    def seq_add(self, seq: int, p0: int, p1: int, delta: int) -> None:
        """Positions of ``seq`` in ``[p0, p1)`` move by ``delta`` (the keys must be rotated:
        ``has_shift``); cells pushed below 0 are freed.  ``head`` goes to the first freed cell, or 0."""
        seq = self._check_seq(seq)
        lo, hi = _bounds(p0, p1)
        delta = as_int32(delta, "delta")
        if delta == 0 or lo == hi:
            return
        moved = self._moved(seq, lo, hi)
        for i in moved:
            if self.pos[i] + delta >= POS_MAX:
                raise kv_error(CODES["SHIFT_POSITION"], i, self.pos[i])
        for i in moved:
            if not -(2**31) <= self.shift[i] + delta < 2**31:
                raise kv_error(CODES["SHIFT_RANGE"], i, self.shift[i])
        freed = []
        for i in moved:
            self.has_shift = True
            self.pos[i] += delta
            self.shift[i] += delta
            if self.pos[i] < 0:
                self._free(i)
                freed.append(i)
        self.head = freed[0] if freed else 0

    def seq_div(self, seq: int, p0: int, p1: int, d: int) -> None:
        """Positions of ``seq`` in ``[p0, p1)`` are divided by ``d`` (rounded down; ``has_shift``)."""
        seq = self._check_seq(seq)
        lo, hi = _bounds(p0, p1)
        d = as_int32(d, "d")
        if d < 1:
            raise kv_error(CODES["DIVISOR"], d)
        if d == 1 or lo == hi:
            return
        moved = self._moved(seq, lo, hi)
        for i in moved:
            if self.shift[i] + self.pos[i] // d - self.pos[i] < -2**31:
                raise kv_error(CODES["SHIFT_RANGE"], i, self.shift[i])
        for i in moved:
            self.has_shift = True
            new = self.pos[i] // d
            self.shift[i] += new - self.pos[i]   # how far the key moved (llama.cpp adds old - new: the wrong way)
            self.pos[i] = new

    def reset_shift(self) -> None:
        """The model rotated the keys: forget every pending shift."""
        self.shift = [0] * self.size
        self.has_shift = False

    def clear(self) -> None:
        """Every cell empty, ``head`` at 0."""
        for i in range(self.size):
            self._free(i)
        self.head = 0
        self.has_shift = False

    # -- the mask -----------------------------------------------------------------------------------

    def mask(self, pos: Any, seq_ids: Any, out: np.ndarray, sliding: bool = True) -> None:
        """Write the ubatch's attention mask into ``out`` ``[n_tokens, n_kv]`` float32: 0 where
        token t sees cell j — the cell holds the token's (first) sequence at a position not after
        the token's, and, when ``sliding`` and the table has a window, within it — else -inf."""
        positions, lists = self._tokens(pos, seq_ids)
        n_kv = check_mask_out(out, len(positions), self.size)
        swa_type = self.swa_type if sliding else "none"
        for t, (p1, ids) in enumerate(zip(positions, lists)):
            for j in range(n_kv):
                p0 = self.pos[j]
                visible = (p0 >= 0 and ids[0] in self.seqs[j] and p0 <= p1
                           and not is_masked_swa(self.n_swa, swa_type, p0, p1))
                out[t, j] = 0.0 if visible else -np.inf


def check_mask_out(out: Any, n_tokens: int, size: int) -> int:
    """The mask's width n_kv, after checking ``out`` is a writable C-contiguous float32
    ``[n_tokens, n_kv]`` array with ``1 <= n_kv <= size``."""
    if not isinstance(out, np.ndarray) or out.dtype != np.float32 or out.ndim != 2:
        raise E.ArgumentError("the mask must be a 2-D float32 numpy array")
    if not (out.flags.c_contiguous and out.flags.writeable):
        raise E.ArgumentError("the mask array must be C-contiguous and writable")
    if out.shape[0] != n_tokens or not 1 <= out.shape[1] <= size:
        raise E.ArgumentError(f"the mask has shape {out.shape}, expected ({n_tokens}, n_kv) with 1 <= n_kv <= {size}")
    return int(out.shape[1])
