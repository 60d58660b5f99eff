"""llama.cpp's attention KV section as data: ``read_kv_section`` parses it, ``compose_kv_section``
writes the same bytes back (docs/llamacpp_formats.md, "KV section").

A hybrid model's state starts with this section (``llama_kv_cache::state_write``), then the
recurrent one.  ``read_kv_section`` is the one reader of it: ``formats.framings`` calls it to step
over the section (``keep=False``: nothing kept, a stream's rows read in pieces and dropped), and
``parse_kv_section`` keeps it as a ``KvSection`` whose rows are numpy views of the bytes it was
given.  Every count is bounded before what it counts is read, and every defect is a
``StateError`` worded in ``formats.messages``.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import StateError
from .blob import MemoryReader, blob_view, charge_skip
from .geometry import Geometry
from .layouts import (CELL, CELL_COUNT, KV_CELL_EXT, KV_DATA_HEADER, KV_STREAMS, KV_V_TRANS_HEADER, MAX_TOKENS,
                      TENSOR_HEADER)
from .messages import kv_count_too_large, kv_sequence_n_seq_id, kv_v_trans, trailing

__all__ = ["KvCell", "KvTensor", "KvTensorHeader", "KvStream", "KvSection", "read_kv_section", "parse_kv_section",
           "compose_kv_section"]


@dataclass(frozen=True)
class KvCell:
    """One KV cell as written: its position, its sequences (ascending; a sequence's own section
    lists the source sequence only) and, for M-RoPE / n-gram models, ``KV_CELL_EXT`` (x, y, token)."""

    pos: int
    seq_ids: tuple[int, ...]
    ext: tuple[int, int, int] | None = None


@dataclass(frozen=True)
class KvTensor:
    """One layer's K or V rows of a stream.

    Not transposed (every K, and V with flash attention): ``rows`` is (cell_count, row_bytes)
    uint8, one row per cell, and ``n_embd`` is None.  Transposed V (``v_trans``, flash attention
    off): ``row_bytes`` is the size of one element, ``n_embd`` the layer's V width, and ``rows`` is
    (n_embd, cell_count * row_bytes): one run of the cells' values per dimension, as written."""

    type_id: int
    row_bytes: int
    rows: np.ndarray
    n_embd: int | None = None

    @property
    def transposed(self) -> bool:
        return self.n_embd is not None

    def by_cell(self) -> np.ndarray:
        """The rows one per cell, (cell_count, bytes per cell) uint8: a view when not transposed,
        a copy gathered across the dimension runs when transposed."""
        if self.n_embd is None:
            return self.rows
        n_cells = self.rows.shape[1] // self.row_bytes if self.row_bytes else 0
        per_dim = self.rows.reshape(self.n_embd, n_cells, self.row_bytes)
        return np.ascontiguousarray(per_dim.transpose(1, 0, 2)).reshape(n_cells, self.n_embd * self.row_bytes)


@dataclass(frozen=True)
class KvTensorHeader:
    """What a K or V tensor's header says, without its rows: as ``KvTensor`` (``n_embd`` None:
    not transposed, ``row_bytes`` one cell's row; else ``row_bytes`` one element)."""

    type_id: int
    row_bytes: int
    n_embd: int | None = None


@dataclass(frozen=True)
class KvStream:
    """One stream's cells and rows.  A stream without cells writes its count only: ``v_trans``
    False, no tensors."""

    cells: tuple[KvCell, ...]
    v_trans: bool = False
    k: tuple[KvTensor, ...] = ()
    v: tuple[KvTensor, ...] = ()

    @property
    def n_layer(self) -> int:
        return len(self.k)


@dataclass(frozen=True)
class KvSection:
    """A KV section: its streams (one with a unified cache, else one per sequence) and whether its
    cells carry ``KV_CELL_EXT``; ``nbytes`` is its length in the bytes it was read from."""

    streams: tuple[KvStream, ...]
    cell_ext: bool
    nbytes: int


def _bound(where: str, field: str, value: int, at: int, bound: int, bound_name: str) -> None:
    if value > bound:
        raise kv_count_too_large(where, field, value, at, bound, bound_name)


