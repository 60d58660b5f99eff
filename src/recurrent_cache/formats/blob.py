"""A blob's memory section read and written in Python: ``parse_blob`` and the header builders.

``parse_blob`` reads a blob into a ``Blob`` without a cache (for ``inspect``) or checks it
against a cache's ``Geometry`` in the order the compiled core does, so both implementations
report the same defect with the same message (``formats.messages``).  ``parse_section`` is
that parser over a ``MemoryReader`` or a ``formats.streams.FileReader``: one parser for bytes
in memory and for a file.  The compiled ``_state_io`` keeps its own loops, held to the same
bytes by the tests.

The builders (``sequence_blob_header``, ``framing_prefix``, ``arch_string``, ``seq_file_header``)
compose the headers the cache's framed writes, ``seqfile`` and the snapshot codec put around
rows; the reference engine writes its whole blobs from the layouts itself, as the oracle the
compiled writer is checked against.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import ArgumentError, StateError
from .dtypes import GGML_TYPES
from .geometry import Geometry
from .layouts import (ARCH_CHARS, ARCH_LENGTH, BARE, CELL, CELL_COUNT, DATA_HEADER, GGSQ, GGSQ_V2, MAX_ARCH,
                      MAX_INFERRED_LAYERS, MAX_SKIPPED_BYTES, MIN_ARCH, SEQ_BLOB_HEADER, SEQ_BLOB_MAGIC, TENSOR_HEADER,
                      SeqFileFormat)
from .messages import (cell_count_too_large, field_name, filter_past_n_layer, n_layer_mismatch, n_seq_id_too_large,
                       negative_pos, no_seq_id, not_a_state_type, odd_tensor_sections, row_bytes_mismatch,
                       seq_id_out_of_range, seq_id_repeated, sequence_cell_count, sequence_n_seq_id, skip_cap,
                       tensor_name, trailing, truncated, type_mismatch, type_name, v_trans_set)

__all__ = [
    "seq_file_header", "seq_file_format", "arch_string", "framing_prefix", "sequence_blob_header", "charge_skip",
    "BlobCell", "BlobTensor", "Blob", "MemoryReader", "check_cells", "parse_section", "parse_any_filter",
    "parse_blob", "byte_view", "blob_view",
]


# -- composing headers --------------------------------------------------------

def seq_file_header(n_tokens: int, framing: SeqFileFormat = GGSQ) -> bytes:
    """The header of a sequence file of ``n_tokens`` tokens (the tokens follow it)."""
    return framing.header.pack(framing.magic, framing.version, n_tokens)


def seq_file_format(version: Any) -> SeqFileFormat:
    """The 'ggsq' framing of ``version`` (3, llama.cpp's current, or 2); ``ArgumentError`` else."""
    for framing in (GGSQ, GGSQ_V2):
        if version == framing.version and isinstance(version, int) and not isinstance(version, bool):
            return framing
    raise ArgumentError(f"unknown sequence file version {version!r} (expected 3 or 2)")


def arch_string(arch: Any) -> bytes:
    """llama_state_get_data's architecture string (u32 length + name); ``ArgumentError`` for a
    name llama.cpp has no architecture for (4 to 64 lower-case letters, digits, '-', '_', '.')."""
    if not isinstance(arch, str):
        raise ArgumentError(f"arch must be an architecture name (str, e.g. 'mamba'), got {type(arch).__name__}")
    name = arch.encode("ascii", "replace")
    if not MIN_ARCH <= len(name) <= MAX_ARCH or not set(name) <= ARCH_CHARS:
        raise ArgumentError(f"arch {arch!r} is not an architecture name ({MIN_ARCH} to {MAX_ARCH} lower-case "
                            f"letters, digits, '-', '_' or '.')")
    return ARCH_LENGTH.pack(len(name)) + name


def framing_prefix(framing: str, seq_id: int, arch: Any = None) -> bytes:
    """The bytes before the memory section in ``framing`` ("bare" or "llama") of ``seq_id``'s
    state: llama_state_seq_get_data's header for a sequence, llama_state_get_data's architecture
    string ``arch`` for the whole cache (seq_id -1)."""
    if framing == BARE:
        if arch is not None:
            raise ArgumentError("arch is written only with framing='llama' (the bare section has no name)")
        return b""
    if framing != "llama":
        raise ArgumentError(f"unknown framing {framing!r} (expected 'bare' or 'llama')")
    if seq_id >= 0:
        if arch is not None:
            raise ArgumentError("arch is written only for the whole cache (seq_id -1): "
                                "llama_state_seq_get_data's header has no name")
        return SEQ_BLOB_HEADER.pack(SEQ_BLOB_MAGIC, seq_id)
    if arch is None:
        raise ArgumentError("framing='llama' of the whole cache needs arch= (llama_state_get_data "
                            "begins with the model's architecture name, e.g. 'mamba')")
    return arch_string(arch)


def sequence_blob_header(pos: int, n_layer: int) -> bytes:
    """The bytes before the first tensor header of a one-cell sequence blob at ``pos``."""
    return CELL_COUNT.pack(1) + CELL.pack(pos, 0) + DATA_HEADER.pack(0, n_layer)


def charge_skip(skipped: int, n: int, field: str, offset: int) -> int:
    """The bytes of framing stepped over once ``n`` more (``field`` at ``offset``) are; a
    ``StateError`` naming the field and its claim, before any of them is read, past
    ``MAX_SKIPPED_BYTES``."""
    total = skipped + n
    if total > MAX_SKIPPED_BYTES:
        raise skip_cap(field, offset, n, skipped)
    return total


# -- the parsed form -----------------------------------------------------------

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
        if self.type_id not in GGML_TYPES or self.row_bytes % GGML_TYPES[self.type_id].itemsize:
            return None
        return self.row_bytes // GGML_TYPES[self.type_id].itemsize


@dataclass(frozen=True)
class Blob:
    cells: tuple[BlobCell, ...]
    n_layer: int
    tensors: tuple[BlobTensor, ...]   # r of every layer with state, then s
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


class MemoryReader:
    """A cursor over a blob in memory; raises ``truncated`` for a field that does not fit.

    ``formats.streams.FileReader`` offers the same calls over a file, so one parser
    (``parse_section``) serves both and reports the same defect with the same words.
    """

    def __init__(self, data: memoryview) -> None:
        self.data = data
        self.offset = 0
        self.length = len(data)
        self.skipped = 0             # bytes of framing stepped over (``charge_skip``)

    def _need(self, n: int, field: str) -> int:
        start = self.offset
        if self.length - start < n:
            raise truncated(field, start, n, self.length)
        self.offset += n
        return start

    def unpack(self, layout: struct.Struct, field: str) -> tuple[tuple[Any, ...], int]:
        """The values of ``layout`` at the cursor, and the offset they were read at."""
        at = self._need(layout.size, field)
        return layout.unpack_from(self.data, at), at

    def ids(self, count: int, field: str) -> tuple[tuple[int, ...], int]:
        """``count`` int32 at the cursor, and their offset."""
        at = self._need(4 * count, field)
        return struct.unpack_from(f"<{count}i", self.data, at), at

    def skip(self, n: int, field: str) -> int:
        """Step over n bytes (rows); returns where they start."""
        return self._need(n, field)

    def step_over(self, n: int, field: str) -> int:
        """Step over n bytes of a framing (not rows); returns where they start."""
        if self.length - self.offset >= n:   # a claim past the end is a truncation first
            self.skipped = charge_skip(self.skipped, n, field, self.offset)
        return self._need(n, field)

    def take(self, n: int, short: Any) -> memoryview:
        """The next n bytes; ``short(offset, n, length)`` is the error when fewer are left."""
        at = self.offset
        if self.length - at < n:
            raise short(at, n, self.length)
        self.offset += n
        return self.data[at:at + n]

    def peek(self, n: int) -> bytes:
        """Up to n bytes at the cursor, without moving it."""
        return bytes(self.data[self.offset:self.offset + n])

    def rebase(self) -> None:
        """Make the current position offset 0 (the blob of a sequence file starts here)."""
        self.data = self.data[self.offset:]
        self.length -= self.offset
        self.offset = 0

    def finish(self) -> memoryview:
        """The blob's bytes, once the parse ended exactly at the end of the data."""
        if self.offset != self.length:
            raise trailing(self.offset, self.length)
        return self.data


def _check_cell_header(i: int, pos: int, pos_at: int, n_seq_id: int, size: int, seq_id: int) -> None:
    """The rules for a cell's pos and n_seq_id when read into a cache of ``size`` cells at ``seq_id``."""
    if not 0 <= pos < 2**31 - 1:   # 2**31 - 1 means "to the end" in ranges
        raise negative_pos(i, pos_at, pos)
    if seq_id >= 0 and n_seq_id != 0:
        raise sequence_n_seq_id(i, pos_at + 4, n_seq_id)
    if seq_id < 0 and n_seq_id == 0:
        raise no_seq_id(i, pos_at + 4)
    if n_seq_id > size:
        raise n_seq_id_too_large(i, pos_at + 4, n_seq_id, size)


def _check_cell_ids(i: int, ids: tuple[int, ...], ids_at: int, size: int, first_cell: dict[int, int]) -> None:
    """The rules for a cell's seq ids: in ``[0, size)``, none listed by an earlier cell."""
    for j, seq in enumerate(ids):
        if not 0 <= seq < size:
            raise seq_id_out_of_range(i, ids_at + 4 * j, seq, size)
        if seq in first_cell:
            raise seq_id_repeated(i, ids_at + 4 * j, seq, first_cell[seq])
        first_cell[seq] = i


def _check_cell_count(count: int, size: int, seq_id: int) -> None:
    if seq_id >= 0 and count > 1:
        raise sequence_cell_count(count)
    if seq_id < 0 and count > size:
        raise cell_count_too_large(count, size)


def check_cells(cells: tuple[BlobCell, ...], size: int, seq_id: int) -> None:
    """The cell rules of ``parse_blob`` for the cells of a blob parsed without a cache, in blob order."""
    _check_cell_count(len(cells), size, seq_id)
    first_cell: dict[int, int] = {}
    at = 4
    for i, cell in enumerate(cells):
        _check_cell_header(i, cell.pos, at, len(cell.seq_ids), size, seq_id)
        _check_cell_ids(i, cell.seq_ids, at + 8, size, first_cell)
        at += 8 + 4 * len(cell.seq_ids)


def parse_section(reader: Any, cache: Geometry | None, seq_id: int, watch: Any = None,
           layers: Sequence[int] | None = None, infer_layers: bool = False) -> Blob:
    """The checks of ``parse_blob`` over a ``MemoryReader`` or a ``formats.streams.FileReader``.

    ``layers`` (without ``cache``): the layers whose sections the blob holds, each below the
    blob's n_layer (None: every layer).  ``infer_layers`` (without either): data that ends
    right after the layer header holds no layer (the empty filter, a hybrid draft's state; up
    to ``MAX_INFERRED_LAYERS``); data that ends after the sections of some of the layers says
    so in its truncation error.

    ``watch`` (optional) sees the blob as it is read, before any row:
    ``watch.cells(blob_cells)`` once the cells are read, ``watch.layers(n_layer,
    offset)`` and ``watch.tensor(k, type_id, row_bytes, offset)``; it may raise
    to stop the read there.
    """
    (cell_count,), _ = reader.unpack(CELL_COUNT, field_name("cell_count"))
    if cache is not None:
        _check_cell_count(cell_count, cache.size, seq_id)
    cells = []
    first_cell: dict[int, int] = {}   # seq id -> the cell that listed it
    for i in range(cell_count):
        (pos, n_seq_id), pos_at = reader.unpack(CELL, field_name("cell", cell=i))
        if cache is not None:
            _check_cell_header(i, pos, pos_at, n_seq_id, cache.size, seq_id)
        ids, ids_at = reader.ids(n_seq_id, field_name("seq_ids", cell=i))
        if cache is not None:
            _check_cell_ids(i, ids, ids_at, cache.size, first_cell)
        cells.append(BlobCell(pos, ids))
    (v_trans, n_layer), data_at = reader.unpack(DATA_HEADER, field_name("data_header"))
    if v_trans != 0:
        raise v_trans_set(data_at, v_trans)
    if cache is not None and n_layer != cache.n_layer:
        raise n_layer_mismatch(data_at + 4, n_layer, cache.n_layer)
    if watch is not None:
        watch.cells(tuple(cells))
        watch.layers(n_layer, data_at + 4)
    tensors = []
    # a blob cannot say which layers its sections are: the cache's filter names them (and
    # decides their count); without a cache the caller's ``layers`` or every layer (a range: a
    # damaged n_layer of 2**32 costs nothing before the first section that is not there)
    if cache is not None:
        layers = range(n_layer) if cache.layers is None else cache.layers
    elif layers is None:
        layers = range(n_layer)
    elif layers and layers[-1] >= n_layer:
        raise filter_past_n_layer(n_layer, data_at + 4, layers[-1])
    n_state = len(layers)
    for k in range(2 * n_state):
        model_tensor = layers[k] if k < n_state else n_layer + layers[k - n_state]
        name = tensor_name(model_tensor, n_layer)
        if infer_layers and not reader.peek(1):   # the data ends before this section
            if k == 0 and n_layer <= MAX_INFERRED_LAYERS:
                layers, n_state = (), 0
                break
            short = truncated(f"{name} type and row size", reader.offset, TENSOR_HEADER.size, reader.offset)
            hint = (f" (or a hybrid's state holding r and s sections of {k // 2} of its {n_layer} layers: "
                    f"name them, inspect --layers)") if k % 2 == 0 else ""
            raise StateError(f"{short}{hint}")
        (type_id, row_bytes), header_at = reader.unpack(TENSOR_HEADER, f"{name} type and row size")
        if cache is not None:
            if type_id != cache.type_ids[k]:
                raise type_mismatch(name, header_at, type_id, cache.type_ids[k])
            if row_bytes != cache.row_bytes[k]:
                raise row_bytes_mismatch(name, header_at + 4, row_bytes, cache.row_bytes[k])
        if watch is not None:
            watch.tensor(k, type_id, row_bytes, header_at)
        rows_at = reader.skip(cell_count * row_bytes, f"{name} rows")
        tensors.append(BlobTensor("r" if k < n_state else "s", layers[k % n_state], type_id, row_bytes, rows_at))
    return Blob(tuple(cells), n_layer, tuple(tensors), reader.offset)


def parse_any_filter(reader: Any, watch: Any = None) -> None:
    """The structure of a memory section whose layer filter is unknown: its cells, then tensor
    sections up to the end of the data, an even number of them and at most 2 x n_layer (a
    filter keeps r and s of the same layers)."""
    (cell_count,), _ = reader.unpack(CELL_COUNT, field_name("cell_count"))
    cells = []
    for i in range(cell_count):
        (pos, n_seq_id), _ = reader.unpack(CELL, field_name("cell", cell=i))
        ids, _ = reader.ids(n_seq_id, field_name("seq_ids", cell=i))
        cells.append(BlobCell(pos, ids))
    (v_trans, n_layer), data_at = reader.unpack(DATA_HEADER, field_name("data_header"))
    if v_trans != 0:
        raise v_trans_set(data_at, v_trans)
    if watch is not None:
        watch.cells(tuple(cells))
        watch.layers(n_layer, data_at + 4)
    k = 0
    while reader.peek(1):
        if k == 2 * n_layer:
            raise trailing(reader.offset, reader.offset + len(reader.peek(1 << 16)))
        (type_id, row_bytes), header_at = reader.unpack(TENSOR_HEADER, f"tensor section {k} type and row size")
        if type_id not in GGML_TYPES:
            raise not_a_state_type(k, type_id, header_at)
        reader.skip(cell_count * row_bytes, f"tensor section {k} rows")
        k += 1
    if k % 2:
        raise odd_tensor_sections(k)


def parse_blob(data: Any, cache: Geometry | None = None, seq_id: int = -1) -> Blob:
    """Parse a state blob, raising ``StateError`` at its first defect.

    Without ``cache`` only the structure is checked (lengths, ``v_trans == 0``,
    no trailing bytes).  With it, every rule of docs/concepts.md §5 for reading the blob
    into that cache at ``seq_id`` is checked too, in blob order: a sequence
    blob (``seq_id >= 0``) has at most one cell and no seq ids; a whole-cache
    blob (``seq_id == -1``) has at most ``size`` cells, each with at least one
    seq id in ``[0, size)``, no seq id twice; no cell has a negative pos; the
    layer count, types and row sizes are the cache's.
    """
    reader = MemoryReader(blob_view(data))
    blob = parse_section(reader, cache, seq_id)
    reader.finish()
    return blob


# -- buffers -------------------------------------------------------------------

def byte_view(obj: Any) -> memoryview:
    """A flat unsigned-byte view of a C-contiguous buffer (numpy arrays of any dtype too).

    Raises TypeError for an object that is no buffer, ArgumentError for one
    that cannot be used (released, not contiguous, an unreadable format).
    """
    if isinstance(obj, np.ndarray):
        if not obj.flags.c_contiguous:
            raise ArgumentError("the array must be C-contiguous")
        # a custom dtype (bfloat16) cannot export a buffer itself, its bytes can
        obj = obj.reshape(-1).view(np.uint8)
    try:
        view = memoryview(obj)
    except (ValueError, BufferError) as exc:   # a released memoryview, a failing exporter
        raise ArgumentError(f"the {type(obj).__name__} cannot be used as a buffer: {exc}") from None
    if not view.c_contiguous:
        raise ArgumentError("the buffer must be C-contiguous")
    if view.format == "B" and view.ndim == 1:
        return view
    try:
        return view.cast("B")
    except (TypeError, ValueError) as exc:
        raise ArgumentError(f"the {type(obj).__name__} (format {view.format!r}, shape {view.shape}) "
                            f"cannot be read as bytes: {exc}") from None


def blob_view(data: Any) -> memoryview:
    """The bytes of a blob given as any bytes-like object."""
    try:
        return byte_view(data)
    except TypeError:
        raise ArgumentError(f"a state blob must be a bytes-like object, got {type(data).__name__}") from None
    except ArgumentError as exc:
        raise ArgumentError(f"a state blob: {exc}") from None

