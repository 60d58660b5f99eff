# cython: language_level=3
"""The C API: a memory context over a compiled ``RecurrentCache`` or ``HybridCache``, for C, C++ and Cython.

A hybrid's context adds the KV half (the KV cell table, the K / V storage; ``_capi_hybrid``): its
batches are placed in both halves, its sequence operations are ``_hybrid_rule``'s (the compiled rule,
shared with ``HybridCache``'s facade), its state bytes the facade's (with the GIL).

A context (``rc_ctx``) points at the cache's memory core (``_core_ops``' ``Core``); a batch
(``rc_batch``) is one ``init_batch``: validated and split (``_split``), proved to fit
(``split_prepare``), then applied ubatch by ubatch by the core, through the same
``core_apply_ubatch`` as the Python facade's ``MemoryState``.  Every change goes
through a ``core_*`` function: the core's one change counter makes a batch stale after
a change made through Python, and a ``MemoryState`` after one made through C.  Every
call but ``rc_ctx_new`` / ``rc_ctx_free`` is ``noexcept nogil`` and returns a code of
``recurrent_cache.errors``' table; the context records the detail of its last failure
and ``rc_error_message`` formats it through that table (taking the GIL for it), so C
users read the Python API's messages.

Published twice: as cdef functions for ``cimport recurrent_cache.capi`` (this module's and
``_capi_hybrid``'s) and as the one ``rc_capi`` table of the capsule ``_C_API`` for
``recurrent_cache/capi.h``.  The types (capi.h's, ``CtxData``, ``BatchData``, ``Context``) are
declared once, in ``_capi_types.pxd``.
"""

from cpython.pycapsule cimport PyCapsule_New
from cpython.ref cimport Py_DECREF, Py_INCREF, PyObject
from libc.stdint cimport INT32_MAX, int8_t, int32_t, int64_t, uint32_t
from libc.stdlib cimport calloc, free, malloc
from libc.string cimport memcpy, memset

from ._capi_types cimport (RC_BATCH_EMBD_POOLED, RC_BATCH_LOGITS_ALL, RC_CAPI_ABI_VERSION, RC_CAPI_API_VERSION,
                           RC_CAPI_CAPSULE_NAME, RC_ERR_ARGUMENT, RC_ERR_BLOB_FIRST, RC_ERR_BLOB_LAST,
                           RC_ERR_FILTERED_LAYER, RC_ERR_FLAGS, RC_ERR_N_TOKENS, RC_ERR_N_UBATCH, RC_ERR_NO_MEMORY,
                           RC_ERR_NULL, RC_ERR_OFFSETS, RC_ERR_OPEN_BATCHES, RC_ERR_OVERLAP, RC_ERR_PYTHON,
                           RC_ERR_STALE, RC_ERR_STATE_SEQ, RC_ERR_TARGET_SIZE, RC_ERR_TENSOR_INDEX, RC_OK, BatchData,
                           Context, CtxData, Detail, rc_capi, record)
from ._capi_hybrid cimport (attach_kv, batch_kv_prepare, hybrid_clear, hybrid_seq_pos, hybrid_state_read,
                            hybrid_state_size, hybrid_state_write, kv_failure, rc_attn_layer, rc_batch_kv_cells,
                            rc_batch_kv_mask, rc_kv_has_shift, rc_kv_reset_shift, rc_kv_shifts, rc_kv_size,
                            rc_kv_tensor, rc_kv_used, rc_n_attn, rule_failure)
from ._cells cimport cells_seq_pos_max, cells_seq_pos_min
from ._core cimport MemoryCore
from ._core_ops cimport (blob_source, core_apply_ubatch, core_clear, core_rollback_min, core_seq_add, core_seq_cp,
                         core_seq_div, core_seq_keep, core_seq_rm, core_state_read, core_step_row, core_steps,
                         shares_rows)
from ._hybrid_rule cimport (RuleDetail, rule_error, rule_rollback_min, rule_seq_add, rule_seq_cp, rule_seq_div,
                            rule_seq_keep, rule_seq_rm)
from ._kv_ops cimport kv_apply, kv_padded_n_kv
from ._kv_table cimport KV_OK
from ._split cimport Split, SplitDetail, split_batch, split_prepare, split_release
from ._state_io cimport (BLOB_ERR_TRUNCATED, BlobDefect, BlobPieces, BlobSource, blob_compose, blob_copy,
                         blob_release, blob_size)

from . import errors


cdef extern from "Python.h":
    int Py_IsInitialized() nogil
    const Py_ssize_t PY_SSIZE_T_MAX

cdef extern from "<stdio.h>":
    int snprintf(char* buffer, size_t capacity, const char* fmt, ...) nogil


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


cdef inline int hybrid_code(CtxData* c, int code, const RuleDetail* rule) noexcept nogil:
    return code if code >= RC_OK else rule_failure(c, code, rule)


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


# -- the table in the capsule -----------------------------------------------------------
# Adding an entry (e.g. rollback): append its pointer at the END of rc_capi in capi.h, bump
# RC_CAPI_API_VERSION there, mirror the field in _capi_types.pxd, set it below, declare the function
# in _capi.pxd (a hybrid's: _capi_hybrid.pxd) / capi.pxd, and add it to tests/capi_table.py's Table.
# Never reorder or change an existing entry: that would need RC_CAPI_ABI_VERSION bumped and every
# extension rebuilt.

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
