"""The bytes of a recurrent state, described once: docs/concepts.md §5 (llama.cpp's recurrent ``state_write``).

This module is the one source of the byte formats: the ggml type table
(``STATE_TYPES`` / ``GGML_TYPES``), the fixed runs of fields (``Layout``:
``CELL_COUNT``, ``CELL``, ``DATA_HEADER``, ``TENSOR_HEADER``), the sequence-file
framing (``SeqFileFormat``: ``GGSQ``; another framing is one more instance),
the cache ``Geometry`` every blob, sequence file, snapshot and store key is
checked against, and the wording of every defect.  The framings current
llama.cpp puts around the memory section (docs/llamacpp_formats.md) are data
here too: ``GGSQ`` (version 3) / ``GGSQ_V2`` / ``GGSN`` files,
``SEQ_BLOB_HEADER`` (``llama_state_seq_get_data``), the architecture string
(``llama_state_get_data``) and a hybrid's attention KV section; ``unframe`` /
``read_file`` find them from the bytes and hand on the bare memory section, the
only bytes the engines read.  ``state_read``,
``seqfile``, ``inspect``, the snapshot codec and the reference engine build
and read their bytes from it; the compiled ``_state_io`` keeps its own loops,
held to the same bytes by the tests.

A blob is, all integers little-endian::

    u32 cell_count
    cell_count x { i32 pos; u32 n_seq_id; n_seq_id x i32 seq_id }   # meta
    u32 v_trans (= 0); u32 n_layer
    n_layer x { i32 r_type; u64 r_row_bytes; cell_count rows of r }
    n_layer x { i32 s_type; u64 s_row_bytes; cell_count rows of s }

With a layer filter (``Geometry.layers``, a hybrid model's recurrent layers)
``n_layer`` stays the model's layer count and the r, then the s, sections are
those of the filtered layers only, in layer order (llama.cpp skips its null layers).

:func:`parse_blob` reads one into a :class:`Blob` without a cache (for
``inspect``) or checks it against a cache's :class:`Geometry` in the order
the compiled core does, so both implementations report the same defect with
the same message.  The message builders below are the only wording of those
defects; the core maps its error codes onto them.
"""

from __future__ import annotations

import io
import os
import stat
import struct
from dataclasses import dataclass
from collections.abc import Sequence
from typing import Any

import numpy as np

from . import _args
from .errors import ArgumentError, StateError

__all__ = [
    "StateType", "STATE_TYPES", "GGML_TYPES", "Layout", "CELL_COUNT", "CELL", "DATA_HEADER", "TENSOR_HEADER",
    "SeqFileFormat", "GGSQ", "MAX_TOKENS", "Geometry", "sequence_blob_header", "seq_file_header",
    "Blob", "BlobCell", "BlobTensor", "FileContents", "parse_blob", "parse_seq_file_header", "read_file",
    "blob_view", "target_view", "target_too_small", "target_aliases_cache", "read_rest", "write_all",
    "check_cells", "GGSQ_V2", "GGSN", "FILE_FORMATS", "BARE", "SEQ_BLOB", "CONTEXT_BLOB", "SEQ_BLOB_HEADER",
    "SEQ_BLOB_MAGIC", "ARCH_LENGTH", "KV_STREAMS", "KV_DATA_HEADER", "KV_V_TRANS_HEADER", "seq_file_format",
    "arch_string", "framing_prefix", "Framing", "Unframed", "unframe", "in_section",
]


# -- the ggml types a state tensor can have ------------------------------------

def _bf16_storage() -> np.dtype:
    """bfloat16 as a real numpy dtype when ml_dtypes is installed, else its raw bits (uint16):
    the upper half of the float32 bit pattern, exactly llama.cpp's layout."""
    try:
        from ml_dtypes import bfloat16
    except ImportError:  # pragma: no cover - exercised only without the extra
        return np.dtype(np.uint16)
    storage: np.dtype = np.dtype(bfloat16)
    return storage


@dataclass(frozen=True)
class StateType:
    """A type a state tensor can have: its name, ggml type id, element size and numpy forms."""

    name: str            # "f32", "f16", "bf16": a cache's dtype_r / dtype_s
    type_id: int         # ggml's type id, in a blob's tensor headers
    itemsize: int
    numpy: np.dtype      # how a cache stores it (bf16: ml_dtypes.bfloat16, or raw uint16 bits)
    bits: np.dtype       # the little-endian bits of one element in a blob


# The one table of the state types (the cache's dtypes, the blob's type ids).
STATE_TYPES = {t.name: t for t in (StateType("f32", 0, 4, np.dtype(np.float32), np.dtype("<f4")),
                                   StateType("f16", 1, 2, np.dtype(np.float16), np.dtype("<f2")),
                                   StateType("bf16", 30, 2, _bf16_storage(), np.dtype("<u2")))}
GGML_TYPES = {t.type_id: t for t in STATE_TYPES.values()}


# -- the layouts: every fixed run of fields, named once -------------------------

