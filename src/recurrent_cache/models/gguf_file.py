"""A small, strict GGUF reader in numpy: metadata, tensor infos, and f32 / f16 / bf16 / f64 tensors.

The shipped model must load with numpy alone (the ``gguf`` package is an
optional extra), and a hostile file must give one clear error, never a
traceback or a huge allocation: every read is bounds-checked against the
file, counts are checked against the bytes left before anything is
allocated, and any defect raises ``GGUFError`` naming the byte offset and
what was expected.  Tensors of other (quantized) types are returned raw;
``load_gguf`` dequantizes them with the ``gguf`` package when it is installed.

Format (GGUF v2/v3, little-endian): magic ``GGUF``, u32 version, u64 tensor
count, u64 key count; the keys (string name, u32 type, value); the tensor infos
(string name, u32 n_dims, u64 dims[n_dims] innermost first, u32 ggml type,
u64 offset); then the tensor data from the next multiple of
``general.alignment`` (32 by default).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import GGUFError
from ..formats.dtypes import GGML_TYPES
from ._untrusted import open_regular

__all__ = ["GGUFFile", "TensorInfo"]

MAGIC = b"GGUF"

# GGUF metadata value types -> struct format (scalars)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9

# ggml tensor types this reader converts itself: type id -> (name, numpy dtype of one element's bits);
# the state types, and F64 (28), which weights may use and a state never does
FLOAT_TYPES: dict[int, tuple[str, np.dtype[Any]]] = {
    **{t.type_id: (t.name.upper(), t.bits) for t in GGML_TYPES.values()}, 28: ("F64", np.dtype("<f8"))}
# (block size in elements, bytes per block) of the other ggml types, to check sizes of tensors we
# hand to the gguf package; unknown types are an error.
_QUANT_BLOCKS = {2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34), 9: (32, 36),
                 10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176), 14: (256, 210),
                 15: (256, 292), 16: (256, 66), 17: (256, 74), 18: (256, 98), 19: (256, 50),
                 20: (32, 18), 21: (256, 110), 22: (256, 82), 23: (256, 136), 24: (1, 1), 25: (1, 2),
                 26: (1, 4), 27: (1, 8), 29: (256, 56), 34: (256, 54), 35: (256, 66), 39: (32, 17)}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]   # numpy order: outermost first (ggml's ne reversed)
    type_id: int
    offset: int              # absolute byte offset of the data in the file
    nbytes: int

    @property
    def type_name(self) -> str:
        return FLOAT_TYPES[self.type_id][0] if self.type_id in FLOAT_TYPES else f"ggml type {self.type_id}"


class GGUFFile:
    """The parsed header of a GGUF file and access to its tensors (memory-mapped)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        # OSError for a missing file: the caller names it; a FIFO or a device is refused without reading it
        with open_regular(self.path, GGUFError) as handle:
            size = os.fstat(handle.fileno()).st_size
            if size == 0:
                raise GGUFError("the file is empty")
            self._data = np.memmap(handle, dtype=np.uint8, mode="r")
        self._at = 0
        if self._read(4, "the magic") != MAGIC:
            raise GGUFError(f"not a GGUF file (the first bytes are {bytes(self._data[:4])!r}, not b'GGUF')")
        version = self._scalar("<I", "the version")
        if version not in (2, 3):
            raise GGUFError(f"GGUF version {version} is not supported (2 and 3 are)")
        n_tensors = self._scalar("<Q", "the tensor count")
        n_keys = self._scalar("<Q", "the key count")
        # each key takes at least 12 bytes, each tensor info at least 28: reject absurd counts early
        if n_keys * 12 + n_tensors * 28 > size:
            raise GGUFError(f"the header claims {n_keys} keys and {n_tensors} tensors; the file has {size} bytes")
        self.fields: dict[str, Any] = {}
        for _ in range(n_keys):
            key = self._string("a key name")
            self.fields[key] = self._value(self._scalar("<I", f"the type of key {key}"), key)
        infos = []
        for _ in range(n_tensors):
            name = self._string("a tensor name")
            n_dims = self._scalar("<I", f"the dimension count of tensor {name}")
            if n_dims > 8:
                raise GGUFError(f"tensor {name} claims {n_dims} dimensions")
            dims = [self._scalar("<Q", f"a dimension of tensor {name}") for _ in range(n_dims)]
            type_id = self._scalar("<I", f"the type of tensor {name}")
            offset = self._scalar("<Q", f"the offset of tensor {name}")
            infos.append((name, dims, type_id, offset))
        alignment = self.fields.get("general.alignment", 32)
        if not isinstance(alignment, int) or alignment < 1:
            raise GGUFError(f"general.alignment is {alignment!r}")
        start = -(self._at // -alignment) * alignment
        self.tensors: dict[str, TensorInfo] = {}
        for name, dims, type_id, offset in infos:
            count = int(np.prod(dims, dtype=object)) if dims else 1
            if type_id in FLOAT_TYPES:
                nbytes = count * FLOAT_TYPES[type_id][1].itemsize
            elif type_id in _QUANT_BLOCKS:
                block, block_bytes = _QUANT_BLOCKS[type_id]
                if count % block:
                    raise GGUFError(f"tensor {name} has {count} elements, not a multiple of its block of {block}")
                nbytes = count // block * block_bytes
            else:
                raise GGUFError(f"tensor {name} has unknown ggml type {type_id}")
            begin = start + offset
            if begin + nbytes > size:
                raise GGUFError(f"tensor {name} ({nbytes} bytes at offset {begin}) runs past the end "
                                f"of the file ({size} bytes): truncated?")
            if name in self.tensors:
                raise GGUFError(f"tensor {name} appears twice")
            self.tensors[name] = TensorInfo(name, tuple(reversed(dims)), type_id, begin, nbytes)

    # -- tensors ------------------------------------------------------------------------

    def raw(self, info: TensorInfo) -> np.ndarray:
        """The tensor's bytes (a read-only view of the mapped file)."""
        return self._data[info.offset:info.offset + info.nbytes]

    def floats(self, info: TensorInfo) -> np.ndarray:
        """An f32 / f16 / bf16 / f64 tensor as a new float32 or float64 array of its shape."""
        name, dtype = FLOAT_TYPES[info.type_id]
        values = self.raw(info).view(dtype).reshape(info.shape)
        widened: np.ndarray
        if name == "BF16":
            widened = (values.astype(np.uint32) << 16).view(np.float32)
        else:
            widened = values.astype(np.float64 if name == "F64" else np.float32)
        return widened

    # -- parsing ------------------------------------------------------------------------

    def _read(self, n: int, what: str) -> bytes:
        if n > len(self._data) - self._at:
            raise GGUFError(f"the file ends at byte {len(self._data)} while reading {what} "
                            f"({n} bytes at offset {self._at}): truncated?")
        chunk = self._data[self._at:self._at + n].tobytes()
        self._at += n
        return chunk

    def _scalar(self, fmt: str, what: str) -> Any:
        return struct.unpack(fmt, self._read(struct.calcsize(fmt), what))[0]

    def _string(self, what: str) -> str:
        at = self._at
        raw = self._read(self._scalar("<Q", f"the length of {what}"), what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise GGUFError(f"{what} at offset {at} is not UTF-8") from None

    def _value(self, type_id: int, key: str) -> Any:
        if type_id in _SCALARS:
            return self._scalar(_SCALARS[type_id], f"the value of key {key}")
        if type_id == _STRING:
            return self._string(f"the value of key {key}")
        if type_id == _ARRAY:
            item_type = self._scalar("<I", f"the item type of key {key}")
            count = self._scalar("<Q", f"the item count of key {key}")
            if item_type in _SCALARS:
                fmt = _SCALARS[item_type]
                itemsize = struct.calcsize(fmt)
                if count * itemsize > len(self._data) - self._at:
                    raise GGUFError(f"key {key} claims {count} items; the file ends before them")
                values = np.frombuffer(self._read(count * itemsize, f"the items of key {key}"), dtype=np.dtype(fmt))
                return values.tolist()
            if item_type == _STRING:
                if count * 8 > len(self._data) - self._at:
                    raise GGUFError(f"key {key} claims {count} strings; the file ends before them")
                return [self._string(f"item {i} of key {key}") for i in range(count)]
            raise GGUFError(f"key {key} is an array of type {item_type}, which this reader does not read")
        raise GGUFError(f"key {key} has unknown value type {type_id}")
