"""The pure-Python reference implementation of SPEC.md, written for clarity.

Every operation is a literal transcription of the specification: cells are
Python lists and sets, and most operations scan every cell, exactly as
llama.cpp's ``llama_kv_cache_recurrent`` does.  It is the oracle the compiled
core is tested against and the baseline the benchmarks compare with; it is
never used as a silent fallback for a missing extension.
"""

from __future__ import annotations

import struct
from typing import Any, Iterator

import numpy as np

from ._config import Config, as_int, state_seq_id
from .batch import Batch
from .errors import ArgumentError, BatchError, CoreError, PositionError, RecurrentCacheError, SeqIdError
from .memory import MemoryStatus, Ubatch
from .state_format import (CacheShape, blob_view, parse_blob, read_rest, target_too_small, target_view,
                           write_all)

# Batch, MemoryStatus and RecurrentCacheError are re-exported so that this
# module can stand in for the package in code written against its API.
__all__ = ["RecurrentCache", "MemoryState", "split_batch", "Batch", "MemoryStatus", "RecurrentCacheError"]

POS_INF = 2**31 - 1  # llama_pos is int32: "p1 < 0" means this


def _range(p0: int, p1: int) -> tuple[int, int]:
    return (0 if p0 < 0 else p0), (POS_INF if p1 < 0 else p1)


class _Group:
    """A run of sorted tokens with identical seq-id lists (llama_sbatch_seq)."""

    def __init__(self, seq_ids: tuple[int, ...], offset: int, length: int) -> None:
        self.seq_ids = seq_ids
        self.offset = offset
        self.length = length


def split_batch(batch: Batch, n_ubatch: int, embd_pooled: bool) -> list[tuple[int, list[tuple[tuple[int, ...], list[int]]]]]:
    """Split a batch into ubatches (SPEC §3).

    Returns, per ubatch, ``(n_seq_tokens, [(seq_ids, token indices), ...])``
    with one entry per group.  ``batch.pos`` must already be resolved.
    """
    n = batch.n_tokens
    lists = [batch.seq_ids(i) for i in range(n)]
    pos = batch.pos.tolist()
    # 1. more seq ids first, then the lists element by element, then position
    ids = sorted(range(n), key=lambda i: (-len(lists[i]), lists[i], pos[i]))
    # 2. consecutive indices with identical lists form a group
    groups: list[_Group] = []
    for k, i in enumerate(ids):
        if groups and groups[-1].seq_ids == lists[i]:
            groups[-1].length += 1
        else:
            groups.append(_Group(lists[i], k, 1))
    # 3. fewer seq ids first, then longer first; consumed from the end
    groups.sort(key=lambda g: (len(g.seq_ids), -g.length))

    ubatches = []
    left = n
    while left > 0:
        while groups and groups[-1].length == 0:
            groups.pop()
        limit = min(left, n_ubatch)
        taken: list[tuple[tuple[int, ...], list[int]]] = []
        length = 0
        n_taken = 0
        for group in reversed(groups):
            if length == 0:
                length = min(group.length, limit)
            taken.append((group.seq_ids, ids[group.offset:group.offset + length]))
            group.offset += length
            group.length -= length
            n_taken += length
            if embd_pooled or len(group.seq_ids) > 1 or length + n_taken > limit:
                break
        left -= n_taken
        ubatches.append((length, taken))
    return ubatches


