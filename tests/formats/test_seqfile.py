"""Sequence files ('ggsq', llama.cpp's llama_state_seq_save_file / _load_file)."""

from __future__ import annotations

import base64
import os
import struct
import threading

import numpy as np
import pytest
from golden import load
from test_state_io import forked_cache, snapshot

from recurrent_cache import load_seq_file, save_seq_file
from recurrent_cache.errors import ArgumentError, SeqIdError, StateError

MAGIC = 0x67677371


def header(tokens, version=3):
    return struct.pack("<III", MAGIC, version, len(tokens)) + struct.pack(f"<{len(tokens)}i", *tokens)


def test_saved_file_is_header_tokens_and_sequence_blob(rc, tmp_path):
    cache = forked_cache(rc)
    path = tmp_path / "seq.ggsq"
    tokens = [5, -1, 2**31 - 1, 0]
    assert save_seq_file(path, cache, 3, np.array(tokens, dtype=np.int64)) == path.stat().st_size
    assert path.read_bytes() == header(tokens) + cache.state_write(3)
    assert save_seq_file(path, cache, 3, tokens, version=2) == path.stat().st_size
    assert path.read_bytes() == header(tokens, version=2) + cache.state_write(3)


def test_load_restores_the_sequence_into_any_seq_id(rc, tmp_path):
    source = forked_cache(rc, "bf16", "f16")
    path = tmp_path / "seq.ggsq"
    save_seq_file(path, source, 5, [7, 8, 9])
    target = rc.RecurrentCache(2, 2, 3, n_seq_max=6, dtype_r="bf16", dtype_s="f16")
    tokens = load_seq_file(path, target, 2)
    assert tokens.dtype == np.int32 and tokens.tolist() == [7, 8, 9]
    target.check()
    assert target.state_write(2) == source.state_write(5)


def test_empty_token_list_and_sequence_without_a_cell(rc, tmp_path):
    cache = forked_cache(rc)
    path = tmp_path / "empty.ggsq"
    save_seq_file(path, cache, 2, [])
    assert path.read_bytes() == header([]) + cache.state_write(2)
    assert load_seq_file(path, cache, 3).tolist() == []
    assert cache.seq_pos_max(3) == -1   # a 0-cell blob removes the sequence


def test_llamacpp_sequence_blob_in_a_file(rc, tmp_path):
    record = next(r for r in load("llamacpp_blobs.jsonl") if r["seq_id"] >= 0 and r["cell_count"] == 1)
    blob = base64.b64decode(record["blob_b64"])
    path = tmp_path / "llama.ggsq"
    path.write_bytes(header([1, 2, 3]) + blob)
    cache = rc.RecurrentCache(record["n_layer"], record["n_embd_r"], record["n_embd_s"],
                              n_seq_max=record["size"])
    assert load_seq_file(path, cache, record["seq_id"]).tolist() == [1, 2, 3]
    assert cache.state_write(record["seq_id"]) == blob


@pytest.mark.parametrize("damage,message", [
    (lambda data: b"", "truncated: 0 bytes"),
    (lambda data: data[:11], "truncated: 11 bytes"),
    (lambda data: struct.pack("<I", 0x67676C61) + data[4:], "magic 0x67676c61 at byte 0"),
    (lambda data: data[:4] + struct.pack("<I", 1) + data[8:], "version 1 at byte 4, expected 3 or 2"),
    (lambda data: data[:8] + struct.pack("<I", 2**32 - 1) + data[12:], "4294967295 tokens"),
    # one token fewer: the second token (2) is read as the blob's cell_count
    (lambda data: data[:8] + struct.pack("<I", 1) + data[12:], "at byte 16: sequence state blob has 2 cells"),
    (lambda data: data + b"\0", "the state blob at byte 20: .*1 trailing bytes"),
    (lambda data: data[:-1], "the state blob at byte 20: .*truncated"),
])
def test_bad_files_are_rejected_and_the_cache_is_untouched(rc, tmp_path, damage, message):
    cache = forked_cache(rc)
    path = tmp_path / "seq.ggsq"
    save_seq_file(path, cache, 4, [1, 2])
    path.write_bytes(damage(path.read_bytes()))
    before = snapshot(cache)
    with pytest.raises(StateError, match=message) as info:
        load_seq_file(path, cache, 0)
    assert str(path) in str(info.value)
    assert snapshot(cache) == before


def test_bad_arguments_create_no_file(rc, tmp_path):
    cache = forked_cache(rc)
    path = tmp_path / "seq.ggsq"
    for tokens in ([1.5], [[1, 2]], [2**31], "abc"):
        with pytest.raises(ArgumentError):
            save_seq_file(path, cache, 0, tokens)
    with pytest.raises(SeqIdError):
        save_seq_file(path, cache, 6, [1])
    assert os.listdir(tmp_path) == []


