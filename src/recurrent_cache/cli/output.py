"""What a command does when its stdout fails: never a traceback.

``python -m recurrent_cache inspect F | head -3`` closes the pipe once the
reader has what it wanted; a Unix tool is then ended by SIGPIPE, silently, and
a shell reports status 141 (128 + SIGPIPE).  Python ignores SIGPIPE, so the
write raises ``BrokenPipeError`` instead: the command stops there, says
nothing and exits with ``READER_LEFT`` (141), as the tool would.

Any other failure means the output is lost: ``... > /dev/full`` has no room,
and ``... >&-`` starts the command without a stdout at all (``sys.stdout`` is
None).  That is one line on stderr, ``PROG: cannot write to stdout: REASON``,
and exit status ``OUTPUT_FAILED`` (1); without a stdout the command does not
run.

``guarded_stdout`` tells such a failure apart from every other ``OSError`` by
wrapping ``sys.stdout``: only writes through the wrapper raise
``OutputError``.  After one, stdout is pointed at the null device, as the
CPython documentation recommends for ``BrokenPipeError``, so that the
interpreter's own flush at exit does not fail a second time.
"""

from __future__ import annotations

import io
import os
import sys
from collections.abc import Callable
from typing import TextIO, cast

from ..errors import OutputError

__all__ = ["OUTPUT_FAILED", "READER_LEFT", "guarded_stdout"]

OUTPUT_FAILED = 1   # the exit status when stdout cannot be written
READER_LEFT = 141   # the exit status after the reader closed the pipe: a shell's for a process ended by SIGPIPE


class _GuardedStream(io.TextIOBase):
    """``stream`` with its write and flush errors raised as ``OutputError``."""

    def __init__(self, stream: TextIO) -> None:
        super().__init__()
        self.stream = stream

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except OSError as error:
            raise OutputError(error.strerror or str(error)) from error

    def flush(self) -> None:
        try:
            self.stream.flush()
        except OSError as error:
            raise OutputError(error.strerror or str(error)) from error

    def isatty(self) -> bool:
        return self.stream.isatty()

    def fileno(self) -> int:
        return self.stream.fileno()


def guarded_stdout(prog: str, command: Callable[[], int]) -> int:
    """Run ``command`` with a guarded stdout; its exit status, ``READER_LEFT`` (quietly) when the
    reader closed the pipe, or ``OUTPUT_FAILED`` after one line ``prog: cannot write to stdout:
    REASON`` on stderr when stdout is closed or a write to it failed otherwise."""
    stdout = sys.stdout
    if stdout is None:   # started with file descriptor 1 closed: whatever the command printed would be lost
        print(f"{prog}: cannot write to stdout: it is closed", file=sys.stderr)
        return OUTPUT_FAILED
    sys.stdout = cast(TextIO, _GuardedStream(stdout))
    try:
        try:
            return command()
        finally:   # also when argparse exits after --help: the text must be out before the interpreter ends
            sys.stdout.flush()
    except OutputError as failure:
        _silence(stdout)
        if isinstance(failure.__cause__, BrokenPipeError):
            return READER_LEFT
        print(f"{prog}: cannot write to stdout: {failure}", file=sys.stderr)
        return OUTPUT_FAILED
    finally:
        sys.stdout = stdout


def _silence(stream: TextIO) -> None:
    """Send what ``stream`` still holds, and whatever follows, to the null device."""
    try:
        descriptor = stream.fileno()
    except (OSError, ValueError):   # not a file (a test's StringIO): nothing is flushed at exit
        return
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, descriptor)
    finally:
        os.close(null)
