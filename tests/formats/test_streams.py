"""Readers bounded by the cache, from streams: a header's claim is refused before it is read.

Every claim a state's headers make - a token count, a memory section's cells, seq ids, layers
and row sizes, June-2025's output block (outputs, logits, embeddings), a hybrid's attention KV
section (streams, cells, seq ids, layers, K and V rows) - is sent by a writer that then keeps
its end open without writing more.  The read must raise ``StateError`` naming the field and the
claimed value at once: a reader that waits for the claimed bytes blocks (the guard's timeout),
one that keeps them grows (the traced peak), and the cache must stay as it was.
"""

from __future__ import annotations

import contextlib
import io
import os
import socket
import struct
import threading
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from recurrent_cache.errors import StateError

SECONDS = 10            # a read still running after this long is blocked on the claimed bytes
PEAK_BYTES = 16 << 20   # what a refused read may allocate at most (the claims are 2**32 and more)

GGSQ, GGSN = 0x67677371, 0x6767736E
ARCH = struct.pack("<I", 5) + b"mamba"
BIG = 2**40             # a u64 claim
U32 = 2**32 - 1         # a u32 claim
N_LAYER, LAYERS, N_EMBD_R, N_EMBD_S = 4, (1, 3), 3, 2   # a hybrid: layers 1 and 3 are recurrent


def new_cache(rc: Any) -> Any:
    """A hybrid's recurrent cache with one sequence in it, so "unchanged" means something."""
    cache = rc.RecurrentCache(N_LAYER, N_EMBD_R, N_EMBD_S, n_seq_max=3, size=3, layers=LAYERS)
    for _ in cache.init_batch(rc.Batch(token=[1, 2], pos=[0, 1], seq_id=[0, 0])):
        pass
    return cache


# -- the claims: the bytes up to and including each claimed field ------------------------------

def section(*parts: bytes) -> bytes:
    return b"".join(parts)


# the recurrent memory section (whole cache, seq_id -1)
SECTION_CLAIMS = {
    "cell_count": (struct.pack("<I", U32), f"{U32} cells"),
    "cell n_seq_id": (struct.pack("<I", 1) + struct.pack("<iI", 0, U32), f"n_seq_id {U32}"),
    "n_layer": (struct.pack("<I", 0) + struct.pack("<II", 0, U32), f"n_layer {U32}"),
    "row size": (struct.pack("<I", 0) + struct.pack("<II", 0, N_LAYER) + struct.pack("<iQ", 0, BIG),
                 f"row size {BIG}"),
}

# June-2025's output block, after the architecture string
OUTPUT_CLAIMS = {
    "n_outputs": (struct.pack("<i", 2**31 - 1), f"n_outputs {2**31 - 1}"),
    "logits": (struct.pack("<ii", 1, 0) + struct.pack("<Q", BIG), f"{BIG} logits"),
    "embeddings": (struct.pack("<ii", 1, 0) + struct.pack("<QQ", 0, BIG), f"{BIG} embeddings"),
}

_KV_CELL = struct.pack("<I", 1) + struct.pack("<iI", 0, 1) + struct.pack("<i", 0)   # 1 cell of seq 0
_K_LAYER = struct.pack("<iQ", 1, 4) + bytes(4)                                       # one K layer, 1 row
# a hybrid's attention KV section (one stream), before the recurrent section
KV_CLAIMS = {
    "n_stream": (struct.pack("<I", U32), f"n_stream {U32}"),
    "cell_count": (struct.pack("<II", 1, U32), f"cell_count {U32}"),
    "n_seq_id": (struct.pack("<II", 1, 1) + struct.pack("<iI", 0, U32), f"n_seq_id {U32}"),
    "n_layer": (struct.pack("<I", 1) + _KV_CELL + struct.pack("<II", 0, U32), f"n_layer {U32}"),
    "K rows": (struct.pack("<I", 1) + _KV_CELL + struct.pack("<II", 0, 1) + struct.pack("<iQ", 1, BIG),
               ("layer 0 K rows", f"claims {BIG} bytes")),
    "V rows": (struct.pack("<I", 1) + _KV_CELL + struct.pack("<II", 0, 1) + _K_LAYER + struct.pack("<iQ", 0, BIG),
               ("layer 0 V rows", f"claims {BIG} bytes")),
    "transposed V rows": (struct.pack("<I", 1) + _KV_CELL + struct.pack("<II", 1, 1) + _K_LAYER
                          + struct.pack("<iII", 0, U32, U32), ("layer 0 V rows", f"claims {U32 * U32} bytes")),
}


