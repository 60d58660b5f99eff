"""The layer filter (SPEC §5, issue 18): ``RecurrentCache(..., layers=...)`` keeps state for some
layers only, as llama.cpp's recurrent memory does for a hybrid model's recurrent layers.

The oracle for behaviour is an unfiltered cache of as many layers driven the same way (a filtered
layer must behave exactly as the k-th layer of that cache); the oracle for bytes is ``llama_blob``
below, llama.cpp's layout written with ``struct`` from the cache's public cells and rows, and the
blobs llama.cpp itself recorded (tests/data/llamacpp_current).
"""

from __future__ import annotations

import ctypes
import gzip
import io
import json
import struct
from pathlib import Path

import numpy as np
import pytest

from recurrent_cache import errors
from recurrent_cache.models import recurrent_layers
from recurrent_cache.formats.geometry import Geometry
from recurrent_cache.stores import DirectoryStore, decode_snapshot, encode_snapshot, snapshot_key
from rows import assign, host
from rows import dtype as dtype_of

CURRENT = Path(__file__).parents[1] / "data" / "llamacpp_current"
GGML_TYPE = {"f32": 0, "f16": 1, "bf16": 30}
ITEMSIZE = {"f32": 4, "f16": 2, "bf16": 2}
N_LAYER, LAYERS = 5, (0, 2, 3)


def llama_blob(cache, seq_id=-1):
    """llama.cpp's recurrent state_write, written independently of the package's writers: the
    cells' meta, ``n_layer`` = the model's layer count, then the r sections of the layers that hold
    state, then their s sections (a filtered-out layer writes nothing)."""
    cells = [i for i in range(cache.size)
             if (seq_id in cache.cell(i)[3] if seq_id >= 0 else cache.cell(i)[3])]
    out = [struct.pack("<I", len(cells))]
    for i in cells:
        ids = cache.cell(i)[3] if seq_id < 0 else ()
        out.append(struct.pack(f"<iI{len(ids)}i", cache.cell(i)[0], len(ids), *ids))
    out.append(struct.pack("<II", 0, cache.n_layer))
    for tensors, dtype, n_embd in ((cache.r, cache.dtype_r, cache.n_embd_r), (cache.s, cache.dtype_s, cache.n_embd_s)):
        for il in range(cache.n_layer):
            if il not in cache.layers:
                continue
            out.append(struct.pack("<iQ", GGML_TYPE[dtype], n_embd * ITEMSIZE[dtype]))
            out.extend(host(tensors[il][i]).tobytes() for i in cells)
    return b"".join(out)


def snapshot(cache):
    return ([cache.cell(i) for i in range(cache.size)], cache.head, cache.used,
            [None if t is None else host(t) for t in cache.r + cache.s])


def assert_unchanged(cache, before):
    cells, head, used, tensors = snapshot(cache)
    assert (cells, head, used) == before[:3]
    for a, b in zip(tensors, before[3]):
        assert (a is None and b is None) or np.array_equal(a, b)


