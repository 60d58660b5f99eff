"""Binary files and buffers a state is read from or written to, bounded by what headers claim.

``FileReader`` offers ``MemoryReader``'s calls over a binary file from its position, so the
one parser (``formats.blob.parse_section``) reads a file as it reads memory: nothing is read
before a header asks for it, and a stream (pipe, FIFO, device) never past what the headers
claim.  ``write_all`` writes a chunk whatever ``write`` returns; ``target_view`` is the buffer
(or file) ``state_write_into`` writes to.
"""

from __future__ import annotations

import io
import os
import stat
import struct
from collections.abc import Callable, Iterator
from typing import Any

from .. import _args
from ..errors import ArgumentError, StateError
from .blob import byte_view, charge_skip
from .messages import file_shrank, stream_trailing, trailing, truncated

__all__ = ["check_file", "target_view", "write_all", "FileReader", "truncation"]


def check_file(file: Any, op: str, method: str, mode: str) -> None:
    """ArgumentError unless ``file`` is an open binary file that can ``method`` ("read" or "write")."""
    if isinstance(file, io.TextIOBase):
        raise ArgumentError(f"{op}: the file is a text file; open it in binary mode")
    if not callable(getattr(file, method, None)):
        raise ArgumentError(f"{op} takes a binary file, got {type(file).__name__}")
    if getattr(file, "closed", False) is True:
        raise ArgumentError(f"{op}: the file is closed")
    able = getattr(file, {"read": "readable", "write": "writable"}[method], None)
    if callable(able):
        try:
            usable = able()
        except (OSError, ValueError) as exc:
            raise ArgumentError(f"{op}: the file cannot be used: {exc}") from None
        if usable is False:
            raise ArgumentError(f"{op}: the file is not open for {mode}")


def target_view(target: Any) -> memoryview | None:
    """A writable byte view of ``target``, or None when it is not a buffer (a file, then)."""
    if isinstance(target, io.TextIOBase):
        raise ArgumentError("state_write_into: the target is a text file; open it in binary mode")
    try:
        view = byte_view(target)
    except TypeError:
        if callable(getattr(target, "write", None)):
            check_file(target, "state_write_into", "write", "writing")
            return None
        raise ArgumentError(f"state_write_into: the target must be a writable buffer or a binary "
                            f"file, got {type(target).__name__}") from None
    except ArgumentError as exc:
        raise ArgumentError(f"state_write_into: {exc}") from None
    if view.readonly:
        raise ArgumentError(f"state_write_into: the target ({type(target).__name__}) is read-only")
    return view


def write_all(file: Any, chunk: Any) -> None:
    """Write every byte of ``chunk`` to a binary file; never loops without progress.

    ``file.write`` may write less than asked (a raw file); the rest is written
    again.  What it returns decides:

    * an integer ``n`` with ``0 < n <= len``: ``n`` bytes were written;
    * ``None`` from an ``io.RawIOBase``: nothing was written, the file would
      block (io's protocol) - an ``ArgumentError``;
    * ``None`` from any other object: everything was written.  Duck-typed
      writers (a class with ``write`` appending to a list) return None, and
      ``shutil.copyfileobj`` and ``print(file=...)`` read it the same way;
    * 0, a negative number, more than asked or a non-integer: an
      ``ArgumentError`` naming the value, since retrying could spin forever.

    Bytes already written stay written: a file cannot be un-written.
    """
    view = memoryview(chunk).cast("B")
    total = len(view)
    while len(view):
        written = file.write(view)
        done = total - len(view)
        if written is None:
            if isinstance(file, io.RawIOBase):
                raise ArgumentError(f"state_write_into: the file would block (a non-blocking raw file "
                                    f"returned None) after {done} of {total} bytes of this part")
            return
        written = _args.integer(written, f"state_write_into: the file's write() result after {done} of "
                                         f"{total} bytes of this part")
        if not 0 < written <= len(view):
            raise ArgumentError(f"state_write_into: the file's write() of {len(view)} bytes returned "
                                f"{int(written)} (after {done} of {total} bytes of this part; "
                                f"expected 1 to {len(view)})")
        view = view[int(written):]


# -- reading a blob or a sequence file from a file, bounded by its headers -----

_CHUNK = 1 << 20   # a stream is read in pieces: memory grows with the data that came, not the claims


def _remaining(file: Any) -> int | None:
    """Bytes from the file's position to its end when that is known (a non-empty regular
    file, a seekable in-memory file); None for a pipe, FIFO, device or socket."""
    try:
        fileno = file.fileno()
    except (AttributeError, OSError, ValueError, TypeError):
        fileno = None
    try:
        if isinstance(fileno, int):
            info = os.fstat(fileno)
            # st_size 0 is also what /proc files report, so such a file is read as a stream
            if not stat.S_ISREG(info.st_mode) or info.st_size == 0:
                return None
            return max(0, info.st_size - int(file.tell()))
        if file.seekable():
            here = file.tell()
            end = file.seek(0, io.SEEK_END)
            file.seek(here)
            return max(0, end - here) if isinstance(end, int) and isinstance(here, int) else None
    except (AttributeError, OSError, ValueError, TypeError):
        pass
    return None


