"""Shared state stores: the second tier of the prefix-state cache (docs/prefix-cache.md).

A store keeps *snapshots* — one sequence's state after a token prefix — where
every process can reach them: ``DirectoryStore(path)`` on a file system (one
llama.cpp 'ggsq' sequence file per snapshot), ``RedisStore(url)`` in Redis or
Valkey (``pip install 'recurrent_cache[redis]'``).  A process that restarts,
or another replica, restores a prefix instead of recomputing it.

Entries and keys (``snapshot.py``)::

    geometry = Geometry.of(cache)                       # layers, row widths, dtypes
    key = snapshot_key(namespace, geometry, tokens)      # "rc2:" + sha256
    keys = prefix_keys(namespace, geometry, tokens, lengths)   # the keys of prefixes: one hash in all
    entry = encode_snapshot(key, tokens, r_rows, s_rows, geometry)   # ggsq file + 32-byte trailer
    rows = decode_snapshot(entry, key, geometry, tokens)            # (r_rows, s_rows) or None

``namespace`` is the model's identity and must be set by the caller (a hash
of the GGUF file, a model name and revision): the key holds it, the geometry
(``n_layer``, ``n_embd_r``, ``n_embd_s``, ``dtype_r``, ``dtype_s``, a layer filter) and the
tokens, and the entry's trailer holds a digest of the key and a CRC-32 of
the bytes, so ``decode_snapshot`` returns None — never a wrong state, never
an exception — for a truncated, damaged or foreign entry.

The interface the prefix cache calls (every store implements it):

``store.get_first(keys) -> (i, entry) | None``
    The first key of ``keys`` with an intact entry. Pass the candidate
    prefixes longest first: only that entry is transferred (Redis: a script
    finds the first key present, a GET fetches it — two round trips, one on
    a miss).
``store.get_many(keys) -> list[entry | None]``
    Every key's entry, in one round trip (Redis ``MGET``).
``store.put(key, entry) -> bool``
    Store an entry made by ``encode_snapshot`` under the same key, whole or
    not at all.  True: the key reads back a complete entry until it is
    evicted, whatever other writers of the key do.  False when it was there
    already (a directory: this very entry; Redis: any entry of the key) or
    the store failed.
``store.stats() -> dict``
    ``lookups`` (calls), ``hits`` / ``misses`` / ``damaged`` (keys), ``errors``,
    ``puts``, ``put_skipped``, ``bytes_read``, ``bytes_written``, and what the
    store knows of its size (``bytes`` and ``entries`` of a directory,
    ``used_memory`` and the eviction policy of a server).

Entries are bytes-like (``bytes``, or ``bytearray`` from a directory). A store
checks each entry's trailer and CRC-32 before it hands it out, counts and
removes a damaged one, and never raises into the serving loop for I/O or
connection failures: they are misses (or skipped writes), counted in
``errors`` and logged once on the ``recurrent_cache.stores`` logger.

``sequence_rows(cache, seq)`` and ``restore_rows(cache, seq, n_tokens, r, s)``
move a state between a cache's rows and a snapshot; ``open_store(target)``
makes the store a command line names (``--store DIR_OR_URL``).

``rc.PrefixCache(cache, max_bytes, store=store, namespace=...)`` puts a store
behind the in-memory snapshots (``StoreTier``, ``tier.py``): every new save
is written through, a memory miss looks in the store, a hit is promoted.
"""

import os
from typing import Any, Union

from .base import Store
from .directory import DirectoryStore
from .redis_store import RedisStore
from .snapshot import (Geometry, check_entry, decode_hybrid_snapshot, decode_snapshot, encode_hybrid_snapshot,
                       encode_snapshot, hybrid_key_text, prefix_keys, restore_rows, sequence_rows, snapshot_key)
from .tier import HybridStoreTier, StoreTier

_URL_SCHEMES = ("redis://", "rediss://", "unix://", "valkey://", "valkeys://")


def open_store(target: Union[str, "os.PathLike[str]"], **options: Any) -> Union[DirectoryStore, RedisStore]:
    """``RedisStore(target)`` for a ``redis://``, ``rediss://`` or ``unix://`` URL, else
    ``DirectoryStore(target)``; ``options`` go to the constructor."""
    if isinstance(target, str) and target.startswith(_URL_SCHEMES):
        if target.startswith("valkey"):
            target = "redis" + target[len("valkey"):]
        return RedisStore(target, **options)
    return DirectoryStore(target, **options)


__all__ = ["Store", "DirectoryStore", "RedisStore", "open_store", "Geometry", "snapshot_key", "prefix_keys",
           "encode_snapshot", "decode_snapshot", "check_entry", "sequence_rows", "restore_rows", "StoreTier",
           "HybridStoreTier", "hybrid_key_text", "encode_hybrid_snapshot", "decode_hybrid_snapshot"]
