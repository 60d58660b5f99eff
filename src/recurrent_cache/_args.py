"""The argument checks of every public call, worded once.

Every integer, flag, token array and path a caller hands the package is
checked here, so one rule and one message hold everywhere:

* an integer is anything ``operator.index`` accepts (numpy integers too) but a
  bool: ``True`` would silently mean 1 (a sequence, a count, a layer);
  "{name} must be an integer, got {value!r}";
* a range is half-open: "{name} must be in [{low}, {high}), got {value}", or
  "{name} must be >= {low}, got {value}" when only a floor applies;
* a flag is a bool or an integer 0 / 1: "{name} must be True or False, got {value!r}";
* an integer array is 1-D, holds integers (no bool, no float, not ragged) that
  fit its dtype: "{name} must be a 1-D array of integers, got ...";
* a path is a str, bytes (decoded as ``os.fsdecode`` does, like every ``os``
  call) or ``os.PathLike``, not empty and without a NUL character.

The error class is the caller's (``ConfigError`` for a constructor,
``SeqIdError`` for a sequence id, ...); the wording is this module's.
"""

from __future__ import annotations

import operator
import os
from typing import Any

import numpy as np

from .errors import ArgumentError, OutOfRangeError, SeqIdError

__all__ = ["INT32_MIN", "INT32_END", "INT32", "LE_INT32", "integer", "in_range", "as_int", "count", "index", "as_flag",
           "state_seq_id", "layer_filter", "plain_sequence", "holds_bool", "int_array", "tokens", "text", "path"]

INT32_MIN = -2**31
INT32_END = 2**31   # one past the largest int32
INT32 = np.dtype(np.int32)
LE_INT32 = np.dtype("<i4")   # a token as llama.cpp's files store it


def _bound(value: int) -> str:
    """A range bound as a reader knows it: the int32 limits as powers of two."""
    return {INT32_END: "2**31", INT32_MIN: "-2**31"}.get(value, str(value))


def integer(value: Any, name: str, error: type[Exception] = ArgumentError) -> int:
    """``value`` as an int, or ``error`` naming it (a bool is not an integer here)."""
    if not isinstance(value, (bool, np.bool_)):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise error(f"{name} must be an integer, got {value!r}")


def in_range(value: Any, name: str, low: int, high: int | None,
             error: type[Exception] = ArgumentError, range_error: type[Exception] | None = None) -> int:
    """An integer in ``[low, high)`` (``high`` None: no ceiling); ``error`` for a value that is
    no integer, ``range_error`` (default: ``error``) for one outside the range."""
    if type(value) is int and low <= value and (high is None or value < high):
        return value   # the common case, without the general checks
    number = integer(value, name, error)
    outside = range_error or error
    if high is None:
        if number < low:
            raise outside(f"{name} must be >= {_bound(low)}, got {number}")
    elif not low <= number < high:
        raise outside(f"{name} must be in [{_bound(low)}, {_bound(high)}), got {number}")
    return number


def as_int(value: Any, name: str, error: type[Exception] = ArgumentError) -> int:
    """An integer that fits a C ``int32_t`` (positions, seq ids, shifts)."""
    return in_range(value, name, INT32_MIN, INT32_END, error)


def count(value: Any, name: str, minimum: int = 0, error: type[Exception] = ArgumentError,
          int32_only: bool = True) -> int:
    """A count of at least ``minimum``; below 2**31 unless ``int32_only`` is False (a byte budget)."""
    return in_range(value, name, minimum, INT32_END if int32_only else None, error)


def index(value: Any, name: str, size: int, error: type[Exception] = OutOfRangeError, low: int = 0) -> int:
    """An index into something of ``size`` entries: an integer in ``[low, size)``.

    A value that is no integer is an ``ArgumentError`` (bad input whatever the
    size); an integer outside the range is ``error`` (an ``IndexError``:
    ``OutOfRangeError``, or ``SeqIdError`` for a sequence id)."""
    return in_range(value, name, low, size, ArgumentError, error)


