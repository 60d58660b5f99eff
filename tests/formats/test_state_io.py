"""State serialisation (SPEC.md §5): exact bytes, round trips, and damaged blobs.

Every test that takes ``rc`` runs against the compiled core and the
pure-Python reference.  Expected blobs are spelled out with ``struct.pack``
from the cell table each test builds and asserts first.
"""

from __future__ import annotations

import io
import struct

import hypothesis.strategies as st
import numpy as np
import pytest
from golden import formula, store
from rows import host
from hypothesis import HealthCheck, given, settings

import recurrent_cache
import recurrent_cache.cache
from variants import ENGINES, VARIANTS, package_on
from recurrent_cache.errors import ArgumentError, SeqIdError, StateError
from recurrent_cache.formats.blob import parse_blob

IMPLEMENTATIONS = [package_on(variant) for variant in VARIANTS]
TYPE_ID = {"f32": 0, "f16": 1, "bf16": 30}
ITEMSIZE = {"f32": 4, "f16": 2, "bf16": 2}
NUMPY = {"f32": "<f4", "f16": "<f2"}
HYPOTHESIS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# -- helpers -------------------------------------------------------------------

def decode(cache, rc, seqs, n_tokens=1):
    """One batch: n_tokens tokens for each seq in seqs, continuing its positions."""
    token, pos, seq_id = [], [], []
    for seq in seqs:
        start = cache.seq_pos_max(seq) + 1
        for p in range(start, start + n_tokens):
            token.append(1)
            pos.append(p)
            seq_id.append(seq)
    for _ in cache.init_batch(rc.Batch(token=token, pos=pos, seq_id=seq_id)):
        pass


def fill(cache, salt):
    """Distinct values in every row of every tensor (exact in f32, f16 and bf16)."""
    for k, tensor in enumerate(list(cache.r) + list(cache.s)):
        for row in range(cache.size):
            store(tensor[row], formula(salt, row, k, 3, tensor.shape[1]))


def row_bytes(values, dtype):
    """Little-endian bytes of float32 values stored as dtype (bf16: the upper half)."""
    values = np.asarray(values, dtype=np.float32)
    if dtype == "bf16":
        return (values.view(np.uint32) >> 16).astype("<u2").tobytes()
    return values.astype(NUMPY[dtype]).tobytes()


def raw(tensor):
    return np.ascontiguousarray(host(tensor)).view(np.uint8).tobytes()


def snapshot(cache):
    """Everything a read may change: head, used, n, every cell, every byte of every row."""
    return (cache.head, cache.used, cache.n, [cache.cell(i) for i in range(cache.size)],
            [raw(tensor) for tensor in list(cache.r) + list(cache.s)])


def table(cache):
    return [cache.cell(i) for i in range(cache.size)]


def forked_cache(rc, dtype_r="f32", dtype_s="f32", n_layer=2):
    """Six cells: 1 {1} pos 0, 3 {3} pos 7, 4 {0, 4, 5} pos 0; cells 0, 2 and 5 free.

    Seq 0 and 5 joined cell 4 after seq 4, so its member list is not sorted.
    """
    cache = rc.RecurrentCache(n_layer, 2, 3, n_seq_max=6, dtype_r=dtype_r, dtype_s=dtype_s)
    for seq in range(5):
        decode(cache, rc, [seq])
    cache.seq_rm(2, -1, -1)
    cache.seq_cp(4, 5, -1, -1)
    cache.seq_cp(4, 0, -1, -1)   # seq 0 leaves cell 0, which becomes free
    cache.seq_add(3, 0, -1, 7)
    fill(cache, salt=9)
    assert [c[0] for c in table(cache)] == [-1, 0, -1, 7, 0, -1]
    assert [c[3] for c in table(cache)] == [(), (1,), (), (3,), (0, 4, 5), ()]
    return cache


