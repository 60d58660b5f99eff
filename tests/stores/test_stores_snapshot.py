"""Snapshot entries and keys: byte-compatible with sequence files, and no damaged or
foreign entry ever decodes."""

from __future__ import annotations

import os
import struct
import zlib

import numpy as np
import pytest

import recurrent_cache

from recurrent_cache.blob_report import describe
from recurrent_cache.stores import (Geometry, check_entry, decode_snapshot, encode_snapshot, restore_rows,
                                    sequence_rows, snapshot_key)
from recurrent_cache.stores.snapshot import TRAILER_SIZE, key_digest, make_trailer
from rows import assign, dtype


def filled_cache(rc, dtype_r, dtype_s, n_layer=2, seed=0):
    """A cache with sequences 0 (3 tokens) and 1 (1 token) and random state rows."""
    cache = rc.RecurrentCache(n_layer, 6, 10, n_seq_max=4, dtype_r=dtype_r, dtype_s=dtype_s)
    for _ in cache.init_batch(rc.Batch(token=[5, 6, 7, 9], pos=[0, 1, 2, 0], seq_id=[0, 0, 0, 1])):
        pass
    rng = np.random.default_rng(seed)
    for il in range(n_layer):
        assign(cache.r[il], rng.standard_normal(tuple(cache.r[il].shape)).astype(dtype(cache.r[il])))
        assign(cache.s[il], rng.standard_normal(tuple(cache.s[il].shape)).astype(dtype(cache.s[il])))
    return cache


@pytest.mark.parametrize("dtypes", [("f32", "f32"), ("f16", "bf16"), ("bf16", "f16")])
def test_entry_is_the_sequence_file_and_restores_the_same_state(rc, tmp_path, dtypes):
    cache = filled_cache(rc, *dtypes)
    geometry = Geometry.of(cache)
    tokens = [5, 6, 7]
    key = snapshot_key("model-a", geometry, tokens)
    entry = encode_snapshot(key, tokens, *sequence_rows(cache, 0), geometry)

    path = tmp_path / "seq0.ggsq"
    recurrent_cache.save_seq_file(path, cache, 0, tokens)
    assert entry[:-TRAILER_SIZE] == path.read_bytes()          # llama.cpp's file, byte for byte
    assert describe(entry[:-TRAILER_SIZE])["tokens"] == tokens   # what inspect reads

    rows = decode_snapshot(entry, key, geometry, tokens)
    assert rows is not None
    other = rc.RecurrentCache(2, 6, 10, n_seq_max=4, dtype_r=dtypes[0], dtype_s=dtypes[1])
    restore_rows(other, 2, len(tokens), *rows)
    assert other.state_write(2) == cache.state_write(0)
    assert other.seq_pos_max(2) == 2
    other.check()


def test_rows_in_and_out_of_a_cache(rc):
    cache = rc.RecurrentCache(1, 2, 3, n_seq_max=2)
    with pytest.raises(recurrent_cache.RecurrentCacheError):
        sequence_rows(cache, 0)                 # holds no cell: no state to take
    row = restore_rows(cache, 1, 4, [np.array([1, -1], np.float32)], [np.array([2, 0, 5], np.float32)])
    r, s = sequence_rows(cache, 1)
    assert r[0].tolist() == [1, -1] and s[0].tolist() == [2, 0, 5]
    assert cache.cell(row)[0] == 3 and cache.seq_pos_max(1) == 3
    before = cache.state_write()
    with pytest.raises(recurrent_cache.RecurrentCacheError):
        restore_rows(cache, 1, 9, r, s)         # seq 1 holds a cell already
    assert cache.state_write() == before
    cache.check()


def small():
    geometry = Geometry(1, 2, 3, "f32", "f16")
    tokens = [11, 12, 13]
    key = snapshot_key("ns", geometry, tokens)
    r, s = [np.array([1.5, -2], np.float32)], [np.array([0.25, 3, -1], np.float16)]
    return geometry, tokens, key, encode_snapshot(key, tokens, r, s, geometry), r, s


def test_every_single_bit_flip_and_every_truncation_is_rejected():
    geometry, tokens, key, entry, r, s = small()
    rows = decode_snapshot(entry, key, geometry, tokens)
    assert rows is not None and rows[0][0].tolist() == r[0].tolist() and rows[1][0].tolist() == s[0].tolist()
    for i in range(len(entry)):
        for bit in (0x01, 0x80):
            damaged = entry[:i] + bytes([entry[i] ^ bit]) + entry[i + 1:]
            assert decode_snapshot(damaged, key, geometry, tokens) is None, (i, bit)
            assert not check_entry(key, damaged)
    for n in range(len(entry)):
        assert decode_snapshot(entry[:n], key, geometry, tokens) is None, n
        assert decode_snapshot(entry[:n], key, geometry, tokens, verify_crc=False) is None, n
    assert decode_snapshot(entry + b"\0", key, geometry, tokens) is None
    assert decode_snapshot(b"\0" + entry, key, geometry, tokens) is None
    assert decode_snapshot("not bytes", key, geometry, tokens) is None
    assert decode_snapshot(None, key, geometry, tokens) is None


