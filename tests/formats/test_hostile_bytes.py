"""Hostile input at the byte, file and inspect surfaces: no crash, no hang, no silent corruption.

Every case runs in a child interpreter (``python tests/formats/test_hostile_bytes.py
--child NAME ...``): one child runs many cases and says when each starts and
ends, so a case that kills the interpreter (a signal) or hangs (no answer in
``CASE_SECONDS``) is a failure of that case by name, and the child is
restarted after it.  Around every rejected call the cache - head, used, every
cell, every byte of every tensor - must be unchanged.

Cases marked ``both`` run against the compiled core and the pure-Python
reference; the inspect cases run the command line itself.
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import io
import json
import os
import resource
import select
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve()
CASE_SECONDS = 60          # a case that says nothing for this long hangs
CASES: dict[str, object] = {}
ENGINES = ("compiled", "reference")


def case(both=True):
    def register(function):
        names = [f"{function.__name__}[{engine}]" for engine in ENGINES] if both else [function.__name__]
        for name in names:
            CASES[name] = function
        return function
    return register


# -- helpers (run in the child) ------------------------------------------------

def engine(name):
    """The package with its caches on the engine the case's name gives (compiled by default)."""
    import functools
    import types

    import recurrent_cache
    chosen = name.rsplit("[", 1)[1].rstrip("]") if "[" in name else "compiled"
    names = {n: getattr(recurrent_cache, n) for n in recurrent_cache.__all__}
    names["RecurrentCache"] = functools.partial(recurrent_cache.RecurrentCache, engine=chosen)
    return types.SimpleNamespace(**names)


def populated(rc, size=6, n_embd_r=3, n_embd_s=5, dtype_r="f32", dtype_s="f16"):
    """A cache with sequences in several cells (one shared) and distinct rows."""
    cache = rc.RecurrentCache(2, n_embd_r, n_embd_s, n_seq_max=size, dtype_r=dtype_r, dtype_s=dtype_s)
    for _ in cache.init_batch(rc.Batch(token=[1, 2, 3, 4], pos=[0, 1, 0, 0], seq_id=[0, 0, 2, 3])):
        pass
    cache.seq_cp(2, 4)
    for k, tensor in enumerate(list(cache.r) + list(cache.s)):
        tensor[...] = (np.arange(tensor.size).reshape(tensor.shape) % 29 - 14 + k) / 4
    return cache


def snapshot(cache):
    return (cache.head, cache.used, cache.n, [cache.cell(i) for i in range(cache.size)],
            [np.ascontiguousarray(t).view(np.uint8).tobytes() for t in list(cache.r) + list(cache.s)])


def rejected(cache, call, error=None, match=None):
    """call() must raise a package error (of type ``error``) and leave the cache as it was."""
    import recurrent_cache as package
    before = snapshot(cache)
    try:
        call()
    except package.RecurrentCacheError as exc:
        assert error is None or isinstance(exc, error), f"{type(exc).__name__}: {exc}"
        assert match is None or match in str(exc), f"{match!r} not in {exc}"
        assert snapshot(cache) == before, f"a rejected call changed the cache ({exc})"
        cache.check()
        return str(exc)
    raise AssertionError("the call was accepted")


def blob(cells, n_layer, tensors, rows=True):
    """A blob from parts: cells [(pos, [seq ids])], tensors [(type, row_bytes)]."""
    out = struct.pack("<I", len(cells))
    for pos, ids in cells:
        out += struct.pack(f"<iI{len(ids)}i", pos, len(ids), *ids)
    out += struct.pack("<II", 0, n_layer)
    for type_id, row_bytes in tensors:
        out += struct.pack("<iQ", type_id, row_bytes) + (bytes(row_bytes * len(cells)) if rows else b"")
    return out


def seq_file(tokens, data):
    return struct.pack("<III", 0x67677371, 2, len(tokens)) + struct.pack(f"<{len(tokens)}i", *tokens) + data


