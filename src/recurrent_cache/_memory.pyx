# cython: language_level=3
"""MemoryState: the ubatches of one init_batch, placed one at a time.

``init_batch`` validates and splits the batch, then ``prepare`` places every
ubatch on a journal of the cell table and rolls it back, so a state with
status SUCCESS can always be applied.  ``apply`` runs find_slot, computes the
copy plan once (no later mutation, SPEC §2 FIX) and moves the state rows.
"""

cimport cython
from libc.stdint cimport int8_t, int32_t, int64_t, uint8_t
from libc.stdlib cimport free, realloc
from libc.string cimport memcpy

import numpy as np

from ._batch cimport (SPLIT_ERR_CONTINUE, SPLIT_ERR_FIND_SLOT, SPLIT_ERR_GAP, SPLIT_ERR_NEGATIVE_POS,
                      SPLIT_ERR_NO_MEMORY, SPLIT_ERR_SEQ_RANGE, SPLIT_OK, Split, SplitDetail,
                      split_alloc, split_batch, split_prepare, split_release)
from ._cells cimport (RC_ERR_ARGUMENT, RC_ERR_DUPLICATE_SEQ, RC_ERR_NO_FREE_CELL, RC_ERR_NO_MEMORY,
                      RC_ERR_PLACEMENT, RC_ERR_POSITION, RC_ERR_SEQ_RANGE, RC_OK, CellTable, cells_copy_plan,
                      cells_find_slot)

from .batch import Batch
from .errors import ArgumentError, CoreError, PositionError, SeqIdError
from .memory import MemoryStatus, Ubatch

_EMPTY_PLAN = np.empty(0, dtype=np.int32)


cdef object split_error(int code, const SplitDetail* d, int32_t size):
    """The exception for a failed split_batch: the one place codes become errors."""
    if code == SPLIT_ERR_SEQ_RANGE:
        return SeqIdError(f"token {d.token}: seq_id {d.seq} is out of range [0, {size}) (cache size {size})")
    if code == SPLIT_ERR_NEGATIVE_POS:
        return PositionError(f"token {d.token} has negative position {d.pos}")
    if code == SPLIT_ERR_GAP:
        return PositionError(f"sequence {d.seq} has non-consecutive positions in the batch: "
                             f"{d.pos} follows {d.prev}")
    if code == SPLIT_ERR_CONTINUE:
        return PositionError(f"sequence {d.seq} continues at position {d.pos}, "
                             f"but its cached state is at position {d.prev}")
    if code == SPLIT_ERR_FIND_SLOT:
        return PositionError(f"find_slot: non-consecutive token position {d.pos} after {d.prev} "
                             f"for sequence {d.seq} with {d.n} new tokens")
    if code == SPLIT_ERR_NO_MEMORY:
        return MemoryError("out of memory while splitting a batch")
    return CoreError(f"split_batch failed with code {code}")


def core_error(int code, str detail=""):
    """The exception for a failed cell-table call: the one place RC_ERR_* codes become errors.

    ``detail`` says what was asked (the caller knows the values); the code
    decides the class.
    """
    text = f"{detail}: " if detail else ""
    if code == RC_ERR_SEQ_RANGE:
        return SeqIdError(f"{text}a seq id is outside the cache")
    if code == RC_ERR_POSITION:
        return PositionError(f"{text}the position would leave [0, 2**31 - 1)")
    if code == RC_ERR_ARGUMENT:
        return ArgumentError(f"{text}argument out of its domain")
    if code == RC_ERR_DUPLICATE_SEQ:
        return CoreError(f"{text}find_slot: a seq id appears twice in one ubatch")
    if code == RC_ERR_NO_FREE_CELL:
        return CoreError(f"{text}find_slot: no free cell left for a sequence")
    if code == RC_ERR_PLACEMENT:
        return CoreError(f"{text}find_slot: groups do not fit in consecutive cells")
    if code == RC_ERR_NO_MEMORY:
        return MemoryError(f"{text}out of memory in the cell table")
    return CoreError(f"{text}cell table failed with code {code}")


