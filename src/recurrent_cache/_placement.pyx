# cython: language_level=3
"""The compiled engine's placement of one batch: split, prepare, then ubatch by ubatch.

``split_batch`` validates the batch against the cells and splits it (``_split``);
``Placement.prepare`` places every ubatch on a journal of the cell table and rolls
it back, so a prepared placement can always be applied; ``Placement.apply(u)`` hands
ubatch ``u`` to the memory core (``_core_ops.core_apply_ubatch``: find_slot, the copy
plan computed once — docs/concepts.md §2 FIX —, rows and history moved) and keeps its plan.  The facade (``memory_state.MemoryState``) owns the protocol,
the checks and the messages; this module owns the loops and the C arrays.
"""

from cpython.bytes cimport PyBytes_FromStringAndSize
from libc.stdint cimport INT32_MAX, int8_t, int32_t, int64_t, uint8_t
from libc.stdlib cimport free, realloc
from libc.string cimport memcpy

import numpy as np

from ._cells cimport (RC_ERR_ARGUMENT, RC_ERR_BROKEN, RC_ERR_DUPLICATE_SEQ, RC_ERR_NO_FREE_CELL,
                      RC_ERR_NO_MEMORY, RC_ERR_PLACEMENT, RC_ERR_POSITION, RC_ERR_SEQ_HAS_CELL,
                      RC_ERR_SEQ_RANGE, RC_OK)
from ._core cimport MemoryCore
from ._split cimport (SPLIT_ERR_CONTINUE, SPLIT_ERR_FIND_SLOT, SPLIT_ERR_GAP, SPLIT_ERR_NEGATIVE_POS,
                      SPLIT_ERR_NO_MEMORY, SPLIT_ERR_POS_MAX, SPLIT_ERR_SEQ_RANGE, SPLIT_OK, Split,
                      SplitDetail, split_batch as split_cells, split_prepare, split_release, split_token_arrays,
                      split_token_entries)

from .errors import CoreError, engine_error

# The compiled enums by the names of ``errors``' table (a test checks they agree).
CODES = {
    "SEQ_RANGE": RC_ERR_SEQ_RANGE, "DUPLICATE_SEQ": RC_ERR_DUPLICATE_SEQ, "NO_FREE_CELL": RC_ERR_NO_FREE_CELL,
    "NO_MEMORY": RC_ERR_NO_MEMORY, "PLACEMENT": RC_ERR_PLACEMENT, "POSITION": RC_ERR_POSITION,
    "ARGUMENT": RC_ERR_ARGUMENT, "SEQ_HAS_CELL": RC_ERR_SEQ_HAS_CELL, "BROKEN": RC_ERR_BROKEN,
    "SPLIT_SEQ_RANGE": SPLIT_ERR_SEQ_RANGE, "SPLIT_NEGATIVE_POS": SPLIT_ERR_NEGATIVE_POS,
    "SPLIT_GAP": SPLIT_ERR_GAP, "SPLIT_CONTINUE": SPLIT_ERR_CONTINUE, "SPLIT_FIND_SLOT": SPLIT_ERR_FIND_SLOT,
    "SPLIT_NO_MEMORY": SPLIT_ERR_NO_MEMORY, "SPLIT_POS_MAX": SPLIT_ERR_POS_MAX,
}


