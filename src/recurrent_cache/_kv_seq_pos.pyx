# cython: language_level=3
"""The per-sequence positions of the KV cell table: a treap of (position, cell) pairs per sequence.

``_kv_ops`` keeps one ``SeqPositions`` beside its cells and reaches a
sequence's cells through it in O(log n) per cell instead of scanning the table
(the structure and its costs: ``_kv_seq_pos.pxd``).
"""

from libc.stdlib cimport free, malloc, realloc
from libc.string cimport memset

cdef int64_t CELL_BITS = 0xFFFFFFFF     # the low half of a pair key: the cell


# -- lifecycle ---------------------------------------------------------------------------------------------

cdef bint sp_init(SeqPositions* p, int32_t n_seq) noexcept nogil:
    memset(p, 0, sizeof(SeqPositions))
    p.n_seq = n_seq
    p.root = <int32_t*>malloc(<size_t>4 * <size_t>n_seq * sizeof(int32_t))
    if p.root == NULL:
        return False
    p.count = p.root + n_seq         # one block, four [n_seq] arrays
    p.lowest = p.root + 2 * n_seq
    p.highest = p.root + 3 * n_seq
    sp_clear(p)
    return True


cdef void sp_release(SeqPositions* p) noexcept nogil:
    free(p.root)
    free(p.nodes)
    memset(p, 0, sizeof(SeqPositions))


cdef void sp_clear(SeqPositions* p) noexcept nogil:
    cdef int32_t i
    for i in range(p.n_seq):
        p.root[i] = -1
        p.lowest[i] = -1
        p.highest[i] = -1
        p.count[i] = 0
    p.node_top = 0
    p.node_free = -1
    p.nodes_live = 0
    p.rng = 2463534242


# -- the treaps --------------------------------------------------------------------------------------------

cdef inline int64_t pair_key(int32_t pos, int32_t cell) noexcept nogil:
    return (<int64_t>pos << 32) | <int64_t>cell


cdef bint sp_reserve(SeqPositions* p, int64_t extra) noexcept nogil:
    cdef int64_t need = p.nodes_live + extra
    cdef int64_t cap = p.node_cap
    cdef PairNode* nodes
    if need <= cap:
        return True
    if need >= INT32_MAX:
        return False
    while cap < need:
        cap = cap * 2 if cap else 1024
    if cap >= INT32_MAX:
        cap = INT32_MAX - 1
    nodes = <PairNode*>realloc(p.nodes, <size_t>cap * sizeof(PairNode))
    if nodes == NULL:
        return False
    p.nodes = nodes
    p.node_cap = <int32_t>cap
    return True


cdef int32_t new_node(SeqPositions* p, int64_t key) noexcept nogil:
    """A node from the free list or the pool (sp_reserve made room)."""
    cdef int32_t node
    if p.node_free >= 0:
        node = p.node_free
        p.node_free = p.nodes[node].left
    else:
        node = p.node_top
        p.node_top += 1
    p.rng ^= p.rng << 13          # xorshift32: the treap's random priorities
    p.rng ^= p.rng >> 17
    p.rng ^= p.rng << 5
    p.nodes[node].key = key
    p.nodes[node].prio = p.rng
    p.nodes[node].left = -1
    p.nodes[node].right = -1
    p.nodes[node].parent = -1
    p.nodes_live += 1
    return node


cdef inline void set_child(SeqPositions* p, int32_t seq, int32_t parent, int32_t old, int32_t new) noexcept nogil:
    """``new`` takes ``old``'s place under ``parent`` (as the root when parent is -1)."""
    if parent < 0:
        p.root[seq] = new
    elif p.nodes[parent].left == old:
        p.nodes[parent].left = new
    else:
        p.nodes[parent].right = new
    if new >= 0:
        p.nodes[new].parent = parent


cdef void rotate_up(SeqPositions* p, int32_t seq, int32_t x) noexcept nogil:
    """``x`` takes its parent's place, the parent becomes its child (the key order stays)."""
    cdef int32_t up = p.nodes[x].parent
    cdef int32_t moved
    if p.nodes[up].left == x:
        moved = p.nodes[x].right
        p.nodes[up].left = moved
        p.nodes[x].right = up
    else:
        moved = p.nodes[x].left
        p.nodes[up].right = moved
        p.nodes[x].left = up
    if moved >= 0:
        p.nodes[moved].parent = up
    set_child(p, seq, p.nodes[up].parent, up, x)
    p.nodes[up].parent = x


cdef void sp_insert(SeqPositions* p, int32_t seq, int32_t pos, int32_t cell) noexcept nogil:
    """Add the pair as a leaf, then rotate it up to its priority's place.  A pair past either end —
    what decoding adds — hangs under that end's node: expected O(1), the tree's height not walked."""
    cdef int64_t key = pair_key(pos, cell)
    cdef int32_t node = new_node(p, key)
    cdef int32_t parent = p.highest[seq]
    p.count[seq] += 1
    if parent < 0:
        p.root[seq] = node
        p.lowest[seq] = node
        p.highest[seq] = node
        return
    if key > p.nodes[parent].key:
        p.nodes[parent].right = node
        p.highest[seq] = node
    elif key < p.nodes[p.lowest[seq]].key:
        parent = p.lowest[seq]
        p.nodes[parent].left = node
        p.lowest[seq] = node
    else:
        parent = p.root[seq]
        while True:
            if key < p.nodes[parent].key:
                if p.nodes[parent].left < 0:
                    p.nodes[parent].left = node
                    break
                parent = p.nodes[parent].left
            else:
                if p.nodes[parent].right < 0:
                    p.nodes[parent].right = node
                    break
                parent = p.nodes[parent].right
    p.nodes[node].parent = parent
    while p.nodes[node].parent >= 0 and p.nodes[node].prio > p.nodes[p.nodes[node].parent].prio:
        rotate_up(p, seq, node)


