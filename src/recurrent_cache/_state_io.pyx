# cython: language_level=3
"""State serialisation loops: llama.cpp's recurrent ``state_write`` / ``state_read`` (docs/concepts.md §5).

Writing goes straight from the state tensors to the target, range by range
(runs of consecutive selected cells), with the GIL released for the row
copies.  Reading validates the whole blob first (``check_blob``) and only
then changes the cells and rows, so a rejected blob leaves the cache exactly
as it was.  Integers are little-endian on every host; rows are copied as
stored.  The loops only: ``_core`` calls them (state reads change the cache, so
they are the core's); ``blob_error`` turns a defect into its ``StateError``.
"""

from libc.stdint cimport INT32_MAX, uint8_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy, memset

from ._codes cimport RC_ERR_NO_MEMORY, RC_OK
from ._cells cimport cells_clear, cells_find_slot, cells_join, cells_new_epoch, cells_seq_rm

from .formats.messages import engine_error


# The compiled blob codes by the names of ``errors``' table (a test checks they agree).
CODES = {
    "BLOB_TRUNCATED": BLOB_ERR_TRUNCATED, "BLOB_TRAILING": BLOB_ERR_TRAILING,
    "BLOB_SEQ_CELL_COUNT": BLOB_ERR_SEQ_CELL_COUNT, "BLOB_CELL_COUNT": BLOB_ERR_CELL_COUNT,
    "BLOB_POSITION": BLOB_ERR_NEGATIVE_POS, "BLOB_SEQ_N_SEQ_ID": BLOB_ERR_SEQ_N_SEQ_ID,
    "BLOB_NO_SEQ_ID": BLOB_ERR_NO_SEQ_ID, "BLOB_N_SEQ_ID": BLOB_ERR_N_SEQ_ID,
    "BLOB_SEQ_ID_RANGE": BLOB_ERR_SEQ_ID_RANGE, "BLOB_SEQ_ID_REPEATED": BLOB_ERR_SEQ_ID_REPEATED,
    "BLOB_V_TRANS": BLOB_ERR_V_TRANS, "BLOB_N_LAYER": BLOB_ERR_N_LAYER, "BLOB_TYPE": BLOB_ERR_TYPE,
    "BLOB_ROW_BYTES": BLOB_ERR_ROW_BYTES,
}


# -- little-endian fields --------------------------------------------------------

cdef void put_u32(unsigned char* p, uint32_t v) noexcept nogil:
    p[0] = <uint8_t>v
    p[1] = <uint8_t>(v >> 8)
    p[2] = <uint8_t>(v >> 16)
    p[3] = <uint8_t>(v >> 24)


cdef void put_u64(unsigned char* p, uint64_t v) noexcept nogil:
    put_u32(p, <uint32_t>v)
    put_u32(p + 4, <uint32_t>(v >> 32))


cdef inline uint32_t get_u32(const unsigned char* p) noexcept nogil:
    return p[0] | (<uint32_t>p[1] << 8) | (<uint32_t>p[2] << 16) | (<uint32_t>p[3] << 24)


cdef inline int32_t get_i32(const unsigned char* p) noexcept nogil:
    return <int32_t>get_u32(p)


cdef inline uint64_t get_u64(const unsigned char* p) noexcept nogil:
    return get_u32(p) | (<uint64_t>get_u32(p + 4) << 32)


# -- writing ---------------------------------------------------------------------

cdef int32_t selected_ranges(const Cells* c, int32_t seq_id, int32_t* begin, int32_t* end) noexcept nogil:
    cdef int32_t cell, n = 0
    if seq_id >= 0:
        # a sequence is in at most one cell
        cell = c.tail[seq_id]
        if cell < 0:
            return 0
        begin[0] = cell
        end[0] = cell + 1
        return 1
    for cell in range(c.size):
        if c.n_seq[cell] == 0:
            continue
        if n > 0 and end[n - 1] == cell:
            end[n - 1] = cell + 1
        else:
            begin[n] = cell
            end[n] = cell + 1
            n += 1
    return n


cdef inline Py_ssize_t max_ranges(int32_t size) noexcept nogil:
    # runs of selected cells are separated by at least one other cell
    return (size + 1) // 2


cdef inline int32_t selected_count(const Cells* c, int32_t seq_id) noexcept nogil:
    if seq_id >= 0:
        return 1 if c.tail[seq_id] >= 0 else 0
    return c.used


cdef Py_ssize_t meta_size(const Cells* c, int32_t seq_id) noexcept nogil:
    cdef Py_ssize_t members = 0
    cdef int32_t seq
    if seq_id < 0:
        # every member of a non-empty cell is a seq id with a tail
        for seq in range(c.size):
            members += c.tail[seq] >= 0
    return 4 + 8 * <Py_ssize_t>selected_count(c, seq_id) + 4 * members