def file_header(magic: int, version: int, n_tokens: int = 0) -> bytes:
    return struct.pack("<III", magic, version, n_tokens)


# what is read: (state_read_from's keywords, the bytes up to the claim, what the message names)
READS: dict[str, tuple[dict[str, Any], bytes, str | tuple[str, ...]]] = {
    "token count": ({"seq_id": 0}, file_header(GGSQ, 3, U32), f"{U32} tokens"),
    **{f"bare section {name}": ({"framing": "bare"}, head, message)
       for name, (head, message) in SECTION_CLAIMS.items()},
    **{f"context blob {name}": ({"arch": "mamba", "framing": "llama"}, ARCH + head, message)
       for name, (head, message) in SECTION_CLAIMS.items()},
    "sequence blob cell_count": ({"seq_id": 1, "framing": "llama"},
                                 struct.pack("<Ii", 0xAF143CD8, 0) + struct.pack("<I", U32), f"{U32} cells"),
    **{f"June-2025 blob {name}": ({"framing": "llama-june-2025"}, ARCH + head, message)
       for name, (head, message) in OUTPUT_CLAIMS.items()},
    **{f"hybrid KV section {name}": ({"arch": "mamba", "framing": "llama", "kv_section": True,
                                      "kv_cell_ext": False}, ARCH + head, message)
       for name, (head, message) in KV_CLAIMS.items()},
    **{f"session file {name}": ({}, file_header(GGSN, 10) + ARCH + head, message)
       for name, (head, message) in SECTION_CLAIMS.items()},
    **{f"June-2025 session file {name}": ({}, file_header(GGSN, 9) + ARCH + head, message)
       for name, (head, message) in OUTPUT_CLAIMS.items()},
}


# -- the sources: each yields a readable file whose writer sent ``head`` and holds its end open --

# Each source ends the writer's side before it closes the reader's: a read still blocked (the
# failure these tests catch) then sees the end and returns, instead of holding the reader's lock.

@contextlib.contextmanager
def held_fifo(head: bytes, directory: Path, opened: list[Any] | None = None) -> Iterator[Any]:
    """A FIFO (os.mkfifo) whose writer thread writes ``head``, then keeps the FIFO open until the
    test is over (a reader that waits for more blocks until then).  Readers in ``opened`` are
    closed once the writer is gone."""
    path = directory / "fifo"
    os.mkfifo(path)
    release = threading.Event()

    def write() -> None:
        with open(path, "wb", buffering=0) as writer:
            writer.write(head)
            release.wait(4 * SECONDS)

    thread = threading.Thread(target=write, daemon=True)
    thread.start()
    try:
        yield path
    finally:
        release.set()
        thread.join(SECONDS)
        for stream in opened or ():
            stream.close()


@contextlib.contextmanager
def fifo(head: bytes, directory: Path) -> Iterator[Any]:
    opened: list[Any] = []
    with held_fifo(head, directory, opened) as path:
        opened.append(open(path, "rb"))   # noqa: SIM115 - closed by held_fifo after its writer
        yield opened[0]


@contextlib.contextmanager
def pipe(head: bytes, directory: Path) -> Iterator[Any]:
    """``io.BufferedReader`` over a pipe's read end; the write end stays open."""
    read_end, write_end = os.pipe()
    stream = io.BufferedReader(io.FileIO(read_end, "rb"))
    try:
        os.write(write_end, head)
        yield stream
    finally:
        os.close(write_end)
        stream.close()