class MemoryState:
    """The state of one ``init_batch`` (or ``init_full``): ubatches and their placement."""

    def __init__(self, cache: "RecurrentCache", status: MemoryStatus,
                 ubatches: list[Ubatch] | None = None, out_ids: list[int] | None = None) -> None:
        self._cache = cache
        self.status = status
        self._ubatches = ubatches or []
        self._out_ids = out_ids or []
        self._i = 0
        self._full = ubatches is None and status == MemoryStatus.SUCCESS
        self.head = 0 if self._full else -1
        self.n_kv = cache.size if self._full else 0
        self.copy_src = np.arange(self.n_kv, dtype=np.int32)
        self.zero = np.zeros(self.n_kv, dtype=bool)
        self._applied = self._full

    @property
    def n_ubatches(self) -> int:
        return len(self._ubatches)

    @property
    def ubatch(self) -> Ubatch:
        return self._ubatches[self._i]

    def apply(self) -> bool:
        if self._full:
            return True
        if self.status != MemoryStatus.SUCCESS:
            raise CoreError(f"apply() on a state whose status is {self.status.name}")
        ub = self.ubatch
        if not self._cache._find_slot(ub):
            raise CoreError("find_slot failed for a prepared ubatch")
        self.head, self.n_kv = self._cache.head, self._cache.n
        self.copy_src, self.zero = self._cache._copy_plan()
        self._cache._apply_plan(self.head, self.copy_src, self.zero)
        self._applied = True
        return True

    def next(self) -> bool:
        if self._full:
            return False
        self._i += 1
        self._applied = False
        if self._i >= len(self._ubatches):
            self._i = len(self._ubatches) - 1
            return False
        return True

    def r(self, il: int) -> np.ndarray:
        return self._cache.r[il][self.head:self.head + self._rows()]

    def s(self, il: int) -> np.ndarray:
        return self._cache.s[il][self.head:self.head + self._rows()]

    def _rows(self) -> int:
        return self.n_kv if self._full else self.ubatch.n_seqs

    @property
    def out_ids(self) -> np.ndarray:
        return np.array(self._out_ids, dtype=np.int64)

    def __iter__(self) -> Iterator[Ubatch]:
        if self.status != MemoryStatus.SUCCESS or self._full:
            return
        while True:
            self.apply()
            yield self.ubatch
            if not self.next():
                return


