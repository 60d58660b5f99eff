"""Stores that trust nothing they did not write (issue 17).

A ``DirectoryStore`` meets files named like its entries that it did not write
(a FIFO, a file far larger than an entry, a link to elsewhere): a miss,
counted as damaged, never a read that blocks or one as large as the file.
Its sweep deletes only files named exactly as it names its own.  A ``put``
that returned True is readable until evicted, however many threads or
processes write the same key.  ``RedisStore`` refuses at construction any
option it could not use, and works with every value it accepts.

Also the worker the multi-process test runs as a separate OS process
(``python test_stores_trust.py race STORE KEY ENTRIES_DIR N``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

import recurrent_cache as rc
from recurrent_cache.stores import DirectoryStore, Geometry, encode_snapshot, open_store
from recurrent_cache.stores.snapshot import key_digest

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))   # for the worker process, which is not run by pytest
from test_stores_shared import numbered_entry, small_entries  # noqa: E402


def data_file(store: DirectoryStore, key: str) -> Path:
    link = Path(store.path) / f"{key_digest(key).hex()}.ggsq"
    return link.parent / os.readlink(link)


def read_in_thread(store: DirectoryStore, key: str, seconds: float = 10.0):
    """``store.get_first([key])`` on a thread: (finished, result); a read that blocks does not finish."""
    out: list = []
    reader = threading.Thread(target=lambda: out.append(store.get_first([key])), daemon=True)
    reader.start()
    reader.join(seconds)
    return (not reader.is_alive()), (out[0] if out else None)


# -- files the store did not write -----------------------------------------------------------

def test_a_fifo_named_like_an_entry_file_is_a_miss_not_a_read_that_blocks(tmp_path):
    store = DirectoryStore(tmp_path)
    (key, entry, _), (other, other_entry, _) = numbered_entry(1, 4), numbered_entry(2, 4)
    assert store.put(key, entry) and store.put(other, other_entry)
    fifo = data_file(store, key)
    fifo.unlink()
    os.mkfifo(fifo)
    try:
        finished, found = read_in_thread(store, key)
    finally:
        if not fifo.exists() or not finished:   # release a reader stuck in open() (the bug)
            with open(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK), "wb"):
                pass
    assert finished, "reading an entry whose file is a FIFO blocked"
    assert found is None
    assert store.stats()["damaged"] == 1
    assert fifo.is_fifo()                                  # not the store's: left where it was
    assert bytes(store.get_first([other])[1]) == other_entry


def test_a_fifo_where_an_entry_link_should_be_is_a_miss_and_left_alone(tmp_path):
    store = DirectoryStore(tmp_path)
    key, entry, _ = numbered_entry(1, 4)
    link = Path(store.path) / f"{key_digest(key).hex()}.ggsq"
    os.mkfifo(link)
    finished, found = read_in_thread(store, key)
    assert finished and found is None and store.stats()["damaged"] == 1 and link.is_fifo()


@pytest.mark.parametrize("grown", ["sparse tail", "link to a large file elsewhere"])
def test_a_file_far_larger_than_its_entry_is_a_miss_not_read_whole(tmp_path, grown):
    store = DirectoryStore(tmp_path / "store")
    key, entry, _ = numbered_entry(1, 4)
    assert store.put(key, entry)
    path = data_file(store, key)
    huge = 256 << 20
    if grown == "sparse tail":        # a valid entry's bytes, then 256 MiB that no header declares
        with open(path, "r+b") as file:
            file.truncate(huge)
    else:
        elsewhere = tmp_path / "elsewhere"
        elsewhere.write_bytes(entry[:-32])
        with open(elsewhere, "r+b") as file:
            file.truncate(huge)
        path.unlink()
        os.symlink(elsewhere, path)
    tracemalloc.start()
    try:
        finished, found = read_in_thread(store, key)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert finished and found is None
    assert peak < 1 << 20, f"reading a {huge}-byte file named like an entry allocated {peak} bytes"
    assert store.stats()["damaged"] == 1
    if grown != "sparse tail":
        assert (tmp_path / "elsewhere").stat().st_size == huge   # the file it pointed at: untouched


def test_an_entry_file_whose_headers_declare_another_length_is_a_miss(tmp_path):
    store = DirectoryStore(tmp_path)
    key, entry, _ = numbered_entry(1, 4)
    assert store.put(key, entry)
    path = data_file(store, key)
    body = bytearray(path.read_bytes())
    body[8:12] = (1 << 20).to_bytes(4, "little")        # n_token_count: far past the end of the file
    path.write_bytes(body)
    assert store.get_first([key]) is None and store.stats()["damaged"] == 1


# -- the sweep deletes only its own files ----------------------------------------------------

def test_the_sweep_leaves_files_it_did_not_write(tmp_path):
    """Old hidden ``*.tmp`` / ``*.lnk`` files (and orphans) not named as the store names its own
    stay; those named exactly like its own are swept."""
    key, entry, _ = numbered_entry(1, 64)
    digest = key_digest(key).hex()
    foreign = {
        ".editor.tmp": "file", ".x.lnk": "file", ".backup.lnk": "symlink",
        f".{digest}.tmp": "file",                             # no random part
        f".{digest}.{'ab' * 8}.tmp.keep": "file",             # longer suffix
        f".{digest}.{'AB' * 8}.tmp": "file",                  # upper-case hex: not the store's
        f".{digest}.{'ab' * 8}.lnk": "file",                  # the store's .lnk are symbolic links
        f".{digest}.{'cd' * 8}.tmp": "directory",
        f".{digest}.{'ef' * 8}.tmp": "fifo",                  # the store's .tmp are regular files
        f"{'12' * 16}.0badf00d.ggsq": "fifo",                 # an orphan's name, not a file the store wrote
        f"{digest}.0badf00d.ggsq.orig": "file",
        f"{'ef' * 16}.ggsq": "file",                          # a link name holding a regular file
        "notes.txt": "file",
    }
    own = [f".{digest}.{'12' * 8}.tmp", f".{'9a' * 16}.{'34' * 8}.lnk"]
    for name, what in foreign.items():
        path = tmp_path / name
        if what == "file":
            path.write_bytes(b"someone else's data")
        elif what == "symlink":
            os.symlink("notes.txt", path)
        elif what == "fifo":
            os.mkfifo(path)
        else:
            path.mkdir()
    (tmp_path / own[0]).write_bytes(b"a dead writer's")
    os.symlink("nowhere", tmp_path / own[1])
    old = time.time() - 3600
    for name in [*foreign, *own]:
        os.utime(tmp_path / name, (old, old), follow_symlinks=False)
    store = DirectoryStore(tmp_path, max_bytes=len(entry))
    store.stats()                                            # a scan
    for i in range(4):                                       # puts over the cap: scans that evict
        store.put(*numbered_entry(i, 64)[:2])
    names = set(os.listdir(tmp_path))
    assert set(foreign) <= names, f"the sweep removed {set(foreign) - names}"
    assert (tmp_path / ".editor.tmp").read_bytes() == b"someone else's data"
    assert not names & set(own)


# -- a put that returned True is readable until evicted ---------------------------------------

def different_entries(n: int) -> tuple[str, list[bytes]]:
    """One key and ``n`` different entries under it (other rows: another machine's rounding)."""
    geometry = Geometry(2, 3, 5, "f32", "f16")
    _, entries = small_entries(1)
    key, tokens, _ = entries[0]
    rng = np.random.default_rng(11)
    out = []
    for _ in range(n):
        r = [rng.standard_normal(3).astype(np.float32) for _ in range(2)]
        s = [rng.standard_normal(5).astype(np.float16) for _ in range(2)]
        out.append(bytes(encode_snapshot(key, tokens, r, s, geometry)))
    return key, out


def hammer(store, key: str, candidates: list[bytes], rounds: int, start: int = 0) -> int:
    """Put the candidates under ``key`` in turn; after every put told True the key must read back
    as one of them.  Returns how many times it did not."""
    bad = 0
    for i in range(rounds):
        if store.put(key, candidates[(start + i) % len(candidates)]):
            found = store.get_first([key])
            bad += found is None or bytes(found[1]) not in candidates
    return bad


def test_threads_racing_puts_of_one_key_leave_a_readable_entry(tmp_path):
    key, candidates = different_entries(3)
    store = DirectoryStore(tmp_path)
    bad = [0, 0, 0]
    barrier = threading.Barrier(3)

    def run(i: int) -> None:
        barrier.wait()
        bad[i] = hammer(store, key, candidates, 400, start=i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert bad == [0, 0, 0]
    final = store.get_first([key])
    assert final is not None and bytes(final[1]) in candidates
    assert store.stats()["damaged"] == 0


@pytest.mark.parametrize("kind", ["directory", "redis"], indirect=True)
def test_processes_racing_puts_of_one_key_leave_a_readable_entry(kind, tmp_path):
    key, candidates = different_entries(3)
    entries_dir = tmp_path / "entries"
    entries_dir.mkdir()
    for i, entry in enumerate(candidates):
        (entries_dir / str(i)).write_bytes(entry)
    processes = [subprocess.Popen([sys.executable, str(HERE), "race", kind.spec, key, str(entries_dir), "300",
                                   str(i)], stdout=subprocess.PIPE, text=True) for i in range(3)]
    results = [json.loads(p.communicate(timeout=300)[0]) for p in processes]
    assert all(p.returncode == 0 for p in processes)
    assert [r["bad"] for r in results] == [0, 0, 0]
    assert sum(r["puts"] for r in results) >= 1
    final = kind.open().get_first([key])
    assert final is not None and bytes(final[1]) in candidates


# -- paths -----------------------------------------------------------------------------------

def test_a_bytes_path_is_the_directory_it_names(tmp_path):
    store = DirectoryStore(os.fsencode(tmp_path / "bytes"))
    key, entry, _ = numbered_entry(1, 4)
    assert store.put(key, entry)
    assert bytes(store.get_first([key])[1]) == entry
    assert store.path == str(tmp_path / "bytes") and store.stats()["entries"] == 1
    assert bytes(DirectoryStore(str(tmp_path / "bytes")).get_first([key])[1]) == entry   # the same place
    assert isinstance(open_store(os.fsencode(tmp_path / "bytes")), DirectoryStore)


@pytest.mark.parametrize("bad", [3, None, 2.5, ["dir"]])
def test_a_path_that_is_not_a_path_is_refused(bad):
    with pytest.raises(rc.ArgumentError, match="path"):
        DirectoryStore(bad)


# -- RedisStore options --------------------------------------------------------------------

REFUSED_OPTIONS = [
    dict(url=b"redis://localhost"), dict(url=None),
    dict(prefix=b"bytes:"), dict(prefix=None), dict(prefix=7), dict(prefix="lone\udcff surrogate:"),
    dict(timeout=0), dict(timeout=0.05), dict(timeout=-1), dict(timeout=float("inf")), dict(timeout=float("nan")),
    dict(timeout=1e7), dict(timeout="1"), dict(timeout=True), dict(timeout=None),
    dict(ttl=0), dict(ttl=0.0004), dict(ttl=-1), dict(ttl=float("inf")), dict(ttl=float("nan")), dict(ttl=1e10),
    dict(ttl=1e300), dict(ttl="1"), dict(ttl=True),
    dict(retry_after=-1), dict(retry_after=float("inf")), dict(retry_after=float("nan")), dict(retry_after=1e6),
    dict(retry_after="0"), dict(retry_after=False),
]


@pytest.mark.parametrize("option", REFUSED_OPTIONS, ids=repr)
def test_redis_options_it_cannot_use_are_refused_at_construction_naming_the_value(option):
    (name, value), = option.items()
    arguments = {"url": "redis://localhost", **option}
    with pytest.raises(rc.ArgumentError) as refused:
        rc.stores.RedisStore(arguments.pop("url"), **arguments)
    assert name in str(refused.value) and repr(value) in str(refused.value)


ACCEPTED_EDGES = [dict(timeout=0.1), dict(timeout=86400), dict(timeout=np.float64(2.5)), dict(retry_after=0),
                  dict(retry_after=86400), dict(ttl=None), dict(ttl=1e9), dict(ttl=np.int64(60)), dict(prefix=""),
                  dict(prefix="ünï cödé → 键:"), dict(prefix="p" * 10000)]


@pytest.mark.parametrize("option", ACCEPTED_EDGES, ids=repr)
def test_every_redis_option_value_accepted_works_against_a_server(redis_server, option):
    store = rc.stores.RedisStore(redis_server.url, **option)
    geometry, entries = small_entries(3)
    for key, _, entry in entries:
        assert store.put(key, entry) is True
    index, found = store.get_first([key for key, _, _ in entries[::-1]])
    assert (index, bytes(found)) == (0, bytes(entries[-1][2]))
    assert [bytes(v) for v in store.get_many([key for key, _, _ in entries])] == [e for _, _, e in entries]
    stats = store.stats()
    assert stats["up"] and stats["errors"] == 0 and stats["puts"] == 3
    name = (store.prefix + entries[0][0]).encode()
    assert redis_server.client().get(name) == entries[0][2]
    if option.get("ttl"):
        assert abs(redis_server.client().pttl(name) - 1000 * option["ttl"]) < 60_000


def test_the_shortest_ttl_accepted_expires_its_entry(redis_server):
    store = rc.stores.RedisStore(redis_server.url, ttl=0.001)
    key, entry, _ = numbered_entry(1, 4)
    assert store.put(key, entry) is True
    time.sleep(0.1)
    assert store.get_first([key]) is None and store.stats()["errors"] == 0


def test_redis_put_does_not_rewrite_an_entry_that_is_there(redis_server):
    store = rc.stores.RedisStore(redis_server.url)
    key, (first, second) = different_entries(2)
    assert store.put(key, first) is True
    assert store.put(key, second) is False          # SET NX: the entry there stays
    assert bytes(store.get_first([key])[1]) == first
    stats = store.stats()
    assert (stats["puts"], stats["put_skipped"], stats["bytes_written"]) == (1, 1, len(first))


def _worker(argv: list[str]) -> int:
    role, spec, key, entries_dir, rounds, start = argv
    assert role == "race"
    store = open_store(spec)
    candidates = [p.read_bytes() for p in sorted(Path(entries_dir).iterdir())]
    bad = hammer(store, key, candidates, int(rounds), int(start))
    print(json.dumps({"bad": bad, "puts": store.stats()["puts"]}))
    return 0


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1:]))
