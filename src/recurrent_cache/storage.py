"""Where a cache's state tensors live: the storage interface and the two storages that ship.

The memory core decides which rows move, are zeroed, are filed into the rollback history
or restored; a *storage* owns the tensors those rows live in.  Each kind of state (r,
then s) is one tensor ``[n_state_layers, rows, width]`` whose ``[k]`` is the rows of the
k-th layer with state, so a decision that moves some rows is one call per kind, whatever
the number of layers or rows.

A storage whose tensors are in host memory says so (``host_access``) and hands the core a
numpy view of them (``host_view``); the core then moves rows itself, in C, without the GIL
(the numpy storage, torch on ``cpu``; the C API needs this).  Any other storage (torch on a
GPU) gets the core's decisions as index arrays at the end of each call: every row gathered
first (``take``), then written (``put``, ``zero``) — see docs/storage.md.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol, cast, runtime_checkable

import numpy as np

from ._args import as_flag
from .errors import ArgumentError, ConfigError, RecurrentCacheError
from .formats.dtypes import STATE_TYPES, StateType

__all__ = ["NumpyStorage", "Storage", "Tensor", "TorchStorage", "allocating", "has_host_access", "storage_for"]

# A tensor of a cache's storage: numpy.ndarray (numpy), torch.Tensor (torch), or what another
# storage allocates.  Both support the indexing, slicing and reshape the package applies to rows.
Tensor = Any


@runtime_checkable
class _RowMethods(Protocol):
    """The methods every storage has, ``host_access`` aside (a storage written before the flag)."""

    @property
    def name(self) -> str:
        """``"numpy"``, ``"torch"``, …: how the tensors are typed."""

    @property
    def device(self) -> str:
        """Where they are (``"cpu"``, ``"cuda:0"``, …)."""

    def allocate(self, shape: tuple[int, ...], dtype: StateType) -> Any:
        """A zeroed, C-contiguous tensor of ``shape`` holding ``dtype`` numbers."""

    def host_view(self, tensor: Any) -> np.ndarray | None:
        """``tensor``'s memory as a numpy array of ``dtype.numpy`` (shared, not a copy) that the
        core may read and write in C; asked for only when ``host_access`` is true (else None)."""

    def take(self, tensor: Any, rows: np.ndarray) -> Any:
        """A new tensor holding ``tensor[:, rows]``."""

    def put(self, tensor: Any, rows: np.ndarray, values: Any) -> None:
        """``tensor[:, rows] = values`` (values as ``take`` or ``from_host`` made them)."""

    def zero(self, tensor: Any, rows: np.ndarray) -> None:
        """``tensor[:, rows] = 0``."""

    def stack(self, rows: Sequence[Any], dtype: StateType) -> Any:
        """A new tensor of this storage ``[len(rows), width]`` from rows of ``dtype`` (numpy arrays or
        tensors of this storage; the numpy ones in one transfer).  Raises ``ArgumentError`` naming
        ``rows[k]`` for a tensor whose values it cannot read; called before anything changes."""

    def to_host(self, tensor: Any) -> np.ndarray:
        """A numpy copy of ``tensor`` (one transfer; never a view of it)."""

    def from_host(self, array: np.ndarray, dtype: StateType) -> Any:
        """A new tensor of this storage holding a copy of ``array`` (one transfer)."""


@runtime_checkable
class Storage(_RowMethods, Protocol):
    """What the core needs of a storage.  ``tensor`` arguments are tensors it allocated;
    ``rows`` are int64 numpy index arrays along axis 1 (a row index within each layer)."""

    @property
    def host_access(self) -> bool:
        """Whether the core may move rows in the tensors' memory itself, through ``host_view``
        (the C API needs it); false: the core hands its moves over as index arrays."""


def has_host_access(storage: _RowMethods) -> bool:
    """``storage.host_access``, the one test of which path moves a storage's rows.  A storage
    without the attribute (written before it existed) runs the index path, which every storage
    serves: its ``host_view`` is never asked for.  Anything but a bool (a forwarding storage's
    ``__getattr__`` handing out a method) is a ``ConfigError``."""
    flag = getattr(storage, "host_access", False)
    if not isinstance(flag, bool):
        raise ConfigError(f"{storage!r}: host_access must be True or False, not {type(flag).__name__}")
    return flag


class NumpyStorage:
    """The default: numpy arrays in host memory, moved by the core in C."""

    name = "numpy"
    host_access = True
    device = "cpu"

    def allocate(self, shape: tuple[int, ...], dtype: StateType) -> np.ndarray:
        return np.zeros(shape, dtype=dtype.numpy)

    def host_view(self, tensor: np.ndarray) -> np.ndarray:
        return tensor

    def take(self, tensor: np.ndarray, rows: np.ndarray) -> np.ndarray:
        return tensor[:, rows]

    def put(self, tensor: np.ndarray, rows: np.ndarray, values: np.ndarray) -> None:
        tensor[:, rows] = values

    def zero(self, tensor: np.ndarray, rows: np.ndarray) -> None:
        tensor[:, rows] = 0

    def stack(self, rows: Sequence[Any], dtype: StateType) -> np.ndarray:
        return np.stack([np.asarray(row).view(dtype.numpy) for row in rows]) if rows else \
            np.zeros((0, 0), dtype.numpy)

    def to_host(self, tensor: np.ndarray) -> np.ndarray:
        return tensor.copy()

    def from_host(self, array: np.ndarray, dtype: StateType) -> np.ndarray:
        return np.array(array, dtype=dtype.numpy, order="C", copy=True)

    def __repr__(self) -> str:
        return "NumpyStorage()"


def _torch() -> Any:
    try:
        return importlib.import_module("torch")
    except ImportError as exc:
        raise ConfigError("storage='torch' needs PyTorch: pip install 'recurrent_cache[torch]'") from exc


def _first_line(exc: BaseException) -> str:
    """An exception's reason in one line (its type's name when it gives none)."""
    return (str(exc).splitlines() or [type(exc).__name__])[0]


class TorchStorage:
    """torch tensors on ``device`` (``"cpu"``, ``"cuda:0"``, ``"mps"``, …): f32, f16 and bf16 as
    ``torch.float32`` / ``float16`` / ``bfloat16``.

    host_access: whether the core may move rows in the tensors' memory itself (only for
    ``cpu``, the default there).  False on ``cpu`` runs exactly the index-array path a GPU
    runs, which tests and benchmarks use to measure it without one.
    """

    name = "torch"

    def __init__(self, device: Any = None, host_access: bool | None = None) -> None:
        torch = self._torch = _torch()
        if host_access is not None:
            host_access = as_flag(host_access, "TorchStorage: host_access", ConfigError)
        try:
            self._device = torch.device("cpu" if device is None else device)
        except (RuntimeError, TypeError, ValueError) as exc:   # torch's words for a name it does not know
            raise ConfigError(f"device {device!r}: {_first_line(exc)}") from None
        on_host = self._device.type == "cpu"
        if host_access is None:
            host_access = on_host
        if host_access and not on_host:
            raise ConfigError(f"host_access=True needs device 'cpu', not {str(self._device)!r}")
        if self._device.type == "meta":
            raise ConfigError(f"device {device!r} holds no data: a cache's states need a device with memory")
        try:
            torch.empty(0, device=self._device)
        # Any failure here means torch cannot serve the device, and each backend words it its
        # own way: an AssertionError (cuda, xpu not compiled in), an ImportError (hpu), ...
        except Exception as exc:
            raise ConfigError(f"device {device!r}: {_first_line(exc)}") from None
        self.host_access = bool(host_access)
        self._types = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}

    @property
    def device(self) -> str:
        return str(self._device)

    def torch_dtype(self, dtype: StateType) -> Any:
        """The torch dtype a state type is stored as."""
        return self._types[dtype.name]

    def _numpy_of(self, tensor: Any) -> np.dtype[Any]:
        """The numpy dtype a cache uses for ``tensor``'s state type (bf16: ml_dtypes' or raw bits)."""
        return next(t.numpy for t in STATE_TYPES.values() if self._types[t.name] == tensor.dtype)

    def allocate(self, shape: tuple[int, ...], dtype: StateType) -> Any:
        # never an inference tensor, even inside torch.inference_mode(): a cache made there is
        # written in place (by its moves and by a model) outside it too
        with self._torch.inference_mode(False):
            return self._torch.zeros(shape, dtype=self._types[dtype.name], device=self._device)

    def host_view(self, tensor: Any) -> np.ndarray | None:
        if not self.host_access:
            return None
        shape = tuple(tensor.shape)
        # through uint8: numpy has no bfloat16 of torch's, but the bits are the same
        raw: np.ndarray = tensor.view(self._torch.uint8).numpy()
        return raw.view(self._numpy_of(tensor)).reshape(shape)

    def _index(self, rows: np.ndarray) -> Any:
        return self._torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int64)).to(self._device)

    def take(self, tensor: Any, rows: np.ndarray) -> Any:
        return tensor.index_select(1, self._index(rows))

    def put(self, tensor: Any, rows: np.ndarray, values: Any) -> None:
        with self._torch.no_grad():   # the cache's tensors never join an autograd graph
            tensor.index_copy_(1, self._index(rows), values)

    def zero(self, tensor: Any, rows: np.ndarray) -> None:
        with self._torch.no_grad():
            tensor.index_fill_(1, self._index(rows), 0)

    def stack(self, rows: Sequence[Any], dtype: StateType) -> Any:
        """Raises ``ArgumentError`` naming a tensor row that holds no readable data (a sparse or
        other non-strided layout, the ``meta`` device); a row on another device is copied here,
        one with ``requires_grad`` detached."""
        if all(isinstance(row, np.ndarray) for row in rows):
            return self.from_host(np.stack(rows) if rows else np.zeros((0, 0), dtype.numpy), dtype)
        torch = self._torch
        kind = self._types[dtype.name]
        dense = [self.from_host(row, dtype) if isinstance(row, np.ndarray) else self._readable(row, k)
                 for k, row in enumerate(rows)]
        with torch.no_grad():
            return torch.stack([row.to(device=self._device, dtype=kind) for row in dense])

    def _readable(self, row: Any, k: int) -> Any:
        """Tensor ``row`` (the k-th given) detached, or ``ArgumentError`` if its values cannot be read."""
        if row.layout != self._torch.strided:
            raise ArgumentError(f"rows[{k}] is a {row.layout} tensor: rows must be dense (torch.strided)")
        if row.is_meta:
            raise ArgumentError(f"rows[{k}] is on device 'meta', which holds no data")
        return row.detach()

    def to_host(self, tensor: Any) -> np.ndarray:
        host = tensor.detach().to("cpu", copy=True).contiguous()   # a copy even of a CPU tensor
        return np.asarray(host.view(self._torch.uint8).numpy().view(self._numpy_of(tensor))
                          .reshape(tuple(tensor.shape)))

    def from_host(self, array: np.ndarray, dtype: StateType) -> Any:
        array = np.ascontiguousarray(array, dtype=dtype.numpy)
        raw = self._torch.from_numpy(array.view(np.uint8).reshape(-1))
        return raw.view(self._types[dtype.name]).reshape(array.shape).to(self._device, copy=True)

    def __repr__(self) -> str:
        return f"TorchStorage(device={self.device!r}, host_access={self.host_access})"


@contextmanager
def allocating(what: str) -> Iterator[None]:
    """Around a constructor's allocations: the allocator's failure — out of memory (numpy's
    MemoryError, torch's RuntimeError), a size it cannot represent (ValueError, TypeError,
    OverflowError) — becomes a ``ConfigError`` naming ``what`` (the sizes asked for), so that no
    half-made object is left and no allocator's error escapes raw."""
    try:
        yield
    except RecurrentCacheError:
        raise
    except (MemoryError, RuntimeError, ValueError, TypeError, OverflowError) as exc:
        raise ConfigError(f"cannot allocate {what}: {_first_line(exc)}") from None


def storage_for(storage: Any, device: Any) -> Storage:
    """The storage a cache's ``storage=`` / ``device=`` arguments name (checked)."""
    if isinstance(storage, str):
        if storage == "numpy":
            if device is not None and str(device) != "cpu":
                raise ConfigError(f"storage='numpy' keeps states in host memory; device {device!r} "
                                  "needs storage='torch'")
            return NumpyStorage()
        if storage == "torch":
            return TorchStorage(device)
        raise ConfigError(f"unknown storage {storage!r} (expected 'numpy', 'torch' or a Storage object)")
    if not isinstance(storage, _RowMethods):
        raise ConfigError(f"storage must be 'numpy', 'torch' or a Storage object, not {type(storage).__name__}")
    if device is not None:
        raise ConfigError(f"device {device!r} is given with a storage object, which has its own device")
    return cast(Storage, storage)   # one without host_access is read through has_host_access
