# cython: language_level=3
"""Batch validation and splitting into equal-length ubatches (docs/concepts.md §3–4).

The order is llama.cpp's ``llama_sbatch`` with its ``std::sort`` replaced by a
stable merge sort (docs/concepts.md §3 fixes the order of equal keys).  Everything runs on C
arrays without the GIL; the caller turns the returned code and
``SplitDetail`` into an exception.
"""

from libc.stdint cimport INT32_MAX, uint32_t, uint64_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy

from ._cells cimport (RC_ERR_NO_MEMORY, RC_OK, cells_find_slot, cells_journal_begin,
                      cells_journal_rollback, cells_new_epoch, cells_seq_pos_max)


cdef struct SortContext:
    const int32_t* seq_id_flat
    const int32_t* seq_id_offset
    const int32_t* pos
    const uint64_t* keys
    const int32_t* group_n_seq_id
    const int32_t* group_length

ctypedef int (*compare_fn)(const SortContext* ctx, int32_t a, int32_t b) noexcept nogil


cdef int compare_tokens(const SortContext* ctx, int32_t a, int32_t b) noexcept nogil:
    """More seq ids first, then the seq-id lists element by element, then position."""
    cdef int32_t na = ctx.seq_id_offset[a + 1] - ctx.seq_id_offset[a]
    cdef int32_t nb = ctx.seq_id_offset[b + 1] - ctx.seq_id_offset[b]
    cdef int32_t i, sa, sb
    if na != nb:
        return -1 if na > nb else 1
    for i in range(na):
        sa = ctx.seq_id_flat[ctx.seq_id_offset[a] + i]
        sb = ctx.seq_id_flat[ctx.seq_id_offset[b] + i]
        if sa != sb:
            return -1 if sa < sb else 1
    if ctx.pos[a] != ctx.pos[b]:
        return -1 if ctx.pos[a] < ctx.pos[b] else 1
    return 0


cdef int compare_keys(const SortContext* ctx, int32_t a, int32_t b) noexcept nogil:
    if ctx.keys[a] != ctx.keys[b]:
        return -1 if ctx.keys[a] < ctx.keys[b] else 1
    return 0


cdef int compare_groups(const SortContext* ctx, int32_t a, int32_t b) noexcept nogil:
    """Fewer seq ids first, then longer first."""
    if ctx.group_n_seq_id[a] != ctx.group_n_seq_id[b]:
        return -1 if ctx.group_n_seq_id[a] < ctx.group_n_seq_id[b] else 1
    if ctx.group_length[a] != ctx.group_length[b]:
        return -1 if ctx.group_length[a] > ctx.group_length[b] else 1
    return 0


cdef int stable_sort(int32_t* items, int32_t n, compare_fn compare, const SortContext* ctx) noexcept nogil:
    """Stable bottom-up merge sort (insertion sort for runs of 16)."""
    cdef int32_t run = 16, start, end, i, j, item, width, lo, mid, hi, left, right, k
    cdef int32_t* buffer
    cdef int32_t* swap
    cdef int32_t* source = items
    # batches usually arrive in order (a decode step lists its sequences once, ascending)
    i = 1
    while i < n and compare(ctx, items[i - 1], items[i]) <= 0:
        i += 1
    if i >= n:
        return 0
    start = 0
    while start < n:
        end = min(start + run, n)
        for i in range(start + 1, end):
            item = items[i]
            j = i
            while j > start and compare(ctx, items[j - 1], item) > 0:
                items[j] = items[j - 1]
                j -= 1
            items[j] = item
        start = end
    if n <= run:
        return 0
    buffer = <int32_t*>malloc(<size_t>n * sizeof(int32_t))
    if buffer == NULL:
        return -1
    cdef int32_t* target = buffer
    width = run
    while width < n:
        lo = 0
        while lo < n:
            mid = min(lo + width, n)
            hi = min(lo + 2 * width, n)
            left, right, k = lo, mid, lo
            while left < mid and right < hi:
                if compare(ctx, source[right], source[left]) < 0:
                    target[k] = source[right]
                    right += 1
                else:
                    target[k] = source[left]
                    left += 1
                k += 1
            while left < mid:
                target[k] = source[left]
                left += 1
                k += 1
            while right < hi:
                target[k] = source[right]
                right += 1
                k += 1
            lo = hi
        swap = source
        source = target
        target = swap
        width *= 2
    if source != items:
        memcpy(items, source, <size_t>n * sizeof(int32_t))
    free(buffer)
    return 0