cdef Py_ssize_t blob_size(const Cells* c, int32_t seq_id, Py_ssize_t n_tensors,
                          const Py_ssize_t* row_bytes) noexcept nogil:
    cdef Py_ssize_t k, rows = 0
    for k in range(n_tensors):
        rows += row_bytes[k]
    return (meta_size(c, seq_id) + DATA_HEADER_BYTES + TENSOR_HEADER_BYTES * n_tensors
            + <Py_ssize_t>selected_count(c, seq_id) * rows)


cdef Py_ssize_t write_meta(const Cells* c, int32_t seq_id, unsigned char* out) noexcept nogil:
    cdef Py_ssize_t off = 4
    cdef Py_ssize_t* slot
    cdef int32_t cell, seq, count = 0
    if seq_id >= 0:
        cell = c.tail[seq_id]
        if cell >= 0:
            put_u32(out + 4, <uint32_t>c.pos[cell])
            put_u32(out + 8, 0)   # a sequence blob lists no seq ids
            off = 12
            count = 1
        put_u32(out, count)
        return off
    slot = <Py_ssize_t*>malloc(c.size * sizeof(Py_ssize_t))   # [size] by cell: where its next seq id goes
    if slot == NULL:
        return -1
    for cell in range(c.size):
        if c.n_seq[cell] == 0:
            continue
        put_u32(out + off, <uint32_t>c.pos[cell])
        put_u32(out + off + 4, <uint32_t>c.n_seq[cell])
        slot[cell] = off + 8
        off += 8 + 4 * <Py_ssize_t>c.n_seq[cell]
        count += 1
    # Visiting seq ids in ascending order fills each cell's list sorted, as
    # llama.cpp's std::set does, in O(size) instead of a sort per cell.
    for seq in range(c.size):
        cell = c.tail[seq]
        if cell >= 0:
            put_u32(out + slot[cell], <uint32_t>seq)
            slot[cell] += 4
    free(slot)
    put_u32(out, count)
    return off


# -- the one blob composer -------------------------------------------------------------------

cdef int blob_compose(BlobPieces* b, const BlobSource* src, int32_t seq_id) noexcept nogil:
    """The pieces of ``state_write(seq_id)``: its headers composed, its rows as ranges of the
    tensors.  A layer filter (llama.cpp's null layers) writes the model's n_layer but sections
    of the layers with state only."""
    cdef const Cells* c = src.cells
    cdef Py_ssize_t k, n_meta = meta_size(c, seq_id), at
    memset(b, 0, sizeof(BlobPieces))
    b.src = src
    b.size = blob_size(c, seq_id, src.n_tensors, src.row_bytes)
    b.head_bytes = n_meta + DATA_HEADER_BYTES
    b.head = <unsigned char*>malloc(b.head_bytes + TENSOR_HEADER_BYTES * src.n_tensors)
    b.begin = <int32_t*>malloc(2 * max_ranges(c.size) * sizeof(int32_t))
    if b.head == NULL or b.begin == NULL or write_meta(c, seq_id, b.head) < 0:
        blob_release(b)
        return RC_ERR_NO_MEMORY
    b.end = b.begin + max_ranges(c.size)
    b.n_ranges = selected_ranges(c, seq_id, b.begin, b.end)
    put_u32(b.head + n_meta, 0)                          # v_trans
    put_u32(b.head + n_meta + 4, <uint32_t>src.n_layer)
    for k in range(src.n_tensors):
        at = b.head_bytes + TENSOR_HEADER_BYTES * k
        put_u32(b.head + at, <uint32_t>src.type_ids[k])
        put_u64(b.head + at + 4, <uint64_t>src.row_bytes[k])
    b.n_pieces = 1 + src.n_tensors * (1 + <Py_ssize_t>b.n_ranges)
    return RC_OK


cdef void blob_release(BlobPieces* b) noexcept nogil:
    free(b.head)
    free(b.begin)
    b.head = NULL
    b.begin = NULL
    b.n_pieces = 0


cdef Py_ssize_t blob_piece(const BlobPieces* b, Py_ssize_t i, const unsigned char** p) noexcept nogil:
    """Piece i of the blob, in order: the meta and data header, then per tensor its header and
    its rows range by range; its start in *p, its length returned."""
    cdef Py_ssize_t k, r, row
    if i == 0:
        p[0] = b.head
        return b.head_bytes
    k = (i - 1) // (1 + b.n_ranges)
    r = (i - 1) % (1 + b.n_ranges)
    if r == 0:
        p[0] = b.head + b.head_bytes + TENSOR_HEADER_BYTES * k
        return TENSOR_HEADER_BYTES
    row = b.src.row_bytes[k]
    p[0] = <const unsigned char*>b.src.tensor_data[k] + b.begin[r - 1] * row
    return (b.end[r - 1] - b.begin[r - 1]) * row


