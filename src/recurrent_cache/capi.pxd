# cython: language_level=3
"""recurrent_cache's C API for Cython: ``cimport recurrent_cache.capi`` (the preferred way in;
``recurrent_cache.core`` is deprecated).

    from cpython.ref cimport PyObject
    from recurrent_cache.capi cimport (RC_OK, rc_ctx, rc_batch, rc_ubatch, rc_ctx_new, rc_ctx_free,
                                       rc_batch_init, rc_batch_apply, rc_batch_release)

    ctx = rc_ctx_new(<PyObject*>cache)         # with the GIL; raises for a non-compiled cache
    with nogil:
        code = rc_batch_init(ctx, n_tokens, seq_ids, NULL, pos, NULL, 512, 0, &batch)
        while code == RC_OK and rc_batch_apply(batch, &ub) == 1:
            ...                                # group g is in state row ub.head + g
        rc_batch_release(batch)
    rc_ctx_free(ctx)

The same functions as the C header ``recurrent_cache/capi.h`` (whose comment documents
each call, the codes and the caller's duties), called directly instead of through the
capsule's table.  Build with ``include_path=[recurrent_cache.get_include()]`` for Cython
and ``include_dirs=[recurrent_cache.get_include()]`` for the C compiler (the generated C
includes ``recurrent_cache/capi.h`` for the types); see examples/capi/cython/.
"""

from recurrent_cache._capi_types cimport (RC_BATCH_EMBD_POOLED, RC_BATCH_LOGITS_ALL, RC_ERR_ARGUMENT,
                                          RC_ERR_BLOB_FIRST, RC_ERR_BLOB_LAST, RC_ERR_BROKEN, RC_ERR_DUPLICATE_SEQ,
                                          RC_ERR_FILTERED_LAYER, RC_ERR_FLAGS, RC_ERR_NO_FREE_CELL,
                                          RC_ERR_NO_MEMORY, RC_ERR_NULL, RC_ERR_N_TOKENS, RC_ERR_N_UBATCH,
                                          RC_ERR_OFFSETS, RC_ERR_OPEN_BATCHES, RC_ERR_OVERLAP, RC_ERR_PLACEMENT,
                                          RC_ERR_POSITION, RC_ERR_SEQ_HAS_CELL, RC_ERR_SEQ_RANGE,
                                          RC_ERR_SPLIT_CONTINUE, RC_ERR_SPLIT_FIND_SLOT, RC_ERR_SPLIT_GAP,
                                          RC_ERR_SPLIT_NEGATIVE_POS, RC_ERR_SPLIT_NO_MEMORY, RC_ERR_SPLIT_POS_MAX,
                                          RC_ERR_SPLIT_SEQ_RANGE, RC_ERR_STALE, RC_ERR_STATE_SEQ,
                                          RC_ERR_TARGET_SIZE, RC_ERR_TENSOR_INDEX, RC_OK, rc_batch, rc_ctx, rc_ubatch,
                                          # API version 3: a HybridCache's context
                                          RC_ERR_CP_RANGE, RC_ERR_KV, RC_ERR_KV_NO_SLOT,
                                          RC_ERR_MASK_SIZE, RC_ERR_MOVE_RANGE, RC_ERR_NOT_APPLIED, RC_ERR_NOT_HYBRID,
                                          RC_ERR_PYTHON,
                                          RC_ERR_SEQ_HOLDS, RC_MASK_FULL, RC_MASK_SLIDING)
from recurrent_cache._capi cimport (rc_batch_apply, rc_batch_init, rc_batch_n_steps, rc_batch_n_ubatches,
                                    rc_batch_out_ids, rc_batch_release, rc_batch_step_row, rc_clear, rc_ctx_free,
                                    rc_ctx_new, rc_error_message, rc_n_layer, rc_n_rollback, rc_seq_add, rc_seq_cp,
                                    rc_seq_cp_range, rc_seq_div, rc_seq_keep, rc_seq_pos_max, rc_seq_pos_min,
                                    rc_seq_rm, rc_seq_rollback_min, rc_size, rc_state_read, rc_state_size,
                                    rc_state_write, rc_tensor, rc_used)
# API version 3: a HybridCache's context
from recurrent_cache._capi_hybrid cimport (rc_attn_layer, rc_batch_kv_cells, rc_batch_kv_mask, rc_kv_has_shift,
                                           rc_kv_reset_shift, rc_kv_shifts, rc_kv_size, rc_kv_tensor, rc_kv_used,
                                           rc_n_attn)
