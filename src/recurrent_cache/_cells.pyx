# cython: language_level=3
"""The cell table in C: placement (find_slot), sequence operations, copy plans.

Semantics are docs/concepts.md §1–2 (llama.cpp's ``llama_kv_cache_recurrent`` with its
FIXes); the costs are not the reference's: a sequence is reached through its
tail in O(1), cell membership is a linked list, and the free-cell search walks
a bitset 64 cells at a time.  Only ``clear``, ``seq_keep`` and ``seq_rm`` of
every sequence touch every cell.  These are primitives: ``_core`` composes them
into the cache's operations (with the history rules) and owns the only instance.
"""

from libc.stdint cimport INT32_MAX
from libc.stdlib cimport free, malloc, realloc
from libc.string cimport memset


cdef extern from "rc_bits.h":
    int rc_ctz64(uint64_t x) noexcept nogil

cdef uint64_t ALL_ONES = <uint64_t>0xFFFFFFFFFFFFFFFF


# -- journalled writes ---------------------------------------------------------

cdef bint journal_push(Cells* c, int32_t* addr32, uint64_t* addr64, int64_t old) noexcept nogil:
    cdef Py_ssize_t cap
    cdef JournalEntry* grown
    if c.journal_failed:
        return False
    if c.journal_len == c.journal_cap:
        cap = c.journal_cap * 2 if c.journal_cap else 256
        grown = <JournalEntry*>realloc(c.journal, cap * sizeof(JournalEntry))
        if grown == NULL:
            # Out of memory: drop this and every later write, so a rollback
            # still restores the cache exactly; prepare then reports failure.
            c.journal_failed = 1
            return False
        c.journal = grown
        c.journal_cap = cap
    c.journal[c.journal_len].addr32 = addr32
    c.journal[c.journal_len].addr64 = addr64
    c.journal[c.journal_len].old = old
    c.journal_len += 1
    return True


cdef inline void set32(Cells* c, int32_t* addr, int32_t value) noexcept nogil:
    if c.journaling and not journal_push(c, addr, NULL, addr[0]):
        return
    addr[0] = value


cdef inline void set64(Cells* c, uint64_t* addr, uint64_t value) noexcept nogil:
    if c.journaling and not journal_push(c, NULL, addr, <int64_t>addr[0]):
        return
    addr[0] = value


cdef void cells_journal_begin(Cells* c) noexcept nogil:
    c.journal_len = 0
    c.journal_failed = 0
    c.journaling = True


cdef int cells_journal_rollback(Cells* c, int32_t head, int32_t used, int32_t n) noexcept nogil:
    cdef Py_ssize_t k
    cdef int failed = c.journal_failed
    for k in range(c.journal_len - 1, -1, -1):
        if c.journal[k].addr32 != NULL:
            c.journal[k].addr32[0] = <int32_t>c.journal[k].old
        else:
            c.journal[k].addr64[0] = <uint64_t>c.journal[k].old
    c.journal_len = 0
    c.journaling = False
    c.journal_failed = 0
    c.head = head
    c.used = used
    c.n = n
    return RC_ERR_NO_MEMORY if failed else RC_OK


# -- lifecycle -----------------------------------------------------------------

cdef int cells_init(Cells* c, int32_t size) noexcept nogil:
    memset(c, 0, sizeof(Cells))
    c.size = size
    c.n_words = (size + 63) // 64
    # sizes in size_t: 9 * size overflows int32 from size = 238,609,295 on
    c.pos = <int32_t*>malloc(<size_t>9 * <size_t>size * sizeof(int32_t))
    c.free_bits = <uint64_t*>malloc(<size_t>c.n_words * sizeof(uint64_t))
    if c.pos == NULL or c.free_bits == NULL:
        cells_release(c)
        return RC_ERR_NO_MEMORY
    # one block, nine [size] arrays
    c.src = c.pos + size
    c.tail = c.pos + 2 * size
    c.n_seq = c.pos + 3 * size
    c.first = c.pos + 4 * size
    c.next = c.pos + 5 * size
    c.prev = c.pos + 6 * size
    c.stamp = c.pos + 7 * size
    c.scratch = c.pos + 8 * size
    memset(c.stamp, 0, <size_t>size * sizeof(int32_t))
    cells_clear(c)
    return RC_OK