class FailingCache:
    """A cache whose state_write_into writes part of the blob, then fails."""

    def __init__(self, cache, error):
        self.cache = cache
        self.error = error

    def state_size(self, seq_id):
        return self.cache.state_size(seq_id)

    def state_write_into(self, file, seq_id):
        file.write(self.cache.state_write(seq_id)[:10])
        file.flush()
        raise self.error


@pytest.mark.parametrize("error", [OSError(28, "No space left on device"), KeyboardInterrupt()])
def test_a_failing_write_leaves_the_old_file_and_no_partial_one(rc, tmp_path, error):
    cache = forked_cache(rc)
    path = tmp_path / "seq.ggsq"
    path.write_bytes(b"the previous file")
    with pytest.raises(type(error)):
        save_seq_file(path, FailingCache(cache, error), 4, [1, 2, 3])
    assert path.read_bytes() == b"the previous file"
    assert os.listdir(tmp_path) == ["seq.ggsq"]


def test_a_failing_rename_leaves_no_temporary_file(rc, tmp_path, monkeypatch):
    cache = forked_cache(rc)
    path = tmp_path / "seq.ggsq"

    def refuse(src, dst):
        assert os.path.dirname(src) == str(tmp_path)   # the temporary file is next to the target
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(PermissionError):
        save_seq_file(path, cache, 4, [1])
    assert os.listdir(tmp_path) == []


def test_saved_file_permissions_follow_the_umask(rc, tmp_path):
    mask = os.umask(0o022)
    try:
        save_seq_file(tmp_path / "seq.ggsq", forked_cache(rc), 4, [1])
    finally:
        os.umask(mask)
    assert (tmp_path / "seq.ggsq").stat().st_mode & 0o777 == 0o644


def test_every_path_type_saves_and_loads(rc, tmp_path):
    cache = forked_cache(rc)
    for path in (str(tmp_path / "a"), os.fsencode(tmp_path / "b"), tmp_path / "c"):
        save_seq_file(path, cache, 3, [4, 5])
        target = rc.RecurrentCache(2, 2, 3, n_seq_max=6)
        assert load_seq_file(path, target, 1).tolist() == [4, 5]
        assert target.state_write(1) == cache.state_write(3)
    for path in (3, None, "", str(tmp_path / "nul\0")):
        with pytest.raises(ArgumentError, match="path"):
            save_seq_file(path, cache, 3, [1])
        with pytest.raises(ArgumentError, match="path"):
            load_seq_file(path, cache, 3)
    assert sorted(os.listdir(tmp_path)) == ["a", "b", "c"]


def test_max_tokens_bounds_the_token_count_before_reading_it(rc, tmp_path):
    cache = forked_cache(rc)
    path = tmp_path / "seq.ggsq"
    save_seq_file(path, cache, 3, [1, 2, 3, 4, 5])
    before = snapshot(cache)
    with pytest.raises(StateError, match="5 tokens .count at byte 8., more than max_tokens 4"):
        load_seq_file(path, cache, 0, max_tokens=4)
    assert snapshot(cache) == before
    assert load_seq_file(path, cache, 0, max_tokens=5).tolist() == [1, 2, 3, 4, 5]
    with pytest.raises(ArgumentError, match="max_tokens"):
        load_seq_file(path, cache, 0, max_tokens=-1)


def test_a_file_defect_is_worded_as_state_read_words_it(rc, tmp_path):
    """load_seq_file checks the blob against the cache while reading the file; its message
    is state_read's for the same bytes (here: every truncation of the blob)."""
    cache = forked_cache(rc)
    path = tmp_path / "seq.ggsq"
    good = header([9]) + cache.state_write(4)
    for keep in range(16, len(good)):
        path.write_bytes(good[:keep])
        with pytest.raises(StateError) as from_file:
            load_seq_file(path, cache, 1)
        with pytest.raises(StateError) as from_memory:
            cache.state_read(good[16:keep], 1)
        assert str(from_file.value) == f"{path}: the state blob at byte 16: {from_memory.value}"


def test_load_from_a_fifo_reads_the_same_as_from_a_file(rc, tmp_path):
    cache = forked_cache(rc)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    content = header([7, 8]) + cache.state_write(4)

    def feed():
        with open(fifo, "wb") as out:
            out.write(content)

    writer = threading.Thread(target=feed)
    writer.start()
    target = rc.RecurrentCache(2, 2, 3, n_seq_max=6)
    try:
        assert load_seq_file(fifo, target, 0).tolist() == [7, 8]
    finally:
        writer.join()
    assert target.state_write(0) == cache.state_write(4)
