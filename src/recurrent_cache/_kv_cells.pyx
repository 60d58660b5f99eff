# cython: language_level=3
"""The attention KV cell table's Python class, ``KVCells``: ``kv_reference.KVCells``'s interface over
``_kv_ops``' C table (docs/hybrid.md, "KV cells").

Each method checks its arguments in ``kv_reference``'s words and calls the C table; a refused call
raises the table's error (``kv_reference.kv_error``) and changes nothing.  The compiled hybrid
step reaches the table through ``KVCells``' C-level entry points (``_kv_cells.pxd``), the hybrid
rule and the C API through ``_kv_ops`` itself.
"""

from libc.stdint cimport int32_t, int64_t

import numpy as np

from . import errors as E
from . import kv_reference
from .kv_reference import (as_int32, cell_array, check_config, check_mask_out, checked_ubatches, kv_error,
                           position_array, token_array_shapes, token_arrays)

from ._kv_check cimport (KV_CHECK_COUNT, KV_CHECK_EMPTY, KV_CHECK_HEAD, KV_CHECK_JOURNAL, KV_CHECK_SHIFT,
                         KV_CHECK_TREE, KV_CHECK_USED, kv_check)
from ._kv_mask cimport kv_mask
from ._kv_ops cimport (POS_END, kv_apply, kv_check_tokens, kv_clear, kv_find_slot, kv_init, kv_load, kv_load_seq,
                      kv_padded_n_kv, kv_prepare, kv_release, kv_reset_shift, kv_seq_add, kv_seq_cp, kv_seq_div,
                      kv_seq_has, kv_seq_keep, kv_seq_pos_max, kv_seq_pos_min, kv_seq_rm)
from ._kv_seq_pos cimport sp_collect
from ._kv_table cimport KV_NO_SLOT, KV_OK, KV_TOO_MANY_CELLS


CHECK_MESSAGES = {
    KV_CHECK_EMPTY: "KV cell {where}: its position, sequence count and free bit disagree",
    KV_CHECK_COUNT: "KV cell {where}: its sequence count is not the size of its sequence set",
    KV_CHECK_SHIFT: "KV cell {where}: empty with a pending shift",
    KV_CHECK_USED: "the KV table's used count or last used cell is wrong",
    KV_CHECK_TREE: "sequence {where}: its ordered positions disagree with the cells",
    KV_CHECK_HEAD: "the KV table's head lies outside [0, size]",
    KV_CHECK_JOURNAL: "between calls, the KV table's journal is on or holds cells, or a cell is marked (cell {where})",
}


cdef checked_offsets(const int32_t[::1] pos, const int32_t[::1] flat, const int32_t[::1] offsets, str what):
    """The shape checks of ``kv_reference.token_array_shapes`` on int32 arrays, in C."""
    cdef int32_t n = <int32_t>pos.shape[0]
    cdef int32_t token
    if n < 1 or offsets.shape[0] != n + 1 or offsets[0] != 0 or offsets[n] != flat.shape[0]:
        raise E.BatchError(f"{what}: offsets must be [n + 1], from 0 to len(flat), for n >= 1 tokens (got {n} "
                           f"positions, {offsets.shape[0]} offsets, {flat.shape[0]} seq ids)")
    for token in range(n):    # every token lists at least one seq id, and no read leaves flat
        if offsets[token + 1] <= offsets[token]:
            raise E.BatchError(f"{what}: token {token} has no seq id (offsets must grow strictly)")


cdef object one_ubatch(ubatches):
    """``prepare``'s argument as ``checked_ubatches`` gives it when it is one ubatch of C-contiguous int32
    arrays (checked here); None for anything else (the general checks then run)."""
    if type(ubatches) is not list or len(ubatches) != 1 or type(ubatches[0]) is not tuple or len(ubatches[0]) != 3:
        return None
    pos, flat, offsets = ubatches[0]
    for values in (pos, flat, offsets):
        if type(values) is not np.ndarray or values.dtype != np.int32 or values.ndim != 1 \
                or not values.flags.c_contiguous:
            return None
    checked_offsets(pos, flat, offsets, "prepare: ubatch 0")
    return np.array([0, pos.shape[0]], dtype=np.int32), pos, flat, offsets


