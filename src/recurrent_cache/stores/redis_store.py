"""``RedisStore``: snapshot entries as values in Redis or Valkey, shared by every machine.

Each entry (a 'ggsq' file and its 32-byte trailer, snapshot.py) is one string
value under ``prefix + key``.  ``get_many`` is one ``MGET``; ``get_first`` is
one server-side script that finds the first key of the list that exists and
one ``GET`` of that key: a lookup of every candidate prefix length is two
round trips that carry one value (a miss: one round trip).  ``put`` is ``SET NX``: an
entry is written whole or not at all (a writer killed in the middle of
sending a value leaves nothing: the server drops an incomplete command), and
one already there is not rewritten, so a reader sees the first complete
entry of a key until it is evicted.

One server (or a primary with replicas), not Redis Cluster: the candidate
keys of one lookup hash to different slots, which a cluster does not run in
one script.

Eviction is the server's: run it with a memory limit and an LRU policy, e.g.
``redis-server --maxmemory 8gb --maxmemory-policy allkeys-lru`` (or set the
two in redis.conf / ``CONFIG SET``).  With the default ``noeviction`` a full
server refuses writes: ``put`` then counts an error and the serving loop goes
on.  ``ttl`` (seconds) gives every entry an expiry as well.

A server that does not answer (connection refused, reset, timed out) is never
an exception in the serving loop: the call answers misses (or skips the
write), the failure is counted in ``stats()["errors"]`` and logged once, and
for ``retry_after`` seconds the store answers misses without trying, so a
dead server costs no time-outs per token.  The next call after that tries
again; redis-py reconnects by itself.  A server that answers with an error
(out of memory under ``noeviction``, ...) fails that call only, counted and
logged once too.

Needs the ``redis`` client package: ``pip install 'recurrent_cache[redis]'``.
"""

from __future__ import annotations

import functools
import logging
import numbers
import re
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import ArgumentError
from .base import StoreCounters
from .snapshot import check_entry, entry_ggsq_length

__all__ = ["RedisStore"]

log = logging.getLogger("recurrent_cache.stores")

# KEYS: the candidates in the order to try; returns the 1-based index of the first that exists, or 0.
# It returns no value: a script that returns the value copies it through Lua, which made a 1 MiB hit
# 5x slower than this script followed by a GET (1.8 ms against 0.35 ms, unix socket, hiredis).
_FIRST_PRESENT = """
for i = 1, #KEYS do
    if redis.call('EXISTS', KEYS[i]) == 1 then return i end
end
return 0
"""


def _import_redis() -> Any:
    try:
        import redis
        import redis.backoff
        import redis.retry
    except ImportError:
        raise ImportError("RedisStore needs the redis client package: "
                          "pip install 'recurrent_cache[redis]' (or pip install redis)") from None
    return redis


# The ranges of the options, in seconds: every value inside works against a real server (a
# timeout under 0.1 s fails on a busy machine; a ttl is whole milliseconds, at least one, and
# Redis refuses an expiry past 2**63 ms from the epoch).
TIMEOUT_RANGE = (0.1, 86400.0)
RETRY_AFTER_RANGE = (0.0, 86400.0)
TTL_RANGE = (0.001, 1e9)


def _seconds(name: str, value: Any, bounds: tuple[float, float]) -> float:
    """``value`` as seconds within ``bounds``, or an ArgumentError naming it."""
    low, high = bounds
    if (isinstance(value, bool) or not isinstance(value, numbers.Real)
            or not low <= float(value) <= high):   # NaN fails the comparison too
        raise ArgumentError(f"RedisStore {name} must be a number of seconds in [{low:g}, {high:g}], "
                            f"got {value!r}")
    return float(value)


