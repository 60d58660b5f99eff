"""Storage doubles for the attacks on every cache: a storage that fails at its N-th call (the index path
a GPU takes), and one whose tensors lie in one host arena with free bytes around each (targets that
overlap exactly one byte of a tensor)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest

from recurrent_cache.errors import BrokenCacheError
from recurrent_cache.storage import NumpyStorage


class DeviceOutOfMemory(RuntimeError):
    """What the failing storage raises (a device's out-of-memory error)."""


class FailingStorage:
    """Numpy's storage without host access (the index path a GPU takes) that raises at the N-th
    storage call after ``arm(N)``; ``calls`` counts every call."""

    name = "failing"
    device = "cpu"

    def __init__(self) -> None:
        self.inner = NumpyStorage()
        self.calls = 0
        self.fail_at: int | None = None
        self.kinds: set[str] = set()   # the methods called since arm()

    def arm(self, n: int | None) -> None:
        self.calls = 0
        self.fail_at = n
        self.kinds = set()

    def _call(self, method: str) -> None:
        self.calls += 1
        self.kinds.add(method)
        if self.calls == self.fail_at:
            raise DeviceOutOfMemory(f"storage call {self.calls} failed")

    def allocate(self, shape, dtype):
        self._call("allocate")
        return self.inner.allocate(shape, dtype)

    def host_view(self, tensor):
        return None

    def take(self, tensor, rows):
        self._call("take")
        return self.inner.take(tensor, rows)

    def put(self, tensor, rows, values):
        self._call("put")
        self.inner.put(tensor, rows, values)

    def zero(self, tensor, rows):
        self._call("zero")
        self.inner.zero(tensor, rows)

    def stack(self, rows, dtype):
        self._call("stack")
        return self.inner.stack(rows, dtype)

    def to_host(self, tensor):
        self._call("to_host")
        return self.inner.to_host(tensor)

    def from_host(self, array, dtype):
        self._call("from_host")
        return self.inner.from_host(array, dtype)


GAP = 1 << 14   # free bytes around every tensor of an arena: room for a whole blob on either side


class ArenaStorage:
    """A storage (numpy or torch on the CPU, with or without host access) whose tensors are carved out
    of one host arena with GAP free bytes around each, so a test can make a target that overlaps
    exactly one byte of a tensor and lies in free arena bytes otherwise."""

    def __init__(self, kind: str, host_access: bool) -> None:
        if kind == "torch":
            torch = pytest.importorskip("torch", reason="the torch arena needs torch")
            from recurrent_cache.storage import TorchStorage
            self.inner: Any = TorchStorage("cpu", host_access=host_access)
            self.torch_arena = torch.zeros(1 << 20, dtype=torch.uint8)
            self.arena = self.torch_arena.numpy()   # the same memory
        else:
            self.inner = NumpyStorage()
            self.arena = np.zeros(1 << 20, dtype=np.uint8)
        self.kind, self.host_access = kind, host_access
        self.name, self.device = self.inner.name, "cpu"
        self.extents: list[tuple[int, int]] = []   # [begin, end) of each tensor, as arena offsets
        self.next_free = GAP

    def allocate(self, shape, dtype):
        nbytes = int(np.prod(shape)) * dtype.itemsize
        begin = self.next_free
        self.next_free = begin + (nbytes + 63) // 64 * 64 + GAP
        assert self.next_free <= self.arena.size
        self.extents.append((begin, begin + nbytes))
        if self.kind == "torch":
            raw = self.torch_arena[begin:begin + nbytes]
            return raw.view(self.inner.torch_dtype(dtype)).reshape(shape)
        return self.arena[begin:begin + nbytes].view(dtype.numpy).reshape(shape)

    def host_view(self, tensor):
        return self.inner.host_view(tensor) if self.host_access else None

    def __getattr__(self, method: str) -> Any:   # take, put, zero, stack, to_host, from_host
        return getattr(self.inner, method)


def chain(error: BaseException | None) -> list[BaseException]:
    """``error`` and the exceptions it was raised from or during, in turn."""
    found: list[BaseException] = []
    while error is not None and error not in found:
        found.append(error)
        error = error.__cause__ or error.__context__
    return found


def strike(new_run: Callable[[Any], Any], steps: Sequence[tuple[str, Callable[[Any], Any]]], index: int,
           n: int) -> tuple[Any, Any, Exception | None]:
    """Two runs, ``new_run(FailingStorage())`` and its twin ``new_run("numpy")``, taken through the steps
    before ``index``; then step ``index`` run on the first with its storage failing at its ``n``-th call.
    Returns both runs and what the step raised (None); a ``BrokenCacheError`` is checked to chain the
    storage's failure."""
    storage = FailingStorage()
    attacked, twin = new_run(storage), new_run("numpy")
    for _, step in steps[:index]:
        step(attacked)
        step(twin)
    storage.arm(n)
    try:
        steps[index][1](attacked)
    except Exception as exc:
        if isinstance(exc, BrokenCacheError):   # the storage's failure, or the engine's out-of-memory it caused
            assert any(isinstance(e, (DeviceOutOfMemory, MemoryError)) for e in chain(exc.__cause__)), steps[index][0]
        return attacked, twin, exc
    finally:
        storage.arm(None)
    return attacked, twin, None
