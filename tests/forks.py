"""A check run in a forked child, with a watchdog: what a test of fork safety needs (a child that would hang on
a lock or a thread pool its parent held is killed and reported, not waited for)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

import pytest


def check_in_forked_child(check: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    """Fork; the child runs ``check`` and exits 0 when it returns True.  Fails the test when the child hangs past
    ``timeout`` seconds (``what`` says what it waited for) or exits otherwise."""
    pid = os.fork()
    if pid == 0:
        try:
            os._exit(0 if check() else 1)
        finally:
            os._exit(2)
    deadline = time.monotonic() + timeout
    while (status := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    if status[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail(f"the forked child hung: {what}")
    assert os.waitstatus_to_exitcode(status[1]) == 0
