# cython: language_level=3
"""The C API: a memory context over a compiled ``RecurrentCache`` or ``HybridCache``, for C, C++ and Cython.

A hybrid's context adds the KV half (``_kv_cells``' table, the K / V storage): its batches are
placed in both halves, its sequence operations are ``_hybrid_rule``'s (the compiled rule, shared
with ``HybridCache``'s facade), its state bytes the facade's (with the GIL).

A context (``rc_ctx``) points at the cache's memory core (``_core``); a batch
(``rc_batch``) is one ``init_batch``: validated and split (``_split``), proved to fit
(``split_prepare``), then applied ubatch by ubatch by the core, through the same
``core_apply_ubatch`` as the Python facade's ``MemoryState``.  Every change goes
through a ``core_*`` function: the core's one change counter makes a batch stale after
a change made through Python, and a ``MemoryState`` after one made through C.  Every
call but ``rc_ctx_new`` / ``rc_ctx_free`` is ``noexcept nogil`` and returns a code of
``recurrent_cache.errors``' table; the context records the detail of its last failure
and ``rc_error_message`` formats it through that table (taking the GIL for it), so C
users read the Python API's messages.

Published twice: as cdef functions for ``cimport recurrent_cache.capi`` and as the
``rc_capi`` table of the capsule ``_C_API`` for ``recurrent_cache/capi.h``.
"""

cimport cython
from cpython.pycapsule cimport PyCapsule_New
from cpython.ref cimport Py_DECREF, Py_INCREF, PyObject
from libc.stdint cimport INT32_MAX, int8_t, int32_t, int64_t, uint8_t, uint32_t, uint64_t, uintptr_t
from libc.stdlib cimport calloc, free, malloc
from libc.string cimport memcpy, memset

from ._cells cimport cells_seq_pos_max, cells_seq_pos_min
from ._core cimport (Core, MemoryCore, core_apply_ubatch, core_clear, core_rollback_min, core_seq_add,
                     core_seq_cp, core_seq_div, core_seq_keep, core_seq_rm, core_state_read, core_step_row,
                     core_steps, shares_rows, blob_source)
from ._kv_cells cimport KVCells
from ._kv_ops cimport kv_apply, kv_check_tokens, kv_clear, kv_padded_n_kv, kv_prepare, kv_reset_shift
from ._kv_mask cimport kv_mask
from ._hybrid_rule cimport (RuleDetail, rule_error, rule_rollback_min, rule_seq_add, rule_seq_cp,
                            rule_seq_div, rule_seq_keep, rule_seq_pos, rule_seq_rm)
from ._kv_table cimport KV_NO_MEMORY, KV_NO_SLOT, KV_OK, KvTable
from ._split cimport (Split, SplitDetail, split_batch, split_prepare, split_release, split_token_arrays,
                      split_token_entries)
from ._state_io cimport (BLOB_ERR_TRUNCATED, BlobDefect, BlobPieces, BlobSource, blob_compose, blob_copy,
                         blob_release, blob_size)

from . import errors

cdef extern from "Python.h":
    int Py_IsInitialized() nogil
    const Py_ssize_t PY_SSIZE_T_MAX

cdef extern from "<stdio.h>":
    int snprintf(char* buffer, size_t capacity, const char* fmt, ...) nogil


cdef struct Detail:                 # what the last failure of a context was about
    int code
    const char* what                # the call (a static string)
    bint by_rule                    # a hybrid's refusal: worded by _hybrid_rule.rule_error from rule
    RuleDetail rule
    int64_t token, seq, pos, prev, n, index, need
    int64_t size                    # the range's bound when it is not the cell count (0: the cell count)
    BlobDefect blob                 # for a state blob's codes
    Py_ssize_t blob_length


cdef struct CtxData:                # what an rc_ctx* points to (inside its Context object)
    PyObject* owner                 # the Context; each rc_ctx_new handle holds a reference
    Core* core                      # the cache's memory core (cells, rows, history, change counter)
    Py_ssize_t open_batches
    Detail detail
    # a HybridCache's KV half (hybrid false: the context of a RecurrentCache)
    bint hybrid
    KvTable* kv                     # its cell table (the KVCells the Context holds)
    int32_t n_attn
    const int32_t* attn_layers      # [n_attn] the model layer of each attention layer
    char* k_data                    # K [n_attn, kv_size, n_embd_k]
    char* v_data                    # V [n_attn, n_embd_v, kv_size] with v_trans, else [n_attn, kv_size, n_embd_v]
    Py_ssize_t k_layer_bytes        # one attention layer's K / V tensor
    Py_ssize_t v_layer_bytes
    Py_ssize_t k_row_bytes          # K: one cell's row; V: one cell's row, or with v_trans one dimension's run
    Py_ssize_t v_row_bytes
    bint v_trans
    int32_t kv_pad


