# cython: language_level=3
"""The compiled engine's KV half of a hybrid batch: the recurrent split's ubatches placed in the KV table.

``prepare(table, placement)`` takes every ubatch's tokens from the compiled placement
(``_placement.Placement.token_arrays``: positions, and each token's seq ids) into C arrays
and finds their cells (``KVCells.prepare_tokens``: the token checks, then the table's
prepare, which leaves it as it was); ``KvPlan.apply(u, pad)`` places ubatch ``u`` on its
cells (``KVCells.apply_tokens``).  One compiled call each, whatever the batch: the hybrid
memory (``hybrid.HybridCache``) keeps the protocol, the staleness checks and the
both-halves rule; this module only keeps the arrays.  The reference engine's path is
``hybrid``'s own, on numpy arrays built from ``MemoryState.planned``.
"""

cimport cython
from cpython.buffer cimport PyBUF_WRITABLE, PyBuffer_Release, PyObject_GetBuffer
from libc.stdint cimport INT32_MAX, int32_t, int64_t
from libc.stdlib cimport free, malloc

import numpy as np

from .errors import ArgumentError, UsageError

from ._kv_cells cimport KVCells
from ._placement cimport Placement

_empty = np.empty                      # a decode step's one allocation, without the attribute lookups
_INT32 = np.dtype(np.int32)

cdef extern from *:
    """
    #if defined(_MSC_VER) && !defined(__clang__)
    #include <intrin.h>
    static int rc_guard_take(long* held) { return _InterlockedExchange(held, 1) == 0; }
    static void rc_guard_give(long* held) { _InterlockedExchange(held, 0); }
    #else
    static int rc_guard_take(long* held) { return __atomic_exchange_n(held, 1, __ATOMIC_ACQUIRE) == 0; }
    static void rc_guard_give(long* held) { __atomic_store_n(held, 0, __ATOMIC_RELEASE); }
    #endif
    """
    bint rc_guard_take(long* held) noexcept nogil
    void rc_guard_give(long* held) noexcept nogil


@cython.final
@cython.auto_pickle(False)   # a guard of one memory in one process: nothing to pickle
cdef class StepGuard:
    """One thread at a time inside a hybrid memory, as ``memory_state.ThreadGuard`` (``enter()`` raises
    ``UsageError`` instead of waiting while another thread is inside), taken with one atomic exchange:
    the decode step takes it twice, and a ``threading.Lock`` costs ~3K instructions a time from Python."""

    cdef long held

    def enter(self):
        """Take the guard, or raise ``UsageError`` (changing nothing) when another thread holds it."""
        if not rc_guard_take(&self.held):
            raise UsageError("this HybridCache is in use by another thread: a cache belongs to one thread at a "
                             "time (use one cache per thread, or a lock around every call)")

    def leave(self):
        """Give the guard back."""
        rc_guard_give(&self.held)


@cython.final
cdef class KvPlan:
    """Every ubatch's KV tokens and the cells ``prepare`` found for them (``HybridState``'s KV half)."""

    cdef KVCells table
    cdef readonly int32_t n_ubatches
    cdef int32_t* block          # one allocation: bounds, pos, offsets, flat
    cdef int32_t* bounds         # [n_ubatches + 1] ubatch u's tokens are [bounds[u], bounds[u + 1])
    cdef int32_t* pos            # [n_tokens]
    cdef int32_t* offsets        # [n_tokens + 1] token t's seq ids: flat[offsets[t]:offsets[t + 1]]
    cdef int32_t* flat
    cdef object slots            # int32 [n_tokens]: each token's cell (what the model reads)
    cdef int32_t* slot_data

    def __cinit__(self):
        self.block = NULL

    def __dealloc__(self):
        free(self.block)

    cdef int _check(self, int32_t u) except -1:
        if not 0 <= u < self.n_ubatches:
            raise IndexError(f"ubatch {u} of {self.n_ubatches}")
        return 0

    def apply(self, int32_t u, int32_t pad):
        """Ubatch ``u`` into the table on the cells ``prepare`` found; then the cells to attend to
        (``[0, n_kv)``: the used ones rounded up to ``pad``).  Raises the table's error, changing
        nothing, for a cell taken meanwhile."""
        self._check(u)
        if pad < 1:
            raise ArgumentError(f"pad must be >= 1, got {pad}")
        cdef int32_t t0 = self.bounds[u]
        self.table.apply_tokens(self.bounds[u + 1] - t0, self.slot_data + t0, self.pos + t0, self.flat,
                                self.offsets + t0)
        return self.table.padded_n_kv(pad)

    def cells(self, int32_t u):
        """[n_tokens] int32: the cell of each token of ubatch ``u`` (ubatch order)."""
        self._check(u)
        return self.slots[self.bounds[u]:self.bounds[u + 1]]

    def tokens(self, int32_t u):
        """``(pos, flat, offsets)`` int32 arrays of ubatch ``u``'s tokens (offsets from 0): what the
        table's ``mask`` reads."""
        self._check(u)
        cdef int32_t t0 = self.bounds[u], t1 = self.bounds[u + 1], e0 = self.offsets[t0], e1 = self.offsets[t1]
        pos = np.array(<int32_t[:t1 - t0]>(self.pos + t0), dtype=np.int32)
        flat = np.array(<int32_t[:e1 - e0]>(self.flat + e0), dtype=np.int32)
        offsets = np.array(<int32_t[:t1 - t0 + 1]>(self.offsets + t0), dtype=np.int32)
        offsets -= e0
        return pos, flat, offsets


def prepare(KVCells table, Placement placement):
    """The KV half of ``placement``'s batch: a ``KvPlan``, or ``None`` when its ubatches fit nowhere in
    ``table`` (left exactly as it was either way).  Raises the table's error for a token it refuses."""
    cdef int32_t n_ubatches = placement.split.n_ubatches, n_tokens = placement.split.n_tokens
    cdef int64_t entries = placement.token_entries()
    if n_ubatches < 1 or entries >= INT32_MAX:
        raise ValueError(f"prepare: a placement of {n_ubatches} ubatches and {entries} seq ids")
    cdef KvPlan plan = KvPlan.__new__(KvPlan)
    plan.table = table
    plan.n_ubatches = n_ubatches
    plan.block = <int32_t*>malloc(<size_t>(n_ubatches + 1 + 2 * <int64_t>n_tokens + 1 + entries) * sizeof(int32_t))
    if plan.block == NULL:
        raise MemoryError(f"out of memory for the KV tokens of {n_tokens} tokens")
    plan.bounds = plan.block
    plan.pos = plan.bounds + n_ubatches + 1
    plan.offsets = plan.pos + n_tokens
    plan.flat = plan.offsets + n_tokens + 1
    placement.token_arrays(plan.bounds, plan.pos, plan.offsets, plan.flat)
    plan.slots = _empty(n_tokens, _INT32)
    cdef Py_buffer view                # the array's memory (it never moves while the plan holds it)
    PyObject_GetBuffer(plan.slots, &view, PyBUF_WRITABLE)
    plan.slot_data = <int32_t*>view.buf
    PyBuffer_Release(&view)
    if not table.prepare_tokens(n_ubatches, plan.bounds, plan.pos, plan.flat, plan.offsets, plan.slot_data):
        return None
    return plan
