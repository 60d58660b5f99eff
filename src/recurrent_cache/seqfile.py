"""Sequence state files, as llama.cpp's ``llama_state_seq_save_file`` / ``_load_file`` write them.

A file is ``u32 magic 0x67677371 ('ggsq')``, ``u32 version 2``,
``u32 n_token_count``, ``n_token_count x i32 token``, then the state blob of
one sequence (SPEC.md §5), all little-endian.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import struct
from typing import Any

import numpy as np

from ._config import state_seq_id
from .errors import ArgumentError, StateError
from .state_format import MAX_TOKENS, SEQ_FILE_MAGIC, SEQ_FILE_VERSION, CacheShape, read_file, write_all

__all__ = ["save_seq_file", "load_seq_file"]


def _tokens(tokens: Any) -> np.ndarray:
    try:
        array = np.asarray(tokens)
    except (TypeError, ValueError) as exc:
        raise ArgumentError(f"tokens must be a 1-D array of integers: {exc}") from None
    if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
        raise ArgumentError(f"tokens must be a 1-D array of integers, got shape {array.shape} "
                            f"dtype {array.dtype}")
    if array.size and (array.min() < -2**31 or array.max() >= 2**31):
        raise ArgumentError("tokens must fit in int32")
    if array.shape[0] >= 2**32:
        raise ArgumentError(f"{array.shape[0]} tokens do not fit a u32 count")
    return array.astype("<i4")


def _path(path: Any, op: str) -> str:
    """``path`` as a str: any str, bytes or os.PathLike path (bytes are decoded as os does)."""
    try:
        name = os.fsdecode(os.fspath(path))
    except TypeError:
        raise ArgumentError(f"{op}: path must be a str, bytes or os.PathLike, got {type(path).__name__}") from None
    if not name or "\0" in name:
        raise ArgumentError(f"{op}: path {name!r} is empty or has a NUL character")
    return name


def save_seq_file(path: str | bytes | os.PathLike, cache: Any, seq_id: int, tokens: Any) -> int:
    """Write sequence ``seq_id`` of ``cache`` and its ``tokens`` to ``path``; returns the file size.

    The file is written under a temporary name in the same directory and
    renamed over ``path`` only when complete, so ``path`` holds either its old
    content or the whole new file, never part of one.
    """
    path = _path(path, "save_seq_file")
    token_array = _tokens(tokens)
    size = cache.state_size(seq_id)   # checks seq_id before a file is created
    directory, name = os.path.split(os.path.abspath(path))
    temporary = os.path.join(directory, f".{name}.{secrets.token_hex(8)}.tmp")
    # os.open honours the umask (tempfile.mkstemp would leave the file 0600)
    handle = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    try:
        with os.fdopen(handle, "wb") as file:
            write_all(file, struct.pack("<III", SEQ_FILE_MAGIC, SEQ_FILE_VERSION, token_array.shape[0]))
            write_all(file, token_array)
            cache.state_write_into(file, seq_id)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    return 12 + 4 * token_array.shape[0] + size


def load_seq_file(path: str | bytes | os.PathLike, cache: Any, seq_id: int, *,
                  max_tokens: int = MAX_TOKENS) -> np.ndarray:
    """Restore sequence ``seq_id`` of ``cache`` from a sequence file; returns its tokens (int32).

    The whole file is checked before the cache changes: a ``StateError``
    (bad magic, version, token count or blob) leaves the cache as it was.
    Only what the header claims is read, the tokens no more than
    ``max_tokens`` (llama.cpp's ``n_token_capacity``; default 2**26) and the
    blob no further than a sequence of this cache can be: a FIFO,
    ``/dev/zero`` or a huge file is rejected after a few bytes.
    """
    path = _path(path, "load_seq_file")
    seq_id = state_seq_id(seq_id, cache.size, "load_seq_file")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0:
        raise ArgumentError(f"load_seq_file: max_tokens must be an integer >= 0, got {max_tokens!r}")
    with open(path, "rb") as file:
        try:
            contents = read_file(file, path, CacheShape.of(cache), seq_id, sequence_file=True,
                                 max_tokens=max_tokens)
        except StateError as exc:
            raise StateError(f"{path}: {exc}") from None
    try:
        cache.state_read(contents.data, seq_id)
    except StateError as exc:   # checked above already: only a rule the parse does not know lands here
        raise StateError(f"{path}: the state blob at byte {contents.blob_offset}: {exc}") from None
    return contents.tokens