cdef struct BatchData:              # what an rc_batch* points to
    CtxData* ctx
    Split split
    int32_t* seq_ids                # [n_entries] the caller's seq ids, copied (the split refers to them)
    int32_t* offsets                # [n_tokens + 1]
    int32_t next_ubatch
    int32_t outputs_before          # output rows of the ubatches applied so far
    uint64_t generation             # the core's generation this batch is valid on
    int32_t steps_n_seqs            # the last applied ubatch, for rc_batch_step_row: its groups
    int32_t steps_m                 # and step states per group
    # a hybrid's KV half: every ubatch's tokens as the KV table takes them, and the cells found for them
    int32_t* kv_block               # one allocation (NULL: a RecurrentCache's batch)
    int32_t* kv_bounds              # [n_ubatches + 1] ubatch u's tokens are [kv_bounds[u], kv_bounds[u + 1])
    int32_t* kv_pos                 # [n_tokens] ubatch order
    int32_t* kv_offsets             # [n_tokens + 1] token t's seq ids: kv_flat[kv_offsets[t]:kv_offsets[t + 1]]
    int32_t* kv_slots               # [n_tokens] each token's cell
    int32_t* kv_flat
    int32_t applied                 # the last applied ubatch (-1: none yet)
    int32_t n_kv                    # the cells it attends to: [0, n_kv)


@cython.final
cdef class Context:
    """The owner of one cache's ``CtxData``: keeps the cache and its memory core alive."""

    cdef CtxData data
    cdef Py_ssize_t handles         # rc_ctx_new calls not matched by rc_ctx_free yet
    cdef MemoryCore core
    cdef object cache
    cdef object kv                  # a hybrid's KVCells, its K / V host views and attention layer ids
    cdef object kv_views
    cdef object python_error        # the message of the last exception a hybrid's state call caught


# id(cache) -> its Context while C handles exist: every handle of one cache shares one
# context, so a batch prepared through one is stale after a change made through another
_contexts = {}


cdef Context context_for(object cache):
    cdef Context context = _contexts.get(id(cache))
    if context is not None:
        return context
    core = getattr(cache, "memory_core", None)   # the facade's public handle to its core
    if core is None:
        raise TypeError(f"rc_ctx_new takes a recurrent_cache.RecurrentCache or HybridCache, got "
                        f"{type(cache).__name__}")
    if not isinstance(core, MemoryCore):
        raise errors.ArgumentError("the C API needs the compiled engine; this cache runs on the "
                                   f"{cache.engine} engine")
    if not core.host_rows:
        raise errors.ConfigError(f"the C API reads and writes state rows in host memory; this cache's "
                                 f"storage is {core.storage!r}: use storage='numpy' or torch on 'cpu'")
    context = Context.__new__(Context)
    context.core = core
    context.cache = cache
    memset(&context.data, 0, sizeof(CtxData))
    context.data.owner = <PyObject*>context
    context.data.core = &context.core.core
    kv_table = getattr(cache, "kv_table", None)  # a HybridCache's KV half
    if kv_table is not None:
        attach_kv(context, cache, kv_table)
    _contexts[id(cache)] = context
    return context


cdef attach_kv(Context context, object cache, object kv_table):
    """The context's KV half: the table, and the K / V tensors' host memory (kept alive by the context)."""
    import numpy as np
    if not isinstance(kv_table, KVCells):   # (the reference engine is refused above, by its memory core)
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


cdef rc_ctx* rc_ctx_new(PyObject* cache) except NULL:
    if cache == NULL:
        raise TypeError("rc_ctx_new takes a recurrent_cache.RecurrentCache, got NULL")
    cdef Context context = context_for(<object>cache)
    Py_INCREF(context)
    context.handles += 1
    return <rc_ctx*>&context.data


cdef int rc_ctx_free(rc_ctx* ctx) noexcept:
    if ctx == NULL:
        return RC_ERR_NULL
    cdef CtxData* data = <CtxData*>ctx
    cdef Context context = <Context>data.owner
    if context.handles == 1 and data.open_batches:
        record(data, RC_ERR_OPEN_BATCHES, "rc_ctx_free")
        data.detail.n = data.open_batches
        return RC_ERR_OPEN_BATCHES
    context.handles -= 1
    if context.handles == 0:
        _contexts.pop(id(context.cache), None)
    Py_DECREF(context)
    return RC_OK


