"""How a state tensor stores numbers, and the rounding that implies.

A model computes in float32 or float64 but the cache keeps its states in f32,
f16 or bf16.  ``StateStorage`` converts between the two, for numpy arrays and
(``torch_forward.TorchStateStorage``) torch tensors alike.  Every conversion to
the storage type goes through float32 first, as ggml does (its compute type
is f32), and bf16 rounds to nearest even, like ``ggml_compute_fp32_to_bf16``.
"""

from __future__ import annotations

import copy
import os
import threading
from types import TracebackType
from typing import Any, ClassVar

import numpy as np

from ..formats.dtypes import STATE_TYPES
from ._scan import PARALLEL_MIN_BYTES, copy_bytes

__all__ = ["StateStorage", "StateUndo", "astype"]

# Without ml_dtypes the cache stores a bf16 row as its raw bits in uint16.
_RAW_BF16 = np.dtype(np.uint16)


def _bf16_bits(values: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bit patterns (uint16), round to nearest even; NaN stays NaN."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16
    is_nan = (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    return np.where(is_nan, (bits >> 16) | np.uint32(0x40), rounded).astype(np.uint16)


def astype(xp: Any, array: Any, dtype: Any, copy: bool = True) -> Any:
    """``array`` as ``dtype`` (numpy 2.0's namespace has no ``astype`` function: the method serves)."""
    if not copy and array.dtype == dtype:   # a state read or written in its own dtype: no library call at all
        return array
    if xp is np:
        return array.astype(dtype, copy=copy)
    return xp.astype(array, dtype, copy=copy)


class StateUndo:
    """The states a forward's steps updated in place, in their rows, each with the values it held before:
    ``restore`` puts every one back, so that a forward that fails leaves every row as it was; ``release``
    once the forward is done with them.  ``with undo:`` around the layers does both: restore when they raise
    (an exception or a ``KeyboardInterrupt``), release either way.

    A one-token scan in host memory (``_ssm.scan_step_on_host``) takes this
    path when its storage has an undo (``StateStorage.with_undo``): the new
    state goes straight into the rows rather than into a new array that a
    second pass then copies there (Mamba-2 at 130m: 19 MB a token and sequence).
    """

    # Buffers of released undos that the next forward's reuse, up to SPARE_BYTES in all: a new array of
    # megabytes is a new mapping whose pages the OS faults in and zeroes on first touch (Mamba-2, 8 sequences:
    # 151 MB a token, which took longer than the step itself)
    SPARE_BYTES = 256 << 20
    _spare: ClassVar[list[np.ndarray]] = []

    def __init__(self) -> None:
        self._entries: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []

    def saving(self, state: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Where a step in place of ``state`` keeps its old values, and the flag it sets once it has: recorded
        before the step runs, so that an interrupt at any point leaves nothing unrecorded."""
        saved, done = self._buffer(state.nbytes).view(state.dtype).reshape(state.shape), np.zeros(1, np.uint8)
        self._entries.append((state, saved, done))
        return saved, done

    def restore(self) -> None:
        """Every state stepped in place back to what it held, the latest first."""
        for state, saved, done in reversed(self._entries):
            if done[0]:
                state[...] = saved

    def release(self) -> None:
        """Forget every entry, their buffers kept for the next undo."""
        buffers = [saved.reshape(-1).view(np.uint8) for _, saved, _ in self._entries]
        self._entries.clear()
        with _spare_lock:
            kept = sum(buffer.nbytes for buffer in self._spare)
            for buffer in buffers:
                if kept + buffer.nbytes <= self.SPARE_BYTES:
                    self._spare.append(buffer)
                    kept += buffer.nbytes

    def __enter__(self) -> StateUndo:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
                 ) -> None:
        try:
            if kind is not None:
                self.restore()
        finally:
            self.release()

    def _buffer(self, nbytes: int) -> np.ndarray:
        """``nbytes`` bytes: a spare buffer of that size, else a new one."""
        with _spare_lock:
            for i, buffer in enumerate(self._spare):
                if buffer.nbytes == nbytes:
                    return self._spare.pop(i)
        return np.empty(nbytes, np.uint8)


# Guards StateUndo's spare buffers (forwards on other threads); a new one in a forked child, where a fork while
# another thread held it would leave the child's copy held for ever
_spare_lock = threading.Lock()


def _renew_spare_lock() -> None:
    global _spare_lock
    _spare_lock = threading.Lock()


os.register_at_fork(after_in_child=_renew_spare_lock)


class StateStorage:
    """The storage dtype of one state tensor (``cache.r[il].dtype``), for arrays of namespace ``xp``.

    The one rounding policy of every backend: a value goes to the storage dtype
    through float32 (ggml's compute type), bf16 rounding to nearest even.
    ``undo``: where a step may update a state in place (``StateUndo``), None
    when every new state is a new array.
    """

    undo: StateUndo | None = None

    def __init__(self, dtype: Any, xp: Any = np) -> None:
        self.xp = xp
        if xp is np:
            dtype = np.dtype(dtype)
            if dtype not in {t.numpy for t in STATE_TYPES.values()} | {_RAW_BF16}:
                raise TypeError(f"no state storage for dtype {dtype}")
        self.dtype = dtype
        self.raw_bf16 = xp is np and dtype == _RAW_BF16

    @classmethod
    def named(cls, name: str) -> "StateStorage":
        """The storage a cache built with ``dtype_r=name`` uses ("f32", "f16", "bf16")."""
        if name not in STATE_TYPES:
            raise ValueError(f"unknown state dtype {name!r} (expected one of {', '.join(STATE_TYPES)})")
        return cls(STATE_TYPES[name].numpy)

    def encode(self, values: Any) -> Any:
        """``values`` as this storage holds them: an array of the storage dtype (``values`` itself when it has
        that dtype: a state is written to its rows right after, so a copy here would only be a second one)."""
        as_f32 = astype(self.xp, values, self.xp.float32, copy=False)
        if self.raw_bf16:
            return _bf16_bits(as_f32)
        return astype(self.xp, as_f32, self.dtype, copy=False)

    def with_undo(self, undo: StateUndo) -> StateStorage:
        """This storage, with steps that may update states in place, recorded in ``undo``."""
        journaled = copy.copy(self)
        journaled.undo = undo
        return journaled

    def write(self, rows: Any, values: Any) -> None:
        """``rows[...] = encode(values)``: nothing when ``values`` are the rows already (a state stepped in
        place), a large numpy copy of one dtype between C-contiguous arrays by the compiled kernel in threads
        (``_scan.copy_bytes``: a layer's states after a decode step), any other by the library's assignment."""
        stored = self.encode(values)
        if self.xp is not np or stored.dtype != rows.dtype or stored.shape != rows.shape:
            rows[...] = stored
        elif _same_memory(stored, rows):
            return
        elif (stored.nbytes >= PARALLEL_MIN_BYTES and stored.flags.c_contiguous and rows.flags.c_contiguous
              and not np.may_share_memory(stored, rows)):
            copy_bytes(stored.reshape(-1).view(np.uint8), rows.reshape(-1).view(np.uint8))
        else:
            rows[...] = stored

    def decode(self, stored: Any, dtype: Any) -> Any:
        """Stored values as floats of ``dtype`` (``stored`` itself when it has that dtype: never written to)."""
        if self.raw_bf16:
            return (stored.astype(np.uint32) << 16).view(np.float32).astype(dtype)
        return astype(self.xp, stored, dtype, copy=False)

    def round(self, values: Any) -> Any:
        """``values`` as they would read back after a store (the input itself when lossless)."""
        if values.dtype == self.dtype:
            return values
        return self.decode(self.encode(values), values.dtype)


def _same_memory(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two numpy arrays of one shape and dtype are views of the same elements."""
    return (a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
            and (a.strides == b.strides or (a.flags.c_contiguous and b.flags.c_contiguous)))