def expected_rows(cache, cells, dtype_r, dtype_s):
    """The tensor sections of a blob holding ``cells``, from the values ``fill(salt=9)`` wrote."""
    out = b""
    n_layer = cache.n_layer
    for k in range(2 * n_layer):
        dtype, width = (dtype_r, 2) if k < n_layer else (dtype_s, 3)
        out += struct.pack("<iQ", TYPE_ID[dtype], width * ITEMSIZE[dtype])
        out += b"".join(row_bytes(formula(9, c, k, 3, width), dtype) for c in cells)
    return out


# -- exact bytes ---------------------------------------------------------------

@pytest.mark.parametrize("dtype_r,dtype_s", [("f32", "f32"), ("f16", "bf16"), ("bf16", "f16")])
def test_whole_cache_blob_is_byte_exact(rc, dtype_r, dtype_s):
    cache = forked_cache(rc, dtype_r, dtype_s)
    expected = (struct.pack("<I", 3)
                + struct.pack("<iIi", 0, 1, 1)            # cell 1: pos 0, seq 1
                + struct.pack("<iIi", 7, 1, 3)            # cell 3: pos 7, seq 3
                + struct.pack("<iI3i", 0, 3, 0, 4, 5)     # cell 4: seqs sorted
                + struct.pack("<II", 0, 2)                # v_trans, n_layer
                + expected_rows(cache, [1, 3, 4], dtype_r, dtype_s))   # ranges [1, 2) and [3, 5)
    assert cache.state_write() == expected
    assert cache.state_write(seq_id=-1) == expected
    assert cache.state_size() == len(expected)


@pytest.mark.parametrize("seq,cell,pos", [(5, 4, 0), (0, 4, 0), (3, 3, 7), (1, 1, 0)])
def test_sequence_blob_is_byte_exact(rc, seq, cell, pos):
    cache = forked_cache(rc, "f16", "f32")
    expected = (struct.pack("<I", 1) + struct.pack("<iI", pos, 0)   # n_seq_id is always 0
                + struct.pack("<II", 0, 2) + expected_rows(cache, [cell], "f16", "f32"))
    assert cache.state_write(seq) == expected
    assert cache.state_size(seq) == len(expected)


def test_blob_of_a_sequence_without_a_cell_has_no_cells(rc):
    cache = forked_cache(rc)
    expected = struct.pack("<I", 0) + struct.pack("<II", 0, 2) + expected_rows(cache, [], "f32", "f32")
    assert cache.state_write(2) == expected


def test_blob_of_an_empty_cache_and_of_a_cache_without_layers(rc):
    assert rc.RecurrentCache(1, 2, 3, n_seq_max=3).state_write() == (
        struct.pack("<III", 0, 0, 1) + struct.pack("<iQ", 0, 8) + struct.pack("<iQ", 0, 12))
    cache = rc.RecurrentCache(0, 2, 3, n_seq_max=3)
    decode(cache, rc, [2], n_tokens=4)
    assert cache.state_write() == struct.pack("<IiIiII", 1, 3, 1, 2, 0, 0)
    assert cache.state_write(2) == struct.pack("<IiIII", 1, 3, 0, 0, 0)


def test_whole_cache_blob_of_a_full_cache_is_one_range(rc):
    cache = rc.RecurrentCache(1, 1, 1, n_seq_max=3)
    decode(cache, rc, [0, 1, 2])
    for row in range(3):
        cache.r[0][row] = row + 1
        cache.s[0][row] = -(row + 1)
    meta = b"".join(struct.pack("<iIi", 0, 1, cache.cell(c)[3][0]) for c in range(3))
    assert cache.state_write() == (struct.pack("<I", 3) + meta + struct.pack("<II", 0, 1)
                                   + struct.pack("<iQ3f", 0, 4, 1, 2, 3)
                                   + struct.pack("<iQ3f", 0, 4, -1, -2, -3))


# -- round trips ---------------------------------------------------------------

