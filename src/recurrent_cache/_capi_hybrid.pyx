# cython: language_level=3
"""The C API's context of a ``HybridCache`` (API version 3; docs/c-api.md, "Hybrid memories").

A hybrid's context adds the KV half: the cache's KV cell table (``_kv_ops``' functions on its
``KVCells``) and the K / V storage, which ``attach_kv`` takes from the cache.  Its batches are
placed in both halves (``batch_kv_prepare`` finds every ubatch's KV cells at ``rc_batch_init``;
``rc_batch_kv_cells`` / ``rc_batch_kv_mask`` read the applied one's), its sequence operations are
HybridCache's, from ``_hybrid_rule`` (the one copy of its both-halves rule for the compiled engine,
which HybridCache's facade calls too), its state bytes the facade's (with the GIL).

``_capi``'s entries call the helpers here on a hybrid's context; the entries only a hybrid has are
defined here and published in ``_capi``'s one table (and ``capi.pxd``).
"""

from libc.stdint cimport INT32_MAX, int32_t, int64_t, uintptr_t
from libc.stdlib cimport malloc
from libc.string cimport memcpy, memset

from ._capi_types cimport (RC_ERR_ARGUMENT, RC_ERR_KV, RC_ERR_KV_NO_SLOT, RC_ERR_MASK_SIZE, RC_ERR_NO_MEMORY,
                           RC_ERR_NOT_APPLIED, RC_ERR_NOT_HYBRID, RC_ERR_NULL, RC_ERR_OVERLAP, RC_ERR_PYTHON,
                           RC_ERR_STALE, RC_ERR_TARGET_SIZE, RC_ERR_TENSOR_INDEX, RC_MASK_FULL, RC_MASK_SLIDING, RC_OK,
                           BatchData, Context, CtxData, rc_batch, rc_ctx, record)
from ._core_ops cimport core_clear, shares_rows
from ._hybrid_rule cimport RuleDetail, rule_seq_pos
from ._kv_cells cimport KVCells
from ._kv_mask cimport kv_mask
from ._kv_ops cimport kv_check_tokens, kv_clear, kv_prepare, kv_reset_shift
from ._kv_table cimport KV_NO_MEMORY, KV_NO_SLOT, KV_OK
from ._split cimport Split, split_token_arrays, split_token_entries

from . import errors


cdef attach_kv(Context context, object cache, object kv_table):
    """The context's KV half: the table, and the K / V tensors' host memory (kept alive by the context)."""
    import numpy as np
    if not isinstance(kv_table, KVCells):   # (the reference engine is refused before: _capi.context_for)
        raise errors.ArgumentError(f"the C API needs the compiled engine's KV table, got {type(kv_table).__name__}")
    cdef CtxData* d = &context.data
    k, v = (cache.storage.host_view(tensor) for tensor in cache.kv_tensors)
    layers = np.ascontiguousarray(cache.attn_layers, dtype=np.int32)
    context.kv = kv_table
    context.kv_views = (k, v, layers)
    d.hybrid = True
    d.kv = &(<KVCells>kv_table).t
    d.n_attn = <int32_t>layers.shape[0]
    d.attn_layers = <const int32_t*><uintptr_t>layers.ctypes.data
    d.k_data = <char*><uintptr_t>k.ctypes.data
    d.v_data = <char*><uintptr_t>v.ctypes.data
    d.k_layer_bytes = k.nbytes // max(1, d.n_attn)
    d.v_layer_bytes = v.nbytes // max(1, d.n_attn)
    d.k_row_bytes = k.strides[1]
    d.v_row_bytes = v.strides[1]
    d.v_trans = bool(cache.v_trans)
    d.kv_pad = cache.kv_pad


cdef int rule_failure(CtxData* c, int code, const RuleDetail* rule) noexcept nogil:
    """Record a hybrid's refusal: rc_error_message words it as the Python API's exception."""
    record(c, code, rule.what)
    c.detail.by_rule = True
    c.detail.rule = rule[0]
    return code


cdef int kv_failure(CtxData* c, int kv_code, int64_t a, int64_t b, const char* what) noexcept nogil:
    """Record a KV table's refusal (its message is the Python API's: ``kv_reference.kv_error``)."""
    cdef RuleDetail rule
    if kv_code == KV_NO_MEMORY:
        return record(c, RC_ERR_NO_MEMORY, what)
    memset(&rule, 0, sizeof(RuleDetail))
    rule.code, rule.what, rule.n, rule.index, rule.need = RC_ERR_KV, what, kv_code, a, b
    return rule_failure(c, RC_ERR_KV, &rule)