cdef Py_ssize_t blob_copy(const BlobPieces* b, unsigned char* out) noexcept nogil:
    """Every piece to out (room for b.size bytes); returns the bytes written."""
    cdef Py_ssize_t i, n, off = 0
    cdef const unsigned char* p
    for i in range(b.n_pieces):
        n = blob_piece(b, i, &p)
        memcpy(out + off, p, n)
        off += n
    return off


# -- reading ---------------------------------------------------------------------

cdef inline bint fits(BlobDefect* d, BlobField field, Py_ssize_t off, Py_ssize_t need,
                      Py_ssize_t length) noexcept nogil:
    """Whether need bytes remain at off; if not, record the truncation."""
    if length - off >= need:
        return True
    d.field = field
    d.offset = off
    d.need = need
    return False


cdef int check_blob(Cells* c, int32_t seq_id, const unsigned char* data, Py_ssize_t length,
                    int32_t n_layer, Py_ssize_t n_tensors, const int32_t* type_ids, const Py_ssize_t* row_bytes,
                    BlobLayout* layout, BlobDefect* d) noexcept nogil:
    # The same checks in the same order as recurrent_cache.formats.blob.parse_blob.
    cdef Py_ssize_t off = 4, k, rows
    cdef uint32_t cell_count, n_seq_id, j, i
    cdef int32_t pos, seq
    memset(d, 0, sizeof(BlobDefect))
    if not fits(d, FIELD_CELL_COUNT, 0, 4, length):
        return BLOB_ERR_TRUNCATED
    cell_count = get_u32(data)
    d.value = cell_count
    if seq_id >= 0 and cell_count > 1:
        return BLOB_ERR_SEQ_CELL_COUNT
    if seq_id < 0 and cell_count > <uint32_t>c.size:
        return BLOB_ERR_CELL_COUNT
    layout.cell_count = <int32_t>cell_count   # <= size from here on
    layout.first_pos = -1
    cells_new_epoch(c)   # stamp[seq] == epoch: seq listed by cell scratch[seq]
    for i in range(cell_count):
        d.cell = i
        if not fits(d, FIELD_CELL, off, 8, length):
            return BLOB_ERR_TRUNCATED
        pos = get_i32(data + off)
        n_seq_id = get_u32(data + off + 4)
        if pos < 0 or pos == INT32_MAX:   # 2**31 - 1 means "to the end" in ranges
            d.offset = off
            d.value = <uint32_t>pos
            return BLOB_ERR_NEGATIVE_POS
        if i == 0:
            layout.first_pos = pos
        d.offset = off + 4
        d.value = n_seq_id
        if seq_id >= 0 and n_seq_id != 0:
            return BLOB_ERR_SEQ_N_SEQ_ID
        if seq_id < 0 and n_seq_id == 0:
            return BLOB_ERR_NO_SEQ_ID
        if n_seq_id > <uint32_t>c.size:
            return BLOB_ERR_N_SEQ_ID
        off += 8
        if not fits(d, FIELD_SEQ_IDS, off, 4 * <Py_ssize_t>n_seq_id, length):
            return BLOB_ERR_TRUNCATED
        for j in range(n_seq_id):
            seq = get_i32(data + off)
            d.offset = off
            d.value = <uint32_t>seq
            if not 0 <= seq < c.size:
                return BLOB_ERR_SEQ_ID_RANGE
            if c.stamp[seq] == c.stamp_epoch:
                d.other = c.scratch[seq]
                return BLOB_ERR_SEQ_ID_REPEATED
            c.stamp[seq] = c.stamp_epoch
            c.scratch[seq] = <int32_t>i
            off += 4
    layout.data_offset = off
    d.cell = 0
    if not fits(d, FIELD_DATA_HEADER, off, DATA_HEADER_BYTES, length):
        return BLOB_ERR_TRUNCATED
    d.offset = off
    d.value = get_u32(data + off)
    if d.value != 0:
        return BLOB_ERR_V_TRANS
    d.offset = off + 4
    d.value = get_u32(data + off + 4)
    if d.value != <uint64_t>n_layer:
        return BLOB_ERR_N_LAYER
    off += DATA_HEADER_BYTES
    for k in range(n_tensors):
        d.index = k
        if not fits(d, FIELD_TENSOR_HEADER, off, TENSOR_HEADER_BYTES, length):
            return BLOB_ERR_TRUNCATED
        d.offset = off
        d.value = get_u32(data + off)
        if get_i32(data + off) != type_ids[k]:
            return BLOB_ERR_TYPE
        d.offset = off + 4
        d.value = get_u64(data + off + 4)
        if d.value != <uint64_t>row_bytes[k]:
            return BLOB_ERR_ROW_BYTES
        off += TENSOR_HEADER_BYTES
        rows = cell_count * row_bytes[k]   # no overflow: at most the tensor's own size
        if not fits(d, FIELD_ROWS, off, rows, length):
            return BLOB_ERR_TRUNCATED
        off += rows
    if off != length:
        d.offset = off
        return BLOB_ERR_TRAILING
    return BLOB_OK