class Layout(struct.Struct):
    """A fixed run of little-endian fields: a ``struct.Struct`` that knows its fields' names.

    Each field is ``(name, code)`` with a one-character ``struct`` code, packed without padding."""

    def __init__(self, *fields: tuple[str, str]) -> None:
        super().__init__("<" + "".join(code for _, code in fields))
        self.names = tuple(name for name, _ in fields)

    def offset(self, field: str) -> int:
        """Where ``field`` starts, from the start of the layout."""
        index = self.names.index(field)
        return struct.calcsize("<" + self.format[1:][:index]) if index else 0


# A state blob (docs/concepts.md §5): CELL_COUNT, cell_count x (CELL, n_seq_id x i32), DATA_HEADER,
# 2 * n_layer x (TENSOR_HEADER, cell_count rows).
CELL_COUNT = Layout(("cell_count", "I"))
CELL = Layout(("pos", "i"), ("n_seq_id", "I"))
DATA_HEADER = Layout(("v_trans", "I"), ("n_layer", "I"))
TENSOR_HEADER = Layout(("type", "i"), ("row_bytes", "Q"))


@dataclass(frozen=True)
class SeqFileFormat:
    """One framing of a state file: ``header`` (a magic, a version, the token count), the
    tokens as i32, then (``arch_string``) the architecture name, then the memory section:
    of one sequence (``whole`` False) or of the whole cache."""

    name: str
    header: Layout
    magic: int
    version: int
    whole: bool = False
    arch_string: bool = False


_FILE_HEADER = Layout(("magic", "I"), ("version", "I"), ("n_token_count", "I"))
# llama.cpp's llama_state_seq_save_file: LLAMA_STATE_SEQ_MAGIC 'ggsq', LLAMA_STATE_SEQ_VERSION 3
# (llama.cpp 0c1e57098); version 2 (June 2025) has the same bytes and is still read.
GGSQ = SeqFileFormat("'ggsq' version 3", _FILE_HEADER, 0x67677371, 3)
GGSQ_V2 = SeqFileFormat("'ggsq' version 2", _FILE_HEADER, 0x67677371, 2)
# llama_state_save_file: LLAMA_SESSION_MAGIC 'ggsn', LLAMA_SESSION_VERSION 10: tokens, then
# exactly a llama_state_get_data blob (the architecture string, the whole memory section).
GGSN = SeqFileFormat("'ggsn' version 10", _FILE_HEADER, 0x6767736e, 10, whole=True, arch_string=True)
FILE_FORMATS = (GGSQ, GGSQ_V2, GGSN)

# The framings of a blob without tokens (``Framing.name``): the bare memory section (what this
# package wrote before, and llama.cpp's memory itself writes), llama_state_seq_get_data's
# (SEQ_BLOB_HEADER first) and llama_state_get_data's (the architecture string first).
BARE = "bare"
SEQ_BLOB = "llama sequence blob"
CONTEXT_BLOB = "llama context blob"
SEQ_BLOB_HEADER = Layout(("magic", "I"), ("seq_id", "i"))
SEQ_BLOB_MAGIC = 0xaf143cd8
ARCH_LENGTH = Layout(("arch_length", "I"))
# Every recurrent or hybrid architecture name llama.cpp has is 4 to 64 of these characters.  Read
# as a bare section, 4 of them make cell 0's pos at least 0x2d2d2d2d, which no sequence reaches:
# that is what tells an architecture string from a bare section's cell count.
MIN_ARCH, MAX_ARCH = 4, 64
_ARCH_CHARS = frozenset(b"abcdefghijklmnopqrstuvwxyz0123456789-_.")

# llama.cpp's attention KV section (llama_kv_cache::state_write), before a hybrid's recurrent section.
KV_STREAMS = Layout(("n_stream", "I"))
KV_DATA_HEADER = Layout(("v_trans", "I"), ("n_layer", "I"))
KV_V_TRANS_HEADER = Layout(("type", "i"), ("element_bytes", "I"), ("n_embd_v_gqa", "I"))


# The most tokens a sequence file may hold unless the caller allows more (llama.cpp's
# llama_state_seq_load_file takes the same bound as n_token_capacity): 2**26 tokens,
# 256 MiB, beyond any context window, so a header claiming 2**32 - 1 from a stream
# cannot make a reader buffer 16 GiB.
MAX_TOKENS = 2**26


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
    if not MIN_ARCH <= len(name) <= MAX_ARCH or not set(name) <= _ARCH_CHARS:
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
    return GGML_TYPES[type_id].name if type_id in GGML_TYPES else "unknown type"


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

def _geometry_fields(error: type[Exception], n_layer: Any, n_embd_r: Any, n_embd_s: Any, dtype_r: Any,
                     dtype_s: Any, size: Any, layers: Any) -> dict[str, Any]:
    """The fields of a ``Geometry``, checked (``error`` for a bad one) and normalised to int."""
    fields: dict[str, Any] = {
        "n_layer": _args.count(n_layer, "n_layer", 0, error), "n_embd_r": _args.count(n_embd_r, "n_embd_r", 1, error),
        "n_embd_s": _args.count(n_embd_s, "n_embd_s", 1, error)}
    for name, value in (("dtype_r", dtype_r), ("dtype_s", dtype_s)):
        if not isinstance(value, str) or value not in STATE_TYPES:
            raise error(f"unknown {name} {value!r} (expected one of {', '.join(STATE_TYPES)})")
        fields[name] = value
    fields["size"] = _args.count(size, "size", 1, error)
    fields["layers"] = _args.layer_filter(layers, fields["n_layer"], error)
    return fields


