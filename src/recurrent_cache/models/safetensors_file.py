"""A small, strict safetensors reader in numpy (no torch, no ``safetensors`` package).

Format: a little-endian u64 header length N, N bytes of JSON
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``,
then the tensor bytes, offsets relative to the end of the header.  F64, F32,
F16 and BF16 tensors are read (BF16 through its uint16 bits: the top half of
a float32).  Every defect raises ``SafetensorsError`` saying what and where;
nothing is allocated before the header has been checked against the file size.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import SafetensorsError
from ._untrusted import open_regular, short_repr

__all__ = ["SafetensorsFile", "TensorEntry"]

# safetensors dtype -> numpy dtype of one stored element
_DTYPES: dict[str, np.dtype[Any]] = {"F64": np.dtype("<f8"),
                                     "F32": np.dtype("<f4"),
                                     "F16": np.dtype("<f2"), "BF16": np.dtype("<u2")}
_MAX_HEADER = 100 * 2**20   # the format's own limit on the JSON header
# bytes per element of every dtype the format defines: sizes of the tensors this reader does not convert
# are checked too
_ITEMSIZES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
              "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
MAX_RANK = 8          # no checkpoint tensor has more axes; numpy itself stops at 64
MAX_DIM = 2**40       # each axis is below this: a real tensor's axes are far smaller, and products stay exact


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str                # "F32", "F16", "BF16", ...
    shape: tuple[int, ...]
    offset: int               # absolute byte offset of the data in the file
    nbytes: int


class SafetensorsFile:
    """The parsed header of one ``.safetensors`` file, and its tensors (memory-mapped).

    Every entry is checked before numpy sees it: a dtype of the format, a shape of at most
    ``MAX_RANK`` axes each in ``[0, MAX_DIM)``, data offsets inside the file that give exactly
    the shape's bytes, and no two tensors sharing a byte.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        # OSError for a missing or unreadable file: the caller names it
        with open_regular(self.path, SafetensorsError) as handle:
            size = os.fstat(handle.fileno()).st_size
            if size < 8:
                raise SafetensorsError(f"the file has {size} bytes, fewer than the 8 of the header length")
            (header_len,) = struct.unpack("<Q", handle.read(8))
            if header_len > min(size - 8, _MAX_HEADER):
                raise SafetensorsError(f"the header claims {header_len} bytes; the file has {size}")
            raw = handle.read(header_len)
            start = 8 + header_len
            self.tensors: dict[str, TensorEntry] = self._entries(raw, start, size)
            self._data = np.memmap(handle, dtype=np.uint8, mode="r") if size > start else np.zeros(0, np.uint8)

    def _entries(self, raw: bytes, start: int, size: int) -> dict[str, TensorEntry]:
        """The header's tensors (``metadata`` set aside), checked one by one and against each other."""
        try:
            header = json.loads(raw.decode("utf-8"))
        except RecursionError:
            raise SafetensorsError("the header is nested too deeply to be a safetensors header") from None
        except (UnicodeDecodeError, ValueError) as exc:
            raise SafetensorsError(f"the header is not JSON: {exc}") from None
        if not isinstance(header, dict):
            raise SafetensorsError("the header is not a JSON object")
        metadata = header.pop("__metadata__", {})
        self.metadata: dict[str, Any] = metadata if isinstance(metadata, dict) else {}
        tensors = {name: self._entry(name, entry, start, size) for name, entry in header.items()}
        previous: TensorEntry | None = None
        for entry in sorted(tensors.values(), key=lambda e: (e.offset, e.nbytes)):
            if previous is not None and entry.offset < previous.offset + previous.nbytes:
                raise SafetensorsError(f"tensors {previous.name} and {entry.name} overlap: their data starts at "
                                       f"bytes {previous.offset} and {entry.offset}")
            if entry.nbytes:   # an empty tensor shares its offset with its neighbour, as the format writes it
                previous = entry
        return tensors

    @staticmethod
    def _entry(name: str, entry: Any, start: int, size: int) -> TensorEntry:
        if not isinstance(entry, dict):
            raise SafetensorsError(f"tensor {name}: the header entry is not an object")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in _ITEMSIZES:
            raise SafetensorsError(f"tensor {name}: dtype {dtype!r} is not one of the format's "
                                   f"({', '.join(_ITEMSIZES)})")
        if (not isinstance(shape, list) or len(shape) > MAX_RANK
                or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < MAX_DIM for d in shape)):
            raise SafetensorsError(f"tensor {name}: shape {short_repr(shape)} is not a list of at most {MAX_RANK} "
                                   f"sizes in [0, 2**40)")
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
                or not 0 <= offsets[0] <= offsets[1]):
            raise SafetensorsError(f"tensor {name}: data_offsets {short_repr(offsets)} are not [begin, end]")
        begin, end = start + offsets[0], start + offsets[1]
        if end > size:
            raise SafetensorsError(f"tensor {name}: its data ends at byte {short_repr(end)}, past the end of the file "
                                   f"({size} bytes): truncated?")
        if end - begin != math.prod(shape) * _ITEMSIZES[dtype]:
            raise SafetensorsError(f"tensor {name}: {end - begin} bytes for a {dtype} tensor of shape {shape}")
        return TensorEntry(name, dtype, tuple(shape), begin, end - begin)

    def floats(self, name: str) -> np.ndarray:
        """Tensor ``name`` as a new float32 (float64 for F64) array of its shape."""
        entry = self.tensors[name]
        if entry.dtype not in _DTYPES:
            raise SafetensorsError(f"tensor {name} is {entry.dtype}; this reader reads F64, F32, F16 and BF16")
        values = self._data[entry.offset:entry.offset + entry.nbytes].view(_DTYPES[entry.dtype]).reshape(entry.shape)
        widened: np.ndarray
        if entry.dtype == "BF16":
            widened = (values.astype(np.uint32) << 16).view(np.float32)
        else:
            widened = values.astype(np.float64 if entry.dtype == "F64" else np.float32)
        return widened