@pytest.mark.parametrize("dtype_r,dtype_s", [(a, b) for a in TYPE_ID for b in TYPE_ID])
def test_whole_cache_round_trip_into_a_fresh_cache(rc, dtype_r, dtype_s):
    source = forked_cache(rc, dtype_r, dtype_s)
    blob = source.state_write()
    target = rc.RecurrentCache(2, 2, 3, n_seq_max=6, dtype_r=dtype_r, dtype_s=dtype_s)
    fill(target, salt=4)   # rows the read must zero
    assert target.state_read(blob) == len(blob)
    target.check()
    # blob cell i becomes cell i, with its own row (src = i)
    # (pos, src, tail, seq ids); tail[s] is stored on cell s: 0 -> 2, 1 -> 0, 3 -> 1, 4 -> 2, 5 -> 2
    assert table(target) == [(0, 0, 2, (1,)), (7, 1, 0, (3,)), (0, 2, -1, (0, 4, 5)),
                             (-1, -1, 1, ()), (-1, -1, 2, ()), (-1, -1, 2, ())]
    assert (target.head, target.used) == (0, 3)
    for source_tensor, target_tensor in zip(list(source.r) + list(source.s), list(target.r) + list(target.s)):
        assert raw(target_tensor[:3]) == raw(source_tensor[[1, 3, 4]])
        assert not np.any(host(target_tensor[3:]).view(np.uint8))
    assert target.state_write() == blob
    for seq in range(6):
        assert target.seq_pos_max(seq) == source.seq_pos_max(seq)
        assert target.state_write(seq) == source.state_write(seq)


@pytest.mark.parametrize("dtype", list(TYPE_ID))
def test_sequence_round_trip_into_another_seq_and_another_cache(rc, dtype):
    source = forked_cache(rc, dtype, dtype)
    blob = source.state_write(3)
    target = rc.RecurrentCache(2, 2, 3, n_seq_max=4, dtype_r=dtype, dtype_s=dtype)
    decode(target, rc, [0, 1, 2])
    fill(target, salt=2)
    before = snapshot(target)
    target.state_read(blob, seq_id=1)
    target.check()
    cell = target.cell(1)[2]   # the tail of seq 1
    assert target.cell(cell) == (7, cell, target.cell(cell)[2], (1,))
    assert target.seq_pos_max(1) == 7
    assert target.state_write(1) == blob   # a sequence blob does not name its seq
    for k, (s, t) in enumerate(zip(list(source.r) + list(source.s), list(target.r) + list(target.s))):
        assert raw(t[cell]) == raw(s[3])
        stride = host(t).strides[0]
        for row in range(4):   # every other row is untouched
            if row != cell:
                assert raw(t[row]) == before[4][k][row * stride:(row + 1) * stride]


def test_sequence_read_places_the_cell_with_find_slot(rc):
    # seq 1 is removed from cell 1, then find_slot takes the first free cell from head
    cache = rc.RecurrentCache(1, 1, 1, n_seq_max=5)
    for seq in range(3):
        decode(cache, rc, [seq])   # cells 0, 1, 2; head 2
    blob = (struct.pack("<IiIII", 1, 41, 0, 0, 1)   # one cell at pos 41, one layer
            + struct.pack("<iQf", 0, 4, 1.5) + struct.pack("<iQf", 0, 4, -1.5))
    cache.state_read(blob, seq_id=1)   # seq_rm frees cell 1 and moves head down to it
    cache.check()
    assert table(cache) == [(0, 0, 0, (0,)), (41, 1, 1, (1,)), (0, 2, 2, (2,)),
                            (-1, -1, -1, ()), (-1, -1, -1, ())]
    assert (cache.head, cache.used, cache.n) == (1, 3, 1)
    assert cache.r[0][1, 0] == 1.5 and cache.s[0][1, 0] == -1.5
    cache.state_read(blob, seq_id=4)   # no cell to free: the first free cell from head 1 is 3
    cache.check()
    assert cache.cell(3) == (41, 3, -1, (4,)) and cache.cell(4)[2] == 3
    assert (cache.head, cache.used, cache.n) == (3, 4, 1)


