# cython: language_level=3
"""C-level API of the KV table's journal (docs/hybrid.md, "Preparing and loading").

While ``t.journal.on``, the cell primitives of ``_kv_ops`` call ``kj_touch``
before they change a cell, so the journal holds each changed cell's state from
before, once; ``kj_undo`` puts those cells back and ``kj_commit`` forgets them,
both in O(cells saved).  ``kj_reserve`` makes room first: ``kj_save`` cannot
fail.  Every function is ``noexcept nogil``.
"""

from libc.stdint cimport int32_t, int64_t

from ._kv_table cimport MARK_SAVED, KvJournal, KvTable

# a cell's pairs into its sequences' trees (listed) or out of them
cdef void list_cell(KvTable* t, int32_t cell, bint listed) noexcept nogil
# room for `extra` more saved cells; False when out of memory (nothing changed then)
cdef bint kj_reserve(KvTable* t, int64_t extra) noexcept nogil
cdef void kj_begin(KvTable* t) noexcept nogil
cdef void kj_save(KvTable* t, int32_t cell) noexcept nogil
cdef void kj_undo(KvTable* t) noexcept nogil
cdef void kj_commit(KvTable* t) noexcept nogil
cdef void kj_release(KvTable* t) noexcept nogil


cdef inline void kj_touch(KvTable* t, int32_t cell) noexcept nogil:
    """``cell`` is about to change: save it first, when journaling and not saved yet."""
    if t.journal.on and not (t.mark[cell] & MARK_SAVED):
        kj_save(t, cell)