def _rows(reader: Any, shape: tuple[int, int], field: str, keep: bool) -> np.ndarray | None:
    """Step over a (rows, bytes per row) block (charged against ``MAX_SKIPPED_BYTES``); a uint8
    view of it when kept."""
    n = shape[0] * shape[1]
    at = reader.step_over(n, field)
    return np.frombuffer(reader.data[at:at + n], dtype=np.uint8).reshape(shape) if keep else None


def _read_tensors(reader: Any, where: str, n_layer: int, cell_count: int, v_trans: bool, keep: bool,
                  headers: list[list[KvTensorHeader]] | None) -> tuple[tuple[KvTensor, ...], tuple[KvTensor, ...]]:
    """The K then V tensors of a stream (kept only with ``keep``); their headers appended to
    ``headers`` (K, V) when given."""
    k, v = [], []
    for il in range(n_layer):
        (type_id, row_bytes), _ = reader.unpack(TENSOR_HEADER, f"{where} layer {il} K type and row size")
        if headers is not None:
            headers[0].append(KvTensorHeader(type_id, row_bytes))
        rows = _rows(reader, (cell_count, row_bytes), f"{where} layer {il} K rows", keep)
        if rows is not None:
            k.append(KvTensor(type_id, row_bytes, rows))
    for il in range(n_layer):
        n_embd = None
        if v_trans:
            (type_id, row_bytes, n_embd), _ = reader.unpack(
                KV_V_TRANS_HEADER, f"{where} layer {il} V type, element size and width")
            shape = (n_embd, cell_count * row_bytes)
        else:
            (type_id, row_bytes), _ = reader.unpack(TENSOR_HEADER, f"{where} layer {il} V type and row size")
            shape = (cell_count, row_bytes)
        if headers is not None:
            headers[1].append(KvTensorHeader(type_id, row_bytes, n_embd))
        rows = _rows(reader, shape, f"{where} layer {il} V rows", keep)
        if rows is not None:
            v.append(KvTensor(type_id, row_bytes, rows, n_embd))
    return tuple(k), tuple(v)


def read_kv_section(reader: Any, seq_id: int | None, ext: bool, cache: Geometry | None = None,
                    max_tokens: int = MAX_TOKENS, keep: bool = False, watch: Any = None) -> KvSection | None:
    """Read llama.cpp's attention KV section at the reader's cursor, checking that it is whole
    and, for a sequence (``seq_id >= 0``), that every cell lists exactly one seq id.  ``ext``:
    every cell carries ``KV_CELL_EXT`` after its n_seq_id.  ``keep``: return it as a
    ``KvSection`` (the reader must be a ``MemoryReader``: its rows are views of its bytes);
    otherwise the rows are stepped over and None is returned.

    Every count is bounded before what it counts is read: streams and seq ids by the cache's
    sequences (``cache.size``; llama.cpp's KV cache has one stream per sequence at most), layers
    by the model's (``cache.n_layer``), cells by ``max_tokens`` (a KV cell holds a token of the
    context), and the seq ids and rows it steps over by ``MAX_SKIPPED_BYTES``.

    ``watch`` (optional; ``inspect``) sees each stream once its rows are stepped over, before the
    next is read: ``watch.kv_stream(cells, v_trans, k_headers, v_headers)`` (``KvCell`` and
    ``KvTensorHeader`` tuples; ``v_trans`` False and no headers for a stream without cells)."""
    if keep and not isinstance(reader, MemoryReader):
        raise TypeError("read_kv_section keeps the section only from a MemoryReader")
    start = reader.offset
    (n_stream,), at = reader.unpack(KV_STREAMS, "KV section n_stream")
    if cache is not None:
        _bound("KV section", "n_stream", n_stream, at, cache.size, "the cache's sequences")
    streams = []
    for stream in range(n_stream):
        where = f"KV section stream {stream}"
        (cell_count,), at = reader.unpack(CELL_COUNT, f"{where} cell_count")
        if cell_count == 0:
            streams.append(KvStream(()))
            if watch is not None:
                watch.kv_stream((), False, (), ())
            continue
        _bound(where, "cell_count", cell_count, at, max_tokens, "max_tokens")
        cells = []
        for i in range(cell_count):
            (pos, n_seq_id), at = reader.unpack(CELL, f"{where} cell {i} pos and n_seq_id")
            if seq_id is not None and seq_id >= 0 and n_seq_id != 1:
                raise kv_sequence_n_seq_id(where, i, n_seq_id, at + 4)
            if cache is not None:
                _bound(where, f"cell {i} n_seq_id", n_seq_id, at + 4, cache.size, "the cache's sequences")
            cell_ext = None
            if ext:
                cell_ext, _ = reader.unpack(KV_CELL_EXT, f"{where} cell {i} extended position (x, y, token)")
            field = f"{where} cell {i} seq ids"
            reader.skipped = charge_skip(reader.skipped, 4 * n_seq_id, field, reader.offset)
            ids, _ = reader.ids(n_seq_id, field)
            if keep or watch is not None:
                cells.append(KvCell(pos, tuple(ids), cell_ext))
        (v_trans, n_layer), at = reader.unpack(KV_DATA_HEADER, f"{where} v_trans and n_layer")
        if v_trans not in (0, 1):
            raise kv_v_trans(where, v_trans, at)
        if cache is not None:
            _bound(where, "n_layer", n_layer, at + 4, cache.n_layer, "the model's layers")
        headers: list[list[KvTensorHeader]] | None = None if watch is None else [[], []]
        k, v = _read_tensors(reader, where, n_layer, cell_count, bool(v_trans), keep, headers)
        streams.append(KvStream(tuple(cells), bool(v_trans), k, v))
        if headers is not None:
            watch.kv_stream(tuple(cells), bool(v_trans), tuple(headers[0]), tuple(headers[1]))
    return KvSection(tuple(streams), ext, reader.offset - start) if keep else None


