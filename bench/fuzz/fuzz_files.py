"""Differential fuzzing of the file surfaces: load_seq_file, state_read_from and inspect.

Each input picks a cache (byte 0), a seq id (byte 1) and the content of a
file (the rest: a 'ggsq' sequence file or a bare state blob).  The file is
written to disk and:

* ``load_seq_file`` into a populated compiled cache and the reference cache
  with the same content: the same ``StateError`` message or identical caches;
  a rejection leaves both bit-identical, an acceptance passes ``check()`` and
  equals ``state_read`` of the blob parsed in memory;
* ``state_read_from`` the file: the same outcome and message as ``state_read``
  of its bytes;
* ``inspect`` (``blob_report.describe_file``) says "valid" exactly when some
  cache's ``state_read`` accepts the blob: when it is valid, the cache it names
  reads it; when a populated cache above accepted it, inspect must call it valid;
* every ``--pipe-every`` th input is also fed through a pipe (a stream of
  unknown length): the same verdicts, and the same messages except where a
  stream cannot know how many bytes trail the blob.

No input may crash the interpreter, hang (``--timeout`` seconds per input:
faulthandler dumps the stacks and exits) or raise anything but a
``RecurrentCacheError``.

    python bench/fuzz/fuzz_files.py --runs 100000            # random mutations of valid files
    pip install atheris && python bench/fuzz/fuzz_files.py --engine atheris -runs=100000

The input being tried is kept in build/fuzz-files-current (the one to replay
after a crash); a failure prints it in base64 and exits non-zero.  The run
ends with the count of inputs tried per surface.
"""

from __future__ import annotations

import argparse
import base64
import collections
import faulthandler
import os
import random
import re
import struct
import sys
import tempfile
import threading
from pathlib import Path


try:
    import atheris
except ImportError:   # the random engine needs nothing else
    atheris = None

import recurrent_cache
from caches import ENGINES, populate, snapshot  # bench/fuzz/caches.py, beside this script
from recurrent_cache import RecurrentCacheError, blob_report, load_seq_file
from recurrent_cache.formats.blob import parse_blob
from recurrent_cache.formats.files import parse_seq_file_header, read_rest
from recurrent_cache.formats.geometry import Geometry

ROOT = Path(__file__).resolve().parents[2]
CURRENT = ROOT / "build" / "fuzz-files-current"
MAGIC = 0x67677371

# (n_layer, n_embd_r, n_embd_s, size, dtype_r, dtype_s)
CONFIGS = [
    (2, 2, 3, 6, "f16", "bf16"),
    (1, 3, 1, 4, "f32", "f32"),
    (0, 1, 1, 3, "f32", "f32"),
]
COUNTS: collections.Counter = collections.Counter()
MAX_BUILT_SIZE = 4096   # inspect's smallest cache is built and read into up to this size




class Target:
    """One configuration: a compiled and a reference cache in the same state."""

    def __init__(self, config):
        self.config = config
        self.caches = [populate(engine, config) for engine in ENGINES]
        self.baseline = self.caches[0].state_write()
        for cache in self.caches:   # rows of empty cells are zeroed by a whole-cache read: start from one
            cache.state_read(self.baseline)
        self.baseline_snapshot = snapshot(self.caches[0])
        assert snapshot(self.caches[1]) == self.baseline_snapshot

    def reset(self):
        for cache in self.caches:
            cache.state_read(self.baseline)
        assert snapshot(self.caches[0]) == self.baseline_snapshot


TARGETS = [Target(config) for config in CONFIGS]
DIRECTORY = Path(tempfile.mkdtemp(prefix="fuzz-files-"))
PATH = DIRECTORY / "input"


def outcome(call, cache):
    """'ok' and the cache's snapshot, or the error message (the cache must be unchanged)."""
    before = snapshot(cache)
    try:
        call()
    except RecurrentCacheError as exc:
        assert snapshot(cache) == before, f"a rejected call changed the cache: {exc}"
        cache.check()
        return f"{type(exc).__name__}: {exc}"
    cache.check()
    return snapshot(cache)


def through_pipe(content, read):
    """read(file) of ``content`` streamed through a pipe by a writer thread."""
    r, w = os.pipe()

    def write():
        with os.fdopen(w, "wb") as out:
            try:
                out.write(content)
            except BrokenPipeError:   # the reader stopped early: that is allowed
                pass

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    try:
        with os.fdopen(r, "rb") as stream:
            return read(stream)
    finally:
        writer.join()


def verdict(call):
    try:
        return "valid", call()
    except RecurrentCacheError as exc:
        return "invalid", f"{type(exc).__name__}: {exc}"