class Twins:
    """A filtered cache and an unfiltered one of its filtered layers, fed the same rows."""

    def __init__(self, rc, n_rollback=0, dtype="f32", seed=0):
        kw = dict(n_seq_max=4, n_rollback=n_rollback, dtype_r=dtype, dtype_s=dtype)
        self.filtered = rc.RecurrentCache(N_LAYER, 3, 5, layers=[3, 0, 2], **kw)
        self.plain = rc.RecurrentCache(len(LAYERS), 3, 5, **kw)
        self.rng = np.random.default_rng(seed)
        self.rc = rc

    def feed(self, entries):
        token, pos, seq_id = [], [], []
        for seq, n in entries:
            start = self.plain.seq_pos_max(seq) + 1
            token += [1] * n
            pos += range(start, start + n)
            seq_id += [seq] * n
        states = [c.init_batch(self.rc.Batch(token=token, pos=pos, seq_id=seq_id), n_ubatch=3)
                  for c in (self.filtered, self.plain)]
        for _ in zip(*states):
            for k, il in enumerate(LAYERS):
                for rows_f, rows_p in ((states[0].r(il), states[1].r(k)), (states[0].s(il), states[1].s(k))):
                    values = self.rng.standard_normal(tuple(rows_p.shape)).astype(dtype_of(rows_p))
                    assign(rows_f, values)
                    assign(rows_p, values)
                m = states[1].r_steps(k).shape[1]
                if m:
                    for steps_f, steps_p in ((states[0].r_steps(il), states[1].r_steps(k)),
                                             (states[0].s_steps(il), states[1].s_steps(k))):
                        values = self.rng.standard_normal(tuple(steps_p.shape)).astype(dtype_of(steps_p))
                        assign(steps_f, values)
                        assign(steps_p, values)

    def assert_same(self):
        f, p = self.filtered, self.plain
        assert [f.cell(i) for i in range(f.size)] == [p.cell(i) for i in range(p.size)]
        assert (f.head, f.used) == (p.head, p.used)
        for k, il in enumerate(LAYERS):
            assert np.array_equal(host(f.r[il]), host(p.r[k])) and np.array_equal(host(f.s[il]), host(p.s[k]))
        for il in set(range(N_LAYER)) - set(LAYERS):
            assert f.r[il] is None and f.s[il] is None


# -- arguments -------------------------------------------------------------------------------

def test_layers_are_kept_sorted_and_others_are_none(rc):
    cache = rc.RecurrentCache(N_LAYER, 3, 5, layers=(3, np.int64(0), 2))
    assert cache.layers == LAYERS and type(cache.layers[1]) is int
    assert len(cache.r) == len(cache.s) == N_LAYER
    assert [t is None for t in cache.r] == [False, True, False, False, True]
    assert rc.RecurrentCache(N_LAYER, 3, 5).layers == tuple(range(N_LAYER))
    assert rc.RecurrentCache(N_LAYER, 3, 5, layers=range(N_LAYER)).layers == tuple(range(N_LAYER))
    assert "layers=(0, 2, 3)" in repr(cache)