@cython.final
cdef class MemoryState:
    """The ubatches of one ``init_batch`` (or the whole cache, for ``init_full``).

    Use ``apply()`` to place the current ubatch (find_slot, copy plan, row
    moves), read ``ubatch`` / ``r(il)`` / ``s(il)``, and ``next()`` to move
    on; or iterate: ``for ub in cache.init_batch(batch): ...`` applies each
    ubatch before yielding it.
    """

    cdef CellTable table
    cdef object cache
    cdef object batch
    cdef object pos_array
    cdef const int32_t[::1] seq_id_flat
    cdef Split split
    cdef int32_t current
    cdef bint full
    cdef bint applied
    cdef readonly object status
    cdef int32_t plan_head
    cdef int32_t plan_n
    cdef int32_t* copy_src_buf   # [plan_capacity] this state's last plan (the table's scratch is shared)
    cdef uint8_t* zero_buf
    cdef int32_t plan_capacity
    cdef object ubatch_cache

    def __cinit__(self):
        self.copy_src_buf = NULL
        self.zero_buf = NULL

    def __dealloc__(self):
        split_release(&self.split)
        free(self.copy_src_buf)
        free(self.zero_buf)

    def __init__(self):
        raise TypeError("MemoryState is created by RecurrentCache.init_batch / init_full")

    @staticmethod
    cdef MemoryState _new(CellTable table, object cache, object status):
        cdef MemoryState st = MemoryState.__new__(MemoryState)
        st.table = table
        st.cache = cache
        st.status = status
        st.plan_head = -1
        return st

    @staticmethod
    def _from_batch(CellTable table, object cache, object batch, object pos, int32_t n_ubatch,
                  bint embd_pooled, bint logits_all, bint simulate=True):
        """Validate, split and prepare; raise for bad input (nothing changed)."""
        cdef MemoryState st = MemoryState._new(table, cache, MemoryStatus.SUCCESS)
        cdef const int32_t[::1] flat = batch.seq_id_flat
        cdef const int32_t[::1] offsets = batch.seq_id_offset
        cdef const int32_t[::1] positions = pos
        cdef const int8_t[::1] flags
        cdef const int8_t* logits = NULL
        cdef SplitDetail detail
        cdef int code
        cdef int32_t n_tokens = batch.n_tokens
        if batch.logits is not None:
            flags = batch.logits
            logits = &flags[0]
        with nogil:
            code = split_batch(&st.split, &table.cells, n_tokens, &flat[0], &offsets[0],
                               &positions[0], logits, logits_all, n_ubatch, embd_pooled, &detail)
        if code != SPLIT_OK:
            raise split_error(code, &detail, table.cells.size)
        st.batch = batch
        st.pos_array = pos
        st._finish(batch.seq_id_flat, simulate)
        return st

    @staticmethod
    def _from_ubatches(CellTable table, object cache, list ubatches):
        """A prepared state of hand-built ubatches: the core's internal entry point.

        ``ubatches[u]`` is ``(n_seq_tokens, groups)`` with ``groups`` a list of
        seq-id lists (owner first); group ``s`` ends at position ``s``.
        Nothing validates the groups, so tests can show what ``prepare`` does
        with ubatches that validation never lets through.
        """
        cdef MemoryState st = MemoryState._new(table, cache, MemoryStatus.SUCCESS)
        cdef int32_t u, s, n, g = 0, token = 0, offset = 0, n_tokens
        n_tokens = sum(n * len(groups) for n, groups in ubatches)
        if not ubatches or any(n < 1 or not groups or not all(groups) for n, groups in ubatches):
            raise ValueError("every ubatch needs groups of >= 1 token and >= 1 seq id")
        flat = np.array([seq for _, groups in ubatches for group in groups for seq in group], dtype=np.int32)
        if split_alloc(&st.split, n_tokens) != SPLIT_OK:
            raise MemoryError("cannot allocate a split")
        for u, (n, groups) in enumerate(ubatches):
            st.split.ub_token_start[u] = token
            st.split.ub_group_start[u] = g
            st.split.ub_n_seq_tokens[u] = n
            for s, group in enumerate(groups):
                st.split.group_seq_offset[g] = offset
                st.split.group_n_seq_id[g] = len(group)
                st.split.group_last_pos[g] = s
                offset += len(group)
                g += 1
            token += n * len(groups)
        st.split.ub_token_start[len(ubatches)] = token
        st.split.ub_group_start[len(ubatches)] = g
        st.split.n_ubatches = len(ubatches)
        st.split.n_outputs = 0
        for u in range(n_tokens):
            st.split.order[u] = u
            st.split.output[u] = 0
        st.batch = Batch(token=np.zeros(n_tokens, dtype=np.int32))
        st.pos_array = np.zeros(n_tokens, dtype=np.int32)
        st._finish(flat, True)
        return st

    cdef _finish(self, object flat, bint simulate):
        """Keep the seq ids and run prepare."""
        cdef int code
        self.seq_id_flat = flat
        if simulate:
            with nogil:
                code = split_prepare(&self.split, &self.table.cells, &self.seq_id_flat[0])
            if code != RC_OK:
                self.status = MemoryStatus.FAILED_PREPARE

    @staticmethod
    def _from_full(CellTable table, object cache):
        cdef MemoryState st = MemoryState._new(table, cache, MemoryStatus.SUCCESS)
        st.full = True
        st.applied = True
        st.plan_head = 0
        st.plan_n = table.cells.size
        return st

    # -- stepping ----------------------------------------------------------------

    def apply(self):
        """Place the current ubatch: find_slot, copy plan, row moves. Returns True."""
        cdef int code
        cdef int32_t u = self.current, g0
        if self.full:
            return True
        if self.status != MemoryStatus.SUCCESS:
            raise CoreError(f"apply() on a state whose status is {self.status.name}")
        if self.applied:
            raise CoreError(f"ubatch {u} is already applied; call next() first")
        g0 = self.split.ub_group_start[u]
        with nogil:
            code = cells_find_slot(&self.table.cells, self.split.ub_group_start[u + 1] - g0,
                                   self.split.ub_token_start[u + 1] - self.split.ub_token_start[u],
                                   &self.seq_id_flat[0], self.split.group_seq_offset + g0,
                                   self.split.group_n_seq_id + g0, self.split.group_last_pos + g0)
            if code == RC_OK:
                self.plan_head = self.table.cells.head
                self.plan_n = self.table.cells.n
                cells_copy_plan(&self.table.cells, self.table.plan_copy_src, self.table.plan_zero)
                code = self.table.apply_plan_rows(self.plan_head, self.plan_n,
                                                  self.table.plan_copy_src, self.table.plan_zero)
        if code != RC_OK:
            raise core_error(code)
        self.applied = True
        self._keep_plan()
        return True

    cdef _keep_plan(self):
        """Copy the plan out of the table's scratch: a later state's apply() reuses it."""
        cdef int32_t* grown_src
        cdef uint8_t* grown_zero
        if self.plan_n > self.plan_capacity:
            grown_src = <int32_t*>realloc(self.copy_src_buf, self.plan_n * sizeof(int32_t))
            if grown_src != NULL:
                self.copy_src_buf = grown_src
            grown_zero = <uint8_t*>realloc(self.zero_buf, self.plan_n)
            if grown_zero != NULL:
                self.zero_buf = grown_zero
            if grown_src == NULL or grown_zero == NULL:
                self.plan_head = -1  # the cache is consistent; only this record of the plan is lost
                raise MemoryError("cannot keep a copy plan")
            self.plan_capacity = self.plan_n
        memcpy(self.copy_src_buf, self.table.plan_copy_src, self.plan_n * sizeof(int32_t))
        memcpy(self.zero_buf, self.table.plan_zero, self.plan_n)

    def next(self):
        """Move to the next ubatch; False after the last one."""
        if self.full or self.status != MemoryStatus.SUCCESS:
            return False
        if self.current + 1 >= self.split.n_ubatches:
            return False
        self.current += 1
        self.applied = False
        self.ubatch_cache = None
        return True

    def __iter__(self):
        if self.full or self.status != MemoryStatus.SUCCESS:
            return
        while True:
            if not self.applied:
                self.apply()
            yield self.ubatch
            if not self.next():
                return

    # -- what the model reads ------------------------------------------------------

    @property
    def n_ubatches(self):
        return 0 if self.full else self.split.n_ubatches

    @property
    def head(self):
        """First cell (row) of the applied ubatch; -1 before apply()."""
        return self.plan_head

    @property
    def n_kv(self):
        """Cells from head that the applied ubatch touches (the copy plan's length)."""
        return self.plan_n if self.plan_head >= 0 else 0

    @property
    def copy_src(self):
        """[n_kv] int32: row head+i was filled from row copy_src[i]."""
        if self.full:
            return np.arange(self.plan_n, dtype=np.int32)
        if self.plan_head < 0:
            return _EMPTY_PLAN
        return np.asarray(<int32_t[:self.plan_n]>self.copy_src_buf).copy()

    @property
    def zero(self):
        """[n_kv] bool: rows that were zeroed (no state yet)."""
        if self.full:
            return np.zeros(self.plan_n, dtype=bool)
        if self.plan_head < 0:
            return np.zeros(0, dtype=bool)
        return np.asarray(<uint8_t[:self.plan_n]>self.zero_buf).astype(bool)

    cdef int32_t rows(self):
        if self.full:
            return self.plan_n
        return self.split.ub_group_start[self.current + 1] - self.split.ub_group_start[self.current]

    def r(self, int il):
        """Rows head .. head+n_seqs-1 of layer il's r tensor: group s is row s."""
        self._require_applied()
        return self.cache.r[il][self.plan_head:self.plan_head + self.rows()]

    def s(self, int il):
        """Rows head .. head+n_seqs-1 of layer il's s tensor: group s is row s."""
        self._require_applied()
        return self.cache.s[il][self.plan_head:self.plan_head + self.rows()]

    def _require_applied(self):
        if self.plan_head < 0:
            raise CoreError("the state has no applied ubatch yet: call apply() first")

    @property
    def ubatch(self):
        """The current ubatch (see ``Ubatch``)."""
        if self.full or self.status != MemoryStatus.SUCCESS:
            raise CoreError("this state has no ubatches")
        if self.ubatch_cache is None:
            self.ubatch_cache = self._make_ubatch(self.current)
        return self.ubatch_cache

    cdef object _make_ubatch(self, int32_t u):
        cdef int32_t t0 = self.split.ub_token_start[u], t1 = self.split.ub_token_start[u + 1]
        cdef int32_t g0 = self.split.ub_group_start[u], g1 = self.split.ub_group_start[u + 1]
        cdef int32_t g, j
        index = np.asarray(<int32_t[:t1 - t0]>(self.split.order + t0)).astype(np.int64)
        output = np.asarray(<uint8_t[:t1 - t0]>(self.split.output + t0)).astype(bool)
        groups = tuple(
            tuple(self.seq_id_flat[self.split.group_seq_offset[g] + j] for j in range(self.split.group_n_seq_id[g]))
            for g in range(g0, g1))
        batch = self.batch
        return Ubatch(
            n_tokens=t1 - t0, n_seq_tokens=self.split.ub_n_seq_tokens[u], n_seqs=g1 - g0,
            token=None if batch.token is None else batch.token[index],
            embd=None if batch.embd is None else batch.embd[index],
            pos=self.pos_array[index], seq_id=groups, output=output, batch_index=index)

    @property
    def out_ids(self):
        """[n_outputs] int64: the batch index of each output row, in ubatch order."""
        if self.full or self.status != MemoryStatus.SUCCESS:
            return np.zeros(0, dtype=np.int64)
        return np.asarray(<int64_t[:self.split.n_outputs]>self.split.out_ids).copy() \
            if self.split.n_outputs else np.zeros(0, dtype=np.int64)

    def __repr__(self):
        if self.full:
            return f"MemoryState(full, n_kv={self.plan_n})"
        return (f"MemoryState({self.status.name}, ubatch {self.current + 1}/{self.split.n_ubatches}, "
                f"{'applied' if self.applied else 'pending'}, head={self.plan_head}, n_kv={self.n_kv})")
