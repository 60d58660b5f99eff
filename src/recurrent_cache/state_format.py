"""The state blob format of SPEC.md §5 (llama.cpp's recurrent ``state_write``), in pure Python.

A blob is, all integers little-endian::

    u32 cell_count
    cell_count x { i32 pos; u32 n_seq_id; n_seq_id x i32 seq_id }   # meta
    u32 v_trans (= 0); u32 n_layer
    n_layer x { i32 r_type; u64 r_row_bytes; cell_count rows of r }
    n_layer x { i32 s_type; u64 s_row_bytes; cell_count rows of s }

:func:`parse_blob` reads one into a :class:`Blob` without a cache (for
``inspect``) or checks it against a cache's :class:`CacheShape` in the order
the compiled core does, so both implementations report the same defect with
the same message.  The message builders below are the only wording of those
defects; the core maps its error codes onto them.
"""

from __future__ import annotations

import io
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import ArgumentError, StateError

__all__ = [
    "GGML_TYPES", "SEQ_FILE_MAGIC", "SEQ_FILE_VERSION", "Blob", "BlobCell", "BlobTensor",
    "CacheShape", "parse_blob", "parse_seq_file_header", "blob_view", "target_view",
    "target_too_small", "read_rest", "write_all",
]

# ggml type id -> (name, element size); the state types this package stores
GGML_TYPES = {0: ("f32", 4), 1: ("f16", 2), 30: ("bf16", 2)}

SEQ_FILE_MAGIC = 0x67677371   # 'ggsq', llama.cpp's LLAMA_STATE_SEQ_MAGIC
SEQ_FILE_VERSION = 2          # llama.cpp's LLAMA_STATE_SEQ_VERSION

_U32 = struct.Struct("<I")
_I32 = struct.Struct("<i")
_U64 = struct.Struct("<Q")
_CELL = struct.Struct("<iI")            # pos, n_seq_id
_DATA_HEADER = struct.Struct("<II")     # v_trans, n_layer
_TENSOR_HEADER = struct.Struct("<iQ")   # type, row_bytes


# -- the defects, worded once --------------------------------------------------

def tensor_name(k: int, n_layer: int) -> str:
    """Tensor ``k`` of a blob: r of layers 0..n_layer-1, then s of the same layers."""
    return f"layer {k} r" if k < n_layer else f"layer {k - n_layer} s"


def field_name(field: str, cell: int = 0, tensor: int = 0, n_layer: int = 0) -> str:
    """How a truncation message names the field that did not fit."""
    if field == "cell_count":
        return "cell_count"
    if field == "cell":
        return f"cell {cell} pos and n_seq_id"
    if field == "seq_ids":
        return f"cell {cell} seq ids"
    if field == "data_header":
        return "v_trans and n_layer"
    if field == "tensor_header":
        return f"{tensor_name(tensor, n_layer)} type and row size"
    return f"{tensor_name(tensor, n_layer)} rows"


def type_name(type_id: int) -> str:
    return GGML_TYPES[type_id][0] if type_id in GGML_TYPES else "unknown type"


def truncated(field: str, offset: int, need: int, length: int) -> StateError:
    return StateError(f"state blob truncated at byte {offset} of {length}: "
                      f"{field} needs {need} bytes, {length - offset} left")


def trailing(end: int, length: int) -> StateError:
    return StateError(f"state blob has {length - end} trailing bytes after byte {end} "
                      f"(blob length {length}, expected {end})")


def sequence_cell_count(count: int) -> StateError:
    return StateError(f"sequence state blob has {count} cells at byte 0 "
                      f"(a sequence state is one cell, expected 0 or 1)")


def cell_count_too_large(count: int, size: int) -> StateError:
    return StateError(f"state blob has {count} cells at byte 0, more than the cache's {size}")


def negative_pos(cell: int, offset: int, pos: int) -> StateError:
    return StateError(f"state blob cell {cell} has pos {pos} at byte {offset}: "
                      f"positions must be in [0, 2**31 - 1)")