cdef inline int record(CtxData* ctx, int code, const char* what) noexcept nogil:
    """Keep code's detail in the context for rc_error_message; returns code."""
    memset(&ctx.detail, 0, sizeof(Detail))
    ctx.detail.code = code
    ctx.detail.what = what
    return code


# -- messages ------------------------------------------------------------------------

cdef str message_for(const CtxData* ctx, int code):
    cdef Detail d
    cdef int32_t size = -1
    if code == RC_OK:
        return "no error"
    cdef str missing = ""
    memset(&d, 0, sizeof(Detail))
    d.what = "recurrent_cache"
    if ctx != NULL:
        size = ctx.core.cells.size
        if ctx.detail.code == code:
            d = ctx.detail
        else:
            missing = " (values not recorded: this context's last failure had another code)"
    if RC_ERR_BLOB_FIRST <= code <= RC_ERR_BLOB_LAST:
        if ctx == NULL or ctx.detail.code != code:
            return f"state_read: the blob has a defect (code {code}; no detail recorded for it)"
        return str((<Context>ctx.owner).core.blob_error(code, &d.blob, d.blob_length))
    cdef bint recorded = ctx != NULL and ctx.detail.code == code
    if recorded and d.by_rule:                  # a hybrid's refusal, in the Python API's words
        return str(rule_error(&d.rule))
    if recorded and code == RC_ERR_PYTHON and (<Context>ctx.owner).python_error is not None:
        return (<Context>ctx.owner).python_error
    return str(errors.engine_error(code, what=d.what.decode("utf-8", "replace"), token=d.token, seq=d.seq,
                                   pos=d.pos, prev=d.prev, n=d.n, index=d.index, need=d.need,
                                   size=d.size if d.size else size)) + missing


cdef Py_ssize_t copy_message(const CtxData* ctx, int code, char* buffer, size_t capacity) noexcept with gil:
    """message_for into buffer (truncated, NUL-terminated); its length, or -1 if formatting failed."""
    cdef bytes text
    cdef size_t n
    try:
        text = message_for(ctx, code).encode("utf-8", "replace")
    except BaseException:
        return -1
    n = <size_t>len(text)
    if buffer != NULL and capacity > 0:
        memcpy(buffer, <const char*>text, min(n, capacity - 1))
        buffer[min(n, capacity - 1)] = 0
    return <Py_ssize_t>n


cdef int rc_error_message(const rc_ctx* ctx, int code, char* buffer, size_t capacity) noexcept nogil:
    """The message of ``code`` (with ctx's detail when it is ctx's last failure) into buffer,
    NUL-terminated and truncated to capacity; returns the message's full length in bytes.
    Takes the GIL to format through ``recurrent_cache.errors``' table."""
    cdef Py_ssize_t n = -1
    if Py_IsInitialized():
        n = copy_message(<const CtxData*>ctx, code, buffer, capacity)
    if n < 0:
        return snprintf(buffer, capacity, "recurrent_cache error %d", code)
    return <int>n


# -- the cache -------------------------------------------------------------------------

cdef int32_t rc_size(const rc_ctx* ctx) noexcept nogil:
    return -1 if ctx == NULL else (<const CtxData*>ctx).core.cells.size


cdef int32_t rc_n_layer(const rc_ctx* ctx) noexcept nogil:
    return -1 if ctx == NULL else (<const CtxData*>ctx).core.n_layer


cdef int32_t rc_used(const rc_ctx* ctx) noexcept nogil:
    return -1 if ctx == NULL else (<const CtxData*>ctx).core.cells.used


cdef Py_ssize_t core_tensor(CtxData* c, int32_t index, const char* what) noexcept nogil:
    """The core's tensor of model tensor ``index`` (r of layer il: il; s: n_layer + il), or the
    recorded error code: RC_ERR_TENSOR_INDEX outside the model's 2 * n_layer tensors,
    RC_ERR_FILTERED_LAYER for a layer the cache's filter keeps no state for."""
    if not 0 <= index < 2 * c.core.n_layer:
        record(c, RC_ERR_TENSOR_INDEX, what)
        c.detail.index = index
        c.detail.size = 2 * c.core.n_layer
        return RC_ERR_TENSOR_INDEX
    cdef Py_ssize_t k = c.core.layer_tensor[index]
    if k < 0:
        record(c, RC_ERR_FILTERED_LAYER, what)
        c.detail.index = index
        c.detail.n = index % c.core.n_layer
        return RC_ERR_FILTERED_LAYER
    return k


