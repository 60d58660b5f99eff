"""Files written whole or not at all: every file the package writes goes through ``atomic_write``.

A file is written under a temporary name in its own directory (a rename
across file systems would copy), synced, and renamed over its target only
once complete: the target holds either its old content or the whole new
file, never part of one, and a write that fails part-way (a full disk, a
killed writer, an exception) leaves the old file as it was and removes the
temporary one.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator

__all__ = ["atomic_write"]

_BINARY = getattr(os, "O_BINARY", 0)


@contextlib.contextmanager
def atomic_write(path: str, temporary_prefix: str | None = None) -> Iterator[str]:
    """The path of a new, empty temporary file next to ``path``, for the block to write.

    When the block ends, the temporary file is synced (fsync) and renamed over
    ``path``; when it raises (or the sync or the rename fails), the temporary
    file is removed, ``path`` is left untouched and the exception goes on.
    The temporary file is ``.NAME.<16 hex digits>.tmp`` (``NAME`` the target's
    name), or ``temporary_prefix.<16 hex digits>.tmp``: a directory's own
    cleanup can recognise what a killed writer left.  It is created with
    mode 0o666 less the umask, as ``open`` would create ``path`` itself.
    """
    directory, name = os.path.split(os.path.abspath(path))
    prefix = f".{name}" if temporary_prefix is None else temporary_prefix
    temporary = os.path.join(directory, f"{prefix}.{secrets.token_hex(8)}.tmp")
    # O_EXCL: never another writer's file; os.open honours the umask (tempfile.mkstemp would make it 0600)
    os.close(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _BINARY, 0o666))
    try:
        yield temporary
        handle = os.open(temporary, os.O_WRONLY | _BINARY)   # fsync syncs the file, whichever handle wrote
        try:
            os.fsync(handle)
        finally:
            os.close(handle)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