def sequence_n_seq_id(cell: int, offset: int, n_seq_id: int) -> StateError:
    return StateError(f"sequence state blob cell {cell} has n_seq_id {n_seq_id} at byte {offset} "
                      f"(must be 0)")


def no_seq_id(cell: int, offset: int) -> StateError:
    return StateError(f"state blob cell {cell} has no seq id (n_seq_id 0 at byte {offset}, "
                      f"a whole-cache blob lists only non-empty cells)")


def n_seq_id_too_large(cell: int, offset: int, n_seq_id: int, size: int) -> StateError:
    return StateError(f"state blob cell {cell} has n_seq_id {n_seq_id} at byte {offset}, "
                      f"more than the cache's {size} sequences")


def seq_id_out_of_range(cell: int, offset: int, seq_id: int, size: int) -> StateError:
    return StateError(f"state blob cell {cell} has seq_id {seq_id} at byte {offset}, "
                      f"out of range [0, {size})")


def seq_id_repeated(cell: int, offset: int, seq_id: int, first_cell: int) -> StateError:
    return StateError(f"state blob cell {cell} lists seq_id {seq_id} at byte {offset}, "
                      f"already listed by cell {first_cell}")


def v_trans_set(offset: int, v_trans: int) -> StateError:
    return StateError(f"state blob v_trans is {v_trans} at byte {offset}, expected 0 "
                      f"(transposed state rows are not supported)")


def n_layer_mismatch(offset: int, got: int, expected: int) -> StateError:
    return StateError(f"state blob has n_layer {got} at byte {offset}, the cache has {expected}")


def type_mismatch(tensor: str, offset: int, got: int, expected: int) -> StateError:
    return StateError(f"state blob {tensor} type {got} ({type_name(got)}) at byte {offset} != "
                      f"the cache's {expected} ({type_name(expected)}) (a read does not convert types)")


def row_bytes_mismatch(tensor: str, offset: int, got: int, expected: int) -> StateError:
    return StateError(f"state blob {tensor} row size {got} at byte {offset} != the cache's {expected}")


# -- the parsed form -----------------------------------------------------------

@dataclass(frozen=True)
class CacheShape:
    """What a blob must match to be read into a cache."""

    size: int
    n_layer: int
    type_ids: tuple[int, ...]    # [2*n_layer] r of every layer, then s
    row_bytes: tuple[int, ...]   # [2*n_layer]


@dataclass(frozen=True)
class BlobCell:
    pos: int
    seq_ids: tuple[int, ...]     # empty in a single-sequence blob


@dataclass(frozen=True)
class BlobTensor:
    """One tensor section: ``cell_count`` rows of ``row_bytes`` bytes at ``offset``."""

    name: str                    # "r" or "s"
    layer: int
    type_id: int
    row_bytes: int
    offset: int                  # where the rows start in the blob

    @property
    def type_name(self) -> str:
        return type_name(self.type_id)

    @property
    def n_embd(self) -> int | None:
        """Elements per row, when the type is one of GGML_TYPES and divides the row."""
        if self.type_id not in GGML_TYPES or self.row_bytes % GGML_TYPES[self.type_id][1]:
            return None
        return self.row_bytes // GGML_TYPES[self.type_id][1]


@dataclass(frozen=True)
class Blob:
    cells: tuple[BlobCell, ...]
    n_layer: int
    tensors: tuple[BlobTensor, ...]   # [2*n_layer] r of every layer, then s
    n_bytes: int

    @property
    def cell_count(self) -> int:
        return len(self.cells)

    @property
    def kind(self) -> str:
        """"single-sequence", "whole-cache", "empty" (0 cells: either) or "mixed" (neither)."""
        if not self.cells:
            return "empty"
        if all(not cell.seq_ids for cell in self.cells):
            return "single-sequence" if len(self.cells) == 1 else "mixed"
        return "whole-cache" if all(cell.seq_ids for cell in self.cells) else "mixed"

    def rows(self, data: Any, tensor: BlobTensor) -> np.ndarray:
        """The raw rows of one tensor section: a read-only (cell_count, row_bytes) uint8 view."""
        count = self.cell_count * tensor.row_bytes
        return np.frombuffer(blob_view(data), dtype=np.uint8, count=count,
                             offset=tensor.offset).reshape(self.cell_count, tensor.row_bytes)