def test_without_the_crc_only_row_damage_goes_unseen():
    geometry, tokens, key, entry, r, s = small()
    # the 82-byte ggsq file: header 12, tokens 12, blob header 20, r header 12, r row 8, s header 12, s row 6
    rows = set(range(56, 64)) | set(range(76, 82))
    crc = set(range(86, 90))
    # bit 0 of the version (byte 4) turns 3 into 2: a version-2 entry of the same state, still read
    version = {4}
    for i in range(len(entry)):
        damaged = entry[:i] + bytes([entry[i] ^ 1]) + entry[i + 1:]
        assert decode_snapshot(damaged, key, geometry, tokens) is None
        unseen = decode_snapshot(damaged, key, geometry, tokens, verify_crc=False) is not None
        assert unseen == (i in rows or i in crc or i in version), i


def test_version_2_entries_are_still_read():
    geometry, tokens, key, entry, r, s = small()
    assert entry[4:8] == struct.pack("<I", 3)
    old = bytearray(entry[:4] + struct.pack("<I", 2) + entry[8:])
    length = len(old) - TRAILER_SIZE
    old[length:] = make_trailer(zlib.crc32(old[:length]), length, key_digest(key))
    r_rows, s_rows = decode_snapshot(bytes(old), key, geometry, tokens)
    assert [row.tobytes() for row in r_rows + s_rows] == [row.tobytes() for row in r + s]


def test_foreign_entries_are_rejected():
    geometry, tokens, key, entry, r, s = small()
    assert decode_snapshot(bytearray(entry), key, geometry, tokens) is not None
    assert decode_snapshot(memoryview(entry), key, geometry, tokens) is not None
    # asked for under another namespace, another geometry or other tokens: another key
    other_geometries = [Geometry(2, 2, 3, "f32", "f16"), Geometry(1, 3, 3, "f32", "f16"),
                        Geometry(1, 2, 4, "f32", "f16"), Geometry(1, 2, 3, "f16", "f16"),
                        Geometry(1, 2, 3, "f32", "f32"), Geometry(1, 2, 3, "f32", "bf16")]
    for g in other_geometries:
        assert decode_snapshot(entry, snapshot_key("ns", g, tokens), g, tokens) is None
        assert decode_snapshot(entry, key, g, tokens) is None   # even under the entry's own key
    assert decode_snapshot(entry, snapshot_key("ns2", geometry, tokens), geometry, tokens) is None
    for other in ([11, 12], [11, 12, 13, 14], [11, 12, 14], [13, 12, 11]):
        assert decode_snapshot(entry, snapshot_key("ns", geometry, other), geometry, other) is None
        assert decode_snapshot(entry, key, geometry, other) is None
    # a well-formed entry of other tokens re-signed for this key: the checksum holds, the tokens do not
    forged_tokens = [11, 12, 99]
    forged = encode_snapshot(key, forged_tokens, r, s, geometry)
    assert check_entry(key, forged)
    assert decode_snapshot(forged, key, geometry, tokens) is None


def test_keys_differ_in_every_field():
    g = Geometry(1, 2, 3)
    keys = {snapshot_key("a", g, [1, 2]), snapshot_key("b", g, [1, 2]), snapshot_key("a", g, [1]),
            snapshot_key("a", g, [1, 2, 3]), snapshot_key("a", g, [2, 1]), snapshot_key("", g, [1, 2]),
            snapshot_key("a", Geometry(1, 2, 3, "f16"), [1, 2]), snapshot_key("a", Geometry(1, 3, 2), [1, 2]),
            snapshot_key("a\0", g, [1, 2]), snapshot_key("a", g, np.array([1, 2], np.int64).view(np.int32)[:2])}
    assert len(keys) == 10
    assert snapshot_key("a", g, np.array([1, 2], np.int16)) == snapshot_key("a", g, [1, 2])
    assert all(k.startswith("rc2:") and len(k) == 68 for k in keys)


def test_bad_arguments_raise_package_errors():
    rc = recurrent_cache
    geometry, tokens, key, entry, r, s = small()
    for bad in [dict(n_layer=-1), dict(n_embd_r=0), dict(n_embd_s=1.5), dict(dtype_r="f64"), dict(n_layer=True)]:
        with pytest.raises(rc.ArgumentError, match=next(iter(bad))):
            Geometry(**{**dict(n_layer=1, n_embd_r=2, n_embd_s=3), **bad})
    with pytest.raises(rc.ArgumentError, match="at least one token"):
        encode_snapshot(key, [], r, s, geometry)
    with pytest.raises(rc.ArgumentError, match="r_rows"):
        encode_snapshot(key, tokens, [np.zeros(2, np.float64)], s, geometry)
    with pytest.raises(rc.ArgumentError, match="s_rows"):
        encode_snapshot(key, tokens, r, s + s, geometry)
    with pytest.raises(rc.ArgumentError, match="int32"):
        snapshot_key("ns", geometry, [2**31])
    with pytest.raises(rc.ArgumentError, match="namespace"):
        snapshot_key(b"ns", geometry, tokens)
    with pytest.raises(rc.ArgumentError, match="tokens"):
        decode_snapshot(entry, key, geometry, [[1]])


def test_n_layer_zero_geometry_round_trips(tmp_path):
    geometry = Geometry(0, 4, 4)
    key = snapshot_key("x", geometry, [3])
    entry = encode_snapshot(key, [3], [], [], geometry)
    assert decode_snapshot(entry, key, geometry, [3]) == ([], [])
    path = tmp_path / "e.ggsq"
    path.write_bytes(entry[:-TRAILER_SIZE])
    assert describe(path.read_bytes())["n_layer"] == 0
    assert os.path.getsize(path) == len(entry) - TRAILER_SIZE
