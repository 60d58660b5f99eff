"""One copy of each core piece: the storage's ``host_access`` flag decides which path moves the rows
(the row mover copies at once or records), one blob composer serves every writer, and the error
codes are declared from one table (``tools/error_codes.py``)."""

from __future__ import annotations

import importlib.util
import io
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

import recurrent_cache as rc
from recurrent_cache.storage import NumpyStorage, has_host_access

ROOT = Path(__file__).resolve().parents[2]


class ViewingStorage:
    """Numpy's work, every take / put / zero counted, and host views handed out whenever asked:
    only the flag (``host_access``, or its absence) may decide that the core does not use them."""

    name = "viewing"
    device = "cpu"

    def __init__(self) -> None:
        self.inner = NumpyStorage()
        self.moves = 0

    def allocate(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        return self.inner.allocate(shape, dtype)

    def host_view(self, tensor: np.ndarray) -> np.ndarray:
        return tensor

    def take(self, tensor: np.ndarray, rows: np.ndarray) -> np.ndarray:
        self.moves += 1
        return self.inner.take(tensor, rows)

    def put(self, tensor: np.ndarray, rows: np.ndarray, values: np.ndarray) -> None:
        self.moves += 1
        self.inner.put(tensor, rows, values)

    def zero(self, tensor: np.ndarray, rows: np.ndarray) -> None:
        self.moves += 1
        self.inner.zero(tensor, rows)

    def stack(self, rows: Any, dtype: Any) -> np.ndarray:
        return self.inner.stack(rows, dtype)

    def to_host(self, tensor: np.ndarray) -> np.ndarray:
        return self.inner.to_host(tensor)

    def from_host(self, array: np.ndarray, dtype: Any) -> np.ndarray:
        return self.inner.from_host(array, dtype)


class FlaggedStorage(ViewingStorage):
    """The same, saying it has no host access although its host_view would give one."""

    host_access = False


def script(cache: rc.RecurrentCache) -> list[bytes]:
    """Prompts, a copied sequence decoded apart (its rows copied on write), a rollback and a clear
    of one sequence: the blobs after each step."""
    blobs = []
    cache.state_read(cache.state_write())   # nothing yet
    for u, _ in enumerate(st := cache.init_batch(rc.Batch(token=[1, 2, 3, 4], seq_id=[0, 0, 1, 1],
                                                             pos=[0, 1, 0, 1]), n_ubatch=2)):
        for il in cache.layers:
            st.r(il)[...] = np.arange(st.r(il).size, dtype=np.float32).reshape(st.r(il).shape) + il + u
            st.s(il)[...] = 2.0 + il
    blobs.append(cache.state_write())
    cache.seq_cp(0, 2)
    for _ in (st := cache.init_batch(rc.Batch(token=[5], seq_id=[2], pos=[2]))):
        for il in cache.layers:
            st.r(il)[...] += 10.0
    blobs += [cache.state_write(), cache.state_write(2)]
    cache.seq_rm(1, -1, -1)
    blobs.append(cache.state_write())
    return blobs


def new_cache(storage: Any) -> rc.RecurrentCache:
    return rc.RecurrentCache(2, 4, 3, n_seq_max=4, storage=storage)


@pytest.mark.parametrize("storage", [FlaggedStorage, ViewingStorage], ids=["host_access=False", "no flag"])
def test_the_flag_decides_the_index_path_not_host_view(storage):
    """A storage that says host_access=False, or says nothing (one written before the flag), has its
    moves handed over as indices even though host_view would give a view; the bytes are numpy's."""
    given = storage()
    assert not has_host_access(given)
    cache = new_cache(given)
    blobs = script(cache)
    assert given.moves > 0
    assert blobs == script(new_cache("numpy"))


class Forwarding(ViewingStorage):
    """A storage wrapping what it lacks in a call counter (as bench/storage.py's did): its
    host_access is a function, which is true."""

    def __getattr__(self, name: str) -> Any:
        forwarded = getattr(self.inner, name)
        return lambda *args: forwarded(*args)


def test_a_host_access_that_is_not_a_bool_is_refused():
    with pytest.raises(rc.ConfigError, match="host_access must be True or False, not function"):
        new_cache(Forwarding())


def test_numpy_storage_has_host_access():
    assert NumpyStorage().host_access is True
    assert has_host_access(NumpyStorage())


@pytest.mark.parametrize("storage", ["numpy", FlaggedStorage], ids=["host", "index path"])
def test_every_writer_writes_the_one_blob(storage):
    """state_write, state_write_into a buffer and into a file compose the same bytes."""
    cache = new_cache(storage if isinstance(storage, str) else storage())
    script(cache)
    for seq_id in (-1, 0, 2, 3):
        blob = cache.state_write(seq_id)
        into = bytearray(len(blob))
        assert cache.state_write_into(into, seq_id) == len(blob)
        file = io.BytesIO()
        assert cache.state_write_into(file, seq_id) == len(blob)
        assert bytes(into) == file.getvalue() == blob


# -- the error codes' one table ------------------------------------------------------------------

def generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("error_codes", ROOT / "tools" / "error_codes.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_generated_regions_match_the_table():
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "error_codes.py"), "--check"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_check_mode_names_a_region_edited_by_hand(tmp_path, monkeypatch, capsys):
    codes = generator()
    package = tmp_path / "src" / "recurrent_cache"
    package.mkdir(parents=True)
    for name in ("_codes.pxd", "capi.h", "errors.py"):
        shutil.copy(codes.PACKAGE / name, package / name)
    monkeypatch.setattr(codes, "PACKAGE", package)
    header = package / "capi.h"
    edited = header.read_text().replace("#define RC_ERR_STALE (-54)", "#define RC_ERR_STALE (-64)")
    header.write_text(edited)
    assert codes.main(["--check"]) == 1
    assert "src/recurrent_cache/capi.h" in capsys.readouterr().err
    assert header.read_text() == edited            # check mode changes nothing
    assert codes.main([]) == 0 and codes.main(["--check"]) == 0
    assert "#define RC_ERR_STALE (-54)" in header.read_text()


def test_the_python_constants_are_the_tables():
    codes = generator()
    for code in codes.CODES:
        assert getattr(rc.errors, code.python) == code.value