class RedisStore:
    """Snapshot entries in the Redis / Valkey server at ``url``.

    ``url``: ``redis://[:password@]host:port/db``, ``rediss://...`` (TLS) or
    ``unix:///path/to/redis.sock``.  ``prefix`` (a str) is put before every
    key, so one server can hold other data too.  ``timeout`` (seconds, 0.1 to
    86400) bounds a connection attempt and every command; a 64 MiB value
    moves in about 0.1 s over the loopback.  ``ttl`` (None, or seconds from
    0.001 to 1e9, rounded to milliseconds) gives every entry an expiry;
    ``retry_after`` (0 to 86400 seconds): see the module docstring.  Every
    option is checked here (``ArgumentError`` naming the value), so a store
    that was made works.  No connection is made until the first call.
    """

    def __init__(self, url: str, *, prefix: str = "recurrent_cache:", ttl: float | None = None,
                 timeout: float = 5.0, retry_after: float = 1.0) -> None:
        redis = _import_redis()
        Retry, NoBackoff = redis.retry.Retry, redis.backoff.NoBackoff
        if not isinstance(url, str):
            raise ArgumentError(f"RedisStore url must be a str, got {url!r}")
        if not isinstance(prefix, str):
            raise ArgumentError(f"RedisStore prefix must be a str, got {prefix!r}")
        try:
            prefix.encode("utf-8")   # how the client sends keys
        except UnicodeEncodeError:
            raise ArgumentError(f"RedisStore prefix must be encodable as UTF-8, got {prefix!r}") from None
        timeout = _seconds("timeout", timeout, TIMEOUT_RANGE)
        self.url = url
        self.prefix = prefix
        self.ttl = None if ttl is None else _seconds("ttl", ttl, TTL_RANGE)
        self._ttl_ms = None if self.ttl is None else max(1, round(self.ttl * 1000))
        self.retry_after = _seconds("retry_after", retry_after, RETRY_AFTER_RANGE)
        try:
            # one retry, at once: enough for a pooled connection the server has closed; a server that
            # is down is the store's business (retry_after), not a backoff inside the serving loop
            self._client = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout,
                                                retry=Retry(NoBackoff(), 1))
        except ValueError as exc:
            raise ArgumentError(f"RedisStore cannot use url {self._safe_url()}: {exc}") from None
        self._first_present = self._client.register_script(_FIRST_PRESENT)
        self._unreachable = (redis.ConnectionError, redis.TimeoutError, OSError)
        self._refused = redis.RedisError
        self._counters = StoreCounters()
        self._down_until = 0.0     # monotonic time before which the server is not tried
        self._failing = False      # the last attempt failed (and was logged)
        self._refusal_logged = False

    def __repr__(self) -> str:
        return f"RedisStore({self._safe_url()!r}, prefix={self.prefix!r})"

    def _safe_url(self) -> str:
        return re.sub(r"//[^@/]*@", "//***@", self.url)

    # -- the store interface ---------------------------------------------------------

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """The entry of every key, in one ``MGET`` (None: missing or damaged)."""
        self._counters.add(lookups=1)
        keys = list(keys)
        if not keys:
            return []
        values = self._call("MGET", lambda: self._client.mget([self.prefix + key for key in keys]))
        if values is None:
            self._counters.add(misses=len(keys))
            return [None] * len(keys)
        out: list[bytes | None] = []
        damaged = []
        for key, value in zip(keys, values):
            if value is None:
                self._counters.add(misses=1)
            elif not check_entry(key, value):
                damaged.append(key)
                value = None
            else:
                self._counters.add(hits=1, bytes_read=len(value))
            out.append(value)
        self._remove_damaged(damaged)
        return out

    def get_first(self, keys: Sequence[str]) -> tuple[int, bytes] | None:
        """``(i, entry)`` for the first key in ``keys`` that has an intact entry, or None.

        Pass the candidates longest prefix first.  Two round trips: a
        server-side script finds the first key present, then one GET fetches
        its value (a miss is one round trip).  A damaged entry, or one evicted
        between the two, is passed over and the keys after it tried.
        """
        self._counters.add(lookups=1)
        keys = list(keys)
        start = 0
        while start < len(keys):
            rest = keys[start:]
            names = [self.prefix + key for key in rest]
            found = self._call("EVALSHA", functools.partial(self._first_present, keys=names))
            if not found:
                # a failed call is a miss for every key; so is an answer of 0
                self._counters.add(misses=len(rest))
                return None
            index = int(found) - 1
            self._counters.add(misses=index)
            name = names[index]
            value = self._call("GET", functools.partial(self._client.get, name))
            if value is not None and check_entry(rest[index], value):
                self._counters.add(hits=1, bytes_read=len(value))
                return start + index, value
            if value is None:
                self._counters.add(misses=1)   # evicted meanwhile, or the server failed
            else:
                self._remove_damaged([rest[index]])
            start += index + 1
        return None

    def put(self, key: str, entry: Any) -> bool:
        """Store ``entry`` (from ``encode_snapshot`` under ``key``) unless the key has one already
        (``SET NX``: an entry there is not rewritten); False if it had, or the server failed."""
        if entry_ggsq_length(key, entry) is None:
            raise ArgumentError("put() takes an entry made by encode_snapshot for the same key "
                                "(its trailer does not name this key)")
        value = entry if isinstance(entry, bytes) else memoryview(entry).cast("B")
        written = self._call("SET", lambda: bool(self._client.set(self.prefix + key, value, px=self._ttl_ms,
                                                                   nx=True)))
        if written is None:
            return False
        if not written:
            self._counters.add(put_skipped=1)
            return False
        self._counters.add(puts=1, bytes_written=len(value))
        return True

    def stats(self) -> dict[str, Any]:
        """Counters of this process (``lookups`` calls; ``hits``, ``misses``, ``damaged`` keys;
        ``errors``, ``puts``, ``put_skipped``, ``bytes_read``, ``bytes_written``) and, when the server answers,
        its ``used_memory``, ``maxmemory``, ``maxmemory_policy`` and ``evicted_keys``."""
        out: dict[str, Any] = {**self._counters.snapshot(), "url": self._safe_url(), "up": False}
        info = self._call("INFO", lambda: {**self._client.info("memory"), **self._client.info("stats")})
        if info is not None:
            out.update(up=True, used_memory=info.get("used_memory"), maxmemory=info.get("maxmemory"),
                       maxmemory_policy=info.get("maxmemory_policy"), evicted_keys=info.get("evicted_keys"))
        return out

    def close(self) -> None:
        """Close the connections (the store reconnects if used again)."""
        self._client.close()

    # -- failures ---------------------------------------------------------------------

    def _call(self, what: str, command: Callable[[], Any]) -> Any:
        """Run ``command``; None (counted, logged once) if the server is down or refuses it."""
        if time.monotonic() < self._down_until:
            return None
        try:
            result = command()
        except self._unreachable as exc:
            self._counters.add(errors=1)
            self._down_until = time.monotonic() + self.retry_after
            if not self._failing:
                log.warning("RedisStore %s: %s failed: %s; lookups are misses and writes are skipped "
                            "until it answers (retried every %gs, logged once)",
                            self._safe_url(), what, exc, self.retry_after)
            self._failing = True
            return None
        except self._refused as exc:      # it answered with an error (out of memory, ...): not down
            self._counters.add(errors=1)
            if not self._refusal_logged:
                log.warning("RedisStore %s: %s refused: %s (counted in stats()['errors'], logged once)",
                            self._safe_url(), what, exc)
            self._refusal_logged = True
            return None
        if self._failing:
            log.warning("RedisStore %s answers again", self._safe_url())
            self._failing = False
        return result

    def _remove_damaged(self, keys: list[str]) -> None:
        if keys:
            self._counters.add(damaged=len(keys), misses=len(keys))
            log.info("RedisStore %s: removing %d damaged entries", self._safe_url(), len(keys))
            self._call("DEL", lambda: self._client.delete(*[self.prefix + key for key in keys]))