@contextlib.contextmanager
def socket_pair(head: bytes, directory: Path) -> Iterator[Any]:
    """A socketpair's reading side as a binary file; the other side stays connected."""
    ours, theirs = socket.socketpair()
    stream = ours.makefile("rb")
    try:
        theirs.sendall(head)
        yield stream
    finally:
        theirs.close()
        stream.close()
        ours.close()


class EndlessZeros:
    """A file object with only ``read`` (no seek, tell, fileno or len): ``head``, then zeros
    without end - up to 64 MiB, then it ends, so a reader that reads the claim stops somewhere."""

    def __init__(self, head: bytes) -> None:
        self.head = head
        self.served = 0

    def read(self, n: int = -1) -> bytes:
        left = (64 << 20) - self.served
        piece = (self.head[self.served:] + bytes(max(0, n - len(self.head) + self.served)))[:max(0, min(n, left))]
        self.served += len(piece)
        return piece


@contextlib.contextmanager
def endless(head: bytes, directory: Path) -> Iterator[Any]:
    source = EndlessZeros(head)
    yield source
    # the claim is refused at its header: at most the header and a peek were asked for
    assert source.served <= len(head) + 64, f"{source.served} bytes read of a {len(head)}-byte header"


SOURCES: dict[str, Callable[[bytes, Path], Any]] = {"fifo": fifo, "pipe": pipe, "socketpair": socket_pair,
                                                     "endless object": endless}


def refused_quickly(cache: Any, call: Callable[[], Any], names: str | tuple[str, ...] = ()) -> str:
    """``call()`` raises StateError naming ``names`` (one fragment or several) within SECONDS,
    allocating at most PEAK_BYTES, and the cache is unchanged; returns the message."""
    fragments = (names,) if isinstance(names, str) else names
    before = cache.state_write(-1)
    outcome: dict[str, BaseException] = {}

    def read() -> None:
        try:
            call()
        except BaseException as exc:   # noqa: BLE001 - handed to the test thread
            outcome["error"] = exc

    tracemalloc.start()
    try:
        thread = threading.Thread(target=read, daemon=True)
        thread.start()
        thread.join(SECONDS)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert not thread.is_alive(), f"the read still waits for the claimed bytes after {SECONDS} s"
    assert peak < PEAK_BYTES, f"the refused read allocated {peak} bytes"
    error = outcome.get("error")
    assert isinstance(error, StateError), f"expected StateError, got {error!r}"
    for fragment in fragments:
        assert fragment in str(error), f"{fragment!r} not in {error}"
    assert cache.state_write(-1) == before
    return str(error)


@pytest.mark.parametrize("source", list(SOURCES))
@pytest.mark.parametrize("what", list(READS))
def test_state_read_from_refuses_a_claim_at_its_header(rc, tmp_path, what, source):
    options, head, message = READS[what]
    cache = new_cache(rc)
    options = dict(options)
    seq_id = options.pop("seq_id", -1)
    with SOURCES[source](head, tmp_path) as stream:
        refused_quickly(cache, lambda: cache.state_read_from(stream, seq_id, **options), message)


@pytest.mark.parametrize("what", [what for what in READS if "session file" in what])
def test_load_session_file_refuses_a_claim_through_a_fifo(rc, tmp_path, what):
    _, head, message = READS[what]
    cache = new_cache(rc)
    with held_fifo(head, tmp_path) as path:
        refused_quickly(cache, lambda: rc.load_session_file(path, cache), message)


@pytest.mark.parametrize("what", list(KV_CLAIMS))
def test_load_session_file_of_a_hybrid_refuses_a_kv_claim_through_a_fifo(rc, tmp_path, what):
    head, message = KV_CLAIMS[what]
    cache = new_cache(rc)
    with held_fifo(file_header(GGSN, 10) + ARCH + head, tmp_path) as path:
        refused_quickly(cache, lambda: rc.load_session_file(path, cache, kv_section=True, kv_cell_ext=False),
                        message)


