# cython: language_level=3
"""The C API's types (from ``recurrent_cache/capi.h``) and its functions, for ``cimport``.

Users ``cimport recurrent_cache.capi`` (capi.pxd), which re-exports the public names
of this file; ``_capi.pyx`` implements them and publishes the same functions as the
``rc_capi`` table of the capsule ``recurrent_cache._capi._C_API`` for C and C++.
"""

from cpython.ref cimport PyObject
from libc.stdint cimport int8_t, int32_t, int64_t, uint8_t, uint32_t

cdef extern from *:
    """
    #define RC_CAPI_TYPES_ONLY 1  /* the types and codes of capi.h, not its import function and macros */
    """

cdef extern from "recurrent_cache/capi.h":
    enum:
        RC_CAPI_ABI_VERSION
        RC_CAPI_API_VERSION
        RC_OK
        RC_BATCH_LOGITS_ALL
        RC_BATCH_EMBD_POOLED
        RC_ERR_SEQ_RANGE
        RC_ERR_DUPLICATE_SEQ
        RC_ERR_NO_FREE_CELL
        RC_ERR_NO_MEMORY
        RC_ERR_PLACEMENT
        RC_ERR_POSITION
        RC_ERR_ARGUMENT
        RC_ERR_SEQ_HAS_CELL
        RC_ERR_BROKEN
        RC_ERR_SPLIT_SEQ_RANGE
        RC_ERR_SPLIT_NEGATIVE_POS
        RC_ERR_SPLIT_GAP
        RC_ERR_SPLIT_CONTINUE
        RC_ERR_SPLIT_FIND_SLOT
        RC_ERR_SPLIT_NO_MEMORY
        RC_ERR_SPLIT_POS_MAX
        RC_ERR_BLOB_FIRST
        RC_ERR_BLOB_LAST
        RC_ERR_NULL
        RC_ERR_N_TOKENS
        RC_ERR_OFFSETS
        RC_ERR_N_UBATCH
        RC_ERR_STALE
        RC_ERR_TARGET_SIZE
        RC_ERR_OVERLAP
        RC_ERR_TENSOR_INDEX
        RC_ERR_STATE_SEQ
        RC_ERR_OPEN_BATCHES
        RC_ERR_FLAGS
        RC_ERR_FILTERED_LAYER
        RC_ERR_SEQ_HOLDS
        RC_ERR_CP_RANGE
        RC_ERR_KV
        RC_ERR_KV_NO_SLOT
        RC_ERR_NOT_HYBRID
        RC_ERR_NOT_APPLIED
        RC_ERR_MASK_SIZE
        RC_ERR_PYTHON
        RC_ERR_MOVE_RANGE
        RC_MASK_FULL
        RC_MASK_SLIDING
    const char* RC_CAPI_CAPSULE_NAME

    ctypedef struct rc_ctx:
        pass
    ctypedef struct rc_batch:
        pass

    ctypedef struct rc_ubatch:
        int32_t index
        int32_t head
        int32_t n_seqs
        int32_t n_seq_tokens
        int32_t n_tokens
        int32_t first_output
        int32_t n_outputs
        const int32_t* token_order
        const uint8_t* output

    ctypedef struct rc_capi:
        uint32_t abi_version
        uint32_t api_version
        rc_ctx* (*ctx_new)(PyObject* cache) except NULL
        int (*ctx_free)(rc_ctx* ctx) noexcept
        int (*error_message)(const rc_ctx* ctx, int code, char* buffer, size_t capacity) noexcept nogil
        int32_t (*size)(const rc_ctx* ctx) noexcept nogil
        int32_t (*n_layer)(const rc_ctx* ctx) noexcept nogil
        int32_t (*used)(const rc_ctx* ctx) noexcept nogil
        int (*tensor)(const rc_ctx* ctx, int32_t index, void** data, size_t* row_bytes) noexcept nogil
        int (*batch_init)(rc_ctx* ctx, int32_t n_tokens, const int32_t* seq_ids, const int32_t* seq_id_offsets,
                          const int32_t* pos, const int8_t* output, int32_t n_ubatch, uint32_t flags,
                          rc_batch** batch) noexcept nogil
        int (*batch_apply)(rc_batch* batch, rc_ubatch* ubatch) noexcept nogil
        int32_t (*batch_n_ubatches)(const rc_batch* batch) noexcept nogil
        const int64_t* (*batch_out_ids)(const rc_batch* batch, int32_t* n_outputs) noexcept nogil
        void (*batch_release)(rc_batch* batch) noexcept nogil
        int (*seq_rm)(rc_ctx* ctx, int32_t seq, int32_t p0, int32_t p1) noexcept nogil
        int (*seq_cp)(rc_ctx* ctx, int32_t seq_src, int32_t seq_dst) noexcept nogil
        int (*seq_keep)(rc_ctx* ctx, int32_t seq) noexcept nogil
        int (*seq_add)(rc_ctx* ctx, int32_t seq, int32_t p0, int32_t p1, int32_t shift) noexcept nogil
        int (*seq_div)(rc_ctx* ctx, int32_t seq, int32_t p0, int32_t p1, int32_t d) noexcept nogil
        int32_t (*seq_pos_min)(const rc_ctx* ctx, int32_t seq) noexcept nogil
        int32_t (*seq_pos_max)(const rc_ctx* ctx, int32_t seq) noexcept nogil
        int (*clear)(rc_ctx* ctx) noexcept nogil
        int (*state_size)(const rc_ctx* ctx, int32_t seq_id, size_t* size) noexcept nogil
        int (*state_write)(rc_ctx* ctx, int32_t seq_id, void* target, size_t capacity, size_t* written) noexcept nogil
        int (*state_read)(rc_ctx* ctx, int32_t seq_id, const void* data, size_t length) noexcept nogil
        int32_t (*n_rollback)(const rc_ctx* ctx) noexcept nogil
        int32_t (*seq_rollback_min)(const rc_ctx* ctx, int32_t seq) noexcept nogil
        int32_t (*batch_n_steps)(const rc_batch* batch) noexcept nogil
        int (*batch_step_row)(const rc_batch* batch, int32_t tensor, int32_t group, int32_t j,
                              void** row) noexcept nogil
        int32_t (*n_attn)(const rc_ctx* ctx) noexcept nogil
        int32_t (*attn_layer)(const rc_ctx* ctx, int32_t attn_index) noexcept nogil
        int32_t (*kv_size)(const rc_ctx* ctx) noexcept nogil
        int32_t (*kv_used)(const rc_ctx* ctx) noexcept nogil
        int (*kv_tensor)(const rc_ctx* ctx, int32_t attn_index, int32_t which, void** data, int32_t* n_rows,
                         size_t* row_bytes, int* v_trans) noexcept nogil
        int (*batch_kv_cells)(const rc_batch* batch, const int32_t** cells, int32_t* n_kv) noexcept nogil
        int (*batch_kv_mask)(const rc_batch* batch, int32_t kind, float* out, size_t capacity) noexcept nogil
        int (*seq_cp_range)(rc_ctx* ctx, int32_t seq_src, int32_t seq_dst, int32_t p0, int32_t p1) noexcept nogil
        int32_t (*kv_has_shift)(const rc_ctx* ctx) noexcept nogil
        int (*kv_shifts)(const rc_ctx* ctx, const int32_t** shifts) noexcept nogil
        int (*kv_reset_shift)(rc_ctx* ctx) noexcept nogil


