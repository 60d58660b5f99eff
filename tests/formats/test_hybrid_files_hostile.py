"""Issue 28's attack on the hybrid memory's files: session files ('ggsn') of a ``HybridCache`` read back
(they raised a raw ``AttributeError``), and FIFOs whose headers claim more than the memory can hold,
refused after a bounded read with the memory unchanged."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

import recurrent_cache as rc
from recurrent_cache.hybrid import HybridCache
from recurrent_cache.seqfile import load_seq_file, load_session_file, save_seq_file, save_session_file

from hybrid_model import Histories, decode, same, snapshot


def make() -> HybridCache:
    return HybridCache(3, attn_layers=[1], recr_layers=[0, 2], n_embd_k=4, n_embd_v=6, n_embd_r=3, n_embd_s=5,
                       kv_size=16, n_seq_max=3, dtype_k="f32", dtype_v="f32")


def served() -> HybridCache:
    cache = make()
    decode(cache, Histories(3), {0: [1, 2, 3], 2: [4, 5]})
    return cache


def test_a_session_file_of_a_hybrid_memory_reads_back_into_another(tmp_path):
    cache, path = served(), tmp_path / "session"
    size = save_session_file(path, cache, [1, 2, 3], "jamba")
    assert size == path.stat().st_size
    other = make()
    assert load_session_file(path, other, arch="jamba").tolist() == [1, 2, 3]
    assert other.state_write() == cache.state_write()
    other.check()


def test_a_bad_session_file_leaves_the_hybrid_memory_as_it_was(tmp_path):
    cache, path = served(), tmp_path / "session"
    save_session_file(path, make(), [7], "jamba")
    before = snapshot(cache)
    with pytest.raises(rc.StateError, match="architecture 'jamba'"):
        load_session_file(path, cache, arch="mamba")
    with pytest.raises(rc.ArgumentError, match="architecture name"):
        load_session_file(path, cache, arch="?")
    data = path.read_bytes()
    (tmp_path / "short").write_bytes(data[:-1])
    with pytest.raises(rc.StateError):
        load_session_file(tmp_path / "short", cache)
    seq_file = tmp_path / "seq"
    save_seq_file(seq_file, served(), 0, [1, 2, 3])
    with pytest.raises(rc.StateError, match="not a 'ggsn' session file"):
        load_session_file(seq_file, cache)
    assert same(before, snapshot(cache))


def endless_fifo(path: Path, head: bytes, written: list[int]) -> threading.Thread:
    """A FIFO whose writer sends ``head``, then zeros until the reader goes (counted in ``written``)."""
    os.mkfifo(path)

    def write() -> None:
        with open(path, "wb", buffering=0) as end:
            try:
                end.write(head)
                while written[0] < 1 << 30:
                    written[0] += end.write(bytes(1 << 16))
            except BrokenPipeError:
                pass

    thread = threading.Thread(target=write, daemon=True)
    thread.start()
    return thread


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs POSIX FIFOs")
@pytest.mark.parametrize("kind", ["session", "sequence"])
def test_a_fifo_claiming_an_endless_state_is_refused_after_a_bounded_read(tmp_path, kind):
    cache, path = served(), tmp_path / "file"
    if kind == "session":
        save_session_file(path, served(), [1, 2], "jamba")
        load, bound = (lambda fifo: load_session_file(fifo, cache)), cache.state_bound()
    else:
        save_seq_file(path, served(), 0, [1, 2])
        load, bound = (lambda fifo: load_seq_file(fifo, cache, 1)), cache.seq_state_bound()
    head = path.read_bytes()[:12 + 8]   # the header and the two tokens: then zeros, forever
    before, written = snapshot(cache), [0]
    thread = endless_fifo(tmp_path / "fifo", head, written)
    with pytest.raises(rc.StateError, match="is longer than"):
        load(tmp_path / "fifo")
    thread.join(30)
    assert not thread.is_alive() and written[0] <= bound + (1 << 20)   # a pipe's buffer beyond the bound
    assert same(before, snapshot(cache))