cdef int batch_kv_prepare(CtxData* c, BatchData* b, const int32_t* pos) noexcept nogil:
    """A hybrid batch's KV half (``HybridCache.init_batch``): every ubatch's tokens from the split, then
    their cells, found with the ubatches before placed and the table left as it was."""
    cdef Split* s = &b.split
    cdef int64_t entries = split_token_entries(s), a = 0, bb = 0
    cdef int32_t u, n_tokens = s.n_tokens
    cdef int code
    if entries >= INT32_MAX:
        return record(c, RC_ERR_NO_MEMORY, "rc_batch_init")
    b.kv_block = <int32_t*>malloc(<size_t>(s.n_ubatches + 1 + 3 * <int64_t>n_tokens + 1 + entries) * sizeof(int32_t))
    if b.kv_block == NULL:
        return record(c, RC_ERR_NO_MEMORY, "rc_batch_init")
    b.kv_bounds = b.kv_block
    b.kv_pos = b.kv_bounds + s.n_ubatches + 1
    b.kv_offsets = b.kv_pos + n_tokens
    b.kv_slots = b.kv_offsets + n_tokens + 1
    b.kv_flat = b.kv_slots + n_tokens
    split_token_arrays(s, pos, b.seq_ids, b.kv_bounds, b.kv_pos, b.kv_offsets, b.kv_flat)
    if c.n_attn == 0:   # (a model without attention layers: its table is never touched)
        return RC_OK
    for u in range(s.n_ubatches):
        code = kv_check_tokens(c.kv, b.kv_bounds[u + 1] - b.kv_bounds[u], b.kv_pos + b.kv_bounds[u], b.kv_flat,
                               b.kv_offsets + b.kv_bounds[u], &a, &bb)
        if code != KV_OK:
            return kv_failure(c, code, a, bb, "rc_batch_init")
    code = kv_prepare(c.kv, s.n_ubatches, b.kv_bounds, b.kv_pos, b.kv_flat, b.kv_offsets, b.kv_slots, &a, &bb)
    if code == KV_NO_SLOT:
        record(c, RC_ERR_KV_NO_SLOT, "rc_batch_init")
        c.detail.n = c.kv.used
        c.detail.size = c.kv.size
        return RC_ERR_KV_NO_SLOT
    if code != KV_OK:
        return kv_failure(c, code, a, bb, "rc_batch_init")
    return RC_OK


cdef inline CtxData* hybrid_of(const rc_ctx* ctx, const char* what, int* code) noexcept nogil:
    """ctx as a hybrid's context, or NULL with *code set (RC_ERR_NULL, RC_ERR_NOT_HYBRID recorded)."""
    cdef CtxData* c = <CtxData*>ctx
    if c == NULL:
        code[0] = RC_ERR_NULL
        return NULL
    if not c.hybrid:
        code[0] = record(c, RC_ERR_NOT_HYBRID, what)
        return NULL
    return c


cdef int32_t rc_n_attn(const rc_ctx* ctx) noexcept nogil:
    """The attention layers (0 for a RecurrentCache's context); RC_ERR_NULL for NULL."""
    return RC_ERR_NULL if ctx == NULL else (<const CtxData*>ctx).n_attn


cdef int32_t rc_attn_layer(const rc_ctx* ctx, int32_t attn_index) noexcept nogil:
    """The model layer of attention layer ``attn_index`` (ascending), or RC_ERR_TENSOR_INDEX."""
    cdef int code = RC_OK
    cdef CtxData* c = hybrid_of(ctx, "rc_attn_layer", &code)
    if c == NULL:
        return code
    if not 0 <= attn_index < c.n_attn:
        record(c, RC_ERR_TENSOR_INDEX, "rc_attn_layer")
        c.detail.index = attn_index
        c.detail.size = c.n_attn
        return RC_ERR_TENSOR_INDEX
    return c.attn_layers[attn_index]


cdef int32_t rc_kv_size(const rc_ctx* ctx) noexcept nogil:
    cdef int code = RC_OK
    cdef CtxData* c = hybrid_of(ctx, "rc_kv_size", &code)
    return code if c == NULL else c.kv.size


cdef int32_t rc_kv_used(const rc_ctx* ctx) noexcept nogil:
    cdef int code = RC_OK
    cdef CtxData* c = hybrid_of(ctx, "rc_kv_used", &code)
    return code if c == NULL else c.kv.used


