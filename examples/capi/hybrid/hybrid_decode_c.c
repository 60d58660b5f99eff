/* A hybrid model's decode loop in C over recurrent_cache's C API (docs/c-api.md, "Hybrid memories").
 *
 * hybrid_decode_c.decode(cache, n_seqs, n_steps): a HybridCache (compiled engine, f32 K / V / r / s
 * rows) decodes one token per sequence per step, the GIL released.  rc_batch_init places every
 * ubatch in both halves; after rc_batch_apply the made-up model writes each token's K and V rows at
 * the KV cell rc_batch_kv_cells gives it and each group's r and s rows at row head + g, and reads the
 * ubatch's mask.  Every value names its token: seq + 8 * pos (K, r) and minus that (V, s), so a test
 * compares the rows with the same loop through the Python API.  Returns the visible mask entries.
 */
#include <Python.h>
#include <stdlib.h>

#include "recurrent_cache/capi.h"

static float token_value(int32_t seq, int32_t pos) {
    return (float)(seq + 8 * pos);
}

static void fill(float* row, size_t n, float value) {
    size_t i;
    for (i = 0; i < n; i++) {
        row[i] = value;
    }
}

/* token value at KV cell `cell` of every attention layer: its K row, and its V row or V column */
static int write_kv(rc_ctx* ctx, int32_t cell, float value) {
    int32_t j, d, n_rows;
    void* data;
    size_t row_bytes;
    int v_trans;
    int code = RC_OK;
    for (j = 0; j < rc_n_attn(ctx) && code == RC_OK; j++) {
        code = rc_kv_tensor(ctx, j, 0, &data, &n_rows, &row_bytes, &v_trans);   /* K: one row per cell */
        if (code != RC_OK) {
            break;
        }
        fill((float*)((char*)data + (size_t)cell * row_bytes), row_bytes / sizeof(float), value);
        code = rc_kv_tensor(ctx, j, 1, &data, &n_rows, &row_bytes, &v_trans);
        if (code != RC_OK) {
            break;
        }
        if (!v_trans) {
            fill((float*)((char*)data + (size_t)cell * row_bytes), row_bytes / sizeof(float), -value);
        } else {   /* V transposed: one row per dimension, the cell's element in each */
            for (d = 0; d < n_rows; d++) {
                ((float*)((char*)data + (size_t)d * row_bytes))[cell] = -value;
            }
        }
    }
    return code;
}

/* the group's state after its last token in row `row` of r and s of every layer with recurrent state */
static int write_state(rc_ctx* ctx, int32_t row, float value) {
    int32_t il, n_layer = rc_n_layer(ctx);
    void* r;
    void* s;
    size_t r_bytes, s_bytes;
    int code;
    for (il = 0; il < n_layer; il++) {
        code = rc_tensor(ctx, il, &r, &r_bytes);
        if (code == RC_ERR_FILTERED_LAYER) {   /* an attention-only layer */
            continue;
        }
        if (code == RC_OK) {
            code = rc_tensor(ctx, n_layer + il, &s, &s_bytes);
        }
        if (code != RC_OK) {
            return code;
        }
        fill((float*)((char*)r + (size_t)row * r_bytes), r_bytes / sizeof(float), value);
        fill((float*)((char*)s + (size_t)row * s_bytes), s_bytes / sizeof(float), -value);
    }
    return RC_OK;
}

static int decode_step(rc_ctx* ctx, int32_t n_seqs, int32_t* seq_ids, int32_t* pos, float* mask,
                       size_t capacity, long* visible) {
    rc_batch* batch;
    rc_ubatch ub;
    const int32_t* cells;
    int32_t n_kv, t, g, c;
    int code, applied;
    for (t = 0; t < n_seqs; t++) {   /* one token per sequence, after its last position */
        seq_ids[t] = t;
        pos[t] = rc_seq_pos_max(ctx, t) + 1;
    }
    code = rc_batch_init(ctx, n_seqs, seq_ids, NULL, pos, NULL, 4, 0, &batch);
    if (code != RC_OK) {   /* RC_ERR_KV_NO_SLOT: the KV cache is full, nothing changed */
        return code;
    }
    while ((applied = rc_batch_apply(batch, &ub)) == 1) {
        code = rc_batch_kv_cells(batch, &cells, &n_kv);
        if (code == RC_OK) {
            code = rc_batch_kv_mask(batch, RC_MASK_FULL, mask, capacity);
        }
        for (t = 0; t < ub.n_tokens && code == RC_OK; t++) {   /* token t of the ubatch is batch token b */
            int32_t b = ub.token_order[t];
            code = write_kv(ctx, cells[t], token_value(seq_ids[b], pos[b]));
            for (c = 0; c < n_kv; c++) {
                *visible += mask[(size_t)t * n_kv + c] == 0.0f;
            }
        }
        for (g = 0; g < ub.n_seqs && code == RC_OK; g++) {   /* one token per group: its state */
            int32_t b = ub.token_order[g * ub.n_seq_tokens + ub.n_seq_tokens - 1];
            code = write_state(ctx, ub.head + g, token_value(seq_ids[b], pos[b]));
        }
        if (code != RC_OK) {
            break;
        }
    }
    rc_batch_release(batch);
    return code != RC_OK ? code : applied;
}

static PyObject* decode(PyObject* self, PyObject* args) {
    PyObject* cache;
    int n_seqs, n_steps, step;
    int code = RC_OK;
    long visible = 0;
    rc_ctx* ctx;
    int32_t* arrays;
    float* mask;
    size_t capacity;
    char message[512];
    if (!PyArg_ParseTuple(args, "Oii", &cache, &n_seqs, &n_steps)) {
        return NULL;
    }
    ctx = rc_ctx_new(cache);   /* with the GIL: NULL and an exception for a cache the C API cannot drive */
    if (ctx == NULL) {
        return NULL;
    }
    capacity = (size_t)n_seqs * (size_t)rc_kv_size(ctx);   /* a ubatch's mask: n_tokens x n_kv floats at most */
    arrays = (int32_t*)malloc(2 * (size_t)n_seqs * sizeof(int32_t));
    mask = (float*)malloc(capacity * sizeof(float));
    if (arrays == NULL || mask == NULL) {
        free(arrays);
        free(mask);
        rc_ctx_free(ctx);
        return PyErr_NoMemory();
    }
    Py_BEGIN_ALLOW_THREADS
    for (step = 0; step < n_steps && code == RC_OK; step++) {
        code = decode_step(ctx, n_seqs, arrays, arrays + n_seqs, mask, capacity, &visible);
    }
    Py_END_ALLOW_THREADS
    free(arrays);
    free(mask);
    if (code < 0) {
        rc_error_message(ctx, code, message, sizeof message);
        rc_ctx_free(ctx);
        PyErr_SetString(PyExc_RuntimeError, message);
        return NULL;
    }
    rc_ctx_free(ctx);
    return PyLong_FromLong(visible);
}

static PyMethodDef methods[] = {
    {"decode", decode, METH_VARARGS, "decode(cache, n_seqs, n_steps): one token per sequence per step, in C"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "hybrid_decode_c", NULL, -1, methods};

PyMODINIT_FUNC PyInit_hybrid_decode_c(void) {
    if (import_recurrent_cache() < 0) {
        return NULL;
    }
    return PyModule_Create(&module);
}
