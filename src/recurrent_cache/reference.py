"""The reference engine: docs/concepts.md in plain Python, written to be read next to it.

Every operation is a literal transcription of the specification: cells are
Python lists and sets, and most operations scan every cell, exactly as
llama.cpp's ``llama_kv_cache_recurrent`` does.  It has the compiled engine's
interface (``MemoryCore``, ``split_batch`` → ``Placement``; ``_engines.Engine``)
and reports failures with the same codes and values, so the facade above both
gives the same exceptions and messages.  It is the oracle the compiled engine
is tested against and the baseline the benchmarks compare with; select it with
``RecurrentCache(..., engine="reference")`` or ``RECURRENT_CACHE_IMPL=reference``.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

from . import errors as E
from .errors import engine_error
from .formats.blob import parse_blob
from .formats.dtypes import GGML_TYPES
from .formats.geometry import Geometry
from .formats.layouts import CELL, CELL_COUNT, DATA_HEADER, TENSOR_HEADER
from .formats.messages import target_aliases_cache, target_too_small
from .formats.streams import write_all
from .storage import Storage, Tensor

__all__ = ["MemoryCore", "Placement", "split_batch"]

POS_INF = E.POS_MAX  # llama_pos is int32: "p1 < 0" means this


def _range(p0: int, p1: int) -> tuple[int, int]:
    return (0 if p0 < 0 else p0), (POS_INF if p1 < 0 else p1)


def _address(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).__array_interface__["data"][0]) if len(view) else 0


# -- cells (docs/concepts.md §1, §2) ------------------------------------------------------------------------

class MemoryCore:
    """A cache's memory: ``size`` cells over the state tensors — r of each of ``layers`` (the
    layers with state, of the model's ``n_layer``), then their s — their rollback history, and
    ``generation``, bumped by every change.

    The only code that changes them: every changing method first files the step states
    the model wrote for the last applied ubatch (``_file_steps``), then bumps ``generation``.
    """

    self_check = False   # the compiled core's debug builds check every placement; this one is read

    def __init__(self, size: int, tensors: list[np.ndarray], n_rollback: int, type_ids: list[int], n_layer: int,
                 layers: tuple[int, ...], storage: Storage) -> None:
        self.size = size
        self.tensors = tensors   # host views of the storage's tensors, one per layer with state: r, then s
        self.storage = storage
        self.type_ids = tuple(type_ids)
        self.n_layer = n_layer
        self.layers = layers
        self.generation = 0
        # rollback history (docs/rollback.md): history[k][c, q % n_rollback] is the state after position q
        # of cell c's tensor k, when tags[c, q % n_rollback] == q + 1 (0 = empty slot)
        self.n_rollback = n_rollback
        self.rollback_history = ([np.zeros((size, n_rollback, t.shape[1]), dtype=t.dtype) for t in tensors]
                                 if n_rollback else [])
        self.tags = np.zeros((size, n_rollback), dtype=np.int32)
        # where the model writes a ubatch's step states: tensors of the storage (the model writes them as it
        # writes the cells' rows, torch ones on torch) and their host views, which the filing reads
        self.step_scratch: list[Tensor] = []
        self.step_host: list[np.ndarray] = []
        self._allocate_steps(0)
        # which ubatch the step states are still to be filed for
        self.pending: tuple[int, int, list[int]] | None = None   # head, m, each group's last position
        self.pos = [-1] * size
        self.src = [-1] * size
        self.tail = [-1] * size
        self.seq_ids: list[set[int]] = [set() for _ in range(size)]
        self.head = 0
        self.used = 0
        self.n = 0

    def cell(self, i: int) -> tuple[int, int, int, tuple[int, ...]]:
        """(pos, src, tail, sorted seq ids) of cell i."""
        if not 0 <= i < self.size:
            raise engine_error(E.CELL_INDEX, what="cell", index=i, size=self.size)
        return self.pos[i], self.src[i], self.tail[i], tuple(sorted(self.seq_ids[i]))

    def check(self) -> str | None:
        """None, or the first broken invariant of docs/concepts.md §1."""
        holder = [-1] * self.size
        for c in range(self.size):
            if not self.seq_ids[c] and (self.pos[c] != -1 or self.src[c] != -1):
                return f"empty cell {c} has pos {self.pos[c]} / src {self.src[c]}"
            for seq in self.seq_ids[c]:
                if not 0 <= seq < self.size:
                    return f"cell {c} holds a seq outside [0, {self.size})"
                if holder[seq] != -1:
                    return f"seq {seq} is in cells {holder[seq]} and {c}"
                holder[seq] = c
        for seq in range(self.size):
            if holder[seq] != self.tail[seq]:
                return f"tail of seq {seq} is {self.tail[seq]}, but it is in cell {holder[seq]}"
        used = sum(1 for ids in self.seq_ids if ids)
        if used != self.used:
            return f"used is {self.used}, but {used} cells are not empty"
        return None

    def _free(self, c: int) -> None:
        self.pos[c] = -1
        self.src[c] = -1
        self.used -= 1

    def _leave(self, seq: int) -> None:
        """Remove ``seq`` from its tail cell, freeing the cell if it empties."""
        c = self.tail[seq]
        if c < 0:
            return
        self.seq_ids[c].discard(seq)
        self.tail[seq] = -1
        if not self.seq_ids[c]:
            self._free(c)

    # -- step states (docs/rollback.md)

    def steps(self, n_seq_tokens: int) -> int:
        """m: the states the model writes per group, after tokens n_seq_tokens - 1 - m .. n_seq_tokens - 2."""
        return min(self.n_rollback, n_seq_tokens - 1) if self.n_rollback else 0

    def _allocate_steps(self, rows: int) -> None:
        """New step scratch of ``rows`` rows per tensor (a view the model still holds of the old one
        stays valid)."""
        self.step_scratch = [self.storage.allocate((rows, t.shape[1]), GGML_TYPES[type_id])
                             for t, type_id in zip(self.tensors, self.type_ids)]
        host = [self.storage.host_view(t) for t in self.step_scratch]
        self.step_host = [view for view in host if view is not None]   # a host storage: every one

    def step_rows(self, k: int, n_seqs: int, m: int) -> Tensor:
        """[n_seqs, m, n_embd]: where the model writes tensor k's step states (of the cache's storage)."""
        scratch = self.step_scratch[k]
        return scratch[:n_seqs * m].reshape(n_seqs, m, scratch.shape[1])

    def _file_steps(self) -> None:
        """File the step states of the last applied ubatch into its cells' histories."""
        if self.pending is None:
            return
        head, m, last_pos = self.pending
        self.pending = None
        for g, last in enumerate(last_pos):
            for j in range(m):
                q = last - m + j                    # the state after position q
                for k, history in enumerate(self.rollback_history):
                    history[head + g, q % self.n_rollback] = self.step_host[k][g * m + j]
                self.tags[head + g, q % self.n_rollback] = q + 1

    def history(self) -> tuple[np.ndarray, list[np.ndarray]]:
        """Copies of ``(tags, [history of tensor k, ...])``."""
        self._file_steps()
        return self.tags.copy(), [history.copy() for history in self.rollback_history]

    # -- operations (docs/concepts.md §1)

    def clear(self) -> None:
        self.pending = None   # the rows it would file into are gone
        self.generation += 1
        for c in range(self.size):
            self.pos[c] = self.src[c] = self.tail[c] = -1
            self.seq_ids[c].clear()
        self.head = self.used = 0
        for tensor in self.tensors:
            tensor[...] = 0
        self.tags[...] = 0

    def seq_rm(self, seq: int, p0: int, p1: int) -> bool:
        self._file_steps()
        pos = self.seq_pos_max(seq) if self.n_rollback and 0 <= seq < self.size else -1
        if 0 < p0 <= pos and (p1 < 0 or p1 > pos):
            removed = self._rollback(seq, p0 - 1)   # docs/rollback.md: back to the state after p0 - 1
        else:
            removed = self._remove(seq, p0, p1)
        if removed:
            self.generation += 1
        return removed

    def _remove(self, seq: int, p0: int, p1: int) -> bool:
        p0, p1 = _range(p0, p1)
        if seq >= self.size:
            return False
        if seq >= 0:
            t = self.tail[seq]
            if t >= 0:
                pos = self.pos[t]
                if (0 < p0 <= pos) or (0 < p1 <= pos):
                    return False
        elif p0 != p1 and (p0 != 0 or p1 != POS_INF):
            return False
        new_head = self.size
        for c in range(self.size):
            if not p0 <= self.pos[c] < p1:
                continue
            if seq < 0:
                for member in self.seq_ids[c]:
                    self.tail[member] = -1  # FIX: the reference leaves these dangling
                self.seq_ids[c].clear()
            elif seq in self.seq_ids[c]:
                self.seq_ids[c].discard(seq)
                self.tail[seq] = -1
            else:
                continue
            if not self.seq_ids[c]:
                self._free(c)
                new_head = min(new_head, c)
        if new_head < self.head:
            self.head = new_head
        return True

    def seq_cp(self, src: int, dst: int) -> None:
        self._file_steps()
        self.generation += 1
        if src == dst or not (0 <= src < self.size and 0 <= dst < self.size):
            return
        self._leave(dst)
        t = self.tail[src]
        if t >= 0:
            self.seq_ids[t].add(dst)
            self.tail[dst] = t

    def seq_keep(self, seq: int) -> int:
        self._file_steps()
        if not 0 <= seq < self.size:
            return E.SEQ_RANGE  # llama.cpp would empty every cell
        self.generation += 1
        new_head = self.size
        for c in range(self.size):
            if c != seq:
                self.tail[c] = -1
            if seq in self.seq_ids[c]:
                self.seq_ids[c] = {seq}
            else:
                if self.seq_ids[c]:
                    self.seq_ids[c].clear()
                    self._free(c)
                new_head = min(new_head, c)
        if new_head < self.head:
            self.head = new_head
        return E.OK

    def _tail_cell_in_range(self, seq: int, p0: int, p1: int) -> int:
        p0, p1 = _range(p0, p1)
        t = self.tail[seq]
        if p0 == p1 or t < 0 or not p0 <= self.pos[t] < p1:
            return -1
        return t

    def seq_add(self, seq: int, p0: int, p1: int, shift: int) -> int:
        self._file_steps()
        if not 0 <= seq < self.size:
            return E.SEQ_RANGE
        t = self._tail_cell_in_range(seq, p0, p1)
        if t >= 0 and shift != 0 and not 0 <= self.pos[t] + shift < POS_INF:
            return E.POSITION
        self.generation += 1
        if shift == 0 or t < 0:
            return E.OK
        self.pos[t] += shift  # the cell's pos: every sequence sharing it moves too
        self.tags[t] = 0      # and its history no longer matches its positions
        return E.OK

    def seq_div(self, seq: int, p0: int, p1: int, d: int) -> int:
        self._file_steps()
        if not 0 <= seq < self.size:
            return E.SEQ_RANGE
        if d <= 0:
            return E.ARGUMENT
        self.generation += 1
        t = self._tail_cell_in_range(seq, p0, p1)
        if d != 1 and t >= 0:
            self.pos[t] //= d  # pos >= 0 here, so floor division is C truncation
            self.tags[t] = 0
        return E.OK

    def seq_pos_min(self, seq: int) -> int:
        found = [self.pos[c] for c in range(self.size) if seq in self.seq_ids[c]]
        return min(found) if found else -1

    def seq_pos_max(self, seq: int) -> int:
        found = [self.pos[c] for c in range(self.size) if seq in self.seq_ids[c]]
        return max(found) if found else -1

    def seq_cell(self, seq: int) -> int:
        """The cell holding ``seq``, or -1."""
        return self.tail[seq]

    # -- rollback (docs/rollback.md)

    def _held(self, cell: int) -> list[int]:
        """The positions whose states cell's history holds, within its window [pos - n, pos - 1]."""
        pos = self.pos[cell]
        return [q for q in (int(t) - 1 for t in self.tags[cell]) if 0 <= q and pos - self.n_rollback <= q < pos]

    def rollback_min(self, seq: int) -> int:
        self._file_steps()
        if not self.n_rollback or not 0 <= seq < self.size or self.tail[seq] < 0:
            return -1
        held = self._held(self.tail[seq])
        return min(held) if held else -1

    def _rollback(self, seq: int, q: int) -> bool:
        """Make ``seq``'s state the state after ``q``; a shared cell is copied first (copy on write)."""
        if not self.n_rollback or not 0 <= seq < self.size or self.tail[seq] < 0:
            return False
        cell = self.tail[seq]
        if q not in self._held(cell):
            return False
        target = cell
        if len(self.seq_ids[cell]) > 1:
            target = self._next_empty(self.head)
            if target < 0:
                return False
            self.seq_ids[cell].discard(seq)
            self.seq_ids[target] = {seq}
            self.tail[seq] = target
            self.used += 1
            self.src[target] = target
            for history in self.rollback_history:     # the branch keeps the history it had
                history[target] = history[cell]
            self.tags[target] = self.tags[cell]
        slot = q % self.n_rollback
        for tensor, history in zip(self.tensors, self.rollback_history):
            tensor[target] = history[cell, slot]
        self.pos[target] = q
        self.tags[target][self.tags[target] > q] = 0   # states after q and later are gone
        return True

    def restore(self, seq: int, pos: int, rows: list[np.ndarray]) -> int:
        """``seq`` (in no cell) takes a cell of its own at ``pos`` holding ``rows`` (one per tensor,
        byte for byte), its history cleared: a one-cell state_read.  Every condition is checked
        before anything changes; the cell, or a negative code."""
        copies = [np.ascontiguousarray(row).reshape(-1).view(np.uint8).copy() for row in rows]   # may be ours
        if len(copies) != len(self.tensors) or any(row.nbytes != t.shape[1] * t.itemsize
                                                   for row, t in zip(copies, self.tensors)):
            raise ValueError("one row per tensor, of the tensor's row size")
        if not 0 <= seq < self.size:
            return E.SEQ_RANGE
        if self.tail[seq] >= 0:
            return E.SEQ_HAS_CELL
        if not 0 <= pos < POS_INF:
            return E.POSITION
        if self.used >= self.size:
            return E.NO_FREE_CELL
        self._file_steps()
        self.generation += 1
        code = self._find_slot([(seq,)], [pos], 1)
        if code:
            return code
        cell = self.head
        self.src[cell] = cell
        for tensor, row in zip(self.tensors, copies):
            tensor.view(np.uint8)[cell] = row
        self.tags[cell] = 0   # another sequence's past is not this one's
        return cell

    # -- find_slot (docs/concepts.md §2)

    def _next_empty(self, start: int) -> int:
        for k in range(self.size):
            c = (start + k) % self.size
            if not self.seq_ids[c]:
                return c
        return -1

    def prepare(self, ubatches: list[tuple[list[tuple[int, ...]], list[int], int]]) -> int:
        """Place every ubatch ``(groups, last_pos, n_tokens)`` on a copy of the cells, then put
        them back (docs/concepts.md §3 FIX): 0 when all of them fit."""
        saved = (self.pos[:], self.src[:], self.tail[:], [set(ids) for ids in self.seq_ids],
                 self.head, self.used, self.n)
        try:
            for groups, last_pos, n_tokens in ubatches:
                code = self._find_slot(groups, last_pos, n_tokens)
                if code:
                    return code
            return E.OK
        finally:
            (self.pos, self.src, self.tail, self.seq_ids, self.head, self.used, self.n) = saved

    def apply_ubatch(self, groups: list[tuple[int, ...]], last_pos: list[int], n_tokens: int,
                     n_seq_tokens: int) -> tuple[int, np.ndarray, np.ndarray]:
        """Place one ubatch (docs/concepts.md §2), move its rows and histories, file the states its groups
        start from, and expect the model's step states: (code, copy_src, zero)."""
        self._file_steps()
        m = self.steps(n_seq_tokens)
        rows = len(groups) * m
        if self.step_scratch and rows > self.step_scratch[0].shape[0]:
            self._allocate_steps(max(rows, 2 * self.step_scratch[0].shape[0]))
        self.generation += 1
        code = self._find_slot(groups, last_pos, n_tokens)
        if code:
            return code, np.zeros(0, dtype=np.int32), np.zeros(0, dtype=bool)
        copy_src, zero = self._copy_plan()
        self._apply_plan(copy_src, zero)
        if self.n_rollback:
            self._keep_start_states(last_pos, n_seq_tokens, zero)
        if m > 0:
            self.pending = (self.head, m, list(last_pos))
        return E.OK, copy_src, zero

    def _find_slot(self, groups: list[tuple[int, ...]], last_pos: list[int], n_tokens: int) -> int:
        """Place one ubatch: group ``s`` (seq ids, owner first) ends at ``last_pos[s]``."""
        n_seqs = len(groups)
        seen: set[int] = set()
        for ids in groups:
            for seq in ids:
                if not 0 <= seq < self.size:
                    return E.SEQ_RANGE
                if seq in seen:
                    return E.DUPLICATE_SEQ
                seen.add(seq)
        # 1. search from the start again when enough cells below head are free
        if self.head > self.used + 2 * n_tokens:
            self.head = 0
        # 2. sequences that become shared leave their own cells
        for ids in groups:
            for seq in ids[1:]:
                self._leave(seq)
        # 3.-4. every owner gets a cell it holds alone
        next_empty = self._next_empty(self.head)
        lo, hi = self.size - 1, 0
        for s, ids in enumerate(groups):
            owner = ids[0]
            t = self.tail[owner]
            if not (t >= 0 and len(self.seq_ids[t]) == 1):
                if next_empty < 0:
                    return E.NO_FREE_CELL
                if t >= 0:
                    self.pos[next_empty], self.src[next_empty] = self.pos[t], self.src[t]
                    self._leave(owner)
                self.seq_ids[next_empty].add(owner)
                t = self.tail[owner] = next_empty
                if s + 1 < n_seqs:
                    next_empty = self._next_empty(next_empty + 1)
            lo, hi = min(lo, t), max(hi, t)
        # 5. gather: group s must end up in cell lo + s
        for s, ids in enumerate(groups):
            dst, src = lo + s, self.tail[ids[0]]
            if dst == src:
                continue
            if dst >= self.size:
                return E.PLACEMENT
            self.pos[dst], self.pos[src] = self.pos[src], self.pos[dst]
            self.src[dst], self.src[src] = self.src[src], self.src[dst]
            self.seq_ids[dst], self.seq_ids[src] = self.seq_ids[src], self.seq_ids[dst]
            for seq in range(self.size):  # FIX: every tail, not just the assumed ones
                if self.tail[seq] == dst:
                    self.tail[seq] = src
                elif self.tail[seq] == src:
                    self.tail[seq] = dst
        # 6. the group's sequences share the cell, at the group's last position
        for s, ids in enumerate(groups):
            c = lo + s
            self.pos[c] = last_pos[s]
            self.seq_ids[c] = set(ids)
            for seq in ids:
                self.tail[seq] = c
        # 7.
        self.head = lo
        self.n = hi - lo + 1
        self.used = sum(1 for ids in self.seq_ids if ids)
        return E.OK if self.n >= n_seqs else E.PLACEMENT

    def _copy_plan(self) -> tuple[np.ndarray, np.ndarray]:
        """The copy plan of cells [head, head + n) (docs/concepts.md §2 FIX), computed once; then src = own cell."""
        copy_src = np.empty(self.n, dtype=np.int32)
        zero = np.empty(self.n, dtype=bool)
        for i in range(self.n):
            c = self.head + i
            copy_src[i] = self.src[c] if self.src[c] >= 0 else c
            zero[i] = self.src[c] < 0
            if self.seq_ids[c]:
                self.src[c] = c
        return copy_src, zero

    def _apply_plan(self, copy_src: np.ndarray, zero: np.ndarray) -> None:
        rows = np.arange(self.head, self.head + copy_src.shape[0])
        # a state's history travels with it; a zeroed row has none
        for tensor in self.tensors + self.rollback_history + ([self.tags] if self.n_rollback else []):
            tensor[rows] = tensor[copy_src]  # fancy indexing reads everything first
            tensor[rows[zero]] = 0

    def _keep_start_states(self, last_pos: list[int], n_seq_tokens: int, zero: np.ndarray) -> None:
        """Before the model overwrites them, the state each group starts from joins its history."""
        for g, last in enumerate(last_pos):
            cell, q = self.head + g, last - n_seq_tokens   # the group continues the state after q
            if zero[g] or q < 0 or q < last - self.n_rollback:
                continue
            for tensor, history in zip(self.tensors, self.rollback_history):
                history[cell, q % self.n_rollback] = tensor[cell]
            self.tags[cell, q % self.n_rollback] = q + 1

    # -- state serialisation (docs/concepts.md §5)

    def aliases(self, buffer: memoryview) -> bool:
        """Whether ``buffer`` shares memory with the cache's state tensors (a target it must refuse)."""
        return self._shares_rows(buffer)

    def _shares_rows(self, view: memoryview) -> bool:
        """Whether the buffer overlaps memory the cache owns: a state tensor, the step scratch or the
        rollback history (a blob or target made of the cache's own rows)."""
        begin, end = _address(view), _address(view) + len(view)
        owned = [*self.tensors, *self.step_host, *self.rollback_history]
        bases = [(array.__array_interface__["data"][0], array.nbytes) for array in owned]
        return len(view) > 0 and any(begin < base + n and base < end for base, n in bases)

    def shape(self) -> Geometry:
        """The cache's geometry, as its state reads check blobs against it."""
        return Geometry.of_tensors(self.size, self.type_ids, self.tensors, self.n_layer, self.layers)

    def _parts(self, seq_id: int) -> list[Any]:
        """The blob in pieces: headers, then the rows range by range."""
        if seq_id == -1:
            cells = [c for c in range(self.size) if self.seq_ids[c]]
        else:
            cells = [c for c in range(self.size) if seq_id in self.seq_ids[c]]
        ranges: list[list[int]] = []   # runs of consecutive cells, [begin, end)
        for c in cells:
            if ranges and ranges[-1][1] == c:
                ranges[-1][1] = c + 1
            else:
                ranges.append([c, c + 1])
        parts: list[Any] = [CELL_COUNT.pack(len(cells))]
        for c in cells:
            ids = sorted(self.seq_ids[c]) if seq_id == -1 else []
            parts.append(CELL.pack(self.pos[c], len(ids)) + struct.pack(f"<{len(ids)}i", *ids))
        shape = self.shape()
        parts.append(DATA_HEADER.pack(0, shape.n_layer))   # v_trans = 0
        for k, tensor in enumerate(self.tensors):
            parts.append(TENSOR_HEADER.pack(shape.type_ids[k], shape.row_bytes[k]))
            rows = tensor.view(np.uint8)
            parts.extend(rows[begin:end].reshape(-1) for begin, end in ranges)
        return parts

    def state_size(self, seq_id: int) -> int:
        return sum(memoryview(part).nbytes for part in self._parts(seq_id))

    def state_write_bytes(self, seq_id: int) -> bytes:
        return b"".join(self._parts(seq_id))

    def state_write_into(self, view: memoryview, seq_id: int) -> int:
        if self._shares_rows(view):
            raise target_aliases_cache()
        parts = self._parts(seq_id)
        length = sum(memoryview(part).nbytes for part in parts)
        if len(view) < length:
            raise target_too_small(len(view), length)
        offset = 0
        for part in parts:
            part_bytes = memoryview(part).cast("B")
            view[offset:offset + len(part_bytes)] = part_bytes
            offset += len(part_bytes)
        return length

    def state_write_file(self, file: Any, seq_id: int) -> int:
        parts = self._parts(seq_id)
        for part in parts:
            write_all(file, part)
        return sum(memoryview(part).nbytes for part in parts)

    def state_read(self, data: memoryview, seq_id: int) -> int:
        """Check the whole blob, then replace the cache (``-1``) or sequence ``seq_id`` with it."""
        if self._shares_rows(data):
            # the blob lies in the cache's own rows, which the restore overwrites: read a copy
            data = memoryview(bytes(data))
        blob = parse_blob(data, self.shape(), seq_id)   # every check, before any change
        self._file_steps()
        self.generation += 1
        if seq_id == -1:
            # the whole cache: blob cell i becomes cell i, with its own row (clear forgets every history)
            self.clear()
            for i, cell in enumerate(blob.cells):
                self.pos[i] = cell.pos
                self.src[i] = i
                self.seq_ids[i] = set(cell.seq_ids)
                for seq in cell.seq_ids:
                    self.tail[seq] = i
            self.used = blob.cell_count
            self.head = 0
        else:
            # one sequence: removed, then placed as one group by find_slot
            self._remove(seq_id, -1, -1)
            if blob.cell_count == 0:
                return blob.n_bytes
            code = self._find_slot([(seq_id,)], [blob.cells[0].pos], 1)
            if code:   # cannot happen: the sequence left every cell, so one is free
                raise engine_error(code, what=f"state_read of seq_id {seq_id}", seq=seq_id, size=self.size)
            self.src[self.head] = self.head
            self.tags[self.head] = 0   # the blob carries no history (llama.cpp's bytes)
        for k, tensor in enumerate(self.tensors):
            tensor.view(np.uint8)[self.head:self.head + blob.cell_count] = blob.rows(data, blob.tensors[k])
        return blob.n_bytes