def test_sequence_read_into_a_shared_cell_gives_the_sequence_its_own_cell(rc):
    cache = forked_cache(rc)
    blob = cache.state_write(3)
    other_rows = [raw(t[4]) for t in list(cache.r) + list(cache.s)]
    cache.state_read(blob, seq_id=5)   # seq 5 shared cell 4 with seqs 0 and 4
    cache.check()
    assert cache.cell(4)[3] == (0, 4)
    new_cell = cache.cell(5)[2]
    assert new_cell not in (1, 3, 4)
    assert cache.cell(new_cell)[0] == 7 and cache.cell(new_cell)[3] == (5,)
    assert cache.state_write(5) == blob
    assert [raw(t[4]) for t in list(cache.r) + list(cache.s)] == other_rows


def test_empty_sequence_blob_removes_the_sequence(rc):
    cache = forked_cache(rc)
    empty = cache.state_write(2)   # seq 2 has no cell
    rows = [raw(t) for t in list(cache.r) + list(cache.s)]
    cache.state_read(empty, seq_id=3)
    cache.check()
    assert cache.seq_pos_max(3) == -1 and cache.used == 2
    assert cache.state_write(3) == empty
    cache.state_read(empty, seq_id=2)   # already absent: nothing changes
    assert [raw(t) for t in list(cache.r) + list(cache.s)] == rows


def test_empty_whole_cache_blob_clears_the_cache(rc):
    cache = forked_cache(rc)
    cache.state_read(rc.RecurrentCache(2, 2, 3, n_seq_max=6).state_write())
    cache.check()
    assert cache.used == 0 and cache.head == 0
    assert all(c == (-1, -1, -1, ()) for c in table(cache))
    assert not any(np.any(host(t).view(np.uint8)) for t in list(cache.r) + list(cache.s))


def test_round_trip_after_removing_every_sequence_and_keeping_one(rc):
    cache = forked_cache(rc)
    cache.seq_keep(4)
    blob = cache.state_write()
    assert parse_blob(blob).cells[0].seq_ids == (4,)
    fresh = rc.RecurrentCache(2, 2, 3, n_seq_max=6)
    fresh.state_read(blob)
    assert fresh.state_write() == blob and fresh.state_write(4) == cache.state_write(4)


def _random_workload(rc, ops, size):
    cache = rc.RecurrentCache(2, 3, 2, n_seq_max=size, dtype_r="bf16", dtype_s="f16")
    for step, (kind, a, b) in enumerate(ops):
        a %= size
        b %= size
        if kind == "decode":
            decode(cache, rc, sorted({a, b}))
            fill(cache, salt=step)
        elif kind == "fork":
            cache.seq_cp(a, b, -1, -1)
        elif kind == "remove":
            cache.seq_rm(a, -1, -1)
        else:
            cache.seq_keep(a)
    return cache


WORKLOAD = st.lists(st.tuples(st.sampled_from(["decode", "decode", "fork", "remove", "keep"]),
                              st.integers(0, 15), st.integers(0, 15)), max_size=12)


@HYPOTHESIS
@given(ops=WORKLOAD, size=st.integers(1, 7))
def test_both_implementations_write_and_read_the_same_blobs(ops, size):
    core = _random_workload(recurrent_cache, ops, size)
    ref = _random_workload(package_on("reference"), ops, size)
    assert core.state_write() == ref.state_write()
    for seq in range(size):
        blob = core.state_write(seq)
        assert blob == ref.state_write(seq)
        # a sequence read back into its own cache keeps its bytes
        core.state_read(blob, seq)
        ref.state_read(blob, seq)
        core.check()
        assert snapshot(core) == snapshot(ref)
        assert core.state_write(seq) == blob
    whole = core.state_write()
    for cache in (core, ref):
        cache.state_read(whole)
        cache.check()
        assert cache.state_write() == whole
    assert snapshot(core) == snapshot(ref)


# -- damaged blobs and bad arguments -------------------------------------------