@dataclass(frozen=True)
class Geometry:
    """The shape of a cache's state: what a blob or a snapshot must match to be read into it.

    ``n_layer`` layers of one r row (``n_embd_r`` values of ``dtype_r``) and
    one s row per cell; ``dtype_r`` / ``dtype_s`` are names of
    ``STATE_TYPES``.  ``size`` (cells) matters only to a whole-cache blob: a
    snapshot is one sequence's state, which any size holds, so a store key
    (``key_text``) leaves it out.  Bad fields raise ``ArgumentError``.

    ``layers``: the layers that hold recurrent state (a hybrid model's recurrent
    layers, llama.cpp's layer filter), sorted; None (also what a filter naming
    every layer becomes) is every layer.  A blob still records ``n_layer``, the
    model's layer count, but holds the r sections, then the s sections, of these
    layers only.
    """

    n_layer: int
    n_embd_r: int
    n_embd_s: int
    dtype_r: str = "f32"
    dtype_s: str = "f32"
    size: int = 1
    layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        fields = _geometry_fields(ArgumentError, self.n_layer, self.n_embd_r, self.n_embd_s, self.dtype_r,
                                  self.dtype_s, self.size, self.layers)
        for name, value in fields.items():
            object.__setattr__(self, name, value)

    @classmethod
    def checked(cls, error: type[Exception], n_layer: Any, n_embd_r: Any, n_embd_s: Any, dtype_r: Any = "f32",
                dtype_s: Any = "f32", size: Any = 1, layers: Any = None) -> Geometry:
        """A geometry, raising ``error`` (a constructor's ``ConfigError``) for a bad field."""
        return cls(**_geometry_fields(error, n_layer, n_embd_r, n_embd_s, dtype_r, dtype_s, size, layers))

    @classmethod
    def of(cls, cache: Any) -> Geometry:
        """The geometry of a ``RecurrentCache`` of either engine, from its public attributes."""
        return cls(cache.n_layer, cache.n_embd_r, cache.n_embd_s, cache.dtype_r, cache.dtype_s, cache.size,
                   cache.layers)

    @classmethod
    def of_tensors(cls, size: int, type_ids: Sequence[int], tensors: Sequence[np.ndarray], n_layer: int,
                   layers: Sequence[int]) -> Geometry:
        """The geometry of an engine's state tensors: r of each of ``layers`` (of the model's
        ``n_layer``), then their s, (size, n_embd) arrays of ggml types ``type_ids``.  Without
        tensors no row width or type is recorded anywhere; 1 and f32 are taken (no row of them
        is ever read or written)."""
        n_state = len(tensors) // 2
        if not n_state:
            return cls(n_layer, 1, 1, size=size, layers=tuple(layers))
        return cls(n_layer, tensors[0].shape[1], tensors[n_state].shape[1], GGML_TYPES[type_ids[0]].name,
                   GGML_TYPES[type_ids[n_state]].name, size, tuple(layers))

    @property
    def state_layers(self) -> tuple[int, ...]:
        """The layers with state, sorted (every layer unless filtered)."""
        return tuple(range(self.n_layer)) if self.layers is None else self.layers

    @property
    def n_state_layers(self) -> int:
        """How many layers hold state: a blob's r sections (and s sections)."""
        return self.n_layer if self.layers is None else len(self.layers)

    def section_tensor(self, k: int) -> int:
        """The model tensor (r of layer il: il; s: n_layer + il) of a blob's section k (r of the
        layers with state, then their s): how messages name a section."""
        n_state = self.n_state_layers
        if self.layers is None or not 0 <= k < 2 * n_state:
            return k
        return self.layers[k] if k < n_state else self.n_layer + self.layers[k - n_state]

    @property
    def type_r(self) -> StateType:
        return STATE_TYPES[self.dtype_r]

    @property
    def type_s(self) -> StateType:
        return STATE_TYPES[self.dtype_s]

    @property
    def row_bytes_r(self) -> int:
        return self.n_embd_r * self.type_r.itemsize

    @property
    def row_bytes_s(self) -> int:
        return self.n_embd_s * self.type_s.itemsize

    @property
    def type_ids(self) -> tuple[int, ...]:
        """The ggml type of every tensor section of a blob: r of every layer with state, then s."""
        n_state = self.n_state_layers
        return (self.type_r.type_id,) * n_state + (self.type_s.type_id,) * n_state

    @property
    def row_bytes(self) -> tuple[int, ...]:
        """The row size of every tensor section of a blob: r of every layer with state, then s."""
        n_state = self.n_state_layers
        return (self.row_bytes_r,) * n_state + (self.row_bytes_s,) * n_state

    @property
    def state_bytes(self) -> int:
        """Bytes of one sequence's rows (r and s of every layer with state)."""
        return self.n_state_layers * (self.row_bytes_r + self.row_bytes_s)

    def sequence_blob_size(self) -> int:
        """Length of a one-cell sequence blob of this geometry."""
        return (CELL_COUNT.size + CELL.size + DATA_HEADER.size + 2 * self.n_state_layers * TENSOR_HEADER.size
                + self.state_bytes)

    def check_rows(self, rows: Sequence[Any], which: str) -> list[np.ndarray]:
        """One sequence's ``which`` ("r" or "s") rows, one per layer with state (in layer order),
        as contiguous arrays; ``ArgumentError`` unless they have exactly this geometry's widths and
        storage dtype."""
        n_embd, dtype = (self.n_embd_r, self.type_r.numpy) if which == "r" else (self.n_embd_s, self.type_s.numpy)
        if len(rows) != self.n_state_layers:
            raise ArgumentError(f"{which}_rows has {len(rows)} rows, the geometry has {self.n_state_layers} "
                                f"layers with state")
        out = []
        for il, row in enumerate(rows):
            array = np.asarray(row)
            if array.shape != (n_embd,) or array.dtype != dtype:
                raise ArgumentError(f"{which}_rows[{il}] has shape {array.shape} and dtype {array.dtype}, "
                                    f"the geometry has ({n_embd},) and {dtype}")
            out.append(np.ascontiguousarray(array))
        return out

    def key_text(self) -> str:
        """What a store key holds of the geometry: every field but ``size``.  A filter is appended
        (``;layers=0,2``, ``;layers=`` for none); an unfiltered geometry's text is as it always was."""
        text = (f"n_layer={self.n_layer};n_embd_r={self.n_embd_r};n_embd_s={self.n_embd_s};"
                f"dtype_r={self.dtype_r};dtype_s={self.dtype_s}")
        if self.layers is not None:
            text += ";layers=" + ",".join(map(str, self.layers))
        return text


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