cdef int rc_tensor(const rc_ctx* ctx, int32_t index, void** data, size_t* row_bytes) noexcept nogil:
    """Base pointer and row size of state tensor ``index`` (r of layer il: il; s: n_layer + il); a
    layer the cache keeps no state for (its ``layers`` filter) is RC_ERR_FILTERED_LAYER."""
    if ctx == NULL:
        return RC_ERR_NULL
    cdef CtxData* c = <CtxData*>ctx
    if data == NULL or row_bytes == NULL:
        return record(c, RC_ERR_NULL, "rc_tensor")
    cdef Py_ssize_t k = core_tensor(c, index, "rc_tensor")
    if k < 0:
        return <int>k
    data[0] = c.core.tensor_data[k]
    row_bytes[0] = <size_t>c.core.row_bytes[k]
    return RC_OK


# -- batches ---------------------------------------------------------------------------

cdef int rc_batch_init(rc_ctx* ctx, int32_t n_tokens, const int32_t* seq_ids, const int32_t* seq_id_offsets,
                       const int32_t* pos, const int8_t* output, int32_t n_ubatch, uint32_t flags,
                       rc_batch** batch) noexcept nogil:
    """Validate, split and prepare a batch (``init_batch``); ``*batch`` is NULL unless RC_OK.

    seq_id_offsets NULL: one seq id per token (``seq_ids[t]``); else token t lists
    ``seq_ids[seq_id_offsets[t]:seq_id_offsets[t + 1]]``, owner first.  output NULL:
    only the last token is an output (llama_decode's default).
    """
    cdef CtxData* c = <CtxData*>ctx
    cdef BatchData* b
    cdef SplitDetail split_detail
    cdef int32_t t, n_entries
    cdef int code
    if batch != NULL:
        batch[0] = NULL
    if ctx == NULL:
        return RC_ERR_NULL
    if batch == NULL or seq_ids == NULL or pos == NULL:
        return record(c, RC_ERR_NULL, "rc_batch_init")
    if n_tokens < 1 or n_tokens == INT32_MAX:
        record(c, RC_ERR_N_TOKENS, "rc_batch_init")
        c.detail.n = n_tokens
        return RC_ERR_N_TOKENS
    if n_ubatch < 1:
        record(c, RC_ERR_N_UBATCH, "rc_batch_init")
        c.detail.n = n_ubatch
        return RC_ERR_N_UBATCH
    if flags & ~<uint32_t>(RC_BATCH_LOGITS_ALL | RC_BATCH_EMBD_POOLED):
        record(c, RC_ERR_FLAGS, "rc_batch_init")
        c.detail.n = flags
        return RC_ERR_FLAGS
    if seq_id_offsets == NULL:
        n_entries = n_tokens
    else:
        for t in range(n_tokens + 1):
            if (t == 0 and seq_id_offsets[0] != 0) or (t > 0 and seq_id_offsets[t] <= seq_id_offsets[t - 1]):
                record(c, RC_ERR_OFFSETS, "rc_batch_init")
                c.detail.index = t
                c.detail.pos = seq_id_offsets[t]
                return RC_ERR_OFFSETS
        n_entries = seq_id_offsets[n_tokens]
    b = <BatchData*>calloc(1, sizeof(BatchData))
    if b == NULL:
        return record(c, RC_ERR_NO_MEMORY, "rc_batch_init")
    b.seq_ids = <int32_t*>malloc((<size_t>n_entries + <size_t>n_tokens + 1) * sizeof(int32_t))
    if b.seq_ids == NULL:
        free(b)
        return record(c, RC_ERR_NO_MEMORY, "rc_batch_init")
    b.offsets = b.seq_ids + n_entries
    memcpy(b.seq_ids, seq_ids, <size_t>n_entries * sizeof(int32_t))
    if seq_id_offsets == NULL:
        for t in range(n_tokens + 1):
            b.offsets[t] = t
    else:
        memcpy(b.offsets, seq_id_offsets, (<size_t>n_tokens + 1) * sizeof(int32_t))
    code = split_batch(&b.split, &c.core.cells, n_tokens, b.seq_ids, b.offsets, pos, output,
                       (flags & RC_BATCH_LOGITS_ALL) != 0, n_ubatch, (flags & RC_BATCH_EMBD_POOLED) != 0,
                       &split_detail)
    if code == RC_OK:
        code = split_prepare(&b.split, &c.core.cells, b.seq_ids)
        if code != RC_OK:
            split_release(&b.split)
    if code != RC_OK:
        free(b.seq_ids)
        free(b)
        record(c, code, "rc_batch_init")
        c.detail.token = split_detail.token
        c.detail.seq = split_detail.seq
        c.detail.pos = split_detail.pos
        c.detail.prev = split_detail.prev
        c.detail.n = split_detail.n
        return code
    b.applied = -1
    if c.hybrid:
        code = batch_kv_prepare(c, b, pos)
        if code != RC_OK:
            free(b.kv_block)
            split_release(&b.split)
            free(b.seq_ids)
            free(b)
            return code
    b.ctx = c
    b.generation = c.core.generation
    c.open_batches += 1
    batch[0] = <rc_batch*>b
    return RC_OK


