"""Bookkeeping workloads for ``measure``: decode steps, Batch construction, prompt ingestion.

A workload owns one cache of one engine (``impl`` is ``recurrent_cache``, the
compiled engine, or ``reference`` below: the same facade on the pure-Python
engine, used through the same code) and talks only to it.  The caches have one layer of 16-float rows: the
rows are tiny, so the times are the cell bookkeeping, not the state copies
(``bandwidth.py`` measures those).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Callable

import functools
import types

import numpy as np

import recurrent_cache

from .measure import expect, loop_over

# the package with its caches on the reference engine, usable where the package is
reference = types.SimpleNamespace(
    __name__="recurrent_cache (reference engine)", Batch=recurrent_cache.Batch,
    MemoryStatus=recurrent_cache.MemoryStatus,
    RecurrentCache=functools.partial(recurrent_cache.RecurrentCache, engine="reference"))

N_LAYER, N_EMBD = 1, 16
N_UBATCH = 512
DECODE_PROMPT = 4                  # prompt tokens per sequence placed before decoding
INGEST_TOKENS, INGEST_CACHE_SIZE = 4096, 256


def make_cache(impl: ModuleType, n_seq_max: int, size: int, n_layer: int = N_LAYER,
               n_embd_r: int = N_EMBD, n_embd_s: int = N_EMBD) -> Any:
    return impl.RecurrentCache(n_layer, n_embd_r, n_embd_s, n_seq_max=n_seq_max, size=size)


def decode_batch(impl: ModuleType, seqs: np.ndarray, pos: np.ndarray | int) -> Any:
    """One token for each sequence in ``seqs``, at ``pos`` (one for all, or one each)."""
    seqs = np.asarray(seqs, dtype=np.int32)
    return impl.Batch(token=np.zeros(seqs.size, dtype=np.int32),
                      pos=np.broadcast_to(np.asarray(pos, dtype=np.int32), seqs.shape).copy(),
                      seq_id=seqs)


def prompt_batch(impl: ModuleType, lengths: list[int], first_seq: int = 0) -> Any:
    """Sequence ``first_seq + i`` gets ``lengths[i]`` tokens at positions 0, 1, ... (contiguous)."""
    seq_id = np.repeat(np.arange(first_seq, first_seq + len(lengths), dtype=np.int32), lengths)
    pos = np.concatenate([np.arange(n, dtype=np.int32) for n in lengths])
    return impl.Batch(token=np.zeros(seq_id.size, dtype=np.int32), pos=pos, seq_id=seq_id)


def decode(impl: ModuleType, cache: Any, batch: Any) -> Any:
    """init_batch, then apply every ubatch (what llama_decode does to the cache); the state."""
    st = cache.init_batch(batch, n_ubatch=N_UBATCH)
    if st.status != impl.MemoryStatus.SUCCESS:
        raise RuntimeError(f"init_batch returned {st.status!r}")
    while True:
        st.apply()
        if not st.next():
            return st


def decoding_cache(impl: ModuleType, n_seqs: int, size: int) -> Any:
    """A cache of ``size`` cells holding sequences 0..n_seqs-1, each after a 4-token prompt."""
    cache = make_cache(impl, n_seqs, size)
    decode(impl, cache, prompt_batch(impl, [DECODE_PROMPT] * n_seqs))
    return cache


def check_positions(cache: Any, n_seqs: int, last_pos: int) -> None:
    cache.check()
    for seq in (0, n_seqs - 1):
        expect(cache.seq_pos_max(seq) == last_pos, f"sequence {seq} is not at position {last_pos}")


class PythonDecodeStep:
    """Python API: one decode step = ``init_batch`` + ``apply()``/``next()`` over a prebuilt
    Batch of one token for each of ``n_seqs`` active sequences."""

    def __init__(self, impl: ModuleType, n_seqs: int, size: int) -> None:
        self.impl, self.n_seqs = impl, n_seqs
        self.cache = decoding_cache(impl, n_seqs, size)
        self.seqs = np.arange(n_seqs, dtype=np.int32)
        self.next_pos = DECODE_PROMPT

    def loop(self, n: int) -> Callable[[], None]:
        batches = [decode_batch(self.impl, self.seqs, self.next_pos + i) for i in range(n)]
        self.next_pos += n
        return loop_over(lambda batch: decode(self.impl, self.cache, batch), batches)

    def verify(self) -> None:
        check_positions(self.cache, self.n_seqs, self.next_pos - 1)


def decode_as_model_reads(cache: Any, batch: Any, n_layer: int) -> None:
    """init_batch, then each ubatch read as a model reads it: token, pos, seq_id, output and
    every layer's state rows (what the numpy Mamba reads), no model arithmetic."""
    st = cache.init_batch(batch, n_ubatch=N_UBATCH)
    for ub in st:
        read = (ub.token, ub.pos, ub.seq_id, ub.output)
        rows = [(st.r(il), st.s(il)) for il in range(n_layer)]
        expect(read[0] is not None and len(rows) == n_layer, "nothing was read")