def target_and_blobs(rc):
    """A populated cache to read into, and valid whole and sequence blobs for it."""
    source = forked_cache(rc, "f16", "bf16")
    target = rc.RecurrentCache(2, 2, 3, n_seq_max=6, dtype_r="f16", dtype_s="bf16")
    decode(target, rc, [0, 2, 5], n_tokens=2)
    target.seq_cp(2, 1, -1, -1)
    fill(target, salt=77)
    return target, {-1: source.state_write(), 0: source.state_write(0), 3: source.state_write(3)}


def expect_rejected(cache, data, seq_id, error=StateError, match=None):
    before = snapshot(cache)
    with pytest.raises(error, match=match) as info:
        cache.state_read(data, seq_id)
    assert snapshot(cache) == before
    cache.check()
    return str(info.value)


@pytest.mark.parametrize("seq_id", [-1, 0, 3])
def test_truncation_at_every_offset_is_rejected(rc, seq_id):
    cache, blobs = target_and_blobs(rc)
    blob = blobs[seq_id]
    for keep in range(len(blob)):
        expect_rejected(cache, blob[:keep], seq_id, match=rf"truncated at byte \d+ of {keep}")


@pytest.mark.parametrize("seq_id", [-1, 0])
@HYPOTHESIS
@given(extra=st.binary(min_size=1, max_size=40))
def test_trailing_bytes_are_rejected(rc, seq_id, extra):
    cache, blobs = target_and_blobs(rc)
    blob = blobs[seq_id]
    expect_rejected(cache, blob + extra, seq_id, match=f"{len(extra)} trailing bytes after byte {len(blob)}")


def _meta_offsets(blob):
    """Offsets of the header fields of a valid blob: {name: offset}."""
    parsed = parse_blob(blob)
    offsets = {"cell_count": 0}
    at = 4
    for i, cell in enumerate(parsed.cells):
        offsets[f"pos{i}"] = at
        offsets[f"n_seq_id{i}"] = at + 4
        for j in range(len(cell.seq_ids)):
            offsets[f"seq_id{i}.{j}"] = at + 8 + 4 * j
        at += 8 + 4 * len(cell.seq_ids)
    offsets["v_trans"] = at
    offsets["n_layer"] = at + 4
    for k, tensor in enumerate(parsed.tensors):
        offsets[f"type{k}"] = tensor.offset - 12
        offsets[f"row_bytes{k}"] = tensor.offset - 8
    return offsets


def _set(blob, offset, fmt, value):
    damaged = bytearray(blob)
    struct.pack_into(fmt, damaged, offset, value)
    return bytes(damaged)


