# cython: language_level=3
"""The C API's types, declared once for ``_capi`` and ``_capi_hybrid``.

``recurrent_cache/capi.h``'s codes, handles, ubatch and table, for ``cimport`` (``capi.pxd``
re-exports them to users); what the opaque handles point to inside (``CtxData``, ``BatchData``,
``Detail``) and the ``Context`` object that owns one cache's; ``record``, which keeps a failure's
detail for ``rc_error_message``.
"""

cimport cython
from cpython.ref cimport PyObject
from libc.stdint cimport int8_t, int32_t, int64_t, uint8_t, uint32_t, uint64_t
from libc.string cimport memset

from ._core cimport MemoryCore
from ._core_ops cimport Core
from ._hybrid_rule cimport RuleDetail
from ._kv_table cimport KvTable
from ._split cimport Split
from ._state_io cimport BlobDefect


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
    cdef CtxData data
    cdef Py_ssize_t handles         # rc_ctx_new calls not matched by rc_ctx_free yet
    cdef MemoryCore core
    cdef object cache
    cdef object kv                  # a hybrid's KVCells, its K / V host views and attention layer ids
    cdef object kv_views
    cdef object python_error        # the message of the last exception a hybrid's state call caught


cdef inline int record(CtxData* ctx, int code, const char* what) noexcept nogil:
    """Keep code's detail in the context for rc_error_message; returns code."""
    memset(&ctx.detail, 0, sizeof(Detail))
    ctx.detail.code = code
    ctx.detail.what = what
    return code
