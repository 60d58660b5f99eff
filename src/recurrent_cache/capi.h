/*
 * recurrent_cache/capi.h — recurrent_cache's C API for C, C++ and Cython extensions.
 *
 * A memory context over a RecurrentCache (compiled engine) and the handful of calls a
 * decode step needs, fetched at run time from a capsule the way numpy's import_array()
 * fetches its table:
 *
 *     #include <Python.h>
 *     #include "recurrent_cache/capi.h"      // include dir: recurrent_cache.get_include()
 *
 *     // once, in the module's init function (with the GIL):
 *     if (import_recurrent_cache() < 0) return NULL;   // ImportError set, with the reason
 *
 *     rc_ctx* ctx = rc_ctx_new(cache_object);          // with the GIL; NULL + exception
 *     // ... any thread, GIL released:
 *     rc_batch* batch;
 *     int code = rc_batch_init(ctx, n_tokens, seq_ids, NULL, pos, NULL, 512, 0, &batch);
 *     rc_ubatch ub;
 *     while (code == RC_OK && (code = rc_batch_apply(batch, &ub)) == 1) {
 *         // group g of the ubatch is in state row ub.head + g of every tensor;
 *         // token k of group g is batch index ub.token_order[g * ub.n_seq_tokens + k]
 *         code = RC_OK;
 *     }
 *     rc_batch_release(batch);
 *     if (code < 0) { char msg[256]; rc_error_message(ctx, code, msg, sizeof msg); ... }
 *     // ... with the GIL:
 *     rc_ctx_free(ctx);
 *
 * Caller's duties (everything else is checked):
 * - one thread at a time per cache: the calls may run without the GIL, in parallel on
 *   different caches, never two at once on one cache — and not while Python code uses
 *   the same cache (the Python facade's own thread check does not see C calls);
 * - pointers point to arrays of the lengths given; a batch is released before its
 *   context is freed (rc_ctx_free refuses otherwise); a handle is used after release
 *   or free never.
 * Checked: NULL handles and arrays, lengths, offsets, n_ubatch, seq ids and positions
 * (the same validation as RecurrentCache.init_batch), state blobs (every field, before
 * anything changes), buffer sizes, a batch applied after the cache changed.
 *
 * Error codes are negative and come from one table (recurrent_cache/errors.py, the
 * state-blob codes from recurrent_cache/_state_io.pxd); rc_error_message() turns a code
 * and the detail its context recorded into the same message the Python API raises.
 *
 * Versions: RC_CAPI_ABI_VERSION changes only if an existing entry changes meaning (the
 * table is append-only); RC_CAPI_API_VERSION grows when entries are appended.  The import
 * fails with an ImportError — never a crash — when the ABI differs or the installed
 * library is older than this header.
 */
#ifndef RECURRENT_CACHE_CAPI_H
#define RECURRENT_CACHE_CAPI_H

#include <Python.h>
#include <stddef.h>
#include <stdint.h>

#define RC_CAPI_ABI_VERSION 1
#define RC_CAPI_API_VERSION 2   /* 2: rollback (n_rollback, seq_rollback_min, step rows) */
#define RC_CAPI_CAPSULE_NAME "recurrent_cache._capi._C_API"

#define RC_OK 0

