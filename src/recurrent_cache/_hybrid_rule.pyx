# cython: language_level=3
"""A hybrid memory's rule, once: the compiled engine's ``HybridCache`` sequence operations over both
halves, for its Python facade (``HybridRule``) and the C API (``_capi``, through ``_hybrid_rule.pxd``).

**Every call changes both halves or neither**: its arguments are checked first, then the half that
may still refuse goes first, and the other is asked only when what it would refuse is ruled out.
(The reference engine's ``HybridCache`` keeps the same rule in Python, in ``hybrid.py``.)
"""

cimport cython
from libc.stdint cimport INT32_MAX, int32_t, int64_t
from libc.stdlib cimport free, malloc

from ._cells cimport cells_seq_pos_max, cells_seq_pos_min, cells_tail_in_range
from ._core cimport MemoryCore
from ._core_ops cimport (Core, core_rollback_min, core_seq_add, core_seq_cp, core_seq_div, core_seq_keep,
                         core_seq_rm)
from ._kv_cells cimport KVCells
from ._kv_ops cimport (kv_seq_add, kv_seq_cp, kv_seq_div, kv_seq_has, kv_seq_keep, kv_seq_pos_max, kv_seq_pos_min,
                       kv_seq_rm)
from ._codes cimport RC_ERR_SEQ_RANGE, RULE_ERR_CP_RANGE, RULE_ERR_KV, RULE_ERR_MOVE_RANGE, RULE_ERR_SEQ_HOLDS
from ._kv_seq_pos cimport sp_collect
from ._kv_table cimport KV_NO_MEMORY, KV_OK, KvTable

from . import errors
from .kv_reference import kv_error


cdef inline int refuse(RuleDetail* d, int code, const char* what, int what_kind, int64_t seq) noexcept nogil:
    d.code = code
    d.what = what
    d.what_kind = what_kind
    d.seq = seq
    d.pos = d.prev = d.n = d.index = d.need = d.size = 0
    return code


cdef inline int kv_refusal(RuleDetail* d, int kv_code, int64_t a, int64_t b, const char* what) noexcept nogil:
    refuse(d, RULE_ERR_KV, what, WHAT_CALL, 0)
    d.n, d.index, d.need = kv_code, a, b
    return RULE_ERR_KV


cdef inline int core_refusal(RuleDetail* d, int code, const char* what, int32_t seq, int32_t size) noexcept nogil:
    if code != 0:
        refuse(d, code, what, WHAT_CALL, seq)
        d.size = size
    return code


cdef inline int32_t kv_low(int32_t p0) noexcept nogil:
    return 0 if p0 < 0 else p0


cdef inline int32_t kv_high(int32_t p1) noexcept nogil:
    return INT32_MAX if p1 < 0 else p1


cdef struct Move:                 # seq_add / seq_div: seq's KV positions in [low, high) go to pos // d + shift
    int32_t seq, low, high, shift, d


@cython.cdivision(True)           # positions are >= 0 and d >= 1: C's division is the floor
cdef inline int64_t moved_pos(const Move* m, int32_t pos) noexcept nogil:
    return pos // m.d + <int64_t>m.shift


cdef int64_t kv_last_after(const KvTable* kv, int32_t seq, const Move* m, int64_t floor, int32_t* cells) noexcept nogil:
    """The last position seq's KV cells hold once ``m`` moved them, when it is at least ``floor`` (>= 0),
    else -1 (a cell moved below 0 leaves).  The moved cells of seq are m.seq's in the range (a fork
    shares them); of the others only those from ``floor`` up are read.  ``cells``: room for kv.size."""
    cdef int64_t last = -1
    cdef int32_t n, k, cell
    n = sp_collect(&kv.seqs, seq, m.low, m.high, cells)
    for k in range(n):
        if kv_seq_has(kv, cells[k], m.seq):
            last = max(last, moved_pos(m, kv.pos[cells[k]]))
    n = sp_collect(&kv.seqs, seq, <int32_t>floor, INT32_MAX, cells)
    for k in range(n):
        cell = cells[k]
        if not (m.low <= kv.pos[cell] < m.high and kv_seq_has(kv, cell, m.seq)):
            last = max(last, kv.pos[cell])
    return last if last >= floor else -1