cdef class Placement:
    """The ubatches of one batch and the copy plan of the last one applied (engine object)."""

    def __cinit__(self):
        self.copy_src_buf = NULL
        self.zero_buf = NULL

    def __dealloc__(self):
        split_release(&self.split)
        free(self.copy_src_buf)
        free(self.zero_buf)

    @property
    def n_ubatches(self):
        return self.split.n_ubatches

    def prepare(self):
        """Place every ubatch on a journal and roll back: RC_OK when all of them fit."""
        cdef int code
        with nogil:
            code = split_prepare(&self.split, &self.core.core.cells, &self.seq_id_flat[0])
        return code

    def apply(self, int32_t u):
        """Ubatch ``u`` placed by the memory core (find_slot, copy plan, row moves); an engine code."""
        cdef int code
        if not 0 <= u < self.split.n_ubatches:
            raise IndexError(f"ubatch {u} of {self.split.n_ubatches}")
        code = self.core.apply_ubatch(&self.split, u, &self.seq_id_flat[0])
        if code == RC_OK:
            code = self.keep_plan(self.core.core.cells.head, self.core.core.cells.n)
        return code

    cdef int keep_plan(self, int32_t head, int32_t n) noexcept nogil:
        """Copy the plan out of the core's scratch, for ``copy_src()`` / ``zero()``."""
        cdef int32_t* grown_src
        cdef uint8_t* grown_zero
        self.head = -1
        self.n_kv = 0
        if n > self.capacity:
            grown_src = <int32_t*>realloc(self.copy_src_buf, <size_t>n * sizeof(int32_t))
            if grown_src == NULL:
                return RC_ERR_NO_MEMORY
            self.copy_src_buf = grown_src
            grown_zero = <uint8_t*>realloc(self.zero_buf, <size_t>n)
            if grown_zero == NULL:
                return RC_ERR_NO_MEMORY
            self.zero_buf = grown_zero
            self.capacity = n
        memcpy(self.copy_src_buf, self.core.core.plan_copy_src, <size_t>n * sizeof(int32_t))
        memcpy(self.zero_buf, self.core.core.plan_zero, <size_t>n)
        self.head = head
        self.n_kv = n
        return RC_OK

    # -- what the model reads: built on demand, from the C arrays -----------------------

    def copy_src(self):
        """[n_kv] int32: row head+i was filled from row copy_src[i]."""
        return np.asarray(<int32_t[:self.n_kv]>self.copy_src_buf).copy() if self.n_kv else \
            np.zeros(0, dtype=np.int32)

    def zero(self):
        """[n_kv] bool: rows that were zeroed (no state yet)."""
        return np.asarray(<uint8_t[:self.n_kv]>self.zero_buf).astype(bool) if self.n_kv else \
            np.zeros(0, dtype=bool)

    def shape(self, int32_t u):
        """``(n_tokens, n_seq_tokens, n_seqs)`` of ubatch ``u``."""
        self._check(u)
        return (self.split.ub_token_start[u + 1] - self.split.ub_token_start[u],
                self.split.ub_n_seq_tokens[u],
                self.split.ub_group_start[u + 1] - self.split.ub_group_start[u])

    def batch_take(self, int32_t u):
        """How to take ubatch ``u``'s tokens from the batch's arrays: a slice when they are a
        contiguous run of the batch, ascending or descending (a decode step's is descending:
        groups are consumed from the end), so the arrays are views; else batch_index."""
        self._check(u)
        cdef int32_t t0 = self.split.ub_token_start[u], t1 = self.split.ub_token_start[u + 1], t
        cdef int32_t first = self.split.order[t0], step = 1, m = t1 - t0
        if m > 1 and self.split.order[t0 + 1] == first - 1:
            step = -1
        for t in range(t0 + 1, t1):
            if self.split.order[t] != first + step * (t - t0):
                return self.batch_index(u)
        if step == 1:
            return slice(first, first + m)
        return slice(first, first - m if first >= m else None, -1)

    def batch_index(self, int32_t u):
        """[n_tokens] int64: where each token of ubatch ``u`` sits in the batch."""
        self._check(u)
        cdef int32_t t0 = self.split.ub_token_start[u], t1 = self.split.ub_token_start[u + 1]
        return np.asarray(<int32_t[:t1 - t0]>(self.split.order + t0)).astype(np.int64)

    def output(self, int32_t u):
        """[n_tokens] bool, read-only: the output flags of ubatch ``u``."""
        self._check(u)
        cdef int32_t t0 = self.split.ub_token_start[u], t1 = self.split.ub_token_start[u + 1]
        # a bytes copy viewed as bool: the cheapest array that owns its memory
        return np.frombuffer(PyBytes_FromStringAndSize(<char*>(self.split.output + t0), t1 - t0), dtype=np.bool_)

    def seq_id_arrays(self, int32_t u):
        """``(flat, offsets)`` int32: group g's seq ids are ``flat[offsets[g]:offsets[g + 1]]``."""
        self._check(u)
        cdef int32_t g0 = self.split.ub_group_start[u], g1 = self.split.ub_group_start[u + 1]
        cdef int32_t g, j, k = 0
        offsets = np.empty(g1 - g0 + 1, dtype=np.int32)
        cdef int32_t[::1] off = offsets
        off[0] = 0
        for g in range(g0, g1):
            off[g - g0 + 1] = off[g - g0] + self.split.group_n_seq_id[g]
        flat = np.empty(off[g1 - g0], dtype=np.int32)
        cdef int32_t[::1] out = flat
        for g in range(g0, g1):
            for j in range(self.split.group_n_seq_id[g]):
                out[k] = self.seq_id_flat[self.split.group_seq_offset[g] + j]
                k += 1
        return flat, offsets

    def out_ids(self):
        """[n_outputs] int64: the batch index of each output row, in ubatch order."""
        if not self.split.n_outputs:
            return np.zeros(0, dtype=np.int64)
        return np.asarray(<int64_t[:self.split.n_outputs]>self.split.out_ids).copy()

    cdef int _check(self, int32_t u) except -1:
        if not 0 <= u < self.split.n_ubatches:
            raise IndexError(f"ubatch {u} of {self.split.n_ubatches}")
        return 0

    # -- the C-level accessor (_placement.pxd) ------------------------------------------

    cdef int64_t token_entries(self) noexcept nogil:
        return split_token_entries(&self.split)

    cdef void token_arrays(self, int32_t* bounds, int32_t* pos, int32_t* offsets, int32_t* flat) noexcept nogil:
        split_token_arrays(&self.split, &self.positions[0], &self.seq_id_flat[0], bounds, pos, offsets, flat)