def same_except_trailing(a, b):
    return a == b or (isinstance(a, str) and isinstance(b, str) and "trailing" in a + b)


def check_inspect(content, accepted_by_some_cache):
    """inspect's verdict against state_read: valid => the cache it names reads the blob."""
    COUNTS["inspect"] += 1
    with open(PATH, "rb") as file:
        kind, report = verdict(lambda: blob_report.describe_file(file))
    if accepted_by_some_cache:
        assert kind == "valid", f"a cache accepted the blob but inspect says: {report}"
    if kind == "valid":
        fits = report["reads_into"]
        blob = content[report["blob_offset"]:]
        shape = {key: fits[key] for key in ("n_layer", "n_embd_r", "n_embd_s", "dtype_r", "dtype_s", "layers")
                 if fits[key] is not None}
        if fits["size"] > MAX_BUILT_SIZE:
            # too large to build here (and RecurrentCache(size=2**30 + 1) crashes the compiled
            # core: the lead's 'huge sizes' fix); the reference's own checks against that geometry
            parse_blob(blob, Geometry(**{"n_embd_r": 1, "n_embd_s": 1, **shape}, size=fits["size"]), fits["seq_id"])
            COUNTS["inspect: valid for a large cache"] += 1
            return kind, report
        cache = recurrent_cache.RecurrentCache(**{"n_embd_r": 1, "n_embd_s": 1, **shape}, n_seq_max=fits["size"])
        cache.state_read(blob, fits["seq_id"])
        cache.check()
        if fits["seq_id"] >= 0:
            assert cache.state_write(fits["seq_id"]) == blob, "inspect's cache does not write the blob back"
        else:   # a whole-cache write sorts each cell's seq ids
            cells = [(cell["pos"], tuple(sorted(cell["seq_ids"]))) for cell in report["cells"]]
            assert [cache.cell(i)[0::3] for i in range(len(cells))] == cells, "inspect's cache holds other cells"
    return kind, report


def test_one_input(data: bytes, pipe: bool = False) -> None:
    COUNTS["inputs"] += 1
    if len(data) < 2:
        return
    CURRENT.write_bytes(data)
    target = TARGETS[data[0] % len(TARGETS)]
    size = target.config[3]
    seq_id = data[1] % (size + 1) - 1   # -1 .. size - 1
    content = data[2:]
    PATH.write_bytes(content)
    is_seq_file = len(content) >= 4 and struct.unpack_from("<I", content)[0] == MAGIC
    accepted = False
    if is_seq_file:
        COUNTS["load_seq_file"] += 1
        core, reference = (outcome(lambda: load_seq_file(PATH, cache, seq_id), cache) for cache in target.caches)
        assert core == reference, f"the implementations disagree:\n core: {core}\n reference: {reference}"
        if not isinstance(core, str):
            accepted = True
            tokens, start = parse_seq_file_header(content)
            memory = populate("compiled", target.config)
            memory.state_read(target.baseline)   # the state the target caches started from
            memory.state_read(content[start:], seq_id, framing="bare")   # what follows a header is a section
            assert snapshot(memory) == core, "load_seq_file and state_read of the same blob differ"
            target.reset()
        elif "the state blob at byte" in core:   # the header passed: the file and memory parses agree
            tokens, start = parse_seq_file_header(content)
            memory = outcome(lambda: target.caches[0].state_read(content[start:], seq_id, framing="bare"),
                             target.caches[0])
            assert isinstance(memory, str) and memory.split(": ", 1)[1] in core, (memory, core)
    else:
        COUNTS["state_read_from"] += 1
        cache = target.caches[seq_id % 2]
        with open(PATH, "rb") as file:
            from_file = outcome(lambda: cache.state_read_from(file, seq_id), cache)
        target.reset()
        from_memory = outcome(lambda: cache.state_read(content, seq_id), cache)
        target.reset()
        # both reject (state_read_from checks the structure first, so the first defect named may
        # differ while the facade passes no cache shape to read_rest) or both give the same cache
        assert isinstance(from_file, str) == isinstance(from_memory, str) and \
            (isinstance(from_file, str) or from_file == from_memory), \
            f"file and memory disagree:\n file: {from_file}\n memory: {from_memory}"
        if isinstance(from_memory, str):
            # read_rest with the cache's shape (what the facade should pass) words the defect as state_read
            with open(PATH, "rb") as file:
                shaped = outcome(lambda: cache.state_read(read_rest(file, Geometry.of(cache), seq_id), seq_id),
                                 cache)
            assert shaped == from_memory, f"shaped file read and memory disagree:\n {shaped}\n {from_memory}"
        else:
            accepted = True
    kind, report = check_inspect(content, accepted)
    if pipe:
        COUNTS["through a pipe"] += 1
        piped_kind, piped = verdict(lambda: through_pipe(content, blob_report.describe_file))
        assert piped_kind == kind and same_except_trailing(piped, report), (piped, report)
        if is_seq_file:
            cache = target.caches[0]
            piped = outcome(lambda: through_pipe(content, lambda stream: load_seq_file(
                f"/dev/fd/{stream.fileno()}", cache, seq_id)), cache)
            direct = outcome(lambda: load_seq_file(PATH, cache, seq_id), cache)
            if isinstance(direct, str) or isinstance(piped, str):
                assert isinstance(direct, str) and isinstance(piped, str), (direct, piped)
                assert same_except_trailing(direct.replace(str(PATH), "P"),
                                            re.sub(r"/dev/fd/\d+", "P", piped)), (direct, piped)
            else:
                assert direct == piped
            target.reset()