cdef int rule_halves_move_alike(Core* core, KvTable* kv, Move m, int32_t p0, int32_t p1, const char* what,
                                RuleDetail* d) noexcept nogil:
    """0 when moving m.seq's positions in [p0, p1) leaves every sequence whose halves agree (its last
    KV position its recurrent state's) agreeing, else RULE_ERR_MOVE_RANGE for the first that would
    not.  The KV half moves the range's cells, the recurrent half the state only when it lies in the
    range, so a range that ends below the last position, or moves it below a position left behind,
    would part them; a fork shares both the cells and the state, and moves with them."""
    cdef int32_t s
    cdef int64_t state
    cdef int32_t moved_cell = cells_tail_in_range(&core.cells, m.seq, p0, p1)
    cdef int32_t* cells = <int32_t*>malloc(<size_t>kv.size * sizeof(int32_t))
    if cells == NULL:
        return kv_refusal(d, KV_NO_MEMORY, 0, 0, what)
    for s in range(kv.n_seq_max):
        state = cells_seq_pos_max(&core.cells, s)
        if state < 0 or kv_seq_pos_max(kv, s) != state:   # (a model without attention layers: no KV cells)
            continue
        if moved_cell >= 0 and cells_tail_in_range(&core.cells, s, p0, p1) == moved_cell:
            state = moved_pos(&m, <int32_t>state)
        if kv_last_after(kv, s, &m, state, cells) != state:
            refuse(d, RULE_ERR_MOVE_RANGE, what, WHAT_CALL, m.seq)
            d.pos, d.prev, d.need, d.n = p0, p1, s, state
            d.index = kv_last_after(kv, s, &m, 0, cells)
            free(cells)
            return RULE_ERR_MOVE_RANGE
    free(cells)
    return 0


cdef int rule_seq(const KvTable* kv, int32_t seq, const char* what, RuleDetail* d) noexcept nogil:
    if 0 <= seq < kv.n_seq_max:
        return 0
    refuse(d, RC_ERR_SEQ_RANGE, what, WHAT_SEQ, seq)
    d.size = kv.n_seq_max
    return RC_ERR_SEQ_RANGE


cdef int rule_seq_rm(Core* core, KvTable* kv, int32_t seq, int32_t p0, int32_t p1) noexcept nogil:
    """The recurrent half decides (it cannot cut a state, but may roll one back); the KV half never refuses."""
    if seq >= kv.n_seq_max:
        return 0
    seq, p0, p1 = max(seq, -1), max(p0, -1), max(p1, -1)
    if not core_seq_rm(core, seq, p0, p1):
        return 0
    kv_seq_rm(kv, seq, kv_low(p0), kv_high(p1))
    return 1


cdef int rule_seq_cp(Core* core, KvTable* kv, int32_t src, int32_t dst, int32_t p0, int32_t p1,
                     RuleDetail* d) noexcept nogil:
    """A whole fork: dst must hold nothing and [p0, p1) must cover src; then the KV half, which may run
    out of memory before changing anything; then the recurrent half, which cannot refuse."""
    cdef int code = rule_seq(kv, src, "seq_cp", d)
    if code == 0:
        code = rule_seq(kv, dst, "seq_cp", d)
    if code != 0 or src == dst:
        return code
    p0, p1 = max(p0, -1), max(p1, -1)
    if kv_seq_pos_max(kv, dst) >= 0 or cells_seq_pos_max(&core.cells, dst) >= 0:
        return refuse(d, RULE_ERR_SEQ_HOLDS, "seq_cp", WHAT_CALL, dst)
    cdef int32_t first = kv_seq_pos_min(kv, src)
    cdef int32_t last = max(kv_seq_pos_max(kv, src), cells_seq_pos_max(&core.cells, src))
    if last >= 0 and (max(p0, 0) > max(first, 0) or 0 <= p1 <= last):
        refuse(d, RULE_ERR_CP_RANGE, "seq_cp", WHAT_CALL, src)
        d.pos, d.prev, d.index, d.n = p0, p1, first, last
        return RULE_ERR_CP_RANGE
    if kv_seq_cp(kv, src, dst, kv_low(p0), kv_high(p1)) != KV_OK:
        return kv_refusal(d, KV_NO_MEMORY, 0, 0, "seq_cp")
    core_seq_cp(core, src, dst)
    return 0