cdef int rc_batch_apply(rc_batch* batch, rc_ubatch* ubatch) noexcept nogil:
    """Place the next ubatch and move its rows: 1 (``*ubatch`` filled), 0 when none is left,
    or a negative code (the batch is then finished)."""
    if batch == NULL:
        return RC_ERR_NULL
    cdef BatchData* b = <BatchData*>batch
    cdef CtxData* c = b.ctx
    cdef Split* s = &b.split
    cdef int32_t u = b.next_ubatch, g0, t0, t, outputs = 0
    cdef int code
    cdef int64_t kv_a = 0, kv_b = 0
    if ubatch == NULL:
        return record(c, RC_ERR_NULL, "rc_batch_apply")
    if u >= s.n_ubatches:
        return 0
    if b.generation != c.core.generation:
        return record(c, RC_ERR_STALE, "rc_batch_apply")
    g0 = s.ub_group_start[u]
    t0 = s.ub_token_start[u]
    if b.kv_block != NULL and c.n_attn > 0:   # the KV half first, on the cells rc_batch_init found
        code = kv_apply(c.kv, b.kv_bounds[u + 1] - b.kv_bounds[u], b.kv_slots + b.kv_bounds[u],
                        b.kv_pos + b.kv_bounds[u], b.kv_flat, b.kv_offsets + b.kv_bounds[u], &kv_a, &kv_b)
        if code != KV_OK:
            b.next_ubatch = s.n_ubatches
            return kv_failure(c, code, kv_a, kv_b, "rc_batch_apply")
    code = core_apply_ubatch(c.core, s, u, b.seq_ids)
    if code != RC_OK:
        b.next_ubatch = s.n_ubatches   # a failed placement ends the batch
        return record(c, code, "rc_batch_apply")
    if b.kv_block != NULL:
        b.n_kv = kv_padded_n_kv(c.kv, c.kv_pad)
        b.applied = u
    b.steps_n_seqs = s.ub_group_start[u + 1] - g0
    b.steps_m = core_steps(c.core, s.ub_n_seq_tokens[u])
    b.generation = c.core.generation
    b.next_ubatch = u + 1
    for t in range(t0, s.ub_token_start[u + 1]):
        outputs += s.output[t]
    ubatch.index = u
    ubatch.head = c.core.cells.head
    ubatch.n_seqs = s.ub_group_start[u + 1] - g0
    ubatch.n_seq_tokens = s.ub_n_seq_tokens[u]
    ubatch.n_tokens = s.ub_token_start[u + 1] - t0
    ubatch.first_output = b.outputs_before
    ubatch.n_outputs = outputs
    ubatch.token_order = s.order + t0
    ubatch.output = s.output + t0
    b.outputs_before += outputs
    return 1


cdef int32_t rc_batch_n_ubatches(const rc_batch* batch) noexcept nogil:
    return RC_ERR_NULL if batch == NULL else (<const BatchData*>batch).split.n_ubatches


cdef const int64_t* rc_batch_out_ids(const rc_batch* batch, int32_t* n_outputs) noexcept nogil:
    """[n_outputs] the batch index of each output row (ubatch order); NULL for a NULL batch."""
    if batch == NULL:
        if n_outputs != NULL:
            n_outputs[0] = 0
        return NULL
    cdef const BatchData* b = <const BatchData*>batch
    if n_outputs != NULL:
        n_outputs[0] = b.split.n_outputs
    return b.split.out_ids


cdef void rc_batch_release(rc_batch* batch) noexcept nogil:
    if batch == NULL:
        return
    cdef BatchData* b = <BatchData*>batch
    b.ctx.open_batches -= 1
    split_release(&b.split)
    free(b.kv_block)
    free(b.seq_ids)
    free(b)


# -- sequences ---------------------------------------------------------------------------

cdef inline int seq_code(CtxData* c, int code, const char* what, int32_t seq) noexcept nogil:
    if code != RC_OK:
        record(c, code, what)
        c.detail.seq = seq
    return code


cdef int rc_seq_rm(rc_ctx* ctx, int32_t seq, int32_t p0, int32_t p1) noexcept nogil:
    """1 when seq's positions [p0, p1) are gone (or it had none there, or it was rolled back to
    the state after p0 - 1: docs/rollback.md), 0 when refused."""
    if ctx == NULL:
        return RC_ERR_NULL
    if (<CtxData*>ctx).hybrid:
        return rule_seq_rm((<CtxData*>ctx).core, (<CtxData*>ctx).kv, seq, p0, p1)
    return 1 if core_seq_rm((<CtxData*>ctx).core, seq, p0, p1) else 0