# -- context (with the GIL) --
cdef rc_ctx* rc_ctx_new(PyObject* cache) except NULL
cdef int rc_ctx_free(rc_ctx* ctx) noexcept
# -- everything else: noexcept nogil --
cdef int rc_error_message(const rc_ctx* ctx, int code, char* buffer, size_t capacity) noexcept nogil
cdef int32_t rc_size(const rc_ctx* ctx) noexcept nogil
cdef int32_t rc_n_layer(const rc_ctx* ctx) noexcept nogil
cdef int32_t rc_used(const rc_ctx* ctx) noexcept nogil
cdef int rc_tensor(const rc_ctx* ctx, int32_t index, void** data, size_t* row_bytes) noexcept nogil
cdef int rc_batch_init(rc_ctx* ctx, int32_t n_tokens, const int32_t* seq_ids, const int32_t* seq_id_offsets,
                       const int32_t* pos, const int8_t* output, int32_t n_ubatch, uint32_t flags,
                       rc_batch** batch) noexcept nogil
cdef int rc_batch_apply(rc_batch* batch, rc_ubatch* ubatch) noexcept nogil
cdef int32_t rc_batch_n_ubatches(const rc_batch* batch) noexcept nogil
cdef const int64_t* rc_batch_out_ids(const rc_batch* batch, int32_t* n_outputs) noexcept nogil
cdef void rc_batch_release(rc_batch* batch) noexcept nogil
cdef int rc_seq_rm(rc_ctx* ctx, int32_t seq, int32_t p0, int32_t p1) noexcept nogil
cdef int rc_seq_cp(rc_ctx* ctx, int32_t seq_src, int32_t seq_dst) noexcept nogil
cdef int rc_seq_keep(rc_ctx* ctx, int32_t seq) noexcept nogil
cdef int rc_seq_add(rc_ctx* ctx, int32_t seq, int32_t p0, int32_t p1, int32_t shift) noexcept nogil
cdef int rc_seq_div(rc_ctx* ctx, int32_t seq, int32_t p0, int32_t p1, int32_t d) noexcept nogil
cdef int32_t rc_seq_pos_min(const rc_ctx* ctx, int32_t seq) noexcept nogil
cdef int32_t rc_seq_pos_max(const rc_ctx* ctx, int32_t seq) noexcept nogil
cdef int rc_clear(rc_ctx* ctx) noexcept nogil
cdef int rc_state_size(const rc_ctx* ctx, int32_t seq_id, size_t* size) noexcept nogil
cdef int rc_state_write(rc_ctx* ctx, int32_t seq_id, void* target, size_t capacity, size_t* written) noexcept nogil
cdef int rc_state_read(rc_ctx* ctx, int32_t seq_id, const void* data, size_t length) noexcept nogil
cdef int32_t rc_n_rollback(const rc_ctx* ctx) noexcept nogil
cdef int32_t rc_seq_rollback_min(const rc_ctx* ctx, int32_t seq) noexcept nogil
cdef int32_t rc_batch_n_steps(const rc_batch* batch) noexcept nogil
cdef int rc_batch_step_row(const rc_batch* batch, int32_t tensor, int32_t group, int32_t j, void** row) noexcept nogil
# -- API version 3: a HybridCache's context --
cdef int32_t rc_n_attn(const rc_ctx* ctx) noexcept nogil
cdef int32_t rc_attn_layer(const rc_ctx* ctx, int32_t attn_index) noexcept nogil
cdef int32_t rc_kv_size(const rc_ctx* ctx) noexcept nogil
cdef int32_t rc_kv_used(const rc_ctx* ctx) noexcept nogil
cdef int rc_kv_tensor(const rc_ctx* ctx, int32_t attn_index, int32_t which, void** data, int32_t* n_rows,
                      size_t* row_bytes, int* v_trans) noexcept nogil
cdef int rc_batch_kv_cells(const rc_batch* batch, const int32_t** cells, int32_t* n_kv) noexcept nogil
cdef int rc_batch_kv_mask(const rc_batch* batch, int32_t kind, float* out, size_t capacity) noexcept nogil
cdef int rc_seq_cp_range(rc_ctx* ctx, int32_t seq_src, int32_t seq_dst, int32_t p0, int32_t p1) noexcept nogil
cdef int32_t rc_kv_has_shift(const rc_ctx* ctx) noexcept nogil
cdef int rc_kv_shifts(const rc_ctx* ctx, const int32_t** shifts) noexcept nogil
cdef int rc_kv_reset_shift(rc_ctx* ctx) noexcept nogil