cdef int rule_seq_keep(Core* core, KvTable* kv, int32_t seq, RuleDetail* d) noexcept nogil:
    cdef int code = rule_seq(kv, seq, "seq_keep", d)
    if code != 0:
        return code
    kv_seq_keep(kv, seq)
    return core_refusal(d, core_seq_keep(core, seq), "seq_keep", seq, kv.n_seq_max)


cdef int rule_seq_add(Core* core, KvTable* kv, int32_t seq, int32_t p0, int32_t p1, int32_t shift,
                      RuleDetail* d) noexcept nogil:
    """The recurrent state's refusal (its position leaving [0, 2**31 - 1)) is found first and given in
    its words; then a move that would part the halves is refused; then the KV half, which refuses
    before changing anything; then the recurrent half."""
    cdef int64_t a = 0, b = 0
    cdef int code = rule_seq(kv, seq, "seq_add", d)
    if code != 0:
        return code
    p0, p1 = max(p0, -1), max(p1, -1)
    cdef int32_t pos = cells_seq_pos_max(&core.cells, seq)
    if shift and kv_low(p0) <= pos < kv_high(p1) and not 0 <= <int64_t>pos + shift < INT32_MAX:
        code = core_seq_add(core, seq, p0, p1, shift)   # refuses, changing nothing
        if code != 0:
            refuse(d, code, "seq_add", WHAT_SHIFT, seq)
            d.pos, d.n, d.size = pos, shift, kv.n_seq_max
            return code
    if shift:
        code = rule_halves_move_alike(core, kv, Move(seq, kv_low(p0), kv_high(p1), shift, 1), p0, p1, "seq_add", d)
        if code != 0:
            return code
    code = kv_seq_add(kv, seq, kv_low(p0), kv_high(p1), shift, &a, &b)
    if code != KV_OK:
        return kv_refusal(d, code, a, b, "seq_add")
    return core_refusal(d, core_seq_add(core, seq, p0, p1, shift), "seq_add", seq, kv.n_seq_max)


cdef int rule_seq_div(Core* core, KvTable* kv, int32_t seq, int32_t p0, int32_t p1, int32_t d_,
                      RuleDetail* d) noexcept nogil:
    """The KV half refuses d < 1 before anything changes, and a move that would part the halves is
    refused; then the recurrent half cannot refuse."""
    cdef int64_t a = 0, b = 0
    cdef int code = rule_seq(kv, seq, "seq_div", d)
    if code != 0:
        return code
    p0, p1 = max(p0, -1), max(p1, -1)
    if d_ > 1:
        code = rule_halves_move_alike(core, kv, Move(seq, kv_low(p0), kv_high(p1), 0, d_), p0, p1, "seq_div", d)
        if code != 0:
            return code
    code = kv_seq_div(kv, seq, kv_low(p0), kv_high(p1), d_, &a, &b)
    if code != KV_OK:
        return kv_refusal(d, code, a, b, "seq_div")
    return core_refusal(d, core_seq_div(core, seq, p0, p1, d_), "seq_div", seq, kv.n_seq_max)