def parse_kv_section(data: Any, seq_id: int = -1, cell_ext: bool = False, cache: Geometry | None = None,
                     max_tokens: int = MAX_TOKENS) -> KvSection:
    """``data`` (any bytes-like object) read whole as one KV section (see ``read_kv_section``):
    ``seq_id`` -1 for a whole context's, >= 0 for a sequence's.  Its rows are views of ``data``."""
    reader = MemoryReader(blob_view(data))
    section = read_kv_section(reader, seq_id, cell_ext, cache, max_tokens, keep=True)
    assert section is not None   # keep=True returns the section
    if reader.offset != reader.length:
        raise trailing(reader.offset, reader.length)
    return section


def _pack_tensor(out: bytearray, tensor: KvTensor, cell_count: int) -> None:
    if tensor.n_embd is None:
        expected: tuple[int, int] = (cell_count, tensor.row_bytes)
        out += TENSOR_HEADER.pack(tensor.type_id, tensor.row_bytes)
    else:
        expected = (tensor.n_embd, cell_count * tensor.row_bytes)
        out += KV_V_TRANS_HEADER.pack(tensor.type_id, tensor.row_bytes, tensor.n_embd)
    if tensor.rows.shape != expected:
        raise StateError(f"KV rows of shape {tensor.rows.shape} for {cell_count} cells, expected {expected}")
    out += np.ascontiguousarray(tensor.rows, dtype=np.uint8).tobytes()


def compose_kv_section(section: KvSection) -> bytes:
    """The bytes llama.cpp writes for ``section``: ``parse_kv_section`` of them gives it back, and
    a parsed section composes to exactly the bytes it was parsed from."""
    out = bytearray(KV_STREAMS.pack(len(section.streams)))
    for stream in section.streams:
        out += CELL_COUNT.pack(len(stream.cells))
        if not stream.cells:
            continue
        for cell in stream.cells:
            out += CELL.pack(cell.pos, len(cell.seq_ids))
            if section.cell_ext:
                if cell.ext is None:
                    raise StateError(f"a KV cell at pos {cell.pos} has no extended position in a section with them")
                out += KV_CELL_EXT.pack(*cell.ext)
            out += struct.pack(f"<{len(cell.seq_ids)}i", *cell.seq_ids)
        if len(stream.v) != len(stream.k):
            raise StateError(f"a KV stream with {len(stream.k)} K layers and {len(stream.v)} V layers")
        out += KV_DATA_HEADER.pack(int(stream.v_trans), stream.n_layer)
        for tensor in stream.k:
            _pack_tensor(out, tensor, len(stream.cells))
        for tensor in stream.v:
            if tensor.transposed != stream.v_trans:
                raise StateError(f"a V tensor {'' if tensor.transposed else 'not '}transposed in a stream with "
                                 f"v_trans {int(stream.v_trans)}")
            _pack_tensor(out, tensor, len(stream.cells))
    return bytes(out)