cdef int64_t split_token_entries(const Split* split) noexcept nogil:
    cdef int64_t entries = 0
    cdef int32_t u, g
    for u in range(split.n_ubatches):
        for g in range(split.ub_group_start[u], split.ub_group_start[u + 1]):
            entries += <int64_t>split.group_n_seq_id[g] * split.ub_n_seq_tokens[u]
    return entries


cdef void split_token_arrays(const Split* split, const int32_t* positions, const int32_t* seq_ids, int32_t* bounds,
                             int32_t* pos, int32_t* offsets, int32_t* flat) noexcept nogil:
    # the split's arrays in locals: the stores below cannot alias them, so the loops keep them in registers
    cdef const int32_t* order = split.order
    cdef int32_t u, g, k, j, n_ids, m, token = 0
    cdef int32_t entry = 0
    cdef const int32_t* ids
    offsets[0] = 0
    for u in range(split.n_ubatches + 1):
        bounds[u] = split.ub_token_start[u]
    for u in range(split.n_ubatches):
        m = split.ub_n_seq_tokens[u]
        for g in range(split.ub_group_start[u], split.ub_group_start[u + 1]):
            ids = seq_ids + split.group_seq_offset[g]
            n_ids = split.group_n_seq_id[g]
            for k in range(m):   # token k of the group: the group's ids
                pos[token] = positions[order[token]]
                if n_ids == 1:   # (most groups: one id, no copy loop to set up)
                    flat[entry] = ids[0]
                else:
                    for j in range(n_ids):
                        flat[entry + j] = ids[j]
                entry += n_ids
                token += 1
                offsets[token] = entry


cdef void split_release(Split* split) noexcept nogil:
    free(split.order)
    free(split.output)
    free(split.out_ids)
    free(split.ub_token_start)
    free(split.group_seq_offset)
    split.order = NULL
    split.output = NULL
    split.out_ids = NULL
    split.ub_token_start = NULL
    split.group_seq_offset = NULL


cdef int split_alloc(Split* split, int32_t n) noexcept nogil:
    split.n_tokens = n
    split.order = <int32_t*>malloc(<size_t>n * sizeof(int32_t))
    split.output = <uint8_t*>malloc(<size_t>n)
    split.out_ids = <int64_t*>malloc(<size_t>n * sizeof(int64_t))
    # ub_token_start, ub_group_start: n + 1 each; ub_n_seq_tokens: n
    split.ub_token_start = <int32_t*>malloc((<size_t>3 * <size_t>n + 2) * sizeof(int32_t))
    # group_seq_offset, group_n_seq_id, group_last_pos: n each (a group has >= 1 token)
    split.group_seq_offset = <int32_t*>malloc(<size_t>3 * <size_t>n * sizeof(int32_t))
    if (split.order == NULL or split.output == NULL or split.out_ids == NULL
            or split.ub_token_start == NULL or split.group_seq_offset == NULL):
        split_release(split)
        return SPLIT_ERR_NO_MEMORY
    split.ub_group_start = split.ub_token_start + n + 1
    split.ub_n_seq_tokens = split.ub_token_start + 2 * n + 2
    split.group_n_seq_id = split.group_seq_offset + n
    split.group_last_pos = split.group_seq_offset + 2 * n
    return SPLIT_OK


cdef int check_positions(Cells* cells, int32_t n_tokens, const int32_t* sorted_tokens,
                         const int32_t* seq_id_flat, const int32_t* seq_id_offset,
                         const int32_t* pos, SplitDetail* detail) noexcept nogil:
    """Each sequence's positions are consecutive, distinct, and continue its cell."""
    cdef int32_t n_entries = seq_id_offset[n_tokens], k, t, j, e, seq, p, previous_seq = -1, previous_pos = -1
    cdef int32_t* entries
    cdef int32_t* entry_token = NULL
    cdef uint64_t* keys = NULL
    cdef SortContext ctx
    if n_entries == n_tokens:
        # one seq per token: the token order is already by (seq, pos)
        entries = <int32_t*>sorted_tokens
    else:
        entries = <int32_t*>malloc(<size_t>n_entries * sizeof(int32_t))
        entry_token = <int32_t*>malloc(<size_t>n_entries * sizeof(int32_t))
        keys = <uint64_t*>malloc(<size_t>n_entries * sizeof(uint64_t))
        if entries == NULL or entry_token == NULL or keys == NULL:
            free(entries)
            free(entry_token)
            free(keys)
            return SPLIT_ERR_NO_MEMORY
        for t in range(n_tokens):
            for j in range(seq_id_offset[t], seq_id_offset[t + 1]):
                entry_token[j] = t
                keys[j] = ((<uint64_t><uint32_t>seq_id_flat[j]) << 32) | <uint32_t>pos[t]
                entries[j] = j
        ctx.keys = keys
        if stable_sort(entries, n_entries, compare_keys, &ctx) != 0:
            free(entries)
            free(entry_token)
            free(keys)
            return SPLIT_ERR_NO_MEMORY
    cdef int code = SPLIT_OK
    for k in range(n_entries):
        e = entries[k]
        if entry_token == NULL:
            seq = seq_id_flat[seq_id_offset[e]]
            p = pos[e]
        else:
            seq = seq_id_flat[e]
            p = pos[entry_token[e]]
        if seq != previous_seq:
            previous_pos = cells_seq_pos_max(cells, seq)
            if previous_pos >= 0 and p != previous_pos + 1:
                code = SPLIT_ERR_CONTINUE
        elif p != previous_pos + 1:
            code = SPLIT_ERR_GAP
        if code != SPLIT_OK:
            detail.seq = seq
            detail.pos = p
            detail.prev = previous_pos
            break
        previous_seq = seq
        previous_pos = p
    if entry_token != NULL:
        free(entries)
        free(entry_token)
        free(keys)
    return code


