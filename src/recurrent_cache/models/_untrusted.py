"""Reading untrusted model files: regular files only, with a size cap, and their values quoted short.

A checkpoint directory is input from anyone: a FIFO named ``config.json``
would block ``open`` forever and a symlink to ``/dev/zero`` would read until
memory runs out.  The file is opened without blocking (a FIFO without a writer
opens at once) and its kind is checked on the open descriptor, so what is
read is what was checked.  Symlinks to regular files are followed: the
Hugging Face hub's cache links every checkpoint file into its blob store.
"""

from __future__ import annotations

import errno
import os
import stat
from typing import Any, BinaryIO

__all__ = ["open_regular", "read_capped", "short_repr"]

_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def open_regular(path: str | os.PathLike[str], error: type[Exception]) -> BinaryIO:
    """``path`` opened for binary reading; ``error`` saying what it is when it is a FIFO, a device or a socket.

    ``OSError`` when it cannot be opened (missing, unreadable) and ``IsADirectoryError`` for a directory, as
    ``open`` raises them.  The messages leave the path to the caller.
    """
    descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    try:
        mode = os.fstat(descriptor).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), os.fspath(path))
        if not stat.S_ISREG(mode):
            kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
            raise error(f"it is {kind}, not a regular file")
        return os.fdopen(descriptor, "rb")
    except BaseException:
        os.close(descriptor)
        raise


def read_capped(path: str | os.PathLike[str], limit: int, error: type[Exception]) -> bytes:
    """The bytes of the regular file ``path`` (``open_regular``); ``error`` when it holds more than ``limit``."""
    with open_regular(path, error) as handle:
        size = os.fstat(handle.fileno()).st_size
        data = handle.read(limit + 1) if size <= limit else b""
        if size > limit or len(data) > limit:
            raise error(f"it has {max(size, len(data)):,} bytes, more than the {limit:,} this loader reads of it")
    return data


def short_repr(value: Any) -> str:
    """``repr(value)`` cut to what a one-line message can carry (a hostile file's values may be huge)."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