class Fifo:
    """A FIFO whose writer thread writes ``head`` then ``tail`` forever (until the reader leaves)."""

    def __init__(self, head, tail=b""):
        self.path = os.path.join(tempfile.mkdtemp(), "fifo")
        os.mkfifo(self.path)
        self.thread = threading.Thread(target=self._write, args=(head, tail), daemon=True)
        self.thread.start()

    def _write(self, head, tail):
        with contextlib.suppress(OSError), open(self.path, "wb") as f:
            f.write(head)
            while tail:
                f.write(tail)


def peak_rss_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def sparse_file(size, head):
    path = os.path.join(tempfile.mkdtemp(), "huge")
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(size)
    return path


def inspect_cli(path, *options, in_process=True):
    """(exit status, stdout, stderr) of ``python -m recurrent_cache inspect``: its main() in
    this process (an exception escaping it is a traceback), or the command itself."""
    if in_process:
        from recurrent_cache.cli import inspect as inspect_command
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = inspect_command.main([str(path), *options])
            except SystemExit as exit:
                code = exit.code
        return code, out.getvalue(), err.getvalue()
    done = subprocess.run([sys.executable, "-m", "recurrent_cache", "inspect", str(path), *options],
                          capture_output=True, text=True, timeout=CASE_SECONDS, check=False)
    return done.returncode, done.stdout, done.stderr


def cli_user_error(path, *options, match=None, in_process=True):
    code, out, err = inspect_cli(path, *options, in_process=in_process)
    assert code != 0, f"exit status 0 for {path}: {out[:200]}"
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert match is None or match in err, f"{match!r} not in {err!r}"
    return err


# -- state_read ----------------------------------------------------------------

@case()
def read_of_wrong_types(name):
    rc = engine(name)
    cache = populated(rc)
    good = cache.state_write()
    released = memoryview(bytearray(good))
    released.release()
    for data in ("text", 12, None, 1.5, [1, 2, 3], {"a": 1}, object(), io.BytesIO(good), released,
                 np.zeros((8, 8), np.uint8)[:, ::2], array.array("d", [1.5, 2.5])):
        rejected(cache, lambda: cache.state_read(data))


