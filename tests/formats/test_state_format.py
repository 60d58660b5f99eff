"""The formats package is the one description of the bytes: the type table, the layouts, the geometry.

The sequence files ``save_seq_file`` writes, the snapshots the codec writes and
the blobs either engine writes are read back field by field through the
package's layouts; the package's sources hold no second copy of a magic, a
header format or a type table; a geometry mismatch is refused in the package's
words; and a store key is what it was before the geometry moved here (an
independent computation of the old formula), so stores written earlier stay
readable.
"""

from __future__ import annotations

import hashlib
import pathlib
import re
import struct

import numpy as np
import pytest

import recurrent_cache
from recurrent_cache.formats.blob import parse_blob
from recurrent_cache.formats.dtypes import GGML_TYPES, STATE_TYPES
from recurrent_cache.formats.layouts import CELL, CELL_COUNT, DATA_HEADER, GGSQ, TENSOR_HEADER, Layout
from recurrent_cache.formats.messages import type_mismatch
from recurrent_cache.errors import ArgumentError, StateError
from recurrent_cache.stores import Geometry, encode_snapshot, sequence_rows, snapshot_key
from recurrent_cache.stores.snapshot import TRAILER_SIZE
from rows import assign, host

SRC = pathlib.Path(recurrent_cache.__file__).parent


def filled_cache(rc, n_layer=2, dtype_r="f32", dtype_s="f16", tokens=(5, 6, 7)):
    """A cache whose sequence 0 holds a state after ``tokens``, with distinct row values."""
    cache = rc.RecurrentCache(n_layer, 3, 4, n_seq_max=2, dtype_r=dtype_r, dtype_s=dtype_s)
    for _ in cache.init_batch(rc.Batch(token=list(tokens), seq_id=[0] * len(tokens), pos=list(range(len(tokens))))):
        pass
    for il in range(n_layer):
        assign(cache.r[il], np.arange(6).reshape(2, 3) + il + 1)
        assign(cache.s[il], np.arange(8).reshape(2, 4) * -(il + 1))
    return cache


def read_fields(layout: Layout, data: bytes, offset: int) -> dict[str, int]:
    return dict(zip(layout.names, layout.unpack_from(data, offset), strict=True))


def walk_sequence_file(data: bytes) -> dict[str, object]:
    """Every field of a one-sequence 'ggsq' file, read through the module's layouts only."""
    header = read_fields(GGSQ.header, data, 0)
    at = GGSQ.header.size
    tokens = list(struct.unpack_from(f"<{header['n_token_count']}i", data, at))
    at += 4 * len(tokens)
    cell_count = read_fields(CELL_COUNT, data, at)["cell_count"]
    at += CELL_COUNT.size
    cell = read_fields(CELL, data, at)
    at += CELL.size
    layers = read_fields(DATA_HEADER, data, at)
    at += DATA_HEADER.size
    tensors = []
    for _ in range(2 * layers["n_layer"]):
        tensor = read_fields(TENSOR_HEADER, data, at)
        tensors.append((tensor["type"], tensor["row_bytes"]))
        at += TENSOR_HEADER.size + cell_count * tensor["row_bytes"]
    return {"header": header, "tokens": tokens, "cell_count": cell_count, "cell": cell, "layers": layers,
            "tensors": tensors, "end": at}


@pytest.mark.parametrize("dtypes", [("f32", "f16"), ("bf16", "f32")])
def test_sequence_files_and_snapshots_are_the_module_layouts_field_by_field(rc, tmp_path, dtypes):
    cache = filled_cache(rc, dtype_r=dtypes[0], dtype_s=dtypes[1])
    tokens = [5, 6, 7]
    path = tmp_path / "seq.ggsq"
    size = recurrent_cache.save_seq_file(path, cache, 0, tokens)
    written = path.read_bytes()
    geometry = Geometry.of(cache)
    key = snapshot_key("ns", geometry, tokens)
    entry = bytes(encode_snapshot(key, tokens, *sequence_rows(cache, 0), geometry))
    for data in (written, entry[:-TRAILER_SIZE]):
        fields = walk_sequence_file(data)
        assert fields["header"] == {"magic": GGSQ.magic, "version": GGSQ.version, "n_token_count": 3}
        assert fields["tokens"] == tokens
        assert fields["cell_count"] == 1 and fields["cell"] == {"pos": 2, "n_seq_id": 0}
        assert fields["layers"] == {"v_trans": 0, "n_layer": cache.n_layer}
        assert fields["tensors"] == list(zip(geometry.type_ids, geometry.row_bytes, strict=True))
        assert fields["end"] == len(data) == size
        assert len(data) == GGSQ.header.size + 4 * len(tokens) + geometry.sequence_blob_size()
    assert written == entry[:-TRAILER_SIZE]


