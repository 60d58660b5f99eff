"""State files, as llama.cpp's ``llama_state_seq_save_file`` / ``llama_state_save_file`` write them.

A sequence file is ``formats.layouts.GGSQ``'s header (``u32 magic 'ggsq'``,
``u32 version 3`` — 2 in June-2025 llama.cpp, the same bytes after it —,
``u32 n_token_count``), ``n_token_count x i32 token``, then the memory section
of one sequence (docs/concepts.md §5), all little-endian.  A session file (``GGSN``,
'ggsn' version 10) has the same header, the tokens, then exactly what
``llama_state_get_data`` writes: the architecture string and the whole cache's
memory section.  June-2025 llama.cpp's session files ('ggsn' version 9,
``GGSN_V9``) have its ``llama_state_get_data`` there instead: the architecture string, the output
block (output positions, logits, embeddings), then the memory section; they are read.
A 'ggsn' file given to ``load_seq_file`` or a 'ggsq' file to
``load_session_file`` is refused with a message naming the function that loads it.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from . import _args
from .atomic_write import atomic_write
from .errors import ArgumentError, StateError
from .formats.blob import arch_string, seq_file_format, seq_file_header
from .formats.files import FileContents, read_file
from .formats.geometry import Geometry
from .formats.layouts import FILE_HEADER, GGSN, GGSN_V9, GGSQ, GGSQ_V2, MAX_ARCH, MAX_TOKENS
from .formats.streams import check_file, write_all
from .hybrid import HybridCache

_Path = str | bytes | os.PathLike[str] | os.PathLike[bytes]

__all__ = ["save_seq_file", "load_seq_file", "save_session_file", "load_session_file"]


def save_seq_file(path: _Path, cache: Any, seq_id: int, tokens: Any, *, version: int = 3) -> int:
    """Write sequence ``seq_id`` of ``cache`` and its ``tokens`` to ``path``; returns the file size.

    ``version`` 3 (the default) is what current llama.cpp reads; 2 is June-2025
    llama.cpp's.  The file is written under a temporary name in the same
    directory and renamed over ``path`` only when complete, so ``path`` holds
    either its old content or the whole new file, never part of one.
    """
    path = _args.path(path, "save_seq_file: path")
    framing = seq_file_format(version)
    token_array = _file_tokens(tokens)
    size = cache.state_size(seq_id)   # checks seq_id before a file is created
    head = seq_file_header(token_array.shape[0], framing)
    _write_atomically(path, (head, token_array), cache, seq_id)
    return len(head) + 4 * int(token_array.shape[0]) + int(size)


def save_session_file(path: _Path, cache: Any, tokens: Any, arch: str) -> int:
    """Write the whole ``cache`` and ``tokens`` as llama.cpp's ``llama_state_save_file`` does
    ('ggsn' version 10) for a model of architecture ``arch`` (e.g. "mamba"); returns the size.
    Written whole or not at all, as ``save_seq_file`` writes."""
    path = _args.path(path, "save_session_file: path")
    token_array = _file_tokens(tokens)
    name = arch_string(arch)
    size = cache.state_size(-1)
    head = seq_file_header(token_array.shape[0], GGSN)
    _write_atomically(path, (head, token_array, name), cache, -1)
    return len(head) + 4 * int(token_array.shape[0]) + len(name) + int(size)


def _file_tokens(tokens: Any) -> np.ndarray:
    token_array = _args.tokens(tokens)
    if token_array.shape[0] >= 2**32:
        raise ArgumentError(f"{token_array.shape[0]} tokens do not fit a sequence file's u32 count")
    return token_array


def _write_atomically(path: str, head: tuple[Any, ...], cache: Any, seq_id: int) -> None:
    """The ``head`` parts, then ``seq_id``'s memory section, written whole or not at all
    (``atomic_write``)."""
    with atomic_write(path) as temporary, open(temporary, "wb") as file:
        for part in head:
            write_all(file, part)
        cache.state_write_into(file, seq_id)


def load_seq_file(path: _Path, cache: Any, seq_id: int, *, max_tokens: int = MAX_TOKENS,
                  kv_section: bool = False, kv_cell_ext: bool | None = None) -> np.ndarray:
    """Restore sequence ``seq_id`` of ``cache`` from a 'ggsq' file (version 3 or 2); returns
    its tokens (int32).

    The whole file is checked before the cache changes: a ``StateError``
    (bad magic, version, token count or blob) leaves the cache as it was.
    Only what the header claims is read, the tokens no more than
    ``max_tokens`` (llama.cpp's ``n_token_capacity``; default 2**26) and the
    blob no further than a sequence of this cache can be: a FIFO,
    ``/dev/zero`` or a huge file is rejected after a few bytes.
    ``kv_section=True``: a hybrid model's file read into a ``RecurrentCache``
    (the recurrent layers alone), whose attention KV section (before the
    recurrent section) is checked and skipped; ``kv_cell_ext`` says whether
    its cells carry the 12-byte extended position (None: found from the
    bytes, refused when both readings fit).  A ``HybridCache`` reads both
    sections (its ``state_read``), no further than ``seq_state_bound()``.
    """
    path = _args.path(path, "load_seq_file: path")
    if isinstance(cache, HybridCache):   # its attention KV section and its recurrent section, both read
        seq_id = _args.state_seq_id(seq_id, cache.n_seq_max, "load_seq_file")
        return _load_hybrid(path, "load_seq_file", cache, seq_id, max_tokens, None)
    seq_id = _args.state_seq_id(seq_id, cache.size, "load_seq_file")
    return _load(path, "load_seq_file", cache, seq_id, max_tokens, None, kv_section, kv_cell_ext)


def load_session_file(path: _Path, cache: Any, *, arch: str | None = None, max_tokens: int = MAX_TOKENS,
                      kv_section: bool = False, kv_cell_ext: bool | None = None) -> np.ndarray:
    """Restore the whole ``cache`` from a 'ggsn' session file (version 10, or June-2025's 9,
    whose output block is checked and skipped); returns its tokens.

    ``arch``, when given, must be the file's architecture name.  Checked as ``load_seq_file`` checks: nothing changes
    unless the whole file is good.  A ``HybridCache`` reads version 10 (its KV and recurrent sections,
    its ``state_read``), no further than ``state_bound()`` allows.
    """
    path = _args.path(path, "load_session_file: path")
    if isinstance(cache, HybridCache):
        if arch is not None:
            arch_string(arch)   # a name llama.cpp could have written, checked before the file is opened
        return _load_hybrid(path, "load_session_file", cache, -1, max_tokens, arch)
    return _load(path, "load_session_file", cache, -1, max_tokens, arch, kv_section, kv_cell_ext)


def _load_hybrid(path: str, op: str, cache: HybridCache, seq_id: int, max_tokens: int, arch: str | None) -> np.ndarray:
    """A 'ggsq' file of a hybrid memory's sequence (``seq_id >= 0``) or a 'ggsn' session file of the whole
    memory (-1): header, tokens, then the state read by ``HybridCache.state_read`` (every check before
    either half changes).  No more is read than the header claims and the memory's state bound allows
    (``seq_state_bound()``; ``state_bound()`` and the architecture string for a session), and one byte
    more to prove the file ends."""
    max_tokens = _args.count(max_tokens, f"{op}: max_tokens", 0, int32_only=False)
    formats, kind, named = (((GGSQ, GGSQ_V2), "sequence", "'ggsq' sequence file (version 3 or 2)") if seq_id >= 0
                            else ((GGSN,), "session", "'ggsn' session file (version 10)"))
    with open(path, "rb") as file:
        check_file(file, op, "read", "reading")
        header = file.read(FILE_HEADER.size)
        if len(header) < FILE_HEADER.size:
            raise StateError(f"{path}: {len(header)} bytes, shorter than a {kind} file's header")
        magic, version, n_tokens = FILE_HEADER.unpack(header)
        framing = next((f for f in formats if (magic, version) == (f.magic, f.version)), None)
        if framing is None:
            june = seq_id < 0 and (magic, version) == (GGSN_V9.magic, GGSN_V9.version)
            raise StateError(f"{path}: magic {magic:#010x} version {version}: "
                             + ("a June-2025 session file (version 9): a HybridCache reads version 10" if june else
                                f"not a {named}"))
        if n_tokens > max_tokens:
            raise StateError(f"{path}: n_token_count {n_tokens} is more than max_tokens {max_tokens}")
        token_bytes = file.read(4 * n_tokens)
        if len(token_bytes) < 4 * n_tokens:
            raise StateError(f"{path}: {n_tokens} tokens claimed, the file ends after {len(token_bytes) // 4}")
        bound = cache.seq_state_bound() if seq_id >= 0 else cache.state_bound() + 4 + MAX_ARCH
        state = file.read(bound + 1)
    if len(state) > bound:
        raise StateError(f"{path}: the state after the tokens is longer than a {'sequence of ' if seq_id >= 0 else ''}"
                         f"this memory can be ({bound} bytes)")
    try:
        cache.state_read(state, seq_id, arch, framing="bare" if seq_id >= 0 else "llama")
    except StateError as exc:
        raise StateError(f"{path}: the state at byte {FILE_HEADER.size + 4 * n_tokens}: {exc}") from None
    return np.frombuffer(token_bytes, dtype="<i4").astype(np.int32)


def _load(path: str, op: str, cache: Any, seq_id: int, max_tokens: int, arch: str | None,
          kv_section: bool, kv_cell_ext: bool | None) -> np.ndarray:
    max_tokens = _args.count(max_tokens, f"{op}: max_tokens", 0, int32_only=False)
    with open(path, "rb") as file:
        try:
            contents: FileContents = read_file(file, path, Geometry.of(cache), seq_id, sequence_file=True,
                                               max_tokens=max_tokens, arch=arch, kv_section=kv_section,
                                               kv_cell_ext=kv_cell_ext)
        except StateError as exc:
            raise StateError(f"{path}: {exc}") from None
    try:
        cache.state_read(contents.data, seq_id, framing="bare")
    except StateError as exc:   # checked above already: only a rule the parse does not know lands here
        raise StateError(f"{path}: the state blob at byte {contents.blob_offset}: {exc}") from None
    assert contents.tokens is not None   # a state file always has them (sequence_file=True)
    return contents.tokens