cdef void cells_release(Cells* c) noexcept nogil:
    free(c.pos)
    free(c.free_bits)
    free(c.journal)
    c.pos = NULL
    c.free_bits = NULL
    c.journal = NULL


cdef void cells_clear(Cells* c) noexcept nogil:
    cdef int32_t i
    memset(c.pos, 0xFF, <size_t>7 * <size_t>c.size * sizeof(int32_t))   # -1 everywhere ...
    memset(c.n_seq, 0, <size_t>c.size * sizeof(int32_t))                # ... but counts
    for i in range(c.n_words):
        c.free_bits[i] = ALL_ONES
    if c.size % 64:
        c.free_bits[c.n_words - 1] = (<uint64_t>1 << (c.size % 64)) - 1
    c.head = 0
    c.used = 0   # n stays: it describes the last placement, as in llama.cpp


# -- membership ----------------------------------------------------------------

cdef inline void mark_free(Cells* c, int32_t cell, bint is_free) noexcept nogil:
    cdef uint64_t* word = &c.free_bits[cell >> 6]
    cdef uint64_t bit = (<uint64_t>1) << (cell & 63)
    set64(c, word, (word[0] | bit) if is_free else (word[0] & ~bit))


cdef inline void join(Cells* c, int32_t cell, int32_t seq) noexcept nogil:
    """Add seq (in no cell) to cell."""
    cdef int32_t head_seq = c.first[cell]
    set32(c, &c.next[seq], head_seq)
    set32(c, &c.prev[seq], -1)
    if head_seq >= 0:
        set32(c, &c.prev[head_seq], seq)
    set32(c, &c.first[cell], seq)
    set32(c, &c.tail[seq], cell)
    if c.n_seq[cell] == 0:
        mark_free(c, cell, False)
        c.used += 1
    set32(c, &c.n_seq[cell], c.n_seq[cell] + 1)


cdef void cells_join(Cells* c, int32_t cell, int32_t seq) noexcept nogil:
    join(c, cell, seq)


cdef int32_t cells_leave(Cells* c, int32_t seq) noexcept nogil:
    return leave(c, seq)


cdef inline void free_cell(Cells* c, int32_t cell) noexcept nogil:
    set32(c, &c.pos[cell], -1)
    set32(c, &c.src[cell], -1)
    mark_free(c, cell, True)
    c.used -= 1


cdef int32_t leave(Cells* c, int32_t seq) noexcept nogil:
    """Remove seq from its cell; return the cell if that freed it, else -1."""
    cdef int32_t cell = c.tail[seq]
    cdef int32_t before, after
    if cell < 0:
        return -1
    before = c.prev[seq]
    after = c.next[seq]
    if before >= 0:
        set32(c, &c.next[before], after)
    else:
        set32(c, &c.first[cell], after)
    if after >= 0:
        set32(c, &c.prev[after], before)
    set32(c, &c.next[seq], -1)
    set32(c, &c.prev[seq], -1)
    set32(c, &c.tail[seq], -1)
    set32(c, &c.n_seq[cell], c.n_seq[cell] - 1)
    if c.n_seq[cell] == 0:
        free_cell(c, cell)
        return cell
    return -1


cdef void empty_cell(Cells* c, int32_t cell) noexcept nogil:
    """Remove every sequence from a non-empty cell and free it."""
    cdef int32_t seq = c.first[cell]
    cdef int32_t after
    while seq >= 0:
        after = c.next[seq]
        set32(c, &c.next[seq], -1)
        set32(c, &c.prev[seq], -1)
        set32(c, &c.tail[seq], -1)
        seq = after
    set32(c, &c.first[cell], -1)
    set32(c, &c.n_seq[cell], 0)
    free_cell(c, cell)


cdef void swap_cells(Cells* c, int32_t a, int32_t b) noexcept nogil:
    """Exchange the contents of two cells and re-point every member's tail."""
    cdef int32_t tmp, seq
    tmp = c.pos[a]; set32(c, &c.pos[a], c.pos[b]); set32(c, &c.pos[b], tmp)
    tmp = c.src[a]; set32(c, &c.src[a], c.src[b]); set32(c, &c.src[b], tmp)
    tmp = c.first[a]; set32(c, &c.first[a], c.first[b]); set32(c, &c.first[b], tmp)
    tmp = c.n_seq[a]; set32(c, &c.n_seq[a], c.n_seq[b]); set32(c, &c.n_seq[b], tmp)
    mark_free(c, a, c.n_seq[a] == 0)
    mark_free(c, b, c.n_seq[b] == 0)
    seq = c.first[a]
    while seq >= 0:
        set32(c, &c.tail[seq], a)
        seq = c.next[seq]
    seq = c.first[b]
    while seq >= 0:
        set32(c, &c.tail[seq], b)
        seq = c.next[seq]


