"""DirectoryStore: plain 'ggsq' files, the size cap, dead writers, failures that are not exceptions."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import recurrent_cache as rc
from recurrent_cache.stores import DirectoryStore, decode_snapshot, encode_snapshot
from recurrent_cache.stores.snapshot import key_digest
from test_stores_shared import HERE, numbered_entry, small_entries


def link_of(store: DirectoryStore, key: str) -> Path:
    return Path(store.path) / f"{key_digest(key).hex()}.ggsq"


def test_files_are_sequence_files_that_inspect_reads(tmp_path):
    store = DirectoryStore(tmp_path / "s")
    _, entries = small_entries(3)
    key, tokens, entry = entries[2]
    store.put(key, entry)
    link = link_of(store, key)
    assert link.is_symlink() and link.read_bytes() == entry[:-32]
    assert sorted(p.name for p in Path(store.path).iterdir()) == \
        sorted([link.name, os.readlink(link)])   # nothing else: no temporary file left behind
    done = subprocess.run([sys.executable, "-m", "recurrent_cache", "inspect", str(link)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert f"tokens: 3 [{', '.join(map(str, tokens))}]" in done.stdout and "single-sequence" in done.stdout


def test_writing_an_entry_that_is_there_already_only_marks_it_used(tmp_path):
    store = DirectoryStore(tmp_path)
    key, entry, _ = numbered_entry(1, 4)
    assert store.put(key, entry) is True
    assert store.put(key, entry) is False
    stats = store.stats()
    assert (stats["puts"], stats["put_skipped"], stats["entries"], stats["bytes"]) == (1, 1, 1, len(entry) - 32)


def test_size_cap_removes_the_least_recently_used(tmp_path):
    entries = [numbered_entry(i, 64) for i in range(5)]
    size = len(entries[0][1]) - 32
    store = DirectoryStore(tmp_path, max_bytes=3 * size + size // 2)
    for key, entry, _ in entries[:3]:
        store.put(key, entry)
        time.sleep(0.05)          # file times are coarse (a few ms) on some kernels
    assert store.get_first([entries[0][0]]) is not None   # 0 is now the most recently used
    time.sleep(0.05)
    store.put(*entries[3][:2])    # over the cap: 1 goes, the least recently used
    present = [store.get_first([key]) is not None for key, _, _ in entries]
    assert present == [True, False, True, True, False]
    stats = store.stats()
    assert stats["evictions"] == 1 and stats["entries"] == 3 and stats["bytes"] == 3 * size
    assert not link_of(store, entries[1][0]).exists() and not os.path.lexists(link_of(store, entries[1][0]))


def test_an_entry_larger_than_the_cap_is_not_kept(tmp_path):
    key, entry, _ = numbered_entry(0, 64)
    store = DirectoryStore(tmp_path, max_bytes=100)
    store.put(key, entry)
    assert store.get_first([key]) is None and store.stats()["bytes"] == 0


@pytest.mark.parametrize("damage", ["regular file", "other key's file", "bad name", "missing file"])
def test_broken_links_are_misses(tmp_path, damage):
    store = DirectoryStore(tmp_path)
    (key, entry, _), (other, other_entry, _) = numbered_entry(1, 4), numbered_entry(2, 4)
    store.put(key, entry)
    store.put(other, other_entry)
    link = link_of(store, key)
    target = os.readlink(link)
    link.unlink()
    if damage == "regular file":
        link.write_bytes(entry[:-32])
    elif damage == "other key's file":
        os.symlink(os.readlink(link_of(store, other)), link)
    elif damage == "bad name":
        os.symlink(target.replace(".ggsq", ".x.ggsq"), link)
    else:
        os.symlink(target, link)
        (tmp_path / target).unlink()
    assert store.get_many([key]) == [None]
    assert store.stats()["damaged"] == (0 if damage == "missing file" else 1)
    assert store.get_first([other]) is not None   # the other key's entry is untouched


def test_a_new_entry_under_a_key_replaces_the_old_file(tmp_path):
    """Other content under one key (another machine's rounding, say): the old file goes once no
    link has pointed to it for STALE_SECONDS (a racing writer of it may still link to it before)."""
    store = DirectoryStore(tmp_path)
    geometry, entries = small_entries(1)
    key, tokens, first = entries[0]
    rows = ([np.ones(3, np.float32)] * 2, [np.ones(5, np.float16)] * 2)
    second = encode_snapshot(key, tokens, *rows, geometry)
    assert store.put(key, first)
    old_file = tmp_path / os.readlink(link_of(store, key))
    assert store.put(key, second)
    assert bytes(store.get_first([key])[1]) == second
    assert len(list(tmp_path.iterdir())) == 3 and old_file.exists()   # young: a writer may link to it
    os.utime(old_file, (time.time() - 3600, time.time() - 3600))
    store.stats()                                 # a scan
    assert len(list(tmp_path.iterdir())) == 2 and not old_file.exists()   # the link and the second file


def test_stale_temporary_files_and_dangling_links_are_swept(tmp_path):
    store = DirectoryStore(tmp_path)
    key, entry, _ = numbered_entry(1, 4)
    store.put(key, entry)
    (tmp_path / os.readlink(link_of(store, key))).unlink()
    digest = key_digest(key).hex()
    stale, fresh = tmp_path / f".{digest}.{'12' * 8}.tmp", tmp_path / f".{digest}.{'56' * 8}.tmp"
    stale.write_bytes(b"x" * 100)
    fresh.write_bytes(b"y" * 10)
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    orphan, young_orphan = tmp_path / f"{'ab' * 16}.0badf00d.ggsq", tmp_path / f"{'cd' * 16}.0badf00d.ggsq"
    orphan.write_bytes(b"z" * 1000)               # no link points to these: a racing writer's
    young_orphan.write_bytes(b"w" * 1)
    os.utime(orphan, (time.time() - 3600, time.time() - 3600))
    assert store.stats()["bytes"] == 11   # a fresh one may be a live writer's: counted, kept
    assert not stale.exists() and fresh.exists() and not os.path.lexists(link_of(store, key))
    assert not orphan.exists() and young_orphan.exists()


def test_io_failures_are_counted_and_logged_once_not_raised(tmp_path, caplog):
    store = DirectoryStore(tmp_path / "gone")
    key, entry, _ = numbered_entry(1, 4)
    store.put(key, entry)
    shutil.rmtree(tmp_path / "gone")
    with caplog.at_level(logging.DEBUG, logger="recurrent_cache.stores"):
        for _ in range(3):
            assert store.put(*numbered_entry(2, 4)[:2]) is False
            assert store.get_first([key]) is None
    assert store.stats()["errors"] >= 3
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 1


def test_bad_arguments(tmp_path):
    (tmp_path / "file").write_bytes(b"")
    for bad in (0, -5, 1.5, True):
        with pytest.raises(rc.ArgumentError, match="max_bytes"):
            DirectoryStore(tmp_path, max_bytes=bad)
    with pytest.raises(rc.ArgumentError):
        DirectoryStore(tmp_path / "file")


def test_a_writer_killed_mid_write_leaves_nothing_a_reader_accepts(tmp_path):
    """SIGKILL a process that writes 8 MiB entries while a temporary file of it exists."""
    for attempt in range(5):
        store_dir = tmp_path / f"store{attempt}"
        store_dir.mkdir()
        writer = subprocess.Popen([sys.executable, str(HERE), "write-forever", str(store_dir)],
                                  stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        caught = None
        while caught is None and time.monotonic() < deadline and writer.poll() is None:
            names = os.listdir(store_dir)
            temporaries = [name for name in names if name.endswith(".tmp")]
            if temporaries and any(name.endswith(".ggsq") for name in names):   # one entry done, one half
                os.kill(writer.pid, signal.SIGKILL)
                caught = temporaries[0]
        writer.wait()
        if caught is not None and (store_dir / caught).exists():   # still there: killed before the rename
            break
    else:
        pytest.fail("could not kill the writer while it was writing")
    store = DirectoryStore(store_dir)
    n = 0
    while True:   # every entry the writer finished is exact; the one it was writing is a miss
        key, entry, geometry = numbered_entry(n, 1 << 20)
        found = store.get_first([key])
        if found is None:
            break
        assert bytes(found[1]) == entry and decode_snapshot(found[1], key, geometry, [n]) is not None
        n += 1
    assert n >= 1                                             # at least one finished entry checked
    assert caught.startswith(f".{key_digest(key).hex()}.")   # the key being written when killed
    assert store.get_first([numbered_entry(n + 1, 1 << 20)[0]]) is None
    assert store.stats()["damaged"] == 0


def test_processes_churning_a_small_capped_directory_read_only_exact_entries(tmp_path):
    width = 1 << 12
    size = len(numbered_entry(0, width)[1]) - 32
    processes = [subprocess.Popen([sys.executable, str(HERE), "churn", str(tmp_path), str(100 * p), "40",
                                   str(6 * size)], stdout=subprocess.PIPE, text=True) for p in range(3)]
    results = [json.loads(p.communicate(timeout=300)[0]) for p in processes]
    assert all(p.returncode == 0 for p in processes)
    assert [r["bad"] for r in results] == [0, 0, 0]
    assert sum(r["stats"]["evictions"] for r in results) > 0
    assert sum(r["stats"]["damaged"] for r in results) == 0
    final = DirectoryStore(tmp_path, max_bytes=6 * size).stats()
    # each process scans after an eighth of the cap: the directory ends at most one entry each over
    assert final["bytes"] <= 6 * size + 3 * size
    assert np.all([p.name.endswith(".ggsq") for p in tmp_path.iterdir()])


def test_open_store_picks_the_store_a_target_names(tmp_path):
    from recurrent_cache.stores import RedisStore, open_store
    assert isinstance(open_store(str(tmp_path)), DirectoryStore)
    assert isinstance(open_store(tmp_path / "sub", max_bytes=10), DirectoryStore)
    for url in ("redis://localhost:6379/0", "rediss://localhost", "unix:///tmp/r.sock", "valkey://localhost"):
        store = open_store(url)
        assert isinstance(store, RedisStore) and store.url.startswith(("redis", "unix"))