SEQUENCE_CLAIMS = {
    "token count": (file_header(GGSQ, 3, U32), f"{U32} tokens"),
    "cell_count": (file_header(GGSQ, 3) + struct.pack("<I", U32), f"{U32} cells"),
    "n_layer": (file_header(GGSQ, 3) + struct.pack("<I", 1) + struct.pack("<iI", 0, 0) + struct.pack("<II", 0, U32),
                f"n_layer {U32}"),
    "row size": (file_header(GGSQ, 3) + struct.pack("<I", 1) + struct.pack("<iI", 0, 0)
                 + struct.pack("<II", 0, N_LAYER) + struct.pack("<iQ", 0, BIG), f"row size {BIG}"),
    "KV cell_count": (file_header(GGSQ, 3) + struct.pack("<II", 1, U32), f"cell_count {U32}"),
    "KV K rows": (file_header(GGSQ, 3) + KV_CLAIMS["K rows"][0], ("layer 0 K rows", f"claims {BIG} bytes")),
}


@pytest.mark.parametrize("what", list(SEQUENCE_CLAIMS))
def test_load_seq_file_refuses_a_claim_through_a_fifo(rc, tmp_path, what):
    head, message = SEQUENCE_CLAIMS[what]
    cache = new_cache(rc)
    kv = {"kv_section": True, "kv_cell_ext": False} if what.startswith("KV") else {}
    with held_fifo(head, tmp_path) as path:
        refused_quickly(cache, lambda: rc.load_seq_file(path, cache, 1, **kv), message)


def fresh(tmp_path: Path) -> Path:
    """A new directory under ``tmp_path``, for one more FIFO."""
    directory = tmp_path / str(len(list(tmp_path.iterdir())))
    directory.mkdir()
    return directory


def test_a_june_2025_blob_found_by_detection_is_refused_at_its_claim_too(rc, tmp_path):
    """Without framing=, an architecture string is read both ways (current and June-2025): the
    June reading's 2**40 logits are refused by its trial parse, not read."""
    cache = new_cache(rc)
    head = ARCH + OUTPUT_CLAIMS["logits"][0]
    for source in SOURCES.values():
        with source(head, fresh(tmp_path)) as stream:
            refused_quickly(cache, lambda stream=stream: cache.state_read_from(stream, -1))


def test_good_states_still_stream_in(rc, tmp_path):
    """The bounds refuse only claims: a June-2025 session file with outputs through a FIFO, and
    a hybrid's state with its KV section through a pipe, load."""
    source = new_cache(rc)
    section_bytes = source.state_write(-1)
    outputs = struct.pack("<ii", 1, 0) + struct.pack("<Q", 3) + bytes(12) + struct.pack("<Q", 0)
    kv = struct.pack("<I", 1) + _KV_CELL + struct.pack("<II", 0, 1) + _K_LAYER + struct.pack("<iQ", 0, 8) + bytes(8)
    target = rc.RecurrentCache(N_LAYER, N_EMBD_R, N_EMBD_S, n_seq_max=3, size=3, layers=LAYERS)
    path = tmp_path / "fifo"
    os.mkfifo(path)
    data = file_header(GGSN, 9, 2) + struct.pack("<2i", 7, 8) + ARCH + outputs + section_bytes
    writer = threading.Thread(target=lambda: path.write_bytes(data), daemon=True)
    writer.start()
    assert rc.load_session_file(path, target).tolist() == [7, 8]
    writer.join(SECONDS)
    assert target.state_write(-1) == section_bytes
    target = rc.RecurrentCache(N_LAYER, N_EMBD_R, N_EMBD_S, n_seq_max=3, size=3, layers=LAYERS)
    read_end, write_end = os.pipe()
    os.write(write_end, ARCH + kv + section_bytes)
    os.close(write_end)
    with open(read_end, "rb") as stream:
        target.state_read_from(stream, -1, "mamba", kv_section=True, kv_cell_ext=False)
    assert target.state_write(-1) == section_bytes