cdef int32_t rule_seq_pos(const Core* core, const KvTable* kv, bint attention, int32_t seq, bint last,
                          RuleDetail* d) noexcept nogil:
    """The first position seq holds in both halves (the larger of the minima), or the last (the smaller
    of the maxima); a model without attention layers: the recurrent half's."""
    cdef int32_t code = rule_seq(kv, seq, "seq_pos_max" if last else "seq_pos_min", d)
    if code != 0:
        return code
    if last:
        code = cells_seq_pos_max(&core.cells, seq)
        return min(kv_seq_pos_max(kv, seq), code) if attention else code
    code = cells_seq_pos_min(&core.cells, seq)
    return max(kv_seq_pos_min(kv, seq), code) if attention else code


cdef int32_t rule_rollback_min(Core* core, const KvTable* kv, int32_t seq, RuleDetail* d) noexcept nogil:
    """The smallest p0 for which seq_rm(seq, p0, -1) rolls seq back in both halves, or -1."""
    cdef int32_t code = rule_seq(kv, seq, "seq_rollback_min", d)
    return code if code != 0 else core_rollback_min(core, seq)


cdef object rule_error(const RuleDetail* d):
    if d.code == RULE_ERR_KV:     # the KV table's own words
        return kv_error(d.n, d.index, d.need)
    what = d.what.decode("utf-8", "replace")
    if d.what_kind == WHAT_SEQ:
        what = f"{what}: seq_id {d.seq}"
    elif d.what_kind == WHAT_SHIFT:
        what = f"{what}: seq_id {d.seq} at pos {d.pos} shifted by {d.n}"
    return errors.engine_error(d.code, what=what, token=0, seq=d.seq, pos=d.pos, prev=d.prev, n=d.n, index=d.index,
                               need=d.need, size=d.size)


@cython.final
cdef class HybridRule:
    """The rule for ``HybridCache``'s Python facade: its recurrent half's memory core and its KV table,
    each operation with the core's checks and its storage's moves around it, a refusal raised."""

    cdef MemoryCore core
    cdef KVCells kv
    cdef bint attention
    cdef RuleDetail detail

    def __cinit__(self, MemoryCore core, KVCells kv, bint attention):
        self.core, self.kv, self.attention = core, kv, attention

    cdef int done(self, int code) except -1:
        """The storage's moves of the call carried out; a refusal raised."""
        self.core.finish()
        if code < 0:
            raise rule_error(&self.detail)
        return code

    def seq_rm(self, int32_t seq, int32_t p0, int32_t p1) -> bool:
        self.core.usable("seq_rm")
        return bool(self.done(rule_seq_rm(&self.core.core, &self.kv.t, seq, p0, p1)))

    def seq_cp(self, int32_t src, int32_t dst, int32_t p0, int32_t p1) -> None:
        self.core.usable("seq_cp")
        self.done(rule_seq_cp(&self.core.core, &self.kv.t, src, dst, p0, p1, &self.detail))

    def seq_keep(self, int32_t seq) -> None:
        self.core.usable("seq_keep")
        self.done(rule_seq_keep(&self.core.core, &self.kv.t, seq, &self.detail))

    def seq_add(self, int32_t seq, int32_t p0, int32_t p1, int32_t shift) -> None:
        self.core.usable("seq_add")
        self.done(rule_seq_add(&self.core.core, &self.kv.t, seq, p0, p1, shift, &self.detail))

    def seq_div(self, int32_t seq, int32_t p0, int32_t p1, int32_t d) -> None:
        self.core.usable("seq_div")
        self.done(rule_seq_div(&self.core.core, &self.kv.t, seq, p0, p1, d, &self.detail))

    def seq_pos(self, int32_t seq, bint last) -> int:
        self.core.usable("seq_pos_max" if last else "seq_pos_min")
        cdef int32_t pos = rule_seq_pos(&self.core.core, &self.kv.t, self.attention, seq, last, &self.detail)
        if pos < -1 or (pos == -1 and not 0 <= seq < self.kv.t.n_seq_max):
            raise rule_error(&self.detail)
        return pos