class _Reader:
    """A cursor over a blob in memory; raises ``truncated`` for a field that does not fit.

    ``_FileReader`` offers the same four calls over a file, so one parser
    (``_parse``) serves both and reports the same defect with the same words.
    """

    def __init__(self, data: memoryview) -> None:
        self.data = data
        self.offset = 0
        self.length = len(data)

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


def _parse(reader: Any, cache: Geometry | None, seq_id: int, watch: Any = None) -> Blob:
    """The checks of ``parse_blob`` over a ``_Reader`` or a ``_FileReader``.

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
    # decides their count); without a cache every layer is taken to hold state (a range: a
    # damaged n_layer of 2**32 costs nothing before the first section that is not there)
    layers: Sequence[int] = range(n_layer) if cache is None or cache.layers is None else cache.layers
    n_state = len(layers)
    for k in range(2 * n_state):
        name = tensor_name(cache.section_tensor(k) if cache is not None else k, n_layer)
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
    reader = _Reader(blob_view(data))
    blob = _parse(reader, cache, seq_id)
    reader.finish()
    return blob


# -- buffers and files ---------------------------------------------------------

def _byte_view(obj: Any) -> memoryview:
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
        return _byte_view(data)
    except TypeError:
        raise ArgumentError(f"a state blob must be a bytes-like object, got {type(data).__name__}") from None
    except ArgumentError as exc:
        raise ArgumentError(f"a state blob: {exc}") from None


def _check_file(file: Any, op: str, method: str, mode: str) -> None:
    """ArgumentError unless ``file`` is an open binary file that can ``method`` ("read" or "write")."""
    if isinstance(file, io.TextIOBase):
        raise ArgumentError(f"{op}: the file is a text file; open it in binary mode")
    if not callable(getattr(file, method, None)):
        raise ArgumentError(f"{op} takes a binary file, got {type(file).__name__}")
    if getattr(file, "closed", False) is True:
        raise ArgumentError(f"{op}: the file is closed")
    able = getattr(file, {"read": "readable", "write": "writable"}[method], None)
    if callable(able):
        try:
            usable = able()
        except (OSError, ValueError) as exc:
            raise ArgumentError(f"{op}: the file cannot be used: {exc}") from None
        if usable is False:
            raise ArgumentError(f"{op}: the file is not open for {mode}")


def target_view(target: Any) -> memoryview | None:
    """A writable byte view of ``target``, or None when it is not a buffer (a file, then)."""
    if isinstance(target, io.TextIOBase):
        raise ArgumentError("state_write_into: the target is a text file; open it in binary mode")
    try:
        view = _byte_view(target)
    except TypeError:
        if callable(getattr(target, "write", None)):
            _check_file(target, "state_write_into", "write", "writing")
            return None
        raise ArgumentError(f"state_write_into: the target must be a writable buffer or a binary "
                            f"file, got {type(target).__name__}") from None
    except ArgumentError as exc:
        raise ArgumentError(f"state_write_into: {exc}") from None
    if view.readonly:
        raise ArgumentError(f"state_write_into: the target ({type(target).__name__}) is read-only")
    return view


def target_too_small(available: int, needed: int) -> ArgumentError:
    return ArgumentError(f"state_write_into: the target has {available} bytes, the blob needs {needed}")


def target_aliases_cache() -> ArgumentError:
    return ArgumentError("state_write_into: the target shares memory with the cache's state tensors "
                         "(writing the blob there would overwrite the rows it is made of)")


def write_all(file: Any, chunk: Any) -> None:
    """Write every byte of ``chunk`` to a binary file; never loops without progress.

    ``file.write`` may write less than asked (a raw file); the rest is written
    again.  What it returns decides:

    * an integer ``n`` with ``0 < n <= len``: ``n`` bytes were written;
    * ``None`` from an ``io.RawIOBase``: nothing was written, the file would
      block (io's protocol) - an ``ArgumentError``;
    * ``None`` from any other object: everything was written.  Duck-typed
      writers (a class with ``write`` appending to a list) return None, and
      ``shutil.copyfileobj`` and ``print(file=...)`` read it the same way;
    * 0, a negative number, more than asked or a non-integer: an
      ``ArgumentError`` naming the value, since retrying could spin forever.

    Bytes already written stay written: a file cannot be un-written.
    """
    view = memoryview(chunk).cast("B")
    total = len(view)
    while len(view):
        written = file.write(view)
        done = total - len(view)
        if written is None:
            if isinstance(file, io.RawIOBase):
                raise ArgumentError(f"state_write_into: the file would block (a non-blocking raw file "
                                    f"returned None) after {done} of {total} bytes of this part")
            return
        written = _args.integer(written, f"state_write_into: the file's write() result after {done} of "
                                         f"{total} bytes of this part")
        if not 0 < written <= len(view):
            raise ArgumentError(f"state_write_into: the file's write() of {len(view)} bytes returned "
                                f"{int(written)} (after {done} of {total} bytes of this part; "
                                f"expected 1 to {len(view)})")
        view = view[int(written):]


# -- reading a blob or a sequence file from a file, bounded by its headers -----

_CHUNK = 1 << 20   # a stream is read in pieces: memory grows with the data that came, not the claims


def _remaining(file: Any) -> int | None:
    """Bytes from the file's position to its end when that is known (a non-empty regular
    file, a seekable in-memory file); None for a pipe, FIFO, device or socket."""
    try:
        fileno = file.fileno()
    except (AttributeError, OSError, ValueError, TypeError):
        fileno = None
    try:
        if isinstance(fileno, int):
            info = os.fstat(fileno)
            # st_size 0 is also what /proc files report, so such a file is read as a stream
            if not stat.S_ISREG(info.st_mode) or info.st_size == 0:
                return None
            return max(0, info.st_size - int(file.tell()))
        if file.seekable():
            here = file.tell()
            end = file.seek(0, io.SEEK_END)
            file.seek(here)
            return max(0, end - here) if isinstance(end, int) and isinstance(here, int) else None
    except (AttributeError, OSError, ValueError, TypeError):
        pass
    return None


class _FileReader:
    """The ``_Reader`` calls over a binary file, from its position.

    Nothing is read before a header asks for it.  When the file's length is
    known, every claim is checked against it before a byte is read, rows are
    stepped over with ``seek`` and read in one piece at the end; a stream
    (pipe, FIFO, device) is read piece by piece up to what the headers claim,
    then one byte more to prove it ends there.  With ``rows`` the rows are
    handed to it piece by piece as they are read and not kept at all.
    """

    def __init__(self, file: Any, op: str, rows: Any = None) -> None:
        self.file = file
        self.op = op                 # who reads, for the messages: "state_read_from", a path, ...
        self.rows = rows
        self.offset = 0              # relative to the start (see ``rebase``)
        self.pending = b""           # bytes read by ``peek``, served first
        self.length = _remaining(file)
        self.start = file.tell() if self.length is not None else 0
        # a stream keeps what it read (it cannot be read again); not with a rows consumer
        self.kept: bytearray | None = bytearray() if self.length is None and rows is None else None

    def _read(self, n: int) -> bytes:
        """Up to n bytes (fewer only at the end of the file)."""
        if self.pending:
            piece, self.pending = self.pending[:n], self.pending[n:]
            return piece
        piece = self.file.read(n)
        if piece is None:
            raise ArgumentError(f"{self.op}: the file would block (a non-blocking file with no data ready)")
        try:
            size = memoryview(piece).nbytes
        except TypeError:
            raise ArgumentError(f"{self.op}: the file's read() returned {type(piece).__name__}, "
                                f"not bytes") from None
        if size > n:
            raise ArgumentError(f"{self.op}: the file's read({n}) returned {size} bytes")
        return bytes(piece)

    def _pieces(self, n: int) -> Any:
        """n bytes in pieces of at most _CHUNK; stops early at the end of the file."""
        while n > 0:
            piece = self._read(min(n, _CHUNK))
            if not piece:
                return
            n -= len(piece)
            yield piece

    def take(self, n: int, short: Any) -> bytes:
        """The next n bytes; ``short(offset, n, length)`` is the error when fewer are left."""
        at = self.offset
        if self.length is not None and self.length - at < n:
            raise short(at, n, self.length)
        data = bytearray()
        for piece in self._pieces(n):
            data += piece
        if len(data) < n:   # a stream ended (or a file shrank since its length was taken)
            raise short(at, n, at + len(data))
        if self.kept is not None:
            self.kept += data
        self.offset += n
        return bytes(data)

    def peek(self, n: int) -> bytes:
        """Up to n bytes at the cursor, without moving it."""
        data = b"".join(self._pieces(n))
        self.pending = data + self.pending
        return data

    def unpack(self, layout: struct.Struct, field: str) -> tuple[tuple[Any, ...], int]:
        at = self.offset
        return layout.unpack(self.take(layout.size, _truncation(field))), at

    def ids(self, count: int, field: str) -> tuple[tuple[int, ...], int]:
        at = self.offset
        return struct.unpack(f"<{count}i", self.take(4 * count, _truncation(field))), at

    def skip(self, n: int, field: str) -> int:
        at = self.offset
        if self.length is not None and self.length - at < n:
            raise truncated(field, at, n, self.length)
        if self.rows is None and self.kept is None:
            served = min(n, len(self.pending))   # bytes a peek read ahead, then the rest by seeking
            self.pending = self.pending[served:]
            if n > served:
                self.file.seek(n - served, io.SEEK_CUR)
        else:
            got = 0
            for piece in self._pieces(n):
                got += len(piece)
                if self.rows is not None:
                    self.rows(piece)
                else:
                    self.kept += piece
            if got < n:
                raise truncated(field, at, n, at + got)
        self.offset += n
        return at

    def rebase(self) -> None:
        """Make the current position offset 0 (the blob of a sequence file starts here)."""
        if self.length is not None:
            self.start += self.offset
            self.length -= self.offset
        if self.kept is not None:
            del self.kept[:]
        self.offset = 0

    def finish(self) -> bytearray | None:
        """The bytes from offset 0 to the cursor (None with a rows consumer), once the file
        is proven to end there."""
        end = self.offset
        if self.length is not None and end != self.length:
            raise trailing(end, self.length)
        if self._read(1):
            raise StateError(f"state blob has trailing bytes after byte {end} "
                             + ("(the file grew while it was read)" if self.length is not None else
                                f"(the stream goes on past the {end} bytes its headers claim)"))
        if self.kept is not None or self.rows is not None:
            return self.kept   # a stream is never read past what a header claims: exactly the blob
        self.file.seek(self.start)
        data = bytearray(end)
        view = memoryview(data)
        got = 0
        for piece in self._pieces(end):
            view[got:got + len(piece)] = piece
            got += len(piece)
        view.release()
        if got < end:
            raise StateError(f"state blob truncated: the file shrank to {got} of {end} bytes while it was read")
        return data


def _truncation(field: str) -> Any:
    return lambda at, n, length: truncated(field, at, n, length)


def read_rest(file: Any, cache: Geometry | None = None, seq_id: int = -1) -> bytearray:
    """The blob of ``state_read_from``: one blob from a binary file's position to its end.

    Reads only what the blob's headers claim (and one byte more to prove the
    file ends there), so ``/dev/zero``, an endless pipe or a huge file with a
    short header are rejected without reading them; with ``cache`` every
    check of ``parse_blob`` is made on the way, which bounds the read by the
    cache's own state size.
    """
    data: bytearray = read_file(file, "state_read_from", cache, seq_id, sequence_file=False).data
    return data


def _seq_file_header(reader: Any, max_tokens: int = MAX_TOKENS) -> tuple[np.ndarray, SeqFileFormat]:
    """The tokens and framing of a state file's header (one of ``FILE_FORMATS``); leaves the
    reader after the tokens."""
    header = _FILE_HEADER
    head = reader.take(header.size, lambda at, n, length: StateError(
        f"sequence file truncated: {length} bytes, the header needs {header.size}"))
    fields = dict(zip(header.names, header.unpack(head), strict=True))
    magic, version, n_tokens = fields["magic"], fields["version"], fields["n_token_count"]
    same_magic = [framing for framing in FILE_FORMATS if framing.magic == magic]
    if not same_magic:
        raise StateError(f"not a sequence file: magic 0x{magic:08x} at byte {header.offset('magic')}, "
                         f"expected 0x{GGSQ.magic:08x} ('ggsq') or 0x{GGSN.magic:08x} ('ggsn')")
    framing = next((framing for framing in same_magic if framing.version == version), None)
    if framing is None:
        kind = "sequence file" if magic == GGSQ.magic else "session file"
        raise StateError(f"{kind} version {version} at byte {header.offset('version')}, "
                         f"expected {' or '.join(str(framing.version) for framing in same_magic)}")
    count_at = header.offset("n_token_count")
    if n_tokens > max_tokens:
        raise StateError(f"sequence file has {n_tokens} tokens (count at byte {count_at}), more than "
                         f"max_tokens {max_tokens}")
    tokens = reader.take(4 * n_tokens, lambda at, n, length: StateError(
        f"sequence file truncated: {n_tokens} tokens (count at byte {count_at}) need {n} bytes, "
        f"{length - at} left"))
    return np.frombuffer(tokens, dtype="<i4").astype(np.int32), framing


def _file_magic(head: bytes) -> bool:
    """Whether a file's first bytes are a state file's magic (its first field, a u32)."""
    return len(head) == 4 and any(head == framing.magic.to_bytes(4, "little") for framing in FILE_FORMATS)


def parse_seq_file_header(data: Any, max_tokens: int = MAX_TOKENS) -> tuple[np.ndarray, int]:
    """The tokens of a 'ggsq' sequence file in memory and the offset where its state blob starts."""
    reader = _Reader(blob_view(data))
    tokens, _ = _seq_file_header(reader, max_tokens)
    return tokens, reader.offset


def _arch_name(head: bytes) -> str | None:
    """The architecture name when ``head`` begins with an architecture string, else None."""
    if len(head) < ARCH_LENGTH.size:
        return None
    (length,) = ARCH_LENGTH.unpack_from(head)
    name = head[ARCH_LENGTH.size:ARCH_LENGTH.size + length]
    if not MIN_ARCH <= length <= MAX_ARCH or len(name) != length or not set(name) <= _ARCH_CHARS:
        return None
    return name.decode("ascii")


def _read_arch(reader: Any, arch: str | None) -> str:
    """The architecture string at the cursor (it must be one), checked against ``arch``."""
    at = reader.offset
    name = _arch_name(reader.peek(ARCH_LENGTH.size + MAX_ARCH))
    if name is None:
        (length,), _ = reader.unpack(ARCH_LENGTH, "architecture string length")
        raise StateError(f"the architecture string at byte {at} is not a name (length {length}, "
                         f"expected {MIN_ARCH} to {MAX_ARCH} lower-case letters, digits, '-', '_', '.')")
    if arch is not None and name != arch:
        raise StateError(f"state is for architecture {name!r} (string at byte {at}), "
                         f"the caller's model is {arch!r}")
    reader.take(ARCH_LENGTH.size + len(name), _truncation("architecture string"))
    return name


@dataclass(frozen=True)
class Framing:
    """What came before the memory section: the framing's name (``BARE``, ``SEQ_BLOB``,
    ``CONTEXT_BLOB`` or a ``SeqFileFormat``'s name), the tokens of a file, the source seq id of
    a llama sequence blob, the architecture name, and the attention KV section's span."""

    name: str
    tokens: np.ndarray | None = None
    source_seq_id: int | None = None
    arch: str | None = None
    kv_offset: int | None = None        # where a hybrid's KV section starts (None: not read)
    section_offset: int = 0             # where the recurrent memory section starts

    @property
    def whole(self) -> bool | None:
        """True when the framing holds the whole cache, False one sequence, None: the bytes say neither."""
        if self.name in (SEQ_BLOB, GGSQ.name, GGSQ_V2.name):
            return False
        if self.name in (CONTEXT_BLOB, GGSN.name):
            return True
        return None


