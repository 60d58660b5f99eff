"""Sequence state files, as llama.cpp's ``llama_state_seq_save_file`` / ``_load_file`` write them.

A file is ``state_format.GGSQ``'s header (``u32 magic 0x67677371 ('ggsq')``,
``u32 version 2``, ``u32 n_token_count``), ``n_token_count x i32 token``,
then the state blob of one sequence (docs/concepts.md §5), all little-endian.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from typing import Any

import numpy as np

from . import _args
from .errors import ArgumentError, StateError
from .state_format import GGSQ, MAX_TOKENS, Geometry, read_file, seq_file_header, write_all

__all__ = ["save_seq_file", "load_seq_file"]


def save_seq_file(path: str | bytes | os.PathLike[str] | os.PathLike[bytes], cache: Any, seq_id: int,
                  tokens: Any) -> int:
    """Write sequence ``seq_id`` of ``cache`` and its ``tokens`` to ``path``; returns the file size.

    The file is written under a temporary name in the same directory and
    renamed over ``path`` only when complete, so ``path`` holds either its old
    content or the whole new file, never part of one.
    """
    path = _args.path(path, "save_seq_file: path")
    token_array = _args.tokens(tokens)
    if token_array.shape[0] >= 2**32:
        raise ArgumentError(f"{token_array.shape[0]} tokens do not fit a sequence file's u32 count")
    size = cache.state_size(seq_id)   # checks seq_id before a file is created
    directory, name = os.path.split(os.path.abspath(path))
    temporary = os.path.join(directory, f".{name}.{secrets.token_hex(8)}.tmp")
    # os.open honours the umask (tempfile.mkstemp would leave the file 0600)
    handle = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    try:
        with os.fdopen(handle, "wb") as file:
            write_all(file, seq_file_header(token_array.shape[0]))
            write_all(file, token_array)
            cache.state_write_into(file, seq_id)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    return GGSQ.header.size + 4 * int(token_array.shape[0]) + int(size)


def load_seq_file(path: str | bytes | os.PathLike[str] | os.PathLike[bytes], cache: Any, seq_id: int, *,
                  max_tokens: int = MAX_TOKENS) -> np.ndarray:
    """Restore sequence ``seq_id`` of ``cache`` from a sequence file; returns its tokens (int32).

    The whole file is checked before the cache changes: a ``StateError``
    (bad magic, version, token count or blob) leaves the cache as it was.
    Only what the header claims is read, the tokens no more than
    ``max_tokens`` (llama.cpp's ``n_token_capacity``; default 2**26) and the
    blob no further than a sequence of this cache can be: a FIFO,
    ``/dev/zero`` or a huge file is rejected after a few bytes.
    """
    path = _args.path(path, "load_seq_file: path")
    seq_id = _args.state_seq_id(seq_id, cache.size, "load_seq_file")
    max_tokens = _args.count(max_tokens, "load_seq_file: max_tokens", 0, int32_only=False)
    with open(path, "rb") as file:
        try:
            contents = read_file(file, path, Geometry.of(cache), seq_id, sequence_file=True,
                                 max_tokens=max_tokens)
        except StateError as exc:
            raise StateError(f"{path}: {exc}") from None
    try:
        cache.state_read(contents.data, seq_id)
    except StateError as exc:   # checked above already: only a rule the parse does not know lands here
        raise StateError(f"{path}: the state blob at byte {contents.blob_offset}: {exc}") from None
    assert contents.tokens is not None   # a sequence file always has them (sequence_file=True)
    return contents.tokens