def test_an_engines_blob_uses_the_geometrys_type_ids_and_row_sizes(rc):
    for dtype_r, dtype_s in (("f32", "bf16"), ("f16", "f32")):
        cache = filled_cache(rc, n_layer=3, dtype_r=dtype_r, dtype_s=dtype_s)
        geometry = Geometry.of(cache)
        blob = parse_blob(cache.state_write(-1), geometry, -1)
        assert tuple(t.type_id for t in blob.tensors) == geometry.type_ids
        assert tuple(t.row_bytes for t in blob.tensors) == geometry.row_bytes
        for k, tensor in enumerate(blob.tensors):
            stored = host((cache.r if k < 3 else cache.s)[k % 3])
            assert GGML_TYPES[tensor.type_id].numpy == stored.dtype
            assert tensor.row_bytes == stored.shape[1] * stored.dtype.itemsize


def test_the_type_table_agrees_with_itself_and_with_numpy():
    assert set(GGML_TYPES) == {t.type_id for t in STATE_TYPES.values()}
    for name, state_type in STATE_TYPES.items():
        assert state_type.name == name and GGML_TYPES[state_type.type_id] is state_type
        assert state_type.itemsize == state_type.numpy.itemsize == state_type.bits.itemsize
        assert state_type.bits == state_type.bits.newbyteorder("<")   # a blob is little-endian
        cache = recurrent_cache.RecurrentCache(1, 2, 2, dtype_r=name, dtype_s=name)
        assert cache.r[0].dtype == state_type.numpy


def test_layout_offsets_are_where_the_fields_are():
    for layout in (GGSQ.header, CELL_COUNT, CELL, DATA_HEADER, TENSOR_HEADER):
        values = list(range(1, len(layout.names) + 1))
        packed = layout.pack(*values)
        for name, value in zip(layout.names, values, strict=True):
            code = layout.format[1 + layout.names.index(name)]
            assert struct.unpack_from("<" + code, packed, layout.offset(name))[0] == value


def test_sequence_file_defects_name_the_offsets_of_the_layout(tmp_path):
    cache = filled_cache(recurrent_cache)
    path = tmp_path / "seq.ggsq"
    recurrent_cache.save_seq_file(path, cache, 0, [5, 6, 7])
    good = path.read_bytes()
    header = GGSQ.header
    for field, value, words in (("magic", 0x12345678, "not a sequence file: magic 0x12345678"),
                                ("version", 7, "sequence file version 7"),
                                ("n_token_count", 2**27, "sequence file has 134217728 tokens")):
        bad = bytearray(good)
        struct.pack_into("<I", bad, header.offset(field), value)
        path.write_bytes(bad)
        with pytest.raises(StateError, match=re.escape(words) + fr".* byte {header.offset(field)}\b"):
            recurrent_cache.load_seq_file(path, cache, 1)
        assert cache.seq_pos_max(1) == -1


def test_a_geometry_mismatch_is_refused_in_the_modules_words(rc, tmp_path):
    cache = filled_cache(rc, dtype_r="f32", dtype_s="f16")
    path = tmp_path / "seq.ggsq"
    recurrent_cache.save_seq_file(path, cache, 0, [5, 6, 7])
    other = rc.RecurrentCache(2, 3, 4, n_seq_max=2, dtype_r="f32", dtype_s="f32")
    before = other.state_write(-1)
    r_tensors = 2   # the first s tensor is the one whose type differs
    at = GGSQ.header.size + 12 + CELL_COUNT.size + CELL.size + DATA_HEADER.size \
        + r_tensors * (TENSOR_HEADER.size + Geometry.of(cache).row_bytes_r)
    expected = type_mismatch("layer 0 s", at - GGSQ.header.size - 12, STATE_TYPES["f16"].type_id,
                                 STATE_TYPES["f32"].type_id)
    with pytest.raises(StateError) as caught:
        recurrent_cache.load_seq_file(path, other, 0)
    assert str(caught.value) == f"{path}: the state blob at byte {GGSQ.header.size + 12}: {expected}"
    assert other.state_write(-1) == before
    # the codec: rows of another geometry are refused by Geometry.check_rows
    geometry = Geometry.of(other)
    r_rows, s_rows = sequence_rows(cache, 0)
    with pytest.raises(ArgumentError, match=re.escape("s_rows[0] has shape (4,) and dtype float16, "
                                                      "the geometry has (4,) and float32")):
        encode_snapshot(snapshot_key("ns", geometry, [5, 6, 7]), [5, 6, 7], r_rows, s_rows, geometry)