@case()
def read_of_exotic_buffers_holding_a_good_blob(name):
    rc = engine(name)
    cache = populated(rc)
    good = cache.state_write()
    for data in ((ctypes.c_char * len(good)).from_buffer_copy(good), array.array("B", good),
                 np.frombuffer(good + bytes(-len(good) % 8), np.float64)[: len(good) // 8]
                 if len(good) % 8 == 0 else np.frombuffer(good, np.uint8).reshape(1, 1, -1)):
        fresh = populated(rc)
        fresh.seq_rm(-1, -1, -1)
        fresh.state_read(data)
        assert fresh.state_write() == good


@case()
def read_with_extreme_seq_ids(name):
    rc = engine(name)
    cache = populated(rc)
    good = cache.state_write(0)
    for seq_id in (-2, cache.size, 2**31, -2**31 - 1, 2**63, 2**200, 1.0, "0", None, True, np.float32(1)):
        rejected(cache, lambda: cache.state_read(good, seq_id))


@case()
def read_of_huge_claims(name):
    rc = engine(name)
    import recurrent_cache as package
    cache = populated(rc, n_embd_r=1, n_embd_s=1, dtype_s="f32")
    tensors = [(0, 4)] * 4
    for data in (struct.pack("<I", 2**32 - 1),                                   # cell count
                 struct.pack("<IiI", 1, 0, 2**32 - 1),                            # n_seq_id
                 blob([(0, [0])], 2**32 - 1, [], rows=False),                     # n_layer
                 blob([(0, [0])], 2, [(0, 2**63)] + tensors[1:], rows=False),     # row size
                 blob([(0, [0])], 2, [(0, 2**64 - 1)] + tensors[1:], rows=False),
                 blob([], 2, [(0, 2**64 - 1)] + tensors[1:], rows=False),         # 0 x 2**64 - 1
                 blob([(2**31 - 1, [0])], 2, [(0, 2**62)] * 4, rows=False)):
        for seq_id in (-1, 0):
            rejected(cache, lambda: cache.state_read(data, seq_id), package.StateError)


@case()
def read_of_blobs_every_read_rejects(name):
    rc = engine(name)
    cache = populated(rc, n_embd_r=1, n_embd_s=1, dtype_s="f32")
    tensors = [(0, 4)] * 4
    for cells in ([(-1, [0])], [(-2**31, [0])], [(0, [-1])], [(0, [1, 1])], [(0, [1]), (0, [1])],
                  [(0, [cache.size])], [(0, [])], [(0, [0]), (0, [])]):
        rejected(cache, lambda: cache.state_read(blob(cells, 2, tensors)))
    for cells in ([(-1, [])], [(0, [0])], [(0, []), (1, [])]):
        rejected(cache, lambda: cache.state_read(blob(cells, 2, tensors), 1))


@case()
def read_of_the_caches_own_rows(name):
    """A blob that lies in the cache's own tensor memory is read as it was when the call began."""
    rc = engine(name)
    source = populated(rc, size=64, n_embd_r=16, n_embd_s=16)
    good = source.state_write()
    for offset in (0, 8, 100):
        cache = populated(rc, size=64, n_embd_r=16, n_embd_s=16)
        own = cache.r[1].view(np.uint8).reshape(-1)
        assert own.size >= offset + len(good)
        own[offset:offset + len(good)] = np.frombuffer(good, np.uint8)
        expected = populated(rc, size=64, n_embd_r=16, n_embd_s=16)
        expected.r[1].view(np.uint8).reshape(-1)[offset:offset + len(good)] = np.frombuffer(good, np.uint8)
        expected.state_read(bytes(good))
        cache.state_read(own[offset:offset + len(good)])
        cache.check()
        assert snapshot(cache) == snapshot(expected)


# -- state_read_from -------------------------------------------------------------

class NonBlocking(io.RawIOBase):
    def readable(self):
        return True

    def readinto(self, buffer):
        return None


class LyingReader:
    def __init__(self, result):
        self.result = result

    def read(self, n=-1):
        return self.result(n)


@case()
def read_from_bad_files(name):
    rc = engine(name)
    import recurrent_cache as package
    cache = populated(rc)
    good = cache.state_write()
    closed = io.BytesIO(good)
    closed.close()
    directory = tempfile.mkdtemp()
    write_only = open(os.path.join(directory, "w"), "wb")
    text = open(os.path.join(directory, "w"))
    for file in (closed, write_only, text, NonBlocking(), LyingReader(lambda n: "text"),
                 LyingReader(lambda n: b"\0" * (n + 1)), LyingReader(lambda n: 5), good, None, 3):
        rejected(cache, lambda: cache.state_read_from(file), package.ArgumentError)
    rejected(cache, lambda: cache.state_read_from(LyingReader(lambda n: b"")), package.StateError)


@case()
def read_from_dev_zero_and_endless_fifos(name):
    rc = engine(name)
    import recurrent_cache as package
    cache = populated(rc)
    # the facade reads with the cache's shape: a stream is refused at the first header that does
    # not fit the cache (0 cells of 0 layers here), never read to its end
    with open("/dev/zero", "rb") as zero:
        rejected(cache, lambda: cache.state_read_from(zero), package.StateError, "n_layer 0")
    fifo = Fifo(b"", b"\0" * 4096)
    with open(fifo.path, "rb") as stream:
        rejected(cache, lambda: cache.state_read_from(stream), package.StateError, "n_layer 0")
    fifo = Fifo(b"\xff" * 64)   # 2**32 - 1 cells, then the writer leaves
    with open(fifo.path, "rb") as stream:
        rejected(cache, lambda: cache.state_read_from(stream), package.StateError, "more than the cache")


@case()
def read_from_a_stream_is_bounded_by_the_cache(name):
    """With the cache's geometry (Geometry.of), an endless stream under a header claiming
    terabytes is rejected at the header: no row is read."""
    rc = engine(name)
    import recurrent_cache as package
    from recurrent_cache.formats.files import read_rest
    from recurrent_cache.formats.geometry import Geometry
    cache = populated(rc)
    head = blob([(0, [])], 2, [], rows=False) + struct.pack("<iQ", 0, 2**40)
    fifo = Fifo(head, b"\0" * 65536)
    before = peak_rss_mib()
    with open(fifo.path, "rb") as stream:
        rejected(cache, lambda: read_rest(stream, Geometry.of(cache), 1), package.StateError, "row size")
    assert peak_rss_mib() - before < 64


@case()
def read_from_a_huge_sparse_file(name):
    rc = engine(name)
    import recurrent_cache as package
    cache = populated(rc)
    # 0 cells and the cache's layer count, then a terabyte of zeros: refused as trailing bytes
    # from the file's length, without reading it
    empty = rc.RecurrentCache(cache.n_layer, cache.n_embd_r, cache.n_embd_s, n_seq_max=cache.size,
                              dtype_r=cache.dtype_r, dtype_s=cache.dtype_s)
    path = sparse_file(2**40, empty.state_write())   # a valid 0-cell blob of this cache
    before = peak_rss_mib()
    with open(path, "rb") as file:
        message = rejected(cache, lambda: cache.state_read_from(file), package.StateError)
    assert "1099511627776" in message, message
    assert peak_rss_mib() - before < 64


# -- state_write_into ------------------------------------------------------------

class Returns:
    """A writer whose write() keeps the bytes and returns ``result(n)``."""

    def __init__(self, result):
        self.result = result
        self.data = bytearray()

    def write(self, chunk):
        self.data += bytes(chunk)
        return self.result(len(chunk))


class RawReturnsNone(io.RawIOBase):
    def writable(self):
        return True

    def write(self, chunk):
        return None


@case()
def write_into_files_whose_write_misbehaves(name):
    """No result of write() makes state_write_into spin: 0, negative, too large, not a number
    are errors; None is 'would block' for a raw file and 'all written' for a duck-typed writer."""
    rc = engine(name)
    import recurrent_cache as package
    cache = populated(rc)
    for result in (lambda n: 0, lambda n: -1, lambda n: -2**70, lambda n: n + 1, lambda n: 2**70,
                   lambda n: "x", lambda n: 1.0, lambda n: True, lambda n: [n]):
        rejected(cache, lambda: cache.state_write_into(Returns(result)), package.ArgumentError)
    rejected(cache, lambda: cache.state_write_into(RawReturnsNone()), package.ArgumentError, "would block")
    duck = Returns(lambda n: None)
    assert cache.state_write_into(duck) == cache.state_size() and duck.data == cache.state_write()
    partial = Returns(lambda n: 1)   # a raw file that writes one byte at a time: the rest is written again
    assert cache.state_write_into(partial, 2) == cache.state_size(2)


@case()
def write_into_bad_targets(name):
    rc = engine(name)
    import recurrent_cache as package
    cache = populated(rc)
    n = cache.state_size()
    closed = io.BytesIO()
    closed.close()
    directory = tempfile.mkdtemp()
    Path(directory, "r").write_bytes(b"")
    read_only = open(os.path.join(directory, "r"), "rb")
    text = open(os.path.join(directory, "t"), "w")
    released = memoryview(bytearray(n))
    released.release()
    for target in (closed, read_only, text, released, bytes(n), memoryview(bytes(n)), bytearray(n - 1),
                   bytearray(0), np.zeros((n, 2), np.uint8)[:, 0], np.zeros(n, np.uint8)[::-1], "path", 5, None,
                   np.frombuffer(bytes(n), np.uint8)):
        rejected(cache, lambda: cache.state_write_into(target), package.ArgumentError)
    for seq_id in (-2, cache.size, 2**63, None, 1.5):
        rejected(cache, lambda: cache.state_write_into(bytearray(n), seq_id), package.RecurrentCacheError)


@case()
def write_into_the_caches_own_rows(name):
    """A target sharing memory with the cache's tensors is refused before a byte is written."""
    rc = engine(name)
    import recurrent_cache as package
    cache = populated(rc, size=64, n_embd_r=16, n_embd_s=16)
    for target in (cache.r[0], cache.s[1], cache.s[1][3:], memoryview(cache.r[1]).cast("B")[5:]):
        rejected(cache, lambda: cache.state_write_into(target), package.ArgumentError, "shares memory")
    other = populated(rc, size=64, n_embd_r=16, n_embd_s=16)
    assert cache.state_write_into(other.s[0]) == cache.state_size()   # another cache's rows: just bytes


# -- save_seq_file / load_seq_file -------------------------------------------------

class PathLike:
    def __init__(self, path):
        self.path = path

    def __fspath__(self):
        return self.path


@case()
def seq_files_take_every_path_type(name):
    rc = engine(name)
    import recurrent_cache as package
    cache = populated(rc)
    directory = tempfile.mkdtemp()
    for path in (os.path.join(directory, "a"), os.fsencode(os.path.join(directory, "b")),
                 Path(directory, "c"), PathLike(os.path.join(directory, "d")),
                 PathLike(os.fsencode(os.path.join(directory, "e")))):
        package.save_seq_file(path, cache, 2, [1, 2])
        target = populated(rc)
        assert package.load_seq_file(path, target, 5).tolist() == [1, 2]
        assert target.state_write(5) == cache.state_write(2)
    for path in (3, None, 1.5, ["a"], "", os.path.join(directory, "x\0y"), b"a\0"):
        rejected(cache, lambda: package.save_seq_file(path, cache, 2, [1]), package.ArgumentError)
        rejected(cache, lambda: package.load_seq_file(path, cache, 2), package.ArgumentError)
    assert sorted(os.listdir(directory)) == ["a", "b", "c", "d", "e"]


@case()
def load_seq_file_of_dev_zero_fifos_and_huge_files(name):
    rc = engine(name)
    import recurrent_cache as package
    cache = populated(rc)
    good = seq_file([1, 2, 3], cache.state_write(2))
    rejected(cache, lambda: package.load_seq_file("/dev/zero", cache, 1), package.StateError, "magic")
    # a good header, then endless zeros: n_layer 0 is not the cache's 2 (after 20 + 12 bytes)
    fifo = Fifo(good[:20], b"\0" * 4096)
    rejected(cache, lambda: package.load_seq_file(fifo.path, cache, 1), package.StateError, "n_layer 0")
    # a good file, then endless zeros: one byte past the blob is enough
    fifo = Fifo(good, b"\0" * 4096)
    rejected(cache, lambda: package.load_seq_file(fifo.path, cache, 1), package.StateError, "stream goes on")
    # a good header, then 0xff forever: 2**32 - 1 cells is more than a sequence's one
    fifo = Fifo(good[:20], b"\xff" * 4096)
    rejected(cache, lambda: package.load_seq_file(fifo.path, cache, 1), package.StateError, "4294967295 cells")
    fifo = Fifo(good)   # and the good file through a FIFO loads
    target = populated(rc)
    assert package.load_seq_file(fifo.path, target, 1).tolist() == [1, 2, 3]
    assert target.state_write(1) == cache.state_write(2)
    before = peak_rss_mib()
    for head in (good[:8] + struct.pack("<I", 2**32 - 1), good[:20], good):
        path = sparse_file(2**30, head)
        rejected(cache, lambda: package.load_seq_file(path, cache, 1), package.StateError)
    assert peak_rss_mib() - before < 64


@case()
def load_seq_file_of_huge_claims(name):
    rc = engine(name)
    import recurrent_cache as package
    cache = populated(rc, n_embd_r=1, n_embd_s=1, dtype_s="f32")
    directory = tempfile.mkdtemp()
    path = os.path.join(directory, "seq")
    for data in (struct.pack("<III", 0x67677371, 2, 2**32 - 1),
                 seq_file([1], blob([(0, [])], 2, [(0, 2**63)] + [(0, 4)] * 3, rows=False)),
                 seq_file([1], blob([(0, [])], 2**32 - 1, [], rows=False)),
                 seq_file([1], blob([(-1, [])], 2, [(0, 4)] * 4)),
                 seq_file([], struct.pack("<I", 2**32 - 1))):
        Path(path).write_bytes(data)
        rejected(cache, lambda: package.load_seq_file(path, cache, 0), package.StateError)


# -- inspect ---------------------------------------------------------------------

def _valid_and_read_by_its_smallest_cache(rc, data, path):
    """inspect accepts data; the cache it names reads it, and one cell smaller does not."""
    Path(path).write_bytes(data)
    code, out, err = inspect_cli(path, "--json")
    assert code == 0 and err == "", err
    fits = json.loads(out)["reads_into"]
    shape = {key: fits[key] for key in ("n_layer", "n_embd_r", "n_embd_s", "dtype_r", "dtype_s", "layers")
             if fits[key] is not None}
    cache = rc.RecurrentCache(**{"n_embd_r": 1, "n_embd_s": 1, **shape}, n_seq_max=fits["size"])
    cache.state_read(data, fits["seq_id"])
    cache.check()
    if fits["seq_id"] == -1 and fits["size"] > 1:
        smaller = rc.RecurrentCache(**{"n_embd_r": 1, "n_embd_s": 1, **shape}, n_seq_max=fits["size"] - 1)
        rejected(smaller, lambda: smaller.state_read(data, -1))


@case(both=False)
def inspect_says_valid_only_for_what_state_read_accepts(name):
    import recurrent_cache as rc
    directory = tempfile.mkdtemp()
    path = os.path.join(directory, "blob")
    cache = populated(rc, dtype_r="bf16")
    for data in (cache.state_write(), cache.state_write(2), cache.state_write(5),
                 blob([(3, [7])], 1, [(1, 6), (30, 2)]), blob([], 0, [])):
        _valid_and_read_by_its_smallest_cache(rc, data, path)
    tensors = [(0, 4), (0, 4)]
    for data, match in (
            (blob([(0, [0])], 1, [(0, 2**63), (0, 4)], rows=False), "row size 9223372036854775808"),
            (blob([(0, [0])], 1, [(0, 2**64 - 4), (0, 4)], rows=False), "n_embd in [1, 2147483647]"),
            (blob([], 1, [(0, 2**63), (0, 4)]), "row size 9223372036854775808"),
            (blob([(-1, [0])], 1, tensors), "has pos -1 at byte 4: positions must be in"),
            (blob([(-5, [])], 1, tensors), "has pos -5 at byte 4: positions must be in"),
            (blob([(0, [-1])], 1, tensors), "seq_id -1"),
            (blob([(0, [1, 1])], 1, tensors), "already listed"),
            (blob([(0, [1]), (4, [2, 1])], 1, tensors), "already listed by cell 0"),
            (blob([(0, [2**31 - 1])], 1, tensors), "seq_id 2147483647"),
            (blob([(0, []), (1, [])], 1, tensors), "has 2 cells"),
            (blob([(0, [0]), (1, [])], 1, tensors), "no seq id"),
            (blob([(0, [0])], 2, [(0, 4), (1, 2), (0, 4), (0, 4)]), "one r type"),
            (blob([(0, [0])], 2, [(0, 4), (0, 8), (0, 4), (0, 4)]), "one r type"),
            (blob([(0, [0])], 1, [(2, 18), (0, 4)]), "has type 2"),
            (blob([(0, [0])], 1, [(0, 6), (0, 4)]), "row size 6"),
            (blob([(0, [0])], 1, [(0, 0), (0, 4)]), "row size 0"),
            (b"", "truncated at byte 0 of 0"),
            (seq_file([1], blob([(-3, [])], 1, tensors)),
             "at byte 16: state blob cell 0 has pos -3 at byte 4: positions must be in"),
            (seq_file([1], b"\0" * 12) + b"!", "trailing")):
        Path(path).write_bytes(data)
        cli_user_error(path, match=match)
        cli_user_error(path, "--json", match=match)
    cli_user_error(path, match="trailing", in_process=False)   # and the command itself


@case(both=False)
def inspect_of_dev_zero_fifos_huge_files_and_non_files(name):
    assert "trailing" in cli_user_error("/dev/zero")
    fifo = Fifo(blob([(0, [0])], 1, [(0, 2**40)], rows=False), b"\0" * 65536)
    start = time.monotonic()
    cli_user_error(fifo.path, match="row size 1099511627776")
    fifo = Fifo(struct.pack("<III", 0x67677371, 2, 2**32 - 1), b"\0" * 65536)
    cli_user_error(fifo.path, match="more than max_tokens 67108864")
    fifo = Fifo(struct.pack("<III", 0x67677371, 2, 1000), b"\0" * 65536)
    cli_user_error(fifo.path, match="stream goes on")   # 1000 tokens, a 12-byte empty blob, then more
    assert time.monotonic() - start < CASE_SECONDS / 2
    cli_user_error(sparse_file(2**40, struct.pack("<I", 0)), match="1099511627764 trailing bytes")
    cli_user_error(tempfile.mkdtemp(), match="cannot read")
    cli_user_error(os.path.join(tempfile.mkdtemp(), "missing"), match="cannot read", in_process=False)


@case(both=False)
def inspect_usage_errors_are_one_line(name):
    from recurrent_cache.cli import inspect as inspect_command
    for argv in ([], ["--bogus", "x"], ["x", "--max-cells", "many"], ["a", "b"], ["x", "--max-tokens", "1e3"]):
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                inspect_command.main(argv)
            except SystemExit as exit:
                assert exit.code == 2, exit.code
            else:
                raise AssertionError(f"{argv} accepted")
        assert len(err.getvalue().strip().splitlines()) == 1, err.getvalue()
    done = subprocess.run([sys.executable, "-m", "recurrent_cache", "inspect"],
                          capture_output=True, text=True, timeout=CASE_SECONDS, check=False)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr


@case(both=False)
def inspect_rows_stream_in_constant_memory(name):
    """A 256 MiB valid blob from a FIFO: summarised as it streams, not kept."""
    from recurrent_cache import blob_report
    row_bytes = 2**27
    values = np.full(row_bytes // 4, 1.5, np.float32).tobytes()
    fifo = Fifo(blob([(0, [0])], 1, [(0, row_bytes)], rows=False) + values
                + struct.pack("<iQ", 0, row_bytes) + values)
    before = peak_rss_mib()
    with open(fifo.path, "rb") as stream:
        report = blob_report.describe_file(stream)
    assert peak_rss_mib() - before < 200
    assert [t["mean"] for t in report["tensors"]] == [1.5, 1.5] and report["reads_into"]["size"] == 1


# -- the harness -------------------------------------------------------------------

def child(names):
    """Run the named cases, saying '@@start NAME' before and '@@pass NAME' / '@@fail NAME msg' after."""
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)   # what the cases print is not the protocol
    for name in names:
        protocol.write(f"@@start {name}\n")
        try:
            CASES[name](name)
        except BaseException as exc:   # noqa: BLE001 - every failure is reported by name
            message = f"{type(exc).__name__}: {exc}".replace("\n", " | ")
            protocol.write(f"@@fail {name} {message}\n")
        else:
            protocol.write(f"@@pass {name}\n")


def run_children(names):
    """Results by case name: None (passed) or what went wrong; a crash or a hang is one case's."""
    results = {}
    pending = list(names)
    while pending:
        proc = subprocess.Popen([sys.executable, str(HERE), "--child", *pending], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        current = None
        buffer = ""
        last = time.monotonic()
        while True:
            ready, _, _ = select.select([proc.stdout], [], [], 1.0)
            if ready:
                line = proc.stdout.readline()
                if not line:
                    break
                last = time.monotonic()
                kind, _, rest = line.rstrip("\n").partition(" ")
                case_name, _, message = rest.partition(" ")
                if kind == "@@start":
                    current = case_name
                elif kind in ("@@pass", "@@fail"):
                    results[case_name] = None if kind == "@@pass" else message
                    current = None
            elif time.monotonic() - last > CASE_SECONDS:
                proc.kill()
                results[current or pending[0]] = f"hung: no answer in {CASE_SECONDS} s"
                break
        proc.wait()
        buffer = proc.stderr.read()[-2000:]
        if current is not None and current not in results:
            results[current] = f"crashed: exit status {proc.returncode}; stderr: {buffer}"
        left = [n for n in pending if n not in results]
        if left and left == pending:   # the child died before running anything
            for n in left:
                results[n] = f"the child failed to start: exit status {proc.returncode}; stderr: {buffer}"
            left = []
        pending = left
    return results


@pytest.fixture(scope="module")
def results():
    return run_children(list(CASES))


@pytest.mark.parametrize("name", list(CASES))
def test_hostile(results, name):
    assert results[name] is None, results[name]


if __name__ == "__main__" and sys.argv[1:2] == ["--child"]:
    sys.path.insert(0, str(HERE.parents[1]))
    child(sys.argv[2:])