def _read_framing(reader: Any, seq_id: int | None, arch: str | None, kv_section: bool,
                  max_tokens: int = MAX_TOKENS, sequence_file: bool | None = None) -> Framing:
    """Read every framing field up to the recurrent memory section (see ``Framing``).

    ``seq_id`` None: any framing (``inspect``); -1: one of the whole cache; >= 0: one of a
    sequence.  ``sequence_file`` True: a state file is required, False: a blob, None: either.
    """
    tokens, source, name = None, None, None
    head = reader.peek(4)
    if sequence_file or (sequence_file is None and _file_magic(head)):
        tokens, file_format = _seq_file_header(reader, max_tokens)
        framing = file_format.name
        if file_format.arch_string:
            name = _read_arch(reader, arch)
    elif len(head) == 4 and struct.unpack("<I", head)[0] == SEQ_BLOB_MAGIC:
        (_, source), _ = reader.unpack(SEQ_BLOB_HEADER, "sequence blob header (magic and seq id)")
        framing = SEQ_BLOB
    elif _arch_name(reader.peek(ARCH_LENGTH.size + MAX_ARCH)) is not None:
        name = _read_arch(reader, arch)
        framing = CONTEXT_BLOB
    else:
        framing = BARE
    result = Framing(framing, tokens, source, name)
    if seq_id is not None and result.whole is not None and result.whole != (seq_id < 0):
        raise StateError(f"a {framing} holds " + ("the whole cache: read it with seq_id -1" if result.whole else
                                                   "one sequence: read it with a seq_id >= 0, not -1"))
    kv_at = None
    if kv_section:
        kv_at = reader.offset
        _skip_kv_section(reader, seq_id)
    return Framing(framing, tokens, source, name, kv_at, reader.offset)