class _Reader:
    """A cursor over the blob that raises ``truncated`` for a field that does not fit."""

    def __init__(self, data: memoryview) -> None:
        self.data = data
        self.offset = 0

    def need(self, n: int, field: str) -> int:
        """Reserve n bytes for ``field``; return where they start."""
        start = self.offset
        if len(self.data) - start < n:
            raise truncated(field, start, n, len(self.data))
        self.offset += n
        return start

    def unpack(self, layout: struct.Struct, field: str) -> tuple[Any, ...]:
        return layout.unpack_from(self.data, self.need(layout.size, field))


def parse_blob(data: Any, cache: CacheShape | None = None, seq_id: int = -1) -> Blob:
    """Parse a state blob, raising ``StateError`` at its first defect.

    Without ``cache`` only the structure is checked (lengths, ``v_trans == 0``,
    no trailing bytes).  With it, every rule of SPEC §5 for reading the blob
    into that cache at ``seq_id`` is checked too, in blob order: a sequence
    blob (``seq_id >= 0``) has at most one cell and no seq ids; a whole-cache
    blob (``seq_id == -1``) has at most ``size`` cells, each with at least one
    seq id in ``[0, size)``, no seq id twice; no cell has a negative pos; the
    layer count, types and row sizes are the cache's.
    """
    reader = _Reader(blob_view(data))
    (cell_count,) = reader.unpack(_U32, field_name("cell_count"))
    if cache is not None:
        if seq_id >= 0 and cell_count > 1:
            raise sequence_cell_count(cell_count)
        if seq_id < 0 and cell_count > cache.size:
            raise cell_count_too_large(cell_count, cache.size)
    cells = []
    first_cell: dict[int, int] = {}   # seq id -> the cell that listed it
    for i in range(cell_count):
        pos_at = reader.offset
        pos, n_seq_id = reader.unpack(_CELL, field_name("cell", cell=i))
        n_seq_id_at = pos_at + 4
        if cache is not None:
            if not 0 <= pos < 2**31 - 1:   # 2**31 - 1 means "to the end" in ranges
                raise negative_pos(i, pos_at, pos)
            if seq_id >= 0 and n_seq_id != 0:
                raise sequence_n_seq_id(i, n_seq_id_at, n_seq_id)
            if seq_id < 0 and n_seq_id == 0:
                raise no_seq_id(i, n_seq_id_at)
            if n_seq_id > cache.size:
                raise n_seq_id_too_large(i, n_seq_id_at, n_seq_id, cache.size)
        ids_at = reader.need(4 * n_seq_id, field_name("seq_ids", cell=i))
        ids = struct.unpack_from(f"<{n_seq_id}i", reader.data, ids_at)
        if cache is not None:
            for j, seq in enumerate(ids):
                if not 0 <= seq < cache.size:
                    raise seq_id_out_of_range(i, ids_at + 4 * j, seq, cache.size)
                if seq in first_cell:
                    raise seq_id_repeated(i, ids_at + 4 * j, seq, first_cell[seq])
                first_cell[seq] = i
        cells.append(BlobCell(pos, ids))
    data_at = reader.offset
    v_trans, n_layer = reader.unpack(_DATA_HEADER, field_name("data_header"))
    if v_trans != 0:
        raise v_trans_set(data_at, v_trans)
    if cache is not None and n_layer != cache.n_layer:
        raise n_layer_mismatch(data_at + 4, n_layer, cache.n_layer)
    tensors = []
    for k in range(2 * n_layer):
        name = tensor_name(k, n_layer)
        header_at = reader.offset
        type_id, row_bytes = reader.unpack(_TENSOR_HEADER,
                                           field_name("tensor_header", tensor=k, n_layer=n_layer))
        if cache is not None:
            if type_id != cache.type_ids[k]:
                raise type_mismatch(name, header_at, type_id, cache.type_ids[k])
            if row_bytes != cache.row_bytes[k]:
                raise row_bytes_mismatch(name, header_at + 4, row_bytes, cache.row_bytes[k])
        rows_at = reader.need(cell_count * row_bytes, field_name("rows", tensor=k, n_layer=n_layer))
        tensors.append(BlobTensor("r" if k < n_layer else "s", k % n_layer, type_id, row_bytes, rows_at))
    if reader.offset != len(reader.data):
        raise trailing(reader.offset, len(reader.data))
    return Blob(tuple(cells), n_layer, tuple(tensors), reader.offset)