cdef int rc_seq_cp(rc_ctx* ctx, int32_t seq_src, int32_t seq_dst) noexcept nogil:
    """A RecurrentCache: dst shares src's cell (a no-op for ids out of range, as llama.cpp).  A
    HybridCache: HybridCache.seq_cp over every position (rc_seq_cp_range for a range)."""
    if ctx == NULL:
        return RC_ERR_NULL
    if (<CtxData*>ctx).hybrid:
        return rc_seq_cp_range(ctx, seq_src, seq_dst, -1, -1)
    core_seq_cp((<CtxData*>ctx).core, seq_src, seq_dst)
    return RC_OK


cdef int rc_seq_cp_range(rc_ctx* ctx, int32_t seq_src, int32_t seq_dst, int32_t p0, int32_t p1) noexcept nogil:
    """HybridCache.seq_cp(src, dst, p0, p1) on a hybrid's context; rc_seq_cp on a RecurrentCache's."""
    if ctx == NULL:
        return RC_ERR_NULL
    cdef RuleDetail rule
    cdef CtxData* c = <CtxData*>ctx
    if c.hybrid:
        return hybrid_code(c, rule_seq_cp(c.core, c.kv, seq_src, seq_dst, p0, p1, &rule), &rule)
    return rc_seq_cp(ctx, seq_src, seq_dst)


cdef int rc_seq_keep(rc_ctx* ctx, int32_t seq) noexcept nogil:
    if ctx == NULL:
        return RC_ERR_NULL
    cdef RuleDetail rule
    cdef CtxData* c = <CtxData*>ctx
    if c.hybrid:
        return hybrid_code(c, rule_seq_keep(c.core, c.kv, seq, &rule), &rule)
    return seq_code(<CtxData*>ctx, core_seq_keep((<CtxData*>ctx).core, seq), "rc_seq_keep", seq)


cdef int rc_seq_add(rc_ctx* ctx, int32_t seq, int32_t p0, int32_t p1, int32_t shift) noexcept nogil:
    if ctx == NULL:
        return RC_ERR_NULL
    cdef RuleDetail rule
    cdef CtxData* c = <CtxData*>ctx
    if c.hybrid:
        return hybrid_code(c, rule_seq_add(c.core, c.kv, seq, p0, p1, shift, &rule), &rule)
    return seq_code(<CtxData*>ctx, core_seq_add((<CtxData*>ctx).core, seq, p0, p1, shift), "rc_seq_add", seq)


cdef int rc_seq_div(rc_ctx* ctx, int32_t seq, int32_t p0, int32_t p1, int32_t d) noexcept nogil:
    if ctx == NULL:
        return RC_ERR_NULL
    cdef RuleDetail rule
    cdef CtxData* c = <CtxData*>ctx
    if c.hybrid:
        return hybrid_code(c, rule_seq_div(c.core, c.kv, seq, p0, p1, d, &rule), &rule)
    return seq_code(<CtxData*>ctx, core_seq_div((<CtxData*>ctx).core, seq, p0, p1, d), "rc_seq_div", seq)


cdef int32_t rc_seq_pos_min(const rc_ctx* ctx, int32_t seq) noexcept nogil:
    if ctx == NULL:
        return RC_ERR_NULL
    if (<const CtxData*>ctx).hybrid:
        return hybrid_seq_pos(<const CtxData*>ctx, seq, False)
    return cells_seq_pos_min(&(<const CtxData*>ctx).core.cells, seq)


cdef int32_t rc_seq_pos_max(const rc_ctx* ctx, int32_t seq) noexcept nogil:
    if ctx == NULL:
        return RC_ERR_NULL
    if (<const CtxData*>ctx).hybrid:
        return hybrid_seq_pos(<const CtxData*>ctx, seq, True)
    return cells_seq_pos_max(&(<const CtxData*>ctx).core.cells, seq)


cdef int rc_clear(rc_ctx* ctx) noexcept nogil:
    """Empty every cell and zero every state row."""
    if ctx == NULL:
        return RC_ERR_NULL
    if (<CtxData*>ctx).hybrid:
        hybrid_clear(<CtxData*>ctx)
    else:
        core_clear((<CtxData*>ctx).core)
    return RC_OK


# -- state -------------------------------------------------------------------------------

cdef inline int check_state_seq(CtxData* c, int32_t seq_id, const char* what) noexcept nogil:
    if -1 <= seq_id < c.core.cells.size:
        return RC_OK
    record(c, RC_ERR_STATE_SEQ, what)
    c.detail.seq = seq_id
    return RC_ERR_STATE_SEQ


