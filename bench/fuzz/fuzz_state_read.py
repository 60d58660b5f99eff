"""Differential fuzzing of ``state_read``: compiled core vs pure-Python reference.

Each input picks a cache (byte 0), a seq id (byte 1, including out-of-range
ones) and a blob (the rest).  It is read into a populated compiled cache and
into the reference cache with the same content, and:

* no input may crash the interpreter or raise anything but a
  ``RecurrentCacheError``;
* a rejected read leaves cells and rows bit-identical, in both;
* both implementations reject the same inputs with the same message, and
  accepted inputs leave both caches identical and consistent (``check()``).

Seeds are valid blobs of every cache and sequence plus the llama.cpp blobs of
tests/data, so mutations reach the checks deep in a blob.

    pip install atheris                                  # coverage-guided engine
    python bench/fuzz/fuzz_state_read.py -runs=200000    # libFuzzer options pass through
    python bench/fuzz/fuzz_state_read.py --engine random --runs 200000   # no atheris needed

The corpus is kept in build/fuzz-corpus (seeded on first use).  A failure
stops the run with a non-zero exit and the input (libFuzzer writes a crash-*
file; the random engine prints it in base64); libFuzzer ends with "Done N
runs", the random engine with the count of inputs tried.
"""

from __future__ import annotations

import argparse
import base64
import gzip
import json
import random
import sys
from pathlib import Path


try:
    import atheris
except ImportError:   # the random engine needs nothing else
    atheris = None

from caches import ENGINES, populate, snapshot  # bench/fuzz/caches.py, beside this script
from recurrent_cache import RecurrentCacheError

ROOT = Path(__file__).resolve().parents[2]
VECTORS = ROOT / "tests" / "data"   # the conformance data recorded from llama.cpp

# (n_layer, n_embd_r, n_embd_s, size, dtype_r, dtype_s); the second is llama.cpp's test shape
CONFIGS = [
    (2, 2, 3, 6, "f16", "bf16"),
    (3, 8, 12, 4, "f32", "f32"),
    (0, 1, 1, 3, "f32", "f32"),
    (1, 5, 1, 9, "bf16", "f32"),
]




class Target:
    """One configuration: a compiled and a reference cache in the same state."""

    def __init__(self, config):
        self.config = config
        self.caches = [populate(engine, config) for engine in ENGINES]
        self.baseline = self.caches[0].state_write()
        assert self.baseline == self.caches[1].state_write()

    def reset(self):
        for cache in self.caches:
            cache.state_read(self.baseline)


TARGETS = [Target(config) for config in CONFIGS]
COUNT = [0]


def attempt(cache, blob, seq_id):
    before = snapshot(cache)
    try:
        cache.state_read(blob, seq_id)
    except RecurrentCacheError as exc:
        assert snapshot(cache) == before, f"a rejected read changed the cache: {exc}"
        cache.check()
        return f"{type(exc).__name__}: {exc}"
    cache.check()
    return snapshot(cache)


def test_one_input(data: bytes) -> None:
    COUNT[0] += 1
    if len(data) < 2:
        return
    target = TARGETS[data[0] % len(TARGETS)]
    size = target.config[3]
    seq_id = data[1] % (size + 3) - 2   # -2 .. size: both ends out of range too
    blob = data[2:]
    core, reference = (attempt(cache, blob, seq_id) for cache in target.caches)
    assert core == reference, f"the implementations disagree:\n core: {core}\n reference: {reference}"
    if not isinstance(core, str):
        assert target.caches[0].state_write() == target.caches[1].state_write()
        target.reset()


def seeds() -> list[bytes]:
    out = []
    for t, target in enumerate(TARGETS):
        size = target.config[3]
        for seq_id in range(-1, size):
            out.append(bytes([t, seq_id + 2]) + target.caches[0].state_write(seq_id))
    blobs = VECTORS / "llamacpp_blobs.jsonl.gz"
    if blobs.exists():
        with gzip.open(blobs, "rt") as f:
            for line in f:
                record = json.loads(line)
                if record["n_layer"] == 3 and record["size"] <= 4:
                    selector = bytes([1, record["seq_id"] + 2])   # config 1, the blob's seq id
                    out.append(selector + base64.b64decode(record["blob_b64"]))
    return out


def mutate(rng: random.Random, data: bytes) -> bytes:
    """A few random edits: flips, 32-bit field overwrites, truncation, insertion, splicing."""
    buf = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        kind = rng.randrange(6)
        if kind == 0 and buf:
            buf[rng.randrange(len(buf))] ^= 1 << rng.randrange(8)
        elif kind == 1 and len(buf) >= 4:
            at = rng.randrange(len(buf) - 3)
            value = rng.choice([0, 1, 2, 0xFFFFFFFF, 0x80000000, rng.getrandbits(32)])
            buf[at:at + 4] = value.to_bytes(4, "little")
        elif kind == 2:
            del buf[rng.randrange(len(buf) + 1):]
        elif kind == 3:
            at = rng.randrange(len(buf) + 1)
            buf[at:at] = rng.randbytes(rng.randint(1, 8))
        elif kind == 4 and buf:
            buf[rng.randrange(len(buf))] = rng.randrange(256)
        else:
            at = rng.randrange(len(buf) + 1)
            buf[at:] = rng.choice(SEEDS)[at:]
    return bytes(buf)


SEEDS = seeds()


def run_random(runs: int, seed: int) -> None:
    rng = random.Random(seed)
    for seed_input in SEEDS:
        test_one_input(seed_input)
    while COUNT[0] < runs:
        data = mutate(rng, rng.choice(SEEDS))
        try:
            test_one_input(data)
        except BaseException:
            print(f"failing input (base64): {base64.b64encode(data).decode()}", file=sys.stderr)
            raise


def run_atheris(libfuzzer_args: list[str]) -> None:
    if atheris is None:
        sys.exit("fuzz_state_read: atheris is not installed (pip install atheris), or use --engine random")
    # Coverage feedback comes from the Python code (the reference's blob parser
    # mirrors the core's checks); instrument_imports misses the editable install's loader.
    atheris.instrument_all()
    corpus = ROOT / "build" / "fuzz-corpus"
    if not corpus.exists():
        corpus.mkdir(parents=True)
        for i, seed_input in enumerate(SEEDS):
            (corpus / f"seed-{i:04d}").write_bytes(seed_input)
    if not any(not arg.startswith("-") for arg in libfuzzer_args):
        libfuzzer_args.append(str(corpus))
    atheris.Setup([sys.argv[0]] + libfuzzer_args, test_one_input)
    atheris.Fuzz()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--engine", choices=["atheris", "random"], default="atheris")
    parser.add_argument("--runs", type=int, default=100_000, help="inputs to try (random engine)")
    parser.add_argument("--seed", type=int, default=0, help="random engine seed")
    options, libfuzzer_args = parser.parse_known_args()
    if options.engine == "random":
        run_random(options.runs, options.seed)
        print(f"fuzz_state_read: {COUNT[0]} inputs tried, no failure")
    else:
        run_atheris(libfuzzer_args)


if __name__ == "__main__":
    main()