/* Error codes (negative; recurrent_cache/errors.py is the table, a test checks these agree) */
#define RC_ERR_SEQ_RANGE (-1)            /* a seq id outside [0, size) */
#define RC_ERR_DUPLICATE_SEQ (-2)        /* a seq id twice in one ubatch (a bug if it reaches you) */
#define RC_ERR_NO_FREE_CELL (-3)         /* the batch needs more cells than are free */
#define RC_ERR_NO_MEMORY (-4)
#define RC_ERR_PLACEMENT (-5)
#define RC_ERR_POSITION (-6)             /* seq_add would move a position out of [0, 2**31 - 1) */
#define RC_ERR_ARGUMENT (-7)             /* seq_div by d <= 0 */
#define RC_ERR_SEQ_HAS_CELL (-8)
#define RC_ERR_BROKEN (-9)               /* an invariant broke: a bug of recurrent_cache */
#define RC_ERR_SPLIT_SEQ_RANGE (-10)     /* a token lists a seq id outside [0, size) */
#define RC_ERR_SPLIT_NEGATIVE_POS (-11)
#define RC_ERR_SPLIT_GAP (-12)           /* a sequence's positions are not consecutive */
#define RC_ERR_SPLIT_CONTINUE (-13)      /* a sequence does not continue its cached position */
#define RC_ERR_SPLIT_FIND_SLOT (-14)
#define RC_ERR_SPLIT_NO_MEMORY (-15)
#define RC_ERR_SPLIT_POS_MAX (-16)       /* position 2**31 - 1 */
/* -43 .. -30: a state blob defect (truncated, trailing bytes, a field that does not fit) */
#define RC_ERR_BLOB_FIRST (-43)
#define RC_ERR_BLOB_LAST (-30)
#define RC_ERR_NULL (-50)                /* a NULL handle or array */
#define RC_ERR_N_TOKENS (-51)            /* n_tokens < 1 */
#define RC_ERR_OFFSETS (-52)             /* seq_id_offsets do not start at 0 and strictly grow */
#define RC_ERR_N_UBATCH (-53)            /* n_ubatch < 1 */
#define RC_ERR_STALE (-54)               /* the cache changed after the batch was prepared */
#define RC_ERR_TARGET_SIZE (-55)         /* state_write: the target is too small */
#define RC_ERR_OVERLAP (-56)             /* a state buffer overlaps the cache's own rows */
#define RC_ERR_TENSOR_INDEX (-57)        /* tensor index outside [0, 2 * n_layer) */
#define RC_ERR_STATE_SEQ (-58)           /* a state seq_id outside [-1, size) */
#define RC_ERR_OPEN_BATCHES (-59)        /* rc_ctx_free with batches not released */
#define RC_ERR_FLAGS (-60)               /* unknown rc_batch_init flags */
#define RC_ERR_FILTERED_LAYER (-61)      /* a tensor of a layer the cache's layer filter keeps no state for */

/* rc_batch_init flags */
#define RC_BATCH_LOGITS_ALL 1u   /* every token is an output */
#define RC_BATCH_EMBD_POOLED 2u  /* one sequence per ubatch (split_seq), for pooled embeddings */

typedef struct rc_ctx rc_ctx;      /* opaque: a memory context over one cache */
typedef struct rc_batch rc_batch;  /* opaque: one validated, split and prepared batch */

/* What rc_batch_apply reports about the ubatch it placed (filled by the library). */
typedef struct rc_ubatch {
    int32_t index;               /* ubatch number within the batch, from 0 */
    int32_t head;                /* state row of group 0: group g is in row head + g */
    int32_t n_seqs;              /* groups (sequences) in the ubatch */
    int32_t n_seq_tokens;        /* tokens per group */
    int32_t n_tokens;            /* n_seqs * n_seq_tokens */
    int32_t first_output;        /* output row of the ubatch's first output token */
    int32_t n_outputs;           /* output tokens in the ubatch */
    const int32_t* token_order;  /* [n_tokens] batch index of token k of group g at g * n_seq_tokens + k */
    const uint8_t* output;       /* [n_tokens] 1 where that token is an output */
} rc_ubatch;

/* The function table in the capsule. Append-only: new entries go at the end and bump
 * RC_CAPI_API_VERSION (recurrent_cache/_capi.pyx says what else to update). */