cdef int rc_state_size(const rc_ctx* ctx, int32_t seq_id, size_t* size) noexcept nogil:
    """Bytes of ``rc_state_write(ctx, seq_id, ...)``."""
    if ctx == NULL:
        return RC_ERR_NULL
    cdef CtxData* c = <CtxData*>ctx
    if size == NULL:
        return record(c, RC_ERR_NULL, "rc_state_size")
    if c.hybrid:   # the Python facade checks everything, in its words
        return hybrid_state_size(c, seq_id, size)
    cdef int code = check_state_seq(c, seq_id, "rc_state_size")
    if code == RC_OK:
        size[0] = <size_t>blob_size(&c.core.cells, seq_id, c.core.n_tensors, c.core.row_bytes)
    return code


cdef int rc_state_write(rc_ctx* ctx, int32_t seq_id, void* target, size_t capacity, size_t* written) noexcept nogil:
    """The blob of ``state_write(seq_id)`` to target (capacity bytes); its length in ``*written``."""
    if ctx == NULL:
        return RC_ERR_NULL
    cdef CtxData* c = <CtxData*>ctx
    cdef Py_ssize_t need
    cdef BlobSource src
    cdef BlobPieces pieces
    if target == NULL or written == NULL:
        return record(c, RC_ERR_NULL, "rc_state_write")
    written[0] = 0
    if c.hybrid:
        return hybrid_state_write(c, seq_id, target, capacity, written)
    cdef int code = check_state_seq(c, seq_id, "rc_state_write")
    if code != RC_OK:
        return code
    need = blob_size(&c.core.cells, seq_id, c.core.n_tensors, c.core.row_bytes)
    if <size_t>need > capacity:
        record(c, RC_ERR_TARGET_SIZE, "rc_state_write")
        c.detail.n = <int64_t>capacity
        c.detail.need = need
        return RC_ERR_TARGET_SIZE
    if shares_rows(c.core, target, <size_t>need):
        return record(c, RC_ERR_OVERLAP, "rc_state_write")
    src = blob_source(c.core)
    if blob_compose(&pieces, &src, seq_id) != RC_OK:
        return record(c, RC_ERR_NO_MEMORY, "rc_state_write")
    written[0] = <size_t>blob_copy(&pieces, <unsigned char*>target)
    blob_release(&pieces)
    return RC_OK


cdef int rc_state_read(rc_ctx* ctx, int32_t seq_id, const void* data, size_t length) noexcept nogil:
    """Check the whole blob, then restore it (``state_read``); a defect changes nothing."""
    if ctx == NULL:
        return RC_ERR_NULL
    cdef CtxData* c = <CtxData*>ctx
    cdef BlobDefect defect
    if data == NULL and length > 0:
        return record(c, RC_ERR_NULL, "rc_state_read")
    if c.hybrid:
        return hybrid_state_read(c, seq_id, data, length)
    cdef int code = check_state_seq(c, seq_id, "rc_state_read")
    if code != RC_OK:
        return code
    if shares_rows(c.core, data, length):
        return record(c, RC_ERR_OVERLAP, "rc_state_read")
    if length > <size_t>PY_SSIZE_T_MAX:   # no buffer is that long: reported as trailing bytes
        length = <size_t>PY_SSIZE_T_MAX
    code = core_state_read(c.core, seq_id, <const unsigned char*>data, <Py_ssize_t>length, &defect)
    if code == RC_OK:
        return RC_OK
    record(c, code, "rc_state_read")
    if code <= BLOB_ERR_TRUNCATED:   # a defect of the blob: say where
        c.detail.blob = defect
        c.detail.blob_length = <Py_ssize_t>length
    return code


# -- rollback (API version 2) ------------------------------------------------------------

cdef int32_t rc_n_rollback(const rc_ctx* ctx) noexcept nogil:
    return RC_ERR_NULL if ctx == NULL else (<const CtxData*>ctx).core.history.n_rollback


cdef int32_t rc_seq_rollback_min(const rc_ctx* ctx, int32_t seq) noexcept nogil:
    """The smallest q that rc_seq_rm(ctx, seq, q + 1, -1) can roll seq back to, or -1."""
    if ctx == NULL:
        return RC_ERR_NULL
    cdef RuleDetail rule
    cdef CtxData* c = <CtxData*>ctx
    cdef int32_t q
    if not c.hybrid:
        return core_rollback_min(c.core, seq)
    q = rule_rollback_min(c.core, c.kv, seq, &rule)
    if not 0 <= seq < c.kv.n_seq_max:   # -1 (no position), the refusal recorded
        rule_failure(c, q, &rule)
    return q