def as_flag(value: Any, name: str, error: type[Exception] = ArgumentError) -> bool:
    """A bool argument: a bool, or an integer 0 / 1 (numpy's included)."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    try:
        number = operator.index(value)
    except TypeError:
        number = None
    if number in (0, 1):
        return bool(number)
    raise error(f"{name} must be True or False, got {value!r}")


def state_seq_id(seq_id: Any, size: int, op: str) -> int:
    """The seq_id of a state call: -1 (the whole cache) or a sequence of a cache of ``size``."""
    return index(seq_id, f"{op}: seq_id", size, SeqIdError, low=-1)


def layer_filter(value: Any, n_layer: int, error: type[Exception] = ArgumentError,
                 name: str = "layers") -> tuple[int, ...] | None:
    """A layer filter: None (every layer) or an iterable of distinct layer indices in
    ``[0, n_layer)`` in any order, returned sorted; one naming every layer is None (the same
    cache).  Not a str / bytes / mapping / set of bools: each entry is checked as an integer.
    Messages call the argument ``name``."""
    if value is None:
        return None
    if isinstance(value, (str, bytes, dict)) or not hasattr(value, "__iter__"):
        raise error(f"{name} must be None or an iterable of layer indices, got {type(value).__name__}")
    try:
        entries = list(value)
    except TypeError as exc:   # iterable by its type, not by its value: a 0-d numpy array or tensor
        raise error(f"{name} must be None or an iterable of layer indices, got {value!r} ({exc})") from None
    layers = sorted(in_range(il, f"{name} entry", 0, n_layer, error) for il in entries)
    for before, il in zip(layers, layers[1:]):
        if before == il:
            raise error(f"{name} must not repeat a layer, got {il} twice")
    return None if len(layers) == n_layer else tuple(layers)


# -- integer arrays ------------------------------------------------------------------

def plain_sequence(values: Any, name: str, error: type[Exception] = ArgumentError) -> Any:
    """``values`` unless numpy would silently change its meaning (a mask dropped, a dict's keys taken)."""
    if isinstance(values, np.ma.MaskedArray):
        raise error(f"{name} is a masked array: pass the values you mean (np.ma.filled)")
    if isinstance(values, (dict, set, frozenset, str, bytes)):
        raise error(f"{name} must be a sequence or array, got {type(values).__name__}")
    return values


def holds_bool(values: Any) -> bool:
    """A list / tuple (or list of lists) with a bool in it: numpy would silently read True as 1."""
    if not isinstance(values, (list, tuple)):
        return False
    return any(isinstance(v, (bool, np.bool_)) or (isinstance(v, (list, tuple)) and holds_bool(v))
               for v in values)


def int_array(values: Any, name: str, dtype: np.dtype = INT32, error: type[Exception] = ArgumentError) -> np.ndarray:
    """``values`` as a 1-D C-contiguous array of ``dtype`` (an integer type), every value checked to fit.

    Refuses bools (in an array or a list), floats, more or fewer than one
    dimension and ragged lists.  The result may be ``values`` itself when it
    is already such an array: copy it to keep it.
    """
    if type(values) is np.ndarray and values.dtype == dtype and values.ndim == 1 \
            and values.flags.c_contiguous:
        return values   # the common case: nothing to convert (a dtype object compares fast, a type does not)
    target = np.dtype(dtype)
    wrong = f"{name} must be a 1-D array of integers"
    try:
        array = np.asarray(plain_sequence(values, name, error))
    except (TypeError, ValueError) as exc:   # ragged lists, objects numpy cannot read
        raise error(f"{wrong}: {exc}") from None
    if array.ndim != 1:
        raise error(f"{wrong}, got shape {array.shape}")
    if array.size and (array.dtype.kind not in "iu" or holds_bool(values)):
        raise error(f"{wrong}, got {'a bool' if array.dtype.kind in 'iu' else f'dtype {array.dtype}'}")
    if array.size and array.dtype.itemsize >= target.itemsize:
        info = np.iinfo(target)
        low, high = array.min(), array.max()
        if low < info.min or high > info.max:
            raise error(f"{name} must hold {target.name} values, got {low if low < info.min else high}")
    return np.ascontiguousarray(array, dtype=target)


def tokens(values: Any, name: str = "tokens") -> np.ndarray:
    """Token ids as little-endian int32, llama.cpp's ``llama_token`` as a file stores it."""
    return int_array(values, name, LE_INT32)


# -- strings and paths ---------------------------------------------------------------

def text(value: Any, name: str, error: type[Exception] = ArgumentError) -> str:
    """A str argument (a namespace, a URL, a prefix)."""
    if not isinstance(value, str):
        raise error(f"{name} must be a str, got {value!r}")
    return value


def path(value: Any, name: str = "path", error: type[Exception] = ArgumentError) -> str:
    """A file or directory path as a str: a str, bytes (decoded as ``os`` does) or os.PathLike."""
    try:
        decoded = os.fsdecode(os.fspath(value))
    except TypeError:
        raise error(f"{name} must be a str, bytes or os.PathLike, got {type(value).__name__}") from None
    if not decoded or "\0" in decoded:
        raise error(f"{name} {decoded!r} is empty or has a NUL character")
    return decoded