# -- batches (docs/concepts.md §3, §4) ----------------------------------------------------------------------

class _Group:
    """A run of sorted tokens with identical seq-id lists (llama_sbatch_seq)."""

    def __init__(self, seq_ids: tuple[int, ...], offset: int, length: int) -> None:
        self.seq_ids = seq_ids
        self.offset = offset
        self.length = length


class Placement:
    """The ubatches of one batch: ``(n_seq_tokens, [(seq_ids, token indices), ...])`` each."""

    def __init__(self, core: MemoryCore, ubatches: list[tuple[int, list[tuple[tuple[int, ...], list[int]]]]],
                 pos: list[int], output: list[bool]) -> None:
        self.core = core
        self.ubatches = ubatches
        self._pos = pos
        self._output = output
        self.head = -1
        self.n_kv = 0
        self._copy_src = np.zeros(0, dtype=np.int32)
        self._zero = np.zeros(0, dtype=bool)

    @property
    def n_ubatches(self) -> int:
        return len(self.ubatches)

    def _groups(self, u: int) -> tuple[list[tuple[int, ...]], list[int], int]:
        n_seq_tokens, groups = self.ubatches[u]
        return ([ids for ids, _ in groups], [self._pos[tokens[-1]] for _, tokens in groups],
                n_seq_tokens * len(groups))

    def prepare(self) -> int:
        """Whether every ubatch fits (docs/concepts.md §3 FIX): 0, or the first failure's code; cells unchanged."""
        return self.core.prepare([self._groups(u) for u in range(len(self.ubatches))])

    def apply(self, u: int) -> int:
        code, copy_src, zero = self.core.apply_ubatch(*self._groups(u), self.ubatches[u][0])
        if code:
            return code
        self._copy_src, self._zero = copy_src, zero
        self.head, self.n_kv = self.core.head, self.core.n
        return E.OK

    def copy_src(self) -> np.ndarray:
        return self._copy_src.copy()

    def zero(self) -> np.ndarray:
        return self._zero.copy()

    def shape(self, u: int) -> tuple[int, int, int]:
        n_seq_tokens, groups = self.ubatches[u]
        return n_seq_tokens * len(groups), n_seq_tokens, len(groups)

    def batch_index(self, u: int) -> np.ndarray:
        return np.array([i for _, tokens in self.ubatches[u][1] for i in tokens], dtype=np.int64)

    def batch_take(self, u: int) -> np.ndarray:
        """How to take the ubatch's tokens from the batch's arrays (the compiled engine may give a slice)."""
        return self.batch_index(u)

    def output(self, u: int) -> np.ndarray:
        flags = np.array([self._output[i] for _, tokens in self.ubatches[u][1] for i in tokens], dtype=bool)
        flags.flags.writeable = False
        return flags

    def seq_id_arrays(self, u: int) -> tuple[np.ndarray, np.ndarray]:
        lists = [ids for ids, _ in self.ubatches[u][1]]
        flat = np.array([seq for ids in lists for seq in ids], dtype=np.int32)
        offsets = np.cumsum([0] + [len(ids) for ids in lists]).astype(np.int32)
        return flat, offsets

    def out_ids(self) -> np.ndarray:
        return np.array([i for u in range(len(self.ubatches)) for i in self.batch_index(u).tolist()
                         if self._output[i]], dtype=np.int64)