def split_batch(MemoryCore core, object seq_id_flat, object seq_id_offset, object pos, object logits,
                bint logits_all, int32_t n_ubatch, bint embd_pooled):
    """Validate a batch's arrays against the cells and split them into a ``Placement``.

    The arrays are int32 / int8, C-contiguous and owned by the caller's immutable
    batch; their lengths are checked against each other here, so no array is read
    out of bounds whatever they hold.  A defect raises through ``engine_error``.
    """
    cdef const int32_t[::1] flat = seq_id_flat
    cdef const int32_t[::1] offsets = seq_id_offset
    cdef const int32_t[::1] positions = pos
    cdef const int8_t[::1] flags
    cdef const int8_t* flag_data = NULL
    cdef Py_ssize_t n_tokens = positions.shape[0], t
    cdef SplitDetail detail
    cdef int code
    cdef Placement p
    core.usable("init_batch")
    if n_tokens < 1 or n_tokens >= INT32_MAX or offsets.shape[0] != n_tokens + 1 or offsets[0] != 0 \
            or offsets[n_tokens] != flat.shape[0]:
        raise CoreError("split_batch: inconsistent batch arrays")
    for t in range(n_tokens):
        if offsets[t + 1] <= offsets[t]:
            raise CoreError("split_batch: inconsistent batch arrays")
    if logits is not None:
        flags = logits
        if flags.shape[0] != n_tokens:
            raise CoreError("split_batch: inconsistent batch arrays")
        flag_data = &flags[0]
    p = Placement.__new__(Placement)
    p.core = core
    p.seq_id_flat = flat
    p.positions = positions
    p.head = -1
    with nogil:
        code = split_cells(&p.split, &core.core.cells, <int32_t>n_tokens, &flat[0], &offsets[0],
                           &positions[0], flag_data, logits_all, n_ubatch, embd_pooled, &detail)
    if code != SPLIT_OK:
        raise engine_error(code, token=detail.token, seq=detail.seq, pos=detail.pos, prev=detail.prev,
                           n=detail.n, size=core.core.cells.size)
    return p
