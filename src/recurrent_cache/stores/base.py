"""What every store offers the prefix cache, and the counters they share."""

from __future__ import annotations

import threading
from typing import Any, Protocol, runtime_checkable
from collections.abc import Sequence

__all__ = ["Store", "StoreCounters"]


@runtime_checkable
class Store(Protocol):
    """The interface ``PrefixCache`` calls; see the package docstring for the contract."""

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]: ...

    def get_first(self, keys: Sequence[str]) -> tuple[int, bytes] | None: ...

    def put(self, key: str, entry: bytes) -> bool: ...

    def stats(self) -> dict[str, Any]: ...


class StoreCounters:
    """Counters behind ``stats()``; a lock keeps them exact when threads share a store."""

    FIELDS = ("lookups", "hits", "misses", "damaged", "errors", "puts", "put_skipped", "bytes_read",
              "bytes_written")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values = dict.fromkeys(self.FIELDS, 0)

    def add(self, **amounts: int) -> None:
        with self._lock:
            for name, amount in amounts.items():
                self._values[name] += amount

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)