cdef int32_t cells_next_free(const Cells* c, int32_t start) noexcept nogil:
    """First free cell at or after start, wrapping around; -1 when none is free."""
    cdef int32_t w, w0
    cdef uint64_t bits
    if start >= c.size:
        start = 0
    w0 = start >> 6
    bits = c.free_bits[w0] & (ALL_ONES << (start & 63))
    w = w0
    while True:
        if bits:
            return (w << 6) + rc_ctz64(bits)
        w += 1
        if w == c.n_words:
            break
        bits = c.free_bits[w]
    for w in range(w0 + 1):
        bits = c.free_bits[w]
        if w == w0:
            bits &= ~(ALL_ONES << (start & 63))
        if bits:
            return (w << 6) + rc_ctz64(bits)
    return -1


# -- sequence operations -------------------------------------------------------

cdef inline int32_t norm_p1(int32_t p1) noexcept nogil:
    return INT32_MAX if p1 < 0 else p1


cdef bint cells_seq_rm(Cells* c, int32_t seq, int32_t p0, int32_t p1) noexcept nogil:
    cdef int32_t cell, freed, new_head
    if p0 < 0:
        p0 = 0
    p1 = norm_p1(p1)
    if seq >= c.size:
        return False
    if seq >= 0:
        cell = c.tail[seq]
        if cell < 0:
            return True
        if (0 < p0 <= c.pos[cell]) or (0 < p1 <= c.pos[cell]):
            return False   # a recurrent state cannot be partially erased
        if p0 <= c.pos[cell] < p1:
            freed = leave(c, seq)
            if 0 <= freed < c.head:
                c.head = freed
        return True
    if p0 == p1:
        return True
    if p0 != 0 or p1 != INT32_MAX:
        return False
    new_head = c.size
    for cell in range(c.size):
        if c.n_seq[cell] > 0 and c.pos[cell] >= 0:
            empty_cell(c, cell)
            if new_head == c.size:
                new_head = cell
    if new_head < c.head:
        c.head = new_head
    return True


cdef void cells_seq_cp(Cells* c, int32_t seq_src, int32_t seq_dst) noexcept nogil:
    cdef int32_t cell
    if seq_src == seq_dst or not (0 <= seq_src < c.size and 0 <= seq_dst < c.size):
        return
    leave(c, seq_dst)
    cell = c.tail[seq_src]
    if cell >= 0:
        join(c, cell, seq_dst)


cdef int cells_seq_keep(Cells* c, int32_t seq) noexcept nogil:
    cdef int32_t cell, member, after, kept
    cdef int32_t new_head = c.size
    if not 0 <= seq < c.size:
        return RC_ERR_SEQ_RANGE   # llama.cpp would empty every cell
    kept = c.tail[seq]
    for cell in range(c.size):
        if cell == kept:
            member = c.first[cell]
            while member >= 0:
                after = c.next[member]
                if member != seq:
                    leave(c, member)
                member = after
            continue
        if c.n_seq[cell] > 0:
            empty_cell(c, cell)
        if new_head == c.size:
            new_head = cell
    if new_head < c.head:
        c.head = new_head
    return RC_OK


cdef int32_t cells_tail_in_range(const Cells* c, int32_t seq, int32_t p0, int32_t p1) noexcept nogil:
    """The cell of seq when its pos lies in [p0, p1) (seq_add / seq_div), else -1."""
    cdef int32_t cell
    if p0 < 0:
        p0 = 0
    p1 = norm_p1(p1)
    if p0 == p1 or not 0 <= seq < c.size:
        return -1
    cell = c.tail[seq]
    if cell < 0 or not (p0 <= c.pos[cell] < p1):
        return -1
    return cell


