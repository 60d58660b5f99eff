"""The C API examples (Cython, C, C++) drive a cache exactly like the Python API.

Each example is built at test time with its own setup.py (Cython, setuptools,
pybind11 and a C/C++ compiler are test dependencies), runs a continuous-batching
schedule of 1,000 steps without the GIL, and must leave the cells, the head and
the state rows exactly as the same schedule driven through the Python API.
Also here: a mismatched API version fails the import with a message.
"""

from __future__ import annotations

import functools
import importlib.util
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import recurrent_cache as rc
from recurrent_cache import _capi as capi_versions

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "capi"
N_SEQS, N_STEPS, N_UBATCH, MAX_PROMPT = 32, 1000, 16, 8
NEEDS = {"cython": ["Cython", "setuptools"], "c": ["setuptools"], "cpp": ["setuptools", "pybind11"]}


def load_builder():
    spec = importlib.util.spec_from_file_location("capi_build", EXAMPLES / "build.py")
    builder = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(builder)
    return builder


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """kind -> the built extension's path (built once per test session)."""
    builder, paths = load_builder(), {}

    def get(kind: str) -> Path:
        for module in NEEDS[kind]:
            pytest.importorskip(module)
        if kind not in paths:
            paths[kind] = builder.build_example(kind, tmp_path_factory.mktemp(kind))
        return paths[kind]
    return get


@pytest.fixture(scope="module", params=["cython", "c", "cpp"])
def example(request, built):
    return load_builder().load(built(request.param))


def python_schedule(cache: rc.RecurrentCache, n_seqs: int, n_steps: int, seed: int, n_ubatch: int) -> None:
    """The examples' schedule and model step, step for step, through the public Python API."""
    state = seed

    def draw() -> int:
        nonlocal state
        state = (state * 1664525 + 1013904223) & 0xFFFFFFFF
        return state >> 8

    for _ in range(n_steps):
        seq_ids: list[int] = []
        positions: list[int] = []
        for seq in range(n_seqs):
            roll = draw() % 16
            start = cache.seq_pos_max(seq) + 1
            if start > 0 and roll == 0:
                cache.seq_rm(seq, -1, -1)
                continue
            if start > 0 and roll == 1:
                cache.seq_cp(draw() % n_seqs, seq)
                continue
            length = 1 if start > 0 else 1 + draw() % MAX_PROMPT
            if start == 0 and roll >= 8:
                continue
            seq_ids += [seq] * length
            positions += range(start, start + length)
        if seq_ids:
            batch = rc.Batch(token=np.zeros(len(seq_ids), np.int32), pos=positions, seq_id=seq_ids)
            st = cache.init_batch(batch, n_ubatch=n_ubatch)
            for ub in st:
                st.s(0)[:, 0] += ub.n_seq_tokens     # the examples' "model"


def snapshot(cache: rc.RecurrentCache) -> tuple:
    cells = [cache.cell(i) for i in range(cache.size)] + [cache.head, cache.used, cache.n]
    return cells, cache.r[0].tobytes(), cache.s[0].tobytes()


@functools.cache
def python_result(size: int, seed: int, n_steps: int = N_STEPS) -> tuple:
    cache = rc.RecurrentCache(1, 3, 5, n_seq_max=N_SEQS, size=size)
    python_schedule(cache, N_SEQS, n_steps, seed, N_UBATCH)
    assert cache.used > 0 and cache.s[0].any()   # the comparison means something
    return snapshot(cache)


@pytest.mark.parametrize("size, seed", [(32, 1), (40, 7), (300, 12345)])
def test_example_loop_equals_python_api(example, size, seed):
    cache = rc.RecurrentCache(1, 3, 5, n_seq_max=N_SEQS, size=size)
    assert example.continuous_batching(cache, N_SEQS, N_STEPS, seed, N_UBATCH) == 0
    cache.check()
    assert snapshot(cache) == python_result(size, seed)


def test_example_checks_n_seqs(example):
    cache = rc.RecurrentCache(1, 3, 5, n_seq_max=N_SEQS, size=40)
    with pytest.raises(ValueError, match=r"n_seqs must be in \[1, 40\]"):
        example.continuous_batching(cache, 41, 10, 1, N_UBATCH)