cdef class KVCells:
    """``size`` KV cells of one stream (``kv_reference.KVCells``'s interface and semantics)."""

    def __cinit__(self, size, n_seq_max=1, n_swa=0, swa_type="none"):
        check_config(size, n_seq_max, n_swa, swa_type)
        if kv_init(&self.t, size, n_seq_max, n_swa, kv_reference.SWA_TYPES.index(swa_type)) != KV_OK:
            raise MemoryError(f"out of memory for {size} KV cells")
        self.swa_type = swa_type

    def __dealloc__(self):
        kv_release(&self.t)

    @property
    def size(self) -> int:
        return self.t.size

    @property
    def n_seq_max(self) -> int:
        return self.t.n_seq_max

    @property
    def n_swa(self) -> int:
        return self.t.n_swa

    @property
    def head(self) -> int:
        return self.t.head

    @property
    def used(self) -> int:
        return self.t.used

    @property
    def used_max_p1(self) -> int:
        return self.t.top

    @property
    def has_shift(self) -> bool:
        return bool(self.t.has_shift)

    def cell(self, Py_ssize_t i):
        if not 0 <= i < self.t.size:
            raise kv_error(kv_reference.CODES["CELL_INDEX"], i, self.t.size)
        if self.t.pos[i] < 0:
            return None
        return self.t.pos[i], tuple(s for s in range(self.t.n_seq_max) if kv_seq_has(&self.t, <int32_t>i, s))

    def cells(self):
        return [self.cell(i) for i in range(self.t.size)]

    def shifts(self):
        return np.asarray(<int32_t[:self.t.size]>self.t.shift).copy()

    cdef int32_t checked_seq(self, seq) except -2:
        seq = as_int32(seq, "seq_id")
        if not 0 <= seq < self.t.n_seq_max:
            raise kv_error(kv_reference.CODES["SEQ_RANGE"], seq, self.t.n_seq_max)
        return seq

    def seq_pos_min(self, seq):
        return kv_seq_pos_min(&self.t, self.checked_seq(seq))

    def seq_pos_max(self, seq):
        return kv_seq_pos_max(&self.t, self.checked_seq(seq))

    def seq_cells(self, seq):
        """The cells holding ``seq``, by position (then by cell): its tree in order, no scan of the table."""
        cdef int32_t s = self.checked_seq(seq)
        cdef int32_t n = sp_collect(&self.t.seqs, s, 0, POS_END, self.t.scratch)
        return np.array(<int32_t[:n]>self.t.scratch, dtype=np.int32) if n else np.empty(0, dtype=np.int32)

    def n_kv(self, int pad=kv_reference.N_KV_PAD):
        if pad < 1:
            raise E.ArgumentError(f"pad must be >= 1, got {pad}")
        return self.padded_n_kv(pad)

    cdef int32_t padded_n_kv(self, int32_t pad) noexcept nogil:
        return kv_padded_n_kv(&self.t, pad)

    def check(self):
        cdef int64_t where = -1
        cdef int broken = kv_check(&self.t, &where)
        if broken:
            raise E.CoreError(CHECK_MESSAGES[broken].format(where=where))

    # -- placing a ubatch

    def find_slot(self, pos, seq_ids, bint cont=False):
        positions, flat, offsets = self.tokens(pos, seq_ids)
        slot = np.empty(positions.shape[0], dtype=np.int32)
        cdef int32_t[::1] slot_view = slot
        cdef int code
        with nogil:
            code = kv_find_slot(&self.t, <int32_t>slot_view.shape[0], cont, &slot_view[0])
        return slot if code == KV_OK else None

    def apply(self, cells, pos, seq_ids):
        positions, flat, offsets = self.tokens(pos, seq_ids)
        self.apply_arrays(cell_array(cells, positions.shape[0], self.t.size), positions, flat, offsets)

    def place(self, pos, seq_ids, bint cont=False):
        positions, flat, offsets = self.tokens(pos, seq_ids)
        return self.place_arrays(positions, flat, offsets, cont)

    def place_arrays(self, const int32_t[::1] pos, const int32_t[::1] flat, const int32_t[::1] offsets,
                     bint cont=False):
        """``place`` for tokens already as ``token_arrays`` gives them: the cells, or ``None``."""
        cdef int32_t n = <int32_t>pos.shape[0]
        cdef int64_t a = 0, b = 0
        cdef int code
        cdef int32_t token
        if n < 1 or offsets.shape[0] != n + 1 or offsets[0] != 0 or offsets[n] != flat.shape[0]:
            raise E.BatchError("place_arrays: offsets must be [n + 1], from 0 to len(flat), for n >= 1 tokens")
        for token in range(n):    # every token lists at least one seq id, and no read leaves flat
            if offsets[token + 1] <= offsets[token]:
                raise E.BatchError(f"place_arrays: token {token} has no seq id (offsets must grow strictly)")
        slot = np.empty(n, dtype=np.int32)
        cdef int32_t[::1] slot_view = slot
        with nogil:
            code = kv_check_tokens(&self.t, n, &pos[0], &flat[0], &offsets[0], &a, &b)
            if code == KV_OK:
                code = kv_find_slot(&self.t, n, cont, &slot_view[0])
                if code == KV_OK:
                    code = kv_apply(&self.t, n, &slot_view[0], &pos[0], &flat[0], &offsets[0], &a, &b)
        if code == KV_NO_SLOT:
            return None
        if code != KV_OK:
            raise kv_error(code, a, b)
        return slot

    def apply_arrays(self, const int32_t[::1] cells, const int32_t[::1] pos, const int32_t[::1] flat,
                     const int32_t[::1] offsets):
        """``apply`` for tokens already as ``token_arrays`` gives them (int32 arrays; what a hybrid
        memory holds for a prepared ubatch), the cells as int32 ``[n]``."""
        checked_offsets(pos, flat, offsets, "apply_arrays")
        if cells.shape[0] != pos.shape[0]:
            raise kv_error(kv_reference.CODES["CELL_COUNT"], cells.shape[0], pos.shape[0])
        self.apply_tokens(<int32_t>pos.shape[0], &cells[0], &pos[0], &flat[0], &offsets[0])

    cdef int apply_tokens(self, int32_t n, const int32_t* cells, const int32_t* pos, const int32_t* flat,
                          const int32_t* offsets) except -1:
        cdef int64_t a = 0, b = 0
        cdef int code
        with nogil:
            code = kv_check_tokens(&self.t, n, pos, flat, offsets, &a, &b)
            if code == KV_OK:
                code = kv_apply(&self.t, n, cells, pos, flat, offsets, &a, &b)
        if code != KV_OK:
            raise kv_error(code, a, b)
        return 0

    cdef tuple tokens(self, pos, seq_ids):
        """token_arrays, then the range checks."""
        positions, flat, offsets = token_arrays(pos, seq_ids)
        cdef const int32_t[::1] p = positions
        cdef const int32_t[::1] f = flat
        cdef const int32_t[::1] o = offsets
        cdef int64_t a = 0, b = 0
        cdef int code = kv_check_tokens(&self.t, <int32_t>p.shape[0], &p[0], &f[0], &o[0], &a, &b)
        if code != KV_OK:
            raise kv_error(code, a, b)
        return positions, flat, offsets

    # -- preparing and loading

    def prepare(self, ubatches):
        """The slot of each ubatch in turn, each placed for the next to see, or ``None``; the table
        is left exactly as it was (``kv_reference.KVCells.prepare``)."""
        one = one_ubatch(ubatches)   # a decode step's one ubatch of int32 arrays: checked here, in C
        bounds, positions, flat, offsets = one if one is not None else checked_ubatches(ubatches)
        slots = np.empty(bounds[-1], dtype=np.int32)
        cdef const int32_t[::1] b_view = bounds, p_view = positions, f_view = flat, o_view = offsets
        cdef int32_t[::1] s_view = slots
        if not self.prepare_tokens(<int32_t>b_view.shape[0] - 1, &b_view[0], &p_view[0], &f_view[0], &o_view[0],
                                   &s_view[0]):
            return None
        ends = bounds.tolist()
        return [slots[start:end] for start, end in zip(ends[:-1], ends[1:])]

    cdef int prepare_tokens(self, int32_t n_ubatch, const int32_t* bounds, const int32_t* pos, const int32_t* flat,
                            const int32_t* offsets, int32_t* slots) except -1:
        cdef int64_t a = 0, b = 0
        cdef int code = KV_OK
        cdef int32_t u
        for u in range(n_ubatch):
            code = kv_check_tokens(&self.t, bounds[u + 1] - bounds[u], pos + bounds[u], flat, offsets + bounds[u],
                                   &a, &b)
            if code != KV_OK:
                raise kv_error(code, a, b)
        with nogil:
            code = kv_prepare(&self.t, n_ubatch, bounds, pos, flat, offsets, slots, &a, &b)
        if code == KV_NO_SLOT:
            return 0
        if code != KV_OK:
            raise kv_error(code, a, b)
        return 1

    def load(self, pos, flat, offsets):
        """Every cell replaced by a whole context's (``kv_reference.KVCells.load``)."""
        positions, ids, starts = token_array_shapes(pos, flat, offsets, "load", 0)
        if positions.shape[0] > self.t.size:
            raise kv_error(KV_TOO_MANY_CELLS, positions.shape[0], self.t.size)
        if positions.shape[0] == 0:
            kv_clear(&self.t)
            return
        cdef const int32_t[::1] p_view = positions, f_view = ids, o_view = starts
        cdef int64_t a = 0, b = 0
        cdef int code = kv_check_tokens(&self.t, <int32_t>p_view.shape[0], &p_view[0], &f_view[0], &o_view[0], &a, &b)
        if code == KV_OK:
            code = kv_load(&self.t, <int32_t>p_view.shape[0], &p_view[0], &f_view[0], &o_view[0])
        if code != KV_OK:
            raise kv_error(code, a, b)

    def load_seq(self, seq, pos):
        """One sequence's cells replaced, at the cells returned, or ``None`` with nothing changed
        (``kv_reference.KVCells.load_seq``)."""
        cdef int32_t dest = self.checked_seq(seq)
        positions = position_array(pos, "load_seq")
        cdef int32_t n = <int32_t>positions.shape[0]
        if n == 0:
            return np.empty(0, dtype=np.int32)
        flat = np.full(n, dest, dtype=np.int32)
        offsets = np.arange(n + 1, dtype=np.int32)
        slot = np.empty(n, dtype=np.int32)
        cdef const int32_t[::1] p_view = positions, f_view = flat, o_view = offsets
        cdef int32_t[::1] s_view = slot
        cdef int64_t a = 0, b = 0
        cdef int code
        with nogil:
            code = kv_load_seq(&self.t, dest, n, &p_view[0], &f_view[0], &o_view[0], &s_view[0], &a, &b)
        if code == KV_NO_SLOT:
            return None
        if code != KV_OK:
            raise kv_error(code, a, b)
        return slot

    # -- sequence operations

    cdef tuple bounds(self, p0, p1):
        p0, p1 = as_int32(p0, "p0"), as_int32(p1, "p1")
        return (0 if p0 < 0 else p0), (POS_END if p1 < 0 else p1)

    def seq_rm(self, seq, p0=-1, p1=-1):
        seq = as_int32(seq, "seq_id")
        if seq != -1:
            self.checked_seq(seq)
        lo, hi = self.bounds(p0, p1)
        kv_seq_rm(&self.t, seq, lo, hi)
        return True

    def seq_cp(self, src, dst, p0=-1, p1=-1):
        src = self.checked_seq(as_int32(src, "seq_id"))
        dst = self.checked_seq(as_int32(dst, "seq_id"))
        lo, hi = self.bounds(p0, p1)
        if kv_seq_cp(&self.t, src, dst, lo, hi) != KV_OK:
            raise kv_error(kv_reference.CODES["NO_MEMORY"])

    def seq_keep(self, seq):
        kv_seq_keep(&self.t, self.checked_seq(as_int32(seq, "seq_id")))

    def seq_add(self, seq, p0, p1, delta):
        cdef int64_t a = 0, b = 0
        seq = self.checked_seq(as_int32(seq, "seq_id"))
        lo, hi = self.bounds(p0, p1)
        code = kv_seq_add(&self.t, seq, lo, hi, as_int32(delta, "delta"), &a, &b)
        if code != KV_OK:
            raise kv_error(code, a, b)

    def seq_div(self, seq, p0, p1, d):
        seq = self.checked_seq(as_int32(seq, "seq_id"))
        lo, hi = self.bounds(p0, p1)
        cdef int64_t a = 0, b = 0
        code = kv_seq_div(&self.t, seq, lo, hi, as_int32(d, "d"), &a, &b)
        if code != KV_OK:
            raise kv_error(code, a, b)

    def reset_shift(self):
        kv_reset_shift(&self.t)

    def clear(self):
        kv_clear(&self.t)

    # -- the mask

    def mask(self, pos, seq_ids, out, bint sliding=True):
        positions, flat, offsets = self.tokens(pos, seq_ids)
        cdef int32_t n_kv = check_mask_out(out, positions.shape[0], self.t.size)
        cdef const int32_t[::1] p = positions
        cdef const int32_t[::1] f = flat
        cdef const int32_t[::1] o = offsets
        cdef float[:, ::1] target = out
        cdef int code
        with nogil:
            code = kv_mask(&self.t, <int32_t>p.shape[0], &p[0], &f[0], &o[0], &target[0, 0], n_kv, sliding)
        if code != KV_OK:
            raise kv_error(code)