def _skip_kv_section(reader: Any, seq_id: int | None) -> None:
    """Step over llama.cpp's attention KV section (docs/llamacpp_formats.md), checking that it
    is whole and, for a sequence (``seq_id >= 0``), that every cell lists exactly one seq id."""
    (n_stream,), _ = reader.unpack(KV_STREAMS, "KV section n_stream")
    for stream in range(n_stream):
        where = f"KV section stream {stream}"
        (cell_count,), _ = reader.unpack(CELL_COUNT, f"{where} cell_count")
        if cell_count == 0:
            continue
        for i in range(cell_count):
            (_, n_seq_id), at = reader.unpack(CELL, f"{where} cell {i} pos and n_seq_id")
            if seq_id is not None and seq_id >= 0 and n_seq_id != 1:
                raise StateError(f"{where} cell {i} has n_seq_id {n_seq_id} at byte {at + 4} "
                                 f"(a sequence's KV cell lists one seq id)")
            reader.ids(n_seq_id, f"{where} cell {i} seq ids")
        (v_trans, n_layer), at = reader.unpack(KV_DATA_HEADER, f"{where} v_trans and n_layer")
        if v_trans not in (0, 1):
            raise StateError(f"{where} v_trans is {v_trans} at byte {at}, expected 0 or 1")
        for il in range(n_layer):
            (_, row_bytes), _ = reader.unpack(TENSOR_HEADER, f"{where} layer {il} K type and row size")
            reader.skip(cell_count * row_bytes, f"{where} layer {il} K rows")
        for il in range(n_layer):
            if v_trans:
                (_, element_bytes, n_embd), _ = reader.unpack(
                    KV_V_TRANS_HEADER, f"{where} layer {il} V type, element size and width")
                reader.skip(n_embd * cell_count * element_bytes, f"{where} layer {il} V rows")
            else:
                (_, row_bytes), _ = reader.unpack(TENSOR_HEADER, f"{where} layer {il} V type and row size")
                reader.skip(cell_count * row_bytes, f"{where} layer {il} V rows")