@pytest.mark.parametrize("kind", ["cython", "c"])
def test_a_failure_reaches_python_with_the_library_message(built, kind):
    """decode_steps does not check n_seqs: the C API's validation does, and rc_error_message words it."""
    kernel = load_builder().load(built(kind))
    cache = rc.RecurrentCache(1, 3, 5, n_seq_max=4, size=4)
    with pytest.raises(RuntimeError) as caught:
        kernel.decode_steps(cache, 6, 3)
    with pytest.raises(rc.SeqIdError) as in_python:
        cache.init_batch(rc.Batch(token=[0] * 6, seq_id=list(range(6)), pos=[0] * 6))
    assert str(caught.value) == str(in_python.value) == "token 4: seq_id 4 is out of range [0, 4) (cache size 4)"
    assert cache.used == 0


def test_example_rejects_a_reference_cache(example):
    with pytest.raises(rc.ArgumentError, match="reference engine"):
        example.continuous_batching(rc.RecurrentCache(1, 3, 5, n_seq_max=4, engine="reference"), 4, 1, 1)
    with pytest.raises(TypeError, match="RecurrentCache"):
        example.continuous_batching(object(), 4, 1, 1)


def test_two_caches_in_two_threads_do_not_interfere(built):
    """The loops release the GIL; each thread owns its cache."""
    c_example = load_builder().load(built("c"))
    caches = [rc.RecurrentCache(1, 3, 5, n_seq_max=N_SEQS) for _ in range(2)]
    codes = [None, None]

    def run(k: int) -> None:
        codes[k] = c_example.continuous_batching(caches[k], N_SEQS, 3000, 99 + k, N_UBATCH)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert codes == [0, 0]
    for k, cache in enumerate(caches):
        alone = rc.RecurrentCache(1, 3, 5, n_seq_max=N_SEQS)
        c_example.continuous_batching(alone, N_SEQS, 3000, 99 + k, N_UBATCH)
        cache.check()
        assert snapshot(cache) == snapshot(alone)


@pytest.mark.parametrize("kind", ["cython", "c"])
def test_decode_steps_advance_every_sequence(built, kind):
    kernel = load_builder().load(built(kind))
    cache = rc.RecurrentCache(1, 3, 5, n_seq_max=64, size=1024)
    assert kernel.decode_steps(cache, 64, 10) == 0
    assert [cache.seq_pos_max(seq) for seq in range(64)] == [9] * 64
    cache.check()


# -- versions: a mismatch is an ImportError with a message, never a crash ----------------

FAKE_TABLE = """
import ctypes, sys
sys.path.insert(0, {tests!r})
import capi_table
from recurrent_cache import _capi
real = capi_table.table()
fake = capi_table.Table.from_buffer_copy(real)   # the same entries, another version
fake.abi_version, fake.api_version = {abi}, {api}
new = ctypes.pythonapi.PyCapsule_New
new.restype, new.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
name = ctypes.c_char_p(b"recurrent_cache._capi._C_API")
_capi._C_API = new(ctypes.addressof(fake), name, None)
import importlib.util
spec = importlib.util.spec_from_file_location({module!r}, {path!r})
try:
    spec.loader.exec_module(importlib.util.module_from_spec(spec))   # pybind11 runs its init here
except ImportError as exc:
    print("ImportError:", exc, "| cause:", exc.__cause__)   # pybind11 chains the reason as the cause
    sys.exit(3)
print("imported")
"""


API = capi_versions.API_VERSION


@pytest.mark.parametrize("kind", ["c", "cpp"])
@pytest.mark.parametrize("abi, api, expected", [
    (2, API, "built against ABI version 1, the installed recurrent_cache has ABI version 2"),
    (1, API - 1, f"needs API version {API}, the installed recurrent_cache has API version {API - 1}; "
                 "upgrade recurrent_cache"),
])
def test_a_version_mismatch_fails_the_import_with_a_message(built, kind, abi, api, expected):
    path = built(kind)
    script = FAKE_TABLE.format(tests=str(Path(__file__).parents[1]), abi=abi, api=api, path=str(path),
                               module=path.name.split(".")[0])
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 3, result.stdout + result.stderr
    assert expected in result.stdout


def test_a_newer_library_than_the_header_imports(built):
    """Entries are only appended: a table with a higher api_version serves an older header."""
    path = built("c")
    script = FAKE_TABLE.format(tests=str(Path(__file__).parents[1]), abi=1, api=API + 5, path=str(path),
                               module=path.name.split(".")[0])
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "imported" in result.stdout, result.stdout + result.stderr


def test_get_include_holds_the_header_and_the_pxds():
    include = Path(rc.get_include()) / "recurrent_cache"
    for name in ("capi.h", "capi.pxd", "_capi.pxd", "core.pxd"):
        assert (include / name).is_file(), name