cdef int check_find_slot_positions(const Split* split, Cells* cells, const int32_t* seq_id_flat,
                                   SplitDetail* detail) noexcept nogil:
    """Walk the ubatches as find_slot will: each owner's new pos = its old pos + n_seq_tokens."""
    cdef int32_t u, g, j, seq, owner, last, n_seq_tokens
    cells_new_epoch(cells)
    for u in range(split.n_ubatches):
        n_seq_tokens = split.ub_n_seq_tokens[u]
        for g in range(split.ub_group_start[u], split.ub_group_start[u + 1]):
            owner = seq_id_flat[split.group_seq_offset[g]]
            last = split.group_last_pos[g]
            if cells.stamp[owner] != cells.stamp_epoch:
                cells.stamp[owner] = cells.stamp_epoch
                cells.scratch[owner] = cells_seq_pos_max(cells, owner)
            if cells.scratch[owner] >= 0 and last != cells.scratch[owner] + n_seq_tokens:
                detail.seq = owner
                detail.pos = last
                detail.prev = cells.scratch[owner]
                detail.n = n_seq_tokens
                return SPLIT_ERR_FIND_SLOT
            for j in range(split.group_n_seq_id[g]):
                seq = seq_id_flat[split.group_seq_offset[g] + j]
                cells.stamp[seq] = cells.stamp_epoch
                cells.scratch[seq] = last
    return SPLIT_OK


