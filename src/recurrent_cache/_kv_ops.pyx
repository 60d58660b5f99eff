# cython: language_level=3
"""The attention KV cell table in C: find_slot, apply, prepare, load, the sequence operations.

Semantics are ``kv_reference`` (llama.cpp's ``llama_kv_cache``, one stream);
the costs are not: a sequence's positions are a treap of (position, cell)
pairs (``_kv_seq_pos``), so ``seq_pos_min`` / ``seq_pos_max`` and every ranged operation of one
sequence reach its cells in O(log n) per cell instead of scanning the table;
empty cells are a bitset that ``find_slot`` walks 64 cells at a time (without a
sliding window, where only empty cells are usable); ``prepare`` and
``load_seq`` undo what they changed through a journal of the cells changed
(``_kv_journal``).  Only ``clear``, ``load``, ``seq_keep`` and ``seq_rm`` of
every sequence touch every cell.  The mask is ``_kv_mask``'s, the invariants'
check ``_kv_check``'s.  ``_kv_cells.KVCells`` is the thin Python class over it, with
``kv_reference.KVCells``'s interface; this module is C only, no Python names.
"""

from libc.stdint cimport INT32_MAX, INT32_MIN, uint8_t, uint64_t
from libc.stdlib cimport free, malloc
from libc.string cimport memset

from ._kv_journal cimport kj_begin, kj_commit, kj_release, kj_reserve, kj_touch, kj_undo, list_cell
from ._kv_seq_pos cimport sp_clear, sp_collect, sp_erase, sp_init, sp_insert, sp_max, sp_min, sp_release, sp_reserve

cdef extern from "rc_bits.h":
    int rc_ctz64(uint64_t x) noexcept nogil


# -- cells -------------------------------------------------------------------------------------------------

cdef bint kv_seq_has(const KvTable* t, int32_t cell, int32_t seq) noexcept nogil:
    return (t.seq_bits[<int64_t>cell * t.seq_words + (seq >> 6)] >> (seq & 63)) & 1


cdef inline int32_t only_seq(const KvTable* t, int32_t cell) noexcept nogil:
    """The sequence of a cell holding exactly one."""
    cdef int32_t w
    cdef uint64_t word
    for w in range(t.seq_words):
        word = t.seq_bits[<int64_t>cell * t.seq_words + w]
        if word:
            return w * 64 + rc_ctz64(word)
    return -1


cdef void lower_top(KvTable* t) noexcept nogil:
    """Cell top - 1 was freed: walk down to the last used cell."""
    cdef int32_t i = t.top - 1
    cdef uint64_t word
    while i >= 0:
        word = t.free_bits[i >> 6]
        if word == <uint64_t>0xFFFFFFFFFFFFFFFF and (i & 63) == 63:
            i -= 64
            continue
        if not ((word >> (i & 63)) & 1):
            break
        i -= 1
    t.top = i + 1


cdef void take_cell(KvTable* t, int32_t cell, int32_t pos) noexcept nogil:
    kj_touch(t, cell)
    t.pos[cell] = pos
    t.free_bits[cell >> 6] &= ~(<uint64_t>1 << (cell & 63))
    t.used += 1
    if cell + 1 > t.top:
        t.top = cell + 1


cdef void join(KvTable* t, int32_t cell, int32_t seq) noexcept nogil:
    kj_touch(t, cell)
    t.seq_bits[<int64_t>cell * t.seq_words + (seq >> 6)] |= <uint64_t>1 << (seq & 63)
    t.n_seq[cell] += 1
    sp_insert(&t.seqs, seq, t.pos[cell], cell)


cdef void empty_cell(KvTable* t, int32_t cell) noexcept nogil:
    """A cell whose last sequence left: free."""
    t.pos[cell] = -1
    t.shift[cell] = 0
    t.free_bits[cell >> 6] |= <uint64_t>1 << (cell & 63)
    t.used -= 1
    if cell + 1 == t.top:
        lower_top(t)


