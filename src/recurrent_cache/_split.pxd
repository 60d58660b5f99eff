# cython: language_level=3
"""C-level API of batch validation and splitting (llama.cpp's llama_sbatch)."""

from libc.stdint cimport int8_t, int32_t, int64_t, uint8_t

from ._cells cimport Cells

from ._codes cimport (SPLIT_OK, SPLIT_ERR_SEQ_RANGE, SPLIT_ERR_NEGATIVE_POS, SPLIT_ERR_GAP, SPLIT_ERR_CONTINUE,
                      SPLIT_ERR_FIND_SLOT, SPLIT_ERR_NO_MEMORY, SPLIT_ERR_POS_MAX)

cdef struct SplitDetail:
    int32_t token
    int32_t seq
    int32_t pos
    int32_t prev
    int32_t n

cdef struct Split:
    int32_t n_tokens
    int32_t n_ubatches
    int32_t n_outputs
    int32_t* order            # [n_tokens] batch index of each token, in ubatch order
    uint8_t* output           # [n_tokens] output flag, in ubatch order
    int64_t* out_ids          # [n_outputs] batch index of each output row
    int32_t* ub_token_start   # [n_ubatches + 1] first entry of each ubatch in order
    int32_t* ub_group_start   # [n_ubatches + 1] first group of each ubatch
    int32_t* ub_n_seq_tokens  # [n_ubatches]
    int32_t* group_seq_offset # [n_groups] where the group's seq-id list starts in seq_id_flat
    int32_t* group_n_seq_id   # [n_groups]
    int32_t* group_last_pos   # [n_groups] position of the group's last token

cdef int split_alloc(Split* split, int32_t n_tokens) noexcept nogil  # arrays for n_tokens tokens
cdef void split_release(Split* split) noexcept nogil

# Validate a batch against the cells and split it; positions must be resolved.
cdef int split_batch(Split* split, Cells* cells, int32_t n_tokens,
                     const int32_t* seq_id_flat, const int32_t* seq_id_offset,
                     const int32_t* pos, const int8_t* logits, bint logits_all,
                     int32_t n_ubatch, bint embd_pooled, SplitDetail* detail) noexcept nogil

# Place every ubatch of a split on a journal of the cells, then roll it all back: RC_OK means
# applying the ubatches in order cannot fail; otherwise the first RC_ERR_* code. Cells unchanged.
cdef int split_prepare(const Split* split, Cells* cells, const int32_t* seq_id_flat) noexcept nogil

# Every ubatch's tokens as an attention KV table takes them (each token listing its group's seq ids), from
# the batch's positions and seq ids (batch order): split_token_entries() is the length of flat;
# split_token_arrays fills bounds[n_ubatches + 1] (ubatch u's tokens are [bounds[u], bounds[u + 1])),
# pos[n_tokens], offsets[n_tokens + 1] (token t's seq ids are flat[offsets[t]:offsets[t + 1]]) and flat,
# tokens in ubatch order.
cdef int64_t split_token_entries(const Split* split) noexcept nogil
cdef void split_token_arrays(const Split* split, const int32_t* positions, const int32_t* seq_ids, int32_t* bounds,
                             int32_t* pos, int32_t* offsets, int32_t* flat) noexcept nogil
