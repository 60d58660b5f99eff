"""A hybrid memory's state bytes: the KV section then the recurrent section, written and read back.

Round trips (whole memory, one sequence, every framing, either V layout into either), what a read
must refuse, and that a refused read leaves both halves exactly as they were.  llama.cpp's own hybrid
blobs are read in ``tests/formats`` (the bytes) and here once recorded (``test_hybrid_llamacpp``).
"""

from __future__ import annotations

import pytest

from recurrent_cache.errors import NoFreeCellError, SeqIdError, StateError
from recurrent_cache.formats.kv import compose_kv_section, parse_kv_section
from recurrent_cache.hybrid import HybridCache

from hybrid_model import Histories, assert_holds_its_history, decode, same, snapshot

ENGINES = ["compiled", "reference"]


def make(engine: str, **kw) -> HybridCache:
    args = dict(attn_layers=[0, 2], recr_layers=[1, 2], n_embd_k=4, n_embd_v=3, n_embd_r=3, n_embd_s=5,
                kv_size=16, n_seq_max=3, dtype_k="f32", dtype_v="f32", engine=engine)
    args.update(kw)
    return HybridCache(3, **args)


@pytest.fixture(params=ENGINES)
def engine(request) -> str:
    return request.param


def filled(engine: str, **kw) -> tuple[HybridCache, Histories]:
    cache, histories = make(engine, **kw), Histories(3)
    decode(cache, histories, {0: [1, 2, 3], 1: [4, 5]})
    cache.seq_cp(0, 2)
    histories.copy(0, 2)
    decode(cache, histories, {2: [6], 1: [7]})
    return cache, histories


@pytest.mark.parametrize("framing, arch", [("bare", None), ("llama", "jamba")])
def test_the_whole_memory_round_trips(engine, framing, arch):
    cache, histories = filled(engine)
    blob = cache.state_write(framing=framing, arch=arch)
    assert cache.state_size(framing=framing, arch=arch) == len(blob)
    other = make(engine)
    assert other.state_read(blob, arch=arch) == len(blob)
    assert other.kv_cells()[:cache.kv_used] == [c for c in cache.kv_cells() if c is not None]
    assert_holds_its_history(other, histories)
    assert other.state_write(framing=framing, arch=arch) == blob
    other.check()


def test_the_kv_section_comes_first_and_is_llamacpps(engine):
    cache, _ = filled(engine)
    blob = cache.state_write()
    recurrent = cache.state_write(partial_only=True)
    assert blob.endswith(recurrent)
    section = parse_kv_section(blob[:len(blob) - len(recurrent)])
    (stream,) = section.streams
    assert [(c.pos, c.seq_ids) for c in stream.cells] == [c for c in cache.kv_cells() if c is not None]
    assert stream.v_trans and stream.n_layer == 2
    assert compose_kv_section(section) == blob[:len(blob) - len(recurrent)]


@pytest.mark.parametrize("seq", [0, 1, 2])
def test_one_sequence_moves_into_another_memory(engine, seq):
    cache, histories = filled(engine)
    blob = cache.state_write(seq, framing="llama")
    other, other_histories = make(engine), Histories(3)
    other_histories.numbers = histories.numbers                 # one numbering of histories for both
    decode(other, other_histories, {1: [9, 9, 9, 9]})          # someone else already there
    other.state_read(blob, seq)
    other_histories.adopt(histories, seq)
    assert_holds_its_history(other, other_histories)
    assert other.state_write(seq) == cache.state_write(seq)
    decode(other, other_histories, {seq: [8]})                 # and it goes on
    assert_holds_its_history(other, other_histories)
    other.check()


@pytest.mark.parametrize("written, read", [(False, True), (True, False)])
def test_either_v_layout_reads_into_either(engine, written, read):
    cache, histories = filled(engine, v_trans=written)
    other = make(engine, v_trans=read)
    other.state_read(cache.state_write())
    assert_holds_its_history(other, histories)
    assert other.state_write(partial_only=True) == cache.state_write(partial_only=True)


def test_partial_only_reads_the_recurrent_half_alone(engine):
    cache, histories = filled(engine)
    checkpoint = cache.state_write(1, partial_only=True)
    kv_before = cache.kv_cells()
    cache.state_read(checkpoint, 1, partial_only=True)
    assert cache.kv_cells() == kv_before
    assert_holds_its_history(cache, histories)


@pytest.mark.parametrize("change, message", [
    (dict(dtype_k="f16"), "dtype_k is f16"), (dict(n_embd_v=5), "n_embd_v is 5"),
    (dict(kv_size=4), "kv_size = 4"), (dict(attn_layers=[0]), "attention layers"),
    (dict(n_embd_r=2), "r row size 12 .* != the cache.s 8")])
def test_a_state_of_another_shape_is_refused_and_changes_nothing(engine, change, message):
    cache, _ = filled(engine)
    blob = cache.state_write()
    other, _ = filled(engine, **change)
    before = snapshot(other)
    with pytest.raises(StateError, match=message):
        other.state_read(blob)
    assert same(before, snapshot(other))


def test_a_truncated_state_is_refused_and_changes_nothing(engine):
    cache, _ = filled(engine)
    blob = cache.state_write()
    before = snapshot(cache)
    for cut in (3, 40, len(blob) // 2, len(blob) - 1):
        with pytest.raises(StateError):
            cache.state_read(blob[:cut])
        assert same(before, snapshot(cache))


def test_a_sequence_whose_cells_fit_nowhere_changes_nothing(engine):
    cache, _ = filled(engine)
    blob = cache.state_write(0)
    full, histories = make(engine, kv_size=6), Histories(3)
    decode(full, histories, {1: [1, 2, 3], 2: [4, 5]})
    before = snapshot(full)
    with pytest.raises(NoFreeCellError, match="fit nowhere"):
        full.state_read(blob, 0)
    assert same(before, snapshot(full))
    with pytest.raises(SeqIdError):
        full.state_read(blob, 3)


@pytest.mark.needs_torch
def test_torch_storage_round_trips_on_the_index_path(engine):
    pytest.importorskip("torch")
    if engine == "reference":
        pytest.skip("the reference engine moves rows in host memory only")
    from recurrent_cache.storage import TorchStorage
    cache, histories = filled(engine)
    blob = cache.state_write()
    for storage in (TorchStorage("cpu"), TorchStorage("cpu", host_access=False)):
        other = make(engine, storage=storage)
        other.state_read(blob)
        assert_holds_its_history(other, histories)
        assert other.state_write() == blob
        other.state_read(other.state_write(2), 2)       # one sequence out and back in, on the same cells
        assert_holds_its_history(other, histories)