def seeds() -> list[bytes]:
    out = []
    for t, target in enumerate(TARGETS):
        cache = target.caches[0]
        for seq_id in range(-1, cache.size):
            blob = cache.state_write(seq_id)
            out.append(bytes([t, seq_id + 1]) + blob)
            tokens = list(range(seq_id + 2))
            out.append(bytes([t, seq_id + 1]) + struct.pack(f"<III{len(tokens)}i", MAGIC, 2, len(tokens), *tokens)
                       + blob)
    return out


SEEDS = seeds()
INTERESTING = [0, 1, 2, 4, 0xFFFFFFFF, 0x7FFFFFFF, 0x80000000, 12, 30, MAGIC]


def mutate(rng: random.Random, data: bytes) -> bytes:
    """A few edits: flips, 32/64-bit field overwrites with edge values, truncation, insertion, splicing."""
    buf = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        kind = rng.randrange(7)
        if kind == 0 and buf:
            buf[rng.randrange(len(buf))] ^= 1 << rng.randrange(8)
        elif kind == 1 and len(buf) >= 4:
            at = rng.randrange(len(buf) - 3)
            value = rng.choice(INTERESTING + [rng.getrandbits(32)])
            buf[at:at + 4] = value.to_bytes(4, "little")
        elif kind == 2 and len(buf) >= 8:
            at = rng.randrange(len(buf) - 7)
            buf[at:at + 8] = rng.choice([2**63, 2**64 - 1, 2**32, rng.getrandbits(64)]).to_bytes(8, "little")
        elif kind == 3:
            del buf[rng.randrange(len(buf) + 1):]
        elif kind == 4:
            at = rng.randrange(len(buf) + 1)
            buf[at:at] = rng.randbytes(rng.randint(1, 8))
        elif kind == 5 and len(buf) > 2:
            buf[rng.randrange(2)] = rng.randrange(256)   # another cache or seq id
        else:
            at = rng.randrange(len(buf) + 1)
            buf[at:] = rng.choice(SEEDS)[at:]
    return bytes(buf)


def guarded(data: bytes, pipe: bool, timeout: float) -> None:
    faulthandler.dump_traceback_later(timeout, exit=True)
    try:
        test_one_input(data, pipe)
    except BaseException:
        print(f"failing input (base64): {base64.b64encode(data).decode()}", file=sys.stderr)
        raise
    finally:
        faulthandler.cancel_dump_traceback_later()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--engine", choices=["atheris", "random"], default="random")
    parser.add_argument("--runs", type=int, default=20_000, help="inputs to try (random engine)")
    parser.add_argument("--seed", type=int, default=0, help="random engine seed")
    parser.add_argument("--pipe-every", type=int, default=20, help="feed every N-th input through a pipe too")
    parser.add_argument("--timeout", type=float, default=30, help="seconds one input may take")
    options, libfuzzer_args = parser.parse_known_args()
    CURRENT.parent.mkdir(parents=True, exist_ok=True)
    if options.engine == "atheris":
        if atheris is None:
            sys.exit("fuzz_files: atheris is not installed (pip install atheris), or use --engine random")
        atheris.instrument_all()
        atheris.Setup([sys.argv[0]] + libfuzzer_args,
                      lambda data: guarded(data, COUNTS["inputs"] % options.pipe_every == 0, options.timeout))
        atheris.Fuzz()
    rng = random.Random(options.seed)
    for seed_input in SEEDS:
        guarded(seed_input, True, options.timeout)
    while COUNTS["inputs"] < options.runs:
        guarded(mutate(rng, rng.choice(SEEDS)), COUNTS["inputs"] % options.pipe_every == 0, options.timeout)
    print("fuzz_files: " + ", ".join(f"{name} {count}" for name, count in COUNTS.items())
          + "; crashes 0, hangs 0, failures 0")


if __name__ == "__main__":
    main()