# (seq_id of the blob, field, struct format, bad value, message fragment)
FIELDS_OUT_OF_RANGE = [
    (-1, "cell_count", "<I", 7, "7 cells at byte 0, more than the cache's 6"),
    (-1, "cell_count", "<I", 2**32 - 1, "more than the cache's 6"),
    (-1, "cell_count", "<I", 2, "n_layer 3 at byte 32"),            # cell 2's pos and n_seq_id
    (-1, "cell_count", "<I", 4, "cell 3 lists seq_id 1 at byte 56, already listed by cell 0"),
    (0, "cell_count", "<I", 2, "sequence state blob has 2 cells"),
    (0, "cell_count", "<I", 2**31, "sequence state blob has 2147483648 cells"),
    (-1, "pos0", "<i", -1, "cell 0 has pos -1 at byte 4: positions must be in"),
    (0, "pos0", "<i", -2**31, "positions must be in"),
    (0, "pos0", "<i", 2**31 - 1, "positions must be in"),
    (-1, "n_seq_id0", "<I", 0, "cell 0 has no seq id"),
    (-1, "n_seq_id2", "<I", 7, "n_seq_id 7 at byte 32, more than the cache's 6 sequences"),
    (-1, "n_seq_id2", "<I", 2**32 - 1, "more than the cache's 6 sequences"),
    (-1, "n_seq_id2", "<I", 2, "v_trans is 5 at byte 44"),           # cell 2's last seq id
    (0, "n_seq_id0", "<I", 1, "sequence state blob cell 0 has n_seq_id 1 at byte 8"),
    (-1, "seq_id0.0", "<i", -1, "seq_id -1 at byte 12, out of range \\[0, 6\\)"),
    (-1, "seq_id0.0", "<i", 6, "seq_id 6 at byte 12"),
    (-1, "seq_id2.1", "<i", 0, "lists seq_id 0 at byte 40, already listed by cell 2"),
    (-1, "seq_id1.0", "<i", 1, "cell 1 lists seq_id 1 at byte 24, already listed by cell 0"),
    (-1, "v_trans", "<I", 1, "v_trans is 1 at byte 48"),
    (0, "v_trans", "<I", 2**32 - 1, "v_trans is 4294967295"),
    (-1, "n_layer", "<I", 3, "n_layer 3 at byte 52, the cache has 2"),
    (0, "n_layer", "<I", 0, "n_layer 0"),
    (-1, "type0", "<i", 0, "layer 0 r type 0 \\(f32\\) at byte 56 != the cache's 1 \\(f16\\)"),
    (-1, "type3", "<i", 1, "layer 1 s type 1 \\(f16\\) .* != the cache's 30 \\(bf16\\)"),
    (0, "type2", "<i", -7, "layer 0 s type -7 \\(unknown type\\)"),
    (-1, "row_bytes1", "<Q", 6, "layer 1 r row size 6 .* != the cache's 4"),
    (0, "row_bytes2", "<Q", 2**64 - 1, "layer 0 s row size 18446744073709551615"),
    (3, "row_bytes0", "<Q", 0, "layer 0 r row size 0"),
]


@pytest.mark.parametrize("seq_id,field,fmt,value,message", FIELDS_OUT_OF_RANGE,
                         ids=[f"{f[0]}-{f[1]}-{f[3]}" for f in FIELDS_OUT_OF_RANGE])
def test_each_header_field_out_of_range_is_rejected(rc, seq_id, field, fmt, value, message):
    cache, blobs = target_and_blobs(rc)
    blob = blobs[seq_id]
    expect_rejected(cache, _set(blob, _meta_offsets(blob)[field], fmt, value), seq_id, match=message)


@pytest.mark.parametrize("seq_id", [-1, 3])
@HYPOTHESIS
@given(data=st.data())
def test_byte_flips_are_rejected_or_read_identically_by_both(seq_id, data):
    """A flip either breaks the blob (StateError, nothing changed) or makes another valid one.

    Both implementations, and the compiled one on torch storage, must then agree, down to the
    error message.
    """
    outcomes = []
    for rc in IMPLEMENTATIONS:
        cache, blobs = target_and_blobs(rc)
        blob = bytearray(blobs[seq_id])
        if not outcomes:
            flips = data.draw(st.lists(st.tuples(st.integers(0, len(blob) - 1), st.integers(1, 255)),
                                       min_size=1, max_size=3))
        for offset, mask in flips:
            blob[offset] ^= mask
        before = snapshot(cache)
        try:
            cache.state_read(bytes(blob), seq_id)
        except StateError as exc:
            assert snapshot(cache) == before
            outcomes.append(str(exc))
        else:
            outcomes.append(snapshot(cache))
        cache.check()
    assert all(outcome == outcomes[0] for outcome in outcomes[1:])


@HYPOTHESIS
@given(garbage=st.binary(max_size=200), seq_id=st.sampled_from([-1, 0, 5]))
def test_garbage_is_rejected_the_same_way_by_both(garbage, seq_id):
    messages = [expect_rejected(target_and_blobs(rc)[0], garbage, seq_id) for rc in IMPLEMENTATIONS]
    assert all(message == messages[0] for message in messages[1:])


