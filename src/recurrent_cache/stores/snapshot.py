"""Snapshot entries: the bytes a store keeps for one sequence state, and their keys.

An *entry* is a 'ggsq' sequence file (SPEC.md §5: what llama.cpp's
``llama_state_seq_save_file`` writes — magic, version 2, the prefix's tokens,
the one-cell state blob) followed by a 32-byte *trailer*::

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
from dataclasses import dataclass
from typing import Any
from collections.abc import Callable, Sequence

import numpy as np

from ..errors import ArgumentError

__all__ = ["Geometry", "snapshot_key", "encode_snapshot", "decode_snapshot", "check_entry",
           "sequence_rows", "restore_rows", "prefix_keys", "ggsq_declared_length",
           "entry_ggsq_length", "key_digest", "make_trailer", "TRAILER_SIZE"]

SEQ_FILE_MAGIC = 0x67677371     # 'ggsq', llama.cpp's LLAMA_STATE_SEQ_MAGIC
SEQ_FILE_VERSION = 2            # llama.cpp's LLAMA_STATE_SEQ_VERSION
TRAILER_MAGIC = b"rcS1"
_TRAILER = struct.Struct("<4sIQ16s")   # magic, crc32, ggsq length, key digest
TRAILER_SIZE = _TRAILER.size
_FILE_HEADER = struct.Struct("<III")   # magic, version, n_token_count
_BLOB_HEADER = struct.Struct("<IiIII")  # cell_count = 1, pos, n_seq_id = 0, v_trans = 0, n_layer
_TENSOR_HEADER = struct.Struct("<iQ")  # ggml type id, row bytes

# dtype name -> (ggml type id, element size); the types a cache stores
_GGML = {"f32": (0, 4), "f16": (1, 2), "bf16": (30, 2)}


def _row_dtype(name: str) -> np.dtype:
    """The numpy dtype of a cache's rows of type ``name`` (bf16 as the cache holds it)."""
    if name == "bf16":
        try:
            import ml_dtypes
            bf16: np.dtype = np.dtype(ml_dtypes.bfloat16)
            return bf16
        except ImportError:   # the cache then holds raw uint16 bits, and so do we
            return np.dtype(np.uint16)
    return np.dtype({"f32": "<f4", "f16": "<f2"}[name])