cdef int split_batch(Split* split, Cells* cells, int32_t n_tokens,
                     const int32_t* seq_id_flat, const int32_t* seq_id_offset,
                     const int32_t* pos, const int8_t* logits, bint logits_all,
                     int32_t n_ubatch, bint embd_pooled, SplitDetail* detail) noexcept nogil:
    cdef int32_t t, j, seq, i, k, g, n_groups, n_live, left, limit, length, taken, n_out
    cdef int32_t n_ub, n_emitted, n_placed, index
    cdef int code
    cdef SortContext ctx
    # -- seq ids and positions that no cache could take
    for t in range(n_tokens):
        if pos[t] < 0 or pos[t] == INT32_MAX:
            detail.token = t
            detail.pos = pos[t]
            return SPLIT_ERR_NEGATIVE_POS if pos[t] < 0 else SPLIT_ERR_POS_MAX
        for j in range(seq_id_offset[t], seq_id_offset[t + 1]):
            seq = seq_id_flat[j]
            if not 0 <= seq < cells.size:
                detail.token = t
                detail.seq = seq
                return SPLIT_ERR_SEQ_RANGE
    if split_alloc(split, n_tokens) != SPLIT_OK:
        return SPLIT_ERR_NO_MEMORY
    # scratch: sorted token ids, then per group: start (in ids), length, list offset, count; group order
    cdef int32_t* scratch = <int32_t*>malloc(<size_t>6 * <size_t>n_tokens * sizeof(int32_t))
    if scratch == NULL:
        split_release(split)
        return SPLIT_ERR_NO_MEMORY
    cdef int32_t* ids = scratch
    cdef int32_t* g_start = scratch + n_tokens
    cdef int32_t* g_length = scratch + 2 * n_tokens
    cdef int32_t* g_list = scratch + 3 * n_tokens
    cdef int32_t* g_n_seq = scratch + 4 * n_tokens
    cdef int32_t* g_order = scratch + 5 * n_tokens

    # 1. sort tokens
    ctx.seq_id_flat = seq_id_flat
    ctx.seq_id_offset = seq_id_offset
    ctx.pos = pos
    for t in range(n_tokens):
        ids[t] = t
    code = SPLIT_ERR_NO_MEMORY if stable_sort(ids, n_tokens, compare_tokens, &ctx) else SPLIT_OK
    if code == SPLIT_OK:
        code = check_positions(cells, n_tokens, ids, seq_id_flat, seq_id_offset, pos, detail)
    if code != SPLIT_OK:
        free(scratch)
        split_release(split)
        return code

    # 2. runs of identical seq-id lists are groups
    n_groups = 0
    for k in range(n_tokens):
        t = ids[k]
        if n_groups and same_list(seq_id_flat, seq_id_offset, g_list[n_groups - 1],
                                  g_n_seq[n_groups - 1], t):
            g_length[n_groups - 1] += 1
            continue
        g_start[n_groups] = k
        g_length[n_groups] = 1
        g_list[n_groups] = seq_id_offset[t]
        g_n_seq[n_groups] = seq_id_offset[t + 1] - seq_id_offset[t]
        g_order[n_groups] = n_groups
        n_groups += 1

    # 3. order groups; they are consumed from the end
    ctx.group_n_seq_id = g_n_seq
    ctx.group_length = g_length
    if stable_sort(g_order, n_groups, compare_groups, &ctx) != 0:
        free(scratch)
        split_release(split)
        return SPLIT_ERR_NO_MEMORY

    # 4.-5. split
    n_live = n_groups
    left = n_tokens
    n_ub = 0
    n_emitted = 0
    n_placed = 0
    n_out = 0
    while left > 0:
        while n_live > 0 and g_length[g_order[n_live - 1]] == 0:
            n_live -= 1
        limit = min(left, n_ubatch)
        length = 0
        taken = 0
        split.ub_token_start[n_ub] = n_placed
        split.ub_group_start[n_ub] = n_emitted
        k = n_live - 1
        while k >= 0:
            g = g_order[k]
            if length == 0:
                length = min(g_length[g], limit)
            elif g_length[g] < length:
                break  # cannot happen: lengths grow towards the front
            for i in range(length):
                index = ids[g_start[g] + i]
                split.order[n_placed] = index
                if logits_all:
                    split.output[n_placed] = 1
                elif logits != NULL:
                    split.output[n_placed] = logits[index] != 0
                else:
                    split.output[n_placed] = index == n_tokens - 1
                if split.output[n_placed]:
                    split.out_ids[n_out] = index
                    n_out += 1
                n_placed += 1
            split.group_seq_offset[n_emitted] = g_list[g]
            split.group_n_seq_id[n_emitted] = g_n_seq[g]
            split.group_last_pos[n_emitted] = pos[ids[g_start[g] + length - 1]]
            n_emitted += 1
            g_start[g] += length
            g_length[g] -= length
            taken += length
            if embd_pooled or g_n_seq[g] > 1 or length + taken > limit:
                break
            k -= 1
        split.ub_n_seq_tokens[n_ub] = length
        n_ub += 1
        left -= taken
    split.ub_token_start[n_ub] = n_placed
    split.ub_group_start[n_ub] = n_emitted
    split.n_ubatches = n_ub
    split.n_outputs = n_out
    free(scratch)

    code = check_find_slot_positions(split, cells, seq_id_flat, detail)
    if code != SPLIT_OK:
        split_release(split)
    return code


cdef inline bint same_list(const int32_t* seq_id_flat, const int32_t* seq_id_offset,
                           int32_t list_offset, int32_t n_seq, int32_t t) noexcept nogil:
    cdef int32_t j
    if seq_id_offset[t + 1] - seq_id_offset[t] != n_seq:
        return False
    for j in range(n_seq):
        if seq_id_flat[seq_id_offset[t] + j] != seq_id_flat[list_offset + j]:
            return False
    return True


cdef int split_prepare(const Split* split, Cells* cells, const int32_t* seq_id_flat) noexcept nogil:
    cdef int32_t u, g0, head = cells.head, used = cells.used, n = cells.n
    cdef int code = RC_OK
    cells_journal_begin(cells)
    for u in range(split.n_ubatches):
        g0 = split.ub_group_start[u]
        code = cells_find_slot(cells, split.ub_group_start[u + 1] - g0,
                               split.ub_token_start[u + 1] - split.ub_token_start[u],
                               seq_id_flat, split.group_seq_offset + g0,
                               split.group_n_seq_id + g0, split.group_last_pos + g0)
        if code != RC_OK:
            break
    if cells_journal_rollback(cells, head, used, n) != RC_OK and code == RC_OK:
        code = RC_ERR_NO_MEMORY
    return code