typedef struct rc_capi {
    uint32_t abi_version;
    uint32_t api_version;
    /* -- context (call with the GIL held) -- */
    rc_ctx* (*ctx_new)(PyObject* cache);          /* NULL + Python exception when not a compiled cache */
    int (*ctx_free)(rc_ctx* ctx);                 /* RC_OK, or an error (open batches: nothing freed) */
    /* -- everything below: no GIL needed -- */
    int (*error_message)(const rc_ctx* ctx, int code, char* buffer, size_t capacity);
    int32_t (*size)(const rc_ctx* ctx);           /* cells; -1 for a NULL ctx */
    int32_t (*n_layer)(const rc_ctx* ctx);
    int32_t (*used)(const rc_ctx* ctx);
    int (*tensor)(const rc_ctx* ctx, int32_t index, void** data, size_t* row_bytes);  /* r of layer il: il, s: n_layer + il; a layer without state (layer filter): RC_ERR_FILTERED_LAYER */
    /* batches */
    int (*batch_init)(rc_ctx* ctx, int32_t n_tokens, const int32_t* seq_ids, const int32_t* seq_id_offsets,
                      const int32_t* pos, const int8_t* output, int32_t n_ubatch, uint32_t flags,
                      rc_batch** batch);
    int (*batch_apply)(rc_batch* batch, rc_ubatch* ubatch);  /* 1: applied; 0: none left; < 0: error */
    int32_t (*batch_n_ubatches)(const rc_batch* batch);     /* RC_ERR_NULL for a NULL batch */
    const int64_t* (*batch_out_ids)(const rc_batch* batch, int32_t* n_outputs);
    void (*batch_release)(rc_batch* batch);       /* NULL is fine */
    /* sequences */
    int (*seq_rm)(rc_ctx* ctx, int32_t seq, int32_t p0, int32_t p1);   /* 1 removed, 0 refused */
    int (*seq_cp)(rc_ctx* ctx, int32_t seq_src, int32_t seq_dst);
    int (*seq_keep)(rc_ctx* ctx, int32_t seq);
    int (*seq_add)(rc_ctx* ctx, int32_t seq, int32_t p0, int32_t p1, int32_t shift);
    int (*seq_div)(rc_ctx* ctx, int32_t seq, int32_t p0, int32_t p1, int32_t d);
    int32_t (*seq_pos_min)(const rc_ctx* ctx, int32_t seq);  /* -1: no cell (or seq out of range); RC_ERR_NULL */
    int32_t (*seq_pos_max)(const rc_ctx* ctx, int32_t seq);
    int (*clear)(rc_ctx* ctx);
    /* state (llama.cpp's byte format, seq_id -1: the whole cache) */
    int (*state_size)(const rc_ctx* ctx, int32_t seq_id, size_t* size);
    int (*state_write)(rc_ctx* ctx, int32_t seq_id, void* target, size_t capacity, size_t* written);
    int (*state_read)(rc_ctx* ctx, int32_t seq_id, const void* data, size_t length);
    /* -- API version 2: rollback for speculative decoding (docs/rollback.md) --
     * With a cache made with n_rollback > 0, rc_seq_rm(ctx, seq, p0, -1) with 0 < p0 <= pos rolls
     * seq back to its state after p0 - 1 when its cell holds it (1), else 0, nothing changed.
     * After rc_batch_apply, the model writes the state of each tensor after each token but the
     * last of every group (m = rc_batch_n_steps of them per group) into the rows rc_batch_step_row
     * gives: group g, j in [0, m) is the state after the group's token n_seq_tokens - 1 - m + j.
     * The cache counts on it (n_rollback > 0 is the model's promise).  The rows are a scratch the
     * next call that changes the cache (through C or Python) files into the history: write them
     * before it; a row pointer is not valid after it (rc_batch_step_row then gives RC_ERR_STALE). */
    int32_t (*n_rollback)(const rc_ctx* ctx);                        /* RC_ERR_NULL for NULL */
    int32_t (*seq_rollback_min)(const rc_ctx* ctx, int32_t seq);     /* smallest reachable q, or -1 */
    int32_t (*batch_n_steps)(const rc_batch* batch);                 /* m of the last applied ubatch */
    int (*batch_step_row)(const rc_batch* batch, int32_t tensor, int32_t group, int32_t j, void** row);
} rc_capi;