cdef int32_t next_end(const SeqPositions* p, int32_t node, int32_t child, bint largest) noexcept nogil:
    """The tree's new last (``largest``) or first node once ``node``, that end with at most the one
    ``child``, leaves: the extreme of the child's subtree, else the node's parent."""
    if child < 0:
        return p.nodes[node].parent
    while (p.nodes[child].right if largest else p.nodes[child].left) >= 0:
        child = p.nodes[child].right if largest else p.nodes[child].left
    return child


cdef void sp_erase(SeqPositions* p, int32_t seq, int32_t pos, int32_t cell) noexcept nogil:
    """Rotate the pair's node down until it has at most one child, then splice it out."""
    cdef int64_t key = pair_key(pos, cell)
    cdef int32_t node, child
    if p.root[seq] < 0:
        return
    if key == p.nodes[p.highest[seq]].key:
        node = p.highest[seq]
    elif key == p.nodes[p.lowest[seq]].key:
        node = p.lowest[seq]
    else:
        node = p.root[seq]
        while node >= 0 and p.nodes[node].key != key:
            node = p.nodes[node].left if key < p.nodes[node].key else p.nodes[node].right
        if node < 0:
            return
    while p.nodes[node].left >= 0 and p.nodes[node].right >= 0:
        child = p.nodes[node].left
        if p.nodes[p.nodes[node].right].prio > p.nodes[child].prio:
            child = p.nodes[node].right
        rotate_up(p, seq, child)
    child = p.nodes[node].left if p.nodes[node].left >= 0 else p.nodes[node].right
    if node == p.highest[seq]:
        p.highest[seq] = next_end(p, node, child, True)
    if node == p.lowest[seq]:
        p.lowest[seq] = next_end(p, node, child, False)
    set_child(p, seq, p.nodes[node].parent, node, child)
    p.nodes[node].left = p.node_free
    p.node_free = node
    p.nodes_live -= 1
    p.count[seq] -= 1


cdef int32_t collect(const SeqPositions* p, int32_t node, int64_t lo, int64_t hi, int32_t* out,
                     int32_t n) noexcept nogil:
    """Append to ``out`` the cells of the pairs with lo <= key < hi, in key order; the new length."""
    while node >= 0:
        if p.nodes[node].key < lo:
            node = p.nodes[node].right
        elif p.nodes[node].key >= hi:
            node = p.nodes[node].left
        else:
            n = collect(p, p.nodes[node].left, lo, hi, out, n)
            out[n] = <int32_t>(p.nodes[node].key & CELL_BITS)
            n += 1
            node = p.nodes[node].right
    return n


cdef int32_t sp_collect(const SeqPositions* p, int32_t seq, int32_t p0, int32_t p1, int32_t* out) noexcept nogil:
    return collect(p, p.root[seq], pair_key(p0, 0), pair_key(p1, 0), out, 0)


# -- the invariants ----------------------------------------------------------------------------------------

cdef int check_tree(const SeqPositions* p, int32_t node, const int32_t* cell_pos, int32_t n_cells, int64_t* last,
                    int64_t* n) noexcept nogil:
    """In order: keys increasing, heap order of priorities, each pair a cell at its position."""
    cdef int32_t cell, child
    if node < 0:
        return 0
    child = p.nodes[node].left
    if child >= 0 and (p.nodes[child].prio > p.nodes[node].prio or p.nodes[child].parent != node):
        return 1
    child = p.nodes[node].right
    if child >= 0 and (p.nodes[child].prio > p.nodes[node].prio or p.nodes[child].parent != node):
        return 1
    if check_tree(p, p.nodes[node].left, cell_pos, n_cells, last, n):
        return 1
    if p.nodes[node].key <= last[0]:
        return 1
    last[0] = p.nodes[node].key
    n[0] += 1
    cell = <int32_t>(p.nodes[node].key & CELL_BITS)
    if cell < 0 or cell >= n_cells or cell_pos[cell] != <int32_t>(p.nodes[node].key >> 32):
        return 1
    return check_tree(p, p.nodes[node].right, cell_pos, n_cells, last, n)


cdef bint ends_agree(const SeqPositions* p, int32_t seq, int64_t last) noexcept nogil:
    """The root has no parent; lowest / highest are the tree's first and last nodes."""
    cdef int32_t node = p.root[seq]
    if node < 0:
        return p.lowest[seq] < 0 and p.highest[seq] < 0
    if p.nodes[node].parent != -1 or p.highest[seq] < 0 or p.nodes[p.highest[seq]].key != last:
        return False
    while p.nodes[node].left >= 0:
        node = p.nodes[node].left
    return node == p.lowest[seq]


cdef int sp_check(const SeqPositions* p, int32_t seq, const int32_t* cell_pos, int32_t n_cells) noexcept nogil:
    cdef int64_t last = -1, n = 0
    if check_tree(p, p.root[seq], cell_pos, n_cells, &last, &n) or n != p.count[seq]:
        return 1
    return 0 if ends_agree(p, seq, last) else 1