cdef bint leave(KvTable* t, int32_t cell, int32_t seq) noexcept nogil:
    """``seq`` leaves ``cell``; whether that emptied it."""
    kj_touch(t, cell)
    t.seq_bits[<int64_t>cell * t.seq_words + (seq >> 6)] &= ~(<uint64_t>1 << (seq & 63))
    t.n_seq[cell] -= 1
    sp_erase(&t.seqs, seq, t.pos[cell], cell)
    if t.n_seq[cell] == 0:
        empty_cell(t, cell)
        return True
    return False


cdef void free_cell(KvTable* t, int32_t cell) noexcept nogil:
    """Every sequence leaves a used cell."""
    kj_touch(t, cell)
    list_cell(t, cell, False)
    memset(&t.seq_bits[<int64_t>cell * t.seq_words], 0, <size_t>t.seq_words * sizeof(uint64_t))
    t.n_seq[cell] = 0
    empty_cell(t, cell)


# -- lifecycle ---------------------------------------------------------------------------------------------

cdef int kv_init(KvTable* t, int32_t size, int32_t n_seq_max, int32_t n_swa, int32_t swa_type) noexcept nogil:
    cdef int32_t k
    memset(t, 0, sizeof(KvTable))
    t.size = size
    t.n_seq_max = n_seq_max
    t.n_swa = n_swa
    t.swa_type = swa_type
    t.seq_words = (n_seq_max + 63) // 64
    t.free_words = (size + 63) // 64
    t.pos = <int32_t*>malloc(<size_t>4 * <size_t>size * sizeof(int32_t))
    t.seq_bits = <uint64_t*>malloc(<size_t>size * <size_t>t.seq_words * sizeof(uint64_t))
    t.free_bits = <uint64_t*>malloc(<size_t>t.free_words * sizeof(uint64_t))
    t.mark = <uint8_t*>malloc(<size_t>size)
    t.max_rm = <int32_t*>malloc(<size_t>n_seq_max * sizeof(int32_t))
    if (t.pos == NULL or t.seq_bits == NULL or t.free_bits == NULL or t.mark == NULL or t.max_rm == NULL
            or not sp_init(&t.seqs, n_seq_max)):
        kv_release(t)
        return KV_NO_MEMORY
    t.shift = t.pos + size         # one block, four [size] arrays
    t.n_seq = t.pos + 2 * size
    t.scratch = t.pos + 3 * size
    memset(t.mark, 0, <size_t>size)
    for k in range(n_seq_max):        # apply_touches tells a sequence it saw by -2
        t.max_rm[k] = -1
    kv_clear(t)
    return KV_OK


cdef void kv_release(KvTable* t) noexcept nogil:
    free(t.pos)
    free(t.seq_bits)
    free(t.free_bits)
    free(t.mark)
    free(t.max_rm)
    sp_release(&t.seqs)
    kj_release(t)
    memset(t, 0, sizeof(KvTable))


cdef void kv_clear(KvTable* t) noexcept nogil:
    cdef int32_t i
    memset(t.pos, 0xFF, <size_t>t.size * sizeof(int32_t))          # -1: empty
    memset(t.shift, 0, <size_t>2 * <size_t>t.size * sizeof(int32_t))   # shift and n_seq
    memset(t.seq_bits, 0, <size_t>t.size * <size_t>t.seq_words * sizeof(uint64_t))
    memset(t.free_bits, 0xFF, <size_t>t.free_words * sizeof(uint64_t))
    if t.size & 63:   # bits past the last cell stay clear, so a full word reads as "no free cell"
        t.free_bits[t.free_words - 1] = (<uint64_t>1 << (t.size & 63)) - 1
    sp_clear(&t.seqs)
    t.head = 0
    t.used = 0
    t.top = 0
    t.has_shift = False


# -- placing a ubatch --------------------------------------------------------------------------------------