cdef int cells_seq_add(Cells* c, int32_t seq, int32_t p0, int32_t p1, int32_t shift) noexcept nogil:
    cdef int32_t cell
    cdef int64_t moved
    if not 0 <= seq < c.size:
        return RC_ERR_SEQ_RANGE
    cell = cells_tail_in_range(c, seq, p0, p1)
    if shift == 0 or cell < 0:
        return RC_OK
    moved = <int64_t>c.pos[cell] + shift
    if moved < 0 or moved >= INT32_MAX:
        return RC_ERR_POSITION
    c.pos[cell] = <int32_t>moved   # the cell's pos: every sequence sharing it moves too
    return RC_OK


cdef int cells_seq_div(Cells* c, int32_t seq, int32_t p0, int32_t p1, int32_t d) noexcept nogil:
    cdef int32_t cell
    if not 0 <= seq < c.size:
        return RC_ERR_SEQ_RANGE
    if d <= 0:
        return RC_ERR_ARGUMENT
    cell = cells_tail_in_range(c, seq, p0, p1)
    if d != 1 and cell >= 0:
        c.pos[cell] = c.pos[cell] // d   # pos >= 0: floor is C's truncation
    return RC_OK


cdef int32_t cells_seq_pos_min(const Cells* c, int32_t seq) noexcept nogil:
    # a sequence is in at most one cell, so min and max are that cell's pos
    if not 0 <= seq < c.size or c.tail[seq] < 0:
        return -1
    return c.pos[c.tail[seq]]


cdef int32_t cells_seq_pos_max(const Cells* c, int32_t seq) noexcept nogil:
    return cells_seq_pos_min(c, seq)


cdef void cells_new_epoch(Cells* c) noexcept nogil:
    if c.stamp_epoch == INT32_MAX:
        memset(c.stamp, 0, <size_t>c.size * sizeof(int32_t))
        c.stamp_epoch = 0
    c.stamp_epoch += 1


# -- find_slot -----------------------------------------------------------------

cdef inline int32_t group_start(const int32_t* seq_offset, int32_t s) noexcept nogil:
    return s if seq_offset == NULL else seq_offset[s]


cdef inline int32_t group_size(const int32_t* n_seq_id, int32_t s) noexcept nogil:
    return 1 if n_seq_id == NULL else n_seq_id[s]


cdef int check_ubatch_seqs(Cells* c, int32_t n_seqs, const int32_t* seq_ids,
                           const int32_t* seq_offset, const int32_t* n_seq_id) noexcept nogil:
    """Every seq id in range and listed once in the whole ubatch; nothing written."""
    cdef int32_t s, j, seq
    cells_new_epoch(c)
    for s in range(n_seqs):
        if group_size(n_seq_id, s) < 1:
            return RC_ERR_SEQ_RANGE
        for j in range(group_size(n_seq_id, s)):
            seq = seq_ids[group_start(seq_offset, s) + j]
            if not 0 <= seq < c.size:
                return RC_ERR_SEQ_RANGE
            if c.stamp[seq] == c.stamp_epoch:
                return RC_ERR_DUPLICATE_SEQ
            c.stamp[seq] = c.stamp_epoch
    return RC_OK