cdef void read_rows(const unsigned char* data, Py_ssize_t data_offset, int32_t head, int32_t count,
                    int32_t zero_from, int32_t size, Py_ssize_t n_tensors, char** tensor_data,
                    const Py_ssize_t* row_bytes) noexcept nogil:
    """Copy each tensor section of a checked blob to rows head.., then zero rows zero_from..size-1."""
    cdef Py_ssize_t k, off = data_offset + DATA_HEADER_BYTES, n
    for k in range(n_tensors):
        off += TENSOR_HEADER_BYTES
        n = count * row_bytes[k]
        memcpy(tensor_data[k] + head * row_bytes[k], data + off, n)
        off += n
        if zero_from < size:
            memset(tensor_data[k] + zero_from * row_bytes[k], 0, (size - zero_from) * row_bytes[k])


cdef int restore_blob(Cells* c, const unsigned char* data, const BlobLayout* layout, int32_t seq_id,
                      Py_ssize_t n_tensors, char** tensor_data, const Py_ssize_t* row_bytes) noexcept nogil:
    """Restore a blob check_blob accepted: the whole cache (seq_id < 0) or one sequence."""
    cdef Py_ssize_t off = 4
    cdef uint32_t j, n_seq_id
    cdef int32_t i, seq_offset = 0, n_one = 1
    cdef int code
    if seq_id < 0:
        # cell i of the blob becomes cell i with its own row (src = i); the rest is cleared
        cells_clear(c)
        for i in range(layout.cell_count):
            n_seq_id = get_u32(data + off + 4)
            for j in range(n_seq_id):
                cells_join(c, i, get_i32(data + off + 8 + 4 * j))
            c.pos[i] = get_i32(data + off)
            c.src[i] = i
            off += 8 + 4 * n_seq_id
        read_rows(data, layout.data_offset, 0, layout.cell_count, layout.cell_count, c.size,
                  n_tensors, tensor_data, row_bytes)
        return RC_OK
    # remove the sequence, then place its one cell with find_slot and fill its row
    cells_seq_rm(c, seq_id, -1, -1)
    if layout.cell_count == 0:
        return RC_OK
    # The sequence is in no cell now, so at most size - 1 cells are taken
    # and find_slot always finds one: it cannot fail after the removal.
    code = cells_find_slot(c, 1, 1, &seq_id, &seq_offset, &n_one, &layout.first_pos)
    if code != RC_OK:
        return code
    c.src[c.head] = c.head
    read_rows(data, layout.data_offset, c.head, 1, c.size, c.size, n_tensors, tensor_data, row_bytes)
    return RC_OK




cdef object blob_error(int code, const BlobDefect* d, Py_ssize_t length, tuple layers, int32_t n_layer,
                       const int32_t* type_ids, const Py_ssize_t* row_bytes, int32_t size):
    cdef Py_ssize_t k = d.index
    signed = code in (BLOB_ERR_NEGATIVE_POS, BLOB_ERR_SEQ_ID_RANGE, BLOB_ERR_SEQ_ID_REPEATED, BLOB_ERR_TYPE)
    expected = None
    if code == BLOB_ERR_TYPE:
        expected = type_ids[k]
    elif code == BLOB_ERR_ROW_BYTES:
        expected = row_bytes[k]
    field = {FIELD_CELL_COUNT: "cell_count", FIELD_CELL: "cell", FIELD_SEQ_IDS: "seq_ids",
             FIELD_DATA_HEADER: "data_header", FIELD_TENSOR_HEADER: "tensor_header",
             FIELD_ROWS: "rows"}.get(d.field, "")
    value = d.value
    if signed:
        value = int(<int32_t><uint32_t>d.value)
    # section k of the blob is r or s of the k-th layer with state: messages name the model's layer
    n_state = len(layers)
    layer_index = k
    if 0 <= k < 2 * n_state:
        layer_index = layers[k] if k < n_state else n_layer + layers[k - n_state]
    return engine_error(code, field=field, offset=d.offset, need=d.need, length=length, cell=d.cell,
                        index=layer_index, other=d.other, value=value, size=size, n_layer=n_layer,
                        expected=expected)