cdef int rc_kv_tensor(const rc_ctx* ctx, int32_t attn_index, int32_t which, void** data, int32_t* n_rows,
                      size_t* row_bytes, int* v_trans) noexcept nogil:
    """Attention layer ``attn_index``'s K (which 0) or V (1) storage, ``*n_rows`` rows of row_bytes: K
    one row per cell; V too, or with ``*v_trans`` one row (kv_size elements) per dimension."""
    cdef int code = RC_OK
    cdef CtxData* c = hybrid_of(ctx, "rc_kv_tensor", &code)
    if c == NULL:
        return code
    if data == NULL or n_rows == NULL or row_bytes == NULL or v_trans == NULL:
        return record(c, RC_ERR_NULL, "rc_kv_tensor")
    if not 0 <= attn_index < c.n_attn:
        record(c, RC_ERR_TENSOR_INDEX, "rc_kv_tensor")
        c.detail.index = attn_index
        c.detail.size = c.n_attn
        return RC_ERR_TENSOR_INDEX
    if which != 0 and which != 1:
        return record(c, RC_ERR_ARGUMENT, "rc_kv_tensor")
    if which == 0:
        data[0] = c.k_data + attn_index * c.k_layer_bytes
        row_bytes[0] = <size_t>c.k_row_bytes
        v_trans[0] = 0
        n_rows[0] = c.kv.size
    else:
        data[0] = c.v_data + attn_index * c.v_layer_bytes
        row_bytes[0] = <size_t>c.v_row_bytes
        v_trans[0] = c.v_trans
        n_rows[0] = <int32_t>(c.v_layer_bytes // c.v_row_bytes)
    return RC_OK


cdef int32_t rc_kv_has_shift(const rc_ctx* ctx) noexcept nogil:
    """1 when seq_add / seq_div moved a KV cell since rc_kv_reset_shift (the keys need rotating), else 0."""
    cdef int code = RC_OK
    cdef CtxData* c = hybrid_of(ctx, "rc_kv_has_shift", &code)
    return code if c == NULL else (1 if c.kv.has_shift else 0)


cdef int rc_kv_shifts(const rc_ctx* ctx, const int32_t** shifts) noexcept nogil:
    """``*shifts``: [kv_size] how far each cell's position moved since its key was last rotated (the
    table's own array: valid until the next call that changes the cache)."""
    cdef int code = RC_OK
    cdef CtxData* c = hybrid_of(ctx, "rc_kv_shifts", &code)
    if c == NULL:
        return code
    if shifts == NULL:
        return record(c, RC_ERR_NULL, "rc_kv_shifts")
    shifts[0] = c.kv.shift
    return RC_OK


cdef int rc_kv_reset_shift(rc_ctx* ctx) noexcept nogil:
    """The model rotated the keys by the shifts: none is pending any more."""
    cdef int code = RC_OK
    cdef CtxData* c = hybrid_of(ctx, "rc_kv_reset_shift", &code)
    if c == NULL:
        return code
    kv_reset_shift(c.kv)
    return RC_OK


cdef inline const BatchData* applied_batch(const rc_batch* batch, const char* what, int* code) noexcept nogil:
    """batch when its last ubatch is applied and nothing changed since, else NULL with *code set."""
    cdef const BatchData* b = <const BatchData*>batch
    if b == NULL:
        code[0] = RC_ERR_NULL
    elif b.kv_block == NULL:
        code[0] = record(b.ctx, RC_ERR_NOT_HYBRID, what)
    elif b.applied < 0:
        code[0] = record(b.ctx, RC_ERR_NOT_APPLIED, what)
    elif b.generation != b.ctx.core.generation:
        code[0] = record(b.ctx, RC_ERR_STALE, what)
    else:
        return b
    return NULL


cdef int rc_batch_kv_cells(const rc_batch* batch, const int32_t** cells, int32_t* n_kv) noexcept nogil:
    """The applied ubatch's KV cells: ``*cells`` [n_tokens] the cell of each token (ubatch order: where
    the model writes its K and V rows; NULL without attention layers), ``*n_kv`` the cells to attend
    to, [0, n_kv)."""
    cdef int code = RC_OK
    cdef const BatchData* b = applied_batch(batch, "rc_batch_kv_cells", &code)
    if b == NULL:
        return code
    if cells == NULL or n_kv == NULL:
        return record(b.ctx, RC_ERR_NULL, "rc_batch_kv_cells")
    cells[0] = b.kv_slots + b.kv_bounds[b.applied] if b.ctx.n_attn > 0 else NULL
    n_kv[0] = b.n_kv
    return RC_OK


cdef int rc_batch_kv_mask(const rc_batch* batch, int32_t kind, float* out, size_t capacity) noexcept nogil:
    """The applied ubatch's mask into out, [n_tokens][n_kv] floats: 0 where the token may attend to the
    cell, -INFINITY elsewhere (HybridState.kv_mask); kind RC_MASK_SLIDING applies the sliding window."""
    cdef int code = RC_OK
    cdef const BatchData* b = applied_batch(batch, "rc_batch_kv_mask", &code)
    if b == NULL:
        return code
    cdef CtxData* c = b.ctx
    cdef int32_t t0 = b.kv_bounds[b.applied], n = b.kv_bounds[b.applied + 1] - t0
    if out == NULL:
        return record(c, RC_ERR_NULL, "rc_batch_kv_mask")
    if kind != RC_MASK_FULL and kind != RC_MASK_SLIDING:
        return record(c, RC_ERR_ARGUMENT, "rc_batch_kv_mask")
    if capacity < <size_t>n * <size_t>b.n_kv:
        record(c, RC_ERR_MASK_SIZE, "rc_batch_kv_mask")
        c.detail.n = <int64_t>capacity
        c.detail.need = <int64_t>n * b.n_kv
        return RC_ERR_MASK_SIZE
    code = kv_mask(c.kv, n, b.kv_pos + t0, b.kv_flat, b.kv_offsets + t0, out, b.n_kv, kind == RC_MASK_SLIDING)
    return RC_OK if code == KV_OK else kv_failure(c, code, 0, 0, "rc_batch_kv_mask")


# the sequence API over both halves (rc_seq_* on a hybrid's context): _hybrid_rule's

cdef int32_t hybrid_seq_pos(const CtxData* c, int32_t seq, bint last) noexcept nogil:
    """rule_seq_pos; a seq id out of range is -1 (no position), its refusal recorded."""
    cdef RuleDetail rule
    cdef int32_t pos = rule_seq_pos(c.core, c.kv, c.n_attn > 0, seq, last, &rule)
    if not 0 <= seq < c.kv.n_seq_max:
        rule_failure(<CtxData*>c, pos, &rule)
    return pos


cdef void hybrid_clear(CtxData* c) noexcept nogil:
    kv_clear(c.kv)
    memset(c.k_data, 0, <size_t>(c.n_attn * c.k_layer_bytes))
    memset(c.v_data, 0, <size_t>(c.n_attn * c.v_layer_bytes))
    core_clear(c.core)


# a hybrid's state bytes: the Python facade's own composer and reader, with the GIL

cdef inline bint shares_kv(const CtxData* c, const void* p, size_t n) noexcept nogil:
    """Whether bytes [p, p + n) overlap the K or V storage."""
    cdef const char* q = <const char*>p
    return ((q < c.k_data + c.n_attn * c.k_layer_bytes and c.k_data < q + n)
            or (q < c.v_data + c.n_attn * c.v_layer_bytes and c.v_data < q + n))


cdef int python_failure(CtxData* c, const char* what) noexcept:
    """The exception being handled, kept as the message of RC_ERR_PYTHON (called with the GIL, in except)."""
    import sys
    (<Context>c.owner).python_error = str(sys.exc_info()[1])
    return record(c, RC_ERR_PYTHON, what)


cdef int hybrid_state_size(CtxData* c, int32_t seq_id, size_t* size) noexcept with gil:
    try:
        size[0] = <size_t>(<Context>c.owner).cache.state_size(seq_id)
    except BaseException:
        return python_failure(c, "rc_state_size")
    return RC_OK


cdef int hybrid_state_write(CtxData* c, int32_t seq_id, void* target, size_t capacity,
                            size_t* written) noexcept with gil:
    cdef bytes data
    try:
        data = (<Context>c.owner).cache.state_write(seq_id)
    except BaseException:
        return python_failure(c, "rc_state_write")
    if <size_t>len(data) > capacity:
        record(c, RC_ERR_TARGET_SIZE, "rc_state_write")
        c.detail.n = <int64_t>capacity
        c.detail.need = len(data)
        return RC_ERR_TARGET_SIZE
    if shares_rows(c.core, target, <size_t>len(data)) or shares_kv(c, target, <size_t>len(data)):
        return record(c, RC_ERR_OVERLAP, "rc_state_write")
    memcpy(target, <const char*>data, <size_t>len(data))
    written[0] = <size_t>len(data)
    return RC_OK


cdef int hybrid_state_read(CtxData* c, int32_t seq_id, const void* data, size_t length) noexcept with gil:
    if shares_rows(c.core, data, length) or shares_kv(c, data, length):
        return record(c, RC_ERR_OVERLAP, "rc_state_read")
    try:
        (<Context>c.owner).cache.state_read((<const char*>data)[:length] if length else b"", seq_id)
    except BaseException:
        return python_failure(c, "rc_state_read")
    return RC_OK
