"""The numpy safetensors reader (no torch): values of every float type, and one clear error per defect."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from recurrent_cache import SafetensorsError
from recurrent_cache.models.safetensors_file import SafetensorsFile

ml_dtypes = pytest.importorskip("ml_dtypes", reason="bf16 reference values")


def write(path, tensors: dict[str, tuple[str, list[int], bytes]], header_extra: dict | None = None) -> None:
    """A safetensors file of raw (dtype, shape, bytes) tensors, laid out one after another."""
    header: dict = dict(header_extra or {})
    data = b""
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    encoded = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data)


def test_float_types_read_as_float32(tmp_path):
    values = np.random.default_rng(0).standard_normal((3, 5))
    path = tmp_path / "w.safetensors"
    write(path, {"a": ("F32", [3, 5], values.astype("<f4").tobytes()),
                 "b": ("F16", [3, 5], values.astype("<f2").tobytes()),
                 "c": ("BF16", [15], values.astype(ml_dtypes.bfloat16).tobytes()),
                 "d": ("F64", [5, 3], values.tobytes())}, {"__metadata__": {"format": "pt"}})
    file = SafetensorsFile(path)
    np.testing.assert_array_equal(file.floats("a"), values.astype(np.float32))
    np.testing.assert_array_equal(file.floats("b"), values.astype(np.float16).astype(np.float32))
    np.testing.assert_array_equal(file.floats("c"), values.reshape(15).astype(ml_dtypes.bfloat16).astype(np.float32))
    np.testing.assert_array_equal(file.floats("d"), values.reshape(5, 3))
    assert file.floats("c").dtype == np.float32 and file.metadata == {"format": "pt"}


@pytest.mark.parametrize("damage, message", [
    (lambda raw: raw[:5], "fewer than the 8"),
    (lambda raw: struct.pack("<Q", 10**9) + raw[8:], "the header claims"),
    (lambda raw: raw[:8] + b"x" + raw[9:], "not JSON"),
    (lambda raw: raw[:-4], "past the end of the file"),
])
def test_damaged_files_are_refused(tmp_path, damage, message):
    path = tmp_path / "w.safetensors"
    write(path, {"a": ("F32", [4], np.arange(4, dtype="<f4").tobytes())})
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(SafetensorsError, match=message):
        SafetensorsFile(path)


def test_inconsistent_entries_are_named(tmp_path):
    path = tmp_path / "w.safetensors"
    write(path, {"short": ("F32", [4], b"\0" * 12)})
    with pytest.raises(SafetensorsError, match=r"tensor short: 12 bytes for a F32 tensor of shape \[4\]"):
        SafetensorsFile(path)
    write(path, {"bad": ("F32", [-1], b"")})
    with pytest.raises(SafetensorsError, match="tensor bad: shape"):
        SafetensorsFile(path)
    write(path, {"ints": ("I32", [2], b"\0" * 8)})
    with pytest.raises(SafetensorsError, match="tensor ints is I32"):
        SafetensorsFile(path).floats("ints")