@dataclass(frozen=True)
class Unframed:
    """A blob or file in memory split at its memory section: ``framing`` and ``section``
    (a zero-copy view of the recurrent memory section)."""

    framing: Framing
    section: memoryview


def unframe(data: Any, seq_id: int | None = None, arch: str | None = None, kv_section: bool = False,
            max_tokens: int = MAX_TOKENS, bare: bool = False) -> Unframed:
    """Find the framing of ``data`` (any of them, see ``Framing``) without being told which;
    ``StateError`` naming the field and byte offset of a damaged header.  ``kv_section``: the
    state is a hybrid model's, whose memory begins with an attention KV section (skipped).
    ``bare``: the caller knows ``data`` is a memory section; nothing is detected."""
    reader = _Reader(blob_view(data))
    if bare:
        return Unframed(Framing(BARE), reader.data)
    framing = _read_framing(reader, seq_id, arch, kv_section, max_tokens)
    return Unframed(framing, reader.data[reader.offset:])


def in_section(exc: StateError, framing: Framing) -> StateError:
    """A defect of the memory section, placed in the framed bytes."""
    if not framing.section_offset:
        return exc
    return StateError(f"the state blob at byte {framing.section_offset}: {exc}")


@dataclass(frozen=True)
class FileContents:
    """A state blob or file, read and checked."""

    tokens: np.ndarray | None    # a state file's tokens (int32); None for a blob
    blob_offset: int             # where the recurrent memory section starts in the file
    blob: Blob
    data: Any                    # the section's bytes (bytes-like); None when read with ``rows``
    framing: Framing