#ifndef RC_CAPI_TYPES_ONLY  /* defined by recurrent_cache itself and by Cython cimports */
/* Each translation unit has its own table pointer, set by import_recurrent_cache(). */
static const rc_capi* RC_CAPI_TABLE = NULL;

static int import_recurrent_cache(void) {
    PyObject* module = PyImport_ImportModule("recurrent_cache._capi");
    PyObject* capsule;
    const rc_capi* table;
    if (module == NULL) {
        return -1;
    }
    capsule = PyObject_GetAttrString(module, "_C_API");
    Py_DECREF(module);
    if (capsule == NULL) {
        return -1;
    }
    /* the table is static data of recurrent_cache._capi, which is never unloaded */
    table = (const rc_capi*)PyCapsule_GetPointer(capsule, RC_CAPI_CAPSULE_NAME);
    Py_DECREF(capsule);
    if (table == NULL) {
        return -1;
    }
    if (table->abi_version != RC_CAPI_ABI_VERSION) {
        PyErr_Format(PyExc_ImportError,
                     "recurrent_cache C API: this extension was built against ABI version %d, the installed "
                     "recurrent_cache has ABI version %u; rebuild the extension against it",
                     RC_CAPI_ABI_VERSION, (unsigned)table->abi_version);
        return -1;
    }
    if (table->api_version < RC_CAPI_API_VERSION) {
        PyErr_Format(PyExc_ImportError,
                     "recurrent_cache C API: this extension needs API version %d, the installed "
                     "recurrent_cache has API version %u; upgrade recurrent_cache",
                     RC_CAPI_API_VERSION, (unsigned)table->api_version);
        return -1;
    }
    RC_CAPI_TABLE = table;
    return 0;
}

#ifndef RC_CAPI_NO_MACROS
#define rc_ctx_new (RC_CAPI_TABLE->ctx_new)
#define rc_ctx_free (RC_CAPI_TABLE->ctx_free)
#define rc_error_message (RC_CAPI_TABLE->error_message)
#define rc_size (RC_CAPI_TABLE->size)
#define rc_n_layer (RC_CAPI_TABLE->n_layer)
#define rc_used (RC_CAPI_TABLE->used)
#define rc_tensor (RC_CAPI_TABLE->tensor)
#define rc_batch_init (RC_CAPI_TABLE->batch_init)
#define rc_batch_apply (RC_CAPI_TABLE->batch_apply)
#define rc_batch_n_ubatches (RC_CAPI_TABLE->batch_n_ubatches)
#define rc_batch_out_ids (RC_CAPI_TABLE->batch_out_ids)
#define rc_batch_release (RC_CAPI_TABLE->batch_release)
#define rc_seq_rm (RC_CAPI_TABLE->seq_rm)
#define rc_seq_cp (RC_CAPI_TABLE->seq_cp)
#define rc_seq_keep (RC_CAPI_TABLE->seq_keep)
#define rc_seq_add (RC_CAPI_TABLE->seq_add)
#define rc_seq_div (RC_CAPI_TABLE->seq_div)
#define rc_seq_pos_min (RC_CAPI_TABLE->seq_pos_min)
#define rc_seq_pos_max (RC_CAPI_TABLE->seq_pos_max)
#define rc_clear (RC_CAPI_TABLE->clear)
#define rc_state_size (RC_CAPI_TABLE->state_size)
#define rc_state_write (RC_CAPI_TABLE->state_write)
#define rc_state_read (RC_CAPI_TABLE->state_read)
#define rc_n_rollback (RC_CAPI_TABLE->n_rollback)
#define rc_seq_rollback_min (RC_CAPI_TABLE->seq_rollback_min)
#define rc_batch_n_steps (RC_CAPI_TABLE->batch_n_steps)
#define rc_batch_step_row (RC_CAPI_TABLE->batch_step_row)
#endif /* RC_CAPI_NO_MACROS */
#endif /* RC_CAPI_TYPES_ONLY */

#endif /* RECURRENT_CACHE_CAPI_H */
