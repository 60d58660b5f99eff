# cython: language_level=3
"""C-level API of the KV table's per-sequence positions (docs/hybrid.md, "KV cells").

Each sequence keeps its (position, cell) pairs ordered in a treap — a binary
search tree by key, a heap by random priority — over one shared node pool, with
links to its parent and to the tree's first and last node: the smallest and
largest position are O(1), and a pair past either end (what decoding adds) is
expected O(1) to add.  Every function is ``noexcept nogil``; the inserts never
fail because ``sp_reserve`` made room for them first.
"""

from libc.stdint cimport INT32_MAX, int32_t, int64_t, uint32_t

cdef struct PairNode:        # one (position, cell) pair of a sequence's treap: one cache line per visit
    int64_t key               # pos << 32 | cell
    int32_t left              # (the free list's link for a free node)
    int32_t right
    int32_t parent            # -1 at the root
    uint32_t prio

cdef struct SeqPositions:
    int32_t n_seq
    int32_t* root             # [n_seq] root node, -1 = the sequence holds no cell
    int32_t* count            # [n_seq] pairs of the sequence
    int32_t* lowest           # [n_seq] the node of the smallest pair, -1 = none
    int32_t* highest          # [n_seq] the node of the largest pair, -1 = none
    PairNode* nodes           # [node_cap]
    int32_t node_cap
    int32_t node_top          # nodes [0, node_top) were handed out once
    int32_t node_free         # free list head, -1 = empty
    int32_t nodes_live
    uint32_t rng

# False when out of memory (nothing allocated then)
cdef bint sp_init(SeqPositions* p, int32_t n_seq) noexcept nogil
cdef void sp_release(SeqPositions* p) noexcept nogil
cdef void sp_clear(SeqPositions* p) noexcept nogil
# room for `extra` more pairs, so that the inserts that follow cannot fail; False when out of memory
cdef bint sp_reserve(SeqPositions* p, int64_t extra) noexcept nogil
cdef void sp_insert(SeqPositions* p, int32_t seq, int32_t pos, int32_t cell) noexcept nogil
cdef void sp_erase(SeqPositions* p, int32_t seq, int32_t pos, int32_t cell) noexcept nogil
# out[:n] = the cells of `seq` with positions in [p0, p1), by position; returns n
cdef int32_t sp_collect(const SeqPositions* p, int32_t seq, int32_t p0, int32_t p1, int32_t* out) noexcept nogil
# the tree of `seq` is well formed, holds count[seq] pairs and each pair's position is cell_pos[cell]
# (cells in [0, n_cells)): 0, else 1
cdef int sp_check(const SeqPositions* p, int32_t seq, const int32_t* cell_pos, int32_t n_cells) noexcept nogil


cdef inline int32_t sp_min(const SeqPositions* p, int32_t seq) noexcept nogil:
    """The sequence's smallest position, -1 when it holds none."""
    return -1 if p.lowest[seq] < 0 else <int32_t>(p.nodes[p.lowest[seq]].key >> 32)


cdef inline int32_t sp_max(const SeqPositions* p, int32_t seq) noexcept nogil:
    """The sequence's largest position, -1 when it holds none."""
    return -1 if p.highest[seq] < 0 else <int32_t>(p.nodes[p.highest[seq]].key >> 32)