class ModelReadDecodeStep(PythonDecodeStep):
    """Python API: the decode step as a model takes it — ``for ub in st`` reading ``ub.token``,
    ``ub.pos``, ``ub.seq_id``, ``ub.output`` and ``st.r(il)`` / ``st.s(il)``."""

    def loop(self, n: int) -> Callable[[], None]:
        batches = [decode_batch(self.impl, self.seqs, self.next_pos + i) for i in range(n)]
        self.next_pos += n
        return loop_over(lambda batch: decode_as_model_reads(self.cache, batch, N_LAYER), batches)


class CimportDecodeStep:
    """C API: the same decode step run in C by an example's ``decode_steps(cache, n_seqs, n)``
    (rc_batch_init: validate, split, prepare; rc_batch_apply: find_slot, copy plan and row
    moves; GIL released); one call does the whole loop, so the time per step has no Python in it."""

    def __init__(self, kernel: ModuleType, impl: ModuleType, n_seqs: int, size: int) -> None:
        self.kernel, self.n_seqs = kernel, n_seqs
        self.cache = decoding_cache(impl, n_seqs, size)
        self.steps = 0

    def loop(self, n: int) -> Callable[[], None]:
        self.steps += n

        def run() -> None:
            code = self.kernel.decode_steps(self.cache, self.n_seqs, n)
            expect(code == 0, f"decode_steps returned error code {code}")
        return run

    def verify(self) -> None:
        check_positions(self.cache, self.n_seqs, DECODE_PROMPT - 1 + self.steps)


class BatchBuild:
    """Building a decode step's ``Batch`` of ``n_seqs`` tokens (1-D seq_id, the fast path):
    the part of a Python decode step that the decode-step rows leave out."""

    def __init__(self, impl: ModuleType, n_seqs: int) -> None:
        self.impl, self.seqs = impl, np.arange(n_seqs, dtype=np.int32)
        self.built = 0

    def loop(self, n: int) -> Callable[[], None]:
        self.built += n
        return loop_over(lambda pos: decode_batch(self.impl, self.seqs, pos), range(n))

    def verify(self) -> None:
        expect(len(decode_batch(self.impl, self.seqs, 0)) == self.seqs.size, "wrong Batch length")


class PromptIngestion:
    """A 4096-token prompt batch over ``n_seqs`` sequences (each a contiguous run of
    4096 / n_seqs tokens) into an empty cache of 256 cells: ``init_batch`` (validation,
    split_equal into 512-token ubatches, prepare) + applying every ubatch.  Every operation
    gets a fresh cache, built before the clock starts."""

    def __init__(self, impl: ModuleType, n_seqs: int) -> None:
        self.impl, self.n_seqs = impl, n_seqs
        self.batch = prompt_batch(impl, [INGEST_TOKENS // n_seqs] * n_seqs)
        self.last_cache = None

    def loop(self, n: int) -> Callable[[], None]:
        caches = [make_cache(self.impl, INGEST_CACHE_SIZE, INGEST_CACHE_SIZE) for _ in range(n)]
        self.last_cache = caches[-1]
        return loop_over(lambda cache: decode(self.impl, cache, self.batch), caches)

    def verify(self) -> None:
        check_positions(self.last_cache, self.n_seqs, INGEST_TOKENS // self.n_seqs - 1)