def split_batch(core: MemoryCore, seq_id_flat: np.ndarray, seq_id_offset: np.ndarray, pos: np.ndarray,
                logits: np.ndarray | None, logits_all: bool, n_ubatch: int, embd_pooled: bool) -> Placement:
    """Validate a batch against the cells (docs/concepts.md §4) and split it into ubatches (docs/concepts.md §3)."""
    n = pos.shape[0]
    flat, offsets, positions = seq_id_flat.tolist(), seq_id_offset.tolist(), pos.tolist()
    lists = [tuple(flat[offsets[i]:offsets[i + 1]]) for i in range(n)]

    def fail(code: int, **detail: int) -> Exception:
        values = dict(token=-1, seq=-1, pos=-1, prev=-1, n=0, size=core.size)
        values.update(detail)
        return engine_error(code, **values)

    # seq ids and positions that no cache could take, token by token
    for i in range(n):
        if positions[i] < 0:
            raise fail(E.SPLIT_NEGATIVE_POS, token=i, pos=positions[i])
        if positions[i] == POS_INF:
            raise fail(E.SPLIT_POS_MAX, token=i, pos=positions[i])
        for seq in lists[i]:
            if not 0 <= seq < core.size:
                raise fail(E.SPLIT_SEQ_RANGE, token=i, seq=seq)
    # each sequence's positions are consecutive, distinct, and continue its cell
    previous_seq = previous_pos = -1
    for seq, p in sorted((seq, positions[i]) for i in range(n) for seq in lists[i]):
        if seq != previous_seq:
            previous_pos = core.seq_pos_max(seq)
            if previous_pos >= 0 and p != previous_pos + 1:
                raise fail(E.SPLIT_CONTINUE, seq=seq, pos=p, prev=previous_pos)
        elif p != previous_pos + 1:
            raise fail(E.SPLIT_GAP, seq=seq, pos=p, prev=previous_pos)
        previous_seq, previous_pos = seq, p

    # 1. more seq ids first, then the lists element by element, then position
    ids = sorted(range(n), key=lambda i: (-len(lists[i]), lists[i], positions[i]))
    # 2. consecutive indices with identical lists form a group
    groups: list[_Group] = []
    for k, i in enumerate(ids):
        if groups and groups[-1].seq_ids == lists[i]:
            groups[-1].length += 1
        else:
            groups.append(_Group(lists[i], k, 1))
    # 3. fewer seq ids first, then longer first; consumed from the end
    groups.sort(key=lambda g: (len(g.seq_ids), -g.length))
    # 4.-5. split_equal / split_seq
    ubatches = []
    left = n
    while left > 0:
        while groups and groups[-1].length == 0:
            groups.pop()
        limit = min(left, n_ubatch)
        taken: list[tuple[tuple[int, ...], list[int]]] = []
        length = n_taken = 0
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

    # find_slot will see each owner's new pos = its old pos + n_seq_tokens
    known: dict[int, int] = {}
    for n_seq_tokens, taken in ubatches:
        for seq_ids, tokens in taken:
            owner, last = seq_ids[0], positions[tokens[-1]]
            if owner not in known:
                known[owner] = core.seq_pos_max(owner)
            if known[owner] >= 0 and last != known[owner] + n_seq_tokens:
                raise fail(E.SPLIT_FIND_SLOT, seq=owner, pos=last, prev=known[owner], n=n_seq_tokens)
            for seq in seq_ids:
                known[seq] = last

    # 6. output flags
    if logits_all:
        output = [True] * n
    elif logits is not None:
        output = [bool(flag) for flag in logits.tolist()]
    else:
        output = [i == n - 1 for i in range(n)]
    return Placement(core, ubatches, positions, output)
