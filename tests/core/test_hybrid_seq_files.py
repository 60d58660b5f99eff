"""Sequence files ('ggsq', llama.cpp's ``llama_state_seq_save_file``) of a hybrid memory: ``save_seq_file`` /
``load_seq_file`` on a ``HybridCache`` carry both halves — llama.cpp's own files load and are written back byte for
byte, a sequence moves between memories exactly, and a bad file is refused with the memory left as it was."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from recurrent_cache import HybridCache, load_seq_file, save_seq_file
from recurrent_cache.errors import ArgumentError, SeqIdError, StateError

from hybrid_model import Histories, assert_holds_its_history, decode, same, snapshot
from test_hybrid_llamacpp import DATA, RECORDINGS, memory, record


@pytest.mark.parametrize("name", RECORDINGS)
def test_llamacpps_sequence_files_load_and_are_written_back_byte_for_byte(name, tmp_path):
    rec = record(name)
    for seq in range(rec["n_seq_max"]):
        path = DATA / name / f"seq{seq}.ggsq"
        cache = memory(name, "compiled")
        tokens = load_seq_file(path, cache, seq)
        assert cache.seq_pos_max(seq) == rec["seq_positions"][str(seq)][1]
        out = tmp_path / f"seq{seq}.ggsq"
        assert save_seq_file(out, cache, seq, tokens) == path.stat().st_size
        assert out.read_bytes() == path.read_bytes()


def make(**kw) -> HybridCache:
    args = dict(attn_layers=[1], recr_layers=[0, 1], n_embd_k=4, n_embd_v=2, n_embd_r=3, n_embd_s=5, kv_size=64,
                n_seq_max=3, dtype_k="f32", dtype_v="f32")
    args.update(kw)
    return HybridCache(2, **args)


@pytest.mark.parametrize("v_trans", [True, False])
@pytest.mark.parametrize("engine", ["compiled", "reference"])
def test_a_sequence_moves_through_a_file_into_another_memory_exactly(tmp_path, v_trans, engine):
    first, histories = make(v_trans=v_trans, engine=engine), Histories(3)
    decode(first, histories, {0: [1, 2, 3, 4, 5], 1: [9, 8]}, n_ubatch=3)
    path = tmp_path / "seq0.ggsq"
    save_seq_file(path, first, 0, [1, 2, 3, 4, 5])
    second, theirs = make(v_trans=v_trans, engine=engine), Histories(3)
    theirs.numbers = histories.numbers
    decode(second, theirs, {2: [7]})
    assert load_seq_file(path, second, 1).tolist() == [1, 2, 3, 4, 5]
    theirs.adopt(histories, 0)
    theirs.copy(0, 1)
    theirs.forget(0)
    assert_holds_its_history(second, theirs)
    decode(second, theirs, {1: [6], 2: [8]})        # and goes on from there
    assert_holds_its_history(second, theirs)
    second.check()


def test_a_bad_file_is_refused_and_the_memory_is_left_as_it_was(tmp_path):
    source, histories = make(), Histories(3)
    decode(source, histories, {0: [1, 2, 3]})
    good = tmp_path / "good.ggsq"
    save_seq_file(good, source, 0, [1, 2, 3])
    data = good.read_bytes()
    cache = make()
    decode(cache, Histories(3), {1: [4, 4]})
    before = snapshot(cache)
    cases = {
        "truncated": (data[:-7], "state"),
        "no header": (data[:5], "shorter than a sequence file's header"),
        "wrong magic": (b"XXXX" + data[4:], "not a 'ggsq' sequence file"),
        "tokens cut": (data[:12] + data[12:16], "tokens claimed"),
        "trailing bytes": (data + b"\0" * 9, "state"),
        "endless": (data + b"\0" * (cache.seq_state_bound() + 10), "longer than a sequence of this memory"),
    }
    for label, (content, words) in cases.items():
        path = tmp_path / f"{label}.ggsq"
        path.write_bytes(content)
        with pytest.raises(StateError, match=words):
            load_seq_file(path, cache, 0)
        assert same(before, snapshot(cache)), label
    many = tmp_path / "many.ggsq"
    many.write_bytes(data)
    with pytest.raises(StateError, match="max_tokens"):
        load_seq_file(many, cache, 0, max_tokens=2)
    with pytest.raises(SeqIdError):
        load_seq_file(good, cache, 3)                 # no such sequence
    assert same(before, snapshot(cache))


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs POSIX FIFOs")
def test_a_fifo_is_refused_after_a_few_bytes(tmp_path):
    cache = make()
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    import threading

    def writer() -> None:
        with open(fifo, "wb") as end:
            try:
                end.write(b"qsgg" + b"\0" * 100)
            except BrokenPipeError:
                pass
    thread = threading.Thread(target=writer)
    thread.start()
    with pytest.raises(StateError):
        load_seq_file(fifo, cache, 0)
    thread.join()
    assert cache.seq_pos_max(0) == -1


def test_state_write_into_a_buffer_or_a_file_and_never_into_the_memory_itself(tmp_path):
    cache, histories = make(), Histories(3)
    decode(cache, histories, {0: [1, 2, 3]})
    expected = cache.state_write(0)
    buffer = bytearray(len(expected) + 4)
    assert cache.state_write_into(buffer, 0) == len(expected) and bytes(buffer[:len(expected)]) == expected
    with open(tmp_path / "state", "wb") as file:
        assert cache.state_write_into(file, 0) == len(expected)
    assert Path(tmp_path / "state").read_bytes() == expected
    with pytest.raises(ArgumentError):
        cache.state_write_into(bytearray(3), 0)
    rows = cache.kv_tensors[0]
    assert isinstance(rows, np.ndarray)
    before = snapshot(cache)
    with pytest.raises(ArgumentError):
        cache.state_write_into(rows.reshape(-1).view(np.uint8), 0)
    assert same(before, snapshot(cache))
