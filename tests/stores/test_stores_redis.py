"""RedisStore against a real redis-server: a server that stops, fills up or is never there is a
miss and never an exception; a client killed mid-write leaves nothing."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import time

import pytest

import recurrent_cache as rc
from recurrent_cache.stores import RedisStore, decode_snapshot
from redis_servers import RedisServer
from test_stores_shared import numbered_entry, small_entries


def test_server_stopped_mid_run_is_misses_then_recovers(tmp_path, caplog):
    server = RedisServer(tmp_path).start()
    store = RedisStore(server.url, retry_after=0.2)
    outcomes = []
    with caplog.at_level(logging.INFO, logger="recurrent_cache.stores"):
        try:
            for step in range(30):
                if step == 10:
                    server.stop()
                if step == 20:
                    server.start()          # an empty server on the same socket
                    time.sleep(0.25)        # past retry_after
                key, entry, geometry = numbered_entry(step, 16)
                started = time.monotonic()
                written = store.put(key, entry)
                found = store.get_first([key])
                outcomes.append((written, found is not None and bytes(found[1]) == entry))
                assert time.monotonic() - started < 1.0   # a dead server costs no time-outs
        finally:
            server.stop()
    assert outcomes == [(True, True)] * 10 + [(False, False)] * 10 + [(True, True)] * 10
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 2 and "failed" in warnings[0] and "answers again" in warnings[1]
    stats = store.stats()
    assert stats["errors"] >= 1 and stats["hits"] == 20 and stats["damaged"] == 0 and not stats["up"]


def test_a_server_that_never_answers(tmp_path):
    store = RedisStore(f"unix://{tmp_path}/no.sock", retry_after=60)
    key, entry, _ = numbered_entry(1, 4)
    for _ in range(5):
        assert store.put(key, entry) is False
        assert store.get_many([key, key]) == [None, None]
        assert store.get_first([key]) is None
    stats = store.stats()
    assert stats["errors"] == 1 and not stats["up"]   # tried once, then not again within retry_after
    assert stats["misses"] == 15


def test_a_client_killed_mid_set_leaves_no_entry(redis_server):
    """A process sends half of a SET of a 4 MiB entry, then is SIGKILLed."""
    store = RedisStore(redis_server.url)
    key, entry, geometry = numbered_entry(7, 1 << 19)
    name = (store.prefix + key).encode()
    command = b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(name), name, len(entry))
    child = subprocess.Popen([sys.executable, "-c", f"""
import socket, sys, time
s = socket.socket(socket.AF_UNIX)
s.connect({redis_server.socket!r})
data = sys.stdin.buffer.read()
s.sendall(data[:len(data) // 2])
print("sent", flush=True)
time.sleep(600)
"""], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    child.stdin.write(command + entry + b"\r\n")
    child.stdin.close()
    assert child.stdout.readline() == b"sent\n"
    child.send_signal(signal.SIGKILL)
    child.wait()
    time.sleep(0.1)
    assert store.get_many([key]) == [None]
    assert store.stats()["damaged"] == 0
    assert store.put(key, entry) and bytes(store.get_first([key])[1]) == entry
    assert decode_snapshot(store.get_first([key])[1], key, geometry, [7]) is not None


def test_allkeys_lru_server_evicts_and_the_store_goes_on(tmp_path):
    server = RedisServer(tmp_path, "--maxmemory", "2mb", "--maxmemory-policy", "allkeys-lru").start()
    try:
        store = RedisStore(server.url)
        entries = [numbered_entry(i, 1 << 13) for i in range(60)]   # 64 KiB each, 3.8 MiB in all
        assert all(store.put(key, entry) for key, entry, _ in entries)
        present = [v is not None for v in store.get_many([key for key, _, _ in entries])]
        # Redis's LRU is approximate (it evicts the oldest of a few sampled keys): the oldest entries go
        # rather than the newest, not necessarily the very first one
        assert present[-1] and 10 < sum(present) < 40 and sum(present[:20]) < sum(present[-20:])
        stats = store.stats()
        assert stats["maxmemory_policy"] == "allkeys-lru" and stats["evicted_keys"] > 0
        assert stats["errors"] == 0 and stats["damaged"] == 0
    finally:
        server.stop()


def test_a_full_noeviction_server_refuses_writes_without_an_exception(tmp_path):
    server = RedisServer(tmp_path, "--maxmemory", "3mb", "--maxmemory-policy", "noeviction").start()
    try:
        store = RedisStore(server.url)
        results = [store.put(*numbered_entry(i, 1 << 13)[:2]) for i in range(60)]
        assert results[0] and not results[-1]
        assert store.stats()["errors"] == results.count(False)
        assert store.get_first([numbered_entry(0, 1 << 13)[0]]) is not None   # reads still work
    finally:
        server.stop()


def test_get_first_skips_a_damaged_candidate(redis_server):
    store = RedisStore(redis_server.url)
    geometry, entries = small_entries(3)
    for key, _, entry in entries:
        store.put(key, entry)
    longest = entries[2]
    redis_server.client().set(store.prefix + longest[0], longest[2][:-5])
    index, entry = store.get_first([e[0] for e in entries[::-1]])
    assert index == 1 and bytes(entry) == entries[1][2]
    stats = store.stats()
    assert (stats["hits"], stats["damaged"]) == (1, 1)
    assert redis_server.client().get(store.prefix + longest[0]) is None


def test_ttl_and_prefix(redis_server):
    store = RedisStore(redis_server.url, ttl=0.3, prefix="other:")
    key, entry, _ = numbered_entry(1, 4)
    store.put(key, entry)
    assert redis_server.client().get("other:" + key) == entry
    assert RedisStore(redis_server.url).get_first([key]) is None   # another prefix: another store
    time.sleep(0.4)
    assert store.get_first([key]) is None


def test_bad_arguments():
    for kwargs in (dict(timeout=0), dict(timeout=None), dict(retry_after=-1), dict(ttl=0), dict(ttl="1")):
        with pytest.raises(rc.ArgumentError, match=next(iter(kwargs))):
            RedisStore("redis://localhost", **kwargs)
    with pytest.raises(rc.ArgumentError, match="url"):
        RedisStore("http://example")
    with pytest.raises(rc.ArgumentError, match="url"):
        RedisStore(b"redis://localhost")
    assert "secret" not in repr(RedisStore("redis://:secret@localhost:1/0"))
