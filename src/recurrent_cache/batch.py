"""`Batch`: the tokens of one ``llama_decode`` call, normalised to flat arrays.

A batch is checked for everything that can be checked without a cache
(lengths, dtypes, seq-id lists); what depends on the cache (seq ids against
its size, positions against the cached ones) is checked by ``init_batch``.
Seq-id lists are stored in CSR form — ``seq_id_flat`` holds every list back
to back and ``seq_id_offset[i]:seq_id_offset[i+1]`` is token ``i``'s list —
so the compiled core reads them without touching a Python object.

A batch is immutable: it keeps read-only copies of what it was given, so a
caller refilling its own buffers after ``init_batch`` cannot change what was
validated.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._args import INT32, holds_bool, int_array, integer, plain_sequence
from .errors import BatchError

__all__ = ["Batch"]


def _frozen(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array


def _plain(values: Any, name: str) -> Any:
    return plain_sequence(values, f"batch {name}", BatchError)


def _int_array(values: Any, name: str) -> np.ndarray:
    """``values`` as a frozen int32 array of the batch's own (the caller may refill its buffers);
    ``name`` ("batch token", ...) names it in errors."""
    if type(values) is np.ndarray and values.dtype == INT32 and values.ndim == 1 and values.flags.c_contiguous:
        return _frozen(values.copy())   # the decode loop's case: one copy, not even a call
    array = int_array(values, name, INT32, BatchError)
    return _frozen(array.copy() if array is values or array.base is not None else array)


def _seq_id_lists(seq_id: Any, n_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """Turn 1-D ids, a 2-D array or a list of lists into (flat ids, offsets)."""
    _plain(seq_id, "seq_id")
    try:
        array = seq_id if isinstance(seq_id, np.ndarray) else np.asarray(seq_id)
    except (TypeError, ValueError):
        array = None  # ragged lists: several sequences per token, in varying numbers
    if array is not None and array.size and (array.dtype.kind == "b" or holds_bool(seq_id)):
        raise BatchError(f"batch seq_id must hold integers, got dtype {array.dtype}")
    if array is not None and array.ndim in (1, 2) and (array.dtype.kind in "iu" or array.size == 0):
        if array.shape[0] != n_tokens:
            raise BatchError(f"batch seq_id has {array.shape[0]} entries for {n_tokens} tokens")
        if array.ndim == 2 and array.shape[1] == 0:
            raise BatchError("token 0 has no seq id")
        if array.ndim == 1 or array.shape[1] == 1:
            # one sequence per token: the fast path
            return (_int_array(array.reshape(-1), "batch seq_id"),
                    _frozen(np.arange(n_tokens + 1, dtype=np.int32)))
        width = array.shape[1]
        flat = _int_array(array.reshape(-1), "batch seq_id")
        if (n_tokens + 1) * width >= 2**31:
            raise BatchError(f"batch seq_id has {n_tokens * width} entries: too many for int32 offsets")
        offsets = _frozen(np.arange(0, (n_tokens + 1) * width, width, dtype=np.int32))
    else:
        flat, offsets = _ragged_seq_id_lists(seq_id, n_tokens)
    _check_seq_id_lists(flat, offsets)
    return flat, offsets


def _ragged_seq_id_lists(seq_id: Any, n_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    try:
        entries = list(seq_id)
    except TypeError:
        raise BatchError(f"batch seq_id must be a sequence, got {type(seq_id).__name__}") from None
    if len(entries) != n_tokens:
        raise BatchError(f"batch seq_id has {len(entries)} entries for {n_tokens} tokens")
    counts = np.empty(n_tokens, dtype=np.int64)
    ids: list[int] = []
    for i, entry in enumerate(entries):
        try:
            members = [_seq_id_value(entry)]
        except TypeError:
            try:
                members = [_seq_id_value(x) for x in _plain(entry, "seq_id")]
            except TypeError:
                raise BatchError(f"token {i}: seq_id {entry!r} is not an integer or a list of integers") from None
        counts[i] = len(members)
        ids.extend(members)
    if int(counts.sum()) >= 2**31:
        raise BatchError(f"batch seq_id has {int(counts.sum())} entries: too many for int32 offsets")
    try:
        wide = np.array(ids, dtype=np.int64)
    except OverflowError:
        raise BatchError("batch seq_id has a value outside the int32 range") from None
    flat = _int_array(wide, "batch seq_id")
    offsets = np.zeros(n_tokens + 1, dtype=np.int32)
    offsets[1:] = np.cumsum(counts)
    return flat, _frozen(offsets)


def _seq_id_value(value: Any) -> int:
    """One seq id: an integer, never a bool (True would silently mean sequence 1)."""
    return integer(value, "seq_id", TypeError)


def _check_seq_id_lists(flat: np.ndarray, offsets: np.ndarray) -> None:
    counts = np.diff(offsets)
    empty = np.flatnonzero(counts == 0)
    if empty.size:
        raise BatchError(f"token {int(empty[0])} has no seq id")
    multi = np.flatnonzero(counts > 1)
    for i in multi.tolist():
        members = flat[offsets[i]:offsets[i + 1]]
        if np.unique(members).size != members.size:
            values, seen = np.unique(members, return_counts=True)
            repeated = int(values[seen > 1][0])
            raise BatchError(f"token {i} lists seq_id {repeated} more than once")


class Batch:
    """The tokens (or embeddings) of one decode call.

    Parameters mirror ``llama_batch``:

    token : 1-D ints, shape ``[n_tokens]`` — or
    embd : 2-D floats, shape ``[n_tokens, n_embd]``
    pos : 1-D ints ``[n_tokens]``; default: each token continues its first
        sequence (``seq_pos_max(seq) + 1``, counting that sequence's earlier
        tokens in the batch), resolved by ``init_batch`` as llama_decode does.
    seq_id : 1-D ints ``[n_tokens]`` (one sequence per token), a 2-D int
        array, or a list of lists (several sequences per token, the first
        is the owner); default: ``[0]`` for every token.
    logits : 1-D bools/ints ``[n_tokens]``, output flags; default: only the
        last token is an output.
    """

    __slots__ = ("n_tokens", "token", "embd", "pos", "seq_id_flat", "seq_id_offset", "logits")

    n_tokens: int
    token: np.ndarray | None          # [n_tokens] int32, read-only
    embd: np.ndarray | None           # [n_tokens, n_embd] float32, read-only
    pos: np.ndarray | None            # [n_tokens] int32, read-only; None: llama_decode's defaults
    seq_id_flat: np.ndarray           # [entries] int32, read-only: every token's seq ids back to back
    seq_id_offset: np.ndarray         # [n_tokens + 1] int32, read-only
    logits: np.ndarray | None         # [n_tokens] int8 output flags, read-only

    def __init__(
        self,
        token: Any = None,
        pos: Any = None,
        seq_id: Any = None,
        logits: Any = None,
        *,
        embd: Any = None,
    ) -> None:
        init = object.__setattr__  # the batch is immutable once built
        if (token is None) == (embd is None):
            raise BatchError("a batch takes exactly one of token= and embd=")
        if token is not None:
            init(self, "token", _int_array(token, "batch token"))
            init(self, "embd", None)
            n_tokens = self.token.shape[0]  # type: ignore[union-attr]
        else:
            try:
                embd_array = np.asarray(_plain(embd, "embd"))
            except (TypeError, ValueError) as exc:
                raise BatchError(f"batch embd is not an array of floats: {exc}") from None
            if embd_array.ndim != 2:
                if embd_array.size == 0:
                    raise BatchError("batch has no tokens")
                raise BatchError(f"batch embd must be 2-D (n_tokens, n_embd), got shape {embd_array.shape}")
            if embd_array.dtype.kind not in "fiub":
                raise BatchError(f"batch embd must hold numbers, got dtype {embd_array.dtype}")
            init(self, "token", None)
            init(self, "embd", _frozen(np.array(embd_array, dtype=np.float32, order="C")))
            n_tokens = self.embd.shape[0]  # type: ignore[union-attr]
        if n_tokens == 0:
            raise BatchError("batch has no tokens")
        if n_tokens >= 2**31 - 1:
            raise BatchError(f"batch has {n_tokens} tokens: at most 2**31 - 2")
        init(self, "n_tokens", n_tokens)

        init(self, "pos", None)
        if pos is not None:
            init(self, "pos", _int_array(pos, "batch pos"))
            if self.pos.shape[0] != n_tokens:  # type: ignore[union-attr]
                raise BatchError(f"batch pos has {self.pos.shape[0]} entries for {n_tokens} tokens")  # type: ignore[union-attr]

        if seq_id is None:
            init(self, "seq_id_flat", _frozen(np.zeros(n_tokens, dtype=np.int32)))
            init(self, "seq_id_offset", _frozen(np.arange(n_tokens + 1, dtype=np.int32)))
        else:
            flat, offsets = _seq_id_lists(seq_id, n_tokens)
            init(self, "seq_id_flat", flat)
            init(self, "seq_id_offset", offsets)

        init(self, "logits", None)
        if logits is not None:
            try:
                flags = np.asarray(_plain(logits, "logits"))
            except (TypeError, ValueError) as exc:
                raise BatchError(f"batch logits is not an array of flags: {exc}") from None
            if flags.ndim != 1 or flags.dtype.kind not in "biuf":
                raise BatchError(f"batch logits must be 1-D flags, got shape {flags.shape} dtype {flags.dtype}")
            if flags.shape[0] != n_tokens:
                raise BatchError(f"batch logits has {flags.shape[0]} entries for {n_tokens} tokens")
            init(self, "logits", _frozen((flags != 0).view(np.int8)))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"a Batch is immutable: build a new one instead of setting {name!r}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"a Batch is immutable: cannot delete {name!r}")

    def seq_ids(self, i: int) -> tuple[int, ...]:
        """The seq-id list of token ``i`` (owner first)."""
        return tuple(self.seq_id_flat[self.seq_id_offset[i]:self.seq_id_offset[i + 1]].tolist())

    def __len__(self) -> int:
        return self.n_tokens

    def __repr__(self) -> str:
        kind = "token" if self.embd is None else f"embd[{self.embd.shape[1]}]"
        n_seqs = np.unique(self.seq_id_flat).size
        return f"Batch(n_tokens={self.n_tokens}, {kind}, sequences={n_seqs})"