cdef int kv_check_tokens(const KvTable* t, int32_t n, const int32_t* pos, const int32_t* flat,
                         const int32_t* offsets, int64_t* a, int64_t* b) noexcept nogil:
    cdef int32_t token, k, k2, seq
    for token in range(n):
        if pos[token] < 0 or pos[token] >= POS_END:
            a[0] = token
            b[0] = pos[token]
            return KV_POSITION
        for k in range(offsets[token], offsets[token + 1]):
            seq = flat[k]
            if seq < 0 or seq >= t.n_seq_max:
                a[0] = seq
                b[0] = t.n_seq_max
                return KV_SEQ_RANGE
            for k2 in range(offsets[token], k):
                if flat[k2] == seq:
                    a[0] = token
                    b[0] = seq
                    return KV_DUPLICATE_SEQ
    return KV_OK


cdef inline bint masked_swa(int32_t n_swa, int32_t swa_type, int32_t p0, int32_t p1) noexcept nogil:
    """kv_reference.is_masked_swa."""
    cdef int32_t diff
    if swa_type == SWA_STANDARD:
        return <int64_t>p1 - p0 >= n_swa
    if swa_type == SWA_CHUNKED:
        return p0 < (p1 // n_swa) * n_swa
    if swa_type == SWA_SYMMETRIC:
        diff = p1 - p0
        return diff > n_swa // 2 or diff < -(n_swa // 2)
    return False


cdef bint usable(const KvTable* t, int32_t cell) noexcept nogil:
    """Empty, or held by one sequence that no longer sees it through the sliding window."""
    cdef int32_t owner
    if t.pos[cell] < 0:
        return True
    if t.n_seq[cell] != 1 or t.swa_type == SWA_NONE:
        return False
    owner = only_seq(t, cell)
    return masked_swa(t.n_swa, t.swa_type, t.pos[cell], kv_seq_pos_max(t, owner) + 1)


cdef int32_t next_free(const KvTable* t, int32_t start, int32_t end) noexcept nogil:
    """The first empty cell in [start, end), or end."""
    cdef int32_t w
    cdef uint64_t word
    if start >= end:
        return end
    w = start >> 6
    word = t.free_bits[w] & (~<uint64_t>0 << (start & 63))
    while True:
        if word:
            start = w * 64 + rc_ctz64(word)
            return start if start < end else end
        w += 1
        if w * 64 >= end:
            return end
        word = t.free_bits[w]


cdef int kv_find_slot(const KvTable* t, int32_t n, bint cont, int32_t* slot) noexcept nogil:
    cdef int32_t head = t.head
    cdef int32_t found = 0, cell, k
    cdef int64_t tested = 0
    cdef int32_t n_test = n if cont else 1
    if head > t.used + 2 * <int64_t>n:
        head = 0
    if n > t.size:
        return KV_NO_SLOT
    if not cont and t.swa_type == SWA_NONE:
        # only empty cells are usable: the first n of them from head on, wrapping around once
        if t.size - t.used < n:
            return KV_NO_SLOT
        cell = next_free(t, head, t.size)
        while found < n and cell < t.size:
            slot[found] = cell
            found += 1
            cell = next_free(t, cell + 1, t.size)
        # wrap around only when the cells from head on did not suffice: the scan below head costs
        # O(head / 64), which a decode step found right after head must not pay
        if found < n:
            cell = next_free(t, 0, head)
        while found < n:
            slot[found] = cell
            found += 1
            cell = next_free(t, cell + 1, head)
        return KV_OK
    # llama.cpp's search, cell by cell
    while True:
        if head + n_test > t.size:
            tested += t.size - head
            head = 0
            continue
        for k in range(n_test):
            cell = head
            head += 1
            tested += 1
            if usable(t, cell):
                slot[found] = cell
                found += 1
            elif cont:
                break
        if found == n:
            return KV_OK
        if cont:
            found = 0
        if tested >= t.size:
            return KV_NO_SLOT


cdef int kv_apply(KvTable* t, int32_t n, const int32_t* slot, const int32_t* pos, const int32_t* flat,
                  const int32_t* offsets, int64_t* a, int64_t* b) noexcept nogil:
    cdef int32_t token, cell, k, owner, lowest, code = KV_OK
    for token in range(n):
        cell = slot[token]
        if cell < 0 or cell >= t.size:
            code = KV_CELL_INDEX
            a[0] = cell
            b[0] = t.size
            break
        if t.mark[cell] & MARK_LISTED or t.n_seq[cell] > 1:
            code = KV_CELL_TAKEN
            a[0] = cell
            break
        t.mark[cell] |= MARK_LISTED
    for k in range(token if code != KV_OK else n):
        t.mark[slot[k]] &= <uint8_t>~MARK_LISTED
    if code != KV_OK:
        return code
    if not sp_reserve(&t.seqs, offsets[n]):
        return KV_NO_MEMORY
    for k in range(t.n_seq_max):
        t.max_rm[k] = -1
    for token in range(n):
        cell = slot[token]
        if t.pos[cell] >= 0:      # reused under the sliding window
            owner = only_seq(t, cell)
            if t.pos[cell] > t.max_rm[owner]:
                t.max_rm[owner] = t.pos[cell]
            leave(t, cell, owner)
        take_cell(t, cell, pos[token])
        for k in range(offsets[token], offsets[token + 1]):
            join(t, cell, flat[k])
    # a sequence keeps one unbroken run of positions: it loses every position up to one overwritten
    for owner in range(t.n_seq_max):
        if t.max_rm[owner] >= 0:
            lowest = kv_seq_pos_min(t, owner)
            if 0 <= lowest <= t.max_rm[owner]:
                kv_seq_rm(t, owner, lowest, t.max_rm[owner] + 1)
    t.head = slot[n - 1] + 1
    return KV_OK


# -- preparing and loading (the journal: _kv_journal) ----------------------------------------------------

cdef int64_t apply_touches(const KvTable* t, int32_t n, const int32_t* slot) noexcept nogil:
    """At most how many cells ``kv_apply`` of this slot changes: its own, and every cell of each
    sequence it overwrites a token of (the purge)."""
    cdef int64_t touched = n
    cdef int32_t k, owner
    for k in range(n):
        if t.pos[slot[k]] >= 0:
            owner = only_seq(t, slot[k])
            if t.max_rm[owner] != -2:
                t.max_rm[owner] = -2
                touched += t.seqs.count[owner]
    for k in range(n):
        if t.pos[slot[k]] >= 0:
            t.max_rm[only_seq(t, slot[k])] = -1
    return touched


cdef int journaled_place(KvTable* t, int32_t n, const int32_t* pos, const int32_t* flat, const int32_t* offsets,
                         int32_t* slot, int64_t* a, int64_t* b) noexcept nogil:
    """find_slot (not continuous) and apply while journaling."""
    cdef int code = kv_find_slot(t, n, False, slot)
    if code != KV_OK:
        return code
    if not kj_reserve(t, apply_touches(t, n, slot)):
        return KV_NO_MEMORY
    return kv_apply(t, n, slot, pos, flat, offsets, a, b)


cdef int32_t kv_padded_n_kv(const KvTable* t, int32_t pad) noexcept nogil:
    return <int32_t>min(<int64_t>t.size, max(<int64_t>pad, (<int64_t>t.top + pad - 1) // pad * pad))


cdef int kv_prepare(KvTable* t, int32_t n_ubatch, const int32_t* bounds, const int32_t* pos, const int32_t* flat,
                    const int32_t* offsets, int32_t* slots, int64_t* a, int64_t* b) noexcept nogil:
    cdef int32_t u
    cdef int code = KV_OK
    kj_begin(t)
    for u in range(n_ubatch - 1):   # each ubatch placed for the next to see ...
        code = journaled_place(t, bounds[u + 1] - bounds[u], pos + bounds[u], flat, offsets + bounds[u],
                               slots + bounds[u], a, b)
        if code != KV_OK:
            break
    if code == KV_OK:               # ... the last one only found: nothing comes after it (a decode step's cost)
        code = kv_find_slot(t, bounds[n_ubatch] - bounds[n_ubatch - 1], False, slots + bounds[n_ubatch - 1])
    kj_undo(t)
    return code


cdef int kv_load(KvTable* t, int32_t n, const int32_t* pos, const int32_t* flat, const int32_t* offsets) noexcept nogil:
    cdef int32_t cell, k
    if n > t.size:
        return KV_TOO_MANY_CELLS
    if not sp_reserve(&t.seqs, <int64_t>offsets[n] - t.seqs.nodes_live):
        return KV_NO_MEMORY
    kv_clear(t)
    for cell in range(n):
        take_cell(t, cell, pos[cell])
        for k in range(offsets[cell], offsets[cell + 1]):
            join(t, cell, flat[k])
    return KV_OK


cdef int kv_load_seq(KvTable* t, int32_t seq, int32_t n, const int32_t* pos, const int32_t* flat,
                     const int32_t* offsets, int32_t* slot, int64_t* a, int64_t* b) noexcept nogil:
    """llama.cpp's state_read_meta for one sequence: seq_rm of it, find_slot (not continuous) from
    head, apply; undone when no slot exists."""
    cdef int code
    if n > t.size:          # llama.cpp refuses before its seq_rm
        return KV_NO_SLOT
    if not kj_reserve(t, t.seqs.count[seq]):
        return KV_NO_MEMORY
    kj_begin(t)
    kv_seq_rm(t, seq, 0, POS_END)
    code = journaled_place(t, n, pos, flat, offsets, slot, a, b)
    if code == KV_OK:
        kj_commit(t)
    else:
        kj_undo(t)
    return code


# -- sequence operations -----------------------------------------------------------------------------------

cdef int kv_seq_rm(KvTable* t, int32_t seq, int32_t p0, int32_t p1) noexcept nogil:
    cdef int32_t n, k, cell, first_freed = t.size
    if seq >= 0:
        n = sp_collect(&t.seqs, seq, p0, p1, t.scratch)
        for k in range(n):
            cell = t.scratch[k]
            if leave(t, cell, seq) and cell < first_freed:
                first_freed = cell
    else:
        for cell in range(t.size):
            if p0 <= t.pos[cell] < p1:
                free_cell(t, cell)
                if cell < first_freed:
                    first_freed = cell
    if first_freed < t.head:
        t.head = first_freed
    return KV_OK


cdef int kv_seq_cp(KvTable* t, int32_t src, int32_t dst, int32_t p0, int32_t p1) noexcept nogil:
    cdef int32_t n, k, cell
    if src == dst:
        return KV_OK
    n = sp_collect(&t.seqs, src, p0, p1, t.scratch)
    if not sp_reserve(&t.seqs, n):
        return KV_NO_MEMORY
    for k in range(n):
        cell = t.scratch[k]
        if not kv_seq_has(t, cell, dst):
            join(t, cell, dst)
    return KV_OK


cdef int kv_seq_keep(KvTable* t, int32_t seq) noexcept nogil:
    cdef int32_t cell, first_freed = t.size
    for cell in range(t.size):
        if t.pos[cell] < 0:
            continue
        if kv_seq_has(t, cell, seq):
            if t.n_seq[cell] > 1:
                list_cell(t, cell, False)
                memset(&t.seq_bits[<int64_t>cell * t.seq_words], 0, <size_t>t.seq_words * sizeof(uint64_t))
                t.seq_bits[<int64_t>cell * t.seq_words + (seq >> 6)] = <uint64_t>1 << (seq & 63)
                t.n_seq[cell] = 1
                sp_insert(&t.seqs, seq, t.pos[cell], cell)
        else:
            free_cell(t, cell)
            if cell < first_freed:
                first_freed = cell
    if first_freed < t.head:
        t.head = first_freed
    return KV_OK


cdef int refused_move(const KvTable* t, int32_t n, int32_t delta, int32_t d, int64_t* a,
                      int64_t* b) noexcept nogil:
    """Whether moving the cells scratch[:n] by ``delta`` (``d == 0``) or dividing their positions by
    ``d`` is refused: a position reaching 2**31 - 1, then a pending shift leaving int32.  Names the
    lowest cell at fault, as a scan of the cells in index order would."""
    cdef int32_t k, cell, check
    cdef int64_t moved, shift
    cdef bint fault
    cdef int code = KV_OK
    for check in range(2):
        for k in range(n):
            cell = t.scratch[k]
            moved = <int64_t>t.pos[cell] + delta if d == 0 else t.pos[cell] // d
            # the shift is how far the key's position moved: delta, or new - old for a division
            # (llama.cpp adds old - new there, which rotates the keys away from their new positions)
            shift = t.shift[cell] + (delta if d == 0 else moved - t.pos[cell])
            fault = moved >= POS_END if check == 0 else not INT32_MIN <= shift <= INT32_MAX
            if fault and (code == KV_OK or cell < a[0]):
                code = KV_SHIFT_POSITION if check == 0 else KV_SHIFT_RANGE
                a[0] = cell
                b[0] = t.pos[cell] if check == 0 else t.shift[cell]
        if code != KV_OK:
            return code
    return KV_OK


cdef int kv_seq_add(KvTable* t, int32_t seq, int32_t p0, int32_t p1, int32_t delta, int64_t* a,
                    int64_t* b) noexcept nogil:
    cdef int32_t n, k, cell, first_freed = t.size
    cdef int code = KV_OK
    if delta == 0 or p0 == p1:
        return KV_OK
    n = sp_collect(&t.seqs, seq, p0, p1, t.scratch)
    code = refused_move(t, n, delta, 0, a, b)
    if code != KV_OK:
        return code
    for k in range(n):
        cell = t.scratch[k]
        t.has_shift = True
        list_cell(t, cell, False)
        t.pos[cell] += delta
        t.shift[cell] += delta
        if t.pos[cell] < 0:
            memset(&t.seq_bits[<int64_t>cell * t.seq_words], 0, <size_t>t.seq_words * sizeof(uint64_t))
            t.n_seq[cell] = 0
            empty_cell(t, cell)
            if cell < first_freed:
                first_freed = cell
        else:
            list_cell(t, cell, True)
    t.head = first_freed if first_freed < t.size else 0
    return KV_OK


cdef int kv_seq_div(KvTable* t, int32_t seq, int32_t p0, int32_t p1, int32_t d, int64_t* a,
                    int64_t* b) noexcept nogil:
    cdef int32_t n, k, cell, moved
    cdef int code = KV_OK
    if d < 1:
        a[0] = d
        return KV_DIVISOR
    if d == 1 or p0 == p1:
        return KV_OK
    n = sp_collect(&t.seqs, seq, p0, p1, t.scratch)
    code = refused_move(t, n, 0, d, a, b)
    if code != KV_OK:
        return code
    for k in range(n):
        cell = t.scratch[k]
        t.has_shift = True
        list_cell(t, cell, False)
        moved = t.pos[cell] // d
        t.shift[cell] += moved - t.pos[cell]
        t.pos[cell] = moved
        list_cell(t, cell, True)
    return KV_OK


cdef int32_t kv_seq_pos_min(const KvTable* t, int32_t seq) noexcept nogil:
    return sp_min(&t.seqs, seq)


cdef int32_t kv_seq_pos_max(const KvTable* t, int32_t seq) noexcept nogil:
    return sp_max(&t.seqs, seq)


cdef void kv_reset_shift(KvTable* t) noexcept nogil:
    memset(t.shift, 0, <size_t>t.size * sizeof(int32_t))
    t.has_shift = False