# -- buffers and files ---------------------------------------------------------

def _byte_view(obj: Any) -> memoryview:
    """A flat unsigned-byte view of a C-contiguous buffer (numpy arrays of any dtype too)."""
    if isinstance(obj, np.ndarray):
        if not obj.flags.c_contiguous:
            raise ArgumentError("the array must be C-contiguous")
        # a custom dtype (bfloat16) cannot export a buffer itself, its bytes can
        obj = obj.reshape(-1).view(np.uint8)
    view = memoryview(obj)
    if not view.c_contiguous:
        raise ArgumentError("the buffer must be C-contiguous")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def blob_view(data: Any) -> memoryview:
    """The bytes of a blob given as any bytes-like object."""
    try:
        return _byte_view(data)
    except TypeError:
        raise ArgumentError(f"a state blob must be a bytes-like object, got {type(data).__name__}") from None


def target_view(target: Any) -> memoryview | None:
    """A writable byte view of ``target``, or None when it is not a buffer (a file, then)."""
    if isinstance(target, io.TextIOBase):
        raise ArgumentError("state_write_into: the target is a text file; open it in binary mode")
    try:
        view = _byte_view(target)
    except TypeError:
        if callable(getattr(target, "write", None)):
            return None
        raise ArgumentError(f"state_write_into: the target must be a writable buffer or a binary "
                            f"file, got {type(target).__name__}") from None
    if view.readonly:
        raise ArgumentError(f"state_write_into: the target ({type(target).__name__}) is read-only")
    return view


def target_too_small(available: int, needed: int) -> ArgumentError:
    return ArgumentError(f"state_write_into: the target has {available} bytes, the blob needs {needed}")


def read_rest(file: Any) -> Any:
    """Everything from a binary file's position to its end (the blob of ``state_read_from``)."""
    if isinstance(file, io.TextIOBase):
        raise ArgumentError("state_read_from: the file is a text file; open it in binary mode")
    if not callable(getattr(file, "read", None)):
        raise ArgumentError(f"state_read_from takes a binary file, got {type(file).__name__}")
    return file.read()


def write_all(file: Any, chunk: Any) -> None:
    """Write every byte of chunk (raw files may write less than asked)."""
    view = memoryview(chunk)
    while len(view):
        written = file.write(view)
        if written is None:   # a non-blocking raw file that would block
            raise BlockingIOError("state_write_into: the file would block")
        if written >= len(view):
            return
        view = view[written:]


def parse_seq_file_header(data: Any) -> tuple[np.ndarray, int]:
    """The tokens of a 'ggsq' sequence file and the offset where its state blob starts."""
    view = blob_view(data)
    if len(view) < 12:
        raise StateError(f"sequence file truncated: {len(view)} bytes, the header needs 12")
    magic, version, n_tokens = struct.unpack_from("<III", view, 0)
    if magic != SEQ_FILE_MAGIC:
        raise StateError(f"not a sequence file: magic 0x{magic:08x} at byte 0, "
                         f"expected 0x{SEQ_FILE_MAGIC:08x} ('ggsq')")
    if version != SEQ_FILE_VERSION:
        raise StateError(f"sequence file version {version} at byte 4, expected {SEQ_FILE_VERSION}")
    if (len(view) - 12) // 4 < n_tokens:
        raise StateError(f"sequence file truncated: {n_tokens} tokens (count at byte 8) need "
                         f"{4 * n_tokens} bytes, {len(view) - 12} left")
    tokens = np.frombuffer(view, dtype="<i4", count=n_tokens, offset=12).astype(np.int32)
    return tokens, 12 + 4 * n_tokens
