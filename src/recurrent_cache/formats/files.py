"""A state read whole from a binary file or from memory: ``read_file``, ``read_rest``,
``parse_seq_file_header``.

``read_file`` finds the framing (``formats.framings``), then parses the memory section
(``formats.blob``) from a ``formats.streams.FileReader``, with every check against the cache on
the way: only what the headers claim is read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import StateError
from .blob import Blob, MemoryReader, blob_view, parse_section
from .framings import Framing, in_section, read_framing, read_seq_file_header
from .geometry import Geometry
from .layouts import MAX_TOKENS
from .streams import FileReader, check_file

__all__ = ["read_rest", "parse_seq_file_header", "FileContents", "read_file"]


def read_rest(file: Any, cache: Geometry | None = None, seq_id: int = -1) -> bytearray:
    """The blob of ``state_read_from``: one blob from a binary file's position to its end.

    Reads only what the blob's headers claim (and one byte more to prove the
    file ends there), so ``/dev/zero``, an endless pipe or a huge file with a
    short header are rejected without reading them; with ``cache`` every
    check of ``parse_blob`` is made on the way, which bounds the read by the
    cache's own state size.
    """
    data: bytearray = read_file(file, "state_read_from", cache, seq_id, sequence_file=False).data
    return data


def parse_seq_file_header(data: Any, max_tokens: int = MAX_TOKENS) -> tuple[np.ndarray, int]:
    """The tokens of a 'ggsq' sequence file in memory and the offset where its state blob starts."""
    reader = MemoryReader(blob_view(data))
    tokens, _ = read_seq_file_header(reader, max_tokens)
    return tokens, reader.offset


@dataclass(frozen=True)
class FileContents:
    """A state blob or file, read and checked."""

    tokens: np.ndarray | None    # a state file's tokens (int32); None for a blob
    blob_offset: int             # where the recurrent memory section starts in the file
    blob: Blob
    data: Any                    # the section's bytes (bytes-like); None when read with ``rows``
    framing: Framing


def read_file(file: Any, op: str, cache: Geometry | None = None, seq_id: int | None = -1,
              sequence_file: bool | None = None, watch: Any = None, rows: Any = None,
              max_tokens: int = MAX_TOKENS, arch: str | None = None, kv_section: bool = False,
              framing: str | None = None, kv_cell_ext: bool | None = None,
              layers: Sequence[int] | None = None, infer_layers: bool = False) -> FileContents:
    """Read a blob (``sequence_file=False``), a state file (True) or either (None: by its magic)
    in any framing (``read_framing``) from a binary file's position to its end, with every
    check of ``parse_blob`` on its memory section.

    Only what the headers claim is read, and one byte more to prove the file
    ends there: ``/dev/zero``, an endless FIFO or a huge file with a short
    header are rejected after a few bytes.  With ``cache`` the claims are
    checked against the cache on the way (a sequence blob of one cell, the
    cache's row sizes), so no more than the cache's own state is ever read.
    A defect of the memory section is reported at its offset in the file;
    a state file with more than ``max_tokens`` tokens is refused at its header.
    ``watch`` and ``rows`` are for ``inspect`` (``seq_id`` None: any framing): ``watch`` sees
    the headers before any row (see ``parse_section``), ``rows(piece)`` takes the rows as they are
    read, which are then not kept (``data`` is None).  ``layers``: without ``cache``, the
    layers whose r and s sections the memory section holds (a hybrid's; None: every layer);
    ``infer_layers``: without either, a section with no layer's rows is read (see ``parse_section``).
    Telling a bare section from a June-2025 context blob reads a stream's blob twice (the
    first time kept in memory).
    """
    check_file(file, op, "read", "reading")
    reader = FileReader(file, op, rows)
    found = read_framing(reader, seq_id, arch, kv_section, max_tokens, sequence_file, cache, framing,
                         kv_cell_ext, layers, watch)
    blob_offset = reader.offset
    reader.rebase()
    try:
        blob = parse_section(reader, cache, -1 if seq_id is None else seq_id, watch, layers, infer_layers)
        data = reader.finish()
    except StateError as exc:
        raise in_section(exc, found) from None
    return FileContents(found.tokens, blob_offset, blob, data, found)

