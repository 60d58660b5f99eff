# cython: language_level=3
"""A ``HybridCache``'s C API context (``_capi_hybrid``): the entries of ``recurrent_cache/capi.h``'s
table only a hybrid's context has (API version 3; ``capi.pxd`` re-exports them), and the hybrid's
side of ``_capi``'s other entries."""

from libc.stdint cimport int32_t, int64_t

from ._capi_types cimport BatchData, Context, CtxData, rc_batch, rc_ctx
from ._hybrid_rule cimport RuleDetail

# -- API version 3: a HybridCache's context --
cdef int32_t rc_n_attn(const rc_ctx* ctx) noexcept nogil
cdef int32_t rc_attn_layer(const rc_ctx* ctx, int32_t attn_index) noexcept nogil
cdef int32_t rc_kv_size(const rc_ctx* ctx) noexcept nogil
cdef int32_t rc_kv_used(const rc_ctx* ctx) noexcept nogil
cdef int rc_kv_tensor(const rc_ctx* ctx, int32_t attn_index, int32_t which, void** data, int32_t* n_rows,
                      size_t* row_bytes, int* v_trans) noexcept nogil
cdef int rc_batch_kv_cells(const rc_batch* batch, const int32_t** cells, int32_t* n_kv) noexcept nogil
cdef int rc_batch_kv_mask(const rc_batch* batch, int32_t kind, float* out, size_t capacity) noexcept nogil
cdef int32_t rc_kv_has_shift(const rc_ctx* ctx) noexcept nogil
cdef int rc_kv_shifts(const rc_ctx* ctx, const int32_t** shifts) noexcept nogil
cdef int rc_kv_reset_shift(rc_ctx* ctx) noexcept nogil
# -- for _capi's entries on a hybrid's context --
cdef attach_kv(Context context, object cache, object kv_table)
cdef int rule_failure(CtxData* c, int code, const RuleDetail* rule) noexcept nogil
cdef int kv_failure(CtxData* c, int kv_code, int64_t a, int64_t b, const char* what) noexcept nogil
cdef int batch_kv_prepare(CtxData* c, BatchData* b, const int32_t* pos) noexcept nogil
cdef int32_t hybrid_seq_pos(const CtxData* c, int32_t seq, bint last) noexcept nogil
cdef void hybrid_clear(CtxData* c) noexcept nogil
# a hybrid's state bytes: the Python facade's, with the GIL
cdef int hybrid_state_size(CtxData* c, int32_t seq_id, size_t* size) noexcept with gil
cdef int hybrid_state_write(CtxData* c, int32_t seq_id, void* target, size_t capacity,
                            size_t* written) noexcept with gil
cdef int hybrid_state_read(CtxData* c, int32_t seq_id, const void* data, size_t length) noexcept with gil
