"""The C-level API (``cimport recurrent_cache.core``) drives a cache exactly like the Python API.

Builds examples/capi/continuous_batching.pyx at test time (Cython, setuptools
and a C compiler are test dependencies), runs its continuous-batching loop
entirely in C, and replays the same schedule through the Python API.
"""

from __future__ import annotations

import importlib.util
import threading
from pathlib import Path

import numpy as np
import pytest

import recurrent_cache as rc

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "capi"
N_SEQS, N_STEPS, N_UBATCH, MAX_PROMPT = 32, 1000, 16, 8


@pytest.fixture(scope="module")
def capi(tmp_path_factory):
    pytest.importorskip("Cython")
    pytest.importorskip("setuptools")
    spec = importlib.util.spec_from_file_location("capi_build", EXAMPLES / "build.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    return build.build(tmp_path_factory.mktemp("capi"))


def python_schedule(cache: rc.RecurrentCache, n_seqs: int, n_steps: int, seed: int, n_ubatch: int) -> None:
    """The C loop's schedule, step for step, through the public Python API."""
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
            for _ in cache.init_batch(batch, n_ubatch=N_UBATCH):
                pass


def cells(cache: rc.RecurrentCache) -> list:
    return [cache.cell(i) for i in range(cache.size)] + [cache.head, cache.used, cache.n]


@pytest.mark.parametrize("size, seed", [(32, 1), (40, 7), (300, 12345)])
def test_c_loop_equals_python_api(capi, size, seed):
    in_c = rc.RecurrentCache(1, 3, 5, n_seq_max=N_SEQS, size=size)
    in_python = rc.RecurrentCache(1, 3, 5, n_seq_max=N_SEQS, size=size)
    assert capi.continuous_batching(in_c.cell_table, N_SEQS, N_STEPS, seed, N_UBATCH) == 0
    python_schedule(in_python, N_SEQS, N_STEPS, seed, N_UBATCH)
    in_c.check()
    assert cells(in_c) == cells(in_python)
    assert in_c.used > 0  # the schedule left sequences running: the comparison means something


def test_two_caches_in_two_threads_do_not_interfere(capi):
    """The loop releases the GIL; each thread owns its cache."""
    caches = [rc.RecurrentCache(1, 3, 5, n_seq_max=N_SEQS) for _ in range(2)]
    codes = [None, None]

    def run(k: int) -> None:
        codes[k] = capi.continuous_batching(caches[k].cell_table, N_SEQS, 3000, 99 + k, N_UBATCH)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert codes == [0, 0]
    for k, cache in enumerate(caches):
        alone = rc.RecurrentCache(1, 3, 5, n_seq_max=N_SEQS)
        capi.continuous_batching(alone.cell_table, N_SEQS, 3000, 99 + k, N_UBATCH)
        cache.check()
        assert cells(cache) == cells(alone)


def test_c_decode_steps_advance_every_sequence(capi):
    cache = rc.RecurrentCache(1, 3, 5, n_seq_max=64, size=1024)
    assert capi.decode_steps(cache.cell_table, 64, 10) == 0
    assert [cache.seq_pos_max(seq) for seq in range(64)] == [9] * 64
    cache.check()


def test_get_include_finds_the_pxd():
    assert (Path(rc.get_include()) / "recurrent_cache" / "core.pxd").is_file()