class FileReader:
    """The ``MemoryReader`` calls over a binary file, from its position.

    Nothing is read before a header asks for it.  When the file's length is
    known, every claim is checked against it before a byte is read, rows are
    stepped over with ``seek`` and read in one piece at the end; a stream
    (pipe, FIFO, device) is read piece by piece up to what the headers claim,
    then one byte more to prove it ends there.  With ``rows`` the rows are
    handed to it piece by piece as they are read and not kept at all.
    """

    def __init__(self, file: Any, op: str, rows: Any = None) -> None:
        self.file = file
        self.op = op                 # who reads, for the messages: "state_read_from", a path, ...
        self.rows = rows
        self.offset = 0              # relative to the start (see ``rebase``)
        self.skipped = 0             # bytes of framing stepped over (``charge_skip``)
        self.pending = b""           # bytes read by ``peek``, served first
        self.length = _remaining(file)
        self.start = file.tell() if self.length is not None else 0
        # a stream keeps what it read (it cannot be read again); not with a rows consumer
        self.kept: bytearray | None = bytearray() if self.length is None and rows is None else None

    def read_up_to(self, n: int) -> bytes:
        """Up to n bytes (fewer only at the end of the file)."""
        if self.pending:
            piece, self.pending = self.pending[:n], self.pending[n:]
            return piece
        piece = self.file.read(n)
        if piece is None:
            raise ArgumentError(f"{self.op}: the file would block (a non-blocking file with no data ready)")
        try:
            size = memoryview(piece).nbytes
        except TypeError:
            raise ArgumentError(f"{self.op}: the file's read() returned {type(piece).__name__}, "
                                f"not bytes") from None
        if size > n:
            raise ArgumentError(f"{self.op}: the file's read({n}) returned {size} bytes")
        return bytes(piece)

    def _pieces(self, n: int) -> Iterator[bytes]:
        """n bytes in pieces of at most _CHUNK; stops early at the end of the file."""
        while n > 0:
            piece = self.read_up_to(min(n, _CHUNK))
            if not piece:
                return
            n -= len(piece)
            yield piece

    def take(self, n: int, short: Any) -> bytes:
        """The next n bytes; ``short(offset, n, length)`` is the error when fewer are left."""
        at = self.offset
        if self.length is not None and self.length - at < n:
            raise short(at, n, self.length)
        data = bytearray()
        for piece in self._pieces(n):
            data += piece
        if len(data) < n:   # a stream ended (or a file shrank since its length was taken)
            raise short(at, n, at + len(data))
        if self.kept is not None:
            self.kept += data
        self.offset += n
        return bytes(data)

    def peek(self, n: int) -> bytes:
        """Up to n bytes at the cursor, without moving it."""
        data = b"".join(self._pieces(n))
        self.pending = data + self.pending
        return data

    def unpack(self, layout: struct.Struct, field: str) -> tuple[tuple[Any, ...], int]:
        at = self.offset
        return layout.unpack(self.take(layout.size, truncation(field))), at

    def ids(self, count: int, field: str) -> tuple[tuple[int, ...], int]:
        at = self.offset
        return struct.unpack(f"<{count}i", self.take(4 * count, truncation(field))), at

    def step_over(self, n: int, field: str) -> int:
        """Step over n bytes of a framing: the rows consumer does not see them, and a stream's
        are read in pieces and dropped (framing is never part of the blob that is kept)."""
        if self.length is None or self.length - self.offset >= n:   # past a file's end: truncated
            self.skipped = charge_skip(self.skipped, n, field, self.offset)
        if self.rows is None and self.length is not None:
            return self.skip(n, field)
        if self.length is None:
            at = self.offset
            got = sum(len(piece) for piece in self._pieces(n))
            if got < n:
                raise truncated(field, at, n, at + got)
            self.offset += n
            return at
        rows, self.rows = self.rows, None
        try:
            return self.skip(n, field)
        finally:
            self.rows = rows

    def skip(self, n: int, field: str) -> int:
        at = self.offset
        if self.length is not None and self.length - at < n:
            raise truncated(field, at, n, self.length)
        if self.rows is None and self.kept is None:
            served = min(n, len(self.pending))   # bytes a peek read ahead, then the rest by seeking
            self.pending = self.pending[served:]
            if n > served:
                self.file.seek(n - served, io.SEEK_CUR)
        else:
            got = 0
            for piece in self._pieces(n):
                got += len(piece)
                if self.rows is not None:
                    self.rows(piece)
                elif self.kept is not None:
                    self.kept += piece
            if got < n:
                raise truncated(field, at, n, at + got)
        self.offset += n
        return at

    def rebase(self) -> None:
        """Make the current position offset 0 (the blob of a sequence file starts here)."""
        if self.length is not None:
            self.start += self.offset
            self.length -= self.offset
        if self.kept is not None:
            del self.kept[:]
        self.offset = 0

    def finish(self) -> bytearray | None:
        """The bytes from offset 0 to the cursor (None with a rows consumer), once the file
        is proven to end there."""
        end = self.offset
        if self.length is not None and end != self.length:
            raise trailing(end, self.length)
        if self.read_up_to(1):
            raise stream_trailing(end, grew=self.length is not None)
        if self.kept is not None or self.rows is not None:
            return self.kept   # a stream is never read past what a header claims: exactly the blob
        self.file.seek(self.start)
        data = bytearray(end)
        view = memoryview(data)
        got = 0
        for piece in self._pieces(end):
            view[got:got + len(piece)] = piece
            got += len(piece)
        view.release()
        if got < end:
            raise file_shrank(got, end)
        return data


def truncation(field: str) -> Callable[[int, int, int], StateError]:
    """The ``short`` error of ``take`` for a field: ``truncated`` naming it."""
    return lambda at, n, length: truncated(field, at, n, length)

