"""The stores' shared fixture: ``kind``, a DirectoryStore or a RedisStore on a real server (tests/conftest.py's
``redis_server``), with a way behind each store to damage its entries."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from recurrent_cache.stores import open_store


class StoreKind:
    """Makes stores of one kind and reaches behind them to damage entries."""

    def __init__(self, kind: str, tmp_path: Path, request) -> None:
        self.kind = kind
        if kind == "directory":
            self.spec = str(tmp_path / "store")
        else:
            self.server = request.getfixturevalue("redis_server")
            self.spec = self.server.url

    def open(self):
        return open_store(self.spec)

    def raw_set(self, store, key: str, value: bytes) -> None:
        """Put ``value`` where ``key``'s entry lives, bypassing every check."""
        if self.kind == "directory":
            link = Path(store.path) / (hashlib.sha256(key.encode()).digest()[:16].hex() + ".ggsq")
            target = link.parent / os.readlink(link)
            target.write_bytes(value[:-32])   # a directory file has no trailer: the name holds it
        else:
            self.server.client().set(store.prefix + key, value)

    def raw_get(self, store, key: str) -> bytes | None:
        if self.kind == "directory":
            link = Path(store.path) / (hashlib.sha256(key.encode()).digest()[:16].hex() + ".ggsq")
            return (link.parent / os.readlink(link)).read_bytes() if os.path.lexists(link) else None
        return self.server.client().get(store.prefix + key)


@pytest.fixture(params=["directory", "redis"])
def kind(request, tmp_path):
    """Each store kind in turn (a test parametrizes it indirectly to pick one)."""
    return StoreKind(request.param, tmp_path, request)
