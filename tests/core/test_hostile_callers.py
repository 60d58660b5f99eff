"""Hostile and careless callers of the Python API: every risky call in a subprocess (a crash
is a named failure), every rejected call leaves the cache bit-identical, misuse of a
MemoryState, of caller buffers or of threads raises instead of corrupting."""

from __future__ import annotations

import math
import subprocess
import sys
import threading
import textwrap
from pathlib import Path

import numpy as np
import pytest

import recurrent_cache as rc
from recurrent_cache import errors
from recurrent_cache.formats import messages
from golden import snapshot
from rows import assign


def run_isolated(code: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter; a segfault shows as a negative return code."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120)


def busy_cache(rc, size=6):
    cache = rc.RecurrentCache(2, 3, 4, n_seq_max=size)
    for _ub in cache.init_batch(rc.Batch(token=[1, 2, 3, 4], seq_id=[0, 0, 1, 2], pos=[0, 1, 0, 0])):
        pass
    for k, array in enumerate(cache.r + cache.s):
        assign(array, np.arange(math.prod(array.shape)).reshape(array.shape) + 100 * k)
    cache.seq_cp(1, 3)
    return cache


def rejected(cache, call, error=rc.RecurrentCacheError, match=None):
    before = snapshot(cache)
    with pytest.raises(error, match=match):
        call()
    assert snapshot(cache) == before
    cache.check()


# -- what used to crash the interpreter ------------------------------------------------------

CRASHERS = {
    "layer index out of range": """
        import recurrent_cache as rc
        c = rc.RecurrentCache(2, 3, 4, n_seq_max=2)
        st = c.init_batch(rc.Batch(token=[1], seq_id=[0], pos=[0])); st.apply()
        for il in (2, -1, -3, 10**6, 2**40):
            for read in (st.r, st.s):
                try: read(il)
                except rc.OutOfRangeError: pass
                else: raise SystemExit(f"layer {il} accepted")
    """,
    "cell_table.cell out of range": """
        import recurrent_cache as rc
        t = rc.RecurrentCache(1, 1, 1, n_seq_max=4).cell_table
        for i in (-1, -2, 4, 1000, 2**31 - 1, -2**31):
            try: t.cell(i)
            except rc.OutOfRangeError: pass
            else: raise SystemExit(f"cell {i} accepted")
    """,
    "huge cache sizes": """
        import recurrent_cache as rc
        for size in (477_218_589, 238_609_295, 2**31 - 1):
            try: rc.RecurrentCache(0, 1, 1, size=size)
            except rc.ConfigError as exc: assert f"size={size}" in str(exc), exc
    """,
    "a batch changed after construction": """
        import numpy as np, recurrent_cache as rc
        b = rc.Batch(token=[1, 2], seq_id=[0, 1], pos=[0, 0])
        for name, value in (("seq_id_offset", np.array([0, 10**6, 2**30], np.int32)), ("n_tokens", 10**6),
                            ("pos", np.zeros(10**6, np.int32))):
            try: setattr(b, name, value)
            except AttributeError: pass
            else: raise SystemExit(f"{name} was set")
        for array in (b.seq_id_offset, b.seq_id_flat, b.pos, b.token):
            try: array[0] = 10**6
            except ValueError: pass
            else: raise SystemExit("an array of the batch is writable")
        # even a batch taken apart by force cannot make the engine read out of bounds
        object.__setattr__(b, "seq_id_offset", np.array([0, 2**30, 2**30 + 1], np.int32))
        c = rc.RecurrentCache(1, 1, 1, n_seq_max=2)
        try: c.init_batch(b)
        except rc.CoreError: pass
        else: raise SystemExit("a forged batch was accepted")
    """,
}


@pytest.mark.parametrize("name", sorted(CRASHERS))
def test_former_crashers_raise_package_errors(name):
    result = run_isolated(CRASHERS[name])
    assert result.returncode == 0, f"{name}: exit {result.returncode}\n{result.stdout}{result.stderr}"


# -- MemoryState misuse ----------------------------------------------------------------------

def test_rows_before_apply_are_refused(rc):
    cache = busy_cache(rc)
    st = cache.init_batch(rc.Batch(token=[5, 6], seq_id=[0, 2], pos=[2, 1]), n_ubatch=1)
    with pytest.raises(rc.UsageError, match="not applied"):
        st.r(0)
    st.apply()
    st.r(0)
    st.next()
    with pytest.raises(rc.UsageError, match="not applied"):   # the previous ubatch's rows
        st.s(1)


@pytest.mark.parametrize("change", ["seq_rm", "seq_cp", "state_read", "clear", "other_state", "seq_keep"])
def test_a_state_prepared_before_the_cache_changed_is_refused(rc, change):
    cache = busy_cache(rc)
    st = cache.init_batch(rc.Batch(token=[5], seq_id=[2], pos=[1]))
    if change == "seq_rm":
        cache.seq_rm(0, -1, -1)
    elif change == "seq_cp":
        cache.seq_cp(1, 4)
    elif change == "state_read":
        cache.state_read(cache.state_write(0), 0)
    elif change == "clear":
        cache.clear()
    elif change == "seq_keep":
        cache.seq_keep(2)
    else:
        for _ in cache.init_batch(rc.Batch(token=[7], seq_id=[0], pos=[2])):
            pass
    rejected(cache, st.apply, rc.UsageError, "changed after this state was prepared")


def test_rows_of_an_applied_ubatch_are_refused_once_the_cache_changed(rc):
    cache = busy_cache(rc)
    st = cache.init_batch(rc.Batch(token=[5], seq_id=[2], pos=[1]))
    st.apply()
    cache.seq_rm(0, -1, -1)
    with pytest.raises(rc.UsageError, match="changed after this ubatch was applied"):
        st.r(0)


def test_apply_twice_and_ubatch_of_full_state_are_usage_errors(rc):
    cache = busy_cache(rc)
    st = cache.init_batch(rc.Batch(token=[5], seq_id=[2], pos=[1]))
    st.apply()
    rejected(cache, st.apply, rc.UsageError, "already applied")
    with pytest.raises(rc.UsageError, match="no ubatches"):
        _ = cache.init_full().ubatch


def test_refilling_caller_buffers_changes_nothing_validated(rc):
    cache = busy_cache(rc)
    seq, pos = np.array([2], np.int32), np.array([1], np.int32)
    st = cache.init_batch(rc.Batch(token=[5], seq_id=seq, pos=pos))
    seq[0], pos[0] = 5, 40   # a server reusing its buffers for the next step
    (ub,) = list(st)
    assert ub.seq_id == ((2,),) and ub.pos.tolist() == [1]
    assert cache.seq_pos_max(2) == 1 and cache.seq_pos_max(5) == -1
    cache.check()


# -- inputs that mean nothing -----------------------------------------------------------------

@pytest.mark.parametrize("kwargs, match", [
    (dict(token=[1, 2], seq_id=[True, False], pos=[0, 0]), "bool"),
    (dict(token=[1, 2], seq_id=[[True], [0]], pos=[0, 0]), "integers"),
    (dict(token=[1, 2], seq_id={0: 1, 1: 1}, pos=[0, 0]), "dict"),
    (dict(token=[1, 2], seq_id={0, 1}, pos=[0, 0]), "set"),
    (dict(token=[1, 2], seq_id=[0, 1], pos=[True, False]), "bool"),
    (dict(token=[True, False], seq_id=[0, 1], pos=[0, 0]), "bool"),
    (dict(token=[1, 2], seq_id=np.ma.masked_array([0, 1], mask=[0, 1]), pos=[0, 0]), "masked"),
    (dict(token=[1, 2], seq_id=[0, 1], pos=np.ma.masked_array([0, 0])), "masked"),
    (dict(token=[1, 2], seq_id=[[0], [2**40]], pos=[0, 0]), "int32"),
])
def test_batches_that_mean_nothing_are_rejected(rc, kwargs, match):
    with pytest.raises(rc.BatchError, match=match):
        rc.Batch(**kwargs)


@pytest.mark.parametrize("kwargs", [dict(embd_pooled=np.array([1, 2])), dict(logits_all="yes"),
                                    dict(n_ubatch=True), dict(n_ubatch=0), dict(n_ubatch=2.0),
                                    dict(embd_pooled=2)])
def test_bad_init_batch_flags_are_argument_errors(rc, kwargs):
    cache = busy_cache(rc)
    rejected(cache, lambda: cache.init_batch(rc.Batch(token=[5], seq_id=[2], pos=[1]), **kwargs),
             rc.ArgumentError)


def test_position_at_the_int32_limit_is_rejected_everywhere(rc):
    cache = busy_cache(rc)
    rejected(cache, lambda: cache.init_batch(rc.Batch(token=[1], seq_id=[4], pos=[2**31 - 1])),
             rc.PositionError, "2\\*\\*31 - 1")
    rejected(cache, lambda: cache.seq_add(0, -1, -1, 2**31 - 2), rc.PositionError)
    zeros = [[row[0] * 0 for row in cache.r], [row[0] * 0 for row in cache.s]]
    rejected(cache, lambda: cache.seq_restore(5, 2**31 - 1, *zeros), rc.PositionError)
    # every position a cell can hold lies inside "to the end": seq_rm(s, -1, -1) removes it
    cache.seq_add(0, -1, -1, 2**31 - 3)
    assert cache.seq_pos_max(0) == 2**31 - 2
    assert cache.seq_rm(0, -1, -1) and cache.seq_pos_max(0) == -1
    cache.check()


def test_default_positions_that_would_overflow_are_rejected(rc):
    cache = rc.RecurrentCache(1, 1, 1, n_seq_max=2)
    for _ in cache.init_batch(rc.Batch(token=[1], seq_id=[1], pos=[2**31 - 3])):
        pass
    rejected(cache, lambda: cache.init_batch(rc.Batch(token=[1, 2], seq_id=[1, 1])), rc.PositionError,
             "default positions of sequence 1")


# -- threads -----------------------------------------------------------------------------------

def test_one_cache_two_threads_raises_instead_of_corrupting(rc):
    cache = rc.RecurrentCache(1, 64, 64, n_seq_max=64)
    errors_seen: list[BaseException] = []
    start = threading.Barrier(2)

    def worker(first: int) -> None:
        start.wait()
        for step in range(300):
            seqs = np.arange(first, first + 32, dtype=np.int32)
            try:
                for _ in cache.init_batch(rc.Batch(token=np.zeros(32, np.int32), seq_id=seqs,
                                                   pos=np.full(32, step, np.int32))):
                    pass
            except rc.UsageError as exc:
                errors_seen.append(exc)
                return
            except rc.PositionError:
                return   # the other thread's refused call left this thread's positions behind

    threads = [threading.Thread(target=worker, args=(first,)) for first in (0, 32)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    cache.check()   # whatever interleaving happened, the cell table is intact
    for exc in errors_seen:
        assert "another thread" in str(exc) or "changed after" in str(exc)


# -- the error table ---------------------------------------------------------------------------

CODES = {name: value for name, value in vars(errors).items()
         if isinstance(value, int) and name.isupper() and name not in ("OK", "POS_MAX")}


@pytest.mark.parametrize("name", sorted(CODES))
def test_every_engine_code_formats_into_a_package_error(name):
    detail = dict(what="op", seq=3, size=4, token=1, pos=5, prev=2, n=1, index=1, field="rows", offset=12,
                  need=8, length=10, cell=0, other=0, value=7, n_layer=1, expected=0)
    exc = messages.engine_error(CODES[name], **detail)
    assert isinstance(exc, (rc.RecurrentCacheError, MemoryError)), name
    assert str(exc) and "{" not in str(exc), name


def test_the_compiled_codes_are_the_table_codes():
    from recurrent_cache import _placement, _state_io
    compiled = {**_placement.CODES, **_state_io.CODES}
    assert compiled == {name: CODES[name] for name in compiled}
    # CELL_INDEX is raised by the cell table through the table itself; the C API's own codes are
    # checked against recurrent_cache/capi.h in test_capi_table.py
    assert {name for name in set(CODES) - set(compiled) if not name.startswith("CAPI_")} == {"CELL_INDEX"}
    assert len(set(CODES.values())) == len(CODES)          # one code, one meaning


# -- the whole API, fuzzed ---------------------------------------------------------------------

@pytest.mark.parametrize("seed", [1, 2])
def test_api_fuzzer_finds_no_crash_no_disagreement_no_change_on_rejection(seed):
    """bench/fuzz/fuzz_api.py, a short run in a subprocess (long runs: see its docstring)."""
    fuzzer = Path(__file__).resolve().parents[2] / "bench" / "fuzz" / "fuzz_api.py"
    result = subprocess.run([sys.executable, str(fuzzer), "--steps", "6000", "--seed", str(seed)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    assert "no crash, no disagreement" in result.stdout


@pytest.mark.parametrize("fuzzer, args", [("fuzz_state_read.py", ["--engine", "random", "--runs", "400"]),
                                          ("fuzz_files.py", ["--runs", "200", "--seed", "1"])])
def test_the_file_fuzzers_run_clean(fuzzer, args):
    """Short runs of the blob and file fuzzers, so they cannot rot (long runs: their docstrings)."""
    path = Path(__file__).resolve().parents[2] / "bench" / "fuzz" / fuzzer
    result = subprocess.run([sys.executable, str(path), *args], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}"
    assert "no failure" in result.stdout or "failures 0" in result.stdout, result.stdout[-2000:]
