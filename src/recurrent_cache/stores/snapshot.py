"""Snapshot entries: the bytes a store keeps for one sequence state, and their keys.

An *entry* is a 'ggsq' sequence file (docs/concepts.md §5: what llama.cpp's
``llama_state_seq_save_file`` writes — magic, version 3, the prefix's tokens,
the one-cell state blob; entries of version 2, written before llama.cpp moved
to 3, are still read) followed by a 32-byte *trailer*::

    ggsq file                       n bytes
    trailer:  b"rcS1"               4 bytes   trailer magic and version
              u32 crc32             4 bytes   CRC-32 of the n bytes of the ggsq file
              u64 n                 8 bytes   length of the ggsq file
              u8[16] key digest    16 bytes   sha256(key)[:16]: the key the entry was written under

The trailer is at the end, so the ggsq file is a prefix of the entry.  The
digest binds an entry to its key (and so to the namespace, the geometry and
the tokens the key is made of): bytes found under another key, however intact,
are a foreign entry.  A ``DirectoryStore`` keeps the ggsq file as the file's
whole content and the trailer in the file's name, so its files stay exactly
llama.cpp's format (see ``directory.py``); a ``RedisStore`` keeps the entry.

CRC-32 is there to catch accidents (a truncated or damaged value, a partial
write, a power cut), not an adversary: whoever can write the store can write a
state.  zlib.crc32 runs at about 3.6 GiB/s on the 2-core machine, sha256 at 1.6 GiB/s.
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from typing import Any
from collections.abc import Callable, Sequence

import numpy as np

from .. import _args
from ..errors import ArgumentError
from ..formats.blob import seq_file_header, sequence_blob_header
from ..formats.geometry import Geometry
from ..formats.layouts import (CELL, CELL_COUNT, DATA_HEADER, GGSQ, GGSQ_V2, KV_DATA_HEADER, KV_STREAMS,
                               KV_V_TRANS_HEADER, MAX_TOKENS, TENSOR_HEADER, SeqFileFormat)

__all__ = ["Geometry", "snapshot_key", "encode_snapshot", "decode_snapshot", "check_entry", "hybrid_key_text",
           "encode_hybrid_snapshot", "decode_hybrid_snapshot",
           "sequence_rows", "restore_rows", "prefix_keys", "ggsq_declared_length",
           "entry_ggsq_length", "key_digest", "make_trailer", "TRAILER_SIZE"]

TRAILER_MAGIC = b"rcS1"
_TRAILER = struct.Struct("<4sIQ16s")   # magic, crc32, ggsq length, key digest
TRAILER_SIZE = _TRAILER.size


def snapshot_key(namespace: str, geometry: Geometry, tokens: Any) -> str:
    """The store key of the state after ``tokens`` in model ``namespace`` for ``geometry``.

    ``namespace`` is the model's identity and the caller's responsibility:
    two models that share a namespace and a geometry would exchange states
    that mean nothing to each other.  Use something that changes whenever the
    weights do — a hash of the GGUF file, a model name with its revision (the
    demo uses the GGUF file's sha256, or the random model's seed and shape).
    The key is ``"rc2:"`` and a sha256 of the namespace, the geometry
    (``Geometry.key_text``: not the cache's size) and the tokens: safe as a file name and as a Redis key.
    """
    token_array = _args.tokens(tokens)
    return prefix_keys(namespace, geometry, token_array, [token_array.size])[0]


def prefix_keys(namespace: str, geometry: Geometry, tokens: Any, lengths: Sequence[int],
                attention: str | None = None) -> list[str]:
    """``snapshot_key(namespace, geometry, tokens[:n])`` for every ``n`` of ``lengths``, in that order.

    The tokens are hashed once, whatever the number of lengths: the hashed
    message is the length-prefixed namespace and geometry, then the tokens,
    then their byte count (last, so that the hash of every prefix is a copy
    of one running hash; the message still parses one way only).
    ``attention``: a hybrid memory's KV layout (``hybrid_key_text``), hashed as
    one more length-prefixed part after the geometry; a recurrent cache's keys
    (None) are as they always were.
    """
    _args.text(namespace, "namespace")
    if not isinstance(geometry, Geometry):
        raise ArgumentError(f"geometry must be a Geometry, got {type(geometry).__name__}")
    token_bytes = memoryview(_args.tokens(tokens).tobytes())
    n_tokens = len(token_bytes) // 4
    for n in lengths:
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 0 <= n <= n_tokens:
            raise ArgumentError(f"prefix length {n!r} is outside [0, {n_tokens}]")
    running = hashlib.sha256()
    parts = [namespace.encode("utf-8", "surrogatepass"), geometry.key_text().encode()]
    if attention is not None:
        parts.append(attention.encode())
    for part in parts:
        running.update(struct.pack("<Q", len(part)))
        running.update(part)
    keys: dict[int, str] = {}
    done = 0
    for n in sorted(set(int(n) for n in lengths)):
        running.update(token_bytes[4 * done:4 * n])
        done = n
        digest = running.copy()
        digest.update(struct.pack("<Q", 4 * n))
        keys[n] = "rc2:" + digest.hexdigest()
    return [keys[int(n)] for n in lengths]


def _ggsq_length(n_tokens: int, geometry: Geometry) -> int:
    """Length of the ggsq file of a snapshot of ``n_tokens`` tokens: header, tokens, one-cell blob."""
    return GGSQ.header.size + 4 * n_tokens + geometry.sequence_blob_size()


def _ggsq_head(token_array: np.ndarray, geometry: Geometry, framing: SeqFileFormat = GGSQ) -> bytes:
    """The bytes of a snapshot's ggsq file before its first tensor header: the file's header
    (``framing``: version 3, or 2 for an entry written before), the tokens, the one-cell blob's
    cell and layer count (its pos is the last token's)."""
    n_tokens = token_array.size
    return (seq_file_header(n_tokens, framing) + token_array.tobytes()
            + sequence_blob_header(n_tokens - 1, geometry.n_layer))


def key_digest(key: str) -> bytes:
    """The 16 bytes of the trailer that bind an entry to ``key``."""
    if not isinstance(key, str):
        raise ArgumentError(f"a store key is a str (from snapshot_key), got {type(key).__name__}")
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()[:16]


def make_trailer(crc: int, ggsq_length: int, digest: bytes) -> bytes:
    """The 32-byte trailer of an entry (see the module docstring)."""
    return _TRAILER.pack(TRAILER_MAGIC, crc, ggsq_length, digest)


def encode_snapshot(key: str, tokens: Any, r_rows: Sequence[Any], s_rows: Sequence[Any],
                    geometry: Geometry) -> bytearray:
    """The entry for the state after ``tokens`` (its pos is ``len(tokens) - 1``) under ``key``.

    ``r_rows[k]`` / ``s_rows[k]`` are the rows of the k-th layer with state
    (``geometry.state_layers[k]``; every layer unless filtered), numpy arrays of
    the cache's dtype (``cache.r[il][row]``): a list over the filtered layers, as
    ``cache.seq_state`` returns and ``cache.seq_restore`` takes them, and in the
    order of the blob's sections.  The ggsq part is byte for byte
    what ``rc.save_seq_file`` writes for a sequence holding that state.  The
    rows are copied once, into the entry.
    """
    token_array = _args.tokens(tokens)
    if token_array.size == 0:
        raise ArgumentError("a snapshot needs at least one token (the state after no token is zeros)")
    rows = geometry.check_rows(r_rows, "r") + geometry.check_rows(s_rows, "s")
    n_tokens = token_array.size
    head = _ggsq_head(token_array, geometry)
    entry = bytearray(_ggsq_length(n_tokens, geometry) + TRAILER_SIZE)
    view = memoryview(entry)
    entry_bytes = np.frombuffer(entry, dtype=np.uint8)   # the same memory, for numpy's row copies
    view[:len(head)] = head
    offset = len(head)
    for type_id, row_bytes, row in zip(geometry.type_ids, geometry.row_bytes, rows, strict=True):
        TENSOR_HEADER.pack_into(entry, offset, type_id, row_bytes)
        offset += TENSOR_HEADER.size
        entry_bytes[offset:offset + row_bytes] = row.view(np.uint8).reshape(-1)
        offset += row_bytes
    view[offset:] = make_trailer(zlib.crc32(view[:offset]), offset, key_digest(key))
    return entry


def hybrid_key_text(cache: Any) -> str:
    """What a store key holds of a ``HybridCache``'s attention half (its recurrent half is its
    ``Geometry``): the attention layers, K / V widths and types, and V's layout."""
    return (f"attn_layers={','.join(map(str, cache.attn_layers))};n_embd_k={cache.n_embd_k};"
            f"n_embd_v={cache.n_embd_v};dtype_k={cache.dtype_k};dtype_v={cache.dtype_v};v_trans={int(cache.v_trans)}")


def encode_hybrid_snapshot(key: str, tokens: Any, blob: Any) -> bytearray:
    """The entry for a hybrid sequence's state after ``tokens`` under ``key``: the ggsq file
    ``llama_state_seq_save_file`` writes for it — header, tokens, then ``blob``, the sequence's
    state (``HybridCache.state_write(seq)``: its KV section, then its recurrent section) — and
    the trailer."""
    token_array = _args.tokens(tokens)
    if token_array.size == 0:
        raise ArgumentError("a snapshot needs at least one token (the state after no token is zeros)")
    data = memoryview(blob).cast("B")
    head = seq_file_header(token_array.size) + token_array.astype("<i4").tobytes()
    entry = bytearray(len(head) + len(data) + TRAILER_SIZE)
    view = memoryview(entry)
    view[:len(head)] = head
    end = len(head) + len(data)
    view[len(head):end] = data
    view[end:] = make_trailer(zlib.crc32(view[:end]), end, key_digest(key))
    return entry


def decode_hybrid_snapshot(entry: Any, key: str, tokens: Any, *, verify_crc: bool = True) -> memoryview | None:
    """The sequence state (a view of ``entry``) of an intact hybrid entry written under ``key`` for
    exactly ``tokens``; None for anything else (damaged, foreign, another token list).  The state
    itself is checked by ``HybridCache.state_read``, which changes nothing when it refuses it."""
    try:
        view = memoryview(entry).cast("B")
    except TypeError:
        return None
    token_array = _args.tokens(tokens)
    intact = check_entry(key, view) if verify_crc else entry_ggsq_length(key, view) is not None
    if token_array.size == 0 or not intact:
        return None
    head = seq_file_header(token_array.size) + token_array.astype("<i4").tobytes()
    if len(view) - TRAILER_SIZE < len(head) or view[:len(head)] != head:
        return None
    return view[len(head):len(view) - TRAILER_SIZE]


def ggsq_declared_length(read_at: Callable[[int, int], bytes], file_size: int) -> int | None:
    """The length a ggsq file of ``file_size`` bytes says it has, from its headers alone; None if
    they are not a snapshot's.

    ``read_at(offset, n)`` returns up to ``n`` bytes of the file at ``offset``.
    A recurrent snapshot: reads the file header, the blob header and the first
    r and s tensor headers (every layer's rows of one kind have one size in a
    snapshot): four small reads, however large the file.  A hybrid snapshot
    (``encode_hybrid_snapshot``: a KV section before the recurrent one): also
    the KV section's cell list (one read) and two tensor headers per attention
    layer.  For a store that meets files it did not write and must not read
    more than an entry can be.  A layer filter writes fewer sections than
    ``n_layer`` and the headers do not say how many: a count (at most
    ``n_layer``) must fill ``file_size`` exactly with the s header where that
    count puts it.
    """
    def unpack(layout: struct.Struct, offset: int) -> tuple[Any, ...] | None:
        data = read_at(offset, layout.size)
        return layout.unpack(data) if len(data) == layout.size else None

    file_header = unpack(GGSQ.header, 0)
    if file_header is None or file_header[:2] not in ((GGSQ.magic, GGSQ.version), (GGSQ_V2.magic, GGSQ_V2.version)):
        return None
    blob_at = GGSQ.header.size + 4 * file_header[2]
    length = _recurrent_section_length(unpack, blob_at, file_size)
    if length is None:
        recurrent_at = _kv_section_end(unpack, read_at, blob_at, file_size)
        length = None if recurrent_at is None else _recurrent_section_length(unpack, recurrent_at, file_size)
    return length


def _recurrent_section_length(unpack: Callable[[struct.Struct, int], tuple[Any, ...] | None], blob_at: int,
                              file_size: int) -> int | None:
    """The end of a one-cell recurrent section at ``blob_at`` that ends the file, or None."""
    # a snapshot's blob: one cell (pos, no seq ids), then v_trans and n_layer
    cell_count = unpack(CELL_COUNT, blob_at)
    if cell_count is None or cell_count[0] != 1:
        return None
    data_at = blob_at + CELL_COUNT.size + CELL.size
    data_header = unpack(DATA_HEADER, data_at)
    if data_header is None:
        return None
    n_layer = data_header[1]
    tensors_at = data_at + DATA_HEADER.size
    if file_size == tensors_at:   # no layer, or a filter that keeps none
        return int(tensors_at)
    if n_layer == 0:
        return None
    r_header = unpack(TENSOR_HEADER, tensors_at)
    if r_header is None:
        return None
    # n sections of r and of s fill the file when (file_size - tensors_at) / n - 24 - r_bytes is the
    # s row size the s header at n * (12 + r_bytes) records; n_layer (unfiltered) is tried first,
    # and a count that does not divide the rest costs no read
    rest = file_size - tensors_at
    for n_state in range(n_layer, 0, -1):
        s_bytes = rest // n_state - 2 * TENSOR_HEADER.size - r_header[1]
        if rest % n_state or s_bytes < 0:
            continue
        s_header = unpack(TENSOR_HEADER, tensors_at + n_state * (TENSOR_HEADER.size + r_header[1]))
        if s_header is not None and s_header[1] == s_bytes:
            return int(file_size)
    return None


def _kv_section_end(unpack: Callable[[struct.Struct, int], tuple[Any, ...] | None],
                    read_at: Callable[[int, int], bytes], at: int, file_size: int) -> int | None:
    """Where one sequence's KV section at ``at`` ends (one stream, every cell of one seq id, as
    ``HybridCache.state_write(seq)`` writes it), from its headers; None when it is not one or
    does not fit in the file."""
    streams = unpack(KV_STREAMS, at)
    cell_count = unpack(CELL_COUNT, at + KV_STREAMS.size)
    if streams is None or cell_count is None or streams[0] != 1 or not 1 <= cell_count[0] <= MAX_TOKENS:
        return None
    n_cells = cell_count[0]
    at += KV_STREAMS.size + CELL_COUNT.size
    cell_bytes = n_cells * (CELL.size + 4)   # pos, n_seq_id = 1, the seq id
    if at + cell_bytes > file_size:
        return None
    cells = np.frombuffer(read_at(at, cell_bytes), dtype="<u4")
    if cells.size != 3 * n_cells or not (cells[1::3] == 1).all():
        return None
    at += cell_bytes
    header = unpack(KV_DATA_HEADER, at)
    if header is None or header[0] not in (0, 1):
        return None
    v_trans, n_layer = header
    at += KV_DATA_HEADER.size
    for kind in range(2 * n_layer):
        if kind >= n_layer and v_trans:
            v_header = unpack(KV_V_TRANS_HEADER, at)
            if v_header is None:
                return None
            at += KV_V_TRANS_HEADER.size + v_header[2] * n_cells * v_header[1]
        else:
            k_header = unpack(TENSOR_HEADER, at)
            if k_header is None:
                return None
            at += TENSOR_HEADER.size + n_cells * k_header[1]
        if at > file_size:
            return None
    return int(at)


def entry_ggsq_length(key: str, entry: Any) -> int | None:
    """Length of the ggsq part of an entry whose trailer is intact and names ``key``; else None.

    Checks the trailer only (no checksum over the content): cheap.
    """
    view = memoryview(entry).cast("B")
    if len(view) < TRAILER_SIZE:
        return None
    magic, _, length, digest = _TRAILER.unpack_from(view, len(view) - TRAILER_SIZE)
    if magic != TRAILER_MAGIC or length != len(view) - TRAILER_SIZE or digest != key_digest(key):
        return None
    return int(length)


def check_entry(key: str, entry: Any) -> bool:
    """True when ``entry`` is whole and was written under ``key``: trailer, length, CRC-32."""
    length = entry_ggsq_length(key, entry)
    if length is None:
        return False
    view = memoryview(entry).cast("B")
    (crc,) = struct.unpack_from("<I", view, length + 4)
    return bool(zlib.crc32(view[:length]) == crc)


def decode_snapshot(entry: Any, key: str, geometry: Geometry, tokens: Any, *,
                    verify_crc: bool = True) -> tuple[list[np.ndarray], list[np.ndarray]] | None:
    """The rows ``(r_rows, s_rows)`` an entry holds, or None when it is not the state asked for.

    None for anything but an intact entry written under ``key`` for exactly
    ``geometry`` and ``tokens``: a truncated or damaged entry (trailer,
    length, CRC-32), a foreign one (another key: another namespace, geometry
    or token list), or a ggsq file whose header, tokens or blob differ in any
    field from what ``encode_snapshot`` would write.  Never raises for the
    bytes of the entry; the rows are views into ``entry``.

    ``verify_crc=False`` skips only the CRC-32 over the content (everything
    else is still checked): for an entry a store's ``get_first`` /
    ``get_many`` just returned, which checked it already — at 64 MiB the
    CRC costs about 18 ms.
    """
    try:
        view = memoryview(entry).cast("B")
    except TypeError:
        return None
    token_array = _args.tokens(tokens)
    if not (check_entry(key, view) if verify_crc else entry_ggsq_length(key, view) is not None):
        return None
    n_tokens = token_array.size
    if n_tokens == 0:
        return None
    # everything before the first row is what encode_snapshot writes for these tokens, byte for byte
    head = _ggsq_head(token_array, geometry)
    if len(view) - TRAILER_SIZE != _ggsq_length(n_tokens, geometry):
        return None
    if view[:len(head)] != head and view[:len(head)] != _ggsq_head(token_array, geometry, GGSQ_V2):
        return None
    offset = len(head)
    rows: list[np.ndarray] = []
    n_state = geometry.n_state_layers
    dtypes = (geometry.type_r.numpy,) * n_state + (geometry.type_s.numpy,) * n_state
    for type_id, row_bytes, dtype in zip(geometry.type_ids, geometry.row_bytes, dtypes, strict=True):
        if TENSOR_HEADER.unpack_from(view, offset) != (type_id, row_bytes):
            return None
        offset += TENSOR_HEADER.size
        rows.append(np.frombuffer(view, dtype=np.uint8, count=row_bytes, offset=offset).view(dtype))
        offset += row_bytes
    return rows[:n_state], rows[n_state:]


# -- between a cache's rows and a snapshot -------------------------------------------

def sequence_rows(cache: Any, seq: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Host copies (numpy, whatever the cache's storage) of the rows holding sequence ``seq``'s
    state (one per layer with state), for ``encode_snapshot``.

    Reads the row of the sequence's cell (``src``: where its data lives; a
    cell that has none yet means zeros).  ``seq`` must hold a cell.
    """
    if cache.seq_cell(seq) < 0:
        raise ArgumentError(f"sequence {seq} holds no cell: there is no state to snapshot")
    r_rows, s_rows = cache.seq_state(seq)
    storage = cache.storage

    def host(row: Any) -> np.ndarray:
        return row if isinstance(row, np.ndarray) else storage.to_host(row)
    return [host(row) for row in r_rows], [host(row) for row in s_rows]


def restore_rows(cache: Any, seq: int, n_tokens: int, r_rows: Sequence[np.ndarray],
                 s_rows: Sequence[np.ndarray]) -> int:
    """Give ``seq`` (holding no cell) the state after ``n_tokens`` tokens; returns its row.

    Placed as ``state_read`` of the one-cell blob would place it, holding the rows byte
    for byte (``cache.seq_restore``: every row is checked before anything changes).
    """
    return int(cache.seq_restore(seq, n_tokens - 1, r_rows, s_rows))