def test_a_blob_for_another_cache_shape_is_rejected(rc):
    cache, blobs = target_and_blobs(rc)
    f32 = rc.RecurrentCache(2, 2, 3, n_seq_max=6)
    expect_rejected(f32, blobs[-1], -1, match="type 1 \\(f16\\) .* != the cache's 0 \\(f32\\)")
    wider = rc.RecurrentCache(2, 4, 3, n_seq_max=6, dtype_r="f16", dtype_s="bf16")
    expect_rejected(wider, blobs[0], 0, match="row size 4 .* != the cache's 8")
    smaller = rc.RecurrentCache(2, 2, 3, n_seq_max=2, dtype_r="f16", dtype_s="bf16")
    expect_rejected(smaller, blobs[-1], -1, match="3 cells at byte 0, more than the cache's 2")
    expect_rejected(rc.RecurrentCache(1, 2, 3, n_seq_max=6, dtype_r="f16", dtype_s="bf16"),
                    blobs[3], 3, match="n_layer 2 .* the cache has 1")


@pytest.mark.parametrize("seq_id", [-2, 6, 2**31 - 1, -2**31])
def test_seq_id_out_of_range_is_rejected(rc, seq_id):
    cache, blobs = target_and_blobs(rc)
    before = snapshot(cache)
    for call in (lambda: cache.state_read(blobs[0], seq_id), lambda: cache.state_write(seq_id),
                 lambda: cache.state_size(seq_id), lambda: cache.state_write_into(bytearray(999), seq_id),
                 lambda: cache.state_read_from(io.BytesIO(blobs[0]), seq_id)):
        with pytest.raises(SeqIdError, match=f"seq_id must be in \\[-1, 6\\), got {seq_id}"):
            call()
    assert snapshot(cache) == before
    with pytest.raises(ArgumentError):
        cache.state_write(1.5)
    with pytest.raises(ArgumentError):
        cache.state_read(blobs[0], True)


def test_state_read_takes_any_bytes_like_object(rc):
    cache, blobs = target_and_blobs(rc)
    blob = blobs[-1]
    padded = bytearray(b"xx" + blob)
    for data in (blob, bytearray(blob), memoryview(blob), memoryview(padded)[2:],
                 np.frombuffer(blob, dtype=np.uint8), np.frombuffer(blob, dtype=np.uint8).reshape(1, -1)):
        fresh = rc.RecurrentCache(2, 2, 3, n_seq_max=6, dtype_r="f16", dtype_s="bf16")
        fresh.state_read(data)
        assert fresh.state_write() == blob
    for bad in ("text", 12, None, np.zeros((4, 4), np.uint8)[:, ::2]):
        with pytest.raises(ArgumentError):
            cache.state_read(bad)
    expect_rejected(cache, b"", -1, match="truncated at byte 0 of 0")


# -- state_write_into / state_read_from ----------------------------------------

