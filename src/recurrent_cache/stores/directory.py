"""``DirectoryStore``: snapshot entries as llama.cpp sequence files in one directory.

Layout, for a key whose digest (``sha256(key)[:16]``, hex) is ``D``::

    D.ggsq              -> D.CCCCCCCC.ggsq   a symbolic link: the key's current entry
    D.CCCCCCCC.ggsq     the ggsq file (docs/concepts.md §5) of the entry, CCCCCCCC its CRC-32 in hex
    .D.<random>.tmp     a file being written (a writer killed now leaves only this)
    .D.<random>.lnk     a link being made, renamed over ``D.ggsq`` next

``<random>`` is 16 hex digits.  The store only ever deletes files named
exactly like this (``D`` 32 hex digits, ``CCCCCCCC`` 8): whatever else is in
the directory is another program's and is left alone.  A file named like an
entry that the store did not write (a FIFO, a device, a link to elsewhere, a
file larger than its own header says) is a damaged entry: a miss, counted
and logged, never a read that blocks or one larger than the entry can be.

Every file that ends in ``.ggsq`` is a plain 'ggsq' file: ``python -m
recurrent_cache inspect D.ggsq`` and llama.cpp's ``llama_state_seq_load_file``
read it as it is.  The entry's trailer (snapshot.py) is not in the file —
``inspect`` rejects a blob with trailing bytes — but in the names: the key's
digest is the file name, the CRC-32 the part after it.  A reader follows the
link, reads the file and checks its CRC-32 and length before it hands it out.

Writes are atomic without locks, so any number of processes can share the
directory: the ggsq file is written under a temporary name and renamed to its
final name, then a new link is made under a temporary name and renamed over
``D.ggsq``.  A reader sees the old entry, the new one or none, never part of
one; a writer killed at any point leaves a temporary file or a file no link
points to (both removed by a later scan once ten minutes old), or a
complete entry.  A ``put`` never deletes a file: another writer of the same
key may be about to link to it, so a ``put`` that returned True leaves an
entry that stays readable until it is evicted (the last writer's link points
at a complete file); the file of an entry replaced by other content is
removed by a later scan once no link has pointed to it for ten minutes.
An entry's file is synced (fsync) before it is renamed, as every file the
package writes is (``recurrent_cache.atomic_write``); the links are not, so
after a power cut an entry can be lost, and the CRC-32 turns any damage into
a miss.

Size cap: with ``max_bytes``, every process scans the directory once it has
written an eighth of the cap since its last scan (or when its last total plus
what it wrote exceeds the cap), and removes the least recently used files
(every hit sets the file's mtime) until the total fits.  Between scans the
directory can exceed the cap by what the processes wrote since their last
scans.  Needs a POSIX file system (symbolic links, atomic rename).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import secrets
import stat
import struct
import time
from typing import Any
from collections.abc import Sequence

from .. import _args
from ..atomic_write import atomic_write
from ..errors import ArgumentError
from .base import StoreCounters
from .snapshot import (TRAILER_SIZE, check_entry, entry_ggsq_length, ggsq_declared_length, key_digest,
                       make_trailer)

__all__ = ["DirectoryStore"]

log = logging.getLogger("recurrent_cache.stores")

_DATA = re.compile(r"^([0-9a-f]{32})\.([0-9a-f]{8})\.ggsq$")
_LINK = re.compile(r"^([0-9a-f]{32})\.ggsq$")
_TEMPORARY = re.compile(r"^\.[0-9a-f]{32}\.[0-9a-f]{16}\.(tmp|lnk)$")   # _write_file's and put's
STALE_SECONDS = 600   # a temporary file this old belongs to a writer that died


class DirectoryStore:
    """Snapshot entries in ``path`` (created if missing), at most ``max_bytes`` of them (None: no cap).

    Implements the store interface of ``recurrent_cache.stores``.  I/O errors
    (disk full, permissions, a vanished directory) are logged once and
    counted in ``stats()["errors"]``; the call then answers a miss or skips
    the write, and never raises into the serving loop.
    """

    def __init__(self, path: str | bytes | os.PathLike[str] | os.PathLike[bytes], max_bytes: int | None = None) -> None:
        if max_bytes is not None:
            max_bytes = _args.count(max_bytes, "DirectoryStore: max_bytes", 1, int32_only=False)
        self.path = os.path.abspath(_args.path(path, "DirectoryStore: path"))
        try:
            os.makedirs(self.path, exist_ok=True)
        except OSError as exc:
            raise ArgumentError(f"DirectoryStore cannot use {self.path}: {exc.strerror or exc}") from None
        if not os.path.isdir(self.path):
            raise ArgumentError(f"DirectoryStore path {self.path} is not a directory")
        self.max_bytes = max_bytes
        self._counters = StoreCounters()
        self._warned = False
        self._last_total = 0              # bytes found by the last scan
        self._written_since_scan = 0      # bytes this process wrote since then
        self._evictions = 0

    def __repr__(self) -> str:
        return f"DirectoryStore({self.path!r}, max_bytes={self.max_bytes!r})"

    # -- the store interface ---------------------------------------------------------

    def get_many(self, keys: Sequence[str]) -> list[bytearray | None]:
        """The entry of every key (None: missing, or damaged and then removed)."""
        self._counters.add(lookups=1)
        return [self._read(key) for key in keys]

    def get_first(self, keys: Sequence[str]) -> tuple[int, bytearray] | None:
        """``(i, entry)`` for the first key in ``keys`` that has an intact entry, or None.

        Pass the candidates longest prefix first: only the entry returned is read.
        """
        self._counters.add(lookups=1)
        for i, key in enumerate(keys):
            entry = self._read(key)
            if entry is not None:
                return i, entry
        return None

    def put(self, key: str, entry: Any) -> bool:
        """Store ``entry`` (from ``encode_snapshot`` under ``key``); False if it was there already or failed."""
        length = entry_ggsq_length(key, entry)
        if length is None:
            raise ArgumentError("put() takes an entry made by encode_snapshot for the same key "
                                "(its trailer does not name this key)")
        view = memoryview(entry).cast("B")
        (crc,) = struct.unpack_from("<I", view, length + 4)
        digest = key_digest(key).hex()
        data_name = f"{digest}.{crc:08x}.ggsq"
        link = os.path.join(self.path, f"{digest}.ggsq")
        previous = None
        with contextlib.suppress(OSError):
            previous = os.readlink(link)
        if previous == data_name:
            with contextlib.suppress(OSError):   # its file is gone: write it again
                os.utime(os.path.join(self.path, data_name), follow_symlinks=False)
                self._counters.add(put_skipped=1)
                return False
        try:
            self._write_file(os.path.join(self.path, data_name), view[:length], f".{digest}")
            temporary_link = os.path.join(self.path, f".{digest}.{secrets.token_hex(8)}.lnk")
            os.symlink(data_name, temporary_link)
            try:
                os.replace(temporary_link, link)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(temporary_link)
                raise
        except OSError as exc:
            self._error(f"cannot write {data_name}", exc)
            return False
        # The file of an entry this one replaced (other content under the key) is not removed here:
        # a writer of that content may be linking to it now, and its put must stay readable.  Once
        # no link has pointed to it for STALE_SECONDS, a scan removes it.
        self._counters.add(puts=1, bytes_written=len(view))
        self._written_since_scan += length
        if self.max_bytes is not None and (self._written_since_scan > self.max_bytes // 8
                                           or self._last_total + self._written_since_scan > self.max_bytes):
            self._scan(evict=True)
        return True

    def stats(self) -> dict[str, Any]:
        """Counters of this process (``lookups`` calls; ``hits``, ``misses``, ``damaged`` keys;
        ``errors``, ``puts``, ``put_skipped``, ``bytes_read``, ``bytes_written``, ``evictions``)
        and, from a scan of the directory now, ``bytes`` and ``entries`` of every process."""
        total, count = self._scan(evict=False)
        return {**self._counters.snapshot(), "evictions": self._evictions, "bytes": total,
                "entries": count, "max_bytes": self.max_bytes, "path": self.path}

    # -- reading -------------------------------------------------------------------

    def _read(self, key: str) -> bytearray | None:
        digest = key_digest(key).hex()
        link = os.path.join(self.path, f"{digest}.ggsq")
        try:
            target = os.readlink(link)
        except FileNotFoundError:
            self._counters.add(misses=1)
            return None
        except OSError as exc:
            if exc.errno == errno.EINVAL:    # not a link: something else wrote there
                self._damaged(key, link, None)
                return None
            self._error(f"cannot read {link}", exc)
            self._counters.add(misses=1)
            return None
        match = _DATA.match(target)
        if match is None or match.group(1) != digest:
            self._damaged(key, link, None)
            return None
        data_path = os.path.join(self.path, target)
        try:
            entry = self._read_data(data_path)
        except FileNotFoundError:          # removed (evicted) since the link was read
            self._counters.add(misses=1)
            return None
        except OSError as exc:
            # a link (ELOOP; EMLINK on some BSDs) or a socket (ENXIO) where an entry's file should be
            if exc.errno in (errno.ELOOP, errno.EMLINK, errno.ENXIO):
                self._damaged(key, link, None)
                return None
            self._error(f"cannot read {data_path}", exc)
            self._counters.add(misses=1)
            return None
        if entry is None:
            self._damaged(key, link, None)
            return None
        size = len(entry) - TRAILER_SIZE
        view = memoryview(entry)
        view[size:] = make_trailer(int(match.group(2), 16), size, bytes.fromhex(digest))
        if not check_entry(key, entry):
            self._damaged(key, link, data_path)
            return None
        self._counters.add(hits=1, bytes_read=len(entry))
        return entry

    def _read_data(self, data_path: str) -> bytearray | None:
        """The content of an entry's file, with room for the trailer after it.

        None when the file is not one this store could have written: not a
        regular file (a FIFO is opened without blocking and not read), or not
        the length its own headers declare (a larger file is not read past
        its headers), or shorter than its size when read.
        """
        flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_BINARY", 0)
        handle = os.open(data_path, flags)
        try:
            st = os.fstat(handle)
            if not stat.S_ISREG(st.st_mode):
                return None
            size = st.st_size
            if ggsq_declared_length(lambda offset, n: os.pread(handle, n, offset), size) != size:
                return None
            entry = bytearray(size + TRAILER_SIZE)
            view = memoryview(entry)
            done = 0
            while done < size:
                n = os.readv(handle, [view[done:size]])
                if not n:
                    return None   # shorter than fstat said: truncated meanwhile
                done += n
            # the hit makes this the most recently used entry
            with contextlib.suppress(OSError):
                os.utime(handle)
            return entry
        finally:
            os.close(handle)

    def _damaged(self, key: str, link: str, data_path: str | None) -> None:
        """Count a damaged entry and remove it, so that no process reads it again.

        Only files the store could have written are removed (``link`` if it is
        a symbolic link, ``data_path`` if it is a regular file); anything else
        named like an entry is another program's, left alone and a miss.
        """
        self._counters.add(damaged=1, misses=1)
        log.info("DirectoryStore %s: removed a damaged entry (%s)", self.path, os.path.basename(link))
        for path, ours in ((data_path, stat.S_ISREG), (link, stat.S_ISLNK)):
            if path is not None:
                with contextlib.suppress(OSError):
                    if ours(os.lstat(path).st_mode):
                        os.unlink(path)

    # -- writing -------------------------------------------------------------------

    def _write_file(self, path: str, data: memoryview, prefix: str) -> None:
        """Write ``data`` to ``path`` whole or not at all (``atomic_write``), through a
        temporary file named ``prefix.<random>.tmp`` that a scan recognises."""
        with atomic_write(path, prefix) as temporary, open(temporary, "wb") as file:
            file.write(data)   # a buffered file writes every byte or raises

    # -- size -----------------------------------------------------------------------

    def _scan(self, evict: bool) -> tuple[int, int]:
        """Total bytes and entry files now; with ``evict``, first bring the total under the cap.

        Also removes what dead or racing writers left: temporary files and
        files no link points to, once older than STALE_SECONDS, and links
        whose file is gone.
        """
        data: list[tuple[float, int, str]] = []   # (mtime, size, name)
        links: list[str] = []
        total = 0
        now = time.time()
        try:
            with os.scandir(self.path) as entries:
                for item in entries:
                    try:
                        if _DATA.match(item.name) and item.is_file(follow_symlinks=False):
                            st = item.stat(follow_symlinks=False)
                            data.append((st.st_mtime, st.st_size, item.name))
                            total += st.st_size
                        elif _LINK.match(item.name) and item.is_symlink():
                            links.append(item.name)
                        elif _TEMPORARY.match(item.name) and (
                                item.is_symlink() if item.name.endswith(".lnk")
                                else item.is_file(follow_symlinks=False)):
                            st = item.stat(follow_symlinks=False)
                            if now - st.st_mtime > STALE_SECONDS:
                                os.unlink(item.path)
                            else:
                                total += st.st_size
                    except FileNotFoundError:   # another process removed it meanwhile
                        continue
        except OSError as exc:
            self._error(f"cannot scan {self.path}", exc)
            return self._last_total, 0
        linked = set()
        for name in links:
            with contextlib.suppress(OSError):
                linked.add(os.readlink(os.path.join(self.path, name)))
        kept = []
        for mtime, size, name in data:
            if name not in linked and now - mtime > STALE_SECONDS and self._still_stale(name, now):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(self.path, name))
                total -= size
            else:
                kept.append((mtime, size, name))
        data = kept
        count = len(data)
        if evict and self.max_bytes is not None and total > self.max_bytes:
            data.sort()
            for _, size, name in data:
                if total <= self.max_bytes:
                    break
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(self.path, name))
                    self._evictions += 1
                total -= size
                count -= 1
                link = os.path.join(self.path, name[:32] + ".ggsq")
                with contextlib.suppress(OSError):
                    if os.readlink(link) == name:
                        os.unlink(link)
        for name in links:
            path = os.path.join(self.path, name)
            with contextlib.suppress(OSError):
                if not os.path.exists(path):   # its file was removed
                    os.unlink(path)
        self._last_total = total
        self._written_since_scan = 0
        return total, count

    def _still_stale(self, name: str, now: float) -> bool:
        """Whether the orphan ``name`` is still an old file no link points to, just before it is removed.

        Since the scan listed it, a writer may have written it again (a fresh file under the
        same name) and linked to it: such a file is young now, or linked, and is kept.
        """
        try:
            young = now - os.lstat(os.path.join(self.path, name)).st_mtime <= STALE_SECONDS
            return not young and os.readlink(os.path.join(self.path, name[:32] + ".ggsq")) != name
        except FileNotFoundError:
            return True    # gone already, or no link under its digest
        except OSError:
            return True    # its digest's name is not a link: nothing of the store links to it

    def _error(self, what: str, exc: OSError) -> None:
        self._counters.add(errors=1)
        level = logging.DEBUG if self._warned else logging.WARNING
        self._warned = True
        log.log(level, "DirectoryStore %s: %s: %s (counted in stats()['errors'], logged once)",
                self.path, what, exc.strerror or exc)