class RecurrentCache:
    """Recurrent-state cache: cells, sequences and per-layer state tensors."""

    def __init__(self, n_layer: int, n_embd_r: int, n_embd_s: int, n_seq_max: int = 1,
                 size: int | None = None, dtype_r: str = "f32", dtype_s: str = "f32") -> None:
        self._config = Config.check(n_layer, n_embd_r, n_embd_s, n_seq_max, size, dtype_r, dtype_s)
        r, s = self._config.allocate()
        self.r, self.s = tuple(r), tuple(s)
        size = self._config.size
        self._pos = [-1] * size
        self._src = [-1] * size
        self._tail = [-1] * size
        self._seq_ids: list[set[int]] = [set() for _ in range(size)]
        self.head = 0
        self.used = 0
        self.n = 0

    size = property(lambda self: self._config.size)
    n_seq_max = property(lambda self: self._config.n_seq_max)
    n_layer = property(lambda self: self._config.n_layer)
    n_embd_r = property(lambda self: self._config.n_embd_r)
    n_embd_s = property(lambda self: self._config.n_embd_s)
    dtype_r = property(lambda self: self._config.dtype_r.name)
    dtype_s = property(lambda self: self._config.dtype_s.name)

    # -- cells ---------------------------------------------------------------

    def cell(self, i: int) -> tuple[int, int, int, tuple[int, ...]]:
        i = as_int(i, "cell index")
        if not 0 <= i < self.size:
            raise SeqIdError(f"cell index {i} out of range [0, {self.size})")
        return self._pos[i], self._src[i], self._tail[i], tuple(sorted(self._seq_ids[i]))

    def _free(self, c: int) -> None:
        self._pos[c] = -1
        self._src[c] = -1
        self.used -= 1

    def _leave(self, seq: int) -> None:
        """Remove ``seq`` from its tail cell, freeing the cell if it empties."""
        c = self._tail[seq]
        if c < 0:
            return
        self._seq_ids[c].discard(seq)
        self._tail[seq] = -1
        if not self._seq_ids[c]:
            self._free(c)

    def check(self) -> None:
        """Raise CoreError if an invariant of SPEC §1 is broken."""
        holder = [-1] * self.size
        for c in range(self.size):
            if not self._seq_ids[c] and (self._pos[c] != -1 or self._src[c] != -1):
                raise CoreError(f"empty cell {c} has pos {self._pos[c]} / src {self._src[c]}")
            for seq in self._seq_ids[c]:
                if not 0 <= seq < self.size:
                    raise CoreError(f"cell {c} holds seq {seq} outside [0, {self.size})")
                if holder[seq] != -1:
                    raise CoreError(f"seq {seq} is in cells {holder[seq]} and {c}")
                holder[seq] = c
        for seq in range(self.size):
            if holder[seq] != self._tail[seq]:
                raise CoreError(f"tail of seq {seq} is {self._tail[seq]}, but it is in cell {holder[seq]}")
        used = sum(1 for ids in self._seq_ids if ids)
        if used != self.used:
            raise CoreError(f"used is {self.used}, but {used} cells are not empty")

    # -- operations (SPEC §1) -----------------------------------------------

    def clear(self) -> None:
        for c in range(self.size):
            self._pos[c] = self._src[c] = self._tail[c] = -1
            self._seq_ids[c].clear()
        self.head = self.used = 0
        for tensor in self.r + self.s:
            tensor[...] = 0

    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> bool:
        seq, p0, p1 = as_int(seq, "seq"), as_int(p0, "p0"), as_int(p1, "p1")
        p0, p1 = _range(p0, p1)
        if seq >= self.size:
            return False
        if seq >= 0:
            t = self._tail[seq]
            if t >= 0:
                pos = self._pos[t]
                if (0 < p0 <= pos) or (0 < p1 <= pos):
                    return False
        elif p0 != p1 and (p0 != 0 or p1 != POS_INF):
            return False
        new_head = self.size
        for c in range(self.size):
            if not p0 <= self._pos[c] < p1:
                continue
            if seq < 0:
                for member in self._seq_ids[c]:
                    self._tail[member] = -1  # FIX: the reference leaves these dangling
                self._seq_ids[c].clear()
            elif seq in self._seq_ids[c]:
                self._seq_ids[c].discard(seq)
                self._tail[seq] = -1
            else:
                continue
            if not self._seq_ids[c]:
                self._free(c)
                new_head = min(new_head, c)
        if new_head < self.head:
            self.head = new_head
        return True

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        src, dst = as_int(src, "src"), as_int(dst, "dst")
        as_int(p0, "p0"), as_int(p1, "p1")
        if src == dst or not (0 <= src < self.size and 0 <= dst < self.size):
            return
        self._leave(dst)
        t = self._tail[src]
        if t >= 0:
            self._seq_ids[t].add(dst)
            self._tail[dst] = t

    def _check_seq(self, seq: int, op: str) -> int:
        seq = as_int(seq, "seq")
        if not 0 <= seq < self.size:
            raise SeqIdError(f"{op}: seq_id {seq} is out of range [0, {self.size})")
        return seq

    def seq_keep(self, seq: int) -> None:
        seq = self._check_seq(seq, "seq_keep")
        new_head = self.size
        for c in range(self.size):
            if c != seq:
                self._tail[c] = -1
            if seq in self._seq_ids[c]:
                self._seq_ids[c] = {seq}
            else:
                if self._seq_ids[c]:
                    self._seq_ids[c].clear()
                    self._free(c)
                new_head = min(new_head, c)
        if new_head < self.head:
            self.head = new_head

    def _tail_cell_in_range(self, seq: int, p0: int, p1: int) -> int:
        p0, p1 = _range(p0, p1)
        t = self._tail[seq]
        if p0 == p1 or t < 0 or not p0 <= self._pos[t] < p1:
            return -1
        return t

    def seq_add(self, seq: int, p0: int, p1: int, shift: int) -> None:
        seq = self._check_seq(seq, "seq_add")
        p0, p1, shift = as_int(p0, "p0"), as_int(p1, "p1"), as_int(shift, "shift")
        t = self._tail_cell_in_range(seq, p0, p1)
        if shift == 0 or t < 0:
            return
        new_pos = self._pos[t] + shift
        if new_pos < 0:
            raise PositionError(f"seq_add: seq {seq} at pos {self._pos[t]} shifted by {shift} "
                                f"gives negative position {new_pos}")
        if new_pos >= POS_INF:
            raise PositionError(f"seq_add: position {new_pos} overflows int32")
        self._pos[t] = new_pos

    def seq_div(self, seq: int, p0: int, p1: int, d: int) -> None:
        seq = self._check_seq(seq, "seq_div")
        p0, p1, d = as_int(p0, "p0"), as_int(p1, "p1"), as_int(d, "d")
        if d <= 0:
            raise ArgumentError(f"seq_div: divisor d must be positive, got {d}")
        t = self._tail_cell_in_range(seq, p0, p1)
        if d == 1 or t < 0:
            return
        self._pos[t] //= d  # pos >= 0 here, so floor division is C truncation

    def seq_pos_min(self, seq: int) -> int:
        seq = as_int(seq, "seq")
        found = [self._pos[c] for c in range(self.size) if seq in self._seq_ids[c]]
        return min(found) if found else -1

    def seq_pos_max(self, seq: int) -> int:
        seq = as_int(seq, "seq")
        found = [self._pos[c] for c in range(self.size) if seq in self._seq_ids[c]]
        return max(found) if found else -1

    # -- find_slot (SPEC §2) -------------------------------------------------

    def _next_empty(self, start: int) -> int:
        for k in range(self.size):
            c = (start + k) % self.size
            if not self._seq_ids[c]:
                return c
        return -1

    def _find_slot(self, ub: Ubatch) -> bool:
        n_seqs = ub.n_seqs
        if self.head > self.used + 2 * ub.n_tokens:
            self.head = 0
        for ids in ub.seq_id:
            for seq in ids:
                if not 0 <= seq < self.size:
                    return False
        for ids in ub.seq_id:
            for seq in ids[1:]:
                self._leave(seq)
        next_empty = self._next_empty(self.head)
        lo, hi = self.size - 1, 0
        for s, ids in enumerate(ub.seq_id):
            owner = ids[0]
            t = self._tail[owner]
            if not (t >= 0 and len(self._seq_ids[t]) == 1):
                if next_empty < 0:
                    return False
                if t >= 0:
                    self._pos[next_empty], self._src[next_empty] = self._pos[t], self._src[t]
                    self._seq_ids[t].discard(owner)
                    self._seq_ids[next_empty].add(owner)
                t = self._tail[owner] = next_empty
                if s + 1 < n_seqs:
                    next_empty = self._next_empty(next_empty + 1)
            lo, hi = min(lo, t), max(hi, t)
        # gather: group s must end up in cell lo + s
        for s, ids in enumerate(ub.seq_id):
            dst, src = lo + s, self._tail[ids[0]]
            if dst == src:
                continue
            self._pos[dst], self._pos[src] = self._pos[src], self._pos[dst]
            self._src[dst], self._src[src] = self._src[src], self._src[dst]
            self._seq_ids[dst], self._seq_ids[src] = self._seq_ids[src], self._seq_ids[dst]
            for seq in range(self.size):  # FIX: every tail, not just the assumed ones
                if self._tail[seq] == dst:
                    self._tail[seq] = src
                elif self._tail[seq] == src:
                    self._tail[seq] = dst
        for s, ids in enumerate(ub.seq_id):
            c = lo + s
            self._pos[c] = int(ub.pos[s * ub.n_seq_tokens + ub.n_seq_tokens - 1])
            self._seq_ids[c] = set(ids)
            for seq in ids:
                self._tail[seq] = c
        self.head = lo
        self.n = hi - lo + 1
        self.used = sum(1 for ids in self._seq_ids if ids)
        return self.n >= n_seqs

    def _copy_plan(self) -> tuple[np.ndarray, np.ndarray]:
        copy_src = np.empty(self.n, dtype=np.int32)
        zero = np.empty(self.n, dtype=bool)
        for i in range(self.n):
            c = self.head + i
            copy_src[i] = self._src[c] if self._src[c] >= 0 else c
            zero[i] = self._src[c] < 0
            if self._seq_ids[c]:
                self._src[c] = c
        return copy_src, zero

    def _apply_plan(self, head: int, copy_src: np.ndarray, zero: np.ndarray) -> None:
        rows = np.arange(head, head + copy_src.shape[0])
        for tensor in self.r + self.s:
            tensor[rows] = tensor[copy_src]  # fancy indexing reads everything first
            tensor[rows[zero]] = 0

    # -- batches (SPEC §3) ---------------------------------------------------

    def _check_batch(self, batch: Batch, n_ubatch: object) -> int:
        if not isinstance(batch, Batch):
            raise BatchError(f"init_batch takes a Batch, got {type(batch).__name__}")
        if isinstance(n_ubatch, bool) or not isinstance(n_ubatch, (int, np.integer)) or n_ubatch < 1:
            raise BatchError(f"n_ubatch must be an integer >= 1, got {n_ubatch!r}")
        for i in range(batch.n_tokens):
            for seq in batch.seq_ids(i):
                if not 0 <= seq < self.size:
                    raise SeqIdError(f"token {i}: seq_id {seq} is out of range [0, {self.size}) "
                                     f"(cache size {self.size})")
        return int(n_ubatch)

    def _resolve_pos(self, batch: Batch) -> np.ndarray:
        if batch.pos is not None:
            return batch.pos
        start = self.seq_pos_max(0) + 1
        return np.arange(start, start + batch.n_tokens, dtype=np.int32)

    def _check_positions(self, batch: Batch, pos: list[int]) -> None:
        by_seq: dict[int, list[int]] = {}
        for i in range(batch.n_tokens):
            if pos[i] < 0:
                raise PositionError(f"token {i} has negative position {pos[i]}")
            for seq in batch.seq_ids(i):
                by_seq.setdefault(seq, []).append(pos[i])
        for seq, seen in by_seq.items():
            distinct = sorted(set(seen))
            if len(distinct) != len(seen) or distinct[-1] - distinct[0] + 1 != len(distinct):
                raise PositionError(f"sequence {seq} has non-consecutive positions in the batch: "
                                    f"{sorted(seen)}")
            cached = self.seq_pos_max(seq)
            if cached >= 0 and distinct[0] != cached + 1:
                raise PositionError(f"sequence {seq} continues at position {distinct[0]}, "
                                    f"but its cached state is at position {cached}")

    def _check_ubatch_positions(self, ubatches: list[Ubatch]) -> None:
        """Walk the ubatches as find_slot will and reject any position jump."""
        last = {seq: self.seq_pos_max(seq) for ub in ubatches for ids in ub.seq_id for seq in ids}
        for ub in ubatches:
            for s, ids in enumerate(ub.seq_id):
                owner = ids[0]
                new_pos = int(ub.pos[(s + 1) * ub.n_seq_tokens - 1])
                if last[owner] >= 0 and new_pos != last[owner] + ub.n_seq_tokens:
                    raise PositionError(
                        f"find_slot: non-consecutive token position {new_pos} after {last[owner]} "
                        f"for sequence {owner} with {ub.n_seq_tokens} new tokens")
                for seq in ids:
                    last[seq] = new_pos

    def _make_ubatches(self, batch: Batch, pos: np.ndarray, n_ubatch: int, embd_pooled: bool,
                       logits_all: bool) -> tuple[list[Ubatch], list[int]]:
        resolved = Batch.__new__(Batch)
        for name in Batch.__slots__:
            setattr(resolved, name, getattr(batch, name))
        resolved.pos = pos
        ubatches = []
        out_ids: list[int] = []
        for n_seq_tokens, groups in split_batch(resolved, n_ubatch, embd_pooled):
            index = np.array([i for _, members in groups for i in members], dtype=np.int64)
            if logits_all:
                output = np.ones(index.shape[0], dtype=bool)
            elif batch.logits is not None:
                output = batch.logits[index] != 0
            else:
                output = index == batch.n_tokens - 1
            out_ids.extend(index[output].tolist())
            ubatches.append(Ubatch(
                n_tokens=index.shape[0], n_seq_tokens=n_seq_tokens, n_seqs=len(groups),
                token=None if batch.token is None else batch.token[index],
                embd=None if batch.embd is None else batch.embd[index],
                pos=pos[index], seq_id=tuple(ids for ids, _ in groups),
                output=output, batch_index=index))
        return ubatches, out_ids

    def _place_sequence(self, seq: int, pos: int) -> int:
        """Give ``seq`` (holding no cell) a cell of its own at ``pos``; returns its row."""
        seq, pos = as_int(seq, "seq"), as_int(pos, "pos")
        if not 0 <= seq < self.size or self._tail[seq] >= 0:
            raise SeqIdError(f"place seq {seq} at pos {pos}: a seq id is outside the cache")
        if not 0 <= pos < POS_INF:
            raise PositionError(f"place seq {seq} at pos {pos}: the position would leave [0, 2**31 - 1)")
        ub = Ubatch(n_tokens=1, n_seq_tokens=1, n_seqs=1, token=None, embd=None,
                    pos=np.array([pos], dtype=np.int32), seq_id=((seq,),), output=np.zeros(1, dtype=bool),
                    batch_index=np.zeros(1, dtype=np.int64))
        if not self._find_slot(ub):
            raise CoreError(f"place seq {seq} at pos {pos}: find_slot: no free cell left for a sequence")
        self._src[self.head] = self.head
        return self.head

    def _prepare(self, ubatches: list[Ubatch]) -> bool:
        saved = (self._pos[:], self._src[:], self._tail[:], [set(ids) for ids in self._seq_ids],
                 self.head, self.used, self.n)
        try:
            return all(self._find_slot(ub) for ub in ubatches)
        finally:
            (self._pos, self._src, self._tail, self._seq_ids, self.head, self.used, self.n) = saved

    def init_batch(self, batch: Batch, n_ubatch: int = 512, embd_pooled: bool = False,
                   logits_all: bool = False) -> MemoryState:
        n_ubatch = self._check_batch(batch, n_ubatch)
        pos = self._resolve_pos(batch)
        self._check_positions(batch, pos.tolist())
        ubatches, out_ids = self._make_ubatches(batch, pos, n_ubatch, bool(embd_pooled), bool(logits_all))
        self._check_ubatch_positions(ubatches)
        if not self._prepare(ubatches):
            return MemoryState(self, MemoryStatus.FAILED_PREPARE, [], [])
        return MemoryState(self, MemoryStatus.SUCCESS, ubatches, out_ids)

    def init_full(self) -> MemoryState:
        return MemoryState(self, MemoryStatus.SUCCESS)

    # -- state serialisation (SPEC §5) ---------------------------------------

    def _shape(self) -> CacheShape:
        n_layer, config = self.n_layer, self._config
        return CacheShape(
            size=self.size, n_layer=n_layer,
            type_ids=(config.dtype_r.ggml_type,) * n_layer + (config.dtype_s.ggml_type,) * n_layer,
            row_bytes=tuple(tensor.shape[1] * tensor.itemsize for tensor in self.r + self.s))

    def _state_parts(self, seq_id: int) -> list[Any]:
        """The blob of ``state_write(seq_id)`` in pieces: headers, then the rows range by range."""
        if seq_id == -1:
            cells = [c for c in range(self.size) if self._seq_ids[c]]
        else:
            cells = [c for c in range(self.size) if seq_id in self._seq_ids[c]]
        ranges: list[list[int]] = []   # runs of consecutive cells, [begin, end)
        for c in cells:
            if ranges and ranges[-1][1] == c:
                ranges[-1][1] = c + 1
            else:
                ranges.append([c, c + 1])
        parts: list[Any] = [struct.pack("<I", len(cells))]
        for c in cells:
            ids = sorted(self._seq_ids[c]) if seq_id == -1 else []
            parts.append(struct.pack(f"<iI{len(ids)}i", self._pos[c], len(ids), *ids))
        shape = self._shape()
        parts.append(struct.pack("<II", 0, self.n_layer))   # v_trans = 0
        for k, tensor in enumerate(self.r + self.s):
            parts.append(struct.pack("<iQ", shape.type_ids[k], shape.row_bytes[k]))
            rows = tensor.view(np.uint8)
            parts.extend(rows[begin:end].reshape(-1) for begin, end in ranges)
        return parts

    def state_size(self, seq_id: int = -1) -> int:
        """Length of ``state_write(seq_id)``."""
        seq_id = state_seq_id(seq_id, self.size, "state_size")
        return sum(memoryview(part).nbytes for part in self._state_parts(seq_id))

    def state_write(self, seq_id: int = -1) -> bytes:
        """The non-empty cells (``seq_id = -1``) or the cell of ``seq_id``, their rows after them."""
        return b"".join(self._state_parts(state_seq_id(seq_id, self.size, "state_write")))

    def state_write_into(self, target: Any, seq_id: int = -1) -> int:
        """``state_write`` into a writable buffer (from its start) or a binary file; returns the length."""
        parts = self._state_parts(state_seq_id(seq_id, self.size, "state_write_into"))
        length = sum(memoryview(part).nbytes for part in parts)
        view = target_view(target)
        if view is None:
            for part in parts:
                write_all(target, part)
            return length
        if len(view) < length:
            raise target_too_small(len(view), length)
        offset = 0
        for part in parts:
            part_bytes = memoryview(part).cast("B")
            view[offset:offset + len(part_bytes)] = part_bytes
            offset += len(part_bytes)
        return length

    def state_read(self, data: Any, seq_id: int = -1) -> int:
        """Check the whole blob, then replace the cache (``-1``) or sequence ``seq_id`` with it."""
        seq_id = state_seq_id(seq_id, self.size, "state_read")
        data = blob_view(data)
        blob = parse_blob(data, self._shape(), seq_id)   # every check, before any change
        if seq_id == -1:
            # the whole cache: blob cell i becomes cell i, with its own row
            self.clear()
            for i, cell in enumerate(blob.cells):
                self._pos[i] = cell.pos
                self._src[i] = i
                self._seq_ids[i] = set(cell.seq_ids)
                for seq in cell.seq_ids:
                    self._tail[seq] = i
            self.used = blob.cell_count
            self.head = 0
        else:
            # one sequence: removed, then placed as one group by find_slot
            self.seq_rm(seq_id, -1, -1)
            if blob.cell_count == 0:
                return blob.n_bytes
            pos = np.array([blob.cells[0].pos], dtype=np.int32)
            ub = Ubatch(n_tokens=1, n_seq_tokens=1, n_seqs=1, token=None, embd=None, pos=pos,
                        seq_id=((seq_id,),), output=np.zeros(1, dtype=bool),
                        batch_index=np.zeros(1, dtype=np.int64))
            if not self._find_slot(ub):   # cannot happen: the sequence left every cell
                raise CoreError(f"state_read: find_slot failed for seq {seq_id}")
            self._src[self.head] = self.head
        for k, tensor in enumerate(self.r + self.s):
            tensor.view(np.uint8)[self.head:self.head + blob.cell_count] = blob.rows(data, blob.tensors[k])
        return blob.n_bytes

    def state_read_from(self, file: Any, seq_id: int = -1) -> int:
        """``state_read`` of everything from a binary file's position to its end."""
        seq_id = state_seq_id(seq_id, self.size, "state_read_from")
        return self.state_read(read_rest(file), seq_id)

    def __repr__(self) -> str:
        return (f"reference.RecurrentCache(size={self.size}, used={self.used}, head={self.head}, "
                f"n_layer={self.n_layer}, n_embd_r={self.n_embd_r}, n_embd_s={self.n_embd_s}, "
                f"dtype_r={self.dtype_r!r}, dtype_s={self.dtype_s!r})")