def read_file(file: Any, op: str, cache: Geometry | None = None, seq_id: int | None = -1,
              sequence_file: bool | None = None, watch: Any = None, rows: Any = None,
              max_tokens: int = MAX_TOKENS, arch: str | None = None, kv_section: bool = False) -> FileContents:
    """Read a blob (``sequence_file=False``), a state file (True) or either (None: by its magic)
    in any framing (``_read_framing``) from a binary file's position to its end, with every
    check of ``parse_blob`` on its memory section.

    Only what the headers claim is read, and one byte more to prove the file
    ends there: ``/dev/zero``, an endless FIFO or a huge file with a short
    header are rejected after a few bytes.  With ``cache`` the claims are
    checked against the cache on the way (a sequence blob of one cell, the
    cache's row sizes), so no more than the cache's own state is ever read.
    A defect of the memory section is reported at its offset in the file;
    a state file with more than ``max_tokens`` tokens is refused at its header.
    ``watch`` and ``rows`` are for ``inspect`` (``seq_id`` None: any framing): ``watch`` sees
    the headers before any row (see ``_parse``), ``rows(piece)`` takes the rows as they are
    read, which are then not kept (``data`` is None).
    """
    _check_file(file, op, "read", "reading")
    reader = _FileReader(file, op, rows)
    framing = _read_framing(reader, seq_id, arch, kv_section, max_tokens, sequence_file)
    blob_offset = reader.offset
    reader.rebase()
    try:
        blob = _parse(reader, cache, -1 if seq_id is None else seq_id, watch)
        data = reader.finish()
    except StateError as exc:
        raise in_section(exc, framing) from None
    return FileContents(framing.tokens, blob_offset, blob, data, framing)
