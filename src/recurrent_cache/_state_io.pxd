# cython: language_level=3
"""C-level API of state serialisation (docs/concepts.md §5, llama.cpp's recurrent state_write / state_read).

The helpers are ``noexcept nogil``: a blob defect is reported as a
``BLOB_ERR_*`` code plus a ``BlobDefect`` saying where, and
``blob_error`` below is the one place that turns them into
``StateError`` messages (worded in ``recurrent_cache.formats.messages``).
"""

from libc.stdint cimport int32_t, int64_t, uint32_t, uint64_t

from ._cells cimport Cells

from ._codes cimport (BLOB_OK, BLOB_ERR_TRUNCATED, BLOB_ERR_TRAILING, BLOB_ERR_SEQ_CELL_COUNT, BLOB_ERR_CELL_COUNT,
                      BLOB_ERR_NEGATIVE_POS, BLOB_ERR_SEQ_N_SEQ_ID, BLOB_ERR_NO_SEQ_ID, BLOB_ERR_N_SEQ_ID,
                      BLOB_ERR_SEQ_ID_RANGE, BLOB_ERR_SEQ_ID_REPEATED, BLOB_ERR_V_TRANS, BLOB_ERR_N_LAYER,
                      BLOB_ERR_TYPE, BLOB_ERR_ROW_BYTES)

cdef enum:                           # the blob's fixed headers (docs/concepts.md §5)
    DATA_HEADER_BYTES = 8            # u32 v_trans, u32 n_layer
    TENSOR_HEADER_BYTES = 12         # i32 type, u64 row_bytes

cdef enum BlobField:                 # what a truncated read was after
    FIELD_CELL_COUNT
    FIELD_CELL                       # pos and n_seq_id of cell `cell`
    FIELD_SEQ_IDS                    # the seq ids of cell `cell`
    FIELD_DATA_HEADER                # v_trans and n_layer
    FIELD_TENSOR_HEADER              # type and row size of tensor `index`
    FIELD_ROWS                       # rows of tensor `index`

cdef struct BlobDefect:
    BlobField field
    Py_ssize_t offset                # byte offset of the defective field in the blob
    Py_ssize_t need                  # bytes the field needs (truncation)
    int64_t cell
    int64_t index                    # tensor index (r of layers 0.., then s)
    int64_t other
    uint64_t value                   # the value found, zero-extended

cdef struct BlobLayout:              # what a valid blob holds, for the restore
    int32_t cell_count
    Py_ssize_t data_offset           # where v_trans is, right after the meta
    int32_t first_pos                # pos of cell 0 (a sequence blob's one cell)

# cells of state_write(seq_id) as runs [begin[i], end[i]) in index order; returns the
# number of runs (begin / end need room for (size + 1) // 2 runs)
cdef int32_t selected_ranges(const Cells* c, int32_t seq_id, int32_t* begin, int32_t* end) noexcept nogil

# bytes of state_write(seq_id): the meta alone, and the whole blob
cdef Py_ssize_t meta_size(const Cells* c, int32_t seq_id) noexcept nogil
cdef Py_ssize_t blob_size(const Cells* c, int32_t seq_id, Py_ssize_t n_tensors,
                          const Py_ssize_t* row_bytes) noexcept nogil

# write cell_count and the meta (seq ids sorted) to out[0:meta_size]; -1 when out of memory
cdef Py_ssize_t write_meta(const Cells* c, int32_t seq_id, unsigned char* out) noexcept nogil

# the one blob composer (MemoryCore.write, state_write_file and rc_state_write all use it): a
# blob is its pieces, in order — the meta with v_trans and n_layer (the model's layers), then per
# tensor (r then s of the layers with state) its header and its rows, one piece per range
cdef struct BlobSource:              # what a blob is written from (the memory core's fields)
    const Cells* cells
    int32_t n_layer
    Py_ssize_t n_tensors
    char** tensor_data
    const Py_ssize_t* row_bytes
    const int32_t* type_ids

cdef struct BlobPieces:
    const BlobSource* src
    Py_ssize_t size                  # bytes of the whole blob
    Py_ssize_t n_pieces
    unsigned char* head              # the meta and data header (head_bytes), then every tensor header
    Py_ssize_t head_bytes
    int32_t n_ranges                 # the selected cells as runs [begin[i], end[i])
    int32_t* begin
    int32_t* end

# compose state_write(seq_id) of src (whose cells and rows must not change until it is released):
# RC_OK, or RC_ERR_NO_MEMORY with nothing to release
cdef int blob_compose(BlobPieces* b, const BlobSource* src, int32_t seq_id) noexcept nogil
cdef void blob_release(BlobPieces* b) noexcept nogil
cdef Py_ssize_t blob_piece(const BlobPieces* b, Py_ssize_t i, const unsigned char** p) noexcept nogil
cdef Py_ssize_t blob_copy(const BlobPieces* b, unsigned char* out) noexcept nogil

# rows of a checked blob to rows head.. of each tensor, then zero rows zero_from..size-1
cdef void read_rows(const unsigned char* data, Py_ssize_t data_offset, int32_t head, int32_t count,
                    int32_t zero_from, int32_t size, Py_ssize_t n_tensors, char** tensor_data,
                    const Py_ssize_t* row_bytes) noexcept nogil

# restore a blob check_blob accepted (seq_id -1: the whole cache); RC_OK, or find_slot's code
cdef int restore_blob(Cells* c, const unsigned char* data, const BlobLayout* layout, int32_t seq_id,
                      Py_ssize_t n_tensors, char** tensor_data, const Py_ssize_t* row_bytes) noexcept nogil

# validate a whole blob against the cache (n_layer: the model's layers; n_tensors sections: r then
# s of the layers with state); nothing but the seq-id stamps is written
cdef int check_blob(Cells* c, int32_t seq_id, const unsigned char* data, Py_ssize_t length,
                    int32_t n_layer, Py_ssize_t n_tensors, const int32_t* type_ids, const Py_ssize_t* row_bytes,
                    BlobLayout* layout, BlobDefect* defect) noexcept nogil


# the StateError for a check_blob code and its defect, from the one table (``errors.engine_error``);
# layers: the model's layers with state (section k of the blob is r or s of the k-th of them)
cdef object blob_error(int code, const BlobDefect* d, Py_ssize_t length, tuple layers, int32_t n_layer,
                       const int32_t* type_ids, const Py_ssize_t* row_bytes, int32_t size)

# little-endian fields of the format
cdef void put_u32(unsigned char* p, uint32_t v) noexcept nogil
cdef void put_u64(unsigned char* p, uint64_t v) noexcept nogil