cdef int cells_find_slot(Cells* c, int32_t n_seqs, int32_t n_tokens,
                         const int32_t* seq_ids, const int32_t* seq_offset,
                         const int32_t* n_seq_id, const int32_t* last_pos) noexcept nogil:
    cdef int32_t s, j, owner, cell, next_empty, lo, hi, dst
    cdef int code = check_ubatch_seqs(c, n_seqs, seq_ids, seq_offset, n_seq_id)
    if code != RC_OK:
        return code
    if n_seqs < 1:
        return RC_ERR_PLACEMENT
    # 1. search from the start again when enough cells below head are free
    if c.head > c.used + 2 * n_tokens:
        c.head = 0
    # 2. sequences that become shared leave their own cells
    for s in range(n_seqs):
        for j in range(1, group_size(n_seq_id, s)):
            leave(c, seq_ids[group_start(seq_offset, s) + j])
    # 3.-4. every owner gets a cell it holds alone
    next_empty = cells_next_free(c, c.head)
    lo = c.size - 1
    hi = 0
    for s in range(n_seqs):
        owner = seq_ids[group_start(seq_offset, s)]
        cell = c.tail[owner]
        if cell < 0 or c.n_seq[cell] != 1:
            if next_empty < 0:
                return RC_ERR_NO_FREE_CELL
            if cell >= 0:
                set32(c, &c.pos[next_empty], c.pos[cell])
                set32(c, &c.src[next_empty], c.src[cell])
                leave(c, owner)
            # The owner enters its new cell at once (the reference only points
            # its tail there), so a later gather swap carries its tail along.
            join(c, next_empty, owner)
            cell = next_empty
            if s + 1 < n_seqs:
                next_empty = cells_next_free(c, next_empty + 1)
        if cell < lo:
            lo = cell
        if cell > hi:
            hi = cell
    # 5. gather: group s into cell lo + s
    for s in range(n_seqs):
        dst = lo + s
        cell = c.tail[seq_ids[group_start(seq_offset, s)]]
        if cell != dst:
            if dst >= c.size:
                return RC_ERR_PLACEMENT
            swap_cells(c, dst, cell)
    # 6. the group's sequences share the cell, at the group's last position
    for s in range(n_seqs):
        cell = lo + s
        set32(c, &c.pos[cell], last_pos[s])
        for j in range(1, group_size(n_seq_id, s)):
            join(c, cell, seq_ids[group_start(seq_offset, s) + j])
    # 7.
    c.head = lo
    c.n = hi - lo + 1
    return RC_OK if c.n >= n_seqs else RC_ERR_PLACEMENT


cdef void cells_copy_plan(Cells* c, int32_t* copy_src, uint8_t* zero) noexcept nogil:
    cdef int32_t i, cell
    for i in range(c.n):
        cell = c.head + i
        copy_src[i] = c.src[cell] if c.src[cell] >= 0 else cell
        zero[i] = c.src[cell] < 0
        if c.n_seq[cell] > 0:
            c.src[cell] = cell


# -- invariants ----------------------------------------------------------------

cdef int cells_check(const Cells* c, int32_t* where=NULL) noexcept nogil:
    """0, or which invariant of docs/concepts.md §1 is broken (CHECK_*), with the cell or seq in *where."""
    cdef int32_t cell, seq, count, before, used = 0, members = 0, tails = 0, at = -1
    cdef int broken = 0
    for cell in range(c.size):
        count = 0
        before = -1
        seq = c.first[cell]
        while seq >= 0 and count <= c.size and not broken:
            if not seq < c.size:
                broken = CHECK_SEQ_RANGE
            elif c.tail[seq] != cell:
                broken = CHECK_TAIL
            elif c.prev[seq] != before:
                broken = CHECK_LIST
            else:
                before = seq
                seq = c.next[seq]
                count += 1
        if not broken and count != c.n_seq[cell]:
            broken = CHECK_COUNT
        if not broken and ((c.free_bits[cell >> 6] >> (cell & 63)) & 1) != (count == 0):
            broken = CHECK_FREE_BIT
        if not broken and count == 0 and (c.pos[cell] != -1 or c.src[cell] != -1):
            broken = CHECK_EMPTY
        if broken:
            at = cell
            break
        used += count > 0
        members += count
    if not broken:
        for seq in range(c.size):
            tails += c.tail[seq] >= 0
        if tails != members:
            broken = CHECK_DANGLING   # every member's tail was checked, so a surplus tail dangles
        elif used != c.used:
            broken = CHECK_USED
    if where != NULL:
        where[0] = at
    return broken



cdef str cells_check_message(const Cells* c, int broken, int32_t at):
    return {
        CHECK_SEQ_RANGE: f"cell {at} holds a seq outside [0, {c.size})",
        CHECK_TAIL: f"cell {at} holds a seq whose tail is elsewhere",
        CHECK_LIST: f"broken member list of cell {at}",
        CHECK_COUNT: f"cell {at} counts {c.n_seq[at] if at >= 0 else 0} sequences but lists another number",
        CHECK_FREE_BIT: f"the free bit of cell {at} disagrees with its sequences",
        CHECK_EMPTY: f"empty cell {at} has pos {c.pos[at] if at >= 0 else 0} / src {c.src[at] if at >= 0 else 0}",
        CHECK_DANGLING: "a sequence has a tail but no cell holds it",
        CHECK_USED: f"used is {c.used}, but another number of cells is not empty",
    }[broken]
