/*
 * Continuous batching from a plain C extension through recurrent_cache's C header.
 *
 * Every step builds a batch in C arrays (new prompts plus one decode token per running
 * sequence), hands it to rc_batch_init (validate, split, prove it fits) and applies its
 * ubatches; "the model" adds the tokens each sequence consumed to column 0 of its s row
 * of layer 0, so the test can check the state rows moved with the cells.  The GIL is
 * released for the whole loop.  Build: see setup.py next to this file.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdlib.h>

#include "recurrent_cache/capi.h"

#define MAX_PROMPT 8

/* Numerical Recipes' LCG: the Python twin in the tests draws the same numbers. */
static uint32_t next_random(uint32_t* state) {
    *state = *state * 1664525u + 1013904223u;
    return *state >> 8;
}

/* One batch: init, apply every ubatch (the model step), release. */
static int decode_batch(rc_ctx* ctx, int32_t n_tokens, const int32_t* seq_ids, const int32_t* pos,
                        int32_t n_ubatch) {
    rc_batch* batch;
    rc_ubatch ub;
    void* s0;
    size_t row_bytes;
    int32_t g;
    int code = rc_tensor(ctx, rc_n_layer(ctx), &s0, &row_bytes);   /* s of layer 0 (f32) */
    if (code == RC_OK) {
        code = rc_batch_init(ctx, n_tokens, seq_ids, NULL, pos, NULL, n_ubatch, 0, &batch);
    }
    if (code != RC_OK) {
        return code;
    }
    while ((code = rc_batch_apply(batch, &ub)) == 1) {
        for (g = 0; g < ub.n_seqs; g++) {   /* group g's state is row head + g */
            float* row = (float*)((char*)s0 + (size_t)(ub.head + g) * row_bytes);
            row[0] += (float)ub.n_seq_tokens;
        }
    }
    rc_batch_release(batch);
    return code;
}

static int run_schedule(rc_ctx* ctx, int32_t n_seqs, int32_t n_steps, uint32_t seed, int32_t n_ubatch) {
    int32_t* seq_ids = malloc(sizeof(int32_t) * (size_t)n_seqs * MAX_PROMPT);
    int32_t* pos = malloc(sizeof(int32_t) * (size_t)n_seqs * MAX_PROMPT);
    uint32_t rng = seed, roll;
    int32_t step, seq, k, n_tokens, length, start;
    int code = RC_OK;
    if (seq_ids == NULL || pos == NULL) {
        code = RC_ERR_NO_MEMORY;
    }
    for (step = 0; code == RC_OK && step < n_steps; step++) {
        n_tokens = 0;
        for (seq = 0; seq < n_seqs; seq++) {
            roll = next_random(&rng) % 16;
            start = rc_seq_pos_max(ctx, seq) + 1;
            if (start > 0 && roll == 0) {
                rc_seq_rm(ctx, seq, -1, -1);                 /* the client finished */
                continue;
            }
            if (start > 0 && roll == 1) {
                rc_seq_cp(ctx, (int32_t)(next_random(&rng) % (uint32_t)n_seqs), seq);   /* a fork */
                continue;
            }
            length = start > 0 ? 1 : 1 + (int32_t)(next_random(&rng) % MAX_PROMPT);
            if (start == 0 && roll >= 8) {
                continue;                                    /* the slot stays free this step */
            }
            for (k = 0; k < length; k++) {
                seq_ids[n_tokens] = seq;
                pos[n_tokens] = start + k;
                n_tokens++;
            }
        }
        if (n_tokens > 0) {
            code = decode_batch(ctx, n_tokens, seq_ids, pos, n_ubatch);
        }
    }
    free(seq_ids);
    free(pos);
    return code;
}

/* n_steps decode steps of one token for sequences 0..n_seqs-1 (the benchmark kernel). */
static int run_decode_steps(rc_ctx* ctx, int32_t n_seqs, int32_t n_steps) {
    int32_t* seq_ids = malloc(sizeof(int32_t) * (size_t)n_seqs);
    int32_t* pos = malloc(sizeof(int32_t) * (size_t)n_seqs);
    rc_batch* batch;
    rc_ubatch ub;
    int32_t step, seq;
    int code = RC_OK;
    if (seq_ids == NULL || pos == NULL) {
        code = RC_ERR_NO_MEMORY;
    }
    for (step = 0; code == RC_OK && step < n_steps; step++) {
        for (seq = 0; seq < n_seqs; seq++) {
            seq_ids[seq] = seq;
            pos[seq] = rc_seq_pos_max(ctx, seq) + 1;
        }
        code = rc_batch_init(ctx, n_seqs, seq_ids, NULL, pos, NULL, 512, 0, &batch);
        if (code == RC_OK) {
            while ((code = rc_batch_apply(batch, &ub)) == 1) {
            }
            rc_batch_release(batch);
        }
    }
    free(seq_ids);
    free(pos);
    return code;
}

/* Free the context and return the code, or raise RuntimeError with the library's message. */
static PyObject* finish(rc_ctx* ctx, int code) {
    char message[512];
    if (code < 0) {
        rc_error_message(ctx, code, message, sizeof message);
        rc_ctx_free(ctx);
        PyErr_SetString(PyExc_RuntimeError, message);
        return NULL;
    }
    rc_ctx_free(ctx);
    return PyLong_FromLong(code);
}

static PyObject* continuous_batching(PyObject* self, PyObject* args) {
    PyObject* cache;
    int n_seqs, n_steps, n_ubatch = 16;
    unsigned int seed;
    rc_ctx* ctx;
    int code;
    (void)self;
    if (!PyArg_ParseTuple(args, "OiiI|i", &cache, &n_seqs, &n_steps, &seed, &n_ubatch)) {
        return NULL;
    }
    if ((ctx = rc_ctx_new(cache)) == NULL) {
        return NULL;
    }
    if (n_seqs < 1 || n_seqs > rc_size(ctx)) {
        PyErr_Format(PyExc_ValueError, "n_seqs must be in [1, %d], got %d", rc_size(ctx), n_seqs);
        rc_ctx_free(ctx);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    code = run_schedule(ctx, n_seqs, n_steps, seed, n_ubatch);
    Py_END_ALLOW_THREADS
    return finish(ctx, code);
}

static PyObject* decode_steps(PyObject* self, PyObject* args) {
    PyObject* cache;
    int n_seqs, n_steps;
    rc_ctx* ctx;
    int code;
    (void)self;
    if (!PyArg_ParseTuple(args, "Oii", &cache, &n_seqs, &n_steps)) {
        return NULL;
    }
    if ((ctx = rc_ctx_new(cache)) == NULL) {
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    code = run_decode_steps(ctx, n_seqs, n_steps);
    Py_END_ALLOW_THREADS
    return finish(ctx, code);
}

static PyMethodDef methods[] = {
    {"continuous_batching", continuous_batching, METH_VARARGS,
     "continuous_batching(cache, n_seqs, n_steps, seed, n_ubatch=16): the schedule, in C; 0 or RuntimeError"},
    {"decode_steps", decode_steps, METH_VARARGS,
     "decode_steps(cache, n_seqs, n_steps): one-token decode steps of sequences 0..n_seqs-1"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "continuous_batching_c", NULL, -1, methods};

PyMODINIT_FUNC PyInit_continuous_batching_c(void) {
    if (import_recurrent_cache() < 0) {   /* ImportError saying why (e.g. a version mismatch) */
        return NULL;
    }
    return PyModule_Create(&module);
}