def test_store_keys_follow_their_documented_format_and_ignore_the_cache_size():
    """The key recomputed from its definition: sha256 over the length-prefixed namespace and
    geometry fields, the tokens, then their byte count ("rc2:", one running hash for every prefix)."""
    def expected_key(namespace, n_layer, n_embd_r, n_embd_s, dtype_r, dtype_s, tokens):
        digest = hashlib.sha256()
        described = (f"n_layer={n_layer};n_embd_r={n_embd_r};n_embd_s={n_embd_s};"
                     f"dtype_r={dtype_r};dtype_s={dtype_s}").encode()
        for part in (namespace.encode(), described):
            digest.update(struct.pack("<Q", len(part)) + part)
        token_bytes = np.asarray(tokens, "<i4").tobytes()
        digest.update(token_bytes + struct.pack("<Q", len(token_bytes)))
        return "rc2:" + digest.hexdigest()

    for fields in ((1, 2, 3, "f32", "f16"), (4, 64, 256, "bf16", "f32"), (0, 1, 1, "f32", "f32")):
        keys = {snapshot_key("model", Geometry(*fields, size=size), [1, 2, 3]) for size in (1, 2, 4096)}
        assert keys == {expected_key("model", *fields, [1, 2, 3])}


@pytest.mark.parametrize("bad,words", [
    (dict(n_layer=-1), "n_layer must be in [0, 2**31), got -1"),
    (dict(n_embd_r=0), "n_embd_r must be in [1, 2**31), got 0"),
    (dict(n_embd_s=1.5), "n_embd_s must be an integer, got 1.5"),
    (dict(size=True), "size must be an integer, got True"),
    (dict(dtype_s="f64"), "unknown dtype_s 'f64' (expected one of f32, f16, bf16)"),
])
def test_one_geometry_check_for_snapshots_and_caches(bad, words):
    fields = {"n_layer": 1, "n_embd_r": 2, "n_embd_s": 3, **bad}
    with pytest.raises(ArgumentError, match="^" + re.escape(words) + "$"):
        Geometry(**fields)
    with pytest.raises(recurrent_cache.ConfigError, match="^" + re.escape(words) + "$"):
        recurrent_cache.RecurrentCache(**fields)


def test_no_module_but_the_formats_tables_spells_out_a_layout_or_the_type_table():
    magic = f"0x{GGSQ.magic:08x}"
    layouts = {f'"{layout.format}"' for layout in (GGSQ.header, CELL, DATA_HEADER, TENSOR_HEADER)}
    for path in SRC.rglob("*.py"):
        if path.parent.name == "formats" and path.name in ("layouts.py", "dtypes.py"):
            continue
        code = "\n".join(line.split("#")[0] for line in path.read_text().splitlines()
                         if not line.lstrip().startswith(("``", "A file is")))
        assert magic not in code, f"{path.name} spells the ggsq magic"
        for layout in layouts:
            assert layout not in code, f"{path.name} spells the layout {layout}"
        assert not re.search(r"\b30\s*:\s*\(|\"bf16\"\s*:\s*\(\s*30", code), f"{path.name} has a type table"


def test_ml_dtypes_is_imported_by_a_bf16_cache_only():
    # ml_dtypes takes about a second to import: a process that never holds bf16 must not pay it
    import subprocess
    import sys
    program = ("import sys, recurrent_cache as rc; c = rc.RecurrentCache(2, 4, 8, 1, dtype_s='f16'); "
               "c.state_write(); assert 'ml_dtypes' not in sys.modules, 'f32/f16'; "
               "rc.RecurrentCache(2, 4, 8, 1, dtype_s='bf16'); "
               "import importlib.util; "
               "assert ('ml_dtypes' in sys.modules) == bool(importlib.util.find_spec('ml_dtypes'))")
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
