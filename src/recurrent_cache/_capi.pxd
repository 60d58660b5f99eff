# cython: language_level=3
"""The C API's functions (from ``recurrent_cache/capi.h``) that ``_capi`` defines, for ``cimport``.

Users ``cimport recurrent_cache.capi`` (capi.pxd), which re-exports the public names of this
file, of ``_capi_hybrid.pxd`` (the entries only a hybrid's context has) and of ``_capi_types.pxd``
(capi.h's types and codes); ``_capi.pyx`` publishes all of the functions as the ``rc_capi`` table
of the capsule ``recurrent_cache._capi._C_API`` for C and C++.
"""

from cpython.ref cimport PyObject
from libc.stdint cimport int8_t, int32_t, int64_t, uint32_t

from ._capi_types cimport rc_batch, rc_ctx, rc_ubatch

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
# -- API version 3: a HybridCache's context (the rest: _capi_hybrid.pxd) --
cdef int rc_seq_cp_range(rc_ctx* ctx, int32_t seq_src, int32_t seq_dst, int32_t p0, int32_t p1) noexcept nogil