@dataclass(frozen=True)
class Geometry:
    """The shape of one sequence's state: what a snapshot must match to be restored.

    ``dtype_r`` / ``dtype_s`` are the cache's storage type names ("f32",
    "f16", "bf16").  Part of every key: a snapshot never reaches a cache of
    another geometry.
    """

    n_layer: int
    n_embd_r: int
    n_embd_s: int
    dtype_r: str = "f32"
    dtype_s: str = "f32"

    def __post_init__(self) -> None:
        for name, low in (("n_layer", 0), ("n_embd_r", 1), ("n_embd_s", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
                raise ArgumentError(f"Geometry {name} must be an integer >= {low}, got {value!r}")
            object.__setattr__(self, name, int(value))
        for name in ("dtype_r", "dtype_s"):
            if getattr(self, name) not in _GGML:
                raise ArgumentError(f"Geometry {name} must be one of {sorted(_GGML)}, "
                                    f"got {getattr(self, name)!r}")

    @classmethod
    def of(cls, cache: Any) -> "Geometry":
        """The geometry of a ``RecurrentCache`` (either engine)."""
        return cls(cache.n_layer, cache.n_embd_r, cache.n_embd_s, cache.dtype_r, cache.dtype_s)

    @property
    def row_bytes_r(self) -> int:
        return self.n_embd_r * _GGML[self.dtype_r][1]

    @property
    def row_bytes_s(self) -> int:
        return self.n_embd_s * _GGML[self.dtype_s][1]

    @property
    def state_bytes(self) -> int:
        """Bytes of one sequence's rows (every layer's r and s)."""
        return self.n_layer * (self.row_bytes_r + self.row_bytes_s)

    def blob_size(self) -> int:
        """Length of a one-cell sequence blob (SPEC §5) of this geometry."""
        return _BLOB_HEADER.size + 2 * self.n_layer * _TENSOR_HEADER.size + self.state_bytes

    def key_fields(self) -> bytes:
        """The geometry as it is hashed into a snapshot key."""
        return (f"n_layer={self.n_layer};n_embd_r={self.n_embd_r};n_embd_s={self.n_embd_s};"
                f"dtype_r={self.dtype_r};dtype_s={self.dtype_s}").encode()


def _token_array(tokens: Any) -> np.ndarray:
    """``tokens`` as a little-endian int32 array, or ArgumentError."""
    try:
        array = np.asarray(tokens)
    except (TypeError, ValueError) as exc:
        raise ArgumentError(f"tokens must be a 1-D sequence of integers: {exc}") from None
    if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
        raise ArgumentError(f"tokens must be a 1-D sequence of integers, got shape {array.shape} "
                            f"dtype {array.dtype}")
    if array.size and (int(array.min()) < -2**31 or int(array.max()) >= 2**31):
        raise ArgumentError("tokens must fit in int32")
    return array.astype("<i4", copy=False)


def snapshot_key(namespace: str, geometry: Geometry, tokens: Any) -> str:
    """The store key of the state after ``tokens`` in model ``namespace`` for ``geometry``.

    ``namespace`` is the model's identity and the caller's responsibility:
    two models that share a namespace and a geometry would exchange states
    that mean nothing to each other.  Use something that changes whenever the
    weights do — a hash of the GGUF file, a model name with its revision (the
    demo uses the GGUF file's sha256, or the random model's seed and shape).
    The key is ``"rc2:"`` and a sha256 of the namespace, the geometry and the
    tokens: safe as a file name and as a Redis key.
    """
    token_array = _token_array(tokens)
    return prefix_keys(namespace, geometry, token_array, [token_array.size])[0]


def prefix_keys(namespace: str, geometry: Geometry, tokens: Any, lengths: Sequence[int]) -> list[str]:
    """``snapshot_key(namespace, geometry, tokens[:n])`` for every ``n`` of ``lengths``, in that order.

    The tokens are hashed once, whatever the number of lengths: the hashed
    message is the length-prefixed namespace and geometry, then the tokens,
    then their byte count (last, so that the hash of every prefix is a copy
    of one running hash; the message still parses one way only).
    """
    if not isinstance(namespace, str):
        raise ArgumentError(f"namespace must be a str, got {type(namespace).__name__}")
    if not isinstance(geometry, Geometry):
        raise ArgumentError(f"geometry must be a Geometry, got {type(geometry).__name__}")
    token_bytes = memoryview(_token_array(tokens).tobytes())
    n_tokens = len(token_bytes) // 4
    for n in lengths:
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 0 <= n <= n_tokens:
            raise ArgumentError(f"prefix length {n!r} is outside [0, {n_tokens}]")
    running = hashlib.sha256()
    for part in (namespace.encode("utf-8", "surrogatepass"), geometry.key_fields()):
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


def key_digest(key: str) -> bytes:
    """The 16 bytes of the trailer that bind an entry to ``key``."""
    if not isinstance(key, str):
        raise ArgumentError(f"a store key is a str (from snapshot_key), got {type(key).__name__}")
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()[:16]


def make_trailer(crc: int, ggsq_length: int, digest: bytes) -> bytes:
    """The 32-byte trailer of an entry (see the module docstring)."""
    return _TRAILER.pack(TRAILER_MAGIC, crc, ggsq_length, digest)


def _rows(rows: Sequence[Any], geometry: Geometry, which: str) -> list[np.ndarray]:
    n_embd = geometry.n_embd_r if which == "r" else geometry.n_embd_s
    dtype = _row_dtype(geometry.dtype_r if which == "r" else geometry.dtype_s)
    if len(rows) != geometry.n_layer:
        raise ArgumentError(f"{which}_rows has {len(rows)} rows, the geometry has {geometry.n_layer} layers")
    out = []
    for il, row in enumerate(rows):
        array = np.asarray(row)
        if array.shape != (n_embd,) or array.dtype != dtype:
            raise ArgumentError(f"{which}_rows[{il}] must have shape ({n_embd},) and dtype {dtype}, "
                                f"got {array.shape} {array.dtype}")
        out.append(np.ascontiguousarray(array))
    return out


def encode_snapshot(key: str, tokens: Any, r_rows: Sequence[Any], s_rows: Sequence[Any],
                    geometry: Geometry) -> bytearray:
    """The entry for the state after ``tokens`` (its pos is ``len(tokens) - 1``) under ``key``.

    ``r_rows[il]`` / ``s_rows[il]`` are layer ``il``'s rows, numpy arrays of
    the cache's dtype (``cache.r[il][row]``).  The ggsq part is byte for byte
    what ``rc.save_seq_file`` writes for a sequence holding that state.  The
    rows are copied once, into the entry.
    """
    token_array = _token_array(tokens)
    if token_array.size == 0:
        raise ArgumentError("a snapshot needs at least one token (the state after no token is zeros)")
    r_list, s_list = _rows(r_rows, geometry, "r"), _rows(s_rows, geometry, "s")
    n_tokens = token_array.size
    ggsq_length = _FILE_HEADER.size + 4 * n_tokens + geometry.blob_size()
    entry = bytearray(ggsq_length + TRAILER_SIZE)
    view = memoryview(entry)
    entry_bytes = np.frombuffer(entry, dtype=np.uint8)   # the same memory, for numpy's row copies
    _FILE_HEADER.pack_into(entry, 0, SEQ_FILE_MAGIC, SEQ_FILE_VERSION, n_tokens)
    offset = _FILE_HEADER.size
    view[offset:offset + 4 * n_tokens] = token_array.tobytes()
    offset += 4 * n_tokens
    _BLOB_HEADER.pack_into(entry, offset, 1, n_tokens - 1, 0, 0, geometry.n_layer)
    offset += _BLOB_HEADER.size
    for which, rows in (("r", r_list), ("s", s_list)):
        type_id = _GGML[geometry.dtype_r if which == "r" else geometry.dtype_s][0]
        row_bytes = geometry.row_bytes_r if which == "r" else geometry.row_bytes_s
        for row in rows:
            _TENSOR_HEADER.pack_into(entry, offset, type_id, row_bytes)
            offset += _TENSOR_HEADER.size
            entry_bytes[offset:offset + row_bytes] = row.view(np.uint8).reshape(-1)
            offset += row_bytes
    view[offset:] = make_trailer(zlib.crc32(view[:offset]), offset, key_digest(key))
    return entry


def ggsq_declared_length(read_at: Callable[[int, int], bytes]) -> int | None:
    """The length a ggsq file says it has, from its headers alone; None if they are not a snapshot's.

    ``read_at(offset, n)`` returns up to ``n`` bytes of the file at ``offset``.
    Reads the file header, the blob header and the first r and s tensor
    headers (every layer's rows of one kind have one size in a snapshot): four
    small reads, however large the file.  For a store that meets files it did
    not write and must not read more than an entry can be.
    """
    def unpack(layout: struct.Struct, offset: int) -> tuple[Any, ...] | None:
        data = read_at(offset, layout.size)
        return layout.unpack(data) if len(data) == layout.size else None

    file_header = unpack(_FILE_HEADER, 0)
    if file_header is None or file_header[:2] != (SEQ_FILE_MAGIC, SEQ_FILE_VERSION):
        return None
    blob_at = _FILE_HEADER.size + 4 * file_header[2]
    blob_header = unpack(_BLOB_HEADER, blob_at)
    if blob_header is None or blob_header[0] != 1:
        return None
    n_layer = blob_header[4]
    tensors_at = blob_at + _BLOB_HEADER.size
    if n_layer == 0:
        return int(tensors_at)
    r_header = unpack(_TENSOR_HEADER, tensors_at)
    if r_header is None:
        return None
    s_header = unpack(_TENSOR_HEADER, tensors_at + n_layer * (_TENSOR_HEADER.size + r_header[1]))
    if s_header is None:
        return None
    return int(tensors_at + n_layer * (2 * _TENSOR_HEADER.size + r_header[1] + s_header[1]))


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
    token_array = _token_array(tokens)
    if not (check_entry(key, view) if verify_crc else entry_ggsq_length(key, view) is not None):
        return None
    n_tokens = token_array.size
    header = _FILE_HEADER.size
    blob_at = header + 4 * n_tokens
    if len(view) - TRAILER_SIZE != blob_at + geometry.blob_size() or n_tokens == 0:
        return None
    if _FILE_HEADER.unpack_from(view, 0) != (SEQ_FILE_MAGIC, SEQ_FILE_VERSION, n_tokens):
        return None
    if view[header:blob_at] != token_array.tobytes():
        return None
    if _BLOB_HEADER.unpack_from(view, blob_at) != (1, n_tokens - 1, 0, 0, geometry.n_layer):
        return None
    offset = blob_at + _BLOB_HEADER.size
    rows: dict[str, list[np.ndarray]] = {"r": [], "s": []}
    for which in ("r", "s"):
        dtype_name = geometry.dtype_r if which == "r" else geometry.dtype_s
        row_bytes = geometry.row_bytes_r if which == "r" else geometry.row_bytes_s
        for _ in range(geometry.n_layer):
            if _TENSOR_HEADER.unpack_from(view, offset) != (_GGML[dtype_name][0], row_bytes):
                return None
            offset += _TENSOR_HEADER.size
            rows[which].append(np.frombuffer(view, dtype=np.uint8, count=row_bytes, offset=offset)
                               .view(_row_dtype(dtype_name)))
            offset += row_bytes
    return rows["r"], rows["s"]


# -- between a cache's rows and a snapshot -------------------------------------------

def sequence_rows(cache: Any, seq: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Copies of the rows holding sequence ``seq``'s state (one per layer), for ``encode_snapshot``.

    Reads the row of the sequence's cell (``src``: where its data lives; a
    cell that has none yet means zeros).  ``seq`` must hold a cell.
    """
    if cache.seq_cell(seq) < 0:
        raise ArgumentError(f"sequence {seq} holds no cell: there is no state to snapshot")
    r_rows, s_rows = cache.seq_state(seq)
    return r_rows, s_rows


def restore_rows(cache: Any, seq: int, n_tokens: int, r_rows: Sequence[np.ndarray],
                 s_rows: Sequence[np.ndarray]) -> int:
    """Give ``seq`` (holding no cell) the state after ``n_tokens`` tokens; returns its row.

    Placed as ``state_read`` of the one-cell blob would place it, holding the rows byte
    for byte (``cache.seq_restore``: every row is checked before anything changes).
    """
    return int(cache.seq_restore(seq, n_tokens - 1, r_rows, s_rows))
