"""``StoreTier``: a store as the second tier of a ``PrefixCache`` (docs/prefix-cache.md).

``rc.PrefixCache(cache, max_bytes, store=store, namespace=...)`` wraps
``store`` (a ``DirectoryStore``, a ``RedisStore``, or any object with the
store interface) in a ``StoreTier``, which speaks the prefix cache's
``SnapshotTier`` protocol in the stores' terms: keys from the namespace, the
cache's geometry and dtypes and the token prefix (``snapshot_key``), entries
in the llama.cpp sequence-file format (``encode_snapshot`` /
``decode_snapshot``).

Nothing a store does raises into the serving loop: a store that fails, or an
object that raises where a store would answer, is a miss or a skipped write,
counted in ``errors`` and logged once on the ``recurrent_cache.stores``
logger; a damaged or foreign entry is a miss counted in ``damaged``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..errors import ArgumentError
from .base import StoreCounters
from .directory import DirectoryStore
from .redis_store import RedisStore
from .snapshot import (Geometry, decode_hybrid_snapshot, decode_snapshot, encode_hybrid_snapshot, encode_snapshot,
                       prefix_keys, snapshot_key)

__all__ = ["HybridStoreTier", "StoreTier"]

log = logging.getLogger("recurrent_cache.stores")

_STORE_METHODS = ("get_first", "put", "stats")


class _Tier:
    """What every tier over a store shares: the store's interface checked, a store that raises or
    answers nonsense counted (``errors``, logged once) and never raised into the caller."""

    def __init__(self, store: Any, namespace: str) -> None:
        missing = [name for name in _STORE_METHODS if not callable(getattr(store, name, None))]
        if missing:
            raise ArgumentError(f"store must have the store interface ({', '.join(_STORE_METHODS)}); "
                                f"{store!r} lacks {', '.join(missing)}")
        self.store = store
        self.namespace = namespace
        # DirectoryStore and RedisStore check an entry's CRC-32 before handing it out; for any
        # other store the decode checks it (about 18 ms per 64 MiB)
        self._verify_crc = not isinstance(store, (DirectoryStore, RedisStore))
        self._counters = StoreCounters()   # damaged (rejected here) and errors (raised by the store)
        self._error_logged = False

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.store!r}, namespace={self.namespace!r})"

    def _put(self, key: str, entry: bytearray) -> bool:
        try:
            return bool(self.store.put(key, entry))
        except Exception as exc:   # a store never raises into the serving loop
            self._failed("put", exc)
            return False

    def _get_first(self, keys: list[str]) -> tuple[int, Any] | None:
        try:
            found = self.store.get_first(keys)
            if found is None:
                return None
            index, entry = found
            return int(index), entry
        except Exception as exc:   # a store that raises, or answers something that is not (i, entry)
            self._failed("get_first", exc)
            return None

    def damaged(self, n: int) -> None:
        """Count an entry for a prefix of ``n`` tokens that was rejected (a miss)."""
        self._counters.add(damaged=1)
        log.info("%r: a damaged or foreign entry for a prefix of %d tokens (a miss)", self, n)

    def stats(self) -> dict[str, int]:
        """``damaged`` and ``errors``: this tier's (entries it rejected, calls that raised) plus the
        store's own counters (the store object's, shared by every user of it in this process)."""
        try:
            theirs = self.store.stats()
        except Exception as exc:
            self._failed("stats", exc)
            theirs = {}
        if not isinstance(theirs, Mapping):   # a store that keeps no counters (None): its counts are unknown
            theirs = {}
        mine = self._counters.snapshot()   # after the call: a failing stats() is one of the errors reported
        return {name: mine[name] + _count(theirs.get(name)) for name in ("damaged", "errors")}

    def _failed(self, what: str, exc: Exception) -> None:
        self._counters.add(errors=1)
        if not self._error_logged:
            log.warning("%r: %s raised %s: %s; treated as a miss / skipped write (counted in "
                        "stats()['store_errors'], logged once)", self, what, type(exc).__name__, exc)
            self._error_logged = True


class StoreTier(_Tier):
    """The ``SnapshotTier`` of a ``PrefixCache`` over ``store``, for states of ``geometry`` in ``namespace``."""

    def __init__(self, store: Any, namespace: str, geometry: Geometry) -> None:
        super().__init__(store, namespace)
        self.geometry = geometry
        self._row_dtypes = (geometry.type_r.numpy, geometry.type_s.numpy)

    def put(self, tokens: np.ndarray, r_rows: Sequence[np.ndarray], s_rows: Sequence[np.ndarray]) -> bool:
        """Write the state after ``tokens``; True when the store confirms a new write.

        False when the store had the entry already, skipped the write or
        failed: the prefix cache then offers the snapshot again when it
        evicts it.
        """
        key = snapshot_key(self.namespace, self.geometry, tokens)
        dtype_r, dtype_s = self._row_dtypes
        # the rows by their bytes: the codec's dtype for bf16 may differ in name, never in bytes
        entry = encode_snapshot(key, tokens, [row.view(dtype_r) for row in r_rows],
                                [row.view(dtype_s) for row in s_rows], self.geometry)
        return self._put(key, entry)

    def fetch(self, tokens: np.ndarray, lengths: Sequence[int]) -> tuple[int, list[np.ndarray],
                                                                         list[np.ndarray]] | None:
        """The longest of ``lengths`` (longest first) whose state the store holds intact:
        ``(n, r_rows, s_rows)``, the rows as raw views of the entry; None for a miss.

        One ``get_first`` call: one lookup round trip for every candidate.
        The keys of all the candidates hash ``tokens`` once (``prefix_keys``).
        """
        keys = prefix_keys(self.namespace, self.geometry, tokens, lengths)
        found = self._get_first(keys)
        if found is None:
            return None
        index, entry = found
        try:
            n = lengths[index]
            rows = decode_snapshot(entry, keys[index], self.geometry, tokens[:n], verify_crc=self._verify_crc)
        except Exception as exc:   # an index outside the candidates: the store answered nonsense
            self._failed("get_first", exc)
            return None
        if rows is None:
            self.damaged(n)
            return None
        return n, rows[0], rows[1]


class HybridStoreTier(_Tier):
    """A ``HybridPrefixCache``'s second tier over ``store``: each entry one sequence's hybrid state
    (its KV rows and its recurrent state) after exactly its tokens, as the ggsq file
    ``llama_state_seq_save_file`` writes (``encode_hybrid_snapshot``); keys from ``namespace``, the
    recurrent half's ``geometry`` and the attention half's layout (``attention``: ``hybrid_key_text``)."""

    def __init__(self, store: Any, namespace: str, geometry: Geometry, attention: str) -> None:
        super().__init__(store, namespace)
        self.geometry = geometry
        self.attention = attention

    def put(self, tokens: np.ndarray, state: Any) -> bool:
        """Write ``state`` (``HybridCache.state_write(seq)``) as the state after ``tokens``; True when
        the store confirms a new write."""
        key = prefix_keys(self.namespace, self.geometry, tokens, [len(tokens)], self.attention)[0]
        return self._put(key, encode_hybrid_snapshot(key, tokens, state))

    def fetch(self, tokens: np.ndarray, lengths: Sequence[int]) -> tuple[int, memoryview] | None:
        """The longest of ``lengths`` (longest first) whose entry the store holds intact: ``(n, state)``
        with the state a view of the entry, for ``HybridCache.state_read``; None for a miss."""
        keys = prefix_keys(self.namespace, self.geometry, tokens, lengths, self.attention)
        found = self._get_first(keys)
        if found is None:
            return None
        index, entry = found
        try:
            n = lengths[index]
            state = decode_hybrid_snapshot(entry, keys[index], tokens[:n], verify_crc=self._verify_crc)
        except Exception as exc:   # an index outside the candidates: the store answered nonsense
            self._failed("get_first", exc)
            return None
        if state is None:
            self.damaged(n)
            return None
        return n, state


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0