def test_state_write_into_buffers(rc):
    cache = forked_cache(rc, "bf16", "f16")
    blob = cache.state_write()
    n = len(blob)
    exact = bytearray(n)
    assert cache.state_write_into(exact) == n and exact == blob
    larger = bytearray(b"\xee" * (n + 5))
    assert cache.state_write_into(larger) == n
    assert larger[:n] == blob and larger[n:] == b"\xee" * 5   # only the blob's bytes are written
    array = np.zeros((n + 3) // 4, dtype=np.float32)   # any dtype: its bytes
    assert cache.state_write_into(array) == n and array.view(np.uint8)[:n].tobytes() == blob
    view = memoryview(bytearray(n + 2))[1:]
    assert cache.state_write_into(view) == n and bytes(view[:n]) == blob
    small = bytearray(n - 1)
    with pytest.raises(ArgumentError, match=f"has {n - 1} bytes, the blob needs {n}"):
        cache.state_write_into(small)
    assert small == bytearray(n - 1)
    for bad in (bytes(n), memoryview(bytes(n)), 5, "path", np.zeros((n, 2), np.uint8)[:, 0]):
        with pytest.raises(ArgumentError):
            cache.state_write_into(bad)


def test_state_write_into_and_read_from_files(rc, tmp_path):
    cache = forked_cache(rc)
    blob = cache.state_write(-1)
    buffer = io.BytesIO()
    buffer.write(b"header")
    assert cache.state_write_into(buffer) == len(blob)
    assert buffer.getvalue() == b"header" + blob
    path = tmp_path / "state.bin"
    for buffering in (0, -1):   # a raw file may write less than asked
        with open(path, "wb", buffering=buffering) as file:
            assert cache.state_write_into(file, seq_id=4) == cache.state_size(4)
        assert path.read_bytes() == cache.state_write(4)
    with open(tmp_path / "text.txt", "w") as text, pytest.raises(ArgumentError, match="binary mode"):
        cache.state_write_into(text)
    fresh = rc.RecurrentCache(2, 2, 3, n_seq_max=6)
    source = io.BytesIO(b"header" + blob)
    source.seek(6)
    assert fresh.state_read_from(source) == len(blob)
    assert fresh.state_write() == blob
    with open(path, "rb") as file:
        fresh.state_read_from(file, seq_id=2)
    assert fresh.state_write(2) == cache.state_write(4)
    with open(path) as text, pytest.raises(ArgumentError, match="binary mode"):
        fresh.state_read_from(text)
    with pytest.raises(ArgumentError, match="binary file"):
        fresh.state_read_from(blob)


def test_state_write_returns_bytes_and_size_matches(rc):
    cache = forked_cache(rc)
    for seq_id in range(-1, 6):
        blob = cache.state_write(seq_id)
        assert type(blob) is bytes and len(blob) == cache.state_size(seq_id)


# -- reading from files: bounded by the blob's headers ---------------------------

@pytest.mark.parametrize("dtype_r,dtype_s", [("f32", "bf16"), ("f16", "f32"), ("bf16", "f16")])
def test_the_geometry_of_a_cache_is_the_one_its_reads_check(dtype_r, dtype_s):
    from recurrent_cache.formats.geometry import Geometry
    for n_layer in (0, 1, 3):
        core, reference = (recurrent_cache.RecurrentCache(n_layer, 5, 7, n_seq_max=4, dtype_r=dtype_r,
                                                          dtype_s=dtype_s, engine=engine)
                           for engine in ENGINES)
        assert Geometry.of(core) == Geometry.of(reference)
        # what a read checks; without layers no row width or type is recorded in the tensors
        checked = reference.memory_core.shape()
        assert (checked.size, checked.n_layer, checked.type_ids, checked.row_bytes) == \
               (core.size, n_layer, Geometry.of(core).type_ids, Geometry.of(core).row_bytes)
        if n_layer:
            assert checked == Geometry.of(core)


def test_state_read_from_reads_only_what_the_headers_claim(rc):
    cache, blobs = target_and_blobs(rc)
    blob = blobs[-1]
    for extra in (b"\0", b"more data" * 1000):
        file = io.BytesIO(blob + extra)
        message = expect_rejected_from(cache, file)
        with pytest.raises(StateError) as from_memory:
            cache.state_read(blob + extra)
        assert message == str(from_memory.value)
    # a header claiming 2**64 - 1 bytes of rows is refused before a row is read
    huge = bytearray(blobs[0])
    layer_1_r_row_bytes = len(huge) - 2 * (12 + 3 * 2) - (12 + 2 * 2) + 4   # s rows: 6 bytes, r: 4
    struct.pack_into("<Q", huge, layer_1_r_row_bytes, 2**64 - 1)
    file = io.BytesIO(bytes(huge))
    assert "row" in expect_rejected_from(cache, file, 0)   # refused at the header, bounded by the cache


def expect_rejected_from(cache, file, seq_id=-1):
    before = snapshot(cache)
    with pytest.raises(StateError) as info:
        cache.state_read_from(file, seq_id)
    assert snapshot(cache) == before
    return str(info.value)