cdef int32_t rc_batch_n_steps(const rc_batch* batch) noexcept nogil:
    """m: the step states per group the model writes for the last applied ubatch (0: none)."""
    return RC_ERR_NULL if batch == NULL else (<const BatchData*>batch).steps_m


cdef int rc_batch_step_row(const rc_batch* batch, int32_t tensor, int32_t group, int32_t j,
                           void** row) noexcept nogil:
    """Where the model writes tensor ``tensor``'s state after token n_seq_tokens - 1 - m + j of
    ``group`` of the last applied ubatch (row_bytes of rc_tensor wide)."""
    if batch == NULL or row == NULL:
        return RC_ERR_NULL
    cdef const BatchData* b = <const BatchData*>batch
    cdef CtxData* c = b.ctx
    cdef Py_ssize_t k = core_tensor(c, tensor, "rc_batch_step_row")
    if k < 0:
        return <int>k
    if not (0 <= group < b.steps_n_seqs and 0 <= j < b.steps_m):
        record(c, RC_ERR_ARGUMENT, "rc_batch_step_row")
        return RC_ERR_ARGUMENT
    if b.generation != c.core.generation:   # the rows were filed, or the cells moved since
        return record(c, RC_ERR_STALE, "rc_batch_step_row")
    row[0] = core_step_row(c.core, k, group, j)
    return RC_OK


# -- a HybridCache's context (API version 3; docs/c-api.md, "Hybrid memories") ----------------
# The sequence operations are HybridCache's, from _hybrid_rule (the one copy of its both-halves rule
# for the compiled engine, which HybridCache's facade calls too).

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

cdef inline int hybrid_code(CtxData* c, int code, const RuleDetail* rule) noexcept nogil:
    return code if code >= RC_OK else rule_failure(c, code, rule)


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


# -- the table in the capsule -----------------------------------------------------------
# Adding an entry (e.g. rollback): append its pointer at the END of rc_capi in capi.h, bump
# RC_CAPI_API_VERSION there, mirror the field in _capi.pxd, set it below, declare the function
# in _capi.pxd / capi.pxd, and add it to tests/capi_table.py's Table.  Never reorder or change
# an existing entry: that would need RC_CAPI_ABI_VERSION bumped and every extension rebuilt.

cdef rc_capi TABLE
TABLE.abi_version = RC_CAPI_ABI_VERSION
TABLE.api_version = RC_CAPI_API_VERSION
TABLE.ctx_new = rc_ctx_new
TABLE.ctx_free = rc_ctx_free
TABLE.error_message = rc_error_message
TABLE.size = rc_size
TABLE.n_layer = rc_n_layer
TABLE.used = rc_used
TABLE.tensor = rc_tensor
TABLE.batch_init = rc_batch_init
TABLE.batch_apply = rc_batch_apply
TABLE.batch_n_ubatches = rc_batch_n_ubatches
TABLE.batch_out_ids = rc_batch_out_ids
TABLE.batch_release = rc_batch_release
TABLE.seq_rm = rc_seq_rm
TABLE.seq_cp = rc_seq_cp
TABLE.seq_keep = rc_seq_keep
TABLE.seq_add = rc_seq_add
TABLE.seq_div = rc_seq_div
TABLE.seq_pos_min = rc_seq_pos_min
TABLE.seq_pos_max = rc_seq_pos_max
TABLE.clear = rc_clear
TABLE.state_size = rc_state_size
TABLE.state_write = rc_state_write
TABLE.state_read = rc_state_read
TABLE.n_rollback = rc_n_rollback
TABLE.seq_rollback_min = rc_seq_rollback_min
TABLE.batch_n_steps = rc_batch_n_steps
TABLE.batch_step_row = rc_batch_step_row
TABLE.n_attn = rc_n_attn
TABLE.attn_layer = rc_attn_layer
TABLE.kv_size = rc_kv_size
TABLE.kv_used = rc_kv_used
TABLE.kv_tensor = rc_kv_tensor
TABLE.batch_kv_cells = rc_batch_kv_cells
TABLE.batch_kv_mask = rc_batch_kv_mask
TABLE.seq_cp_range = rc_seq_cp_range
TABLE.kv_has_shift = rc_kv_has_shift
TABLE.kv_shifts = rc_kv_shifts
TABLE.kv_reset_shift = rc_kv_reset_shift

_C_API = PyCapsule_New(&TABLE, RC_CAPI_CAPSULE_NAME, NULL)
ABI_VERSION = RC_CAPI_ABI_VERSION
API_VERSION = RC_CAPI_API_VERSION