@pytest.mark.parametrize(("layers", "words"), [
    ([0, 2, 2], "must not repeat a layer, got 2 twice"),
    ([0, 5], "layers entry must be in [0, 5), got 5"),
    ([-1], "layers entry must be in [0, 5), got -1"),
    ([True], "layers entry must be an integer, got True"),
    ([1.0], "layers entry must be an integer, got 1.0"),
    ("02", "must be None or an iterable of layer indices, got str"),
    (3, "must be None or an iterable of layer indices, got int"),
])
def test_bad_filters_are_refused(rc, layers, words):
    with pytest.raises(rc.ConfigError, match=words.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        rc.RecurrentCache(N_LAYER, 3, 5, layers=layers)


def test_a_layer_without_state_has_no_rows_to_write(rc):
    cache = rc.RecurrentCache(N_LAYER, 3, 5, n_rollback=2, layers=LAYERS)
    st = cache.init_batch(rc.Batch(token=[1, 2, 3], seq_id=[0] * 3, pos=range(3)))
    st.apply()
    for call in (st.r, st.s, st.r_steps, st.s_steps):
        with pytest.raises(rc.OutOfRangeError, match=r"layer 1 holds no recurrent state \(layers=\(0, 2, 3\)\)"):
            call(1)
        assert call(2).shape[-1] in (3, 5)
    with pytest.raises(rc.OutOfRangeError, match=r"layer index must be in \[0, 5\)"):
        st.r(5)


def test_an_empty_filter_allocates_nothing_and_moves_positions(rc):
    cache = rc.RecurrentCache(4, 3, 5, n_seq_max=2, layers=())
    assert cache.layers == () and all(t is None for t in cache.r + cache.s)
    for _ in cache.init_batch(rc.Batch(token=[1, 2], seq_id=[0, 1], pos=[0, 0])):
        pass
    assert (cache.seq_pos_max(0), cache.seq_pos_max(1)) == (0, 0)
    blob = cache.state_write()
    assert blob == llama_blob(cache)
    assert blob.endswith(struct.pack("<II", 0, 4))
    other = rc.RecurrentCache(4, 3, 5, n_seq_max=2, layers=())
    other.state_read(blob)
    assert [other.cell(i) for i in range(2)] == [cache.cell(i) for i in range(2)]
    assert cache.seq_state(0) == ([], [])


# -- behaviour: the filtered layers are an unfiltered cache's ----------------------------------

def test_placement_and_sequence_ops_match_an_unfiltered_cache(rc):
    twins = Twins(rc)
    twins.feed([(0, 4), (1, 2)])
    twins.assert_same()
    for cache in (twins.filtered, twins.plain):
        cache.seq_cp(0, 2)
    twins.feed([(2, 3), (1, 1)])
    twins.assert_same()
    for cache in (twins.filtered, twins.plain):
        cache.seq_add(1, 0, 10, 5)
        cache.seq_keep(2)
    twins.assert_same()
    for cache in (twins.filtered, twins.plain):
        cache.clear()
    twins.assert_same()


def test_rollback_matches_an_unfiltered_cache(rc):
    twins = Twins(rc, n_rollback=3, seed=1)
    twins.feed([(0, 5), (1, 4)])
    twins.feed([(0, 2)])
    rolled = 0
    for seq in (0, 1):
        q = twins.plain.seq_rollback_min(seq)
        assert twins.filtered.seq_rollback_min(seq) == q
        if 0 <= q < twins.plain.seq_pos_max(seq):
            results = [cache.seq_rm(seq, q + 1, -1) for cache in (twins.filtered, twins.plain)]
            assert results == [True, True]
            rolled += 1
        twins.assert_same()
    assert rolled
    # history is kept for the filtered layers only: what the core holds is the unfiltered twin's
    tags_f, hist_f = twins.filtered.memory_core.history()
    tags_p, hist_p = twins.plain.memory_core.history()
    assert np.array_equal(tags_f, tags_p) and len(hist_f) == 2 * len(LAYERS)
    assert all(np.array_equal(host(a), host(b)) for a, b in zip(hist_f, hist_p))


# -- bytes ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_blobs_are_llama_cpp_layout_for_every_dtype(rc, dtype):
    twins = Twins(rc, dtype=dtype, seed=2)
    twins.feed([(0, 3), (1, 2), (3, 1)])
    twins.filtered.seq_cp(0, 2)
    cache = twins.filtered
    for seq_id in (-1, 0, 1, 2, 3):
        blob = cache.state_write(seq_id)
        assert blob == llama_blob(cache, seq_id)
        assert cache.state_size(seq_id) == len(blob)
        target = bytearray(len(blob))
        assert cache.state_write_into(target, seq_id) == len(blob) and target == blob
    whole = cache.state_write()
    other = rc.RecurrentCache(N_LAYER, 3, 5, n_seq_max=4, dtype_r=dtype, dtype_s=dtype, layers=LAYERS)
    other.state_read(whole)
    assert other.state_write() == whole
    for il in LAYERS:
        assert np.array_equal(host(other.r[il]).view(np.uint8), host(cache.r[il]).view(np.uint8))


@pytest.mark.parametrize("layers", [(0, 2), (1,), (0, 1, 2, 3), (), None])
def test_another_filter_is_refused_with_the_cache_unchanged(rc, layers):
    twins = Twins(rc, seed=3)
    twins.feed([(0, 2)])
    blob = twins.filtered.state_write()
    target = rc.RecurrentCache(N_LAYER, 3, 5, n_seq_max=4, layers=layers)
    for _ in target.init_batch(rc.Batch(token=[1], seq_id=[1], pos=[0])):
        pass
    before = snapshot(target)
    with pytest.raises(rc.StateError):
        target.state_read(blob)
    assert_unchanged(target, before)
    with pytest.raises(rc.StateError):
        target.state_read(twins.plain.state_write())   # n_layer 3 != 5 (and fewer sections)
    assert_unchanged(target, before)


def test_a_filter_of_as_many_layers_cannot_be_told_apart(rc):
    """SPEC §5: a blob does not say which layers its sections are; count, types and widths are checked."""
    twins = Twins(rc, seed=3)
    twins.feed([(0, 2)])
    blob = twins.filtered.state_write()
    target = rc.RecurrentCache(N_LAYER, 3, 5, n_seq_max=4, layers=(1, 2, 4))
    target.state_read(blob)
    assert target.state_write() == blob


def test_a_section_error_names_the_model_layer(rc):
    cache = rc.RecurrentCache(N_LAYER, 3, 5, layers=LAYERS)
    blob = bytearray(cache.state_write())
    # the third r section's header (layer 3's): type id f16 instead of f32
    offset = 4 + 8 + 2 * 12
    struct.pack_into("<i", blob, offset, 1)
    with pytest.raises(rc.StateError, match="layer 3 r"):
        cache.state_read(bytes(blob))


def recording(scenario):
    with gzip.open(CURRENT / "records.jsonl.gz", "rt") as file:
        for line in file:
            record = json.loads(line)
            if record["scenario"] == scenario:
                return record
    raise AssertionError(scenario)


@pytest.mark.parametrize("scenario", ["jamba", "jamba_fa_unified", "nemotron_h_unified"])
def test_llama_cpp_recurrent_sections_read_into_the_matching_filter(rc, scenario):
    record = recording(scenario)
    shape = record["shape"]
    model = CURRENT / f"tiny_{record['model']}.gguf"
    assert recurrent_layers(model) == tuple(shape["recurrent_layers"])
    n_seq_max = record["context"]["n_seq_max"]

    def cache(layers):
        return rc.RecurrentCache(shape["n_layer"], shape["n_embd_r"], shape["n_embd_s"], n_seq_max=n_seq_max,
                                 layers=layers)

    target = cache(recurrent_layers(model))
    wrong = cache(recurrent_layers(model)[:-1])
    for sequence in record["sequences"]:
        seq = sequence["seq_id"]
        partial = (CURRENT / scenario / f"seq{seq}.partial.blob").read_bytes()
        assert struct.unpack_from("<I", partial)[0] == 0xaf143cd8   # then the source seq id
        section = partial[8:]   # the recurrent section (the framings parse the header)
        assert target.state_read(section, seq) == len(section)
        assert target.seq_pos_max(seq) == sequence["next_pos"] - 1
        assert target.state_write(seq) == section == llama_blob(target, seq)
        before = snapshot(wrong)
        with pytest.raises(rc.StateError):
            wrong.state_read(section, seq)
        assert_unchanged(wrong, before)


def test_recurrent_layers_of_a_pure_mamba_file_are_every_layer():
    from recurrent_cache.models.trained import TRAINED_GGUF
    assert recurrent_layers(TRAINED_GGUF) == (0, 1, 2, 3)


# -- prefix cache, snapshots, stores ----------------------------------------------------------------

def test_prefix_cache_saves_and_restores_the_filtered_layers(rc):
    twins = Twins(rc, seed=4)
    twins.feed([(0, 4)])
    cache = twins.filtered
    prefix = rc.PrefixCache(cache, max_bytes=1 << 16, block_size=2)
    assert prefix.snapshot_bytes == len(LAYERS) * (3 + 5) * 4
    tokens = [1, 1, 1, 1]
    assert prefix.save(0, tokens)
    assert prefix.restore(1, tokens + [7]) == 4
    r0, s0 = cache.seq_state(0)
    r1, s1 = cache.seq_state(1)
    assert len(r1) == len(LAYERS) and all(np.array_equal(host(a), host(b)) for a, b in zip(r0 + s0, r1 + s1))


def test_snapshots_and_store_keys_carry_the_filter(rc, tmp_path):
    twins = Twins(rc, seed=5)
    twins.feed([(0, 3)])
    cache = twins.filtered
    geometry = Geometry.of(cache)
    assert geometry.layers == LAYERS
    plain_key_text = Geometry(N_LAYER, 3, 5).key_text()
    assert plain_key_text == "n_layer=5;n_embd_r=3;n_embd_s=5;dtype_r=f32;dtype_s=f32"   # keys stay valid
    assert Geometry(N_LAYER, 3, 5, layers=range(N_LAYER)) == Geometry(N_LAYER, 3, 5)
    keys = {snapshot_key("ns", Geometry(N_LAYER, 3, 5, layers=layers), [1, 1, 1])
            for layers in (None, LAYERS, (0, 2), (0, 2, 4), ())}
    assert len(keys) == 5
    key = snapshot_key("ns", geometry, [1, 1, 1])
    r_rows, s_rows = cache.seq_state(0)
    entry = encode_snapshot(key, [1, 1, 1], r_rows, s_rows, geometry)
    # the ggsq part holds the one-cell blob of llama.cpp's layout
    assert bytes(entry[12 + 12:len(entry) - 32]) == llama_blob(cache, 0)
    decoded = decode_snapshot(entry, key, geometry, [1, 1, 1])
    assert decoded is not None
    assert all(np.array_equal(host(a), host(b)) for a, b in zip(decoded[0] + decoded[1], r_rows + s_rows))
    assert decode_snapshot(entry, key, Geometry(N_LAYER, 3, 5, layers=(0, 2)), [1, 1, 1]) is None
    store = DirectoryStore(tmp_path / "store")
    store.put(key, entry)
    assert store.get_many([key]) == [entry]   # read back through the length its headers declare
    with pytest.raises(rc.ArgumentError, match="has 2 rows, the geometry has 3 layers with state"):
        encode_snapshot(key, [1, 1, 1], r_rows[:2], s_rows[:2], geometry)
    before = snapshot(cache)
    with pytest.raises(rc.ArgumentError, match="one per layer with state"):
        cache.seq_restore(3, 0, r_rows[:2], s_rows[:2])
    assert_unchanged(cache, before)
    assert cache.seq_restore(3, 2, r_rows, s_rows) >= 0
    assert cache.state_write(3) == cache.state_write(0)


def test_prefix_cache_with_a_store_round_trips_filtered_snapshots(rc, tmp_path):
    twins = Twins(rc, seed=6)
    twins.feed([(0, 4)])
    cache = twins.filtered
    store = DirectoryStore(tmp_path / "store")
    writer = rc.PrefixCache(cache, max_bytes=1 << 16, block_size=2, store=store, namespace="m")
    assert writer.save(0, [1, 1, 1, 1])
    fresh = rc.RecurrentCache(N_LAYER, 3, 5, n_seq_max=4, layers=LAYERS)
    reader = rc.PrefixCache(fresh, max_bytes=1 << 16, block_size=2, store=store, namespace="m")
    assert reader.restore(0, [1, 1, 1, 1, 9]) == 4
    assert fresh.state_write(0) == cache.state_write(0)
    other = rc.RecurrentCache(N_LAYER, 3, 5, n_seq_max=4, layers=(0, 2))
    assert rc.PrefixCache(other, max_bytes=1 << 16, block_size=2, store=store, namespace="m").restore(
        0, [1, 1, 1, 1, 9]) == 0


# -- the C API -------------------------------------------------------------------------------------

def test_c_api_tensors_of_a_filtered_cache():
    import recurrent_cache as rc_package
    from capi_table import P, message, size_t, table
    T = table()
    cache = rc_package.RecurrentCache(N_LAYER, 3, 5, n_seq_max=2, layers=LAYERS, engine="compiled")
    ctx = T.ctx_new(cache)
    try:
        assert T.n_layer(ctx) == N_LAYER
        data, row_bytes = P(), size_t()
        for index in range(2 * N_LAYER):
            array = (cache.r + cache.s)[index]
            code = T.tensor(ctx, index, ctypes.byref(data), ctypes.byref(row_bytes))
            if array is None:
                assert code == errors.CAPI_FILTERED_LAYER
                assert message(T, ctx, code) == (f"rc_tensor: tensor index {index} is of layer {index % N_LAYER}, "
                                                 f"which holds no recurrent state (the cache's layer filter "
                                                 f"excludes it)")
            else:
                assert code == 0 and (data.value, row_bytes.value) == (array.ctypes.data, array.strides[0])
        assert T.tensor(ctx, 2 * N_LAYER, ctypes.byref(data), ctypes.byref(row_bytes)) == errors.CAPI_TENSOR_INDEX
        assert message(T, ctx, errors.CAPI_TENSOR_INDEX) == "rc_tensor: tensor index 10 is out of range [0, 10)"
        size = size_t()
        assert T.state_size(ctx, -1, ctypes.byref(size)) == 0 and size.value == len(cache.state_write())
        buffer = ctypes.create_string_buffer(size.value)
        written = size_t()
        assert T.state_write(ctx, -1, buffer, size.value, ctypes.byref(written)) == 0
        assert buffer.raw == llama_blob(cache)
    finally:
        assert T.ctx_free(ctx) == 0


def test_c_api_step_rows_of_a_filtered_cache():
    import recurrent_cache as rc_package
    from capi_table import P, Ubatch, ints, table
    T = table()
    cache = rc_package.RecurrentCache(N_LAYER, 3, 5, n_seq_max=2, n_rollback=2, layers=LAYERS, engine="compiled")
    ctx = T.ctx_new(cache)
    batch = P()
    try:
        assert T.batch_init(ctx, 3, ints([0, 0, 0]), None, ints([0, 1, 2]), None, 512, 0, ctypes.byref(batch)) == 0
        ubatch = Ubatch()
        assert T.batch_apply(batch, ctypes.byref(ubatch)) == 1   # 1: a ubatch was placed
        assert T.batch_n_steps(batch) == 2
        row = P()
        assert T.batch_step_row(batch, 1, 0, 0, ctypes.byref(row)) == errors.CAPI_FILTERED_LAYER
        assert T.batch_step_row(batch, N_LAYER + 3, 0, 1, ctypes.byref(row)) == 0
        # s of layer 3 is the core's sixth tensor: the python view of it is the same memory
        st_rows = cache.memory_core.step_rows(5, 1, 2)
        assert row.value == st_rows[0, 1].ctypes.data
    finally:
        T.batch_release(batch)
        assert T.ctx_free(ctx) == 0


def test_sequence_files_and_file_reads_of_a_filtered_cache(rc, tmp_path):
    twins = Twins(rc, seed=7)
    twins.feed([(0, 2), (1, 3)])
    cache = twins.filtered
    path = tmp_path / "seq.ggsq"
    rc.save_seq_file(path, cache, 0, [1, 1])
    assert path.read_bytes()[12 + 8:] == llama_blob(cache, 0)   # ggsq header, 2 tokens, then the section
    fresh = rc.RecurrentCache(N_LAYER, 3, 5, n_seq_max=4, layers=LAYERS)
    assert list(rc.load_seq_file(path, fresh, 2)) == [1, 1]
    assert fresh.state_write(2) == cache.state_write(0)
    wrong = rc.RecurrentCache(N_LAYER, 3, 5, n_seq_max=4, layers=(0, 2))
    before = snapshot(wrong)
    with pytest.raises(rc.StateError):
        rc.load_seq_file(path, wrong, 2)
    assert_unchanged(wrong, before)
    fresh.state_read_from(io.BytesIO(cache.state_write()))
    assert fresh.state_write() == cache.state_write()
